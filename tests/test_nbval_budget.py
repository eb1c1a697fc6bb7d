"""The nbval budget plugin fails a run whose notebook exceeds its budget, and passes one within it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # absent on a lent GPU machine without the notebook wheels

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One nbval run of two notebooks: 98_within (budget 120 s) and 99_over (budget 0.1 s), each sleeping 0.5 s."""
    tmp_path = tmp_path_factory.mktemp("nbval_budget")
    (tmp_path / "nbs").mkdir()
    for name in ("98_within", "99_over"):
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(0.5)"),
                    nbformat.v4.new_code_cell(f"import sys, warnings\nprint('out')\nprint('{name} note', file=sys.stderr)\n"
                                              "warnings.warn('a library note')")]
        nbformat.write(nb, tmp_path / "nbs" / f"{name}.ipynb")
    (tmp_path / "params.yaml").write_text("98_within:\n  budget_seconds: 120\n99_over:\n  budget_seconds: 0.1\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "NBVAL_BUDGET_PARAMS_FILE": str(tmp_path / "params.yaml"),
           "NBVAL_BUDGET_SECONDS_FILE": str(tmp_path / "seconds.json"), "NBVAL_BUDGET_STDERR_FILE": str(tmp_path / "stderr.json")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "nbval_budget", "-p", "no:cacheprovider", "--nbval-lax",
         "--nbval-current-env", str(tmp_path / "nbs")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    return result, tmp_path


def _line(result, name):
    return next(line for line in result.stdout.splitlines() if line.strip().startswith(name))


def test_over_budget_fails(run):
    result, tmp_path = run
    assert result.returncode == 1, result.stdout + result.stderr
    assert "OVER BUDGET" in _line(result, "99_over")
    assert (tmp_path / "seconds.json").exists()


def test_within_budget_passes(run):
    result, _ = run
    assert "OVER BUDGET" not in _line(result, "98_within"), result.stdout
    assert "4 passed" in result.stdout, result.stdout  # both notebooks' cells ran; only the budget failed the run


def test_each_cells_stderr_is_recorded_by_notebook(run):
    """What a notebook's cells write to stderr (prints, warnings) is kept per notebook and cell; stdout is not."""
    import json

    _, tmp_path = run
    recorded = json.loads((tmp_path / "stderr.json").read_text())
    assert set(recorded) == {"98_within", "99_over"}
    for name, records in recorded.items():
        assert [r["cell"] for r in records] == [1], records
        text = records[0]["text"]
        assert text.startswith(f"{name} note\n") and "UserWarning: a library note" in text and "out" not in text


def test_the_session_runs_first_files_then_notebooks_by_budget_then_early_files_then_the_rest(tmp_path, monkeypatch):
    """The order two workers take the session's files in: `--run-first`, the notebooks (largest budget first),
    `--run-early` (the longest test files, so that short ones end the session), then the rest as collected."""
    import types

    import nbval_budget

    (tmp_path / "params.yaml").write_text("01_a:\n  budget_seconds: 10\n02_b:\n  budget_seconds: 99\n")
    monkeypatch.setattr(nbval_budget, "PARAMS_FILE", tmp_path / "params.yaml")
    names = ["tests/test_a.py", "nbs/01_a.ipynb", "tests/test_long.py", "tests/test_measured.py", "nbs/02_b.ipynb",
             "tests/test_z.py"]
    items = [types.SimpleNamespace(path=tmp_path / name) for name in names]
    options = {"run_first": [str(tmp_path / "tests/test_measured.py")], "run_early": [str(tmp_path / "tests/test_long.py")]}
    config = types.SimpleNamespace(getoption=options.__getitem__)
    nbval_budget.pytest_collection_modifyitems(None, config, items)
    assert [str(item.path.relative_to(tmp_path)) for item in items] == [
        "tests/test_measured.py", "nbs/02_b.ipynb", "nbs/01_a.ipynb", "tests/test_long.py", "tests/test_a.py",
        "tests/test_z.py"]
