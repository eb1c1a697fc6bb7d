"""The package's layers, bottom to top: one folder each; a module imports only from its own layer or the ones below.

    (a) core/        measure memory: result files written whole (`fileio`), the tracker adapter, device and host
                     facts, `measure`, `report`, planning's isolation from the run; `wording`, the shape of every
                     printout
    (b) techniques/  the model, the data and the techniques, one module each, each usable alone
    (c) training/    the `Recipe`, its presets, the training step that applies the techniques, loading and saving
    (d) planning/    what fits before a run (estimate, planner, recommender, capacity, the Trainer's plan and fit,
                     the guard) and what went wrong after one (monitor, oom, doctor)
    (e) tooling/     the command line, the notebooks' runner, roll-up, plots and widgets, the GPU check

The folders are the declaration: `LAYERS` is read from them (their order is `colab_memopt.LAYER_FOLDERS`), and each
folder's `__init__.py` docstring says what it holds and what it may import. Within a layer, modules may import each
other, without cycles. `tests/test_layers.py` reads every module's imports (function-level ones included) and fails
on an import cycle or on an import from a lower layer to a higher one; CONTRIBUTING.md's module table follows this
order. `colab_memopt/__init__.py` is the facade (`import colab_memopt as cm`) and reaches every layer;
`colab_memopt/__main__.py` runs the command line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Layer:
    """One layer: its folder's name, what it is for (its `__init__` docstring's first line), and its modules."""

    name: str
    purpose: str
    modules: tuple[str, ...]


def _folders() -> tuple[str, ...]:
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAYER_FOLDERS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("colab_memopt/__init__.py names no LAYER_FOLDERS")


def read_layers(package_dir: Path = PACKAGE_DIR, folders: tuple[str, ...] | None = None) -> tuple[Layer, ...]:
    """Return the layers as the folders hold them: each folder's modules (file stems, sorted)."""
    out = []
    for folder in folders if folders is not None else _folders():
        init = package_dir / folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.is_file() else None
        modules = tuple(sorted(p.stem for p in (package_dir / folder).glob("*.py") if p.stem != "__init__"))
        out.append(Layer(folder, (doc or "").split("\n")[0], modules))
    return tuple(out)


LAYERS: tuple[Layer, ...] = read_layers()
FACADE = "__init__"
ENTRY = "__main__"


def layer_of(module: str) -> int:
    """Return the index of the layer whose folder holds `module` (a file stem such as 'measure')."""
    for index, layer in enumerate(LAYERS):
        if module in layer.modules:
            return index
    raise KeyError(f"module {module!r} is in no layer's folder under colab_memopt/; put it in one")
