"""The device a notebook runs on: choice, capabilities, and a preflight summary."""

from __future__ import annotations

import os
import platform
import sys
import warnings
from dataclasses import dataclass

import torch

GiB = 2**30
MiB = 2**20
# One T4, one answer: every tool (plan, plan_trainer, fit_trainer, the guard, recommend, doctor, capacity, context,
# the notebooks) reads these, through `planning.targets.TARGETS["t4"]`.
# What a Colab free-tier T4 shows PyTorch on 2026 images: 14,912 MiB, "GPU 0 has a total capacity of 14.56 GiB" in the
# OOM text of published T4 notebook runs (torch 2.8-2.10, CUDA 12.8); 2024-2025 images showed 14.74 GiB.
T4_TOTAL_BYTES = 14_912 * MiB
T4_TOTAL_SOURCE = "Colab's 2026 T4 images: total capacity 14.56 GiB (14,912 MiB), as PyTorch reports it"
# The CUDA context of a T4 process, outside the caching allocator (neither max_memory_allocated nor the trace sees
# it): 133-147 MiB in the fitcheck project's published T4 validation (33 runs, torch 2.x with lazy module loading);
# the largest is planned. Older reports of 0.5-2 GB predate lazy loading.
T4_CUDA_CONTEXT_BYTES = 147 * MiB
T4_CUDA_CONTEXT_SOURCE = "measured 133-147 MiB on a T4 (fitcheck's T4 validation, 33 runs, lazy loading); 147 planned"
# The margin a plan keeps free of the device and of host RAM (the caching allocator's fragmentation), the same in every
# tool unless you give another `headroom`: a named margin, not another "usable".
PLAN_MARGIN = 0.05
# The T4's usable memory, as every tool prints it: its total less the margin (13.83 GiB on 2026 images).
T4_USABLE_BYTES = int(T4_TOTAL_BYTES * (1 - PLAN_MARGIN))
# Colab free tier host RAM, and the part of it a plan may use (the same margin).
COLAB_HOST_RAM_BYTES = int(12.7e9)
COLAB_HOST_USABLE_BYTES = int(COLAB_HOST_RAM_BYTES * (1 - PLAN_MARGIN))
# CM_EMULATE=t4 makes a bigger CUDA GPU behave like Colab's T4 (see `apply_emulation`).
EMULATE_ENV = "CM_EMULATE"
EMULATIONS = ("t4",)
_emulating: dict[int, str] = {}  # CUDA device index -> what it emulates, once applied

_DEVICE_TYPES = ("cpu", "cuda")


def pick_device(device: str | torch.device | None = "auto") -> torch.device:
    """Return the torch device for 'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or 'cuda:N'.

    Example:
        >>> pick_device("cpu")
        device(type='cpu')
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if dev.type not in _DEVICE_TYPES:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but this machine has no CUDA GPU; use 'auto' or 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
    return dev


def gpu_name(device: torch.device | None = None) -> str | None:
    """Return the GPU's name, or None on the CPU."""
    dev = pick_device(device)
    return device_label(dev) if dev.type == "cuda" else None


def compute_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """Return the CUDA compute capability (a T4 is (7, 5)), or None on the CPU."""
    dev = pick_device(device)
    return torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None


def bf16_native(device: torch.device | None = None) -> bool:
    """Return whether the GPU computes bf16 in hardware (capability >= 8.0).

    `torch.cuda.is_bf16_supported()` says True on a T4 because it counts emulation; we do not.
    On the CPU this returns False: bf16 runs there, but emulated and slowly on AVX2-only machines.
    Under `CM_EMULATE=t4` (`apply_emulation`) it returns False, as on a T4.
    """
    cc = compute_capability(device)
    if cc is not None and emulated_gpu(device) == "t4":
        return False
    return cc is not None and cc >= (8, 0)


def requested_emulation() -> str | None:
    """Return what `CM_EMULATE` asks for ('t4'), or None when it is unset, empty or 'none'."""
    value = os.environ.get(EMULATE_ENV, "").strip().lower()
    if value in ("", "none", "0"):
        return None
    if value not in EMULATIONS:
        raise ValueError(f"{EMULATE_ENV} must be one of {EMULATIONS} or 'none', got {value!r}")
    return value


def emulated_gpu(device: torch.device | None = None) -> str | None:
    """Return what the CUDA device emulates once `apply_emulation` ran ('t4'), else None."""
    if not _emulating:
        return None
    dev = pick_device(device)
    if dev.type != "cuda":
        return None
    return _emulating.get(dev.index if dev.index is not None else torch.cuda.current_device())


def apply_emulation(device: str | torch.device | None = "auto", emulate: str | None = None) -> str | None:
    """Make a CUDA GPU behave like Colab's T4 when `emulate` (default: `CM_EMULATE`) is 't4'; return it.

    - caps the caching allocator at the T4's total less its CUDA context:
      `torch.cuda.set_per_process_memory_fraction((T4_TOTAL_BYTES - T4_CUDA_CONTEXT_BYTES) / total)`;
      the cap does not cover this GPU's own context, workspaces outside the allocator or unified memory;
    - forces the T4's code paths: no native bf16 (`bf16_native` is False, so fp16 + GradScaler is
      chosen), no flash or cuDNN attention (SDPA's memory-efficient kernel, as on sm_75), TF32 off;
    - `device_label` then names the GPU "<gpu> emulating t4": timings are this GPU's, not a T4's.
    On the CPU, or when nothing is asked for, it does nothing and returns None.
    """
    emulate = requested_emulation() if emulate is None else emulate
    if emulate is None:
        return None
    if emulate not in EMULATIONS:
        raise ValueError(f"emulate must be one of {EMULATIONS}, got {emulate!r}")
    dev = pick_device(device)
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    cap = T4_TOTAL_BYTES - T4_CUDA_CONTEXT_BYTES
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _emulating[index] = emulate
    return emulate


def device_label(device: str | torch.device | None = "auto") -> str:
    """Return the device's name for results: the GPU's name ("<gpu> emulating t4" under emulation), or 'cpu'."""
    dev = pick_device(device)
    if dev.type != "cuda":
        return str(dev)
    name = torch.cuda.get_device_name(dev)
    emulated = emulated_gpu(dev)
    return f"{name} emulating {emulated}" if emulated else name


def autocast_dtype(device: torch.device | None = None) -> torch.dtype:
    """Return the recommended autocast dtype: bf16 on Ampere+, fp16 (with GradScaler) below, bf16 on CPU."""
    dev = pick_device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if bf16_native(dev) else torch.float16
    return torch.bfloat16


def in_colab() -> bool:
    """Return whether this runs in Google Colab."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


@dataclass
class HostMemory:
    """This process's resident memory and the machine's RAM, in bytes."""

    rss_bytes: int
    available_bytes: int
    total_bytes: int


def host_memory() -> HostMemory:
    """Return this process's RSS and the machine's available and total RAM."""
    import psutil

    vm = psutil.virtual_memory()
    return HostMemory(
        rss_bytes=psutil.Process().memory_info().rss,
        available_bytes=vm.available,
        total_bytes=vm.total,
    )


def usable_device_memory(device: torch.device | None = None) -> int:
    """Return the bytes a training step may use: the GPU's total capacity, or available host RAM on CPU."""
    dev = pick_device(device)
    if dev.type == "cuda":
        if emulated_gpu(dev) == "t4":  # the allocator cap of `apply_emulation`
            return T4_TOTAL_BYTES - T4_CUDA_CONTEXT_BYTES
        return torch.cuda.get_device_properties(dev).total_memory
    return host_memory().available_bytes


def cap_device_memory(limit_bytes: int, device: torch.device | None = None) -> float:
    """Cap this process's CUDA allocations at `limit_bytes` (e.g. `T4_USABLE_BYTES` on a bigger GPU).

    Returns the fraction of the card passed to `torch.cuda.set_per_process_memory_fraction`. On the
    CPU there is no allocator to cap: use `colab_memopt.MemoryBudget`, which works on any device.
    """
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
    dev = pick_device(device)
    if dev.type != "cuda":
        raise ValueError(f"cap_device_memory needs a CUDA device, got {dev}; use MemoryBudget on the CPU")
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = min(1.0, limit_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return fraction


@dataclass
class Preflight:
    """What a notebook runs on."""

    device: str
    gpu_name: str | None
    compute_capability: tuple[int, int] | None
    usable_device_bytes: int
    host_available_bytes: int
    host_total_bytes: int
    torch_version: str
    autocast_dtype: str
    bf16_native: bool
    colab: bool
    emulating: str | None = None
    warnings: tuple[str, ...] = ()

    def __str__(self) -> str:
        cc = f"sm_{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else "-"
        where = self.gpu_name or f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        return "\n".join(
            [
                f"device            {self.device}: {where}",
                f"compute cap.      {cc}   native bf16: {self.bf16_native}",
                f"usable memory     {self.usable_device_bytes / GiB:.2f} GiB"
                + ("" if self.device.startswith("cuda") else " (host RAM available: the CPU's 'device')"),
                f"host RAM          {self.host_available_bytes / GiB:.2f} GiB available of {self.host_total_bytes / GiB:.2f} GiB",
                f"torch             {self.torch_version}",
                f"autocast dtype    {self.autocast_dtype}"
                + (" + GradScaler" if self.autocast_dtype == "float16" else ""),
                f"Colab             {self.colab}",
            ] + ([f"emulating         {self.emulating} (CM_EMULATE): allocator capped, T4 code paths; timings are not a T4's"]
                 if self.emulating else [])
            + [f"\n*** WARNING: {w}" for w in self.warnings]
        )


NO_GPU_ON_COLAB = (
    "this Colab runtime has no GPU. The notebook's defaults are sized for a T4 and would run for a long time "
    "on Colab's 2 CPU cores. Choose Runtime > Change runtime type > T4 GPU (then Runtime > Run all), or lower "
    "the values in the Parameters cell."
)


def runtime_warnings(dev: torch.device, *, colab: bool, device_requested: str | torch.device | None) -> tuple[str, ...]:
    """Return what a user must know before running: on Colab, no GPU where 'auto' wanted one."""
    wanted_gpu = device_requested in (None, "auto") or str(device_requested).startswith("cuda")
    if colab and dev.type == "cpu" and wanted_gpu:
        return (NO_GPU_ON_COLAB,)
    return ()


def preflight(device: str | torch.device | None = "auto", *, verbose: bool = True) -> Preflight:
    """Print and return the device, usable memory, host RAM, torch version and autocast dtype.

    On Colab without a GPU (device 'auto') it warns, loudly: the notebooks' defaults are sized for a T4.

    With `CM_EMULATE=t4` on a CUDA GPU it first applies the T4 emulation (`apply_emulation`).
    """
    dev = pick_device(device)
    emulating = apply_emulation(dev)
    host = host_memory()
    info = Preflight(
        device=str(dev),
        gpu_name=gpu_name(dev),
        compute_capability=compute_capability(dev),
        usable_device_bytes=usable_device_memory(dev),
        host_available_bytes=host.available_bytes,
        host_total_bytes=host.total_bytes,
        torch_version=torch.__version__,
        autocast_dtype=str(autocast_dtype(dev)).removeprefix("torch."),
        bf16_native=bf16_native(dev),
        colab=in_colab(),
        emulating=emulating,
    )
    info.warnings = runtime_warnings(dev, colab=info.colab, device_requested=device)
    for message in info.warnings:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    if verbose:
        print(info)
    return info
