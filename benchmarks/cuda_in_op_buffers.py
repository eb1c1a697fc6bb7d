"""Where a step's CUDA peak falls, and which operations hold memory inside themselves (needs a CUDA GPU).

A plan counts tensors. CUDA's caching allocator also holds what an operation allocates and frees inside itself (a
kernel's workspace, a copy made for cuBLAS, SDPA's math softmax buffer), which no tensor tracker on the CPU sees. This
runs one training step per case under a dispatch mode that reads the allocator around every aten operation, forward,
backward and optimizer step: bytes allocated before it, the allocator's peak while it ran, and bytes allocated after.
What an operation held inside itself is its peak less the larger of before and after.

For each case it writes the step's peak (which operation, in which phase, with how much allocated before it), the
operations that held the most inside themselves, the same grouped by operation, and the plan of the same run:

    python benchmarks/cuda_in_op_buffers.py --out build/gpu/in_op_buffers.json [--cases llama_gqa_fp32 qlora_ckpt ...]

Cases: the grouped-query Llama of tests/gpu/test_attention_cuda.py (fp32, 4 x 512, SDPA's math kernel), the Trainer
classes of tests/gpu/test_trainer_classes_cuda.py, and the planner grid's `medium` model at 8 x 256 in fp16 autocast.
Under `CM_EMULATE=t4` (the default here) the GPU is capped and configured as `env.apply_emulation` does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]

import colab_memopt as cm  # noqa: E402
from colab_memopt import env  # noqa: E402

CASES = ("llama_gqa_fp32", "qlora_ckpt", "medium_fp16", "lora_fp16_ckpt", "qlora_nockpt", "full")


class OpMemory(TorchDispatchMode):
    """Read the CUDA allocator around every aten operation: (op, phase, allocated before, peak during, after, out)."""

    def __init__(self, baseline: int) -> None:
        super().__init__()
        self.baseline = baseline
        self.rows: list[tuple[str, str, int, int, int, int]] = []
        self.requested_peak = 0  # bytes requested (before the allocator's rounding) at their highest, less the baseline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        stats = torch.cuda.memory_stats()
        peak, after = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        self.requested_peak = max(self.requested_peak, stats["requested_bytes.all.peak"] - self.baseline)
        out_bytes = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor) and t.device.type == "cuda")
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward/optimizer"
        b = self.baseline
        self.rows.append((str(func), phase, before - b, peak - b, after - b, out_bytes))
        return out


def summarize(rows: list[tuple[str, str, int, int, int, int]], top: int = 15) -> dict[str, Any]:
    """Return the step's peak and its operation, the largest inside buffers, and the same grouped by operation."""
    peak_index = max(range(len(rows)), key=lambda i: rows[i][3])
    op, phase, before, peak, after, out_bytes = rows[peak_index]
    inside = [(max(0, r[3] - max(r[2], r[4])), i) for i, r in enumerate(rows)]
    largest = sorted(inside, reverse=True)[:top]
    by_op: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "max_inside_bytes": 0, "calls_with_inside": 0})
    for nbytes, i in inside:
        entry = by_op[rows[i][0]]
        entry["calls"] += 1
        if nbytes > 0:
            entry["calls_with_inside"] += 1
            entry["max_inside_bytes"] = max(entry["max_inside_bytes"], nbytes)
    return {
        "operations": len(rows),
        "peak_bytes": peak,
        "peak_op": {"index": peak_index, "op": op, "phase": phase, "allocated_before": before, "peak": peak,
                    "allocated_after": after, "output_bytes": out_bytes, "inside_bytes": peak - max(before, after)},
        "context": [{"index": i, "op": rows[i][0], "phase": rows[i][1], "before": rows[i][2], "peak": rows[i][3]}
                    for i in range(max(0, peak_index - 6), min(len(rows), peak_index + 3))],
        "largest_inside": [{"index": i, "op": rows[i][0], "phase": rows[i][1], "inside_bytes": n, "allocated_before": rows[i][2],
                            "output_bytes": rows[i][5], "share_of_step_peak": round(rows[i][3] / max(peak, 1), 4)} for n, i in largest],
        "by_op": dict(sorted(((k, v) for k, v in by_op.items() if v["max_inside_bytes"]),
                             key=lambda kv: -kv[1]["max_inside_bytes"])[:top]),
    }


def _plan_fields(plan: Any) -> dict[str, Any]:
    return {"peak_bytes": plan.peak_bytes, "step_peak_bytes": plan.step_peak_bytes,
            "allocator_peak_bytes": plan.allocator_peak_bytes, "by_category": plan.by_category,
            "device_costs": {c.name: c.bytes for c in plan.device_costs}}


def llama_gqa_fp32() -> dict[str, Any]:
    """The grouped-query Llama of tests/gpu/test_attention_cuda.py: fp32, 4 x 512, no mask (SDPA's math kernel)."""
    import transformers

    from colab_memopt.planning import planner
    from colab_memopt.techniques import architectures

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(architectures.small_config("llama"))

    plan = planner.plan(llama, 4, seq_len=512, target="t4", find_max_batch=False)
    return _run_step(lambda: llama().to("cuda"), cm.Recipe.from_dict({}), 4, 512, plan)


def medium_fp16() -> dict[str, Any]:
    """The planner grid's `medium` model at 8 x 256 in fp16 autocast (its row was -5.2% on 2026-11-28)."""
    from colab_memopt.planning import planner

    recipe = cm.Recipe.from_dict({"precision": "fp16-autocast"})
    plan = planner.plan(lambda: cm.build_model("medium"), 8, seq_len=256, recipe=recipe, target="t4", find_max_batch=False)
    return _run_step(lambda: cm.build_model("medium", device=torch.device("cuda")), recipe, 8, 256, plan)


def _run_step(factory: Any, recipe: Any, batch: int, seq: int, plan: Any) -> dict[str, Any]:
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    model, opt = recipe.build(factory())
    step = cm.make_train_step(model, opt, cm.load_corpus(), batch_size=batch, seq_len=seq, recipe=recipe)
    step()  # the warm-up: gradients and the optimizer's state, as the measured step begins with them
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    mode = OpMemory(baseline)
    with mode:
        step()
    torch.cuda.synchronize()
    out = {"plan": _plan_fields(plan), "measured": summarize(mode.rows), "requested_peak": mode.requested_peak}
    del model, opt, step, mode
    gc.collect()
    torch.cuda.empty_cache()
    return out


def trainer_class(klass: str) -> dict[str, Any]:
    """One Trainer class of tests/gpu/test_trainer_classes_cuda.py, its first step that begins with AdamW's state."""
    import tempfile

    from datasets import Dataset
    from peft import get_peft_model, prepare_model_for_kbit_training
    from test_trainer_classes_cuda import SEQ, SHAPE, _settings
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, default_data_collator

    tmp = tempfile.mkdtemp()
    folder = os.path.join(tmp, "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE)).to(torch.float16).save_pretrained(folder)
    s = _settings(klass, os.path.join(tmp, "out"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = cm.plan_trainer(s["args"], model=folder, lora=s["lora"], bnb=s["bnb"], dtype=s["dtype"], target="t4",
                               seq_len=SEQ, prepare_model_for_kbit_training=s["prepare"])
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=s["dtype"], quantization_config=s["bnb"], device_map={"": 0})
        if s["prepare"]:
            model = prepare_model_for_kbit_training(model)
        if s["lora"] is not None:
            model = get_peft_model(model, s["lora"])
    data = Dataset.from_dict({"input_ids": [[1] * SEQ] * 4, "labels": [[1] * SEQ] * 4})
    mode = OpMemory(baseline)
    seen: dict[str, Any] = {}

    class Measure(TrainerCallback):
        trainer: Any = None

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            if "step" not in seen and len(self.trainer.optimizer.state) > 0:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                seen["step"] = state.global_step + 1
                mode.__enter__()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            if "step" in seen and "done" not in seen:
                mode.__exit__(None, None, None)
                torch.cuda.synchronize()
                seen["done"] = True
                control.should_training_stop = True

    measure = Measure()
    trainer = Trainer(model=model, args=s["args"], train_dataset=data, data_collator=default_data_collator, callbacks=[measure])
    measure.trainer = trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    out = {"plan": _plan_fields(plan), "measured_step": seen.get("step"), "requested_peak": mode.requested_peak,
           "measured": summarize(mode.rows) if mode.rows else None}
    del trainer, model, mode
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build/gpu/in_op_buffers.json")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it reads CUDA's allocator around every operation")
    env.apply_emulation("cuda", os.environ.get("CM_EMULATE", "t4"))
    result: dict[str, Any] = {"device": env.device_label("cuda"), "torch": torch.__version__, "cases": {}}
    for case in args.cases:
        start = time.perf_counter()
        try:
            result["cases"][case] = globals()[case]() if case in ("llama_gqa_fp32", "medium_fp16") else trainer_class(case)
        except Exception as exc:  # noqa: BLE001 - one case's failure is recorded, the others still run
            result["cases"][case] = {"error": f"{type(exc).__name__}: {exc}"}
        result["cases"][case]["seconds"] = round(time.perf_counter() - start, 1)
        c = result["cases"][case]
        m = c.get("measured") or {}
        print(f"{case}: {c['seconds']} s; measured peak {m.get('peak_bytes')} at {m.get('peak_op', {}).get('op')} "
              f"({m.get('peak_op', {}).get('phase')}); plan {c.get('plan', {}).get('allocator_peak_bytes')}; "
              f"{c.get('error', '')}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
