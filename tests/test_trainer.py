"""plan_trainer against the step peak a real TRL SFTTrainer reaches on the CPU (MemoryProfiler's callback),
on three transformers families, with LoRA dropout 0.05, gradient checkpointing and four optims."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    TrainingArguments,
)
from trl import SFTConfig, SFTTrainer  # noqa: E402

import colab_memopt as cm  # noqa: E402
from colab_memopt import guard as cm_guard, hfconfig  # noqa: E402
from colab_memopt import trainer as tr, trainerfit, trainertrace  # noqa: E402
from colab_memopt.planning.hfconfig import checkpointing_names  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "adafactor")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer (printable ASCII), built in memory: no hub."""
    tok = Tokenizer(models.WordLevel({**{chr(i): i for i in range(32, 127)}, "<pad>": 0, "<eos>": 1, "<unk>": 2},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sft_args(optim: str = "adamw_torch_fused", **changes) -> SFTConfig:
    values = dict(output_dir="/tmp/colab_memopt_test_trainer", per_device_train_batch_size=2, max_length=48, max_steps=2,
                  logging_steps=1, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                  optim=optim, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False)
    values.update(changes)
    return SFTConfig(**values)


def lora(dropout: float = 0.05) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def sft_trainer(family: str, optim: str, dropout: float = 0.05, **changes) -> SFTTrainer:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](**DIMS))
    # every text is longer than max_length: each row is truncated to it, no padding (the plan's full rows)
    data = Dataset.from_dict({"text": ["the quick brown fox jumps over the lazy dog " * 4] * 4})
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(model=model, args=sft_args(optim, **changes), train_dataset=data,
                             processing_class=char_tokenizer(), peft_config=lora(dropout))
    logging.disable(logging.NOTSET)
    return trainer


@functools.lru_cache(maxsize=None)
def planned_and_measured(family: str, optim: str, dropout: float = 0.05, checkpointing: bool = True) -> tuple[int, int]:
    """Return (plan_trainer's peak, the second step's measured peak): the first step also makes the optimizer state."""
    trainer = sft_trainer(family, optim, dropout, gradient_checkpointing=checkpointing)
    planned = tr.plan_trainer(trainer, target="cpu").peak_bytes
    profiler = cm.MemoryProfiler(device="cpu", capacity_bytes=cm.T4_USABLE_BYTES)
    trainer.add_callback(profiler.callback())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return planned, profiler.samples[-1].peak_bytes


# Each optim once, each family at least once: four real Trainer runs of two steps. The whole grid (3 families x
# 4 optims) is benchmarks/trainer_accuracy.py's, which writes benchmarks/results/trainer_accuracy.json.
CASES = (("llama", "adamw_torch"), ("qwen2", "adamw_torch_fused"), ("mistral", "adamw_8bit"), ("llama", "adafactor"))


@pytest.mark.parametrize(("family", "optim"), CASES)
def test_plan_trainer_within_one_percent_of_the_trainer_step(family, optim):
    planned, measured = planned_and_measured(family, optim)
    assert abs(planned - measured) <= 0.01 * measured, (planned, measured)


def test_plan_trainer_sees_what_lora_dropout_and_the_optimizer_hold():
    """The differences, not only the totals: each setting's bytes as the Trainer holds them. Without checkpointing
    (with it, a layer's dropped input lives only while that layer is recomputed, under the peak)."""
    base, base_m = planned_and_measured("llama", "adamw_torch", 0.05, False)
    no_drop, no_drop_m = planned_and_measured("llama", "adamw_torch", 0.0, False)
    assert base - no_drop == pytest.approx(base_m - no_drop_m, abs=64) and base_m > no_drop_m
    base, base_m = planned_and_measured("llama", "adamw_torch", 0.05)
    ada, ada_m = planned_and_measured("llama", "adafactor", 0.05)
    assert base - ada == pytest.approx(base_m - ada_m, abs=64) and base_m > ada_m


def test_fp16_is_planned_as_the_16_bit_autocast_it_runs_on_a_t4():
    trainer = sft_trainer("llama", "adamw_torch_fused")
    fp16 = tr.plan_trainer(trainer, target="t4", fp16=True, bf16=False)
    bf16 = tr.plan_trainer(trainer, target="a100-40gb", bf16=True)
    fp32 = tr.plan_trainer(trainer, target="t4")
    assert fp16.peak_bytes == bf16.peak_bytes < fp32.peak_bytes
    assert fp16.recipe["precision"] == "fp16-autocast"
    assert any("fp16 autocast is traced as bf16" in w for w in fp16.notes)
    bf16_t4 = tr.plan_trainer(trainer, target="t4", bf16=True)
    assert any("no native bf16" in w for w in bf16_t4.warnings)


def test_plan_from_settings_matches_the_plan_of_the_built_trainer():
    trainer = sft_trainer("qwen2", "adamw_torch_fused")
    from_trainer = tr.plan_trainer(trainer, target="cpu")
    from_settings = tr.plan_trainer(sft_args(), model=Qwen2Config(**DIMS), lora=lora(), target="cpu")
    assert from_settings.peak_bytes == pytest.approx(from_trainer.peak_bytes, rel=0.001)
    assert from_settings.batch == 2 and from_settings.seq_len == 48


@pytest.mark.parametrize("settings", ["TrainingArguments", "SFTConfig"])
def test_plan_from_settings_on_a_gpu_machine_keeps_the_fake_model_on_the_cpu(tmp_path, settings):
    # cuda-run-1 #4 (notebook 19): there args.device is cuda:0, the Trainer built around the fake model moved it there
    # ("cannot plan a model that moves its tensors to cuda:0") and its batches followed
    def args():
        if settings == "SFTConfig":
            return sft_args()
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2)

    model, peft = Qwen2Config(**DIMS), lora() if settings == "SFTConfig" else None
    on_cpu = tr.plan_trainer(args(), model=model, lora=peft, target="t4", seq_len=32)
    on_gpu = args()
    on_gpu.__dict__["_setup_devices"] = torch.device("cuda", 0)  # what TrainingArguments.device reads on a GPU machine
    planned = tr.plan_trainer(on_gpu, model=model, lora=peft, target="t4", seq_len=32)
    assert (planned.peak_bytes, planned.by_phase) == (on_cpu.peak_bytes, on_cpu.by_phase)
    assert on_gpu.device == torch.device("cuda", 0)  # the user's settings as they were


def test_trainer_recipe_names_what_the_recipe_cannot_say():
    # use_reentrant=True given: transformers 5 defaults to False (no note then); the note is for reentrant checkpoints
    args = TrainingArguments(output_dir="/tmp/x", fp16=True, gradient_checkpointing=True, optim="paged_adamw_8bit",
                             gradient_checkpointing_kwargs={"use_reentrant": True},
                             gradient_accumulation_steps=4, learning_rate=2e-4, use_cpu=True, report_to=[])
    peft = LoraConfig(r=16, lora_dropout=0.1, bias="all", target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float16, llm_int8_skip_modules=["lm_head"])
    recipe, notes = hfconfig.trainer_recipe(args, peft, bnb)
    assert (recipe.optimizer, recipe.precision, recipe.checkpointing, recipe.accumulation_steps) == (
        "paged_adamw8bit", "fp16-autocast", "full", 4)
    assert (recipe.lora_rank, recipe.lora_targets, recipe.quantization, recipe.lr) == (16, ("q_proj", "v_proj"), "nf4", 2e-4)
    text = "\n".join(notes)
    for said in ("use_reentrant", "lora_dropout=0.1", "bias='all'", "modules_to_save", "double_quant",
                 "compute_dtype", "llm_int8_skip_modules", "paged"):
        assert said in text, said


def test_optims_outside_the_plan_are_refused_by_name():
    with pytest.raises(ValueError, match="'galore_adamw'.*cannot be planned"):
        hfconfig.check_optim("galore_adamw")
    with pytest.raises(ValueError, match="'adamw_foo' is not a transformers OptimizerNames"):
        hfconfig.check_optim("adamw_foo")
    assert hfconfig.check_optim("adamw_torch_fused") == "adamw_torch_fused"
    with pytest.raises(ValueError, match=r"unknown SFTConfig field\(s\) \['per_device_batch'\]"):
        tr.plan_trainer(sft_args(), model=Qwen2Config(**DIMS), target="cpu", per_device_batch=2)
    with pytest.raises(ValueError, match="needs model="):
        tr.plan_trainer(sft_args(), target="cpu")


def big_dims(**changes):
    """Two layers of a 7B-wide Llama (about 0.5B parameters): fake tensors trace it in seconds."""
    return LlamaConfig(**{**dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=2,
                                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096), **changes})


def test_fit_trainer_returns_changes_after_which_the_plan_fits_a_t4():
    args = sft_args("adamw_torch", per_device_train_batch_size=4, max_length=256, fp16=True,
                    gradient_checkpointing=False, gradient_checkpointing_kwargs=None)
    model = big_dims(num_hidden_layers=4)
    fit = trainerfit.fit_trainer(args, model=model, target="t4")
    assert not fit.before.fits and fit.fits, str(fit)
    changed = trainertrace._changed_args(args, fit.changes)
    assert changed.per_device_train_batch_size * changed.gradient_accumulation_steps == 4  # the effective batch kept
    again = tr.plan_trainer(changed, model=model, target="t4")
    assert again.fits and again.peak_bytes == fit.after.peak_bytes
    assert fit.snippet().splitlines()[1:] == [f"    {k}={v!r}," for k, v in fit.changes.items()]
    assert fit.tried[-1][0] == fit.changes and all(need > fit.before.device_limit_bytes for _, need, _ in fit.tried[:-1])


def test_fit_trainer_switches_bf16_to_fp16_on_a_t4_even_when_it_fits():
    fit = trainerfit.fit_trainer(sft_args(bf16=True), model=Qwen2Config(**DIMS), lora=lora(), target="t4")
    assert fit.changes == {"bf16": False, "fp16": True} and fit.fits


TRL_YAML = """\
# as `trl sft --config sft.yaml` reads it: SFTConfig, ModelConfig and ScriptArguments keys in one file
model_name_or_path: {model}
dataset_name: trl-lib/Capybara
learning_rate: 2.0e-4
per_device_train_batch_size: 2
gradient_accumulation_steps: 4
max_length: 48
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
fp16: true
optim: paged_adamw_8bit
use_peft: true
lora_r: 4
lora_alpha: 8
lora_dropout: 0.05
lora_target_modules: [q_proj, v_proj]
output_dir: {out}
"""


def test_cli_plans_a_trl_yaml_config(tmp_path, capsys):
    import json

    from colab_memopt.tooling.cli import main

    Qwen2Config(**DIMS).save_pretrained(tmp_path / "model")
    config = tmp_path / "sft.yaml"
    config.write_text(TRL_YAML.format(model=tmp_path / "model", out=tmp_path / "out"))
    code = main(["plan", "--training-args", str(config), "--target", "t4", "--no-max-batch", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"], out
    assert (out["batch"], out["seq_len"]) == (8, 48)
    assert out["recipe"]["optimizer"] == "paged_adamw8bit" and out["recipe"]["precision"] == "fp16-autocast"
    assert out["recipe"]["lora_rank"] == 4 and out["recipe"]["accumulation_steps"] == 4
    assert any("dataset_name" in w for w in out["warnings"]) and any("lora_dropout=0.05" in w for w in out["warnings"])
    config.write_text(config.read_text() + "lora_rnak: 8\n")
    assert main(["plan", "--training-args", str(config), "--json"]) == 2
    assert "lora_rnak" in json.loads(capsys.readouterr().out)["error"]


def test_memory_guard_measures_the_run_and_stops_one_that_will_not_fit(capsys):
    guard = cm.MemoryGuardCallback(target="t4")
    trainer = sft_trainer("llama", "adamw_torch_fused")
    trainer.add_callback(guard)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert guard.plan.fits and len(guard.peaks) == 2  # logging_steps=1: one peak per logged step
    assert guard.report["planned_on"] == "cpu" and abs(guard.report["error_pct"]) < 1, guard.report
    assert "MemoryGuard: measured step peak" in capsys.readouterr().out
    tiny = {"name": "tiny", "device_bytes": 4 * 2**20, "host_bytes": 2**40, "cuda_context_bytes": 0}
    stopper = cm.MemoryGuardCallback(target=tiny, max_plans=1)
    trainer = sft_trainer("llama", "adamw_torch_fused", gradient_checkpointing=False)
    trainer.add_callback(stopper)
    with pytest.raises(cm_guard.MemoryGuardError, match="will not fit tiny.*before the first step"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_recipe_reads_back_from_its_trainer_settings():
    recipe = cm.Recipe(optimizer="paged_adamw8bit", precision="fp16-autocast", checkpointing="full", accumulation_steps=4,
                       lora_rank=16, lora_targets=("q_proj", "v_proj"), quantization="nf4", lr=2e-4)
    out = hfconfig.recipe_settings(recipe, 16, 512)
    assert out["training_args"]["per_device_train_batch_size"] == 4 and out["not_expressible"] == []
    args = SFTConfig(output_dir="/tmp/x", use_cpu=True, report_to=[], **out["training_args"])
    back, _ = hfconfig.trainer_recipe(args, LoraConfig(**out["lora"]), BitsAndBytesConfig(**out["bnb"]))
    assert back == recipe
    selective = hfconfig.recipe_settings(recipe.with_(checkpointing="selective"), 16, 512)
    assert selective["training_args"][checkpointing_names()[0]] is True
    assert selective["not_expressible"] == [
        f"checkpointing='selective' (the Trainer recomputes whole layers, not parts of them: {checkpointing_names()[0]}"
        "=True checkpoints every layer: slower, less memory)"]


def test_printed_settings_use_the_installed_transformers_names_for_checkpointing(monkeypatch):
    """issue 46: transformers 5.2x renamed gradient_checkpointing* to activation_checkpointing* (the old names warn
    and go in v6); older versions, as on Colab, know only the old names. Printed settings use the installed ones."""
    import dataclasses

    import transformers

    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    expected = (("activation_checkpointing", "activation_checkpointing_kwargs") if "activation_checkpointing" in names
                else ("gradient_checkpointing", "gradient_checkpointing_kwargs"))
    assert checkpointing_names() == expected
    out = hfconfig.recipe_settings(cm.Recipe(checkpointing="full"), 8, 512)["training_args"]
    assert out[expected[0]] is True and out[expected[1]] == {"use_reentrant": False}
    assert not {"gradient_checkpointing", "activation_checkpointing"} - {expected[0]} & set(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the printed names are not the deprecated aliases
        SFTConfig(output_dir="/tmp/x", use_cpu=True, report_to=[], **out)

    @dataclasses.dataclass
    class OlderTrainingArguments:  # transformers before the rename
        gradient_checkpointing: bool = False
        gradient_checkpointing_kwargs: dict | None = None

    monkeypatch.setattr(transformers, "TrainingArguments", OlderTrainingArguments)
    monkeypatch.setattr(hfconfig, "checkpointing_names", hfconfig.checkpointing_names.__wrapped__)
    older = hfconfig.recipe_settings(cm.Recipe(checkpointing="full"), 8, 512)["training_args"]
    assert older["gradient_checkpointing"] is True and "activation_checkpointing" not in older


def test_a_recipe_that_checkpoints_every_other_layer_trains_so_through_the_installed_trainer():
    """newcomer review 4, finding 6: recommend printed no gradient_checkpointing for checkpointing='every_n'; the
    installed Trainer takes `every_n_layers` (read from its code), and the printed settings train that way."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    assert "every_n_layers" in hfconfig.trainer_checkpointing_keys()
    out = hfconfig.recipe_settings(cm.Recipe(checkpointing="every_n", checkpoint_interval=2), 2, 48)
    assert out["not_expressible"] == []
    on, kwargs_name = checkpointing_names()
    kwargs = out["training_args"][kwargs_name]
    assert out["training_args"][on] is True and kwargs == {"use_reentrant": False, "every_n_layers": 2}
    trainer = sft_trainer("llama", "adamw_torch", **{on: True, kwargs_name: kwargs})  # as printed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    layers = [m for m in trainer.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert [m.gradient_checkpointing for m in layers] == [True, False]  # layers 0, 2, 4, ... of DIMS' two
    assert trainer.state.global_step == 2


def test_a_trainer_without_every_n_layers_gets_full_checkpointing_and_a_note(monkeypatch):
    """Where the Trainer hands every key to torch's checkpoint (older transformers), a recipe that checkpoints
    still prints gradient_checkpointing=True, never a run without the checkpointing it planned."""
    monkeypatch.setattr(hfconfig, "trainer_checkpointing_keys", lambda: frozenset())
    for policy, says in (("every_n", "slower, less memory"), ("selective", "slower, less memory"),
                         ("segments", "can hold more than planned"), ("offload", "can hold more than planned")):
        interval = 2 if policy in ("every_n", "segments") else 1
        out = hfconfig.recipe_settings(cm.Recipe(checkpointing=policy, checkpoint_interval=interval), 8, 512)
        assert out["training_args"][checkpointing_names()[0]] is True, policy
        assert out["training_args"][checkpointing_names()[1]] == {"use_reentrant": False}, policy
        (note,) = out["not_expressible"]
        assert note.startswith(f"checkpointing={policy!r}") and note.endswith(f"checkpoints every layer: {says})"), note
    assert "checkpoint_interval=2" in hfconfig.recipe_settings(cm.Recipe(checkpointing="every_n", checkpoint_interval=2),
                                                               8, 512)["not_expressible"][0]


def test_the_checkpointing_keys_are_read_from_the_installed_code(monkeypatch):
    import transformers

    read = hfconfig.trainer_checkpointing_keys.__wrapped__
    assert read() == hfconfig.trainer_checkpointing_keys() >= {"every_n_layers"}

    def enable(self, activation_checkpointing_kwargs=None):  # a model method that takes no every_n_layers
        raise AssertionError("only its signature is read")

    name = "activation_checkpointing_enable" if hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable") \
        else "gradient_checkpointing_enable"
    monkeypatch.setattr(transformers.PreTrainedModel, name, enable)
    assert read() == frozenset()
    out = hfconfig.recipe_settings(cm.Recipe(checkpointing="offload"), 8, 512)  # the cached read: offload where taken
    assert out["training_args"][checkpointing_names()[1]] == (
        {"use_reentrant": False, "offload": True} if "offload" in hfconfig.trainer_checkpointing_keys()
        else {"use_reentrant": False})


def test_a_bitsandbytes_config_is_planned_on_4_bit_layers():
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float16)
    plain = tr.plan_trainer(sft_args(fp16=True), model=big_dims(), lora=lora(), target="t4")
    qlora = tr.plan_trainer(sft_args(fp16=True), model=big_dims(), lora=lora(), bnb=nf4, target="t4")
    assert qlora.recipe["quantization"] == "nf4" and plain.recipe["quantization"] is None
    # the two layers' linear weights (about 0.3B) go from 4 bytes to about 0.5 per weight; the embeddings stay
    saved = plain.by_category["parameters"] - qlora.by_category["parameters"]
    linear = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 11008)
    assert 3.5 * linear <= saved < 3.51 * linear, (saved, linear)  # 4 -> 0.5 B of packed weight (and the norms' casts)
    scales = next(c.bytes for c in qlora.device_costs if c.name == "quantization scales")
    assert linear / 64 < scales < linear / 64 * 1.1  # double quantization: about one byte per 64-weight block


def gqa_trainer() -> Any:
    """A plain Trainer on a grouped-query llama (4 heads, 2 KV heads) whose batches carry no attention mask: transformers
    then passes enable_gqa=True to SDPA, as in the project's own steps (cuda-run-1 #6)."""
    from transformers import Trainer, default_data_collator

    from colab_memopt import architectures

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(architectures.small_config("llama"))
    data = Dataset.from_dict({"input_ids": [[1] * 512] * 4, "labels": [[1] * 512] * 4})
    args = TrainingArguments(output_dir="/tmp/colab_memopt_test_trainer", per_device_train_batch_size=4, optim="adamw_torch",
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)


@pytest.mark.parametrize("flash_flag", [True, False])
def test_plan_trainer_plans_grouped_query_attention_as_a_t4_runs_it(flash_flag):
    trainer = gqa_trainer()
    was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(flash_flag)
    try:
        t4 = tr.plan_trainer(trainer, target="t4", seq_len=512)
        t4_fp16 = tr.plan_trainer(trainer, target="t4", seq_len=512, fp16=True)
        a100_bf16 = tr.plan_trainer(trainer, target="a100-40gb", seq_len=512, bf16=True)
        assert torch.backends.cuda.flash_sdp_enabled() is flash_flag
    finally:
        torch.backends.cuda.enable_flash_sdp(was)
    for plan in (t4, t4_fp16):
        assert any("math kernel on t4" in w for w in [*plan.warnings, *plan.notes]), (plan.warnings, plan.notes)
    assert not any("math kernel" in w for w in [*a100_bf16.warnings, *a100_bf16.notes])
    # math holds the (B, heads, T, T) scores and softmax per layer for backward; flash on an A100 holds O(T)
    assert t4_fp16.peak_bytes > 2 * a100_bf16.peak_bytes, (t4_fp16.peak_bytes, a100_bf16.peak_bytes)
    # 94.47 MiB, whatever the flag: 78.47 MiB of tensors and the 16 MiB softmax's backward holds inside itself on CUDA
    assert t4.peak_bytes == 99_055_616, t4.peak_bytes


def test_bf16_asked_of_a_plan_on_a_machine_without_a_gpu_says_to_add_use_cpu(tmp_path, monkeypatch):
    """Newcomer review 4, finding 9: transformers refuses bf16=True without a GPU ("Your setup doesn't support
    bf16/gpu. You need to assign use_cpu ..."); where that happens inside plan_trainer (a what-if, fit_trainer's
    changes), our error says what to do in the user's words."""
    import transformers.training_args

    from trl import SFTConfig

    # a machine without a bf16 GPU, as transformers sees it (this one has none; a GPU machine is made to look so)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: False)

    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, max_length=16, report_to=[], bf16=False)
    with pytest.raises(ValueError, match=r"add use_cpu=True to your SFTConfig\(\.\.\.\); it does not change the plan; "
                                         r"drop it on Colab") as err:
        cm.plan_trainer(args, model=cm.architectures.small_config("llama"), target="t4", bf16=True)
    assert "SFTConfig(..., bf16=True) cannot be built on this machine without a GPU" in str(err.value)
