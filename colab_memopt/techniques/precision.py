"""Mixed precision: which dtype each part of a training step computes and stores in.

Four precisions, named as the recipe names them (notebook 02):

- 'fp32': everything in float32 (the baseline).
- 'fp16-autocast': fp32 weights, matmuls and their saved activations in float16 under
  `torch.autocast`, loss scaled by `torch.amp.GradScaler` so small fp16 gradients do not flush to
  zero. The T4's choice (sm_75 has fp16 tensor cores, no native bf16).
- 'bf16-autocast': fp32 weights, matmuls in bfloat16 under `torch.autocast`; bf16 has fp32's
  exponent range, so no scaler. Native on Ampere and newer; the CPU runs it too (slowly on AVX2).
- 'bf16': the weights themselves (and so gradients and optimizer state) in bfloat16: no fp32 master
  copy. Halves model states, at the cost of updates smaller than bf16's resolution being lost.
- 'fp16': the weights and gradients in float16 (the T4's 16-bit type), no fp32 master copy, the loss
  scaled by `rounding.DynamicLossScaler` (torch's GradScaler refuses fp16 gradients). Updates kept
  honest by `rounding.UpdateRounding` (Kahan or stochastic rounding; notebook 16).

Forward-only phases (evaluation) can run at a different precision: `forward_context`.

With LoRA, the frozen base need not be fp32 at all: `half_frozen_base` stores it in fp16 (a T4) or
bf16 (native from Ampere on) and keeps the trainable adapters in fp32, so fp16 autocast's GradScaler
unscales fp32 gradients (fp16 trainable weights fail with "Attempting to unscale FP16 gradients").
The recipe field is `Recipe.base_dtype`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

PRECISIONS = ("fp32", "fp16-autocast", "bf16-autocast", "bf16", "fp16")
# Pure 16-bit weights (no fp32 master copy) and their dtype.
PURE_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Precisions a forward-only phase may use: the model's weights are what they are, autocast on top.
FORWARD_PRECISIONS = ("fp32", "fp16-autocast", "bf16-autocast")

_AUTOCAST_DTYPE = {"fp16-autocast": torch.float16, "bf16-autocast": torch.bfloat16}
# Frozen-base dtypes (Recipe.base_dtype) and the autocast precision each one computes under.
BASE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BASE_DTYPE_PRECISION = {"fp16": "fp16-autocast", "bf16": "bf16-autocast"}


def check_precision(precision: str, *, allowed: tuple[str, ...] = PRECISIONS, name: str = "precision") -> str:
    """Return `precision` if it is one of `allowed`, else raise ValueError naming it."""
    if not isinstance(precision, str) or precision not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {precision!r}")
    return precision


def weight_dtype(precision: str) -> torch.dtype:
    """Return the dtype the weights are stored in under `precision` (16-bit only for pure 'bf16' and 'fp16')."""
    check_precision(precision)
    return PURE_PRECISIONS.get(precision, torch.float32)


def compute_dtype(precision: str) -> torch.dtype:
    """Return the dtype matmuls compute in under `precision`."""
    check_precision(precision)
    if precision in ("fp32", "fp16"):
        return torch.float16 if precision == "fp16" else torch.float32
    return _AUTOCAST_DTYPE.get(precision, torch.bfloat16)


def autocast_context(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Return the autocast context for `precision` on `device`; a no-op for 'fp32', 'bf16' and 'fp16'.

    Example:
        >>> with autocast_context("bf16-autocast", "cpu"):
        ...     loss = model(x, labels=x).loss
    """
    check_precision(precision)
    device_type = torch.device(device).type
    if precision in _AUTOCAST_DTYPE:
        return torch.autocast(device_type=device_type, dtype=_AUTOCAST_DTYPE[precision])
    return contextlib.nullcontext()


def forward_context(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Return the context a forward-only phase (evaluation) runs in: autocast, or nothing for 'fp32'."""
    check_precision(precision, allowed=FORWARD_PRECISIONS, name="eval precision")
    return autocast_context(precision, device)


def make_grad_scaler(precision: str, device: torch.device | str) -> torch.amp.GradScaler | Any | None:
    """Return a GradScaler for 'fp16-autocast' on `device`, a `rounding.DynamicLossScaler` for pure
    'fp16' (GradScaler refuses fp16 gradients), else None (bf16 and fp32 need none)."""
    check_precision(precision)
    if precision == "fp16":
        from colab_memopt.techniques.rounding import DynamicLossScaler

        return DynamicLossScaler()
    if precision != "fp16-autocast":
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def cast_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast `model`'s floating-point parameters and saved buffers to `dtype`, as `from_pretrained(dtype=...)` loads
    them: buffers a checkpoint does not hold (rotary tables' `inv_freq`) keep their dtype, so the model computes as
    it does when its saved weights are loaded again. Return the model."""
    kept = [(m, name, buf, buf.dtype) for m in model.modules() for name, buf in m._buffers.items()
            if name in m._non_persistent_buffers_set and buf is not None and buf.is_floating_point()]
    model.to(dtype)
    for m, name, buf, was in kept:  # the dtype it had, not the tensor's: a planner's fake .to() casts in place
        m._buffers[name] = buf.to(m._buffers[name].device, dtype=was)
    return model


def prepare_model(model: nn.Module, precision: str) -> nn.Module:
    """Cast the model's floating-point weights for `precision` (only 'bf16' and 'fp16' change them) and return it."""
    check_precision(precision)
    if precision in PURE_PRECISIONS:
        cast_weights(model, PURE_PRECISIONS[precision])
    return model


def backward_and_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    *,
    step: bool = True,
) -> None:
    """Run backward on `loss` (scaled when a scaler is given) and, if `step`, the optimizer step."""
    if scaler is None:
        loss.backward()
        if step:
            optimizer.step()
        return
    scaler.scale(loss).backward()
    if step:
        scaler.step(optimizer)  # unscales, skips the step when a gradient is inf or NaN
        scaler.update()


def fp16_supported(device: torch.device | str) -> bool:
    """Return whether a float16 matmul with backward runs on `device` (CPU builds may lack kernels)."""
    dev = torch.device(device)
    try:
        a = torch.randn(4, 4, device=dev, requires_grad=True)
        with torch.autocast(device_type=dev.type, dtype=torch.float16):
            out = a @ a
        out.float().sum().backward()
    except RuntimeError:
        return False
    return True



def check_base_dtype(base_dtype: str | None, *, name: str = "base_dtype") -> str | None:
    """Return `base_dtype` if it is None, 'fp16' or 'bf16', else raise ValueError naming it."""
    if base_dtype is not None and base_dtype not in BASE_DTYPES:
        raise ValueError(f"{name} must be None (fp32) or one of {tuple(BASE_DTYPES)}, got {base_dtype!r}")
    return base_dtype


def check_native_bf16(base_dtype: str | None, *, native_bf16: bool | None, where: str) -> None:
    """Raise ValueError for a bf16 frozen base on a device known to lack native bf16 (a T4, sm_75).

    `native_bf16` None means the device is not known: nothing is refused.
    """
    if base_dtype == "bf16" and native_bf16 is False:
        raise ValueError(
            f"base_dtype='bf16' on {where}, which has no native bf16 (compute capability < 8.0: its bf16 matmuls "
            "are emulated and slow): use base_dtype='fp16' with precision='fp16-autocast'"
        )


def half_frozen_base(model: nn.Module, base_dtype: str) -> nn.Module:
    """Store every floating-point weight and saved buffer of `model` in `base_dtype` ('fp16' or 'bf16'); return it.

    Call it on the frozen base before LoRA adapters are added (and before 4-bit quantization, whose layers
    then compute in that dtype), then `adapters_to_fp32` after: only the adapters train. Buffers a
    checkpoint does not hold (rotary tables) keep their dtype, as `from_pretrained(dtype=...)` keeps them.
    """
    check_base_dtype(base_dtype)
    return cast_weights(model, BASE_DTYPES[base_dtype])


def adapters_to_fp32(model: nn.Module) -> nn.Module:
    """Keep the trainable parameters (the LoRA adapters) in fp32, whatever dtype the base is stored in."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
    return model


# -- trainable weights under fp16 autocast (MemoryGuardCallback, plan_trainer and doctor use these) --
HALF_DTYPES = (torch.bfloat16, torch.float16)


def half_trainable(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """Return {name: dtype} of the trainable parameters stored in bf16 or fp16.

    Under `fp16=True` the GradScaler cannot unscale them: bf16 fails on CUDA with
    "_amp_foreach_non_finite_check_and_unscale_cuda not implemented for 'BFloat16'" (TRL casts a
    4-bit or 8-bit model's LoRA weights to bf16: huggingface/trl#4901), fp16 with "Attempting to
    unscale FP16 gradients" (diffusers#6086).
    """
    return {n: p.dtype for n, p in model.named_parameters() if p.requires_grad and p.dtype in HALF_DTYPES}


def upcast_trainable(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """Cast the bf16/fp16 trainable parameters of `model` to fp32 in place; return {name: dtype before}.

    The parameters stay the same objects (an optimizer already built keeps them); call it before the first
    step, while no optimizer state exists. Example:
        >>> cm.guard.upcast_trainable(trainer.model)   # after SFTTrainer(...), before trainer.train()
    """
    found = half_trainable(model)
    for name, p in model.named_parameters():
        if name in found:
            p.data = p.data.float()
    return found


def describe_half_trainable(found: dict[str, torch.dtype]) -> str:
    """Return 'N trainable tensor(s) in bfloat16' (the dtypes named as torch names them)."""
    dtypes = sorted({str(d).removeprefix("torch.") for d in found.values()})
    return f"{len(found)} trainable tensor(s) in {' and '.join(dtypes)}"


def bf16_matmul_check(device: torch.device | str, *, size: int = 2048, repeat: int = 5) -> dict[str, Any]:
    """Return what a bf16 matmul measures on a CUDA device against the same matmul in fp16.

    Keys: 'capability' (major, minor), 'is_bf16_supported' (what torch answers), 'bf16_seconds' and
    'fp16_seconds' (median of `repeat` timed (size, size) matmuls, after one warm-up), 'bf16_error'
    (the exception text where bf16 does not run, else None). On a device that is not CUDA it measures
    nothing and says so: {'measured': False, 'why': ...}.

    Example:
        >>> bf16_matmul_check("cpu")["measured"]
        False
    """
    import statistics
    import time

    dev = torch.device(device)
    if dev.type != "cuda":
        return {"measured": False, "why": f"device {dev.type!r} is not CUDA: bf16 on a T4 is measured on a CUDA GPU"}
    if size < 1 or repeat < 1:
        raise ValueError(f"size and repeat must be >= 1, got size={size}, repeat={repeat}")
    out: dict[str, Any] = {"measured": True, "capability": torch.cuda.get_device_capability(dev),
                           "is_bf16_supported": torch.cuda.is_bf16_supported(), "bf16_error": None}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        try:
            a = torch.randn(size, size, device=dev, dtype=dtype)
            a @ a  # warm-up: kernel selection
            torch.cuda.synchronize(dev)
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                a @ a
                torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - start)
            out[f"{name}_seconds"] = statistics.median(times)
        except RuntimeError as exc:  # no bf16 kernel on this card
            out[f"{name}_seconds"] = None
            out[f"{name}_error"] = str(exc).splitlines()[0]
    return out
