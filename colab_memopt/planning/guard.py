"""Guard a Hugging Face Trainer run: fix the fp16 traps, plan it before the first step, stop it if it will not fit.

`MemoryGuardCallback(target=...)` is a transformers `TrainerCallback` subclass. This module imports
transformers, so the package exposes it as a lazy attribute (`colab_memopt.MemoryGuardCallback` imports it on
first use). At every `on_train_begin` it starts a fresh run: it casts trainable weights that fp16's GradScaler
cannot unscale (bf16 from TRL's QLoRA cast, or fp16) to fp32, plans the run with `trainer.plan_trainer` on the
real model, raises `MemoryGuardError` with `fit_trainer`'s changes before the first step of a run that will not
fit, records the step peaks, and reports plan against measurement at the end. Its own work (the cast, the plans)
runs in `core.console.quiet()`: the libraries' notes stay off the console unless the training runs inside
`cm.quiet(verbose=True)`.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from colab_memopt.core.console import quiet
from colab_memopt.core.measure import LiveMemory, MemoryReport, format_bytes
from colab_memopt.planning.prediction import Plan
from colab_memopt.planning.targets import DEFAULT_HEADROOM, Target
from colab_memopt.techniques.precision import HALF_DTYPES, describe_half_trainable, half_trainable, upcast_trainable  # noqa: F401 - cm.guard.upcast_trainable
from colab_memopt.core.tracker import LiveBytesMode
from colab_memopt.planning.trainer import CPU_TARGET_NAME, _target, plan_trainer
from colab_memopt.planning.trainerfit import fit_trainer

with quiet():  # transformers' import notes (torchao's, DeepSpeed's): nothing about this run
    from transformers import TrainerCallback



class MemoryGuardError(RuntimeError):
    """Raised by `MemoryGuardCallback` before the first step of a run that will not fit or cannot train."""


def _running_trainer() -> Any:
    """Return the Trainer whose `train()` is calling us (callbacks are not handed the Trainer itself)."""
    import inspect

    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from transformers import Trainer

    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    raise RuntimeError("MemoryGuardCallback found no Trainer calling it: add it to a Trainer (callbacks=[...])")


FP16_FIX = ("cast them to float32 after SFTTrainer(...) and before train():\n"
            "    for p in trainer.model.parameters():\n"
            "        if p.requires_grad: p.data = p.data.float()")


REBUILD = ("build a new Trainer with fit.apply(args).args, or with the changes set in your SFTConfig(...) / "
           "TrainingArguments(...)")


def _built_batch(trainer: Any, args: Any) -> dict[str, Any]:
    """Return the changes that make `args` what the Trainer runs: {} where they agree, the per-device batch it
    builds where `auto_find_batch_size` lowered it; raise MemoryGuardError where `trainer.args` was changed after
    the Trainer was built (it fixes its batch and its mixed precision then: the plan would not be of its run)."""
    import os

    changed = []
    built = getattr(trainer, "_train_batch_size", None)  # the batch its dataloader is built with, set at __init__
    asked = getattr(args, "train_batch_size", None)  # per_device_train_batch_size x the GPUs
    if isinstance(built, int) and isinstance(asked, int) and built != asked:
        gpus = max(1, int(getattr(args, "n_gpu", 1) or 1))
        if getattr(args, "auto_find_batch_size", False) and built < asked:  # halved after an out-of-memory error
            return {"per_device_train_batch_size": max(1, built // gpus)}
        changed.append(f"per_device_train_batch_size is {args.per_device_train_batch_size} there, but the Trainer "
                       f"builds micro-batches of {built // gpus}")
    mixed = getattr(args, "mixed_precision", None)  # set from fp16 / bf16 when the arguments are built
    flags = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    if isinstance(mixed, str) and (flags or mixed) in ("fp16", "bf16") and mixed != (
            flags or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")):
        changed.append(f"fp16={bool(args.fp16)}, bf16={bool(args.bf16)} there, but the Trainer runs "
                       f"{'no mixed precision' if mixed == 'no' else mixed}")
    if changed:
        from colab_memopt.core.wording import wrap

        lines = wrap("trainer.args changed after the Trainer was built: " + "; ".join(changed) + ".")
        lines += wrap(f"Stopped before the first step (a Trainer fixes its batch and precision when it is built): "
                      f"{REBUILD}.", rest="")
        raise MemoryGuardError("\n".join(lines))
    return {}


def _tensors(*objects: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(list(objects))[0] if isinstance(t, torch.Tensor)]


class MemoryGuardCallback(TrainerCallback):
    """A transformers `TrainerCallback` that fixes the fp16 traps, plans the run before its first step and measures it.

    At `on_train_begin` (every `train()` call starts afresh: a guard can be reused) it first checks the trainable
    weights: under `fp16=True` bf16 ones (TRL's QLoRA cast) or fp16 ones would crash the GradScaler at the first step
    on a GPU, so it casts them to fp32 and says so in one line (`upcast_trainable=False`: it stops with the fix
    instead). Then it plans the Trainer's own step on the real model (`plan_trainer`) for `target`; if the run will
    not fit, it raises `MemoryGuardError` before the first step, with the changes `fit_trainer` finds (at most
    `max_plans` plans). During training it records the peak of every step (the CUDA allocator on a GPU; on the CPU
    a tensor counter that is active only inside the Trainer's `training_step` and `optimizer.step` calls, and is
    removed whatever they raise) and keeps the highest per logging step (`.peaks`: (global step, bytes)); at the end
    it prints the plan beside the measured peak (`.report`). On the CPU the measured peak is compared with a plan of
    this CPU run (what runs here), on a GPU with the target's plan as the allocator sees it.

    Example:
        >>> trainer = SFTTrainer(..., callbacks=[cm.MemoryGuardCallback(target="t4")])
        >>> trainer.train()   # stops before step 1 if it will not fit a T4
    """

    def __init__(self, target: str | Target | dict[str, Any] = "t4", *, headroom: float = DEFAULT_HEADROOM,
                 seq_len: int | None = None, max_plans: int = 8, verbose: bool = True,
                 upcast_trainable: bool = True) -> None:
        self.target = _target(target)
        self.headroom = headroom
        self.seq_len = seq_len
        self.max_plans = max_plans
        self.verbose = verbose
        self.upcast_trainable = upcast_trainable
        self._wrapped: list[tuple[Any, str, bool, Any]] = []  # (object, attribute, had its own, its own value)
        self._reset()

    def _reset(self) -> None:
        """Forget the previous run: plans, peaks, report, timings, counter (a guard serves one run at a time)."""
        self._unwrap()
        self.plan: Plan | None = None  # the target's plan
        self.compare_plan: Plan | None = None  # the plan of what runs here, compared with the measurement
        self.peaks: list[tuple[int, int]] = []  # (global step, peak bytes since the last log)
        self.report: dict[str, Any] = {}
        self.upcast: dict[str, torch.dtype] = {}  # trainable parameters cast to fp32 at this run's start
        self.step_seconds: list[float] = []
        self.device = torch.device("cpu")
        self._memory: LiveMemory | None = None  # CUDA: the allocator's counters
        self._mode: LiveBytesMode | None = None  # CPU: entered only inside the wrapped calls
        self._since_log = 0
        self._step_start = 0.0
        self._step_open = False  # between on_step_begin and on_step_end
        self._counting = False  # inside a wrapped call

    # -- the fp16 traps ------------------------------------------------------------------------------------
    def _fix_trainable_dtypes(self, args: Any, model: torch.nn.Module) -> None:
        if not getattr(args, "fp16", False):
            return
        found = half_trainable(model)
        if not found:
            return
        what = describe_half_trainable(found)
        if not self.upcast_trainable:
            raise MemoryGuardError(
                f"fp16=True with {what}: fp16's GradScaler fails on them on a GPU.\n"
                f"Stopped before the first step (the first one: {next(iter(found))}).\n"
                f"Fix: {FP16_FIX}\nor leave MemoryGuardCallback(upcast_trainable=True), which does it.")
        self.upcast = upcast_trainable(model)
        if self.verbose:
            dtypes = " and ".join(sorted({str(d).removeprefix("torch.") for d in found.values()}))
            print(f"MemoryGuard: cast {len(found)} trainable tensor(s) from {dtypes} to float32 "
                  "(fp16=True's GradScaler)")

    # -- counting on the CPU, only inside the step's calls ---------------------------------------------------
    def _wrap(self, trainer: Any, owner: Any, name: str, track_args: bool) -> None:
        had = name in vars(owner)
        own = vars(owner).get(name)
        original = getattr(owner, name)
        guard = self

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            mode = guard._mode
            if (mode is None or not guard._step_open or guard._counting
                    or guard not in trainer.callback_handler.callbacks):
                return original(*args, **kwargs)  # outside a step, already counting, or the guard was removed
            if track_args:
                mode.track(*_tensors(args, kwargs))  # the prefetched batch
            guard._counting = True
            try:
                with mode:  # popped whatever the call raises
                    return original(*args, **kwargs)
            finally:
                guard._counting = False

        setattr(owner, name, counted)
        self._wrapped.append((owner, name, had, own))

    def _unwrap(self) -> None:
        for owner, name, had, own in reversed(getattr(self, "_wrapped", [])):
            if had:
                setattr(owner, name, own)
            else:
                vars(owner).pop(name, None)
        self._wrapped = []

    def _peak(self) -> int:
        if self._memory is not None:
            return self._memory.peak_bytes
        return self._mode.peak if self._mode is not None else 0

    # -- the callbacks -----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
        self._reset()
        trainer = _running_trainer()
        runs = _built_batch(trainer, trainer.args)  # plan what the Trainer runs, not what its args say now
        with quiet():  # the libraries' notes while planning (cm.quiet(verbose=True) around train() shows them)
            self._fix_trainable_dtypes(args, trainer.model)
            self.plan = plan_trainer(trainer, target=self.target, headroom=self.headroom, seq_len=self.seq_len, **runs)
            if not self.plan.fits:
                fit = fit_trainer(trainer, target=self.target, headroom=self.headroom, seq_len=self.seq_len,
                                  max_plans=self.max_plans)
                then = ("\nThen build a new Trainer with them: a built Trainer keeps its batch whatever trainer.args "
                        "says." if fit.fits and fit.changes else "")
                raise MemoryGuardError(
                    f"this run will not fit {self.target.name}: it needs {format_bytes(self.plan.device_need_bytes)} "
                    f"of {format_bytes(self.plan.device_limit_bytes)} usable. Stopped before the first step.\n{fit}"
                    + then)
            self.device = torch.device(args.device)
            on_gpu = self.device.type == "cuda"
            self.compare_plan = self.plan if on_gpu else plan_trainer(trainer, target=CPU_TARGET_NAME,
                                                                      seq_len=self.seq_len, **runs)
        optimizer = optimizer if optimizer is not None else trainer.optimizer
        if on_gpu:
            self._memory = LiveMemory(model, optimizer, device=self.device)
            self._memory.__enter__()  # resets the allocator's peak; installs nothing
        else:
            self._mode = LiveBytesMode(sys.maxsize, device=self.device)
            self._mode.track(*[t for t in (model if model is not None else trainer.model, optimizer) if t is not None])
            self._wrap(trainer, trainer, "training_step", track_args=True)
            if optimizer is not None:
                self._wrap(trainer, optimizer, "step", track_args=False)
        if self.verbose:
            print(f"MemoryGuard: plan on {self.target.name}: {format_bytes(self.plan.device_need_bytes)} of "
                  f"{format_bytes(self.plan.device_limit_bytes)} usable: fits")

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self._memory is not None:
            self._memory.reset_peak()
        elif self._mode is not None:
            self._mode.peak = self._mode.live
        self._step_open = True
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._step_open = False
        self._since_log = max(self._since_log, self._peak())
        self.step_seconds.append(time.perf_counter() - self._step_start)

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if self._since_log:
            self.peaks.append((state.global_step, self._since_log))
            self._since_log = 0

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._step_open = False
        self._unwrap()
        if self.compare_plan is None:
            return
        if self._memory is not None:
            self._memory.__exit__(None, None, None)
            self._memory = None  # it tracks the model and optimizer: holding it would keep them on the GPU
        if self._since_log:
            self.peaks.append((state.global_step, self._since_log))
            self._since_log = 0
        measured = max((p for _, p in self.peaks), default=0)
        planned = (self.compare_plan.allocator_peak_bytes if self.compare_plan.target.cuda
                   else self.compare_plan.peak_bytes)
        self.report = {"target": self.target.name, "target_need_bytes": self.plan.device_need_bytes,
                       "target_limit_bytes": self.plan.device_limit_bytes, "planned_bytes": planned,
                       "measured_bytes": measured, "planned_on": self.compare_plan.target.name,
                       "error_pct": 100 * (planned - measured) / measured if measured else None,
                       "upcast_to_fp32": sorted(self.upcast)}
        if self.verbose and measured:
            print(f"MemoryGuard: measured step peak {format_bytes(measured)}, planned {format_bytes(planned)} "
                  f"({self.report['error_pct']:+.2f}%, plan of this {self.compare_plan.target.name} run)")

    def memory_report(self, label: str = "Trainer run") -> MemoryReport:
        """Return the run's highest step peak as a `measure.MemoryReport` (no breakdown: the guard samples
        the live bytes, not their categories)."""
        if not self.peaks:
            raise ValueError("no step measured yet: train with this callback first")
        return MemoryReport(
            peak_bytes=max(p for _, p in self.peaks), by_category={}, category_peaks={}, resident_bytes={},
            by_phase={}, by_module={}, step_seconds=statistics.median(self.step_seconds), device=str(self.device),
            method="MemoryGuardCallback: live bytes over each Trainer step", label=label)
