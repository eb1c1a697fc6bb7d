"""How long `cm.fit_trainer` takes to find the fit of the common T4 case, on this machine, and whether its applied
settings plan to fit.

    OMP_NUM_THREADS=2 python benchmarks/fit_speed.py [--model llama-3.2-3b] [--batch 4] [--max-length 1024]

The case (issue 35): LoRA `all-linear` through TRL's SFTTrainer given a model id (TRL loads it in fp32), batch 4 x
1024 tokens, on a free Colab T4:

    args = SFTConfig(per_device_train_batch_size=4, max_length=1024)
    fit = cm.fit_trainer(args, model="llama-3.2-3b", lora=LoraConfig(target_modules="all-linear"), target="t4")
    fitted = fit.apply(args)

On a machine without a GPU, `SFTConfig()` refuses its default bf16=True unless `use_cpu=True` is given: the case is
run with it (the plan is for the T4 whatever the machine). Runs in a fresh process (imports timed apart) and records
the seconds fit_trainer took (wall, and CPU: about what a quiet machine takes), the CPU seconds of the process, the
load averages before and after (other processes slow the wall time), the plans it made and skipped, its changes, and
the need of the applied settings planned again. Target: the fit found in 60 s or less on 2 cores. Writes
benchmarks/results/fit_speed.json, and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "fit_speed.json"
TARGET_SECONDS = 60.0


def worker(model: str, batch: int, max_length: int) -> dict[str, object]:
    """Run the case in this process; return its figures."""
    import warnings

    warnings.simplefilter("ignore")
    start = time.perf_counter()
    from peft import LoraConfig
    from trl import SFTConfig

    import colab_memopt as cm

    imported, cpu = time.perf_counter(), time.process_time()
    args = SFTConfig(output_dir="/tmp/fit_speed", per_device_train_batch_size=batch, max_length=max_length,
                     use_cpu=True, report_to=[])
    fit = cm.fit_trainer(args, model=model, lora=LoraConfig(target_modules="all-linear"), target="t4")
    found, fit_cpu = time.perf_counter(), time.process_time() - cpu
    row: dict[str, object] = {
        "model": model, "per_device_train_batch_size": batch, "max_length": max_length, "target": "t4",
        "import_seconds": round(imported - start, 2), "fit_seconds": round(found - imported, 2),
        "fit_cpu_seconds": round(fit_cpu, 2),  # this process's CPU time for the fit: about a quiet machine's wall time
        "fits": fit.fits, "plans": 1 + len(fit.tried), "skipped": fit.skipped,
        "before_need_gib": round(fit.before.device_need_bytes / 2**30, 2),
        "limit_gib": round(fit.before.device_limit_bytes / 2**30, 2),
        "changes": {k: v for k, v in fit.changes.items()}, "printout": str(fit).splitlines(),
    }
    if fit.fits:
        fitted = fit.apply(args)
        again = cm.plan_trainer(fitted.args, model=model, lora=fitted.lora, bnb=fitted.bnb, target="t4")
        row.update(after_need_gib=round(fit.after.device_need_bytes / 2**30, 2), applied_fits=again.fits,
                   applied_need_gib=round(again.device_need_bytes / 2**30, 2),
                   applied_dtype=str(fitted.dtype), applied_bnb=fitted.bnb is not None)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-3b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        print(json.dumps(worker(opts.model, opts.batch, opts.max_length)))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, __file__, "--worker", "--model", opts.model, "--batch", str(opts.batch),
           "--max-length", str(opts.max_length)]
    load_before = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
        return run.returncode
    row = json.loads(run.stdout.strip().splitlines()[-1])
    import torch

    result = {
        "machine": {"cores": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "torch": torch.__version__, "device": "this CPU (no GPU: the plan is for a T4)"},
        "target_fit_seconds": TARGET_SECONDS,
        "cpu_seconds": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        **row,
        "within_target": bool(row["fits"]) and float(row["fit_seconds"]) <= TARGET_SECONDS,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
