"""How far is the planner from measurement? Predicted vs measured peak over a grid of configurations.

    python benchmarks/planner_accuracy.py [--quick]

Writes benchmarks/results/planner_accuracy.json: one row per configuration (predicted, measured,
relative error, device), the time and memory of planning a ~1B-parameter model, and the worst error,
which is printed last. On CUDA the measurement is torch.cuda.max_memory_allocated.
Targets: CPU within 1% everywhere; CUDA within 5%; a ~1B plan under 20 s and 1 GB of RAM.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import colab_memopt as cm
from colab_memopt import planner
from colab_memopt.fileio import write_json

OUT = Path(__file__).resolve().parent / "results" / "planner_accuracy.json"

GRID = {
    "size": ["tiny", "small", "medium"],
    "batch": [2, 8],
    "seq_len": [32, 128],
    "recipe": [
        {}, {"optimizer": "sgd"}, {"attention": "naive"}, {"precision": "bf16-autocast"}, {"checkpointing": "full"},
        {"accumulation_steps": 2}, {"lora_rank": 4}, {"optimizer": "adamw8bit"},
    ],
}
QUICK = {"size": ["tiny", "small"], "batch": [1, 4], "seq_len": [32], "recipe": [{}, {"attention": "naive"}]}

# The child's own peak RSS: VmHWM starts afresh at exec, while ru_maxrss keeps the parent's peak.
PLAN_1B = """
import re, time, warnings
warnings.simplefilter("ignore")
from colab_memopt.planner import plan
start = time.perf_counter()
p = plan("1b", 1, seq_len=2048, target="t4")
seconds = time.perf_counter() - start
hwm_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(seconds, hwm_kib * 1024, p.method, p.max_batch)
"""


def measure(size: str, batch: int, seq_len: int, recipe: cm.Recipe, device: torch.device, corpus: cm.TextCorpus) -> int:
    model, opt = recipe.build(cm.build_model(size, device=device))
    step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq_len, recipe=recipe)
    return cm.measure_step(step, model=model, optimizer=opt, repeat=1).peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    args = parser.parse_args()
    device = cm.pick_device("auto")
    corpus = cm.load_corpus()
    target = "t4" if device.type == "cuda" else {"name": "cpu", "device_bytes": 2**40, "host_bytes": 2**40, "cuda": False}
    grid = QUICK if args.quick else GRID
    rows = []
    for size, batch, seq_len, fields in itertools.product(*grid.values()):
        seq_len = min(seq_len, cm.get_config(size).seq_len)
        recipe = cm.Recipe.from_dict(fields)
        predicted = planner.plan(lambda s=size: cm.build_model(s), batch, seq_len=seq_len, recipe=recipe, target=target, find_max_batch=False)
        measured = measure(size, batch, seq_len, recipe, device, corpus)
        error = 100.0 * (predicted.peak_bytes - measured) / measured
        rows.append({
            "size": size, "batch": batch, "seq_len": seq_len, "recipe": fields, "method": predicted.method,
            "predicted_bytes": predicted.peak_bytes, "measured_bytes": measured, "rel_error_pct": error,
        })
        print(f"{size:7s} b={batch:<2d} s={seq_len:<4d} {str(fields):28s} predicted {cm.format_bytes(predicted.peak_bytes):>11s} "
              f"measured {cm.format_bytes(measured):>11s} error {error:+.3f}%")

    out = subprocess.run([sys.executable, "-c", PLAN_1B], capture_output=True, text=True, check=True).stdout.split()
    plan_1b = {"model": "1b", "params": cm.get_config("1b").n_params, "batch": 1, "seq_len": 2048,
               "seconds": float(out[0]), "max_rss_bytes": int(out[1]), "method": out[2], "max_batch": int(out[3])}
    worst = max(rows, key=lambda r: abs(r["rel_error_pct"]))
    worst_by_method = {
        method: max(abs(r["rel_error_pct"]) for r in rows if r["method"] == method)
        for method in sorted({r["method"] for r in rows})
    }
    device_name = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f"cpu ({platform.machine()})"
    result = {
        "device": device_name, "torch": torch.__version__, "rows": rows, "plan_1b": plan_1b,
        "worst_rel_error_pct": worst["rel_error_pct"], "worst_abs_error_pct_by_method": worst_by_method,
        "target_rel_error_pct": 5.0 if device.type == "cuda" else 1.0,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    write_json(OUT, result)
    print(f"\nplanning the 1B model ({plan_1b['params'] / 1e9:.2f}B params, batch 1 x 2048): {plan_1b['seconds']:.1f} s, "
          f"{cm.format_bytes(plan_1b['max_rss_bytes'])} peak RSS, method {plan_1b['method']}")
    print(f"wrote {OUT}")
    for method, err in worst_by_method.items():
        n = sum(r["method"] == method for r in rows)
        print(f"  {method:8s}: {n} configurations, worst |error| {err:.3f}%")
    print(f"worst relative error over {len(rows)} configurations on {device_name}: {worst['rel_error_pct']:+.3f}% "
          f"({worst['size']}, batch {worst['batch']}, seq {worst['seq_len']}, {worst['recipe']}); target {result['target_rel_error_pct']}%")


if __name__ == "__main__":
    main()
