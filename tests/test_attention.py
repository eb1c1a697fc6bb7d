import pytest
import torch
import torch.nn.functional as F

import colab_memopt as cm
from colab_memopt import attention as A


def _qkv(T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, T, 8, generator=g) for _ in range(3)]


@pytest.mark.parametrize("window", [None, 1, 5, 64])
def test_naive_and_sdpa_agree(window):
    q, k, v = _qkv()
    torch.testing.assert_close(A.attend(q, k, v, impl="naive", window=window), A.attend(q, k, v, impl="sdpa", window=window),
                               rtol=1e-4, atol=1e-5)


def test_window_mask_and_window_one_returns_v():
    mask = A.causal_mask(5, window=2)
    assert mask.sum().item() == 5 + 4 and mask[4, 3] and not mask[4, 2] and not mask[1, 2]
    q, k, v = _qkv()
    torch.testing.assert_close(A.attend(q, k, v, window=1), v)


def test_sdpa_memory_grows_linearly_and_naive_quadratically():
    mem = {"naive": [], "sdpa": []}
    lens = [128, 256, 512]
    for impl in mem:
        for T in lens:
            step, inputs = A.attention_step(impl, batch=1, heads=2, seq_len=T, head_dim=16)
            rep = cm.measure_step(step, track=inputs, device="cpu", warmup=0, repeat=1)
            mem[impl].append(rep.peak_bytes - sum(t.numel() * t.element_size() for t in inputs))
    assert A.fit_growth_exponent(lens, mem["naive"]) > 1.6
    assert A.fit_growth_exponent(lens, mem["sdpa"]) < 1.2
    assert mem["sdpa"][-1] * 5 < mem["naive"][-1]


def test_backends():
    assert A.sdpa_backend("cpu") in ("flash (CPU kernel)", "math")
    assert A.expected_cuda_backend((7, 5), torch.float16) == "memory-efficient"
    assert A.expected_cuda_backend((8, 0), torch.bfloat16) == "flash"
    assert A.expected_cuda_backend((8, 0), torch.float16, masked=True) == "memory-efficient"
    assert A.expected_cuda_backend((7, 5), torch.bfloat16) == "math"


def test_recipe_window_on_the_reference_model(corpus):
    model, _ = cm.Recipe(attention="naive", attention_window=4).build(cm.build_model("tiny"))
    assert all(b.attn.window == 4 and b.attn.attention == "naive" for b in model.blocks)
    x = corpus.batch(2, 16, generator=torch.Generator().manual_seed(0))
    naive = model(x).logits
    model2, _ = cm.Recipe(attention="sdpa", attention_window=4).build(cm.build_model("tiny"))
    torch.testing.assert_close(model2(x).logits, naive, rtol=1e-4, atol=1e-5)


def test_fit_and_bad_values():
    assert A.fit_growth_exponent([1, 2, 4], [3, 12, 48]) == pytest.approx(2.0)
    assert A.score_matrix_bytes(8192, 32) == 8 * 2**30
    with pytest.raises(ValueError, match="sliding window must be None or an integer >= 1"):
        A.causal_mask(4, window=0)
    with pytest.raises(ValueError, match="attention impl must be one of"):
        A.attend(*_qkv(), impl="flash")
    with pytest.raises(ValueError, match="recipe.attention_window must be None or an integer"):
        cm.Recipe(attention_window=-3)
    with pytest.raises(ValueError, match="need two or more"):
        A.fit_growth_exponent([1], [1])


@pytest.mark.parametrize(("capability", "dtype", "kwargs", "kernel"), [
    # grouped-query heads (enable_gqa, no mask): flash takes them (sm_80+, fp16/bf16); memory-efficient does not
    ((7, 5), torch.float16, dict(gqa=True), "math"),
    ((7, 5), torch.float32, dict(gqa=True), "math"),
    ((8, 0), torch.bfloat16, dict(gqa=True), "flash"),
    ((9, 0), torch.float16, dict(gqa=True), "flash"),
    ((8, 0), torch.float32, dict(gqa=True), "math"),
    ((7, 5), torch.float16, dict(gqa=True, efficient_gqa=True), "memory-efficient"),
    # head dims: memory-efficient needs a multiple of 8 in 16-bit on sm_75+, of 4 in fp32 on sm_80+
    ((7, 5), torch.float16, dict(head_dim=60), "math"),
    ((7, 5), torch.float32, dict(head_dim=60), "memory-efficient"),
    ((8, 0), torch.float32, dict(head_dim=62), "math"),
    ((8, 0), torch.float16, dict(head_dim=264), "memory-efficient"),
    ((8, 6), torch.float16, dict(head_dim=200), "memory-efficient"),
    ((8, 0), torch.float16, dict(head_dim=200), "flash"),
    ((8, 0), torch.float16, dict(head_dim=64, value_head_dim=128), "memory-efficient"),
    ((7, 0), torch.float16, {}, "memory-efficient"),
    ((3, 7), torch.float32, {}, "math"),
])
def test_expected_cuda_backend_follows_torch_dispatch_rules(capability, dtype, kwargs, kernel):
    assert A.expected_cuda_backend(capability, dtype, **kwargs) == kernel


def _gqa_call(T=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, T, 16, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def _kernels(fn):
    recorder = A._OpRecorder()
    with recorder:
        fn()
    fused = [A.SDPA_OPS[op] for op in recorder.ops if op in A.SDPA_OPS]
    if fused:
        return fused
    return ["math"] if "_safe_softmax" in recorder.ops else []


@pytest.mark.parametrize("flash_flag", [True, False])
def test_traced_attention_runs_the_targets_kernel_whatever_the_process_flags(flash_flag):
    q, k, v = _gqa_call()
    was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(flash_flag)
    try:
        with A.traced_attention((7, 5)) as t4:
            gqa = _kernels(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            mha = _kernels(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
        with A.traced_attention((8, 0)) as a100:
            a100_gqa = _kernels(lambda: F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                                       is_causal=True, enable_gqa=True))
        with A.traced_attention(None) as cpu:
            cpu_gqa = _kernels(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        assert torch.backends.cuda.flash_sdp_enabled() is flash_flag  # restored
    finally:
        torch.backends.cuda.enable_flash_sdp(was)
    assert gqa == ["math"] and mha == ["flash (CPU kernel)"], (gqa, mha)
    assert t4.math_calls == 1 and t4.hidden_bytes == 2 * 4 * 64 * 64 * 4  # (B, heads, T, T) fp32, once
    assert a100_gqa == ["flash (CPU kernel)"] and a100.hidden_bytes == 0
    assert cpu is None and cpu_gqa == ["flash (CPU kernel)"]


def test_traced_attention_picks_the_kernel_for_the_dtype_the_target_runs():
    """fp16 autocast on CUDA is traced as bf16 autocast (trainer.py): bf16 on a T4 is math, fp16 memory-efficient."""
    q = torch.randn(1, 2, 32, 16)
    with A.traced_attention((7, 5)) as t4, torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with A.traced_attention((7, 5), stand_in={torch.bfloat16: torch.float16}) as t4_fp16, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert t4.math_calls == 1 and t4.hidden_bytes == 2 * 32 * 32 * 4  # math upcasts 16-bit scores to fp32
    assert t4_fp16.math_calls == 0


def test_repeat_kv_for_sdpa_gives_the_same_logits_and_a_t4_plan_without_math_attention():
    import transformers

    from colab_memopt import architectures, planner

    def llama():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(architectures.small_config("llama"))  # 4 heads, 2 KV heads

    x = torch.randint(0, 500, (2, 64), generator=torch.Generator().manual_seed(0))
    model = llama()
    reference = model(x).logits
    assert A.repeat_kv_for_sdpa(model) is model and model.config._attn_implementation == A.REPEATED_KV_ATTENTION
    torch.testing.assert_close(model(x).logits, reference)
    repeated = planner.plan(lambda: A.repeat_kv_for_sdpa(llama()), 4, seq_len=512, target="t4", find_max_batch=False)
    assert repeated.step_peak_bytes == repeated.peak_bytes  # no math attention line
    assert repeated.peak_bytes < 0.4 * (82_260_992 + 4 * 4 * 512 * 512 * 4)  # the math plan (tests/test_planner.py)
    with pytest.raises(TypeError, match="needs a transformers model"):
        A.repeat_kv_for_sdpa(torch.nn.Linear(2, 2))
