"""A Trainer plan lists the installed libraries' defaults it assumed, with their versions (issue 41, item 5)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")
import transformers  # noqa: E402
import trl  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import LlamaConfig, TrainingArguments  # noqa: E402
from trl import SFTConfig  # noqa: E402

from colab_memopt import trainer as tr  # noqa: E402
from colab_memopt.planning import hfconfig, libdefaults  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def sft(**changes):
    values = dict(output_dir="/tmp/colab_memopt_test_libdefaults", per_device_train_batch_size=2, max_length=32,
                  report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=True)
    values.update(changes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTConfig(**values)


def plan(args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tr.plan_trainer(args, model=LlamaConfig(**DIMS), lora=LoraConfig(r=4, target_modules=["q_proj"]),
                               target="t4", **kw)


def test_a_plan_lists_the_defaults_it_assumed_with_the_installed_versions():
    p = plan(sft())
    reentrant, _ = hfconfig.checkpoint_use_reentrant(None)  # read from the installed transformers
    assert p.defaults == [
        f"gradient checkpointing use_reentrant={reentrant}: transformers {transformers.__version__}'s default",
        f"loss: loss_type='nll', TRL {trl.__version__}'s SFTConfig default",
        f"load dtype: float32 (the config's): transformers {transformers.__version__}'s from_pretrained default "
        "dtype='auto'",
    ]
    assert p.to_dict()["defaults"] == p.defaults
    explained = p.explain().splitlines()
    assert [line for line in explained if line.startswith("library default assumed: ")] == [
        f"library default assumed: {d}" for d in p.defaults]
    assert all(len(d) <= 100 for d in p.defaults), p.defaults


def test_what_the_user_set_is_not_listed_as_a_default():
    p = plan(sft(gradient_checkpointing_kwargs={"use_reentrant": False}, loss_type="dft"), dtype=torch.float16)
    assert p.defaults == []
    off = plan(sft(gradient_checkpointing=False))
    assert not any("use_reentrant" in d for d in off.defaults)


def test_the_checkpointing_default_is_read_from_the_installed_code(monkeypatch):
    """A transformers that passes no use_reentrant leaves torch's default (True): said so, with torch's version."""
    monkeypatch.setattr(hfconfig, "_installed_checkpoint_keywords", lambda given: {})
    assert libdefaults.checkpointing_line(sft(), True) == [
        f"gradient checkpointing use_reentrant=True: torch {torch.__version__}'s default (transformers passes none)"]


def test_the_load_dtype_of_a_model_id_is_trl_s_read_from_its_code():
    line = libdefaults.load_dtype_line(sft(), "HuggingFaceTB/SmolLM2-135M", None, torch.float32)
    assert line == [f"load dtype: float32, TRL {trl.__version__}'s default for a model id; set "
                    "model_init_kwargs={'dtype': ...} to change it"]
    assert libdefaults.load_dtype_line(sft(model_init_kwargs={"dtype": "float16"}), "a/b", None, torch.float16) == []
    plain = TrainingArguments(output_dir="/tmp/x", use_cpu=True, report_to=[])
    assert libdefaults.load_dtype_line(plain, "a/b", None, torch.bfloat16)[0].startswith(
        "load dtype: bfloat16 (the config's")
