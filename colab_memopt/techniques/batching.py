"""Notebook 12: the largest batch that fits, OOM recovery that keeps the effective batch, prefetch memory.

- `find_max_batch_size` searches for the largest batch whose step fits, by real OOMs on CUDA or by
  `MemoryBudget` on any device, and cleans up after each failed try.
- `train_with_oom_recovery` trains over a dataset of samples; on an OOM it halves the micro-batch
  and doubles gradient accumulation (plain torch, each micro-batch's loss weighted by its share of
  the batch), redoes the step from zeroed gradients so no sample is lost or seen twice, and restores
  the micro-batch when the monitor's thresholds say it fits again.
- `measure_prefetch_bytes` measures the host RAM a DataLoader's prefetched batches take.
- `diagnose` (in `colab_memopt.planning.oom`) turns an OOM into ordered suggestions.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from colab_memopt.core.env import pick_device
from colab_memopt.core.measure import LiveMemory, MemoryBudget
from colab_memopt.core.tracker import LiveBytesMode


def release_memory(track: Iterable[Any] = (), device: str | torch.device | None = None) -> None:
    """Free what a failed step left: the tracked modules' gradients, garbage, the CUDA cache."""
    for obj in track:
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                p.grad = None
        elif isinstance(obj, torch.optim.Optimizer):
            obj.zero_grad(set_to_none=True)
    gc.collect()
    dev = pick_device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def resident_bytes(track: Iterable[Any] = (), device: str | torch.device | None = None) -> int:
    """Return the bytes held between steps: allocated on CUDA; on the CPU, the tracked objects' tensors."""
    dev = pick_device(device) if device is not None else pick_device("auto")
    if dev.type == "cuda":
        return torch.cuda.memory_allocated(dev)
    mode = LiveBytesMode(sys.maxsize, device=dev)
    mode.track(*list(track))
    return mode.live


def _memory(limit_bytes: int | None, track: list[Any], device: torch.device) -> MemoryBudget | LiveMemory:
    if limit_bytes is not None:
        return MemoryBudget(limit_bytes, *track, device=device)
    return LiveMemory(*track, device=device)


# -- the batch search ---------------------------------------------------------------------------
@dataclass
class BatchTry:
    """One try of the search: the batch, whether its steps fit, their peak, bytes a failed try left behind
    (`stranded_bytes`) and bytes of earlier tries that were freed during it (`released_bytes`: the CUDA allocator
    lets go of some of them late, so a try can end with fewer bytes held than it started with)."""

    batch_size: int
    fits: bool
    peak_bytes: int
    stranded_bytes: int
    released_bytes: int = 0


@dataclass
class BatchSearch:
    """The result of `find_max_batch_size`: the largest batch that fits and every try made."""

    max_batch_size: int
    tries: list[BatchTry] = field(default_factory=list)

    def __str__(self) -> str:
        path = ", ".join(f"{t.batch_size}{'' if t.fits else ' OOM'}" for t in self.tries)
        return f"largest batch that fits: {self.max_batch_size} (tried {path})"


def find_max_batch_size(
    step_factory: Callable[[int], Callable[[], Any]],
    *,
    start: int = 1,
    limit_bytes: int | None = None,
    track: Iterable[Any] = (),
    max_batch_size: int = 4096,
    steps: int = 2,
    device: str | torch.device | None = "auto",
) -> BatchSearch:
    """Return the largest batch size whose training steps fit: double from `start`, then bisect.

    Args:
        step_factory: batch size -> zero-argument step function (called `steps` times per try).
        start: the first batch tried (halved while it does not fit).
        limit_bytes: emulate a device of this size with `MemoryBudget` (any device); None: real
            OOMs of the device (CUDA).
        track: objects made before the search whose tensors count (model, optimizer); their
            gradients are released after every try.
        max_batch_size: stop doubling here.
        steps: steps per try; 2 includes a step with the optimizer state already made.

    The tries train the model: search before training, or build a fresh model in the factory.

    Example:
        >>> find_max_batch_size(lambda b: cm.make_train_step(model, opt, corpus, batch_size=b, seq_len=128),
        ...                     start=8, limit_bytes=2**30, track=(model, opt)).max_batch_size
    """
    if not callable(step_factory):
        raise TypeError(f"step_factory must be callable, got {type(step_factory).__name__}")
    for name, value in (("start", start), ("max_batch_size", max_batch_size), ("steps", steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if start > max_batch_size:
        raise ValueError(f"start ({start}) must be <= max_batch_size ({max_batch_size})")
    dev = pick_device(device)
    if limit_bytes is None and dev.type != "cuda":
        raise ValueError("on the CPU there is no device OOM to find: pass limit_bytes to emulate one")
    tracked = [t for t in track if t is not None]
    tries: list[BatchTry] = []
    known: dict[int, bool] = {}

    def fits(batch: int) -> bool:
        if batch in known:
            return known[batch]
        release_memory(tracked, dev)
        before = resident_bytes(tracked, dev)
        peak, ok = 0, True
        step = None
        try:
            with _memory(limit_bytes, tracked, dev) as mem:
                step = step_factory(batch)
                if not callable(step):
                    raise TypeError(f"step_factory({batch}) must return a zero-argument step function, "
                                    f"got {type(step).__name__}")
                for _ in range(steps):
                    step()
                peak = mem.peak_bytes
        except torch.OutOfMemoryError:
            ok = False
        finally:
            del step
            release_memory(tracked, dev)
        left = resident_bytes(tracked, dev) - before if not ok else 0  # bytes; < 0: earlier tries' bytes freed late
        tries.append(BatchTry(batch, ok, int(peak), max(0, int(left)), max(0, -int(left))))
        known[batch] = ok
        return ok

    lo = start
    while not fits(lo):
        if lo == 1:
            return BatchSearch(0, tries)
        lo //= 2
    hi = None
    while lo < max_batch_size:
        nxt = min(lo * 2, max_batch_size)
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
            break
    if hi is None:
        return BatchSearch(lo, tries)
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return BatchSearch(lo, tries)


# -- training that recovers from OOM ----------------------------------------------------------
@dataclass
class RecoveryEvent:
    """A change of micro-batch: after an OOM, at a critical reading, or restored."""

    step: int
    kind: str  # 'oom', 'critical', 'restore'
    micro_batch_from: int
    micro_batch_to: int


@dataclass
class RecoveryRun:
    """Per optimizer step: loss, micro-batch, accumulation, peak; the events and the sample ids seen."""

    effective_batch_size: int
    losses: list[float] = field(default_factory=list)
    micro_batch_sizes: list[int] = field(default_factory=list)
    accumulation_steps: list[int] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    events: list[RecoveryEvent] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)

    @property
    def recoveries(self) -> int:
        """Return the micro-batch reductions (after an OOM or at a critical reading)."""
        return sum(e.kind in ("oom", "critical") for e in self.events)

    @property
    def restores(self) -> int:
        """Return how often the micro-batch was raised back."""
        return sum(e.kind == "restore" for e in self.events)

    def samples_lost(self, dataset_size: int, epochs: int = 1) -> int:
        """Return samples not seen exactly `epochs` times (missed plus repeated)."""
        counts = torch.bincount(torch.tensor(self.sample_ids, dtype=torch.long), minlength=dataset_size)
        return int((counts - epochs).abs().sum())


class OOMNotRecovered(torch.OutOfMemoryError):
    """`train_with_oom_recovery` met an OOM it cannot absorb; `.run` is the record of the steps finished.

    Attributes:
        run: the `RecoveryRun` of the steps finished before the OOM (their weight updates are applied
            to the model, in place).
        step: the step that failed (0-based).
        where: 'micro-batch' (even the smallest micro-batch does not fit) or 'optimizer.step'.
    """

    def __init__(self, message: str, run: RecoveryRun, step: int, where: str) -> None:
        super().__init__(message)
        self.run, self.step, self.where = run, step, where

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.run, self.step, self.where))


def accumulate_gradients(model: nn.Module, samples: torch.Tensor, ids: torch.Tensor, micro_batch_size: int,
                         device: torch.device) -> float:
    """Run forward and backward over `ids` in micro-batches; return the batch's mean loss.

    Each micro-batch's loss is weighted by its share of the batch (len(chunk) / len(ids)), so the
    summed gradients equal those of one pass over the whole batch (all sequences have one length).
    """
    total = 0.0
    for chunk in ids.split(micro_batch_size):
        x = samples[chunk].to(device)  # (b, T) token ids
        loss = model(x, labels=x).loss * (len(chunk) / len(ids))
        loss.backward()
        total += loss.item()
        del loss, x
    return total


def train_with_oom_recovery(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: torch.Tensor,
    *,
    effective_batch_size: int,
    micro_batch_size: int | None = None,
    epochs: int = 1,
    seed: int = 0,
    limit_bytes: int | None = None,
    monitor: Any = None,
    restore_after: int = 2,
    min_micro_batch_size: int = 1,
    on_step_start: Callable[[int], Any] | None = None,
) -> RecoveryRun:
    """Train on `samples` (N, T) keeping the effective batch through OOMs; return the run's record.

    Each optimizer step takes the next `effective_batch_size` sample ids of a seeded permutation
    (the last step of an epoch takes the rest). An OOM during forward or backward drops the step's
    partial gradients, halves the micro-batch (doubling accumulation) and redoes the same step, so
    every sample is seen exactly once per epoch. After each step, with a `monitor`
    (`monitor.MemoryMonitor`), a critical or emergency reading halves the micro-batch before the next
    OOM; after `restore_after` good steps below the original micro-batch, it is doubled back when the
    predicted peak (bytes live + 2 x the step's growth) stays under the critical threshold.

    The optimizer step itself runs outside the retry: its memory does not depend on the batch.
    `limit_bytes` emulates a device of that size (`MemoryBudget`); None uses the real device.
    `on_step_start(step)` runs inside the memory context before each step (to add memory pressure).

    Raises:
        OOMNotRecovered (a `torch.OutOfMemoryError`): an OOM that halving cannot absorb: at
            `min_micro_batch_size`, or in `optimizer.step`. It says which, and carries the record of
            the steps already finished (`.run`), whose weight updates are applied to the model.
    """
    if not isinstance(samples, torch.Tensor) or samples.dim() != 2:
        shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"samples must be a (N, T) tensor of token ids, got {shape}")
    if samples.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"samples must hold integer token ids, got dtype {samples.dtype}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if samples.numel() and (int(samples.min()) < 0 or (isinstance(vocab, int) and int(samples.max()) >= vocab)):
        raise ValueError(f"samples hold token ids in [{int(samples.min())}, {int(samples.max())}]; "
                         f"the model takes [0, {vocab - 1 if isinstance(vocab, int) else '...'}]")
    samples = samples.long()
    n = len(samples)

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not is_int(effective_batch_size) or not 1 <= effective_batch_size <= n:
        raise ValueError(f"effective_batch_size must be an integer in [1, {n}], got {effective_batch_size!r}")
    micro = effective_batch_size if micro_batch_size is None else micro_batch_size
    if not is_int(micro) or not 1 <= micro <= effective_batch_size:
        raise ValueError(f"micro_batch_size must be an integer in [1, {effective_batch_size}], got {micro!r}")
    if not is_int(min_micro_batch_size) or not 1 <= min_micro_batch_size <= micro:
        raise ValueError(f"min_micro_batch_size must be an integer in [1, {micro}], got {min_micro_batch_size!r}")
    if not is_int(epochs) or not is_int(restore_after) or epochs < 1 or restore_after < 1:
        raise ValueError(f"epochs and restore_after must be integers >= 1, got {epochs!r} and {restore_after!r}")
    device = next(model.parameters()).device
    capacity = limit_bytes if limit_bytes is not None else getattr(monitor, "capacity_bytes", None)
    original = micro
    run = RecoveryRun(effective_batch_size)
    generator = torch.Generator().manual_seed(seed)
    batches = [ids for _ in range(epochs) for ids in torch.randperm(n, generator=generator).split(effective_batch_size)]
    good_steps = 0
    with _memory(limit_bytes, [model, optimizer], device) as mem:
        for step, ids in enumerate(batches):
            if on_step_start is not None:
                on_step_start(step)
            start = time.perf_counter()
            while True:
                optimizer.zero_grad(set_to_none=True)
                mem.reset_peak()
                try:
                    loss = accumulate_gradients(model, samples, ids, micro, device)
                    break
                except torch.OutOfMemoryError as exc:
                    release_memory([model, optimizer], device)
                    if micro <= min_micro_batch_size:
                        run.events.append(RecoveryEvent(step, "oom", micro, micro))
                        raise OOMNotRecovered(
                            f"train_with_oom_recovery gave up at step {step}: out of memory in forward/backward at "
                            f"micro-batch {micro}, the smallest allowed (min_micro_batch_size={min_micro_batch_size}). "
                            f"{_finished(run)} The OOM: {exc}", run, step, "micro-batch") from exc
                    new = max(min_micro_batch_size, micro // 2)
                    run.events.append(RecoveryEvent(step, "oom", micro, new))
                    micro, good_steps = new, 0
            try:
                optimizer.step()
            except torch.OutOfMemoryError as exc:
                raise OOMNotRecovered(
                    f"train_with_oom_recovery gave up at step {step}: out of memory in optimizer.step, whose memory "
                    "does not depend on the micro-batch, so halving it cannot help (an 8-bit optimizer, or offloading "
                    f"its state, can); this step's update may be partly applied. {_finished(run)} The OOM: {exc}",
                    run, step, "optimizer.step") from exc
            peak = mem.peak_bytes
            run.losses.append(loss)
            run.micro_batch_sizes.append(micro)
            run.accumulation_steps.append(math.ceil(len(ids) / micro))
            run.peak_bytes.append(int(peak))
            run.step_seconds.append(time.perf_counter() - start)
            run.sample_ids.extend(ids.tolist())

            status = monitor.status_of(peak / capacity) if monitor is not None and capacity else "normal"
            if status in ("critical", "emergency") and micro > min_micro_batch_size:
                new = max(min_micro_batch_size, micro // 2)
                run.events.append(RecoveryEvent(step, "critical", micro, new))
                micro, good_steps = new, 0
            elif micro < original:
                good_steps += 1
                live = mem.live_bytes()
                predicted = live + 2 * (peak - live)
                ceiling = monitor.thresholds.critical * capacity if monitor is not None and capacity else capacity
                if good_steps >= restore_after and (ceiling is None or predicted < ceiling):
                    new = min(original, micro * 2)
                    run.events.append(RecoveryEvent(step, "restore", micro, new))
                    micro, good_steps = new, 0
    return run


def _finished(run: RecoveryRun) -> str:
    steps = len(run.losses)
    return (f"{steps} step(s) finished before it, their weight updates applied to the model; their record is "
            "this error's .run." if steps else "No earlier step had finished.")


# -- data pipeline -------------------------------------------------------------------------------
def _shm_used_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def measure_prefetch_bytes(dataset: Any, *, batch_size: int, num_workers: int, prefetch_factor: int,
                           settle_seconds: float = 3.0) -> dict[str, int]:
    """Measure the host RAM that a DataLoader's prefetched batches hold, in shared memory.

    Workers put finished batches in shared memory (/dev/shm on Linux) until the main process takes
    them; with the consumer paused, `num_workers x prefetch_factor` batches wait there. Returns the
    /dev/shm growth after taking one batch and waiting `settle_seconds`, and the bytes of one batch.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1 (without workers nothing is prefetched), got {num_workers}")
    if not os.path.isdir("/dev/shm"):
        raise OSError("no /dev/shm on this system: prefetched batches cannot be measured this way")
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                         prefetch_factor=prefetch_factor, shuffle=False)
    before = _shm_used_bytes()
    it = iter(loader)
    first = next(it)
    batch_bytes = first.numel() * first.element_size()
    del first
    gc.collect()
    deadline = time.perf_counter() + settle_seconds
    grown, stable_since = 0, time.perf_counter()
    while time.perf_counter() < deadline:  # wait until the workers have filled the queue
        time.sleep(0.05)
        now = _shm_used_bytes() - before
        if now > grown:
            grown, stable_since = now, time.perf_counter()
        elif grown > batch_bytes and time.perf_counter() - stable_since > 0.5:
            break
    del it
    return {"measured_bytes": int(grown), "batch_bytes": int(batch_bytes)}
