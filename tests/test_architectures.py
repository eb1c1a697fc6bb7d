"""Any causal LM by name, Hugging Face id, folder, config.json, PretrainedConfig or factory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import colab_memopt as cm
from colab_memopt import architectures, planner
from colab_memopt.tooling.cli import main as cli
from colab_memopt.techniques.architectures import SMALL_FAMILIES, resolve_model, small_config

CPU_TARGET = {"name": "cpu-test", "device_bytes": 2**30, "host_bytes": 64 * 2**30, "cuda": False}
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("family", SMALL_FAMILIES)
def test_cli_plans_a_folder_with_a_config_of_each_family(tmp_path, capsys, family):
    small_config(family).save_pretrained(tmp_path)
    assert cli(["plan", "--model", str(tmp_path), "--batch", "1", "--seq", "128", "--json", "--no-max-batch"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "trace" and out["fits"] and out["peak_bytes"] > 0
    assert out["model"] == str(tmp_path)
    params = sum(p.numel() for p in AutoModel(tmp_path).parameters())
    assert out["by_category"]["parameters"] >= 4 * params * 0.99  # fp32 weights, whatever else is counted


def AutoModel(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))


def test_the_cli_itself_plans_a_config_json(tmp_path):
    small_config("qwen2").save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "colab_memopt", "plan", "--model", str(tmp_path / "config.json"),
                          "--batch", "1", "--seq", "128", "--json", "--no-max-batch"], capture_output=True, text=True, env=env,
                         timeout=300)  # the largest-batch search is the planner's own tests' (13 s here with it)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["method"] == "trace"


def test_a_hub_id_without_network_is_one_clear_line_and_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "colab_memopt", "plan", "--model", "Qwen/Qwen2.5-0.5B", "--batch", "1",
                          "--seq", "128"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "no network" in lines[0] and "Qwen/Qwen2.5-0.5B" in lines[0], run.stderr


def test_an_unreachable_hub_is_detected_without_retries(monkeypatch, tmp_path):
    import socket

    def refuse(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert not architectures._hub_reachable()
    with pytest.raises(ValueError, match="no network"):
        resolve_model("HuggingFaceTB/SmolLM2-360M")


def test_every_form_resolves_to_the_same_model(tmp_path):
    config = small_config("llama")
    config.save_pretrained(tmp_path)
    forms = [str(tmp_path), str(tmp_path / "config.json"), config, lambda: torch.nn.Linear(1, 1)]
    specs = [resolve_model(f) for f in forms]
    assert [s.family for s in specs] == ["llama", "llama", "llama", None]
    n = [sum(p.numel() for p in s.build().parameters()) for s in specs[:3]]
    assert n[0] == n[1] == n[2] > 0
    assert specs[0].max_seq_len == 2048 and specs[0].path == str(tmp_path)
    assert resolve_model("smollm2-135m").family == "llama" and resolve_model("tiny").family is None


def test_a_checkpoint_in_bf16_is_planned_with_fp32_weights(tmp_path):
    small_config("llama", dtype="bfloat16").save_pretrained(tmp_path)
    model = resolve_model(str(tmp_path)).build()
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bad_models_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        resolve_model("gpt-9")
    with pytest.raises(ValueError, match="holds no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="must be a config.json"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(TypeError, match="got int"):
        resolve_model(3)
    import transformers

    with pytest.raises(ValueError, match="causal language model"):
        resolve_model(transformers.ViTConfig())
    with pytest.raises(ValueError, match="unknown transformers family"):
        small_config("gpt-9")


def test_plan_of_a_folder_model_is_exact_on_the_cpu(tmp_path, corpus):
    small_config("mistral").save_pretrained(tmp_path)
    recipe = cm.Recipe()
    plan = planner.plan(str(tmp_path), 2, seq_len=64, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    model, opt = recipe.build(resolve_model(str(tmp_path)).build())
    step = cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=64, recipe=recipe)
    measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    assert plan.method == "trace" and plan.peak_bytes == measured.peak_bytes


def test_recommend_and_capacity_take_a_folder(tmp_path):
    small_config("phi3").save_pretrained(tmp_path)
    rec = cm.recommend(str(tmp_path), 1, seq_len=64, target="t4", mode="lora", method="analytic")
    assert rec.recipe.lora_targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert rec.plan.fits
    from colab_memopt import capacity

    fit = capacity.best_fit(str(tmp_path), mode="qlora", seq_len=64)
    assert fit.fits and fit.params == capacity.model_params(str(tmp_path)) > 0
    rows = capacity.capacity_table([str(tmp_path), "smollm2-135m"], seq_lens=(64,), modes=("full",), presets=("ckpt-every-2-paged",))
    assert rows[0]["largest_model"] == "smollm2-135m"


def test_full_checkpointing_at_long_sequences_is_exact_on_a_gqa_model(corpus):
    """Without a KV cache transformers probes the positions for packing; on fake tensors it cannot read them,
    assumed packing and built a (B, 1, T, T) mask (no causal kernel, keys repeated per head): +49% at 1024 tokens."""
    spec = resolve_model(small_config("llama"))  # 4 heads, 2 key-value heads
    recipe = cm.Recipe(checkpointing="full")
    plan = planner.plan(spec.build, 3, seq_len=1024, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    model, opt = recipe.build(spec.build())
    step = cm.make_train_step(model, opt, corpus, batch_size=3, seq_len=1024, recipe=recipe)
    measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    assert plan.method == "trace" and plan.peak_bytes == measured.peak_bytes
    from transformers import masking_utils

    assert masking_utils.find_packed_sequence_indices.__name__ == "find_packed_sequence_indices"  # restored after


def test_built_in_names_carry_their_checkpoints_dtype_and_plan_trainer_loads_them_so():
    """transformers 5 loads a checkpoint in its config's dtype when none is given: the built-in names carry the published
    config.json's torch_dtype (cuda-readiness-2, R6: SmolLM2-135M's LoRA plan held fp32 weights, 514.9 MiB)."""
    import torch
    from peft import LoraConfig
    from transformers import TrainingArguments

    import colab_memopt as cm

    for name, arch in architectures.ARCHITECTURES.items():
        expected = torch.float32 if name == "gpt2" else torch.bfloat16  # GPT-2's config.json names no dtype
        assert arch.hf_config().dtype == expected, name
    args = TrainingArguments("/tmp/cm_arch_dtype", per_device_train_batch_size=1, use_cpu=True, report_to=[])
    plan = cm.plan_trainer(args, model="smollm2-135m", lora=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]),
                           target="h100-80gb", seq_len=64)
    n_base = 134_515_008  # SmolLM2-135M's parameters (tied head counted once)
    lora = 30 * 8 * ((576 + 576) + (576 + 192))  # rank 8, 30 layers: q_proj 576->576, v_proj 576->192 (A and B)
    assert plan.by_category["parameters"] >= n_base * 2
    assert plan.by_category["parameters"] - n_base * 2 <= 4 * lora + 2**20, plan.by_category["parameters"]  # fp32 adapters


def test_a_config_objects_dtype_is_read_by_its_current_name(monkeypatch, tmp_path):
    """transformers 5 answers `config.torch_dtype` with "`torch_dtype` is deprecated! Use `dtype` instead!", which the
    example model of notebooks 18 and 19 printed (newcomer review 4): a config object is read as `dtype` only."""
    from colab_memopt.planning import hfconfig
    from colab_memopt.techniques.architectures import check_config

    config = small_config("llama")
    read = []
    monkeypatch.setattr(type(config), "torch_dtype", property(lambda self: read.append(1)), raising=False)
    check_config(config, "a llama config")
    resolve_model(config)
    hfconfig.save_example_chat_model("llama", tmp_path / "model")
    assert read == []
    # config.json's dict, and a config object without `dtype` (transformers before 4.56), still have `torch_dtype` checked
    with pytest.raises(ValueError, match="torch_dtype must name a torch dtype"):
        check_config({"hidden_size": 64, "torch_dtype": "float33"}, "config.json")
    old = type("OldConfig", (), {"hidden_size": 64, "torch_dtype": "float33"})()
    with pytest.raises(ValueError, match="torch_dtype must name a torch dtype"):
        check_config(old, "an old config")


def test_the_example_chat_models_tokenizer_has_a_word_for_every_id_of_the_model(tmp_path):
    """Notebook 19 asks the example model (random weights) for answers: an id its tokenizer had no token for decoded
    to nothing, and an answer of such ids came back empty (ids 3-31 of 128, once on the project's CI)."""
    from transformers import AutoConfig, AutoTokenizer

    from colab_memopt.planning import hfconfig

    folder = hfconfig.save_example_chat_model("llama", tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    assert len(tokenizer) == vocab_size
    silent = [i for i in range(vocab_size) if not tokenizer.decode([i], skip_special_tokens=True)]
    assert silent == sorted(tokenizer.all_special_ids), silent
    text = "".join(tokenizer.convert_ids_to_tokens([i for i in range(vocab_size) if i not in silent]))
    assert tokenizer(text)["input_ids"] == [i for i in range(vocab_size) if i not in silent]
