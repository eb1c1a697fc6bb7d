"""Shape what a person reads: lines of at most `WIDTH` characters; a warning is wrapped, never cut short.

Every printout (`Plan`, `Recommendation`, `LongestContext`, `TrainerFit`, the guard's summary, `doctor`) gives the
answer first and one line per figure; the sources and derivations behind each figure are in its `explain()` (the
command line's `--verbose`). These helpers keep those lines short without dropping a word from `explain()`;
`short` cuts a figure's note (never a warning, which names a setting to change) at a clause, with `MORE`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

WIDTH = 100  # characters per line of a printout
MORE = "..."


def wrap(text: str, first: str = "", rest: str = "  ", width: int = WIDTH) -> list[str]:
    """Return `text` as lines of at most `width` characters, the first led by `first`, the others by `rest`."""
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=rest,
                         break_long_words=True, break_on_hyphens=False) or [first.rstrip()]


def short(text: str, limit: int) -> str:
    """Return `text` if it has at most `limit` characters, else its longest leading clause (cut at '; ', '. ' or
    ': ') that fits with `MORE` after it, else its first words that fit, with `MORE`."""
    if len(text) <= limit:
        return text
    room = limit - len(MORE)
    cuts = [i for sep in ("; ", ". ", ": ") for i in _find_all(text, sep) if 0 < i <= room]
    if cuts:
        return text[:max(cuts)] + MORE
    return text[:room].rsplit(" ", 1)[0] + MORE


def _find_all(text: str, sep: str) -> Iterable[int]:
    start = text.find(sep)
    while start >= 0:
        yield start
        start = text.find(sep, start + 1)


def first_clause(text: str, limit: int) -> str:
    """Return the words of `text` before its first '; ', ' (' or ': ' when they fit in `limit` characters, else ''."""
    cut = min((i for i in (text.find(s) for s in ("; ", " (", ": ", ", ")) if i > 0), default=len(text))
    head = text[:cut].strip()
    return head if len(head) <= limit else ""


def warning_lines(warnings: Iterable[str], width: int = WIDTH) -> list[str]:
    """Return one `warning:` entry per warning, wrapped to `width` characters, never cut short: a warning says a
    setting to change, and a cut one could drop the setting."""
    out: list[str] = []
    for w in warnings:
        out += wrap(w, first="warning: ", rest="  ", width=width)
    return out


def step_time(ratio: float, kinds: dict[str, str], device: str = "", device_class: str | None = None,
              against: str = "an fp32 AdamW step") -> str:
    """Return 'step time xN of <against> (prior|measured on ...)': N < 1 is faster, N > 1 slower.

    `kinds` maps each technique in the ratio to 'measured' or 'prior' (`costs.Slowdown.kinds`)."""
    priors = sorted(t for t, k in kinds.items() if k != "measured")
    measured = sorted(t for t, k in kinds.items() if k == "measured")
    where = f"measured on {device or device_class}"
    if not kinds:
        label = "nothing to time"
    elif not measured:
        label = f"prior: published figures, not measured on {'a ' + device_class if device_class else 'this device'}"
    elif not priors:
        label = where
    else:
        label = f"{where}; prior for {', '.join(priors)}"
    return f"step time x{ratio:.2f} of {against} ({label})"


def call_lines(name: str, fields: dict, indent: str = "  ", width: int = WIDTH) -> list[str]:
    """Return `name(k=v, ...)` as Python lines of at most `width` characters (continuations under the first field)."""
    parts = [f"{k}={_py(v)}," for k, v in fields.items()]
    if parts:
        parts[-1] = parts[-1][:-1] + ")"
    else:
        return [f"{indent}{name}()"]
    lead = f"{indent}{name}("
    pad = " " * len(lead)
    lines, line = [], lead
    for part in parts:
        sep = "" if line in (lead, pad) else " "
        if sep and len(line) + 1 + len(part) > width:
            lines.append(line)
            line, sep = pad, ""
        if len(line) + len(sep) + len(part) > width and "[" in part:  # a long list: its items over lines
            inner = " " * (len(line) + len(sep) + part.index("[") + 1)
            wrapped = textwrap.wrap(part, width=width, initial_indent=line + sep, subsequent_indent=inner,
                                    break_long_words=False, break_on_hyphens=False)
            lines += wrapped[:-1]
            line = wrapped[-1]
            continue
        line += sep + part
    lines.append(line)
    return lines


def _py(value: object) -> str:
    """Return `value` as Python source, small rates as people write them (2e-4, not 0.0002)."""
    if isinstance(value, float) and 0 < abs(value) < 1e-3:
        mantissa, exponent = f"{value:.6e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    return repr(value)


def estimate_line(band: dict) -> str:
    """Return one line on how far the analytic estimate was from traces (the source is in explain())."""
    if "cases" not in band:
        return "ESTIMATE, NOT TRACED: its error is not measured; keep a margin or trace the step"
    return (f"ESTIMATE, NOT TRACED: within 10% of the traced peak in {band['within_10pct']} of {band['cases']} cases "
            f"({band['min_rel_error_pct']:+.0f}% to {band['max_rel_error_pct']:+.0f}%); keep a margin")
