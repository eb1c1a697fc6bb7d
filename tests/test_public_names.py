"""Every name of colab_memopt that the notebooks, the README and CONTRIBUTING.md use still resolves (no public name lost)."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

import colab_memopt as cm

ROOT = Path(__file__).resolve().parent.parent


def _code_texts() -> dict[str, str]:
    """Return source name -> the code it shows: notebooks' code cells, README/CONTRIBUTING code blocks and `inline` code."""
    texts = {}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts[path.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for doc in ("README.md", "CONTRIBUTING.md"):
        text = (ROOT / doc).read_text()
        texts[doc] = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text))
    return texts


def used_names() -> set[tuple[str, str]]:
    """Return (source, dotted name) for every `cm.x.y`, `colab_memopt.x.y` and `from colab_memopt[.m] import n`."""
    out = set()
    for source, text in _code_texts().items():
        for chain in re.findall(r"\b(?:cm|colab_memopt)((?:\.[A-Za-z_]\w*)+)", text):
            out.add((source, chain.lstrip(".")))
        for module, names in re.findall(r"from colab_memopt((?:\.\w+)*) import ([\w, ]+)", text):
            for name in names.split(","):
                name = name.strip().split(" as ")[0]
                if name:
                    out.add((source, f"{module.lstrip('.')}.{name}".lstrip(".")))
    return out


def resolve(dotted: str) -> object:
    """Return the object `colab_memopt.<dotted>` names, importing submodules on the way."""
    obj: object = cm
    path = "colab_memopt"
    try:
        for part in dotted.split("."):
            path += f".{part}"
            if hasattr(obj, part):
                obj = getattr(obj, part)
            else:
                obj = importlib.import_module(path)
    except (AttributeError, ModuleNotFoundError):  # a package attribute shadows its submodule (cm.train, the function, over train.py)
        module, _, name = f"colab_memopt.{dotted}".rpartition(".")
        obj = getattr(importlib.import_module(module), name)
    return obj


NAMES = sorted(used_names())


def test_the_sources_use_many_names():
    assert len(NAMES) > 100, "the name scan found almost nothing: the patterns above no longer match the notebooks"
    assert ("README.md", "measure_step") in NAMES


@pytest.mark.parametrize("source,dotted", NAMES, ids=[f"{s}:{d}" for s, d in NAMES])
def test_name_resolves(source, dotted):
    try:
        resolve(dotted)
    except (AttributeError, ModuleNotFoundError) as err:
        pytest.fail(f"{source} uses colab_memopt.{dotted}, which no longer exists: {err}")
