"""Tests for LOMO and AdaLomo (lomo-optim) as wired here: state size, one step against a reference, the recipe."""

from __future__ import annotations

import math

import pytest
import torch

import colab_memopt as cm
from colab_memopt import estimate
from colab_memopt.techniques.lomo import fused_step, is_fused_backward, lomo_state, make_lomo

pytest.importorskip("lomo_optim")


def _one_step(name: str, dtype: torch.dtype, lr: float):
    model = cm.build_model("tiny", dtype=dtype)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    # The reference gradients: an ordinary backward on a copy.
    ref = cm.build_model("tiny", dtype=dtype)
    ref.load_state_dict(model.state_dict())
    ref(x, labels=x).loss.backward()
    grads = {n: p.grad.float() for n, p in ref.named_parameters()}
    opt = make_lomo(name, model, lr=lr)
    fused_step(opt, model(x, labels=x).loss)
    after = {n: p.detach().float() for n, p in model.named_parameters()}
    return model, opt, before, grads, after


def test_lomo_step_is_sgd_inside_backward_with_no_state():
    lr = 0.05
    model, opt, before, grads, after = _one_step("lomo", torch.float32, lr)
    assert is_fused_backward(opt) and lomo_state(opt) == {}
    assert all(p.grad is None for p in model.parameters())  # no gradient kept
    for n in before:
        if n == "lm_head.weight":  # tied to wte: updated once per use, each with its part of the gradient
            continue
        torch.testing.assert_close(after[n], before[n] - lr * grads[n], rtol=1e-5, atol=1e-6)


def _adalomo_reference(p: torch.Tensor, g: torch.Tensor, lr: float, eps=(1e-30, 1e-3), clip_threshold=1.0) -> torch.Tensor:
    """AdaLomo's first step (Lv et al. 2023, Algorithm 1 with beta2 = 1 - 1**-0.8 = 0): Adafactor's
    factored second moment, the update's RMS clipped to 1, the step scaled by the parameter's RMS."""
    g2 = g * g + eps[0]
    if p.dim() > 1:
        row, col = g2.mean(dim=-1), g2.mean(dim=-2)
        v = (row / row.mean()).unsqueeze(-1) * col.unsqueeze(-2)
    else:
        v = g2
    update = g / v.sqrt()
    update = update / max(1.0, (update.norm() / math.sqrt(update.numel())).item() / clip_threshold)
    scale = max(eps[1], (p.norm() / math.sqrt(p.numel())).item())
    return p - lr * scale * update


def test_adalomo_one_step_matches_the_reference_and_its_state_is_factored():
    lr = 1e-2
    model, opt, before, grads, after = _one_step("adalomo", torch.float32, lr)
    for n in before:
        if n in ("lm_head.weight", "wte.weight"):  # tied: two partial updates
            continue
        torch.testing.assert_close(after[n], _adalomo_reference(before[n], grads[n], lr), rtol=1e-4, atol=1e-6)
    # State: an fp32 row and column vector per matrix, a full fp32 vector per 1-D tensor; listed in opt.state.
    state_bytes = sum(v.numel() * v.element_size() for v in lomo_state(opt).values())
    assert state_bytes == estimate.optimizer_state_bytes(model.parameters(), "adalomo")
    tracked = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert tracked == state_bytes
    n = sum(p.numel() for p in model.parameters())
    assert state_bytes / n < 0.5  # well under a byte per parameter even on this tiny model


def test_bf16_lomo_trains_through_the_recipe_and_keeps_2_bytes_per_param(corpus):
    recipe = cm.Recipe(precision="bf16", optimizer="lomo", lr=0.05)
    model, opt = recipe.build(cm.build_model("tiny"))
    step = cm.make_train_step(model, opt, corpus, batch_size=4, seq_len=32, recipe=recipe)
    losses = [step() for _ in range(8)]
    assert losses[-1] < losses[0]
    report = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    n = sum(p.numel() for p in model.parameters())
    resident = report.resident_bytes
    model_state = resident["parameters"] + resident.get("gradients", 0) + resident.get("optimizer_state", 0)
    assert model_state / n == 2.0  # bf16 weights, no gradients, no state


def test_fp16_lomo_scales_its_loss_itself():
    model = cm.build_model("tiny", dtype=torch.float16)
    opt = make_lomo("lomo", model, lr=0.05)
    assert opt.clip_grad_norm == 1.0  # lomo-optim's requirement for an fp16 loss, set up front
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in model.parameters()]
    fused_step(opt, model(x, labels=x).loss)
    assert opt.loss_scaler is not None
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_recipe_refuses_what_lomo_breaks():
    with pytest.raises(ValueError, match="cannot accumulate gradients"):
        cm.Recipe(optimizer="lomo", accumulation_steps=2)
    with pytest.raises(ValueError, match="before a GradScaler could unscale"):
        cm.Recipe(optimizer="adalomo", precision="fp16-autocast")
    with pytest.raises(ValueError, match="leave update_rounding=None"):
        cm.Recipe(optimizer="lomo", precision="bf16", update_rounding="kahan")
    with pytest.raises(ValueError, match="full fine-tuning"):
        cm.Recipe(optimizer="lomo", lora_rank=4)
    assert cm.Recipe(optimizer="lomo", precision="fp16").rounding_mode is None
    with pytest.raises(ValueError, match="pass model="):
        cm.make_optimizer("lomo", cm.build_model("tiny").parameters())
    with pytest.raises(ValueError, match="name must be one of"):
        make_lomo("sgd", cm.build_model("tiny"), lr=1.0)


# -- pure fp16: a loss scale that falls on overflow and grows back; no inf/NaN written ---------------

SMALL = {"n_layer": 1, "d_model": 16, "n_head": 2, "vocab_size": 64}  # CPU fp16 is slow: a small model, 100 steps


@pytest.fixture
def one_thread():
    """Run on one CPU thread: the small model's ops are too small to share, and threads waiting on each
    other made 100 steps take 20x the CPU time on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fp16_run(name, steps, overflow_at, *, scale_window=4, lr=0.05):
    """Train the tiny fp16 model `steps` steps, the loss made inf at `overflow_at`; return (scales, updated)."""
    model = cm.build_model("tiny", dtype=torch.float16, **SMALL)
    opt = make_lomo(name, model, lr=lr, scale_window=scale_window)
    x = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    scales, updated = [], []
    for i in range(steps):
        loss = model(x, labels=x).loss
        if i in overflow_at:
            loss = loss * float("inf")  # inf loss: every gradient inf or NaN, as an overflow gives
        before = [p.detach().clone() for p in model.parameters()]
        updated.append(fused_step(opt, loss))
        for p, b in zip(model.parameters(), before):
            assert torch.isfinite(p).all(), (name, i)  # never an inf or NaN written into a weight
            if not updated[-1]:
                assert torch.equal(p, b), (name, i)  # a skipped step writes nothing
        scales.append(opt.loss_scaler.loss_scale)
    return scales, updated


def test_fp16_lomo_survives_100_steps_with_overflows_and_its_scale_grows_back(one_thread):
    overflow_at = set(range(3, 100, 7))  # 14 overflows: lomo-optim 0.1.1 alone raises at the 12th
    scales, updated = _fp16_run("lomo", 100, overflow_at)
    assert [i for i, u in enumerate(updated) if not u] == sorted(overflow_at)
    assert scales[3] == scales[2] / 2  # an overflow halves the scale
    assert scales[3 + 4] == scales[3] * 2  # 4 clean steps (scale_window) double it
    assert max(scales[50:]) >= scales[0]  # it grows back instead of only falling


def test_fp16_adalomo_skips_overflowing_steps_and_never_writes_inf_or_nan(one_thread):
    model = cm.build_model("tiny", dtype=torch.float16, **SMALL)
    opt = make_lomo("adalomo", model, lr=1e-3)
    assert opt.clip_grad_norm == float("inf")  # a norm pass that clips nothing, to find overflows first
    overflow_at = {2, 3, 9}
    scales, updated = _fp16_run("adalomo", 14, overflow_at, lr=1e-3)
    assert [i for i, u in enumerate(updated) if not u] == sorted(overflow_at)
    assert scales[3] == scales[1] / 4 and scales[7] == scales[3] * 2  # halved twice, doubled after 4 clean steps


def test_fp16_lomo_overflow_in_the_update_pass_leaves_no_gradient(one_thread, monkeypatch):
    # On CUDA the two backward passes may differ, so an overflow can show only in the second (update) pass
    # (review cuda-run-1 #16). Forced here at each of its checks in turn: the step is reported skipped, the
    # scale halves, and no gradient stays resident into the next step.
    from lomo_optim.lomo import DynamicLossScaler

    real_check = DynamicLossScaler._has_inf_or_nan
    x = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    for at in (1, 2, 5, 13):
        model = cm.build_model("tiny", dtype=torch.float16, **SMALL)
        opt = make_lomo("lomo", model, lr=0.05)
        checks = []

        def check(self, grad, opt=opt, checks=checks, at=at):
            if opt.gather_norm:  # the norm pass: the real check
                return real_check(self, grad)
            checks.append(1)
            return len(checks) == at or real_check(self, grad)

        monkeypatch.setattr(DynamicLossScaler, "_has_inf_or_nan", check)
        scale = opt.loss_scaler.loss_scale
        assert fused_step(opt, model(x, labels=x).loss) is False, at
        assert opt.loss_scaler.loss_scale == scale / 2, at
        assert [n for n, p in model.named_parameters() if p.grad is not None] == [], at
        monkeypatch.setattr(DynamicLossScaler, "_has_inf_or_nan", real_check)
        assert fused_step(opt, model(x, labels=x).loss) is True  # the next step runs clean


def test_fp16_scaler_exists_for_an_fp32_loss_and_bad_scale_window_is_named():
    model = cm.build_model("tiny", dtype=torch.float16, **SMALL)
    model.loss_chunk_tokens = 8  # the chunked loss returns an fp32 loss: lomo-optim alone would not scale it
    opt = make_lomo("lomo", model, lr=0.05)
    x = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(x, labels=x).loss
    assert loss.dtype == torch.float32 and opt.loss_scaler is not None
    assert fused_step(opt, loss)
    with pytest.raises(ValueError, match="scale_window must be an integer >= 1.*got 0"):
        make_lomo("lomo", model, lr=0.05, scale_window=0)
