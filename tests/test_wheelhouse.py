"""make gpu-wheels (colab_memopt.tooling.wheelhouse): what a lent GPU machine lacks, and its split into carries; no download here."""

from __future__ import annotations

import pytest

from colab_memopt import wheelhouse
from colab_memopt.tooling.gpucheck import NEEDED

MiB = 2**20


def test_lacking_is_the_closure_less_the_image_and_never_torch():
    groups = wheelhouse.lacking(sorted(set(NEEDED.values())))
    carried = {n for g in groups.values() for n in g}
    # the image has them (transformers, peft, pytest, numpy, ...); its setuptools and wheel are outside pip's isolated
    # build environment, which an offline build fills from the wheelhouse
    assert carried & wheelhouse.IMAGE_PACKAGES == set(wheelhouse.BUILD_TOOLS)
    assert not any(wheelhouse.NEVER_CARRIED.match(n) for n in carried) and "torch" not in carried
    assert not carried & set(wheelhouse.NOT_IMPORTED)
    for name in ("bitsandbytes", "deepspeed", "galore-torch", "apollo-torch", "torchao", "badam", "torch-optimi",
                 "lomo-optim", "papermill", "nbval", "ipykernel", "ipywidgets", "trl", "datasets"):
        assert name in groups and groups[name][0] == name
    # DeepSpeed is an sdist: its isolated offline build needs setuptools and wheel beside it; its own needs come too
    assert {"setuptools", "wheel", "hjson", "pydantic"} <= set(groups["deepspeed"])
    assert "setuptools" not in groups["badam"]


def test_download_commands_pin_this_environment_for_python_312_manylinux():
    from importlib import metadata

    cmd = wheelhouse.download_command("bitsandbytes", wheelhouse.REPO_ROOT / "x")
    assert f"bitsandbytes=={metadata.version('bitsandbytes')}" == cmd[-1]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_24_x86_64" in cmd  # bitsandbytes 0.50.2's only Linux x86-64 tag
    sdist = wheelhouse.download_command("deepspeed", wheelhouse.REPO_ROOT / "x")
    assert "--no-binary=:all:" in sdist and "--python-version" not in sdist
    assert wheelhouse.download_command("setuptools", wheelhouse.REPO_ROOT / "x")[-1] == f"setuptools=={wheelhouse.BUILD_TOOLS['setuptools']}"


def test_split_keeps_each_package_with_its_needs_under_the_limit():
    groups = {"big": ["big", "shared"], "mid": ["mid", "shared"], "small": ["small"]}
    sizes = {"big": 40 * MiB, "mid": 25 * MiB, "shared": 5 * MiB, "small": 10 * MiB}
    parts = wheelhouse.split(groups, sizes, 60 * MiB)
    assert [p.packages for p in parts] == [["big", "small"], ["mid"]]
    assert [p.bytes for p in parts] == [55 * MiB, 30 * MiB] and all(p.bytes <= 60 * MiB for p in parts)
    assert "shared" in parts[0].files and "shared" in parts[1].files  # each part installs on its own
    with pytest.raises(ValueError, match="'big' and the packages it needs take 45.0 MiB"):
        wheelhouse.split(groups, sizes, 44 * MiB)


def test_normalize_and_limit_checks():
    assert wheelhouse.normalize("Torch_Optimi") == wheelhouse.normalize("torch.optimi") == "torch-optimi"
    with pytest.raises(SystemExit):
        wheelhouse.main(["--limit-mib", "70", "--dry-run"])


def test_sdist_groups_come_last_in_parts_of_their_own_so_part1_holds_every_wheel():
    # the one call carries part1 (gpuplan.CARRY): every wheel, DeepSpeed's sdist and build tools left to part2
    groups = {"deepspeed": ["deepspeed", "setuptools", "pydantic"], "bnb": ["bnb"], "trl": ["trl", "pydantic"]}
    sizes = {"deepspeed": 2 * MiB, "setuptools": 1 * MiB, "pydantic": 1 * MiB, "bnb": 40 * MiB, "trl": 5 * MiB}
    parts = wheelhouse.split(groups, sizes, 60 * MiB, {"deepspeed"})
    assert [p.packages for p in parts] == [["bnb", "trl"], ["deepspeed"]]  # without `apart`, deepspeed joins part1
    assert [p.packages for p in wheelhouse.split(groups, sizes, 60 * MiB)] == [["bnb", "trl", "deepspeed"]]
    assert parts[1].files == ["deepspeed", "setuptools", "pydantic"] and parts[1].bytes == 4 * MiB
    # make gpu-wheels writes part1 where the one call's carry names it
    from colab_memopt.tooling.gpuplan import CARRY

    assert wheelhouse.REPO_ROOT / CARRY == wheelhouse.REPO_ROOT / "build" / "wheelhouse" / parts[0].name
    assert "WHEELHOUSE_DIR ?= build/wheelhouse" in (wheelhouse.REPO_ROOT / "Makefile").read_text()
