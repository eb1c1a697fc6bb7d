import pytest

import colab_memopt as cm
from colab_memopt import estimate


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
@pytest.mark.parametrize("size, batch, seq", [("tiny", 4, 32), ("small", 2, 100)])
def test_block_activations_match_measurement_to_the_byte(corpus, size, batch, seq, attention):
    model = cm.build_model(size, attention=attention)
    opt = cm.make_optimizer("sgd", model.parameters())
    step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq)
    report = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    expected = estimate.block_activation_bytes(model.config, batch, seq)
    for i in range(model.config.n_layer):
        assert report.by_module[f"GPT.blocks.{i}"] == expected


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "sgd"])
def test_optimizer_state_bytes_match_measurement(tiny, corpus, name):
    model = cm.build_model("tiny")
    opt = cm.make_optimizer(name, model.parameters())
    report = cm.measure_step(cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=16), model=model, optimizer=opt, repeat=1)
    assert report.resident_bytes["optimizer_state"] == estimate.optimizer_state_bytes(model.parameters(), name)

# The analytic estimate models O(T) attention (SDPA's flash / memory-efficient kernels). A CUDA target without a
# compute capability is traced with the O(T) kernel; a T4 runs grouped-query calls without a mask with the math
# kernel (T x T scores), which the estimate does not model yet: see the t4 test below.
O_T_TARGET = {"name": "o(t)-attention", "device_bytes": 14 * 2**30, "host_bytes": 12 * 10**9}



def test_formulas_and_conventions():
    assert estimate.fp32_training_bytes_per_param("adamw") == 16
    assert estimate.fp32_training_bytes_per_param("sgd") == 8
    assert {v[0] for v in estimate.MODEL_STATE_CONVENTIONS.values()} == {16, 18, 20, 8}
    s, b, h, a = 2048, 1, 4096, 32
    assert estimate.korthikanti_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert estimate.korthikanti_activation_bytes(s, b, h, a, flash=True) == 34 * s * b * h


def test_estimate_rejects_bad_input():
    config = cm.get_config("tiny")
    with pytest.raises(ValueError, match="batch and seq must be >= 1"):
        estimate.block_activation_bytes(config, 0, 8)
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        estimate.optimizer_state_bytes([], "lamb")
    with pytest.raises(ValueError, match="attention must be"):
        estimate.block_activation_bytes(config, 1, 8, attention="flash")


def test_precision_and_attention_formulas():
    from colab_memopt import estimate as est

    assert est.precision_state_bytes_per_param("fp32") == 16
    assert est.precision_state_bytes_per_param("bf16-autocast") == 16
    assert est.precision_state_bytes_per_param("bf16") == 8
    assert est.attention_scores_bytes(8192, 32) == 8 * 2**30
    with pytest.raises(ValueError, match="precision must be one of"):
        est.precision_state_bytes_per_param("fp8")
def test_training_step_bytes_honours_quantization_lora_and_checkpointing():
    from colab_memopt.techniques.quantization import add_lora, linear_weight_bytes

    full = estimate.training_step_bytes(cm.build_model("tiny", device="meta"), 2, 32, cm.Recipe())
    qlora = cm.Recipe(quantization="bnb_int8", lora_rank=4)
    est = estimate.training_step_bytes(cm.build_model("tiny", device="meta"), 2, 32, qlora)
    real = add_lora(cm.build_model("tiny"), 4)
    lora_bytes = sum(p.numel() * 4 for p in real.parameters() if p.requires_grad)
    assert est.phase_categories["backward"]["gradients"] == lora_bytes
    assert est.by_category["optimizer_state"] == 2 * lora_bytes + 4 * sum(1 for p in real.parameters() if p.requires_grad)
    fp32_linear = linear_weight_bytes(cm.build_model("tiny"), skip=("lm_head",))
    assert est.by_category["parameters"] < full.by_category["parameters"] - 0.5 * fp32_linear  # int8: 1/4 of the bytes, adapters added
    ckpt = estimate.training_step_bytes(cm.build_model("tiny", device="meta"), 2, 32, cm.Recipe(compression_checkpointing=True))
    assert ckpt.by_category["activations"] < full.by_category["activations"]


@pytest.mark.parametrize("family, recipe", [("llama", {"precision": "bf16-autocast"}), ("gemma2", {}), ("phi3", {"lora_rank": 8})])
def test_the_analytic_estimate_follows_the_trace_of_transformers_families_at_long_sequence(family, recipe):
    # Before: -47% (autocast keeps fp32 norms and the residual stream), -87% (Gemma-2's eager scores), -28%
    # (phi3's fused gate_up_proj read as an ungated MLP); benchmarks/estimate_accuracy.py has the whole grid.
    from colab_memopt.techniques.architectures import small_config
    from colab_memopt.planning.planner import plan

    config = small_config(family)
    analytic = plan(config, 2, seq_len=512, recipe=recipe, method="analytic", find_max_batch=False, target=O_T_TARGET)
    traced = plan(config, 2, seq_len=512, recipe=recipe, method="trace", find_max_batch=False, target=O_T_TARGET)
    assert abs(analytic.peak_bytes - traced.peak_bytes) / traced.peak_bytes < 0.15, (analytic.peak_bytes, traced.peak_bytes)
    assert not any("math kernel" in w for w in traced.warnings)


def test_the_analytic_estimate_says_what_it_leaves_out_for_grouped_query_attention_on_a_t4():
    # On a T4 (sm_75) transformers' grouped-query call without a mask runs SDPA's math kernel: the trace counts its
    # T x T scores, the analytic estimate does not yet; it says so and names the two ways out.
    from colab_memopt.techniques.architectures import small_config
    from colab_memopt.planning.planner import plan

    analytic = plan(small_config("llama"), 2, seq_len=512, method="analytic", find_max_batch=False, target="t4")
    traced = plan(small_config("llama"), 2, seq_len=512, method="trace", find_max_batch=False, target="t4")
    assert traced.peak_bytes > 1.5 * analytic.peak_bytes
    assert any("math kernel on t4" in w and "repeat_kv_for_sdpa" in w for w in analytic.warnings), analytic.warnings


def _selective_model(family, recipe):
    """Return (model as `recipe.build` makes it, a meta copy for the estimate, the recipe with the family's targets)."""
    import torch

    from colab_memopt.techniques.architectures import resolve_model, small_config
    from colab_memopt.training.presets import with_family_lora_targets

    spec = resolve_model("small" if family == "gpt" else small_config(family))
    recipe = with_family_lora_targets(recipe, spec.family)
    with torch.device("meta"):
        meta = spec.build()
    return recipe.build(spec.build())[0], meta, recipe


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("fields", [{}, {"lora_rank": 8}, {"precision": "fp16-autocast"},
                                    {"lora_rank": 8, "precision": "fp16-autocast"},
                                    {"lora_rank": 8, "quantization": "nf4", "base_dtype": "fp16", "precision": "fp16-autocast"}],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "fp32")
def test_selective_saved_bytes_are_the_outputs_selective_checkpointing_saves(family, fields):
    """Per block, to the byte: the outputs of the ops `checkpointing.SAVE_OPS` names, run through a real block.

    A 4-bit base layer adds none of its own (bitsandbytes' gemm_4bit is no matmul SAVE_OPS names); its adapters do.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from colab_memopt.techniques.checkpointing import _SAVE_OPS, find_block_stacks

    model, meta, recipe = _selective_model(family, cm.Recipe(checkpointing="selective", **fields))

    class SavedOutputs(TorchDispatchMode):
        saved_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in _SAVE_OPS:
                outs = out if isinstance(out, (tuple, list)) else (out,)
                self.saved_bytes += sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
            return out

    batch, seq = 2, 64
    hidden = estimate._dims(meta)["hidden"]
    x = torch.randn(batch, seq, hidden, dtype=torch.float16 if recipe.base_dtype else torch.float32, requires_grad=True)
    kwargs = {}
    if family != "gpt":  # a decoder layer takes the rotary embeddings its model computes once
        kwargs["position_embeddings"] = model.base_model.rotary_emb(x, torch.arange(seq)[None].expand(batch, seq))
    autocast = recipe.precision == "fp16-autocast"
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast), SavedOutputs() as counter:
        find_block_stacks(model)[0][0](x, **kwargs)
    expected = estimate.selective_saved_bytes(meta, batch, seq, recipe, bytes_per_value=2 if autocast else 4)
    assert counter.saved_bytes == expected


# The analytic 'selective' peak against the trace (benchmarks/estimate_accuracy.py's grid has it as 'checkpoint-selective').
# Before the fix the estimate counted 'selective' as 'full' (each block's input only): measured -30.8%, -59.2%,
# -23.7%, -57.5% (reference GPT at 4 x 128 tokens: fp32, LoRA 8 fp32, fp16 autocast, LoRA 8 fp16 autocast) and
# -33.4%, -51.0%, -29.5%, -42.4% (small llama config at 2 x 512 tokens, same order). After: +0.4%, -1.0%, -13.4%,
# -13.4% and -0.7%, +2.5%, -14.8%, -10.6%. What is left under fp16 autocast is the checkpointed baseline's, which
# 'full' shares (-8.1%, -26.0%, -11.5%, -8.4% at the same points) and which this fix leaves as it is: at the llama's
# peak (the start of the loss backward) the traced activations of 'selective' minus those of 'full' equal the
# estimate's difference to the byte; the baseline counts the block inputs at 2 bytes where autocast keeps the
# residual stream in fp32, and less than the trace holds around the loss. Hence 16% there, 10% in fp32.
@pytest.mark.parametrize("model, batch, seq", [("small", 4, 128), ("llama", 2, 512)])
@pytest.mark.parametrize("fields, within", [({}, 0.10), ({"lora_rank": 8}, 0.10), ({"precision": "fp16-autocast"}, 0.16),
                                            ({"lora_rank": 8, "precision": "fp16-autocast"}, 0.16)],
                         ids=["fp32", "lora-fp32", "fp16-autocast", "lora-fp16-autocast"])
def test_the_analytic_estimate_of_selective_checkpointing_follows_the_trace(model, batch, seq, fields, within):
    from colab_memopt.techniques.architectures import small_config
    from colab_memopt.planning.planner import plan

    config = small_config(model) if model == "llama" else model
    recipe = {"checkpointing": "selective", **fields}
    analytic = plan(config, batch, seq_len=seq, recipe=recipe, method="analytic", find_max_batch=False,
                    target=O_T_TARGET).peak_bytes
    traced = plan(config, batch, seq_len=seq, recipe=recipe, method="trace", find_max_batch=False,
                  target=O_T_TARGET).peak_bytes
    assert abs(analytic - traced) / traced < within, (analytic, traced)
