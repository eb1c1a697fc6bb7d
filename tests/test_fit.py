"""fit_trainer's search in the user's settings (base dtype, 4-bit base, checkpointing, batch, max_length), its bound,
its advice on failure, and `TrainerFit.apply`, on a tiny Llama saved as a local model folder (a model id's route)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")
from peft import LoraConfig  # noqa: E402
from transformers import BitsAndBytesConfig, LlamaConfig  # noqa: E402
from trl import SFTConfig  # noqa: E402

from colab_memopt import trainer as tr, trainerfit  # noqa: E402

# linear layers hold most of the weights, as in the models people fine-tune
CFG = dict(vocab_size=256, hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def model_id(tmp_path_factory):
    """A model folder: SFTTrainer given it loads it with SFTConfig's model_init_kwargs (fp32 where they name none)."""
    path = tmp_path_factory.mktemp("fit") / "tiny-llama"
    LlamaConfig(**CFG).save_pretrained(path)
    return str(path)


def sft(**changes) -> SFTConfig:
    """SFTConfig as a T4 user writes it (bf16=True: TRL's default); use_cpu only so it builds on a CPU machine."""
    values = dict(output_dir="/tmp/colab_memopt_test_fit", per_device_train_batch_size=4, max_length=256,
                  report_to=[], use_cpu=True, bf16=True)
    return SFTConfig(**{**values, **changes})


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def small_t4(device_bytes: int) -> dict:
    return {"name": "small-t4", "device_bytes": device_bytes, "host_bytes": 2**40, "cuda_context_bytes": 0,
            "cuda": True, "compute_capability": (7, 5)}


def need(model_id, target, **kwargs) -> int:
    return tr.plan_trainer(sft(bf16=False, fp16=True), model=model_id, lora=lora(), target=target, headroom=0.0,
                           **kwargs).device_need_bytes


def between(low: int, high: int) -> dict:
    assert low < high, (low, high)
    return small_t4((low + high) // 2)


def test_lora_fit_loads_the_base_in_fp16_first_and_apply_returns_settings_that_fit(model_id):
    """The common T4 case: LoRA on a model id TRL loads in fp32. The first plan after yours is the base in fp16 (the
    must-change bf16 -> fp16 alone needs no less than bf16: it would not be planned); no optimizer swap is tried."""
    t4 = small_t4(2**40)
    fp32_need = need(model_id, t4)
    fp16_need = need(model_id, t4, dtype="float16")
    target = between(fp16_need, fp32_need)
    args = sft()
    fit = trainerfit.fit_trainer(args, model=model_id, lora=lora(), target=target, headroom=0.0)
    assert fit.fits and not fit.before.fits, str(fit)
    assert fit.changes == {"bf16": False, "fp16": True, "model_init_kwargs": {"dtype": "float16"}}, fit.changes
    assert len(fit.tried) == 1  # one plan after yours
    assert fit.dtype == torch.float16 and fit.bnb is None and fit.model_init_kwargs == {"dtype": "float16"}
    fitted = fit.apply(args)
    assert type(fitted.args) is SFTConfig and fitted.args is not args and args.bf16 and args.model_init_kwargs is None
    assert fitted.args.fp16 and not fitted.args.bf16 and fitted.model_init_kwargs == {"dtype": "float16"}
    assert fitted.lora is fit.lora and fitted.bnb is None and fitted.dtype == torch.float16
    # the same fit for TrainingArguments and a model you load yourself: the dtype to load it with
    from transformers import TrainingArguments

    hf_args = TrainingArguments(output_dir="/tmp/colab_memopt_test_fit", per_device_train_batch_size=4, use_cpu=True,
                                bf16=True, report_to=[])
    hf_needs = [tr.plan_trainer(hf_args, model=model_id, lora=lora(), target=small_t4(2**40), headroom=0.0, seq_len=256,
                                bf16=False, fp16=True, dtype=d).device_need_bytes for d in ("float16", None)]
    hf_fit = trainerfit.fit_trainer(hf_args, model=model_id, lora=lora(), target=between(*hf_needs), headroom=0.0, seq_len=256)
    hf_fitted = hf_fit.apply(hf_args)
    assert hf_fit.fits and hf_fit.changes == {"bf16": False, "fp16": True} and hf_fit.dtype == torch.float16
    assert hf_fitted.model_init_kwargs == {"dtype": torch.float16} and hf_fitted.dtype == torch.float16
    again = tr.plan_trainer(fitted.args, model=model_id, lora=fitted.lora, bnb=fitted.bnb, target=target, headroom=0.0)
    assert again.fits and again.device_need_bytes == fit.after.device_need_bytes
    assert "model_init_kwargs={'dtype': 'float16'}," in fit.snippet()


def test_lora_fit_takes_a_4bit_base_where_the_fp16_base_does_not_fit(model_id):
    """Checkpointing on and one row per step already: a 4-bit base (the rest in fp16) before a shorter max_length."""
    t4 = small_t4(2**40)
    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)
    fp16_need = need(model_id, t4, dtype="float16", per_device_train_batch_size=1, gradient_checkpointing=True)
    qlora_need = need(model_id, t4, bnb=four_bit, dtype="float16", per_device_train_batch_size=1,
                      gradient_checkpointing=True)
    target = between(qlora_need, fp16_need)
    args = sft(per_device_train_batch_size=1, gradient_checkpointing=True)
    fit = trainerfit.fit_trainer(args, model=model_id, lora=lora(), target=target, headroom=0.0)
    assert fit.fits, str(fit)
    assert fit.bnb is not None and fit.bnb.load_in_4bit and fit.bnb.bnb_4bit_quant_type == "nf4"
    assert fit.bnb.bnb_4bit_compute_dtype == torch.float16 and fit.dtype == torch.float16  # the rest in fp16
    assert not any("optim" in changes or "max_length" in changes for changes, _, _ in fit.tried)
    assert [sorted(c) for c, _, _ in fit.tried] == [sorted(["bf16", "fp16", "model_init_kwargs", "dtype"]),
                                                    sorted(["bf16", "fp16", "model_init_kwargs", "dtype", "bnb"])]
    assert "# load the model 4-bit: quantization_config=BitsAndBytesConfig(load_in_4bit=True, " \
           "bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype=torch.float16)" in fit.snippet().replace("\n#     ", " ")
    assert all(len(line) <= 100 for line in fit.snippet().splitlines()), fit.snippet()
    fitted = fit.apply(args)
    again = tr.plan_trainer(fitted.args, model=model_id, lora=fitted.lora, bnb=fitted.bnb, dtype=fitted.dtype,
                            target=target, headroom=0.0)
    assert again.fits and again.device_need_bytes == fit.after.device_need_bytes


def test_a_failed_fit_prints_the_smallest_need_and_what_to_do_next_and_apply_refuses(model_id):
    target = small_t4(2**21)  # just room for the first hidden states (else refused before any plan: check_micro_batch)
    fit = trainerfit.fit_trainer(sft(), model=model_id, lora=lora(), target=target, max_plans=3)
    assert not fit.fits and len(fit.tried) == 3
    text = str(fit)
    smallest = min(n for _, n, _ in fit.tried)
    assert "note: smallest need reached:" in text and "note: next: a smaller model" in text, text
    assert any(n.startswith("smallest need reached") for n in fit.notes)
    assert fit.notes[0].startswith("stopped after max_plans=3 plans")
    from colab_memopt.core.measure import format_bytes

    assert format_bytes(smallest) in text
    assert all(len(line) <= 120 for line in text.splitlines()), text
    with pytest.raises(ValueError, match="nothing tried fits small-t4"):
        fit.apply(sft())


def test_no_optimizer_swap_for_lora_but_for_full_fine_tuning(model_id):
    tgt = tr._target(small_t4(2**30))
    args = sft(optim="adamw_torch")
    lora_sets = trainerfit._candidates(args, tgt, lora=lora(), loaded=torch.float32, sft_model_id=True)
    full_sets = trainerfit._candidates(args, tgt, loaded=torch.float32, sft_model_id=True)
    assert not any("optim" in c for c in lora_sets) and any("optim" in c for c in full_sets)
    assert any("model_init_kwargs" in c for c in lora_sets)
    assert not any("model_init_kwargs" in c for c in full_sets)  # fp16 weights cannot be trained under the scaler
    assert all(c.get("fp16") for c in lora_sets)  # bf16 on a T4 is always changed
    # cheapest first (the most saving among sets of one cost): the base in fp16 before checkpointing, batch changes
    # and a shorter max_length
    order = [next(iter(k for k in c if k not in ("bf16", "fp16")), None) for c in lora_sets]
    assert order[:2] == ["model_init_kwargs", None] and order.index("max_length") > order.index("per_device_train_batch_size")


@pytest.mark.parametrize("number", ["18", "19"])
def test_the_capstone_snippets_train_the_settings_fit_apply_returns(number):
    """Review 3 finding 4: the "Use it" code printed the fit and then trained the unfixed `args`. Each fenced
    snippet that calls fit_trainer applies the fit with the public `fit.apply(args)` and trains its `.args`."""
    import re
    from pathlib import Path

    import nbformat

    path = next((Path(__file__).resolve().parent.parent / "notebooks").glob(f"{number}_*.ipynb"))
    source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
    assert "_changed_args" not in source and "cmtrainer._target" not in source  # no private helpers
    snippets = [s for s in re.findall(r"```python\n(.*?)```", source, re.S) if "fit_trainer(" in s]
    assert snippets, path.name
    for code in snippets:
        applied = re.search(r"(\w+) = \w+\.apply\(", code)
        assert applied, f"{path.name}: no fit.apply(args) in\n{code}"
        trainer_call = code[code.index("SFTTrainer("):]
        assert f"args={applied.group(1)}.args" in trainer_call, f"{path.name}: the trainer does not train the fit\n{code}"


def test_batch_changes_are_predicted_from_two_plans_and_the_fit_confirmed(monkeypatch):
    """Full fine-tuning where only the per-device batch can change: batches 8 and 4 are planned, 2 is predicted more
    than 5% over the limit (linear in the batch) and not planned, 1 is planned and fits (the bound from the plan at
    the settings' own batch turned off: the next test has it)."""
    from transformers import TrainingArguments

    monkeypatch.setattr(trainerfit, "_batch_lower_bound", lambda *args: 0)

    model = LlamaConfig(**CFG)
    args = TrainingArguments(output_dir="/tmp/colab_memopt_test_fit", per_device_train_batch_size=16, fp16=True,
                             use_cpu=True, optim="adafactor", gradient_checkpointing=True, report_to=[])
    plans = {b: tr.plan_trainer(args, model=model, target=small_t4(2**40), headroom=0.0, seq_len=256,
                                per_device_train_batch_size=b, gradient_accumulation_steps=16 // b).device_need_bytes
             for b in (1, 2)}
    target = small_t4(plans[1] + 2**10)
    assert plans[2] > 1.05 * target["device_bytes"], plans  # beyond the prediction's 5% margin
    fit = trainerfit.fit_trainer(args, model=model, target=target, headroom=0.0, seq_len=256)
    assert fit.fits and fit.changes == {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 16}, str(fit)
    assert [c["per_device_train_batch_size"] for c, _, _ in fit.tried] == [8, 4, 1] and fit.predicted == 1
    assert fit.after.device_need_bytes == plans[1]


def test_a_smaller_batch_the_plan_at_the_settings_batch_bounds_over_the_limit_is_not_planned():
    """The plan at per_device_train_batch_size=16 bounds every smaller batch from below (its parameters, buffers and
    optimizer state, the rest scaled with the batch): 8 is bounded over the limit and not planned; 4 and 2 are
    planned, 1 fits. The bound is under every batch's planned need (what makes skipping safe)."""
    from transformers import TrainingArguments

    model = LlamaConfig(**CFG)
    args = TrainingArguments(output_dir="/tmp/colab_memopt_test_fit", per_device_train_batch_size=16, fp16=True,
                             use_cpu=True, optim="adafactor", gradient_checkpointing=True, report_to=[])
    plans = {b: tr.plan_trainer(args, model=model, target=small_t4(2**40), headroom=0.0, seq_len=256,
                                per_device_train_batch_size=b, gradient_accumulation_steps=16 // b)
             for b in (16, 8, 1)}
    fixed = sum(plans[16].by_category[c] for c in ("parameters", "buffers", "optimizer_state"))

    def bound(b):
        return trainerfit._batch_lower_bound(plans[16].device_need_bytes, fixed, 16, b)

    target = small_t4(plans[1].device_need_bytes + 2**10)
    assert plans[8].device_need_bytes >= bound(8) > 1.05 * target["device_bytes"]  # 8: bounded over, and truly over
    fit = trainerfit.fit_trainer(args, model=model, target=target, headroom=0.0, seq_len=256)
    assert fit.fits and fit.changes == {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 16}, str(fit)
    assert [c["per_device_train_batch_size"] for c, _, _ in fit.tried] == [4, 2, 1] and fit.predicted == 1
    assert all(need >= bound(c["per_device_train_batch_size"]) for c, need, _ in fit.tried)  # a lower bound of each


def test_apply_refuses_settings_other_than_those_fitted_naming_the_field_and_both_values(model_id):
    """Probe 4: a fit for per_device_train_batch_size=8 applied to settings with 16 returned 4 x 2 = 8 (the run's
    effective batch halved, no word); applied to max_length=4096 where the fit planned 256, it kept 4096."""
    args = sft(per_device_train_batch_size=8, bf16=False, fp16=True)
    fit = trainerfit.fit_trainer(args, model=model_id, lora=lora(), target=small_t4(2**40), max_plans=1)
    assert fit.apply(args).args.per_device_train_batch_size == 8  # the settings fitted: applied
    assert fit.apply(sft(per_device_train_batch_size=8, bf16=False, fp16=True, learning_rate=1e-3)).args.learning_rate \
        == 1e-3  # a field the fit did not plan: kept as given
    for changed, text in [(dict(per_device_train_batch_size=16), "per_device_train_batch_size=16 where the fit planned 8"),
                          (dict(max_length=4096), "max_length=4096 where the fit planned 256"),
                          (dict(gradient_accumulation_steps=4), "gradient_accumulation_steps=4 where the fit planned 1"),
                          (dict(fp16=False), "fp16=False where the fit planned True"),
                          (dict(optim="adafactor"), "optim='adafactor' where the fit planned 'adamw_torch_fused'"),
                          (dict(gradient_checkpointing=False), "gradient_checkpointing=False where the fit planned True")]:
        with pytest.raises(ValueError, match=r"these settings are not the ones fitted: " + text.replace("(", r"\(")):
            fit.apply(sft(**{**dict(per_device_train_batch_size=8, bf16=False, fp16=True), **changed}))
    for wrong in (None, {"per_device_train_batch_size": 8}, SFTConfig):
        with pytest.raises(TypeError, match="apply takes your TrainingArguments / SFTConfig"):
            fit.apply(wrong)
