"""Notebook 11: watch memory while training: a per-step profiler, a threshold monitor, leak detection.

`MemoryProfiler` samples every step (live bytes after the step, the step's peak, reserved bytes where
the device has a caching allocator, and a phase label) and reports initial, final and peak use,
utilisation of the device's capacity, per-phase statistics, spikes and leaks; it exports CSV.
`MemoryMonitor` applies utilisation thresholds (profiles aggressive, balanced, conservative: this
project's defaults) and returns concrete recommendations. Both run as a hook in a plain training
loop (`with profiler: ... profiler.sample(step)`) and as a transformers `TrainerCallback`.

Sampling reads `measure.LiveMemory`: the caching allocator's counters on CUDA, live tensor storage
counted by `LiveBytesMode` on the CPU.
"""

from __future__ import annotations

import csv
import io
import statistics
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from colab_memopt.planning import estimate
from colab_memopt.core.fileio import atomic_write_text
from colab_memopt.core.env import pick_device, usable_device_memory
from colab_memopt.core.measure import LiveMemory, format_bytes
from colab_memopt.core.console import quiet

NOT_APPLICABLE = "not applicable on this device (no caching allocator)"
STATUSES = ("normal", "warning", "critical", "emergency")


# -- the profiler ------------------------------------------------------------------------------
@dataclass
class MemorySample:
    """One step's memory: bytes live after it, its peak, reserved bytes (None without an allocator)."""

    step: int
    phase: str
    allocated_bytes: int
    peak_bytes: int
    reserved_bytes: int | None = None


@dataclass
class Spike:
    """A step whose peak jumped above the previous step's by more than the threshold."""

    step: int
    delta_bytes: int
    phase: str


@dataclass
class PhaseStats:
    """Mean, max and min of the step peaks in one phase, in bytes."""

    steps: int
    mean_bytes: float
    max_bytes: int
    min_bytes: int


@dataclass
class ProfileReport:
    """What a profiled run used: initial, final and peak bytes, utilisation, phases, spikes, leak."""

    initial_bytes: int
    final_bytes: int
    peak_bytes: int
    peak_step: int
    capacity_bytes: int
    utilization: float
    by_phase: dict[str, PhaseStats]
    spikes: list[Spike]
    leak_step: int | None
    reserved_peak_bytes: int | None

    def __str__(self) -> str:
        lines = [
            f"initial {format_bytes(self.initial_bytes)}, final {format_bytes(self.final_bytes)}, "
            f"peak {format_bytes(self.peak_bytes)} at step {self.peak_step} "
            f"({self.utilization:.1%} of {format_bytes(self.capacity_bytes)})",
            "reserved peak: " + (format_bytes(self.reserved_peak_bytes) if self.reserved_peak_bytes is not None else NOT_APPLICABLE),
        ]
        for phase, s in self.by_phase.items():
            lines.append(f"  {phase:8s} {s.steps:3d} steps: mean {format_bytes(s.mean_bytes)}, "
                         f"max {format_bytes(s.max_bytes)}, min {format_bytes(s.min_bytes)}")
        lines.append(f"spikes: {len(self.spikes)}" + "".join(
            f"\n  step {s.step} ({s.phase}): +{format_bytes(s.delta_bytes)}" for s in self.spikes))
        lines.append("leak: " + (f"steady climb from step {self.leak_step}" if self.leak_step is not None else "none"))
        return "\n".join(lines)


def find_spikes(samples: Sequence[MemorySample], threshold_bytes: int) -> list[Spike]:
    """Return the steps whose peak rose above the previous step's peak by more than `threshold_bytes`."""
    if threshold_bytes < 0:
        raise ValueError(f"threshold_bytes must be >= 0, got {threshold_bytes}")
    return [
        Spike(step=cur.step, delta_bytes=cur.peak_bytes - prev.peak_bytes, phase=cur.phase)
        for prev, cur in zip(samples, samples[1:])
        if cur.peak_bytes - prev.peak_bytes > threshold_bytes
    ]


def find_leak(samples: Sequence[MemorySample], *, window: int = 4, min_growth_bytes: int = 1) -> int | None:
    """Return the step where a steady climb of the bytes live after each step begins, or None.

    A climb is `window` consecutive steps that each end with at least `min_growth_bytes` more live
    than the step before (a one-time rise, such as the optimizer state made by the first step, is
    not a climb). The step returned is the first one that grew.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    run_start, run = None, 0
    for prev, cur in zip(samples, samples[1:]):
        if cur.allocated_bytes - prev.allocated_bytes >= min_growth_bytes:
            run_start = cur.step if run == 0 else run_start
            run += 1
            if run >= window:
                return run_start
        else:
            run = 0
    return None


class MemoryProfiler:
    """Sample memory at every step of a training loop and report on it.

    Args:
        *track: objects made before profiling whose tensors count on the CPU (model, optimizer).
        device: 'auto', 'cpu' or 'cuda'.
        capacity_bytes: the device's capacity for utilisation (default: what the device offers;
            on the CPU there is none, so pass the budget you emulate).
        spike_threshold_bytes: a step whose peak exceeds the previous one's by more is a spike
            (default: 10% of the capacity).
        leak_window: consecutive growing steps that make a leak.
        warmup_steps: first steps left out of spike and leak detection (the first step makes the
            optimizer state, a one-time rise of the next step's peak).

    Example:
        >>> with MemoryProfiler(model, opt, capacity_bytes=cm.T4_USABLE_BYTES) as prof:
        ...     for i in range(steps):
        ...         prof.begin_step(); step_fn(); prof.sample(i, phase="train")
        >>> print(prof.report()); prof.to_csv("memory.csv")
    """

    def __init__(
        self,
        *track: Any,
        device: str | torch.device = "auto",
        capacity_bytes: int | None = None,
        spike_threshold_bytes: int | None = None,
        leak_window: int = 4,
        warmup_steps: int = 1,
    ) -> None:
        import math

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not integer(warmup_steps) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if not integer(leak_window) or leak_window < 2:
            raise ValueError(f"leak_window must be an integer >= 2 (steps compared for a leak), got {leak_window!r}")
        for name, value in (("capacity_bytes", capacity_bytes), ("spike_threshold_bytes", spike_threshold_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
        if spike_threshold_bytes is not None and spike_threshold_bytes < 0:
            raise ValueError(f"spike_threshold_bytes must be >= 0, got {spike_threshold_bytes!r}")
        self.warmup_steps = warmup_steps
        self.device = pick_device(device)
        if capacity_bytes is None:
            if self.device.type != "cuda":
                raise ValueError("capacity_bytes is required on the CPU (it has no device capacity); "
                                 "pass the budget you emulate, e.g. cm.T4_USABLE_BYTES")
            capacity_bytes = usable_device_memory(self.device)
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.spike_threshold_bytes = int(0.1 * self.capacity_bytes if spike_threshold_bytes is None else spike_threshold_bytes)
        self.leak_window = leak_window
        self.samples: list[MemorySample] = []
        self.memory = LiveMemory(*track, device=self.device)
        self._active = False

    def __enter__(self) -> MemoryProfiler:
        self.memory.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        self.memory.__exit__(*exc)

    def begin_step(self) -> None:
        """Start the step's peak from the bytes live now."""
        self.memory.reset_peak()

    def sample(self, step: int, phase: str = "train") -> MemorySample:
        """Record the step that just ended: live bytes now, its peak, reserved bytes; start the next peak."""
        if not self._active:
            raise RuntimeError("sample() needs an active profiler: use `with MemoryProfiler(...) as prof:`")
        s = MemorySample(
            step=int(step),
            phase=str(phase),
            allocated_bytes=self.memory.live_bytes(),
            peak_bytes=self.memory.peak_bytes,
            reserved_bytes=self.memory.reserved_bytes(),
        )
        self.samples.append(s)
        self.memory.reset_peak()
        return s

    def report(self) -> ProfileReport:
        """Return initial, final and peak use, utilisation, per-phase stats, spikes and the leak step."""
        if not self.samples:
            raise ValueError("no samples yet: call sample() after each step")
        peak = max(self.samples, key=lambda s: s.peak_bytes)
        phases: dict[str, list[int]] = {}
        for s in self.samples:
            phases.setdefault(s.phase, []).append(s.peak_bytes)
        reserved = [s.reserved_bytes for s in self.samples if s.reserved_bytes is not None]
        return ProfileReport(
            initial_bytes=self.samples[0].allocated_bytes,
            final_bytes=self.samples[-1].allocated_bytes,
            peak_bytes=peak.peak_bytes,
            peak_step=peak.step,
            capacity_bytes=self.capacity_bytes,
            utilization=peak.peak_bytes / self.capacity_bytes,
            by_phase={p: PhaseStats(len(v), statistics.fmean(v), max(v), min(v)) for p, v in phases.items()},
            spikes=find_spikes(self.samples[self.warmup_steps:], self.spike_threshold_bytes),
            leak_step=find_leak(self.samples[self.warmup_steps:], window=self.leak_window),
            reserved_peak_bytes=max(reserved) if reserved else None,
        )

    def to_csv(self, path: str | Path | None = None) -> str:
        """Return the samples as CSV text (one row per step) and write it to `path` if given."""
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=[f.name for f in fields(MemorySample)], lineterminator="\n")
        writer.writeheader()
        for s in self.samples:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(s).items()})
        text = buf.getvalue()
        if path is not None:
            atomic_write_text(path, text)
        return text

    def callback(self, phase: str = "train") -> Any:
        """Return a transformers `TrainerCallback` that profiles a `Trainer` run with this profiler."""
        return _trainer_callback(self, phase=phase)


def read_csv(source: str | Path) -> list[MemorySample]:
    """Return the samples from CSV text or a CSV file written by `MemoryProfiler.to_csv`."""
    text = Path(source).read_text() if isinstance(source, Path) or "\n" not in str(source) else str(source)
    rows = csv.DictReader(io.StringIO(text))
    expected = [f.name for f in fields(MemorySample)]
    if rows.fieldnames != expected:
        raise ValueError(f"CSV columns must be {expected}, got {rows.fieldnames}")
    return [
        MemorySample(
            step=int(r["step"]), phase=r["phase"], allocated_bytes=int(r["allocated_bytes"]),
            peak_bytes=int(r["peak_bytes"]),
            reserved_bytes=int(r["reserved_bytes"]) if r["reserved_bytes"] else None,
        )
        for r in rows
    ]


def plot_timeline(samples: Sequence[MemorySample], *, capacity_bytes: int | None = None, ax: Any = None,
                  unit: str = "MiB", spikes: Iterable[Spike] = ()) -> Any:
    """Draw live-after-step and step-peak bytes per step, the capacity and the spikes. Return the axes."""
    import matplotlib.pyplot as plt

    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    steps = [s.step for s in samples]
    ax.plot(steps, [s.peak_bytes / scale for s in samples], marker=".", label="step peak")
    ax.plot(steps, [s.allocated_bytes / scale for s in samples], marker=".", label="live after step")
    if any(s.reserved_bytes is not None for s in samples):
        ax.plot(steps, [(s.reserved_bytes or 0) / scale for s in samples], linestyle=":", label="reserved")
    if capacity_bytes:
        ax.axhline(capacity_bytes / scale, color="black", linestyle="--", linewidth=1, label="capacity")
    by_step = {s.step: s for s in samples}
    for spike in spikes:
        ax.annotate(f"+{spike.delta_bytes / scale:.1f}", (spike.step, by_step[spike.step].peak_bytes / scale),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8, color="crimson")
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)
    return ax


# -- the monitor -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Thresholds:
    """Utilisation fractions: aim at `target`; warn, reduce the batch, clean up at the others."""

    target: float
    warning: float
    critical: float
    emergency: float

    def __post_init__(self) -> None:
        values = (self.target, self.warning, self.critical, self.emergency)
        if not all(0 < v <= 1 for v in values) or list(values) != sorted(values) or len(set(values)) < 4:
            raise ValueError(f"thresholds must rise strictly within (0, 1]: target < warning < critical < "
                             f"emergency, got {values}")


# Utilisation thresholds (target, warning, critical, emergency) as fractions of capacity: this project's
# defaults, a margin below the limit for the allocator's fragmentation and a step's transient spikes.
PROFILES = {
    "aggressive": Thresholds(0.92, 0.94, 0.96, 0.98),
    "balanced": Thresholds(0.90, 0.92, 0.95, 0.97),
    "conservative": Thresholds(0.85, 0.88, 0.92, 0.95),
}


# Checkpointing every block: one s*b*h input per layer instead of 34+5*a*s/h values (Korthikanti et al. 2022,
# https://arxiv.org/abs/2205.05198); the "60-80% of activations" quoted in fine-tuning guides (figures vary) is a
# rule of thumb with no primary source.
_CHECKPOINTING_SAVES = ("keeps one s*b*h input per layer instead of 34+ (Korthikanti et al. 2022); "
                        "60-80% of activations is a rule of thumb (no primary source)")


@dataclass
class HealthCheck:
    """The monitor's verdict on one reading: status, utilisation and what to do."""

    status: str
    utilization: float
    used_bytes: int
    capacity_bytes: int
    batch_size: int
    suggested_batch_size: int
    recommendations: list[str] = field(default_factory=list)


class MemoryMonitor:
    """Check memory use against utilisation thresholds and say what to do (batch size, accumulation, freeing).

    Args:
        capacity_bytes: the device's capacity (default on CUDA: what it offers; required on the CPU).
        profile: 'aggressive', 'balanced' or 'conservative' (ignored when `thresholds` is given).
        thresholds: custom `Thresholds`.
        fixed_bytes: bytes that do not grow with the batch (model states); with it, batch
            suggestions scale only the rest. Without it, all use is assumed to scale with the batch.
        profiler: where `check` reads the last step's peak when no `used_bytes` is passed.
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        profile: str = "balanced",
        thresholds: Thresholds | None = None,
        fixed_bytes: int = 0,
        profiler: MemoryProfiler | None = None,
        device: str | torch.device = "auto",
    ) -> None:
        if thresholds is None:
            if profile not in PROFILES:
                raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
            thresholds = PROFILES[profile]
        self.thresholds = thresholds
        self.device = pick_device(device)
        if capacity_bytes is None:
            if profiler is not None:
                capacity_bytes = profiler.capacity_bytes
            elif self.device.type == "cuda":
                capacity_bytes = usable_device_memory(self.device)
            else:
                raise ValueError("capacity_bytes is required on the CPU; pass the budget you emulate")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if fixed_bytes < 0:
            raise ValueError(f"fixed_bytes must be >= 0, got {fixed_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.fixed_bytes = int(fixed_bytes)
        self.profiler = profiler

    def status_of(self, utilization: float) -> str:
        """Return 'normal', 'warning', 'critical' or 'emergency' for a utilisation fraction."""
        t = self.thresholds
        if utilization >= t.emergency:
            return "emergency"
        if utilization >= t.critical:
            return "critical"
        if utilization >= t.warning:
            return "warning"
        return "normal"

    def batch_for(self, fraction: float, batch_size: int, used_bytes: int) -> int:
        """Return the largest batch whose use stays within `fraction` of capacity (linear in the batch)."""
        per_sample = max(used_bytes - self.fixed_bytes, 1) / batch_size
        room = fraction * self.capacity_bytes - self.fixed_bytes
        return max(int(room // per_sample), 0)

    def check(self, batch_size: int, used_bytes: int | None = None) -> HealthCheck:
        """Return the status of a step's use at this batch size and concrete recommendations."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if used_bytes is None:
            if self.profiler is None or not self.profiler.samples:
                raise ValueError("pass used_bytes, or give the monitor a profiler that has sampled a step")
            used_bytes = self.profiler.samples[-1].peak_bytes
        util = used_bytes / self.capacity_bytes
        status = self.status_of(util)
        t = self.thresholds
        target_batch = self.batch_for(t.target, batch_size, used_bytes)
        recs: list[str] = []
        if status == "normal":
            suggested = batch_size
            if target_batch > batch_size:
                recs.append(f"utilisation {util:.1%} is below the {t.target:.0%} target: a batch of up to "
                            f"{target_batch} fits (now {batch_size})")
            else:
                recs.append(f"utilisation {util:.1%} is within the {t.target:.0%} target: keep batch {batch_size}")
        elif status == "warning":
            suggested = batch_size
            recs.append(f"utilisation {util:.1%} is above the {t.warning:.0%} warning line: do not grow the batch; "
                        f"a spike of {format_bytes((t.critical - util) * self.capacity_bytes)} reaches critical")
        else:
            suggested = max(1, min(target_batch, batch_size // 2 if status == "emergency" else batch_size - 1))
            accum = -(-batch_size // suggested)
            recs.append(f"{status}: utilisation {util:.1%} >= {getattr(t, status):.0%}: reduce the micro-batch "
                        f"{batch_size} -> {suggested} and accumulate {accum} micro-batches to keep the effective batch")
            if status == "emergency":
                recs.append("free what is not needed now: drop references to old losses/outputs, gc.collect(), "
                            "torch.cuda.empty_cache() (CUDA)")
        return HealthCheck(status, util, int(used_bytes), self.capacity_bytes, batch_size, suggested, recs)

    def breakdown(self) -> dict[str, Any]:
        """Return allocated, reserved and fragmentation (1 - allocated/reserved); CPU: not applicable."""
        if self.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            return {
                "allocated_bytes": allocated,
                "reserved_bytes": reserved,
                "fragmentation_ratio": (1 - allocated / reserved) if reserved else 0.0,
                "capacity_bytes": self.capacity_bytes,
            }
        allocated = None
        if self.profiler is not None:
            allocated = (self.profiler.memory.live_bytes() if self.profiler._active
                         else self.profiler.samples[-1].allocated_bytes if self.profiler.samples else None)
        return {
            "allocated_bytes": allocated,
            "reserved_bytes": NOT_APPLICABLE,
            "fragmentation_ratio": NOT_APPLICABLE,
            "capacity_bytes": self.capacity_bytes,
        }

    @staticmethod
    def estimate_activation_memory(
        batch_size: int,
        sequence_length: int,
        hidden_size: int,
        num_layers: int,
        num_attention_heads: int,
        *,
        use_gradient_checkpointing: bool = False,
        use_flash_attention: bool = True,
        bytes_per_value: int = 2,
    ) -> dict[str, int]:
        """Return activation bytes on paper: per layer, total, with checkpointing, and the saving.

        Per layer: Korthikanti et al. (2022) s*b*h*(34 + 5*a*s/h) in 16-bit (the 5*a*s/h term goes
        with memory-efficient attention), scaled by bytes_per_value/2. Full recomputation keeps each
        layer's input (s*b*h values) plus one layer's activations while it is recomputed.
        """
        per_layer = estimate.korthikanti_activation_bytes(
            sequence_length, batch_size, hidden_size, num_attention_heads, flash=use_flash_attention
        ) * bytes_per_value // 2
        full = per_layer * num_layers
        checkpointed = num_layers * sequence_length * batch_size * hidden_size * bytes_per_value + per_layer
        effective = checkpointed if use_gradient_checkpointing else full
        return {
            "per_layer_bytes": per_layer,
            "total_bytes": full,
            "effective_bytes": effective,
            "savings_bytes": full - effective,
        }

    @staticmethod
    def optimizations(recipe: Any) -> dict[str, dict[str, Any]]:
        """Return each technique a recipe can carry: enabled or not, and what it is expected to save.

        Reads the recipe's fields by name, so fields that other notebooks add are listed once they
        exist; the expected savings come from the formulas and papers named in each line, or are
        marked as rules of thumb.
        """
        values = recipe.to_dict() if hasattr(recipe, "to_dict") else dict(recipe)
        known = {
            "attention": (lambda v: v in (None, "sdpa"),
                          "memory-efficient (SDPA) attention drops the a*s^2 score tensor: 5*a*s/h of 34+5*a*s/h per layer (Korthikanti)"),
            "optimizer": (lambda v: v in ("sgd", "sgd_momentum", "adamw8bit", "adam8bit"),
                          "AdamW keeps 8 B/param of state; SGD+momentum 4, SGD 0, 8-bit Adam 2 (Dettmers et al. 2022)"),
            "mixed_precision": (bool, "16-bit activations: 2 bytes per value instead of 4 for what autocast runs in "
                                "16-bit, about half the activation bytes"),
            "precision": (lambda v: v not in (None, "fp32"), "16-bit activations under autocast (2 bytes per value "
                          "instead of 4 where autocast runs in 16-bit); 16-bit weights and their state with 'bf16'/'fp16'"),
            "gradient_checkpointing": (bool, _CHECKPOINTING_SAVES),
            "activation_checkpointing": (bool, _CHECKPOINTING_SAVES),  # transformers 5.2x's name for it
            # Recipe.checkpointing is a policy name: 'none' is off (bool('none') would say on)
            "checkpointing": (lambda v: v not in (None, False, "none"), _CHECKPOINTING_SAVES),
            "gradient_accumulation_steps": (lambda v: bool(v) and v > 1, "activations of one micro-batch instead of the whole batch"),
            "optimizer_offload": (bool, "optimizer state in host RAM: 8 B/param off the device (AdamW)"),
            "offload_optimizer": (bool, "optimizer state in host RAM (ZeRO-Offload): 8 B/param off the device (AdamW)"),
            "layer_offload_active": (lambda v: bool(v) and v > 0, "only this many blocks' weights on the device at a time; "
                                     "the rest stream from host RAM each step"),
            "cpu_offload": (bool, "parameters/optimizer state in host RAM: their bytes leave the device; each step waits on PCIe copies, "
                           "so the slowdown depends on the host-device bandwidth"),
        }
        out = {}
        for name, (enabled, saves) in known.items():
            if name in values:
                out[name] = {"value": values[name], "enabled": bool(enabled(values[name])), "memory_savings": saves}
        return out


# -- transformers Trainer ----------------------------------------------------------------------
def _trainer_callback(profiler: MemoryProfiler, *, phase: str, monitor: MemoryMonitor | None = None) -> Any:
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from transformers import TrainerCallback

    class MemoryProfilerCallback(TrainerCallback):
        """Profile a transformers `Trainer`: count from train begin, sample at each step end."""

        def __init__(self) -> None:
            self.profiler = profiler
            self.monitor = monitor
            self.checks: list[HealthCheck] = []

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            profiler.memory._track = [t for t in (model, optimizer) if t is not None]
            profiler.__enter__()

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            profiler.begin_step()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            sample = profiler.sample(state.global_step, phase=phase)
            if self.monitor is not None:
                self.checks.append(self.monitor.check(args.per_device_train_batch_size, sample.peak_bytes))

        def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            profiler.__exit__(None, None, None)

    return MemoryProfilerCallback()


def trainer_callback(profiler: MemoryProfiler, *, monitor: MemoryMonitor | None = None, phase: str = "train") -> Any:
    """Return a transformers `TrainerCallback` that samples `profiler` every step and checks `monitor`."""
    return _trainer_callback(profiler, phase=phase, monitor=monitor)


# -- allocation history ------------------------------------------------------------------------
def record_memory_history(step_fn: Callable[[], Any], *, steps: int, path: str | Path,
                          device: str | torch.device = "auto") -> dict[str, Any]:
    """Run `steps` steps while recording allocations and write the record to `path`.

    On CUDA: `torch.cuda.memory._record_memory_history` and `_dump_snapshot` (a pickle to open at
    https://pytorch.org/memory_viz). On the CPU, which has no allocator history, `torch.profiler`'s
    memory timeline (`profile_memory=True`), written as JSON [times, bytes by category]. Returns
    the path, the kind of record and, for the timeline, its peak by category.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    dev = pick_device(device)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if dev.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        try:
            for _ in range(steps):
                step_fn()
            torch.cuda.synchronize(dev)
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return {"path": str(path), "kind": "cuda allocator snapshot (open at https://pytorch.org/memory_viz)"}

    import json

    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        for _ in range(steps):
            step_fn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of the CUDA-only history
        prof.export_memory_timeline(str(path), device="cpu")
    times, sizes = json.loads(path.read_text())
    names = ["unknown" if c is None else c.name.lower() for c in _CATEGORY_TO_INDEX]
    # Column 0 is unused; category i is column i + 1.
    totals = [sum(row[1:]) for row in sizes]
    peak_at = max(range(len(totals)), key=totals.__getitem__)
    return {
        "path": str(path),
        "kind": "torch.profiler memory timeline (CPU)",
        "events": len(times),
        "peak_bytes": totals[peak_at],
        "peak_by_category": {name: sizes[peak_at][i + 1] for i, name in enumerate(names)},
        "category_max_bytes": {name: max(row[i + 1] for row in sizes) for i, name in enumerate(names)},
    }
