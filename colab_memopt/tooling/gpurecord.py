"""What `make test-gpu` records as it runs: each step's result, results.json and claims.md, the archive, the summary.

Each step, notebook or slice item ends as a `StepResult`: passed, failed, "not finished" (stopped at, or not
started before, the run's deadline) or "not run" (a module it needs is absent), never a pass unless it passed.
`Recorder` merges each result into results.json the moment it comes (`write_outputs`: slices run in separate calls
add up), rewrites claims.md, and the one .tar.gz a lent machine returns (`write_archive`); `finish` prints the
summary table last and gives the exit status.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class StepResult:
    """One step of the run: passed, failed or skipped, how long, and what it found."""

    step: str
    status: str
    seconds: float
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


NOT_FINISHED = "not finished"  # stopped at (or not started before) the run's deadline: never a pass
NOT_RUN = "not run"  # left out for a reason the summary names (a module absent): not a pass either


def not_run_reason(missing: list[str]) -> str:
    """Return the detail of a notebook left out because `missing` modules are absent."""
    why = f"not run: {', '.join(missing)} not installed"
    return why + (" (one call carries no DeepSpeed sdist)" if "deepspeed" in missing else "")


def summary_table(label: str, steps: list[StepResult]) -> str:
    """Return the plain-text summary printed last: one row per step, then the verdict."""
    rows = [("step", "status", "seconds", "detail")]
    rows += [(s.step, s.status.upper() if s.status in ("failed", NOT_FINISHED) else s.status, f"{s.seconds:.0f}", s.detail[:90])
             for s in steps]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"make test-gpu on {label}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(2, "  ".join("-" * w for w in widths))
    failed = [s.step for s in steps if s.status == "failed"]
    unfinished = [s.step for s in steps if s.status == NOT_FINISHED]
    left_out = [s.step for s in steps if s.status == NOT_RUN]
    passed = len(steps) - len(failed) - len(unfinished) - len(left_out)
    lines.append(f"{passed} of {len(steps)} steps passed" + (f"; FAILED: {', '.join(failed)}" if failed else "")
                 + (f"; NOT FINISHED: {', '.join(unfinished)}" if unfinished else "")
                 + (f"; not run (reason above): {', '.join(left_out)}" if left_out else ""))
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """Return `value` with every NaN or infinite float inside it as None (strict JSON has neither; a step that
    measured one is still recorded)."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_outputs(out: Path, label: str, info: dict[str, Any], steps: list[StepResult]) -> dict[str, Any]:
    """Merge `steps` into out/results.json (a step run again replaces its earlier result; others are kept, so
    each slice of make test-gpu adds to what earlier calls wrote) and rewrite claims.md from every notebook
    record so far; return the merged payload.

    Slices run side by side in separate processes: the read, merge and both writes happen under one lock
    (`fileio.update_json`), each file replaced whole, so no writer loses another's result. A results.json that
    is not valid JSON (cut short by a killed call) is kept aside as results.json.broken-<time>, named in a
    warning, and the results recorded in a new one."""
    from colab_memopt.core.fileio import atomic_write_text, update_json
    from colab_memopt.core.report import merge_results
    from colab_memopt.tooling.rollup import claims_markdown

    path = out / "results.json"
    merged: dict[str, Any] = {}

    def update(old: Any) -> dict[str, Any]:
        old = old if isinstance(old, dict) else {}
        merged_steps = {s["step"]: s for s in old.get("steps", []) if isinstance(s, dict) and "step" in s}
        for s in steps:
            merged_steps[s.step] = _finite(asdict(s))
        results_dir = out / "results"
        found = merge_results(results_dir) if results_dir.is_dir() and any(results_dir.glob("*.json")) else {}
        merged.update(found or {"notebooks": {}})
        claims = claims_markdown(merged) if merged.get("notebooks") else "(no notebook ran)\n"
        atomic_write_text(out / "claims.md", f"# Claims checked on {label}\n\nTimings are this GPU's, not a T4's, "
                                             f"where it emulates one.\n\n{claims}")
        return {"label": label, "env": info or old.get("env", {}), "steps": list(merged_steps.values()),
                "notebooks": merged.get("notebooks", {}),
                "failed": [s["step"] for s in merged_steps.values() if s["status"] == "failed"],
                "not_finished": [s["step"] for s in merged_steps.values() if s["status"] == NOT_FINISHED],
                "not_run": [s["step"] for s in merged_steps.values() if s["status"] == NOT_RUN]}

    return update_json(path, update, empty={})


MiB = 2**20


ARCHIVE_LIMIT_BYTES = 15 * MiB  # a file back from $OUT may hold 16 MiB


LEFT_OUT = "LEFT_OUT.txt"


def write_archive(folder: Path, archive: Path, limit_bytes: int = ARCHIVE_LIMIT_BYTES) -> dict[str, list[str]]:
    """Write `folder` as one .tar.gz at `archive` (atomically: a run killed mid-write keeps the last whole one).

    Small files first (results, logs), the executed notebooks last; a file that would take the archive past
    `limit_bytes` (counted uncompressed: the archive is never larger) is left out and named in LEFT_OUT.txt."""
    import io
    import tarfile

    from colab_memopt.core.fileio import atomic_write

    sized = []
    for path in folder.rglob("*"):
        try:
            if (path.is_file() and path.name != LEFT_OUT and not path.name.endswith((".partial", ".lock"))
                    and not path.name.startswith(f".{archive.name}.") and path.resolve() != archive.resolve()):
                sized.append((path.parent.name == "notebooks", path.stat().st_size, str(path), path))
        except OSError:  # a temporary file renamed meanwhile
            continue
    files = [entry[-1] for entry in sorted(sized)]
    archive.parent.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    left_out: list[str] = []

    def save(tmp: Path) -> None:
        used = 4096  # the end-of-archive blocks and gzip's header
        with tarfile.open(tmp, "w:gz") as tar:
            for path in files:
                try:
                    data = path.read_bytes()  # a log still being written: what it holds now
                except OSError:
                    continue
                cost = 512 + -(-len(data) // 512) * 512 + 64
                if used + cost + 4096 > limit_bytes:
                    left_out.append(str(path.relative_to(folder)))
                    continue
                info = tarfile.TarInfo(f"{folder.name}/{path.relative_to(folder)}")
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
                written.append(str(path.relative_to(folder)))
                used += cost
            if left_out:
                note = ("left out to keep the archive under %d MiB:\n" % (limit_bytes // MiB) + "\n".join(left_out)
                        + "\n").encode()
                info = tarfile.TarInfo(f"{folder.name}/{LEFT_OUT}")
                info.size, info.mtime = len(note), int(time.time())
                tar.addfile(info, io.BytesIO(note))

    atomic_write(archive, save)
    return {"written": written, "left_out": left_out}


class Recorder:
    """Record each result as it comes (results.json at once, the archive at most every `every_s` seconds)."""

    def __init__(self, out: Path, label: str, info: dict[str, Any], archive: Path | None, every_s: float = 20.0):
        import threading

        self.out, self.label, self.info, self.archive, self.every_s = out, label, info, archive, every_s
        self.steps: list[StepResult] = []
        self.lock = threading.Lock()
        self.last_archive = 0.0
        if archive is not None:
            self.save_archive()  # something comes back even if the call is killed at once

    def __call__(self, result: StepResult) -> None:
        with self.lock:
            self.steps.append(result)
            print(f"  {result.step}: {result.status} ({result.seconds:.0f} s) {result.detail[:160]}", flush=True)
            try:
                write_outputs(self.out, self.label, self.info, [result])  # at once: a call stopped later keeps it
                if self.archive is not None and time.monotonic() - self.last_archive >= self.every_s:
                    self.save_archive()
            except Exception as exc:  # noqa: BLE001 - a record another slice is writing: the next result rewrites it
                print(f"  (results.json not rewritten after {result.step}: {type(exc).__name__}: {exc})", flush=True)

    def save_archive(self) -> None:
        """Rewrite the archive from the out folder now."""
        if self.archive is not None:
            write_archive(self.out, self.archive)
            self.last_archive = time.monotonic()

    def finish(self, text: str) -> None:
        """Write the summary (summary.txt) and the archive a last time."""
        with self.lock:
            from colab_memopt.core.fileio import atomic_write_text

            atomic_write_text(self.out / "summary.txt", text + "\n")
            self.save_archive()


def finish(record: Recorder, out: Path, label: str) -> int:
    """Print the summary table last, write it and the archive; return 1 if anything failed or did not finish."""
    text = summary_table(label, record.steps)
    measured = [f"{s.step.removeprefix('notebook ')} {s.seconds:.0f}" for s in record.steps if "estimate_seconds" in s.data
                and s.status in ("passed", "failed")]
    if measured:
        import textwrap

        text += "\n" + textwrap.fill("measured seconds (for tests/notebook_parameters_t4.yaml): " + ", ".join(measured),
                                     100, subsequent_indent="  ")
    print()
    print(text)
    print(f"\nmerged into {out / 'results.json'}; {out / 'claims.md'}, {out / 'env.json'}")
    record.finish(text)
    return 1 if any(s.status in ("failed", NOT_FINISHED) for s in record.steps) else 0
