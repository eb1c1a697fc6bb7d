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
    # an H100 emulating a T4 measures the t4 table (labelled so); the package reads it by that name
    from colab_memopt.costs import COSTS_FILES

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

    first = gpucheck.StepResult("unit 1/3", "failed", 5.0, "exit 1")
    gpucheck.write_outputs(tmp_path, "H100 emulating t4", {"gpu": "H100"}, [first])
    gpucheck.write_outputs(tmp_path, "H100 emulating t4", {}, [gpucheck.StepResult("gpu-tests", "passed", 9.0, "exit 0")])
    again = gpucheck.StepResult("unit 1/3", "passed", 6.0, "exit 0")
    written = gpucheck.write_outputs(tmp_path, "H100 emulating t4", {}, [again])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == written and on_disk["env"] == {"gpu": "H100"}  # a later slice keeps the first call's env
    assert [s["step"] for s in on_disk["steps"]] == ["unit 1/3", "gpu-tests"] and on_disk["failed"] == []
    assert on_disk["steps"][0]["seconds"] == 6.0


def test_unit_tests_split_into_parts_that_cover_each_file_once():
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py"))
    for n in (1, 3, 4):
        parts = gpucheck.unit_parts(n)
        assert len(parts) == n and all(parts) and sorted(f for part in parts for f in part) == files
    assert gpucheck.parse_part("2/3") == (2, 3) and gpucheck.parse_part(None) is None
    for bad in ("0/3", "4/3", "two", "1/0"):
        with pytest.raises(ValueError, match="--part must be K/N"):
            gpucheck.parse_part(bad)
    with pytest.raises(ValueError, match="parts must be an integer >= 1"):
        gpucheck.unit_parts(0)


def test_only_and_notebooks_and_part_are_options():
    for argv in (["--only", "bogus"], ["--part", "5/2"]):
        with pytest.raises(SystemExit) as exc:
            gpucheck.main(argv)
        assert exc.value.code == 2


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


def test_call_plan_covers_everything_within_the_device_budget(capsys):
    from colab_memopt.runner import notebook_paths

    plan = gpucheck.CALL_PLAN
    assert sum(c["budget_minutes"] for c in plan) <= 45 and all(c["budget_minutes"] <= 9 for c in plan)
    assert all(c["only"][0] == "install" for c in plan)  # every call starts on a bare machine
    assert {s for c in plan for s in c["only"]} == set(gpucheck.STEPS)
    parts = [c["part"] for c in plan if "unit" in c["only"]]
    n = int(parts[0].split("/")[1])
    assert sorted(parts) == [f"{k}/{n}" for k in range(1, n + 1)]
    planned = [nb for c in plan for nb in c.get("notebooks", [])]
    assert sorted(p.stem for p in notebook_paths(planned)) == sorted(p.stem for p in notebook_paths())
    assert len(planned) == len(set(planned))
    commands = gpucheck.call_commands()
    assert len(commands) == len(plan) and all("--wheelhouse .whl/part1" in c and "--budget-seconds" in c for c in commands)
    assert "--only install unit --part 2/2" in commands[2]
    assert gpucheck.main(["plan"]) == 0  # no GPU needed to print it
    printed = capsys.readouterr().out
    assert printed.count("\ncall ") == len(plan) - 1 and "budgets, not measurements" in printed


def test_a_call_budget_cuts_the_notebooks_short_and_says_so(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(gpucheck, "load_budgets", lambda: ({}, 600, 3600))
    results = gpucheck.run_notebooks(tmp_path, gpucheck.child_env("none"), ["00"], deadline=time.monotonic() - 1)
    assert [(r.status, r.detail) for r in results] == [("failed", "not run: this call's --budget-seconds is spent")]


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
