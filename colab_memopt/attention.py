"""Attention, naive and memory-efficient, and which SDPA kernel a device runs (notebook 05).

Naive attention materialises the (B, heads, T, T) scores and keeps the softmax of them for
backward: memory grows with T^2. PyTorch's `scaled_dot_product_attention` (SDPA) dispatches to a
fused kernel (FlashAttention-2 on sm_80+, the memory-efficient kernel on a T4's sm_75, a
flash-style kernel on the CPU) that tiles the computation and keeps only the output and a
log-sum-exp per row: memory grows with T. Both support a causal sliding window.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ATTENTION_IMPLS = ("naive", "sdpa")

# The aten op each SDPA backend dispatches to, and its name in PyTorch's `SDPBackend`.
SDPA_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU kernel)",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable (custom device)",
}


def check_window(window: int | None) -> None:
    """Raise ValueError unless `window` is None or an integer >= 1."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding window must be None or an integer >= 1 (tokens), got {window!r}")


def causal_mask(seq_len: int, *, window: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Return the (T, T) boolean mask of allowed positions: causal, and within `window` tokens if set.

    Row i may attend to columns j with i - window < j <= i.
    """
    check_window(window)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if window is not None:
        mask = mask.triu(-(window - 1))
    return mask


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None) -> torch.Tensor:
    """Return causal attention computed by hand: scores (B, nh, T, T), mask, softmax, times v."""
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
    mask = causal_mask(T, window=window, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v  # (B, nh, T, hs)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None) -> torch.Tensor:
    """Return causal attention through `F.scaled_dot_product_attention`.

    Without a window it passes `is_causal=True` (no mask tensor at all). A sliding window needs an
    explicit (T, T) boolean mask: 1 byte per entry, shared across batch and heads; SDPA turns it into
    an additive mask in q's dtype before the kernel (T x T x 4 bytes in fp32, 2 in fp16: checked on
    the CPU), and on CUDA the mask rules out the flash kernel (the memory-efficient kernel takes the
    float bias, padded to 16 columns).
    """
    check_window(window)
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = causal_mask(q.size(-2), window=window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, impl: str = "sdpa", window: int | None = None) -> torch.Tensor:
    """Return causal attention of q, k, v (B, nh, T, hs) with implementation `impl`: 'naive' or 'sdpa'."""
    if impl == "sdpa":
        return sdpa_attention(q, k, v, window=window)
    if impl == "naive":
        return naive_attention(q, k, v, window=window)
    raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def sdpa_backend(
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype = torch.float32,
    heads: int = 4,
    head_dim: int = 64,
    seq_len: int = 128,
    window: int | None = None,
) -> str:
    """Return the SDPA kernel that runs forward and backward on `device` for these shapes.

    It runs SDPA once and reads the aten op it dispatched to: 'flash', 'flash (CPU kernel)',
    'memory-efficient', 'cuDNN', or 'math' (the unfused fallback, which materialises the scores).
    """
    dev = torch.device(device)
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    recorder = _OpRecorder()
    with recorder:
        out = sdpa_attention(q, k, v, window=window)
    out.sum().backward()
    for op in recorder.ops:
        if op in SDPA_OPS:
            return SDPA_OPS[op]
    return "math"


def expected_cuda_backend(capability: tuple[int, int], dtype: torch.dtype, *, masked: bool = False) -> str:
    """Return the SDPA kernel PyTorch picks on a CUDA GPU of this compute capability (no GPU needed).

    FlashAttention-2 needs sm_80+ and fp16/bf16 and no arbitrary mask; the memory-efficient kernel
    runs from sm_50 in fp32, fp16 and (sm_80+) bf16, masks included; otherwise the math fallback.
    A T4 is (7, 5): fp16 or fp32 -> 'memory-efficient'.
    """
    if not (isinstance(capability, tuple) and len(capability) == 2):
        raise ValueError(f"capability must be a (major, minor) tuple like (7, 5), got {capability!r}")
    half = dtype in (torch.float16, torch.bfloat16)
    if capability >= (8, 0) and half and not masked:
        return "flash"
    if capability >= (5, 0) and (dtype != torch.bfloat16 or capability >= (8, 0)):
        return "memory-efficient"
    return "math"


def attention_step(
    impl: str,
    *,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    seed: int = 0,
) -> tuple[Any, list[torch.Tensor]]:
    """Return (step, [q, k, v]): a step that runs attention forward and backward on fixed inputs.

    Pass the inputs to `measure_step(..., track=inputs)` so they count in the peak; the attention's
    own memory is then the peak minus the inputs' bytes.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    for name, value in (("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq_len, head_dim)
    inputs = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_() for _ in range(3)]

    def step() -> None:
        for t in inputs:
            t.grad = None
        out = attend(*inputs, impl=impl, window=window)
        out.backward(torch.ones_like(out))

    return step, inputs


def fit_growth_exponent(seq_lens: list[int], values: list[float]) -> float:
    """Return the slope of log(value) against log(seq_len): 2 for T^2 growth, 1 for linear."""
    if len(seq_lens) != len(values) or len(seq_lens) < 2:
        raise ValueError(f"need two or more (seq_len, value) pairs, got {len(seq_lens)} and {len(values)}")
    if min(seq_lens) <= 0 or min(values) <= 0:
        raise ValueError("seq_lens and values must be positive to fit on a log-log scale")
    xs = [math.log(s) for s in seq_lens]
    ys = [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        raise ValueError("seq_lens must not all be equal")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def score_matrix_bytes(seq_len: int, heads: int, *, batch: int = 1, bytes_per_value: int = 4) -> int:
    """Return the bytes of one materialised (batch, heads, T, T) score matrix: the naive term."""
    return batch * heads * seq_len * seq_len * bytes_per_value
