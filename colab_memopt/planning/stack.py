"""Trace what repeats once: a decoder's step planned from two shallow traces, its stack of blocks counted.

A decoder is an embedding, a stack of N blocks and a head. Its training step, traced on fake tensors, is a sequence
of operations, and after each the tracker knows the live bytes per category. With the blocks alike, the operations of
one block's forward (or its backward, its recomputation included) are the same in every block, and the bytes alive
after each of them are affine in the block's place j and the depth K:

    bytes(event r of block j, depth K) = A_r + B_r * j + C_r * K

B is what one block more below leaves alive (its saved activations in forward; those less its gradients in
backward), C what one block more in the model adds wherever the step is (its weights, optimizer state and, once
backward has passed it, gradients). The first and the last block see other neighbours (the embedding, the head) and
are kinds of their own, each affine in K; so are the operations outside the blocks (the embedding, the loss, the
optimizer step). Blocks that differ by their place (interleaved attention windows, every n-th block checkpointed,
two-level offload's segments) repeat with a period: a unit of that many blocks is what repeats.

So the step is traced at two shallow depths, 3 and 5 units (`STACK_UNITS`): the first unit, one and three middle
units, the last unit. Each operation is matched with its twin at the other depth (the same operation, or the fast
path gives up), the three middle units at depth 5 check that B is one constant, and every line of bytes is carried
to the whole stack: a middle unit's bytes are affine in j, so their largest value is at the second or the
second-to-last unit. The plan is then the largest sum over the extrapolated step, per phase, with its categories,
as the full trace finds it (tests/test_stack.py holds them equal within 0.1% across the built-in families and
modes). Where the blocks do not repeat as this needs (a mixture of blocks, one not in one stack, a step that visits
them out of order), `NotRepeating` says why and the planner traces every block instead, saying so.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from colab_memopt.core.progress import say
from colab_memopt.core.tracker import CATEGORIES, PHASES

# The depths traced, in units: the first unit, middle units, the last unit. Three middle units at the larger depth
# check that what one more unit below leaves alive is one constant.
STACK_UNITS = (3, 5)

# Attributes that number a block (and so differ between blocks that are otherwise alike).
_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "block_idx", "idx", "index"})


class NotRepeating(Exception):
    """The traced blocks do not repeat as the fast path needs: the step must be traced with every block."""


@dataclass(frozen=True)
class StackShape:
    """A model's stack of blocks as the fast path sees it: N blocks in units of `period` blocks. `keys`: what each
    shallow copy is (`model_key`, one per `STACK_UNITS` depth; None where unknown), for reusing its traces."""

    n_blocks: int
    period: int = 1
    keys: tuple[Any, ...] = dataclasses.field(default=(None, None), compare=False)

    @property
    def n_units(self) -> int:
        return -(-self.n_blocks // self.period)

    @property
    def last_unit_blocks(self) -> int:
        """Blocks in the last unit (fewer than `period` where N is not a multiple of it)."""
        return self.n_blocks - (self.n_units - 1) * self.period

    def depth(self, units: int) -> int:
        """Return the blocks of a model of `units` units: the first, the middle ones and a last like the whole's."""
        return (units - 1) * self.period + self.last_unit_blocks

    @property
    def worth_it(self) -> bool:
        """Whether the shallow traces are fewer blocks than the whole stack (and the stack deep enough to hold them)."""
        return self.n_units > STACK_UNITS[1] and sum(self.depth(k) for k in STACK_UNITS) < self.n_blocks + self.period

    def extrapolate(self, at_small: int, at_large: int) -> int:
        """Return the whole stack's value of a count affine in the depth, from its values at the two depths traced."""
        steps = STACK_UNITS[1] - STACK_UNITS[0]
        slope, rest = divmod(at_large - at_small, steps)
        if rest:
            raise NotRepeating(f"a count grew by {at_large - at_small} over {steps} units: not the same per unit")
        return at_large + slope * (self.n_units - STACK_UNITS[1])

    def describe(self) -> str:
        unit = "block" if self.period == 1 else f"unit of {self.period} blocks"
        small, large = (self.depth(k) for k in STACK_UNITS)
        return (f"traced {small} and {large} of its {self.n_blocks} blocks, the rest counted: the blocks repeat "
                f"(one {unit} at a time)")


# -- the stack of blocks ----------------------------------------------------------------------------------------------

def block_stack(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """Return (the parent module, the attribute name, the ModuleList) of the model's one stack of repeated blocks;
    raise NotRepeating where there is none, or more than one (an encoder and a decoder)."""
    from colab_memopt.techniques.checkpointing import find_block_stacks

    try:
        stacks = find_block_stacks(model)
    except ValueError as exc:
        raise NotRepeating(str(exc)) from None
    if len(stacks) != 1:
        raise NotRepeating(f"{len(stacks)} stacks of blocks (an encoder and a decoder): one is needed")
    stack = stacks[0]
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is stack:
                return parent, name, stack
    raise NotRepeating("the stack of blocks is not a submodule of the model")  # pragma: no cover - found in it


def _signature(block: nn.Module, layer_type: Any = None) -> tuple[Any, ...]:
    """Return what makes a block the kind it is: its modules' classes and plain settings (not its index), its
    parameters' and buffers' shapes, dtypes and trainability, and the config's type of its layer."""
    parts: list[Any] = [layer_type]
    for name, module in block.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(module).items()
                             if not k.startswith("_") and k not in _INDEX_ATTRS
                             and isinstance(v, (str, int, float, bool, type(None)))))
        parts.append((name, type(module).__name__, plain))
    parts += [(name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters()]
    parts += [(name, tuple(b.shape), b.dtype) for name, b in block.named_buffers()]
    return tuple(parts)


def _signatures(model: nn.Module) -> list[tuple[Any, ...]]:
    """Return the `_signature` of each block of the model's stack, in order."""
    _, _, stack = block_stack(model)
    config = getattr(model, "config", None)
    types = getattr(config, "layer_types", None)
    types = list(types) if isinstance(types, (list, tuple)) and len(types) == len(stack) else [None] * len(stack)
    return [_signature(b, t) for b, t in zip(stack, types)]


def structural_period(model: nn.Module) -> int:
    """Return the least period with which the model's blocks repeat (1: all alike); raise NotRepeating where none
    up to a third of the stack does (each kind must appear in the first, a middle and the last unit)."""
    sigs = _signatures(model)
    for period in range(1, len(sigs) // 3 + 1):
        if all(sigs[i] == sigs[i + period] for i in range(len(sigs) - period)):
            return period
    raise NotRepeating(f"its {len(sigs)} blocks are not alike, nor repeat with a period")


def shape_of(model: nn.Module, period: int = 1) -> StackShape:
    """Return the StackShape of a built model (meta or fake tensors): its blocks, in units of the least common
    multiple of `period` (what the recipe applies per place) and the period the blocks themselves repeat with."""
    _, _, stack = block_stack(model)
    return StackShape(len(stack), math.lcm(period, structural_period(model)))


def units_of(model: nn.Module, period: int) -> dict[int, int]:
    """Return {id(block): its unit's index} for the model's stack (the tracker's `units`)."""
    _, _, stack = block_stack(model)
    return {id(block): i // period for i, block in enumerate(stack)}


def truncate(model: nn.Module, blocks: int) -> nn.Module:
    """Keep the first `blocks` blocks of the model's stack (in place, and in its config's layer count); return it."""
    parent, name, stack = block_stack(model)
    parent._modules[name] = nn.ModuleList(list(stack)[:blocks])
    shallow: dict[int, Any] = {}  # the model's config (one object its submodules share), each once
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None:
            continue
        if id(config) not in shallow:
            frozen = dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen  # type: ignore[union-attr]
            if frozen and not isinstance(config, type):  # the reference model's GPTConfig: a copy with fewer layers
                fields = {f.name for f in dataclasses.fields(config)}
                shallow[id(config)] = dataclasses.replace(config, **{k: blocks for k in ("n_layer", "num_hidden_layers")
                                                                     if k in fields})
            else:
                _set_layers(config, blocks)
                shallow[id(config)] = config
        module.config = shallow[id(config)]
    return model


def _set_layers(config: Any, blocks: int) -> None:
    for key in ("num_hidden_layers", "n_layer"):
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, blocks)
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        config.layer_types = list(types)[:blocks]


def shallow_factory(spec: Any, blocks: int) -> Callable[[], nn.Module]:
    """Return a factory of the model `spec` (an `architectures.ModelSpec`) with only its first `blocks` blocks:
    built from its config with that many layers where it has one (nothing of the rest is built), else built whole
    and cut."""
    from colab_memopt.techniques import architectures
    from colab_memopt.techniques.models import MODEL_SIZES, build_model

    arch = architectures.ARCHITECTURES.get(spec.name)
    if arch is not None and spec.source == "colab_memopt.techniques.architectures":
        key = "n_layer" if "n_layer" in arch.config else "num_hidden_layers"
        return dataclasses.replace(arch, config={**arch.config, key: blocks}).build
    if spec.name in MODEL_SIZES and spec.source == "colab_memopt.techniques.architectures":
        return lambda: build_model(spec.name, device="cpu", n_layer=blocks)
    if spec.config is not None and spec.source != "factory":
        import torch
        import transformers

        config = copy.deepcopy(spec.config)
        _set_layers(config, blocks)
        return lambda: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    return lambda: truncate(spec.build(), blocks)


# -- the timeline, read and carried to the whole stack -------------------------------------------------------------

@dataclass
class _Segment:
    kind: str  # 'other' (outside the blocks) or 'sweep' (every unit once, in order)
    phase: int
    spans: list[tuple[int, int]]  # 'other': one span; 'sweep': one per unit, by unit index
    ascending: bool = True


def _segments(timeline: list[tuple[int, int, Any, tuple[int, ...]]], n_units: int) -> list[_Segment]:
    """Split a timeline into runs outside the blocks and sweeps through every unit (forward: 0 to n-1; backward:
    n-1 to 0); raise NotRepeating where the blocks run otherwise."""
    runs: list[list[int]] = []  # [phase, unit, start, end]
    for i, (phase, unit, _, _) in enumerate(timeline):
        if runs and runs[-1][0] == phase and runs[-1][1] == unit:
            runs[-1][3] = i + 1
        else:
            runs.append([phase, unit, i, i + 1])
    merged: list[list[int]] = []
    for i, run in enumerate(runs):  # what runs between two neighbouring units belongs to the one before
        after = runs[i + 1] if i + 1 < len(runs) else None
        if (run[1] < 0 and merged and merged[-1][1] >= 0 and after is not None and after[1] >= 0
                and merged[-1][0] == run[0] == after[0] and abs(after[1] - merged[-1][1]) == 1):
            merged[-1][3] = run[3]
            continue
        merged.append(list(run))
    out: list[_Segment] = []
    i = 0
    while i < len(merged):
        phase, unit, start, end = merged[i]
        if unit < 0:
            out.append(_Segment("other", phase, [(start, end)]))
            i += 1
            continue
        if unit not in (0, n_units - 1):
            raise NotRepeating(f"unit {unit} of {n_units} ran first in a pass through the blocks")
        ascending = unit == 0
        order = range(n_units) if ascending else range(n_units - 1, -1, -1)
        spans: list[tuple[int, int]] = [(0, 0)] * n_units
        for u in order:
            if i >= len(merged) or merged[i][0] != phase or merged[i][1] != u:
                got = "the end" if i >= len(merged) else f"unit {merged[i][1]}"
                raise NotRepeating(f"a pass through the blocks went to {got} where unit {u} of {n_units} was next")
            spans[u] = (merged[i][2], merged[i][3])
            i += 1
        out.append(_Segment("sweep", phase, spans, ascending))
    return out


def _funcs(timeline: list[Any], span: tuple[int, int]) -> list[Any]:
    return [timeline[i][2] for i in range(*span)]


def _lines(timeline: list[Any], span: tuple[int, int]) -> list[tuple[int, ...]]:
    return [timeline[i][3] for i in range(*span)]


def _check_twins(small: list[Any], large: list[Any], span_s: tuple[int, int], span_l: tuple[int, int], what: str) -> None:
    if _funcs(small, span_s) != _funcs(large, span_l):
        raise NotRepeating(f"{what} runs other operations at another depth")


def _carry(a: tuple[int, ...], b: tuple[int, ...], steps: int, ahead: int) -> tuple[int, ...]:
    """Return b + (b - a) / steps * ahead per category; raise NotRepeating where b - a is not `steps` equal parts."""
    out = []
    for x, y in zip(a, b):
        slope, rest = divmod(y - x, steps)
        if rest:
            raise NotRepeating("bytes that grow unevenly with the depth")
        out.append(y + slope * ahead)
    return tuple(out)


def _extrapolated(small: list[Any], large: list[Any],
                  shape: StackShape) -> Iterator[tuple[int, tuple[int, ...], tuple[Any, ...]]]:
    """Yield (phase index, live bytes per category, the moment's key) for every line of the whole stack's step that
    can be the largest of its phase or category, in the order the whole step runs them. The key names the moment
    without its position: (the part of the step, where in it, the operation just run; for a loop's lines, the loop's
    operations at both depths). Two traces whose keys are equal ran the same operations."""
    k1, k2 = STACK_UNITS
    n = shape.n_units
    steps, ahead = k2 - k1, n - k2
    seg_s, seg_l = _segments(small, k1), _segments(large, k2)
    if [(s.kind, s.phase, s.ascending) for s in seg_s] != [(s.kind, s.phase, s.ascending) for s in seg_l]:
        raise NotRepeating("the step runs other passes at another depth")
    for part, (s, l) in enumerate(zip(seg_s, seg_l)):
        if s.kind == "other":
            (span_s,), (span_l,) = s.spans, l.spans
            if _funcs(small, span_s) == _funcs(large, span_l):
                for func, a, b in zip(_funcs(small, span_s), _lines(small, span_s), _lines(large, span_l)):
                    yield s.phase, _carry(a, b, steps, ahead), (part, "", func)
            else:  # a loop over the parameters (a single-tensor optimizer, a norm per gradient): its peak line, and
                # the largest line of each category, each carried (what one unit adds there is one constant)
                lines_s, lines_l = _lines(small, span_s), _lines(large, span_l)
                if not lines_s or not lines_l:
                    raise NotRepeating("a part of the step runs at one depth only")
                loop = (tuple(_funcs(small, span_s)), tuple(_funcs(large, span_l)))  # its operations: part of its key
                for i, pick in enumerate((sum, *[lambda v, c=c: v[c] for c in range(len(CATEGORIES))])):
                    yield s.phase, _carry(max(lines_s, key=pick), max(lines_l, key=pick), steps, ahead), (part, "loop", i, loop)
            continue
        ends_s, ends_l = (s.spans[0], s.spans[-1]), (l.spans[0], l.spans[-1])
        _check_twins(small, large, ends_s[0], ends_l[0], "the first unit")
        _check_twins(small, large, ends_s[1], ends_l[1], "the last unit")
        middle_s = s.spans[1]
        mid = l.spans[1:k2 - 1]  # units 1, 2, 3 at depth 5
        for span in mid:
            _check_twins(small, large, middle_s, span, "a middle unit")
        m3 = _lines(small, middle_s)
        a, b, c = (_lines(large, span) for span in mid)
        low, high = [], []  # the middle units next to the first and the last, at the whole depth
        for x3, xa, xb, xc in zip(m3, a, b, c):
            per_unit = tuple(q - p for p, q in zip(xa, xb))
            if per_unit != tuple(q - p for p, q in zip(xb, xc)):
                raise NotRepeating("what one middle unit more leaves alive changes from unit to unit")
            at_second = _carry(x3, xa, steps, ahead)  # unit 1 at the whole depth
            low.append(at_second)
            high.append(tuple(v + d * (n - 3) for v, d in zip(at_second, per_unit)))  # unit n-2
        first_lines = [_carry(x, y, steps, ahead) for x, y in zip(_lines(small, ends_s[0]), _lines(large, ends_l[0]))]
        last_lines = [_carry(x, y, steps, ahead) for x, y in zip(_lines(small, ends_s[1]), _lines(large, ends_l[1]))]
        funcs = {"first": _funcs(small, ends_s[0]), "middle": _funcs(small, middle_s), "last": _funcs(small, ends_s[1])}
        units = [("first", first_lines), ("low", low), ("high", high), ("last", last_lines)]
        for where, unit_lines in units if s.ascending else units[::-1]:
            for func, line in zip(funcs.get(where, funcs["middle"]), unit_lines):
                yield s.phase, line, (part, where, func)


def extrapolate(small: Any, large: Any, shape: StackShape) -> Any:
    """Return the whole stack's `_Trace` from traces at `STACK_UNITS` (each with its `timeline`); raise
    NotRepeating where the two do not repeat as the fast path needs (see the module's docstring)."""
    from colab_memopt.planning.faketrace import _Trace

    if small.timeline is None or large.timeline is None:
        raise NotRepeating("a trace without its timeline")  # pragma: no cover - the stack tracer records them
    peak, peak_cats = 0, dict.fromkeys(CATEGORIES, 0)
    phase_peaks: dict[str, int] = {}
    phase_cats: dict[str, dict[str, int]] = {}
    category_peaks = dict.fromkeys(CATEGORIES, 0)
    lines, keys = [], []
    for phase_index, line, key in _extrapolated(small.timeline, large.timeline, shape):
        if min(line) < 0:
            raise NotRepeating("bytes that would be negative at the whole depth")
        lines.append((phase_index, line))
        keys.append((phase_index, *key))
        live = sum(line)
        phase = PHASES[phase_index]
        if live > phase_peaks.get(phase, 0):
            phase_peaks[phase] = live
            phase_cats[phase] = dict(zip(CATEGORIES, line))
        for name, nbytes in zip(CATEGORIES, line):
            if nbytes > category_peaks[name]:
                category_peaks[name] = nbytes
        if live > peak:
            peak, peak_cats = live, dict(zip(CATEGORIES, line))
    return _Trace(peak, peak_cats, {p: phase_peaks.get(p, 0) for p in PHASES}, phase_cats,
                  category_peaks["activations"], max(small.hidden_bytes, large.hidden_bytes), lines=lines, keys=keys)


# -- the tracer -------------------------------------------------------------------------------------------------------

def recipe_period(recipe: Any) -> int:
    """Return the period, in blocks, with which the recipe treats the blocks alike (every N-th block checkpointed,
    segments of N blocks, one offloaded copy per N blocks: N); raise NotRepeating for what the fast path does not
    count (offload across the stack, DeepSpeed)."""
    if recipe.uses_deepspeed or recipe.zero_stage:
        raise NotRepeating("DeepSpeed's step")
    if recipe.layer_offload_active:
        raise NotRepeating("layer offload (a window of blocks on the device)")
    if recipe.offload_keep_blocks:
        raise NotRepeating("offloaded checkpoints split (the last blocks kept on the device)")
    if recipe.phase_offload or recipe.optimizer_state_offload != "keep":
        raise NotRepeating("optimizer state offloaded")
    if recipe.checkpointing in ("every_n", "segments", "offload"):  # offload: two-level where N > 1
        return recipe.checkpoint_interval
    return 1


class StackTracer:
    """A `faketrace._Tracer` of a deep model that traces two shallow copies (`STACK_UNITS` units) and counts the
    rest of the stack (`extrapolate`); where the blocks turn out not to repeat, it traces the whole model, saying why.

    Same interface as `_Tracer`: `trace(batch)` (cached per batch), `model` (the larger copy: per-layer facts, such
    as the largest layer), `int8_as_on_cuda`, and `extrapolated_count(fn)` for a count of the model (quantization
    scales) carried to the whole stack."""

    def __init__(self, spec: Any, shape: StackShape, make_tracer: Callable[..., Any]) -> None:
        self.spec, self.shape, self._make = spec, shape, make_tracer
        small, large = (shape.depth(k) for k in STACK_UNITS)
        units = functools.partial(units_of, period=shape.period)
        self.small = make_tracer(shallow_factory(spec, small), units, key=shape.keys[0])
        self.large = make_tracer(shallow_factory(spec, large), units, key=shape.keys[1])
        self.model = self.large.model
        self.int8_as_on_cuda = self.large.int8_as_on_cuda
        self.full: Any = None  # the whole model's tracer, where the blocks do not repeat
        self._cache: dict[int, Any] = {}

    def trace(self, batch: int) -> Any:
        if batch in self._cache:
            return self._cache[batch]
        if self.full is None:
            try:
                self._cache[batch] = extrapolate(self.small.trace(batch), self.large.trace(batch), self.shape)
                return self._cache[batch]
            except NotRepeating as exc:
                say(f"the blocks do not repeat as counting needs ({exc}): tracing all {self.shape.n_blocks}")
                self.full = self._make(self.spec.build, None, key=None)
                self.model = self.full.model
                self._cache.clear()
        self._cache[batch] = self.full.trace(batch)
        return self._cache[batch]

    def extrapolated_count(self, count: Callable[[nn.Module], int]) -> int:
        """Return `count(model)` for the whole model: affine in the depth, from the two copies (or the whole one)."""
        if self.full is not None:
            return count(self.full.model)
        return self.shape.extrapolate(count(self.small.model), count(self.large.model))


def stack_shape(meta_model: nn.Module, recipe: Any = None, spec: Any = None, *, period: int = 1) -> StackShape:
    """Return the StackShape the fast path traces `meta_model` with under `recipe` (None: blocks treated alike but
    for `period`, the blocks a Trainer's `every_n_layers` checkpointing repeats with); raise NotRepeating where it does
    not apply or would trace as many blocks as the whole. With `spec` (the model's `architectures.ModelSpec`), also
    check that the shallow copies it builds are the whole model's first blocks (`check_shallow`)."""
    shape = shape_of(meta_model, math.lcm(period, recipe_period(recipe) if recipe is not None else 1))
    if not shape.worth_it:
        raise NotRepeating(f"{shape.n_blocks} blocks: the whole stack is as quick to trace")
    if spec is not None:
        shape = dataclasses.replace(shape, keys=check_shallow(spec, meta_model, shape))
    return shape


def check_shallow(spec: Any, meta_model: nn.Module, shape: StackShape) -> tuple[Any, ...]:
    """Raise NotRepeating unless each shallow copy of `spec` (built on the meta device) has, block for block, the
    whole model's first blocks: a config whose layers depend on their count (a window from some layer on, the
    first layers dense in a mixture of experts) would otherwise plan other blocks than the model has. Return each
    copy's `model_key`."""
    from colab_memopt.planning.faketrace import shape_model

    whole = _signatures(meta_model)
    keys = []
    for units in STACK_UNITS:
        blocks = shape.depth(units)
        shallow = shape_model(shallow_factory(spec, blocks))
        if _signatures(shallow) != whole[:blocks]:
            raise NotRepeating(f"a copy of {blocks} blocks is not the model's first {blocks} blocks")
        keys.append(model_key(shallow))
    return tuple(keys)


def model_key(model: nn.Module) -> tuple[Any, ...] | None:
    """Return what a built model (meta) is, for a trace to be reused: its class, its config's every value (the
    attention implementation too), its parameters' names, shapes, dtypes and trainability, and its blocks'
    `_signature`s; None where it has no config to say it (a factory's plain module). Two shallow copies of one
    architecture at two depths (capacity's search) have the same key: they are the same model."""
    import json

    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        values = config.to_dict()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        values = dataclasses.asdict(config)
    else:
        return None
    return (type(model).__module__, type(model).__qualname__, json.dumps(values, sort_keys=True, default=str),
            getattr(config, "_attn_implementation", None),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()), tuple(_signatures(model)))
