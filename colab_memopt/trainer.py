"""Plan a Hugging Face `Trainer` (or TRL `SFTTrainer`) run as it is, and fit it to a target.

`plan_trainer` traces the Trainer's own step on fake tensors: the model the Trainer holds (its
parameters swapped for fake ones for the duration, so nothing is allocated), the optimizer the
Trainer itself builds from `optim` (`Trainer.create_optimizer`), one batch made by the Trainer's own
data collator at `max_length`, then what the training loop runs: `Trainer.training_step` (its
`compute_loss`, TRL's fused LM head and token metrics included, and the backward) for each
micro-batch, the gradient clipping, `optimizer.step()` and `model.zero_grad()`. What peft's LoRA
dropout keeps (a dropped copy of each adapted layer's input and its mask), the fused AdamW kernel
(no foreach temporaries) and bitsandbytes' 8-bit states are in that trace because they run in it.

The settings are also read into this project's `Recipe` (`trainer_recipe`), the common language of
`plan`, `recommend` and the notebooks; what a Recipe cannot say is listed, never dropped silently.
`fit_trainer` searches the Trainer's own settings for the cheapest change that fits
(`hfconfig.py` reads configs from files and writes them back as code).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from colab_memopt.planner import (
    Cost,
    Plan,
    Target,
    _fake_safe_bitsandbytes,
    _fake_safe_module_to,
    _fake_safe_transformers,
    _host_costs,
    _Trace,
    check_headroom,
    cublas_workspace_bytes,
    get_target,
)
from colab_memopt.recipe import Recipe
from colab_memopt.tracker import PHASES, TensorTracker

# transformers' `optim` names -> this project's optimizer names (`optimizers.OPTIMIZERS`), for the Recipe.
# The trace builds what the Trainer builds, so this table is only the Recipe's vocabulary.
OPTIM_TO_RECIPE = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_torch_npu_fused": "adamw",
    "adamw_torch_xla": "adamw",
    "adamw_apex_fused": "adamw",
    "adamw_bnb_8bit": "adamw8bit",
    "adamw_8bit": "adamw8bit",
    "paged_adamw_8bit": "paged_adamw8bit",
    "paged_adamw": "adamw",
    "paged_adamw_32bit": "adamw",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "lion_8bit": "lion8bit",
    "paged_lion_8bit": "lion8bit",
    "lion_32bit": "lion",
    "paged_lion_32bit": "lion",
    "galore_adamw_8bit": "galore_adamw8bit",
    "galore_adamw": "galore_adamw",
    "apollo_adamw": "apollo",
    "lomo": "lomo",
    "adalomo": "adalomo",
}

# The optimizers the trace can build and step on fake tensors: every `OptimizerNames` value not listed
# here is refused by name (`check_optim`).
TRACEABLE_OPTIMS = (
    "adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop",
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw", "paged_adamw_32bit",
    "adamw_anyprecision", "lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "ademamix", "ademamix_8bit", "paged_ademamix_8bit",
    "paged_ademamix_32bit",
)
_BNB_OPTIMS = tuple(o for o in TRACEABLE_OPTIMS if "8bit" in o or "32bit" in o or o in ("paged_adamw", "ademamix", "rmsprop_bnb"))


def check_optim(optim: Any) -> str:
    """Return `optim` as a string if the plan can trace it; else raise ValueError naming it and what is allowed."""
    from transformers.training_args import OptimizerNames

    value = optim.value if isinstance(optim, OptimizerNames) else str(optim)
    known = [o.value for o in OptimizerNames]
    if value not in known:
        raise ValueError(f"optim={value!r} is not a transformers OptimizerNames value; known: {known}")
    if value not in TRACEABLE_OPTIMS:
        raise ValueError(f"optim={value!r} cannot be planned here (it needs a GPU-only build, a process group or an "
                         f"optimizer that steps inside backward); planned optims: {list(TRACEABLE_OPTIMS)}")
    return value


class _ScalarMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Answer `.item()` / `bool()` of a fake tensor with 1, so that the Trainer's metrics and branches on a
    value (`if num_valid > 0`, `loss.item()`) run; the bytes of a step do not depend on those values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1 if not t.is_floating_point() else 1.0)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fake_parameters(model: nn.Module, mode: Any) -> Iterator[None]:
    """Swap every parameter and buffer of `model` for a fake tensor of the same shape, dtype and
    `requires_grad` (tied weights stay tied), for the duration; the real ones come back afterwards."""
    saved: list[tuple[Any, str, str, Any]] = []
    swapped: dict[int, Any] = {}
    try:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in swapped:
                        fake = mode.from_tensor(t.detach(), static_shapes=True)
                        swapped[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
                    saved.append((table, name, kind, t))
                    table[name] = swapped[id(t)]
        yield
    finally:
        for table, name, _kind, t in reversed(saved):
            table[name] = t


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


def _synthetic_batch(trainer: Any, batch: int, seq_len: int) -> dict[str, Any]:
    """Return one batch the Trainer's own collator makes from `batch` examples of `seq_len` tokens
    (every position a trained token: the most the run can hold)."""
    examples = []
    columns = set(getattr(trainer.train_dataset, "column_names", None) or ["input_ids"])
    for _ in range(batch):
        ex: dict[str, Any] = {"input_ids": [1] * seq_len}
        for name in ("completion_mask", "assistant_masks"):
            if name in columns:
                ex[name] = [1] * seq_len
        if "labels" in columns:
            ex["labels"] = [1] * seq_len
        examples.append(ex)
    out = trainer.data_collator(examples)
    return dict(out)


def _trace_step(trainer: Any, args: Any, batch: int, seq_len: int, *, cuda: bool) -> tuple[_Trace, int]:
    """Trace the Trainer's step on fake tensors; return (the trace, the number of trainable parameters)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    grad_accum = int(args.gradient_accumulation_steps)
    micro = int(args.per_device_train_batch_size)
    model = trainer.model
    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True), allow_non_fake_inputs=True)
    recipe = Recipe(optimizer=OPTIM_TO_RECIPE.get(str(getattr(args.optim, "value", args.optim)), "adamw"))
    saved = {k: copy.deepcopy(getattr(trainer, k)) for k in ("_metrics", "_total_train_tokens") if hasattr(trainer, k)}
    saved_optimizer, saved_training = trainer.optimizer, model.training
    gc_was = bool(getattr(model, "is_gradient_checkpointing", False))
    # The run's autocast: accelerate autocasts fp16 and bf16 on CUDA, only bf16 on the CPU (an fp16 run there is fp32);
    # CUDA's fp16 autocast is traced as CPU bf16 autocast (the same 2-byte activations).
    autocasts = bool(args.bf16 or (args.fp16 and cuda))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocasts else contextlib.nullcontext
    try:
        if args.gradient_checkpointing and not gc_was:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        elif not args.gradient_checkpointing and gc_was:
            model.gradient_checkpointing_disable()
        with _fake_parameters(model, mode), mode, _ScalarMode(), _fake_safe_module_to(), \
                _fake_safe_bitsandbytes(mode, recipe, cuda=cuda), _fake_safe_transformers():
            trainer.optimizer = None
            optimizer = trainer.create_optimizer(model)
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
        if args.gradient_checkpointing and not gc_was:
            model.gradient_checkpointing_disable()
        elif not args.gradient_checkpointing and gc_was:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    trace = _Trace(
        tracker.peak_bytes,
        dict(tracker.peak_categories),
        {p: tracker.phase_peaks.get(p, 0) for p in PHASES},
        {p: dict(c) for p, c in tracker.phase_peak_categories.items()},
        tracker.category_peaks["activations"],
    )
    return trace, n_trainable


def _prefer_impl(optimizer: Any, cuda: bool) -> None:
    """Run torch optimizers as the target runs them: with `foreach=None` torch picks foreach for CUDA
    tensors and single-tensor on the CPU; a fused optimizer (`adamw_torch_fused`) stays fused."""
    for group in getattr(optimizer, "param_groups", []):
        if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = bool(cuda)


# -- the Recipe a Trainer's settings amount to ---------------------------------------------------------
def trainer_recipe(args: Any, lora: Any = None, bnb: Any = None) -> tuple[Recipe, list[str]]:
    """Return (the `Recipe` closest to these Trainer / peft / bitsandbytes settings, what it cannot say).

    The second item names every setting the Recipe has no field for (the trace of `plan_trainer`
    still runs it): nothing is dropped silently.
    """
    from colab_memopt.optimizers import OPTIMIZERS

    notes: list[str] = []
    optim = str(getattr(args.optim, "value", args.optim))
    fields: dict[str, Any] = {"lr": float(args.learning_rate), "accumulation_steps": int(args.gradient_accumulation_steps)}
    name = OPTIM_TO_RECIPE.get(optim)
    if name in OPTIMIZERS:
        fields["optimizer"] = name
        if optim == "adamw_torch_fused":
            notes.append("optim='adamw_torch_fused': the Recipe's 'adamw' with the fused kernel (no foreach temporaries)")
        if optim.startswith("paged_"):
            notes.append(f"optim={optim!r}: paged state (bitsandbytes pages it to host RAM under pressure on CUDA)")
    else:
        notes.append(f"optim={optim!r} has no Recipe optimizer (traced as the Trainer builds it)")
    if args.fp16:
        fields["precision"] = "fp16-autocast"
    elif args.bf16:
        fields["precision"] = "bf16-autocast"
    if args.gradient_checkpointing:
        fields["checkpointing"] = "full"
        kwargs = args.gradient_checkpointing_kwargs or {}
        if kwargs.get("use_reentrant", True) is not False:
            notes.append("gradient_checkpointing with use_reentrant=True (transformers' default): PyTorch recommends "
                         "use_reentrant=False; the trace runs what you set")
        other = sorted(set(kwargs) - {"use_reentrant"})
        if other:
            notes.append(f"gradient_checkpointing_kwargs {other}: no Recipe field (traced as set)")
    if getattr(args, "torch_compile", False):
        notes.append("torch_compile=True: not traced (the plan is of the eager step; compiled kernels can hold less)")
    if getattr(args, "use_liger_kernel", False):
        notes.append("use_liger_kernel=True: Liger's layer kernels are not traced (the plan is of transformers' layers)")
    if getattr(args, "label_smoothing_factor", 0):
        notes.append(f"label_smoothing_factor={args.label_smoothing_factor}: the full logits are built (traced)")
    if getattr(args, "packing", False):
        notes.append("packing=True: every row is planned full at max_length")
    if lora is not None:
        fields["lora_rank"] = int(lora.r)
        targets = lora.target_modules
        if isinstance(targets, str):
            notes.append(f"lora target_modules={targets!r} (a regex or 'all-linear'): the Recipe keeps its default targets")
        elif targets:
            fields["lora_targets"] = tuple(sorted(targets))
        if lora.lora_dropout:
            notes.append(f"lora_dropout={lora.lora_dropout}: each adapted layer keeps a dropped copy of its input and the "
                         "mask (traced; no Recipe field)")
        if lora.bias != "none":
            notes.append(f"lora bias={lora.bias!r}: trains biases too (traced; no Recipe field)")
        if lora.modules_to_save:
            notes.append(f"lora modules_to_save={list(lora.modules_to_save)}: full trainable copies (traced; no Recipe field)")
    if bnb is not None:
        if getattr(bnb, "load_in_4bit", False):
            fields["quantization"] = str(bnb.bnb_4bit_quant_type)
            if bnb.bnb_4bit_use_double_quant:
                notes.append("bnb_4bit_use_double_quant=True: the absmax scales quantized again (no Recipe field)")
            notes.append(f"bnb_4bit_compute_dtype={bnb.bnb_4bit_compute_dtype}: no Recipe field")
        elif getattr(bnb, "load_in_8bit", False):
            fields["quantization"] = "bnb_int8"
        if getattr(bnb, "llm_int8_skip_modules", None):
            notes.append(f"llm_int8_skip_modules={list(bnb.llm_int8_skip_modules)}: kept in 16 bits (no Recipe field)")
    try:
        return Recipe.from_dict(fields), notes
    except ValueError as err:
        notes.append(f"the Recipe refuses these settings together ({err}); it keeps the precision and batch only")
        keep = {k: v for k, v in fields.items() if k in ("lr", "accumulation_steps", "precision", "checkpointing")}
        return Recipe.from_dict(keep), notes


# -- planning ------------------------------------------------------------------------------------------
CPU_TARGET_NAME = "cpu"


def _target(target: Any) -> Target:
    """Return the target: a planner target, or 'cpu' (this machine's RAM, no CUDA costs, as a CPU run holds)."""
    if target == CPU_TARGET_NAME:
        from colab_memopt.measure import host_memory

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


def _model_dtype(args: Any, spec: Any) -> torch.dtype:
    """Return the dtype the run loads the weights in: SFTConfig's model_init_kwargs dtype, else the checkpoint's
    config dtype for 'auto', else fp32 (transformers' default for a model built from a config)."""
    kwargs = getattr(args, "model_init_kwargs", None) or {}
    value = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if value == "auto":
        value = getattr(spec.config, "dtype", None) if spec.config is not None else None
    if value is None:
        return torch.float32
    if isinstance(value, str):
        value = getattr(torch, value, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"model_init_kwargs dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {kwargs!r}")
    return value


def _fake_trainer(args: Any, model: Any, lora: Any, bnb: Any, seq_len: int, mode: Any) -> Any:
    """Build the Trainer these settings would build, around a fake-tensor model (nothing allocated)."""
    from datasets import Dataset
    from transformers import Trainer, default_data_collator

    from colab_memopt import architectures

    spec = architectures.resolve_model(model)
    dtype = _model_dtype(args, spec)
    sft = type(args).__name__ == "SFTConfig"
    rows = {"input_ids": [[1] * seq_len]}
    if not sft:
        rows.update(attention_mask=[[1] * seq_len], labels=[[1] * seq_len])
    data = Dataset.from_dict(rows)
    with mode, _fake_safe_module_to(), _quiet_datasets():
        net = spec.build().to(dtype)
        if bnb is not None and (getattr(bnb, "load_in_4bit", False) or getattr(bnb, "load_in_8bit", False)):
            raise ValueError("plan_trainer with a BitsAndBytesConfig needs the Trainer built on the quantized model "
                             "(pass the trainer); from settings alone use cm.plan with recipe quantization='nf4'")
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
    **changes: Any,
) -> Plan:
    """Predict the peak memory of one optimizer step of a Hugging Face Trainer run on a target, without a GPU.

    Args:
        trainer: a `transformers.Trainer` or TRL `SFTTrainer` (planned on the model it holds), or
            `TrainingArguments` / `SFTConfig` with `model=`.
        model: with TrainingArguments: a model id, a local folder or config.json, a `PretrainedConfig`
            or one of `architectures.model_names()` (random weights under fake tensors).
        lora: with TrainingArguments: a peft `LoraConfig` (a Trainer already holds its peft model).
        bnb: a `BitsAndBytesConfig`; read into the Recipe (a Trainer already holds the quantized model).
        target: 't4', 'l4', 'a100-40gb', 'a100-80gb', 'h100-80gb', 'cpu' (this machine), a `Target` or a dict.
        seq_len: tokens per sequence (default: SFTConfig's max_length).
        headroom: fraction of device memory kept free.
        find_max_batch: also find the largest per_device_train_batch_size that fits (two more traces).
        **changes: TrainingArguments fields to change for this plan (what `fit_trainer` tries), e.g.
            `per_device_train_batch_size=2`.

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
    optim = check_optim(args.optim)
    if real_trainer is None and model is None:
        raise ValueError("plan_trainer(TrainingArguments) needs model= (a model id, folder, config or name)")
    if real_trainer is not None and (model is not None or lora is not None):
        raise ValueError("a Trainer already holds its model and peft adapters: leave model= and lora= out")
    if real_trainer is not None and lora is None:
        lora = _peft_config(real_trainer.model)
    if real_trainer is not None and bnb is None:
        bnb = getattr(getattr(real_trainer.model, "config", None), "quantization_config", None)
        bnb = None if isinstance(bnb, dict) else bnb
    seq = int(seq_len) if seq_len is not None else seq_len_of(args)
    if seq < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq}")
    recipe, notes = trainer_recipe(args, lora, bnb)
    warn = [f"not in the Recipe: {n}" for n in notes]
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
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    holder = real_trainer
    if holder is None:
        holder = _fake_trainer(args, model, lora, bnb, seq, FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True),
                                                                       allow_non_fake_inputs=True))
    micro = int(args.per_device_train_batch_size)
    with _args_of(holder, args):
        trace, _n = _trace_step(holder, args, micro, seq, cuda=tgt.cuda)
    name = _model_name(holder.model, model)
    batch = micro * int(args.gradient_accumulation_steps)
    device_costs: list[Cost] = []
    if tgt.cuda:
        workspace, source = cublas_workspace_bytes(tgt.compute_capability)
        device_costs = [
            Cost("CUDA context", tgt.cuda_context_bytes, "assumed (0.5-2 GB seen on Colab; measure with NVML on your card)"),
            Cost("cuBLAS workspace", workspace, source, in_allocator=True),
        ]
    result = Plan(
        model=name, batch=batch, seq_len=seq, recipe=recipe.to_dict(), target=tgt, method="trace",
        peak_bytes=trace.peak_bytes, by_category=trace.by_category, by_phase=trace.by_phase,
        by_phase_category=trace.phase_categories, device_costs=device_costs, host_costs=_host_costs(recipe, batch, seq),
        headroom_fraction=headroom, analytic_peak_bytes=0, warnings=warn,
        optimizer_impl=f"the Trainer's optim={optim!r}" + (" (torch's CUDA choice)" if tgt.cuda else ""),
    )
    if find_max_batch:
        result.max_batch = _max_micro_batch(holder, args, seq, tgt, result, trace)
    result.seconds = time.perf_counter() - start
    return result


def _changed_args(args: Any, changes: dict[str, Any]) -> Any:
    """Return a copy of TrainingArguments with `changes`, refusing names it does not have."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(args)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"unknown {type(args).__name__} field(s) {unknown}")
    new = copy.copy(args)
    for key, value in changes.items():
        setattr(new, key, value)
    return new


@contextlib.contextmanager
def _args_of(trainer: Any, args: Any) -> Iterator[None]:
    saved = trainer.args
    trainer.args = args
    try:
        yield
    finally:
        trainer.args = saved


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


def _max_micro_batch(trainer: Any, args: Any, seq_len: int, tgt: Target, plan: Plan, trace: _Trace) -> int:
    """Return the largest per_device_train_batch_size that fits: linear in the batch from two traces, then confirmed."""
    budget = plan.device_limit_bytes - sum(c.bytes for c in plan.device_costs)
    micro = int(args.per_device_train_batch_size)

    def peak(b: int) -> int:
        with _args_of(trainer, _changed_args(args, {"per_device_train_batch_size": b})):
            return _trace_step(trainer, _changed_args(args, {"per_device_train_batch_size": b}), b, seq_len, cuda=tgt.cuda)[0].peak_bytes

    other = micro + 1
    p1, p2 = trace.peak_bytes, peak(other)
    per_sample = max(p2 - p1, 1)
    guess = max(0, micro + (budget - p1) // per_sample)
    while guess > 0 and peak(guess) > budget:
        guess -= 1
    return int(guess)


# -- fitting -------------------------------------------------------------------------------------------
_EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit", "adafactor")
_FULL_ADAM = ("adamw_torch", "adamw_torch_fused", "adamw_apex_fused", "adamw_anyprecision", "paged_adamw",
              "paged_adamw_32bit")


@dataclass
class TrainerFit:
    """What to change in a Trainer's settings so the run fits a target, with the plans before and after."""

    changes: dict[str, Any]  # TrainingArguments / SFTConfig fields to set
    before: Plan
    after: Plan | None  # None: nothing tried fits
    slowdown: float  # expected step time after / before, from the target's technique-cost table
    tried: list[tuple[dict[str, Any], int, float]] = field(default_factory=list)  # (changes, peak bytes, slowdown)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.after is not None and self.after.fits

    def snippet(self, name: str = "SFTConfig") -> str:
        """Return the lines to paste into your `SFTConfig(...)` / `TrainingArguments(...)` call."""
        if not self.changes:
            return f"# {name}(...) fits as it is: nothing to change"
        lines = [f"# in your {name}(...) / TrainingArguments(...) call, set:"]
        lines += [f"    {k}={v!r}," for k, v in self.changes.items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        from colab_memopt.measure import format_bytes

        before = self.before
        head = (f"before: needs {format_bytes(before.device_need_bytes)} of {format_bytes(before.device_limit_bytes)} "
                f"usable on {before.target.name}: {'fits' if before.fits else 'does not fit'}")
        if self.after is None:
            return head + f"\nno change tried fits ({len(self.tried)} tried)"
        return "\n".join([head, f"after:  needs {format_bytes(self.after.device_need_bytes)}: "
                          f"{'fits' if self.after.fits else 'does not fit'}; expected step time x{self.slowdown:.2f}",
                          self.snippet(), *[f"note: {n}" for n in self.notes]])


def _slowdown(args: Any, tgt: Target, lora: Any, bnb: Any) -> float:
    """Return the expected step time of these settings against plain fp32 training on the target (costs.py)."""
    from colab_memopt import costs

    recipe, _ = trainer_recipe(args, lora, bnb)
    accumulation = recipe.accumulation_steps
    if accumulation > 4:  # the table has 2 and 4: a longer accumulation counts as 4 (a lower bound on its cost)
        recipe = recipe.with_(accumulation_steps=4)
    elif accumulation == 3:
        recipe = recipe.with_(accumulation_steps=2)
    return costs.expected_slowdown(recipe, costs.costs_for_target(tgt)).ratio


def _candidates(args: Any, tgt: Target) -> list[dict[str, Any]]:
    """Return the change sets to try: precision, checkpointing, a lean optimizer and a smaller per-device batch
    with more accumulation (the effective batch kept), each alone and together."""
    import itertools

    precision: list[dict[str, Any]] = [{}]
    if tgt.cuda and tgt.compute_capability is not None and tuple(tgt.compute_capability) < (8, 0):
        if args.bf16:  # no native bf16 on a T4: fp16 is a must, not an option
            precision = [{"bf16": False, "fp16": True}]
        elif not args.fp16:
            precision = [{}, {"fp16": True}]
    elif tgt.cuda and not (args.fp16 or args.bf16):
        precision = [{}, {"bf16": True}]
    checkpointing: list[dict[str, Any]] = [{}]
    if not args.gradient_checkpointing:
        checkpointing.append({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}})
    optim = str(getattr(args.optim, "value", args.optim))
    optims: list[dict[str, Any]] = [{}] + ([{"optim": o} for o in _EIGHT_BIT] if optim in _FULL_ADAM else [])
    micro, accum = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    effective = micro * accum
    batches: list[dict[str, Any]] = [{}] + [
        {"per_device_train_batch_size": b, "gradient_accumulation_steps": effective // b}
        for b in range(micro - 1, 0, -1) if effective % b == 0]
    return [{**p, **c, **o, **b} for p, c, o, b in itertools.product(precision, checkpointing, optims, batches)]


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
) -> TrainerFit:
    """Return the cheapest change to a Trainer's own settings that makes the run fit the target.

    Tries the precision the target runs natively (fp16 on a T4), gradient checkpointing
    (use_reentrant=False), an 8-bit or factored optimizer, and a smaller `per_device_train_batch_size`
    with `gradient_accumulation_steps` raised so the effective batch stays the same; alone and
    together, cheapest expected step time first (`costs.py`'s table for the target's device class),
    fewer changes first among equals, planning each with `plan_trainer` until one fits (at most
    `max_plans` plans). Arguments as `plan_trainer`.

    Example:
        >>> fit = cm.fit_trainer(trainer, target="t4")
        >>> print(fit.snippet()); fit.after.fits
    """
    tgt = _target(target)
    kwargs = dict(model=model, lora=lora, bnb=bnb, target=tgt, seq_len=seq_len, headroom=headroom)
    before = plan_trainer(trainer, **kwargs)
    _, args = _unwrap(trainer)
    if real_lora := (lora if lora is not None else _peft_config(getattr(trainer, "model", None))):
        lora = real_lora
    base_cost = _slowdown(args, tgt, lora, bnb)
    if before.fits and not (args.bf16 and tgt.cuda and tgt.compute_capability and tuple(tgt.compute_capability) < (8, 0)):
        return TrainerFit({}, before, before, 1.0)
    ranked = sorted(((c, _slowdown(_changed_args(args, c), tgt, lora, bnb) / base_cost) for c in _candidates(args, tgt) if c),
                    key=lambda cs: (round(cs[1], 3), len(cs[0])))
    tried: list[tuple[dict[str, Any], int, float]] = []
    for changes, cost in ranked[:max_plans]:
        after = plan_trainer(trainer, **kwargs, **changes)
        tried.append((changes, after.device_need_bytes, cost))
        if after.fits:
            notes = [] if "gradient_accumulation_steps" not in changes else [
                f"effective batch kept: {changes['per_device_train_batch_size']} x {changes['gradient_accumulation_steps']} "
                f"= {before.batch}"]
            return TrainerFit(changes, before, after, cost, tried, notes)
    notes = ["none of these settings fits: shorten max_length, use LoRA / QLoRA (BitsAndBytesConfig(load_in_4bit=True)) "
             "or a smaller model"]
    return TrainerFit({}, before, None, 1.0, tried, notes)


# -- guarding a run --------------------------------------------------------------------------------------
class MemoryGuardError(RuntimeError):
    """Raised by `MemoryGuardCallback` before the first step of a run that will not fit its target."""


def _running_trainer() -> Any:
    """Return the Trainer whose `train()` is calling us (callbacks are not handed the Trainer itself)."""
    import inspect

    from transformers import Trainer

    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    raise RuntimeError("MemoryGuardCallback found no Trainer calling it: add it to a Trainer (callbacks=[...])")


def MemoryGuardCallback(target: str | Target | dict[str, Any] = "t4", *, headroom: float = 0.05,
                        seq_len: int | None = None, max_plans: int = 8, verbose: bool = True) -> Any:  # noqa: N802 - a class to its users
    """Return a transformers `TrainerCallback` that plans the run before its first step and measures it.

    At `on_train_begin` it plans the Trainer's own step on the real model (`plan_trainer`) for `target`;
    if the run will not fit, it raises `MemoryGuardError` before the first step, with the changes
    `fit_trainer` finds (at most `max_plans` plans). During training it records the peak of every step (the CUDA allocator on a
    GPU, the tensor tracker on the CPU: `measure.LiveMemory`) and keeps the highest per logging step
    (`.peaks`: (global step, bytes)); at the end it prints the plan beside the measured peak
    (`.report`). On the CPU the measured peak is compared with a plan of this CPU run (what runs here),
    on a GPU with the target's plan as the allocator sees it.

    Example:
        >>> trainer = SFTTrainer(..., callbacks=[cm.MemoryGuardCallback(target="t4")])
        >>> trainer.train()   # stops before step 1 if it will not fit a T4
    """
    from transformers import TrainerCallback

    from colab_memopt.measure import LiveMemory, format_bytes

    class _MemoryGuardCallback(TrainerCallback):
        def __init__(self) -> None:
            self.target = _target(target)
            self.plan: Plan | None = None  # the target's plan
            self.compare_plan: Plan | None = None  # the plan of what runs here, compared with the measurement
            self.peaks: list[tuple[int, int]] = []  # (global step, peak bytes since the last log)
            self.report: dict[str, Any] = {}
            self._memory: LiveMemory | None = None
            self._since_log = 0
            self._step_start = 0.0
            self.step_seconds: list[float] = []

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            trainer = _running_trainer()
            self.plan = plan_trainer(trainer, target=self.target, headroom=headroom, seq_len=seq_len)
            if not self.plan.fits:
                fit = fit_trainer(trainer, target=self.target, headroom=headroom, seq_len=seq_len, max_plans=max_plans)
                advice = fit.snippet() if fit.fits else "\n".join(fit.notes)
                raise MemoryGuardError(
                    f"this run will not fit {self.target.name}: it needs {format_bytes(self.plan.device_need_bytes)} of "
                    f"{format_bytes(self.plan.device_limit_bytes)} usable (colab_memopt.plan_trainer). "
                    f"Stopped before the first step. fit_trainer's changes:\n{advice}")
            device = args.device
            on_gpu = getattr(device, "type", str(device)) == "cuda"
            self.compare_plan = self.plan if on_gpu else plan_trainer(trainer, target=CPU_TARGET_NAME, seq_len=seq_len)
            self._memory = LiveMemory(model, trainer.optimizer, device=device)
            self._memory.__enter__()
            if verbose:
                print(f"MemoryGuard: plan on {self.target.name}: {format_bytes(self.plan.device_need_bytes)} of "
                      f"{format_bytes(self.plan.device_limit_bytes)} usable: fits")

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if self._memory is not None:
                self._memory.reset_peak()
            self._step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if self._memory is not None:
                self._since_log = max(self._since_log, self._memory.peak_bytes)
            self.step_seconds.append(time.perf_counter() - self._step_start)

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if self._since_log:
                self.peaks.append((state.global_step, self._since_log))
                self._since_log = 0

        def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if self._memory is None:
                return
            self._memory.__exit__(None, None, None)
            if self._since_log:
                self.peaks.append((state.global_step, self._since_log))
            measured = max((p for _, p in self.peaks), default=0)
            planned = (self.compare_plan.allocator_peak_bytes if self.compare_plan.target.cuda
                       else self.compare_plan.peak_bytes)
            self.report = {"target": self.target.name, "target_need_bytes": self.plan.device_need_bytes,
                           "target_limit_bytes": self.plan.device_limit_bytes, "planned_bytes": planned,
                           "measured_bytes": measured, "planned_on": self.compare_plan.target.name,
                           "error_pct": 100 * (planned - measured) / measured if measured else None}
            if verbose and measured:
                print(f"MemoryGuard: measured step peak {format_bytes(measured)}, planned {format_bytes(planned)} "
                      f"({self.report['error_pct']:+.2f}%, plan of this {self.compare_plan.target.name} run)")

        def memory_report(self, label: str = "Trainer run") -> Any:
            """Return the run's highest step peak as a `measure.MemoryReport` (no breakdown: the guard samples
            the live bytes, not their categories)."""
            import statistics

            from colab_memopt.measure import MemoryReport

            if not self.peaks:
                raise ValueError("no step measured yet: train with this callback first")
            device = self._memory.device if self._memory is not None else torch.device("cpu")
            return MemoryReport(
                peak_bytes=max(p for _, p in self.peaks), by_category={}, category_peaks={}, resident_bytes={},
                by_phase={}, by_module={}, step_seconds=statistics.median(self.step_seconds), device=str(device),
                method="MemoryGuardCallback: measure.LiveMemory over each Trainer step", label=label)

    return _MemoryGuardCallback()


def save_example_chat_model(family: str, folder: str | Any) -> str:
    """Save a small random causal LM of a transformers family with a character tokenizer and a chat template
    to `folder`, for CI and tests, which have no hub access; return the folder. Its generations are noise."""
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from colab_memopt import architectures, loading

    folder = Path(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{chr(i): i for i in range(32, 127)}, "\n": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    loading.save_random_model(architectures.small_config(family, vocab_size=128, eos_token_id=1, bos_token_id=1), folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


# -- a Recipe as Trainer settings ------------------------------------------------------------------------
_RECIPE_TO_OPTIM = {"adamw": "adamw_torch", "adamw8bit": "adamw_8bit", "paged_adamw8bit": "paged_adamw_8bit",
                    "adafactor": "adafactor", "sgd": "sgd", "lion8bit": "lion_8bit", "lion": "lion_32bit",
                    "galore_adamw8bit": "galore_adamw_8bit", "galore_adamw": "galore_adamw", "apollo": "apollo_adamw",
                    "lomo": "lomo", "adalomo": "adalomo"}


def recipe_settings(recipe: Recipe | dict[str, Any], batch: int, seq_len: int) -> dict[str, Any]:
    """Return a `Recipe` (at an effective `batch` of `seq_len` tokens) as Hugging Face settings.

    {'training_args': SFTConfig / TrainingArguments fields, 'lora': LoraConfig fields or None,
    'bnb': BitsAndBytesConfig fields or None, 'not_expressible': the recipe fields they cannot say}.
    """
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(dict(recipe))
    missing: list[str] = []
    accumulation = rec.accumulation_steps
    args: dict[str, Any] = {"per_device_train_batch_size": max(1, batch // accumulation),
                            "gradient_accumulation_steps": accumulation, "max_length": seq_len, "learning_rate": rec.lr}
    if rec.optimizer in _RECIPE_TO_OPTIM:
        args["optim"] = _RECIPE_TO_OPTIM[rec.optimizer]
    else:
        missing.append(f"optimizer={rec.optimizer!r} (no Trainer optim; pass it with optimizers=(opt, None))")
    if rec.precision == "fp16-autocast":
        args["fp16"] = True
    elif rec.precision == "bf16-autocast":
        args["bf16"] = True
    elif rec.precision in ("bf16", "fp16"):
        args["model_init_kwargs"] = {"dtype": "bfloat16" if rec.precision == "bf16" else "float16"}
        missing.append(f"precision={rec.precision!r}: the Trainer trains the weights in that dtype with no update rounding")
    if rec.base_dtype is not None:
        args["model_init_kwargs"] = {"dtype": "float16" if rec.base_dtype == "fp16" else "bfloat16"}
    if rec.checkpointing == "full":
        args.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    elif rec.checkpointing != "none":
        missing.append(f"checkpointing={rec.checkpointing!r} (the Trainer checkpoints every layer or none)")
    lora = None
    if rec.lora_rank:
        lora = {"r": rec.lora_rank, "lora_alpha": 2 * rec.lora_rank, "lora_dropout": 0.0,
                "target_modules": list(rec.lora_targets), "task_type": "CAUSAL_LM"}
    bnb = None
    if rec.quantization in ("nf4", "fp4") and rec.quantization_phase == "all":
        bnb = {"load_in_4bit": True, "bnb_4bit_quant_type": rec.quantization,
               "bnb_4bit_compute_dtype": "bfloat16" if rec.precision == "bf16-autocast" else "float16"}
    elif rec.quantization == "bnb_int8" and rec.quantization_phase == "all":
        bnb = {"load_in_8bit": True}
    elif rec.quantization is not None:
        missing.append(f"quantization={rec.quantization!r} ({rec.quantization_phase})")
    if rec.loss_chunk_tokens is not None:
        missing.append(f"loss_chunk_tokens={rec.loss_chunk_tokens} (TRL's SFTTrainer computes the loss by tiles itself)")
    defaults = Recipe()
    for name in ("activation_compression", "compression_checkpointing", "attention", "attention_window", "phase_offload",
                 "update_rounding", "layer_offload_active", "zero_stage", "offload_optimizer", "offload_param"):
        if getattr(rec, name) != getattr(defaults, name):
            missing.append(f"{name}={getattr(rec, name)!r}")
    return {"training_args": args, "lora": lora, "bnb": bnb, "not_expressible": missing}
