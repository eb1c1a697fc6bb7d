"""loading.quantized_load_bytes: what a 4-bit `from_pretrained` holds, planned from the checkpoint and measured.

The host side is measured on the CPU (bitsandbytes quantizes there too) in fresh processes by
benchmarks/qlora_load.py (VmHWM after a reset; the committed JSON is read here) and one small case runs here; the GPU
side is not measurable on this machine: its plan follows transformers' code path, whose one-tensor-at-a-time
behaviour is checked on the installed release below.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import transformers

import colab_memopt as cm
from colab_memopt.training import loading
from colab_memopt.training.loading import bnb_4bit_bytes, quantized_load_bytes

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "qlora_load.json"
_SPEC = importlib.util.spec_from_file_location("qlora_load", ROOT / "benchmarks" / "qlora_load.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)
MiB = 2**20
# a small Llama for the tests' own loads: 5M parameters, 10 MB in 16-bit
SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688, vocab_size=2048,
             tie_word_embeddings=False)


def test_the_installed_transformers_loads_one_tensor_at_a_time_when_it_quantizes(tmp_path, monkeypatch):
    """The claim the GPU plan rests on: with on-the-fly 4-bit quantization the installed loader starts no reading
    threads (so no full-precision tensors queue ahead of the quantizer); without quantization it does."""
    import concurrent.futures

    from transformers import core_model_loading

    folder = tmp_path / "ckpt"
    bench.write_checkpoint(folder, torch.bfloat16, 1, "2MB", SMALL)
    pools = []

    class Recording(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(kwargs.get("max_workers"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(core_model_loading, "ThreadPoolExecutor", Recording)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True),
                                         device_map={"": "cpu"})
    assert pools == [], "the installed transformers reads ahead in threads while quantizing"
    AutoModelForCausalLM.from_pretrained(folder, device_map={"": "cpu"})
    assert pools, "the check no longer sees transformers' reading threads"
    assert not quantized_load_bytes(str(folder), device="cuda").spikes


def test_the_8b_load_to_a_t4_is_planned_from_transformers_code_path():
    """Llama-3.1-8B in 4 bits on a T4 (fp16): the GPU holds the 4-bit weights, the fp16 embedding and head and one
    fp16 tensor being quantized; a release that reads in threads (5.0 to 5.3) is planned with the whole fp16 model
    there and told the setting that avoids it."""
    plan = quantized_load_bytes("llama-3.1-8b", device="cuda", dtype=torch.float16, transformers_version="5.23.0")
    config = cm.resolve_model("llama-3.1-8b").config
    head = config.vocab_size * config.hidden_size
    mlp = config.intermediate_size * config.hidden_size
    assert plan.transient_tensor.endswith("mlp.gate_proj.weight") and plan.transient_bytes == mlp * 2
    assert plan.device_bytes == plan.quantized_bytes + plan.kept_bytes + mlp * 2
    assert 2 * head * 2 < plan.kept_bytes < 2 * head * 2 + 2 * MiB  # embedding, head, norms in fp16
    assert plan.device_bytes < cm.T4_USABLE_BYTES and not plan.spikes and not plan.fix
    # host: the bf16 embedding cast to fp16 on the host as it is copied (torch casts host-to-GPU copies on the host)
    assert plan.host_anon_bytes == head * 2 + loading.QLORA_LOAD_OVERHEAD_BYTES < cm.COLAB_HOST_RAM_BYTES
    old = quantized_load_bytes("llama-3.1-8b", device="cuda", dtype=torch.float16, transformers_version="5.3.0")
    assert old.spikes and old.device_bytes > cm.T4_USABLE_BYTES  # transformers#43032: OOM on a 16 GB card
    assert "HF_DEACTIVATE_ASYNC_LOAD" in old.fix and "transformers>=5.4" in old.fix
    for text in (str(plan), str(old)):
        assert max(len(line) for line in text.splitlines()) <= 100 and text.startswith("4-bit load of llama-3.1-8b")


def test_4bit_bytes_follow_bitsandbytes_layout():
    import bitsandbytes as bnb

    for shape, double in (((96, 64), False), ((160, 64), True), ((7, 9), False)):
        w = bnb.nn.Params4bit(torch.randn(shape, dtype=torch.float16), requires_grad=False,
                              compress_statistics=double, quant_type="nf4").to("cpu")
        qs = w.quant_state
        held = w.numel() * w.element_size() + qs.absmax.numel() * qs.absmax.element_size()
        if double:
            held += qs.state2.absmax.numel() * qs.state2.absmax.element_size() + qs.state2.code.numel() * 4
        assert bnb_4bit_bytes(math.prod(shape), double) == held, shape


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"device must be 'cuda' or 'cpu', got 'gpu'"):
        quantized_load_bytes("smollm2-135m", device="gpu")
    with pytest.raises(ValueError, match=r"dtype must be None, torch.float16, torch.bfloat16 or torch.float32, got "
                                         r"torch.int8"):
        quantized_load_bytes("smollm2-135m", dtype=torch.int8)


@pytest.mark.parametrize("ckpt,dtype", [(torch.bfloat16, torch.float16), (torch.float16, None)])
def test_a_small_4bit_load_measured_in_a_fresh_process_is_within_the_plan(tmp_path, ckpt, dtype):
    """A random Llama in 4+ shards loaded in 4 bits to the CPU with the heap limited (the way that does not keep freed
    copies): its VmHWM and sampled allocated peak are within the plan; the 4-bit weights are bitsandbytes' own."""
    name = str(ckpt).removeprefix("torch.")
    folder = tmp_path / "ckpt"
    bench.write_checkpoint(folder, ckpt, 4, "2MB", SMALL)
    bench.write_checkpoint(tmp_path / "warm", ckpt, 1, "2MB", SMALL)
    assert len(list(folder.glob("*.safetensors"))) >= 4
    row = bench.measure(folder, tmp_path / "warm", str(dtype).removeprefix("torch.") if dtype else None, "limited")
    plan = quantized_load_bytes(str(folder), device="cpu", dtype=dtype)
    print(f"{name} -> {dtype}: measured +{row['added_bytes'] / MiB:.1f} MiB ({row['anon_added_bytes'] / MiB:.1f} "
          f"allocated), planned {plan.host_bytes / MiB:.1f} MiB ({plan.host_anon_bytes / MiB:.1f})")
    assert row["quantized_bytes"] == plan.quantized_bytes and row["kept_bytes"] == plan.kept_bytes
    assert row["added_bytes"] <= plan.host_bytes and row["anon_added_bytes"] <= plan.host_anon_bytes
    assert row["anon_added_bytes"] >= plan.quantized_bytes  # the measurement sees the load


def test_the_committed_measurements_are_within_the_plan_and_say_where_they_are_not():
    """benchmarks/qlora_load.py on this CPU: with the heap limited, every installed-release load is within its plan
    (VmHWM and the allocated part); glibc's default heap keeps more, which the limit removes; a release that reads in
    threads piles cast copies up, and HF_DEACTIVATE_ASYNC_LOAD=1 removes that. The plans are today's code's."""
    result = json.loads(RESULT.read_text())
    rows = result["measured"]
    installed = {k: r for k, r in rows.items() if r["transformers"] == transformers.__version__}
    assert {r["heap"] for r in installed.values()} == {"default", "limited"} and len(installed) == 6
    for label, row in installed.items():
        assert row["quantized_bytes"] == row["planned"]["cpu"]["quantized_bytes"], label
        if row["heap"] == "limited":
            assert row["plan_covers_peak"] and row["plan_covers_allocated"], label
            default = installed[label.replace("heap limited", "heap default")]
            assert row["anon_added_bytes"] <= default["anon_added_bytes"], label
    # today's plan of the committed shape, from the config (the temporary checkpoints are gone): the same figures
    shape = dict(result["shape"])
    shape.pop("max_shard_size")
    for ckpt, dtype in bench.CASES:
        config = transformers.LlamaConfig(**shape, dtype=ckpt)
        plan = quantized_load_bytes(config, device="cpu", dtype=getattr(torch, dtype) if dtype else None)
        (row,) = [r for k, r in installed.items() if k.startswith(f"{ckpt} checkpoint, dtype={dtype or 'auto'}, "
                                                                  "heap limited")]
        assert plan.host_bytes == row["planned"]["cpu"]["host_bytes"], (ckpt, dtype)
    threaded = {k: r for k, r in rows.items() if r["transformers"].startswith("5.3")}
    if threaded:  # written with --transformers-path: the release before one-at-a-time loading
        plain = [r for k, r in threaded.items() if "HF_DEACTIVATE_ASYNC_LOAD" not in k]
        fixed = [r for k, r in threaded.items() if "HF_DEACTIVATE_ASYNC_LOAD" in k]
        assert plain and fixed and plain[0]["planned"]["cpu"]["spikes"]
        assert fixed[0]["anon_added_bytes"] < plain[0]["anon_added_bytes"]
        assert fixed[0]["plan_covers_allocated"] and plain[0]["plan_covers_allocated"]
    eight_b = result["llama_3_1_8b_to_a_gpu_in_fp16"][transformers.__version__]
    assert eight_b["device_bytes"] == quantized_load_bytes("llama-3.1-8b", device="cuda",
                                                           dtype=torch.float16).device_bytes
    assert result["gpu_measured"].startswith("not measurable here")
