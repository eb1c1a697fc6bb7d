"""Will it fit? Predict a training step's peak memory without a GPU.

`plan` builds the model and optimizer under `FakeTensorMode` (shapes only, nothing allocated) and
runs one whole training step of the recipe, through the same `Recipe.build` and
`train.make_train_step` that real measurements use, with the same tensor tracker as
`measure.measure_step`. Where a model cannot be traced (data-dependent control flow, custom ops), it
falls back to the analytic estimate and says so.

What CUDA runs differently is planned as CUDA runs it: for a CUDA target the optimizer is traced in
the implementation torch picks there (foreach: `_default_to_fused_or_foreach` picks it for CUDA
tensors, and foreach AdamW's `_foreach_sqrt` holds a 4 B/param temporary for all parameters at
once), and the fixed bytes a step allocates through the caching allocator (the cuBLAS workspace) are
lines of the plan with their source. bitsandbytes' 8-bit layers run LLM.int8 there (the CPU's training
path dequantizes the weight instead): traced with no outlier column, since which input columns are
outliers depends on the values, and said to be a lower bound (`_int8_as_on_cuda`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from colab_memopt.planning import estimate
from colab_memopt.techniques.attention import traced_attention
from colab_memopt.techniques.checkpointing import checkpoint_offloader
from colab_memopt.core.env import COLAB_HOST_RAM_BYTES, T4_USABLE_BYTES, GiB
from colab_memopt.core.isolation import isolated
from colab_memopt.core.measure import format_bytes, host_memory
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.tracker import _CUDA_MIN_BLOCK, PHASES, TensorTracker
from colab_memopt.training.train import make_train_step


@dataclass(frozen=True)
class Target:
    """A device to plan for: its usable memory, host RAM and fixed costs.

    `device_bytes` is what PyTorch reports as the GPU's total capacity; `cuda_context_bytes` is taken
    from it before any tensor exists (the CUDA context and kernels, which neither
    `max_memory_allocated` nor the tracker sees).
    """

    name: str
    device_bytes: int
    host_bytes: int
    cuda_context_bytes: int = int(0.75 * GiB)
    description: str = ""
    cuda: bool = True
    compute_capability: tuple[int, int] | None = None
    optimizer_impl: str = "auto"  # how the device runs torch's optimizers; 'auto': foreach on CUDA, else single-tensor

    def __post_init__(self) -> None:
        for key in ("device_bytes", "host_bytes", "cuda_context_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"target {key} must be an integer number of bytes, got {value!r}")
        if self.cuda_context_bytes < 0:
            raise ValueError(f"target cuda_context_bytes must be >= 0, got {self.cuda_context_bytes}")
        if self.device_bytes <= 0 or self.host_bytes <= 0:
            raise ValueError(
                f"target device_bytes and host_bytes must be > 0, got {self.device_bytes} and {self.host_bytes}"
            )


# Device capacities are what PyTorch reports for the card (a T4 shows 14.74 GiB: Colab's OOM messages);
# for the others the vendor's nominal size less what the driver keeps, as PyTorch typically reports it.
# Host RAM is the Colab runtime's where one exists. The CUDA context (0.5-2 GB, FACTS.md) is an
# assumption until measured with NVML on the card.
TARGETS: dict[str, Target] = {
    "t4": Target("t4", T4_USABLE_BYTES, COLAB_HOST_RAM_BYTES, description="Colab free tier: T4 (14.74 GiB), 12.7 GB RAM",
                 compute_capability=(7, 5)),
    "l4": Target("l4", int(22.03 * GiB), int(53e9), description="Colab L4 runtime: 22 GiB usable of 24 GB, 53 GB RAM",
                 compute_capability=(8, 9)),
    "a100-40gb": Target("a100-40gb", int(39.39 * GiB), int(83.5e9), description="A100 40GB (Colab high-RAM: 83.5 GB)",
                        compute_capability=(8, 0)),
    "a100-80gb": Target("a100-80gb", int(79.15 * GiB), int(170e9), description="A100 80GB", compute_capability=(8, 0)),
    "h100-80gb": Target("h100-80gb", int(79.11 * GiB), int(200e9), description="H100 80GB", compute_capability=(9, 0)),
}

# How the optimizer runs its update: 'foreach' (one kernel over all tensors; what torch picks for CUDA
# tensors), 'single-tensor' (a loop over tensors; what torch picks on the CPU); 'auto' follows the target.
OPTIMIZER_IMPLS = ("auto", "foreach", "single-tensor")


def set_optimizer_impl(optimizer: torch.optim.Optimizer, impl: str) -> torch.optim.Optimizer:
    """Make a torch optimizer run its 'foreach' or 'single-tensor' implementation, whatever the device.

    Used to trace (and to measure on the CPU) what CUDA runs: torch defaults to foreach for CUDA
    tensors and to single-tensor on the CPU. Optimizers without a `foreach` option (bitsandbytes,
    this project's Lion and Adam-mini) are left as they are; `*_in_backward` optimizers are set per
    parameter. Returns the optimizer.
    """
    if impl not in ("foreach", "single-tensor"):
        raise ValueError(f"impl must be 'foreach' or 'single-tensor', got {impl!r}")
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, dict):  # OptimizerInBackward: one optimizer per parameter
        for opt in inner.values():
            set_optimizer_impl(opt, impl)
        return optimizer
    base = getattr(optimizer, "base_optimizer", None)
    if isinstance(base, torch.optim.Optimizer):  # BAdam: torch's AdamW over the trained block
        set_optimizer_impl(base, impl)
        for group in optimizer.param_groups:
            group["foreach"] = impl == "foreach"
        return optimizer
    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = impl == "foreach"
    return optimizer


# torch's default CUBLAS_WORKSPACE_CONFIG (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize):
# ':4096:2:16:8' (8 MiB + 128 KiB), and 32 MiB on sm_90 (Hopper: `major == 9 && minor == 0`).
_CUBLAS_DEFAULT_BELOW_SM90 = 4096 * 1024 * 2 + 16 * 1024 * 8
_CUBLAS_DEFAULT_SM90 = 4096 * 1024 * 8


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None, config: str | None = None) -> tuple[int, str]:
    """Return (bytes, source) of the cuBLAS workspace a step's first matmul allocates on a CUDA device.

    torch allocates it through the caching allocator (so `max_memory_allocated` includes it), once
    per (cuBLAS handle, stream). `config` is a `CUBLAS_WORKSPACE_CONFIG` value (':SIZE_KiB:COUNT' pairs,
    e.g. ':4096:8'); None or '': torch's default for the capability. A plan never reads this machine's environment
    (it plans the target's run, which may be on another machine): pass the run's own value where it sets one.

    Example:
        >>> cublas_workspace_bytes((7, 5))[0]   # a T4: 8,519,680 bytes
    """
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if not pairs or "".join(f":{a}:{b}" for a, b in pairs) != config.strip():
            raise ValueError(f"CUBLAS_WORKSPACE_CONFIG must be ':SIZE_KiB:COUNT' pairs such as ':4096:8', got {config!r}")
        return sum(int(a) * 1024 * int(b) for a, b in pairs), f"CUBLAS_WORKSPACE_CONFIG={config} (as given)"
    if compute_capability is not None and tuple(compute_capability) == (9, 0):  # `major == 9 && minor == 0` there
        return _CUBLAS_DEFAULT_SM90, "torch's default cuBLAS workspace on sm_90 (32 MiB, CublasHandlePool.cpp)"
    return _CUBLAS_DEFAULT_BELOW_SM90, ("torch's default cuBLAS workspace below sm_90 (':4096:2:16:8' = 8,519,680 B, "
                                        "CublasHandlePool.cpp), through the caching allocator")


_CUBLASLT_DEFAULT_KIB = 1024  # CublasHandlePool.cpp, parseCUDABlasLtWorkspaceSize: "default size in KiB according to #73328"
_CUBLAS_SOURCE = "https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/cuda/CublasHandlePool.cpp"


def cublaslt_workspace_bytes(config: str | None = None, unified: str | None = None) -> tuple[int, str]:
    """Return (bytes, source) of the cuBLASLt workspace torch allocates per (handle, stream) on CUDA.

    `config` is a `CUBLASLT_WORKSPACE_SIZE` value in KiB (None or '': torch's default, 1024 KiB; a plan never reads
    this machine's environment); `unified` a `TORCH_CUBLASLT_UNIFIED_WORKSPACE` value: when it is '1'/'true',
    cuBLASLt calls share the cuBLAS workspace and allocate nothing of their own (0 bytes). torch allocates it
    through the caching allocator on the first cuBLASLt matmul of a thread (`getCUDABlasLtWorkspace`):
    `addmm` with a bias, every `nn.Linear` with one, goes there.

    Example:
        >>> cublaslt_workspace_bytes("", "")[0]   # 1 MiB
        1048576
    """
    if unified and unified.strip().lower() in ("1", "true", "on", "yes", "y"):
        return 0, f"TORCH_CUBLASLT_UNIFIED_WORKSPACE={unified}: cuBLASLt shares the cuBLAS workspace ({_CUBLAS_SOURCE})"
    if config:
        if not config.strip().isdigit():
            raise ValueError(f"CUBLASLT_WORKSPACE_SIZE must be a size in KiB such as '1024', got {config!r}")
        return int(config) * 1024, f"CUBLASLT_WORKSPACE_SIZE={config} KiB (as given)"
    return _CUBLASLT_DEFAULT_KIB * 1024, (f"torch's default cuBLASLt workspace (1024 KiB, parseCUDABlasLtWorkspaceSize; "
                                          f"a separate one unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1: {_CUBLAS_SOURCE})")


def cuda_workspace_costs(compute_capability: tuple[int, int] | None) -> list[Cost]:
    """Return the plan lines of the cuBLAS and cuBLASLt workspaces a training step holds on CUDA.

    torch keys each workspace by (cuBLAS handle, stream) (`setWorkspaceForHandle`,
    `cublas_handle_stream_to_workspace` in CublasHandlePool.cpp) and a handle belongs to one thread
    (`thread_local` pool window in `getCurrentCUDABlasHandle`). A step runs its matmuls on two threads:
    forward (and the optimizer) on the caller's, backward on the autograd engine's device thread, so it
    holds two cuBLAS workspaces; the forward's biased Linears (`addmm` through cuBLASLt) add a cuBLASLt
    workspace. All are allocated through the caching allocator at the first step and kept: inside
    `max_memory_allocated`, outside a later step's foreign-corrected peak. Sizes are torch's defaults for the
    capability: a plan does not read this machine's `CUBLAS_WORKSPACE_CONFIG` and the like (`cublas_workspace_bytes`
    and `cublaslt_workspace_bytes` take a run's own values).
    """
    workspace, source = cublas_workspace_bytes(compute_capability)
    lt, lt_source = cublaslt_workspace_bytes()
    costs = [
        Cost("cuBLAS workspace", workspace, f"forward thread's handle: {source}", in_allocator=True),
        Cost("cuBLAS workspace (autograd thread)", workspace,
             f"backward's matmuls run on the autograd engine's device thread, whose own cuBLAS handle gets its own "
             f"workspace (handles are per thread, workspaces per (handle, stream): {_CUBLAS_SOURCE}); {source}",
             in_allocator=True),
    ]
    if lt:
        costs.append(Cost("cuBLASLt workspace", lt, f"addmm with a bias (nn.Linear) runs cuBLASLt: {lt_source}", in_allocator=True))
    return costs


def get_target(target: str | Target | dict[str, Any]) -> Target:
    """Return a target from its name, a `Target`, or a dict with device_bytes and host_bytes."""
    if isinstance(target, Target):
        return target
    if isinstance(target, dict):
        allowed = {"name", "device_bytes", "host_bytes", "cuda_context_bytes", "description", "cuda", "compute_capability",
                   "optimizer_impl"}
        unknown = sorted(set(target) - allowed)
        if unknown or "device_bytes" not in target or "host_bytes" not in target:
            raise ValueError(f"a target dict needs device_bytes and host_bytes (allowed keys {sorted(allowed)}), got {sorted(target)}")
        return Target(**{"name": "custom", **target})
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {sorted(TARGETS)} or give device_bytes and host_bytes")
    return TARGETS[target]


def check_headroom(headroom: Any) -> float:
    """Return `headroom` if it is a number in [0, 1), else raise ValueError naming it."""
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1) (the fraction of memory kept free), got {headroom!r}")
    return float(headroom)


def max_positions(model: nn.Module) -> int | None:
    """Return the longest sequence a built model's config accepts (seq_len, max_position_embeddings, n_positions), or None."""
    config = getattr(model, "config", None)
    for key in ("seq_len", "max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_seq_len(seq_len: Any, limit: int | None, name: str) -> int:
    """Return `seq_len` if it is an integer in [1, limit], else raise ValueError naming it and the limit."""
    if seq_len is None or isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len {seq_len} exceeds {name!r}'s maximum of {limit}")
    return seq_len


def shape_model(model_factory: Callable[[], nn.Module], name: str = "model_factory") -> nn.Module:
    """Build the model on the meta device (shapes only); raise TypeError if the factory is not a zero-argument model builder."""
    import inspect

    if not callable(model_factory):
        raise TypeError(f"{name} must be a model name or a zero-argument function that builds the model, "
                        f"got {type(model_factory).__name__}")
    try:
        inspect.signature(model_factory).bind()
    except TypeError as exc:
        raise TypeError(f"{name} must be callable with no arguments ({exc}); wrap it: lambda: build(...)") from None
    except ValueError:  # a builtin without a signature: try it
        pass
    with torch.device("meta"), _fake_safe_module_to():  # a factory that moves its model to its device: a no-op here
        model = model_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name} must return a torch.nn.Module, it returned {type(model).__name__}")
    return model


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


def _step_fits(trace: Any, costs: list[Cost], limit_bytes: int) -> bool:
    """Return whether a traced step (a `_Trace`) with `costs` needs at most `limit_bytes`, as `Plan.device_need_bytes` counts."""
    fixed = sum(c.bytes for c in costs if not c.in_step)
    return step_peak_with_transients(trace.peak_bytes, trace.by_phase, costs) + fixed <= limit_bytes


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
        return "\n".join(lines)


class _FakeBatches:
    """Stand-in for the corpus under fake tensors: random token ids of the right shape.

    `rows` > batch_size yields the first batch_size rows of a (rows, seq_len) tensor: a view that keeps the
    whole batch's storage alive, as the step of every micro-batch does (`_Tracer._step`)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.rows = 0

    def batches(self, batch_size: int, seq_len: int, *, seed: int = 0, device: Any = "cpu", split: str = "train") -> Iterator[torch.Tensor]:
        while True:
            rows = max(batch_size, self.rows)
            yield torch.randint(0, self.vocab_size, (rows, seq_len), device=device)[:batch_size]


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}: it needs .config.vocab_size")
    return int(vocab)


@dataclass
class _Trace:
    peak_bytes: int
    by_category: dict[str, int]
    by_phase: dict[str, int]
    phase_categories: dict[str, dict[str, int]]
    activation_peak: int = 0
    hidden_bytes: int = 0  # the largest buffer freed inside one op, unseen by the trace (math attention's scores)


@contextlib.contextmanager
def _fake_safe_module_to() -> Iterator[None]:
    """Make `nn.Module.to` and `nn.Module.cuda` work on modules built on the meta device or under FakeTensorMode.

    `Module._apply` swaps fake parameters with `torch.utils.swap_tensors`, which refuses any tensor
    that has a weak reference, and FakeTensorMode keeps one to each of its tensors: so `.to()` fails
    on every fake-built module (peft and transformers call it while building). Meta tensors cannot be
    copied to a device at all. Here a device move of meta or fake tensors is a no-op (the plan is for
    the target, wherever the factory or the Trainer wanted the weights; a real tensor is never moved:
    that raises), and a dtype change is done in place with `.data`, which keeps shared (tied)
    parameters shared.
    """
    from torch._subclasses.fake_tensor import is_fake

    original_to, original_cuda = nn.Module.to, nn.Module.cuda

    def move(self: nn.Module, device: Any, dtype: torch.dtype | None) -> nn.Module:
        with torch.no_grad():
            for t in [*self.parameters(), *self.buffers()]:
                if device is not None and t.device.type != torch.device(device).type and not (t.is_meta or is_fake(t)):
                    raise ValueError(f"cannot plan a model that moves its real tensors to {device} while it is built")
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t.data = t.data.to(dtype)
        return self

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return move(self, device, dtype)

    def cuda(self: nn.Module, device: Any = None) -> nn.Module:
        return move(self, torch.device("cuda", device) if isinstance(device, int) else device or "cuda", None)

    nn.Module.to, nn.Module.cuda = to, cuda  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to, nn.Module.cuda = original_to, original_cuda  # type: ignore[method-assign]


FOUR_BIT_BLOCKSIZE = 64  # bitsandbytes' Linear4bit / Params4bit default, as quantization._bnb_linear builds them


def traced_linear4bit(linear: nn.Module, scheme: str, *, compress_statistics: bool = True) -> nn.Module:
    """Return a stand-in for `quantization._bnb_linear(linear, scheme)` that works on fake tensors.

    bitsandbytes' `Params4bit` is a tensor subclass that cannot wrap a fake tensor. This module holds
    the exact storage of a real `Linear4bit` as a plain frozen parameter, made by bitsandbytes' own
    `quantize_4bit` (which has fake kernels): the packed weight ((out * in + 1) // 2 bytes of uint8),
    the nested quantization state (uint8 absmax per 64-value block, fp32 absmax per 256 of those,
    the offset and both code books), and the bias. Its forward is `Linear4bit.forward` itself, so the
    step traces bitsandbytes' `matmul_4bit` (dequantize, linear; dequantize again in backward) and
    peft wraps it as it wraps a real 4-bit layer. `tests/test_planner.py` pins its bytes to a real
    `Linear4bit` per quant type. `compress_statistics=False`: one fp32 absmax per block, not nested
    (BitsAndBytesConfig's default `bnb_4bit_use_double_quant=False`).
    """
    import bitsandbytes as bnb

    class TracedLinear4bit(bnb.nn.Linear4bit):
        def __init__(self) -> None:  # noqa: D107 - built from `linear` below, not from sizes
            nn.Module.__init__(self)

    from colab_memopt.techniques.quantization import _as_linear

    linear = _as_linear(linear)
    w = linear.weight.detach()
    packed, state = bnb.functional.quantize_4bit(w, blocksize=FOUR_BIT_BLOCKSIZE, quant_type=scheme,
                                                 compress_statistics=compress_statistics, quant_storage=torch.uint8)
    new = TracedLinear4bit()
    new.in_features, new.out_features = linear.in_features, linear.out_features
    weight = nn.Parameter(packed, requires_grad=False)
    for name, value in (("quant_state", state), ("blocksize", FOUR_BIT_BLOCKSIZE),
                        ("compress_statistics", compress_statistics), ("quant_type", scheme),
                        ("quant_storage", torch.uint8), ("bnb_quantized", True)):
        setattr(weight, name, value)
    new.weight = weight
    new.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    new.compute_dtype, new.compute_type_is_set = w.dtype, True
    new.quant_state, new.quant_storage, new.support_avx512bf16_for_cpu = None, torch.uint8, False
    return new


def traced_linear8bit(linear: nn.Module, threshold: float | None = None) -> nn.Module:
    """Return a stand-in for `quantization._bnb_linear(linear, 'bnb_int8')` that works on fake tensors.

    bitsandbytes' `Int8Params` is a tensor subclass that cannot wrap a fake tensor. This module is a
    `Linear8bitLt` holding the exact storage of a real one after its first forward, made by bitsandbytes'
    own `int8_vectorwise_quant` (which has a fake kernel) from the fp16 weight, as `Int8Params` does: the
    int8 weight (out x in bytes) as a plain frozen parameter, which is also `state.CB`; the fp32 row
    scales `state.SCB` (4 bytes per output row, kept in the layer's state, not as a parameter); and the
    bias. Its forward is `Linear8bitLt.forward` itself, so the step traces `bitsandbytes.matmul` (on the
    CPU, in training: the whole weight dequantized to the input's dtype in forward and again in
    backward) and peft wraps it as it wraps a real 8-bit layer. `tests/test_planner.py` pins its tensors
    to a real `Linear8bitLt`.
    """
    import bitsandbytes as bnb

    from colab_memopt.techniques.quantization import INT8_THRESHOLD, _as_linear

    class TracedLinear8bitLt(bnb.nn.Linear8bitLt):
        def __init__(self) -> None:  # noqa: D107 - built from `linear` below, not from sizes
            nn.Module.__init__(self)

    linear = _as_linear(linear)
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(linear.weight.detach().to(torch.float16))  # (out, in) int8, (out,) fp32
    new = TracedLinear8bitLt()
    new.in_features, new.out_features, new.index = linear.in_features, linear.out_features, None
    weight = nn.Parameter(cb, requires_grad=False)
    weight.CB, weight.SCB, weight.has_fp16_weights = None, None, False  # moved to `state` at the first forward
    new.weight = weight
    new.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    new.state = bnb.MatmulLtState()
    new.state.threshold = INT8_THRESHOLD if threshold is None else threshold
    new.state.has_fp16_weights = False
    new.state.use_pool = new.state.threshold > 0.0
    new.state.CB, new.state.SCB = cb, scb
    return new


def _int8_layers(model: nn.Module) -> list[nn.Module]:
    """Return the bitsandbytes 8-bit linear layers of `model` (real or stand-ins)."""
    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        return []
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]


@contextlib.contextmanager
def _int8_as_on_cuda() -> Iterator[None]:
    """Trace bitsandbytes' 8-bit matmul as CUDA runs it, with no outlier column, for the duration.

    On CUDA, `bitsandbytes.matmul` runs `MatMul8bitLt` (LLM.int8: the input quantized to int8 per row,
    an int8 matmul, the input's columns holding a value of magnitude >= the threshold multiplied in 16
    bits beside it and kept for backward); on the CPU, in training, it runs `MatMul8bitFp` (the weight
    dequantized). The fake tensors here are CPU tensors, so `bitsandbytes.matmul` is pointed at
    `MatMul8bitLt` for the duration. Which columns are outliers depends on the values: bitsandbytes'
    fake kernels give them a size fake tensors cannot count, so for the duration the fake kernels of
    `int8_vectorwise_quant`, `int8_double_quant` and `int8_mixed_scaled_mm` say "no outlier column",
    as the real kernels do on inputs below the threshold. The plan then is a lower bound for inputs
    that have outliers (the plan's warning gives the bytes per outlier column). Restored afterwards.
    """
    import logging

    import bitsandbytes as bnb
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState
    from torch._library.simple_registry import singleton
    from torch._library.utils import Kernel

    def vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows = A.numel() // A.shape[-1]
        outliers = None if threshold == 0.0 else A.new_empty(0, dtype=torch.int64)
        return torch.empty(A.shape, device=A.device, dtype=torch.int8), torch.empty(rows, device=A.device, dtype=torch.float32), outliers

    def double_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, ...]:
        rows = A.numel() // A.shape[-1]
        return (torch.empty_like(A, dtype=torch.int8), torch.empty_like(A, dtype=torch.int8),
                torch.empty(rows, device=A.device, dtype=torch.float32), torch.empty(A.shape[-1], device=A.device, dtype=torch.float32),
                A.new_empty(0, dtype=torch.int64))

    def mixed_scaled_mm(A: torch.Tensor, CA: torch.Tensor, CB: torch.Tensor, SCA: torch.Tensor, SCB: torch.Tensor,
                        outlier_cols: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # bitsandbytes' own no-outlier branch: the output, and an empty `subA` of the input's dtype
        return torch.empty((*CA.shape[:-1], CB.shape[0]), device=A.device, dtype=A.dtype), torch.empty(0, device=A.device, dtype=A.dtype)

    def matmul(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, state: MatmulLtState | None = None,
               threshold: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
        state = state or MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return MatMul8bitLt.apply(A, B, out, bias, state)

    kernels = [(singleton.find(f"bitsandbytes::{name}").fake_impl, Kernel(fn, "colab_memopt.planning.planner: no outlier column"))
               for name, fn in (("int8_vectorwise_quant", vectorwise_quant), ("int8_double_quant", double_quant),
                                ("int8_mixed_scaled_mm", mixed_scaled_mm))]
    log = logging.getLogger(MatMul8bitLt.__module__)  # "inputs will be cast ... to float16", once per layer and step
    original_matmul, level = bnb.matmul, log.level
    for holder, kernel in kernels:
        holder.kernels.append(kernel)  # the newest fake kernel is the one that runs
    bnb.matmul = matmul
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        bnb.matmul = original_matmul
        log.setLevel(level)
        for holder, kernel in kernels:
            holder.kernels.remove(kernel)


def quantization_scale_bytes(model: nn.Module, *, cuda_rounding: bool = False) -> int:
    """Return the bytes bitsandbytes keeps beside the quantized weights of `model`, outside its parameters.

    `Linear8bitLt`'s fp32 row scales (`state.SCB`) and `Linear4bit`'s absmax and offset
    (`quantization._quant_state_tensors`), each tensor once. Neither the tracker (which counts
    parameters, buffers, gradients, optimizer state and what the step allocates) nor a plan's tensors at
    peak include them; on CUDA they are inside `max_memory_allocated` (`cuda_rounding`: each rounded
    up to the caching allocator's 512-byte blocks).
    """
    from colab_memopt.techniques.quantization import _quant_state_tensors

    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        return 0
    seen: dict[int, int] = {}
    for mod in model.modules():
        weight = getattr(mod, "weight", None)
        if isinstance(mod, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) and isinstance(weight, torch.Tensor):
            for t in _quant_state_tensors(weight, mod):
                nbytes = t.numel() * t.element_size()
                seen[id(t)] = -(-nbytes // _CUDA_MIN_BLOCK) * _CUDA_MIN_BLOCK if cuda_rounding else nbytes
    return sum(seen.values())


def _int8_outlier_warning(model: nn.Module, batch: int, seq_len: int, recipe: Recipe, target: Target) -> str:
    """Return the plan's warning for 8-bit bases traced as CUDA runs them: what the trace cannot know."""
    from colab_memopt.techniques.quantization import INT8_THRESHOLD

    tokens = -(-batch // max(1, recipe.accumulation_steps)) * seq_len
    value_bytes = 2 if recipe.precision in ("bf16", "bf16-autocast", "fp16-autocast") else 4
    per_column, every_column = int8_outlier_bytes(model, tokens, value_bytes)
    scratch = max((tokens * m.out_features * (4 + 2) for m in _int8_layers(model)), default=0)
    return (f"bnb_int8 on {target.name} is traced as CUDA runs LLM.int8 (MatMul8bitLt) with no outlier column: this "
            f"plan is a lower bound. Input columns holding a value of magnitude >= {INT8_THRESHOLD} are kept in the "
            f"input's dtype until backward: {format_bytes(per_column)} for one such column in each of the "
            f"{len(_int8_layers(model))} 8-bit layers, {format_bytes(every_column)} if every column were one; the int8 matmul's own scratch "
            f"(an int32 and a 16-bit copy of a layer's output, up to {format_bytes(scratch)}) is not traced either. "
            "Not yet checked against a GPU measurement; on the CPU the 8-bit path is traced exactly")


def int8_outlier_bytes(model: nn.Module, tokens: int, value_bytes: int) -> tuple[int, int]:
    """Return (bytes per outlier column, bytes if every column were one) that LLM.int8 keeps for backward.

    On CUDA each 8-bit layer keeps, until backward, its input's outlier columns in the input's dtype
    (`subA`: `tokens` values of `value_bytes` per column); the trace assumes none. The first figure is
    one outlier column in every 8-bit layer, the second every input column of every layer an outlier.
    """
    layers = _int8_layers(model)
    return tokens * value_bytes * len(layers), sum(tokens * value_bytes * m.in_features for m in layers)


@contextlib.contextmanager
def _fake_safe_bitsandbytes(mode: Any, recipe: Recipe, *, cuda: bool = False) -> Iterator[None]:
    """Let bitsandbytes' 8-bit optimizers and its 4-bit and 8-bit layers be built under fake tensors, for the duration.

    Both build the 256-value dynamic code book with `.tolist()` on a tensor, a value fake tensors
    cannot give; here the code book is built for real and handed to the fake mode, and bitsandbytes'
    cache of it is emptied for the duration and restored afterwards (a real code book cannot enter a
    fake op, and a fake one left there would break later real calls).
    4-bit layers are built as `traced_linear4bit` stand-ins, 8-bit ones as `traced_linear8bit`. The steps
    themselves trace: bitsandbytes registers fake implementations of its update, quantize and dequantize
    ops. With `cuda`, 8-bit layers are traced as CUDA runs them (`_int8_as_on_cuda`).
    """
    from colab_memopt.techniques import quantization
    from colab_memopt.techniques.optimizers import BNB_OPTIMIZERS, IN_BACKWARD_SUFFIX

    four_bit = recipe.quantization in ("nf4", "fp4") and recipe.quantization_phase == "all"
    eight_bit = recipe.quantization == "bnb_int8" and recipe.quantization_phase == "all"
    # GaLore's 8-bit optimizer is bitsandbytes' with a projection: the same code book.
    if (recipe.optimizer.removesuffix(IN_BACKWARD_SUFFIX) not in (*BNB_OPTIMIZERS, "galore_adamw8bit") and not four_bit
            and not eight_bit):
        yield
        return
    import bitsandbytes.functional as bnb_functional
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original_map, original_linear = bnb_functional.create_dynamic_map, quantization._bnb_linear
    cached = dict(bnb_functional.name2qmap)

    def create_dynamic_map(*args: Any, **kwargs: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            real = original_map(*args, **kwargs)
        return mode.from_tensor(real, static_shapes=True)

    def bnb_linear(linear: nn.Module, scheme: str) -> nn.Module:
        if scheme == "bnb_int8":
            return traced_linear8bit(linear)
        return traced_linear4bit(linear, scheme) if scheme in ("nf4", "fp4") else original_linear(linear, scheme)

    bnb_functional.create_dynamic_map = create_dynamic_map
    bnb_functional.name2qmap.clear()  # a real code book cached by an earlier real call cannot enter a fake op
    quantization._bnb_linear = bnb_linear
    try:
        with _int8_as_on_cuda() if cuda and eight_bit else contextlib.nullcontext():
            yield
    finally:
        bnb_functional.create_dynamic_map = original_map
        quantization._bnb_linear = original_linear
        bnb_functional.name2qmap.clear()
        bnb_functional.name2qmap.update(cached)


@contextlib.contextmanager
def _fake_safe_low_state(recipe: Recipe) -> Iterator[None]:
    """Let the optimizers with almost no state (`lowstate`) step on fake tensors, for the duration.

    - torchao's low-bit states build their code books with Python comparisons on tensor values (cached
      as plain floats afterwards): here they are built for real first, as bitsandbytes' are.
    - APOLLO's norm-growth limiter takes Python's `max(norm_ratio, 1.01)` of a 0-d tensor, a branch on
      its value: the trace takes the branch where the update norm grew by more than 1% (the limiter
      acts, `max` returns the tensor). Where it did not, the real step holds one 0-d tensor (4 bytes)
      less for an instant: the traced optimizer phase is exact or 4 bytes above it; the state and the
      full-size temporaries are the same either way.
    """
    base = recipe.optimizer.removesuffix("_in_backward")
    if base in ("torchao_adamw8bit", "torchao_adamw4bit"):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torchao.optim import subclass_4bit, subclass_8bit

        with unset_fake_temporarily():
            for module in (subclass_8bit, subclass_4bit):
                module.get_qmap_signed()
                module.get_qmap_unsigned()
        yield
        return
    if base not in ("apollo", "apollo_mini"):
        yield
        return
    import builtins

    from apollo_torch import apollo

    def tensor_safe_max(a: Any, b: Any) -> Any:
        if isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            return a  # the limiter acts: see above
        return builtins.max(a, b)

    apollo.max = tensor_safe_max  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del apollo.max  # back to the builtin


@contextlib.contextmanager
def _fake_safe_transformers() -> Iterator[None]:
    """Let transformers choose the attention mask it chooses on real data, for the duration.

    Without a KV cache (training with checkpointing, `use_cache=False`), transformers reads the position
    ids to detect packed sequences; on fake tensors it cannot read them and assumes packing: it then
    builds a (B, 1, T, T) mask, which turns off SDPA's causal kernel and its grouped-query attention
    (keys and values repeated per head). The planner's batches are contiguous windows, never packed,
    so here the detection answers "not packed", as it does on the real batch: without this, full
    checkpointing at 1024 tokens was over-predicted by up to 50% on GQA models (llama, qwen2, mistral,
    phi3, gpt_neox; tests/test_architectures.py checks it).
    """
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _prime_optimizer(optimizer: Any, recipe: Recipe) -> bool:
    """Give every trainable parameter a zero gradient and run one optimizer step (its state now exists), as a
    warm-up step leaves them; return False where only a whole step can do it (an optimizer that steps in
    backward, phase-aware training)."""
    from colab_memopt.techniques.optimizers import steps_in_backward

    if (not isinstance(optimizer, torch.optim.Optimizer) or steps_in_backward(recipe.optimizer)
            or recipe.phase_offload is not None or recipe.uses_deepspeed or recipe.layer_offload_active):
        return False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    return True


# Traces of named models within this process (the recommender, its modes and the explore panel plan the same
# recipes again):
# (model name, traced recipe, seq_len, batch, CUDA rounding, optimizer implementation) -> trace.
_TRACE_CACHE: dict[tuple[Any, ...], Any] = {}
_TRACE_CACHE_SIZE = 256


def clear_trace_cache() -> None:
    """Forget the traces `plan` cached in this process."""
    _TRACE_CACHE.clear()


@contextlib.contextmanager
def _fake_safe_lomo(recipe: Recipe) -> Iterator[None]:
    """Let AdaLomo's update run under fake tensors, for the duration.

    lomo-optim 0.1.1 computes `max(eps, p_rms)` with Python's `max` on a 0-dim tensor, which asks
    for the tensor's value; fake tensors have none. The same value as a `torch.clamp` (a 0-dim tensor,
    as `max` returns when p_rms is larger) traces.
    """
    if recipe.optimizer != "adalomo":
        yield
        return
    import builtins

    import lomo_optim.adalomo as adalomo

    def tensor_max(a: Any, b: Any) -> Any:
        if torch.is_tensor(b) and not torch.is_tensor(a):
            return torch.clamp(b, min=a)
        return builtins.max(a, b)

    adalomo.max = tensor_max  # a module global shadows the builtin
    try:
        yield
    finally:
        del adalomo.max


@contextlib.contextmanager
def _fake_safe_scalers(recipe: Recipe) -> Iterator[None]:
    """Let fp16's loss scalers step under fake tensors, for the duration: fp16 is traced in fp16.

    A scaler skips the update of a step whose gradients hold an inf or NaN, a branch on their values,
    which fake tensors do not have: the trace takes the clean step (the update applied), with the same
    checks' tensors. torch's GradScaler (fp16 autocast) sums `found_inf.item()` before stepping;
    lomo-optim's scaler (LOMO in fp16) reads `float(grad.float().sum())` per gradient (its fp32 copy is
    traced). `rounding.DynamicLossScaler` and AdaLomo's check in `lomo.fused_step` see fake tensors themselves.
    """
    patches: list[tuple[Any, str, Any]] = []
    if recipe.precision == "fp16-autocast":
        def maybe_opt_step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
            return optimizer.step(*args, **kwargs)

        patches.append((torch.amp.GradScaler, "_maybe_opt_step", maybe_opt_step))
    if recipe.precision == "fp16" and recipe.optimizer == "lomo":
        from lomo_optim.lomo import DynamicLossScaler

        def has_inf_or_nan(self: Any, x: torch.Tensor) -> bool:
            x.float().sum()
            return False

        patches.append((DynamicLossScaler, "_has_inf_or_nan", has_inf_or_nan))
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


class _Tracer:
    """Build the model once under fake tensors, warm it up, then trace steps at any batch size."""

    def __init__(self, model_factory: Callable[[], nn.Module], recipe: Recipe, seq_len: int, *, cuda_rounding: bool, batch: int = 1,
                 optimizer_impl: str = "single-tensor", capability: tuple[int, int] | None = None) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # allow_scalar_outputs: `loss.item()` in the step returns a symbolic float instead of failing.
        self.mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True))
        self.seq_len = seq_len
        self.recipe = recipe
        self.cuda_rounding = cuda_rounding
        self.capability = capability  # the CUDA target's, for its SDPA kernels (None: the CPU's)
        self._cache: dict[int, _Trace] = {}
        # On a CUDA target bitsandbytes' 8-bit layers run LLM.int8's kernels, traced with no outlier column.
        self.int8_as_on_cuda = cuda_rounding and recipe.quantization == "bnb_int8" and recipe.quantization_phase == "all"
        with self.mode, _fake_safe_module_to(), _fake_safe_bitsandbytes(self.mode, recipe, cuda=cuda_rounding), \
                _fake_safe_transformers(), _fake_safe_lomo(recipe), _fake_safe_low_state(recipe), _fake_safe_scalers(recipe), \
                traced_attention(capability):
            model = model_factory()
            self.model, self.optimizer = recipe.build(model)
            set_optimizer_impl(self.optimizer, optimizer_impl)
            self.batches = _FakeBatches(_vocab_size(self.model))
            # A warm-up creates the optimizer state and the gradients, as a real warm-up step does. Where the
            # optimizer steps after backward, one optimizer step on zero gradients does it without the forward
            # and backward (half a plan's time on a big model; tests/test_planner.py pins the peaks to
            # real measurements); otherwise a whole step, at the batch that is planned.
            if not _prime_optimizer(self.optimizer, recipe):
                self._step(batch)()

    def _step(self, batch: int) -> Callable[[], Any]:
        recipe, self.batches.rows = self.recipe, batch
        if recipe.accumulation_steps > 2:
            # Trace the first two micro-batches and the optimizer step, with the whole batch's token ids alive: from
            # the second micro-batch on each one runs with the gradients already there and no more rows than the
            # second (micro_batch_sizes puts the larger ones first), so the later ones repeat its peak. The same
            # peak as all n passes (tests/test_planner.py measures it), in two of them.
            from colab_memopt.techniques.accumulation import micro_batch_sizes

            batch = sum(micro_batch_sizes(batch, recipe.accumulation_steps)[:2])
            recipe = recipe.with_(accumulation_steps=2)
        return make_train_step(self.model, self.optimizer, self.batches, batch_size=batch, seq_len=self.seq_len, recipe=recipe)

    def trace(self, batch: int) -> _Trace:
        if batch not in self._cache:
            self._cache[batch] = self._trace(batch)
        return self._cache[batch]

    def _trace(self, batch: int) -> _Trace:
        with self.mode, _fake_safe_transformers(), _fake_safe_lomo(self.recipe), _fake_safe_low_state(self.recipe), \
                _fake_safe_scalers(self.recipe), _int8_as_on_cuda() if self.int8_as_on_cuda else contextlib.nullcontext(), \
                traced_attention(self.capability) as sdpa:
            step = self._step(batch)
            scaler = getattr(step, "scaler", None)
            if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled():
                # a real warm-up step leaves the GradScaler's scale and growth tracker allocated (8 bytes)
                scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
            tracker = TensorTracker(device=torch.device("cpu"), cuda_rounding=self.cuda_rounding)
            tracker.track_external(self.model, self.optimizer)
            with tracker:
                step()
        return _Trace(
            tracker.peak_bytes,
            dict(tracker.peak_categories),
            {p: tracker.phase_peaks.get(p, 0) for p in PHASES},
            {p: dict(c) for p, c in tracker.phase_peak_categories.items()},
            tracker.category_peaks["activations"],
            sdpa.hidden_bytes if sdpa is not None else 0,
        )


MATH_ATTENTION_LINE = "math attention scores (inside one op)"


def _with_math_attention(costs: list[Cost], trace: Any, target: Target) -> list[Cost]:
    """Return `costs` with the math-attention line of `trace` (another batch's trace holds another score size)."""
    kept = [c for c in costs if c.name != MATH_ATTENTION_LINE]
    return kept + ([math_attention_cost(trace.hidden_bytes, target)] if trace.hidden_bytes else [])


def math_attention_cost(hidden_bytes: int, target: Target) -> Cost:
    """Return the in-step line of the score buffer SDPA's math kernel frees inside one op (traced calls that the
    target runs with math: `attention.expected_cuda_backend`), counted once: one call at a time holds it."""
    cc = target.compute_capability
    where = f"{target.name} (sm_{cc[0]}{cc[1]})" if cc is not None else target.name
    return Cost(MATH_ATTENTION_LINE, hidden_bytes,
                f"SDPA runs its math kernel on {where} for some attention calls (grouped-query heads without a mask "
                "need flash, sm_80+ and fp16/bf16; bf16 needs sm_80+); inside `_safe_softmax` it frees one batch x heads "
                "x T x T fp32 score tensor that the trace cannot see: the largest, once", in_allocator=True, in_step=True)


def _grouped_query(model: Any) -> bool:
    """Return whether a transformers model has fewer key/value heads than query heads (grouped-query attention)."""
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    config = get() if callable(get) else config
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    return isinstance(heads, int) and isinstance(kv, int) and kv < heads


def math_attention_warning(target: Target) -> str:
    """Return the warning of a plan whose attention runs SDPA's math kernel on the target: T x T scores per layer."""
    return (f"attention runs SDPA's math kernel on {target.name}: T x T scores per layer (planned); for a "
            "grouped-query model, colab_memopt.techniques.attention.repeat_kv_for_sdpa(model) runs the O(T) kernel")


_BATCH_CAP = 10**6


def _activation_max_batch(trace: _Trace, batch: int, budget_bytes: int) -> int:
    """Guess the largest batch under `budget_bytes` from one trace.

    The peak is the larger of a part that does not grow with the batch (model states, and the
    previous step's gradients at the start of the step) and model states plus activations, which
    grow linearly: activations per sample come from the activation peak, exact at any batch.
    """
    if trace.peak_bytes > budget_bytes and batch == 1:
        return 0
    per_sample = trace.activation_peak / batch
    fwd = trace.phase_categories.get("forward", {})
    states = fwd.get("parameters", 0) + fwd.get("buffers", 0) + fwd.get("optimizer_state", 0)
    if per_sample <= 0:
        return _BATCH_CAP
    return max(0, int((budget_bytes - states) / per_sample))


def _secant_step(at_guess: _Trace, guess: int, first: _Trace, budget_bytes: int) -> int:
    """Correct a batch guess with the trace at that guess: re-fit the bytes per sample above the states."""
    fwd = first.phase_categories.get("forward", {})
    states = fwd.get("parameters", 0) + fwd.get("buffers", 0) + fwd.get("optimizer_state", 0)
    per_sample = (at_guess.peak_bytes - states) / guess
    if per_sample <= 0:
        return guess
    return max(1, int((budget_bytes - states) / per_sample))


def _linear_max_batch(trace: _Trace, batch: int, budget_bytes: int) -> int:
    """Return the largest batch whose peak fits `budget_bytes` from one estimate: activations (and, outside
    the optimizer step, temporaries) per sample, the rest fixed. Used when there is no trace."""
    best = math.inf
    for phase, peak in trace.by_phase.items():
        cats = trace.phase_categories.get(phase, {})
        per_sample = (cats.get("activations", 0) + (cats.get("temporaries", 0) if phase != "optimizer" else 0)) / batch
        fixed = peak - per_sample * batch
        if fixed > budget_bytes:
            return 0
        if per_sample > 0:
            best = min(best, (budget_bytes - fixed) / per_sample)
    return int(best) if best != math.inf else _BATCH_CAP


# The max-batch search traces at most this many loop rounds of the chunked loss and tiled MLPs per step (or 4x the
# asked batch's): their trace time grows with the batch (about 0.1 s a round on a CPU), other ops' does not.
_SEARCH_LOOP_ROUNDS = 32


def _search_batch_cap(meta_model: nn.Module, rec: Recipe, batch: int, seq_len: int) -> int | None:
    """Return the largest batch the max-batch search may trace (None: no bound needed): where the recipe loops over
    tokens (loss_chunk_tokens, mlp_tile_tokens) a trace runs a round per chunk or tile, so its time grows with the
    batch; the bound keeps each trace at most `_SEARCH_LOOP_ROUNDS` rounds (or 4x the asked batch's)."""
    per_sample = 0.0
    if isinstance(rec.loss_chunk_tokens, int):
        per_sample += seq_len / rec.loss_chunk_tokens
    if rec.mlp_tile_tokens is not None:
        from colab_memopt.techniques.tiling import find_mlps

        per_sample += len(find_mlps(meta_model)) * seq_len / rec.mlp_tile_tokens
    if per_sample == 0:
        return None
    return max(4 * batch, int(_SEARCH_LOOP_ROUNDS / per_sample), rec.accumulation_steps)


def _verified_max_batch(
    fits: Callable[[int], bool], guess: int, max_traces: int = 16, *, lower: int = 1, upper: int | None = None
) -> tuple[int, bool]:
    """Return (largest batch >= `lower` that fits, or 0 if none; whether the boundary was found).

    `fits` traces one step. The guess is usually right within one, so this gallops away from it
    (1, 2, 4, ... batches) until the answer changes, then bisects: two traces when the guess is
    right, about 2*log2(error) otherwise. Batches below `lower` (the accumulation steps) are not valid;
    batches above `upper` are not tried (where `upper` fits, the answer is `upper`, not converged).
    """
    traces = 0

    def probe(b: int) -> bool:
        nonlocal traces
        if upper is not None and b > upper:
            return False
        traces += 1
        return fits(b)

    guess = max(guess, lower)
    if upper is not None:
        guess = min(guess, max(upper, lower))
    step = 1
    if probe(guess):
        lo, hi = guess, None
        while hi is None and traces < max_traces:
            if probe(lo + step):
                lo += step
                step *= 2
            else:
                hi = lo + step
    else:
        lo, hi = None, guess
        while lo is None and traces < max_traces:
            b = max(lower, hi - step)
            if b == hi:  # `lower` itself does not fit
                lo = lower - 1
            elif probe(b):
                lo = b
            else:
                hi = b
                step *= 2
    if lo is None or hi is None:
        return (lo if lo is not None and lo >= lower else 0), False
    while hi - lo > 1 and traces < max_traces:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    capped = upper is not None and lo == upper and hi == upper + 1  # `upper + 1` was never tried
    return (lo if lo >= lower else 0), hi - lo <= 1 and not capped


# bitsandbytes 0.50.2, backends/cuda/ops.py: the `gemm_4bit` CUDA kernel's dispatch. At or below 4 rows (tokens)
# the fused cgemm_4bit kernel always runs; above 1536 the unfused fallback always does; between, a per-GPU heuristic.
FOUR_BIT_FUSED_MAX_TOKENS = 4  # _GEMM_4BIT_CUSTOM_FLOOR_M
FOUR_BIT_FALLBACK_ABOVE_TOKENS = 1536  # _gemm_4bit_custom_max_m (CUDA)
_BNB_CUDA_OPS = "bitsandbytes 0.50.2 backends/cuda/ops.py"


def _round_block(nbytes: int) -> int:
    return -(-nbytes // _CUDA_MIN_BLOCK) * _CUDA_MIN_BLOCK


def four_bit_dequant_bytes(numel: int, itemsize: int, *, nested: bool, blocksize: int = FOUR_BIT_BLOCKSIZE) -> int:
    """Return the device bytes bitsandbytes allocates on CUDA to dequantize (or to quantize) one 4-bit weight.

    The weight in `itemsize`-byte floats and, with nested (double-quantized) statistics, the per-block fp32
    absmax twice (dequantized, then shifted by the offset; `_dequant_linear_fallback`, `quantize_4bit`), each
    rounded up to the caching allocator's 512-byte blocks.

    Example:
        >>> four_bit_dequant_bytes(4096 * 4096, 2, nested=True)   # 32 MiB + 2 x 1 MiB
        35651584
    """
    blocks = -(-numel // blocksize)
    return _round_block(numel * itemsize) + (2 * _round_block(blocks * 4) if nested else 0)


def _four_bit_numels(meta_model: nn.Module) -> list[int]:
    """Return the weight sizes of the layers a 4-bit recipe quantizes (`quantization.linear_layers`: lm_head kept)."""
    from colab_memopt.techniques.quantization import linear_layers

    return [mod.weight.numel() for _, mod in linear_layers(meta_model)]


def _four_bit_path(spec: Any, recipe: Recipe, target: Target, meta_model: nn.Module) -> tuple[bool, torch.dtype]:
    """Return (quantized by transformers while loading, the dtype the weights are quantized from and computed in)."""
    from colab_memopt.training.loading import has_weights, load_dtype
    from colab_memopt.techniques.precision import BASE_DTYPES
    from colab_memopt.training.presets import BF16_TARGETS
    from colab_memopt.techniques.quantization import linear_layers

    if has_weights(spec):  # loading.load_model: BitsAndBytesConfig, compute dtype = load dtype
        return True, load_dtype(recipe, "cuda", native_bf16=target.name in BF16_TARGETS)
    if recipe.base_dtype is not None:  # Recipe.build: the frozen base cast before quantize_model
        return False, BASE_DTYPES[recipe.base_dtype]
    weights = [mod.weight.dtype for _, mod in linear_layers(meta_model)]
    return False, weights[0] if weights else torch.float32


def four_bit_step_costs(meta_model: nn.Module, spec: Any, recipe: Recipe, target: Target, batch: int,
                        seq_len: int) -> list[Cost]:
    """Return the plan lines of what a 4-bit (QLoRA) step allocates on CUDA that a CPU trace does not see.

    bitsandbytes' `MatMul4Bit.forward` calls the `gemm_4bit` op. Its CUDA kernel either runs the fused
    `cgemm_4bit` kernel (output only) or, above 1536 tokens per micro-batch always and between 5 and 1536 by
    a per-GPU heuristic, `_dequant_linear_fallback`: the layer's whole weight dequantized to the compute dtype
    (and a nested absmax to fp32, twice), `F.linear`, then freed. That happens inside the op: the fake kernel
    the trace runs allocates only the output, and the CUDA tracker cannot see inside an op either (it lands in
    `untracked`). One layer at a time, so the largest layer's bytes are added once, to the peak of the phase it
    happens in (`Plan.step_peak_bytes`): forward, and backward too where checkpointing recomputes the forward
    there; an upper bound within that phase. Backward's dequantization (`MatMul4Bit.backward`:
    `F.dequantize_4bit`) is a Python call of ops the trace runs, so it is traced already. Empty unless the
    recipe trains a 4-bit base.
    """
    if recipe.quantization not in ("nf4", "fp4") or recipe.quantization_phase != "all":
        return []
    numels = _four_bit_numels(meta_model)
    tokens = -(-batch // recipe.accumulation_steps) * seq_len
    if not numels or tokens <= FOUR_BIT_FUSED_MAX_TOKENS:
        return []
    by_transformers, dtype = _four_bit_path(spec, recipe, target, meta_model)
    nbytes = four_bit_dequant_bytes(max(numels), dtype.itemsize, nested=not by_transformers)
    when = (f"{tokens} tokens per micro-batch > {FOUR_BIT_FALLBACK_ABOVE_TOKENS}: always this path" if tokens > FOUR_BIT_FALLBACK_ABOVE_TOKENS
            else f"{tokens} tokens per micro-batch: the fused kernel or this path by a per-GPU heuristic "
                 "(_gemm_4bit_use_custom_cuda); planned as this path, an upper bound")
    # in forward; in backward too where checkpointing recomputes the forward there
    recomputes = recipe.checkpointing != "none" or recipe.compression_checkpointing
    return [Cost("4-bit dequantized weight", nbytes,
                 f"{_BNB_CUDA_OPS} _dequant_linear_fallback: the largest 4-bit layer's weight ({max(numels):,} values) "
                 f"dequantized to {str(dtype).removeprefix('torch.')}"
                 f"{' with its nested absmax in fp32 twice' if not by_transformers else ''} inside gemm_4bit, once per "
                 f"layer call ({when}); not in the trace (the fake kernel allocates only the output)",
                 in_allocator=True, in_step=True, phases=("forward", "backward") if recomputes else ("forward",))]


def four_bit_load_costs(meta_model: nn.Module, spec: Any, recipe: Recipe, target: Target, model_bytes: int) -> list[Cost]:
    """Return the plan lines of the device at the peak of loading a 4-bit base onto CUDA (empty otherwise).

    Two paths, as `loading.load_model` and `Recipe.build` take them:
    - a checkpoint (hub id or folder with weights): transformers quantizes each weight as it arrives on the
      device (`integrations/bitsandbytes.py`: `Params4bit(value, ...).to(value.device)`, per tensor), so the
      peak is the loaded model (`model_bytes`: the step's parameters and buffers, and the quantization scales)
      plus one weight in the load dtype (an upper bound: the largest one, as if it came last);
    - no checkpoint (our named models, random weights): the whole model is on the device in its own dtype
      before `quantize_model` replaces its layers one by one, each cloned (`quantization._bnb_linear`) and
      quantized there (`Params4bit._quantize` -> `quantize_4bit`: its absmax in fp32, and again less the
      offset for nested statistics), so the peak is the unquantized model plus one clone and its absmax.
    The CUDA context is a line of both, as in the step.
    """
    if not target.cuda or recipe.quantization not in ("nf4", "fp4") or recipe.quantization_phase != "all":
        return []
    numels = _four_bit_numels(meta_model)
    if not numels:
        return []
    by_transformers, dtype = _four_bit_path(spec, recipe, target, meta_model)
    context = Cost("CUDA context", target.cuda_context_bytes, "assumed, as in the step")
    name = str(dtype).removeprefix("torch.")
    if by_transformers:
        return [context,
                Cost("loaded 4-bit model", model_bytes, "the step's parameters and buffers (traced; adapters included) "
                     "and the quantization scales: what loading leaves on the device", in_allocator=True),
                Cost("weight being quantized", four_bit_dequant_bytes(max(numels), dtype.itemsize, nested=False),
                     f"transformers loads each weight to the device in {name} and quantizes it there "
                     "(integrations/bitsandbytes.py, Params4bit.to -> bitsandbytes quantize_4bit); the largest, "
                     "counted as if it came last", in_allocator=True)]
    seen: dict[int, torch.Tensor] = {id(t): t for t in [*meta_model.parameters(), *meta_model.buffers()]}
    quantize = four_bit_dequant_bytes(max(numels), dtype.itemsize, nested=True)
    # precision.half_frozen_base casts tensor by tensor (Module.to): the whole model plus one tensor in base_dtype
    cast = max((_round_block(t.numel() * dtype.itemsize) for t in seen.values() if t.is_floating_point()
                and t.dtype != dtype), default=0) if recipe.base_dtype is not None else 0
    lines = [context,
             Cost("unquantized model", sum(_round_block(t.numel() * t.element_size()) for t in seen.values()),
                  "the model as built, on the device before it is cast (base_dtype) and quantized", in_allocator=True)]
    if cast > quantize:
        return [*lines, Cost("tensor being cast", cast, f"the model is cast to {name} tensor by "
                             "tensor before it is quantized (Module.to): the largest tensor's new copy", in_allocator=True)]
    return [*lines, Cost("weight being quantized", quantize,
                         f"each layer's weight ({name}) is cloned and bitsandbytes quantizes the clone "
                         f"on the device (quantize_4bit: absmax in fp32, then less its offset: {_BNB_CUDA_OPS}); the "
                         "largest layer", in_allocator=True)]


def _host_costs(recipe: Recipe, batch: int, seq_len: int, n_params: int = 0) -> list[Cost]:
    rss = host_memory().rss_bytes
    costs = [
        Cost("this process", rss, "measured: this Python process's RSS now (torch, the model code, the notebook)"),
        Cost("data pipeline", estimate.dataloader_prefetch_bytes(1, 1, batch, seq_len, 8),
             "one batch of int64 token ids in flight (estimate.dataloader_prefetch_bytes)"),
    ]
    if recipe.offload_optimizer or recipe.offload_param:  # notebook 10: ZeRO-Offload keeps model states in host RAM
        ds = estimate.zero_offload_bytes(n_params, zero_stage=recipe.zero_stage, offload_optimizer=recipe.offload_optimizer,
                                         offload_param=recipe.offload_param)
        costs.append(Cost("offloaded states", ds["host_bytes"], "DeepSpeed's estimate_zero*_model_states_mem_needs (estimate.zero_offload_bytes)"))
    return costs


def offloaded_checkpoint_bytes(model: nn.Module, batch: int, seq_len: int, recipe: Recipe, *, pinned: bool = False) -> int:
    """Return the host RAM of `recipe`'s offloaded checkpoints by rule: one (micro-batch x seq x hidden)
    input per block (0 unless checkpointing="offload"); a traced plan counts the traced bytes instead. The inputs are the residual
    stream, fp32 under autocast (fp32 weights and norms; so too after peft's prepare_model_for_kbit_training),
    2 bytes with pure 16-bit weights or a 16-bit frozen base (`Recipe.base_dtype`). `pinned` (a CUDA target): each input is a pinned host copy, which
    torch's caching host allocator rounds up to a power of two (`offload.pinned_bytes`); the offloader stores
    it in pieces of power-of-two bytes (`offload.power_of_two_pieces`), so the rounding adds nothing.
    Blocks kept on the device (`Recipe.offload_keep_blocks`) hold no host bytes; with checkpoint_interval N, one
    input per N blocks."""
    from colab_memopt.techniques.offload import pinned_bytes, power_of_two_pieces

    if recipe.checkpointing != "offload":
        return 0
    dims = estimate._dims(model)
    micro = -(-batch // recipe.accumulation_steps)
    # a 16-bit frozen base (base_dtype) under autocast makes the residual stream 16-bit too
    width = 2 if recipe.precision in ("bf16", "fp16") or recipe.base_dtype is not None else 4
    one = micro * seq_len * dims["hidden"] * width
    # stored in pieces of power-of-two bytes (offload.power_of_two_pieces), which the pinned allocator takes unrounded
    per_block = sum(pinned_bytes(n * width) for n in power_of_two_pieces(one // width)) if pinned else one
    stored = -(-dims["layers"] // recipe.checkpoint_interval)  # one input per segment of checkpoint_interval blocks
    return max(0, stored - recipe.offload_keep_blocks) * per_block


_PINNED_NOTE = ("; each a pinned copy stored in pieces of power-of-two bytes, which torch's caching host allocator "
                "(ATen/core/CachingHostAllocator.h: PowerOf2Ceil) takes without rounding, kept cached between steps")


def offload_split(p: Plan, n_blocks: int) -> int | None:
    """Return how many blocks' checkpoints to keep on the device (`Recipe.offload_keep_blocks`) so that a step
    planned with every checkpoint offloaded (`p`, checkpointing='offload', offload_keep_blocks=0) fits both
    memories; None when no split does.

    Each block kept on the device moves one block input (its host bytes, `offloaded checkpoints` / n_blocks,
    as the pinned allocator takes them) from host RAM to the device. The device need grows by at most that
    much per block (the kept inputs are all alive at worst; backward frees them as it goes), so the least
    split that fits the host (`need`) and the most the device's free bytes hold (`room`) bound the choice; the
    split keeps the middle, leaving spare blocks' worth in both memories.
    """
    host = sum(c.bytes for c in p.host_costs if c.name == "offloaded checkpoints")
    if p.recipe.get("checkpointing") != "offload" or p.recipe.get("offload_keep_blocks") or not host or n_blocks < 1:
        return None
    per_block = -(-host // n_blocks)
    device_free = p.device_limit_bytes - p.device_need_bytes
    host_over = p.host_need_bytes - p.host_limit_bytes
    if device_free < 0:
        return None
    need = max(0, -(-host_over // per_block))
    room = min(n_blocks, device_free // per_block)
    return None if need > room else (need + room) // 2


def plan_offload_split(model_factory: Any, batch: int, *, seq_len: int, recipe: Recipe, target: Any = "t4",
                       headroom: float = 0.05, method: str = "auto") -> Plan:
    """Return the plan of `recipe` (checkpointing='offload') with the checkpoints split between device and host
    for `target` (`offload_split`; two plans): the split's plan when one fits, else the all-offloaded plan.

    Example:
        >>> p = plan_offload_split("llama-3.2-1b", 1, seq_len=32768, recipe=Recipe(checkpointing="offload"))
        >>> p.recipe["offload_keep_blocks"], p.fits
    """
    from colab_memopt.techniques import architectures

    if recipe.checkpointing != "offload":
        raise ValueError(f"plan_offload_split needs checkpointing='offload', got {recipe.checkpointing!r}")
    whole = plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(offload_keep_blocks=0), target=target,
                 headroom=headroom, find_max_batch=False, method=method)
    n_blocks = estimate._dims(shape_model(architectures.resolve_model(model_factory).build))["layers"]
    keep = offload_split(whole, n_blocks)
    if not keep:
        return whole
    return plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(offload_keep_blocks=keep), target=target,
                headroom=headroom, find_max_batch=False, method=method)


def _load_costs(spec: Any, recipe: Recipe, target: Target) -> list[Cost]:
    """Return the host RAM of loading a checkpoint (a hub id, or a folder with weights), by `loading.load_model`'s path;
    with int8 weights by `loading.load_int8`'s, for our names too (their published checkpoints are 16 GB at 8B)."""
    from colab_memopt.training.loading import has_weights, load_host_bytes
    from colab_memopt.training.presets import BF16_TARGETS

    if not has_weights(spec) and not (recipe.weight_dtype == "int8" and spec.config is not None):
        return []
    load = load_host_bytes(spec, recipe, "cuda" if target.cuda else "cpu", native_bf16=target.name in BF16_TARGETS)
    return [Cost("loading weights", load.host_bytes,
                 f"loading.load_host_bytes: {load.path}, {load.load_dtype} (the classic load would need "
                 f"{format_bytes(load.classic_host_bytes)})")]


# Model states over this many times the device: answered by the analytic estimate at once, without a trace
# (a 1.3e12-parameter config took a minute or more to trace only to say it does not fit).
HOPELESS_FACTOR = 2


def _plan_auto_chunk(model_factory: Any, batch: int, *, seq_len: int | None, recipe: Recipe, **kwargs: Any) -> Plan:
    """Plan `recipe` with loss_chunk_tokens='auto': plan it at DEFAULT_CHUNK_TOKENS, take the device bytes that plan
    leaves free as the room at the loss (the peak is at the loss or later, so it is at least that), choose the chunk
    (`loss.auto_chunk_tokens`) and plan that chunk; the larger chunk only where its own plan fits too."""
    from colab_memopt.techniques import architectures
    from colab_memopt.techniques.loss import DEFAULT_CHUNK_TOKENS, auto_chunk_tokens

    search = kwargs.pop("find_max_batch")  # one max-batch search, on the plan returned (not on each plan tried)
    base = plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(loss_chunk_tokens=DEFAULT_CHUNK_TOKENS),
                find_max_batch=False, **kwargs)
    dims = estimate._dims(shape_model(architectures.resolve_model(model_factory).build))
    micro = -(-batch // recipe.accumulation_steps)
    chunk = auto_chunk_tokens(max(0, base.device_limit_bytes - base.device_need_bytes), dims["vocab"], dims["hidden"],
                              micro * base.seq_len)
    note = (f"loss_chunk_tokens='auto': {chunk} tokens, from the {format_bytes(max(0, base.device_limit_bytes - base.device_need_bytes))} "
            f"the plan at {DEFAULT_CHUNK_TOKENS} tokens leaves free (loss.auto_chunk_tokens)")
    if chunk != DEFAULT_CHUNK_TOKENS:
        bigger = plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(loss_chunk_tokens=chunk),
                      find_max_batch=search, **kwargs)
        if bigger.fits or not base.fits:
            bigger.warnings.append(note)
            return bigger
        note += f"; {chunk} did not fit its own plan, so {DEFAULT_CHUNK_TOKENS}"
    if search:
        base = plan(model_factory, batch, seq_len=seq_len, recipe=recipe.with_(loss_chunk_tokens=DEFAULT_CHUNK_TOKENS),
                    find_max_batch=True, **kwargs)
    base.warnings.append(note)
    return base


@isolated
def plan(
    model_factory: Callable[[], nn.Module] | str | Any,
    batch: int,
    *,
    seq_len: int | None = None,
    recipe: Recipe | dict[str, Any] | None = None,
    target: str | Target | dict[str, Any] = "t4",
    headroom: float = 0.05,
    find_max_batch: bool = True,
    method: str = "auto",
    optimizer_impl: str = "auto",
) -> Plan:
    """Predict the peak memory of one training step on a target, without a GPU.

    Args:
        model_factory: a zero-argument function that builds the model (any `nn.Module` with
            `model(input_ids, labels=...)` -> `.loss` and `.config.vocab_size`), a model name
            from `architectures.model_names()`, a Hugging Face model id, a local folder or
            config.json, or a `transformers.PretrainedConfig` (see `architectures.resolve_model`).
        batch: sequences per step (>= 1).
        seq_len: tokens per sequence (>= 1; default: the reference model's seq_len).
        recipe: the techniques applied (a `Recipe` or a dict of its fields).
        target: 't4', 'l4', 'a100-40gb', 'a100-80gb', 'h100-80gb', a `Target`, or a dict.
        headroom: fraction of device memory and host RAM kept free (allocator fragmentation).
        find_max_batch: also search for the largest batch that fits (a few more traces).
        method: 'auto' (trace, else analytic with a warning), 'trace' or 'analytic'.
        optimizer_impl: 'auto' (the target's `optimizer_impl`; by default foreach for a CUDA target,
            as torch picks there, single-tensor otherwise, as on the CPU), 'foreach' or 'single-tensor'.

    Example:
        >>> p = plan("gpt2-small", 8, seq_len=512, target="t4")
        >>> p.fits, p.max_batch
    """
    from colab_memopt.techniques import architectures

    start = time.perf_counter()
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    headroom = check_headroom(headroom)
    if method not in ("auto", "trace", "analytic"):
        raise ValueError(f"method must be 'auto', 'trace' or 'analytic', got {method!r}")
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {optimizer_impl!r}")
    tgt = get_target(target)
    if tgt.optimizer_impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"target optimizer_impl must be one of {OPTIMIZER_IMPLS}, got {tgt.optimizer_impl!r}")
    impl = optimizer_impl if optimizer_impl != "auto" else tgt.optimizer_impl
    impl = ("foreach" if tgt.cuda else "single-tensor") if impl == "auto" else impl
    if recipe is not None and not isinstance(recipe, (Recipe, dict)):
        raise TypeError(f"recipe must be a Recipe or a dict of its fields, got {type(recipe).__name__} {recipe!r}")
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(recipe or {})
    if rec.loss_chunk_tokens == "auto":  # the chunk from the memory the plan leaves at the loss
        return _plan_auto_chunk(model_factory, batch, seq_len=seq_len, recipe=rec, target=target, headroom=headroom,
                                find_max_batch=find_max_batch, method=method, optimizer_impl=optimizer_impl)
    if batch < rec.accumulation_steps:
        raise ValueError(f"batch {batch} is smaller than recipe.accumulation_steps={rec.accumulation_steps}: "
                         "the batch is the effective batch, split into that many micro-batches")
    model_factory_arg = model_factory
    try:
        spec = architectures.resolve_model(model_factory)  # a name, hub id, folder, config.json, config or factory
    except TypeError:
        shape_model(model_factory)  # names the bad factory in plan's own words
        raise
    name, limit, model_factory = spec.name, spec.max_seq_len, spec.build
    from colab_memopt.training.presets import with_family_lora_targets

    rec = with_family_lora_targets(rec, spec.family)  # a folder's llama: q_proj..., not the reference model's names
    if limit is not None:
        seq_len = check_seq_len(limit if seq_len is None else seq_len, limit, name)
        meta_model = shape_model(model_factory)
    else:
        if seq_len is None and spec.config is not None:
            raise ValueError(f"model {name!r} has no usable max_position_embeddings in its config: give seq_len (--seq)")
        check_seq_len(seq_len, None, name)
        meta_model = shape_model(model_factory)
        check_seq_len(seq_len, max_positions(meta_model), type(meta_model).__name__)
    rec.check_model(meta_model)  # a plan only for what can run: what Recipe.build refuses, plan refuses
    if tgt.cuda and tgt.compute_capability is not None:  # a bf16 frozen base needs native bf16 (sm_80+)
        from colab_memopt.techniques.precision import check_native_bf16

        check_native_bf16(rec.base_dtype, native_bf16=tuple(tgt.compute_capability) >= (8, 0),
                          where=f"target {tgt.name!r} (sm_{tgt.compute_capability[0]}{tgt.compute_capability[1]})")
    analytic = estimate.training_step_bytes(meta_model, batch, seq_len, rec)
    device_costs = []
    if tgt.cuda:
        device_costs = [
            Cost("CUDA context", tgt.cuda_context_bytes, "assumed (0.5-2 GB seen on Colab; measure with NVML on your card)"),
            *cuda_workspace_costs(tgt.compute_capability),
            *four_bit_step_costs(meta_model, spec, rec, tgt, batch, seq_len),
        ]
    warn: list[str] = []
    if rec.precision == "fp16":
        warn.append("pure fp16 is traced in fp16 with its loss scaler taking a clean step (fake tensors have no values: "
                    "the skip of an overflowing step, which holds less, is not traced)")
        if rec.optimizer in ("lomo", "adalomo") and rec.weight_dtype is None:  # (int8train's rules do not clip)
            warn.append(f"{rec.optimizer} in fp16 runs two backward passes, the first with the graph retained (the "
                        "global norm, which finds overflows before any weight changes): both are traced")
    if rec.precision == "fp16-autocast" or rec.eval_precision == "fp16-autocast":
        warn.append("fp16 autocast is traced in CPU fp16 autocast with the GradScaler taking a clean step; CUDA "
                    "autocast runs softmax, log_softmax, layer_norm and sum in fp32 where CPU autocast keeps fp16 "
                    "(naive attention on CUDA holds a 4-byte softmax per score, not 2)")
    uses_bf16 = "bf16" in (rec.precision, rec.eval_precision or "") or rec.precision == "bf16-autocast"
    if tgt.cuda and uses_bf16 and tgt.compute_capability is not None and tuple(tgt.compute_capability) < (8, 0):
        warn.append(f"{tgt.name} (sm_{tgt.compute_capability[0]}{tgt.compute_capability[1]}) has no native bf16: its "
                    "matmuls are emulated and SDPA has no bf16 memory-efficient kernel there, so it falls back to math "
                    "and builds the T x T scores (planned so); use fp16-autocast")

    used = "analytic"
    trace = None
    states = sum(analytic.by_category.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
    if method == "auto" and states > HOPELESS_FACTOR * tgt.device_bytes and not rec.uses_deepspeed \
            and not rec.layer_offload_active and rec.optimizer_state_offload == "keep":
        warn.append(f"not traced: the weights, gradients and optimizer state alone ({states / 2**30:.1f} GiB by the "
                    f"analytic estimate) are {states / tgt.device_bytes:.0f}x {tgt.name}'s device memory, so no trace could "
                    "make it fit; the figures are the analytic estimate")
    elif method != "analytic" and rec.untraceable_reason:
        if method == "trace":
            raise ValueError(f"cannot trace this recipe: {rec.untraceable_reason}")
        warn.append(f"not traced: {rec.untraceable_reason}; the figures are the analytic estimate")
    elif method != "analytic":
        # A named model's trace is cached (the recommender and notebooks plan the same recipe again), unless the
        # tracer itself is needed afterwards (the max-batch search, offloaded checkpoints' host bytes).
        capability = tuple(tgt.compute_capability) if tgt.cuda and tgt.compute_capability is not None else None
        cache_key = ((name, rec, seq_len, batch, tgt.cuda, impl, capability)
                     if isinstance(model_factory_arg, str) and model_factory_arg in architectures.model_names()
                     and not find_max_batch and rec.checkpointing != "offload" else None)
        try:
            if cache_key is not None and cache_key in _TRACE_CACHE:
                trace, scales, int8_warning = _TRACE_CACHE[cache_key]
            else:
                tracer = _Tracer(model_factory, rec, seq_len, cuda_rounding=tgt.cuda, batch=batch,
                                 optimizer_impl=impl, capability=capability)
                trace = tracer.trace(batch)
                # what the plan reads from the traced model, kept beside a cached trace
                scales = quantization_scale_bytes(tracer.model, cuda_rounding=tgt.cuda)
                int8_warning = (_int8_outlier_warning(tracer.model, batch, seq_len, rec, tgt)
                                if tracer.int8_as_on_cuda else None)
                if cache_key is not None:
                    if len(_TRACE_CACHE) >= _TRACE_CACHE_SIZE:
                        _TRACE_CACHE.pop(next(iter(_TRACE_CACHE)))
                    _TRACE_CACHE[cache_key] = (trace, scales, int8_warning)
            used = "trace"
        except Exception as exc:  # noqa: BLE001 - any failure to trace falls back, loudly
            if method == "trace":
                raise
            warn.append(f"could not trace the step on fake tensors ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                        "the figures are the analytic estimate, not a trace")
            warnings.warn(warn[-1], stacklevel=2)
    if trace is None:
        trace = _Trace(analytic.peak_bytes, analytic.by_category, analytic.by_phase, analytic.phase_categories)
        if _grouped_query(meta_model) and tgt.cuda and tgt.compute_capability is not None \
                and tuple(tgt.compute_capability) < (8, 0):
            warn.append(f"grouped-query attention without a mask runs SDPA's math kernel on {tgt.name}: the estimate "
                        "leaves out its T x T scores per layer; trace the step (method='trace'), or call "
                        "colab_memopt.techniques.attention.repeat_kv_for_sdpa(model) to run the O(T) kernel")

    result = Plan(
        model=name, batch=batch, seq_len=seq_len, recipe=rec.to_dict(), target=tgt, method=used,
        peak_bytes=trace.peak_bytes, by_category=trace.by_category, by_phase=trace.by_phase,
        by_phase_category=trace.phase_categories, device_costs=device_costs, host_costs=_host_costs(rec, batch, seq_len, sum(p.numel() for p in estimate._unique(meta_model.parameters()))),
        headroom_fraction=headroom,
        analytic_peak_bytes=analytic.peak_bytes, warnings=warn, optimizer_impl=impl if used == "trace" else "analytic",
    )
    result.host_costs += _load_costs(spec, rec, tgt)
    if used == "trace":
        if scales:
            device_costs.append(Cost("quantization scales", scales,
                                     "traced: bitsandbytes' row scales and absmax kept beside the quantized weights (outside "
                                     "the parameters, so not in the tensors at peak, as the tracker does not see them either)",
                                     in_allocator=True))
        if int8_warning:
            warn.append(int8_warning)
        if trace.hidden_bytes:
            device_costs.append(math_attention_cost(trace.hidden_bytes, tgt))
            warn.append(math_attention_warning(tgt))
    if tgt.cuda:  # loading (and quantizing) can be the run's highest point, which a CPU trace cannot see
        model_bytes = (result.by_category.get("parameters", 0) + result.by_category.get("buffers", 0)
                       + sum(c.bytes for c in device_costs if c.name == "quantization scales"))
        result.load_costs = four_bit_load_costs(meta_model, spec, rec, tgt, model_bytes)
        if result.load_costs and not result.fits_run:
            warn.append(f"loading needs {format_bytes(result.load_need_bytes)} on the device ({result.load_costs[1].name}, "
                        f"{result.load_costs[2].name}), more than the {format_bytes(result.device_limit_bytes)} usable, though "
                        "the step fits or not as said: load from a checkpoint, which transformers quantizes tensor by tensor "
                        "on the device (loading.load_model with a hub id or a saved folder)")
    if rec.checkpointing == "offload":  # the checkpointed blocks' inputs wait in host RAM
        if used == "trace":
            offloader = checkpoint_offloader(tracer.model)
            result.host_costs.append(Cost("offloaded checkpoints",
                                          offloader.peak_pinned_host_bytes if tgt.cuda else offloader.peak_host_bytes,
                                          "traced: one block input per block (checkpointing.CheckpointOffloader)" + _PINNED_NOTE * tgt.cuda))
        else:
            result.host_costs.append(Cost("offloaded checkpoints",
                                          offloaded_checkpoint_bytes(meta_model, batch, seq_len, rec, pinned=tgt.cuda),
                                          "analytic: one block input per block (offloaded_checkpoint_bytes)" + _PINNED_NOTE * tgt.cuda))
    if find_max_batch:
        budget = result.device_limit_bytes - sum(c.bytes for c in device_costs if c.name != MATH_ATTENTION_LINE)
        if used == "trace":
            # Guess from the activations per sample, then confirm the boundary with traces.
            guess = _activation_max_batch(trace, batch, budget)
            cap = _search_batch_cap(meta_model, rec, batch, seq_len)
            if 0 < guess < _BATCH_CAP:
                if cap is not None:
                    guess = min(guess, cap)
                guess = _secant_step(tracer.trace(guess), guess, trace, budget)
                guess, converged = _verified_max_batch(
                    lambda b: _step_fits(tracer.trace(b), _with_math_attention(device_costs, tracer.trace(b), tgt),
                                         result.device_limit_bytes), guess, lower=rec.accumulation_steps, upper=cap
                )
                if not converged and cap is not None and guess == cap:
                    warn.append(f"max_batch {guess} is the largest batch searched, and it fits: a larger one's trace "
                                "would run more rounds of the chunked loss / tiled MLP than the search allows "
                                f"({_SEARCH_LOOP_ROUNDS}, or 4x batch {batch}'s); plan a larger batch to check it")
                elif not converged:
                    warn.append(f"max_batch {guess} is the largest traced batch that fits; the search stopped before the boundary")
        else:
            guess = _linear_max_batch(trace, batch, budget)
        result.max_batch = guess
    result.seconds = time.perf_counter() - start
    return result
