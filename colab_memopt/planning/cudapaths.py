"""What a CUDA run takes another path for, traced that way: a plan traces on fake CPU tensors.

Where the libraries branch on the device, the trace of a CUDA target takes the CUDA branch, for the traced step
only (`as_on_cuda`), on this thread only, and everything is put back afterwards:

- dropout: torch runs the fused `native_dropout` for CUDA tensors (aten/src/ATen/native/Dropout.cpp,
  `is_fused_kernel_acceptable`), which keeps a 1-byte bool mask for backward; on CPU tensors `dropout` is
  `input * noise`, and the noise is kept in the input's dtype (4 bytes a value for peft's float32 adapters). The
  model's `nn.Dropout` modules (peft's `lora_dropout`, GPT-2's) run `native_dropout` for the trace (their own
  `forward` replaced on the instance, put back afterwards); a functional `F.dropout` in a model's code is traced
  on the CPU's path.
- the CUDA autocast flag: peft's LoRA on bitsandbytes layers (`tuners/lora/bnb.py`, `Linear4bit.forward` and
  `Linear8bitLt.forward`) asks `torch.is_autocast_enabled()` with no device, which answers for CUDA. Under
  accelerate's autocast on CUDA it is True and each adapter takes the layer's 16-bit input as it is; a CPU trace
  would read False, and each adapter would make a float32 copy of the input and a 16-bit copy of that. Where the
  run autocasts on CUDA, this thread's CUDA autocast flag is set for the trace (only CUDA tensors are cast by it;
  the trace's are CPU fakes), as accelerate's `torch.autocast("cuda")` sets it in the run.

- CUDA's autocast op lists (`cuda_autocast_policy`): the trace autocasts on the CPU, whose lists differ. CUDA
  autocast runs softmax, log_softmax, layer_norm, group_norm, exp, log, pow, rsqrt, sum, cumsum, the losses and a
  few more in float32 (PyTorch's aten/src/ATen/autocast_mode.h, `AT_FORALL_FP32` and
  `AT_FORALL_FP32_SET_OPT_DTYPE`; https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float32);
  CPU autocast runs them in the 16-bit dtype. A LayerNorm's output, a hand-written attention's softmax and GPT-2's
  GELU are float32 tensors on CUDA, kept for backward: the first CUDA run's trace of the project's LayerNorm model
  under fp16 autocast planned 33% under what an H200 emulating a T4 measured with naive attention, 27% with QLoRA.
  For the trace, those ops get CUDA's policy at the CPU autocast's dispatch key, for the block only.

And one that holds on every device (`forward_autocast`): accelerate autocasts the model's forward only
(`Accelerator.prepare_model`: `convert_outputs_to_fp32(autocast(forward))`, on CUDA for fp16 and bf16 and on the
CPU for bf16); backward runs outside it. Autocast keeps its 16-bit copy of each float32 weight that trains (the
adapters) until the outermost autocast exits: at the end of the forward in the run, so the trace wraps the forward
the same way, with accelerate's own wrapper.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class CudaPaths:
    """What the trace of a CUDA target ran as CUDA runs it, counted while a step is traced."""

    dropout_calls: int = 0  # training dropout calls run as native_dropout (a 1-byte mask)
    autocast_flag: bool = False  # this thread's CUDA autocast flag was on (peft's bitsandbytes LoRA reads it)


@contextlib.contextmanager
def _native_dropout(model: nn.Module, paths: CudaPaths) -> Iterator[None]:
    """Run `model`'s training `nn.Dropout` modules as torch runs them for CUDA tensors, `torch.native_dropout` (a
    bool mask kept for backward), for the block: each module's own `forward` is replaced on the instance and put
    back afterwards (nothing process-wide). An instance attribute, not a TorchFunctionMode: the mode would be off
    while `backward()` runs (it handles that call), and checkpointing's recompute there would take the CPU path."""
    replaced = []

    def native(module: nn.Dropout) -> Any:
        def forward(input: torch.Tensor) -> torch.Tensor:
            # Dropout.cpp: fused for 0 < p < 1 and a non-empty input; in place (dropout_) never is
            if not module.training or module.inplace or not 0.0 < module.p < 1.0 or input.numel() == 0:
                return F.dropout(input, module.p, module.training, module.inplace)
            paths.dropout_calls += 1
            return torch.native_dropout(input, module.p, True)[0]
        return forward

    try:
        for module in model.modules():
            if type(module) is nn.Dropout and 0.0 < module.p < 1.0:
                replaced.append((module, "forward" in vars(module), vars(module).get("forward")))
                module.forward = native(module)
        yield
    finally:
        for module, had, own in reversed(replaced):
            if had:
                module.forward = own
            else:
                vars(module).pop("forward", None)


@contextlib.contextmanager
def _cuda_autocast_flag(dtype: torch.dtype) -> Iterator[None]:
    """Set this thread's CUDA autocast flag and dtype for the block (thread-local state); put back afterwards."""
    enabled, was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        yield
    finally:
        torch.set_autocast_dtype("cuda", was)
        torch.set_autocast_enabled("cuda", enabled)


# CUDA autocast's float32 policies (aten/src/ATen/autocast_mode.h, torch 2.x): 'fp32' casts each 16-bit floating
# input to float32; 'fp32_set_opt_dtype' leaves the input and asks for a float32 result where no dtype is given.
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "norm.Scalar", "norm.ScalarOpt_dim",
)
_CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# On the CPU cross_entropy_loss casts its logits to a float32 copy first; CUDA has no kernel for it: it runs as
# log_softmax (a float32 result read from the 16-bit logits) and nll_loss, each under autocast.
_CUDA_DECOMPOSED = ("cross_entropy_loss",)
_HALF = (torch.float16, torch.bfloat16)
_policy_lock = threading.Lock()
_policy_users = 0
_policy_library: Any = None


def _overload(name: str) -> Any:
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _exclude_autocast_cpu() -> Any:
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _fp32_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        up = [a.float() if isinstance(a, torch.Tensor) and a.dtype in _HALF else a for a in args]
        with _exclude_autocast_cpu():
            return op(*up, **kwargs)
    return kernel


def _fp32_result_kernel(op: Any) -> Any:
    arguments = op._schema.arguments
    index = next(i for i, a in enumerate(arguments) if a.name == "dtype")
    keyword = arguments[index].kwarg_only

    def kernel(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dtype in _HALF:
            if keyword and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            elif not keyword and (len(args) <= index or args[index] is None):
                padded = [*args, *[None] * (index + 1 - len(args))]
                padded[index] = torch.float32
                args = tuple(padded)
        with _exclude_autocast_cpu():
            return op(*args, **kwargs)
    return kernel


def _decomposed_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return op.decompose(*args, **kwargs)  # its parts dispatch under autocast, as on CUDA
    return kernel


def _register_cuda_policy() -> Any:
    import warnings

    from torch.library import Library

    library = Library("aten", "IMPL")  # noqa: TOR901 - removed again by _destroy when the last trace ends
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the CPU's own, put back after
        for names, make in ((_CUDA_FP32, _fp32_kernel), (_CUDA_FP32_SET_OPT_DTYPE, _fp32_result_kernel),
                            (_CUDA_DECOMPOSED, _decomposed_kernel)):
            for name in names:
                library.impl(name, make(_overload(name)), "AutocastCPU")
    return library


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """Run the CPU autocast in the block with CUDA autocast's float32 op lists (see the module docstring): a trace of
    a CUDA run that autocasts keeps float32 where CUDA does. The ops' CPU autocast kernels are replaced at the
    `AutocastCPU` dispatch key for the block and put back when the last such block ends (nested blocks share one
    registration). It acts only where CPU autocast is on (`torch.autocast("cpu")`, which the trace stands in for
    CUDA's) and only on 16-bit inputs; `autocast(enabled=False)` regions and checkpointing's recompute behave as on
    CUDA, since the policy sits where CUDA's does, above autograd."""
    global _policy_users, _policy_library
    with _policy_lock:
        if _policy_users == 0:
            _policy_library = _register_cuda_policy()
        _policy_users += 1
    try:
        yield
    finally:
        with _policy_lock:
            _policy_users -= 1
            if _policy_users == 0:
                library, _policy_library = _policy_library, None
                library._destroy()


@contextlib.contextmanager
def as_on_cuda(cuda: bool, autocast_dtype: torch.dtype | None, model: nn.Module) -> Iterator[CudaPaths | None]:
    """Trace `model`'s step in the block as a CUDA run takes it: its dropout as `native_dropout`, and where the run
    autocasts (`autocast_dtype`: the 16-bit dtype the trace autocasts in, None where the run does not autocast),
    this thread's CUDA autocast flag on and CUDA's float32 op lists (`cuda_autocast_policy`). Yields what it did (`CudaPaths`), None for a target that is not CUDA.

    Example:
        >>> with as_on_cuda(True, torch.bfloat16, model) as paths:
        ...     step()
        >>> paths.dropout_calls
    """
    if not cuda:
        yield None
        return
    paths = CudaPaths(autocast_flag=autocast_dtype is not None)
    with contextlib.ExitStack() as stack:
        if autocast_dtype is not None:
            stack.enter_context(_cuda_autocast_flag(autocast_dtype))
            stack.enter_context(cuda_autocast_policy())
        stack.enter_context(_native_dropout(model, paths))
        yield paths


@contextlib.contextmanager
def forward_autocast(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast `model`'s forward only, in `dtype` on the trace's CPU tensors, with its outputs converted to float32,
    as accelerate's `prepare_model` wraps it (None: no autocast); the model's own forward is put back afterwards."""
    if dtype is None:
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32

    had, own = "forward" in vars(model), vars(model).get("forward")
    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=dtype)(model.forward))
    try:
        yield
    finally:
        if had:
            model.forward = own
        else:
            vars(model).pop("forward", None)


def _bnb_lora_layers(model: nn.Module) -> int:
    """Return how many of `model`'s modules are peft LoRA layers over bitsandbytes' 4-bit or 8-bit layers."""
    from colab_memopt.core.console import quiet

    try:
        with quiet():  # peft's import notes (torchao's): nothing about this run
            from peft.tuners.lora import bnb as lora_bnb
    except ImportError:  # pragma: no cover - peft is a dependency
        return 0
    kinds = tuple(getattr(lora_bnb, name) for name in ("Linear4bit", "Linear8bitLt") if hasattr(lora_bnb, name))
    return sum(isinstance(m, kinds) for m in model.modules()) if kinds else 0


def cuda_path_note(paths: CudaPaths | None, model: nn.Module) -> list[str]:
    """Return the plan's line saying what was traced as CUDA runs it (none where nothing took another path)."""
    if paths is None:
        return []
    parts = []
    if paths.dropout_calls:
        parts.append("dropout keeps a 1-byte mask per value (the CPU keeps 4-byte noise)")
    if paths.autocast_flag and _bnb_lora_layers(model):
        parts.append("LoRA on the quantized layers reads their 16-bit input as it is (no float32 copy)")
    return [f"traced as CUDA runs it: {'; '.join(parts)}"] if parts else []
