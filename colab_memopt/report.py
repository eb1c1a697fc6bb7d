"""Write one notebook's measured results as JSON, and merge them into one file.

On Colab `results_dir` is None and nothing is written; `make run` and the tests set it.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from colab_memopt.measure import MemoryReport, format_bytes

VERDICTS = ("holds", "partly holds", "does not hold", "not measurable here")


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
        results_dir: where to write; None writes nothing (Colab).
        seconds: the notebook's own wall time, if it measured it.
    """
    if not name or "/" in name:
        raise ValueError(f"name must be a notebook name without '/', got {name!r}")
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
    }
    if results_dir is not None:
        out = Path(results_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(entry, indent=2) + "\n")
    return entry


def merge_results(results_dir: str | Path) -> dict[str, Any]:
    """Return every notebook's record in `results_dir`, keyed by notebook name, with device and torch."""
    notebooks = {p.stem: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))}
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
