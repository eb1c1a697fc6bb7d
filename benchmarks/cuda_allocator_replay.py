"""Record what CUDA's caching allocator did in one Trainer step, to check an allocator model against (needs a GPU).

A plan counts the bytes its tensors ask for. CUDA's allocator counts the blocks it hands out: a block is cut from a
cached segment, and when the part left over is small (1 MiB or less in the large pool) the whole block is handed out
and counted. The first CUDA runs measured that difference at 1.3-1.4% of full fine-tuning's peak
(`results/cuda/h200-emulating-t4-2026-11-28-run3/README.md`). To model it, one needs what the allocator held when
the step began and every allocation and free inside the step, in order. This writes both, for the Trainer classes of
tests/gpu/test_trainer_classes_cuda.py:

    python benchmarks/cuda_allocator_replay.py --out build/gpu/allocator_replay.json.gz [--cases full lora_fp16_ckpt]

Per case: the segments and blocks at the start of the measured step (address, size, requested size, state), the
step's allocator events (action, address, size, stream), the allocated and requested peaks and currents from
`torch.cuda.memory_stats`, and the segments and blocks at its end (for checking a replay). Under `CM_EMULATE=t4` (the
default here) the GPU is capped and configured as `env.apply_emulation` does. With `--history` the events start
before the model's load instead (`history_start`: the blocks held then), and an allocation of STEP_MARK + n bytes,
freed at once, marks where step n begins.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]


def _segments(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"address": s["address"], "total_size": s["total_size"], "stream": s["stream"],
             "segment_type": s["segment_type"],
             "blocks": [[b["address"], b["size"], b.get("requested_size", 0), b["state"]] for b in s["blocks"]]}
            for s in snapshot["segments"]]


def _stats() -> dict[str, int]:
    s = torch.cuda.memory_stats()
    return {k: s[k] for k in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "requested_bytes.all.current",
                              "requested_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.all.peak",
                              "num_alloc_retries")}


STEP_MARK = 1000  # --history: an allocation of STEP_MARK + n bytes (freed at once) marks where step n begins


def run_case(klass: str, folder: str, out_dir: str, history: bool = False) -> dict[str, Any]:
    from test_trainer_classes_cuda import MAX_STEPS, SEQ, _cublas_workspaces_made, _settings, loaded
    from transformers import Trainer, TrainerCallback, default_data_collator

    import colab_memopt as cm

    s = _settings(klass, out_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = cm.plan_trainer(s["args"], model=folder, lora=s["lora"], bnb=s["bnb"], dtype=s["dtype"], target="t4",
                               seq_len=SEQ, prepare_model_for_kbit_training=s["prepare"])
    _cublas_workspaces_made(torch.device("cuda"))
    gc.collect()
    torch.cuda.empty_cache()
    baseline = _stats()
    seen: dict[str, Any] = {}
    if history:  # from before the load: every block the run makes, loading and each step, in order
        seen.update(history_start=_segments(torch.cuda.memory._snapshot()))
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=2_000_000)
    model = loaded(folder, s)
    rows = [{"input_ids": torch.ones(SEQ, dtype=torch.long), "labels": torch.ones(SEQ, dtype=torch.long)}] * 4

    class Record(TrainerCallback):
        trainer: Any = None

        def on_step_begin(self, args, state, control, **kw):
            if history and "step" not in seen:
                torch.empty(STEP_MARK + state.global_step + 1, dtype=torch.uint8, device="cuda")  # freed at once
            if "step" not in seen and len(self.trainer.optimizer.state) > 0:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                seen.update(step=state.global_step + 1, start_stats=_stats(),
                            start=_segments(torch.cuda.memory._snapshot()))
                if not history:
                    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                             max_entries=1_000_000)

        def on_step_end(self, args, state, control, **kw):
            if "step" in seen and "end" not in seen:
                torch.cuda.synchronize()
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                seen.update(end_stats=_stats(), end=_segments(snap),
                            events=[[e["action"], e["addr"], e["size"], e["stream"]]
                                    for trace in snap.get("device_traces", []) for e in trace])
                control.should_training_stop = True

    record = Record()
    trainer = Trainer(model=model, args=s["args"], train_dataset=rows, data_collator=default_data_collator,
                      callbacks=[record])
    record.trainer = trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    workspaces = sum(c.bytes for c in plan.device_costs if c.name.startswith("cuBLAS"))
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    seen.update(klass=klass, baseline=baseline, plan_bytes=plan.allocator_peak_bytes - workspaces,
                max_steps=MAX_STEPS)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/gpu/allocator_replay.json.gz")
    parser.add_argument("--cases", nargs="+", default=["full", "lora_fp16_ckpt"])
    parser.add_argument("--history", action="store_true",
                        help="record from before the model's load (its blocks, then each step's, marked)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_allocator_replay: no CUDA GPU here; nothing measured")
        return 2
    from test_trainer_classes_cuda import SHAPE
    from transformers import AutoModelForCausalLM, LlamaConfig

    from colab_memopt.core.env import apply_emulation

    apply_emulation("cuda")
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "smollm2_360m_shape"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE)).to(torch.float16).save_pretrained(folder)
    cases = []
    for klass in args.cases:
        t0 = time.perf_counter()
        case = run_case(klass, str(folder), str(folder / f"out_{klass}"), args.history)
        case["seconds"] = round(time.perf_counter() - t0, 1)
        peak = case["end_stats"]["allocated_bytes.all.peak"] - case["baseline"]["allocated_bytes.all.current"]
        print(f"{klass}: step {case['step']}, {len(case['events']):,d} events, allocated peak {peak:,d}, "
              f"plan {case['plan_bytes']:,d}, {case['seconds']} s", flush=True)
        cases.append(case)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "emulate": os.environ.get("CM_EMULATE"), "cases": cases}, f)
    print(f"wrote {out} ({out.stat().st_size:,d} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
