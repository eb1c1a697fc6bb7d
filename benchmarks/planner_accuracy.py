"""How far is the planner from measurement? Predicted vs measured peak over a grid of configurations.

    python benchmarks/planner_accuracy.py [--quick]
    python benchmarks/planner_accuracy.py --grid architectures [--quick]

Writes benchmarks/results/planner_accuracy.json: one row per configuration (predicted, measured,
relative error, device), the time and memory of planning a ~1B-parameter model, and the worst error,
which is printed last. On CUDA the measurement is torch.cuda.max_memory_allocated.
Targets: CPU within 1% everywhere; CUDA within 5%; a ~1B plan under 20 s and 1 GB of RAM.

`--grid architectures` is the second grid (issue 19): six transformers families beyond our named
models, built from small configs (`architectures.small_config`), odd batches, sequences up to 2048,
with and without full checkpointing, LoRA on the family's layers and 8-bit optimizer state; it
writes benchmarks/results/planner_accuracy_architectures.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import colab_memopt as cm
from colab_memopt import planner

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
ARCH_OUT = Path(__file__).resolve().parent / "results" / "planner_accuracy_architectures.json"
ARCH_GRID = {
    "family": ["llama", "qwen2", "mistral", "phi3", "gemma2", "gpt_neox"],
    "batch": [1, 3, 5],
    "seq_len": [128, 1024, 2048],
    "recipe": [{}, {"checkpointing": "full"}, {"lora_rank": 4}, {"optimizer": "adamw8bit"}],
}
ARCH_QUICK = {**ARCH_GRID, "batch": [3], "seq_len": [128, 2048]}

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


def architecture_grid(grid: dict, device: torch.device, corpus: cm.TextCorpus, target: object) -> list[dict]:
    """Return one row per (family, batch, seq_len, recipe): the trace against the measured step."""
    from colab_memopt.architectures import resolve_model, small_config
    from colab_memopt.presets import LORA_TARGETS_BY_FAMILY

    rows = []
    for family, batch, seq_len, fields in itertools.product(*grid.values()):
        spec = resolve_model(small_config(family))
        if fields.get("lora_rank"):
            fields = {**fields, "lora_targets": LORA_TARGETS_BY_FAMILY[family]}
        recipe = cm.Recipe.from_dict(fields)
        start = time.perf_counter()
        predicted = planner.plan(spec.build, batch, seq_len=seq_len, recipe=recipe, target=target, find_max_batch=False)
        plan_seconds = time.perf_counter() - start
        model, opt = recipe.build(spec.build().to(device))
        step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq_len, recipe=recipe)
        measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1).peak_bytes
        error = 100.0 * (predicted.peak_bytes - measured) / measured
        shown = {k: v for k, v in fields.items() if k != "lora_targets"}
        rows.append({"family": family, "batch": batch, "seq_len": seq_len, "recipe": shown, "method": predicted.method,
                     "predicted_bytes": predicted.peak_bytes, "measured_bytes": measured, "rel_error_pct": error,
                     "plan_seconds": plan_seconds})
        print(f"{family:9s} b={batch} s={seq_len:<5d} {str(shown):28s} predicted {cm.format_bytes(predicted.peak_bytes):>11s} "
              f"measured {cm.format_bytes(measured):>11s} error {error:+.3f}%", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--grid", choices=["reference", "architectures"], default="reference",
                        help="reference: our models (default); architectures: six transformers families")
    args = parser.parse_args()
    if args.grid == "architectures":
        device = cm.pick_device("auto")
        target = "t4" if device.type == "cuda" else {"name": "cpu", "device_bytes": 2**40, "host_bytes": 2**40, "cuda": False}
        rows = architecture_grid(ARCH_QUICK if args.quick else ARCH_GRID, device, cm.load_corpus(), target)
        worst = max(rows, key=lambda r: abs(r["rel_error_pct"]))
        device_name = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f"cpu ({platform.machine()})"
        result = {"device": device_name, "torch": torch.__version__, "grid": "quick" if args.quick else "full", "rows": rows,
                  "worst_rel_error_pct": worst["rel_error_pct"], "target_rel_error_pct": 5.0 if device.type == "cuda" else 1.0}
        ARCH_OUT.parent.mkdir(parents=True, exist_ok=True)
        ARCH_OUT.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {ARCH_OUT}\nworst relative error over {len(rows)} configurations on {device_name}: "
              f"{worst['rel_error_pct']:+.3f}% ({worst['family']}, batch {worst['batch']}, seq {worst['seq_len']}, {worst['recipe']})")
        return
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
    OUT.write_text(json.dumps(result, indent=2) + "\n")
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
