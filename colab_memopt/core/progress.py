"""Progress lines for the planning calls that take long: one line per plan or search step, on stderr.

Planning traces a training step on fake tensors: a few seconds per plan on two CPU cores, and a search (the fitting
settings, the recommended recipe, the longest context, the largest batch) plans several. A call that runs longer
than `SHOW_AFTER_S` says what it is doing: one plain line per step on stderr, in a terminal and in a notebook alike
(plain lines, no carriage returns, so a notebook's output keeps every line). A call that answers sooner prints
nothing; once the time is up, the steps already begun are shown, then each step as it starts.

    with progress("fit_trainer"):             # the outermost block owns the lines
        for i, change in enumerate(changes, 1):
            say(f"plan {i}/{len(changes)}: {change}")

A progress block inside another (`recommend` planning each candidate, each plan searching its largest batch) adds
its lines to the outer one's, indented; only the outermost decides when they show.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar

# A call that runs longer than this (seconds) prints its progress lines.
SHOW_AFTER_S = 2.0
LINE_WIDTH = 100  # characters per printed line

F = TypeVar("F", bound=Callable[..., Any])


class _Lines:
    """The lines of one outermost call: held until the call has run `after_s` seconds, printed from then on."""

    def __init__(self, after_s: float, stream: TextIO | None) -> None:
        self.after_s = after_s
        self.stream = stream
        self.start = time.perf_counter()
        self.held: list[str] = []
        self.shown = False
        self.printed = 0  # lines printed
        self.lock = threading.Lock()
        self.timer = threading.Timer(after_s, self.show)
        self.timer.daemon = True

    def _write(self, lines: list[str]) -> None:
        stream = self.stream if self.stream is not None else sys.stderr  # read now: a notebook's or a test's stderr
        for line in lines:  # at most LINE_WIDTH characters, a longer step continued on indented lines
            indent = " " * (len(line) - len(line.lstrip()) + 4)
            for part in textwrap.wrap(line, LINE_WIDTH, subsequent_indent=indent, break_on_hyphens=False,
                                      drop_whitespace=True) or [line]:
                print(part, file=stream, flush=True)
            self.printed += 1

    def show(self) -> None:
        """Print the lines held so far and every later line at once (called when the time is up)."""
        with self.lock:
            if self.shown:
                return
            self.shown = True
            held, self.held = self.held, []
            self._write(held)

    def add(self, line: str) -> None:
        with self.lock:
            if not self.shown and time.perf_counter() - self.start < self.after_s:
                self.held.append(line)
                return
            if not self.shown:
                self.shown = True
                held, self.held = self.held, []
                self._write(held)
            self._write([line])


@dataclass(frozen=True)
class _Block:
    """A progress block: the outermost call's lines, this block's name and how deep it sits."""

    lines: _Lines
    what: str
    depth: int
    silent: bool = False  # a block inside another that reports nothing (a plan inside a search: the search's line)


_CURRENT: contextvars.ContextVar[_Block | None] = contextvars.ContextVar("colab_memopt_progress", default=None)


@contextlib.contextmanager
def progress(what: str, *, after_s: float | None = None, stream: TextIO | None = None,
             nested: bool = True) -> Iterator[None]:
    """Open a block whose steps `say()` reports as lines "what: text", shown once the outermost block runs long.

    Args:
        what: the call, in the user's words ("fit_trainer", "largest batch").
        after_s: seconds before the lines show (default `SHOW_AFTER_S`; 0 shows them at once); outermost block only.
        stream: where to print (default: sys.stderr as it is when a line is printed); outermost block only.
        nested: inside another progress block, whether this block's lines join the outer block's (indented by two
            spaces); False keeps them out (one plan of a search: the search already said which).
    """
    outer = _CURRENT.get()
    if outer is not None:
        token = _CURRENT.set(_Block(outer.lines, what, outer.depth + 1, outer.silent or not nested))
        try:
            yield
        finally:
            _CURRENT.reset(token)
        return
    lines = _Lines(SHOW_AFTER_S if after_s is None else after_s, stream)
    token = _CURRENT.set(_Block(lines, what, 0))
    lines.timer.start()
    try:
        yield
    finally:
        lines.timer.cancel()
        _CURRENT.reset(token)
    if lines.printed:  # an answer, after steps were shown (an error says itself, without a "done" line)
        lines.add(f"{what}: done in {time.perf_counter() - lines.start:.1f} s")


def say(text: str) -> None:
    """Report one step of the innermost progress block (nothing outside one)."""
    block = _CURRENT.get()
    if block is not None and not block.silent:
        block.lines.add(f"{'  ' * block.depth}{block.what}: {text}")


def shows_progress(what: str, *, nested: bool = True) -> Callable[[F], F]:
    """Decorate a function so that each call is a progress block named `what` (`nested` as `progress` takes it)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with progress(what, nested=nested):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
