"""Run a worker on several ranks of this machine: spawned processes, gloo on the loopback address.

`zero.run_zero` (DeepSpeed ZeRO, notebook 10) and `structured.distributed_matvec` (notebook 13) use
`launch`. A worker must live in an importable module (spawn re-imports it; a function defined in a
notebook fails), is called as `worker(rank, world_size, *args)`, writes its result with `write_result`
when it has finished, and calls `redirect_output` first, so that what it prints, C++
aborts included, lands in `rank<N>.log` and is quoted when the rank fails.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from colab_memopt.core.fileio import atomic_write

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """Return a TCP port on the loopback address that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def write_result(path: str | Path, save: Callable[[Path], None]) -> None:
    """Write a rank's result whole: `save` writes a temporary file, fsynced, then renamed to `path`.

    `launch` takes the presence of every result file to mean every rank has finished its work
    (`fileio.atomic_write`, the one writer of result files).

    Example:
        >>> write_result(Path(workdir, f"rank{rank}.json"), lambda p: p.write_text(json.dumps(out)))
    """
    atomic_write(path, save)


def log_path(workdir: str | Path, rank: int) -> Path:
    """Return where rank `rank` writes what it prints."""
    return Path(workdir, f"rank{rank}.log")


def redirect_output(workdir: str | Path, rank: int) -> None:
    """Send this process's stdout and stderr to `log_path(workdir, rank)`, at the file-descriptor level."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path(workdir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def log_tail(workdir: str | Path, rank: int, chars: int = 3000) -> str:
    """Return the end of what rank `rank` printed, or a note that it printed nothing."""
    path = log_path(workdir, rank)
    if not path.exists():
        return f"(rank {rank} wrote no log)"
    # DeepSpeed prints this line once per process on a machine without a GPU: it says nothing about the failure.
    lines = [line for line in path.read_text(errors="replace").splitlines() if "Setting accelerator to CPU" not in line]
    return "\n".join(lines)[-chars:] or f"(rank {rank}'s log is empty)"


def rank_environment(threads_per_rank: int = 1) -> dict[str, str]:
    """Return the environment variables `launch` sets for its ranks: CPU only, `threads_per_rank` threads.

    The ranks run on the CPU with gloo whatever the machine has: `CUDA_VISIBLE_DEVICES=""` hides the
    GPU, and `DS_ACCELERATOR=cpu` makes DeepSpeed pick its CPU accelerator (on a GPU machine it would
    otherwise pick CUDA and call `set_device(local_rank)`: rank 1 -> cuda:1, an invalid device on one GPU).
    """
    return {"OMP_NUM_THREADS": str(threads_per_rank), "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


def launch(
    worker: Callable[..., None],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    workdir: str | Path,
    result_file: str = "rank{rank}.json",
    timeout_s: float = 300.0,
    what: str = "ranks",
    threads_per_rank: int = 1,
) -> None:
    """Run `worker(rank, world_size, *args)` on `world_size` spawned processes and wait for all of them.

    Args:
        worker: a function of an importable module; rank r writes `workdir/result_file.format(rank=r)`
            with `write_result` when its work is done.
        world_size: number of ranks (>= 1).
        args: further arguments, picklable.
        workdir: where the ranks write their results and logs.
        timeout_s: the ranks are killed after this many seconds and a TimeoutError raised.
        what: names the job in errors ("ZeRO ranks").
        threads_per_rank: OMP_NUM_THREADS of each rank (ranks share the machine's cores).

    The ranks see no GPU (`rank_environment`): they run on the CPU, also on a CUDA machine.

    Raises:
        RuntimeError: a rank raised, died before every rank had written its result, or exited
            without writing its result; the message names the rank and quotes the end of its log.
        TimeoutError: the ranks outlived `timeout_s`.
        ValueError: `workdir` is not an existing folder, or `worker` cannot be imported by a spawned
            process (defined in a notebook cell or an interactive session).

    Result files and logs left in `workdir` by an earlier launch are removed before the ranks start,
    so a result returned is always this launch's.

    A rank that dies after every rank has written its result (in the process group's teardown, where
    gloo can abort when a peer has already closed its sockets) costs nothing that was measured: the
    launch returns and a RuntimeWarning quotes that rank's log.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be an integer >= 1, got {threads_per_rank!r}")
    if not Path(workdir).is_dir():
        raise ValueError(f"workdir must be an existing folder, got {str(workdir)!r}")
    if not callable(worker):
        raise TypeError(f"worker must be a function, got {type(worker).__name__}")
    module = getattr(worker, "__module__", None)
    if module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise ValueError(f"worker {getattr(worker, '__qualname__', worker)!r} is defined in __main__ without a file "
                         "(a notebook cell or an interactive session): spawned ranks cannot import it; "
                         "move it into a module (a .py file) and import it from there")
    results = [Path(workdir, result_file.format(rank=r)) for r in range(world_size)]
    for path in [*results, *(log_path(workdir, r) for r in range(world_size))]:
        path.unlink(missing_ok=True)  # an earlier launch's: never passed off as this one's
    child_env = rank_environment(threads_per_rank)
    saved = {name: os.environ.get(name) for name in child_env}
    os.environ.update(child_env)  # read by the children when they start
    try:
        ctx = mp.start_processes(worker, args=(world_size, *args), nprocs=world_size, join=False, start_method="spawn")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(0.5, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within timeout_s={timeout_s} s; killed them")
    except mp.ProcessRaisedException as exc:  # a Python error in a rank: its traceback is in the message
        raise RuntimeError(f"{what}: rank {exc.error_index} failed: {exc}\n"
                           f"its log ends:\n{log_tail(workdir, exc.error_index)}") from exc
    except mp.ProcessExitedException as exc:  # killed by a signal, or exited with a code and no Python error
        done = all(p.exists() for p in results)
        if not done:
            raise RuntimeError(f"{what}: rank {exc.error_index} died before every rank had written its result "
                               f"({exc}); its log ends:\n{log_tail(workdir, exc.error_index)}") from exc
        warnings.warn(f"{what}: rank {exc.error_index} died after every rank had written its result ({exc}); "
                      f"the results are kept. Its log ends:\n{log_tail(workdir, exc.error_index)}",
                      RuntimeWarning, stacklevel=2)
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    missing = [r for r, p in enumerate(results) if not p.exists()]
    if missing:
        r = missing[0]
        raise RuntimeError(f"{what}: rank {r} exited without writing its result {results[r].name} "
                           f"(ranks without a result: {missing}); its log ends:\n{log_tail(workdir, r)}")
