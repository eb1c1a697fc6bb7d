"""The devices a plan is for: their memory, host RAM and CUDA context, and the workspaces torch allocates there.

`Target` describes a device (`TARGETS`: Colab's T4 and L4, the A100s, the H100; `get_target` takes a name, a
`Target` or a dict). `cublas_workspace_bytes` and `cublaslt_workspace_bytes` give the fixed bytes torch's cuBLAS
handles allocate on a CUDA device, with their source. A plan never reads this machine's environment: it plans the
target's run, which may be on another machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from colab_memopt.core.env import (COLAB_HOST_RAM_BYTES, PLAN_MARGIN, T4_CUDA_CONTEXT_BYTES, T4_CUDA_CONTEXT_SOURCE,
                                   T4_TOTAL_BYTES, GiB)

# The margin every tool keeps free by default (`headroom`): one figure, so that every tool prints the same usable.
DEFAULT_HEADROOM = PLAN_MARGIN
ASSUMED_CONTEXT_SOURCE = "assumed (0.5-2 GB reported before lazy loading; measure it on your card with NVML)"


@dataclass(frozen=True)
class Target:
    """A device to plan for: its usable memory, host RAM and fixed costs.

    `device_bytes` is what PyTorch reports as the GPU's total capacity; `cuda_context_bytes` is taken
    from it before any tensor exists (the CUDA context and kernels, which neither
    `max_memory_allocated` nor the tracker sees), `context_source` says where that figure comes from. A plan may use
    `usable_bytes(headroom)` of the device: the total less the margin kept free.
    """

    name: str
    device_bytes: int
    host_bytes: int
    cuda_context_bytes: int = int(0.75 * GiB)
    description: str = ""
    cuda: bool = True
    compute_capability: tuple[int, int] | None = None
    optimizer_impl: str = "auto"  # how the device runs torch's optimizers; 'auto': foreach on CUDA, else single-tensor
    context_source: str = ASSUMED_CONTEXT_SOURCE

    def usable_bytes(self, headroom: float = DEFAULT_HEADROOM) -> int:
        """Return the device bytes a plan may use: the total less the margin `headroom` kept free."""
        return int(self.device_bytes * (1 - headroom))

    def host_usable_bytes(self, headroom: float = DEFAULT_HEADROOM) -> int:
        """Return the host RAM a plan may use: the total less the margin `headroom` kept free."""
        return int(self.host_bytes * (1 - headroom))

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


# Device capacities are what PyTorch reports for the card (the T4: Colab's 2026 images, core/env.py); for the others
# the vendor's nominal size less what the driver keeps, as PyTorch typically reports it. Host RAM is the Colab
# runtime's where one exists. The T4's CUDA context is a published T4 measurement (core/env.py); the others' an
# assumption until measured with NVML on the card.
TARGETS: dict[str, Target] = {
    "t4": Target("t4", T4_TOTAL_BYTES, COLAB_HOST_RAM_BYTES, cuda_context_bytes=T4_CUDA_CONTEXT_BYTES,
                 description="Colab free tier: T4 (14.56 GiB), 12.7 GB RAM", compute_capability=(7, 5),
                 context_source=T4_CUDA_CONTEXT_SOURCE),
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


def get_target(target: str | Target | dict[str, Any]) -> Target:
    """Return a target from its name, a `Target`, or a dict with device_bytes and host_bytes."""
    if isinstance(target, Target):
        return target
    if isinstance(target, dict):
        allowed = {"name", "device_bytes", "host_bytes", "cuda_context_bytes", "description", "cuda", "compute_capability",
                   "optimizer_impl", "context_source"}
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
