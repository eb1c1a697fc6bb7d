"""Attention, naive and memory-efficient, and which SDPA kernel a device runs (notebook 05).

Naive attention materialises the (B, heads, T, T) scores and keeps the softmax of them for
backward: memory grows with T^2. PyTorch's `scaled_dot_product_attention` (SDPA) dispatches to a
fused kernel (FlashAttention-2 on sm_80+, the memory-efficient kernel on a T4's sm_75, a
flash-style kernel on the CPU) that tiles the computation and keeps only the output and a
log-sum-exp per row: memory grows with T. Both support a causal sliding window.

Which kernel a CUDA GPU runs is a rule of its compute capability and the call (`expected_cuda_backend`):
grouped-query models called without a padding mask (transformers passes `enable_gqa=True`) run the
math kernel below sm_80 and in fp32, so a T4 holds their T x T scores; `repeat_kv_for_sdpa(model)`
makes transformers repeat K/V instead, and the memory-efficient kernel runs. The planner traces each
call with the target's kernel, whatever the process's SDPA flags (`traced_attention`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from colab_memopt.core.console import quiet

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


def _mem_efficient_alignment(capability: tuple[int, int], half: bool) -> int:
    """Return the head-dim multiple the memory-efficient kernel needs (torch's `minimum_gemm_alignment`)."""
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    alignment = 4 if capability >= (8, 0) else 1
    return max(alignment, (128 // 16 if half else 128 // 32)) if tensor_cores else alignment


def expected_cuda_backend(
    capability: tuple[int, int],
    dtype: torch.dtype,
    *,
    masked: bool = False,
    gqa: bool = False,
    head_dim: int = 64,
    value_head_dim: int | None = None,
    efficient_gqa: bool = False,
) -> str:
    """Return the SDPA kernel PyTorch picks on a CUDA GPU of this compute capability (no GPU needed).

    The rule of torch's `select_sdp_backend` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
    torch 2.5 to 2.13) with its default flags, for a dense training call:
    - flash (FlashAttention-2): sm_80 to sm_121, fp16 or bf16, no mask, q/k/v head dims equal and
      <= 256 (not in (192, 224] for backward on sm_86/89/120/121); grouped-query heads accepted;
    - memory-efficient: sm_50 to sm_121, fp32 or fp16 (and bf16 from sm_80), masks accepted, head dims
      a multiple of 8 in fp16/bf16 on sm_75+ (4 in fp32 on sm_80+); grouped-query heads refused
      (`check_batch_size_and_num_heads_dense<false>`);
    - otherwise math, which materialises the (B, heads, T, T) scores.
    `gqa`: the call passes `enable_gqa=True` with fewer key/value heads than query heads (what
    transformers does for a grouped-query model called without a mask). `efficient_gqa`: the
    memory-efficient kernel accepts those (PyTorch main after 2.13, pytorch#191085). cuDNN attention,
    preferred on sm_90+ with a recent cuDNN, holds the same O(T) memory as flash.
    A T4 is (7, 5): fp16 or fp32 -> 'memory-efficient'; grouped-query heads without a mask -> 'math'.
    """
    if not (isinstance(capability, tuple) and len(capability) == 2):
        raise ValueError(f"capability must be a (major, minor) tuple like (7, 5), got {capability!r}")
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    half = dtype in (torch.float16, torch.bfloat16)
    big_head_backward = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
    if ((8, 0) <= capability <= (12, 1) and half and not masked and head_dim == value_head_dim <= 256
            and not (big_head_backward and 192 < head_dim <= 224)):
        return "flash"
    align = _mem_efficient_alignment(capability, half)
    dtype_ok = dtype in (torch.float16, torch.float32) or (dtype == torch.bfloat16 and capability >= (8, 0))
    if ((5, 0) <= capability <= (12, 1) and dtype_ok and (efficient_gqa or not gqa)
            and head_dim % align == 0 and value_head_dim % align == 0):
        return "memory-efficient"
    return "math"


# What a plan runs for calls the target runs fused: CPU SDPA has the flash kernel (O(T), like the CUDA
# ones) and math for what it refuses. Listed explicitly so that no process-wide flag
# (`torch.backends.cuda.enable_flash_sdp(False)`, which CPU dispatch reads too) changes a plan.
_FUSED_BACKENDS = [getattr(SDPBackend, name) for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
                   if hasattr(SDPBackend, name)]
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class TargetAttention:
    """Run each SDPA call with the kernel a CUDA target picks for it; record the calls that run math.

    For calls that `expected_cuda_backend` sends to math on the target (grouped-query heads without a
    mask below sm_80, bf16 below sm_80, ...) the call runs under `sdpa_kernel(MATH)`, so the trace holds
    the scores and softmax the math path keeps for backward. `hidden_bytes` is the largest math call's
    score tensor (batch x heads x T x S, in fp32 for fp16/bf16 inputs, as math upcasts them), `math_calls`
    counts the calls: a plan warns of them. What CUDA's kernels hold inside one op on that path (softmax's
    backward's `grad * output`, `_safe_softmax`'s mask) the tracker counts where it lives
    (`core.tracker.in_op_bytes`).
    """

    def __init__(self, capability: tuple[int, int], *, stand_in: dict[torch.dtype, torch.dtype] | None = None) -> None:
        self.capability = tuple(capability)
        self.stand_in = dict(stand_in or {})  # traced dtype -> the dtype the target runs (bf16 tracing fp16)
        self.hidden_bytes = 0  # bytes
        self.math_calls = 0

    def kernel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, masked: bool, enable_gqa: bool) -> str:
        """Return the kernel the target runs for one call with these tensors (autocast applied first)."""
        dtype = query.dtype
        device_type = query.device.type
        if query.is_floating_point() and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)  # SDPA is on autocast's lower-precision list
        dtype = self.stand_in.get(dtype, dtype)
        gqa = enable_gqa and query.dim() >= 3 and key.dim() >= 3 and query.size(-3) != key.size(-3)
        return expected_cuda_backend(self.capability, dtype, masked=masked, gqa=gqa,
                                     head_dim=int(query.size(-1)), value_head_dim=int(value.size(-1)))

    def call(self, sdpa: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run `sdpa` (torch's `scaled_dot_product_attention`) on these arguments with the target's kernel."""
        bound = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
        query, key, value = bound["query"], bound["key"], bound["value"]
        kernel = self.kernel(query, key, value, masked=bound.get("attn_mask") is not None,
                             enable_gqa=bool(bound.get("enable_gqa", False)))
        if kernel != "math":
            with sdpa_kernel(_FUSED_BACKENDS):
                return sdpa(*args, **kwargs)
        with sdpa_kernel([SDPBackend.MATH]):
            out = sdpa(*args, **kwargs)
        score_itemsize = max(4, query.element_size())  # math upcasts fp16/bf16 scores to fp32
        scores = int(query.numel()) // int(query.size(-1)) * int(key.size(-2))  # (B, heads, T, S)
        self.hidden_bytes = max(self.hidden_bytes, scores * score_itemsize)
        self.math_calls += 1
        return out


@contextlib.contextmanager
def traced_attention(
    capability: tuple[int, int] | None, *, stand_in: dict[torch.dtype, torch.dtype] | None = None
) -> Iterator[TargetAttention | None]:
    """Trace SDPA as the target runs it, whatever the process's SDPA flags, for the duration.

    `capability`: the CUDA target's (major, minor), or None for a CPU target (or a GPU of unknown
    capability): every call then runs the CPU's fused kernel. With a capability each call of
    `torch.nn.functional.scaled_dot_product_attention` (looked up at call time, as transformers and
    this package do; checkpointed recomputation included) picks its kernel by `TargetAttention`.
    Yields that `TargetAttention` (None without a capability): its `math_calls` and `hidden_bytes` say whether
    and how big math ran. The SDPA flags, math's fp16/bf16 reduction flag and the function are restored afterwards.

    Example:
        >>> with traced_attention((7, 5)) as sdpa:
        ...     step()
        >>> sdpa.hidden_bytes
    """
    reduction = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    allowed = reduction() if reduction is not None else None
    target = TargetAttention(capability, stand_in=stand_in) if capability is not None else None
    previous = F.scaled_dot_product_attention

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        return target.call(torch._C._nn.scaled_dot_product_attention, *args, **kwargs)  # type: ignore[union-attr]

    try:
        if allowed:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)  # torch's default: math upcasts to fp32
        if target is not None:
            F.scaled_dot_product_attention = scaled_dot_product_attention
        with sdpa_kernel(_FUSED_BACKENDS):
            yield target
    finally:
        F.scaled_dot_product_attention = previous
        if allowed:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)


REPEATED_KV_ATTENTION = "sdpa_repeated_kv"  # the attn_implementation name `repeat_kv_for_sdpa` registers


class _OneGroup:
    """A view of an attention module whose key/value heads are already repeated: one group per query head."""

    num_key_value_groups = 1

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _sdpa_repeated_kv(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                      **kwargs: Any) -> tuple[torch.Tensor, Any]:
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    return sdpa_attention_forward(_OneGroup(module), query, repeat_kv(key, groups), repeat_kv(value, groups),
                                  attention_mask, **kwargs)


def repeat_kv_for_sdpa(model: Any) -> Any:
    """Make a transformers model repeat its grouped-query key/value heads before SDPA; return the model.

    Grouped-query models (Llama 3, Qwen2.5, SmolLM2, ...) called without a padding mask pass
    `enable_gqa=True` to SDPA. Below sm_80 (a T4) and in fp32 anywhere, torch then runs the math
    kernel, which holds batch x heads x T x T scores per layer. With K/V repeated (two
    (B, heads, T, head_dim) copies per layer, O(T)) the memory-efficient kernel runs instead. Same
    results; the model's `attn_implementation` becomes 'sdpa_repeated_kv' (transformers'
    AttentionInterface). Plan the model after calling this: the planner traces what it runs.

    Example:
        >>> model = repeat_kv_for_sdpa(AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M"))
    """
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from transformers import AttentionInterface, PreTrainedModel
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"repeat_kv_for_sdpa needs a transformers model (PreTrainedModel), got {type(model).__name__}")
    AttentionInterface.register(REPEATED_KV_ATTENTION, _sdpa_repeated_kv)
    AttentionMaskInterface.register(REPEATED_KV_ATTENTION, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(REPEATED_KV_ATTENTION)
    else:  # transformers before set_attn_implementation
        model.config._attn_implementation = REPEATED_KV_ATTENTION
    return model


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
