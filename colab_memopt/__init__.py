"""colab_memopt: measure what a training step holds in GPU memory, and what each technique saves.

    import colab_memopt as cm
    model = cm.build_model("tiny"); opt = cm.make_optimizer("adamw", model.parameters())
    report = cm.measure_step(cm.make_train_step(model, opt, cm.load_corpus(), batch_size=8, seq_len=64),
                             model=model, optimizer=opt)

Plots and widgets live in `colab_memopt.plots` and `colab_memopt.widgets` (they import matplotlib
and ipywidgets, which the core does not need). Importing the package changes no global state.
The modules form five layers, bottom to top (core, blocks, recipe, planning, tooling): see
`colab_memopt.layers`.
"""

from colab_memopt import (
    accumulation,
    attention,
    batching,
    checkpointing,
    compression,
    estimate,
    monitor,
    oom,
    optimizers,
    phases,
    precision,
    quantization,
    structured,
)
from colab_memopt import offload, zero
from colab_memopt import loss
from colab_memopt.data import TextCorpus, load_corpus
from colab_memopt.env import (
    COLAB_HOST_RAM_BYTES,
    T4_USABLE_BYTES,
    autocast_dtype,
    bf16_native,
    cap_device_memory,
    in_colab,
    pick_device,
    preflight,
)
from colab_memopt.batching import OOMNotRecovered, find_max_batch_size, train_with_oom_recovery
from colab_memopt.measure import (
    Comparison,
    LiveMemory,
    MemoryBudget,
    MemoryReport,
    HostPeak,
    compare,
    format_bytes,
    host_memory,
    measure_step,
    time_interleaved,
)
from colab_memopt.planner import Plan, Target, plan
# 15_fit_the_biggest_model: presets, technique costs, the recommender, capacity
from colab_memopt import capacity, costs, presets
from colab_memopt.recommender import NoRecipeFits, Recommendation, recommend
from colab_memopt.recipe import Recipe
# 18_your_own_model: any causal LM by id or folder, loading without a host-RAM spike, the doctor
from colab_memopt import architectures, loading
from colab_memopt.architectures import resolve_model
from colab_memopt.doctor import Checkup, Finding, doctor
from colab_memopt.loading import LoadedModel, load_int8, load_model
from colab_memopt.models import MODEL_SIZES, GPT, GPTConfig, build_model, count_parameters, get_config
from colab_memopt.monitor import MemoryMonitor, MemoryProfiler
from colab_memopt.oom import diagnose
from colab_memopt.report import Claim, record
from colab_memopt.evaluation import evaluate
from colab_memopt.optimizers import make_optimizer
# 17_long_context: the MLP by sequence tiles; the longest trainable sequence per mode
from colab_memopt import tiling
from colab_memopt.capacity import longest_context, longest_sequence
from colab_memopt.train import make_eval_step, make_train_step, train, train_step
# 19_your_trainer_on_a_free_t4: a Hugging Face Trainer / TRL SFTTrainer planned, fitted and guarded as it is
from colab_memopt.trainer import fit_trainer, plan_trainer
from colab_memopt.chat import MergeCost, merge_cost, to_messages

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """Import `MemoryGuardCallback` (a transformers `TrainerCallback` subclass) and its module `guard` on first use:
    importing the package does not import transformers."""
    if name in ("MemoryGuardCallback", "guard"):
        import importlib

        guard = importlib.import_module("colab_memopt.guard")  # sets the package's `guard` attribute too
        globals()["MemoryGuardCallback"] = guard.MemoryGuardCallback  # once imported, an ordinary attribute
        return guard if name == "guard" else guard.MemoryGuardCallback
    raise AttributeError(f"module 'colab_memopt' has no attribute {name!r}")

__all__ = [
    "COLAB_HOST_RAM_BYTES",
    "MergeCost",
    "merge_cost",
    "to_messages",
    "GPT",
    "MODEL_SIZES",
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
    "estimate",
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
    "monitor",
    "offload",
    "oom",
    "measure_step",
    "optimizers",
    "time_interleaved",
    "pick_device",
    "preflight",
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
