"""load_model: weights the test writes itself (save_pretrained of a small random model), peak RSS measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import colab_memopt as cm
from colab_memopt import loading
from colab_memopt.techniques.architectures import small_config

ROOT = Path(__file__).resolve().parent.parent
# About 26M parameters: 100 MiB of fp32 weights, well above the noise of a process's RSS.
MID = dict(hidden_size=512, num_hidden_layers=6, intermediate_size=1376, vocab_size=16384, num_attention_heads=8,
           num_key_value_heads=4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A llama checkpoint of about 100 MiB in fp32, saved with save_pretrained."""
    return loading.save_random_model(small_config("llama", **MID), tmp_path_factory.mktemp("model"))


def _run(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_load_model_needs_less_host_ram_than_the_classic_load(saved):
    """Each load in a fresh process: peak RSS added by the load, sampled by measure.HostPeak."""
    lean = _run(f"""
        import json, colab_memopt as cm
        loaded = cm.load_model({str(saved)!r}, cm.Recipe(), "cpu")
        x = sum(float(p.float().sum()) for p in loaded.model.parameters())  # touch every weight
        print(json.dumps({{"added": loaded.host_added_bytes, "random": loaded.random_weights}}))
    """)
    classic = _run(f"""
        import json, torch, transformers
        from colab_memopt.core.measure import HostPeak
        from safetensors.torch import load_file
        with HostPeak() as host:
            config = transformers.AutoConfig.from_pretrained({str(saved)!r})
            model = transformers.AutoModelForCausalLM.from_config(config)   # random fp32 weights, allocated
            state = load_file({str(saved)!r} + "/model.safetensors")        # the whole state dict beside them
            state = {{k: v.clone() for k, v in state.items()}}
            model.load_state_dict(state, strict=False)
        print(json.dumps({{"added": host.added_bytes}}))
    """)
    plan = loading.load_host_bytes(str(saved), device="cpu")
    weights = plan.params * 4
    print(f"params {plan.params}, classic load +{classic['added']} B, load_model +{lean['added']} B, planned {plan.host_bytes} B")
    assert not lean["random"]
    assert classic["added"] > 1.7 * weights  # fp32 random init + the state dict: about twice the weights
    assert lean["added"] < 0.5 * classic["added"]
    assert plan.classic_host_bytes == pytest.approx(plan.params * 4 + plan.checkpoint_bytes)
    assert lean["added"] <= plan.host_bytes * 1.1  # the plan bounds what the lean path took


def test_lora_on_the_cpu_trains_fp32_adapters_with_the_family_targets(saved, corpus):
    loaded = cm.load_model(str(saved), cm.Recipe(lora_rank=4), "cpu")
    assert loaded.recipe.lora_targets[0] == "q_proj" and loaded.dtype == torch.float32
    trainable = [p for p in loaded.model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    step = cm.make_train_step(loaded.model, loaded.optimizer, corpus, batch_size=2, seq_len=32, recipe=loaded.recipe)
    losses = [step() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert "host RAM peak" in str(loaded)


def test_qlora_on_the_cpu_quantizes_to_4_bit(saved):
    import bitsandbytes as bnb

    loaded = cm.load_model(str(saved), cm.Recipe(lora_rank=4, quantization="nf4"), "cpu")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in loaded.model.modules())
    assert "doctor" and "fp16-trainable-params" not in cm.doctor(loaded.model, loaded.optimizer, loaded.recipe, target="t4", seq_len=32, method="analytic")


def test_load_dtype_per_device_and_mode():
    lora, full = cm.Recipe(lora_rank=4), cm.Recipe()
    assert loading.load_dtype(lora, "cuda", native_bf16=False) == torch.float16  # a T4: frozen base in fp16
    assert loading.load_dtype(lora, "cuda", native_bf16=True) == torch.bfloat16
    assert loading.load_dtype(full, "cuda") == torch.float32  # trained weights stay fp32 master weights
    assert loading.load_dtype(lora, "cpu") == torch.float32


def test_the_plan_holds_the_host_ram_of_loading(saved):
    p = cm.plan(str(saved), 1, seq_len=64, target="t4", method="analytic", find_max_batch=False)
    load = [c for c in p.host_costs if c.name == "loading weights"]
    assert len(load) == 1 and load[0].bytes == loading.load_host_bytes(str(saved), device="cuda").host_bytes
    assert "loading weights" not in [c.name for c in cm.plan("tiny", 1, seq_len=32, find_max_batch=False).host_costs]


def test_a_config_without_weights_loads_random_weights_and_says_so(tmp_path):
    small_config("gpt_neox").save_pretrained(tmp_path)
    loaded = cm.load_model(str(tmp_path), device="cpu")
    assert loaded.random_weights and "random weights" in str(loaded)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="DeepSpeed"):
        cm.load_model("smollm2-135m", cm.Recipe(zero_stage=2))
    with pytest.raises(ValueError, match="reference model or a factory"):
        cm.load_model("tiny", device="cpu")
    with pytest.raises(ValueError, match="unknown model"):
        cm.load_model("gpt-9", device="cpu")


def test_save_trained_writes_adapters_or_the_model(saved, tmp_path):
    loaded = cm.load_model(str(saved), cm.Recipe(lora_rank=4), "cpu")
    files = [p.name for p in loading.save_trained(loaded.model, tmp_path / "adapter", loaded.recipe)]
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert state and all("lora_" in k for k in state)
    small = tmp_path / "small"
    loading.save_random_model(small_config("qwen2"), small)
    full = cm.load_model(str(small), cm.Recipe(), "cpu")
    assert "config.json" in [p.name for p in loading.save_trained(full.model, tmp_path / "full", full.recipe)]
