"""Plan without touching the run: the process's modes and the user's Trainer are as they were after a plan.

A plan is a pure function of what the user gave. Two context managers make it so:

- `neutral_process_state()`: the trace runs with gradients on, outside inference mode, with autocast off, float32
  as the default dtype and the CPU as the default device, whatever the caller's code set; the RNG states (torch's,
  CUDA's where it is initialised, Python's `random` and numpy's) are put back afterwards, so a plan that builds a
  Trainer (which seeds the process) or a data collator (which draws masks) changes no later draw of the run; and
  bitsandbytes' process-wide optimizer overrides, which a Trainer's 8-bit optimizer registers, are as they were.
- `trainer_kept(trainer)`: a real Trainer's step is traced with a throwaway GradScaler in place of its own (the
  scaler creates its scale lazily, on its first `scale()`: a traced step would leave it a fake tensor, and every
  later step would then train nothing); its `args` fields, `state`, `control`, callbacks, optimizer and scheduler
  come back as they were.

Nested use is fine: each level puts back what it found.

A third, `collector_spared()`, is for speed alone: while a plan runs, Python's garbage collector leaves alone the
objects that were there before it (the libraries' modules, the user's model), which a plan's many short-lived
objects would otherwise have it scan again and again; afterwards they are collected as before.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import random
import threading
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def _rng_states() -> tuple[Any, ...]:
    numpy_state = None
    try:
        import numpy

        numpy_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's wheels
        pass
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda_states, random.getstate(), numpy_state


def _set_rng_states(states: tuple[Any, ...]) -> None:
    cpu, cuda_states, python_state, numpy_state = states
    torch.set_rng_state(cpu)
    if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)
    random.setstate(python_state)
    if numpy_state is not None:
        import numpy

        numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Put every random-number generator the run draws from back as it was after the block."""
    states = _rng_states()
    try:
        yield
    finally:
        _set_rng_states(states)


@contextlib.contextmanager
def neutral_process_state() -> Iterator[None]:
    """Run the block with gradients on, autocast off, float32 default dtype, CPU default device; RNGs kept.

    What the caller set comes back afterwards. A plan traced inside `torch.no_grad()`, under
    `torch.set_default_dtype(torch.bfloat16)` or inside an autocast region gives the same bytes as one outside them.
    """
    old_dtype = torch.get_default_dtype()
    old_device = torch.get_default_device() if hasattr(torch, "get_default_device") else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(rng_kept())
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(_autocast_off())
        stack.enter_context(_bnb_overrides_kept())
        try:
            torch.set_default_dtype(torch.float32)
            if old_device is not None and old_device != torch.device("cpu"):
                torch.set_default_device("cpu")
            yield
        finally:
            torch.set_default_dtype(old_dtype)
            if old_device is not None and old_device != torch.device("cpu"):
                torch.set_default_device(old_device)


_AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def _bnb_overrides_kept() -> Iterator[None]:
    """Run the block with bitsandbytes' optimizer overrides as a fresh process has them (none); put the caller's back.

    transformers' Trainer registers every embedding for 32-bit optimizer state in bitsandbytes' process-wide
    `GlobalOptimManager` each time it builds an 8-bit optimizer, and every later 8-bit optimizer of the process reads
    those overrides by parameter position (`index2config`), whatever its model. A plan that builds a Trainer left them
    behind: a GaLore 8-bit optimizer built afterwards kept 32-bit state where it should keep 8-bit."""
    import sys

    def manager() -> Any:
        module = sys.modules.get("bitsandbytes.optim.optimizer")
        return getattr(getattr(module, "GlobalOptimManager", None), "_instance", None)

    before = manager()
    saved = dict(vars(before)) if before is not None else None
    if before is not None:
        before.initialize()
    try:
        yield
    finally:
        after = manager()
        if after is not None:
            after.initialize()  # what the plan registered goes
            if saved is not None:
                vars(after).update(saved)


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Turn autocast off and its nesting to zero for the block, as outside any autocast region.

    Not an `autocast(enabled=False)` region: autocast keeps its cache of cast weights until the outermost region
    exits, so a plan traced inside any region (the caller's, or one of ours) would keep the bf16 copies of the weights
    from the forward to the recomputation, bytes the run does not hold (measured: +100 KB on the tiny model with
    offloaded checkpoints under bf16 autocast)."""
    devices = [d for d in _AUTOCAST_DEVICES if d == "cpu" or torch.cuda.is_available()]
    enabled = {d: torch.is_autocast_enabled(d) for d in devices}
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    try:
        for d in devices:
            torch.set_autocast_enabled(d, False)
        for _ in range(nesting):
            torch.autocast_decrement_nesting()
        yield
    finally:
        if torch.autocast_increment_nesting() - 1 == 0:  # balanced inside: the cache holds nothing of ours
            torch.clear_autocast_cache()
        torch.autocast_decrement_nesting()
        for _ in range(nesting):
            torch.autocast_increment_nesting()
        for d, was in enabled.items():
            torch.set_autocast_enabled(d, was)


@contextlib.contextmanager
def collector_spared() -> Iterator[None]:
    """Run the block with the objects that exist before it out of the garbage collector's scans (`gc.freeze()`);
    they are handed back to it afterwards (`gc.unfreeze()`), as collectable as before.

    A plan builds and drops hundreds of thousands of short-lived objects (fake tensors, modules, configs). Each of
    the collector's full passes they set off scans every object of the process as well: torch's, transformers',
    the user's. Measured on a 2-core machine: about 1 s of a 10 s plan went to those passes. Where the caller froze
    objects itself (`gc.get_freeze_count()` above 0), the block runs as it is: unfreezing would hand back theirs too.

    A block inside another (`recommend` planning each candidate, `fit_trainer` each change) runs as it is: the outer one
    froze already, or left the collector alone. `gc.get_freeze_count()` walks every frozen object (47 ms with torch and
    transformers frozen), so it is asked once, by the outermost block.
    """
    with _SPARING_LOCK:
        outermost = not _SPARING["depth"]
        _SPARING["depth"] += 1
    spare = False
    try:
        spare = outermost and gc.isenabled() and not _caller_froze()
        if spare:
            gc.freeze()
        yield
    finally:
        if spare:
            gc.unfreeze()
        with _SPARING_LOCK:
            _SPARING["depth"] -= 1


# How many `collector_spared` blocks are running (process-wide: the collector is; a plan on another thread meanwhile
# runs as it is, the collector already spared or left alone by the first).
_SPARING = {"depth": 0}
_SPARING_LOCK = threading.Lock()


def _caller_froze() -> bool:
    """Return whether the process holds frozen objects (a caller's `gc.freeze()`). A test session that froze its
    modules itself answers True here without the walk (tests/conftest.py)."""
    return gc.get_freeze_count() > 0


def isolated(function: F) -> F:
    """Decorate a planning entry point: it runs under `neutral_process_state()` and `collector_spared()`."""

    @wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with collector_spared(), neutral_process_state():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def throwaway_scaler(scaler: Any) -> Any:
    """Return a new GradScaler on the CPU with `scaler`'s settings and none of its state.

    The trace's tensors are CPU fakes; the scaler's own scale is a few bytes that no plan counts. `scaler` is not read
    beyond its settings, and never written."""
    if scaler is None:
        return None
    settings = {}
    for key, attr in (("init_scale", "_init_scale"), ("growth_factor", "_growth_factor"),
                      ("backoff_factor", "_backoff_factor"), ("growth_interval", "_growth_interval")):
        if hasattr(scaler, attr):
            settings[key] = getattr(scaler, attr)
    enabled = scaler.is_enabled() if hasattr(scaler, "is_enabled") else True
    return torch.amp.GradScaler("cpu", enabled=enabled, **settings)


_TRAINER_FIELDS = ("optimizer", "lr_scheduler", "_metrics", "_total_train_tokens")


@contextlib.contextmanager
def trainer_kept(trainer: Any) -> Iterator[None]:
    """Trace `trainer`'s step inside this block and find it as it was after: its GradScaler (swapped for a throwaway
    one for the duration), `args` fields, `state`, `control`, callbacks, optimizer, scheduler and logged metrics.

    None: nothing to keep (a planner-built Trainer is the planner's own)."""
    if trainer is None:
        yield
        return
    accelerator = getattr(trainer, "accelerator", None)
    scaler = getattr(accelerator, "scaler", None)
    args = getattr(trainer, "args", None)
    args_fields = dict(vars(args)) if args is not None else None
    kept = {k: getattr(trainer, k) for k in _TRAINER_FIELDS if hasattr(trainer, k)}
    copied = {k: copy.deepcopy(v) for k, v in kept.items() if k in ("_metrics", "_total_train_tokens")}
    state = copy.deepcopy(getattr(trainer, "state", None))
    control = copy.deepcopy(getattr(trainer, "control", None))
    handler = getattr(trainer, "callback_handler", None)
    callbacks = list(handler.callbacks) if handler is not None else None
    if scaler is not None:
        accelerator.scaler = throwaway_scaler(scaler)
    try:
        with rng_kept():
            yield
    finally:
        if scaler is not None:
            accelerator.scaler = scaler
        for key, value in kept.items():
            setattr(trainer, key, copied.get(key, value))
        for now, then in ((getattr(trainer, "state", None), state), (getattr(trainer, "control", None), control)):
            if now is not None and then is not None:  # in place: the training loop holds these objects
                vars(now).clear()
                vars(now).update(vars(then))
        if callbacks is not None:
            handler.callbacks[:] = callbacks
        if args_fields is not None:
            for key in [k for k in vars(args) if k not in args_fields]:
                del vars(args)[key]
            vars(args).update(args_fields)
