"""colab_memopt: measure what a training step holds in GPU memory, and what each technique saves.

    import colab_memopt as cm
    model = cm.build_model("tiny"); opt = cm.make_optimizer("adamw", model.parameters())
    report = cm.measure_step(cm.make_train_step(model, opt, cm.load_corpus(), batch_size=8, seq_len=64),
                             model=model, optimizer=opt)

Plots and widgets live in `colab_memopt.tooling.plots` and `colab_memopt.tooling.widgets` (they import
matplotlib and ipywidgets, which the core does not need). Importing the package changes no global state.

The modules live in one folder per layer, bottom to top: `core/` (measuring), `techniques/` (the model, the
data and one module per technique), `training/` (the recipe and the step), `planning/` (what fits, and what went
wrong) and `tooling/` (the command line, the notebooks' runner, plots, panels, the GPU check); each folder's
`__init__` says what it holds and what it may import (`colab_memopt.tooling.layers`). Every module is also reachable
as `cm.<module>` (`cm.checkpointing`, `cm.planner`), wherever its folder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

__version__ = "0.1.0"

# Where each public name is defined. Names and submodules are imported on first use (PEP 562), so `import
# colab_memopt` imports none of them: a process that needs one module (a training rank, `python -m
# colab_memopt.gpucheck`) does not load torch and the other modules (import colab_memopt: 3.1 s before, 0.02 s now,
# on 2 cores). `MemoryGuardCallback` is a transformers `TrainerCallback`: importing the package never imports transformers.
_DEFINED_IN = {name: module for module, names in {
    "console": ("quiet",),
    "data": ("TextCorpus", "load_corpus"),
    "env": ("COLAB_HOST_RAM_BYTES", "COLAB_HOST_USABLE_BYTES", "T4_TOTAL_BYTES", "T4_USABLE_BYTES", "autocast_dtype",
            "bf16_native", "cap_device_memory", "in_colab",
            "pick_device", "preflight"),
    "batching": ("OOMNotRecovered", "find_max_batch_size", "train_with_oom_recovery"),
    "measure": ("Comparison", "LiveMemory", "MemoryBudget", "MemoryReport", "HostPeak", "compare", "format_bytes",
                "host_memory", "measure_step", "time_interleaved"),
    "planner": ("Plan", "Target", "plan"),
    "recommender": ("NoRecipeFits", "Recommendation", "recommend"),
    "recipe": ("Recipe",),
    "architectures": ("resolve_model",),
    "doctor": ("Checkup", "Finding", "doctor"),
    "loading": ("LoadedModel", "load_int8", "load_model"),
    "models": ("MODEL_SIZES", "GPT", "GPTConfig", "build_model", "count_parameters", "get_config"),
    "monitor": ("MemoryMonitor", "MemoryProfiler"),
    "oom": ("diagnose",),
    "report": ("Claim", "record"),
    "evaluation": ("evaluate",),
    "optimizers": ("make_optimizer",),
    "capacity": ("longest_context", "longest_sequence"),
    "train": ("make_eval_step", "make_train_step", "run_steps", "train", "train_step"),
    "trainer": ("plan_trainer",),
    "trainerfit": ("fit_trainer",),
    "chat": ("MergeCost", "merge_cost", "to_messages"),
    "merge": ("MergeResult", "merge_adapter"),
    "guard": ("MemoryGuardCallback",),
    "longcontext": ("LongContext", "installed_long_context", "long_context"),
}.items() for name in names}


# The layers' folders, bottom to top (colab_memopt.tooling.layers reads them; tests/test_layers.py enforces them).
LAYER_FOLDERS = ("core", "techniques", "training", "planning", "tooling")


def _module_path(name: str) -> str | None:
    """Return 'colab_memopt.<folder>.<name>' for a module stem in one of the layers' folders, else None."""
    for folder in LAYER_FOLDERS:
        if importlib.util.find_spec(f"{__name__}.{folder}.{name}") is not None:
            return f"{__name__}.{folder}.{name}"
    return None


def _import(path: str) -> types.ModuleType:
    """Import one of the package's modules with the libraries' import notes hidden (`core.console.quiet`): a module
    that imports transformers, peft or TRL would otherwise print torchao's and torch's notes on first use."""
    if path in sys.modules:
        return sys.modules[path]
    from colab_memopt.core.console import import_quietly

    return import_quietly(path)


def __getattr__(name: str) -> object:
    """Import a public name's module, or a module by its stem (`cm.planner`, `cm.checkpointing`), on first use."""
    if name in _DEFINED_IN:
        value = getattr(_import(_module_path(_DEFINED_IN[name]) or ""), name)
        globals()[name] = value  # once imported, an ordinary attribute
        return value
    if name in LAYER_FOLDERS:
        return _import(f"{__name__}.{name}")
    if not name.startswith("__") and name.isidentifier() and (path := _module_path(name)) is not None:
        module = _import(path)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'colab_memopt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_DEFINED_IN) | set(__all__))


class _EntryPoint(importlib.abc.MetaPathFinder):
    """`python -m colab_memopt.gpucheck` runs `colab_memopt.tooling.gpucheck`: the GPU check's command stays where the
    GPU machines' instructions name it, while its code lives with the other tools."""

    ALIASES = {f"{__name__}.gpucheck": f"{__name__}.tooling.gpucheck"}

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in self.ALIASES:
            return None
        real = importlib.util.find_spec(self.ALIASES[fullname])
        return importlib.util.spec_from_file_location(fullname, real.origin) if real is not None else None


if not any(isinstance(f, _EntryPoint) or type(f).__name__ == "_EntryPoint" for f in sys.meta_path):
    sys.meta_path.append(_EntryPoint())

__all__ = [
    "COLAB_HOST_RAM_BYTES",
    "COLAB_HOST_USABLE_BYTES",
    "MergeCost",
    "merge_cost",
    "to_messages",
    "MergeResult",
    "merge_adapter",
    "LongContext",
    "installed_long_context",
    "long_context",
    "GPT",
    "MODEL_SIZES",
    "T4_TOTAL_BYTES",
    "T4_USABLE_BYTES",
    "Claim",
    "Comparison",
    "GPTConfig",
    "LiveMemory",
    "MemoryBudget",
    "MemoryMonitor",
    "MemoryProfiler",
    "MemoryReport",
    "Plan",
    "Target",
    "plan",
    "Recipe",
    "TextCorpus",
    "autocast_dtype",
    "bf16_native",
    "build_model",
    "cap_device_memory",
    "batching",
    "compare",
    "compression",
    "count_parameters",
    "diagnose",
    "estimate",
    "phases",
    "structured",
    "accumulation",
    "attention",
    "checkpointing",
    "precision",
    "evaluate",
    "OOMNotRecovered",
    "find_max_batch_size",
    "format_bytes",
    "get_config",
    "host_memory",
    "in_colab",
    "load_corpus",
    "loss",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "run_steps",
    "monitor",
    "offload",
    "oom",
    "measure_step",
    "optimizers",
    "time_interleaved",
    "pick_device",
    "preflight",
    "quiet",
    "quantization",
    "record",
    "train",
    "train_step",
    "train_with_oom_recovery",
    "zero",
    # 15_fit_the_biggest_model
    "capacity",
    "costs",
    "presets",
    "NoRecipeFits",
    "Recommendation",
    "recommend",
    # 18_your_own_model
    "architectures",
    "loading",
    "resolve_model",
    "Checkup",
    "Finding",
    "doctor",
    "LoadedModel",
    "load_model",
    "load_int8",
    "HostPeak",
    # 19_your_trainer_on_a_free_t4
    "plan_trainer",
    "fit_trainer",
    "MemoryGuardCallback",
    "tiling",
    "longest_context",
    "longest_sequence",
]
