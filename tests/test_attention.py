import pytest
import torch

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
