"""The README's first screen, run as written: the commands for one's own machine and the install line for one's own
notebook (newcomer review 4: the README's only command was `make test`, and no install line).

There is no GitHub here: the repository's URL is replaced by this checkout (its committed HEAD for the clone and the
install). `make run` runs as written with two make variables that keep it short and out of build/: one notebook
(NOTEBOOKS) and its own output folder (RUN_OUT); `make test` is this test's own suite, so it is checked as make reads
it (`make -n`), not run inside itself.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

from colab_memopt.tooling.project import BRANCH, REPOSITORY_URL, install_command

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FIRST_SCREEN_LINES = 40
SHORT_NOTEBOOK = "04_gradient_accumulation"  # one of the shortest at its CI parameters


def _first_screen_commands() -> tuple[list[str], list[str]]:
    """Return the first screen's two shell blocks: (the commands for one's own machine, the install line)."""
    first = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES])
    blocks = re.findall(r"```bash\n(.*?)```", first, re.S)
    assert len(blocks) == 2, f"the README's first {FIRST_SCREEN_LINES} lines hold {len(blocks)} bash blocks, not 2"
    machine, install = ([line.split("  #")[0].strip() for line in b.splitlines() if line.strip()] for b in blocks)
    return machine, install


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "MAKEFLAGS",
                                                           "MAKELEVEL", "MFLAGS")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def test_the_first_screen_holds_the_machine_commands_and_the_install_line():
    machine, install = _first_screen_commands()
    assert machine == [f"git clone {REPOSITORY_URL} && cd {REPOSITORY_URL.rsplit('/', 1)[1]}", "make run", "make test"]
    assert install == [install_command(("colab",))], "the notebooks' install cell (colab_memopt.tooling.project)"


def test_the_clone_command_clones_a_checkout_with_both_make_targets(tmp_path):
    clone = _first_screen_commands()[0][0].split(" && ")[0]
    name = REPOSITORY_URL.rsplit("/", 1)[1]
    (tmp_path / "origin").mkdir()
    (tmp_path / "origin" / name).symlink_to(REPO)  # a local path that ends as the URL does: git names the folder so
    (tmp_path / "here").mkdir()
    tmp_path = tmp_path / "here"
    command = shlex.split(clone.replace(REPOSITORY_URL, str(tmp_path.parent / "origin" / name)))
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=300)
    assert run.returncode == 0, run.stderr
    folder = tmp_path / name  # what `cd` enters
    makefile = (folder / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_make_run_runs_a_notebook_headless_and_prints_its_summary(tmp_path):
    """The README's `make run`, on one short notebook at the CPU parameters the runner picks without a GPU. Its cells
    take seconds: a minute per cell (RUN_ARGS) bounds what a kernel that goes idle without replying costs (the
    runner's note on ipykernel#1529: it happened here once on 2026-11-29, and the run waited over 10 minutes), and the
    runner runs a timed-out notebook once more."""
    command = _first_screen_commands()[0][1]
    assert command == "make run"
    out = tmp_path / "build"
    run = subprocess.run([*shlex.split(command), f"NOTEBOOKS={SHORT_NOTEBOOK}", f"RUN_OUT={out}",
                          "RUN_ARGS=--cell-timeout 60"], cwd=REPO, capture_output=True, text=True, env=_env(), timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "running 1 notebook(s) on the CPU with CI parameters" in run.stdout, run.stdout[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["notebooks"]) == [SHORT_NOTEBOOK]
    assert (out / "notebooks" / f"{SHORT_NOTEBOOK}.ipynb").is_file() and (out / "claims.md").is_file()
    assert SHORT_NOTEBOOK in run.stdout.split("running 1 notebook(s)", 1)[1]  # the summary names it


def test_make_test_is_a_target_make_can_run():
    command = _first_screen_commands()[0][2]
    assert command == "make test"
    run = subprocess.run([*shlex.split(command), "-n"], cwd=REPO, capture_output=True, text=True, env=_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert "pytest" in run.stdout, run.stdout


def test_the_install_line_installs_the_package_into_a_fresh_environment(tmp_path):
    """The install line as a user runs it, the GitHub URL replaced by this repository at HEAD (`git+file://`):
    without its dependencies (`--no-deps`: no download), which the fresh environment reaches through a path line to
    this environment's site-packages, as tests/test_packaging.py does."""
    (line,) = _first_screen_commands()[1]
    line = line.replace(f"{REPOSITORY_URL}@{BRANCH}", f"file://localhost{REPO}@{_head()}")  # pip reads file:///p@x as a path
    assert f"file://localhost{REPO}" in line, "the install line names the repository's URL and branch"
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=False)
    py = str(env_dir / "bin" / "python")
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               env=_env(), capture_output=True, text=True, check=True).stdout.strip())
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "_test_dependencies.pth").write_text("\n".join(ours) + "\n")
    words = shlex.split(line)
    assert words[:2] == ["pip", "install"], line
    command = [sys.executable, "-m", *words, "--no-deps", "--no-build-isolation", "--target", str(site)]
    install = subprocess.run(command, env=_env(), capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    code = ("import colab_memopt as cm, sys; assert cm.__file__.startswith(sys.prefix), cm.__file__; "
            "print(cm.plan_trainer.__name__, cm.quiet.__name__)")
    run = subprocess.run([py, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.split() == ["plan_trainer", "quiet"], run.stderr[-3000:]

