"""The memory budget on paper: bytes per parameter and activations per layer.

Every figure here is a formula with its source; notebooks put it next to a measurement.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from colab_memopt.models import GPTConfig

# Bytes per parameter of the model states (weights, gradients, optimizer state) in mixed-precision
# AdamW training, as the literature counts them. They differ in what they include.
MODEL_STATE_CONVENTIONS = {
    "zero": (16, "ZeRO paper (Rajbhandari et al. 2020): 2 fp16 weights + 2 fp16 grads + 12 fp32 master, m, v"),
    "megatron": (18, "Megatron / stas00's ML Engineering book: as ZeRO plus fp32 gradients (+2 net)"),
    "zero_infinity": (20, "ZeRO-Infinity (Rajbhandari et al. 2021): as ZeRO plus fp32 gradient copy"),
    "accelerate_fp16": (8, "Accelerate estimate-memory for fp16 training: the largest component, not the sum"),
}

# Optimizer-state bytes per parameter element for fp32 parameters (PyTorch's implementations).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}


def fp32_training_bytes_per_param(optimizer: str = "adamw") -> int:
    """Return the bytes per parameter of plain fp32 training: 4 weights + 4 gradients + optimizer state."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}")
    return 4 + 4 + OPTIMIZER_STATE_BYTES[optimizer]


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    """Return the bytes of the given parameters, each shared tensor counted once."""
    return sum(p.numel() * p.element_size() for p in _unique(params))


def optimizer_state_bytes(params: Iterable[torch.Tensor], optimizer: str) -> int:
    """Return the exact optimizer-state bytes PyTorch allocates for these parameters.

    Adam and AdamW keep exp_avg and exp_avg_sq in the parameter's dtype plus a 4-byte float32
    `step` tensor per parameter tensor; SGD with momentum keeps one momentum buffer; SGD nothing.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}")
    ps = [p for p in _unique(params) if p.requires_grad]
    elems = sum(p.numel() * p.element_size() for p in ps)
    if optimizer in ("adam", "adamw"):
        return 2 * elems + 4 * len(ps)
    if optimizer == "sgd_momentum":
        return elems
    return 0


def block_activation_bytes(
    config: GPTConfig, batch: int, seq: int, *, bytes_per_value: int = 4, attention: str | None = None
) -> int:
    """Return the bytes one block of the reference model keeps for backward (no recomputation).

    Counted from what PyTorch's autograd saves in `models.Block` (units of s*b*h values):
    LayerNorm outputs 2, qkv 3, attention output 1, residual stream after attention 1 and after the
    MLP 1, MLP up-projection and GELU outputs 2*r; LayerNorm mean and rstd (fp32, 2 per norm).
    SDPA adds its log-sum-exp (b*a*s fp32); naive attention adds the softmax output (a*s^2*b values)
    and the causal mask (s^2 bool). Checked to the byte against the tensor tracker in the tests.
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    attention = attention or config.attention
    b, s, h, a, r = batch, seq, config.d_model, config.n_head, config.mlp_ratio
    total = (8 + 2 * r) * s * b * h * bytes_per_value + 2 * 2 * b * s * 4
    if attention == "sdpa":
        total += a * b * s * 4
    elif attention == "naive":
        total += a * s * s * b * bytes_per_value + s * s
    else:
        raise ValueError(f"attention must be 'sdpa' or 'naive', got {attention!r}")
    return total


def korthikanti_activation_bytes(seq: int, batch: int, hidden: int, heads: int, *, flash: bool = False) -> int:
    """Return Korthikanti et al. (2022)'s activation bytes per transformer layer: s*b*h*(34 + 5*a*s/h).

    Their count assumes 16-bit activations, 1-byte dropout masks and no recomputation;
    memory-efficient (flash) attention removes the 5*a*s/h term.
    """
    sbh = seq * batch * hidden
    return 34 * sbh + (0 if flash else 5 * heads * seq * seq * batch)


def precision_state_bytes_per_param(precision: str, optimizer: str = "adamw") -> int:
    """Return the model-state bytes per parameter (weights + gradients + optimizer state) under `precision`.

    Autocast ('fp16-autocast', 'bf16-autocast') keeps fp32 weights, fp32 gradients and fp32 optimizer
    state: the same 16 B/param as fp32 with AdamW (its 16-bit weight copies are per-step temporaries).
    Pure 'bf16' stores all three in bf16: 2 + 2 + 4 = 8 B/param with AdamW (PyTorch keeps the state
    in the parameter's dtype). Source: PyTorch's autocast and AdamW implementations; cf. the 16-20
    B/param conventions in `MODEL_STATE_CONVENTIONS`, which add a 16-bit weight copy.
    """
    from colab_memopt.precision import check_precision

    check_precision(precision)
    fp32 = fp32_training_bytes_per_param(optimizer)
    return fp32 // 2 if precision == "bf16" else fp32


def attention_scores_bytes(seq: int, heads: int, *, batch: int = 1, bytes_per_value: int = 4) -> int:
    """Return the bytes of one materialised attention score matrix per layer: b*a*s^2 values.

    Naive attention keeps the softmax of it for backward (and briefly the scores and their gradient);
    memory-efficient kernels keep none of it. The literature's "8 GB per layer for 32 heads at 8192
    tokens" is this with batch 1 in fp32.
    """
    if seq < 1 or heads < 1 or batch < 1:
        raise ValueError(f"seq, heads and batch must be >= 1, got seq={seq}, heads={heads}, batch={batch}")
    return batch * heads * seq * seq * bytes_per_value
