"""Tests for pure 16-bit weights: update rounding (Kahan, stochastic) and the fp16 loss scaler."""

from __future__ import annotations

import pytest
import torch

from colab_memopt.techniques.rounding import DynamicLossScaler, UpdateRounding, stochastic_round


def _regression(dtype: torch.dtype, steps: int, make_opt, *, seed: int = 0) -> tuple[torch.Tensor, list[float]]:
    """Fit y = X w_true from w = 1 with weights stored in `dtype`; return the final weights (fp32) and losses.

    The target is 1% away from the start and the steps are below half of bf16's spacing at 1.0
    (2**-8 = 0.0039), so round-to-nearest 16-bit updates vanish.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=gen)
    w_true = 1.0 + 0.01 * torch.randn(16, generator=gen)
    y = x @ w_true
    w = torch.nn.Parameter(torch.ones(16, dtype=dtype))
    opt = make_opt([w])
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ((x.to(dtype) @ w).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return w.detach().float(), losses


def _sgd(lr: float = 0.05):
    return lambda ps: torch.optim.SGD(ps, lr=lr)


def test_plain_bf16_updates_vanish_and_compensated_ones_track_fp32():
    ref, ref_losses = _regression(torch.float32, 200, _sgd())
    plain, plain_losses = _regression(torch.bfloat16, 200, _sgd())
    # Round to nearest: every update is below half a bf16 spacing at 1.0, so no weight moves.
    assert torch.equal(plain, torch.ones(16)), plain
    assert plain_losses[-1] == plain_losses[0]
    assert ref_losses[-1] < 0.1 * ref_losses[0]  # fp32 learns
    for mode in ("kahan", "stochastic"):
        w, losses = _regression(torch.bfloat16, 200, lambda ps, m=mode: UpdateRounding(_sgd()(ps), m))
        assert losses[-1] < 0.2 * losses[0], (mode, losses[0], losses[-1])
        # Within a bf16 spacing of fp32's weights (the stored weight is rounded to bf16).
        assert (w - ref).abs().max().item() < 2**-7, (mode, (w - ref).abs().max())
    w_none, _ = _regression(torch.bfloat16, 200, lambda ps: UpdateRounding(_sgd()(ps), "none"))
    assert torch.equal(w_none, torch.ones(16))  # 'none' is the failure: round to nearest


def test_fp16_kahan_tracks_fp32_with_adamw():
    ref, _ = _regression(torch.float32, 150, lambda ps: torch.optim.AdamW(ps, lr=2e-4, weight_decay=0.0))
    plain, _ = _regression(torch.float16, 150, lambda ps: torch.optim.AdamW(ps, lr=2e-4, weight_decay=0.0))
    kahan, _ = _regression(torch.float16, 150,
                           lambda ps: UpdateRounding(torch.optim.AdamW(ps, lr=2e-4, weight_decay=0.0), "kahan"))
    err_plain = (plain - ref).abs().max().item()
    err_kahan = (kahan - ref).abs().max().item()
    assert err_kahan <= 2**-10, err_kahan  # within one fp16 spacing at 1.0 (the stored weight is rounded)
    # Plain AdamW on fp16 weights keeps its state in fp16: squared gradients and eps=1e-8 flush to zero
    # (fp16's smallest subnormal is 6e-8), so m / (sqrt(v) + eps) is 0/0 = NaN; or, where it is not, the
    # updates vanish. Either way it is far from fp32.
    assert not err_plain <= 4 * err_kahan, (err_plain, err_kahan)


def test_kahan_matches_optimi_kahan_sum():
    optimi = pytest.importorskip("optimi")
    hp = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0)
    ref, _ = _regression(torch.float32, 150, lambda ps: torch.optim.AdamW(ps, **hp))
    ours, _ = _regression(torch.bfloat16, 150, lambda ps: UpdateRounding(torch.optim.AdamW(ps, **hp), "kahan"))
    theirs, _ = _regression(torch.bfloat16, 150, lambda ps: optimi.AdamW(ps, kahan_sum=True, foreach=False, **hp))
    plain, _ = _regression(torch.bfloat16, 150, lambda ps: optimi.AdamW(ps, kahan_sum=False, foreach=False, **hp))
    # Both compensated runs end within a bf16 spacing of fp32 and of each other; without it, far off.
    assert (ours - ref).abs().max().item() < 2**-7
    assert (theirs - ref).abs().max().item() < 2**-7
    assert (ours - theirs).abs().max().item() <= 2**-7
    assert (plain - ref).abs().max().item() > (ours - ref).abs().max().item()


def test_stochastic_round_is_unbiased_and_lands_on_neighbours():
    x = torch.full((200_000,), 1.0 + 2**-10)  # an eighth of the way from 1.0 to the next bf16 value, 1 + 2**-7
    out = stochastic_round(x, torch.bfloat16, generator=torch.Generator().manual_seed(0))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert out.float().mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    exact = torch.tensor([0.5, -2.0, 3.0])
    assert torch.equal(stochastic_round(exact, torch.float16).float(), exact)
    with pytest.raises(ValueError, match="dtype must be one of"):
        stochastic_round(x, torch.float32)


def test_update_rounding_state_bytes_and_errors():
    w = torch.nn.Parameter(torch.ones(64, 32, dtype=torch.bfloat16))
    opt = UpdateRounding(torch.optim.AdamW([w], lr=1e-3), "kahan")
    w.grad = torch.randn_like(w)
    opt.step()
    state = opt.state[w]
    # AdamW's two moments stored in bf16, the compensation in the weight's dtype: 3 x 2 bytes per value.
    big = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
    assert sorted(big) == ["compensation", "exp_avg", "exp_avg_sq"]
    assert all(v.dtype == torch.bfloat16 and v.shape == w.shape for v in big.values())
    assert w.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    sr = UpdateRounding(torch.optim.SGD([torch.nn.Parameter(torch.ones(4, dtype=torch.float16))], lr=1e-3), "stochastic")
    assert all("compensation" not in s for s in sr.state.values())
    with pytest.raises(ValueError, match="mode must be one of"):
        UpdateRounding(torch.optim.SGD([w], lr=1.0), "round")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        UpdateRounding(object(), "kahan")  # type: ignore[arg-type]


def test_dynamic_loss_scaler_skips_overflow_and_unscales_in_fp32():
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    opt = UpdateRounding(torch.optim.SGD([w], lr=1.0), "kahan")
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    # A gradient of 2**-20 per weight: it survives only scaled (fp16's smallest subnormal is 2**-24).
    loss = (w.float() * 2**-20).sum()
    scaler.scale(loss).backward()
    assert w.grad.min().item() == 2**-10  # scaled: 2**-20 * 2**10
    assert scaler.step(opt) is True
    scaler.update()
    assert opt.compensation[w].float().sub(-(2**-20)).abs().max().item() < 2**-30  # the update, kept exactly
    w.grad = torch.full_like(w, float("inf"))
    before = w.detach().clone()
    assert scaler.step(opt) is False
    scaler.update()
    assert torch.equal(w.detach(), before) and w.grad is None
    assert scaler.get_scale() == 2.0**9 and scaler.skipped_steps == 1
    for _ in range(2):
        w.grad = torch.zeros_like(w)
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**10  # doubled after growth_interval clean steps
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=0)


def test_torch_grad_scaler_refuses_fp16_gradients():
    """The reason DynamicLossScaler exists: GradScaler.unscale_ raises on fp16 gradients."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(w.float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-3), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)],
                         ids=["adamw", "sgd_momentum"])
@pytest.mark.parametrize("mode", ["kahan", "none"])
def test_chunked_update_equals_the_whole_parameter_update(make, mode):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(10, 7, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(10, 7, generator=gen).to(torch.bfloat16) for _ in range(3)]
    out = []
    for chunk in (10**6, 14):  # whole, then chunks of two rows
        w = torch.nn.Parameter(start.clone())
        opt = UpdateRounding(make([w]), mode, chunk_elements=chunk)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        out.append((w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items() if torch.is_tensor(v)}))
    (w_whole, s_whole), (w_chunk, s_chunk) = out
    assert torch.equal(w_whole, w_chunk)
    assert s_whole.keys() == s_chunk.keys()
    for key in s_whole:
        assert torch.equal(s_whole[key], s_chunk[key]), key
