"""LOMO and AdaLomo: the update fused into backward, 16-bit weights, no gradients kept (notebook 16).

LOMO (Lv et al. 2023, "Full Parameter Fine-tuning for Large Language Models with Limited
Resources") is SGD applied inside backward: as soon as a parameter's gradient is computed, the
parameter is updated (in fp32, from its 16-bit copy) and the gradient dropped, so no gradient buffers
and no optimizer state outlive the step: model states of about 2 B/param with 16-bit weights (a 7B
model fine-tuned on one 24 GB RTX 3090, reported). AdaLomo (Lv et al. 2023, "AdaLomo: Low-memory
Optimization with Adaptive Learning Rate") adds Adafactor's factored second moment (one fp32 row
and one column vector per matrix) and a step size scaled by the parameter's RMS.

Both come from the authors' package `lomo-optim` (PyPI; `lomo_optim.Lomo`, `lomo_optim.AdaLomo`).
Checked here (lomo-optim 0.1.1, CPU-only torch):
- They replace `loss.backward(); optimizer.step()` by `optimizer.fused_backward(loss, lr)`;
  `fused_step` calls it (the training step calls it for them).
- `AdaLomo.__init__` creates its state with `.cuda()`, which fails on a CPU-only torch ("Torch not
  compiled with CUDA enabled"); `make_lomo` builds it with `Tensor.cuda` pointed at the model's
  device for the duration of the constructor, so its state lives next to the weights.
- Global-norm clipping needs two backward passes (`grad_norm(loss)` first, with the graph retained,
  then `fused_backward`): `clip_grad_norm` here does that, at the cost of keeping the activations
  through a second backward and of a second backward's time.
- LOMO with an fp16 loss scales it itself (`lomo_optim.lomo.DynamicLossScaler`, initial scale 2**32,
  and it then forces `clip_grad_norm=1.0`, so two passes; `make_lomo` sets that itself for fp16
  weights); the loss is multiplied in fp16, so 2**32 overflows at once: `make_lomo` passes 2**11. On
  a skipped step its scaler calls `torch.distributed.get_rank()`, which fails without a process group
  ("Default process group has not been initialized"): `fused_step` starts a single-process gloo
  group for an fp16 LOMO when none exists.
- lomo-optim 0.1.1 only ever lowers that scale: `update_scale(overflow=False)`, the only call that
  raises it, is never made, and the scaler raises "Current loss scale already at minimum" at the 12th
  overflow of a run. `fused_step` calls it after every clean step (the scale doubles after
  `LOMO_FP16_SCALE_WINDOW` clean steps, GradScaler's 2000) and `make_lomo` turns the raise off. It also
  creates the scaler up front for fp16 weights: lomo-optim creates it only when the loss itself is
  fp16, so an fp32 loss (the chunked loss, or a model that upcasts its logits) went unscaled.
- AdaLomo scales the loss by a fixed 2**10 and never checks its gradients: in fp16 an overflowed
  gradient would reach its moments and the weights as inf/NaN. For fp16 weights `make_lomo` gives it
  the same dynamic scaler (from 2**10) and a norm pass (`clip_grad_norm=inf` unless one is given:
  two backward passes, as LOMO in fp16); `fused_step` skips the update when that pass finds an inf or
  NaN gradient, lowers the scale, and raises it after clean steps.
- They break: gradient accumulation (each backward updates the weights), a GradScaler (the update
  happens before it could unscale), update rounding (they round to nearest themselves:
  `p.data.copy_(p_fp32)`, so bf16 updates below half a spacing vanish as in `rounding`), learning-rate
  schedulers (the lr is an argument of each `fused_backward`), and weights tied to each other are
  updated once per use with a partial gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

LOMO_OPTIMIZERS = ("lomo", "adalomo")
# LOMO multiplies the fp16 loss by its scale in fp16: 2**11 keeps a loss up to 31 below fp16's 65504
# (lomo-optim's default, 2**32, overflows at once).
LOMO_FP16_INIT_SCALE = 2.0**11
ADALOMO_FP16_INIT_SCALE = 2.0**10  # AdaLomo's own fixed scale, now the start of a dynamic one
LOMO_FP16_SCALE_WINDOW = 2000  # clean steps before the fp16 loss scale doubles (GradScaler's growth_interval)


def is_fused_backward(optimizer: Any) -> bool:
    """Return whether `optimizer` updates inside its own `fused_backward(loss, lr)` (LOMO, AdaLomo)."""
    return callable(getattr(optimizer, "fused_backward", None))


@contextlib.contextmanager
def _cuda_to(device: torch.device) -> Iterator[None]:
    """Make `Tensor.cuda()` move to `device` for the duration (AdaLomo's constructor hard-codes it)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self.to(device)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def make_lomo(name: str, model: nn.Module, *, lr: float, clip_grad_norm: float | None = None,
              weight_decay: float = 0.0, scale_window: int = LOMO_FP16_SCALE_WINDOW) -> torch.optim.Optimizer:
    """Return `lomo_optim.Lomo` or `lomo_optim.AdaLomo` over `model` (they hook every trainable parameter).

    Args:
        name: 'lomo' or 'adalomo'.
        model: the model to train; its weights should be 16-bit already (`precision='bf16'`/'fp16').
        lr: the learning rate (> 0) each `fused_step` passes on.
        clip_grad_norm: None, or the global gradient norm to clip to (two backward passes per step).
        scale_window: with fp16 weights, the clean steps after which the loss scale doubles (>= 1).

    Example:
        >>> model = build_model("tiny", dtype=torch.bfloat16)
        >>> opt = make_lomo("adalomo", model, lr=1e-3)
        >>> fused_step(opt, model(x, labels=x).loss)
    """
    if name not in LOMO_OPTIMIZERS:
        raise ValueError(f"name must be one of {LOMO_OPTIMIZERS}, got {name!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name!r} hooks a model's parameters: pass the model (an nn.Module), got {type(model).__name__}")
    try:
        from lomo_optim import AdaLomo, Lomo
    except ImportError as err:
        raise RuntimeError(f"optimizer {name!r} needs lomo-optim: pip install lomo-optim") from err
    if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
        raise ValueError(f"scale_window must be an integer >= 1 (clean steps), got {scale_window!r}")
    from lomo_optim.lomo import DynamicLossScaler

    fp16 = next(model.parameters()).dtype == torch.float16
    if fp16 and clip_grad_norm is None:
        # LOMO: what lomo-optim forces for an fp16 loss (with a warning), set here up front. AdaLomo: no
        # clipping (a coefficient of 1), but the norm pass that finds an overflow before any weight changes
        clip_grad_norm = 1.0 if name == "lomo" else float("inf")
    init_scale = LOMO_FP16_INIT_SCALE if name == "lomo" else ADALOMO_FP16_INIT_SCALE
    scale_args = {"init_scale": init_scale, "scale_window": scale_window, "raise_error_at_min_scale": False}
    if name == "lomo":
        opt = Lomo(model, lr=lr, clip_grad_norm=clip_grad_norm, weight_decay=weight_decay, loss_scale_args=scale_args)
    else:
        device = next(model.parameters()).device
        with _cuda_to(device):
            opt = AdaLomo(model, lr=lr, clip_grad_norm=clip_grad_norm, weight_decay=weight_decay)
    if fp16:  # the scaler from the start, whatever the loss's dtype (lomo-optim: only for an fp16 loss)
        opt.loss_scaler = DynamicLossScaler(**scale_args)  # type: ignore[attr-defined]
        opt.first_backward = False  # type: ignore[attr-defined]
    opt.lomo_lr = lr  # type: ignore[attr-defined]
    # AdaLomo keeps its moments in dicts by parameter name; list the same tensors (updated in place) in
    # `optimizer.state` too, where `measure_step` and the planner's tracker read optimizer state.
    for pname, p in model.named_parameters():
        for attr in ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"):
            value = getattr(opt, attr, {}).get(pname)
            if value is not None:
                opt.state[p][attr] = value
    return opt


def lomo_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Return the state tensors a LOMO-style optimizer keeps between steps, by name (AdaLomo's factored
    moments; `make_lomo` also lists them in `optimizer.state`)."""
    out: dict[str, torch.Tensor] = {}
    for attr in ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"):
        for key, value in getattr(optimizer, attr, {}).items():
            out[f"{attr}.{key}"] = value
    return out


def _ensure_process_group() -> None:
    """Start a single-process gloo group if none exists (lomo-optim's fp16 loss scaler asks for a rank)."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        import os
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)


def _all_finite(tensor: torch.Tensor) -> bool:
    """Return whether every value is finite; True under fake tensors (the planner's trace has no values)."""
    from torch._subclasses.fake_tensor import is_fake

    finite = torch.isfinite(tensor).all()
    return is_fake(finite) or bool(finite)


def fused_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, lr: float | None = None) -> bool:
    """Run backward with the update fused in: `grad_norm` first when clipping, then `fused_backward`.

    `lr` defaults to the one `make_lomo` was given. Return whether the weights were updated: with fp16
    weights a step whose gradients overflow is skipped (nothing written) and the loss scale halved;
    after `scale_window` clean steps it doubles.
    """
    if not is_fused_backward(optimizer):
        raise TypeError(f"fused_step needs a LOMO-style optimizer with fused_backward, got {type(optimizer).__name__}")
    lr = getattr(optimizer, "lomo_lr", None) if lr is None else lr
    if lr is None or not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None or (loss.dtype == torch.float16 and hasattr(optimizer, "loss_scale_args")):
        _ensure_process_group()  # lomo-optim's fp16 loss scaler calls torch.distributed.get_rank()
    adalomo = scaler is not None and not hasattr(optimizer, "loss_scale_args")  # AdaLomo in fp16
    if adalomo:
        optimizer.loss_scale = scaler.loss_scale  # AdaLomo multiplies the loss by it, in both passes
    if getattr(optimizer, "clip_grad_norm", None) is not None:
        if scaler is not None:
            scaler.has_overflow_serial = False
        optimizer.grad_norm(loss)
        if adalomo and not _all_finite(optimizer.grad_norms):  # AdaLomo does not check: here
            scaler.has_overflow_serial = True
            for p in optimizer.model.parameters():
                p.grad = None
            optimizer.clip_coef = None
        if scaler is not None and scaler.has_overflow_serial:
            if adalomo:  # LOMO's grad_norm lowered its scale itself
                scaler.update_scale(overflow=True)
            return False  # overflow: the scale is lower, the gradients dropped, this step skipped
    optimizer.fused_backward(loss, lr)
    if scaler is not None:
        if scaler.has_overflow_serial:
            # lomo-optim drops one gradient per hook call after the overflow: any it did not reach would stay
            # resident and be added into the next step's update
            for p in optimizer.model.parameters():
                p.grad = None
        # lomo-optim never raises the scale; a skip found in this pass (partial update) lowers it
        scaler.update_scale(overflow=scaler.has_overflow_serial)
        return not scaler.has_overflow_serial
    return True
