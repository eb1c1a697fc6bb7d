"""The doctor: each finding produced by building its pitfall for real, and absent on a healthy setup."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import colab_memopt as cm
from colab_memopt.planning.doctor import CODES, QLORA_MIN_SAVING, deepspeed_ops, doctor
from colab_memopt import env, loading
from colab_memopt.tooling.cli import main as cli
from colab_memopt.techniques.architectures import small_config
from colab_memopt.techniques.quantization import add_lora

CPU_BIG = {"name": "cpu-big", "device_bytes": 64 * 2**30, "host_bytes": 256 * 2**30, "cuda": False}
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_model(layers: int = 2):
    import transformers

    return transformers.AutoModelForCausalLM.from_config(small_config("llama", num_hidden_layers=layers))


def _lora_model(layers: int = 2):
    return add_lora(_hf_model(layers), 4, targets=LLAMA_TARGETS).train()


def test_a_healthy_lora_setup_has_no_finding(corpus):
    recipe = cm.Recipe(lora_rank=4, lora_targets=LLAMA_TARGETS, checkpointing="full", precision="fp16-autocast")
    model, opt = recipe.build(_hf_model())
    result = doctor(model, opt, recipe, target="t4", seq_len=64)
    assert result.codes == [] and result.ok, str(result)
    assert set(result.checked) == set(CODES)
    assert "no pitfall found" in str(result)


def test_bf16_on_a_t4_is_found_and_not_on_an_ampere_target(tmp_path):
    small_config("qwen2").save_pretrained(tmp_path)
    recipe = cm.Recipe(precision="bf16-autocast")
    assert "bf16-not-native" in doctor(str(tmp_path), recipe=recipe, target="t4", seq_len=64)
    assert "bf16-not-native" not in doctor(str(tmp_path), recipe=recipe, target="l4", seq_len=64)
    assert "bf16-not-native" not in doctor(str(tmp_path), recipe=cm.Recipe(precision="fp16-autocast"), target="t4", seq_len=64)
    model = cm.build_model("tiny").to(torch.bfloat16)  # bf16 weights, whatever the recipe
    found = doctor(model, target="t4", seq_len=32)
    assert "bf16-not-native" in found and "parameters stored in bfloat16" in str(found)


def test_target_auto_reads_this_gpus_capability(monkeypatch, tmp_path):
    """On a CPU, emulate a T4 (capability 7.5) and an A100 (8.0) behind target='auto'."""
    small_config("llama").save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=cm.T4_USABLE_BYTES))
    monkeypatch.setattr(env, "gpu_name", lambda d=None: "Tesla T4")
    recipe = cm.Recipe(precision="bf16-autocast")
    for capability, expected in (((7, 5), True), ((8, 0), False)):
        monkeypatch.setattr(env, "compute_capability", lambda d=None, c=capability: c)
        result = doctor(str(tmp_path), recipe=recipe, target="auto", seq_len=64, method="analytic")
        assert ("bf16-not-native" in result) is expected and result.target == "Tesla T4"


def test_fp16_trainable_parameters_fail_the_step_and_are_found_before_it(corpus):
    recipe = cm.Recipe(lora_rank=4, lora_targets=LLAMA_TARGETS, precision="fp16-autocast")
    model = _lora_model().half()  # the pitfall: the whole model, adapters included, in fp16
    opt = cm.make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    found = doctor(model, opt, recipe, target="t4", seq_len=32)
    assert "fp16-trainable-params" in found
    step = cm.make_train_step(model, opt, corpus, batch_size=1, seq_len=16, recipe=recipe)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        step()
    # The fix: frozen base in fp16, adapters in fp32; the same step trains.
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    opt = cm.make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    assert "fp16-trainable-params" not in doctor(model, opt, recipe, target="t4", seq_len=32)
    step = cm.make_train_step(model, opt, corpus, batch_size=1, seq_len=16, recipe=recipe)
    assert step() > 0


def _reentrant(model, every_n_layers=1):
    """Checkpoint the blocks as transformers before 4.35 did by default: reentrant, no input-grad hook."""
    model._set_gradient_checkpointing(enable=True, every_n_layers=every_n_layers,
                                      gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=True))
    return model


def test_lora_with_reentrant_checkpointing_leaves_adapters_untrained(corpus):
    model = _reentrant(_lora_model(layers=2), every_n_layers=2)  # block 0 checkpointed, block 1 not
    opt = cm.make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    before = doctor(model, opt, cm.Recipe(lora_rank=4, lora_targets=LLAMA_TARGETS), target=CPU_BIG, seq_len=32)
    assert {"checkpointing-frozen-inputs", "adapters-not-training"} <= set(before.codes), str(before)
    assert all(p.grad is None for p in model.parameters())  # the probe step left no gradient behind
    # For real: one training step runs without an error, and block 0's adapters get no gradient.
    step = cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=32)
    step()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing and all("layers.0." in n for n in missing)
    after = doctor(model, opt, target=CPU_BIG, seq_len=32)
    assert "adapters-not-training" in after
    assert set(after.findings[after.codes.index("adapters-not-training")].details["missing"]) == set(missing)
    # The fix: inputs that require grad; every adapter trains.
    model.enable_input_require_grads()
    opt.zero_grad(set_to_none=True)  # the last step's gradients are from before the fix: probe afresh
    assert not {"checkpointing-frozen-inputs", "adapters-not-training"} & set(
        doctor(model, opt, target=CPU_BIG, seq_len=32, probe=True).codes)
    step()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_plan_that_does_not_fit_names_the_recommender_whose_recipe_fits(tmp_path):
    small_config("llama", num_hidden_layers=4).save_pretrained(tmp_path)
    need = cm.plan(str(tmp_path), 1, seq_len=128, target=CPU_BIG, find_max_batch=False).peak_bytes
    small = {"name": "small-gpu", "device_bytes": int(need * 0.75), "host_bytes": 256 * 2**30, "cuda": False}
    result = doctor(str(tmp_path), target=small, seq_len=128, headroom=0.0)
    assert "does-not-fit" in result
    finding = result.findings[result.codes.index("does-not-fit")]
    # named, not run: the recommender plans one candidate after another, each a trace of its own
    assert f"cm.recommend({str(tmp_path)!r}, 1, seq_len=128" in finding.fix and "recommended" not in finding.details
    assert result.plan.device_need_bytes == finding.details["need_bytes"] > result.plan.device_limit_bytes
    fixed = cm.recommend(str(tmp_path), 1, seq_len=128, target=small, headroom=0.0).recipe
    assert "does-not-fit" not in doctor(str(tmp_path), recipe=fixed, target=small, seq_len=128, headroom=0.0)
    assert "does-not-fit" not in doctor(str(tmp_path), target=CPU_BIG, seq_len=128)


def test_host_ram_too_small_for_the_classic_load(tmp_path):
    import gc

    # a vocabulary large enough that the two loads' needs lie 75 MB apart: this process's RSS, read here and again
    # by the doctor, moves by MBs between the two reads in a long test worker (8,192 tokens put them 27 MB apart: flaky)
    folder = loading.save_random_model(small_config("llama", hidden_size=256, num_hidden_layers=4, vocab_size=32768,
                                                    intermediate_size=688), tmp_path / "model")
    load = loading.load_host_bytes(str(folder), device="cuda")
    gc.collect()
    rss = cm.host_memory().rss_bytes
    # host RAM between the lean path's need and the classic path's (with headroom 0)
    host = rss + (load.host_bytes + load.classic_host_bytes) // 2
    gpu = {"name": "small-host", "device_bytes": 16 * 2**30, "host_bytes": host, "cuda": True}
    result = doctor(str(folder), target=gpu, seq_len=64, headroom=0.0, method="analytic")
    assert "host-ram-load" in result
    finding = result.findings[result.codes.index("host-ram-load")]
    assert finding.severity == "warning" and "load_model" in finding.fix
    assert "host-ram-load" not in doctor(str(folder), target=dict(gpu, host_bytes=256 * 2**30), seq_len=64,
                                             method="analytic")


QLORA_8B = cm.Recipe(precision="fp16-autocast", quantization="nf4", lora_rank=16, base_dtype="fp16",
                    checkpointing="full")


def test_an_8b_qlora_load_is_checked_as_transformers_quantizes_it_and_fits_colab():
    """newcomer-review-4 finding 1: the doctor said Llama-3.1-8B could not be loaded on Colab (one fp32 shard
    assumed). A 4-bit load quantizes tensor by tensor on the GPU: its host and device peak are
    loading.quantized_load_bytes', from the published layout (bf16, the published config's shapes)."""
    found = doctor("llama-3.1-8b", recipe=QLORA_8B, target="t4", batch=4, seq_len=1024, method="analytic")
    assert "host-ram-load" in found.checked and "host-ram-load" not in found, str(found)
    load = loading.quantized_load_bytes("llama-3.1-8b", dtype=torch.float16)
    t4 = cm.targets.TARGETS["t4"]
    assert load.checkpoint_dtype == "bfloat16" and not load.spikes
    assert load.device_bytes + t4.cuda_context_bytes <= t4.usable_bytes()
    assert cm.host_memory().rss_bytes + load.host_anon_bytes <= t4.host_usable_bytes()
    # LoRA on a 16-bit base: the published checkpoint's shards (assumed, and said so), never an error
    lora = doctor("llama-3.1-8b", recipe=QLORA_8B.with_(quantization=None), target="t4", seq_len=64,
                  method="analytic")
    finding = lora.findings[lora.codes.index("host-ram-load")]
    assert finding.severity == "warning" and "bfloat16" in finding.found
    assert "assumed: the published checkpoint in bfloat16, in shards of at most 5 GB" in finding.found
    assert finding.details["largest_shard_bytes"] == loading.PUBLISHED_MAX_SHARD_BYTES


def test_a_load_that_does_not_fit_is_an_error_from_the_files_and_a_warning_when_assumed(tmp_path):
    """The files' layout read: an error. Only a config (the layout assumed): a warning naming the assumption."""
    cfg = small_config("llama", hidden_size=256, num_hidden_layers=4, vocab_size=8192, intermediate_size=688)
    files = loading.save_random_model(cfg, tmp_path / "files")
    cfg.save_pretrained(tmp_path / "config")
    tiny = {"name": "tiny-host", "device_bytes": 16 * 2**30, "host_bytes": 2**20, "cuda": True}  # below this process
    for recipe in (cm.Recipe(lora_rank=4), cm.Recipe(lora_rank=4, quantization="nf4")):
        read = doctor(str(files), recipe=recipe, target=tiny, seq_len=64, headroom=0.0, method="analytic")
        finding = read.findings[read.codes.index("host-ram-load")]
        assert finding.severity == "error" and "assumed" not in finding.found, str(read)
        assumed = doctor(str(tmp_path / "config"), recipe=recipe, target=tiny, seq_len=64, headroom=0.0,
                         method="analytic")
        finding = assumed.findings[assumed.codes.index("host-ram-load")]
        assert finding.severity == "warning" and "assumed" in finding.found and "Hugging Face id or folder" in \
            finding.found, str(assumed)
    # a 4-bit load that fits the host but not the GPU: its device peak, read from the files, is the error
    load = loading.quantized_load_bytes(str(files), dtype=torch.float16)
    small_gpu = {"name": "small-gpu", "device_bytes": load.device_bytes // 2, "host_bytes": 256 * 2**30,
                 "cuda": True, "cuda_context_bytes": 0}
    found = doctor(str(files), recipe=cm.Recipe(lora_rank=4, quantization="nf4"),
                   target=small_gpu, seq_len=64, headroom=0.0, method="analytic")
    finding = found.findings[found.codes.index("host-ram-load")]
    assert finding.severity == "error" and "on the GPU" in finding.found
    assert finding.details["device_need_bytes"] == load.device_bytes


def test_qlora_that_saves_little_over_lora(tmp_path):
    small_config("mistral").save_pretrained(tmp_path)
    qlora = cm.Recipe(lora_rank=8, quantization="nf4", lora_targets=LLAMA_TARGETS)
    result = doctor(str(tmp_path), recipe=qlora, target="t4", seq_len=512, method="analytic")
    assert "qlora-small-saving" in result
    assert result.findings[result.codes.index("qlora-small-saving")].details["saving_fraction"] < QLORA_MIN_SAVING
    big = doctor("llama-3.2-1b", recipe=qlora, target="t4", seq_len=128, method="analytic")
    assert "qlora-small-saving" not in big
    assert "qlora-small-saving" not in doctor(str(tmp_path), recipe=qlora.with_(quantization=None), target="t4",
                                                  seq_len=512, method="analytic")


def test_deepspeed_ops_not_built_yet(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty extensions cache: a fresh Colab runtime
    offload = cm.Recipe(zero_stage=2, offload_optimizer=True)
    result = doctor("tiny", recipe=offload, target="t4", seq_len=32)
    assert "deepspeed-op-build" in result and "cpu_adam" in str(result)
    assert deepspeed_ops(cm.Recipe(zero_stage=2), cuda=True) == ["fused_adam"]
    (tmp_path / "py311_cpu" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "py311_cpu" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert "deepspeed-op-build" not in doctor("tiny", recipe=offload, target="t4", seq_len=32)
    assert "deepspeed-op-build" not in doctor("tiny", target="t4", seq_len=32)


def test_cli_doctor_prints_findings_and_exits_1_on_an_error(tmp_path, capsys):
    small_config("gemma2").save_pretrained(tmp_path)
    assert cli(["doctor", "--model", str(tmp_path), "--recipe", "precision=bf16-autocast", "--target", "t4",
                "--seq", "64", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["codes"] == ["bf16-not-native"] and not out["ok"]
    assert cli(["doctor", "--model", str(tmp_path), "--recipe", "precision=fp16-autocast", "--target", "t4", "--seq", "64"]) == 0
    assert "no pitfall found" in capsys.readouterr().out
    assert cli(["doctor", "--model", "gpt-9"]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        doctor("tiny", batch=0)
    with pytest.raises(ValueError, match="unknown target"):
        doctor("tiny", target="v100")
    with pytest.raises(ValueError, match="unknown recipe field"):
        doctor("tiny", recipe={"precison": "fp32"})


def test_trl_bf16_adapters_under_fp16_are_an_error_with_the_fix():
    """TRL casts a quantized model's LoRA weights to bf16 whatever fp16 says (trl#4901): under fp16=True the
    GradScaler fails on CUDA. The doctor reads the Trainer (its model and settings) and names the fix."""
    pytest.importorskip("trl")
    from test_guard import sft

    trainer = sft(quantized_flag=True, fp16=True)
    found = doctor(trainer, target="t4", seq_len=32, probe=False)
    assert "bf16-trainable-under-fp16" in found and not found.ok, str(found)
    assert "bf16-not-native" not in found  # TRL's cast, not a bf16 choice: one finding, the right fix
    finding = found.findings[found.codes.index("bf16-trainable-under-fp16")]
    assert "8 trainable tensor(s) in bfloat16 under fp16 autocast (fp16=True)" in finding.found
    assert "upcast_trainable(trainer.model)" in finding.fix and "MemoryGuardCallback" in finding.fix
    cm.guard.upcast_trainable(trainer.model)
    assert "bf16-trainable-under-fp16" not in doctor(trainer, target="t4", seq_len=32, probe=False)
    plain = sft(quantized_flag=True)  # no fp16: no GradScaler, so bf16 adapters are no error of this kind
    assert "bf16-trainable-under-fp16" not in doctor(plain, target="l4", seq_len=32, probe=False)


def test_probe3_row_221_doctor_refuses_what_build_refuses(capsys):
    with pytest.raises(ValueError, match=r"offload_keep_blocks=99 exceeds the model's 2 blocks"):
        doctor("tiny", recipe={"checkpointing": "offload", "offload_keep_blocks": 99}, target="t4", verbose=False)
    code = cli(["doctor", "--model", "tiny", "--recipe", "checkpointing=offload", "offload_keep_blocks=99"])
    out, err = capsys.readouterr()
    assert code == 2 and "offload_keep_blocks=99 exceeds the model's 2 blocks" in err and "no pitfall" not in out


def test_cli_doctor_of_training_args_prints_plan_trainers_need(tmp_path, capsys):
    """`doctor --training-args` checks the run `plan --training-args` plans: the same need, in the same words."""
    import re

    config = tmp_path / "sft.yaml"
    config.write_text(f"output_dir: {tmp_path / 'out'}\nper_device_train_batch_size: 2\nmax_length: 48\n"
                      "use_cpu: true\nbf16: false\nreport_to: []\nuse_peft: true\nlora_r: 4\nlora_target_modules: [q_proj, v_proj]\n")
    small_config("llama", num_hidden_layers=4, dtype="bfloat16").save_pretrained(tmp_path / "llama")  # its size is not tested
    argv = ["--model", str(tmp_path / "llama"), "--training-args", str(config), "--target", "t4"]
    assert cli(["plan", *argv, "--no-max-batch"]) == 0
    plan_out = capsys.readouterr().out
    assert cli(["doctor", *argv]) == 0
    doctor_out = capsys.readouterr().out
    need = re.compile(r"need [\d.]+ [KMG]iB of [\d.]+ [KMG]iB usable")
    assert need.search(doctor_out) and need.search(doctor_out).group(0) == need.search(plan_out).group(0), doctor_out
    assert "batch 2 x 48 tokens" in doctor_out
    assert cli(["doctor", *argv, "--batch", "4"]) == 2
    assert "leave --batch and --recipe out" in capsys.readouterr().err
    assert cli(["doctor", "--model", "tiny", "--lora", "r=4"]) == 2
    assert "--lora, --bnb and --dtype go with --training-args" in capsys.readouterr().err


def test_a_hub_ids_load_is_checked_from_the_hubs_headers(monkeypatch):
    """A Hugging Face id without local files: its shards from the hub's safetensors headers (nothing downloaded),
    so a load that does not fit is an error; where the hub cannot be read, the layout is assumed: a warning."""
    import huggingface_hub

    config = small_config("llama", hidden_size=256, num_hidden_layers=4, vocab_size=8192, intermediate_size=688)
    config.name_or_path = "someone/small-llama"  # read from the hub, as AutoConfig.from_pretrained(id) names it
    shard = {"model.embed_tokens.weight": SimpleNamespace(dtype="BF16", shape=[8192, 256])}
    rest = {"lm_head.weight": SimpleNamespace(dtype="BF16", shape=[8192, 256])}
    meta = SimpleNamespace(files_metadata={"a.safetensors": SimpleNamespace(tensors=shard),
                                           "b.safetensors": SimpleNamespace(tensors=rest)})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", lambda model_id: meta)
    loading.hub_shard_bytes.cache_clear()  # asked once per id in a process
    assert loading.hub_shard_bytes("someone/small-llama") == (8192 * 256 * 2,) * 2
    tiny = {"name": "tiny-host", "device_bytes": 16 * 2**30, "host_bytes": 2**20, "cuda": True}
    found = doctor(config, recipe=cm.Recipe(lora_rank=4), target=tiny, seq_len=64, headroom=0.0, method="analytic")
    finding = found.findings[found.codes.index("host-ram-load")]
    assert finding.severity == "error" and "largest shard 4.00 MiB" in finding.found, str(found)
    assert "on the hub (2 shard(s))" in finding.details["layout"]

    def offline(model_id):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", offline)
    loading.hub_shard_bytes.cache_clear()
    found = doctor(config, recipe=cm.Recipe(lora_rank=4), target=tiny, seq_len=64, headroom=0.0, method="analytic")
    finding = found.findings[found.codes.index("host-ram-load")]
    assert finding.severity == "warning" and "assumed: one shard" in finding.found
    loading.hub_shard_bytes.cache_clear()  # no fake answer left for later tests


def test_sft_settings_that_do_not_fit_get_fit_trainer_as_the_fix():
    """Trainer settings are answered in Trainer words: the fix is fit_trainer, which changes your SFTConfig."""
    from peft import LoraConfig
    from trl import SFTConfig

    args = SFTConfig("/tmp/cm_doctor_small", per_device_train_batch_size=2, max_length=48, use_cpu=True, bf16=False,
                     report_to=[])
    small = {"name": "small-gpu", "device_bytes": 64 * 2**20, "host_bytes": 256 * 2**30, "cuda": False}
    found = doctor("smollm2-135m", recipe=args, lora=LoraConfig(r=4, target_modules=["q_proj"]), target=small)
    finding = found.findings[found.codes.index("does-not-fit")]
    assert finding.fix.startswith("cm.fit_trainer(args, model=..., lora=..., bnb=...)") and "fit.apply(args)" in finding.fix
    assert finding.details["need_bytes"] == found.plan.device_need_bytes > 64 * 2**20 and not found.ok
    assert "at batch 2 x 48 tokens" in finding.found


def test_probe4_a_checkpoint_interval_too_large_for_the_model_is_a_finding(tmp_path):
    """probe 4: doctor said "no pitfall found" for checkpointing='every_n' with checkpoint_interval 64 on a 2-block
    model (no block checkpointed, nothing saved), which the plan of the same run warns about."""
    small_config("llama").save_pretrained(tmp_path)  # 2 blocks
    too_large = cm.Recipe(checkpointing="every_n", checkpoint_interval=64)
    found = doctor(str(tmp_path), recipe=too_large, target="t4", seq_len=32)
    assert found.codes == ["checkpoint-interval"], str(found)
    (finding,) = found.findings
    assert finding.severity == "warning" and finding.found == "checkpoint_interval 64 exceeds the model's 2 blocks"
    assert "nothing is saved" in finding.why and finding.fix.startswith("use an interval <= 2")
    plan = cm.plan(str(tmp_path), 1, seq_len=32, recipe=too_large, target="t4")
    assert any(finding.found in w for w in plan.warnings)  # the plan's words
    assert "checkpoint-interval" not in doctor(str(tmp_path), recipe=too_large.with_(checkpoint_interval=2),
                                                target="t4", seq_len=32)
    offload = cm.Recipe(checkpointing="offload", checkpoint_interval=2)  # one segment of both blocks
    built, opt = offload.with_(checkpoint_interval=1).build(_hf_model())
    checked = doctor(built, opt, offload, target="t4", seq_len=32, probe=False)
    assert "checkpoint-interval" in checked and "covers all of the model's 2 blocks" in str(checked)
