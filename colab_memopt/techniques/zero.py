"""ZeRO with DeepSpeed (notebook 10): configs, real multi-rank runs on loopback, per-rank bytes.

`deepspeed_config` turns ZeRO settings (`ZeroSettings`, or a `Recipe`, which has the same fields:
zero_stage, offload_optimizer, offload_param, lr) into a DeepSpeed config that DeepSpeed's own config classes validate. `run_zero` launches ranks with `ranks.launch`
(spawned processes; the worker lives here, so it is importable), the gloo backend on 127.0.0.1,
and reads on every rank the bytes DeepSpeed's engine and optimizer hold:
parameters, gradients and optimizer state (`rank_state_bytes`). `zero_state_bytes` is the ZeRO
paper's formula (Rajbhandari et al. 2020) to compare them with.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from colab_memopt.core import ranks
from colab_memopt.core.ranks import LOOPBACK, free_port
from colab_memopt.core.measure import iter_tensors
from colab_memopt.core.console import import_quietly, quiet

ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed's reduce / all-gather bucket (elements) in `deepspeed_config`: the engine holds one flat buffer of
# this many gradient values whatever the model's size (200 MB in fp32, measured: benchmarks/planner_accuracy.py --zero)
DEFAULT_BUCKET_ELEMENTS = 5 * 10**7
PRECISIONS = ("fp32", "bf16", "fp16")


class ZeroFields(Protocol):
    """What the config and the engine read: a `ZeroSettings` here, or a `Recipe` in the training step."""

    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    lr: float


def check_zero_fields(zero_stage: Any, offload_optimizer: Any, offload_param: Any, *, prefix: str = "") -> None:
    """Raise ValueError naming the first ZeRO setting that is not allowed (`prefix` names its owner, e.g. 'recipe.')."""
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"{prefix}zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if not isinstance(value, bool):
            raise ValueError(f"{prefix}{name} must be True or False, got {value!r}")
    if offload_optimizer and zero_stage == 0:
        raise ValueError(f"{prefix}offload_optimizer needs zero_stage 1, 2 or 3 (ZeRO-Offload), got zero_stage=0")
    if offload_param and zero_stage != 3:
        raise ValueError(f"{prefix}offload_param needs zero_stage=3 (only stage 3 partitions parameters), got {zero_stage}")


@dataclass(frozen=True)
class ZeroSettings:
    """A ZeRO stage, its offload options and the AdamW learning rate (validated on construction).

    `Recipe(zero_stage=..., offload_optimizer=..., ...)` carries the same fields for the training step;
    this is the same without the rest of a recipe, for using this module on its own.
    """

    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    lr: float = 1e-3

    def __post_init__(self) -> None:
        check_zero_fields(self.zero_stage, self.offload_optimizer, self.offload_param)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


# -- the formulas ---------------------------------------------------------------------------------

def zero_state_bytes(
    n_params: float,
    stage: int,
    world_size: int,
    *,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
    persistent_params: float = 0,
) -> dict[str, float]:
    """Return per-rank bytes of parameters, gradients and optimizer state under ZeRO (Rajbhandari et al. 2020).

    Stage 0 keeps everything on every rank; stage 1 shards the optimizer state (K/N), stage 2 also the
    gradients, stage 3 also the parameters. Mixed precision: 2 + 2 + K with K = 12 (fp32 master, m, v).
    `persistent_params` (stage 3): parameters DeepSpeed keeps whole on every rank
    (under `stage3_param_persistence_threshold`); their partition is kept too.

    Example:
        >>> zero_state_bytes(7e9, 3, 8, optimizer_bytes=4)  # the 7B / 8 GPUs example: 1.75 + 1.75 + 3.5 GB
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {ZERO_STAGES}, got {stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if n_params < 0 or persistent_params < 0:
        raise ValueError(f"n_params and persistent_params must be >= 0, got {n_params} and {persistent_params}")
    n, w = n_params, world_size
    params = weight_bytes * (n / w + persistent_params if stage == 3 else n)
    grads = grad_bytes * (n / w if stage >= 2 else n)
    opt = optimizer_bytes * (n / w if stage >= 1 else n)
    return {"parameters": params, "gradients": grads, "optimizer_state": opt, "total": params + grads + opt}


def zero_reduction_x(stage: int, world_size: int, *, weight_bytes: float = 2, grad_bytes: float = 2,
                     optimizer_bytes: float = 12) -> float:
    """Return the per-rank model-state reduction of a ZeRO stage against stage 0 (e.g. 4x for ZeRO-2 with many ranks)."""
    kw = {"weight_bytes": weight_bytes, "grad_bytes": grad_bytes, "optimizer_bytes": optimizer_bytes}
    return zero_state_bytes(1.0, 0, world_size, **kw)["total"] / zero_state_bytes(1.0, stage, world_size, **kw)["total"]


# -- the config -----------------------------------------------------------------------------------

def deepspeed_config(
    recipe: ZeroFields,
    *,
    micro_batch_size: int = 1,
    grad_accum_steps: int = 1,
    precision: str = "fp32",
    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
    param_persistence_threshold: int = 10**5,
    pin_memory: bool = True,
    validate: bool = True,
) -> dict[str, Any]:
    """Return a DeepSpeed config for the recipe's ZeRO stage and offload options, validated by DeepSpeed.

    Args:
        recipe: a `ZeroSettings` or a `Recipe`: reads `zero_stage`, `offload_optimizer`, `offload_param`.
        micro_batch_size: sequences per rank per micro-step; grad_accum_steps: micro-steps per update.
        precision: 'fp32', 'bf16' or 'fp16' (fp16 needs CUDA: DeepSpeed refuses it on the CPU).
        bucket_elements: reduce / all-gather bucket size (elements); small models need small buckets.
        param_persistence_threshold: stage 3 keeps parameters with fewer elements whole on every rank.
        pin_memory: pin offloaded host buffers (CUDA only; ignored on the CPU).
        validate: parse the config with DeepSpeed's `DeepSpeedZeroConfig` and `DeepSpeedConfig`.

    The optimizer is not in the config: `zero.initialize` passes DeepSpeedCPUAdam when the optimizer
    is offloaded and PyTorch's AdamW otherwise (no fused_adam build on the CPU).
    """
    for name, value in (("micro_batch_size", micro_batch_size), ("grad_accum_steps", grad_accum_steps),
                        ("bucket_elements", bucket_elements)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if isinstance(param_persistence_threshold, bool) or not isinstance(param_persistence_threshold, int) or param_persistence_threshold < 0:
        raise ValueError(f"param_persistence_threshold must be an integer >= 0, got {param_persistence_threshold!r}")
    zero: dict[str, Any] = {
        "stage": recipe.zero_stage,
        "reduce_bucket_size": bucket_elements,
        "allgather_bucket_size": bucket_elements,
        "contiguous_gradients": True,
        "overlap_comm": False,
    }
    if recipe.zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=param_persistence_threshold,
                    stage3_prefetch_bucket_size=bucket_elements, stage3_max_live_parameters=bucket_elements,
                    stage3_max_reuse_distance=bucket_elements)
    if recipe.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if recipe.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    if validate:
        validate_config(config)
    return config


def validate_config(config: dict[str, Any]) -> None:
    """Parse a config with DeepSpeed's own classes; raise ValueError with DeepSpeed's message if it refuses."""
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**config.get("zero_optimization", {}))
        DeepSpeedConfig(json.loads(json.dumps(config)))
    except Exception as exc:  # pydantic's ValidationError, DeepSpeed's asserts
        raise ValueError(f"DeepSpeed rejects the config: {type(exc).__name__}: {exc}") from exc


# -- the engine -----------------------------------------------------------------------------------

def _skip_shm_comm_op() -> None:
    # DeepSpeed builds a shared-memory all-reduce op at every init on its CPU accelerator (about 30-55 s
    # cold). Only inference_all_reduce uses it; training collectives go through gloo. Skip the build.
    # the module itself (deepspeed.comm's attribute `torch` is torch), imported with its notes hidden
    import_quietly("deepspeed.comm.torch").build_shm_op = lambda: None


def init_distributed(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """Start DeepSpeed's process group with gloo on the loopback address (once per process)."""
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        import deepspeed
    import torch.distributed as dist

    _skip_shm_comm_op()  # also where the group exists: DeepSpeed's comm still starts on it, at its engine's first use
    if dist.is_initialized():  # started by someone else (LOMO's fp16 scaler): DeepSpeed's engine still reads these
        for key, value in (("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size()), ("LOCAL_RANK", dist.get_rank())):
            os.environ.setdefault(key, str(value))
        return
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port or free_port()), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    backend = "gloo" if not torch.cuda.is_available() or world_size > torch.cuda.device_count() else "nccl"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


# torch's JIT loader waits without a limit while a `lock` file sits in the op's build folder; a build killed part-way
# (a restarted runtime, an interrupted cell) leaves it, and every later run waits forever. A cpu_adam build takes about
# 45 s to 3 min on 2 cores (FACTS.md): a lock 15 minutes old is a leftover.
STALE_BUILD_LOCK_SECONDS = 900


def build_directory(op: str) -> Path:
    """Return the folder torch's JIT loader builds a DeepSpeed op in, named as torch.utils.cpp_extension names it
    (TORCH_EXTENSIONS_DIR/<op>, else ~/.cache/torch_extensions/py3XX_<accelerator>/<op>); nothing is created."""
    import sys

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / op


def clear_stale_build_lock(op: str = "cpu_adam", *, older_than_s: float = STALE_BUILD_LOCK_SECONDS) -> Path | None:
    """Remove the lock a cut-short build of a DeepSpeed op left behind; return its path, or None where there is none.

    A lock older than `older_than_s` seconds is a leftover (a build in progress is younger): removed with a warning
    naming it, so the op builds again instead of DeepSpeed waiting on it forever. A younger lock is left alone.
    """
    lock = build_directory(op) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age < older_than_s:
        return None
    lock.unlink(missing_ok=True)
    warnings.warn(f"removed {lock}: a build of DeepSpeed's {op} was cut short {age / 60:.0f} min ago and left it "
                  "(DeepSpeed would wait on it forever); the op builds again now", stacklevel=2)
    return lock


def initialize(model: torch.nn.Module, recipe: ZeroFields, **config_kwargs: Any) -> tuple[Any, Any]:
    """Wrap the model in a DeepSpeed engine for the recipe; return (engine, the engine's optimizer).

    The optimizer is DeepSpeedCPUAdam (AdamW mode) when `recipe.offload_optimizer`, else PyTorch's
    AdamW; weight decay 0.01 as `optimizers.make_optimizer('adamw')`. `recipe` is a `ZeroSettings` or a
    `Recipe`.
    """
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        import deepspeed

    init_distributed()
    config = deepspeed_config(recipe, **config_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    if recipe.offload_optimizer or recipe.offload_param:
        with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
            from deepspeed.ops.adam import DeepSpeedCPUAdam

        clear_stale_build_lock("cpu_adam")
        optimizer = DeepSpeedCPUAdam(params, lr=recipe.lr, weight_decay=0.01, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.01)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, ds_optimizer


def engine_train_step(engine: Any, input_ids: torch.Tensor) -> float:
    """Run one DeepSpeed step (forward, engine.backward, engine.step) and return the loss."""
    loss = engine(input_ids, labels=input_ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


# -- reading what a rank holds --------------------------------------------------------------------

_tensors = iter_tensors  # every tensor in nested dicts, lists and tuples (measure.iter_tensors)


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Return the bytes of the distinct storages behind the tensors (views of one buffer count once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _view_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Return the bytes of the distinct tensors (views) themselves, not of the buffers behind them."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def rank_state_bytes(engine: Any) -> dict[str, int]:
    """Return the bytes of parameters, gradients and optimizer state this rank holds, read from DeepSpeed.

    Call it after `engine.backward` and before `engine.step` (gradients exist then). What is read:
    - stage 0: the module's parameters, their `.grad`, the PyTorch optimizer's state (m, v, step);
    - stages 1-2 (`DeepSpeedZeroOptimizer`): the flat parameter buffers `bit16_groups_flat`
      (every rank keeps all weights), the gradients DeepSpeed keeps (`averaged_gradients`, the
      contiguous `grads_in_partition`, or the whole `.grad` at stage 1), and as optimizer state the fp32
      master partitions `single_partition_of_fp32_groups` plus the inner optimizer's state of them;
    - stage 3 (`DeepSpeedZeroOptimizer_Stage3`): each parameter's partition `ds_tensor`, plus the whole
      data of persistent parameters; gradients in `grad_partitions_flat_buffer`; the fp32 master
      partitions `fp32_partitioned_groups_flat` plus their optimizer state.
    Each distinct storage counts once. `host_bytes` is the part that lives on the CPU when offloaded.
    """
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    params = [p for p in engine.module.parameters()]
    out = {"stage": stage}
    if stage == 0:
        inner = getattr(opt, "optimizer", opt)
        out["parameters"] = _storage_bytes(params)
        out["gradients"] = _storage_bytes(p.grad for p in params if p.grad is not None)
        out["optimizer_state"] = _storage_bytes(_tensors(list(inner.state.values())))
    elif stage in (1, 2):
        out["parameters"] = _storage_bytes(opt.bit16_groups_flat)
        grads = list(_tensors(opt.averaged_gradients)) + list(_tensors(getattr(opt, "grads_in_partition", None)))
        grads += [p.grad for p in params if p.grad is not None]
        out["gradients"] = _view_bytes(grads)
        out["gradient_buffer"] = _storage_bytes(grads)
        master = opt.single_partition_of_fp32_groups
        out["optimizer_state"] = _storage_bytes(list(master) + list(_tensors([opt.optimizer.state[p] for p in master if p in opt.optimizer.state])))
    else:
        persistent = [p for p in params if getattr(p, "ds_persist", False)]
        seen: set[int] = set()
        out["parameters"] = _storage_bytes([p.ds_tensor for p in params], seen) + _storage_bytes(persistent, seen)
        grads = list(_tensors(getattr(opt, "grad_partitions_flat_buffer", None))) + list(_tensors(opt.averaged_gradients))
        out["gradients"] = _storage_bytes(grads)
        master = opt.fp32_partitioned_groups_flat
        out["optimizer_state"] = _storage_bytes(list(master) + list(_tensors([opt.optimizer.state[p] for p in master if p in opt.optimizer.state])))
        out["persistent_params"] = sum(p.ds_numel for p in persistent)
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer_state"]
    return out


# -- running ranks --------------------------------------------------------------------------------

@dataclass
class ZeroJob:
    """What each rank runs: the model, the data, which stages, and the extras."""

    model_size: str = "tiny"
    batch_size: int = 2
    seq_len: int = 32
    steps: int = 3
    lr: float = 1e-3
    stages: tuple[int, ...] = ZERO_STAGES
    bucket_elements: int = 5 * 10**7
    param_persistence_threshold: int = 10**5
    offload: tuple[tuple[int, bool, bool], ...] = ()  # (stage, offload_optimizer, offload_param)
    fsdp: bool = False
    checkpoint_stage: int | None = None
    checkpoint_dir: str = ""
    seed: int = 0


@dataclass
class ZeroResult:
    """What the ranks measured: per run label, per rank bytes, losses and step times."""

    world_size: int
    n_params: int
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # label -> one dict per rank
    checkpoint: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def bytes_of(self, label: str, rank: int = 0) -> dict[str, int]:
        return self.runs[label][rank]["bytes"]


def _rank_batches(job: ZeroJob, rank: int) -> Any:
    from colab_memopt.techniques.data import load_corpus

    return load_corpus().batches(job.batch_size, job.seq_len, seed=job.seed + 1000 * rank)


def _run_engine(job: ZeroJob, rank: int, recipe: ZeroSettings, steps: int, *, read_bytes: bool = True) -> tuple[Any, dict[str, Any]]:
    from colab_memopt.techniques.models import build_model

    engine, _ = initialize(build_model(job.model_size, seed=job.seed), recipe, micro_batch_size=job.batch_size,
                           bucket_elements=job.bucket_elements, param_persistence_threshold=job.param_persistence_threshold)
    batches = _rank_batches(job, rank)
    losses, times, state = [], [], {}
    for i in range(steps):
        x = next(batches)
        start = time.perf_counter()
        loss = engine(x, labels=x).loss
        engine.backward(loss)
        if read_bytes and i == steps - 1:
            state = rank_state_bytes(engine)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return engine, {"bytes": state, "losses": losses, "step_seconds": sorted(times)[len(times) // 2]}


def _fsdp_run(job: ZeroJob, rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from colab_memopt.techniques.models import build_model

    model = build_model(job.model_size, seed=job.seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.01)
    batches = _rank_batches(job, rank)
    losses, times, state = [], [], {}
    for i in range(job.steps):
        x = next(batches)
        start = time.perf_counter()
        loss = model(x, labels=x).loss
        loss.backward()
        if i == job.steps - 1:
            local = [p.to_local() for p in model.parameters()]
            state = {
                "stage": 3,
                "parameters": _storage_bytes(local),
                "gradients": _storage_bytes(p.grad.to_local() for p in model.parameters() if p.grad is not None),
                "optimizer_state": _storage_bytes(
                    t.to_local() if hasattr(t, "to_local") else t for t in _tensors(list(opt.state.values()))),
            }
            state["total"] = state["parameters"] + state["gradients"] + state["optimizer_state"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"bytes": state, "losses": losses, "step_seconds": sorted(times)[len(times) // 2]}


def _checkpoint_run(job: ZeroJob, rank: int) -> dict[str, Any]:
    """Train, save at the middle, train on; then a fresh engine loads the checkpoint and trains the same batches."""
    recipe = ZeroSettings(lr=job.lr, zero_stage=job.checkpoint_stage)
    half = max(1, job.steps)
    engine, _ = _run_engine(job, rank, recipe, half, read_bytes=False)
    engine.save_checkpoint(job.checkpoint_dir, tag="half")
    batches = _rank_batches(job, rank)
    for _ in range(half):
        next(batches)
    continued = [engine_train_step(engine, next(batches)) for _ in range(half)]
    from colab_memopt.techniques.models import build_model

    fresh, _ = initialize(build_model(job.model_size, seed=job.seed + 1), recipe, micro_batch_size=job.batch_size,
                          bucket_elements=job.bucket_elements, param_persistence_threshold=job.param_persistence_threshold)
    fresh.load_checkpoint(job.checkpoint_dir, tag="half")
    batches = _rank_batches(job, rank)
    for _ in range(half):
        next(batches)
    resumed = [engine_train_step(fresh, next(batches)) for _ in range(half)]
    return {"stage": job.checkpoint_stage, "continued": continued, "resumed": resumed}


def _zero_worker(rank: int, world_size: int, port: int, job_dict: dict[str, Any], out_dir: str) -> None:
    """One rank: init gloo on loopback, run each stage (and FSDP2, offload, checkpoint), write rank<N>.json.

    The rank's stdout and stderr go to rank<N>.log, which `run_zero` quotes when the rank fails.
    """
    import logging

    ranks.redirect_output(out_dir, rank)
    torch.set_num_threads(1)
    job = ZeroJob(**job_dict)
    init_distributed(rank, world_size, port)
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.ERROR)
    from colab_memopt.techniques.models import build_model

    out: dict[str, Any] = {"rank": rank, "runs": {}, "n_params": sum(p.numel() for p in build_model(job.model_size).parameters())}
    for stage in job.stages:
        _, out["runs"][f"zero{stage}"] = _run_engine(job, rank, ZeroSettings(lr=job.lr, zero_stage=stage), job.steps)
    for stage, off_opt, off_param in job.offload:
        label = f"zero{stage}" + ("+offload_optimizer" if off_opt else "") + ("+offload_param" if off_param else "")
        recipe = ZeroSettings(lr=job.lr, zero_stage=stage, offload_optimizer=off_opt, offload_param=off_param)
        _, out["runs"][label] = _run_engine(job, rank, recipe, job.steps)
    if job.fsdp:
        out["runs"]["fsdp2"] = _fsdp_run(job, rank)
    if job.checkpoint_stage is not None:
        out["checkpoint"] = _checkpoint_run(job, rank)
    ranks.write_result(Path(out_dir, f"rank{rank}.json"), lambda path: path.write_text(json.dumps(out)))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def run_zero(job: ZeroJob | None = None, *, world_size: int = 2, timeout_s: float = 300.0) -> ZeroResult:
    """Run the job on `world_size` CPU ranks (spawned, gloo on 127.0.0.1) and return what each rank measured.

    Ranks that outlive `timeout_s` are killed and a TimeoutError raised; a rank that fails raises its error
    here, with the end of what it printed. A rank that dies after every rank has written its results (in
    the process group's teardown, where gloo can abort when a peer has already closed its sockets) does
    not cost the measurement: its results are kept and a RuntimeWarning quotes its log.

    Example:
        >>> result = run_zero(ZeroJob(model_size="tiny", stages=(0, 1, 2, 3)), world_size=2)
        >>> result.bytes_of("zero2", rank=1)
    """
    job = job or ZeroJob()
    bad = [s for s in (*job.stages, *(o[0] for o in job.offload)) if s not in ZERO_STAGES]
    if bad:
        raise ValueError(f"ZeRO stages must be in {ZERO_STAGES}, got {bad}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="colab_memopt_zero_") as tmp:
        job_dict = {**job.__dict__, "checkpoint_dir": job.checkpoint_dir or str(Path(tmp, "checkpoint"))}
        ranks.launch(_zero_worker, world_size, (free_port(), job_dict, tmp), workdir=tmp, timeout_s=timeout_s,
                     what="ZeRO ranks")
        outs = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
    result = ZeroResult(world_size=world_size, n_params=outs[0]["n_params"], seconds=time.perf_counter() - start)
    for label in outs[0]["runs"]:
        result.runs[label] = [r["runs"][label] for r in outs]
    result.checkpoint = outs[0].get("checkpoint", {})
    return result
