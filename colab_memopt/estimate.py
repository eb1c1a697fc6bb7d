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


# -- notebook 13: semiseparable matrices (structured.py) ----------------------------------------------


def semiseparable_bytes(n: int, rank: int, *, band_bytes: int = 4, lowrank_bytes: int = 4) -> int:
    """Return the storage of tridiagonal + rank-r: (3N - 2) band values and 2 N r factor values.

    With r = ceil(log2 N) this is what the source's "98.8% vs dense" (N = 2048, fp32) and "99.3%
    mixed precision" (fp16 factors) amount to: 1 - (3N + 2Nr) / N^2 at 4 bytes each.
    """
    if n < 2 or rank < 1:
        raise ValueError(f"n must be >= 2 and rank >= 1, got n={n}, rank={rank}")
    return (3 * n - 2) * band_bytes + 2 * n * rank * lowrank_bytes


def hierarchical_semiseparable_bytes(n: int, rank: int, num_levels: int, *, bytes_per_value: int = 4) -> int:
    """Return the storage of the multi-level form: 2 off-diagonal rank-r blocks per split, leaves tridiagonal + rank r.

    Each level stores about 2 N r values, the leaves N (3 + 2 r): O(N r L), so O(N log N) with
    r = log2 N and a fixed number of levels, O(N log^2 N) when the levels grow as log N.
    """
    if num_levels == 0:
        return semiseparable_bytes(n, min(rank, n), band_bytes=bytes_per_value, lowrank_bytes=bytes_per_value)
    m = n // 2
    r = min(rank, m, n - m)
    return (
        2 * (m * r + (n - m) * r) * bytes_per_value
        + hierarchical_semiseparable_bytes(m, rank, num_levels - 1, bytes_per_value=bytes_per_value)
        + hierarchical_semiseparable_bytes(n - m, rank, num_levels - 1, bytes_per_value=bytes_per_value)
    )


def max_trainable_params(device_bytes: int, bytes_per_param: float) -> int:
    """Return how many parameters fit in `device_bytes` at `bytes_per_param` (activations not counted)."""
    if device_bytes <= 0 or bytes_per_param <= 0:
        raise ValueError(f"device_bytes and bytes_per_param must be > 0, got {device_bytes}, {bytes_per_param}")
    return int(device_bytes // bytes_per_param)


# -- notebook 14: phase-aware training (phases.py) ----------------------------------------------------


def phase_device_bytes(
    n_params: int,
    phase: str,
    *,
    weight_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    predictor_bytes: int = 2,
    offload_optimizer: bool = True,
) -> int:
    """Return the model-state bytes on the device in a 'full' or 'predict' step (activations not counted).

    Full: weights + gradients + optimizer state (unless offloaded to the host) + the predictor's
    moving average of updates. Predict: weights + predictor; gradients are freed, the optimizer
    state is offloaded. Defaults: mixed-precision AdamW as the ZeRO paper counts it (2 + 2 + 12).
    """
    if phase not in ("full", "predict"):
        raise ValueError(f"phase must be 'full' or 'predict', got {phase!r}")
    if n_params < 1:
        raise ValueError(f"n_params must be >= 1, got {n_params}")
    per_param = weight_bytes + predictor_bytes
    if phase == "full":
        per_param += grad_bytes + (0 if offload_optimizer else optimizer_bytes)
    return n_params * per_param
