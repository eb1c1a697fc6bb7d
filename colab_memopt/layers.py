"""The package's layers, bottom to top: a module imports only from its own layer or the ones below.

    (a) core        measure memory: result files written whole (`fileio`), the tracker adapter, device
                    and host facts, `measure`, `report`; `wording`, the shape of every printout
    (b) blocks      the model, the data and the techniques, one module each, each usable alone
    (c) recipe      the `Recipe`, its presets and the training step that apply the techniques
    (d) planning    what fits before a run (estimate, planner, recommender, capacity) and what went
                    wrong after one (monitor, oom)
    (e) tooling     the notebooks' runner, roll-up, plots and widgets, make test-gpu, and the command line

Within a layer, modules may import each other, without cycles. `tests/test_layers.py` reads every
module's imports (function-level ones included) and fails on an import cycle or on an import from a
lower layer to a higher one; the README's module table follows this order. `__init__` is the facade
(`import colab_memopt as cm`) and imports from every layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layer:
    """One layer: its short name, what it is for, and its modules (file stems under colab_memopt/)."""

    name: str
    purpose: str
    modules: tuple[str, ...]


LAYERS: tuple[Layer, ...] = (
    Layer("core", "measure memory: the one way every number is taken",
          ("fileio", "isolation", "tracker", "env", "measure", "report", "ranks", "wording")),
    Layer("blocks", "the model, the data and the techniques, one module each, each usable alone",
          ("models", "architectures", "data", "evaluation", "attention", "structured", "precision",
           "checkpointing", "accumulation", "lowstate", "optimizers", "rounding", "lomo", "quantization", "compression",
           "loss", "offload", "tiling", "int8train",
           "zero", "phases", "batching")),
    Layer("recipe", "the Recipe, its presets and the training step that apply the techniques",
          ("recipe", "presets", "train", "loading")),
    Layer("planning", "what fits before a run, and what went wrong after one",
          ("estimate", "planner", "costs", "recommender", "capacity", "monitor", "oom", "doctor", "hfconfig", "trainer",
           "guard", "chat")),
    Layer("tooling", "the notebooks' runner, roll-up, plots and widgets, and the command line",
          ("runner", "rollup", "project", "plots", "widgets", "layers", "gpucheck", "wheelhouse", "__main__")),
)
FACADE = "__init__"


def layer_of(module: str) -> int:
    """Return the index of the layer that declares `module` (a file stem such as 'measure')."""
    for index, layer in enumerate(LAYERS):
        if module in layer.modules:
            return index
    raise KeyError(f"module {module!r} is in no layer of colab_memopt.layers.LAYERS; add it to one")
