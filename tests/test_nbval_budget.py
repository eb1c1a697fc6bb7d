"""The nbval budget plugin fails a run whose notebook exceeds its budget, and passes one within it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # absent on a lent GPU machine without the notebook wheels

TESTS = Path(__file__).resolve().parent


def _run(tmp_path, budget):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(0.5)")]
    (tmp_path / "nbs").mkdir()
    nbformat.write(nb, tmp_path / "nbs" / "99_demo.ipynb")
    (tmp_path / "params.yaml").write_text(f"99_demo:\n  budget_seconds: {budget}\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "NBVAL_BUDGET_PARAMS_FILE": str(tmp_path / "params.yaml"),
           "NBVAL_BUDGET_SECONDS_FILE": str(tmp_path / "seconds.json")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "nbval_budget", "-p", "no:cacheprovider", "--nbval-lax",
         "--nbval-current-env", str(tmp_path / "nbs")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )


def test_over_budget_fails(tmp_path):
    result = _run(tmp_path, 0.1)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "OVER BUDGET" in result.stdout
    assert (tmp_path / "seconds.json").exists()


def test_within_budget_passes(tmp_path):
    result = _run(tmp_path, 120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "99_demo" in result.stdout and "OVER BUDGET" not in result.stdout
