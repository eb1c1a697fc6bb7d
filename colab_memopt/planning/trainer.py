"""Plan a Hugging Face `Trainer` (or TRL `SFTTrainer`) run as it is, and fit it to a target.

`plan_trainer` traces the Trainer's own step on fake tensors: the model the Trainer holds (its
parameters swapped for fake ones for the duration, so nothing is allocated), the optimizer the
Trainer itself builds from `optim` (`Trainer.create_optimizer`) or the one you gave it
(`optimizers=(opt, None)`), the checkpointing `train()` leaves on, one batch made by the Trainer's own
data collator at `max_length`, then what the training loop runs: `Trainer.training_step` (its
`compute_loss`, TRL's fused LM head and token metrics included, and the backward) for each
micro-batch, the gradient clipping, `optimizer.step()` and `model.zero_grad()`. What peft's LoRA
dropout keeps (a dropped copy of each adapted layer's input and its mask), the fused AdamW kernel
(no foreach temporaries) and bitsandbytes' 8-bit states are in that trace because they run in it.

The settings are also read into this project's `Recipe` (`hfconfig.trainer_recipe`), the common
language of `plan`, `recommend` and the notebooks; what a Recipe cannot say is listed, never dropped
silently. `fit_trainer` searches the Trainer's own settings for the cheapest change that fits.
`hfconfig.py` reads the settings from files; `guard.py` holds `MemoryGuardCallback`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from colab_memopt.techniques.attention import traced_attention
from colab_memopt.planning.faketrace import _Trace, _fake_safe_module_to, _fake_safe_transformers
from colab_memopt.planning.prediction import Cost, Plan
from colab_memopt.planning.quantized import _fake_safe_bitsandbytes
from colab_memopt.planning.targets import Target, check_headroom, cublas_workspace_bytes, get_target
from colab_memopt.planning.untraced import MATH_ATTENTION_LINE, _host_costs, math_attention_cost, math_attention_warning
from colab_memopt.planning.hfconfig import OPTIM_TO_RECIPE, check_optim, trainer_recipe
from colab_memopt.core.isolation import isolated, trainer_kept
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.tracker import PHASES, TensorTracker


class _ScalarMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Answer `.item()` / `bool()` of a fake tensor with 1, so that the Trainer's metrics and branches on a
    value (`if num_valid > 0`, `loss.item()`) run; the bytes of a step do not depend on those values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1 if not t.is_floating_point() else 1.0)
        return func(*args, **(kwargs or {}))


# What bitsandbytes keeps on its quantized layers (the 4-bit and 8-bit layers' states) and reads in forward; the
# planner hands each layer a copy holding fake tensors for the duration and puts the real one back afterwards.
_BNB_LAYER_STATE = ("state", "quant_state", "compute_dtype", "compute_type_is_set")
_BNB_WEIGHT_STATE = ("quant_state", "blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized",
                     "module", "CB", "SCB", "has_fp16_weights")


@contextlib.contextmanager
def _fake_parameters(model: nn.Module, mode: Any, *, half: torch.dtype | None = None) -> Iterator[None]:
    """Swap every parameter and buffer of `model` for a fake CPU tensor of the same shape, dtype and
    `requires_grad` (tied weights stay tied), for the duration; the real ones come back afterwards.

    `half`: the dtype fp16 tensors (and bitsandbytes' fp16 compute and quantization dtypes) are traced in: bf16
    where CUDA's fp16 autocast is traced as the CPU's bf16 autocast (the same bytes; an fp16 tensor under CPU
    bf16 autocast would be cast where CUDA casts nothing).

    The fakes are CPU tensors wherever the real ones live (a model on CUDA is planned as the trace counts it).
    bitsandbytes' quantized weights stay bnb-shaped: a 4-bit weight keeps its `quant_state` (blocksize, quant
    type, absmax and code books as fakes), an 8-bit one its `CB`/`SCB`, and each quantized layer sees a copy of
    its own state holding fakes, so the trace runs bitsandbytes' own forward and backward on them.
    """
    saved: list[tuple[Any, str, str, Any]] = []
    layer_states: list[tuple[nn.Module, dict[str, Any]]] = []
    swapped: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        if isinstance(t, torch.dtype):
            return half if half is not None and t == torch.float16 else t
        if not isinstance(t, torch.Tensor):
            return _fake_state(t, fake)
        if id(t) not in swapped:
            swapped[id(t)] = _cpu_fake(t, mode, fake(t.dtype))
            if isinstance(t, nn.Parameter):
                param = nn.Parameter(swapped[id(t)], requires_grad=t.requires_grad)
                for name in _BNB_WEIGHT_STATE:  # a Params4bit's quant_state, an Int8Params' CB and SCB, ...
                    if name in vars(t):
                        setattr(param, name, fake(vars(t)[name]))
                swapped[id(t)] = param
        return swapped[id(t)]

    try:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    new = fake(t)
                    saved.append((table, name, kind, t))
                    table[name] = new
            if any(name in vars(module) for name in _BNB_LAYER_STATE) and _is_bnb_layer(module):
                kept = {name: vars(module)[name] for name in _BNB_LAYER_STATE if name in vars(module)}
                layer_states.append((module, kept))
                for name, value in kept.items():
                    setattr(module, name, fake(value))
        yield
    finally:
        for module, kept in reversed(layer_states):
            for name, value in kept.items():
                setattr(module, name, value)
        for table, name, _kind, t in reversed(saved):
            table[name] = t


def _cpu_fake(t: torch.Tensor, mode: Any, dtype: torch.dtype) -> torch.Tensor:
    """Return a fake CPU tensor like `t` (shape, strides) in `dtype`; nothing is allocated or copied from its device."""
    if t.device.type == "cpu" and t.dtype == dtype:
        return mode.from_tensor(t.detach(), static_shapes=True)
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device="cpu")


def _fake_state(value: Any, fake: Any) -> Any:
    """Return a copy of bitsandbytes' `QuantState` / `MatmulLtState` with its tensors (and dtypes) made fake (by
    `fake`); any other value as it is."""
    try:
        from bitsandbytes.autograd._functions import MatmulLtState
        from bitsandbytes.functional import QuantState
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        return value
    if not isinstance(value, (QuantState, MatmulLtState)):
        return value
    new = copy.copy(value)
    for name, item in vars(value).items():
        if isinstance(item, (torch.Tensor, QuantState, torch.dtype)):
            setattr(new, name, fake(item))
    return new


def _is_bnb_layer(module: nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        return False
    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


@contextlib.contextmanager
def _cpu_device_without_index(args: Any) -> Iterator[None]:
    """Make `args.device` read plain 'cpu' wherever else it points (CUDA, or a CPU device with an index), for the duration.

    The planner's fake tensors are CPU tensors. On a GPU machine `args.device` is 'cuda:0': the Trainer would move
    the model there while it is built and `_prepare_inputs` would put the batch there, beside parameters on the CPU
    (FakeTensorDeviceMismatchError). With a process group up or its environment set (LOCAL_RANK: a DeepSpeed or
    LOMO-fp16 run earlier in the process, a launcher), accelerate places a CPU run on `torch.device('cpu', rank)`,
    'cpu:0': real CPU tensors drop the index, but fake tensors keep it, with the same mismatch. The user's value
    comes back afterwards.
    """
    device = getattr(args, "device", None)
    if not isinstance(device, torch.device) or device == torch.device("cpu"):
        yield
        return
    had, saved = "_setup_devices" in args.__dict__, args.__dict__.get("_setup_devices")
    args.__dict__["_setup_devices"] = torch.device("cpu")  # TrainingArguments.device reads this cached property
    try:
        yield
    finally:
        if had:
            args.__dict__["_setup_devices"] = saved
        else:
            args.__dict__.pop("_setup_devices", None)


def _unwrap(trainer: Any) -> tuple[Any, Any]:
    """Return (trainer or None, args) from a Trainer, or from TrainingArguments."""
    from transformers import Trainer, TrainingArguments

    if isinstance(trainer, Trainer):
        return trainer, trainer.args
    if isinstance(trainer, TrainingArguments):
        return None, trainer
    raise TypeError("plan_trainer takes a transformers Trainer (or TRL SFTTrainer), or TrainingArguments / SFTConfig "
                    f"with model=; got {type(trainer).__name__}")


def seq_len_of(args: Any) -> int:
    """Return the tokens per sequence the run pads or truncates to: SFTConfig's `max_length` (or the old
    `max_seq_length`); for plain TrainingArguments there is none: pass seq_len=."""
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if value is not None:
            return int(value)
    raise ValueError("these TrainingArguments set no max_length: pass seq_len= (tokens per sequence)")


# The per-token fields of a training example the planner's batch fills where the user's dataset has them (an
# attention mask of ones is left out: transformers drops an all-ones mask on real data, so the run holds none).
_TOKEN_FIELDS = ("input_ids", "labels", "completion_mask", "assistant_masks")


def _example_fields(dataset: Any) -> dict[str, Any]:
    """Return {field: an example value} of what the dataset yields per example: its columns (a `datasets.Dataset`)
    or the keys of its first example (a PyTorch `Dataset`, read for real, outside any fake-tensor mode); input_ids
    alone where neither can be read."""
    names = getattr(dataset, "column_names", None) or list(getattr(dataset, "features", None) or ())
    if names:
        return {name: None for name in names}
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily():
            example = next(iter(dataset)) if isinstance(dataset, torch.utils.data.IterableDataset) else dataset[0]
    except Exception:  # noqa: BLE001 - a dataset the planner cannot index: the collator's own fields only
        return {"input_ids": None}
    return dict(example) if isinstance(example, dict) or hasattr(example, "keys") else {"input_ids": None}


def _synthetic_batch(trainer: Any, batch: int, seq_len: int) -> dict[str, Any]:
    """Return one batch the Trainer's own collator makes from `batch` examples of `seq_len` tokens (every position
    a trained token: the most the run can hold), with the per-token fields the Trainer's dataset yields (labels
    included), each a list or a tensor as the dataset gives it."""
    fields = _example_fields(trainer.train_dataset)
    examples = []
    for _ in range(batch):
        ex: dict[str, Any] = {}
        for name in _TOKEN_FIELDS:
            if name == "input_ids" or name in fields:
                like = fields.get(name)
                ex[name] = (torch.ones(seq_len, dtype=like.dtype) if isinstance(like, torch.Tensor) else [1] * seq_len)
        examples.append(ex)
    out = trainer.data_collator(examples)
    return dict(out)


def _trace_step(trainer: Any, args: Any, batch: int, seq_len: int, *, cuda: bool, mode: Any = None,
                notes: list[str] | None = None, param_names: dict[int, str] | None = None) -> tuple[_Trace, int]:
    """Trace the Trainer's step on fake tensors; return (the trace, the number of trainable parameters).

    `mode`: the fake-tensor mode a planner-built Trainer's model lives in (its parameters are fake already);
    None swaps a real Trainer's parameters for fake ones for the duration. The optimizer is the one the Trainer
    steps (the user's own, `optimizers=(opt, None)`, as a twin over the fake parameters); checkpointing is what
    the Trainer's `train()` leaves on: the model's own, or the settings' `gradient_checkpointing`; every flag and
    hook that enabling it adds is taken off afterwards. `notes`: what the trace could not run as given is added.
    `param_names`: {id: name} of the real parameters, where they are swapped for fakes before this is called."""
    grad_accum = int(args.gradient_accumulation_steps)
    micro = int(args.per_device_train_batch_size)
    model = trainer.model
    swap = mode is None
    mode = mode if mode is not None else _new_mode()
    recipe = Recipe(optimizer=OPTIM_TO_RECIPE.get(str(getattr(args.optim, "value", args.optim)), "adamw"))
    saved = {k: copy.deepcopy(getattr(trainer, k)) for k in ("_metrics", "_total_train_tokens") if hasattr(trainer, k)}
    saved_optimizer, saved_training = trainer.optimizer, model.training
    # the names of the parameters of a user's own optimizer (optimizers=(opt, None)), to find their fake twins
    names = param_names if param_names is not None else (
        {id(p): n for n, p in model.named_parameters()} if saved_optimizer is not None else {})
    restore_modules = _snapshot_modules(model)
    # The run's autocast: accelerate autocasts fp16 and bf16 on CUDA, only bf16 on the CPU (an fp16 run there is fp32);
    # CUDA's fp16 autocast is traced as CPU bf16 autocast (the same 2-byte activations).
    autocasts = bool(args.bf16 or (args.fp16 and cuda))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocasts else contextlib.nullcontext
    try:
        _enable_checkpointing_as_the_trainer_does(model, args)
        with _fake_parameters(model, mode) if swap else contextlib.nullcontext(), mode, _ScalarMode(), _fake_safe_module_to(), \
                _fake_safe_bitsandbytes(mode, recipe, cuda=cuda), _fake_safe_transformers(), _cpu_device_without_index(trainer.args):
            if args.fp16:  # fp16's GradScaler needs fp32 trainables: planned as MemoryGuardCallback casts them
                _upcast_trainable(model)
            optimizer = _run_optimizer(trainer, model, saved_optimizer, names, notes)
            _prefer_impl(optimizer, cuda)
            n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            # warm-up: the optimizer state exists after the first step, as in every step after it
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            optimizer.step()
            model.zero_grad()
            # Micro-batches after the second hold what the second holds (the gradients accumulate in place): two
            # are traced, whatever gradient_accumulation_steps is.
            inputs = [_synthetic_batch(trainer, micro, seq_len) for _ in range(grad_accum)]
            tokens = micro * grad_accum * seq_len
            tracker = TensorTracker(device=torch.device("cpu"), cuda_rounding=cuda)
            tracker.track_external(model, optimizer, *[t for b in inputs for t in b.values() if isinstance(t, torch.Tensor)])
            with tracker:
                for batch_inputs in inputs[:2]:
                    with autocast():
                        trainer.training_step(model, batch_inputs, num_items_in_batch=torch.tensor(tokens))
                if args.max_grad_norm and args.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                model.zero_grad()
    finally:
        trainer.optimizer = saved_optimizer
        for k, v in saved.items():
            setattr(trainer, k, v)
        model.train(saved_training)
        restore_modules()
    trace = _Trace(
        tracker.peak_bytes,
        dict(tracker.peak_categories),
        {p: tracker.phase_peaks.get(p, 0) for p in PHASES},
        {p: dict(c) for p, c in tracker.phase_peak_categories.items()},
        tracker.category_peaks["activations"],
    )
    return trace, n_trainable


def _snapshot_modules(model: nn.Module) -> Any:
    """Return a function that puts back every module's attributes and hooks as they are now (what enabling
    checkpointing sets: the flags, the checkpoint function, peft's `enable_input_require_grads` forward hook)."""
    saved = []
    for module in model.modules():
        attrs = dict(module.__dict__)
        hooks = {k: dict(v) for k, v in attrs.items() if "hook" in k and isinstance(v, dict)}
        saved.append((module, attrs, hooks))

    def restore() -> None:
        for module, attrs, hooks in saved:
            for key in [k for k in module.__dict__ if k not in attrs]:
                del module.__dict__[key]
            for key, value in attrs.items():
                if module.__dict__.get(key) is not value:
                    module.__dict__[key] = value
            for key, table in hooks.items():  # the same dict objects (hook handles hold them), their old entries
                module.__dict__[key].clear()
                module.__dict__[key].update(table)

    return restore


def _enable_checkpointing_as_the_trainer_does(model: Any, args: Any) -> None:
    """Enable activation checkpointing as `Trainer.train()` does when the settings ask for it (a model the user
    enabled it on keeps it either way: the Trainer never disables it)."""
    if not getattr(args, "activation_checkpointing", args.gradient_checkpointing):
        return
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", args.gradient_checkpointing_kwargs) or {})
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                              every_n_layers=every_n_layers, offload=offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def _run_optimizer(trainer: Any, model: Any, given: Any, names: dict[int, str], notes: list[str] | None) -> Any:
    """Return the optimizer the run steps, over the model's current (fake) parameters: a twin of the user's own
    (`optimizers=(opt, None)`: its class and each group's hyperparameters), else the one the Trainer builds."""
    if given is not None:
        import inspect

        fakes = dict(model.named_parameters())
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [fakes[names[id(p)]] for p in g["params"] if names.get(id(p)) in fakes]}
                  for g in given.param_groups]
        cls = type(given)
        try:
            accepted = inspect.signature(cls.__init__).parameters
            return cls([g for g in groups if g["params"]], **{k: v for k, v in given.defaults.items() if k in accepted})
        except Exception as exc:  # noqa: BLE001 - an optimizer class we cannot rebuild: plan the Trainer's, say so
            if notes is not None:
                optim = str(getattr(trainer.args.optim, "value", trainer.args.optim))
                notes.append(f"your optimizers=({cls.__name__}, ...) could not be rebuilt to trace ({type(exc).__name__}): "
                             f"planned with optim={optim!r} instead")
    trainer.optimizer = None
    return trainer.create_optimizer(model)


def _new_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # allow_scalar_outputs: `.item()` gives a symbol (then `_ScalarMode` a value); real inputs become fake
    return FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True), allow_non_fake_inputs=True)


def _prefer_impl(optimizer: Any, cuda: bool) -> None:
    """Run torch optimizers as the target runs them: with `foreach=None` torch picks foreach for CUDA
    tensors and single-tensor on the CPU; a fused optimizer (`adamw_torch_fused`) stays fused."""
    for group in getattr(optimizer, "param_groups", []):
        if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = bool(cuda)


# -- planning ------------------------------------------------------------------------------------------
CPU_TARGET_NAME = "cpu"


def _target(target: Any) -> Target:
    """Return the target: a planner target, or 'cpu' (this machine's RAM, no CUDA costs, as a CPU run holds)."""
    if target == CPU_TARGET_NAME:
        from colab_memopt.core.measure import host_memory

        total = host_memory().total_bytes
        return Target("cpu", total, total, cuda_context_bytes=0, description="this machine's CPU and RAM", cuda=False)
    if isinstance(target, dict) and isinstance(target.get("compute_capability"), list):  # from YAML or JSON
        target = {**target, "compute_capability": tuple(target["compute_capability"])}
    return get_target(target)


def _plan_tokenizer() -> Any:
    """Return a three-token tokenizer: what the planner's Trainer needs (a pad token), nothing more."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


# The dtypes a model is loaded in, by the names transformers, TRL and torch give them.
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _dtype_value(value: Any, name: str) -> torch.dtype | str | None:
    """Return `value` as a torch dtype, 'auto' or None; raise ValueError naming `name` for anything else."""
    if value is None or value == "auto" or (isinstance(value, torch.dtype) and value in _DTYPES.values()):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{name} must be 'auto', 'float32', 'float16' or 'bfloat16' (or that torch dtype), got {value!r}")


def _config_dtype(spec: Any) -> torch.dtype:
    """Return the dtype transformers 5's `from_pretrained` (and `from_config`) loads with none given: the config's
    dtype ('auto'), fp32 where the config names none."""
    config = spec.config
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) if config is not None else None
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def _model_dtype(args: Any, spec: Any, model: Any = None, dtype: Any = None) -> torch.dtype:
    """Return the dtype the run loads the weights in.

    `dtype` where given (the dtype the user loads with); else, for TRL's SFTTrainer given a model id (`model` a
    string with an SFTConfig), SFTConfig's `model_init_kwargs` dtype, fp32 where it names none (TRL's rule);
    else what transformers 5 loads with none given: the config's dtype, fp32 where the config names none.
    """
    value = _dtype_value(dtype, "dtype")
    if value is None and type(args).__name__ == "SFTConfig" and isinstance(model, str):
        kwargs = getattr(args, "model_init_kwargs", None) or {}
        value = _dtype_value(kwargs.get("dtype", kwargs.get("torch_dtype")), "SFTConfig.model_init_kwargs['dtype']")
        value = torch.float32 if value is None else value
    return _config_dtype(spec) if value in (None, "auto") else value


def _as_loaded(net: nn.Module, bnb: Any, mode: Any, half: torch.dtype | None = None) -> None:
    """Quantize `net` in place as `from_pretrained(quantization_config=bnb)` loads it: the linear layers in
    bitsandbytes' 4-bit or 8-bit storage (the planner's fake-tensor stand-ins of Linear4bit / Linear8bitLt, with
    the config's compute dtype and double quantization), the skipped ones and the rest in the load dtype; and the
    model marked quantized as transformers marks it (the Trainer refuses a quantized model without adapters).
    `half`: the dtype an fp16 compute dtype is traced in (as `_fake_parameters`)."""
    from transformers.quantizers import AutoHfQuantizer
    from transformers.utils.quantization_config import QuantizationMethod

    from colab_memopt.techniques import quantization
    from colab_memopt.planning.quantized import traced_linear4bit
    from colab_memopt.techniques.quantization import quantize_model

    four_bit = bool(bnb.load_in_4bit)
    scheme = str(bnb.bnb_4bit_quant_type) if four_bit else "bnb_int8"
    with _fake_safe_bitsandbytes(mode, Recipe(quantization=scheme, lora_rank=1)):
        stand_in = quantization._bnb_linear

        def bnb_linear(linear: nn.Module, kind: str) -> nn.Module:
            if kind not in ("nf4", "fp4"):
                return stand_in(linear, kind)
            new = traced_linear4bit(linear, kind, compress_statistics=bool(bnb.bnb_4bit_use_double_quant))
            new.compute_dtype = bnb.bnb_4bit_compute_dtype or torch.float32
            if half is not None and new.compute_dtype == torch.float16:
                new.compute_dtype = half
            return new

        quantization._bnb_linear = bnb_linear
        try:
            quantize_model(net, scheme, skip=tuple(bnb.llm_int8_skip_modules or ("lm_head",)))
        finally:
            quantization._bnb_linear = stand_in
    net.is_loaded_in_4bit, net.is_loaded_in_8bit = four_bit, bool(bnb.load_in_8bit)
    net.is_quantized, net.quantization_method = True, QuantizationMethod.BITS_AND_BYTES
    net.hf_quantizer = AutoHfQuantizer.from_config(bnb)
    net.config.quantization_config = bnb


def _fake_trainer(args: Any, model: Any, lora: Any, bnb: Any, seq_len: int, mode: Any, dtype: Any = None,
                  half: torch.dtype | None = None) -> Any:
    """Build the Trainer these settings would build, around a fake-tensor model (nothing allocated): the model
    in the dtype the run loads it in (`_model_dtype`; fp16 as `half` where given, as `_fake_parameters`),
    quantized as `bnb` loads it."""
    from datasets import Dataset
    from transformers import Trainer, default_data_collator

    from colab_memopt.techniques import architectures

    spec = architectures.resolve_model(model)
    dtype = _model_dtype(args, spec, model, dtype)
    dtype = half if half is not None and dtype == torch.float16 else dtype
    sft = type(args).__name__ == "SFTConfig"
    if sft and getattr(args, "model_init_kwargs", None):  # read above (the load dtype): TRL would say it ignores them
        args = _changed_args(args, {"model_init_kwargs": None})
    rows = {"input_ids": [[1] * seq_len]}
    if not sft:
        rows.update(attention_mask=[[1] * seq_len], labels=[[1] * seq_len])
    data = Dataset.from_dict(rows)
    with mode, _fake_safe_module_to(), _quiet_datasets():
        net = spec.build()
        with torch.no_grad():  # the weights in the load dtype; buffers as built (transformers keeps RoPE's in fp32)
            for p in net.parameters():
                if p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        if net.config is spec.config:  # the model's own config is marked below, never the caller's
            net.config = copy.deepcopy(spec.config)
        if bnb is not None and (getattr(bnb, "load_in_4bit", False) or getattr(bnb, "load_in_8bit", False)):
            if lora is None:  # what the Trainer answers for a purely quantized model, in the user's settings
                kind = "load_in_4bit" if bnb.load_in_4bit else "load_in_8bit"
                raise ValueError(f"BitsAndBytesConfig({kind}=True) without LoRA: the Trainer refuses to fine-tune a "
                                 "purely quantized model; give lora=LoraConfig(...)")
            _as_loaded(net, bnb, mode, half)
        if sft:
            from trl import SFTTrainer

            return SFTTrainer(model=net, args=args, train_dataset=data, processing_class=_plan_tokenizer(), peft_config=lora)
        if lora is not None:
            from peft import get_peft_model

            net = get_peft_model(net, lora)
        return Trainer(model=net, args=args, train_dataset=data, data_collator=default_data_collator)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Hide `datasets`' progress bars while the planner's one-row dataset is prepared."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


@isolated
def plan_trainer(
    trainer: Any,
    *,
    model: Any = None,
    lora: Any = None,
    bnb: Any = None,
    target: str | Target | dict[str, Any] = "t4",
    seq_len: int | None = None,
    headroom: float = 0.05,
    find_max_batch: bool = False,
    dtype: Any = None,
    **changes: Any,
) -> Plan:
    """Predict the peak memory of one optimizer step of a Hugging Face Trainer run on a target, without a GPU.

    Args:
        trainer: a `transformers.Trainer` or TRL `SFTTrainer` (planned on the model it holds), or
            `TrainingArguments` / `SFTConfig` with `model=`.
        model: with TrainingArguments: a model id, a local folder or config.json, a `PretrainedConfig`
            or one of `architectures.model_names()` (random weights under fake tensors).
        lora: with TrainingArguments: a peft `LoraConfig` (or its fields as a dict) or another peft config
            (`IA3Config`, `LoHaConfig`, prompt tuning: traced, named in the warnings); a Trainer already holds
            its peft model.
        bnb: with TrainingArguments: a `BitsAndBytesConfig` (or a dict of its fields): the model is planned
            as `from_pretrained(quantization_config=bnb)` loads it (a Trainer already holds its quantized model).
        target: 't4', 'l4', 'a100-40gb', 'a100-80gb', 'h100-80gb', 'cpu' (this machine), a `Target` or a dict.
        seq_len: tokens per sequence (default: SFTConfig's max_length).
        headroom: fraction of device memory kept free.
        find_max_batch: also find the largest per_device_train_batch_size that fits (two more traces).
        dtype: with TrainingArguments: the dtype you load the model in (`torch.bfloat16`, 'float16', 'auto', ...).
            Default: what the run loads with none given: `SFTTrainer` given a model id loads it in SFTConfig's
            `model_init_kwargs` dtype, else fp32 (TRL's rule); a model you load yourself (`from_pretrained`,
            transformers 5) comes in its config's dtype. A Trainer's model is planned in the dtypes it holds.
        **changes: TrainingArguments fields to change for this plan (what `fit_trainer` tries), e.g.
            `per_device_train_batch_size=2`; the arguments are rebuilt through their class, so what
            `TrainingArguments` refuses is refused (fp16 with bf16), and `deepspeed` / `fsdp`, which the
            plan does not model. A what-if leaves nothing on the Trainer or its model.

    Returns the same `Plan` as `cm.plan`: `batch` is the effective batch (per-device batch x
    accumulation steps), `recipe` the Recipe these settings amount to (`trainer_recipe`), and
    `warnings` name every setting the Recipe cannot say and what the trace cannot run.

    Example:
        >>> p = cm.plan_trainer(SFTConfig(per_device_train_batch_size=8, max_length=1024),
        ...                     model="HuggingFaceTB/SmolLM2-135M-Instruct", lora=LoraConfig(r=16), target="t4")
        >>> p.fits, p.device_need_bytes
    """
    start = time.perf_counter()
    headroom = check_headroom(headroom)
    tgt = _target(target)
    real_trainer, args = _unwrap(trainer)
    if changes:
        args = _changed_args(args, changes)
    _check_args(args, given=real_trainer is None)
    optim = check_optim(args.optim)
    if real_trainer is None and model is None:
        raise ValueError("plan_trainer(TrainingArguments) needs model= (a model id, folder, config or name)")
    given = {k: v for k, v in dict(model=model, lora=lora, bnb=bnb, dtype=dtype).items() if v is not None}
    if real_trainer is not None and given:
        raise ValueError(f"a Trainer already holds its model, its peft adapters, their quantization and dtype: leave "
                         f"{' and '.join(f'{k}=' for k in given)} out")
    if real_trainer is None:
        _check_trainable_model(model)
    if isinstance(lora, dict):
        from colab_memopt.planning.hfconfig import read_lora

        lora = read_lora(lora)
    if real_trainer is not None:
        lora = _peft_config(real_trainer.model)
        bnb = getattr(getattr(real_trainer.model, "config", None), "quantization_config", None)
        bnb = bnb if isinstance(bnb, dict) or type(bnb).__name__ == "BitsAndBytesConfig" else None
    bnb = _bnb_config(bnb)
    seq = _whole("seq_len", seq_len) if seq_len is not None else seq_len_of(args)
    recipe, notes = trainer_recipe(args, lora, bnb)
    given_optimizer = getattr(real_trainer, "optimizer", None)
    warn = [n for n in notes if given_optimizer is None or not n.startswith("optim=")]  # each names the setting
    if given_optimizer is not None:
        recipe, line = _given_optimizer_recipe(recipe, given_optimizer, optim)
        warn.append(line)
    if real_trainer is not None and not args.gradient_checkpointing and _checkpointing_on(real_trainer.model):
        recipe = recipe.with_(checkpointing="full")
        warn.append("your model has checkpointing on (gradient_checkpointing=False): the Trainer keeps it; planned on")
    warn += _unplanned_parallelism(args)
    if args.fp16 and not tgt.cuda:
        warn.append("fp16=True on the CPU: accelerate runs no fp16 autocast there, so the step is planned in fp32 as it runs")
    if args.fp16 and tgt.cuda:
        warn.append("fp16 autocast is traced as bf16 autocast (the same 2-byte activations); the GradScaler's few scalars "
                    "are not traced")
    if tgt.cuda and args.bf16 and tgt.compute_capability is not None and tuple(tgt.compute_capability) < (8, 0):
        warn.append(f"bf16=True on {tgt.name} (sm_{tgt.compute_capability[0]}{tgt.compute_capability[1]}): no native bf16; "
                    "use fp16=True there")
    if tgt.cuda and type(args).__name__ == "SFTConfig":
        warn.append("TRL's fused LM head is traced on its CPU path (torch tiles, every position scored); on CUDA with "
                    "Triton it scores only the trained positions in its own kernels: the plan is the most it can hold")
    # CUDA's fp16 autocast is traced as the CPU's bf16 autocast: fp16 weights are traced as bf16 ones (the same bytes)
    half = torch.bfloat16 if tgt.cuda and args.fp16 else None
    # the planner's own Trainer builds its accelerator from these settings: in accelerate's process-wide state,
    # which is put back as it was afterwards
    with _accelerate_state_kept(fresh=real_trainer is None), trainer_kept(real_trainer):
        holder, mode = real_trainer, _new_mode()
        if holder is None:
            built = _buildable(args)
            with _cpu_device_without_index(built):  # the Trainer moves its model to args.device while it is built
                holder = _fake_trainer(built, model, lora, bnb, seq, mode, dtype, half)

        # a user's own optimizer holds the real parameters: their names find the fake twins
        names = {id(p): n for n, p in holder.model.named_parameters()} if given_optimizer is not None else None

        def fakes() -> Any:  # a real Trainer's tensors swapped for fakes for the duration; a planner-built one's are fake
            if real_trainer is None:
                return contextlib.nullcontext()
            return _fake_parameters(real_trainer.model, mode, half=half)

        if args.fp16 and (found := _half_trainable(holder.model)):
            warn.append(f"{FP16_TRAP} {len(found)} trainable tensor(s) in "
                        f"{' and '.join(sorted({str(d).removeprefix('torch.') for d in found.values()}))}: the GradScaler "
                        "cannot unscale them on a GPU; planned in float32, as MemoryGuardCallback casts them")
        micro = int(args.per_device_train_batch_size)
        warn += _position_limit(holder.model, seq)
        trace_notes: list[str] = []
        with _args_of(holder, args), fakes(), _rows_kept(holder, args, trace_notes), _target_attention(tgt, args) as sdpa:
            trace, _n = _trace_step(holder, args, micro, seq, cuda=tgt.cuda, mode=mode, notes=trace_notes,
                                    param_names=names)
        trace.hidden_bytes = sdpa.hidden_bytes if sdpa is not None else 0
        warn += trace_notes
        loaded = _frozen_dtype(real_trainer.model) if real_trainer is not None else _model_dtype(
            args, _resolve(model), model, dtype)
        recipe = _with_base_dtype(recipe, loaded, warn)
        name = _model_name(holder.model, model)
        batch = micro * int(args.gradient_accumulation_steps)
        device_costs: list[Cost] = []
        if tgt.cuda:
            workspace, source = cublas_workspace_bytes(tgt.compute_capability)
            device_costs = [
                Cost("CUDA context", tgt.cuda_context_bytes, "assumed (0.5-2 GB seen on Colab; measure with NVML on your card)"),
                Cost("cuBLAS workspace", workspace, source, in_allocator=True),
            ]
            if trace.hidden_bytes:
                device_costs.append(math_attention_cost(trace.hidden_bytes, tgt))
                warn.append(math_attention_warning(tgt))
        if bnb is not None:
            from colab_memopt.planning.quantized import quantization_scale_bytes

            with mode:
                scales = quantization_scale_bytes(holder.model, cuda_rounding=tgt.cuda)
            if scales:
                device_costs.append(Cost("quantization scales", scales,
                                         "bitsandbytes' absmax and row scales kept beside the quantized weights (outside the "
                                         "parameters, which the trace counts)", in_allocator=True))
        result = Plan(
            model=name, batch=batch, seq_len=seq, recipe=recipe.to_dict(), target=tgt, method="trace",
            peak_bytes=trace.peak_bytes, by_category=trace.by_category, by_phase=trace.by_phase,
            by_phase_category=trace.phase_categories, device_costs=device_costs, host_costs=_host_costs(recipe, batch, seq),
            headroom_fraction=headroom, analytic_peak_bytes=0, warnings=warn,
            optimizer_impl=(f"your {type(given_optimizer).__name__} (optimizers=)" if given_optimizer is not None
                            and not any(n.startswith("your optimizers=") for n in trace_notes)
                            else f"the Trainer's optim={optim!r}") + (" (torch's CUDA choice)" if tgt.cuda else ""),
        )
        if find_max_batch:
            with fakes():
                result.max_batch = _max_micro_batch(holder, args, seq, tgt, result, trace, mode, names)
    result.seconds = time.perf_counter() - start
    return result


# transformers 5 resolves gradient_checkpointing* as deprecated aliases of activation_checkpointing*
_ALIASES = (("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"))


def _changed_args(args: Any, changes: dict[str, Any]) -> Any:
    """Return TrainingArguments / SFTConfig with `changes`, rebuilt through their class, so that its
    `__post_init__` refuses what the Trainer refuses (fp16 with bf16, ...); refuse names it does not have, and
    DeepSpeed / FSDP settings, which the plan does not model (and which set process-wide state when built)."""
    import dataclasses
    import warnings

    fields = {f.name: f for f in dataclasses.fields(args)}
    unknown = sorted(set(changes) - set(fields))
    if unknown:
        raise ValueError(f"unknown {type(args).__name__} field(s) {unknown}")
    derived = sorted(k for k in changes if not fields[k].init)
    if derived:
        raise ValueError(f"{type(args).__name__} sets {derived} itself: change the fields they come from")
    for key in ("deepspeed", "fsdp"):
        if changes.get(key):
            raise ValueError(_UNPLANNED[key].format(value=changes[key]))
    values = dict(changes)
    for old, new in _ALIASES:  # keep both names in step: the new one wins when both are set
        for a, b in ((old, new), (new, old)):
            if a in changes and b in fields and b not in changes:
                values[b] = changes[a]
    with warnings.catch_warnings(), _accelerate_state_kept():
        warnings.simplefilter("ignore")  # the aliases' deprecation notes
        return dataclasses.replace(args, **values)


@contextlib.contextmanager
def _accelerate_state_kept(*, fresh: bool = False) -> Iterator[None]:
    """Put accelerate's process-wide state back as it was: building TrainingArguments resets it (its `device`
    set-up), which would leave the user's own Trainer without its accelerator state. `fresh`: start without an
    accelerator state, so that the planner's own Trainer sets up its own (its mixed precision)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    tables = [cls._shared_state for cls in (PartialState, AcceleratorState, GradientState)]
    saved = [dict(t) for t in tables]
    if fresh:
        AcceleratorState._shared_state.clear()
        GradientState._shared_state.clear()
    try:
        yield
    finally:
        for table, old in zip(tables, saved):  # in place: every state object shares its class's dict
            table.clear()
            table.update(old)


_UNPLANNED = {
    "deepspeed": "deepspeed={value!r}: the plan does not model DeepSpeed (it traces one GPU without it); "
                 "leave deepspeed out, or plan ZeRO with the recipe fields zero_stage and offload_optimizer",
    "fsdp": "fsdp={value!r}: the plan does not model FSDP (it traces one GPU without it); leave fsdp out",
}


def _whole(name: str, value: Any) -> int:
    """Return `value` as an int if it is a whole number >= 1; else raise ValueError naming it."""
    import operator

    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return number


def _check_args(args: Any, *, given: bool) -> None:
    """Refuse the values a Trainer run cannot take, naming the field (TrainingArguments does not check them).

    `given`: the settings alone (no built Trainer): DeepSpeed there is refused, as the plan does not model it."""
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        _whole(name, getattr(args, name))
    if getattr(args, "max_length", None) is not None:
        _whole("max_length", args.max_length)
    for name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        value = getattr(args, name, None)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{name} must be a dict such as {{'use_reentrant': False}}, got {value!r}")
    if given and args.deepspeed:
        raise ValueError(_UNPLANNED["deepspeed"].format(value=args.deepspeed))


def _unplanned_parallelism(args: Any) -> list[str]:
    """Return a warning for each DeepSpeed / FSDP setting a built Trainer has: the plan is of one GPU without them."""
    out = []
    if args.deepspeed:
        out.append(f"deepspeed={args.deepspeed!r}: not modeled; planned as one GPU without DeepSpeed")
    if args.fsdp:
        fsdp = " ".join(str(getattr(o, "value", o)) for o in args.fsdp) if isinstance(args.fsdp, list) else args.fsdp
        out.append(f"fsdp={fsdp!r}: not modeled; planned as one GPU without FSDP")
    return out


def _checkpointing_on(model: Any) -> bool:
    """Return whether activation checkpointing is on in any module of `model` (what the Trainer leaves on)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


# the Recipe's names of the optimizer classes users pass as optimizers=(opt, None)
_OPTIMIZER_CLASSES = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "Adafactor": "adafactor", "AdamW8bit": "adamw8bit",
                      "Adam8bit": "adam8bit", "PagedAdamW8bit": "paged_adamw8bit", "Lion8bit": "lion8bit", "Lion": "lion"}


def _given_optimizer_recipe(recipe: Recipe, optimizer: Any, optim: str) -> tuple[Recipe, str]:
    """Return (the Recipe with the user's own optimizer, the warning that says the plan steps it, not optim)."""
    cls = type(optimizer).__name__
    name = _OPTIMIZER_CLASSES.get(cls)
    if name == "sgd" and any(g.get("momentum") for g in optimizer.param_groups):
        name = "sgd_momentum"
    line = f"optimizers=({cls}, ...) is what the Trainer steps, not optim={optim!r}: planned with yours"
    try:
        return (recipe.with_(optimizer=name) if name else recipe), line
    except ValueError:
        return recipe, line


def _check_trainable_model(model: Any) -> None:
    """Refuse this project's reference GPT sizes: a Trainer trains Hugging Face models only."""
    from colab_memopt.techniques.models import MODEL_SIZES

    if isinstance(model, str) and model in MODEL_SIZES:
        raise ValueError(f"model={model!r} is one of this project's reference GPTs, which a Trainer cannot train: "
                         "give a Hugging Face id, folder or config")


def _position_limit(net: Any, seq_len: int) -> list[str]:
    """Refuse a seq_len past a learned position table (the run would index out of it); warn past a
    rotary model's max_position_embeddings (it runs, beyond the lengths it was trained on)."""
    config = getattr(net, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for module_name, module in net.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and (leaf in ("wpe", "embed_positions") or "position" in leaf) \
                and module.num_embeddings < seq_len:
            limit = getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None) or module.num_embeddings
            raise ValueError(f"seq_len={seq_len} (max_length) is longer than the model's {limit} positions "
                             f"(n_positions / max_position_embeddings): use max_length <= {limit}")
    limit = getattr(text, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        return [f"max_length={seq_len} is past max_position_embeddings={limit}: it runs, but beyond the lengths the "
                "model was trained on"]
    return []


def _buildable(args: Any) -> Any:
    """Return the settings the planner's own Trainer is built with: what needs data it does not have (evaluation,
    a conversational dataset for assistant_only_loss) turned off; the training step is the same."""
    off = {"eval_strategy": "no", "load_best_model_at_end": False, "eval_on_start": False, "assistant_only_loss": False}
    changes = {k: v for k, v in off.items() if hasattr(args, k) and str(getattr(getattr(args, k), "value", getattr(args, k)))
               != str(v)}
    return _changed_args(args, changes) if changes else args


@contextlib.contextmanager
def _rows_kept(trainer: Any, args: Any, notes: list[str]) -> Iterator[None]:
    """Trace a padding-free collator's batch (packing=True, padding_free=True) as its full rows, for the duration:
    the flattened row's sequence boundaries are data-dependent, which fake tensors cannot follow."""
    collator = getattr(trainer, "data_collator", None)
    if not getattr(collator, "padding_free", False):
        yield
        return
    setting = "packing=True" if getattr(args, "packing", False) else "padding_free=True"
    notes.append(f"{setting}: planned as full rows of max_length (the same tokens); the packed row's attention "
                 "is not traced")
    collator.padding_free = False
    try:
        yield
    finally:
        collator.padding_free = True


@contextlib.contextmanager
def _args_of(trainer: Any, args: Any) -> Iterator[None]:
    saved = trainer.args
    trainer.args = args
    try:
        yield
    finally:
        trainer.args = saved


def _resolve(model: Any) -> Any:
    from colab_memopt.techniques import architectures

    return architectures.resolve_model(model)


def _frozen_dtype(model: nn.Module) -> torch.dtype:
    """Return the dtype most of the model's frozen floating-point weights are in (fp32 where there are none)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point() and not p.requires_grad:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def _with_base_dtype(recipe: Recipe, loaded: torch.dtype, warn: list[str]) -> Recipe:
    """Return the Recipe with `base_dtype` where the model is loaded in 16 bits and a Recipe can say so (LoRA under
    that dtype's autocast); else the Recipe as it is and a note in `warn`."""
    from colab_memopt.techniques.precision import BASE_DTYPE_PRECISION

    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(loaded)
    if name is None:
        return recipe
    if recipe.lora_rank and recipe.precision == BASE_DTYPE_PRECISION[name]:
        return recipe.with_(base_dtype=name)
    warn.append(f"the model loaded in {str(loaded).removeprefix('torch.')}: planned as loaded, its weights "
                f"{str(loaded).removeprefix('torch.')} (the plan's recipe summary says base_dtype only for LoRA under "
                f"{BASE_DTYPE_PRECISION[name]})")
    return recipe


def _bnb_config(bnb: Any) -> Any:
    """Return a BitsAndBytesConfig from one, from a dict of its fields (as a model's config.json holds it) or None;
    None where it quantizes nothing."""
    from colab_memopt.planning.hfconfig import read_bnb

    method = bnb.get("quant_method", "bitsandbytes") if isinstance(bnb, dict) else None
    if isinstance(bnb, dict) and str(getattr(method, "value", method)) == "bitsandbytes":
        bnb = read_bnb({k: v for k, v in bnb.items() if k not in ("quant_method", "_load_in_4bit", "_load_in_8bit")})
    elif bnb is not None and type(bnb).__name__ != "BitsAndBytesConfig":
        raise ValueError(f"bnb must be a BitsAndBytesConfig or a dict of its fields, got {type(bnb).__name__} {bnb!r}")
    if bnb is None or not (getattr(bnb, "load_in_4bit", False) or getattr(bnb, "load_in_8bit", False)):
        return None
    return bnb


def _peft_config(model: Any) -> Any:
    configs = getattr(model, "peft_config", None)
    if isinstance(configs, dict) and configs:
        return next(iter(configs.values()))
    return None


def _model_name(net: Any, given: Any) -> str:
    if isinstance(given, str):
        return given
    config = getattr(net, "config", None)
    return str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or type(net).__name__)


def _max_micro_batch(trainer: Any, args: Any, seq_len: int, tgt: Target, plan: Plan, trace: _Trace, mode: Any,
                     param_names: dict[int, str] | None = None) -> int:
    """Return the largest per_device_train_batch_size that fits: linear in the batch from two traces, then confirmed."""
    budget = plan.device_limit_bytes - sum(c.bytes for c in plan.device_costs if c.name != MATH_ATTENTION_LINE)
    micro = int(args.per_device_train_batch_size)

    def peak(b: int) -> int:
        with _args_of(trainer, _changed_args(args, {"per_device_train_batch_size": b})), _target_attention(tgt, args) as sdpa:
            peak_bytes = _trace_step(trainer, _changed_args(args, {"per_device_train_batch_size": b}), b, seq_len,
                                     cuda=tgt.cuda, mode=mode, param_names=param_names)[0].peak_bytes
        return peak_bytes + (sdpa.hidden_bytes if sdpa is not None else 0)

    other = micro + 1
    p1, p2 = trace.peak_bytes + trace.hidden_bytes, peak(other)
    per_sample = max(p2 - p1, 1)
    guess = max(0, micro + (budget - p1) // per_sample)
    while guess > 0 and peak(guess) > budget:
        guess -= 1
    return int(guess)


def _target_attention(tgt: Target, args: Any) -> Any:
    """Return the context that traces SDPA as the target runs it (`attention.traced_attention`): the CUDA target's
    kernels, whatever the process's SDPA flags; fp16 autocast, traced as bf16 autocast, picks them as fp16."""
    capability = tuple(tgt.compute_capability) if tgt.cuda and tgt.compute_capability is not None else None
    return traced_attention(capability, stand_in={torch.bfloat16: torch.float16} if args.fp16 and tgt.cuda else None)


def _half_trainable(model: Any) -> dict[str, torch.dtype]:
    from colab_memopt.techniques.precision import half_trainable

    return half_trainable(model)


def _upcast_trainable(model: Any) -> None:
    from colab_memopt.techniques.precision import upcast_trainable

    upcast_trainable(model)


FP16_TRAP = "fp16=True with"  # how plan_trainer's warning about bf16/fp16 trainable weights begins
FP16_TRAP_NOTE = "fp16=True needs float32 trainable weights (TRL makes 4-bit LoRA bfloat16): add MemoryGuardCallback"


def _fp16_trap_notes(*plans: Plan | None) -> list[str]:
    """Return fit_trainer's note for trainable weights fp16 cannot train, where a plan found them."""
    return [FP16_TRAP_NOTE] if any(p is not None and any(w.startswith(FP16_TRAP) for w in p.warnings) for p in plans) else []


# -- fitting -------------------------------------------------------------------------------------------
_EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit", "adafactor")
_FULL_ADAM = ("adamw_torch", "adamw_torch_fused", "adamw_apex_fused", "adamw_anyprecision", "paged_adamw",
              "paged_adamw_32bit")


@dataclass
class FittedSettings:
    """The settings to train with, from `TrainerFit.apply(args)`: pass each where your script loads and trains.

    Example (a model id given to TRL's SFTTrainer, which loads it with `args.model_init_kwargs`):
        >>> fitted = fit.apply(args)
        >>> trainer = SFTTrainer(model=model_id, args=fitted.args, peft_config=fitted.lora,
        ...                      quantization_config=fitted.bnb, train_dataset=dataset)
    or a model you load yourself:
        >>> model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=fitted.bnb,
        ...                                              **fitted.model_init_kwargs)
        >>> trainer = SFTTrainer(model=model, args=fitted.args, peft_config=fitted.lora, train_dataset=dataset)
    """

    args: Any  # a new TrainingArguments / SFTConfig: yours with the fit's changes, built (and checked) by its class
    lora: Any  # the LoraConfig (peft config) to train with, or None (full fine-tuning)
    bnb: Any  # the BitsAndBytesConfig to load the model with, or None (not quantized)
    dtype: torch.dtype | None  # the dtype to load the model with; None: none chosen (as you load it)
    model_init_kwargs: dict[str, Any]  # `from_pretrained` keywords: an SFTConfig's model_init_kwargs, and the dtype


@dataclass
class TrainerFit:
    """What to change in a Trainer's settings so the run fits a target, with the plans before and after.

    `apply(args)` returns the fitted settings; `lora`, `bnb` and `dtype` are what to load and train the model with.
    """

    changes: dict[str, Any]  # TrainingArguments / SFTConfig fields to set
    before: Plan
    after: Plan | None  # None: nothing tried fits
    slowdown: float  # expected step time after / before, from the target's technique-cost table
    tried: list[tuple[dict[str, Any], int, float]] = field(default_factory=list)  # (changes, peak bytes, slowdown)
    notes: list[str] = field(default_factory=list)
    lora: Any = None  # the LoraConfig to train with (yours), or None
    bnb: Any = None  # the BitsAndBytesConfig to load the model with (yours, or the fit's 4-bit one), or None
    dtype: torch.dtype | None = None  # the dtype to load the model with, where the fit or you chose one
    skipped: int = 0  # change sets not planned: they save no more than one that did not fit
    predicted: int = 0  # change sets not planned: two plans that differ only in the batch predict they do not fit

    @property
    def fits(self) -> bool:
        return self.after is not None and self.after.fits

    @property
    def model_init_kwargs(self) -> dict[str, Any] | None:
        """SFTConfig's `model_init_kwargs` the fit sets (the dtype SFTTrainer loads a model id in), or None."""
        return self.changes.get("model_init_kwargs")

    def apply(self, args: Any) -> FittedSettings:
        """Return the fitted settings: a new `args` (TrainingArguments / SFTConfig) with the changes, built through
        its class so that it is checked as yours was, and the LoraConfig, BitsAndBytesConfig and dtype to use.
        `args` is not changed. Raise ValueError where nothing tried fits.

        Example:
            >>> fit = cm.fit_trainer(args, model=model_id, lora=lora, target="t4")
            >>> fitted = fit.apply(args)
            >>> trainer = SFTTrainer(model=model_id, args=fitted.args, peft_config=fitted.lora,
            ...                      quantization_config=fitted.bnb, train_dataset=dataset)
        """
        if not self.fits:
            from colab_memopt.core.measure import format_bytes

            before = self.before
            raise ValueError(f"nothing tried fits {before.target.name} (needs {format_bytes(before.device_need_bytes)} "
                             f"of {format_bytes(before.device_limit_bytes)}): {'; '.join(self.notes)}")
        fitted = _changed_args(args, self.changes)
        kwargs = dict(getattr(fitted, "model_init_kwargs", None) or {})
        dtype = self.dtype if self.dtype is not None else _dtype_value(kwargs.get("dtype", kwargs.get("torch_dtype")),
                                                                        "model_init_kwargs['dtype']")
        if isinstance(dtype, torch.dtype) and "dtype" not in kwargs and "torch_dtype" not in kwargs:
            kwargs["dtype"] = dtype
        return FittedSettings(fitted, self.lora, self.bnb, dtype if isinstance(dtype, torch.dtype) else None, kwargs)

    def _load_lines(self) -> list[str]:
        """Return the lines that say how to load the model, where the fit changed it (dtype, 4-bit)."""
        load = self.tried[-1][0] if self.fits and self.tried else {}
        lines = []
        if "bnb" in load:
            lines += textwrap.wrap(f"# load the model 4-bit: quantization_config={_bnb_text(self.bnb)}", 96,
                                   subsequent_indent="#     ")
        if "dtype" in load and "model_init_kwargs" not in self.changes:  # SFTTrainer loads a model id with those
            lines.append(f"# load the model with dtype={_dtype_text(self.dtype)}")
        return lines

    def snippet(self, name: str = "SFTConfig") -> str:
        """Return the lines to paste into your `SFTConfig(...)` / `TrainingArguments(...)` call (and, where the fit
        loads the model otherwise, how to load it)."""
        if not self.changes and not self._load_lines():
            return f"# {name}(...) fits as it is: nothing to change"
        lines = [f"# in your {name}(...) / TrainingArguments(...) call, set:"] if self.changes else []
        lines += [f"    {k}={v!r}," for k, v in self.changes.items()] + self._load_lines()
        return "\n".join(lines)

    def __str__(self) -> str:
        """Return the answer first (fits or not, the need against the limit), the lines to set, the step time with
        its source, the notes; lines of at most 100 characters (`before.explain()` / `after.explain()`: the plans)."""
        from colab_memopt.core.measure import format_bytes
        from colab_memopt.core.wording import wrap

        before = self.before
        limit = format_bytes(before.device_limit_bytes)
        tgt = before.target.name
        if self.after is None:
            lines = [f"no change tried fits {tgt} ({len(self.tried)} tried): your settings need "
                     f"{format_bytes(before.device_need_bytes)} of {limit} usable"]  # the notes: the least need reached
        elif not self.changes:
            lines = [f"fits {tgt} as it is: needs {format_bytes(self.after.device_need_bytes)} of {limit} usable"]
        else:
            verdict = "fits" if self.after.fits else "does not fit"
            lines = [f"{verdict} {tgt} with these changes: needs {format_bytes(self.after.device_need_bytes)} of {limit} "
                     f"usable (now {format_bytes(before.device_need_bytes)})", *self.snippet().splitlines(),
                     self._step_time()]
        for n in self.notes:
            lines += wrap(n, first="note: ", rest="  ")
        return "\n".join(lines)

    def _step_time(self) -> str:
        """Return 'step time xN of your settings' (prior|measured on ...)' from the target's cost table."""
        from colab_memopt.planning import costs

        table = costs.costs_for_target(self.before.target)
        kinds = {table.kind(t) for t in table.ratios}
        label = (f"prior: published figures, not measured on a {table.device_class}" if kinds <= {"prior"}
                 else f"measured on {table.device}" if kinds == {"measured"} else f"from the {table.table}")
        return f"step time x{self.slowdown:.2f} of your settings' ({label})"

    def explain(self) -> str:
        """Return every change set tried with its need and step time, then the plans before and after in full."""
        from colab_memopt.core.measure import format_bytes

        lines = [f"tried ({len(self.tried)}), cheapest expected step time first:"]
        lines += [f"  {format_bytes(need):>10s}  step time x{cost:.2f}  "
                  + (", ".join(_change_text(k, v) for k, v in changes.items()) or "no change") for changes, need, cost in self.tried]
        lines += ["plan of your settings:", *[f"  {line}" for line in self.before.explain().splitlines()]]
        if self.after is not None and self.after is not self.before:
            lines += ["plan with the changes:", *[f"  {line}" for line in self.after.explain().splitlines()]]
        return "\n".join(lines)


def _dtype_text(dtype: Any) -> str:
    return f"torch.{str(dtype).removeprefix('torch.')}" if isinstance(dtype, torch.dtype) else repr(dtype)


def _change_text(key: str, value: Any) -> str:
    """Return one change as the user writes it: `bnb=BitsAndBytesConfig(...)`, `dtype=torch.float16`, `k=v`."""
    if key == "bnb":
        return f"bnb={_bnb_text(value)}"
    return f"{key}={_dtype_text(value) if isinstance(value, torch.dtype) else repr(value)}"


def _bnb_text(bnb: Any) -> str:
    """Return the BitsAndBytesConfig(...) call that builds `bnb` (its load and 4-bit fields)."""
    if bnb is None:
        return "None"
    fields = [("load_in_4bit", bnb.load_in_4bit), ("load_in_8bit", bnb.load_in_8bit)]
    if bnb.load_in_4bit:
        fields += [("bnb_4bit_quant_type", bnb.bnb_4bit_quant_type), ("bnb_4bit_compute_dtype", bnb.bnb_4bit_compute_dtype)]
    text = ", ".join(f"{k}={_dtype_text(v) if isinstance(v, torch.dtype) else repr(v)}" for k, v in fields if v)
    return f"BitsAndBytesConfig({text})"


def _slowdown(args: Any, tgt: Target, lora: Any, bnb: Any) -> float:
    """Return the expected step time of these settings against plain fp32 training on the target (costs.py)."""
    from colab_memopt.planning import costs

    recipe, _ = trainer_recipe(args, lora, bnb)
    accumulation = recipe.accumulation_steps
    if accumulation > 4:  # the table has 2 and 4: a longer accumulation counts as 4 (a lower bound on its cost)
        recipe = recipe.with_(accumulation_steps=4)
    elif accumulation == 3:
        recipe = recipe.with_(accumulation_steps=2)
    return costs.expected_slowdown(recipe, costs.costs_for_target(tgt)).ratio


@dataclass(frozen=True)
class _Level:
    """One value of one setting `fit_trainer` may change."""

    args: tuple[tuple[str, Any], ...] = ()  # TrainingArguments / SFTConfig fields it sets
    load: tuple[tuple[str, Any], ...] = ()  # how the model is loaded: ('dtype', torch dtype), ('bnb', BitsAndBytesConfig)
    cost: float = 0.0  # to the user: 0 free, 1 slower steps, 2 also a small quality loss, 3 per halving of max_length


# the cost of each change to the user, lowest first (fit_trainer tries the cheapest sets first)
_OPTIM_COST = {"adamw_8bit": 1.0, "paged_adamw_8bit": 1.2, "adafactor": 2.0}


def _native_half(tgt: Target) -> torch.dtype | None:
    """Return the 16-bit dtype the target computes in natively: fp16 before sm_80 (a T4), bf16 after; None for a CPU."""
    if not tgt.cuda:
        return None
    old = tgt.compute_capability is not None and tuple(tgt.compute_capability) < (8, 0)
    return torch.float16 if old else torch.bfloat16


def _dimensions(args: Any, tgt: Target, trainer: Any = None, *, lora: Any = None, bnb: Any = None, loaded: Any = None,
                sft_model_id: bool = False, seq_given: bool = False) -> list[tuple[list[_Level], bool]]:
    """Return what fit_trainer may change, one list of levels per setting, each starting with 'as it is' and ordered by
    the memory it saves where the flag says so (a later level never needs more): precision, the base's dtype and a
    4-bit base (LoRA), checkpointing, the optimizer and 16-bit weights (full fine-tuning), the per-device batch with
    accumulation keeping the effective batch, and `max_length`. A built `trainer` holds its model: its dtype,
    quantization and (where its model has it on) checkpointing stay, and so does `optim` with its own optimizer."""
    half = _native_half(tgt)
    dims: list[tuple[list[_Level], bool]] = []
    if half == torch.float16:
        if args.bf16:  # no native bf16 on a T4: fp16 is a must, not an option (it needs no less than bf16 autocast)
            dims.append(([_Level((("bf16", False), ("fp16", True)))], True))
        elif not args.fp16:
            dims.append(([_Level(), _Level((("fp16", True),))], False))
    elif half is not None and not (args.fp16 or args.bf16):
        dims.append(([_Level(), _Level((("bf16", True),))], False))

    def load_dtype(dtype: torch.dtype) -> _Level:
        if sft_model_id:  # SFTTrainer loads a model id with SFTConfig's model_init_kwargs
            kwargs = {**(args.model_init_kwargs or {}), "dtype": str(dtype).removeprefix("torch.")}
            kwargs.pop("torch_dtype", None)
            return _Level((("model_init_kwargs", kwargs),), (("dtype", dtype),))
        return _Level((), (("dtype", dtype),))

    if trainer is None and half is not None and lora is not None:  # LoRA's frozen base: 16 bits, then 4 bits
        base = [_Level()]
        sixteen = load_dtype(half) if loaded == torch.float32 else _Level()  # LoRA trains fp32 adapters on it
        if sixteen.load:
            base.append(sixteen)
        if bnb is None:  # QLoRA: the linear layers in nf4, the rest (embeddings, norms, head) in 16 bits
            from transformers import BitsAndBytesConfig

            four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=half)
            base.append(_Level(sixteen.args, sixteen.load + (("bnb", four_bit),), 2.0))
        if len(base) > 1:
            dims.append((base, True))
    elif trainer is None and half == torch.bfloat16 and loaded == torch.float32:  # full fine-tuning: 16-bit weights,
        level = load_dtype(half)  # bf16 only (a T4's fp16 weights cannot be trained under the GradScaler)
        dims.append(([_Level(), _Level(level.args + (("bf16", True), ("fp16", False)), level.load, 2.0)], True))
    if not args.gradient_checkpointing and not (trainer is not None and _checkpointing_on(trainer.model)):
        dims.append(([_Level(), _Level((("gradient_checkpointing", True),
                                        ("gradient_checkpointing_kwargs", {"use_reentrant": False})), cost=1.0)], True))
    optim = str(getattr(args.optim, "value", args.optim))
    own = getattr(trainer, "optimizer", None) is not None  # optimizers=(opt, None): the Trainer ignores optim
    if optim in _FULL_ADAM and not own and lora is None:  # LoRA's optimizer state is small: swaps save little
        dims.append(([_Level()] + [_Level((("optim", o),), cost=_OPTIM_COST[o]) for o in _EIGHT_BIT], False))
    micro, accum = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    effective = micro * accum
    batches = [_Level()] + [_Level((("per_device_train_batch_size", b), ("gradient_accumulation_steps", effective // b)),
                                   cost=0.5 * math.log2(micro / b)) for b in range(micro - 1, 0, -1) if effective % b == 0]
    if len(batches) > 1:
        dims.append((batches, True))
    length = getattr(args, "max_length", None)
    if trainer is None and not seq_given and isinstance(length, int):  # shorter rows: the run trains on less text
        shorter = [length // 2**k for k in (1, 2) if length // 2**k >= 128]
        if shorter:
            dims.append(([_Level()] + [_Level((("max_length", n),), cost=3.0 * k) for k, n in enumerate(shorter, 1)], True))
    return dims


def _candidates(args: Any, tgt: Target, trainer: Any = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Return the change sets to try (TrainingArguments / SFTConfig fields), cheapest first; see `_dimensions`."""
    return [{k: v for level in levels for k, v in level.args} for _, levels in _ranked(_dimensions(args, tgt, trainer,
                                                                                                   **kwargs))]


def _ranked(dims: list[tuple[list[_Level], bool]]) -> list[tuple[tuple[int, ...], list[_Level]]]:
    """Return every combination of one level per setting, as (level indices, levels), cheapest to the user first
    (the sum of the levels' costs), then the most changes among sets of the same cost: the set that saves the most for
    that cost is planned first, and where it does not fit, the sets it includes are not planned."""
    import itertools

    combos = itertools.product(*[range(len(levels)) for levels, _ in dims])
    picked = [(idx, [dims[d][0][i] for d, i in enumerate(idx)]) for idx in combos]
    return sorted(picked, key=lambda p: (round(sum(lv.cost for lv in p[1]), 3),
                                         -sum(bool(lv.args or lv.load) for lv in p[1])))


def _saves_no_more(idx: tuple[int, ...], than: tuple[int, ...], dims: list[tuple[list[_Level], bool]]) -> bool:
    """Return whether the change set `idx` saves no more memory than `than` (each of its levels saves at most the
    other's on an ordered setting, and is the same on the others)."""
    return all(a <= b if ordered else a == b for a, b, (_, ordered) in zip(idx, than, dims))


@isolated
def fit_trainer(
    trainer: Any,
    *,
    model: Any = None,
    lora: Any = None,
    bnb: Any = None,
    target: str | Target | dict[str, Any] = "t4",
    seq_len: int | None = None,
    headroom: float = 0.05,
    max_plans: int = 24,
    dtype: Any = None,
) -> TrainerFit:
    """Return the cheapest change to a Trainer's own settings that makes the run fit the target.

    Searches, cheapest to you first, and stops at the first change set that fits:
    - the precision the target runs natively (fp16 on a T4, where bf16 is a must to change);
    - LoRA / QLoRA: the frozen base loaded in 16 bits (`model_init_kwargs={"dtype": "float16"}` for an SFTConfig
      with a model id, else `dtype=`), a 4-bit base (`BitsAndBytesConfig(load_in_4bit=True, nf4)`);
    - full fine-tuning: an 8-bit or factored optimizer (`optim`), and 16-bit (bf16) weights where the GPU has bf16;
    - gradient checkpointing (`use_reentrant=False`);
    - a smaller `per_device_train_batch_size` with `gradient_accumulation_steps` keeping the effective batch;
    - a shorter `max_length` (half, then a quarter: the run then trains on less text, so it comes last).
    A change set that saves no more memory than one that did not fit is not planned, nor one whose need two plans
    differing only in `per_device_train_batch_size` predict (linear in it) over the limit. At most `max_plans` plans
    after the first; a built Trainer keeps its model's dtype and quantization. On failure the notes name the
    smallest need reached and what to do next. Arguments as `plan_trainer`.

    Example:
        >>> args = SFTConfig(per_device_train_batch_size=4, max_length=1024)
        >>> fit = cm.fit_trainer(args, model="meta-llama/Llama-3.2-3B", lora=LoraConfig(target_modules="all-linear"),
        ...                      target="t4")
        >>> print(fit)   # here: fp16=True, model_init_kwargs={'dtype': 'float16'} (the frozen base in fp16)
        >>> fitted = fit.apply(args)   # .args, .lora, .bnb, .dtype, .model_init_kwargs: see TrainerFit.apply
        >>> trainer = SFTTrainer(model="meta-llama/Llama-3.2-3B", args=fitted.args, peft_config=fitted.lora,
        ...                      quantization_config=fitted.bnb, train_dataset=dataset)
    """
    from colab_memopt.core.measure import format_bytes

    tgt = _target(target)
    max_plans = _whole("max_plans", max_plans)
    if isinstance(lora, dict):
        from colab_memopt.planning.hfconfig import read_lora

        lora = read_lora(lora)
    kwargs = dict(model=model, lora=lora, target=tgt, seq_len=seq_len, headroom=headroom)
    load0 = {k: v for k, v in dict(bnb=bnb, dtype=dtype).items() if v is not None}
    before = plan_trainer(trainer, **kwargs, **load0)
    real, args = _unwrap(trainer)
    if real_lora := (lora if lora is not None else _peft_config(getattr(trainer, "model", None))):
        lora = real_lora
    bnb = _bnb_config(bnb)
    kept = dict(lora=lora, bnb=bnb, dtype=_dtype_value(dtype, "dtype") if dtype is not None else None)
    base_cost = _slowdown(args, tgt, lora, bnb)
    if before.fits and not (args.bf16 and _native_half(tgt) == torch.float16):
        return TrainerFit({}, before, before, 1.0, notes=_fp16_trap_notes(before), **kept)
    loaded = None if real is not None else _model_dtype(args, _resolve(model), model, dtype)
    dims = _dimensions(args, tgt, real, lora=lora, bnb=bnb, loaded=loaded,
                       sft_model_id=type(args).__name__ == "SFTConfig" and isinstance(model, str),
                       seq_given=seq_len is not None)
    ranked = [(idx, levels) for idx, levels in _ranked(dims) if any(lv.args or lv.load for lv in levels)]
    # the settings as they are, where they do not fit (fp16 for a T4's bf16, a must, needs no less than bf16)
    failed: list[tuple[int, ...]] = [] if before.fits else [tuple(0 for _ in dims)]
    tried: list[tuple[dict[str, Any], int, float]] = []
    skipped = predicted = 0
    # the need is linear in the per-device batch at a fixed accumulation regime: two plans of smaller batches that
    # differ only in it predict the others; one predicted 5% over the limit is not planned (a fit is always planned)
    bdim = next((d for d, (levels, _) in enumerate(dims) for lv in levels
                 if dict(lv.args).get("per_device_train_batch_size")), None)
    points: dict[tuple[int, ...], dict[int, int]] = {}

    def split(idx: tuple[int, ...], levels: list[_Level]) -> tuple[tuple[int, ...], int]:
        micro = int(dict(levels[bdim].args).get("per_device_train_batch_size", args.per_device_train_batch_size))
        return idx[:bdim] + idx[bdim + 1:], micro

    for idx, levels in ranked:
        if any(_saves_no_more(idx, f, dims) for f in failed):
            skipped += 1
            continue
        if bdim is not None and idx[bdim] > 0:
            rest, micro = split(idx, levels)
            known = sorted(points.get(rest, {}).items())
            if len(known) >= 2:
                (b1, n1), (b2, n2) = known[0], known[-1]
                if n1 + (n2 - n1) * (micro - b1) / (b2 - b1) > 1.05 * before.device_limit_bytes:
                    predicted += 1
                    failed.append(idx)
                    continue
        if len(tried) >= max_plans:
            break
        changes = {k: v for lv in levels for k, v in lv.args}
        load = {**load0, **{k: v for lv in levels for k, v in lv.load}}
        after = plan_trainer(trainer, **kwargs, **load, **changes)
        use = dict(lora=lora, bnb=_bnb_config(load.get("bnb")), dtype=load.get("dtype", kept["dtype"]))
        cost = _slowdown(_changed_args(args, changes), tgt, lora, use["bnb"]) / base_cost
        tried.append(({**changes, **{k: v for lv in levels for k, v in lv.load}}, after.device_need_bytes, cost))
        if bdim is not None and idx[bdim] > 0:  # a smaller batch with accumulation (accumulating holds the gradients)
            rest, micro = split(idx, levels)
            points.setdefault(rest, {})[micro] = after.device_need_bytes
        if after.fits:
            notes = [] if "gradient_accumulation_steps" not in changes else [
                f"effective batch kept: {changes['per_device_train_batch_size']} x {changes['gradient_accumulation_steps']} "
                f"= {before.batch}"]
            return TrainerFit(changes, before, after, cost, tried, notes + _fp16_trap_notes(after), skipped=skipped,
                              predicted=predicted, **use)
        failed.append(idx)
    left = len(ranked) - len(tried) - skipped - predicted
    notes = [f"stopped after max_plans={max_plans} plans; {left} more change sets not tried (raise max_plans)"
             ] if left > 0 else []
    best = min(tried, key=lambda t: t[1]) if tried else ({}, before.device_need_bytes, 1.0)
    shown = {k: v for k, v in best[0].items() if not (k == "bf16" and best[0].get("fp16"))
             and not (k == "dtype" and "model_init_kwargs" in best[0])}
    text = ", ".join(f"{k}={_dtype_text(v) if isinstance(v, torch.dtype) else _bnb_text(v) if k == 'bnb' else repr(v)}"
                     for k, v in shown.items()) or "your settings"
    notes.append("\n      ".join(textwrap.wrap(f"smallest need reached: {format_bytes(best[1])} of "
                                               f"{format_bytes(before.device_limit_bytes)} usable, with {text}", 92)))
    if lora is None:
        notes.append("next: train LoRA adapters (peft_config=LoraConfig(...)), or QLoRA with a 4-bit base, "
                     "or a smaller model")
    else:
        notes.append("next: a smaller model, a shorter max_length, fewer LoRA target_modules, or a GPU with more memory")
    return TrainerFit({}, before, None, 1.0, tried, notes + _fp16_trap_notes(before), skipped=skipped,
                      predicted=predicted, **kept)
