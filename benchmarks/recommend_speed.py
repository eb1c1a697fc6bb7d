"""How long `python -m colab_memopt recommend` takes for the named architectures, on this machine.

    python benchmarks/recommend_speed.py [--models qwen2.5-1.5b ...] [--seq 1024] [--target t4]

Runs the command line a user runs (`python -m colab_memopt recommend --model M --seq S --target t4
--json`), each in a fresh process (imports included, no trace cached), and records per model: the wall
time, the CPU time the process used (user + system: what a quiet machine would take as wall time on
one core, since the trace is single-threaded), the load average before and after (other processes on
the machine slow the wall time, not the CPU time), the recipe chosen, its mode, precision, frozen-base
dtype and how it was planned. This project's target: qwen2.5-1.5b at 1024 tokens under 15 s on 2 cores.
Writes benchmarks/results/recommend_speed.json with the machine named, and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from colab_memopt.core.fileio import write_json

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "recommend_speed.json"
MODELS = ["gpt2", "smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "llama-3.2-1b", "qwen2.5-1.5b", "smollm2-1.7b",
          "llama-3.2-3b", "llama-3.1-8b"]
TARGET_SECONDS = {("qwen2.5-1.5b", 1024): 15.0}


def machine() -> dict[str, object]:
    """Return what the timings were taken on: the CPU model, its cores, Python and torch."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def time_one(model: str, seq: int, target: str) -> dict[str, object]:
    """Run the command line once in a fresh process; return its times, load and answer."""
    cmd = [sys.executable, "-m", "colab_memopt", "recommend", "--model", model, "--seq", str(seq), "--target", target, "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    load_before = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row: dict[str, object] = {"model": model, "seq_len": seq, "target": target, "exit_code": run.returncode,
                              "wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
                              "load_before": [round(x, 2) for x in load_before],
                              "load_after": [round(x, 2) for x in os.getloadavg()]}
    try:
        out = json.loads(run.stdout)
    except json.JSONDecodeError:
        row["error"] = run.stderr[-500:]
        return row
    if "error" in out:
        row["error"] = out["error"]
        return row
    recipe = out["recipe"]
    row.update({"chosen": out["chosen"], "mode": out["mode"], "precision": recipe["precision"],
                "base_dtype": recipe.get("base_dtype"), "quantization": recipe["quantization"],
                "checkpointing": recipe["checkpointing"], "method": out["method"],
                "predicted_need_bytes": out["predicted_need_bytes"], "costs_table": out.get("costs", {}).get("table"),
                "plans": sum(1 for line in out["reasoning"] if line.startswith("planned "))})
    goal = TARGET_SECONDS.get((model, seq))
    if goal is not None:
        row["target_seconds"] = goal
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--target", default="t4")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for m in args.models:
        rows.append(time_one(m, args.seq, args.target))
        r = rows[-1]
        print(f"{m:14s} wall {r['wall_seconds']:6.1f} s  cpu {r['cpu_seconds']:6.1f} s  load {r['load_before'][0]:.1f}  "
              f"{r.get('chosen', r.get('error', ''))}", flush=True)
    data = {"machine": machine(), "command": "python -m colab_memopt recommend --model M --seq S --target T --json",
            "note": ("wall time includes the imports and whatever else ran on the machine (see the load averages); "
                     "cpu_seconds is what this process used"), "rows": rows, "seconds": round(time.perf_counter() - start, 1)}
    write_json(args.out, data)
    print(f"\nmachine: {data['machine']['cpu']}, {data['machine']['cores']} cores")
    print(f"{'model':14s} {'seq':>5s} {'wall s':>7s} {'cpu s':>6s} {'load':>5s}  {'mode':5s} {'precision':14s} base  chosen")
    for r in rows:
        print(f"{r['model']:14s} {r['seq_len']:5d} {r['wall_seconds']:7.1f} {r['cpu_seconds']:6.1f} {r['load_before'][0]:5.1f}  "
              f"{r.get('mode', '-'):5s} {str(r.get('precision', '-')):14s} {str(r.get('base_dtype')):5s} "
              f"{r.get('chosen', r.get('error', ''))}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
