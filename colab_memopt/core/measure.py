"""The one way this project measures memory.

Every notebook measures through `measure_step`: warm up, reset, synchronize, run, read the peak.
On CUDA the peak is the caching allocator's `max_memory_allocated` less the bytes that were already
allocated at the reset and that the step does not own (other objects of the notebook, cuBLAS
workspaces): the step's own peak, as on the CPU, where it is the peak of live tensor storage. In both
cases the breakdown by category and phase comes from `TensorTracker`.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from colab_memopt.core.env import HostMemory, device_label, host_memory, pick_device
from colab_memopt.core.tracker import CATEGORIES, PHASES, LiveBytesMode, TensorTracker

__all__ = [
    "MemoryReport",
    "REPORT_CATEGORIES",
    "optimizer_state_placement",
    "MemoryBudget",
    "LiveMemory",
    "HostMemory",
    "Comparison",
    "measure_step",
    "time_interleaved",
    "host_memory",
    "compare",
    "format_bytes",
    "max_reserved_bytes",
]


def format_bytes(nbytes: float) -> str:
    """Return a human-readable size in binary units: 1536 -> '1.50 KiB'."""
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# The highest `max_memory_reserved` per CUDA device before each peak reset made here, so that the
# process's high-water mark survives the resets (`max_reserved_bytes`).
_RESERVED_HIGH_WATER: dict[int, int] = {}


def _reset_cuda_peak(device: torch.device) -> None:
    """Reset the CUDA peak statistics of `device`, keeping its reserved high-water mark."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    _RESERVED_HIGH_WATER[index] = max(_RESERVED_HIGH_WATER.get(index, 0), torch.cuda.max_memory_reserved(index))
    torch.cuda.reset_peak_memory_stats(index)


def max_reserved_bytes(device: str | torch.device | None = None) -> int | None:
    """Return the most bytes the caching allocator held on a CUDA device in this process, None without CUDA.

    `torch.cuda.max_memory_reserved()` since the process started, across the peak resets that
    `measure_step` and `LiveMemory` make: what the process held from the allocator (cached blocks
    included), to which the CUDA context adds. Its need on a card is about this plus the context.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    index = torch.device(device if device is not None else "cuda").index
    index = torch.cuda.current_device() if index is None else index
    return max(_RESERVED_HIGH_WATER.get(index, 0), torch.cuda.max_memory_reserved(index))


# The tracker's categories plus 'untracked' (CUDA only): allocator bytes of the step that no tracked
# tensor accounts for (workspaces allocated in the step, allocator slack), so the categories sum to the peak.
REPORT_CATEGORIES = (*CATEGORIES, "untracked")


@dataclass
class MemoryReport:
    """The memory and time of one training step.

    Attributes:
        peak_bytes: the step's own peak. CUDA: `max_memory_allocated` less `foreign_bytes`, plus
            `paged_state_bytes`; CPU: peak live tensor storage.
        by_category: bytes per category at the peak; sums to `peak_bytes` (on CUDA with an
            'untracked' entry for allocator bytes no tracked tensor accounts for).
        category_peaks: each category's own maximum during the step.
        resident_bytes: live bytes per category after the step (what stays between steps).
        by_phase: peak live bytes in the forward, backward and optimizer phases.
        by_module: bytes each module left alive after its forward (its activations).
        step_seconds: median wall time of the timed repeats.
        device: where it ran, with the GPU name on CUDA.
        method: how `peak_bytes` was obtained.
        label: a name for tables and plots.
        tracked_peak_bytes: the tracker's own peak of live tensor storage on the device.
        allocator_peak_bytes: CUDA: the raw `max_memory_allocated` after the reset (everything on the
            device, foreign bytes included); None on the CPU.
        foreign_bytes: CUDA: bytes allocated at the reset that no tracked object owns (other tensors
            of the process, cuBLAS workspaces); not in `peak_bytes`. 0 on the CPU, where only tracked
            objects and what the step makes are counted.
        host_state_bytes: optimizer state the optimizer keeps in host memory while training on CUDA
            (torch's Adam/AdamW/Adafactor `step` tensors); not in `peak_bytes`.
        paged_state_bytes: bitsandbytes paged optimizer state (CUDA unified memory, which PyTorch
            sees as CPU tensors and the allocator does not count); counted in `peak_bytes` and in
            'optimizer_state', since it lives on the GPU while the optimizer runs.
        skipped_steps: warm-up steps whose update a GradScaler skipped (fp16 calibrating its scale);
            the warm-up goes on until one update is applied (at most `MAX_EXTRA_WARMUP` more steps).
        optimizer_skipped: the measured step's update was skipped too: its optimizer phase made no update.
    """

    peak_bytes: int
    by_category: dict[str, int]
    category_peaks: dict[str, int]
    resident_bytes: dict[str, int]
    by_phase: dict[str, int]
    by_module: dict[str, int]
    step_seconds: float
    device: str
    method: str
    label: str = ""
    tracked_peak_bytes: int = 0
    allocator_peak_bytes: int | None = None
    foreign_bytes: int = 0
    host_state_bytes: int = 0
    paged_state_bytes: int = 0
    skipped_steps: int = 0
    optimizer_skipped: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)

    def __str__(self) -> str:
        cats = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.by_category.items() if v)
        text = (
            f"{self.label or 'step'} on {self.device}: peak {format_bytes(self.peak_bytes)}"
            + (f" ({cats})" if cats else "") + f"; {self.step_seconds * 1e3:.1f} ms/step"
        )
        if self.skipped_steps:
            text += f"; {self.skipped_steps} warm-up update(s) skipped by the GradScaler"
        if self.optimizer_skipped:
            text += "; WARNING: the measured step's update was skipped (no optimizer update in it)"
        return text


def _device_of(model: torch.nn.Module | None, device: Any) -> torch.device:
    if device is not None:
        return pick_device(device)
    if model is not None:
        for tensor in model.parameters():
            return tensor.device
    return pick_device("auto")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_state_placement(optimizer: torch.optim.Optimizer | None, device: str | torch.device) -> dict[str, int]:
    """Return the optimizer state's bytes by where they live when training on `device`.

    'device': tensors on `device` (what its allocator counts); 'host': tensors the optimizer keeps in
    host memory while training on a GPU (torch's Adam `step` unless fused or capturable); 'paged':
    bitsandbytes paged state, unified memory that PyTorch sees as CPU tensors (`is_paged`) and that
    lives on the GPU while the optimizer runs. On the CPU everything is 'device'.
    """
    out = {"device": 0, "host": 0, "paged": 0}
    if optimizer is None:
        return out
    dev = torch.device(device)
    seen: set[tuple[str, int]] = set()
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def plain(value: Any) -> list[Any]:  # torchao's low-bit states are tensor subclasses: their inner tensors
        if is_traceable_wrapper_subclass(value):
            return [t for attr in value.__tensor_flatten__()[0] for t in plain(getattr(value, attr))]
        return [value]

    for state in optimizer.state.values():
        for value in (t for v in state.values() for t in plain(v)):
            if not isinstance(value, torch.Tensor) or value.is_meta:
                continue
            key = (str(value.device), value.untyped_storage().data_ptr())
            if key in seen:
                continue
            seen.add(key)
            nbytes = value.untyped_storage().nbytes()
            if dev.type == "cpu" or value.device.type == dev.type:
                out["device"] += nbytes
            elif getattr(value, "is_paged", False):
                out["paged"] += nbytes
            else:
                out["host"] += nbytes
    return out


def _cuda_step_peak(allocator_peak: int, allocated_at_reset: int, tracked_at_reset: int,
                    tracked_categories: Mapping[str, int], paged_bytes: int = 0) -> tuple[int, int, dict[str, int]]:
    """Return (step peak, foreign bytes, categories summing to the peak) from the CUDA allocator's figures.

    Foreign bytes were allocated at the reset but belong to no tracked object; the step's peak is the
    allocator's peak without them, plus the paged optimizer state the allocator does not see.
    """
    foreign = max(0, allocated_at_reset - tracked_at_reset)
    peak = allocator_peak - foreign + paged_bytes
    cats = dict(tracked_categories)
    cats["optimizer_state"] = cats.get("optimizer_state", 0) + paged_bytes
    cats["untracked"] = peak - sum(cats.values())
    return peak, foreign, cats


def measure_step(
    step_fn: Callable[[], Any],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | torch.device | None = None,
    warmup: int = 1,
    repeat: int = 3,
    track: Iterable[Any] = (),
    label: str = "",
) -> MemoryReport:
    """Measure the peak memory, its breakdown and the time of one training step.

    Args:
        step_fn: runs one whole step (forward, backward, optimizer step); called warmup + 1 + repeat times.
        model, optimizer: objects made before the step, so their tensors are counted (parameters,
            buffers, existing gradients, optimizer state).
        device: where to count; default: the model's device, else 'auto'.
        warmup: untimed, untracked steps first (>= 0); 1 creates the optimizer state. With a GradScaler
            (`step_fn.scaler`, as `make_train_step` sets it) more follow until an update is applied.
        repeat: timed steps (>= 1); the median is reported.
        track: other tensors made before the step that it keeps using (a fixed batch, say).
        label: the name shown in tables and plots.

    Example:
        >>> model = build_model("tiny"); opt = torch.optim.AdamW(model.parameters())
        >>> report = measure_step(make_train_step(model, opt, load_corpus()), model=model, optimizer=opt)
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an integer >= 1, got {repeat!r}")
    dev = _device_of(model, device)

    # A GradScaler (fp16) skips the updates of its first steps while it calibrates its scale: warm up
    # until one update is applied, so the measured step has optimizer state and an update to make.
    scaler = getattr(step_fn, "scaler", None)
    skipped = 0
    applied = 0
    for i in range(warmup + MAX_EXTRA_WARMUP):
        if i >= warmup and (applied or scaler is None):
            break
        if _skipped_update(step_fn, scaler):
            skipped += 1
        else:
            applied += 1
    gc.collect()
    tracker = TensorTracker(device=dev)
    inner, extra = _trackable_optimizer(optimizer)
    tracker.track_external(*[obj for obj in (model, inner, *track) if obj is not None])
    for category, tensors in extra.items():
        tracker.track_as(category, *tensors)
    if dev.type == "cuda":
        _sync(dev)
        _reset_cuda_peak(dev)
        allocated_at_reset = torch.cuda.memory_allocated(dev)
        tracked_at_reset = tracker.live_bytes()

    with tracker:
        optimizer_skipped = _skipped_update(step_fn, scaler)
        _sync(dev)
        resident = tracker.current_categories()
        by_module = tracker.module_activation_bytes()
    placement = optimizer_state_placement(inner, dev)
    by_category = dict(tracker.peak_categories)
    allocator_peak, foreign = None, 0
    if dev.type == "cuda":
        allocator_peak = torch.cuda.max_memory_allocated(dev)
        peak, foreign, by_category = _cuda_step_peak(allocator_peak, allocated_at_reset, tracked_at_reset,
                                                     by_category, placement["paged"])
        resident["optimizer_state"] += placement["paged"]
        method = ("torch.cuda.max_memory_allocated less foreign bytes (allocated at the reset, owned by no "
                  "tracked object), plus paged optimizer state; categories from the tensor tracker")
        device_name = f"{dev} ({device_label(dev)})"
    else:
        peak = tracker.peak_bytes
        method = "tensor tracker: peak of live tensor storage"
        device_name = str(dev)

    times = []
    for _ in range(repeat):
        _sync(dev)
        start = time.perf_counter()
        step_fn()
        _sync(dev)
        times.append(time.perf_counter() - start)

    return MemoryReport(
        peak_bytes=int(peak),
        by_category=by_category,
        category_peaks=dict(tracker.category_peaks),
        resident_bytes=resident,
        by_phase={p: tracker.phase_peaks.get(p, 0) for p in PHASES},
        by_module=by_module,
        step_seconds=statistics.median(times),
        device=device_name,
        method=method,
        label=label,
        tracked_peak_bytes=tracker.peak_bytes,
        allocator_peak_bytes=allocator_peak,
        foreign_bytes=foreign,
        host_state_bytes=placement["host"],
        paged_state_bytes=placement["paged"],
        skipped_steps=skipped,
        optimizer_skipped=optimizer_skipped,
    )


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in `obj`, a tensor or nested dicts, lists and tuples of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def _trackable_optimizer(optimizer: Any) -> tuple[Any, dict[str, list[torch.Tensor]]]:
    """Return (a torch optimizer the tracker can follow, other tensors it holds by category) for `optimizer`.

    A torch optimizer is itself. DeepSpeed's ZeRO optimizers (not torch optimizers) wrap one (`.optimizer`,
    stepping the fp32 master partitions) and keep flat buffers the tracker would otherwise never see:
    stages 1-2 the 16-bit flat weights (`bit16_groups_flat`, the model's parameters are views of them), the
    gradient partitions and the fp32 master partitions; stage 3 each parameter's partition (`ds_tensor`), the
    flat gradient buffer and the fp32 master partitions (as `zero.rank_state_bytes` reads them).
    """
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, {}
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a DeepSpeed ZeRO optimizer (with a torch optimizer "
                        f"in .optimizer), got {type(optimizer).__name__}")
    _tensors = iter_tensors
    groups = getattr(optimizer, "fp16_groups", None) or getattr(optimizer, "bit16_groups", None) or []
    params = [p for group in groups for p in group]
    extra = {
        "parameters": list(_tensors(getattr(optimizer, "bit16_groups_flat", None)))
        + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")],
        "gradients": list(_tensors(getattr(optimizer, "averaged_gradients", None)))
        + list(_tensors(getattr(optimizer, "grads_in_partition", None)))
        + list(_tensors(getattr(optimizer, "grad_partitions_flat_buffer", None))),
        "optimizer_state": list(_tensors(getattr(optimizer, "single_partition_of_fp32_groups", None)))
        + list(_tensors(getattr(optimizer, "fp32_partitioned_groups_flat", None))),
    }
    return inner, extra


MAX_EXTRA_WARMUP = 32  # warm-up steps beyond `warmup` allowed to wait for a GradScaler's first applied update


def _skipped_update(step_fn: Callable[[], Any], scaler: Any) -> bool:
    """Run one step; return True when its GradScaler skipped the optimizer update (inf/NaN gradients).

    A skip is the only thing that lowers the scale (`backoff_factor` < 1); growth only raises it.
    """
    if scaler is None or not scaler.is_enabled():
        step_fn()
        return False
    before = scaler.get_scale()
    step_fn()
    return scaler.get_scale() < before


def time_interleaved(
    step_fns: Mapping[str, Callable[[], Any]],
    *,
    rounds: int = 5,
    warmup: int = 1,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Return each step's fastest wall time in seconds, running the steps in turn, round after round.

    Interleaving spreads a shared machine's load changes over every variant alike, and the minimum
    is the least disturbed run; use it for time ratios between variants (`measure_step` times each
    variant on its own).
    """
    if not step_fns:
        raise ValueError("time_interleaved needs at least one step function, got none")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    dev = pick_device(device) if device is not None else pick_device("auto")
    for fn in step_fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(step_fns, float("inf"))
    for _ in range(rounds):
        for label, fn in step_fns.items():
            _sync(dev)
            start = time.perf_counter()
            fn()
            _sync(dev)
            best[label] = min(best[label], time.perf_counter() - start)
    return best


class MemoryBudget:
    """Emulate a device with `limit_bytes` of memory, on any device.

    Inside the block, when live tracked tensor bytes would exceed the limit, the operation raises
    `torch.OutOfMemoryError` naming the limit, the bytes asked for and the bytes live. Tensors made
    before the block count only if passed in `track` (a model, an optimizer, tensors).

    Example:
        >>> with MemoryBudget(cm.T4_TOTAL_BYTES, model, optimizer):
        ...     step_fn()
    """

    def __init__(self, limit_bytes: int, *track: Any, device: str | torch.device | None = None) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, (int, float)):
            raise TypeError(f"limit_bytes must be a number of bytes, got {limit_bytes!r}")
        if limit_bytes != limit_bytes or limit_bytes == float("inf"):
            raise ValueError(f"limit_bytes must be a finite number of bytes > 0, got {limit_bytes}")
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = int(limit_bytes)
        self.device = pick_device(device) if device is not None else None
        self._track = [t for t in track if t is not None]
        self._mode: LiveBytesMode | None = None

    def __enter__(self) -> MemoryBudget:
        self._mode = LiveBytesMode(self.limit_bytes, device=self.device)
        self._mode.track(*self._track)
        if self._mode.live > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"MemoryBudget: the tracked objects already hold {self._mode.live:,} bytes, over the "
                f"limit of {self.limit_bytes:,} bytes"
            )
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)

    def live_bytes(self) -> int:
        """Return the tracked bytes alive now."""
        return self._mode.live if self._mode is not None else 0

    @property
    def peak_bytes(self) -> int:
        """Return the highest tracked live bytes seen in the block so far (or since `reset_peak`)."""
        return self._mode.peak if self._mode is not None else 0

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (call it before each step to get per-step peaks)."""
        if self._mode is not None:
            self._mode.peak = self._mode.live


class LiveMemory:
    """Sample the live tensor bytes of a device and their peak, cheaply, inside a `with` block.

    On CUDA it reads the caching allocator (`memory_allocated`, `max_memory_allocated`,
    `memory_reserved`): no cost per operation. On the CPU there is no caching allocator; it counts
    live tensor storage with `LiveBytesMode` (no module or autograd hooks), counting the objects in
    `track` plus every tensor made inside the block. `reserved_bytes()` is None where the device has
    no caching allocator.

    Example:
        >>> with LiveMemory(model, optimizer) as mem:
        ...     mem.reset_peak(); step_fn(); print(mem.live_bytes(), mem.peak_bytes)
    """

    def __init__(self, *track: Any, device: str | torch.device | None = "auto") -> None:
        self.device = pick_device(device)
        self._track = [t for t in track if t is not None]
        self._mode: LiveBytesMode | None = None

    @property
    def has_caching_allocator(self) -> bool:
        """Return True where reserved memory and fragmentation exist (CUDA)."""
        return self.device.type == "cuda"

    def __enter__(self) -> LiveMemory:
        if self.device.type == "cuda":
            _sync(self.device)
            _reset_cuda_peak(self.device)
        else:
            self._mode = LiveBytesMode(sys.maxsize, device=self.device)
            self._mode.track(*self._track)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)

    def live_bytes(self) -> int:
        """Return the bytes of tensor storage alive now."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._mode.live if self._mode is not None else 0

    @property
    def peak_bytes(self) -> int:
        """Return the highest live bytes since the block started or since `reset_peak`."""
        if self.device.type == "cuda":
            _sync(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return self._mode.peak if self._mode is not None else 0

    def reserved_bytes(self) -> int | None:
        """Return the bytes the caching allocator holds (CUDA), or None where there is none."""
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device)
        return None

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        if self.device.type == "cuda":
            _sync(self.device)
            _reset_cuda_peak(self.device)
        elif self._mode is not None:
            self._mode.peak = self._mode.live


CPU_TIME_NOTE = ("step_ms and time_ratio are CPU wall times (a median of a few steps): noisy, and no guide to a "
                 "GPU's, where the kernels, tensor cores and transfers differ")


@dataclass
class Comparison:
    """Reports side by side, each against the first (the baseline)."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def saving_pct(self, label: str) -> float:
        """Return the peak saving of `label` against the baseline, in %."""
        for row in self.rows:
            if row["label"] == label:
                return row["saving_pct"]
        raise KeyError(f"no report labelled {label!r}; have {[r['label'] for r in self.rows]}")

    def _columns(self) -> list[tuple[str, str]]:
        cats = [c for c in REPORT_CATEGORIES if any(r[c] for r in self.rows)]
        return [("label", "")] + [(c, "bytes") for c in cats] + [
            ("peak_bytes", "bytes"),
            ("saving_pct", "pct"),
            ("step_ms", "ms"),
            ("time_ratio", "x"),
        ]

    @staticmethod
    def _cell(value: Any, kind: str) -> str:
        if kind == "bytes":
            return format_bytes(value)
        if kind == "pct":
            return f"{value:+.1f}%"
        if kind == "ms":
            return f"{value:.1f}"
        if kind == "x":
            return f"{value:.2f}x"
        return str(value)

    def __str__(self) -> str:
        cols = self._columns()
        table = [[name for name, _ in cols]] + [[self._cell(r[n], k) for n, k in cols] for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
        lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.rows and all(str(r.get("device", "")).startswith("cpu") for r in self.rows):
            lines.append(CPU_TIME_NOTE)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        cols = self._columns()
        head = "".join(f"<th>{n}</th>" for n, _ in cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{self._cell(r[n], k)}</td>" for n, k in cols) + "</tr>" for r in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __repr__(self) -> str:
        return str(self)


def compare(reports: Mapping[str, MemoryReport]) -> Comparison:
    """Return a table of reports with peak saving in % and time ratio against the first entry.

    The saving is positive when a report's peak is below the baseline's.
    """
    if not reports:
        raise ValueError("compare needs at least one report, got none")
    items = list(reports.items())
    base = items[0][1]
    rows = []
    for label, rep in items:
        row = {"label": label}
        row.update({c: rep.by_category.get(c, 0) for c in REPORT_CATEGORIES})
        row["peak_bytes"] = rep.peak_bytes
        row["saving_pct"] = 100.0 * (1 - rep.peak_bytes / base.peak_bytes) if base.peak_bytes else 0.0
        row["step_ms"] = rep.step_seconds * 1e3
        row["time_ratio"] = rep.step_seconds / base.step_seconds if base.step_seconds else float("nan")
        row["device"] = rep.device
        rows.append(row)
    return Comparison(rows)


class HostPeak:
    """Sample this process's resident memory (RSS) in a thread and keep its peak, inside a `with` block.

    For host RAM, which no allocator counts: loading a model, building a corpus. Sampled every
    `interval_s` seconds (a peak shorter than that can be missed), plus once at entry and exit.

    Example:
        >>> with HostPeak() as host:
        ...     model = load_model(path).model
        >>> host.peak_bytes, host.added_bytes   # peak RSS; peak less the RSS at entry
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self.end_bytes = 0
        self._stop: Any = None
        self._thread: Any = None

    def _sample(self) -> None:
        import psutil

        process = psutil.Process()
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, process.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> HostPeak:
        import threading

        self.start_bytes = self.peak_bytes = host_memory().rss_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.end_bytes = host_memory().rss_bytes
        self.peak_bytes = max(self.peak_bytes, self.end_bytes)

    @property
    def added_bytes(self) -> int:
        """Return the peak less the RSS at entry: what the block needed on top of the process."""
        return self.peak_bytes - self.start_bytes
