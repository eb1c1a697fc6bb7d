"""Will it fit? Predict a training step's peak memory without a GPU.

`plan` builds the model and optimizer under `FakeTensorMode` (shapes only, nothing allocated) and
runs one whole training step of the recipe, through the same `Recipe.build` and
`train.make_train_step` that real measurements use, with the same tensor tracker as
`measure.measure_step`. Where a model cannot be traced (data-dependent control flow, custom ops), it
falls back to the analytic estimate and says so. With `find_max_batch` it also finds the largest batch that fits
(a guess from one trace, confirmed by traces at the boundary); `plan_offload_split` splits offloaded checkpoints
between the device and host RAM.

What CUDA runs differently is planned as CUDA runs it: for a CUDA target the optimizer is traced in
the implementation torch picks there (foreach: `_default_to_fused_or_foreach` picks it for CUDA
tensors, and foreach AdamW's `_foreach_sqrt` holds a 4 B/param temporary for all parameters at
once), and the fixed bytes a step allocates through the caching allocator (the cuBLAS workspace) are
lines of the plan with their source. bitsandbytes' 8-bit layers run LLM.int8 there (the CPU's training
path dequantizes the weight instead): traced with no outlier column, since which input columns are
outliers depends on the values, and said to be a lower bound (`_int8_as_on_cuda`).

The parts, one module each beside this one: the devices (`targets`), the answer and its printout (`prediction`),
the trace (`faketrace`), bitsandbytes' layers (`quantized`) and the lines a trace does not produce (`untraced`).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from colab_memopt.planning import estimate
from colab_memopt.techniques.checkpointing import checkpoint_offloader, interval_pitfalls
from colab_memopt.core.console import quiet
from colab_memopt.core.isolation import isolated
from colab_memopt.core.measure import format_bytes
from colab_memopt.core.progress import progress, say, shows_progress
from colab_memopt.core.tracker import PHASES
from colab_memopt.training.recipe import Recipe
from colab_memopt.planning.faketrace import (
    _SHALLOW_TRACERS,
    _SHALLOW_TRACERS_SIZE,
    _TRACE_CACHE,
    _TRACE_CACHE_SIZE,
    _Trace,
    _Tracer,
    shape_model,
)
from colab_memopt.planning.stack import STACK_UNITS, NotRepeating, StackTracer, stack_shape
from colab_memopt.planning.prediction import Cost, Plan, step_peak_with_transients
from colab_memopt.planning.quantized import (
    _int8_outlier_warning,
    four_bit_load_costs,
    four_bit_step_costs,
    quantization_scale_bytes,
)
from colab_memopt.planning.targets import DEFAULT_HEADROOM, OPTIMIZER_IMPLS, Target, check_headroom, get_target
from colab_memopt.planning.untraced import (
    _PINNED_NOTE,
    _grouped_query,
    _host_costs,
    _load_costs,
    cuda_workspace_costs,
    math_attention_warning,
    offloaded_checkpoint_bytes,
)


def max_positions(model: nn.Module) -> int | None:
    """Return the longest sequence a built model's config accepts (seq_len, max_position_embeddings, n_positions), or None."""
    config = getattr(model, "config", None)
    for key in ("seq_len", "max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_seq_len(seq_len: Any, limit: int | None, name: str) -> int:
    """Return `seq_len` if it is an integer in [1, limit], else raise ValueError naming it and the limit."""
    if seq_len is None or isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len {seq_len} exceeds {name!r}'s maximum of {limit}")
    return seq_len


def _step_fits(trace: Any, costs: list[Cost], limit_bytes: int) -> bool:
    """Return whether a traced step (a `_Trace`) with `costs` needs at most `limit_bytes`, as `Plan.device_need_bytes` counts."""
    fixed = sum(c.bytes for c in costs if not c.in_step)
    return step_peak_with_transients(trace.peak_bytes, trace.by_phase, costs) + fixed <= limit_bytes


_BATCH_CAP = 10**6


def _activation_max_batch(trace: _Trace, batch: int, budget_bytes: int) -> int:
    """Guess the largest batch under `budget_bytes` from one trace.

    The peak is the larger of a part that does not grow with the batch (model states, and the
    previous step's gradients at the start of the step) and model states plus activations, which
    grow linearly: activations per sample come from the activation peak, exact at any batch.
    """
    if trace.peak_bytes > budget_bytes and batch == 1:
        return 0
    per_sample = trace.activation_peak / batch
    fwd = trace.phase_categories.get("forward", {})
    states = fwd.get("parameters", 0) + fwd.get("buffers", 0) + fwd.get("optimizer_state", 0)
    if per_sample <= 0:
        return _BATCH_CAP
    return max(0, int((budget_bytes - states) / per_sample))


def _secant_step(at_guess: _Trace, guess: int, first: _Trace, budget_bytes: int) -> int:
    """Correct a batch guess with the trace at that guess: re-fit the bytes per sample above the states."""
    fwd = first.phase_categories.get("forward", {})
    states = fwd.get("parameters", 0) + fwd.get("buffers", 0) + fwd.get("optimizer_state", 0)
    per_sample = (at_guess.peak_bytes - states) / guess
    if per_sample <= 0:
        return guess
    return max(1, int((budget_bytes - states) / per_sample))


def _linear_max_batch(trace: _Trace, batch: int, budget_bytes: int) -> int:
    """Return the largest batch whose peak fits `budget_bytes` from one estimate: activations (and, outside
    the optimizer step, temporaries) per sample, the rest fixed. Used when there is no trace."""
    best = math.inf
    for phase, peak in trace.by_phase.items():
        cats = trace.phase_categories.get(phase, {})
        per_sample = (cats.get("activations", 0) + (cats.get("temporaries", 0) if phase != "optimizer" else 0)) / batch
        fixed = peak - per_sample * batch
        if fixed > budget_bytes:
            return 0
        if per_sample > 0:
            best = min(best, (budget_bytes - fixed) / per_sample)
    return int(best) if best != math.inf else _BATCH_CAP


# The max-batch search traces at most this many loop rounds of the tiled MLPs per step (or 4x the asked batch's):
# their trace time grows with the batch, other ops' does not (four tiles of each MLP run, the others are held, one op
# each: `tiling.traced_tiles`). The chunked loss's loops are traced by their first rounds (`loss.first_rounds_traced`):
# no bound needed.
_SEARCH_LOOP_ROUNDS = 32


def _search_batch_cap(meta_model: nn.Module, rec: Recipe, batch: int, seq_len: int) -> int | None:
    """Return the largest batch the max-batch search may trace (None: no bound needed): where the recipe loops over
    tokens (mlp_tile_tokens) a trace runs a round per tile, so its time grows with the batch; the bound keeps each
    trace at most `_SEARCH_LOOP_ROUNDS` rounds (or 4x the asked batch's)."""
    if rec.mlp_tile_tokens is None:
        return None
    from colab_memopt.techniques.tiling import find_mlps

    per_sample = len(find_mlps(meta_model)) * seq_len / rec.mlp_tile_tokens
    return max(4 * batch, int(_SEARCH_LOOP_ROUNDS / per_sample), rec.accumulation_steps)


# How close to the limit a need read off the lines between two batches' traces may come before the search traces
# that batch instead (what the tracker's rounding of each tensor to the allocator's blocks may make of a line).
_LINE_MARGIN_BYTES = 2 * 2**20


def _batch_lines(first: Any, batch: int, other: Any, other_batch: int) -> Callable[[int], Any] | None:
    """Return the counted stack's step at any batch from its traces at two (`stack.extrapolate`'s lines: every moment
    of the step that can be its peak, each moment's bytes linear in the batch: tensors of (batch x tokens x ...)
    and fixed ones), or None where the two traces cannot be read so.

    `at(n)` gives the step's peak and its peak per phase, and `.floor`: the same from the moments both traces ran.
    Where one trace ran operations the other did not (where a batch's tokens equal the hidden size, autograd sums a
    LoRA layer's two input gradients without the out-of-place add it runs at other batches: llama-3.2-1b QLoRA at
    4 x 512), those moments are known at one batch only. At a batch up to that one they are bounded by their bytes
    there (a tensor's bytes never shrink as the batch grows); above it they are unknown, and `at(n)` is None.
    """
    import difflib
    import types

    if first.lines is None or other.lines is None or batch == other_batch:
        return None
    if first.keys == other.keys:  # the same operations
        pairs, extra, extra_batch = list(zip(first.lines, other.lines)), [], other_batch
    else:
        matcher = difflib.SequenceMatcher(a=first.keys, b=other.keys, autojunk=False)
        pairs, only = [], {"first": [], "other": []}
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                pairs += zip(first.lines[i1:i2], other.lines[j1:j2])
                continue
            if tag == "replace":
                return None
            only["first"] += first.lines[i1:i2]
            only["other"] += other.lines[j1:j2]
        if only["first"] and only["other"]:
            return None  # each ran something the other did not: no trace has every moment
        extra, extra_batch = (only["first"], batch) if only["first"] else (only["other"], other_batch)
    span = other_batch - batch
    rows = [(PHASES[phase], sum(a), sum(b) - sum(a)) for (phase, a), (_, b) in pairs]
    if any((change < 0) != (span < 0) and change for _, _, change in rows):
        return None  # a moment with fewer bytes at the larger batch: not tensors that grow with it
    bounds = [(PHASES[phase], sum(line)) for phase, line in extra]

    def peaks(by_phase: dict[str, int]) -> Any:
        return types.SimpleNamespace(peak_bytes=max(by_phase.values(), default=0), by_phase=by_phase)

    def floor_at(n: int) -> Any:
        by_phase: dict[str, int] = {}
        for name, live, change in rows:
            need = live - (-change * (n - batch) // span)  # rounded up
            if need > by_phase.get(name, 0):
                by_phase[name] = need
        return peaks(by_phase)

    def at(n: int) -> Any:
        if bounds and n > extra_batch:
            return None
        floor = floor_at(n)
        bounded = dict(floor.by_phase)
        for name, nbytes in bounds:
            bounded[name] = max(bounded.get(name, 0), nbytes)
        step = peaks(bounded)
        step.floor = floor
        return step

    def same(step: Any, trace: Any) -> bool:
        return (step is not None and step.peak_bytes == trace.peak_bytes
                and all(step.by_phase.get(p, 0) == v for p, v in trace.by_phase.items()))

    # each trace's own step given back to the byte (the moments only one ran: at that one's batch, their bytes)
    at_first, at_other = (at(batch), floor_at(other_batch)) if extra_batch == batch else (floor_at(batch), at(other_batch))
    if not (same(at_first, first) and same(at_other, other)):
        return None
    at.one_batch = (len(extra), extra_batch)  # type: ignore[attr-defined]
    return at


def _max_batch_from_lines(at: Callable[[int], Any], costs: list[Cost], limit: int, lower: int,
                          upper: int | None) -> int | None:
    """Return the largest batch that fits by the lines between two traces (`_batch_lines`), or None where the
    answer is not clear from them: the boundary's batch or the next within `_LINE_MARGIN_BYTES` of the limit, no
    batch >= `lower` fitting, the boundary at the search's cap (the traced search says so), or the boundary where
    moments known at one batch only leave it open."""
    fixed = sum(c.bytes for c in costs if not c.in_step)

    def need(n: int, *, floor: bool = False) -> float:
        """The need at batch n: at most (the default), or at least (`floor`; 0 where nothing is known)."""
        step = at(n)
        if step is None:
            return 0 if floor else float("inf")
        step = getattr(step, "floor", step) if floor else step
        return step_peak_with_transients(step.peak_bytes, step.by_phase, costs) + fixed

    top = upper if upper is not None else _BATCH_CAP
    if need(lower) > limit - _LINE_MARGIN_BYTES:
        return None
    lo, hi = lower, top + 1  # lo fits; hi does not (top + 1: never planned)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= limit else (lo, mid)
    if hi > top or need(lo) > limit - _LINE_MARGIN_BYTES or need(hi, floor=True) <= limit + _LINE_MARGIN_BYTES:
        return None
    return lo


def _verified_max_batch(
    fits: Callable[[int], bool], guess: int, max_traces: int = 16, *, lower: int = 1, upper: int | None = None
) -> tuple[int, bool]:
    """Return (largest batch >= `lower` that fits, or 0 if none; whether the boundary was found).

    `fits` traces one step. The guess is usually right within one, so this gallops away from it
    (1, 2, 4, ... batches) until the answer changes, then bisects: two traces when the guess is
    right, about 2*log2(error) otherwise. Batches below `lower` (the accumulation steps) are not valid;
    batches above `upper` are not tried (where `upper` fits, the answer is `upper`, not converged).
    """
    traces = 0

    def probe(b: int) -> bool:
        nonlocal traces
        if upper is not None and b > upper:
            return False
        traces += 1
        return fits(b)

    guess = max(guess, lower)
    if upper is not None:
        guess = min(guess, max(upper, lower))
    step = 1
    if probe(guess):
        lo, hi = guess, None
        while hi is None and traces < max_traces:
            if probe(lo + step):
                lo += step
                step *= 2
            else:
                hi = lo + step
    else:
        lo, hi = None, guess
        while lo is None and traces < max_traces:
            b = max(lower, hi - step)
            if b == hi:  # `lower` itself does not fit
                lo = lower - 1
            elif probe(b):
                lo = b
            else:
                hi = b
                step *= 2
    if lo is None or hi is None:
        return (lo if lo is not None and lo >= lower else 0), False
    while hi - lo > 1 and traces < max_traces:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    capped = upper is not None and lo == upper and hi == upper + 1  # `upper + 1` was never tried
    return (lo if lo >= lower else 0), hi - lo <= 1 and not capped


def offload_split(p: Plan, n_blocks: int) -> int | None:
    """Return how many blocks' checkpoints to keep on the device (`Recipe.offload_keep_blocks`) so that a step
    planned with every checkpoint offloaded (`p`, checkpointing='offload', offload_keep_blocks=0) fits both
    memories; None when no split does.

    Each block kept on the device moves one block input (its host bytes, `offloaded checkpoints` / n_blocks,
    as the pinned allocator takes them) from host RAM to the device. The device need grows by at most that
    much per block (the kept inputs are all alive at worst; backward frees them as it goes), so the least
    split that fits the host (`need`) and the most the device's free bytes hold (`room`) bound the choice; the
    split keeps the middle, leaving spare blocks' worth in both memories.
    """
    host = sum(c.bytes for c in p.host_costs if c.name == "offloaded checkpoints")
    if p.recipe.get("checkpointing") != "offload" or p.recipe.get("offload_keep_blocks") or not host or n_blocks < 1:
        return None
    per_block = -(-host // n_blocks)
    device_free = p.device_limit_bytes - p.device_need_bytes
    host_over = p.host_need_bytes - p.host_limit_bytes
    if device_free < 0:
        return None
    need = max(0, -(-host_over // per_block))
    room = min(n_blocks, device_free // per_block)
    return None if need > room else (need + room) // 2


def plan_offload_split(model_factory: Any, batch: int, *, seq_len: int, recipe: Recipe, target: Any = "t4",
                       headroom: float = DEFAULT_HEADROOM, method: str = "auto") -> Plan:
    """Return the plan of `recipe` (checkpointing='offload') with the checkpoints split between device and host
    for `target` (`offload_split`; two plans): the split's plan when one fits, else the all-offloaded plan.

    Example:
        >>> p = plan_offload_split("llama-3.2-1b", 1, seq_len=32768, recipe=Recipe(checkpointing="offload"))
        >>> p.recipe["offload_keep_blocks"], p.fits
    """
    from colab_memopt.techniques import architectures

    if recipe.checkpointing != "offload":
        raise ValueError(f"plan_offload_split needs checkpointing='offload', got {recipe.checkpointing!r}")
    whole = plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(offload_keep_blocks=0), target=target,
                 headroom=headroom, find_max_batch=False, method=method)
    n_blocks = estimate._dims(shape_model(architectures.resolve_model(model_factory).build))["layers"]
    keep = offload_split(whole, n_blocks)
    if not keep:
        return whole
    return plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(offload_keep_blocks=keep), target=target,
                headroom=headroom, find_max_batch=False, method=method)


# Model states over this many times the device: answered by the analytic estimate at once, without a trace
# (a 1.3e12-parameter config took a minute or more to trace only to say it does not fit).
HOPELESS_FACTOR = 2


def _plan_auto_chunk(model_factory: Any, batch: int, *, seq_len: int | None, recipe: Recipe, **kwargs: Any) -> Plan:
    """Plan `recipe` with loss_chunk_tokens='auto': plan it at DEFAULT_CHUNK_TOKENS, take the device bytes that plan
    leaves free as the room at the loss (the peak is at the loss or later, so it is at least that), choose the chunk
    (`loss.auto_chunk_tokens`) and plan that chunk; the larger chunk only where its own plan fits too."""
    from colab_memopt.techniques import architectures
    from colab_memopt.techniques.loss import DEFAULT_CHUNK_TOKENS, auto_chunk_tokens

    search = kwargs.pop("find_max_batch")  # one max-batch search, on the plan returned (not on each plan tried)
    base = plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(loss_chunk_tokens=DEFAULT_CHUNK_TOKENS),
                find_max_batch=False, **kwargs)
    dims = estimate._dims(shape_model(architectures.resolve_model(model_factory).build))
    micro = -(-batch // recipe.accumulation_steps)
    chunk = auto_chunk_tokens(max(0, base.device_limit_bytes - base.device_need_bytes), dims["vocab"], dims["hidden"],
                              micro * base.seq_len)
    note = (f"loss_chunk_tokens='auto': {chunk} tokens, from the {format_bytes(max(0, base.device_limit_bytes - base.device_need_bytes))} "
            f"the plan at {DEFAULT_CHUNK_TOKENS} tokens leaves free (loss.auto_chunk_tokens)")
    if chunk != DEFAULT_CHUNK_TOKENS:
        bigger = plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(loss_chunk_tokens=chunk),
                      find_max_batch=search, **kwargs)
        if bigger.fits or not base.fits:
            bigger.warnings.append(note)
            return bigger
        note += f"; {chunk} did not fit its own plan, so {DEFAULT_CHUNK_TOKENS}"
    if search:
        base = plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(loss_chunk_tokens=DEFAULT_CHUNK_TOKENS),
                    find_max_batch=True, **kwargs)
    base.warnings.append(note)
    return base


@shows_progress("plan", nested=False)
@quiet()
@isolated
def plan(
    model_factory: Callable[[], nn.Module] | str | Any,
    batch: int,
    *,
    seq_len: int | None = None,
    recipe: Recipe | dict[str, Any] | None = None,
    target: str | Target | dict[str, Any] = "t4",
    headroom: float = DEFAULT_HEADROOM,
    find_max_batch: bool = True,
    method: str = "auto",
    optimizer_impl: str = "auto",
) -> Plan:
    """Predict the peak memory of one training step on a target, without a GPU.

    Args:
        model_factory: a zero-argument function that builds the model (any `nn.Module` with
            `model(input_ids, labels=...)` -> `.loss` and `.config.vocab_size`), a model name
            from `architectures.model_names()`, a Hugging Face model id, a local folder or
            config.json, or a `transformers.PretrainedConfig` (see `architectures.resolve_model`).
        batch: sequences per step (>= 1).
        seq_len: tokens per sequence (>= 1; default: the reference model's seq_len).
        recipe: the techniques applied (a `Recipe` or a dict of its fields).
        target: 't4', 'l4', 'a100-40gb', 'a100-80gb', 'h100-80gb', a `Target`, or a dict.
        headroom: fraction of device memory and host RAM kept free (allocator fragmentation).
        find_max_batch: also search for the largest batch that fits (a few more traces).
        method: 'auto' (trace, else analytic with a warning), 'trace' or 'analytic'.
        optimizer_impl: 'auto' (the target's `optimizer_impl`; by default foreach for a CUDA target,
            as torch picks there, single-tensor otherwise, as on the CPU), 'foreach' or 'single-tensor'.

    Example:
        >>> p = plan("gpt2-small", 8, seq_len=512, target="t4")
        >>> p.fits, p.max_batch
    """
    from colab_memopt.techniques import architectures

    start = time.perf_counter()
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    headroom = check_headroom(headroom)
    if method not in ("auto", "trace", "analytic"):
        raise ValueError(f"method must be 'auto', 'trace' or 'analytic', got {method!r}")
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {optimizer_impl!r}")
    tgt = get_target(target)
    if tgt.optimizer_impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"target optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {tgt.optimizer_impl!r}")
    impl = optimizer_impl if optimizer_impl != "auto" else tgt.optimizer_impl
    impl = ("foreach" if tgt.cuda else "single-tensor") if impl == "auto" else impl
    if recipe is not None and not isinstance(recipe, (Recipe, dict)):
        raise TypeError(f"recipe must be a Recipe or a dict of its fields, got {type(recipe).__name__} {recipe!r}")
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(recipe or {})
    if rec.loss_chunk_tokens == "auto":  # the chunk from the memory the plan leaves at the loss
        return _plan_auto_chunk(model_factory, batch, seq_len=seq_len, recipe=rec, target=target, headroom=headroom,
                                find_max_batch=find_max_batch, method=method, optimizer_impl=optimizer_impl)
    if batch < rec.accumulation_steps:
        raise ValueError(f"batch {batch} is smaller than recipe.accumulation_steps={rec.accumulation_steps}: "
                         "the batch is the effective batch, split into that many micro-batches")
    model_factory_arg = model_factory
    try:
        spec = architectures.resolve_model(model_factory)  # a name, hub id, folder, config.json, config or factory
    except TypeError:
        shape_model(model_factory)  # names the bad factory in plan's own words
        raise
    name, limit, model_factory = spec.name, spec.max_seq_len, spec.build
    from colab_memopt.training.presets import with_family_lora_targets

    rec = with_family_lora_targets(rec, spec.family)  # a folder's llama: q_proj..., not the reference model's names
    if limit is not None:
        seq_len = check_seq_len(limit if seq_len is None else seq_len, limit, name)
        meta_model = shape_model(model_factory)
    else:
        if seq_len is None and spec.config is not None:
            raise ValueError(f"model {name!r} has no usable max_position_embeddings in its config: give seq_len (--seq)")
        check_seq_len(seq_len, None, name)
        meta_model = shape_model(model_factory)
        check_seq_len(seq_len, max_positions(meta_model), type(meta_model).__name__)
    rec.check_model(meta_model)  # a plan only for what can run: what Recipe.build refuses, plan refuses
    if tgt.cuda and tgt.compute_capability is not None:  # a bf16 frozen base needs native bf16 (sm_80+)
        from colab_memopt.techniques.precision import check_native_bf16

        check_native_bf16(rec.base_dtype, native_bf16=tuple(tgt.compute_capability) >= (8, 0),
                          where=f"target {tgt.name!r} (sm_{tgt.compute_capability[0]}{tgt.compute_capability[1]})")
    analytic = estimate.training_step_bytes(meta_model, batch, seq_len, rec)
    device_costs = []
    if tgt.cuda:
        device_costs = [
            Cost("CUDA context", tgt.cuda_context_bytes, tgt.context_source),
            *cuda_workspace_costs(tgt.compute_capability),
            *four_bit_step_costs(meta_model, spec, rec, tgt, batch, seq_len),
        ]
    warn: list[str] = []
    if rec.precision == "fp16":
        warn.append("pure fp16 is traced in fp16 with its loss scaler taking a clean step (fake tensors have no values: "
                    "the skip of an overflowing step, which holds less, is not traced)")
        if rec.optimizer in ("lomo", "adalomo") and rec.weight_dtype is None:  # (int8train's rules do not clip)
            warn.append(f"{rec.optimizer} in fp16 runs two backward passes, the first with the graph retained (the "
                        "global norm, which finds overflows before any weight changes): both are traced")
    warn += interval_pitfalls(meta_model, rec.checkpointing, rec.checkpoint_interval)  # the build says it on stderr
    notes: list[str] = []
    if rec.precision == "fp16-autocast" or rec.eval_precision == "fp16-autocast":
        notes.append("fp16 autocast traced with its GradScaler taking a clean step (a skipped overflowing step holds "
                     "less)" + ("; with CUDA's autocast lists: softmax, log_softmax, layer_norm, sum and the losses "
                            "in float32, as on the GPU" if tgt.cuda and rec.precision == "fp16-autocast" else ""))
    uses_bf16 = "bf16" in (rec.precision, rec.eval_precision or "") or rec.precision == "bf16-autocast"
    if tgt.cuda and uses_bf16 and tgt.compute_capability is not None and tuple(tgt.compute_capability) < (8, 0):
        warn.append(f"{tgt.name} (sm_{tgt.compute_capability[0]}{tgt.compute_capability[1]}) has no native bf16: its "
                    "matmuls are emulated and SDPA has no bf16 memory-efficient kernel there, so it falls back to math "
                    "and builds the T x T scores (planned so); use fp16-autocast")

    used = "analytic"
    trace = tracer = None
    states = sum(analytic.by_category.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
    if method == "auto" and states > HOPELESS_FACTOR * tgt.device_bytes and not rec.uses_deepspeed \
            and not rec.layer_offload_active and rec.optimizer_state_offload == "keep":
        warn.append(f"not traced: the weights, gradients and optimizer state alone ({states / 2**30:.1f} GiB by the "
                    f"analytic estimate) are {states / tgt.device_bytes:.0f}x {tgt.name}'s device memory, so no trace could "
                    "make it fit; the figures are the analytic estimate")
    elif method != "analytic" and rec.untraceable_reason:
        if method == "trace":
            raise ValueError(f"cannot trace this recipe: {rec.untraceable_reason}")
        warn.append(f"not traced: {rec.untraceable_reason}; the figures are the analytic estimate")
    elif method != "analytic":
        # A named model's trace is cached (the recommender and notebooks plan the same recipe again), unless the
        # tracer itself is needed afterwards (the max-batch search, offloaded checkpoints' host bytes).
        capability = tuple(tgt.compute_capability) if tgt.cuda and tgt.compute_capability is not None else None
        cache_key = ((name, rec, seq_len, batch, tgt.cuda, impl, capability)
                     if isinstance(model_factory_arg, str) and model_factory_arg in architectures.model_names()
                     and not find_max_batch and rec.checkpointing != "offload" else None)
        try:
            if cache_key is not None and cache_key in _TRACE_CACHE:
                trace, scales, int8_warning = _TRACE_CACHE[cache_key]
            else:
                say(f"building {name} on fake tensors (no weights loaded)")
                tracer = _make_tracer(spec, meta_model, rec, seq_len, cuda_rounding=tgt.cuda, batch=batch,
                                      optimizer_impl=impl, capability=capability)
                say(f"tracing one training step: batch {batch} x {seq_len:,} tokens")
                trace = tracer.trace(batch)
                # what the plan reads from the traced model, kept beside a cached trace
                scale_bytes = functools.partial(quantization_scale_bytes, cuda_rounding=tgt.cuda)
                scales = (tracer.extrapolated_count(scale_bytes) if isinstance(tracer, StackTracer)
                          else scale_bytes(tracer.model))
                int8_warning = (_int8_outlier_warning(tracer.model, batch, seq_len, rec, tgt)
                                if tracer.int8_as_on_cuda else None)
                if cache_key is not None:
                    if len(_TRACE_CACHE) >= _TRACE_CACHE_SIZE:
                        _TRACE_CACHE.pop(next(iter(_TRACE_CACHE)))
                    _TRACE_CACHE[cache_key] = (trace, scales, int8_warning)
            used = "trace"
        except Exception as exc:  # noqa: BLE001 - any failure to trace falls back, loudly
            if method == "trace":
                raise
            warn.append(f"could not trace the step on fake tensors ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                        "the figures are the analytic estimate, not a trace")
            warnings.warn(warn[-1], stacklevel=2)
    if trace is None:
        trace = _Trace(analytic.peak_bytes, analytic.by_category, analytic.by_phase, analytic.phase_categories)
        if _grouped_query(meta_model) and tgt.cuda and tgt.compute_capability is not None \
                and tuple(tgt.compute_capability) < (8, 0):
            warn.append(f"grouped-query attention without a mask runs SDPA's math kernel on {tgt.name}: the estimate "
                        "leaves out its T x T scores per layer; trace the step (method='trace'), or call "
                        "colab_memopt.techniques.attention.repeat_kv_for_sdpa(model) to run the O(T) kernel")

    result = Plan(
        model=name, batch=batch, seq_len=seq_len, recipe=rec.to_dict(), target=tgt, method=used,
        peak_bytes=trace.peak_bytes, by_category=trace.by_category, by_phase=trace.by_phase,
        by_phase_category=trace.phase_categories, device_costs=device_costs, host_costs=_host_costs(rec, batch, seq_len, sum(p.numel() for p in estimate._unique(meta_model.parameters()))),
        headroom_fraction=headroom,
        analytic_peak_bytes=analytic.peak_bytes, warnings=warn, optimizer_impl=impl if used == "trace" else "analytic",
        next_call=(f"cm.recommend({repr(model_factory_arg) if isinstance(model_factory_arg, str) else 'model'}, "
                   f"{batch}, seq_len={seq_len}, target={tgt.name!r}) picks settings that fit"),
    )
    result.host_costs += _load_costs(spec, rec, tgt)
    result.notes += notes
    if used == "trace" and isinstance(tracer, StackTracer) and tracer.full is None:
        result.notes.append(tracer.shape.describe())
    if used == "trace":
        if scales:
            device_costs.append(Cost("quantization scales", scales,
                                     "traced: bitsandbytes' row scales and absmax kept beside the quantized weights (outside "
                                     "the parameters, so not in the tensors at peak, as the tracker does not see them either)",
                                     in_allocator=True))
        if int8_warning:
            warn.append(int8_warning)
        if trace.hidden_bytes:  # the trace holds the math kernel's scores and what it frees inside its ops
            warn.append(math_attention_warning(tgt))
    if tgt.cuda:  # loading (and quantizing) can be the run's highest point, which a CPU trace cannot see
        model_bytes = (result.by_category.get("parameters", 0) + result.by_category.get("buffers", 0)
                       + sum(c.bytes for c in device_costs if c.name == "quantization scales"))
        result.load_costs = four_bit_load_costs(meta_model, spec, rec, tgt, model_bytes)
        if result.load_costs and not result.fits_run:
            warn.append(f"loading needs {format_bytes(result.load_need_bytes)} on the device ({result.load_costs[1].name}, "
                        f"{result.load_costs[2].name}), more than the {format_bytes(result.device_limit_bytes)} usable, though "
                        "the step fits or not as said: load from a checkpoint, which transformers quantizes tensor by tensor "
                        "on the device (loading.load_model with a hub id or a saved folder)")
    if rec.checkpointing == "offload":  # the checkpointed blocks' inputs wait in host RAM
        if used == "trace":
            def held(model: nn.Module) -> int:
                offloader = checkpoint_offloader(model)
                return offloader.peak_pinned_host_bytes if tgt.cuda else offloader.peak_host_bytes

            result.host_costs.append(Cost("offloaded checkpoints",
                                          tracer.extrapolated_count(held) if isinstance(tracer, StackTracer)
                                          else held(tracer.model),
                                          "traced: one block input per block (checkpointing.CheckpointOffloader)" + _PINNED_NOTE * tgt.cuda))
        else:
            result.host_costs.append(Cost("offloaded checkpoints",
                                          offloaded_checkpoint_bytes(meta_model, batch, seq_len, rec, pinned=tgt.cuda),
                                          "analytic: one block input per block (offloaded_checkpoint_bytes)" + _PINNED_NOTE * tgt.cuda))
    if find_max_batch:
        with progress("largest batch"):
            result.max_batch = _max_batch(result, trace, tracer if used == "trace" else None, meta_model, rec, batch,
                                          seq_len, device_costs, tgt, warn)
    result.seconds = time.perf_counter() - start
    return result


def _make_tracer(spec: Any, meta_model: nn.Module, rec: Recipe, seq_len: int, **kwargs: Any) -> Any:
    """Return the step's tracer: a `stack.StackTracer` (two shallow copies traced, the rest of the blocks counted)
    where the model is a deep stack of repeating blocks and the recipe treats them alike, else a `_Tracer` of the
    whole model."""
    # (LLM.int8 traced as on CUDA: its warning counts the outlier columns of every 8-bit layer of the whole model)
    if not _FAST_STACK or (kwargs.get("cuda_rounding") and rec.quantization == "bnb_int8"):
        return _Tracer(spec.build, rec, seq_len, **kwargs)
    try:
        shape = stack_shape(meta_model, rec, spec)
    except NotRepeating:
        return _Tracer(spec.build, rec, seq_len, **kwargs)
    say(f"{shape.n_blocks} blocks alike: tracing {shape.depth(STACK_UNITS[0])} and {shape.depth(STACK_UNITS[1])}, "
        "counting the rest")

    def make(factory: Callable[[], nn.Module], units_of: Any, key: Any = None) -> _Tracer:
        # a shallow copy's tracer, reused by the next plan of the same copy (capacity's search plans one architecture
        # at many depths: their shallow copies are one model), its traces kept per batch
        cache_key = None if key is None else (key, rec, seq_len, tuple(sorted(kwargs.items())))
        if cache_key is not None and cache_key in _SHALLOW_TRACERS:
            _SHALLOW_TRACERS.move_to_end(cache_key)
            return _SHALLOW_TRACERS[cache_key]
        tracer = _Tracer(factory, rec, seq_len, units_of=units_of, **kwargs)
        if cache_key is not None:
            _SHALLOW_TRACERS[cache_key] = tracer
            while len(_SHALLOW_TRACERS) > _SHALLOW_TRACERS_SIZE:
                _SHALLOW_TRACERS.popitem(last=False)
        return tracer

    return StackTracer(spec, shape, make)


# Whether plans of deep models trace two shallow copies and count the rest of the stack (tests turn it off to
# compare with the whole trace).
_FAST_STACK = True
# Whether the largest-batch search of a counted stack reads the batch off the lines between two traces where they
# are clear of the limit (tests turn it off to compare with the traced search).
_LINES_SEARCH = True


def _max_batch(result: Plan, trace: Any, tracer: Any, meta_model: nn.Module, rec: Recipe, batch: int, seq_len: int,
               device_costs: list[Cost], tgt: Target, warn: list[str]) -> int:
    """Return the largest batch that fits: from the activations per sample, confirmed by traces where `tracer` traces
    (each batch traced once: the tracer keeps its traces); linear in the batch from the estimate otherwise."""
    budget = result.device_limit_bytes - sum(c.bytes for c in device_costs)

    def traced(b: int) -> Any:
        if b not in tracer._cache:
            say(f"trace at batch {b}")
        return tracer.trace(b)

    if tracer is not None:
        # Guess from the activations per sample, then confirm the boundary with traces.
        guess = _activation_max_batch(trace, batch, budget)
        cap = _search_batch_cap(meta_model, rec, batch, seq_len)
        if 0 < guess < _BATCH_CAP:
            if cap is not None:
                guess = min(guess, cap)
            at_guess = traced(guess)

            def from_lines(a: Any, at_a: int, b: Any, at_b: int) -> int | None:
                """A counted stack's step at any batch, from the lines between its traces at two (each moment's
                bytes linear in the batch): the answer where it is clear of the limit, else None."""
                at = _batch_lines(a, at_a, b, at_b) if _LINES_SEARCH else None
                known = None if at is None else _max_batch_from_lines(at, device_costs, result.device_limit_bytes,
                                                                      rec.accumulation_steps, cap)
                if known is not None:
                    moments, traced_at = at.one_batch
                    say(f"every moment's bytes are linear in the batch between the traces at {min(at_a, at_b)} and "
                        f"{max(at_a, at_b)}" + (f" ({moments} moments only the trace at {traced_at} ran: at most their bytes there)"
                                                if moments else "") + f": {known} fits, {known + 1} does not")
                return known

            known = from_lines(trace, batch, at_guess, guess)
            if known is not None:
                return known
            first_guess, guess = guess, _secant_step(at_guess, guess, trace, budget)
            if guess not in (first_guess, batch) and (cap is None or guess <= cap):
                # the first two traces did not settle it (the boundary near the limit, or above a guess whose trace
                # ran moments the first did not: `_batch_lines`): the lines between the guess's trace and the
                # corrected guess's
                known = from_lines(at_guess, first_guess, traced(guess), guess)
                if known is not None:
                    return known
            guess, converged = _verified_max_batch(
                lambda b: _step_fits(traced(b), device_costs, result.device_limit_bytes), guess,
                lower=rec.accumulation_steps, upper=cap
            )
            if not converged and cap is not None and guess == cap:
                warn.append(f"max_batch {guess} is the largest batch searched, and it fits: a larger one's trace "
                            "would run more rounds of the tiled MLP than the search allows "
                            f"({_SEARCH_LOOP_ROUNDS}, or 4x batch {batch}'s); plan a larger batch to check it")
            elif not converged:
                warn.append(f"max_batch {guess} is the largest traced batch that fits; the search stopped before the boundary")
    else:
        guess = _linear_max_batch(trace, batch, budget)
    return guess
