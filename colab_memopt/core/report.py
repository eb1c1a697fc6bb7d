"""Write one notebook's measured results as JSON, and merge them into one file.

On Colab `results_dir` is None and nothing is written; `make run` and the tests set it.
"""

from __future__ import annotations

import math
import platform
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from colab_memopt.core.fileio import nonfinite_paths, read_json_or_set_aside, write_json
from colab_memopt.core.measure import MemoryReport, format_bytes, max_reserved_bytes

VERDICTS = ("holds", "partly holds", "does not hold", "not measurable here")
# A `measured` text that opens by saying nothing was measured: such a claim gets no verdict but 'not measurable
# here' (a text that names one part not measurable after what was measured keeps its verdict).
NOT_MEASURED = re.compile(r"^\W*(not (measurable|measured)|nothing (was )?measured)\b", re.I)


@dataclass
class Claim:
    """A claim from the literature, what was measured here, and the verdict."""

    claim: str
    source: str
    measured: str
    verdict: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        for name in ("claim", "source", "measured"):
            if not str(getattr(self, name)).strip():
                raise ValueError(f"claim {name} must not be empty")
        if self.verdict != "not measurable here" and NOT_MEASURED.match(self.measured):
            raise ValueError(f"verdict {self.verdict!r} needs a measurement, but measured says {self.measured!r}: "
                             "use 'not measurable here' and say what would measure it")


def _entry(report: MemoryReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"label": report.label, "peak_bytes": report.peak_bytes, "step_seconds": report.step_seconds}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # a numpy scalar
        return _jsonable(value.item())
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not JSON-serialisable")


def record(
    name: str,
    *,
    baseline: MemoryReport,
    optimized: MemoryReport | None = None,
    metrics: Mapping[str, Any] | None = None,
    claims: Iterable[Claim | Mapping[str, str]] = (),
    results_dir: str | Path | None = None,
    seconds: float | None = None,
) -> dict[str, Any]:
    """Return one notebook's results and write them to `results_dir/<name>.json` when it is set.

    Args:
        name: the notebook's name, e.g. '00_where_the_memory_goes'.
        baseline, optimized: the reports the notebook compares (optimized may be None).
        metrics: the notebook's named figures (plain numbers, strings, or mappings of them).
        claims: `Claim`s, or dicts with claim, source, measured, verdict.
        results_dir: where to write; None writes nothing and prints nothing (Colab).
        seconds: the notebook's own wall time, if it measured it.

    A NaN or infinite metric is written as null, and named with its value under "nonfinite" (strict
    JSON has neither), with a warning. The file is written whole or not at all (`fileio.write_json`):
    a crash while writing keeps the previous result.
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name must be a notebook name without '/', got {name!r}")
    for label, report in (("baseline", baseline), ("optimized", optimized)):
        if not isinstance(report, MemoryReport) and not (label == "optimized" and report is None):
            allowed = "a MemoryReport" + (" or None" if label == "optimized" else "")
            raise TypeError(f"{label} must be {allowed} (from measure_step), got {type(report).__name__}")
    out = None
    if results_dir is not None:
        out = Path(results_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"results_dir must be a folder, got {str(out)!r}, which is a file")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"results_dir {str(out)!r} cannot be created: {exc.strerror or exc}") from exc
    checked = [c if isinstance(c, Claim) else Claim(**c) for c in claims]
    saving = time_ratio = None
    if optimized is not None:
        saving = 100.0 * (1 - optimized.peak_bytes / baseline.peak_bytes) if baseline.peak_bytes else None
        time_ratio = optimized.step_seconds / baseline.step_seconds if baseline.step_seconds else None
    entry = {
        "device": baseline.device,
        "seconds": seconds,
        "baseline": _entry(baseline),
        "optimized": _entry(optimized),
        "saving_pct": saving,
        "time_ratio": time_ratio,
        "metrics": _jsonable(dict(metrics or {})),
        "claims": [asdict(c) for c in checked],
        # the process's allocator high-water mark on CUDA (cached blocks included; None elsewhere): with the
        # CUDA context, what the notebook needed of the card (measure.max_reserved_bytes)
        "cuda_max_reserved_bytes": max_reserved_bytes(),
    }
    nonfinite = nonfinite_paths(entry)
    if nonfinite:
        entry = _nulled(entry)
        entry["nonfinite"] = {k: f"{v}: JSON has no NaN or infinity, written as null" for k, v in nonfinite.items()}
        warnings.warn(f"record({name!r}): {sorted(nonfinite)} are NaN or infinite; written as null (see 'nonfinite')",
                      RuntimeWarning, stacklevel=2)
    if out is not None:
        write_json(out / f"{name}.json", entry)
        print(f"recorded {len(entry['metrics'])} metrics and {len(entry['claims'])} claims in {out / f'{name}.json'}")
    return entry


def _nulled(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nulled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nulled(v) for v in value]
    return value


def merge_results(results_dir: str | Path) -> dict[str, Any]:
    """Return every notebook's record in `results_dir`, keyed by notebook name, with device and torch.

    A broken record (empty, cut short) is set aside as `<name>.json.broken-<time>` with a warning naming it, and
    the others are merged: one bad file never stops a run from recording what it measured."""
    notebooks = {}
    for p in sorted(Path(results_dir).glob("*.json")):
        entry = read_json_or_set_aside(p)
        if entry is not None:
            notebooks[p.stem] = entry
    devices = sorted({entry["device"] for entry in notebooks.values()})
    return {
        "device": devices[0] if len(devices) == 1 else devices,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "notebooks": notebooks,
    }


def summary_table(merged: Mapping[str, Any]) -> str:
    """Return a plain-text table: notebook, device, baseline and optimized peak, saving %, time ratio."""
    header = ("notebook", "device", "baseline peak", "optimized peak", "saving", "time ratio")
    rows = [header]
    for name, entry in merged["notebooks"].items():
        opt = entry.get("optimized")
        rows.append(
            (
                name,
                str(entry["device"]),
                format_bytes(entry["baseline"]["peak_bytes"]),
                format_bytes(opt["peak_bytes"]) if opt else "-",
                f"{entry['saving_pct']:.1f}%" if entry.get("saving_pct") is not None else "-",
                f"{entry['time_ratio']:.2f}x" if entry.get("time_ratio") is not None else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
