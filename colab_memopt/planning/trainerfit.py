"""Fit a Trainer run to a target: `fit_trainer` finds the cheapest change of the Trainer's own settings that fits.

The changes, cheapest to you first: the precision the target runs natively, LoRA's frozen base in 16 or 4 bits,
16-bit weights or an 8-bit optimizer for full fine-tuning, gradient checkpointing, a smaller per-device batch with
accumulation keeping the effective batch, a shorter `max_length`. Each change set is planned with
`plan_trainer`; a set that saves no more than one that did not fit is not planned. `TrainerFit` is the answer (the
lines to set, the plans before and after) and `TrainerFit.apply(args)` the settings to train with
(`FittedSettings`).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

import torch

from colab_memopt.planning.prediction import Plan
from colab_memopt.planning.targets import DEFAULT_HEADROOM, Target
from colab_memopt.planning.hfconfig import checkpointing_names, trainer_recipe
from colab_memopt.core.console import quiet_unless_verbose
from colab_memopt.core.isolation import isolated
from colab_memopt.core.progress import say, shows_progress
from colab_memopt.planning.trainer import (
    FP16_TRAP,
    _bnb_config,
    _checkpointing_on,
    _peft_config,
    _resolve,
    _target,
    _whole,
    plan_trainer,
)
from colab_memopt.planning.trainertrace import _changed_args, _dtype_value, _model_dtype, _unwrap


FP16_TRAP_NOTE = "fp16=True needs float32 trainable weights (TRL makes 4-bit LoRA bfloat16): add MemoryGuardCallback"


def _fp16_trap_notes(*plans: Plan | None) -> list[str]:
    """Return fit_trainer's note for trainable weights fp16 cannot train, where a plan found them."""
    return [FP16_TRAP_NOTE] if any(p is not None and any(w.startswith(FP16_TRAP) for w in p.warnings) for p in plans) else []


_EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit", "adafactor")
_FULL_ADAM = ("adamw_torch", "adamw_torch_fused", "adamw_apex_fused", "adamw_anyprecision", "paged_adamw",
              "paged_adamw_32bit")


# The settings a fit planned: applying its changes to settings that differ in one of them gives a run it did not plan
FITTED_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "fp16", "bf16", "optim",
                 "gradient_checkpointing")


def fitted_values(args: Any) -> dict[str, Any]:
    """Return the values of `FITTED_FIELDS` in `args` (optim as its name; a field `args` lacks as None)."""
    values = {}
    for name in FITTED_FIELDS:
        value = getattr(args, name, None)
        values[name] = getattr(value, "value", value)  # transformers' OptimizerNames enum: its string
    return values


@dataclass
class FittedSettings:
    """The settings to train with, from `TrainerFit.apply(args)`: pass each where your script loads and trains.

    Example (a model id given to TRL's SFTTrainer, which loads it with `args.model_init_kwargs`):
        >>> fitted = fit.apply(args)
        >>> trainer = SFTTrainer(model=model_id, args=fitted.args, peft_config=fitted.lora,
        ...                      quantization_config=fitted.bnb, train_dataset=dataset)
    or a model you load yourself:
        >>> model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=fitted.bnb,
        ...                                              **fitted.model_init_kwargs)
        >>> trainer = SFTTrainer(model=model, args=fitted.args, peft_config=fitted.lora, train_dataset=dataset)
    """

    args: Any  # a new TrainingArguments / SFTConfig: yours with the fit's changes, built (and checked) by its class
    lora: Any  # the LoraConfig (peft config) to train with, or None (full fine-tuning)
    bnb: Any  # the BitsAndBytesConfig to load the model with, or None (not quantized)
    dtype: torch.dtype | None  # the dtype to load the model with; None: none chosen (as you load it)
    model_init_kwargs: dict[str, Any]  # `from_pretrained` keywords: an SFTConfig's model_init_kwargs, and the dtype


@dataclass
class TrainerFit:
    """What to change in a Trainer's settings so the run fits a target, with the plans before and after.

    `apply(args)` returns the fitted settings; `lora`, `bnb` and `dtype` are what to load and train the model with.
    """

    changes: dict[str, Any]  # TrainingArguments / SFTConfig fields to set
    before: Plan
    after: Plan | None  # None: nothing tried fits
    slowdown: float  # expected step time after / before, from the target's technique-cost table
    tried: list[tuple[dict[str, Any], int, float]] = field(default_factory=list)  # (changes, peak bytes, slowdown)
    notes: list[str] = field(default_factory=list)
    lora: Any = None  # the LoraConfig to train with (yours), or None
    bnb: Any = None  # the BitsAndBytesConfig to load the model with (yours, or the fit's 4-bit one), or None
    dtype: torch.dtype | None = None  # the dtype to load the model with, where the fit or you chose one
    skipped: int = 0  # change sets not planned: they save no more than one that did not fit
    predicted: int = 0  # change sets not planned: two plans that differ only in the batch predict they do not fit
    fitted_on: dict[str, Any] = field(default_factory=dict)  # FITTED_FIELDS of the settings fitted (apply checks them)

    @property
    def fits(self) -> bool:
        return self.after is not None and self.after.fits

    @property
    def model_init_kwargs(self) -> dict[str, Any] | None:
        """SFTConfig's `model_init_kwargs` the fit sets (the dtype SFTTrainer loads a model id in), or None."""
        return self.changes.get("model_init_kwargs")

    def apply(self, args: Any) -> FittedSettings:
        """Return the fitted settings: a new `args` (TrainingArguments / SFTConfig) with the changes, built through
        its class so that it is checked as yours was, and the LoraConfig, BitsAndBytesConfig and dtype to use.
        `args` is not changed. Raise ValueError where nothing tried fits, or where `args` differs from the settings
        fitted in a field the fit planned (batch, accumulation, max_length, precision, optim, checkpointing): the
        changes would not give the run that was planned; fit those settings instead.

        Example:
            >>> fit = cm.fit_trainer(args, model=model_id, lora=lora, target="t4")
            >>> fitted = fit.apply(args)
            >>> trainer = SFTTrainer(model=model_id, args=fitted.args, peft_config=fitted.lora,
            ...                      quantization_config=fitted.bnb, train_dataset=dataset)
        """
        import dataclasses

        if not dataclasses.is_dataclass(args) or isinstance(args, type) or not hasattr(
                args, "per_device_train_batch_size"):
            raise TypeError("apply takes your TrainingArguments / SFTConfig (the settings you fitted), "
                            f"got {type(args).__name__ if args is not None else 'None'}")
        given = fitted_values(args)
        differ = [f"{k}={given[k]!r} where the fit planned {v!r}" for k, v in self.fitted_on.items()
                  if k in given and given[k] != v]
        if differ:
            raise ValueError(f"these settings are not the ones fitted: {'; '.join(differ)}. Apply the fit to the "
                             "settings you fitted, or fit these: cm.fit_trainer(args, ...)")
        if not self.fits:
            from colab_memopt.core.measure import format_bytes

            before = self.before
            raise ValueError(f"nothing tried fits {before.target.name} (needs {format_bytes(before.device_need_bytes)} "
                             f"of {format_bytes(before.device_limit_bytes)}): {'; '.join(self.notes)}")
        fitted = _changed_args(args, self.changes)
        kwargs = dict(getattr(fitted, "model_init_kwargs", None) or {})
        dtype = self.dtype if self.dtype is not None else _dtype_value(kwargs.get("dtype", kwargs.get("torch_dtype")),
                                                                        "model_init_kwargs['dtype']")
        if isinstance(dtype, torch.dtype) and "dtype" not in kwargs and "torch_dtype" not in kwargs:
            kwargs["dtype"] = dtype
        return FittedSettings(fitted, self.lora, self.bnb, dtype if isinstance(dtype, torch.dtype) else None, kwargs)

    def _load_lines(self) -> list[str]:
        """Return the lines that say how to load the model, where the fit changed it (dtype, 4-bit)."""
        load = self.tried[-1][0] if self.fits and self.tried else {}
        lines = []
        if "bnb" in load:
            lines += textwrap.wrap(f"# load the model 4-bit: quantization_config={_bnb_text(self.bnb)}", 96,
                                   subsequent_indent="#     ")
        if "dtype" in load and "model_init_kwargs" not in self.changes:  # SFTTrainer loads a model id with those
            lines.append(f"# load the model with dtype={_dtype_text(self.dtype)}")
        return lines

    def snippet(self, name: str = "SFTConfig") -> str:
        """Return the lines to paste into your `SFTConfig(...)` / `TrainingArguments(...)` call (and, where the fit
        loads the model otherwise, how to load it)."""
        if not self.changes and not self._load_lines():
            return f"# {name}(...) fits as it is: nothing to change"
        lines = [f"# in your {name}(...) / TrainingArguments(...) call, set:"] if self.changes else []
        lines += [f"    {k}={v!r}," for k, v in self.changes.items()] + self._load_lines()
        return "\n".join(lines)

    def __str__(self) -> str:
        """Return the answer first (fits or not, the need against the limit), the lines to set, the step time with
        its source, the notes; lines of at most 100 characters (`before.explain()` / `after.explain()`: the plans)."""
        from colab_memopt.core.measure import format_bytes
        from colab_memopt.core.wording import wrap

        before = self.before
        limit = format_bytes(before.device_limit_bytes)
        tgt = before.target.name
        if self.after is None:
            lines = [f"no change tried fits {tgt} ({len(self.tried)} tried): your settings need "
                     f"{format_bytes(before.device_need_bytes)} of {limit} usable"]  # the notes: the least need reached
        elif not self.changes:
            lines = [f"fits {tgt} as it is: needs {format_bytes(self.after.device_need_bytes)} of {limit} usable"]
        else:
            verdict = "fits" if self.after.fits else "does not fit"
            lines = [f"{verdict} {tgt} with these changes: needs {format_bytes(self.after.device_need_bytes)} of {limit} "
                     f"usable (now {format_bytes(before.device_need_bytes)})", *self.snippet().splitlines(),
                     self._step_time()]
        for n in self.notes:
            lines += wrap(n, first="note: ", rest="  ")
        return "\n".join(lines)

    def _step_time(self) -> str:
        """Return 'step time xN of your settings' (prior|measured on ...)' from the target's cost table."""
        from colab_memopt.planning import costs

        table = costs.costs_for_target(self.before.target)
        kinds = {table.kind(t) for t in table.ratios}
        label = (f"prior: published figures, not measured on a {table.device_class}" if kinds <= {"prior"}
                 else f"measured on {table.device}" if kinds == {"measured"} else f"from the {table.table}")
        return f"step time x{self.slowdown:.2f} of your settings' ({label})"

    def explain(self) -> str:
        """Return every change set tried with its need and step time, then the plans before and after in full."""
        from colab_memopt.core.measure import format_bytes

        lines = [f"tried ({len(self.tried)}), cheapest expected step time first:"]
        lines += [f"  {format_bytes(need):>10s}  step time x{cost:.2f}  "
                  + (", ".join(_change_text(k, v) for k, v in changes.items()) or "no change") for changes, need, cost in self.tried]
        lines += ["plan of your settings:", *[f"  {line}" for line in self.before.explain().splitlines()]]
        if self.after is not None and self.after is not self.before:
            lines += ["plan with the changes:", *[f"  {line}" for line in self.after.explain().splitlines()]]
        return "\n".join(lines)


def _dtype_text(dtype: Any) -> str:
    return f"torch.{str(dtype).removeprefix('torch.')}" if isinstance(dtype, torch.dtype) else repr(dtype)


def _change_text(key: str, value: Any) -> str:
    """Return one change as the user writes it: `bnb=BitsAndBytesConfig(...)`, `dtype=torch.float16`, `k=v`."""
    if key == "bnb":
        return f"bnb={_bnb_text(value)}"
    return f"{key}={_dtype_text(value) if isinstance(value, torch.dtype) else repr(value)}"


def _bnb_text(bnb: Any) -> str:
    """Return the BitsAndBytesConfig(...) call that builds `bnb` (its load and 4-bit fields)."""
    if bnb is None:
        return "None"
    fields = [("load_in_4bit", bnb.load_in_4bit), ("load_in_8bit", bnb.load_in_8bit)]
    if bnb.load_in_4bit:
        fields += [("bnb_4bit_quant_type", bnb.bnb_4bit_quant_type), ("bnb_4bit_compute_dtype", bnb.bnb_4bit_compute_dtype)]
    text = ", ".join(f"{k}={_dtype_text(v) if isinstance(v, torch.dtype) else repr(v)}" for k, v in fields if v)
    return f"BitsAndBytesConfig({text})"


def _slowdown(args: Any, tgt: Target, lora: Any, bnb: Any) -> float:
    """Return the expected step time of these settings against plain fp32 training on the target (costs.py)."""
    from colab_memopt.planning import costs

    recipe, _ = trainer_recipe(args, lora, bnb)
    accumulation = recipe.accumulation_steps
    if accumulation > 4:  # the table has 2 and 4: a longer accumulation counts as 4 (a lower bound on its cost)
        recipe = recipe.with_(accumulation_steps=4)
    elif accumulation == 3:
        recipe = recipe.with_(accumulation_steps=2)
    return costs.expected_slowdown(recipe, costs.costs_for_target(tgt)).ratio


@dataclass(frozen=True)
class _Level:
    """One value of one setting `fit_trainer` may change."""

    args: tuple[tuple[str, Any], ...] = ()  # TrainingArguments / SFTConfig fields it sets
    load: tuple[tuple[str, Any], ...] = ()  # how the model is loaded: ('dtype', torch dtype), ('bnb', BitsAndBytesConfig)
    cost: float = 0.0  # to the user: 0 free, 1 slower steps, 2 also a small quality loss, 3 per halving of max_length


# the cost of each change to the user, lowest first (fit_trainer tries the cheapest sets first)
_OPTIM_COST = {"adamw_8bit": 1.0, "paged_adamw_8bit": 1.2, "adafactor": 2.0}


def _native_half(tgt: Target) -> torch.dtype | None:
    """Return the 16-bit dtype the target computes in natively: fp16 before sm_80 (a T4), bf16 after; None for a CPU."""
    if not tgt.cuda:
        return None
    old = tgt.compute_capability is not None and tuple(tgt.compute_capability) < (8, 0)
    return torch.float16 if old else torch.bfloat16


def _dimensions(args: Any, tgt: Target, trainer: Any = None, *, lora: Any = None, bnb: Any = None, loaded: Any = None,
                sft_model_id: bool = False, seq_given: bool = False) -> list[tuple[list[_Level], bool]]:
    """Return what fit_trainer may change, one list of levels per setting, each starting with 'as it is' and ordered by
    the memory it saves where the flag says so (a later level never needs more): precision, the base's dtype and a
    4-bit base (LoRA), checkpointing, the optimizer and 16-bit weights (full fine-tuning), the per-device batch with
    accumulation keeping the effective batch, and `max_length`. A built `trainer` holds its model: its dtype,
    quantization and (where its model has it on) checkpointing stay, and so does `optim` with its own optimizer."""
    half = _native_half(tgt)
    dims: list[tuple[list[_Level], bool]] = []
    if half == torch.float16:
        if args.bf16:  # no native bf16 on a T4: fp16 is a must, not an option (it needs no less than bf16 autocast)
            dims.append(([_Level((("bf16", False), ("fp16", True)))], True))
        elif not args.fp16:
            dims.append(([_Level(), _Level((("fp16", True),))], False))
    elif half is not None and not (args.fp16 or args.bf16):
        dims.append(([_Level(), _Level((("bf16", True),))], False))

    def load_dtype(dtype: torch.dtype) -> _Level:
        if sft_model_id:  # SFTTrainer loads a model id with SFTConfig's model_init_kwargs
            kwargs = {**(args.model_init_kwargs or {}), "dtype": str(dtype).removeprefix("torch.")}
            kwargs.pop("torch_dtype", None)
            return _Level((("model_init_kwargs", kwargs),), (("dtype", dtype),))
        return _Level((), (("dtype", dtype),))

    if trainer is None and half is not None and lora is not None:  # LoRA's frozen base: 16 bits, then 4 bits
        base = [_Level()]
        sixteen = load_dtype(half) if loaded == torch.float32 else _Level()  # LoRA trains fp32 adapters on it
        if sixteen.load:
            base.append(sixteen)
        if bnb is None:  # QLoRA: the linear layers in nf4, the rest (embeddings, norms, head) in 16 bits
            from transformers import BitsAndBytesConfig

            four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=half)
            base.append(_Level(sixteen.args, sixteen.load + (("bnb", four_bit),), 2.0))
        if len(base) > 1:
            dims.append((base, True))
    elif trainer is None and half == torch.bfloat16 and loaded == torch.float32:  # full fine-tuning: 16-bit weights,
        level = load_dtype(half)  # bf16 only (a T4's fp16 weights cannot be trained under the GradScaler)
        dims.append(([_Level(), _Level(level.args + (("bf16", True), ("fp16", False)), level.load, 2.0)], True))
    if not args.gradient_checkpointing and not (trainer is not None and _checkpointing_on(trainer.model)):
        on, kwargs_name = checkpointing_names()  # the installed transformers' names
        dims.append(([_Level(), _Level(((on, True), (kwargs_name, {"use_reentrant": False})), cost=1.0)], True))
    optim = str(getattr(args.optim, "value", args.optim))
    own = getattr(trainer, "optimizer", None) is not None  # optimizers=(opt, None): the Trainer ignores optim
    if optim in _FULL_ADAM and not own and lora is None:  # LoRA's optimizer state is small: swaps save little
        dims.append(([_Level()] + [_Level((("optim", o),), cost=_OPTIM_COST[o]) for o in _EIGHT_BIT], False))
    micro, accum = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    effective = micro * accum
    batches = [_Level()] + [_Level((("per_device_train_batch_size", b), ("gradient_accumulation_steps", effective // b)),
                                   cost=0.5 * math.log2(micro / b)) for b in range(micro - 1, 0, -1) if effective % b == 0]
    if len(batches) > 1:
        dims.append((batches, True))
    length = getattr(args, "max_length", None)
    if trainer is None and not seq_given and isinstance(length, int):  # shorter rows: the run trains on less text
        shorter = [length // 2**k for k in (1, 2) if length // 2**k >= 128]
        if shorter:
            dims.append(([_Level()] + [_Level((("max_length", n),), cost=3.0 * k) for k, n in enumerate(shorter, 1)], True))
    return dims


def _candidates(args: Any, tgt: Target, trainer: Any = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Return the change sets to try (TrainingArguments / SFTConfig fields), cheapest first; see `_dimensions`."""
    return [{k: v for level in levels for k, v in level.args} for _, levels in _ranked(_dimensions(args, tgt, trainer,
                                                                                                   **kwargs))]


def _ranked(dims: list[tuple[list[_Level], bool]]) -> list[tuple[tuple[int, ...], list[_Level]]]:
    """Return every combination of one level per setting, as (level indices, levels), cheapest to the user first
    (the sum of the levels' costs), then the most changes among sets of the same cost: the set that saves the most for
    that cost is planned first, and where it does not fit, the sets it includes are not planned."""
    import itertools

    combos = itertools.product(*[range(len(levels)) for levels, _ in dims])
    picked = [(idx, [dims[d][0][i] for d, i in enumerate(idx)]) for idx in combos]
    return sorted(picked, key=lambda p: (round(sum(lv.cost for lv in p[1]), 3),
                                         -sum(bool(lv.args or lv.load) for lv in p[1])))


def _saves_no_more(idx: tuple[int, ...], than: tuple[int, ...], dims: list[tuple[list[_Level], bool]]) -> bool:
    """Return whether the change set `idx` saves no more memory than `than` (each of its levels saves at most the
    other's on an ordered setting, and is the same on the others)."""
    return all(a <= b if ordered else a == b for a, b, (_, ordered) in zip(idx, than, dims))


def _batch_lower_bound(need: int, fixed: int, batch: int, smaller: int) -> float:
    """Return the least a step at per-device batch `smaller` can need, from a plan at `batch` (`need` bytes, of which
    `fixed` are parameters, buffers and optimizer state): the fixed bytes, and the rest scaled down with the batch."""
    return fixed + (need - fixed) * smaller / batch


@shows_progress("fit_trainer")
@quiet_unless_verbose
@isolated
def fit_trainer(
    trainer: Any,
    *,
    model: Any = None,
    lora: Any = None,
    bnb: Any = None,
    target: str | Target | dict[str, Any] = "t4",
    seq_len: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    max_plans: int = 24,
    dtype: Any = None,
    verbose: bool = False,
    prepare_model_for_kbit_training: bool | dict[str, Any] = False,
) -> TrainerFit:
    """Return the cheapest change to a Trainer's own settings that makes the run fit the target.

    Searches, cheapest to you first, and stops at the first change set that fits:
    - the precision the target runs natively (fp16 on a T4, where bf16 is a must to change);
    - LoRA / QLoRA: the frozen base loaded in 16 bits (`model_init_kwargs={"dtype": "float16"}` for an SFTConfig
      with a model id, else `dtype=`), a 4-bit base (`BitsAndBytesConfig(load_in_4bit=True, nf4)`);
    - full fine-tuning: an 8-bit or factored optimizer (`optim`), and 16-bit (bf16) weights where the GPU has bf16;
    - gradient checkpointing (`use_reentrant=False`);
    - a smaller `per_device_train_batch_size` with `gradient_accumulation_steps` keeping the effective batch;
    - a shorter `max_length` (half, then a quarter: the run then trains on less text, so it comes last).
    A change set that saves no more memory than one that did not fit is not planned, nor one whose need two plans
    differing only in `per_device_train_batch_size` predict (linear in it) over the limit, nor a smaller batch whose
    need the plan at your batch bounds from below over it (the parameters and optimizer state stay, the rest scales at
    most with the batch). At most `max_plans` plans
    after the first; a built Trainer keeps its model's dtype and quantization. On failure the notes name the
    smallest need reached and what to do next. Arguments as `plan_trainer` (`prepare_model_for_kbit_training`: your
    call of peft's function, planned in every change set; `verbose=True` shows the libraries' notes while planning,
    hidden by default).

    Planning on a machine without a GPU: an `SFTConfig` with `bf16=True` or `fp16=True` (SFTConfig's default is bf16)
    raises inside TRL ("Your setup doesn't support bf16/gpu"); add `use_cpu=True` there (it does not change the plan)
    and drop it on Colab (`fit.apply(args)` keeps what your arguments hold).

    Example:
        >>> args = SFTConfig(per_device_train_batch_size=4, max_length=1024)
        >>> fit = cm.fit_trainer(args, model="meta-llama/Llama-3.2-3B", lora=LoraConfig(target_modules="all-linear"),
        ...                      target="t4")
        >>> print(fit)   # here: fp16=True, model_init_kwargs={'dtype': 'float16'} (the frozen base in fp16)
        >>> fitted = fit.apply(args)   # .args, .lora, .bnb, .dtype, .model_init_kwargs: see TrainerFit.apply
        >>> trainer = SFTTrainer(model="meta-llama/Llama-3.2-3B", args=fitted.args, peft_config=fitted.lora,
        ...                      quantization_config=fitted.bnb, train_dataset=dataset)
    """
    from colab_memopt.core.measure import format_bytes

    tgt = _target(target)
    max_plans = _whole("max_plans", max_plans)
    if isinstance(lora, dict):
        from colab_memopt.planning.hfconfig import read_lora

        lora = read_lora(lora)
    kwargs = dict(model=model, lora=lora, target=tgt, seq_len=seq_len, headroom=headroom,
                  prepare_model_for_kbit_training=prepare_model_for_kbit_training)
    load0 = {k: v for k, v in dict(bnb=bnb, dtype=dtype).items() if v is not None}
    say("plan 1: your settings")
    before = plan_trainer(trainer, **kwargs, **load0)
    real, args = _unwrap(trainer)
    fitted_on = fitted_values(args)
    if real_lora := (lora if lora is not None else _peft_config(getattr(trainer, "model", None))):
        lora = real_lora
    bnb = _bnb_config(bnb)
    kept = dict(lora=lora, bnb=bnb, dtype=_dtype_value(dtype, "dtype") if dtype is not None else None)
    base_cost = _slowdown(args, tgt, lora, bnb)
    if before.fits and not (args.bf16 and _native_half(tgt) == torch.float16):
        return TrainerFit({}, before, before, 1.0, notes=_fp16_trap_notes(before), fitted_on=fitted_on, **kept)
    loaded = None if real is not None else _model_dtype(args, _resolve(model), model, dtype)
    dims = _dimensions(args, tgt, real, lora=lora, bnb=bnb, loaded=loaded,
                       sft_model_id=type(args).__name__ == "SFTConfig" and isinstance(model, str),
                       seq_given=seq_len is not None)
    ranked = [(idx, levels) for idx, levels in _ranked(dims) if any(lv.args or lv.load for lv in levels)]
    # the settings as they are, where they do not fit (fp16 for a T4's bf16, a must, needs no less than bf16)
    failed: list[tuple[int, ...]] = [] if before.fits else [tuple(0 for _ in dims)]
    tried: list[tuple[dict[str, Any], int, float]] = []
    skipped = predicted = 0
    # the need is linear in the per-device batch at a fixed accumulation regime: two plans of smaller batches that
    # differ only in it predict the others; one predicted 5% over the limit is not planned (a fit is always planned)
    bdim = next((d for d, (levels, _) in enumerate(dims) for lv in levels
                 if dict(lv.args).get("per_device_train_batch_size")), None)
    points: dict[tuple[int, ...], dict[int, int]] = {}
    # A plan at the settings' own batch bounds every smaller one below: the parameters, buffers and optimizer state
    # stay; everything else at its peak at most scales with the batch (activations, logits, temporaries: in
    # proportion; gradients and the batch's token ids, counted as scaling too, not at all). Where even that bound is
    # 5% over the limit, the smaller batches with the same other settings are not planned (an 8B draft at 8 x 2,048
    # without checkpointing: 324 GiB, over a T4 at any batch).
    full_batch: dict[tuple[int, ...], tuple[int, int, int]] = {}

    def at_full_batch(idx: tuple[int, ...], p: Plan) -> None:
        if bdim is not None and idx[bdim] == 0:
            fixed = sum(p.by_category.get(c, 0) for c in ("parameters", "buffers", "optimizer_state"))
            full_batch[idx[:bdim] + idx[bdim + 1:]] = (int(args.per_device_train_batch_size), p.device_need_bytes, fixed)

    at_full_batch(tuple(0 for _ in dims), before)

    def split(idx: tuple[int, ...], levels: list[_Level]) -> tuple[tuple[int, ...], int]:
        micro = int(dict(levels[bdim].args).get("per_device_train_batch_size", args.per_device_train_batch_size))
        return idx[:bdim] + idx[bdim + 1:], micro

    for idx, levels in ranked:
        if any(_saves_no_more(idx, f, dims) for f in failed):
            skipped += 1
            continue
        if bdim is not None and idx[bdim] > 0:
            rest, micro = split(idx, levels)
            known = sorted(points.get(rest, {}).items())
            if len(known) >= 2:
                (b1, n1), (b2, n2) = known[0], known[-1]
                if n1 + (n2 - n1) * (micro - b1) / (b2 - b1) > 1.05 * before.device_limit_bytes:
                    predicted += 1
                    failed.append(idx)
                    continue
            if rest in full_batch:
                b0, n0, fixed = full_batch[rest]
                if micro < b0 and _batch_lower_bound(n0, fixed, b0, micro) > 1.05 * before.device_limit_bytes:
                    predicted += 1
                    failed.append(idx)
                    continue
        if len(tried) >= max_plans:
            break
        changes = {k: v for lv in levels for k, v in lv.args}
        load = {**load0, **{k: v for lv in levels for k, v in lv.load}}
        say(f"plan {len(tried) + 2}: " + ", ".join(_change_text(k, v) for k, v in {**changes, **dict(
            (k, v) for lv in levels for k, v in lv.load)}.items() if not (k == "dtype" and "model_init_kwargs" in changes)))
        after = plan_trainer(trainer, **kwargs, **load, **changes)
        use = dict(lora=lora, bnb=_bnb_config(load.get("bnb")), dtype=load.get("dtype", kept["dtype"]))
        cost = _slowdown(_changed_args(args, changes), tgt, lora, use["bnb"]) / base_cost
        tried.append(({**changes, **{k: v for lv in levels for k, v in lv.load}}, after.device_need_bytes, cost))
        if bdim is not None and idx[bdim] > 0:  # a smaller batch with accumulation (accumulating holds the gradients)
            rest, micro = split(idx, levels)
            points.setdefault(rest, {})[micro] = after.device_need_bytes
        at_full_batch(idx, after)
        if after.fits:
            notes = [] if "gradient_accumulation_steps" not in changes else [
                f"effective batch kept: {changes['per_device_train_batch_size']} x {changes['gradient_accumulation_steps']} "
                f"= {before.batch}"]
            return TrainerFit(changes, before, after, cost, tried, notes + _fp16_trap_notes(after), skipped=skipped,
                              predicted=predicted, fitted_on=fitted_on, **use)
        failed.append(idx)
    left = len(ranked) - len(tried) - skipped - predicted
    notes = [f"stopped after max_plans={max_plans} plans; {left} more change sets not tried (raise max_plans)"
             ] if left > 0 else []
    best = min(tried, key=lambda t: t[1]) if tried else ({}, before.device_need_bytes, 1.0)
    shown = {k: v for k, v in best[0].items() if not (k == "bf16" and best[0].get("fp16"))
             and not (k == "dtype" and "model_init_kwargs" in best[0])}
    text = ", ".join(f"{k}={_dtype_text(v) if isinstance(v, torch.dtype) else _bnb_text(v) if k == 'bnb' else repr(v)}"
                     for k, v in shown.items()) or "your settings"
    notes.append("\n      ".join(textwrap.wrap(f"smallest need reached: {format_bytes(best[1])} of "
                                               f"{format_bytes(before.device_limit_bytes)} usable, with {text}", 92)))
    if lora is None:
        notes.append("next: train LoRA adapters (peft_config=LoraConfig(...)), or QLoRA with a 4-bit base, "
                     "or a smaller model")
    else:
        notes.append("next: a smaller model, a shorter max_length, fewer LoRA target_modules, or a GPU with more memory")
    return TrainerFit({}, before, None, 1.0, tried, notes + _fp16_trap_notes(before), skipped=skipped,
                      predicted=predicted, fitted_on=fitted_on, **kept)
