"""plan_trainer against the step peak a real TRL SFTTrainer reaches on the CPU: every family x optim.

    python benchmarks/trainer_accuracy.py [--out benchmarks/results/trainer_accuracy.json]

Three transformers families (Llama, Qwen2, Mistral; small random configs, nothing downloaded), LoRA rank 4
with dropout 0.05, gradient checkpointing, four optims (`adamw_torch`, `adamw_torch_fused`, `adamw_8bit`,
`adafactor`): 12 real Trainer runs of two steps, each planned first by `colab_memopt.planning.trainer.plan_trainer`
and then measured by `MemoryProfiler`'s callback. The bar is 1% of the measured peak. `make test` runs four
of these cases (tests/test_trainer.py, which also holds the models and the Trainer this script builds).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "trainer_accuracy.json"
TOLERANCE_PCT = 1.0


def _test_module():
    spec = importlib.util.spec_from_file_location("test_trainer", ROOT / "tests" / "test_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    tt = _test_module()
    rows = []
    for family in sorted(tt.FAMILIES):
        for optim in tt.OPTIMS:
            start = time.perf_counter()
            planned, measured = tt.planned_and_measured(family, optim)
            error_pct = 100 * (planned - measured) / measured
            rows.append({"family": family, "optim": optim, "planned_bytes": planned, "measured_bytes": measured,
                         "error_pct": error_pct, "ok": abs(error_pct) <= TOLERANCE_PCT,
                         "seconds": time.perf_counter() - start})
            print(f"{family:8s} {optim:18s} planned {planned:>10,d} B  measured {measured:>10,d} B  "
                  f"{error_pct:+.3f}%  {'ok' if rows[-1]['ok'] else 'OFF'}", flush=True)
    out = {"device": "cpu", "torch": torch.__version__, "machine": platform.machine(), "tolerance_pct": TOLERANCE_PCT,
           "rows": rows, "worst_abs_error_pct": max(abs(r["error_pct"]) for r in rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"worst |error| {out['worst_abs_error_pct']:.3f}% over {len(rows)} cases; wrote {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
