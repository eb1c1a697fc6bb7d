"""Cross-entropy over a large vocabulary without the full `tokens x vocab` logits or their gradient.

A language model's loss is usually `F.cross_entropy(hidden @ weight.T, labels)`: it materialises the
logits (N, V), their log-softmax and, in backward, their gradient, each N x V values (upcast to fp32
as transformers does). At Llama-3's vocabulary of 128,256 and 16,384 tokens one such fp32 tensor is
16384 x 128256 x 4 bytes = 8.4 GB, more than half of a free T4's 14.56 GiB, and the plain loss holds
three at its peak (traced in the benchmark). `chunked_cross_entropy` goes through the tokens by chunks: for
each chunk it computes the logits in fp32, their logsumexp and the loss contribution, then drops
the chunk's logits; backward goes through the chunks again, computes each chunk's logits once more and
from them the gradient with respect to the hidden states and the head's weight (and bias). Only the
gradients (N, H) and (V, H), which any method returns, outlive a chunk. The figures are in `benchmarks/results/chunked_loss.json`
(`benchmarks/chunked_loss.py`).

The field's versions of the same idea, both GPU kernels:
- Liger Kernel's fused linear cross-entropy (Hsu et al. 2024, `liger-kernel` on PyPI), Triton; it
  moved transformers' limit from 4K to 16K tokens (reported). On this project's CPU-only machine it does not
  run (checked with liger-kernel 0.8.5): without Triton `from liger_kernel.transformers import
  LigerFusedLinearCrossEntropyLoss` fails with "ModuleNotFoundError: No module named 'triton'"; with
  triton 3.9.0 installed the import works and the first call on CPU tensors fails in the Triton
  launcher with "RuntimeError: 0 active drivers ([]). There should only be one." So no comparison
  with it was measured here.
- Apple's Cut Cross-Entropy (Wijmans et al. 2024, `cut-cross-entropy`): computes the logsumexp in
  on-chip memory and never writes any logits; Gemma-2-2B's loss from 24 GB to 1 MB (reported;
  Ampere-only kernel).

This module is plain PyTorch, so it runs on the CPU, on a T4 and under fake tensors (the planner's
trace). It does four matmuls where the plain loss does three (the logits twice) and reads the head's
weight once per chunk instead of once per step. The gradients are computed in backward because only
there the incoming gradient is known: under a loss scaler it carries the scale (GradScaler starts at
2^16), and the logits' gradient is multiplied by it in fp32 before the cast to fp16, as the plain
loss's backward does. Computed in forward and cast unscaled, (softmax - onehot) / N underflows in fp16
(p / N is about 1e-8 at vocabulary 128,256 and 1,024 tokens, below fp16's smallest subnormal), and the
scale 2^16 itself is inf in fp16. Evaluation (`torch.no_grad()`) holds one chunk's logits and nothing
else. With an fp32 weight its gradient is accumulated in fp32, also under autocast (an fp32 matmul for
that part). `python benchmarks/chunked_loss.py --fp16-check` prints the fp16 gradient errors of the
chunked and the plain loss against fp32 at loss scales 2^10 and 2^16.
Labels are checked against the vocabulary on real tensors (one device sync per call), not under fake
tensors.

A whole model's loss by chunks: `apply_chunked_loss(model, chunk_tokens)` (what
`Recipe(loss_chunk_tokens=...)` applies in `Recipe.build`) sets the reference model's
`loss_chunk_tokens`, or, for a transformers causal LM (peft adapters injected or not), makes
`model(ids, labels=ids)` run the base model to its final hidden states and hand them, with the output
layer's weight, to `causal_lm_loss`: the head is never applied to all tokens and `.logits` is None.
`traced_loss_bytes` traces one loss step on fake tensors (notebook 17's Cut Cross-Entropy claim).

Example:
    >>> loss = causal_lm_loss(hidden, model.lm_head.weight, input_ids, chunk_tokens=128)
    >>> loss.backward()
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from colab_memopt.core.console import quiet

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "REDUCTIONS",
    "ChunkedCrossEntropy",
    "chunked_cross_entropy",
    "causal_lm_loss",
    "make_loss_step",
    "check_chunkable",
    "check_objective",
    "check_head_not_adapted",
    "apply_chunked_loss",
    "traced_loss_bytes",
    "AUTO_CHUNK_MAX_TOKENS",
    "auto_chunk_tokens",
]

# Tokens per chunk. Picked by `benchmarks/chunked_loss.py`'s sweep on this project's 2-core CPU
# ("chunk_sweep" in benchmarks/results/chunked_loss.json: 2048 tokens x vocabulary 16,384 x hidden
# 256, chunks of 32 to 2048 tokens): the smallest chunk within 5% of the fastest. The chunk's memory
# grows linearly with it (at vocabulary 128,256 a 128-token chunk's fp32 logits are 63 MiB), while
# smaller chunks pay for more, smaller matmuls. The machine is shared and the recorded sweep ran
# while other work raised its load (the JSON keeps the load average and every round's times): rerun
# it on a quiet machine, and on a GPU, before trusting the time ranking.
DEFAULT_CHUNK_TOKENS = 128
REDUCTIONS = ("mean", "sum")


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """Return the dtype the head's matmul runs in: autocast's where it is on, else the inputs'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must have the same dtype outside autocast, got {hidden.dtype} and {weight.dtype}"
        )
    return hidden.dtype


def _gathered(*tensors: torch.Tensor | None) -> Any:
    """Return a context in which DeepSpeed ZeRO-3 partitioned parameters among `tensors` hold their full values.

    Under ZeRO-3 a parameter's data is a 0-element placeholder except while its module runs. The loss's
    backward runs before any module's backward hook re-gathers the head's weight (in forward a head whose
    own forward is skipped, as in `_chunked_forward`, may be partitioned too; untested there), so the weight
    and bias are gathered here (`deepspeed.zero.GatheredParameters`, read-only: partitioned again on exit).
    Parameters already available are left alone (exiting the context would partition them under their
    module); without DeepSpeed's attributes (`ds_id`, `ds_status`) this is a no-op and deepspeed is not imported.
    """
    import contextlib

    params = [t for t in tensors if t is not None and hasattr(t, "ds_id") and hasattr(t, "ds_status")
              and getattr(t.ds_status, "name", None) != "AVAILABLE"]
    if not params:
        return contextlib.nullcontext()
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


# A trace on fake tensors (the planner's) runs only the first rounds of each loop over chunks (this loss's, the tiled
# RMSNorm's): every round allocates what the first does and frees it before the next (the outputs go into buffers made
# before the loop; the last round, smaller, holds less), so the loop's peak is its first rounds'. Thousands of rounds
# at long context were most of a plan's time. Real tensors always run every round.
_TRACED = threading.local()


@contextlib.contextmanager
def first_rounds_traced(rounds: int = 2) -> Iterator[None]:
    """Within the block, a loop over chunks of fake tensors runs its first `rounds` rounds only (this thread)."""
    was = getattr(_TRACED, "rounds", None)
    _TRACED.rounds = rounds
    try:
        yield
    finally:
        _TRACED.rounds = was


def first_rounds_only(tensor: torch.Tensor) -> int | None:
    """Return how many first rounds a loop over `tensor`'s chunks runs: None (all) but for a fake tensor inside
    `first_rounds_traced`."""
    from torch._subclasses.fake_tensor import FakeTensor

    rounds = getattr(_TRACED, "rounds", None)
    return rounds if rounds is not None and isinstance(tensor, FakeTensor) else None


def chunk_starts(stop: int, step: int, tensor: torch.Tensor) -> range:
    """Return range(0, stop, step): all of it, or its first rounds for a fake tensor in `first_rounds_traced`."""
    starts = range(0, stop, step)
    rounds = first_rounds_only(tensor)
    return starts if rounds is None else starts[:rounds]


def first_rounds_range(*args: int) -> range:
    """Return range(*args): all of it, or its first rounds inside `first_rounds_traced` on this thread while a fake
    mode is active; for a library's own loop over chunks that sees no tensor of ours (TRL's fused LM head)."""
    from torch._guards import detect_fake_mode

    starts = range(*args)
    rounds = getattr(_TRACED, "rounds", None)
    if rounds is None or len(args) != 3 or args[0] != 0 or detect_fake_mode() is None:
        return starts
    return starts[:rounds]


class ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of `hidden @ weight.T + bias` against `labels`, forward and gradients by chunks.

    Call it through `chunked_cross_entropy`, which checks the arguments. Forward computes the loss
    chunk by chunk and keeps nothing but references to its inputs. Backward computes each chunk's
    logits again and their gradient in fp32, multiplied by the incoming gradient (which carries a
    loss scaler's scale) before anything is cast to a 16-bit dtype, as the plain loss's backward does:
    in fp16 no gradient entry underflows or overflows where the plain loss's would not. The price is
    one more matmul per chunk (the logits again) against the plain loss's three.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,  # (N, H)
        weight: torch.Tensor,  # (V, H)
        bias: torch.Tensor | None,  # (V,)
        labels: torch.Tensor,  # (N,) int
        chunk_tokens: int,
        reduction: str,
        ignore_index: int,
    ) -> torch.Tensor:
        cdt = _compute_dtype(hidden, weight)
        with _gathered(weight, bias), torch.autocast(hidden.device.type, enabled=False):
            w_c = weight.to(cdt)  # (V, H); no copy when the dtypes agree (autocast makes the same copy)
            b_c = bias.to(cdt) if bias is not None else None
            valid = labels != ignore_index  # (N,) bool
            safe_labels = torch.where(valid, labels, 0)  # ignored rows read class 0, then count 0
            lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,) kept for backward
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in chunk_starts(hidden.shape[0], chunk_tokens, hidden):
                end = min(start + chunk_tokens, hidden.shape[0])
                logits = F.linear(hidden[start:end].to(cdt), w_c, b_c).float()  # (C, V) fp32, one chunk's
                target = logits.gather(1, safe_labels[start:end, None]).squeeze(1)  # (C,)
                lse[start:end] = torch.logsumexp(logits, dim=1)
                loss += ((lse[start:end] - target) * valid[start:end]).sum()
                del logits, target
            del w_c, b_c
            # mean: divide by the number of non-ignored tokens (0 of them gives nan, as F.cross_entropy does)
            scale = 1.0 / valid.sum().to(torch.float32) if reduction == "mean" else 1.0
        ctx.save_for_backward(hidden, weight, bias, labels, lse)  # the inputs, and 4 bytes per token
        ctx.compute_dtype, ctx.chunk_tokens = cdt, chunk_tokens
        ctx.reduction, ctx.ignore_index = reduction, ignore_index
        return loss * scale

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        with _gathered(weight, bias):  # a ZeRO-3 partitioned head is gathered for the logits and its gradient's shape
            return ChunkedCrossEntropy._backward(ctx, grad_output, hidden, weight, bias, labels, lse)

    @staticmethod
    def _backward(ctx, grad_output, hidden, weight, bias, labels, lse):  # noqa: ANN001, ANN205 - backward's body
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdt, chunk_tokens = ctx.compute_dtype, ctx.chunk_tokens
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        # a 16-bit weight's gradient summed over token chunks would be rounded to 16 bits once per chunk;
        # it is computed by vocabulary blocks over all tokens instead, rounded once as the plain loss's
        w_by_blocks = need_w and weight.dtype != torch.float32
        with torch.autocast(hidden.device.type, enabled=False):
            w_c = weight.to(cdt)  # (V, H)
            b_c = bias.to(cdt) if bias is not None else None
            valid = labels != ctx.ignore_index  # (N,) bool
            safe_labels = torch.where(valid, labels, 0)
            # the incoming gradient (a loss scaler's scale, 2^16 and more) in fp32, applied before any
            # 16-bit cast; mean: divided by the number of non-ignored tokens
            multiplier = grad_output.float()
            if ctx.reduction == "mean":
                multiplier = multiplier / valid.sum().to(torch.float32)
            # (N,) fp32: what each row's d loss / d logits is multiplied by; ignored rows 0 (also when all are)
            row_weight = torch.where(valid, multiplier, 0.0)
            grad_hidden = torch.empty_like(hidden) if need_h else None  # (N, H)
            grad_weight = (torch.empty_like(weight) if w_by_blocks else torch.zeros_like(weight)) if need_w else None
            grad_bias = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if need_b else None  # (V,) fp32
            if need_h or need_b or (need_w and not w_by_blocks):
                for start in chunk_starts(n_tokens, chunk_tokens, hidden):
                    end = min(start + chunk_tokens, n_tokens)
                    h_c = hidden[start:end].to(cdt)  # (C, H)
                    logits = F.linear(h_c, w_c, b_c).float()  # (C, V) fp32
                    # d loss / d logits = (softmax - onehot) * row weight, in fp32 in the logits' buffer
                    grad_logits = logits.sub_(lse[start:end, None]).exp_()
                    grad_logits.scatter_add_(1, safe_labels[start:end, None], -valid[start:end, None].to(torch.float32))
                    grad_logits.mul_(row_weight[start:end, None])
                    if need_h:
                        grad_hidden[start:end] = grad_logits.to(cdt) @ w_c  # (C, H)
                    if need_w and not w_by_blocks:  # fp32 weight: fp32 accumulation, also when autocast is on
                        grad_weight.addmm_(grad_logits.T, hidden[start:end].float())
                    if need_b:
                        grad_bias += grad_logits.sum(0)
                    del logits, grad_logits, h_c
            if w_by_blocks:
                h_all = hidden.to(cdt)  # (N, H); no copy when the dtypes agree
                block = max(1, chunk_tokens * vocab // max(n_tokens, 1))  # (N, block) holds a chunk's logits' values
                for v0 in chunk_starts(vocab, block, hidden):
                    v1 = min(v0 + block, vocab)
                    logits = F.linear(h_all, w_c[v0:v1], None if b_c is None else b_c[v0:v1]).float()  # (N, B) fp32
                    grad_logits = logits.sub_(lse[:, None]).exp_()
                    in_block = valid & (safe_labels >= v0) & (safe_labels < v1)
                    grad_logits.scatter_add_(1, (safe_labels - v0).clamp(0, v1 - v0 - 1)[:, None],
                                             -in_block[:, None].to(torch.float32))
                    grad_logits.mul_(row_weight[:, None])
                    grad_weight[v0:v1] = grad_logits.to(cdt).T @ h_all  # (B, H), one rounding
                    del logits, grad_logits, in_block
                del h_all
            del w_c, b_c
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _check_chunk_tokens(chunk_tokens: object) -> int:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1 (tokens per chunk), got {chunk_tokens!r}")
    return chunk_tokens


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Return `F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)` without the full logits.

    Args:
        hidden: (N, H) the final hidden states, one row per token.
        weight: (V, H) the LM head's weight (tied embeddings are fine).
        labels: (N,) integer class per token; `ignore_index` marks tokens that do not count.
        bias: (V,) the head's bias, or None.
        chunk_tokens: tokens per chunk (>= 1); the chunk's logits take chunk_tokens x V x 4 bytes.
        reduction: 'mean' (over non-ignored tokens) or 'sum'.
        ignore_index: the label value to skip.

    The loss is fp32; gradients come back in the inputs' dtypes. Under autocast the head's matmul
    runs in autocast's dtype and the logits are upcast to fp32 before the softmax, as transformers does.

    Example:
        >>> loss = chunked_cross_entropy(h.view(-1, h.size(-1)), head.weight, y.view(-1), chunk_tokens=512)
    """
    _check_chunk_tokens(chunk_tokens)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an integer, got {ignore_index!r}")
    for name, tensor in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must have shape (tokens, hidden), got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must have shape (vocab, {hidden.shape[1]}) to match hidden {tuple(hidden.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must have shape ({hidden.shape[0]},) to match hidden {tuple(hidden.shape)}, got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels must be integer class indices, got dtype {labels.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be None or a tensor of shape ({weight.shape[0]},), got {shape}")
    if not hidden.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    _check_label_range(labels, weight.shape[0], ignore_index)
    return ChunkedCrossEntropy.apply(hidden, weight, bias, labels.long(), chunk_tokens, reduction, ignore_index)


def _check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise if a label is outside [0, vocab) and not ignore_index (skipped under fake tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(labels) or labels.numel() == 0:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise ValueError(f"labels must be in [0, {vocab}) or ignore_index ({ignore_index}), got {value}")


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Return the mean next-token loss of a causal LM by chunks: position t predicts labels[t + 1].

    Args:
        hidden: (B, T, H) the final hidden states (after the last norm).
        weight: (V, H) the LM head's weight; bias: (V,) or None.
        labels: (B, T) token ids, usually the input ids; `ignore_index` marks padding.
        chunk_tokens: tokens per chunk (>= 1).

    The labels are shifted as transformers' `ForCausalLMLoss` does, by padding with ignore_index,
    so the hidden states are not copied and the last position of each sequence does not count.
    Equal to `F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())`.
    """
    _check_chunk_tokens(chunk_tokens)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must have shape (batch, seq, hidden), got {shape}")
    if not isinstance(labels, torch.Tensor) or labels.shape != hidden.shape[:2]:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:2])} to match hidden {tuple(hidden.shape)}, got {shape}")
    shifted = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]  # (B, T): labels[t + 1], last = ignored
    return chunked_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        shifted.reshape(-1),
        bias=bias,
        chunk_tokens=chunk_tokens,
        reduction="mean",
        ignore_index=ignore_index,
    )


def make_loss_step(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
):
    """Return a function that runs the loss's forward and backward once: plain, or chunked.

    `chunk_tokens=None` is the plain loss, `F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)`;
    an integer runs `chunked_cross_entropy` with that many tokens per chunk. The same step with one
    argument changed, for `measure.measure_step` and for traces under fake tensors. Each call clears
    the inputs' gradients first, so after it they hold this step's gradients only.

    Example:
        >>> report = measure_step(make_loss_step(h, w, y, chunk_tokens=256), track=[h, w, y], device="cpu")
    """
    if chunk_tokens is not None:
        _check_chunk_tokens(chunk_tokens)
    inputs = [t for t in (hidden, weight, bias) if t is not None]

    def step() -> torch.Tensor:
        for tensor in inputs:
            tensor.grad = None
        if chunk_tokens is None:
            loss = F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)
        else:
            loss = chunked_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=chunk_tokens)
        loss.backward()
        return loss.detach()

    return step


# -- a whole model's loss by chunks: what `Recipe(loss_chunk_tokens=...)` applies ----------------

_CHUNK_ATTR = "_cm_loss_chunk_tokens"


def _head_problem(name: str, head: nn.Module, got: str | None = None) -> str:
    """Return the one message for an output layer the chunked loss cannot use (LoRA-wrapped, quantized, other)."""
    cls = type(head)
    got = got or f"got {cls.__module__}.{cls.__qualname__}"
    return (f"the chunked loss (loss_chunk_tokens) needs {name}'s output layer to be a plain torch.nn.Linear, {got}: "
            "leave lm_head out of lora_targets and of quantization (or set loss_chunk_tokens=None)")


def _causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """Return (base model, LM head) of a transformers causal LM, or raise ValueError saying why not.

    The base model returns the final hidden states (after the last norm); the head must be a plain
    `nn.Linear` (not a LoRA-wrapped or quantized one) and nothing may act on the logits between the
    head and the loss (Gemma-2's final soft-capping, Cohere's logit scale): `check_objective` runs the
    model once to see that.
    """
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    base = getattr(model, "base_model", None)
    if head is None or not isinstance(base, nn.Module) or base is model:
        raise ValueError(
            f"the chunked loss needs the reference model or a transformers causal LM (a base model and an output "
            f"layer from get_output_embeddings()), got {name}"
        )
    if type(head) is not nn.Linear and not hasattr(head, "dequantized"):  # int8train's Int8Linear dequantizes
        raise ValueError(_head_problem(name, head))
    config = getattr(model, "config", None)
    for key in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling"):
        value = getattr(config, key, None)
        if value not in (None, 1, 1.0):
            raise ValueError(f"the chunked loss computes plain logits, but {name} transforms them ({key}={value!r})")
    return base, head


# -- whether the chunked loss computes the model's own objective: decided by running the model -------

# Ops that move or retype values without changing them: allowed between the base model's hidden states
# and the head's input, and between the head's output and the loss.
_SAME_VALUES = {"__getitem__", "view", "reshape", "contiguous", "float", "to", "type", "clone", "detach", "flatten",
                "__get__", "size", "dim", "shape", "dtype", "device", "numel", "requires_grad_"}
_LOSSES = {"cross_entropy", "nll_loss", "log_softmax", "logsumexp"}
_OBJECTIVE_CACHE: dict[tuple[str, str], tuple[str | None, bool]] = {}  # -> (problem, checked with real weights)


def _op_name(func: Any) -> str:
    return getattr(func, "__name__", str(func)).rsplit(".", 1)[-1]


def _trace_objective(model: nn.Module, base: nn.Module, head: nn.Module) -> tuple[list[str], Any, Any]:
    """Run `model(ids, labels=ids)` once on a 1 x 8 input; return (what acted on the hidden states before the head
    or on the logits before the loss, the model's own loss, the base model's final hidden states)."""
    from torch.overrides import TorchFunctionMode

    tainted: dict[int, str] = {}  # id(tensor) -> 'hidden' (the base's output) or 'logits' (the head's)
    keep: list[torch.Tensor] = []  # alive while traced, so their ids stay theirs
    found: list[str] = []
    seen: dict[str, Any] = {}
    in_head = [False]

    def mark(t: Any, kind: str) -> None:
        if isinstance(t, torch.Tensor):
            tainted[id(t)] = kind
            keep.append(t)

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if in_head[0]:
                return out
            kinds = {tainted[id(a)] for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor) and id(a) in tainted}
            if kinds:
                op = _op_name(func)
                scalars = [a for a in args[1:] if isinstance(a, (int, float))]
                if op in _LOSSES:
                    return out
                if op not in _SAME_VALUES and not (op in ("mul", "__mul__", "div", "__truediv__", "true_divide")
                                                   and scalars == [1] * len(scalars) and scalars):
                    found.append(f"{op} on the {'logits' if 'logits' in kinds else 'hidden states before the head'}")
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    mark(t, "logits" if "logits" in kinds else "hidden")
            return out

    def base_out(module: nn.Module, args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        hidden = hidden if hidden is not None else (output[0] if isinstance(output, (tuple, list)) else output)
        seen["hidden"] = hidden
        mark(hidden, "hidden")

    def head_pre(module: nn.Module, args: Any) -> None:
        in_head[0] = True

    def head_out(module: nn.Module, args: Any, output: Any) -> None:
        in_head[0] = False
        mark(output, "logits")

    weight = head_weight(head)
    device = weight.device
    ids = (torch.arange(8, device=device) * 7 + 3).remainder(weight.shape[0])[None]  # (1, 8) distinct tokens
    handles = [base.register_forward_hook(base_out), head.register_forward_pre_hook(head_pre),
               head.register_forward_hook(head_out)]
    was_training = model.training
    model.eval()  # no dropout: the same values twice
    try:
        with torch.no_grad(), Watch():
            out = type(model).forward(model, input_ids=ids, labels=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    return found, loss, seen.get("hidden")


_TWIN_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def _small_twin(model: nn.Module) -> nn.Module:
    """Return a CPU model of `model`'s class and config with its sizes made small (`_TWIN_SIZES`), random weights:
    what acts on the logits (multipliers, soft caps) is kept, so it behaves as `model` does."""
    import copy

    config = copy.deepcopy(model.config)
    for key, value in _TWIN_SIZES.items():
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, min(getattr(config, key), value))
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):
        try:
            config.layer_types = layer_types[: config.num_hidden_layers]
        except AttributeError:  # derived from other fields in some families
            pass
    with torch.device("cpu"):
        twin = type(model)(config)
    if sum(p.numel() for p in twin.parameters()) > 50_000_000:
        raise ValueError("its small twin is still over 50M parameters")
    return twin


def check_objective(model: nn.Module) -> None:
    """Raise ValueError unless the chunked loss computes `model`'s own objective, as seen by running it once.

    The model runs `model(ids, labels=ids)` on 8 tokens (on the meta device too, where nothing is computed):
    nothing but reshaping may act on the base model's final hidden states before the head, nor on the
    head's logits before the loss (Falcon-H1's `lm_head_multiplier`, RecurrentGemma's `logits_soft_cap`, a
    masked LM's transform before its decoder all do). With real weights the model's own loss is also
    compared with the chunked loss of the same hidden states (the causal shift). The answer is cached per
    model class and config (a meta copy's answer is checked again once real weights come).
    """
    from torch._subclasses.fake_tensor import is_fake

    model = _unwrapped(model)
    base, head = _causal_lm_parts(model)
    config = getattr(model, "config", None)
    key = (f"{type(model).__module__}.{type(model).__qualname__}",
           config.to_json_string() if hasattr(config, "to_json_string") else repr(config))
    real = not (head_weight(head).is_meta or is_fake(head_weight(head)))
    cached = _OBJECTIVE_CACHE.get(key)
    if cached is not None and (cached[1] or not real):  # a real model's check is reused (Recipe.build checks twice)
        problem = cached[0]
    else:
        name = type(model).__name__
        try:
            try:
                found, loss, hidden = _trace_objective(model, base, head)
            except Exception:  # noqa: BLE001 - on the meta device a data-dependent branch fails: run a small real twin
                if real:
                    raise
                model = _small_twin(model)
                base, head = _causal_lm_parts(model)
                real = True
                found, loss, hidden = _trace_objective(model, base, head)
        except Exception as exc:  # noqa: BLE001 - a model whose loss cannot be checked is not chunked
            found, loss, hidden = None, None, None
            problem = (f"the chunked loss could not be checked against {name}'s own loss: model(input_ids, labels=..., "
                       f"use_cache=False) on 8 tokens failed ({type(exc).__name__}: {' '.join(str(exc).split())[:160]}); "
                       "leave loss_chunk_tokens=None")
        else:
            problem = None
        if found:
            problem = (f"the chunked loss computes plain next-token cross-entropy from the base model's hidden states "
                       f"and the head, but {name} does more: {', '.join(dict.fromkeys(found))}; leave loss_chunk_tokens=None")
        elif real and isinstance(loss, torch.Tensor) and isinstance(hidden, torch.Tensor):
            with torch.no_grad():
                weight = head_weight(head)
                ids = (torch.arange(8, device=hidden.device) * 7 + 3).remainder(weight.shape[0])[None]
                ours = causal_lm_loss(hidden, weight, ids, bias=head.bias, chunk_tokens=8)
            # both from the same hidden states, so the gap is rounding only (the logits' dtype), or another objective
            tol = 1e-3 if weight.dtype == torch.float32 else 2e-2
            if abs(float(ours) - float(loss)) > tol * (1 + abs(float(loss))):
                problem = (f"the chunked loss computes next-token cross-entropy, but {name}'s own loss differs on 8 tokens "
                           f"({float(loss):.4f} against {float(ours):.4f}): another objective; leave loss_chunk_tokens=None")
        _OBJECTIVE_CACHE[key] = (problem, real)
    if problem is not None:
        raise ValueError(problem)


def head_weight(head: nn.Module) -> torch.Tensor:
    """Return the output layer's weight for the chunked loss: `head.weight`, or an int8-trained head's
    dequantized weight (`int8train.Int8Linear.dequantized`, whose gradient updates the int8 weight)."""
    dequantized = getattr(head, "dequantized", None)
    return dequantized() if callable(dequantized) else head.weight


def _unwrapped(model: nn.Module) -> nn.Module:
    """Return the causal LM inside a peft `PeftModel` (`get_peft_model`), else the model itself."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else model
    return inner if isinstance(inner, nn.Module) else model


def check_chunkable(model: nn.Module) -> None:
    """Raise ValueError, with `apply_chunked_loss`'s message, where the chunked loss cannot replace the model's."""
    model = _unwrapped(model)
    if hasattr(model, "loss_chunk_tokens"):  # the reference model (models.GPT) chunks by itself
        head = getattr(model, "lm_head", None)
        if type(head) is not nn.Linear and not hasattr(head, "dequantized"):  # int8train's Int8Linear dequantizes
            raise ValueError(_head_problem(type(model).__name__, head))
        return
    check_objective(model)


def check_head_not_adapted(model: nn.Module, lora_targets: Any) -> None:
    """Raise ValueError (`check_chunkable`'s message) when LoRA targets would wrap the model's output layer."""
    inner = _unwrapped(model)
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else getattr(inner, "lm_head", None)
    names = [n for n, m in inner.named_modules() if m is head and n]
    if any(n == t or n.endswith(f".{t}") for n in names for t in lora_targets):
        raise ValueError(_head_problem(type(inner).__name__, head,
                                       f"but lora_targets {tuple(lora_targets)} would wrap it ({names[0]}) in a LoRA layer"))


def _chunked_forward(self: nn.Module, input_ids: Any = None, attention_mask: Any = None, labels: Any = None,
                     **kwargs: Any) -> Any:
    """A transformers causal LM's forward whose loss, when labels are given, is `causal_lm_loss` by chunks."""
    if labels is None:  # generation, or logits wanted: the model's own forward
        return type(self).forward(self, input_ids, attention_mask=attention_mask, **kwargs)
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from transformers.modeling_outputs import CausalLMOutputWithPast

    base, head = _causal_lm_parts(self)
    for key in ("logits_to_keep", "num_logits_to_keep", "num_items_in_batch", "return_dict"):
        kwargs.pop(key, None)
    out = base(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **kwargs)
    hidden = out.last_hidden_state  # (B, T, H), after the final norm
    loss = causal_lm_loss(hidden, head_weight(head), labels, bias=head.bias, chunk_tokens=getattr(self, _CHUNK_ATTR))
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None))


def apply_chunked_loss(model: nn.Module, chunk_tokens: int | None) -> nn.Module:
    """Make `model(input_ids, labels=...)` compute its loss by chunks of `chunk_tokens` tokens; return the model.

    For the reference model this sets `GPT.loss_chunk_tokens`. For a transformers causal LM (with or
    without peft adapters injected) it replaces the instance's forward: with labels, the base model's
    final hidden states go to `causal_lm_loss` with the output layer's weight, so the head is never
    applied to all tokens and `.logits` is None; without labels the model's own forward runs.
    `chunk_tokens=None` removes what this function installed (on the reference model it leaves
    `loss_chunk_tokens` as it is).

    Example:
        >>> model = apply_chunked_loss(LlamaForCausalLM(config), 256)
        >>> model(ids, labels=ids).loss.backward()  # same loss and gradients, no (B, T, V) logits
    """
    outer, model = model, _unwrapped(model)  # a PeftModel's forward reaches the causal LM's instance forward
    if chunk_tokens is None:
        if _CHUNK_ATTR in model.__dict__:
            del model.__dict__[_CHUNK_ATTR]
            model.__dict__.pop("forward", None)
        return outer
    _check_chunk_tokens(chunk_tokens)
    if model.__dict__.get(_CHUNK_ATTR) is not None:  # installed and checked already (Recipe.build, then the step)
        setattr(model, _CHUNK_ATTR, chunk_tokens)
        return outer
    check_chunkable(model)
    if hasattr(model, "loss_chunk_tokens"):
        model.loss_chunk_tokens = chunk_tokens
        return outer
    setattr(model, _CHUNK_ATTR, chunk_tokens)
    # a bound method: a deep copy of the model (quantization's forward-only copy) rebinds it to the copy
    model.forward = types.MethodType(_chunked_forward, model)
    return outer


def traced_loss_bytes(tokens: int, vocab: int, hidden: int, *, chunk_tokens: int | None = None,
                      dtype: torch.dtype = torch.float32, frozen_head: bool = False) -> dict[str, int]:
    """Return the bytes of one loss step (forward and backward) traced on fake tensors: nothing is allocated.

    The step is `make_loss_step` on (tokens, hidden) hidden states, a (vocab, hidden) head and int64
    labels, plain (`chunk_tokens=None`) or by chunks, traced with the project's tensor tracker. Returns
    `peak_bytes`, `input_bytes` (the three inputs), `after_bytes` (alive after backward: the inputs and
    their gradients) and `transient_bytes` (peak - after: the logits, their gradient and what else the
    loss holds for a while; what a method that never writes logits, as Cut Cross-Entropy, avoids).

    Example:
        >>> traced_loss_bytes(8192, 256000, 2304)["transient_bytes"]  # Gemma-2-2B's head at 8K tokens
    """
    from colab_memopt.core.tracker import TensorTracker, fake_tensor_mode

    for name, value in (("tokens", tokens), ("vocab", vocab), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    with fake_tensor_mode():
        h = torch.empty(tokens, hidden, dtype=dtype, requires_grad=True)
        w = torch.empty(vocab, hidden, dtype=dtype, requires_grad=not frozen_head)
        y = torch.zeros(tokens, dtype=torch.long)
        step = make_loss_step(h, w, y, chunk_tokens=chunk_tokens)
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(h, w, y)
        with tracker:
            step()
            after = tracker.live_bytes()
    inputs = sum(t.numel() * t.element_size() for t in (h, w, y))
    return {"peak_bytes": tracker.peak_bytes, "input_bytes": inputs, "after_bytes": after,
            "transient_bytes": tracker.peak_bytes - after}


AUTO_CHUNK_MAX_TOKENS = 4096  # loss_chunk_tokens='auto' never goes past this (bigger chunks only add memory)


def auto_chunk_tokens(free_bytes: int, vocab: int, hidden: int, tokens: int, *,
                      dtype: torch.dtype = torch.float32) -> int:
    """Return the loss chunk (tokens) for `loss_chunk_tokens='auto'`: the largest power of two from
    DEFAULT_CHUNK_TOKENS up to AUTO_CHUNK_MAX_TOKENS (and at most `tokens`, rounded up to a power of two) whose
    extra bytes over a DEFAULT_CHUNK_TOKENS chunk fit `free_bytes`, the device memory left at the loss (a plan's).

    The bytes per chunk token are traced, not assumed: the loss step's transient at two chunk sizes
    (`traced_loss_bytes`, on fake tensors) gives its slope, which is linear in the chunk.

    Example:
        >>> auto_chunk_tokens(2 * 2**30, 128256, 4096, 49152)  # 2 GiB left: a chunk of 1,024 tokens
    """
    for name, value in (("free_bytes", free_bytes), ("vocab", vocab), ("hidden", hidden), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and name != "free_bytes"):
            raise ValueError(f"{name} must be an integer{'' if name == 'free_bytes' else ' >= 1'}, got {value!r}")
    base = DEFAULT_CHUNK_TOKENS
    probe = 2 * base
    small = traced_loss_bytes(probe, vocab, hidden, chunk_tokens=base, dtype=dtype)["transient_bytes"]
    large = traced_loss_bytes(probe, vocab, hidden, chunk_tokens=probe, dtype=dtype)["transient_bytes"]
    per_token = max(1, (large - small) // base)  # bytes per token of chunk
    chunk = base
    cap = min(AUTO_CHUNK_MAX_TOKENS, 1 << max(0, (tokens - 1).bit_length()))
    while chunk * 2 <= cap and (chunk * 2 - base) * per_token <= free_bytes:
        chunk *= 2
    return chunk
