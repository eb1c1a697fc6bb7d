"""A plan's answer: `Plan`, the predicted memory of one training step on a target, with its lines and its printout.

`Plan` holds the tensors at the step's peak (traced, or the analytic estimate), the lines a trace does not produce
(`Cost`: the CUDA context, the workspaces, transients inside one op, host RAM) and the verdict: `fits`,
`device_need_bytes`, the run's peak while loading. `str(plan)` is what a person reads first, `plan.explain()` every
figure with its source. `estimate_band` is the analytic estimate's measured error, shown where a plan is an estimate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from colab_memopt.core.measure import format_bytes
from colab_memopt.core.tracker import PHASES
from colab_memopt.planning.targets import Target


@dataclass
class Cost:
    """A line of the plan that the trace does not produce: what it is, its bytes, where the figure comes from."""

    name: str
    bytes: int
    source: str
    in_allocator: bool = False  # allocated through the caching allocator: inside max_memory_allocated
    in_step: bool = False  # allocated and freed inside each step (a transient): inside its foreign-corrected peak
    phases: tuple[str, ...] = PHASES  # an in-step transient: the phases it happens in, whose peaks it adds to


def step_peak_with_transients(peak_bytes: int, by_phase: dict[str, int], costs: list[Cost]) -> int:
    """Return a step's peak with its in-step transients (`Cost.in_step`), each added to the peak of the phases it
    happens in (`Cost.phases`), never below the traced peak; bytes. Without phases, each is added to the peak."""
    transients = [c for c in costs if c.in_step]
    if not by_phase:
        return peak_bytes + sum(c.bytes for c in transients)
    return max(peak_bytes, *(held + sum(c.bytes for c in transients if phase in c.phases) for phase, held in by_phase.items()))


def estimate_band() -> dict[str, Any]:
    """Return the analytic estimate's error against traces, as benchmarks/estimate_accuracy.py measured it."""
    from pathlib import Path

    from colab_memopt.core.fileio import read_json

    path = Path(__file__).with_name("estimate_band.json")
    return dict(read_json(path)) if path.exists() else {"source": "not measured (benchmarks/estimate_accuracy.py)"}


def describe_estimate_error(band: dict[str, Any]) -> str:
    """Return one line saying how far the analytic estimate was from traces."""
    if "cases" not in band:
        return f"the analytic estimate's error is {band.get('source', 'not measured')}"
    return (f"the analytic estimate was within 10% of the traced peak on {band['within_10pct']} of {band['cases']} "
            f"traced cases, off by {band['min_rel_error_pct']:+.0f}% to {band['max_rel_error_pct']:+.0f}% "
            f"({band['source']}); keep a margin or trace the step")


@dataclass
class Plan:
    """The predicted memory of one training step on a target."""

    model: str
    batch: int
    seq_len: int
    recipe: dict[str, Any]
    target: Target
    method: str  # 'trace' or 'analytic'
    peak_bytes: int  # tensors at the step's peak: what max_memory_allocated would show
    by_category: dict[str, int]
    by_phase: dict[str, int]
    by_phase_category: dict[str, dict[str, int]]  # the categories at each phase's peak
    device_costs: list[Cost]
    host_costs: list[Cost]
    headroom_fraction: float
    analytic_peak_bytes: int
    max_batch: int | None = None
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    optimizer_impl: str = "single-tensor"  # the optimizer implementation traced
    load_costs: list[Cost] = field(default_factory=list)  # the device at the peak of loading (CUDA, 4-bit bases)
    # how a figure was derived, where nothing is for you to change (a setting planned as set): in explain() only
    notes: list[str] = field(default_factory=list)
    # what to call next where the plan does not fit (the call that finds settings that fit), e.g. 'cm.fit_trainer(...)'
    next_call: str = ""
    defaults: list[str] = field(default_factory=list)  # the installed libraries' defaults assumed, with versions

    @property
    def device_need_bytes(self) -> int:
        """Return the device bytes the step needs: its peak with its transients, plus the fixed costs."""
        return self.step_peak_bytes + sum(c.bytes for c in self.device_costs if not c.in_step)

    @property
    def step_peak_bytes(self) -> int:
        """Return the step's own peak as `measure_step` reports it on CUDA (foreign bytes taken out): the tensors
        at the peak plus the step's transients the trace cannot see (`Cost.in_step`, e.g. 4-bit dequantization),
        each added to the peak of the phase it happens in (`by_phase`), not to a peak in another phase."""
        return step_peak_with_transients(self.peak_bytes, self.by_phase, self.device_costs)

    @property
    def load_need_bytes(self) -> int:
        """Return the device bytes at the peak of loading the model (0 where not planned: only CUDA 4-bit bases
        are, since there quantizing on the device can be the run's highest point)."""
        return sum(c.bytes for c in self.load_costs)

    @property
    def run_peak_bytes(self) -> int:
        """Return the run's peak device need: the higher of loading and the training step."""
        return max(self.device_need_bytes, self.load_need_bytes)

    @property
    def run_peak_phase(self) -> str:
        """Return which part of the run is highest: 'loading' or 'step'."""
        return "loading" if self.load_need_bytes > self.device_need_bytes else "step"

    @property
    def allocator_peak_bytes(self) -> int:
        """Return what `max_memory_allocated` would show for this step in a fresh process: the tensors at
        the peak plus the fixed costs allocated through the caching allocator (cuBLAS workspace)."""
        in_allocator = [c for c in self.device_costs if c.in_allocator]
        return (step_peak_with_transients(self.peak_bytes, self.by_phase, in_allocator)
                + sum(c.bytes for c in in_allocator if not c.in_step))

    @property
    def host_need_bytes(self) -> int:
        return sum(c.bytes for c in self.host_costs)

    @property
    def device_limit_bytes(self) -> int:
        """Return the device bytes a plan may use: capacity less the headroom kept for fragmentation."""
        return int(self.target.device_bytes * (1 - self.headroom_fraction))

    @property
    def host_limit_bytes(self) -> int:
        return int(self.target.host_bytes * (1 - self.headroom_fraction))

    @property
    def fits_device(self) -> bool:
        return self.device_need_bytes <= self.device_limit_bytes

    @property
    def fits_run(self) -> bool:
        """Return whether the whole run fits the device: loading (`load_costs`, by the path assumed there) and the step."""
        return self.run_peak_bytes <= self.device_limit_bytes

    @property
    def fits_host(self) -> bool:
        return self.host_need_bytes <= self.host_limit_bytes

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (what the CLI's --json prints)."""
        return {
            "model": self.model,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "recipe": self.recipe,
            "target": asdict(self.target),
            "method": self.method,
            "peak_bytes": self.peak_bytes,
            "by_category": self.by_category,
            "by_phase": self.by_phase,
            "by_phase_category": self.by_phase_category,
            "device_costs": [asdict(c) for c in self.device_costs],
            "host_costs": [asdict(c) for c in self.host_costs],
            "device_need_bytes": self.device_need_bytes,
            "host_need_bytes": self.host_need_bytes,
            "device_limit_bytes": self.device_limit_bytes,
            "host_limit_bytes": self.host_limit_bytes,
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "fits": self.fits,
            "max_batch": self.max_batch,
            "analytic_peak_bytes": self.analytic_peak_bytes,
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "optimizer_impl": self.optimizer_impl,
            "step_peak_bytes": self.step_peak_bytes,
            "load_costs": [asdict(c) for c in self.load_costs],
            "load_need_bytes": self.load_need_bytes,
            "run_peak_bytes": self.run_peak_bytes,
            "run_peak_phase": self.run_peak_phase,
            "fits_run": self.fits_run,
            "seconds": self.seconds,
            "warnings": self.warnings,
            "notes": self.notes,
            "defaults": self.defaults,
            "estimate": self.method == "analytic",
            "estimate_error": self.estimate_error,
        }

    @property
    def estimate_error(self) -> dict[str, Any] | None:
        """Return the analytic estimate's measured error against traces (None for a traced plan)."""
        return estimate_band() if self.method == "analytic" else None

    def __str__(self) -> str:
        """Return the answer first, then one line per figure (at most 100 characters); `explain()` has the sources."""
        from colab_memopt.core.wording import WIDTH, estimate_line, first_clause, warning_lines, wrap

        verdict = "fits" if self.fits else "DOES NOT FIT"
        why = [] if self.fits else [w for w, ok in (("device memory", self.fits_device), ("host RAM", self.fits_host)) if not ok]
        how = "traced" if self.method == "trace" else "ESTIMATE, not traced"
        spare = self.device_limit_bytes - self.device_need_bytes
        lines = wrap(f"{self.model}, batch {self.batch} x {self.seq_len} tokens on {self.target.name}: {verdict}"
                     + (f" ({' and '.join(why)})" if why else ""), rest="  ")
        lines.append(f"need {format_bytes(self.device_need_bytes)} of {format_bytes(self.device_limit_bytes)} usable "
                     + (f"({format_bytes(spare)} spare)" if spare >= 0 else f"(short by {format_bytes(-spare)})") + f"; {how}")
        if self.max_batch is not None:
            lines.append(f"largest batch that fits: {self.max_batch}")
        lines.append("device memory:")

        def row(sign: str, name: str, nbytes: int, note: str = "") -> str:
            head = f"  {sign}{name:{20 - len(sign)}s} {format_bytes(nbytes):>10s}"
            note = first_clause(note, WIDTH - len(head) - 2) if note else ""
            return f"{head}  {note}".rstrip()

        lines += [row("", c, b) for c, b in self.by_category.items() if b]
        lines.append(row("= ", "tensors at peak", self.peak_bytes))
        lines += [row("+ ", c.name, c.bytes, c.source) for c in self.device_costs]
        overlap = self.peak_bytes + sum(c.bytes for c in self.device_costs if c.in_step) - self.step_peak_bytes
        if overlap > 0:
            lines.append(row("- ", "off the peak", overlap, "a transient below the step's peak"))
        lines.append(row("= ", "need", self.device_need_bytes,
                         f"of {format_bytes(self.device_limit_bytes)} usable ({self.headroom_fraction:.0%} kept free)"))
        lines += wrap("peak by phase: " + ", ".join(f"{p} {format_bytes(b)}" for p, b in self.by_phase.items()))
        if self.load_costs:
            lines.append(f"run peak: {format_bytes(self.run_peak_bytes)}, while "
                         f"{'loading' if self.run_peak_phase == 'loading' else 'training'} (loading "
                         f"{format_bytes(self.load_need_bytes)}, step {format_bytes(self.device_need_bytes)})")
        lines.append(f"host RAM: need {format_bytes(self.host_need_bytes)} of {format_bytes(self.host_limit_bytes)} usable")
        if self.estimate_error:
            lines += wrap(estimate_line(self.estimate_error))
        lines += warning_lines(self.warnings)
        if not self.fits and self.next_call:
            lines += wrap(self.next_call, first="next: ", rest="  ")
        lines.append("where each figure comes from: plan.explain() (command line: --verbose)")
        return "\n".join(lines)

    def explain(self) -> str:
        """Return the whole plan: every figure with its source and derivation (what `--verbose` prints)."""
        lines = [
            f"plan: {self.model}, batch {self.batch} x {self.seq_len} tokens, on {self.target.name} "
            f"({self.target.description or format_bytes(self.target.device_bytes)}); method: {self.method}; "
            f"optimizer traced {self.optimizer_impl}",
            "device memory:",
        ]
        lines += [f"  {c:18s} {format_bytes(b):>12s}" for c, b in self.by_category.items() if b]
        lines.append(f"  {'= tensors at peak':18s} {format_bytes(self.peak_bytes):>12s}"
                     + (f"   (analytic estimate {format_bytes(self.analytic_peak_bytes)})"
                        if self.analytic_peak_bytes and self.method != "analytic" else ""))
        lines += [f"  + {c.name:16s} {format_bytes(c.bytes):>12s}   {c.source}" for c in self.device_costs]
        overlap = self.peak_bytes + sum(c.bytes for c in self.device_costs if c.in_step) - self.step_peak_bytes
        if overlap > 0:  # a transient of a phase below the step's peak
            lines.append(f"  - {'off the peak':16s} {format_bytes(overlap):>12s}   "
                         f"{', '.join(c.name for c in self.device_costs if c.in_step)}: in "
                         f"{'/'.join(sorted({p for c in self.device_costs if c.in_step for p in c.phases}))}, "
                         f"below the {max(self.by_phase, key=self.by_phase.get)} peak")
        lines.append(f"  {'= need':18s} {format_bytes(self.device_need_bytes):>12s}   of {format_bytes(self.device_limit_bytes)} "
                     f"usable ({format_bytes(self.target.device_bytes)} less {self.headroom_fraction:.0%} headroom)")
        lines.append("peak by phase: " + ", ".join(f"{p} {format_bytes(b)}" for p, b in self.by_phase.items()))
        if self.load_costs:
            lines.append("device memory while loading:")
            lines += [f"  {c.name:18s} {format_bytes(c.bytes):>12s}   {c.source}" for c in self.load_costs]
            lines.append(f"  {'= need':18s} {format_bytes(self.load_need_bytes):>12s}")
            lines.append(f"run peak: {format_bytes(self.run_peak_bytes)}, while {'loading' if self.run_peak_phase == 'loading' else 'training'} "
                         f"(loading {format_bytes(self.load_need_bytes)}, step {format_bytes(self.device_need_bytes)})")
        lines.append("host RAM:")
        lines += [f"  {c.name:18s} {format_bytes(c.bytes):>12s}   {c.source}" for c in self.host_costs]
        lines.append(f"  {'= need':18s} {format_bytes(self.host_need_bytes):>12s}   of {format_bytes(self.host_limit_bytes)} usable")
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        why = [] if self.fits else [w for w, ok in (("device memory", self.fits_device), ("host RAM", self.fits_host)) if not ok]
        lines.append(f"verdict: {verdict}" + (f" ({' and '.join(why)})" if why else "")
                     + f"; device headroom {format_bytes(self.device_limit_bytes - self.device_need_bytes)}")
        if self.estimate_error:
            lines.append(f"ESTIMATE, NOT TRACED: {describe_estimate_error(self.estimate_error)}")
        if self.max_batch is not None:
            lines.append(f"largest batch that fits: {self.max_batch}")
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"library default assumed: {d}" for d in self.defaults]
        lines += [f"note: {n}" for n in self.notes]
        if not self.fits and self.next_call:
            lines.append(f"next: {self.next_call}")
        return "\n".join(lines)
