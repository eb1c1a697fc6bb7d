"""make test-gpu on a machine without CUDA (this one), and the pieces of colab_memopt.tooling.gpucheck a CPU can run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colab_memopt import gpucheck, gpuplan, gpurecord
from colab_memopt.tooling.runner import notebook_paths

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
    run = subprocess.run([sys.executable, "-m", "colab_memopt.tooling.gpucheck", "--out", str(tmp_path / "gpu")], cwd=REPO,
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
    per, default, total = gpuplan.load_budgets()
    stems = {p.stem for p in notebook_paths()}
    assert set(per) <= stems, set(per) - stems
    assert 0 < default <= total and all(0 < b <= total for b in per.values())


def test_summary_names_failed_steps_last():
    steps = [gpurecord.StepResult("unit", "passed", 12.0, "exit 0"), gpurecord.StepResult("notebook 05_x", "failed", 3.0, "exit 1")]
    text = gpurecord.summary_table("NVIDIA H100 emulating t4", steps)
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
    gpurecord.write_outputs(tmp_path, "NVIDIA H100 emulating t4", {"gpu": "NVIDIA H100"}, [ok, slow, bad])
    import json

    written = json.loads((tmp_path / "results.json").read_text())
    assert written["label"] == "NVIDIA H100 emulating t4" and written["failed"] == ["slow", "bad"]
    assert (tmp_path / "claims.md").read_text().startswith("# Claims checked on NVIDIA H100 emulating t4")


def test_the_costs_step_writes_the_table_of_the_class_the_run_stands_for():
    # an H100 emulating a T4 measures the t4 table (labelled so); the package reads it by that name
    from colab_memopt.planning.costs import COSTS_FILES

    assert gpucheck.costs_class("t4", (9, 0)) == "t4" and gpucheck.costs_class("none", (7, 5)) == "t4"
    assert gpucheck.costs_class("none", (8, 0)) == "ampere+"
    assert gpucheck.costs_file_name("t4", (9, 0)) == COSTS_FILES["t4"].name == "technique_costs_t4.json"
    assert gpucheck.costs_file_name("none", (9, 0)) == "technique_costs_ampere.json"


# -- make test-gpu on the GPU machines we can get (offline, in slices) -----------------------------------------

def _third_party_imports() -> set[str]:
    """Return the top-level modules the package, tests, benchmarks and notebooks import that are not the stdlib."""
    import ast
    import json

    sources = [p.read_text() for folder in ("colab_memopt", "tests", "benchmarks") for p in (REPO / folder).rglob("*.py")]
    for nb in (REPO / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        sources += ["\n".join(line for line in "".join(c["source"]).splitlines() if not line.lstrip().startswith(("!", "%")))
                    for c in cells if c["cell_type"] == "code"]
    local = {p.stem for p in (REPO / "tests").rglob("*.py")} | {p.stem for p in (REPO / "benchmarks").glob("*.py")}
    found = set()
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    written = {"probe_workers"}  # benchmarks/reliability_probe.py writes it into a scratch folder and imports it
    return found - set(sys.stdlib_module_names) - local - written - {"colab_memopt", "torch", "__future__", "playwright"}


def test_needed_covers_every_package_the_tests_and_notebooks_import():
    # playwright is the browser tests' own (make test-browser), never run by make test-gpu
    missing = _third_party_imports() - set(gpucheck.NEEDED)
    assert not missing, f"make test-gpu would not install {sorted(missing)}: add them to gpucheck.NEEDED"
    for module in ("galore_torch", "apollo_torch", "torchao", "badam", "optimi", "trl", "datasets", "deepspeed"):
        assert module in gpucheck.NEEDED


def test_results_merge_step_by_step_so_a_stopped_run_keeps_what_finished(tmp_path):
    import json

    first = gpurecord.StepResult("unit 1/3", "failed", 5.0, "exit 1")
    gpurecord.write_outputs(tmp_path, "H100 emulating t4", {"gpu": "H100"}, [first])
    gpurecord.write_outputs(tmp_path, "H100 emulating t4", {}, [gpurecord.StepResult("gpu-tests", "passed", 9.0, "exit 0")])
    again = gpurecord.StepResult("unit 1/3", "passed", 6.0, "exit 0")
    written = gpurecord.write_outputs(tmp_path, "H100 emulating t4", {}, [again])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == written and on_disk["env"] == {"gpu": "H100"}  # a later slice keeps the first call's env
    assert [s["step"] for s in on_disk["steps"]] == ["unit 1/3", "gpu-tests"] and on_disk["failed"] == []
    assert on_disk["steps"][0]["seconds"] == 6.0


# -- results.json written by slices side by side, and by calls killed at any moment (reliability probe 4) -------------

# One interpreter imports gpurecord once, then forks the writers (a fork costs no import): each writer adds its steps
# through write_outputs and reports each one on a pipe once write_outputs has returned (from then on it must survive).
_FORKED_WRITERS = r"""
import json, os, random, signal, sys, time
from pathlib import Path
from colab_memopt.tooling.gpurecord import StepResult, write_outputs
import colab_memopt.core.report, colab_memopt.tooling.rollup  # what write_outputs imports: once, before the forks

out, mode = Path(sys.argv[1]), sys.argv[2]


def writer(name, count):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            for i in range(count):
                write_outputs(out, "cpu", {"writer": name}, [StepResult(f"{name}-{i}", "passed", 0.1, "x" * 4000)])
                os.write(w, f"{name}-{i}\n".encode())
        except BaseException as exc:
            os.write(w, f"ERROR {type(exc).__name__}: {exc}\n".encode())
            code = 1
        os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)


def finish(pid, pipe):
    lines = [line.strip() for line in pipe]
    _, status = os.waitpid(pid, 0)
    return lines, status


steps = lambda: {s["step"] for s in json.loads((out / "results.json").read_text())["steps"]}
if mode == "race":  # make test-gpu's slices: two processes, 25 results each
    writers = [writer(name, 25) for name in ("a", "b")]
    done = [finish(*w) for w in writers]
    confirmed = [line for lines, _ in done for line in lines]
    print(json.dumps({"confirmed": confirmed, "status": [s for _, s in done], "kept": sorted(steps())}))
else:  # a call killed (SIGKILL: a lent machine's limit) at random moments while another slice keeps writing
    rng = random.Random(0)
    confirmed, lost, errors = set(), [], []
    for attempt in range(12):
        victim, other = writer(f"k{attempt}", 10**6), writer(f"o{attempt}", 3)
        first = victim[1].readline().strip()  # it writes: kill it at a random moment of its next writes
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(victim[0], signal.SIGKILL)
        for lines, status in (finish(*victim), finish(*other)):
            errors += [line for line in lines if line.startswith("ERROR")]
            confirmed |= {line for line in [first, *lines] if line and not line.startswith("ERROR")}
        lost += sorted(confirmed - steps())  # whole JSON after every kill, holding every result confirmed so far
    print(json.dumps({"confirmed": len(confirmed), "lost": lost, "errors": errors}))
"""


def _forked_writers(out: Path, mode: str) -> dict:
    import json

    out.mkdir(exist_ok=True)
    run = subprocess.run([sys.executable, "-c", _FORKED_WRITERS, str(out), mode], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_two_slices_writing_results_json_side_by_side_keep_every_result(tmp_path):
    """Probe 4: two processes adding 25 results each to one results.json kept 41-48 of 50, and one of them raised
    FileNotFoundError renaming the shared results.json.tmp."""
    found = _forked_writers(tmp_path / "gpu", "race")
    assert found["status"] == [0, 0] and len(found["confirmed"]) == 50
    assert found["kept"] == sorted(found["confirmed"])
    import json

    payload = json.loads((tmp_path / "gpu" / "results.json").read_text())
    assert len(payload["steps"]) == 50 and payload["failed"] == []
    assert (tmp_path / "gpu" / "claims.md").read_text().startswith("# Claims checked on cpu")
    assert not [p.name for p in (tmp_path / "gpu").iterdir() if p.name.endswith((".tmp", ".partial"))]


def test_a_call_killed_while_recording_loses_no_result_written_before(tmp_path):
    """A writer SIGKILLed at random moments of its writes, 12 times, another slice writing beside it: results.json is
    whole after every kill and holds every result either had finished writing."""
    found = _forked_writers(tmp_path / "gpu", "kill")
    assert found["errors"] == [] and found["lost"] == []
    assert found["confirmed"] > 12 * 4  # the victims wrote before they were killed (the test can fail)


def test_a_broken_results_json_is_kept_aside_and_the_run_still_records(tmp_path, capsys):
    """Probe 4: a results.json cut short made every later write_outputs raise JSONDecodeError (naming no file), and
    the Recorder went on without recording anything."""
    import json

    broken = '{"steps": [{"step": "unit", "status": "pass'
    (tmp_path / "results.json").write_text(broken)
    record = gpurecord.Recorder(tmp_path, "H100 emulating t4", {}, None)
    with pytest.warns(RuntimeWarning, match=r"results\.json is not valid JSON .*kept as results\.json\.broken-"):
        record(gpurecord.StepResult("planner", "passed", 1.0))
    record(gpurecord.StepResult("notebook 00_x", "passed", 2.0))
    assert "not rewritten" not in capsys.readouterr().out
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [s["step"] for s in payload["steps"]] == ["planner", "notebook 00_x"]
    aside = [p for p in tmp_path.iterdir() if ".broken-" in p.name]
    assert len(aside) == 1 and aside[0].read_text() == broken  # kept for a person to read, not deleted


def test_unit_tests_split_into_parts_that_cover_each_file_once():
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py"))
    for n in (1, 3, 4):
        parts = gpuplan.unit_parts(n)
        assert len(parts) == n and all(parts) and sorted(f for part in parts for f in part) == files
    assert gpuplan.parse_part("2/3") == (2, 3) and gpuplan.parse_part(None) is None
    for bad in ("0/3", "4/3", "two", "1/0"):
        with pytest.raises(ValueError, match="--part must be K/N"):
            gpuplan.parse_part(bad)
    with pytest.raises(ValueError, match="parts must be an integer >= 1"):
        gpuplan.unit_parts(0)


def test_only_and_notebooks_and_part_are_options():
    for argv in (["--only", "bogus"], ["--part", "5/2"]):
        with pytest.raises(SystemExit) as exc:
            gpucheck.main(argv)
        assert exc.value.code == 2


@pytest.mark.parametrize("argv, message", [
    (["--budget-seconds", "nan"], "--budget-seconds must be > 0, got nan"),
    (["--budget-seconds", "inf"], "--budget-seconds must be a finite number of seconds, got inf"),
    (["--budget-seconds", "0"], "--budget-seconds must be > 0, got 0"),
    (["_notebook"], "_notebook needs the path of one notebook"),
    (["_notebook", "no/such/notebook.ipynb"], "_notebook: no notebook at 'no/such/notebook.ipynb'"),
])
def test_bad_command_lines_are_refused_with_status_2_before_anything_runs(argv, message, capsys):
    # reliability probe 4: NaN passed the `<= 0` check; `_notebook` without a path, or with a missing one, gave a
    # Python traceback and exit 1
    with pytest.raises(SystemExit) as exc:
        gpucheck.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "_notebook" not in gpucheck.build_parser().format_usage()  # the internal verb is not offered


def _fake_wheel(folder: Path, name: str, version: str = "1.0", body: str = "VALUE = 1\n") -> Path:
    """Write a minimal valid wheel of a pure-Python package `name` into `folder`."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": body,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},{len(t.encode())}"
              for p, t in files.items()] + [f"{dist}/RECORD,,"]
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def test_install_works_offline_from_a_wheelhouse_one_package_at_a_time(tmp_path, monkeypatch):
    # A fake wheelhouse in two parts, no index: one package installs, one is absent, one wheel is broken.
    (tmp_path / "house" / "part1").mkdir(parents=True)
    (tmp_path / "house" / "part2").mkdir()
    _fake_wheel(tmp_path / "house" / "part1", "cm_fake_ok")
    (tmp_path / "house" / "part2" / "cm_fake_broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    monkeypatch.setattr(gpucheck, "NEEDED", {"cm_fake_ok": "cm-fake-ok", "cm_fake_absent": "cm-fake-absent",
                                             "cm_fake_broken": "cm-fake-broken"})
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # nothing may come from a network
    site = tmp_path / "site"
    result = gpucheck.install_missing(str(tmp_path / "house"), str(site))
    assert (site / "cm_fake_ok" / "__init__.py").exists()
    assert result.data["installed"] == ["cm_fake_ok-1.0-py3-none-any.whl"]
    assert list(result.data["failed"]) == ["cm_fake_broken-1.0-py3-none-any.whl"]
    assert result.data["absent"] == ["cm-fake-absent"] and result.status == "failed"
    assert "FAILED" in result.detail and "absent" in result.detail
    # a second call on the same machine installs nothing again
    (tmp_path / "house" / "part2" / "cm_fake_broken-1.0-py3-none-any.whl").unlink()
    again = gpucheck.install_missing(str(tmp_path / "house"), str(site))
    assert again.data["installed"] == [] and again.status == "passed"
    with pytest.raises(ValueError, match="must be a folder of wheels"):
        gpucheck.install_missing(str(tmp_path / "nowhere"), str(site))
    _fake_wheel(tmp_path / "house" / "part2", "cm_fake_ok", "2.0")
    with pytest.raises(ValueError, match="two versions of cm-fake-ok"):
        gpucheck.wheelhouse_files(str(tmp_path / "house"))


def test_a_call_budget_cuts_the_notebooks_short_and_says_so(tmp_path, monkeypatch):
    import time

    results = gpucheck.run_notebooks(tmp_path, gpucheck.child_env("none"), ["00"], deadline=time.monotonic() - 1)
    assert [(r.status, r.detail) for r in results] == [("not finished", "not started: this call's --budget-seconds is spent")]


def test_a_test_failing_only_for_an_absent_optional_package_is_skipped(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tests_conftest", REPO / "tests" / "conftest.py")  # not tests/gpu's
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "galore_torch" else real(name, *a))
    err = RuntimeError("optimizer 'galore_adamw8bit' needs galore-torch and bitsandbytes: pip install galore-torch")
    assert conftest._absent_package(err) == "galore-torch"
    missing = ModuleNotFoundError("No module named 'galore_torch'", name="galore_torch")
    assert conftest._absent_package(missing) == "galore-torch"
    # installed packages, and errors of other kinds, are not skipped: the test fails as it should
    assert conftest._absent_package(RuntimeError("optimizer 'badam' needs badam: pip install badam")) is None
    assert conftest._absent_package(ValueError("needs galore-torch")) is None


def test_the_skip_hook_end_to_end(tmp_path):
    # a few seconds (a pytest child that imports torch): the hooks' wiring is what a unit check cannot show
    (tmp_path / "test_fake.py").write_text(
        "import pytest\nfrom colab_memopt import gpucheck\ngpucheck.NEEDED['cm_not_here'] = 'cm-not-here'\n\n"
        "@pytest.fixture\ndef opt():\n    raise ModuleNotFoundError(\"No module named 'cm_not_here'\", name='cm_not_here')\n\n"
        "def test_needs_it():\n    raise RuntimeError(\"optimizer 'x' needs cm-not-here: pip install cm-not-here\")\n\n"
        "def test_fixture_needs_it(opt):\n    pass\n\n"
        "def test_fails_for_another_reason():\n    raise RuntimeError('a real bug')\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])})
    assert "1 failed, 2 skipped" in run.stdout, run.stdout[-2000:]
    assert "needs cm-not-here, which is not installed here" in run.stdout

@pytest.mark.parametrize("reserved,status", [(10 * 2**30, "passed"), (int(14.5 * 2**30), "failed"), (None, "passed")])
def test_notebooks_are_held_to_the_t4_by_reserved_bytes_plus_a_context(tmp_path, monkeypatch, reserved, status):
    # a step peak under the T4 can still need more of the card: the allocator's cache and the CUDA context
    import json

    from colab_memopt import env, runner

    assert gpucheck.T4_CUDA_CONTEXT_BYTES == env.T4_CUDA_CONTEXT_BYTES
    assert gpucheck.T4_DEVICE_LIMIT_BYTES == env.T4_TOTAL_BYTES
    path = notebook_paths()[0]
    monkeypatch.setattr(runner, "notebook_paths", lambda names: [path])

    def fake_run(step, cmd, env_, timeout_s, log, **kwargs):
        report = {"peak_bytes": 8 * 2**30}
        (tmp_path / "results").mkdir(exist_ok=True)
        (tmp_path / "results" / f"{path.stem}.json").write_text(json.dumps(
            {"device": "cuda", "baseline": report, "optimized": None, "cuda_max_reserved_bytes": reserved}))
        return gpurecord.StepResult(step, "passed", 1.0, "exit 0")

    monkeypatch.setattr(gpucheck, "run_command", fake_run)
    (result,) = gpucheck.run_notebooks(tmp_path, {}, None)
    assert result.status == status and result.data["max_reserved_bytes"] == reserved
    if status == "failed":
        assert "a T4's CUDA context of" in result.detail  # the message since one T4 answer (427f128)


# -- the one call on a lent GPU machine (--parallel, the deadline, the archive, `plan`) ----------------------------

def _parameters_cell(stem: str) -> dict:
    """Return the names and values of a notebook's `parameters` cell."""
    import ast
    import json

    cells = json.loads((REPO / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    (cell,) = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    tree = ast.parse("".join(cell["source"]))
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)}


def test_the_one_call_command_fits_the_device_tool_and_parses():
    import shlex

    command = gpuplan.one_call_command()
    assert len(command) <= gpuplan.COMMAND_LIMIT_CHARS == 2000
    words = shlex.split(command)
    assert words[:4] == ["PYTHONUNBUFFERED=1", "python3", "-m", "colab_memopt.gpucheck"]  # the name the lent machines are told
    args = gpucheck.build_parser().parse_args(words[4:])
    settings = gpuplan.load_t4_settings()
    assert args.parallel == settings.workers and args.budget_seconds == settings.deadline_seconds
    assert set(args.only) == {"install", "gpu-tests", "planner", "notebooks"} and args.notebooks is None
    assert args.wheelhouse == gpuplan.CARRY and args.pip_target == gpuplan.SITE
    assert args.archive == f"$OUT/{gpuplan.ARCHIVE_NAME}"  # one file back, at the top of $OUT


def test_the_plan_covers_every_notebook_gpu_tests_and_the_grid_within_the_deadline():
    settings = gpuplan.load_t4_settings()
    stems = [p.stem for p in notebook_paths()]
    items, not_run = gpuplan.lent_items(settings, gpuplan.ONE_CALL_STEPS, stems,
                                         lambda stem: [m for m in settings.requires.get(stem, []) if m == "deepspeed"])
    names = {i.name for i in items}
    assert {"gpu-tests", "planner"} <= names
    assert {f"notebook {s}" for s in stems} == {n for n in names if n.startswith("notebook")} | {r.step for r in not_run}
    assert [(r.step, r.status) for r in not_run] == [("notebook 10_deepspeed_zero", "not run")]
    assert not_run[0].detail.startswith("not run: deepspeed not installed")
    slices = gpuplan.pack_slices(items, settings.workers)
    assert sorted(i.name for s in slices for i in s) == sorted(names)
    # every slice's estimates fit what the deadline leaves after the install; the deadline leaves the call's
    # last minute and a half for the archive and the transfers
    assert max(sum(i.seconds for i in s) for s in slices) <= settings.deadline_seconds - settings.setup_seconds
    assert settings.deadline_seconds + 60 <= gpuplan.CALL_LIMIT_SECONDS
    # every notebook's estimate is listed (none falls back to the default unnoticed)
    assert set(settings.lent_seconds) == set(stems)


def test_plan_prints_the_command_and_the_carry(capsys):
    assert gpucheck.main(["plan"]) == 0  # no GPU needed to print it
    printed = capsys.readouterr().out.splitlines()
    command = gpuplan.one_call_command()
    assert command in printed and f'  carry: ["{gpuplan.CARRY}"]' in printed
    assert any("of 64" in line and "the checkout" in line for line in printed)
    assert any("10_deepspeed_zero: not run" in line for line in printed)
    assert all(len(line) <= 100 for line in printed if line != command), [l for l in printed if len(l) > 100]


def test_plan_says_when_the_carry_does_not_fit(tmp_path, monkeypatch, capsys):
    part = tmp_path / gpuplan.CARRY
    part.mkdir(parents=True)
    (part / "big.whl").write_bytes(b"\0" * (63 * 2**20))  # with the checkout, over 64 MiB
    monkeypatch.setattr(gpuplan, "checkout_bytes", lambda root=None: 3 * 2**20)
    assert gpuplan.print_plan(tmp_path) == 1
    assert "does not fit: the carry and the checkout take 66.0 MiB, over 64" in capsys.readouterr().out


def test_slices_are_packed_longest_first():
    items = [gpuplan.Item(n, s) for n, s in [("a", 300), ("b", 200), ("c", 200), ("d", 100), ("e", 100)]]
    slices = gpuplan.pack_slices(items, 2)
    assert [[i.name for i in s] for s in slices] == [["a", "d", "e"], ["b", "c"]]
    # LPT alone gives 7 s and 5 s here (3+2+2, 3+2); a swap evens them out
    items = [gpuplan.Item(n, s) for n, s in [("a", 3), ("b", 3), ("c", 2), ("d", 2), ("e", 2)]]
    assert sorted(sum(i.seconds for i in s) for s in gpuplan.pack_slices(items, 2)) == [6, 6]
    with pytest.raises(ValueError, match="--parallel must be an integer >= 1"):
        gpuplan.pack_slices(items, 0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return not Path(f"/proc/{pid}/stat").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_the_deadline_kills_a_straggler_and_records_it_not_finished(tmp_path):
    import time

    env = gpucheck.child_env("none")
    # the straggler starts a grandchild in a session of its own, as a notebook's kernel is started
    straggler = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
                 f" start_new_session=True); open({str(tmp_path / 'grandchild')!r}, 'w').write(str(p.pid)); time.sleep(120)")
    commands = {"fast": "print('fine')", "slow": straggler, "after slow": "print('never')", "other": "print('also fine')"}
    slices = [[gpuplan.Item("fast", 1), gpuplan.Item("slow", 1), gpuplan.Item("after slow", 1)], [gpuplan.Item("other", 1)]]
    seen = []

    def run_item(item, left):
        return gpucheck.run_command(item.name, [sys.executable, "-c", commands[item.name]], env, left,
                                    tmp_path / f"{item.name}.log", at_deadline=True)

    start = time.monotonic()
    results = gpucheck.run_slices(slices, run_item, start + 4, seen.append)
    assert time.monotonic() - start < 30
    status = {r.step: r.status for r in results}
    # the idle slice takes "after slow" before the deadline: it passes; the straggler is stopped
    assert status == {"fast": "passed", "other": "passed", "slow": "not finished", "after slow": "passed"}, results
    slow = next(r for r in results if r.step == "slow")
    assert "stopped at the run's deadline" in slow.detail and slow.data["slice"] in (1, 2)
    assert [r.step for r in seen] == [r.step for r in results]
    grandchild = int((tmp_path / "grandchild").read_text())
    time.sleep(0.5)
    assert not _pid_alive(grandchild), "the straggler's grandchild survived the deadline"


def test_items_not_started_by_the_deadline_are_not_finished_never_passed():
    import time

    ran = []
    slices = [[gpuplan.Item("a", 1), gpuplan.Item("b", 1)]]
    results = gpucheck.run_slices(slices, lambda item, left: ran.append(item) or gpurecord.StepResult(item.name, "passed", 0),
                                  time.monotonic() - 1, lambda r: None)
    assert ran == [] and [(r.step, r.status) for r in results] == [("a", "not finished"), ("b", "not finished")]
    assert all(r.detail == "not started before the run's deadline" for r in results)
    # an item's crash is its own failure
    boom = gpucheck.run_slices([[gpuplan.Item("x", 1)]], lambda item, left: 1 / 0, time.monotonic() + 60, lambda r: None)
    assert boom[0].status == "failed" and "ZeroDivisionError" in boom[0].detail


def test_summary_and_exit_status_count_not_finished_as_failures_and_not_run_apart(tmp_path, capsys):
    record = gpurecord.Recorder(tmp_path, "H100 emulating t4", {}, None)
    record(gpurecord.StepResult("notebook 00_x", "passed", 5.0, "exit 0", {"estimate_seconds": 60}))
    record(gpurecord.StepResult("notebook 10_x", "not run", 0.0, "not run: deepspeed not installed"))
    assert gpurecord.finish(record, tmp_path, "H100 emulating t4") == 0  # a reason given: not a failure
    record(gpurecord.StepResult("notebook 17_x", "not finished", 9.0, "stopped at the run's deadline after 9 s"))
    assert gpurecord.finish(record, tmp_path, "H100 emulating t4") == 1
    text = (tmp_path / "summary.txt").read_text()
    assert "1 of 3 steps passed; NOT FINISHED: notebook 17_x; not run (reason above): notebook 10_x" in text
    assert "measured seconds (for tests/notebook_parameters_t4.yaml): 00_x 5" in text
    import json

    written = json.loads((tmp_path / "results.json").read_text())
    assert written["not_finished"] == ["notebook 17_x"] and written["not_run"] == ["notebook 10_x"] and written["failed"] == []


def test_the_archive_holds_what_finished_when_the_call_is_killed(tmp_path):
    # a run killed by the call's limit (SIGKILL: no cleanup) still leaves the archive of what finished so far
    import signal
    import tarfile
    import time

    out, archive = tmp_path / "gpu", tmp_path / "OUT" / "gpucheck.tar.gz"
    script = f"""
import sys, time
from pathlib import Path
from colab_memopt import gpucheck, gpuplan, gpurecord
record = gpurecord.Recorder(Path({str(out)!r}), "H100 emulating t4", {{}}, Path({str(archive)!r}), every_s=0)
env = gpucheck.child_env("none")
def run_item(item, left):
    code = "print('fine')" if item.name == "fast" else "import time; time.sleep(120)"
    return gpucheck.run_command(item.name, [sys.executable, "-c", code], env, left, Path({str(out)!r}) / "logs" / "x.log",
                                at_deadline=True)
gpucheck.run_slices([[gpuplan.Item("fast", 1), gpuplan.Item("slow", 1)]], run_item, time.monotonic() + 300, record)
"""
    (out / "logs").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        for _ in range(600):
            time.sleep(0.1)
            if archive.exists():
                with tarfile.open(archive) as tar:
                    if "gpu/results.json" in tar.getnames() and b'"fast"' in tar.extractfile("gpu/results.json").read():
                        break
        else:
            pytest.fail("no archive with the first result")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with tarfile.open(archive) as tar:
        import json

        payload = json.loads(tar.extractfile("gpu/results.json").read())
    assert [(s["step"], s["status"]) for s in payload["steps"]] == [("fast", "passed")]


def test_the_archive_stays_under_its_limit_results_first(tmp_path):
    import tarfile

    out = tmp_path / "gpu"
    (out / "notebooks").mkdir(parents=True)
    (out / "results.json").write_text("{}")
    (out / "notebooks" / "17_long_context.ipynb").write_bytes(os.urandom(3 * 2**20))
    (out / "notebooks" / "00_where.ipynb").write_bytes(os.urandom(2**20))
    written = gpurecord.write_archive(out, tmp_path / "a.tar.gz", limit_bytes=2 * 2**20)
    assert written["left_out"] == ["notebooks/17_long_context.ipynb"]
    assert (tmp_path / "a.tar.gz").stat().st_size <= 2 * 2**20
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        names = tar.getnames()
        assert names[0] == "gpu/results.json" and "gpu/notebooks/00_where.ipynb" in names
        assert b"notebooks/17_long_context.ipynb" in tar.extractfile("gpu/LEFT_OUT.txt").read()


def test_t4_parameters_are_the_notebooks_own_and_take_no_model_from_the_hub():
    import transformers

    settings = gpuplan.load_t4_settings()
    for stem, params in settings.parameters.items():
        declared = _parameters_cell(stem)
        assert set(params) <= set(declared), f"{stem}: {set(params) - set(declared)} are not its parameters"
    for path in notebook_paths():
        declared = _parameters_cell(path.stem)
        if "/" in str(declared.get("model_id", "")):  # a hub id by default: the lent machine has no network
            family = settings.parameters.get(path.stem, {}).get("example_family")
            assert family in transformers.CONFIG_MAPPING, f"{path.stem} would download {declared['model_id']}"
    assert set(settings.parameters) == {"18_your_own_model", "19_your_trainer_on_a_free_t4"}


def test_the_notebook_child_injects_the_t4_parameters(tmp_path, monkeypatch):
    from colab_memopt import runner

    seen = {}

    def fake_run_notebook(path, out_dir, results_dir, parameters):
        seen[path.stem] = parameters
        return runner.NotebookRun(path.stem, out_dir / path.name, 0.1, parameters)

    monkeypatch.setattr(runner, "run_notebook", fake_run_notebook)
    for stem in ("18_your_own_model", "00_where_the_memory_goes"):
        assert gpucheck._notebook_child(str(REPO / "notebooks" / f"{stem}.ipynb"), str(tmp_path)) == 0
    assert seen["18_your_own_model"]["example_family"] == "llama" and seen["00_where_the_memory_goes"] == {}
    assert gpucheck.child_env("t4")["HF_HUB_OFFLINE"] == "1"


def test_the_t4_settings_file_refuses_what_it_does_not_know(tmp_path):
    bad = tmp_path / "t4.yaml"
    bad.write_text("notebooks:\n  00_where_the_memory_goes:\n    model_size: small\n")
    with pytest.raises(ValueError, match=r"notebook '00_where_the_memory_goes' may set \['budget_seconds', 'lent_seconds', "
                                         r"'parameters', 'requires'\].*got \['model_size'\]"):
        gpuplan.load_t4_settings(bad)
    bad.write_text("lent_run:\n  steps:\n    unit: 100\n")
    with pytest.raises(ValueError, match=r"lent_run.steps may name \['gpu-tests', 'planner', 'costs'\], got \['unit'\]"):
        gpuplan.load_t4_settings(bad)


def test_a_notebook_whose_module_is_absent_is_not_run_with_the_reason(tmp_path, monkeypatch):
    settings = gpuplan.load_t4_settings()
    settings.requires["00_where_the_memory_goes"] = ["cm_not_a_module"]
    monkeypatch.setattr(gpucheck, "load_t4_settings", lambda path=None: settings)
    monkeypatch.setattr(gpucheck, "run_command", lambda *a, **k: pytest.fail("a notebook without its module ran"))
    (result,) = gpucheck.run_notebooks(tmp_path, gpucheck.child_env("none"), ["00"])
    assert result.status == "not run" and result.detail == "not run: cm_not_a_module not installed"
    assert gpucheck.absent_requirements(settings, "10_deepspeed_zero", {}) == (
        [] if importlib.util.find_spec("deepspeed") else ["deepspeed"])


def test_each_slice_gets_its_share_of_the_cores():
    env = gpucheck.worker_env({"PATH": "/bin"}, 5, cpus=16)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3" and env["PATH"] == "/bin"
    assert gpucheck.worker_env({"OMP_NUM_THREADS": "1"}, 5, cpus=16)["OMP_NUM_THREADS"] == "1"
    assert gpucheck.worker_env({}, 32, cpus=16)["OMP_NUM_THREADS"] == "1"


def test_the_parallel_run_end_to_end_with_fake_steps(tmp_path, monkeypatch, capsys):
    # run_parallel's wiring on the CPU: install first, a notebook left out with its reason, the rest in two slices,
    # each result recorded at once, the summary and the archive at the end
    import argparse
    import json
    import tarfile
    import time

    settings = gpuplan.load_t4_settings()
    settings.requires["10_deepspeed_zero"] = ["cm_not_a_module"]
    monkeypatch.setattr(gpucheck, "load_t4_settings", lambda path=None: settings)
    monkeypatch.setattr(gpucheck, "install_missing", lambda wheelhouse, target: gpurecord.StepResult("install", "passed", 1.0, "ok"))
    monkeypatch.setattr(gpucheck, "step_command", lambda name, out, *a: (
        [sys.executable, "-c", f"print('{name} ok')"], out / "logs" / f"{name}.log"))
    monkeypatch.setattr(gpucheck, "notebook_command", lambda path, out: [sys.executable, "-c", (
        f"import json, pathlib; d = pathlib.Path({str(tmp_path / 'results')!r}); d.mkdir(exist_ok=True); "
        f"(d / '{path.stem}.json').write_text(json.dumps({{'device': 'cuda', 'baseline': {{'peak_bytes': 1}}}}))")])
    args = argparse.Namespace(only=list(gpuplan.ONE_CALL_STEPS), skip=[], notebooks=["00", "10", "18"], parallel=2,
                              wheelhouse=None, pip_target=None)
    record = gpurecord.Recorder(tmp_path, "H100 emulating t4", {"gpu": "H100"}, tmp_path / "OUT" / "gpucheck.tar.gz")
    code = gpucheck.run_parallel(args, tmp_path, "H100 emulating t4", gpucheck.child_env("t4"), "t4", (9, 0), record,
                                 time.monotonic() + 120)
    assert code == 0, capsys.readouterr().out
    steps = {s.step: s for s in record.steps}
    assert steps["install"].status == "passed" and record.steps[0].step == "install"
    assert steps["notebook 10_deepspeed_zero"].status == "not run"
    assert all(steps[n].status == "passed" for n in ("gpu-tests", "planner", "notebook 00_where_the_memory_goes",
                                                      "notebook 18_your_own_model"))
    assert steps["notebook 18_your_own_model"].data["peak_bytes"] == 1  # held to the T4 (notebook_verdict)
    assert {steps[n].data["slice"] for n in ("gpu-tests", "planner")} <= {1, 2}
    with tarfile.open(tmp_path / "OUT" / "gpucheck.tar.gz") as tar:
        summary = tar.extractfile(f"{tmp_path.name}/summary.txt").read().decode()
        assert json.loads(tar.extractfile(f"{tmp_path.name}/results.json").read())["not_run"] == ["notebook 10_deepspeed_zero"]
    assert "5 of 6 steps passed; not run (reason above): notebook 10_deepspeed_zero" in summary


def test_the_offline_install_is_one_pip_call_when_every_wheel_installs(tmp_path, monkeypatch):
    (tmp_path / "house").mkdir()
    for name in ("cm_fake_one", "cm_fake_two"):
        _fake_wheel(tmp_path / "house", name)
    monkeypatch.setattr(gpucheck, "NEEDED", {"cm_fake_one": "cm-fake-one", "cm_fake_two": "cm-fake-two"})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    real, pips = subprocess.run, []

    def counting_run(cmd, *a, **k):
        if cmd[1:4] == ["-m", "pip", "install"]:
            pips.append(cmd)
        return real(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "run", counting_run)
    result = gpucheck.install_missing(str(tmp_path / "house"), str(tmp_path / "site"))
    assert result.status == "passed" and sorted(result.data["installed"]) == [
        "cm_fake_one-1.0-py3-none-any.whl", "cm_fake_two-1.0-py3-none-any.whl"]
    assert len(pips) == 1  # the one-call carry in one pip (2 s on the H100 machine), not one pip per package


def test_a_step_that_measured_nan_is_still_recorded(tmp_path):
    # results.json is strict JSON now (fileio): a NaN in a step's data is written as null, not refused
    import json

    gpurecord.write_outputs(tmp_path, "cpu", {}, [gpurecord.StepResult("grid", "failed", float("nan"), "x",
                                                                       {"error_pct": float("inf"), "rows": [1.0, float("nan")]})])
    step = json.loads((tmp_path / "results.json").read_text())["steps"][0]
    assert step["seconds"] is None and step["data"] == {"error_pct": None, "rows": [1.0, None]}
