"""MemoryGuardCallback: a real TrainerCallback class, fresh state per run, nothing left installed after an
exception, and the fp16 traps (TRL's bf16 QLoRA adapters, fp16 adapters) fixed before the first step."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import colab_memopt as cm  # noqa: E402
from colab_memopt import guard as cm_guard  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def char_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({**{chr(i): i for i in range(32, 127)}, "<pad>": 0, "<eos>": 1, "<unk>": 2},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sft(model=None, *, quantized_flag: bool = False, **changes) -> SFTTrainer:
    """A small SFTTrainer with LoRA on the CPU; `quantized_flag` marks the model as TRL sees a 4-bit one."""
    torch.manual_seed(0)
    model = model if model is not None else AutoModelForCausalLM.from_config(LlamaConfig(**DIMS))
    if quantized_flag:
        model.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets; TRL reads it
    values = dict(output_dir="/tmp/colab_memopt_test_guard", per_device_train_batch_size=2, max_length=48, max_steps=2,
                  logging_steps=1, optim="adamw_torch", report_to=[], save_strategy="no", use_cpu=True,
                  disable_tqdm=True, gradient_checkpointing=False)
    values.update(changes)
    data = Dataset.from_dict({"text": ["the quick brown fox jumps over the lazy dog " * 4] * 8})
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SFTTrainer(model=model, args=SFTConfig(**values), train_dataset=data, processing_class=char_tokenizer(),
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     task_type="CAUSAL_LM"))
    finally:
        logging.disable(logging.NOTSET)


def train(trainer: SFTTrainer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


def trainable_dtypes(trainer: SFTTrainer) -> set[torch.dtype]:
    return {p.dtype for p in trainer.model.parameters() if p.requires_grad}


def test_the_guard_is_a_trainer_callback_class_and_the_package_does_not_import_transformers():
    code = ("import sys, colab_memopt as cm; assert 'transformers' not in sys.modules, 'imported at package import'; "
            "from transformers import TrainerCallback; assert issubclass(cm.MemoryGuardCallback, TrainerCallback); "
            "import colab_memopt as fresh; assert callable(fresh.guard.upcast_trainable); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]

    class Mine(cm.MemoryGuardCallback):  # users can subclass it
        pass

    assert isinstance(Mine(target="cpu"), TrainerCallback) and cm.MemoryGuardCallback is cm_guard.MemoryGuardCallback


def test_a_reused_guard_reports_the_run_it_just_watched():
    guard = cm.MemoryGuardCallback(target="cpu", verbose=False)
    big = sft(per_device_train_batch_size=4, max_length=96)
    big.add_callback(guard)
    train(big)
    big_report = dict(guard.report)
    small = sft(per_device_train_batch_size=1, max_length=16)
    small.add_callback(guard)
    train(small)
    assert guard.report["measured_bytes"] < big_report["measured_bytes"], (guard.report, big_report)
    assert abs(guard.report["error_pct"]) < 1 and abs(big_report["error_pct"]) < 1, (guard.report, big_report)
    assert len(guard.peaks) == 2 and guard.memory_report().peak_bytes == guard.report["measured_bytes"]
    train(small)  # the same Trainer trained again: the same figures, not the earlier run's
    assert abs(guard.report["error_pct"]) < 1, guard.report


class Stop(TrainerCallback):
    def on_step_end(self, *args, **kwargs):
        raise RuntimeError("interrupted")


def test_an_exception_mid_run_leaves_no_counting_mode_installed():
    before = torch._C._len_torch_dispatch_stack()
    trainer = sft(max_steps=4)
    trainer.add_callback(Stop())  # runs before the guard's on_step_end
    guard = cm.MemoryGuardCallback(target="cpu", verbose=False)
    trainer.add_callback(guard)
    with pytest.raises(RuntimeError, match="interrupted"):
        train(trainer)
    assert torch._C._len_torch_dispatch_stack() == before
    # an exception inside the step itself (a bad batch): the counter is popped as it propagates
    broken = sft(max_steps=4)
    guard2 = cm.MemoryGuardCallback(target="cpu", verbose=False)
    broken.add_callback(guard2)
    real_compute_loss = broken.compute_loss

    def compute_loss(*args, **kwargs):
        assert torch._C._len_torch_dispatch_stack() > before  # counting inside the step
        raise ValueError("bad batch")

    broken.compute_loss = compute_loss
    with pytest.raises(ValueError, match="bad batch"):
        train(broken)
    assert torch._C._len_torch_dispatch_stack() == before
    broken.compute_loss = real_compute_loss
    train(broken)  # the same guard runs again after the failure
    assert torch._C._len_torch_dispatch_stack() == before and abs(guard2.report["error_pct"]) < 1, guard2.report


def test_trl_bf16_adapters_under_fp16_are_cast_to_fp32_before_the_first_step(capsys):
    """TRL 1.16 casts a quantized model's trainable weights to bf16 whatever fp16 says (trl#4901); on CUDA fp16's
    GradScaler then fails. The precondition on the CPU: the adapters are bf16 after SFTTrainer(...)."""
    trainer = sft(quantized_flag=True, fp16=True)
    assert trainable_dtypes(trainer) == {torch.bfloat16}  # TRL's cast: the trap is set
    guard = cm.MemoryGuardCallback(target="cpu")
    trainer.add_callback(guard)
    train(trainer)
    assert trainable_dtypes(trainer) == {torch.float32}
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "float32" in x)
    assert "fp16=True" in line and "bfloat16" in line and len(line) <= 100, line
    assert len(guard.upcast) == 8 and guard.report["upcast_to_fp32"]  # 2 layers x q, v x A, B
    assert abs(guard.report["error_pct"]) < 1, guard.report  # planned and measured with the fp32 adapters


def test_fp16_adapters_under_fp16_are_cast_or_refused_with_the_fix():
    trainer = sft(fp16=True)
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data = p.data.half()  # "Attempting to unscale FP16 gradients" on a GPU
    refuse = cm.MemoryGuardCallback(target="cpu", verbose=False, upcast_trainable=False)
    trainer.add_callback(refuse)
    with pytest.raises(cm_guard.MemoryGuardError, match=r"fp16=True with 8 trainable tensor\(s\) in float16"
                                                        r"(.|\n)*p.data = p.data.float\(\)"):
        train(trainer)
    assert trainer.state.global_step == 0 and trainable_dtypes(trainer) == {torch.float16}
    trainer.remove_callback(refuse)
    trainer.add_callback(cm.MemoryGuardCallback(target="cpu", verbose=False))
    train(trainer)
    assert trainable_dtypes(trainer) == {torch.float32} and trainer.state.global_step == 2


def test_without_fp16_the_guard_leaves_the_dtypes_alone():
    trainer = sft(quantized_flag=True)  # fp16=False: bf16 adapters train (no GradScaler)
    trainer.add_callback(cm.MemoryGuardCallback(target="cpu", verbose=False))
    train(trainer)
    assert trainable_dtypes(trainer) == {torch.bfloat16}


def test_a_real_qlora_sft_trainer_trains_guarded_with_fp32_adapters(tmp_path):
    """A bitsandbytes 4-bit base loaded by from_pretrained, LoRA, fp16=True: TRL's bf16 cast is undone by the guard
    and the run trains. (Planning a real 4-bit model needs the Params4bit-safe fake parameters of plan_trainer.)"""
    from transformers import BitsAndBytesConfig

    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**DIMS)).save_pretrained(tmp_path / "model")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", quantization_config=bnb, device_map="cpu",
                                                     dtype=torch.float16)
    assert model.is_loaded_in_4bit
    trainer = sft(model, fp16=True)
    assert trainable_dtypes(trainer) == {torch.bfloat16}
    guard = cm.MemoryGuardCallback(target="t4", verbose=False)
    trainer.add_callback(guard)
    train(trainer)
    assert trainable_dtypes(trainer) == {torch.float32} and trainer.state.global_step == 2
    assert guard.plan.fits and guard.report["measured_bytes"] > 0


def test_plan_and_fit_of_bf16_adapters_under_fp16_count_float32_and_name_the_fix():
    from colab_memopt import trainer as tr, trainerfit

    trainer = sft(quantized_flag=True, fp16=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = tr.plan_trainer(trainer, target="t4")
    assert any(w.startswith("fp16=True with 8 bfloat16 trainable tensor(s): add callbacks=[cm.MemoryGuardCallback()]")
               for w in before.warnings), before.warnings
    assert trainable_dtypes(trainer) == {torch.bfloat16}  # planning changed nothing
    fit = trainerfit.fit_trainer(trainer, target="t4")
    assert trainerfit.FP16_TRAP_NOTE in fit.notes and len(trainerfit.FP16_TRAP_NOTE) <= 100
    cm.guard.upcast_trainable(trainer.model)
    after = tr.plan_trainer(trainer, target="t4")
    assert not any(w.startswith(tr.FP16_TRAP) for w in after.warnings)
    assert before.peak_bytes == after.peak_bytes  # what the guard will train: float32 adapters
    assert trainerfit.FP16_TRAP_NOTE not in trainerfit.fit_trainer(trainer, target="t4").notes
    # from settings alone: the planner's own SFTTrainer on a 4-bit model gets TRL's cast too
    from transformers import BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)
    args = SFTConfig(output_dir="/tmp/colab_memopt_test_guard", max_length=48, fp16=True, use_cpu=True, report_to=[])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned = tr.plan_trainer(args, model=LlamaConfig(**DIMS), lora=lora, bnb=nf4, target="t4")
    assert any(w.startswith("fp16=True with 8 bfloat16 trainable tensor(s): add callbacks=[cm.MemoryGuardCallback()]")
               for w in planned.warnings), planned.warnings


def _reachable(root, limit: int = 200_000) -> list:
    """Return the objects reachable from `root` through references (modules and classes not followed)."""
    import gc
    import types

    seen, todo, found = set(), [root], []
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        found.append(obj)
        todo.extend(gc.get_referents(obj))
    return found


def test_after_the_run_the_guard_holds_neither_the_model_nor_the_optimizer():
    """On a GPU the guard measures through a LiveMemory that tracks the model and the optimizer: kept after the run,
    it kept them on the device, so a notebook that freed its Trainer to merge the adapter still held the 4-bit
    model and its optimizer. (The CUDA path's LiveMemory is entered here on the CPU, as on_train_begin enters it.)"""
    from transformers import TrainerControl

    guard = cm.MemoryGuardCallback(target="cpu", verbose=False)
    trainer = sft()
    trainer.add_callback(guard)
    train(trainer)
    memory = cm.LiveMemory(trainer.model, trainer.optimizer, device="cpu")
    memory.__enter__()
    guard._memory = memory  # what on_train_begin holds on a GPU
    guard.on_train_end(trainer.args, trainer.state, TrainerControl())
    held = {id(o) for o in _reachable(guard)}
    assert id(trainer.model) not in held and id(trainer.optimizer) not in held
    assert guard.report["measured_bytes"] > 0


def _between(small_batch: int, big_batch: int) -> dict:
    """A target the run fits at `small_batch` per device and not at `big_batch` (planned here, not typed in)."""
    from colab_memopt.planning import trainer as tr

    roomy = dict(name="roomy", device_bytes=2**40, host_bytes=2**40, cuda=False)
    args = SFTConfig("/tmp/colab_memopt_test_guard", per_device_train_batch_size=small_batch, max_length=48,
                     use_cpu=True, bf16=False, optim="adamw_torch", report_to=[], gradient_checkpointing=False)
    plans = [tr.plan_trainer(args, model=LlamaConfig(**DIMS), lora=LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "v_proj"], task_type="CAUSAL_LM"), target=roomy, per_device_train_batch_size=b)
        for b in (small_batch, big_batch)]
    scale = plans[0].device_limit_bytes / 2**40  # the usable fraction of the device
    assert plans[0].device_need_bytes < plans[1].device_need_bytes, plans
    return dict(name="small", device_bytes=int((plans[0].device_need_bytes + plans[1].device_need_bytes) / 2 / scale),
                host_bytes=2**40, cuda=False)


def test_args_changed_on_a_built_trainer_are_refused_not_planned():
    """Probe 4: after the guard stopped a run, the user set its changes on trainer.args; the guard planned micro-batches
    of 2 and let the run start, while the Trainer (its batch fixed when it was built) ran batches of 8."""
    small = _between(2, 8)
    trainer = sft(per_device_train_batch_size=8, max_steps=1, bf16=False)
    trainer.add_callback(cm.MemoryGuardCallback(target=small, verbose=False))
    with pytest.raises(cm_guard.MemoryGuardError, match=r"(?s)will not fit small.*per_device_train_batch_size=.*"
                                                        r"Then build a new Trainer with them") as stop:
        train(trainer)
    assert all(len(line) <= 100 for line in str(stop.value).splitlines()), str(stop.value)
    trainer.args.per_device_train_batch_size = 2
    trainer.args.gradient_accumulation_steps = 4
    said = r"\s+".join(map(re.escape, ("trainer.args changed after the Trainer was built: per_device_train_batch_size "
                                      "is 2 there, but the Trainer builds micro-batches of 8.").split()))
    rebuild = r"\s+".join(map(re.escape, "build a new Trainer with fit.apply(args).args".split()))
    with pytest.raises(cm_guard.MemoryGuardError, match=f"(?s){said}.*{rebuild}") as refused:
        train(trainer)
    assert all(len(line) <= 100 for line in str(refused.value).splitlines()), str(refused.value)
    rebuilt = sft(per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=1, bf16=False)
    guard = cm.MemoryGuardCallback(target=small, verbose=False)
    rebuilt.add_callback(guard)
    train(rebuilt)  # the settings in a new Trainer: planned as they run, and they fit
    assert guard.plan.fits and guard.plan.batch == 8


def test_the_guard_plans_the_batch_auto_find_batch_size_lowered_and_names_a_changed_precision():
    from types import SimpleNamespace

    def args(**kw):
        base = dict(per_device_train_batch_size=8, train_batch_size=8, n_gpu=1, auto_find_batch_size=False,
                    fp16=False, bf16=False, mixed_precision="no")
        return SimpleNamespace(**{**base, **kw})

    assert cm_guard._built_batch(SimpleNamespace(_train_batch_size=8), args()) == {}
    lowered = args(auto_find_batch_size=True)  # transformers halved the batch after an out-of-memory error
    assert cm_guard._built_batch(SimpleNamespace(_train_batch_size=4), lowered) == {"per_device_train_batch_size": 4}
    with pytest.raises(cm_guard.MemoryGuardError, match=r"fp16=True, bf16=False there, but\s+the\s+Trainer\s+runs\s+no\s+"
                                                        r"mixed\s+precision"):
        cm_guard._built_batch(SimpleNamespace(_train_batch_size=8), args(fp16=True))
    with pytest.raises(cm_guard.MemoryGuardError, match=r"fp16=False, bf16=False there, but\s+the\s+Trainer\s+runs\s+bf16"):
        cm_guard._built_batch(SimpleNamespace(_train_batch_size=8), args(mixed_precision="bf16"))
    assert cm_guard._built_batch(SimpleNamespace(_train_batch_size=8), args(bf16=True, mixed_precision="bf16")) == {}
