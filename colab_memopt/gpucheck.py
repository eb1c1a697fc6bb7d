"""`make test-gpu`: everything this project claims about CUDA, checked in one command on any CUDA GPU.

    python -m colab_memopt.gpucheck [--out build/gpu] [--wheelhouse DIR [--pip-target DIR]] [--only STEP ...]
                                    [--part K/N] [--notebooks 00 05 ...] [--budget-seconds S] [--skip STEP ...]
    python -m colab_memopt.gpucheck plan      # the calls that cover everything on a lent GPU machine (CALL_PLAN)

Where torch sees no CUDA GPU it prints one line and exits 2. Otherwise, with `CM_EMULATE=t4` (the
default on any GPU that is not a T4; `CM_EMULATE=none` turns it off) every process it starts caps the
caching allocator to the T4's usable bytes less its context and takes the T4's code paths
(`env.apply_emulation`), and every result is labelled "<gpu> emulating t4". The steps:

0. preflight (every call): the GPU, versions, and measurements in a fresh process (this GPU's own CUDA
   context outside the allocator, the cuBLAS workspace the first matmul allocates, the workspaces a biased
   Linear's backward adds: the autograd thread's cuBLAS one and cuBLASLt's, `is_bf16_supported`): env.json;
1. install: what the machine lacks (`NEEDED`), one package at a time, each failure reported, from PyPI or,
   without a network, from `make gpu-wheels`' folder (`--wheelhouse`, `WHEELHOUSE=dir` in make);
2. the unit tests (`--part K/N`: one of N parts), then `tests/gpu` (what only CUDA shows);
3. every notebook with its Colab defaults (papermill, a fresh kernel each, README.md untouched), each
   under its budget from tests/notebook_parameters_t4.yaml;
4. the planner-accuracy grid on CUDA (benchmarks/planner_accuracy.py --grid cuda);
5. the technique costs at a size where a T4 is compute-bound (gpt2-small, 4 x 512), for the device class the run
   stands for (`costs_class`: 't4' on a T4 or under T4 emulation, 'ampere+' on sm_80+), labelled with the GPU and
   its emulation: technique_costs_t4.json or technique_costs_ampere.json, the name of the package data file the
   recommender reads for that class (copy it into colab_memopt/ to replace the published priors).
It writes build/gpu/{env.json, results.json, planner_accuracy.json, technique_costs_<class>.json, claims.md}
and prints a summary table last; the exit status is 1 if any step failed. `--only` runs some steps (a slice);
each step's result is merged into results.json as soon as it ends, so slices run in separate calls add up. Timings of an emulated run
are this GPU's, not a T4's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BUDGETS_FILE = REPO_ROOT / "tests" / "notebook_parameters_t4.yaml"
T4_DEVICE_LIMIT_BYTES = int(14.74 * 2**30)  # what a Colab T4 shows PyTorch (env.T4_USABLE_BYTES)
ASSUMED_T4_CONTEXT_BYTES = int(0.75 * 2**30)  # env.ASSUMED_T4_CONTEXT_BYTES (this module imports no torch)
STEPS = ("install", "unit", "gpu-tests", "notebooks", "planner", "costs")
# import name -> pip name: every package the tests, the notebooks and the benchmarks import besides torch (the
# lent GPU machines' image has torch, transformers, peft, accelerate, matplotlib, pytest and more:
# wheelhouse.IMAGE_PACKAGES). Those marked optional in tests skip where absent (tests/conftest.py).
NEEDED = {
    "yaml": "pyyaml", "psutil": "psutil", "numpy": "numpy", "pytest": "pytest", "matplotlib": "matplotlib",
    "transformers": "transformers", "peft": "peft", "bitsandbytes": "bitsandbytes", "deepspeed": "deepspeed",
    "papermill": "papermill", "nbval": "nbval", "nbformat": "nbformat", "ipykernel": "ipykernel",
    "ipywidgets": "ipywidgets", "lomo_optim": "lomo-optim", "galore_torch": "galore-torch",
    "apollo_torch": "apollo-torch", "torchao": "torchao", "badam": "badam", "optimi": "torch-optimi",
    "trl": "trl", "datasets": "datasets", "accelerate": "accelerate", "safetensors": "safetensors",
    "tokenizers": "tokenizers", "packaging": "packaging",
}
NO_CUDA = 2


@dataclass
class StepResult:
    """One step of the run: passed, failed or skipped, how long, and what it found."""

    step: str
    status: str
    seconds: float
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def cuda_or_exit() -> None:
    """Return if torch sees a CUDA GPU; otherwise print one line saying why and exit with status 2."""
    why = None
    try:
        import torch
    except ImportError:
        why = f"torch is not installed for {sys.executable}"
    else:
        if not torch.cuda.is_available():
            why = f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)"
    if why:
        print(f"make test-gpu needs a CUDA GPU: {why}; nothing was run.", file=sys.stderr)
        sys.exit(NO_CUDA)


def emulation_for(gpu_name: str, requested: str | None) -> str:
    """Return what to emulate: `requested` (CM_EMULATE) if set, else 't4' on any GPU that is not a T4."""
    if requested is not None and requested.strip():
        value = requested.strip().lower()
        if value not in ("t4", "none"):
            raise ValueError(f"CM_EMULATE must be 't4' or 'none', got {requested!r}")
        return value
    return "none" if "T4" in gpu_name.upper().replace("-", " ").split() else "t4"


def child_env(emulate: str) -> dict[str, str]:
    """Return the environment of every process the run starts: the repository importable, the emulation,
    the T4's default cuBLAS workspace under emulation, no allocator settings (as on Colab)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["CM_EMULATE"] = emulate
    env.setdefault("MPLBACKEND", "Agg")
    if emulate == "t4":
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")  # sm_75's default size
    return env


def costs_class(emulate: str, capability: tuple[int, int]) -> str:
    """Return the device class the technique costs of this run stand for: 't4' when emulating one or below sm_80."""
    return "t4" if emulate == "t4" or tuple(capability) < (8, 0) else "ampere+"


def costs_file_name(emulate: str, capability: tuple[int, int]) -> str:
    """Return the file the costs step writes: the package data name of its class (technique_costs_t4.json, ...)."""
    from colab_memopt.costs import COSTS_FILES

    return COSTS_FILES[costs_class(emulate, capability)].name


def load_budgets(path: Path = BUDGETS_FILE) -> tuple[dict[str, int], int, int]:
    """Return (per-notebook budget seconds, default budget, total budget) from the T4 budgets file."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    default = int(data.get("default_budget_seconds", 600))
    total = int(data.get("total_budget_seconds", 3600))
    per = {}
    for name, entry in (data.get("notebooks") or {}).items():
        if set(entry) != {"budget_seconds"}:
            raise ValueError(f"{path}: notebook {name!r} may only set budget_seconds (Colab defaults run), got {sorted(entry)}")
        per[name] = int(entry["budget_seconds"])
    return per, default, total


_PROBE = r"""
import json, torch
r512 = lambda t: 512 * ((t.nbytes + 511) // 512)
torch.cuda.init()
torch.ones(1, device="cuda").add_(1); torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
context = total - free - torch.cuda.memory_reserved()
a = torch.randn(64, 64, device="cuda"); b = torch.randn(64, 64, device="cuda")
before = torch.cuda.memory_allocated()
c = a @ b; torch.cuda.synchronize()
workspace = torch.cuda.memory_allocated() - before - r512(c)
# A biased Linear's forward (addmm: cuBLASLt) and backward (the autograd engine's device thread: its own handle)
lin = torch.nn.Linear(64, 64, device="cuda"); x = torch.randn(8, 64, device="cuda", requires_grad=True)
before = torch.cuda.memory_allocated()
lin(x).sum().backward(); torch.cuda.synchronize()
more = torch.cuda.memory_allocated() - before - sum(r512(t) for t in (x.grad, lin.weight.grad, lin.bias.grad))
print(json.dumps({"context_bytes": int(context), "cublas_workspace_bytes": int(workspace),
                  "step_more_workspace_bytes": int(more), "is_bf16_supported": bool(torch.cuda.is_bf16_supported())}))
"""


def preflight(out: Path, env: dict[str, str]) -> dict[str, Any]:
    """Write env.json: the GPU, versions, and the context, workspace and bf16 facts measured in a fresh process."""
    import platform

    import torch

    from colab_memopt import planner

    props = torch.cuda.get_device_properties(0)
    versions = {}
    for module in ("torch", "transformers", "peft", "bitsandbytes", "deepspeed", "ipywidgets", "papermill", "nbval"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - absent or broken: say so
            versions[module] = None
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    measured = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {"error": probe.stderr[-2000:]}
    capability = torch.cuda.get_device_capability(0)
    planned, source = planner.cublas_workspace_bytes((7, 5) if env["CM_EMULATE"] == "t4" else capability,
                                                     env.get("CUBLAS_WORKSPACE_CONFIG"))
    lt, _ = planner.cublaslt_workspace_bytes(env.get("CUBLASLT_WORKSPACE_SIZE", ""), env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", ""))
    measured["context_note"] = f"{torch.cuda.get_device_name(0)}'s own CUDA context, not a T4's (emulation caps the allocator only)"
    info = {
        "gpu": torch.cuda.get_device_name(0), "capability": list(capability), "total_memory": props.total_memory,
        "cuda": torch.version.cuda, "python": platform.python_version(), "versions": versions,
        "emulate": env["CM_EMULATE"], "cublas_workspace_config": env.get("CUBLAS_WORKSPACE_CONFIG"),
        "measured": measured, "planned_cublas_workspace_bytes": planned, "planned_cublas_workspace_source": source,
        # planner.cuda_workspace_costs: the autograd thread's cuBLAS workspace and the cuBLASLt one (the probe's second figure)
        "planned_step_more_workspace_bytes": planned + lt,
        "measured_note": f"context_bytes and cublas_workspace_bytes are this GPU's ({torch.cuda.get_device_name(0)}), "
                         "measured in a fresh process; under T4 emulation they are not a T4's figures",
    }
    (out / "env.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _importable(module: str, env: dict[str, str] | None = None) -> str | None:
    """Return None if `module` imports in a fresh interpreter (with `env`), else the error's last line."""
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env, timeout=300)
    return None if run.returncode == 0 else ((run.stderr.strip().splitlines() or ["exit %d" % run.returncode])[-1])[:300]


def normalize(name: str) -> str:
    """Return a distribution name as PEP 503 compares them: 'Torch_Optimi' -> 'torch-optimi'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheelhouse_files(wheelhouse: str) -> list[Path]:
    """Return the wheels and sdists in `wheelhouse` and its subfolders (parts of `make gpu-wheels`), one per distribution.

    Raises ValueError if `wheelhouse` is not a folder, or if two files hold two versions of one distribution
    (pip would stop at the conflict).
    """

    root = Path(wheelhouse)
    if not root.is_dir():
        raise ValueError(f"the wheelhouse must be a folder of wheels (make gpu-wheels), got {wheelhouse!r}")
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*")):
        if not (path.name.endswith(".whl") or path.name.endswith(".tar.gz") or path.name.endswith(".zip")):
            continue
        name = normalize(path.name.split("-")[0])
        if name in found and found[name].name != path.name:
            raise ValueError(f"the wheelhouse holds two versions of {name}: {found[name].name} and {path.name}")
        found.setdefault(name, path)
    return sorted(found.values(), key=lambda p: (not p.name.endswith(".whl"), p.name))  # wheels before sdists


def install_missing(wheelhouse: str | None, target: str | None = None) -> StepResult:
    """pip-install what the steps need and this machine lacks, one package at a time; report each failure.

    With `wheelhouse` (no network): every distribution in it (`make gpu-wheels` downloads exactly what the
    lent machine lacks, with their dependencies) not installed yet, each by its own `pip install --no-index
    --no-deps` (DeepSpeed's sdist builds in isolation from setuptools and wheel found in the same folders).
    Without: each missing package from PyPI, at requirements.txt's pin. `target` installs into that folder
    (`pip --target`, for an environment that is not writable; the steps then get it on PYTHONPATH). Then each
    module of `NEEDED` is imported in a fresh process: a failure is the step's failure, an absent package
    (not in this wheelhouse) is named, and the tests that need it skip (tests/conftest.py).
    """
    from importlib import metadata


    start = time.perf_counter()
    env = dict(os.environ)
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(target).resolve()), *filter(None, [env.get("PYTHONPATH")])])
    base = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    base += ["--target", str(Path(target).resolve()), "--upgrade"] if target else []
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    installed, failed = [], {}
    if wheelhouse:
        files = wheelhouse_files(wheelhouse)
        links = sorted({str(f.parent.resolve()) for f in files})
        for path in files:
            name = normalize(path.name.split("-")[0])
            try:
                metadata.version(name)
                if not target:
                    continue  # already installed in this environment
            except metadata.PackageNotFoundError:
                pass
            if target and (Path(target) / f"{path.name.split('-')[0]}-{path.name.split('-')[1]}.dist-info").exists():
                continue  # installed by an earlier call on this machine
            cmd = base + ["--no-index", "--no-deps", *[a for link in links for a in ("--find-links", link)], str(path)]
            run = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if run.returncode == 0:
                installed.append(path.name)
            else:
                failed[path.name] = (run.stderr.strip().splitlines() or ["?"])[-1][:300]
    else:
        pins = _requirement_pins()
        for module in missing:
            pip = NEEDED[module]
            spec = f"{pip}=={pins[normalize(pip)]}" if normalize(pip) in pins else pip
            run = subprocess.run(base + [spec], capture_output=True, text=True, env=env)
            if run.returncode == 0:
                installed.append(spec)
            else:
                failed[spec] = (run.stderr.strip().splitlines() or ["?"])[-1][:300]
    broken, absent = {}, []
    for module in missing:
        error = _importable(module, env)
        if error is None:
            continue
        if f"No module named '{module}'" in error and not any(normalize(re.split(r"[-=]", k)[0]) == normalize(NEEDED[module])
                                                               for k in failed):
            absent.append(NEEDED[module])
        else:
            broken[NEEDED[module]] = error
    status = "failed" if failed or broken else "passed"
    detail = (f"installed {len(installed)} file(s)" + (f"; FAILED {failed}" if failed else "")
              + (f"; installed but not importable {broken}" if broken else "")
              + (f"; absent (not in {'the wheelhouse' if wheelhouse else 'PyPI'}; their tests skip): {absent}" if absent else ""))
    return StepResult("install", status, time.perf_counter() - start, detail,
                      {"installed": installed, "failed": failed, "not_importable": broken, "absent": absent,
                       "missing_before": [NEEDED[m] for m in missing], "target": target})


def _requirement_pins(path: Path = REPO_ROOT / "requirements.txt") -> dict[str, str]:
    """Return {normalized name: version} of requirements.txt's `name==version` lines."""

    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if m:
            pins[normalize(m.group(1))] = m.group(2)
    return pins


def run_command(step: str, cmd: list[str], env: dict[str, str], timeout_s: float, log: Path) -> StepResult:
    """Run one step's command with a time limit; its output goes to `log`."""
    start = time.perf_counter()
    try:
        with log.open("w") as f:
            run = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
        status = "passed" if run.returncode == 0 else "failed"
        detail = f"exit {run.returncode}"
    except subprocess.TimeoutExpired:
        status, detail = "failed", f"over its budget of {timeout_s:.0f} s"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    return StepResult(step, status, time.perf_counter() - start, f"{detail}; {tail[0] if tail else ''}; log {log.name}")


def run_notebooks(out: Path, env: dict[str, str], names: list[str] | None,
                  done: Callable[[StepResult], None] | None = None, deadline: float | None = None) -> list[StepResult]:
    """Run each notebook with its Colab defaults in its own process, under its budget; README.md is not touched.

    `done` is called with each notebook's result as soon as it is known (make test-gpu records it at once)."""
    from colab_memopt.runner import notebook_paths

    from colab_memopt.planner import cuda_workspace_costs

    per, default, total = load_budgets()
    workspaces = sum(c.bytes for c in cuda_workspace_costs((7, 5)))  # a T4's: the emulation's CUBLAS_WORKSPACE_CONFIG
    results, spent = [], 0.0
    for path in notebook_paths(names):
        budget = per.get(path.stem, default)
        if spent + budget > total:
            budget = max(0.0, total - spent)
        why = f"the total budget of {total} s is spent"
        if deadline is not None and time.monotonic() + budget > deadline:
            budget, why = max(0.0, deadline - time.monotonic()), "this call's --budget-seconds is spent"
        if budget <= 0:
            results.append(StepResult(f"notebook {path.stem}", "failed", 0.0, f"not run: {why}"))
            if done is not None:
                done(results[-1])
            continue
        cmd = [sys.executable, "-m", "colab_memopt.gpucheck", "_notebook", str(path), "--out", str(out)]
        result = run_command(f"notebook {path.stem}", cmd, env, budget, out / "logs" / f"{path.stem}.log")
        spent += result.seconds
        record = out / "results" / f"{path.stem}.json"
        if result.status == "passed" and record.exists():
            entry = json.loads(record.read_text())
            peaks = [entry[k]["peak_bytes"] for k in ("baseline", "optimized") if entry.get(k)]
            # the step peaks leave out the cuBLAS/cuBLASLt workspaces (allocated in the warm-up: foreign); the T4 holds them
            need = max(peaks, default=0) + workspaces
            result.data = {"peak_bytes": max(peaks, default=0), "workspace_bytes": workspaces, "device": entry.get("device")}
            if peaks and need > T4_DEVICE_LIMIT_BYTES:
                result.status, result.detail = "failed", f"peak {max(peaks):,} B + workspaces {workspaces:,} B over the T4's 14.74 GiB"
            # the process's need: the allocator's high-water mark (cached blocks included) plus a T4's
            # context (assumed: this GPU's own context is not a T4's), held against what a T4 shows PyTorch
            reserved = entry.get("cuda_max_reserved_bytes")
            result.data["max_reserved_bytes"] = reserved
            if reserved is not None and reserved + ASSUMED_T4_CONTEXT_BYTES > T4_DEVICE_LIMIT_BYTES:
                result.status, result.detail = "failed", (
                    f"reserved {reserved:,} B + an assumed T4 context of {ASSUMED_T4_CONTEXT_BYTES:,} B is over "
                    "the T4's 14.74 GiB")
        results.append(result)
        if done is not None:
            done(result)
    return results


def _notebook_child(path: str, out: str) -> int:
    """Execute one notebook with its Colab defaults (no parameters but results_dir); used by run_notebooks."""
    from colab_memopt.runner import run_notebook

    run = run_notebook(Path(path), Path(out) / "notebooks", Path(out).resolve() / "results", {})
    print(f"{run.name}: {run.seconds:.1f} s")
    return 0


def summary_table(label: str, steps: list[StepResult]) -> str:
    """Return the plain-text summary printed last: one row per step, then the verdict."""
    rows = [("step", "status", "seconds", "detail")]
    rows += [(s.step, s.status.upper() if s.status == "failed" else s.status, f"{s.seconds:.0f}", s.detail[:90]) for s in steps]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"make test-gpu on {label}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(2, "  ".join("-" * w for w in widths))
    failed = [s.step for s in steps if s.status == "failed"]
    lines.append(f"{len(steps) - len(failed)} of {len(steps)} steps passed" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines)


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


def write_outputs(out: Path, label: str, info: dict[str, Any], steps: list[StepResult]) -> dict[str, Any]:
    """Merge `steps` into out/results.json (a step run again replaces its earlier result; others are kept, so
    each slice of make test-gpu adds to what earlier calls wrote) and rewrite claims.md from every notebook
    record so far; return the merged payload."""
    from colab_memopt.report import merge_results
    from colab_memopt.rollup import claims_markdown

    path = out / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    merged_steps = {s["step"]: s for s in old.get("steps", [])}
    for s in steps:
        merged_steps[s.step] = asdict(s)
    results_dir = out / "results"
    merged = merge_results(results_dir) if results_dir.is_dir() and any(results_dir.glob("*.json")) else {"notebooks": {}}
    payload = {"label": label, "env": info or old.get("env", {}), "steps": list(merged_steps.values()),
               "notebooks": merged.get("notebooks", {}),
               "failed": [s["step"] for s in merged_steps.values() if s["status"] == "failed"]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)  # a call stopped mid-write keeps the previous file whole
    claims = claims_markdown(merged) if merged.get("notebooks") else "(no notebook ran)\n"
    (out / "claims.md").write_text(f"# Claims checked on {label}\n\nTimings are this GPU's, not a T4's, where it emulates one.\n\n{claims}")
    return payload


# make test-gpu on a lent H100/H200, in calls: at most 10 minutes a call, 45 minutes of device time a session, 64 MiB
# carried a call, a bare machine at each call. Every call carries the one wheelhouse part `make gpu-wheels` makes
# (56.7 MiB, wheelhouse.py) and installs it first; its slices then run under the call's budget (--budget-seconds:
# each step's limit is cut to what is left), and every finished step is merged into build/gpu/results.json at once.
# The minutes are budgets, not measurements: nothing here has run on a GPU yet. What does not finish in its budget is
# recorded ("over its budget", "not run") and is the first slice of the next session (the results merge).
CALL_PLAN = [
    {"only": ["install", "gpu-tests"], "budget_minutes": 5},
    {"only": ["install", "unit"], "part": "1/2", "budget_minutes": 6},
    {"only": ["install", "unit"], "part": "2/2", "budget_minutes": 6},
    {"only": ["install", "planner", "costs"], "budget_minutes": 6},
    {"only": ["install", "notebooks"], "notebooks": ["00", "01", "02", "03", "04", "05", "06", "07"], "budget_minutes": 5},
    {"only": ["install", "notebooks"], "notebooks": ["08", "09", "10", "11", "12", "13", "14", "15"], "budget_minutes": 6},
    {"only": ["install", "notebooks"], "notebooks": ["16"], "budget_minutes": 5},
    {"only": ["install", "notebooks"], "notebooks": ["17", "18", "19"], "budget_minutes": 5},
]
MARGIN_SECONDS = 30  # of each call's budget kept out of --budget-seconds (which covers the install too): the copy to $OUT


def call_commands(carry: str = ".whl/part1", site: str = "/tmp/site") -> list[str]:
    """Return the command of each call of `CALL_PLAN`, in order (run from the repository root on the lent machine,
    with `carry` carried; results under build/gpu, to copy into $OUT at the end of each call)."""
    out = []
    for call in CALL_PLAN:
        budget = int(call["budget_minutes"] * 60 - MARGIN_SECONDS)
        args = ["python3", "-m", "colab_memopt.gpucheck", "--wheelhouse", carry, "--pip-target", site,
                "--budget-seconds", str(budget), "--only", *call["only"]]
        if "part" in call:
            args += ["--part", call["part"]]
        if "notebooks" in call:
            args += ["--notebooks", *call["notebooks"]]
        out.append(" ".join(args) + "; cp -r build/gpu $OUT/")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="all", choices=["all", "preflight", "plan", "_notebook"])
    parser.add_argument("path", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO_ROOT / "build" / "gpu"))
    parser.add_argument("--wheelhouse", default=os.environ.get("WHEELHOUSE") or None,
                        help="install missing packages from this folder of wheels (make gpu-wheels; its subfolders too), not from PyPI")
    parser.add_argument("--pip-target", default=os.environ.get("CM_PIP_TARGET") or None,
                        help="install into this folder (pip --target) and put it on the steps' PYTHONPATH")
    parser.add_argument("--notebooks", nargs="*", default=None, help="only these notebooks (stems or number prefixes)")
    parser.add_argument("--only", nargs="+", default=None, choices=STEPS, help="run only these steps (results merge into results.json)")
    parser.add_argument("--part", default=None, help="the unit step's part K/N: the unit tests split into N groups (unit_parts)")
    parser.add_argument("--skip", nargs="*", default=[], choices=STEPS, help="steps to leave out (named in the summary)")
    parser.add_argument("--budget-seconds", type=float, default=None,
                        help="this call's wall-clock budget: each step's limit is cut to what is left (CALL_PLAN's slices)")
    args = parser.parse_args(argv)
    if args.budget_seconds is not None and args.budget_seconds <= 0:
        parser.error(f"--budget-seconds must be > 0, got {args.budget_seconds}")
    deadline = None if args.budget_seconds is None else time.monotonic() + args.budget_seconds

    def limit(seconds: float) -> float:
        return seconds if deadline is None else max(1.0, min(seconds, deadline - time.monotonic()))
    if args.command == "_notebook":
        return _notebook_child(args.path, args.out)
    if args.command == "plan":  # no GPU needed: print the calls that cover make test-gpu on a lent machine
        for i, (call, cmd) in enumerate(zip(CALL_PLAN, call_commands()), 1):
            print(f"call {i} ({call['budget_minutes']} min): {cmd}")
        print(f"total {sum(c['budget_minutes'] for c in CALL_PLAN)} min of device time (budgets, not measurements)")
        return 0
    try:
        part = parse_part(args.part)
    except ValueError as err:
        parser.error(str(err))
    cuda_or_exit()
    import torch

    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    emulate = emulation_for(gpu, os.environ.get("CM_EMULATE"))
    label = f"{gpu} emulating t4" if emulate == "t4" else gpu
    env = child_env(emulate)
    if args.pip_target:
        site = str(Path(args.pip_target).resolve())
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], site])
        sys.path.append(site)
    info = preflight(out, env)
    print(f"make test-gpu on {label}; env.json: {json.dumps(info['measured'])}", flush=True)
    if args.command == "preflight":
        return 0
    py = sys.executable
    unit_files = ["tests"] if part is None else unit_parts(part[1])[part[0] - 1]
    unit_name = "unit" if part is None else f"unit {part[0]}/{part[1]}"
    steps: list[StepResult] = []

    def done(result: StepResult) -> None:
        steps.append(result)
        write_outputs(out, label, info, [result])  # at once: a call stopped later keeps what finished
        print(f"  {result.step}: {result.status} ({result.seconds:.0f} s) {result.detail[:160]}", flush=True)

    plan = [
        ("install", lambda: install_missing(args.wheelhouse, args.pip_target)),
        ("unit", lambda: run_command(unit_name, [py, "-m", "pytest", *unit_files, "-m", "not notebook and not browser", "-q",
                                                 "-p", "no:cacheprovider", "--ignore=tests/gpu", "-rs"], env, limit(1800),
                                     out / "logs" / f"{unit_name.replace(' ', '_').replace('/', 'of')}.log")),
        ("gpu-tests", lambda: run_command("gpu-tests", [py, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"],
                                          env, limit(1200), out / "logs" / "gpu_tests.log")),
        ("notebooks", lambda: run_notebooks(out, env, args.notebooks, done, deadline)),
        ("planner", lambda: run_command("planner", [py, "benchmarks/planner_accuracy.py", "--grid", "cuda", "--out",
                                                    str(out / "planner_accuracy.json"), "--label", label],
                                        env, limit(1200), out / "logs" / "planner_accuracy.log")),
        ("costs", lambda: run_command("costs", [py, "benchmarks/technique_costs.py", "--model", "gpt2-small", "--batch", "4",
                                                "--seq", "512", "--rounds", "5", "--out",
                                                str(out / costs_file_name(emulate, torch.cuda.get_device_capability(0)))],
                                      env, limit(1200), out / "logs" / "technique_costs.log")),
    ]
    for name, run in plan:
        if args.only is not None and name not in args.only:
            continue
        if name in args.skip:
            done(StepResult(name, "skipped", 0.0, "--skip"))
            continue
        result = run()
        if not isinstance(result, list):
            done(result)
    print()
    print(summary_table(label, steps))
    print(f"\nmerged into {out / 'results.json'}; {out / 'claims.md'}, {out / 'env.json'}")
    return 1 if any(s.status == "failed" for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
