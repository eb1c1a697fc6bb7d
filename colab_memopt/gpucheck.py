"""`make test-gpu`: everything this project claims about CUDA, checked in one command on any CUDA GPU.

    python -m colab_memopt.gpucheck [--out build/gpu] [--wheelhouse DIR] [--notebooks 00 05 ...] [--skip STEP ...]

Where torch sees no CUDA GPU it prints one line and exits 2. Otherwise, with `CM_EMULATE=t4` (the
default on any GPU that is not a T4; `CM_EMULATE=none` turns it off) every process it starts caps the
caching allocator to the T4's usable bytes less its context and takes the T4's code paths
(`env.apply_emulation`), and every result is labelled "<gpu> emulating t4". The steps:

0. preflight: the GPU, versions, and three measurements in fresh processes (the CUDA context outside
   the allocator, the cuBLAS workspace the first matmul allocates, `is_bf16_supported`): env.json;
1. install: what the machine lacks (bitsandbytes, deepspeed, papermill, nbval, ...) from PyPI, or from
   a local wheel folder (`--wheelhouse`, `WHEELHOUSE=dir` in make) on machines without internet;
2. the unit tests, then `tests/gpu` (what only CUDA shows);
3. every notebook with its Colab defaults (papermill, a fresh kernel each, README.md untouched), each
   under its budget from tests/notebook_parameters_t4.yaml;
4. the planner-accuracy grid on CUDA (benchmarks/planner_accuracy.py --grid cuda);
5. the technique costs at a size where a T4 is compute-bound (gpt2-small, 4 x 512), for the device class the run
   stands for (`costs_class`: 't4' on a T4 or under T4 emulation, 'ampere+' on sm_80+), labelled with the GPU and
   its emulation: technique_costs_t4.json or technique_costs_ampere.json, the name of the package data file the
   recommender reads for that class (copy it into colab_memopt/ to replace the published priors).
It writes build/gpu/{env.json, results.json, planner_accuracy.json, technique_costs_<class>.json, claims.md}
and prints a summary table last; the exit status is 1 if any step failed. Timings of an emulated run
are this GPU's, not a T4's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BUDGETS_FILE = REPO_ROOT / "tests" / "notebook_parameters_t4.yaml"
T4_DEVICE_LIMIT_BYTES = int(14.74 * 2**30)  # what a Colab T4 shows PyTorch (env.T4_USABLE_BYTES)
ASSUMED_T4_CONTEXT_BYTES = int(0.75 * 2**30)  # env.ASSUMED_T4_CONTEXT_BYTES (this module imports no torch)
STEPS = ("install", "unit", "gpu-tests", "notebooks", "planner", "costs")
# import name -> pip name: what the steps need besides torch (the GPU image has torch, transformers, peft,
# accelerate, matplotlib and pytest; FACTS.md "The GPU machine").
NEEDED = {
    "yaml": "pyyaml", "psutil": "psutil", "numpy": "numpy", "pytest": "pytest", "matplotlib": "matplotlib",
    "transformers": "transformers", "peft": "peft", "bitsandbytes": "bitsandbytes", "deepspeed": "deepspeed",
    "papermill": "papermill", "nbval": "nbval", "nbformat": "nbformat", "ipykernel": "ipykernel",
    "ipywidgets": "ipywidgets", "lomo_optim": "lomo-optim",
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
torch.cuda.init()
torch.ones(1, device="cuda").add_(1); torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
context = total - free - torch.cuda.memory_reserved()
a = torch.randn(64, 64, device="cuda"); b = torch.randn(64, 64, device="cuda")
before = torch.cuda.memory_allocated()
c = a @ b; torch.cuda.synchronize()
workspace = torch.cuda.memory_allocated() - before - 512 * ((c.nbytes + 511) // 512)
print(json.dumps({"context_bytes": int(context), "cublas_workspace_bytes": int(workspace),
                  "is_bf16_supported": bool(torch.cuda.is_bf16_supported())}))
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
    info = {
        "gpu": torch.cuda.get_device_name(0), "capability": list(capability), "total_memory": props.total_memory,
        "cuda": torch.version.cuda, "python": platform.python_version(), "versions": versions,
        "emulate": env["CM_EMULATE"], "cublas_workspace_config": env.get("CUBLAS_WORKSPACE_CONFIG"),
        "measured": measured, "planned_cublas_workspace_bytes": planned, "planned_cublas_workspace_source": source,
        "measured_note": f"context_bytes and cublas_workspace_bytes are this GPU's ({torch.cuda.get_device_name(0)}), "
                         "measured in a fresh process; under T4 emulation they are not a T4's figures",
    }
    (out / "env.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def install_missing(wheelhouse: str | None) -> StepResult:
    """pip-install the modules the steps need and this machine lacks (from `wheelhouse` when given)."""
    start = time.perf_counter()
    missing = [pip for module, pip in NEEDED.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return StepResult("install", "passed", time.perf_counter() - start, "nothing missing")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if wheelhouse:
        if not Path(wheelhouse).is_dir():
            raise ValueError(f"WHEELHOUSE must be a folder of wheels, got {wheelhouse!r}")
        cmd += ["--no-index", "--find-links", str(Path(wheelhouse).resolve())]
    run = subprocess.run(cmd + missing, capture_output=True, text=True)
    status = "passed" if run.returncode == 0 else "failed"
    return StepResult("install", status, time.perf_counter() - start,
                      f"installed {missing}" + ("" if status == "passed" else f": {run.stderr[-1500:]}"))


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


def run_notebooks(out: Path, env: dict[str, str], names: list[str] | None) -> list[StepResult]:
    """Run each notebook with its Colab defaults in its own process, under its budget; README.md is not touched."""
    from colab_memopt.runner import notebook_paths

    per, default, total = load_budgets()
    results, spent = [], 0.0
    for path in notebook_paths(names):
        budget = per.get(path.stem, default)
        if spent + budget > total:
            budget = max(0.0, total - spent)
        if budget <= 0:
            results.append(StepResult(f"notebook {path.stem}", "failed", 0.0, f"not run: the total budget of {total} s is spent"))
            continue
        cmd = [sys.executable, "-m", "colab_memopt.gpucheck", "_notebook", str(path), "--out", str(out)]
        result = run_command(f"notebook {path.stem}", cmd, env, budget, out / "logs" / f"{path.stem}.log")
        spent += result.seconds
        record = out / "results" / f"{path.stem}.json"
        if result.status == "passed" and record.exists():
            entry = json.loads(record.read_text())
            peaks = [entry[k]["peak_bytes"] for k in ("baseline", "optimized") if entry.get(k)]
            result.data = {"peak_bytes": max(peaks, default=0), "device": entry.get("device")}
            if peaks and max(peaks) > T4_DEVICE_LIMIT_BYTES:
                result.status, result.detail = "failed", f"peak {max(peaks):,} B over the T4's 14.74 GiB"
            # the process's need: the allocator's high-water mark (cached blocks included) plus a T4's
            # context (assumed: this GPU's own context is not a T4's), held against what a T4 shows PyTorch
            reserved = entry.get("cuda_max_reserved_bytes")
            result.data["max_reserved_bytes"] = reserved
            if reserved is not None and reserved + ASSUMED_T4_CONTEXT_BYTES > T4_DEVICE_LIMIT_BYTES:
                result.status, result.detail = "failed", (
                    f"reserved {reserved:,} B + an assumed T4 context of {ASSUMED_T4_CONTEXT_BYTES:,} B is over "
                    "the T4's 14.74 GiB")
        results.append(result)
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


def write_outputs(out: Path, label: str, info: dict[str, Any], steps: list[StepResult]) -> None:
    """Write results.json and claims.md (from the notebooks' records, labelled with the device)."""
    from colab_memopt.report import merge_results
    from colab_memopt.rollup import claims_markdown

    results_dir = out / "results"
    merged = merge_results(results_dir) if results_dir.is_dir() and any(results_dir.glob("*.json")) else {"notebooks": {}}
    payload = {"label": label, "env": info, "steps": [asdict(s) for s in steps], "notebooks": merged.get("notebooks", {}),
               "failed": [s.step for s in steps if s.status == "failed"]}
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    claims = claims_markdown(merged) if merged.get("notebooks") else "(no notebook ran)\n"
    (out / "claims.md").write_text(f"# Claims checked on {label}\n\nTimings are this GPU's, not a T4's, where it emulates one.\n\n{claims}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="all", choices=["all", "preflight", "_notebook"])
    parser.add_argument("path", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO_ROOT / "build" / "gpu"))
    parser.add_argument("--wheelhouse", default=os.environ.get("WHEELHOUSE") or None,
                        help="install missing packages from this folder of wheels, not from PyPI")
    parser.add_argument("--notebooks", nargs="*", default=None, help="only these notebooks (stems or number prefixes)")
    parser.add_argument("--skip", nargs="*", default=[], choices=STEPS, help="steps to leave out (named in the summary)")
    args = parser.parse_args(argv)
    if args.command == "_notebook":
        return _notebook_child(args.path, args.out)
    cuda_or_exit()
    import torch

    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    emulate = emulation_for(gpu, os.environ.get("CM_EMULATE"))
    label = f"{gpu} emulating t4" if emulate == "t4" else gpu
    env = child_env(emulate)
    info = preflight(out, env)
    print(f"make test-gpu on {label}; env.json: {json.dumps(info['measured'])}", flush=True)
    if args.command == "preflight":
        return 0
    py = sys.executable
    plan = [
        ("install", lambda: install_missing(args.wheelhouse)),
        ("unit", lambda: run_command("unit", [py, "-m", "pytest", "tests", "-m", "not notebook and not browser", "-q",
                                              "-p", "no:cacheprovider", "--ignore=tests/gpu"], env, 1800, out / "logs" / "unit.log")),
        ("gpu-tests", lambda: run_command("gpu-tests", [py, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"],
                                          env, 1200, out / "logs" / "gpu_tests.log")),
        ("notebooks", lambda: run_notebooks(out, env, args.notebooks)),
        ("planner", lambda: run_command("planner", [py, "benchmarks/planner_accuracy.py", "--grid", "cuda", "--out",
                                                    str(out / "planner_accuracy.json"), "--label", label],
                                        env, 1200, out / "logs" / "planner_accuracy.log")),
        ("costs", lambda: run_command("costs", [py, "benchmarks/technique_costs.py", "--model", "gpt2-small", "--batch", "4",
                                                "--seq", "512", "--rounds", "5", "--out",
                                                str(out / costs_file_name(emulate, torch.cuda.get_device_capability(0)))],
                                      env, 1200, out / "logs" / "technique_costs.log")),
    ]
    steps: list[StepResult] = []
    for name, run in plan:
        if name in args.skip:
            steps.append(StepResult(name, "skipped", 0.0, "--skip"))
            continue
        result = run()
        steps.extend(result if isinstance(result, list) else [result])
        print(f"  {name}: " + ", ".join(f"{s.step} {s.status}" for s in (result if isinstance(result, list) else [result])), flush=True)
    write_outputs(out, label, info, steps)
    print()
    print(summary_table(label, steps))
    print(f"\nwrote {out / 'results.json'}, {out / 'claims.md'}, {out / 'env.json'}")
    return 1 if any(s.status == "failed" for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
