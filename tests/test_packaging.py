"""The package as a user installs it: a wheel built from the repository, used from outside it (review A10)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _pins(*names: str) -> list[str]:
    """Return requirements.txt's pinned lines for these packages (torch==2.13.0 installs from local disk)."""
    lines = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    pins = [line for line in lines if line.split("==")[0] in names]
    assert len(pins) == len(names), f"requirements.txt lacks a pin among {names}: {pins}"
    return pins


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


def test_wheel_ships_every_module_and_the_default_cost_table(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "colab_memopt/technique_costs.json" in names
    modules = {f"colab_memopt/{p.name}" for p in (REPO / "colab_memopt").glob("*.py")}
    assert modules <= names, f"missing from the wheel: {sorted(modules - names)}"


def test_recommend_works_from_the_installed_wheel_outside_the_repo(wheel, tmp_path):
    # A fresh venv away from the repository: only what the wheel carries is importable from colab_memopt.
    # --system-site-packages reuses a torch the base interpreter has (a GPU machine's); what is missing is
    # installed at requirements.txt's pins (torch==2.13.0 installs from local disk on the CI machine).
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=True)
    py = str(env_dir / "bin" / "python")
    probe = "import importlib.util as u; print(' '.join(m for m in ('torch', 'transformers', 'numpy', 'psutil', 'yaml') if u.find_spec(m) is None))"
    missing = subprocess.run([py, "-c", probe], env=_clean_env(), capture_output=True, text=True, check=True).stdout.split()
    pins = _pins(*[{"yaml": "pyyaml"}.get(m, m) for m in missing if m != "psutil"]) + (["psutil"] if "psutil" in missing else [])
    if pins:
        install = subprocess.run([py, "-m", "pip", "install", "-q", *pins], env=_clean_env(), capture_output=True, text=True)
        assert install.returncode == 0, install.stderr[-3000:]
    install = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], env=_clean_env(),
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    code = ("import colab_memopt as cm; "
            "assert str(cm.__file__).startswith(__import__('sys').prefix), cm.__file__; "
            "r = cm.recommend('smollm2-135m', 1, seq_len=256); print(r.recipe); print('OK')")
    run = subprocess.run([py, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]


def test_transformers_floor_takes_the_dtype_argument():
    # loading.load_model and architectures pass `dtype=` to from_pretrained/from_config: transformers 4.56 on
    import re

    text = (REPO / "pyproject.toml").read_text()
    floors = re.findall(r'"transformers>=([0-9.]+)"', text)
    assert floors and all(tuple(int(x) for x in f.split(".")) >= (4, 56) for f in floors), floors
    uses = [p.name for p in (REPO / "colab_memopt").glob("*.py") if re.search(r"from_(pretrained|config)\([^)]*\bdtype=", p.read_text())]
    assert uses  # the reason for the floor; drop the floor's comment with the last use
