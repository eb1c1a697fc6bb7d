"""The first CUDA run's Trainer classes, plan against CUDA's allocator (issue 41, item 3; cuda_classes.md's GPU check).

One small shape (a random Llama of SmolLM2-360M's shape, 2 x 512 tokens, LoRA r=16 on every linear, fp16 with the
GradScaler): each class is planned from its settings before anything is loaded, then run on the device until the
first step that begins with the optimizer's state has run (at most `MAX_STEPS`). That step is measured from its start
(`reset_peak_memory_stats`), with the allocator's memory history recorded; printed per class: the plan
(`allocator_peak_bytes` less the cuBLAS workspaces, which are made before the baseline: `_cublas_workspaces_made`), the
allocated peak, the requested peak (before the allocator's rounding), the plan's categories at its peak, and the
history's largest live blocks at the allocated peak. Asserted: the issue's goal, within +1.5% of the allocated peak and
never under it by more than 1%.

What the GPU said (benchmarks/results/cuda/h200-emulating-t4-2026-11-28-run2/FINDINGS.md): the checkpointed classes
were over-planned by the math-attention line, a 31.5 MB buffer added at the peak though CUDA holds it inside
softmax's backward, far from the peak (now counted where it lives: `tracker.in_op_bytes`); full fine-tuning's
allocated peak holds 1.3% more than the bytes requested (the allocator's block rounding), which no plan counts.
Run 3 (h200-emulating-t4-2026-11-28-run3/README.md): the checkpointed classes pass; full fine-tuning is +0.18% of the
requested peak and -1.25% of the allocated one. Its 76 MB of whole blocks appear at the first real update, when
AdamW's state lands on the blocks the step left free (benchmarks/cuda_allocator_model.py replays the run exactly).

Why not simply the second step: fp16's GradScaler skips the update of a step whose gradients overflow, and AdamW makes
its state at its first update. On 2026-11-28 (an NVIDIA H200 emulating a T4) the full class's second step peaked at
5,771,671,040 B against a plan of 8,665,486,848 (+50.1%), the plan less its optimizer state 5,770,736,128 (-0.016%):
that step had no AdamW state. It cannot have had it: parameters, their gradients and the state (4 x 1,447,301,120 B)
are more than that peak, and all three are live at any update. With every token 1, the tied head's fp16 weight gradient
has one row of sum over 1,022 tokens of the same hidden state: at most 3.06 x the loss scale in fp32 (this folder's
weights, on the CPU), past fp16's 65,504 at 65,536 and 32,768, so steps 1 and 2 were skipped; 16,384 fits.
"""

from __future__ import annotations

import gc
import os
import pickle
import warnings
from typing import Any

import pytest
import torch

SHAPE = dict(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
             num_key_value_heads=5, max_position_embeddings=2048, tie_word_embeddings=True)
BATCH, SEQ = 2, 512
MAX_STEPS = 6  # the full class's first update is its third step (loss scale 16,384): see the docstring
CLASSES = ("full", "qlora_ckpt", "lora_fp16_ckpt", "qlora_nockpt", "qlora_prepared")


def _settings(klass: str, out: str) -> dict[str, Any]:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, TrainingArguments

    ckpt = klass.endswith("ckpt") and not klass.endswith("nockpt") or klass == "qlora_prepared"
    args = TrainingArguments(output_dir=out, fp16=True, per_device_train_batch_size=BATCH, gradient_checkpointing=ckpt,
                             max_steps=MAX_STEPS, logging_strategy="no", save_strategy="no", report_to=[],
                             optim="adamw_torch", disable_tqdm=True)
    lora = None if klass == "full" else LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                                   task_type="CAUSAL_LM")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float16) if klass.startswith("qlora") else None
    return dict(args=args, lora=lora, bnb=bnb, dtype=torch.float32 if klass == "full" else torch.float16,
                prepare=klass == "qlora_prepared")


def loaded(folder: str, s: dict[str, Any]) -> Any:
    """Load a class's model on the GPU as its run does: the base in its dtype (4-bit where it is QLoRA), peft's
    prepare_model_for_kbit_training where the class uses it, then LoRA (benchmarks/cuda_allocator_replay.py too)."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=s["dtype"], quantization_config=s["bnb"],
                                                     device_map={"": 0})
        if s["prepare"]:
            model = prepare_model_for_kbit_training(model)
        if s["lora"] is not None:
            model = get_peft_model(model, s["lora"])
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("smollm2_360m_shape")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE)).to(torch.float16).save_pretrained(path)
    return str(path)


def _cublas_workspaces_made(device: torch.device) -> None:
    """Make the cuBLAS workspaces of this thread and of the autograd thread, and cuBLASLt's, before the baseline.

    Each is made once, at its first matmul, and kept. On 2026-11-28 (an NVIDIA H200 emulating a T4) the first class run
    made them inside its measured step and the later ones found them made (in their baseline): the same plan was
    18 MB nearer one measurement than the other. Made here, every class measures without them, and its plan's lines for
    them are taken out."""
    x = torch.randn(16, 64, device=device, requires_grad=True)
    layer = torch.nn.Linear(64, 64).to(device)  # addmm with a bias: cuBLASLt; its backward: the autograd thread's
    layer(x).sum().backward()
    torch.cuda.synchronize()


def _largest_live_blocks(snapshot: dict[str, Any], top: int = 12) -> list[tuple[int, str]]:
    """Return (bytes, top frame) of the largest blocks live at the end of the recorded trace's allocated peak."""
    live: dict[int, tuple[int, str]] = {}
    best: dict[int, tuple[int, str]] = {}
    now = peak = 0
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            frames = event.get("frames") or [{}]
            where = next((f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '')}"
                          for f in frames if "torch/" not in f.get("filename", "torch/")), "?")
            if event["action"] == "alloc":
                live[event["addr"]] = (event["size"], where)
                now += event["size"]
                if now > peak:
                    peak, best = now, dict(live)
            elif event["action"] in ("free_requested", "free_completed") and event["addr"] in live:
                now -= live.pop(event["addr"])[0]
    return sorted(best.values(), reverse=True)[:top]


@pytest.mark.parametrize("klass", CLASSES)
def test_each_trainer_class_is_planned_within_the_goal_of_cuda_s_allocator(cuda, folder, tmp_path, klass):
    pytest.importorskip("bitsandbytes")
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, default_data_collator

    import colab_memopt as cm

    s = _settings(klass, str(tmp_path / "out"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = cm.plan_trainer(s["args"], model=folder, lora=s["lora"], bnb=s["bnb"], dtype=s["dtype"], target="t4",
                               seq_len=SEQ, prepare_model_for_kbit_training=s["prepare"])
    _cublas_workspaces_made(cuda)
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()  # the workspaces are in it: the plan's lines for them are taken out below
    model = loaded(folder, s)
    data = Dataset.from_dict({"input_ids": [[1] * SEQ] * 4, "labels": [[1] * SEQ] * 4})
    seen: dict[str, Any] = {}

    class FirstStepWithOptimizerState(TrainerCallback):
        """Measure the first step that begins with the optimizer's state (what the plan holds), then stop."""

        trainer: Any = None

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            if "step" not in seen and len(self.trainer.optimizer.state) > 0:  # AdamW's state: made at its first update
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.memory._record_memory_history(max_entries=200000)
                seen["step"] = state.global_step + 1

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            if "step" in seen and "allocated" not in seen:
                torch.cuda.synchronize()
                stats = torch.cuda.memory_stats()
                seen.update(allocated=stats["allocated_bytes.all.peak"] - baseline,
                            requested=stats["requested_bytes.all.peak"] - baseline,
                            snapshot=torch.cuda.memory._snapshot())
                torch.cuda.memory._record_memory_history(enabled=None)
                control.should_training_stop = True

    measure = FirstStepWithOptimizerState()
    trainer = Trainer(model=model, args=s["args"], train_dataset=data, data_collator=default_data_collator,
                      callbacks=[measure])
    measure.trainer = trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert "allocated" in seen, (f"{klass}: none of {MAX_STEPS} steps began with the optimizer's state: fp16's "
                                 "GradScaler skipped every update (the gradients overflowed at each loss scale tried)")
    workspaces = sum(c.bytes for c in plan.device_costs if c.name.startswith("cuBLAS"))
    planned, allocated, requested = plan.allocator_peak_bytes - workspaces, seen["allocated"], seen["requested"]
    error = (planned - allocated) / allocated
    print(f"\n{klass}: plan {planned:,d}  allocated {allocated:,d}  requested {requested:,d}  "
          f"plan-allocated {error:+.2%}  measured step {seen['step']}  "
          f"peak phase {max(plan.by_phase, key=plan.by_phase.get)}")
    print(f"  plan at its peak: {plan.by_category}; device lines {[(c.name, c.bytes) for c in plan.device_costs]}")
    for nbytes, where in _largest_live_blocks(seen["snapshot"]):
        print(f"  live at the allocated peak: {nbytes:>14,d}  {where}")
    out = os.environ.get("CM_GPU_OUT")
    if out:  # the whole history, for a closer look
        with open(os.path.join(out, f"trainer_class_{klass}.pickle"), "wb") as f:
            pickle.dump(seen["snapshot"], f)
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    assert -0.01 <= error <= 0.015, (klass, planned, allocated, requested)
