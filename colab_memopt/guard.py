"""Guard a Hugging Face Trainer run: plan it before the first step, stop it if it will not fit, measure it.

`MemoryGuardCallback(target=...)` is a transformers `TrainerCallback` (built when called, so that importing
the package does not import transformers). It plans the run with `trainer.plan_trainer` on the real model,
raises `MemoryGuardError` with `fit_trainer`'s changes before the first step of a run that will not fit,
records the step peaks through `measure.LiveMemory`, and reports plan against measurement at the end.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from colab_memopt.planner import Plan, Target
from colab_memopt.trainer import CPU_TARGET_NAME, _target, fit_trainer, plan_trainer


class MemoryGuardError(RuntimeError):
    """Raised by `MemoryGuardCallback` before the first step of a run that will not fit its target."""


def _running_trainer() -> Any:
    """Return the Trainer whose `train()` is calling us (callbacks are not handed the Trainer itself)."""
    import inspect

    from transformers import Trainer

    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    raise RuntimeError("MemoryGuardCallback found no Trainer calling it: add it to a Trainer (callbacks=[...])")


def MemoryGuardCallback(target: str | Target | dict[str, Any] = "t4", *, headroom: float = 0.05,
                        seq_len: int | None = None, max_plans: int = 8, verbose: bool = True) -> Any:  # noqa: N802 - a class to its users
    """Return a transformers `TrainerCallback` that plans the run before its first step and measures it.

    At `on_train_begin` it plans the Trainer's own step on the real model (`plan_trainer`) for `target`;
    if the run will not fit, it raises `MemoryGuardError` before the first step, with the changes
    `fit_trainer` finds (at most `max_plans` plans). During training it records the peak of every step (the CUDA allocator on a
    GPU, the tensor tracker on the CPU: `measure.LiveMemory`) and keeps the highest per logging step
    (`.peaks`: (global step, bytes)); at the end it prints the plan beside the measured peak
    (`.report`). On the CPU the measured peak is compared with a plan of this CPU run (what runs here),
    on a GPU with the target's plan as the allocator sees it.

    Example:
        >>> trainer = SFTTrainer(..., callbacks=[cm.MemoryGuardCallback(target="t4")])
        >>> trainer.train()   # stops before step 1 if it will not fit a T4
    """
    from transformers import TrainerCallback

    from colab_memopt.measure import LiveMemory, format_bytes

    class _MemoryGuardCallback(TrainerCallback):
        def __init__(self) -> None:
            self.target = _target(target)
            self.plan: Plan | None = None  # the target's plan
            self.compare_plan: Plan | None = None  # the plan of what runs here, compared with the measurement
            self.peaks: list[tuple[int, int]] = []  # (global step, peak bytes since the last log)
            self.report: dict[str, Any] = {}
            self._memory: LiveMemory | None = None
            self._since_log = 0
            self._step_start = 0.0
            self.step_seconds: list[float] = []

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            trainer = _running_trainer()
            self.plan = plan_trainer(trainer, target=self.target, headroom=headroom, seq_len=seq_len)
            if not self.plan.fits:
                fit = fit_trainer(trainer, target=self.target, headroom=headroom, seq_len=seq_len, max_plans=max_plans)
                advice = fit.snippet() if fit.fits else "\n".join(fit.notes)
                raise MemoryGuardError(
                    f"this run will not fit {self.target.name}: it needs {format_bytes(self.plan.device_need_bytes)} of "
                    f"{format_bytes(self.plan.device_limit_bytes)} usable (colab_memopt.plan_trainer). "
                    f"Stopped before the first step. fit_trainer's changes:\n{advice}")
            device = args.device
            on_gpu = getattr(device, "type", str(device)) == "cuda"
            self.compare_plan = self.plan if on_gpu else plan_trainer(trainer, target=CPU_TARGET_NAME, seq_len=seq_len)
            self._memory = LiveMemory(model, trainer.optimizer, device=device)
            self._memory.__enter__()
            if verbose:
                print(f"MemoryGuard: plan on {self.target.name}: {format_bytes(self.plan.device_need_bytes)} of "
                      f"{format_bytes(self.plan.device_limit_bytes)} usable: fits")

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if self._memory is not None:
                self._memory.reset_peak()
            self._step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if self._memory is not None:
                self._since_log = max(self._since_log, self._memory.peak_bytes)
            self.step_seconds.append(time.perf_counter() - self._step_start)

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if self._since_log:
                self.peaks.append((state.global_step, self._since_log))
                self._since_log = 0

        def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if self._memory is None:
                return
            self._memory.__exit__(None, None, None)
            if self._since_log:
                self.peaks.append((state.global_step, self._since_log))
            measured = max((p for _, p in self.peaks), default=0)
            planned = (self.compare_plan.allocator_peak_bytes if self.compare_plan.target.cuda
                       else self.compare_plan.peak_bytes)
            self.report = {"target": self.target.name, "target_need_bytes": self.plan.device_need_bytes,
                           "target_limit_bytes": self.plan.device_limit_bytes, "planned_bytes": planned,
                           "measured_bytes": measured, "planned_on": self.compare_plan.target.name,
                           "error_pct": 100 * (planned - measured) / measured if measured else None}
            if verbose and measured:
                print(f"MemoryGuard: measured step peak {format_bytes(measured)}, planned {format_bytes(planned)} "
                      f"({self.report['error_pct']:+.2f}%, plan of this {self.compare_plan.target.name} run)")

        def memory_report(self, label: str = "Trainer run") -> Any:
            """Return the run's highest step peak as a `measure.MemoryReport` (no breakdown: the guard samples
            the live bytes, not their categories)."""
            import statistics

            from colab_memopt.measure import MemoryReport

            if not self.peaks:
                raise ValueError("no step measured yet: train with this callback first")
            device = self._memory.device if self._memory is not None else torch.device("cpu")
            return MemoryReport(
                peak_bytes=max(p for _, p in self.peaks), by_category={}, category_peaks={}, resident_bytes={},
                by_phase={}, by_module={}, step_seconds=statistics.median(self.step_seconds), device=str(device),
                method="MemoryGuardCallback: measure.LiveMemory over each Trainer step", label=label)

    return _MemoryGuardCallback()
