import math

import pytest
import torch

import colab_memopt as cm
from colab_memopt import estimate, structured as st
from colab_memopt.techniques.offload import OffloadManager


def _tridiag_plus_rank(n, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, V = torch.randn(n, r, generator=g), torch.randn(n, r, generator=g)
    band = torch.diag(torch.randn(n, generator=g)) + torch.diag(torch.randn(n - 1, generator=g), 1) + torch.diag(
        torch.randn(n - 1, generator=g), -1
    )
    return U @ V.T + band


def test_factorization_is_exact_for_tridiagonal_plus_rank_r():
    H = _tridiag_plus_rank(64, 6)
    S = st.SemiseparableMatrix.factorize(H, 6, refine_iters=40)
    assert S.relative_error(H) < 1e-5
    assert S.rank == 6 and S.n == 64


def test_truly_tridiagonal_matrix_has_zero_lowrank_part():
    H = torch.diag(torch.arange(1.0, 33)) + torch.diag(torch.ones(31), 1) - torch.diag(torch.ones(31), -1)
    S = st.SemiseparableMatrix.factorize(H, 2)
    assert S.relative_error(H) < 1e-6


def test_matvec_and_matmul_match_dense():
    H = st.smooth_kernel_plus_band(300)
    S = st.SemiseparableMatrix.factorize(H)
    dense = S.to_dense()
    x, X = torch.randn(300), torch.randn(300, 5)
    torch.testing.assert_close(S.matvec(x), dense @ x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S.matmul(X), dense @ X, rtol=1e-4, atol=1e-4)


def test_structured_matrix_is_approximated_and_random_is_not():
    H = st.smooth_kernel_plus_band(512)
    S = st.SemiseparableMatrix.factorize(H)
    assert S.rank == math.ceil(math.log2(512))
    assert S.relative_error(H) < 1e-3
    R = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    assert st.SemiseparableMatrix.factorize(R).relative_error(R) > 0.9


def test_memory_matches_the_formula_and_mixed_precision_halves_factors():
    H = st.smooth_kernel_plus_band(2048)
    S32 = st.SemiseparableMatrix.factorize(H)
    S16 = st.SemiseparableMatrix.factorize(H, lowrank_dtype=torch.float16)
    assert S32.memory_bytes() == estimate.semiseparable_bytes(2048, 11)
    assert S16.memory_bytes() == estimate.semiseparable_bytes(2048, 11, lowrank_bytes=2)
    assert round(100 * S32.reduction_vs_dense(), 1) == 98.8 and round(100 * S16.reduction_vs_dense(), 1) == 99.3
    assert S16.U.dtype == torch.float16 and S16.diag.dtype == torch.float32
    assert S16.relative_error(H) < 1e-3


def test_hierarchical_matvec_matches_its_dense_form_and_storage_formula():
    H = st.smooth_kernel_plus_band(256)
    Hs = st.HierarchicalSemiseparable.factorize(H, num_levels=2)
    x = torch.randn(256)
    torch.testing.assert_close(Hs.matvec(x), Hs.to_dense() @ x, rtol=1e-4, atol=1e-4)
    assert Hs.relative_error(H) < 1e-2
    assert Hs.memory_bytes() == estimate.hierarchical_semiseparable_bytes(256, 8, 2)
    # Exact for a block-diagonal matrix whose blocks are tridiagonal + low rank and off-blocks low rank.
    B = torch.block_diag(_tridiag_plus_rank(32, 2, 1), _tridiag_plus_rank(32, 2, 2))
    Hb = st.HierarchicalSemiseparable.factorize(B, rank=2, num_levels=1, refine_iters=40)
    assert Hb.relative_error(B) < 1e-5


def test_hierarchical_dense_form_is_built_on_the_device_of_its_factors():
    # cuda-run-1 #5 (notebook 13): to_dense built its identity on the CPU beside factors on CUDA
    import dataclasses

    def on(h, device):
        if h.leaf is not None:
            return dataclasses.replace(h, leaf=h.leaf.to(device))
        return dataclasses.replace(h, children=tuple(on(c, device) for c in h.children),
                                   upper=tuple(t.to(device) for t in h.upper), lower=tuple(t.to(device) for t in h.lower))

    H = st.smooth_kernel_plus_band(64)
    meta = on(st.HierarchicalSemiseparable.factorize(H, num_levels=2), "meta")
    assert {t.device.type for t in meta.tensors()} == {"meta"}
    dense = meta.to_dense()
    assert dense.device.type == "meta" and dense.shape == (64, 64)


def test_distributed_matvec_equals_single_process_and_halves_factor_bytes():
    H = st.smooth_kernel_plus_band(301)
    S = st.SemiseparableMatrix.factorize(H)
    x = torch.randn(301)
    res = st.distributed_matvec(S, x, world_size=2, timeout_s=90)
    torch.testing.assert_close(res.y, S.matvec(x), rtol=1e-5, atol=1e-5)
    full = S.U.numel() * 4 + S.V.numel() * 4
    assert sum(res.factor_bytes_per_rank) == full and max(res.factor_bytes_per_rank) <= full / 2 + 2 * S.rank * 4


def test_partition_rows_covers_every_row_once():
    spans = [st.partition_rows(10, 3, r) for r in range(3)]
    assert spans == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="rank must be in"):
        st.partition_rows(10, 2, 2)


def test_offloaded_matvec_matches_and_counts_transfers():
    S = st.SemiseparableMatrix.factorize(st.smooth_kernel_plus_band(500))
    manager = OffloadManager()
    off = st.OffloadedSemiseparable(S, manager, chunk_rows=128)
    x = torch.randn(500)
    torch.testing.assert_close(off.matvec(x), S.matvec(x), rtol=1e-5, atol=1e-5)
    stats = manager.get_statistics()
    assert stats.to_host == 8 and stats.to_device == 8  # U and V in 4 chunks of 128 rows, each way once
    assert stats.bytes_to_device == manager.host_bytes == S.U.numel() * 8
    with pytest.raises(ValueError, match="chunk_rows must be an integer >= 1, got 0"):
        st.OffloadedSemiseparable(S, manager, chunk_rows=0)


def test_causal_mixing_matches_dense_and_is_causal():
    q, k, v = torch.randn(3, 2, 3, 70, 8).unbind(0)
    y = st.causal_semiseparable_mixing(q, k, v, chunk_size=16)
    torch.testing.assert_close(y, st.causal_semiseparable_dense(q, k, v), rtol=1e-4, atol=1e-5)
    v2 = v.clone()
    v2[:, :, 40:] += 1.0  # a change in the future must not move the past
    torch.testing.assert_close(st.causal_semiseparable_mixing(q, k, v2, chunk_size=16)[:, :, :40], y[:, :, :40])


def test_semiseparable_attention_option_trains_and_swaps_in_by_recipe(corpus):
    model = cm.build_model("tiny", attention="semiseparable")
    opt = cm.make_optimizer("adamw", model.parameters())
    losses = cm.train(model, opt, corpus, steps=3, batch_size=2, seq_len=32).train_loss
    assert all(math.isfinite(v) for v in losses)
    swapped, _ = cm.Recipe(attention="semiseparable").build(cm.build_model("tiny"))
    assert all(b.attn.attention == "semiseparable" for b in swapped.blocks)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="square matrix"):
        st.SemiseparableMatrix.factorize(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, 8\], got 9"):
        st.SemiseparableMatrix.factorize(torch.eye(8), 9)
    with pytest.raises(ValueError, match="lowrank_dtype must be one of"):
        st.SemiseparableMatrix.factorize(torch.eye(8), lowrank_dtype=torch.int8)
    with pytest.raises(TypeError, match="torch.Tensor"):
        st.SemiseparableMatrix.factorize([[1.0]])
    with pytest.raises(ValueError, match="too small for 5 levels"):
        st.HierarchicalSemiseparable.factorize(torch.eye(16), num_levels=5)
    with pytest.raises(ValueError, match="attention must be one of"):
        cm.build_model("tiny", attention="linear")
