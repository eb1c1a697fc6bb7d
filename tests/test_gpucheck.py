"""make test-gpu on a machine without CUDA (this one), and the pieces of colab_memopt.gpucheck a CPU can run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colab_memopt import gpucheck
from colab_memopt.runner import notebook_paths

REPO = Path(__file__).resolve().parent.parent
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@needs_no_cuda
def test_make_test_gpu_refuses_in_one_line_with_status_2():
    run = subprocess.run(["make", "--no-print-directory", "test-gpu", f"GPU_PYTHON={sys.executable}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert run.returncode == 2, run
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "nothing was run" in lines[0], lines


@needs_no_cuda
def test_gpucheck_itself_refuses_in_one_line_with_status_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "colab_memopt.gpucheck", "--out", str(tmp_path / "gpu")], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "sees no CUDA GPU" in lines[0], run.stderr
    assert not (tmp_path / "gpu").exists()


def test_emulation_is_t4_on_other_gpus_and_can_be_turned_off():
    assert gpucheck.emulation_for("Tesla T4", None) == "none"
    assert gpucheck.emulation_for("NVIDIA H100 80GB HBM3", None) == "t4"
    assert gpucheck.emulation_for("NVIDIA H100 80GB HBM3", "") == "t4"
    assert gpucheck.emulation_for("NVIDIA H100 80GB HBM3", "none") == "none"
    with pytest.raises(ValueError, match="CM_EMULATE must be 't4' or 'none', got 'a100'"):
        gpucheck.emulation_for("NVIDIA H100", "a100")


def test_child_env_emulates_and_leaves_the_allocator_as_on_colab(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    env = gpucheck.child_env("t4")
    assert env["CM_EMULATE"] == "t4" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:2:16:8"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert "CUBLAS_WORKSPACE_CONFIG" not in gpucheck.child_env("none")


def test_t4_budgets_name_real_notebooks_and_override_no_parameter():
    per, default, total = gpucheck.load_budgets()
    stems = {p.stem for p in notebook_paths()}
    assert set(per) <= stems, set(per) - stems
    assert 0 < default <= total and all(0 < b <= total for b in per.values())


def test_summary_names_failed_steps_last():
    steps = [gpucheck.StepResult("unit", "passed", 12.0, "exit 0"), gpucheck.StepResult("notebook 05_x", "failed", 3.0, "exit 1")]
    text = gpucheck.summary_table("NVIDIA H100 emulating t4", steps)
    assert text.splitlines()[0] == "make test-gpu on NVIDIA H100 emulating t4"
    assert "FAILED" in text and text.splitlines()[-1] == "1 of 2 steps passed; FAILED: notebook 05_x"


def test_steps_time_out_fail_and_are_written(tmp_path):
    env = gpucheck.child_env("none")
    ok = gpucheck.run_command("ok", [sys.executable, "-c", "print('fine')"], env, 60, tmp_path / "ok.log")
    slow = gpucheck.run_command("slow", [sys.executable, "-c", "import time; time.sleep(30)"], env, 1, tmp_path / "slow.log")
    bad = gpucheck.run_command("bad", [sys.executable, "-c", "raise SystemExit(3)"], env, 60, tmp_path / "bad.log")
    assert ok.status == "passed" and "fine" in ok.detail
    assert slow.status == "failed" and "over its budget of 1 s" in slow.detail
    assert bad.status == "failed" and "exit 3" in bad.detail
    gpucheck.write_outputs(tmp_path, "NVIDIA H100 emulating t4", {"gpu": "NVIDIA H100"}, [ok, slow, bad])
    import json

    written = json.loads((tmp_path / "results.json").read_text())
    assert written["label"] == "NVIDIA H100 emulating t4" and written["failed"] == ["slow", "bad"]
    assert (tmp_path / "claims.md").read_text().startswith("# Claims checked on NVIDIA H100 emulating t4")


def test_the_costs_step_writes_the_table_of_the_class_the_run_stands_for():
    # issue 18: an H100 emulating a T4 measures the t4 table (labelled so); the package reads it by that name
    from colab_memopt.costs import COSTS_FILES

    assert gpucheck.costs_class("t4", (9, 0)) == "t4" and gpucheck.costs_class("none", (7, 5)) == "t4"
    assert gpucheck.costs_class("none", (8, 0)) == "ampere+"
    assert gpucheck.costs_file_name("t4", (9, 0)) == COSTS_FILES["t4"].name == "technique_costs_t4.json"
    assert gpucheck.costs_file_name("none", (9, 0)) == "technique_costs_ampere.json"


@pytest.mark.parametrize("reserved,status", [(10 * 2**30, "passed"), (int(14.5 * 2**30), "failed"), (None, "passed")])
def test_notebooks_are_held_to_the_t4_by_reserved_bytes_plus_a_context(tmp_path, monkeypatch, reserved, status):
    # a step peak under the T4 can still need more of the card: the allocator's cache and the CUDA context
    import json

    from colab_memopt import env, runner

    assert gpucheck.ASSUMED_T4_CONTEXT_BYTES == env.ASSUMED_T4_CONTEXT_BYTES
    path = notebook_paths()[0]
    monkeypatch.setattr(runner, "notebook_paths", lambda names: [path])

    def fake_run(step, cmd, env_, timeout_s, log):
        report = {"peak_bytes": 8 * 2**30}
        (tmp_path / "results").mkdir(exist_ok=True)
        (tmp_path / "results" / f"{path.stem}.json").write_text(json.dumps(
            {"device": "cuda", "baseline": report, "optimized": None, "cuda_max_reserved_bytes": reserved}))
        return gpucheck.StepResult(step, "passed", 1.0, "exit 0")

    monkeypatch.setattr(gpucheck, "run_command", fake_run)
    (result,) = gpucheck.run_notebooks(tmp_path, {}, None)
    assert result.status == status and result.data["max_reserved_bytes"] == reserved
    if status == "failed":
        assert "assumed T4 context" in result.detail
