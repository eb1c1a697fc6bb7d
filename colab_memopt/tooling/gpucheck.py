"""`make test-gpu`: everything this project claims about CUDA, checked in one command on any CUDA GPU.

    python -m colab_memopt.gpucheck [--out build/gpu] [--wheelhouse DIR [--pip-target DIR]] [--only STEP ...]
                                    [--part K/N] [--notebooks 00 05 ...] [--budget-seconds S] [--skip STEP ...]
                                    [--parallel N] [--archive FILE]
    python -m colab_memopt.gpucheck plan      # the one call that covers tests/gpu, the grid and every notebook

Where torch sees no CUDA GPU it prints one line and exits 2. Otherwise, with `CM_EMULATE=t4` (the
default on any GPU that is not a T4; `CM_EMULATE=none` turns it off) every process it starts caps the
caching allocator to the T4's usable bytes less its context and takes the T4's code paths
(`env.apply_emulation`), and every result is labelled "<gpu> emulating t4". The steps:

0. preflight (every call): the GPU, versions, and measurements in a fresh process (this GPU's own CUDA
   context outside the allocator, the cuBLAS workspace the first matmul allocates, the workspaces a biased
   Linear's backward adds: the autograd thread's cuBLAS one and cuBLASLt's, `is_bf16_supported`): env.json;
1. install: what the machine lacks (`NEEDED`), each failure reported, from PyPI or, without a network,
   from `make gpu-wheels`' folder (`--wheelhouse`, `WHEELHOUSE=dir` in make: one pip call, one package at
   a time if that fails);
2. the unit tests (`--part K/N`: one of N parts), then `tests/gpu` (what only CUDA shows);
3. every notebook with its Colab defaults (papermill, a fresh kernel each, README.md untouched), each
   under its budget from tests/notebook_parameters_t4.yaml, which changes only what a machine without a
   network needs (18 and 19 train a small random model of a family) and names what a notebook requires
   (10: DeepSpeed; where absent it is "not run: <reason>", never passed);
4. the planner-accuracy grid on CUDA (benchmarks/planner_accuracy.py --grid cuda);
5. the technique costs at a size where a T4 is compute-bound (gpt2-small, 4 x 512), for the device class the run
   stands for (`costs_class`: 't4' on a T4 or under T4 emulation, 'ampere+' on sm_80+), labelled with the GPU and
   its emulation: technique_costs_t4.json or technique_costs_ampere.json, the name of the package data file the
   recommender reads for that class (copy it into colab_memopt/ to replace the published priors).
It writes build/gpu/{env.json, results.json, planner_accuracy.json, technique_costs_<class>.json, claims.md}
and prints a summary table last; the exit status is 1 if any step failed. `--only` runs some steps (a slice);
each step's result is merged into results.json as soon as it ends, so slices run in separate calls add up. Timings of an emulated run
are this GPU's, not a T4's.

`--parallel N` (the one call on a lent GPU machine, `plan` prints it): after the install, gpu-tests, planner,
costs and the notebooks run in N slices side by side, each process capped to a T4's memory by the emulation,
packed by the estimates in tests/notebook_parameters_t4.yaml (lent_run); a slice that is done takes work
not started from the others. `--budget-seconds` is the one deadline: what is still running then is killed with
every process it started and recorded "not finished", what has not started too (never passed). `--archive`
writes the out folder as one .tar.gz, rewritten as results come and at the end, so a call killed early
still returns what finished.

This module runs the steps; planning the one call (the T4 settings file, the slices, the command, the carry) is in
`colab_memopt.tooling.gpuplan`, and recording what ran (results.json, claims.md, the archive, the summary) in
`colab_memopt.tooling.gpurecord`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colab_memopt.core.fileio import atomic_write_text
from colab_memopt.tooling.gpuplan import (
    LENT_STEPS,
    ONE_CALL_STEPS,
    REPO_ROOT,
    Item,
    T4Settings,
    lent_items,
    load_t4_settings,
    pack_slices,
    parse_part,
    print_plan,
    unit_parts,
)
from colab_memopt.tooling.gpurecord import NOT_FINISHED, NOT_RUN, Recorder, StepResult, finish, not_run_reason


# env.T4_TOTAL_BYTES and env.T4_CUDA_CONTEXT_BYTES (this module imports no torch; a test holds them equal)
T4_DEVICE_LIMIT_BYTES = 14_912 * 2**20  # what a Colab T4 shows PyTorch on 2026 images (14.56 GiB)
T4_CUDA_CONTEXT_BYTES = 147 * 2**20  # a T4's CUDA context as measured (133-147 MiB)
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
    "huggingface_hub": "huggingface-hub",
    "tokenizers": "tokenizers", "packaging": "packaging", "IPython": "ipython", "nbclient": "nbclient",
}
NO_CUDA = 2


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
    env.setdefault("HF_HUB_OFFLINE", "1")  # no notebook needs the hub (tests/notebook_parameters_t4.yaml): fail at once
    if emulate == "t4":
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")  # sm_75's default size
    return env


def costs_class(emulate: str, capability: tuple[int, int]) -> str:
    """Return the device class the technique costs of this run stand for: 't4' when emulating one or below sm_80."""
    return "t4" if emulate == "t4" or tuple(capability) < (8, 0) else "ampere+"


def costs_file_name(emulate: str, capability: tuple[int, int]) -> str:
    """Return the file the costs step writes: the package data name of its class (technique_costs_t4.json, ...)."""
    from colab_memopt.planning.costs import COSTS_FILES

    return COSTS_FILES[costs_class(emulate, capability)].name


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

    from colab_memopt.planning import targets

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
    planned, source = targets.cublas_workspace_bytes((7, 5) if env["CM_EMULATE"] == "t4" else capability,
                                                     env.get("CUBLAS_WORKSPACE_CONFIG"))
    lt, _ = targets.cublaslt_workspace_bytes(env.get("CUBLASLT_WORKSPACE_SIZE", ""), env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", ""))
    measured["context_note"] = f"{torch.cuda.get_device_name(0)}'s own CUDA context, not a T4's (emulation caps the allocator only)"
    info = {
        "gpu": torch.cuda.get_device_name(0), "capability": list(capability), "total_memory": props.total_memory,
        "cuda": torch.version.cuda, "python": platform.python_version(), "versions": versions,
        "emulate": env["CM_EMULATE"], "cublas_workspace_config": env.get("CUBLAS_WORKSPACE_CONFIG"),
        "measured": measured, "planned_cublas_workspace_bytes": planned, "planned_cublas_workspace_source": source,
        # untraced.cuda_workspace_costs: the autograd thread's cuBLAS workspace and the cuBLASLt one (the probe's second figure)
        "planned_step_more_workspace_bytes": planned + lt,
        "measured_note": f"context_bytes and cublas_workspace_bytes are this GPU's ({torch.cuda.get_device_name(0)}), "
                         "measured in a fresh process; under T4 emulation they are not a T4's figures",
    }
    atomic_write_text(out / "env.json", json.dumps(info, indent=2) + "\n")
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
    """pip-install what the steps need and this machine lacks; report each failure.

    With `wheelhouse` (no network): every distribution in it (`make gpu-wheels` downloads exactly what the
    lent machine lacks, with their dependencies) not installed yet, all in one `pip install --no-index
    --no-deps`, or, if that fails, each by its own, to name each failure (DeepSpeed's sdist builds in
    isolation from setuptools and wheel found in the same folders).
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
        todo = []
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
            todo.append(path)
        offline = base + ["--no-index", "--no-deps", *[a for link in links for a in ("--find-links", link)]]
        # all in one pip (2 s for the one-call carry); only if that fails, one at a time, to name each failure
        if todo and subprocess.run(offline + [str(p) for p in todo], capture_output=True, text=True, env=env).returncode == 0:
            installed, todo = [p.name for p in todo], []
        for path in todo:
            run = subprocess.run(offline + [str(path)], capture_output=True, text=True, env=env)
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
    from concurrent.futures import ThreadPoolExecutor

    broken, absent = {}, []
    with ThreadPoolExecutor(8) as pool:  # a fresh interpreter each (transformers, trl: seconds apiece)
        errors = dict(zip(missing, pool.map(lambda m: _importable(m, env), missing)))
    for module in missing:
        error = errors[module]
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


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill `proc` and every process below it (a notebook's kernel runs in a session of its own), then reap it."""
    pids = []
    try:
        import psutil

        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - psutil absent or the process gone: its own group still goes
        pass
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, 9)  # started with start_new_session: its group id is its pid
    except OSError:
        pass
    proc.wait()


def run_command(step: str, cmd: list[str], env: dict[str, str], timeout_s: float, log: Path, *,
                at_deadline: bool = False) -> StepResult:
    """Run one step's command with a time limit; its output goes to `log`.

    Past the limit the command and every process it started are killed: the step failed (over its budget), or,
    when the limit is the run's deadline (`at_deadline`), it is "not finished"."""
    start = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(0.0, timeout_s))
            status, detail = ("passed" if code == 0 else "failed"), f"exit {code}"
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            if at_deadline:
                status, detail = NOT_FINISHED, f"stopped at the run's deadline after {time.perf_counter() - start:.0f} s"
            else:
                status, detail = "failed", f"over its budget of {timeout_s:.0f} s"
        except BaseException:  # Ctrl-C, SIGTERM: a session of its own gets no signal from the terminal, so stop it here
            kill_tree(proc)
            raise
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    return StepResult(step, status, time.perf_counter() - start, f"{detail}; {tail[0] if tail else ''}; log {log.name}")


def absent_requirements(settings: T4Settings, stem: str, env: dict[str, str] | None = None) -> list[str]:
    """Return the modules notebook `stem` requires (T4 settings' `requires`) that cannot be found here."""
    paths = [p for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p]
    importlib.invalidate_caches()  # the --pip-target folder was empty when the first imports looked in it
    missing = []
    for module in settings.requires.get(stem, []):
        if importlib.util.find_spec(module) is None and not any((Path(p) / module).exists() for p in paths):
            missing.append(module)
    return missing


def notebook_command(path: Path, out: Path) -> list[str]:
    """Return the command that executes one notebook with its T4 settings (`_notebook_child`)."""
    return [sys.executable, "-m", "colab_memopt.tooling.gpucheck", "_notebook", str(path), "--out", str(out)]


def notebook_verdict(result: StepResult, stem: str, out: Path, workspaces: int) -> StepResult:
    """Hold a notebook that ran to the T4: its step peaks plus the workspaces, its reserved bytes plus a context."""
    record = out / "results" / f"{stem}.json"
    if result.status != "passed" or not record.exists():
        return result
    entry = json.loads(record.read_text())
    peaks = [entry[k]["peak_bytes"] for k in ("baseline", "optimized") if entry.get(k)]
    # the step peaks leave out the cuBLAS/cuBLASLt workspaces (allocated in the warm-up: foreign); the T4 holds them
    need = max(peaks, default=0) + workspaces
    result.data.update({"peak_bytes": max(peaks, default=0), "workspace_bytes": workspaces, "device": entry.get("device")})
    if peaks and need > T4_DEVICE_LIMIT_BYTES:
        result.status, result.detail = "failed", f"peak {max(peaks):,} B + workspaces {workspaces:,} B over the T4's 14.56 GiB"
    # the process's need: the allocator's high-water mark (cached blocks included) plus a T4's
    # context (a T4's as measured: this GPU's own context is not a T4's), held against what a T4 shows PyTorch
    reserved = entry.get("cuda_max_reserved_bytes")
    result.data["max_reserved_bytes"] = reserved
    if reserved is not None and reserved + T4_CUDA_CONTEXT_BYTES > T4_DEVICE_LIMIT_BYTES:
        result.status, result.detail = "failed", (
            f"reserved {reserved:,} B + a T4's CUDA context of {T4_CUDA_CONTEXT_BYTES:,} B is over "
            "the T4's 14.56 GiB")
    return result


def _t4_workspaces() -> int:
    from colab_memopt.planning.untraced import cuda_workspace_costs

    return sum(c.bytes for c in cuda_workspace_costs((7, 5)))  # a T4's: the emulation's CUBLAS_WORKSPACE_CONFIG


def run_notebooks(out: Path, env: dict[str, str], names: list[str] | None,
                  done: Callable[[StepResult], None] | None = None, deadline: float | None = None) -> list[StepResult]:
    """Run each notebook with its Colab defaults in its own process, under its budget; README.md is not touched.

    `done` is called with each notebook's result as soon as it is known (make test-gpu records it at once)."""
    from colab_memopt.tooling.runner import notebook_paths

    settings = load_t4_settings()
    per, default, total = settings.budgets, settings.default_budget, settings.total_budget
    workspaces = _t4_workspaces()
    results, spent = [], 0.0
    for path in notebook_paths(names):
        budget = per.get(path.stem, default)
        missing = absent_requirements(settings, path.stem, env)
        if missing:
            results.append(StepResult(f"notebook {path.stem}", NOT_RUN, 0.0, not_run_reason(missing)))
            if done is not None:
                done(results[-1])
            continue
        if spent + budget > total:
            budget = max(0.0, total - spent)
        why, at_deadline = f"the total budget of {total} s is spent", False
        if deadline is not None and time.monotonic() + budget > deadline:
            budget, why, at_deadline = max(0.0, deadline - time.monotonic()), "this call's --budget-seconds is spent", True
        if budget <= 0:
            status = NOT_FINISHED if at_deadline else "failed"
            results.append(StepResult(f"notebook {path.stem}", status, 0.0, f"not started: {why}"))
            if done is not None:
                done(results[-1])
            continue
        result = run_command(f"notebook {path.stem}", notebook_command(path, out), env, budget,
                             out / "logs" / f"{path.stem}.log", at_deadline=at_deadline)
        spent += result.seconds
        results.append(notebook_verdict(result, path.stem, out, workspaces))
        if done is not None:
            done(result)
    return results


def _notebook_child(path: str, out: str) -> int:
    """Execute one notebook with its Colab defaults, but the T4 settings' parameters (a machine without hub)."""
    from colab_memopt.tooling.runner import run_notebook

    params = load_t4_settings().parameters.get(Path(path).stem, {})
    run = run_notebook(Path(path), Path(out) / "notebooks", Path(out).resolve() / "results", params)
    print(f"{run.name}: {run.seconds:.1f} s" + (f" with {params}" if params else ""))
    return 0


def run_slices(slices: list[list[Item]], run_item: Callable[[Item, float], StepResult], deadline: float,
               done: Callable[[StepResult], None], clock: Callable[[], float] = time.monotonic) -> list[StepResult]:
    """Run the slices side by side, one thread each, every item in its own process; return every result.

    `run_item(item, seconds_left)` runs one item and must stop by the deadline (`run_command(..., at_deadline=True)`
    kills it and says "not finished"). A slice that is done takes the last item not started of the slice with the
    most estimated seconds left. An item not started by the deadline is "not finished" too: never passed."""
    import threading
    from collections import deque

    lock = threading.Lock()
    queues = [deque(s) for s in slices]
    results: list[StepResult] = []

    def take(k: int) -> Item | None:
        with lock:
            if queues[k]:
                return queues[k].popleft()
            busiest = max(queues, key=lambda q: sum(i.seconds for i in q))
            return busiest.pop() if busiest else None

    def worker(k: int) -> None:
        while (item := take(k)) is not None:
            left = deadline - clock()
            start = time.perf_counter()
            try:
                result = (StepResult(item.name, NOT_FINISHED, 0.0, "not started before the run's deadline") if left <= 0
                          else run_item(item, left))
            except Exception as exc:  # noqa: BLE001 - one item's crash is its failure, not the run's
                result = StepResult(item.name, "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
            result.data.update({"slice": k + 1, "estimate_seconds": item.seconds})
            with lock:
                results.append(result)
            done(result)

    threads = [threading.Thread(target=worker, args=(k,), name=f"slice-{k + 1}", daemon=True) for k in range(len(queues))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def step_command(name: str, out: Path, label: str, emulate: str, capability: tuple[int, int]) -> tuple[list[str], Path]:
    """Return the command and log of a step of LENT_STEPS ('gpu-tests', 'planner', 'costs')."""
    py = sys.executable
    if name == "gpu-tests":
        return [py, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"], out / "logs" / "gpu_tests.log"
    if name == "planner":
        return ([py, "benchmarks/planner_accuracy.py", "--grid", "cuda", "--out", str(out / "planner_accuracy.json"),
                 "--label", label], out / "logs" / "planner_accuracy.log")
    if name == "costs":
        return ([py, "benchmarks/technique_costs.py", "--model", "gpt2-small", "--batch", "4", "--seq", "512", "--rounds", "5",
                 "--out", str(out / costs_file_name(emulate, capability))], out / "logs" / "technique_costs.log")
    raise ValueError(f"a step run as one command is one of {list(LENT_STEPS)}, got {name!r}")


def worker_env(env: dict[str, str], workers: int, cpus: int | None = None) -> dict[str, str]:
    """Return the environment of each slice's processes: the CPU cores shared out (one OpenMP pool per slice)."""
    threads = str(max(1, (cpus or os.cpu_count() or 1) // workers))
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", threads), "MKL_NUM_THREADS": env.get("MKL_NUM_THREADS", threads)}


def build_parser() -> argparse.ArgumentParser:
    """Return the command line of make test-gpu (`python -m colab_memopt.gpucheck`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # `_notebook PATH` is the internal verb each notebook's child process runs (`notebook_command`): not offered
    parser.add_argument("command", nargs="?", default="all", choices=["all", "preflight", "plan", "_notebook"],
                        metavar="{all,preflight,plan}")
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
                        help="the run's wall-clock deadline from its start: each step's limit is cut to what is left; "
                             "with --parallel, what the deadline stops is 'not finished'")
    parser.add_argument("--parallel", type=int, default=None, metavar="N",
                        help="run gpu-tests, planner, costs and the notebooks in N slices side by side (after the install), "
                             "packed by tests/notebook_parameters_t4.yaml's estimates")
    parser.add_argument("--archive", default=None, metavar="FILE",
                        help="write the out folder as one .tar.gz here, rewritten as results come and at the end")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget_seconds is not None:
        if not args.budget_seconds > 0:  # NaN too: every comparison with it is false
            parser.error(f"--budget-seconds must be > 0, got {args.budget_seconds:g}")
        if not math.isfinite(args.budget_seconds):
            parser.error(f"--budget-seconds must be a finite number of seconds, got {args.budget_seconds:g}")
    if args.parallel is not None and args.parallel < 1:
        parser.error(f"--parallel must be >= 1 (worker processes), got {args.parallel}")
    deadline = None if args.budget_seconds is None else time.monotonic() + args.budget_seconds

    def limit(seconds: float) -> float:
        return seconds if deadline is None else max(1.0, min(seconds, deadline - time.monotonic()))
    if args.command == "_notebook":
        if args.path is None:
            parser.error("_notebook needs the path of one notebook")
        if not Path(args.path).is_file():
            parser.error(f"_notebook: no notebook at {args.path!r}")
        return _notebook_child(args.path, args.out)
    if args.command == "plan":  # no GPU needed: print the one call that covers make test-gpu on a lent machine
        return print_plan()
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
    archive = Path(args.archive) if args.archive else None
    record = Recorder(out, label, {}, archive)
    try:
        info = record.info = preflight(out, env)
        print(f"make test-gpu on {label}; env.json: {json.dumps(info['measured'])}", flush=True)
        if args.command == "preflight":
            return 0
        capability = tuple(torch.cuda.get_device_capability(0))
        if args.parallel:
            return run_parallel(args, out, label, env, emulate, capability, record, deadline)
        py = sys.executable
        unit_files = ["tests"] if part is None else unit_parts(part[1])[part[0] - 1]
        unit_name = "unit" if part is None else f"unit {part[0]}/{part[1]}"

        def step(name: str, seconds: float) -> StepResult:
            cmd, log = step_command(name, out, label, emulate, capability)
            return run_command(name, cmd, env, limit(seconds), log)
        plan = [
            ("install", lambda: install_missing(args.wheelhouse, args.pip_target)),
            ("unit", lambda: run_command(unit_name, [py, "-m", "pytest", *unit_files, "-m", "not notebook and not browser", "-q",
                                                     "-p", "no:cacheprovider", "--ignore=tests/gpu", "-rs"], env, limit(1800),
                                         out / "logs" / f"{unit_name.replace(' ', '_').replace('/', 'of')}.log")),
            ("gpu-tests", lambda: step("gpu-tests", 1200)),
            ("notebooks", lambda: run_notebooks(out, env, args.notebooks, record, deadline)),
            ("planner", lambda: step("planner", 1200)),
            ("costs", lambda: step("costs", 1200)),
        ]
        for name, run in plan:
            if args.only is not None and name not in args.only:
                continue
            if name in args.skip:
                record(StepResult(name, "skipped", 0.0, "--skip"))
                continue
            result = run()
            if not isinstance(result, list):
                record(result)
        return finish(record, out, label)
    finally:
        record.save_archive()


def run_parallel(args: argparse.Namespace, out: Path, label: str, env: dict[str, str], emulate: str,
                 capability: tuple[int, int], record: Recorder, deadline: float | None) -> int:
    """The install, then gpu-tests, planner, costs and the notebooks (those of `args.only`) in `args.parallel` slices."""
    from colab_memopt.tooling.runner import notebook_paths

    wanted = [s for s in (args.only or ONE_CALL_STEPS) if s not in args.skip]
    if "install" in wanted:
        record(install_missing(args.wheelhouse, args.pip_target))
    if "unit" in wanted:
        record(StepResult("unit", NOT_RUN, 0.0, "not run: the unit tests run one after the other (leave out --parallel)"))
    settings = load_t4_settings()
    wenv = worker_env(env, args.parallel)
    paths = {p.stem: p for p in notebook_paths(args.notebooks)} if "notebooks" in wanted else {}
    items, not_run = lent_items(settings, wanted, list(paths), lambda stem: absent_requirements(settings, stem, wenv))
    for result in not_run:
        record(result)
    slices = pack_slices(items, args.parallel)
    end = deadline if deadline is not None else time.monotonic() + settings.deadline_seconds
    print(f"{len(items)} items in {args.parallel} slices, deadline in {end - time.monotonic():.0f} s:", flush=True)
    for k, s in enumerate(slices, 1):
        print(f"  slice {k} (~{sum(i.seconds for i in s):.0f} s): {', '.join(i.name.removeprefix('notebook ') for i in s)}",
              flush=True)
    workspaces = _t4_workspaces()

    def run_item(item: Item, left: float) -> StepResult:
        if item.name.startswith("notebook "):
            stem = item.name.removeprefix("notebook ")
            result = run_command(item.name, notebook_command(paths[stem], out), wenv, min(left, item.budget),
                                 out / "logs" / f"{stem}.log", at_deadline=left <= item.budget)
            return notebook_verdict(result, stem, out, workspaces)
        cmd, log = step_command(item.name, out, label, emulate, capability)
        return run_command(item.name, cmd, wenv, left, log, at_deadline=True)

    run_slices(slices, run_item, end, record)
    return finish(record, out, label)


if __name__ == "__main__":
    sys.exit(main())
