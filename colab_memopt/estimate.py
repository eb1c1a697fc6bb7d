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


# -- notebooks 11-12: monitoring, OOM diagnosis, data pipeline --------------------------------------
def training_peak_bytes(
    config: GPTConfig,
    batch: int,
    seq: int,
    *,
    optimizer: str = "adamw",
    attention: str | None = None,
    bytes_per_value: int = 4,
    checkpointing: bool = False,
    optimizer_bytes_per_param: float | None = None,
) -> int:
    """Return the paper estimate of one training step's peak for the reference model, in bytes.

    Model states (fp32 weights and gradients, optimizer state: `OPTIMIZER_STATE_BYTES`, or
    `optimizer_bytes_per_param` for e.g. 8-bit Adam's 2) plus activations: each block's
    `block_activation_bytes` (with `checkpointing`, only each block's input, s*b*h values, plus one
    block recomputed: Korthikanti et al. 2022, full recomputation), the embedding output and the
    output layer's logits, their log-softmax and its gradient (3*b*s*V values). An upper-side
    estimate: the real peak never holds all of these at once; notebook 12 compares it with a
    measurement.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}")
    if bytes_per_value not in (2, 4):
        raise ValueError(f"bytes_per_value must be 2 or 4, got {bytes_per_value}")
    n = config.n_params
    opt_bpp = OPTIMIZER_STATE_BYTES[optimizer] if optimizer_bytes_per_param is None else optimizer_bytes_per_param
    states = int(n * (4 + 4 + opt_bpp))
    block = block_activation_bytes(config, batch, seq, bytes_per_value=bytes_per_value, attention=attention)
    if checkpointing:
        blocks = config.n_layer * batch * seq * config.d_model * bytes_per_value + block
    else:
        blocks = config.n_layer * block
    head = 3 * batch * seq * config.vocab_size * bytes_per_value + batch * seq * config.d_model * bytes_per_value
    return states + blocks + head


def dataloader_prefetch_bytes(
    num_workers: int, prefetch_factor: int, batch_size: int, seq_len: int, bytes_per_token: int = 2
) -> int:
    """Return the host RAM of batches a DataLoader holds prefetched: workers x prefetch x batch x seq x bytes.

    Source document 002's data-pipeline formula (with 2-byte tokens); PyTorch's DataLoader keeps
    `prefetch_factor` batches in flight per worker. Token ids as int64 take 8 bytes.
    """
    for name, value in (("num_workers", num_workers), ("prefetch_factor", prefetch_factor),
                        ("batch_size", batch_size), ("seq_len", seq_len), ("bytes_per_token", bytes_per_token)):
        if not isinstance(value, int) or value < (0 if name == "num_workers" else 1):
            raise ValueError(f"{name} must be an integer >= {0 if name == 'num_workers' else 1}, got {value!r}")
    return num_workers * prefetch_factor * batch_size * seq_len * bytes_per_token
