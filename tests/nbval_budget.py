"""pytest plugin for the nbval run of the notebooks: time each notebook and hold it to its budget.

`make test` executes every notebook once, with nbval, on copies that papermill prepared with the CI
parameters of tests/notebook_parameters.yaml. This plugin sums the time of each notebook's cells,
writes build/notebook_seconds.json, and fails the run when a notebook exceeds its `budget_seconds`. It also keeps
what each notebook's cells wrote to stderr (their `stderr` stream outputs, as nbval received them from the kernel) in
build/notebook_stderr.json, {notebook: [{"cell": index, "text": ...}]}: tests/test_notebooks.py holds it to a short
allow-list.

It also orders the session's items for two workers (`--dist loadscope --no-loadscope-reorder`): the files named
by `--run-first` first (each becomes the first work of a worker process), then the notebooks, the largest budget
first, then the files named by `--run-early` (the longest test files: started early, they leave short files for the
session's end, which both workers then finish together), then everything else in collection order.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from colab_memopt.tooling.runner import CPU_PARAMS_FILE, REPO_ROOT, load_cpu_parameters

# Both can be pointed elsewhere by the plugin's own test.
SECONDS_FILE = Path(os.environ.get("NBVAL_BUDGET_SECONDS_FILE", REPO_ROOT / "build" / "notebook_seconds.json"))
PARAMS_FILE = Path(os.environ.get("NBVAL_BUDGET_PARAMS_FILE", CPU_PARAMS_FILE))
STDERR_FILE = Path(os.environ.get("NBVAL_BUDGET_STDERR_FILE", SECONDS_FILE.parent / "notebook_stderr.json"))
_seconds: dict[str, float] = defaultdict(float)
_stderr: dict[str, list[dict]] = defaultdict(list)


def pytest_addoption(parser):  # noqa: ANN001 - pytest hook
    parser.addoption("--run-first", action="append", default=[], metavar="PATH",
                     help="a test file whose items run before all others (repeatable)")
    parser.addoption("--run-early", action="append", default=[], metavar="PATH",
                     help="a test file whose items run right after the notebooks (repeatable)")


def pytest_collection_modifyitems(session, config, items):  # noqa: ANN001 - pytest hook
    first = [Path(p).resolve() for p in config.getoption("run_first")]
    early = [Path(p).resolve() for p in config.getoption("run_early")]
    budgets = load_cpu_parameters(PARAMS_FILE)

    def key(pair):
        index, item = pair
        path = Path(str(item.path)).resolve()
        if path in first:
            return (0, first.index(path), index)
        if path.suffix == ".ipynb":
            return (1, -float(budgets.get(path.stem, {}).get("budget_seconds", 0)), index)
        if path in early:
            return (2, early.index(path), index)
        return (3, 0, index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001 - pytest hook
    """Put a notebook cell's stderr on its report (it travels from an xdist worker to the main process with it)."""
    outcome = yield
    outputs = getattr(item, "test_outputs", None) if call.when == "call" else None
    text = "".join(o.get("text", "") for o in outputs or () if o.get("output_type") == "stream" and o.get("name") == "stderr")
    if text:
        outcome.get_result().user_properties.append(("stderr", {"cell": getattr(item, "cell_num", None), "text": text}))


def pytest_runtest_logreport(report):  # noqa: ANN001 - pytest hook
    path = Path(report.nodeid.split("::")[0])
    if path.suffix == ".ipynb":
        _seconds[path.stem] += report.duration
        _stderr[path.stem] += [value for key, value in report.user_properties if key == "stderr"]


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001 - pytest hook
    if not _seconds:
        return
    SECONDS_FILE.parent.mkdir(parents=True, exist_ok=True)
    SECONDS_FILE.write_text(json.dumps(dict(_seconds), indent=2) + "\n")
    STDERR_FILE.parent.mkdir(parents=True, exist_ok=True)
    STDERR_FILE.write_text(json.dumps({name: _stderr.get(name, []) for name in sorted(_seconds)}, indent=2) + "\n")
    budgets = load_cpu_parameters(PARAMS_FILE)
    over = {name: (sec, budgets[name]["budget_seconds"]) for name, sec in _seconds.items()
            if name in budgets and sec > budgets[name]["budget_seconds"]}
    width = max(len(n) for n in _seconds)
    print("\nnotebook seconds (budget):")
    for name, sec in sorted(_seconds.items()):
        budget = budgets.get(name, {}).get("budget_seconds", "?")
        print(f"  {name:{width}s} {sec:6.1f} s ({budget} s){'  OVER BUDGET' if name in over else ''}")
    if over:
        session.exitstatus = 1
