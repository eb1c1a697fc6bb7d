"""The package as a user installs it: a wheel built from the repository, used from outside it (review A10)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, env=_clean_env(), capture_output=True, text=True)
    (path,) = out.glob("colab_memopt-*.whl")
    return path


def test_wheel_ships_every_module_and_the_data_files_the_package_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"colab_memopt/{n}" for n in _package_data_files()}  # what the package's readers open
    assert "colab_memopt/planning/technique_costs.json" in shipped
    assert shipped <= names, f"read by the package, missing from the wheel: {sorted(shipped - names)}"
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "colab_memopt").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= names, f"missing from the wheel: {sorted(modules - names)}"


def test_recommend_works_from_the_installed_wheel_outside_the_repo(wheel, tmp_path):
    # A fresh venv away from the repository: only what the wheel carries is importable from colab_memopt.
    # Its dependencies (torch, transformers, ...) are this environment's, reached through a path line in a
    # .pth file: a path added that way is not a site directory, so this environment's own .pth files (the
    # editable install's finder, which would import the checkout) do not run in the fresh venv.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=False)
    py = str(env_dir / "bin" / "python")
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               env=_clean_env(), capture_output=True, text=True, check=True).stdout.strip())
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    assert ours, sys.path
    (site / "_test_dependencies.pth").write_text("\n".join(ours) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                             env=_clean_env(), capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    code = ("import colab_memopt as cm, sys; "
            "assert str(cm.__file__).startswith(sys.prefix), cm.__file__; "
            "assert not any('__editable__' in type(f).__module__ for f in sys.meta_path), sys.meta_path; "
            "from colab_memopt.techniques.architectures import small_config; "
            "small_config('llama').save_pretrained('llama'); "  # a transformers model: the SFTTrainer's plan too
            "r = cm.recommend('llama', 1, seq_len=64); print(r.recipe); print('OK')")
    run = subprocess.run([py, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]


def test_transformers_floor_takes_the_dtype_argument():
    # loading.load_model and architectures pass `dtype=` to from_pretrained/from_config: transformers 4.56 on
    import re

    text = (REPO / "pyproject.toml").read_text()
    floors = re.findall(r'"transformers>=([0-9.]+)"', text)
    assert floors and all(tuple(int(x) for x in f.split(".")) >= (4, 56) for f in floors), floors
    uses = [p.name for p in (REPO / "colab_memopt").rglob("*.py") if re.search(r"from_(pretrained|config)\([^)]*\bdtype=", p.read_text())]
    assert uses  # the reason for the floor; drop the floor's comment with the last use


# A path out of the installed package (a checkout's benchmarks/ or tests/): missing on Colab.
_CHECKOUT_PATH = re.compile(r"""__file__\s*\)(?:\.resolve\(\))?\.parent\.parent|["']benchmarks["']\s*/|benchmarks/results/""")
# How a notebook would read a package file itself (it reads them through the package: cm.capacity.shipped_table,
# cm.chat.SAMPLE_CHATS), which breaks when a file moves.
_OWN_READ = re.compile(r"""files\(\s*["']colab_memopt|cm\.__file__|colab_memopt\.__file__""")


def _package_data_files() -> list[str]:
    """Return the data files (relative to colab_memopt/) the package's own readers open."""
    from colab_memopt.planning import capacity, chat, costs, prediction

    pkg = REPO / "colab_memopt"
    paths = [chat.SAMPLE_CHATS, costs.COSTS_FILE, pkg / "planning" / "estimate_band.json",
             *(capacity.RESULTS_DIR / f"{name}.json" for name in ("capacity", "context"))]
    assert Path(prediction.__file__).with_name("estimate_band.json") == paths[2]  # prediction.estimate_band reads it
    return [p.resolve().relative_to(pkg.resolve()).as_posix() for p in paths]


def test_package_data_covers_every_file_the_package_reads():
    """What the package reads at run time (notebooks 15-19 through it) ships in the wheel: a package-data glob."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for name in _package_data_files():
        assert (REPO / "colab_memopt" / name).is_file(), f"colab_memopt/{name} does not exist"
        folder, _, file = name.rpartition("/")
        package = "colab_memopt." + folder.split("/")[0]
        relative = name.split("/", 1)[1]
        assert any(fnmatch.fnmatch(relative, g) for g in data.get(package, [])), f"no package-data glob ships {name}"


def test_notebooks_read_package_files_through_the_package():
    import nbformat

    for path in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                hit = _OWN_READ.search(cell.source)
                assert hit is None, f"{path.name} opens a package file by its path: {cell.source[:80]!r}"


def test_notebooks_read_no_path_only_a_checkout_has():
    """No notebook code reads benchmarks/ or climbs out of the installed package (review: 17's context.json)."""
    import nbformat

    for path in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                hit = _CHECKOUT_PATH.search(cell.source)
                assert hit is None, f"{path.name} reads a path only a checkout has: {hit.group(0)!r} in {cell.source[:80]!r}"
