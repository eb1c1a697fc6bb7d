"""plan_trainer on the Trainers users really have, against the step peak the Trainer reaches on the CPU
(MemoryProfiler's callback): a model loaded in bf16 (the CPU's half type: the same bytes as fp16 on a T4), a QLoRA
SFTTrainer holding a real bitsandbytes 4-bit or 8-bit model, a plain Trainer over a PyTorch Dataset, a model that
lives on another device; and the dtype a plan from settings loads the base in."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("bitsandbytes")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    Trainer,
    TrainingArguments,
)
from trl import SFTConfig, SFTTrainer  # noqa: E402

import colab_memopt as cm  # noqa: E402
from colab_memopt import trainer as tr  # noqa: E402
from colab_memopt.hfconfig import save_example_chat_model  # noqa: E402

SEQ = 64


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A tiny llama saved in bf16 (config.json says dtype bfloat16), with its tokenizer."""
    root = tmp_path_factory.mktemp("models")
    fp32 = save_example_chat_model("llama", root / "fp32")
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(root / "bf16")
    AutoTokenizer.from_pretrained(fp32).save_pretrained(root / "bf16")
    return str(root / "bf16")


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def train_args(**changes) -> TrainingArguments:
    values = dict(output_dir="/tmp/colab_memopt_test_trainer_models", per_device_train_batch_size=2, max_steps=2,
                  logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False)
    return TrainingArguments(**{**values, **changes})


def sft_args(**changes) -> SFTConfig:
    values = dict(output_dir="/tmp/colab_memopt_test_trainer_models", per_device_train_batch_size=2, max_length=SEQ,
                  max_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                  bf16=False)
    return SFTConfig(**{**values, **changes})


def quiet(build):
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build()
    finally:
        logging.disable(logging.NOTSET)


def measured_peak(trainer) -> int:
    """Return the second step's peak (the first also makes the optimizer state), as tests/test_trainer.py does."""
    profiler = cm.MemoryProfiler(device="cpu", capacity_bytes=cm.T4_USABLE_BYTES)
    trainer.add_callback(profiler.callback())
    quiet(trainer.train)
    return profiler.samples[-1].peak_bytes


def qlora_trainer(folder: str, bnb: BitsAndBytesConfig, *, prepare: bool = False) -> SFTTrainer:
    model = quiet(lambda: AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb, device_map="cpu"))
    if prepare:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    text = Dataset.from_dict({"text": ["hello world " * 20] * 8})  # every row longer than max_length: full rows
    return quiet(lambda: SFTTrainer(model=model, args=sft_args(), processing_class=AutoTokenizer.from_pretrained(folder),
                                    train_dataset=text, peft_config=lora()))


NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.mark.parametrize(("bnb", "prepare"), [(NF4, False), (NF4, True), (dict(load_in_8bit=True), False)],
                         ids=["nf4", "nf4-prepared", "int8"])
def test_a_qlora_sft_trainer_holding_a_real_bitsandbytes_model_is_planned_within_one_percent(bf16_folder, bnb, prepare):
    trainer = qlora_trainer(bf16_folder, BitsAndBytesConfig(**bnb), prepare=prepare)
    layer = trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    kept = ("state", "quant_state", "compute_dtype", "compute_type_is_set")
    weight, state = layer.weight, (dict(vars(layer.weight)), {k: getattr(layer, k, None) for k in kept})
    inner = dict(vars(layer.state)) if hasattr(layer, "state") else None
    plan = tr.plan_trainer(trainer, target="cpu")
    # the real weights and bitsandbytes' states are untouched: the same objects, the same attributes
    assert layer.weight is weight and (dict(vars(layer.weight)), {k: getattr(layer, k, None) for k in kept}) == state
    assert inner is None or vars(layer.state) == inner
    measured = measured_peak(trainer)
    assert abs(plan.peak_bytes - measured) <= 0.01 * measured, (plan.peak_bytes, measured)
