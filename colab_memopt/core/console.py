"""A quiet console: the libraries' notes a user cannot act on, hidden while the package works, shown on request.

Importing torchao, DeepSpeed, bitsandbytes, transformers or TRL, and tracing a step on fake tensors, prints lines
that say nothing about the user's run: torchao's CUDA-only extensions that a CPU build cannot load, torch's
deprecations of calls the libraries make, DeepSpeed's "Setting accelerator to CPU", transformers' renamed
arguments. `quiet()` hides them for the length of a `with` block or a decorated call, and puts back what it changed
afterwards: its two warning filters come out again (the filters a library adds while it is imported inside the
block stay, as they would without it) and the logging threshold (`logging.disable`) is restored. Nothing changes
when the package is imported.

    with cm.quiet():                    # the libraries' notes hidden
        from peft import LoraConfig
    with cm.quiet(verbose=True):        # everything shown, also inside the package's own quiet calls
        plan = cm.plan_trainer(args, model=model_id)

What stays visible inside: errors (exceptions, log records at ERROR and above), everything printed to stdout, and
warnings raised by this package's own modules (they name a setting of yours).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# The package's own modules: their warnings pass a quiet block (the filter's `module` is the warning's module name).
OWN_MODULES = r"colab_memopt(\.|$)"
# Set by quiet(verbose=True): the quiet blocks inside it show everything too.
_SHOW_ALL: contextvars.ContextVar[bool] = contextvars.ContextVar("colab_memopt_show_all", default=False)


def _check_verbose(verbose: Any) -> bool | None:
    if verbose is not None and not isinstance(verbose, bool):
        raise ValueError(f"verbose must be True, False or None, got {verbose!r}")
    return verbose


@contextlib.contextmanager
def quiet(verbose: bool | None = None) -> Iterator[None]:
    """Hide the libraries' warnings and log notes inside the block; take its filters out and restore the logging after.

    Args:
        verbose: True shows everything, here and in every quiet block inside this one (the package's own calls);
            False hides; None (the default) hides unless an enclosing `quiet(verbose=True)` shows.

    Hidden: every Python warning except those of this package's modules, and log records below ERROR from every
    logger. Works as a decorator too (`@quiet()`); each call enters afresh.

    Example:
        >>> with cm.quiet():
        ...     from trl import SFTConfig, SFTTrainer    # torchao's and torch's import notes hidden
    """
    verbose = _check_verbose(verbose)
    if verbose or (verbose is None and _SHOW_ALL.get()):
        token = _SHOW_ALL.set(True)
        try:
            yield
        finally:
            _SHOW_ALL.reset(token)
        return
    token = _SHOW_ALL.set(False)
    previous_disable = logging.root.manager.disable
    ours = [("default", None, Warning, re.compile(OWN_MODULES), 0), ("ignore", None, Warning, None, 0)]
    warnings.filters = [*ours, *warnings.filters]  # a new list, as warnings.catch_warnings makes
    warnings._filters_mutated()  # type: ignore[attr-defined] - what filterwarnings calls: no stale "once" records
    # logging.disable empties every logger's level cache (thousands of loggers with torch and transformers loaded):
    # called only where the level changes, so a quiet block inside another costs nothing there
    if previous_disable < logging.WARNING:
        logging.disable(logging.WARNING)
    try:
        yield
    finally:
        if logging.root.manager.disable != previous_disable:
            logging.disable(previous_disable)
        _SHOW_ALL.reset(token)
        # Take out the two filters put in above and keep the rest: a library imported inside the block adds its own
        # (transformers, torchao and TRL add nine at import), which warnings.catch_warnings would throw away.
        kept = list(warnings.filters)
        for entry in ours:
            for i, other in enumerate(kept):
                if other is entry:
                    del kept[i]
                    break
        warnings.filters = kept
        warnings._filters_mutated()  # type: ignore[attr-defined]


def quiet_unless_verbose(func: F) -> F:
    """Decorate a function with a `verbose` parameter: its call runs inside `quiet(...)`.

    `verbose=True` in the call shows everything; the default (False or None) hides the libraries' notes unless the
    call is inside `quiet(verbose=True)`.

    Example:
        >>> @quiet_unless_verbose
        ... def plan_trainer(args, *, model=None, verbose: bool = False): ...
    """
    signature = inspect.signature(func)
    parameter = signature.parameters.get("verbose")
    if parameter is None or parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        raise TypeError(f"quiet_unless_verbose needs a function with a 'verbose' parameter; "
                        f"{func.__qualname__}{signature} has none")
    default = None if parameter.default is inspect.Parameter.empty else parameter.default

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "verbose" in kwargs:
            verbose = kwargs["verbose"]
        else:
            try:
                verbose = signature.bind_partial(*args, **kwargs).arguments.get("verbose", default)
            except TypeError:  # the call itself is wrong: let the function say so
                verbose = default
        with quiet(True if verbose is True else None):
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def import_quietly(name: str) -> types.ModuleType:
    """Import the module `name` and return it, as `importlib.import_module` does, with its import notes hidden as in
    `quiet()` (a library prints them on its first import only).

    bitsandbytes (0.50), on a CPU with AVX512-BF16 (AMD Zen 4, Intel Sapphire Rapids), warns at import that an optional
    CPU kernel from the Hugging Face Hub is not installed; its 4-bit layers work without it.

    Example:
        >>> bnb = import_quietly("bitsandbytes")
    """
    module = sys.modules.get(name)
    if module is not None:
        return module
    with quiet():
        return importlib.import_module(name)
