"""How far the analytic estimate (`estimate.training_step_bytes`, the planner's fallback) is from the trace.

    PYTHONPATH=. python benchmarks/estimate_accuracy.py

For each model x sequence x recipe of a modest grid, plans the step twice on the T4 target, with
method='analytic' and method='trace' (the trace is the reference: it matches measured CPU peaks to
about 1%, benchmarks/planner_accuracy.py), and records the relative error of the analytic peak and of
its activations. Writes benchmarks/results/estimate_accuracy.json, and the error band the planner
prints beside every analytic answer to colab_memopt/estimate_band.json.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from colab_memopt.techniques.architectures import small_config  # noqa: E402
from colab_memopt.core.fileio import write_json  # noqa: E402
from colab_memopt.planning.planner import plan  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "estimate_accuracy.json"
BAND = ROOT / "colab_memopt" / "planning" / "estimate_band.json"
FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gemma2", "gpt_neox")
RECIPES = {"fp32": {}, "checkpoint-full": {"checkpointing": "full"}, "checkpoint-selective": {"checkpointing": "selective"},
           "lora-8": {"lora_rank": 8}, "bf16-autocast": {"precision": "bf16-autocast"}}
WITHIN_PCT = 10.0


def grid() -> list[tuple[str, object, int]]:
    """(label, model, seq_len): small configs of transformers families, the reference model, one named model."""
    models = [(f"{f} (small config)", small_config(f), s) for f in FAMILIES for s in (128, 1024)]
    models += [("small (reference GPT)", "small", s) for s in (64, 128)]
    models += [("smollm2-135m", "smollm2-135m", s) for s in (512, 2048)]
    return models


def main() -> int:
    rows = []
    start = time.perf_counter()
    for label, model, seq in grid():
        for name, recipe in RECIPES.items():
            row = {"model": label, "seq_len": seq, "batch": 2, "recipe": name}
            try:
                a = plan(model, 2, seq_len=seq, recipe=recipe, method="analytic", find_max_batch=False)
                t = plan(model, 2, seq_len=seq, recipe=recipe, method="trace", find_max_batch=False)
            except Exception as exc:  # noqa: BLE001 - a recipe the model refuses (LoRA targets, ...): say so
                row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                rows.append(row)
                print(f"{label:28s} {seq:5d} {name:15s} skipped: {row['error'][:80]}", flush=True)
                continue
            row.update(analytic_bytes=a.peak_bytes, trace_bytes=t.peak_bytes,
                       rel_error_pct=100.0 * (a.peak_bytes - t.peak_bytes) / t.peak_bytes,
                       analytic_activations=a.by_category["activations"], trace_activations=t.by_category["activations"])
            rows.append(row)
            print(f"{label:28s} {seq:5d} {name:15s} analytic {a.peak_bytes / 2**20:9.1f} MiB trace {t.peak_bytes / 2**20:9.1f} MiB "
                  f"{row['rel_error_pct']:+7.1f}%", flush=True)
    done = [r for r in rows if "rel_error_pct" in r]
    errors = [r["rel_error_pct"] for r in done]
    within = sum(abs(e) <= WITHIN_PCT for e in errors)
    summary = {"cases": len(done), "within_10pct": within, "min_rel_error_pct": min(errors), "max_rel_error_pct": max(errors),
               "median_abs_rel_error_pct": sorted(abs(e) for e in errors)[len(errors) // 2]}
    print(f"\n{within} of {len(done)} within {WITHIN_PCT:.0f}%; error from {min(errors):+.1f}% to {max(errors):+.1f}%")
    previous = json.loads(OUT.read_text()).get("summary") if OUT.exists() else None  # the last run's, to show a change
    write_json(OUT, {"torch": torch.__version__, "target": "t4", "batch": 2, "recipes": RECIPES, "summary": summary,
                     "previous_summary": previous,
                     "seconds": time.perf_counter() - start, "rows": rows})
    write_json(BAND, {"source": "benchmarks/estimate_accuracy.py (analytic vs traced peak, T4 target, CPU fake tensors)",
                      **summary})
    print(f"wrote {OUT} and {BAND}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
