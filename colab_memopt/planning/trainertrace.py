"""The Trainer a plan traces and its step, on fake tensors: your Trainer as it is, or the one settings would build.

`_trace_step` runs what the training loop runs for one optimizer step (`Trainer.training_step` on two micro-batches,
the gradient clipping, `optimizer.step()` and `model.zero_grad()`) on a batch made by the Trainer's own data
collator, under the tensor tracker. A real Trainer's parameters are swapped for fake ones for the duration
(`_fake_parameters`: tied weights stay tied, bitsandbytes' quantized weights keep their state as fakes) and what the
step sets on the Trainer and its model is put back. `_fake_trainer` builds the Trainer a `TrainingArguments` /
`SFTConfig` would build, around a fake-tensor model in the dtype the run loads it in and quantized as a
`BitsAndBytesConfig` loads it; `_changed_args` rebuilds settings with changes through their class, with
accelerate's process-wide state put back.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from colab_memopt.techniques.attention import traced_attention
from colab_memopt.techniques.loss import first_rounds_traced
from colab_memopt.planning.cudapaths import as_on_cuda, cuda_path_note, forward_autocast
from colab_memopt.planning.faketrace import _Trace, _fake_safe_module_to, _fake_safe_transformers
from colab_memopt.planning.quantized import _fake_safe_bitsandbytes
from colab_memopt.planning.targets import Target
from colab_memopt.planning.hfconfig import OPTIM_TO_RECIPE, packed_rows_note
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.console import import_quietly
from colab_memopt.core.tracker import PHASES, NoDynamoWrap, TensorTracker, fake_device, fake_tensor_mode, tensors_bytes


class _ScalarMode(NoDynamoWrap, torch.utils._python_dispatch.TorchDispatchMode):
    """Answer `.item()` / `bool()` of a fake tensor with 1, so that the Trainer's metrics and branches on a
    value (`if num_valid > 0`, `loss.item()`) run; the bytes of a step do not depend on those values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1 if not t.is_floating_point() else 1.0)
        device = fake_device(func, args)  # `tensor.device`: answered as the fake mode below answers it
        return device if device is not None else func(*args, **(kwargs or {}))


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
        MatmulLtState = import_quietly("bitsandbytes.autograd._functions").MatmulLtState
        QuantState = import_quietly("bitsandbytes.functional").QuantState
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
        bnb = import_quietly("bitsandbytes")
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
        empty = hasattr(dataset, "__len__") and len(dataset) == 0
    except Exception:  # noqa: BLE001 - a length it cannot give: read a row to learn more
        empty = False
    if empty:  # nothing to read: the collator's own fields only (the Trainer says what it does with no rows)
        return {"input_ids": None}
    try:
        with unset_fake_temporarily():
            example = next(iter(dataset)) if isinstance(dataset, torch.utils.data.IterableDataset) else dataset[0]
    except StopIteration:  # an iterable dataset without rows
        return {"input_ids": None}
    except Exception as exc:  # noqa: BLE001 - the run would stop at its first batch: say so now, naming the error
        raise ValueError(f"cannot read a row of the train dataset: its first row raised {type(exc).__name__}: {exc} "
                         "(the Trainer reads its rows the same way: fix the dataset)") from exc
    return dict(example) if isinstance(example, dict) or hasattr(example, "keys") else {"input_ids": None}


# Micro-batches of up to this many examples are made by the Trainer's collator from that many examples; a larger one
# from two collations of a few examples, each field's shape carried to the batch (the collator's own loop over
# 100,000 examples under the fake mode took minutes; the bytes depend on the shapes only).
_COLLATED_DIRECTLY = 8


def _collate(trainer: Any, batch: int, seq_len: int, fields: dict[str, Any]) -> dict[str, Any]:
    examples = []
    for _ in range(batch):
        ex: dict[str, Any] = {}
        for name in _TOKEN_FIELDS:
            if name == "input_ids" or name in fields:
                like = fields.get(name)
                ex[name] = (torch.ones(seq_len, dtype=like.dtype) if isinstance(like, torch.Tensor) else [1] * seq_len)
        examples.append(ex)
    return dict(trainer.data_collator(examples))


def _synthetic_batch(trainer: Any, batch: int, seq_len: int) -> dict[str, Any]:
    """Return one batch the Trainer's own collator makes from `batch` examples of `seq_len` tokens (every position
    a trained token: the most the run can hold), with the per-token fields the Trainer's dataset yields (labels
    included), each a list or a tensor as the dataset gives it.

    Above `_COLLATED_DIRECTLY` examples, the collator makes batches of 2 and 4 and every field's shape is carried to
    `batch` (each dimension grows by the same amount per example: along the batch, or along the one packed row of
    a padding-free collator); where a field is not such a tensor, the collator makes the whole batch."""
    fields = _example_fields(trainer.train_dataset)
    if batch <= _COLLATED_DIRECTLY:
        return _collate(trainer, batch, seq_len, fields)
    two, four = _collate(trainer, 2, seq_len, fields), _collate(trainer, 4, seq_len, fields)
    out: dict[str, Any] = {}
    for name, value in four.items():
        small = two.get(name)
        if not (isinstance(value, torch.Tensor) and isinstance(small, torch.Tensor) and small.dim() == value.dim()
                and small.dtype == value.dtype):
            return _collate(trainer, batch, seq_len, fields)
        shape = []
        for at_two, at_four in zip(small.shape, value.shape):
            grows, rest = divmod(at_four - at_two, 2)
            if rest or at_two - 2 * grows < 0:
                return _collate(trainer, batch, seq_len, fields)
            shape.append(at_two + grows * (batch - 2))
        out[name] = value.new_ones(shape)
    return out


def _trace_step(trainer: Any, args: Any, batch: int, seq_len: int, *, cuda: bool, mode: Any = None,
                notes: list[str] | None = None, param_names: dict[int, str] | None = None,
                period: int | None = None) -> tuple[_Trace, int]:
    """Trace the Trainer's step on fake tensors; return (the trace, the number of trainable parameters).

    `mode`: the fake-tensor mode a planner-built Trainer's model lives in (its parameters are fake already);
    None swaps a real Trainer's parameters for fake ones for the duration. The optimizer is the one the Trainer
    steps (the user's own, `optimizers=(opt, None)`, as a twin over the fake parameters); checkpointing is what
    the Trainer's `train()` leaves on: the model's own, or the settings' `gradient_checkpointing`; every flag and
    hook that enabling it adds is taken off afterwards. `notes`: what the trace could not run as given is added.
    `param_names`: {id: name} of the real parameters, where they are swapped for fakes before this is called.
    `period`: the trace records its timeline by units of that many blocks (`stack.py`), for the stack count."""
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
    # The run's autocast: accelerate autocasts fp16 and bf16 on CUDA, only bf16 on the CPU (an fp16 run there is fp32),
    # over the model's forward only (`cudapaths.forward_autocast`); CUDA's fp16 autocast is traced as CPU bf16
    # autocast (the same 2-byte activations).
    half = torch.bfloat16 if args.bf16 or (args.fp16 and cuda) else None
    try:
        _enable_checkpointing_as_the_trainer_does(model, args)
        with _fake_parameters(model, mode) if swap else contextlib.nullcontext(), mode, _ScalarMode(), _fake_safe_module_to(), \
                _fake_safe_bitsandbytes(mode, recipe, cuda=cuda), _fake_safe_transformers(), _cpu_device_without_index(trainer.args):
            if args.fp16:  # fp16's GradScaler needs fp32 trainables: planned as MemoryGuardCallback casts them
                _upcast_trainable(model)
            optimizer = _run_optimizer(trainer, model, saved_optimizer, names, notes)
            _prefer_impl(optimizer, cuda)
            n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            # The Trainer fetches every micro-batch of the step before the first runs (`get_batch_samples`): two are
            # built, the others are alive all step long, a constant added to every figure below (built, 100,000
            # accumulation steps took minutes). With more than one, a micro-batch after the first holds, at every
            # moment, what the first holds and the gradients the first left (they accumulate in place), so one such
            # micro-batch is traced, the gradients there before it starts: the step's peak at half the tracing
            # (tests/test_trainer_speed.py traces every micro-batch and finds the same figures).
            built = min(grad_accum, _BUILT_BATCHES)
            # warm-up: the optimizer state exists after the first step, as in every step after it; its gradients,
            # zeroed, are those a later micro-batch starts with
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            optimizer.step()
            model.zero_grad(set_to_none=built <= _TRACED_MICRO_BATCHES)
            inputs = [_synthetic_batch(trainer, micro, seq_len) for _ in range(built)]
            traced = inputs[-_TRACED_MICRO_BATCHES:]
            unbuilt = (grad_accum - len(inputs)) * tensors_bytes(inputs[-1].values(), cuda_rounding=cuda)
            tokens = micro * grad_accum * seq_len
            units = None
            if period is not None:
                from colab_memopt.planning.stack import units_of

                units = units_of(model, period)
            tracker = TensorTracker(device=torch.device("cpu"), cuda_rounding=cuda, units=units, in_op_buffers=cuda, module_stats=False)
            tracker.track_external(model, optimizer, *[t for b in inputs for t in b.values() if isinstance(t, torch.Tensor)])
            with tracker, forward_autocast(model, half), as_on_cuda(cuda, half, model) as paths, first_rounds_traced(), \
                    _trl_tiles_first_rounds():
                for batch_inputs in traced:
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
    if notes is not None:
        notes += [n for n in cuda_path_note(paths, model) if n not in notes]
    phase_categories = {p: dict(c) for p, c in tracker.phase_peak_categories.items()}
    by_category = dict(tracker.peak_categories)
    if unbuilt:  # the micro-batches not built, as the tracker counts tensors made before the step ("other")
        for cats in (by_category, *phase_categories.values()):
            cats["other"] = cats.get("other", 0) + unbuilt
    trace = _Trace(
        tracker.peak_bytes + unbuilt,
        by_category,
        {p: tracker.phase_peaks[p] + unbuilt if tracker.phase_peaks.get(p) else 0 for p in PHASES},
        phase_categories,
        tracker.category_peaks["activations"],
        timeline=_with_unbuilt(tracker.timeline, unbuilt),
    )
    return trace, n_trainable


def _with_unbuilt(timeline: list[Any] | None, unbuilt: int) -> list[Any] | None:
    """Return the timeline with the micro-batches not built counted in every line ("other"), as in the trace."""
    if timeline is None or not unbuilt:
        return timeline
    from colab_memopt.core.tracker import CATEGORIES

    other = CATEGORIES.index("other")
    return [(ph, unit, func, (*cats[:other], cats[other] + unbuilt, *cats[other + 1:])) for ph, unit, func, cats in timeline]


# Micro-batches built per step: the first, and the second, which runs with the gradients already there; the later
# ones repeat the second's peak (tests/test_trainer_speed.py builds every one and finds the same figures). Of those,
# the last `_TRACED_MICRO_BATCHES` are traced: the second alone, its gradients made before it starts.
_BUILT_BATCHES = 2
_TRACED_MICRO_BATCHES = 1


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
    """Return the fake-tensor mode a Trainer's step is traced in (real inputs become fake).

    No ShapeEnv: `.item()` and `bool()` inside the step are answered by `_ScalarMode`, above this mode; a
    padding-free collator, whose `nonzero` has a size only data can say, makes full rows here (`_rows_kept`); and with
    a ShapeEnv such a size could not be counted either (the tracker's byte count of a `nonzero` raised
    GuardOnDataDependentSymNode there). A ShapeEnv made every operation enter and leave its guard suppression: 10% of
    an 8B QLoRA plan's time (2.25-2.31 s without, 2.43-2.57 s with; the same bytes, and the same in every test of the
    Trainer path)."""
    return fake_tensor_mode(allow_non_fake_inputs=True)


def _prefer_impl(optimizer: Any, cuda: bool) -> None:
    """Run torch optimizers as the target runs them: with `foreach=None` torch picks foreach for CUDA
    tensors and single-tensor on the CPU; a fused optimizer (`adamw_torch_fused`) stays fused."""
    for group in getattr(optimizer, "param_groups", []):
        if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = bool(cuda)


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
                  half: torch.dtype | None = None, prepare: dict[str, Any] | None = None, blocks: int | None = None) -> Any:
    """Build the Trainer these settings would build, around a fake-tensor model (nothing allocated): the model
    in the dtype the run loads it in (`_model_dtype`; fp16 as `half` where given, as `_fake_parameters`),
    quantized as `bnb` loads it; `prepare`: the keyword arguments of the run's `prepare_model_for_kbit_training`
    call (peft's own function run on the fake model after loading, `kbitprep.apply`), None where it makes none.
    `blocks`: only the model's first that many blocks (`stack.shallow_factory`), for the stack count."""
    import dataclasses

    from datasets import Dataset
    from transformers import Trainer, default_data_collator

    from colab_memopt.techniques import architectures

    spec = architectures.resolve_model(model)
    # peft writes into the config it is given: `target_modules="all-linear"` becomes the set of the planned model's
    # module names (`model.layers.0.self_attn.q_proj`, ...). On the caller's LoraConfig that set then named only the
    # planned model's layers: a later plan of a deeper model (the stack count's second copy, fit_trainer's next
    # candidate) and the user's own SFTTrainer put adapters on those layers only.
    lora = copy.deepcopy(lora)
    if blocks is not None:
        from colab_memopt.planning.stack import shallow_factory

        spec = dataclasses.replace(spec, build=shallow_factory(spec, blocks))
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
            if prepare is not None:
                from colab_memopt.planning import kbitprep

                kbitprep.apply(net, prepare)
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


@contextlib.contextmanager
def _trl_tiles_first_rounds() -> Iterator[None]:
    """Trace TRL's fused LM head (`trl.kernels.chunked_logprob`) by the first rounds of its loops over token and
    vocabulary tiles, as `loss.first_rounds_traced` does for this package's own loops.

    Its forward and backward loop over tiles of 4,096 tokens and, inside, over vocabulary chunks; each round makes the
    same temporaries (the chunk in the compute dtype, the weight chunk's copy) and frees them before the next, writing
    into buffers made before the loops; the last rounds are smaller. So the loops' peak is their first rounds'. At
    100,000 x 64 tokens the whole loops were 1,540 tiles each way and most of a minute and a half. The module's `range`
    is replaced while the trace runs, and gives the first rounds only on this thread, under the fake mode: a real run,
    or another thread, runs every round.
    """
    try:
        from trl.kernels import chunked_logprob
    except ImportError:  # no TRL, or a TRL without the fused head: nothing to trace faster
        yield
        return
    from colab_memopt.techniques.loss import first_rounds_range

    had = "range" in vars(chunked_logprob)
    was = vars(chunked_logprob).get("range")
    chunked_logprob.range = first_rounds_range
    try:
        yield
    finally:
        if had:
            chunked_logprob.range = was
        else:
            del chunked_logprob.range


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
        try:
            return dataclasses.replace(args, **values)
        except ValueError as err:
            if NO_GPU_BF16 not in str(err):
                raise
            raise ValueError(no_gpu_message(type(args).__name__, changes)) from err


NO_GPU_BF16 = "doesn't support bf16/gpu"  # what transformers' TrainingArguments says for bf16=True without a GPU


def no_gpu_message(cls: str, changes: dict[str, Any]) -> str:
    """Return our words for transformers' refusal of bf16=True on a machine without a GPU (planning only)."""
    setting = ", ".join(f"{k}={v!r}" for k, v in changes.items() if k in ("bf16", "fp16")) or "bf16=True"
    return (f"{cls}(..., {setting}) cannot be built on this machine without a GPU: TRL / transformers refuse "
            f"bf16 there (\"Your setup doesn't support bf16/gpu\"). Planning on a machine without a GPU: add "
            f"use_cpu=True to your {cls}(...); it does not change the plan; drop it on Colab")


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


def _buildable(args: Any) -> Any:
    """Return the settings the planner's own Trainer is built with: what needs data it does not have (evaluation,
    a conversational dataset for assistant_only_loss) turned off; the training step is the same."""
    # activation_offloading: TRL builds its CUDA hooks with the Trainer (and fails without a GPU); the plan traces
    # them as CUDA runs them (`longtrace.trl_activation_offloading`)
    off = {"eval_strategy": "no", "load_best_model_at_end": False, "eval_on_start": False, "assistant_only_loss": False,
           "activation_offloading": False}
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
    notes.append(packed_rows_note(setting))
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


def _target_attention(tgt: Target, args: Any) -> Any:
    """Return the context that traces SDPA as the target runs it (`attention.traced_attention`): the CUDA target's
    kernels, whatever the process's SDPA flags; fp16 autocast, traced as bf16 autocast, picks them as fp16."""
    capability = tuple(tgt.compute_capability) if tgt.cuda and tgt.compute_capability is not None else None
    return traced_attention(capability, stand_in={torch.bfloat16: torch.float16} if args.fp16 and tgt.cuda else None)


def _upcast_trainable(model: Any) -> None:
    from colab_memopt.techniques.precision import upcast_trainable

    upcast_trainable(model)
