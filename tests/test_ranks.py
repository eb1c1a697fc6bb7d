"""ranks.launch: results, and every way a rank can fail (the workers live here so spawn can import them)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from colab_memopt import ranks


def _write_result(workdir: str, rank: int, world_size: int) -> None:
    out = {"rank": rank, "world_size": world_size, "threads": os.environ.get("OMP_NUM_THREADS"),
           "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "ds_accelerator": os.environ.get("DS_ACCELERATOR")}
    ranks.write_result(Path(workdir, f"rank{rank}.json"), lambda path: path.write_text(json.dumps(out)))


def _ok_worker(rank: int, world_size: int, workdir: str) -> None:
    ranks.redirect_output(workdir, rank)
    print(f"rank {rank} says hello")
    _write_result(workdir, rank, world_size)


def _raise_worker(rank: int, world_size: int, workdir: str) -> None:
    ranks.redirect_output(workdir, rank)
    if rank == 1:
        print("rank 1 is about to raise")
        raise ValueError("broken on purpose")
    _write_result(workdir, rank, world_size)


def _abort_before_worker(rank: int, world_size: int, workdir: str) -> None:
    ranks.redirect_output(workdir, rank)
    if rank == 1:
        print("rank 1 aborts before its result", flush=True)
        os.abort()
    _write_result(workdir, rank, world_size)


def _abort_after_worker(rank: int, world_size: int, workdir: str) -> None:
    ranks.redirect_output(workdir, rank)
    _write_result(workdir, rank, world_size)
    if rank == 1:
        while not Path(workdir, "rank0.json").exists():  # the teardown case: every result is written
            time.sleep(0.05)
        print("rank 1 aborts in teardown", flush=True)
        os.abort()


def _hang_worker(rank: int, world_size: int, workdir: str) -> None:
    ranks.redirect_output(workdir, rank)
    time.sleep(600)


def test_launch_runs_every_rank_with_its_threads_and_no_gpu(tmp_path, monkeypatch):
    # The parent may see a GPU; the ranks must not (review A1: DeepSpeed would pick cuda:<rank>).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    ranks.launch(_ok_worker, 2, (str(tmp_path),), workdir=tmp_path, timeout_s=120, threads_per_rank=1)
    for r in range(2):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert out == {"rank": r, "world_size": 2, "threads": "1", "cuda_visible": "", "ds_accelerator": "cpu"}
        assert f"rank {r} says hello" in ranks.log_tail(tmp_path, r)
    assert not list(tmp_path.glob("*.partial"))
    # The parent's own environment is left as it was.
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0" and "DS_ACCELERATOR" not in os.environ


def test_a_rank_that_raises_names_itself_and_quotes_its_log(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)test ranks: rank 1 failed.*broken on purpose.*rank 1 is about to raise"):
        ranks.launch(_raise_worker, 2, (str(tmp_path),), workdir=tmp_path, timeout_s=120, what="test ranks")


def test_a_rank_that_dies_before_its_result_fails_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 died before every rank had written its result.*SIGABRT.*aborts before its result"):
        ranks.launch(_abort_before_worker, 2, (str(tmp_path),), workdir=tmp_path, timeout_s=120)


def test_a_rank_that_dies_in_teardown_keeps_the_results_and_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"(?s)rank 1 died after every rank had written its result.*aborts in teardown"):
        ranks.launch(_abort_after_worker, 2, (str(tmp_path),), workdir=tmp_path, timeout_s=120)
    assert all((tmp_path / f"rank{r}.json").exists() for r in range(2))


def test_ranks_past_the_timeout_are_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="hanging ranks did not finish within timeout_s=2"):
        ranks.launch(_hang_worker, 2, (str(tmp_path),), workdir=tmp_path, timeout_s=2, what="hanging ranks")
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
    ({"world_size": True}, "world_size must be an integer >= 1, got True"),
    ({"timeout_s": 0}, "timeout_s must be > 0, got 0"),
    ({"threads_per_rank": 0}, "threads_per_rank must be an integer >= 1, got 0"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, match):
    args = {"world_size": 2, "timeout_s": 10, "threads_per_rank": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        ranks.launch(_ok_worker, args.pop("world_size"), (str(tmp_path),), workdir=tmp_path, **args)


def _quiet_worker(rank: int, world_size: int, workdir: str) -> None:
    ranks.redirect_output(workdir, rank)
    if rank == 0:
        _write_result(workdir, rank, world_size)
    else:
        print("rank 1 returns without a result", flush=True)


def test_an_earlier_launchs_results_are_never_passed_off_as_this_ones(tmp_path):
    # probe row 125: run 1 leaves rank0/1.json; in run 2 rank 1 aborts before writing.
    ranks.launch(_ok_worker, 2, (str(tmp_path),), workdir=tmp_path, timeout_s=120)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 died before every rank had written its result.*aborts before its result"):
        ranks.launch(_abort_before_worker, 2, (str(tmp_path),), workdir=tmp_path, timeout_s=120)
    assert not (tmp_path / "rank1.json").exists()
    assert "says hello" not in ranks.log_tail(tmp_path, 1)  # the log is this launch's only


def test_a_rank_that_exits_0_without_its_result_is_an_error_naming_it(tmp_path):
    # probe row 127
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 exited without writing its result rank1.json.*returns without a result"):
        ranks.launch(_quiet_worker, 2, (str(tmp_path),), workdir=tmp_path, timeout_s=120)


def test_a_workdir_that_does_not_exist_is_refused_before_launching(tmp_path):
    # probe row 129
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"workdir must be an existing folder, got '.*nope'"):
        ranks.launch(_ok_worker, 2, (str(tmp_path),), workdir=tmp_path / "nope", timeout_s=120)
    assert time.monotonic() - start < 2


def test_a_worker_from_a_notebook_cell_is_refused_naming_why(monkeypatch, tmp_path):
    # probe row 131: a function defined in __main__ without a file cannot be imported by spawn
    import sys

    def cell_worker(rank, world_size):
        pass

    cell_worker.__module__ = "__main__"
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    with pytest.raises(ValueError, match=r"worker 'test_a_worker.*cell_worker' is defined in __main__ without a file.*module"):
        ranks.launch(cell_worker, 2, workdir=tmp_path, timeout_s=120)


def test_write_result_leaves_the_previous_file_when_saving_fails(tmp_path):
    path = tmp_path / "rank0.json"
    path.write_text('{"old": 1}')

    def crash(p):
        p.write_text('{"half')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ranks.write_result(path, crash)
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.json"]
