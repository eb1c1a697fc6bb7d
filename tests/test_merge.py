"""colab_memopt.training.merge: a LoRA adapter merged into its base one tensor at a time, from the files.

The merged folder is compared with peft's own `merge_and_unload()` weight for weight and logit for logit, on random
multi-shard Llamas in bf16 and fp16 (and a GPT-2 for fan_in_fan_out); its host peak is measured in a fresh process
(the kernel's high-water mark, VmHWM, reset before the merge) against `merge_bytes`' plan.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import colab_memopt as cm
from colab_memopt.training import merge
from colab_memopt.training.merge import merge_adapter, merge_bytes, read_header

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _llama(tied: bool = False, **kw) -> transformers.LlamaConfig:
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tied)
    return transformers.LlamaConfig(**{**fields, **kw})


def _base(folder: Path, config, dtype: torch.dtype, shard: str = "60KB") -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder, max_shard_size=shard)
    return folder


def _adapter(base: Path, folder: Path, adapter_dtype: torch.dtype | None = None, **lora) -> Path:
    """Save a LoRA adapter of `base` with random, nonzero A and B (init_lora_weights=False), as peft saves it."""
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": "all-linear",
                                                     "init_lora_weights": False, **lora}))
    if adapter_dtype is not None:  # as TRL leaves the adapters of a 4-bit run: in bf16
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(adapter_dtype)
    peft_model.save_pretrained(folder)
    return folder


def _peft_merged(base: Path, adapter: Path, dtype: torch.dtype) -> torch.nn.Module:
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload()


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _assert_same_model(reference: torch.nn.Module, folder: Path, vocab: int) -> None:
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ref, got = reference.state_dict(), merged.state_dict()
    assert sorted(ref) == sorted(got)
    for key in ref:  # exactly: the same fp32 update, added in fp32, rounded once
        assert ref[key].dtype == got[key].dtype and torch.equal(ref[key], got[key]), key
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, merged(ids).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_merged_folder_equals_peft_merge_and_unload_weight_for_weight(tmp_path, dtype):
    base = _base(tmp_path / "base", _llama(), dtype)
    assert len(list(base.glob("*.safetensors"))) >= 3
    adapter = _adapter(base, tmp_path / "adapter")
    before = {**_digest(base), **{f"adapter/{k}": v for k, v in _digest(adapter).items()}}
    result = merge_adapter(base, adapter, tmp_path / "merged")
    reference = _peft_merged(base, adapter, dtype)
    _assert_same_model(reference, tmp_path / "merged", 128)
    original = transformers.AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(original.model.layers[0].mlp.down_proj.weight,
                           reference.model.layers[0].mlp.down_proj.weight), "the adapter changed nothing"
    assert {**_digest(base), **{f"adapter/{k}": v for k, v in _digest(adapter).items()}} == before, "inputs changed"
    assert result.updated == 3 * 7 and result.shards == len(list(base.glob("*.safetensors")))
    assert sorted(p.name for p in (tmp_path / "merged").glob("*.safetensors")) == sorted(p.name for p in base.glob("*.safetensors"))
    assert json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())["weight_map"] == \
        json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    assert (tmp_path / "merged" / "generation_config.json").is_file()
    assert max(len(line) for line in str(result).splitlines() if str(tmp_path) not in line) <= 100


def test_a_bf16_base_merged_into_fp16_equals_loading_it_in_fp16_and_merging(tmp_path):
    """dtype=torch.float16 on a bf16 base: what from_pretrained(dtype=float16) then merge_and_unload() gives, with
    the adapters TRL leaves in bf16 (peft loads them in fp32); config.json says float16."""
    base = _base(tmp_path / "base", _llama(), torch.bfloat16)
    adapter = _adapter(base, tmp_path / "adapter", adapter_dtype=torch.bfloat16)
    assert {e.dtype for e in read_header(adapter / "adapter_model.safetensors")[0]} == {"BF16"}
    result = merge_adapter(base, adapter, tmp_path / "merged", dtype="float16")
    _assert_same_model(_peft_merged(base, adapter, torch.float16), tmp_path / "merged", 128)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "float16"
    assert result.dtype == "float16"


def test_rslora_rank_and_alpha_patterns_an_embedding_and_modules_to_save_merge_as_peft_does(tmp_path):
    base = _base(tmp_path / "base", _llama(), torch.float16)
    adapter = _adapter(base, tmp_path / "adapter", use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj",
                                                                                     "embed_tokens"],
                       rank_pattern={"down_proj": 4}, alpha_pattern={"v_proj": 3}, modules_to_save=["lm_head"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["use_rslora"] and config["rank_pattern"] == {"down_proj": 4}
    result = merge_adapter(base, adapter, tmp_path / "merged")
    _assert_same_model(_peft_merged(base, adapter, torch.float16), tmp_path / "merged", 128)
    assert result.replaced >= 1  # the trained lm_head copy


def test_gpt2_fan_in_fan_out_and_lora_bias_merge_as_peft_does(tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=32)
    base = _base(tmp_path / "base", config, torch.float16, shard="40KB")
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                       lora_bias=True)
    merge_adapter(base, adapter, tmp_path / "merged")
    _assert_same_model(_peft_merged(base, adapter, torch.float16), tmp_path / "merged", 96)


def test_what_cannot_be_merged_is_refused_by_name(tmp_path):
    base = _base(tmp_path / "base", _llama(), torch.float16)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj"])

    def variant(name: str, **fields) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
        config = json.loads((adapter / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **fields}))
        return folder

    with pytest.raises(ValueError, match=r"DoRA \(use_dora=True\) is a LoRA variant merge_adapter does not merge"):
        merge_adapter(base, variant("dora", use_dora=True), tmp_path / "out")
    with pytest.raises(ValueError, match=r"peft_type is 'IA3'; merge_adapter merges LoRA"):
        merge_adapter(base, variant("ia3", peft_type="IA3"), tmp_path / "out")
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight' \(8, 64\) and .* are not a rank-4 pair"):
        merge_adapter(base, variant("rank", r=4), tmp_path / "out")
    # an adapter of a wider model: the shapes do not match, named
    other = _base(tmp_path / "other", _llama(hidden_size=96, num_attention_heads=4), torch.float16)
    with pytest.raises(ValueError, match=r"make a \(96, 96\) update, the base's 'model.layers.0.self_attn.q_proj.weight' "
                                         r"is \(64, 64\)"):
        merge_adapter(base, _adapter(other, tmp_path / "wide", target_modules=["q_proj"]), tmp_path / "out")
    # an adapter on modules this base does not have
    gpt2 = _base(tmp_path / "gpt2", transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=96), torch.float16)
    with pytest.raises(ValueError, match=r"adapts 'transformer.h.0.attn.c_attn' .* no tensor 'transformer.h.0.attn."
                                         r"c_attn.weight'"):
        merge_adapter(base, _adapter(gpt2, tmp_path / "gpt2_adapter", target_modules=["c_attn"]), tmp_path / "out")
    # a 4-bit base folder (save_pretrained of a bitsandbytes model writes its quantization_config)
    quant = tmp_path / "quant"
    quant.mkdir()
    for p in base.iterdir():
        (quant / p.name).write_bytes(p.read_bytes())
    config = json.loads((base / "config.json").read_text())
    (quant / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ValueError, match=r"quantization_config \(bitsandbytes\): the base is quantized"):
        merge_adapter(quant, adapter, tmp_path / "out")
    with pytest.raises(ValueError, match=r"out_dir .* is the base's folder"):
        merge_adapter(base, adapter, base)
    with pytest.raises(ValueError, match=r"dtype must be None \(keep the base's\), 'float16', 'bfloat16' or 'float32', "
                                         r"got 'int8'"):
        merge_adapter(base, adapter, tmp_path / "out", dtype="int8")
    with pytest.raises(ValueError, match=r"holds no adapter_config.json"):
        merge_adapter(base, base, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "a refused merge wrote files"


def test_a_merged_folder_is_not_overwritten_unless_asked_and_old_weights_go(tmp_path):
    base = _base(tmp_path / "base", _llama(), torch.float16)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    out = tmp_path / "merged"
    merge_adapter(base, adapter, out)
    with pytest.raises(ValueError, match=r"holds a model already \(its config.json\): pass overwrite=True"):
        merge_adapter(base, adapter, out)
    (out / "model.safetensors").write_bytes(b"an older single-file model")  # would shadow the index on loading
    merge_adapter(base, adapter, out, overwrite=True)
    assert not (out / "model.safetensors").exists()
    _assert_same_model(_peft_merged(base, adapter, torch.float16), out, 128)


_KILLED = """
import os, signal, sys
from colab_memopt.training import merge
calls = [0]
write = merge._write_bytes
def write_then_die(f, t):
    write(f, t)
    calls[0] += 1
    if calls[0] == int(sys.argv[4]):
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # as the runtime's out-of-memory killer or a closed tab would
merge._write_bytes = write_then_die
merge.merge_adapter(sys.argv[1], sys.argv[2], sys.argv[3])
"""


def test_a_killed_merge_leaves_no_half_written_shard_under_its_name_and_no_config(tmp_path):
    base = _base(tmp_path / "base", _llama(), torch.float16)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    shards = sorted(base.glob("*.safetensors"))
    first = len(read_header(shards[0])[0])
    out = tmp_path / "merged"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _KILLED, str(base), str(adapter), str(out), str(first + 2)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -9, run.stderr[-2000:]
    whole = sorted(p.name for p in out.glob("*.safetensors"))
    assert whole == [shards[0].name], "the shard being written is under its final name"
    assert list(out.glob(f".{shards[1].name}.*.partial")), "the half-written shard is not in its temporary file"
    assert not (out / "config.json").exists(), "a half-merged folder looks like a whole model"
    from safetensors import safe_open

    with safe_open(str(out / whole[0]), "pt") as f:
        assert len(list(f.keys())) == first
    merge_adapter(base, adapter, out)  # no config.json: the unfinished merge is redone without overwrite=True
    _assert_same_model(_peft_merged(base, adapter, torch.float16), out, 128)


def test_a_hub_id_is_downloaded_by_its_index_shards_only(tmp_path, monkeypatch):
    import huggingface_hub

    base = _base(tmp_path / "base", _llama(), torch.float16)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    calls = []

    def hf_hub_download(repo_id, filename, **kwargs):
        calls.append(("file", repo_id, filename))
        return str(base / filename)

    def snapshot_download(repo_id, **kwargs):
        calls.append(("snapshot", repo_id, kwargs["allow_patterns"]))
        return str(base)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    merge_adapter("some-org/some-model", adapter, tmp_path / "merged")
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert calls[0] == ("file", "some-org/some-model", "model.safetensors.index.json")
    kind, repo, patterns = calls[1]
    assert kind == "snapshot" and set(shards) < set(patterns) and "config.json" in patterns
    assert not any(p.endswith(".bin") or p == "*.safetensors" for p in patterns)  # no consolidated or .bin copies


# -- host RAM: measured in a fresh process against the plan ---------------------------------------------------------

# About 24M parameters in many small tensors: 46 MB in bf16 in shards of about 16 MB, its largest tensor 0.34 MiB.
MID = dict(hidden_size=256, num_hidden_layers=32, intermediate_size=688, vocab_size=1024, num_attention_heads=4,
           num_key_value_heads=2)

_MEASURE = """
import ctypes, json, re, sys
from pathlib import Path
import torch
from colab_memopt.training.merge import merge_adapter
status = lambda key: int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
base, adapter, out, dtype = sys.argv[1:5]
dtype = None if dtype == "None" else getattr(torch, dtype)
merge_adapter(base, adapter, out + "_warm", dtype=dtype)  # warm-up: every import and allocation pool the merge uses
ctypes.CDLL("libc.so.6").malloc_trim(0)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
before = status("VmRSS")
merge_adapter(base, adapter, out, dtype=dtype)
print(json.dumps({"added_bytes": status("VmHWM") - before}))
"""


def _mid(folder: Path, dtype: torch.dtype, shard_bytes: int = 16_000_000) -> Path:
    """A 46 MB random llama checkpoint written directly (random init and save_pretrained take seconds here)."""
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**MID)
    with torch.device("meta"):
        names = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).state_dict()
    g = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for key, meta in names.items():
        t = (torch.randn(meta.shape, generator=g) * 0.02).to(dtype)
        if shards[-1] and sum(v.nbytes for v in shards[-1].values()) + t.nbytes > shard_bytes:
            shards.append({})
        shards[-1][key] = t
    folder.mkdir(parents=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)
    return folder


def _mid_adapter(base: Path, folder: Path, r: int = 8) -> tuple[Path, list[str], int]:
    """A rank-r adapter on every Linear but the head, A and B random, in fp32 as peft saves it (written directly)."""
    from safetensors.torch import save_file

    state, adapted = {}, []
    g = torch.Generator().manual_seed(1)
    for name, dtype, shape in merge.folder_tensors(base):
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            module = name.removesuffix(".weight")
            state[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, shape[1], generator=g) * 0.01
            state[f"base_model.model.{module}.lora_B.weight"] = torch.randn(shape[0], r, generator=g) * 0.01
            adapted.append(name)
    folder.mkdir(parents=True)
    save_file(state, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                            "target_modules": "all-linear"}))
    return folder, adapted, sum(t.nbytes for t in state.values())


@pytest.mark.parametrize("dtype,into", [(torch.bfloat16, None), (torch.bfloat16, torch.float16)])
def test_the_host_peak_measured_in_a_fresh_process_is_within_the_plan_and_under_one_shard(tmp_path, dtype, into):
    base = _mid(tmp_path / "base", dtype)
    adapter, adapted, adapter_bytes = _mid_adapter(base, tmp_path / "adapter")
    shard = max(p.stat().st_size for p in base.glob("*.safetensors"))
    assert len(list(base.glob("*.safetensors"))) >= 3
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_MEASURE), str(base), str(adapter),
                          str(tmp_path / "merged"), str(into).removeprefix("torch.")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])["added_bytes"]
    plan = merge_bytes(merge.folder_tensors(base), adapted, adapter_bytes, into, "headers")
    print(f"merge {dtype} -> {into}: measured +{measured / MiB:.1f} MiB, planned {plan.host_bytes / MiB:.1f} MiB "
          f"(adapter {adapter_bytes / MiB:.1f}, working set {plan.working_bytes / MiB:.2f} of {plan.working_tensor}); "
          f"largest shard {shard / MiB:.1f} MiB")
    assert measured <= plan.host_bytes, "the merge held more than its plan"
    assert measured < shard, "the merge held a shard or more"
    assert plan.disk_bytes == sum(p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little")
                                  for p in (tmp_path / "merged").glob("*.safetensors"))


# -- merge_cost: the plan a user reads ------------------------------------------------------------------------------

def test_merge_cost_of_llama_3_1_8b_shard_by_shard_fits_colab_and_states_its_disk():
    cost = cm.merge_cost("llama-3.1-8b", torch.float16, r=16)
    plan = cost.shard_by_shard
    assert cost.peak_bytes > cm.COLAB_HOST_RAM_BYTES  # merge_and_unload: the 16-bit model whole
    assert plan.host_bytes < cm.COLAB_HOST_RAM_BYTES / 10
    assert plan.disk_bytes == cost.weights_bytes  # the merged folder: every weight in float16
    # the worst tensor is an MLP projection (14336 x 4096): bf16 read and cast to fp16, then its fp32 update
    n = 14336 * 4096
    assert plan.working_tensor.endswith("mlp.gate_proj.weight") and plan.working_bytes == n * (2 + 4)
    assert plan.adapter_bytes == cost.adapter_bytes
    assert plan.source == "assumed: the config's shapes in bfloat16 (as published)"
    text = str(cost)
    assert "shard by shard (cm.merge_adapter)" in text and "of disk" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_merge_cost_of_a_folder_reads_the_shards_headers(tmp_path):
    base = _base(tmp_path / "base", _llama(), torch.bfloat16)
    cost = cm.merge_cost(str(base), torch.float16, r=8)
    tensors = merge.folder_tensors(base)
    assert cost.shard_by_shard.source.startswith("the headers of the safetensors files in")
    assert cost.shard_by_shard.disk_bytes == sum(math.prod(s) * 2 for _, _, s in tensors)
    assert cost.shard_by_shard == merge_bytes(tensors, [n for n, _, s in tensors if n.endswith("proj.weight")],
                                              cost.adapter_bytes, torch.float16, cost.shard_by_shard.source)
