"""The fake-tensor trace of a training step: the model built and one whole step run under `FakeTensorMode`.

`_Tracer` builds the model and optimizer once under fake tensors (shapes only, nothing allocated) through
`Recipe.build`, warms them up, and traces steps at any batch size with the tensor tracker `measure.measure_step`
uses. The `_fake_safe_*` context managers let what a step goes through (`nn.Module.to`, transformers' masks,
lomo-optim, APOLLO, torchao, the fp16 loss scalers) run on tensors without values, each put back afterwards;
bitsandbytes' are in `colab_memopt.planning.quantized`. `set_optimizer_impl` traces the optimizer in the
implementation CUDA runs (foreach). Traces of named models are cached in this process (`clear_trace_cache`).
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from colab_memopt.core.console import quiet
from colab_memopt.techniques.attention import traced_attention
from colab_memopt.techniques.checkpointing import INTERVAL_PITFALL_PATTERN
from colab_memopt.techniques.loss import first_rounds_traced
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.tracker import PHASES, TensorTracker, fake_tensor_mode
from colab_memopt.training.train import make_train_step
from colab_memopt.planning.cudapaths import cuda_autocast_policy
from colab_memopt.planning.quantized import _fake_safe_bitsandbytes, _int8_as_on_cuda


def set_optimizer_impl(optimizer: torch.optim.Optimizer, impl: str) -> torch.optim.Optimizer:
    """Make a torch optimizer run its 'foreach' or 'single-tensor' implementation, whatever the device.

    Used to trace (and to measure on the CPU) what CUDA runs: torch defaults to foreach for CUDA
    tensors and to single-tensor on the CPU. Optimizers without a `foreach` option (bitsandbytes,
    this project's Lion and Adam-mini) are left as they are; `*_in_backward` optimizers are set per
    parameter. Returns the optimizer.
    """
    if impl not in ("foreach", "single-tensor"):
        raise ValueError(f"impl must be 'foreach' or 'single-tensor', got {impl!r}")
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, dict):  # OptimizerInBackward: one optimizer per parameter
        for opt in inner.values():
            set_optimizer_impl(opt, impl)
        return optimizer
    base = getattr(optimizer, "base_optimizer", None)
    if isinstance(base, torch.optim.Optimizer):  # BAdam: torch's AdamW over the trained block
        set_optimizer_impl(base, impl)
        for group in optimizer.param_groups:
            group["foreach"] = impl == "foreach"
        return optimizer
    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = impl == "foreach"
    return optimizer


def shape_model(model_factory: Callable[[], nn.Module], name: str = "model_factory") -> nn.Module:
    """Build the model on the meta device (shapes only); raise TypeError if the factory is not a zero-argument model builder."""
    import inspect

    if not callable(model_factory):
        raise TypeError(f"{name} must be a model name or a zero-argument function that builds the model, "
                        f"got {type(model_factory).__name__}")
    try:
        inspect.signature(model_factory).bind()
    except TypeError as exc:
        raise TypeError(f"{name} must be callable with no arguments ({exc}); wrap it: lambda: build(...)") from None
    except ValueError:  # a builtin without a signature: try it
        pass
    with torch.device("meta"), _fake_safe_module_to():  # a factory that moves its model to its device: a no-op here
        model = model_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name} must return a torch.nn.Module, it returned {type(model).__name__}")
    return model


class _FakeBatches:
    """Stand-in for the corpus under fake tensors: random token ids of the right shape.

    `rows` > batch_size yields the first batch_size rows of a (rows, seq_len) tensor: a view that keeps the
    whole batch's storage alive, as the step of every micro-batch does (`_Tracer._step`)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rows = 0

    def batches(self, batch_size: int, seq_len: int, *, seed: int = 0, device: Any = "cpu", split: str = "train") -> Iterator[torch.Tensor]:
        while True:
            rows = max(batch_size, self.rows)
            yield torch.randint(0, self.vocab_size, (rows, seq_len), device=device)[:batch_size]


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}: it needs .config.vocab_size")
    return int(vocab)


@dataclass
class _Trace:
    peak_bytes: int
    by_category: dict[str, int]
    by_phase: dict[str, int]
    phase_categories: dict[str, dict[str, int]]
    activation_peak: int = 0
    hidden_bytes: int = 0  # the largest score tensor of an attention call run with SDPA's math kernel (0: none ran)
    # (phase, unit, op, bytes per category) after every op, where the tracker followed a stack's units (stack.py)
    timeline: list[tuple[int, int, Any, tuple[int, ...]]] | None = field(default=None, repr=False)
    # A counted stack's step (stack.extrapolate): (phase, live bytes per category) at every moment that can be the
    # largest, and what each line is (`stack._extrapolated`'s key: its part of the step, where in it, its operation;
    # equal keys at two batches: the same operations, the same moments)
    lines: list[tuple[int, tuple[int, ...]]] | None = field(default=None, repr=False)
    keys: list[tuple[Any, ...]] | None = field(default=None, repr=False)


@contextlib.contextmanager
def _fake_safe_module_to() -> Iterator[None]:
    """Make `nn.Module.to` and `nn.Module.cuda` work on modules built on the meta device or under FakeTensorMode.

    `Module._apply` swaps fake parameters with `torch.utils.swap_tensors`, which refuses any tensor
    that has a weak reference, and FakeTensorMode keeps one to each of its tensors: so `.to()` fails
    on every fake-built module (peft and transformers call it while building). Meta tensors cannot be
    copied to a device at all. Here a device move of meta or fake tensors is a no-op (the plan is for
    the target, wherever the factory or the Trainer wanted the weights; a real tensor is never moved:
    that raises), and a dtype change is done in place with `.data`, which keeps shared (tied)
    parameters shared.
    """
    from torch._subclasses.fake_tensor import is_fake

    original_to, original_cuda = nn.Module.to, nn.Module.cuda

    def move(self: nn.Module, device: Any, dtype: torch.dtype | None) -> nn.Module:
        with torch.no_grad():
            for t in [*self.parameters(), *self.buffers()]:
                if device is not None and t.device.type != torch.device(device).type and not (t.is_meta or is_fake(t)):
                    raise ValueError(f"cannot plan a model that moves its real tensors to {device} while it is built")
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t.data = t.data.to(dtype)
        return self

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return move(self, device, dtype)

    def cuda(self: nn.Module, device: Any = None) -> nn.Module:
        return move(self, torch.device("cuda", device) if isinstance(device, int) else device or "cuda", None)

    nn.Module.to, nn.Module.cuda = to, cuda  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to, nn.Module.cuda = original_to, original_cuda  # type: ignore[method-assign]


@contextlib.contextmanager
def _fake_safe_low_state(recipe: Recipe) -> Iterator[None]:
    """Let the optimizers with almost no state (`lowstate`) step on fake tensors, for the duration.

    - torchao's low-bit states build their code books with Python comparisons on tensor values (cached
      as plain floats afterwards): here they are built for real first, as bitsandbytes' are.
    - APOLLO's norm-growth limiter takes Python's `max(norm_ratio, 1.01)` of a 0-d tensor, a branch on
      its value: the trace takes the branch where the update norm grew by more than 1% (the limiter
      acts, `max` returns the tensor). Where it did not, the real step holds one 0-d tensor (4 bytes)
      less for an instant: the traced optimizer phase is exact or 4 bytes above it; the state and the
      full-size temporaries are the same either way.
    """
    base = recipe.optimizer.removesuffix("_in_backward")
    if base in ("torchao_adamw8bit", "torchao_adamw4bit"):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with quiet():  # torchao's import notes (CUDA extensions a CPU build cannot load): nothing about this run
            from torchao.optim import subclass_4bit, subclass_8bit

        with unset_fake_temporarily():
            for module in (subclass_8bit, subclass_4bit):
                module.get_qmap_signed()
                module.get_qmap_unsigned()
        yield
        return
    if base not in ("apollo", "apollo_mini"):
        yield
        return
    import builtins

    from apollo_torch import apollo

    def tensor_safe_max(a: Any, b: Any) -> Any:
        if isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            return a  # the limiter acts: see above
        return builtins.max(a, b)

    apollo.max = tensor_safe_max  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del apollo.max  # back to the builtin


@contextlib.contextmanager
def _fake_safe_transformers() -> Iterator[None]:
    """Let transformers choose the attention mask it chooses on real data, for the duration.

    - Packing: without a KV cache (training with checkpointing, `use_cache=False`), transformers reads the position
      ids to detect packed sequences; on fake tensors it cannot read them and assumes packing: it then builds a
      (B, 1, T, T) mask, which turns off SDPA's causal kernel and its grouped-query attention (keys and values
      repeated per head). The planner's batches are contiguous windows, never packed, so here the detection answers
      "not packed", as it does on the real batch: without this, full checkpointing at 1024 tokens was over-predicted
      by up to 50% on GQA models (llama, qwen2, mistral, phi3, gpt_neox; tests/test_architectures.py checks it).
    - Padding: given an attention mask, SDPA's mask is skipped (`is_causal=True`, no mask) where no token is padded;
      transformers reads that from the mask's values, and on a fake tensor it does not read them and builds the
      (B, 1, T, T) mask (`masking_utils._ignore_causal_mask_sdpa`'s `is_tracing`). The planner's rows are full
      (every mask value 1), so here the skip is decided as on those values. Without this, an 8B QLoRA SFTTrainer
      plan at 40,960 tokens held a 1.68 GB bool mask and SDPA's 3.36 GB fp16 copy of it that the run never makes.
    """
    try:
        with quiet():  # transformers' submodule imports torch's and torchao's notes with it
            from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    patched: list[tuple[str, Any]] = []
    packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    if packed is not None:
        patched.append(("find_packed_sequence_indices", packed))
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    skip = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if skip is not None:
        patched.append(("_ignore_causal_mask_sdpa", skip))

        from torch._subclasses.fake_tensor import is_fake

        def full_rows_skip(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
            if isinstance(padding_mask, torch.Tensor) and is_fake(padding_mask):
                padding_mask = None  # every value 1: what the real check finds on the planner's full rows
            return skip(padding_mask, *args, **kwargs)

        masking_utils._ignore_causal_mask_sdpa = full_rows_skip
    try:
        yield
    finally:
        for name, original in patched:
            setattr(masking_utils, name, original)


def _prime_optimizer(optimizer: Any, recipe: Recipe) -> bool:
    """Give every trainable parameter a zero gradient and run one optimizer step (its state now exists), as a
    warm-up step leaves them; return False where only a whole step can do it (an optimizer that steps in
    backward, phase-aware training)."""
    from colab_memopt.techniques.optimizers import steps_in_backward

    if (not isinstance(optimizer, torch.optim.Optimizer) or steps_in_backward(recipe.optimizer)
            or recipe.phase_offload is not None or recipe.uses_deepspeed or recipe.layer_offload_active):
        return False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    return True


# Traces of named models within this process (the recommender, its modes and the explore panel plan the same
# recipes again):
# (model name, traced recipe, seq_len, batch, CUDA rounding, optimizer implementation) -> trace.
_TRACE_CACHE: dict[tuple[Any, ...], Any] = {}
_TRACE_CACHE_SIZE = 256
# The stack count's shallow copies' tracers (`planner._make_tracer`), by what the copy is (`stack.model_key`), the
# recipe, the length and the target's way of tracing: the most recent few (each holds a fake model, no memory).
_SHALLOW_TRACERS: collections.OrderedDict[Any, Any] = collections.OrderedDict()
_SHALLOW_TRACERS_SIZE = 8


def clear_trace_cache() -> None:
    """Forget the traces `plan` cached in this process (and the shallow copies' tracers it keeps)."""
    _TRACE_CACHE.clear()
    _SHALLOW_TRACERS.clear()


@contextlib.contextmanager
def _fake_safe_lomo(recipe: Recipe) -> Iterator[None]:
    """Let AdaLomo's update run under fake tensors, for the duration.

    lomo-optim 0.1.1 computes `max(eps, p_rms)` with Python's `max` on a 0-dim tensor, which asks
    for the tensor's value; fake tensors have none. The same value as a `torch.clamp` (a 0-dim tensor,
    as `max` returns when p_rms is larger) traces.
    """
    if recipe.optimizer != "adalomo":
        yield
        return
    import builtins

    import lomo_optim.adalomo as adalomo

    def tensor_max(a: Any, b: Any) -> Any:
        if torch.is_tensor(b) and not torch.is_tensor(a):
            return torch.clamp(b, min=a)
        return builtins.max(a, b)

    adalomo.max = tensor_max  # a module global shadows the builtin
    try:
        yield
    finally:
        del adalomo.max


@contextlib.contextmanager
def _fake_safe_scalers(recipe: Recipe) -> Iterator[None]:
    """Let fp16's loss scalers step under fake tensors, for the duration: fp16 is traced in fp16.

    A scaler skips the update of a step whose gradients hold an inf or NaN, a branch on their values,
    which fake tensors do not have: the trace takes the clean step (the update applied), with the same
    checks' tensors. torch's GradScaler (fp16 autocast) sums `found_inf.item()` before stepping;
    lomo-optim's scaler (LOMO in fp16) reads `float(grad.float().sum())` per gradient (its fp32 copy is
    traced). `rounding.DynamicLossScaler` and AdaLomo's check in `lomo.fused_step` see fake tensors themselves.
    """
    patches: list[tuple[Any, str, Any]] = []
    if recipe.precision == "fp16-autocast":
        def maybe_opt_step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
            return optimizer.step(*args, **kwargs)

        patches.append((torch.amp.GradScaler, "_maybe_opt_step", maybe_opt_step))
    if recipe.precision == "fp16" and recipe.optimizer == "lomo":
        from lomo_optim.lomo import DynamicLossScaler

        def has_inf_or_nan(self: Any, x: torch.Tensor) -> bool:
            x.float().sum()
            return False

        patches.append((DynamicLossScaler, "_has_inf_or_nan", has_inf_or_nan))
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def _cuda_policy(on: bool) -> contextlib.AbstractContextManager[None]:
    return cuda_autocast_policy() if on else contextlib.nullcontext()


class _Tracer:
    """Build the model once under fake tensors, warm it up, then trace steps at any batch size."""

    def __init__(self, model_factory: Callable[[], nn.Module], recipe: Recipe, seq_len: int, *, cuda_rounding: bool, batch: int = 1,
                 optimizer_impl: str = "single-tensor", capability: tuple[int, int] | None = None,
                 units_of: Callable[[nn.Module], dict[int, int]] | None = None) -> None:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # allow_scalar_outputs: `loss.item()` in the step returns a symbolic float instead of failing.
        self.mode = fake_tensor_mode(shape_env=ShapeEnv(allow_scalar_outputs=True))
        self.seq_len = seq_len
        self.recipe = recipe
        self.cuda_rounding = cuda_rounding
        self.capability = capability  # the CUDA target's, for its SDPA kernels (None: the CPU's)
        self._cache: dict[int, _Trace] = {}
        # On a CUDA target bitsandbytes' 8-bit layers run LLM.int8's kernels, traced with no outlier column.
        self.int8_as_on_cuda = cuda_rounding and recipe.quantization == "bnb_int8" and recipe.quantization_phase == "all"
        # On a CUDA target an autocast recipe keeps float32 where CUDA's autocast does (softmax, LayerNorm, ...).
        self.cuda_autocast = cuda_rounding and recipe.precision.endswith("-autocast")
        with self.mode, _fake_safe_module_to(), _fake_safe_bitsandbytes(self.mode, recipe, cuda=cuda_rounding), \
                _fake_safe_transformers(), _fake_safe_lomo(recipe), _fake_safe_low_state(recipe), _fake_safe_scalers(recipe), \
                traced_attention(capability), _cuda_policy(self.cuda_autocast), first_rounds_traced():
            model = model_factory()
            with warnings.catch_warnings():  # a checkpoint_interval too large for the model: in the plan's warnings
                warnings.filterwarnings("ignore", message=INTERVAL_PITFALL_PATTERN, category=RuntimeWarning)
                self.model, self.optimizer = recipe.build(model)
            set_optimizer_impl(self.optimizer, optimizer_impl)
            self.batches = _FakeBatches(_vocab_size(self.model))
            # a stack's units (`units_of`: `stack.units_of`): each trace records its timeline, which the stack count
            # carries to the whole stack
            self.units = units_of(self.model) if units_of is not None else None
            # A warm-up creates the optimizer state and the gradients, as a real warm-up step does. Where the
            # optimizer steps after backward, one optimizer step on zero gradients does it without the forward
            # and backward (half a plan's time on a big model; tests/test_planner.py pins the peaks to
            # real measurements); otherwise a whole step, at the batch that is planned.
            if not _prime_optimizer(self.optimizer, recipe):
                self._step(batch)()

    def _step(self, batch: int) -> Callable[[], Any]:
        recipe, self.batches.rows = self.recipe, batch
        if recipe.accumulation_steps > 2:
            # Trace the first two micro-batches and the optimizer step, with the whole batch's token ids alive: from
            # the second micro-batch on each one runs with the gradients already there and no more rows than the
            # second (micro_batch_sizes puts the larger ones first), so the later ones repeat its peak. The same
            # peak as all n passes (tests/test_planner.py measures it), in two of them.
            from colab_memopt.techniques.accumulation import micro_batch_sizes

            batch = sum(micro_batch_sizes(batch, recipe.accumulation_steps)[:2])
            recipe = recipe.with_(accumulation_steps=2)
        return make_train_step(self.model, self.optimizer, self.batches, batch_size=batch, seq_len=self.seq_len, recipe=recipe)

    def trace(self, batch: int) -> _Trace:
        if batch not in self._cache:
            self._cache[batch] = self._trace(batch)
        return self._cache[batch]

    def _trace(self, batch: int) -> _Trace:
        with self.mode, _fake_safe_transformers(), _fake_safe_lomo(self.recipe), _fake_safe_low_state(self.recipe), \
                _fake_safe_scalers(self.recipe), _int8_as_on_cuda() if self.int8_as_on_cuda else contextlib.nullcontext(), \
                traced_attention(self.capability) as sdpa, _cuda_policy(self.cuda_autocast), first_rounds_traced():
            step = self._step(batch)
            scaler = getattr(step, "scaler", None)
            if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled():
                # a real warm-up step leaves the GradScaler's scale and growth tracker allocated (8 bytes)
                scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
            tracker = TensorTracker(device=torch.device("cpu"), cuda_rounding=self.cuda_rounding, units=self.units,
                                    in_op_buffers=self.cuda_rounding, module_stats=False)
            tracker.track_external(self.model, self.optimizer)
            with tracker:
                step()
        return _Trace(
            tracker.peak_bytes,
            dict(tracker.peak_categories),
            {p: tracker.phase_peaks.get(p, 0) for p in PHASES},
            {p: dict(c) for p, c in tracker.phase_peak_categories.items()},
            tracker.category_peaks["activations"],
            sdpa.hidden_bytes if sdpa is not None else 0,
            tracker.timeline,
        )
