"""The one call of `make test-gpu` on a lent GPU machine, planned before it runs: what it runs, in which slices.

A lent machine gives one call of at most 10 minutes, 64 MiB carried with the checkout and no network. From
tests/notebook_parameters_t4.yaml (`load_t4_settings`: each notebook's T4 budget, the one call's estimates and the
parameters a machine without a hub needs) this plans the call: its items (`lent_items`: gpu-tests, the planner
grid, the notebooks), packed into slices that run side by side (`pack_slices`), the command (`one_call_command`),
the carry and whether it all fits (`print_plan`: `python -m colab_memopt.gpucheck plan`); and the unit tests split
into parts for calls of their own (`unit_parts`, `--part K/N`). Nothing here needs a GPU or torch.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colab_memopt.tooling.gpurecord import NOT_RUN, MiB, StepResult, not_run_reason

REPO_ROOT = Path(__file__).resolve().parents[2]
BUDGETS_FILE = REPO_ROOT / "tests" / "notebook_parameters_t4.yaml"


NOTEBOOK_KEYS = ("budget_seconds", "lent_seconds", "parameters", "requires")
LENT_STEPS = ("gpu-tests", "planner", "costs")  # steps that can run as one slice's item beside the notebooks


@dataclass
class T4Settings:
    """tests/notebook_parameters_t4.yaml: budgets, the one-call run's estimates, and the few parameters changed."""

    budgets: dict[str, int]  # notebook stem -> seconds a T4 user would accept (one after the other)
    default_budget: int
    total_budget: int
    lent_seconds: dict[str, float]  # notebook stem -> estimated seconds on a lent H100 beside the other slices
    default_lent_seconds: float
    step_seconds: dict[str, float]  # a step of LENT_STEPS -> its estimate there
    workers: int
    deadline_seconds: float
    setup_seconds: float
    parameters: dict[str, dict[str, Any]]  # notebook stem -> parameters injected (only what a machine without hub needs)
    requires: dict[str, list[str]]  # notebook stem -> modules it cannot run without

    def notebook_seconds(self, stem: str) -> float:
        """Return the estimated seconds of notebook `stem` in the one-call run."""
        return self.lent_seconds.get(stem, self.default_lent_seconds)


def load_t4_settings(path: Path = BUDGETS_FILE) -> T4Settings:
    """Return the T4 settings file, checked: each notebook entry sets only NOTEBOOK_KEYS; raise ValueError naming a bad one."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    lent = data.get("lent_run") or {}
    steps = {str(k): float(v) for k, v in (lent.get("steps") or {}).items()}
    if set(steps) - set(LENT_STEPS):
        raise ValueError(f"{path}: lent_run.steps may name {list(LENT_STEPS)}, got {sorted(set(steps) - set(LENT_STEPS))}")
    settings = T4Settings({}, int(data.get("default_budget_seconds", 600)), int(data.get("total_budget_seconds", 3600)),
                          {}, float(lent.get("default_lent_seconds", 90)), steps, int(lent.get("workers", 5)),
                          float(lent.get("deadline_seconds", 510)), float(lent.get("setup_seconds", 60)), {}, {})
    for name, entry in (data.get("notebooks") or {}).items():
        entry = entry or {}
        if set(entry) - set(NOTEBOOK_KEYS):
            raise ValueError(f"{path}: notebook {name!r} may set {list(NOTEBOOK_KEYS)} (Colab defaults run otherwise), "
                             f"got {sorted(entry)}")
        if "budget_seconds" in entry:
            settings.budgets[name] = int(entry["budget_seconds"])
        if "lent_seconds" in entry:
            settings.lent_seconds[name] = float(entry["lent_seconds"])
        params = entry.get("parameters") or {}
        plain = (str, int, float, bool, list, dict, type(None))
        if not isinstance(params, dict) or not all(isinstance(v, plain) for v in params.values()):
            raise ValueError(f"{path}: notebook {name!r}'s parameters must map names to plain values, got {params!r}")
        if params:
            settings.parameters[name] = dict(params)
        needs = entry.get("requires") or []
        if not isinstance(needs, list) or not all(isinstance(m, str) for m in needs):
            raise ValueError(f"{path}: notebook {name!r}'s requires must be a list of module names, got {needs!r}")
        if needs:
            settings.requires[name] = list(needs)
    return settings


def load_budgets(path: Path = BUDGETS_FILE) -> tuple[dict[str, int], int, int]:
    """Return (per-notebook budget seconds, default budget, total budget) from the T4 settings file."""
    settings = load_t4_settings(path)
    return settings.budgets, settings.default_budget, settings.total_budget


def unit_parts(parts: int, tests_dir: Path = REPO_ROOT / "tests") -> list[list[str]]:
    """Return the unit test files split into `parts` groups of about equal size (bytes of test code, a
    stand-in for time), each sorted; every `tests/test_*.py` is in exactly one. make test-gpu runs one
    group per call (`--only unit --part K/N`) so that each stays well inside a call's 10 minutes."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an integer >= 1, got {parts!r}")
    files = sorted(tests_dir.glob("test_*.py"), key=lambda f: (-f.stat().st_size, f.name))
    groups: list[list[Path]] = [[] for _ in range(parts)]
    for f in files:
        min(groups, key=lambda g: sum(x.stat().st_size for x in g)).append(f)
    return [sorted(str(f.relative_to(REPO_ROOT)) for f in g) for g in groups]


def parse_part(text: str | None) -> tuple[int, int] | None:
    """Return (k, n) from 'K/N' (1 <= K <= N), or None for None; raise ValueError naming a bad value."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--part must be K/N with 1 <= K <= N (e.g. 2/3), got {text!r}")
    return int(m.group(1)), int(m.group(2))


# make test-gpu on a lent H100/H200 in one call: at most 10 minutes a call and 15 minutes of device time a loan (the
# start takes 1-2 of them), 64 MiB carried with the checkout, a bare machine without a network, at most 8 files of 16 MiB
# back through $OUT. The call carries the wheel part of `make gpu-wheels` (DeepSpeed's sdist stays out), installs it,
# then runs tests/gpu, the planner grid and every notebook in `workers` slices side by side (tests/notebook_parameters_t4
# .yaml: lent_run), under one deadline; everything lands in one archive in $OUT, rewritten as results come.
ONE_CALL_STEPS = ("install", "gpu-tests", "planner", "notebooks")
CARRY = "build/wheelhouse/part1"  # make gpu-wheels' part of wheels (wheelhouse.build puts sdists in parts of their own)
SITE = "/tmp/site"
ARCHIVE_NAME = "gpucheck.tar.gz"


CALL_LIMIT_SECONDS = 600
COMMAND_LIMIT_CHARS = 2000
CARRY_LIMIT_BYTES = 64 * MiB  # the checkout and the carried paths together


MEASURED_CARRY_MIB = 56.7  # part1 on 2026-11-26 (everything the image lacks but DeepSpeed's sdist)


@dataclass
class Item:
    """One piece of the one-call run: a step of LENT_STEPS or 'notebook <stem>', its estimate and its most seconds."""

    name: str
    seconds: float  # estimated, on a lent H100 emulating a T4 beside the other slices: packs the slices
    budget: float = float("inf")  # a notebook's T4 budget: it never runs longer (the deadline cuts it first)


def lent_items(settings: T4Settings, steps: set[str] | list[str], stems: list[str],
               absent: Callable[[str], list[str]] = lambda stem: []) -> tuple[list[Item], list[StepResult]]:
    """Return the items of the one-call run (`steps` of LENT_STEPS, then the notebooks `stems` if 'notebooks' is
    among `steps`) and the notebooks left out because `absent(stem)` names modules they require."""
    items = [Item(s, settings.step_seconds.get(s, settings.default_lent_seconds)) for s in LENT_STEPS if s in steps]
    not_run = []
    for stem in stems if "notebooks" in steps else []:
        missing = absent(stem)
        if missing:
            not_run.append(StepResult(f"notebook {stem}", NOT_RUN, 0.0, not_run_reason(missing)))
        else:
            items.append(Item(f"notebook {stem}", settings.notebook_seconds(stem), settings.budgets.get(stem, settings.default_budget)))
    return items, not_run


def pack_slices(items: list[Item], workers: int) -> list[list[Item]]:
    """Return `workers` slices of `items`: longest first to the slice with the fewest estimated seconds (LPT), then
    items moved or swapped from the longest slice to the shortest while that shortens the longest; each slice longest
    item first."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--parallel must be an integer >= 1 (worker processes), got {workers!r}")
    slices: list[list[Item]] = [[] for _ in range(workers)]

    def load(s: list[Item]) -> float:
        return sum(i.seconds for i in s)
    for item in sorted(items, key=lambda i: (-i.seconds, i.name)):
        min(slices, key=load).append(item)
    improved = True
    while improved:  # each change lowers the sum of squared loads: it ends
        improved = False
        hi, lo = max(slices, key=load), min(slices, key=load)
        for a in hi:
            for b in [None, *lo]:
                delta = a.seconds - (b.seconds if b else 0.0)
                if delta > 0 and load(lo) + delta < load(hi):
                    hi.remove(a)
                    lo.append(a)
                    if b is not None:
                        lo.remove(b)
                        hi.append(b)
                    improved = True
                    break
            if improved:
                break
    return [sorted(s, key=lambda i: (-i.seconds, i.name)) for s in slices]


def one_call_command(workers: int | None = None, deadline_seconds: float | None = None) -> str:
    """Return the one command that runs make test-gpu on a lent GPU machine (from the checkout's root, CARRY carried)."""
    settings = load_t4_settings()
    workers = workers or settings.workers
    deadline = int(deadline_seconds or settings.deadline_seconds)
    return (f"PYTHONUNBUFFERED=1 python3 -m colab_memopt.gpucheck --parallel {workers} --budget-seconds {deadline} "
            f"--wheelhouse {CARRY} --pip-target {SITE} --only {' '.join(ONE_CALL_STEPS)} --archive $OUT/{ARCHIVE_NAME}")


def checkout_bytes(root: Path = REPO_ROOT) -> int | None:
    """Return the bytes of what a call sends of the checkout (tracked and untracked-not-ignored files), or None."""
    run = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, timeout=60)
    if run.returncode != 0:
        return None
    return sum((root / n).stat().st_size for n in run.stdout.decode().split("\0") if n and (root / n).is_file())


def folder_bytes(folder: Path) -> int | None:
    """Return the bytes of the files under `folder`, or None if it is not there."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else None


def print_plan(root: Path = REPO_ROOT) -> int:
    """Print the one call (command, carry, slices); return 1 if it cannot fit (carry, command or slices), else 0."""
    from colab_memopt.tooling.runner import notebook_paths

    settings = load_t4_settings()
    command = one_call_command()
    stems = [p.stem for p in notebook_paths()]
    # what the one call leaves out: DeepSpeed is not carried
    items, not_run = lent_items(settings, ONE_CALL_STEPS, stems,
                                lambda stem: [m for m in settings.requires.get(stem, []) if m == "deepspeed"])
    slices = pack_slices(items, settings.workers)
    room = settings.deadline_seconds - settings.setup_seconds
    tree, wheels = checkout_bytes(root), folder_bytes(root / CARRY)
    problems = []
    if len(command) > COMMAND_LIMIT_CHARS:
        problems.append(f"the command has {len(command)} characters, over {COMMAND_LIMIT_CHARS}")
    wheel_mib = wheels / MiB if wheels is not None else MEASURED_CARRY_MIB
    total_mib = wheel_mib + (tree or 0) / MiB
    if total_mib > CARRY_LIMIT_BYTES / MiB:
        problems.append(f"the carry and the checkout take {total_mib:.1f} MiB, over {CARRY_LIMIT_BYTES // MiB}")
    longest = max(sum(i.seconds for i in s) for s in slices)
    if longest > room:
        problems.append(f"the longest slice is estimated at {longest:.0f} s, over the {room:.0f} s the deadline leaves")
    covered = sum(i.name.startswith("notebook") for i in items)
    lines = [
        "make test-gpu in one call on a lent GPU machine (an H100 or H200), from the checkout's root:",
        f"  timeout_s: {CALL_LIMIT_SECONDS}",
        f'  carry: ["{CARRY}"]',
        f"  command ({len(command)} of {COMMAND_LIMIT_CHARS} characters):",
        command,
        "",
        f"carry: {CARRY} (make gpu-wheels: the wheels the machine lacks, no DeepSpeed sdist)",
        "  " + (f"{wheel_mib:.1f} MiB here" if wheels is not None else f"{wheel_mib} MiB on 2026-11-26 (not built here)"),
        f"  + the checkout: " + (f"{tree / MiB:.1f} MiB" if tree is not None else "unknown (not a git checkout)")
        + f" = {total_mib:.1f} MiB of {CARRY_LIMIT_BYTES // MiB}",
        f"covers: tests/gpu, the planner grid on CUDA and {covered} notebooks",
        *[f"  {r.step}: {r.detail}" for r in not_run],
        "  not in it: the unit tests (CI runs them) and the technique costs (`--only install costs`)",
        f"{settings.workers} slices side by side, each process capped to a T4's memory by the emulation;",
        f"  deadline {settings.deadline_seconds:.0f} s after the start ({settings.setup_seconds:.0f} s of it to install "
        "and preflight),",
        "  then the unfinished items are killed and recorded 'not finished'. Estimated seconds",
        "  (tests/notebook_parameters_t4.yaml; from an earlier run, not this one), notebooks by number:",
    ]
    for k, s in enumerate(slices, 1):
        short = [(i.name.removeprefix("notebook ")[:2] if i.name.startswith("notebook ") else i.name) for i in s]
        lines.append(f"  slice {k} ({sum(i.seconds for i in s):.0f} s): "
                     + ", ".join(f"{n} {i.seconds:.0f}" for n, i in zip(short, s)))
    lines += [f"back: $OUT/{ARCHIVE_NAME}: build/gpu (summary.txt, results.json, env.json, logs, executed",
              "  notebooks), rewritten as results come: a call stopped early returns what finished"]
    print("\n".join(lines))
    for p in problems:
        print(f"does not fit: {p}")
    return 1 if problems else 0
