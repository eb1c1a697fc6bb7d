"""The device a notebook runs on: choice, capabilities, and a preflight summary."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

import torch

GiB = 2**30
# What a Colab free-tier T4 shows PyTorch ("GPU 0 has a total capacity of 14.74 GiB").
T4_USABLE_BYTES = int(14.74 * GiB)
# Colab free tier host RAM.
COLAB_HOST_RAM_BYTES = int(12.7e9)

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
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else None


def compute_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """Return the CUDA compute capability (a T4 is (7, 5)), or None on the CPU."""
    dev = pick_device(device)
    return torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None


def bf16_native(device: torch.device | None = None) -> bool:
    """Return whether the GPU computes bf16 in hardware (capability >= 8.0).

    `torch.cuda.is_bf16_supported()` says True on a T4 because it counts emulation; we do not.
    On the CPU this returns False: bf16 runs there, but emulated and slowly on AVX2-only machines.
    """
    cc = compute_capability(device)
    return cc is not None and cc >= (8, 0)


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
            ]
        )


def preflight(device: str | torch.device | None = "auto", *, verbose: bool = True) -> Preflight:
    """Print and return the device, usable memory, host RAM, torch version and autocast dtype."""
    dev = pick_device(device)
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
    )
    if verbose:
        print(info)
    return info
