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
silently. Beside this module: `trainertrace.py` holds the Trainer a plan traces and its step on fake
tensors, `trainerfit.py` `fit_trainer` (the cheapest change of the Trainer's own settings that fits),
`hfconfig.py` reads the settings from files and `guard.py` holds `MemoryGuardCallback`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import torch
from torch import nn

from colab_memopt.core.progress import progress, say, shows_progress
from colab_memopt.planning import kbitprep, libdefaults
from colab_memopt.planning.faketrace import _Trace
from colab_memopt.planning.prediction import Cost, Plan
from colab_memopt.planning.stack import STACK_UNITS, NotRepeating
from colab_memopt.planning.targets import DEFAULT_HEADROOM, Target, check_headroom, get_target
from colab_memopt.planning.untraced import (
    _host_costs,
    cuda_workspace_costs,
    math_attention_warning,
)
from colab_memopt.planning.hfconfig import check_micro_batch, check_optim, trainer_recipe
from colab_memopt.core.console import quiet_unless_verbose
from colab_memopt.planning.longtrace import activation_offload_cost, offloaded_inputs, trl_activation_offloading
from colab_memopt.techniques.longcontext import LongContext, installed_long_context
from colab_memopt.core.isolation import isolated, trainer_kept
from colab_memopt.training.recipe import Recipe
from colab_memopt.planning.trainertrace import (
    _UNPLANNED,
    _accelerate_state_kept,
    _args_of,
    _buildable,
    _changed_args,
    _cpu_device_without_index,
    _dtype_value,
    _fake_parameters,
    _fake_trainer,
    _model_dtype,
    _new_mode,
    _rows_kept,
    _target_attention,
    _trace_step,
    _unwrap,
)


def seq_len_of(args: Any) -> int:
    """Return the tokens per sequence the run pads or truncates to: SFTConfig's `max_length` (or the old
    `max_seq_length`); for plain TrainingArguments there is none: pass seq_len=."""
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if value is not None:
            return int(value)
    raise ValueError("these TrainingArguments set no max_length: pass seq_len= (tokens per sequence)")


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


@shows_progress("plan_trainer", nested=False)
@quiet_unless_verbose
@isolated
def plan_trainer(
    trainer: Any,
    *,
    model: Any = None,
    lora: Any = None,
    bnb: Any = None,
    target: str | Target | dict[str, Any] = "t4",
    seq_len: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    find_max_batch: bool = False,
    dtype: Any = None,
    verbose: bool = False,
    prepare_model_for_kbit_training: bool | dict[str, Any] = False,
    long_context: Any = None,
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
        verbose: show the libraries' warnings and log notes while planning (torch's, transformers', TRL's,
            DeepSpeed's); hidden by default, as they say nothing about your run. The plan's own warnings are in
            `plan.warnings` either way.
        prepare_model_for_kbit_training: with TrainingArguments and bnb: True where you call peft's
            `prepare_model_for_kbit_training(model)` before training, or a dict of the keyword arguments you pass
            it (`{"use_gradient_checkpointing": False}`); the installed peft's function is run on the planned
            model (float32 embeddings, lm_head and norms; its checkpointing). A Trainer's model shows the call.
        long_context: with TrainingArguments: a `cm.LongContext`, planned as `cm.long_context(trainer, ...)` installs
            it into the Trainer's model (a Trainer you called it on is planned as it holds it).
        **changes: TrainingArguments fields to change for this plan (what `fit_trainer` tries), e.g.
            `per_device_train_batch_size=2`; the arguments are rebuilt through their class, so what
            `TrainingArguments` refuses is refused (fp16 with bf16), and `deepspeed` / `fsdp`, which the
            plan does not model. A what-if leaves nothing on the Trainer or its model.

    Planning on a machine without a GPU (a laptop, a CPU runtime): `SFTConfig(...)` / `TrainingArguments(...)` with
    `bf16=True` or `fp16=True` (TRL's SFTConfig sets bf16 by default) raise inside TRL / transformers before this
    function is reached ("Your setup doesn't support bf16/gpu"). Add `use_cpu=True` to the arguments there: it does
    not change the plan (the target is planned, not this machine); drop it on Colab.

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
    given = {k: v for k, v in dict(model=model, lora=lora, bnb=bnb, dtype=dtype, long_context=long_context).items()
             if v is not None}
    if real_trainer is not None and given:
        raise ValueError(f"a Trainer already holds its model, its peft adapters, their quantization and dtype: leave "
                         f"{' and '.join(f'{k}=' for k in given)} out")
    if real_trainer is None:
        _check_trainable_model(model)
    if long_context is not None:
        _check_long_context(long_context, args)
    if isinstance(lora, dict):
        from colab_memopt.planning.hfconfig import read_lora

        lora = read_lora(lora)
    if real_trainer is not None:
        lora = _peft_config(real_trainer.model)
        bnb = getattr(getattr(real_trainer.model, "config", None), "quantization_config", None)
        bnb = bnb if isinstance(bnb, dict) or type(bnb).__name__ == "BitsAndBytesConfig" else None
    bnb = _bnb_config(bnb)
    prepare = kbitprep.prepare_kwargs(prepare_model_for_kbit_training, bnb=bnb, trainer_given=real_trainer is not None)
    seq = _whole("seq_len", seq_len) if seq_len is not None else seq_len_of(args)
    config = (getattr(real_trainer.model, "config", None) if real_trainer is not None
              else getattr(_resolve(model), "config", None))
    check_micro_batch(int(args.per_device_train_batch_size), seq, getattr(config, "hidden_size", None), tgt.device_bytes,
                      seq_name="seq_len" if seq_len is not None else "max_length", target_name=tgt.name)
    recipe, notes = trainer_recipe(args, lora, bnb)  # refuses a learning_rate that is no number, by name
    given_optimizer = getattr(real_trainer, "optimizer", None)
    if isinstance(args.learning_rate, str) and given_optimizer is None:
        # TrainingArguments and SFTConfig keep '2e-4' as text; the Trainer's optimizer refuses it when training starts
        raise ValueError(f"learning_rate={args.learning_rate!r} is text: the Trainer keeps it so, and its optimizer "
                         f"refuses it when training starts; give a number: learning_rate={float(args.learning_rate):g}")
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
    autocasts = bool(args.bf16 or (args.fp16 and tgt.cuda))  # accelerate's autocast of the forward
    # the planner's own Trainer builds its accelerator from these settings: in accelerate's process-wide state,
    # which is put back as it was afterwards
    with _accelerate_state_kept(fresh=real_trainer is None), trainer_kept(real_trainer):
        holder, mode, stack = real_trainer, _new_mode(), None
        if holder is None:
            say(f"building {model if isinstance(model, str) else getattr(model, 'model_type', None) or 'the model'} on "
                "fake tensors (no weights loaded)")
            built = _buildable(args)

            def build(blocks: int | None = None, built: Any = built) -> Any:  # None: the whole model
                with _cpu_device_without_index(built):  # the Trainer moves its model to args.device while it is built
                    made = _fake_trainer(built, model, lora, bnb, seq, mode, dtype, half, prepare, blocks=blocks)
                if long_context is not None:
                    from colab_memopt.techniques.longcontext import long_context as install

                    with mode:
                        install(made.model, long_context)
                return made

            shape = _stack_shape(model, args, lora, long_context)
            if shape is not None:  # two shallow copies, traced; the rest of the stack counted
                say(f"{shape.n_blocks} blocks alike: tracing {shape.depth(STACK_UNITS[0])} and "
                    f"{shape.depth(STACK_UNITS[1])}, counting the rest")
                stack = _StackHolders(shape, build)
                holder = stack.large  # its model's per-layer facts: the largest layer, the LoRA targets
            else:
                holder = build()
            if prepare is not None:  # peft's function leaves its own checkpointing on unless told not to
                own = not args.gradient_checkpointing and _checkpointing_on(holder.model)
                if own:
                    recipe = recipe.with_(checkpointing="full")
                extra = stack.count(lambda h: kbitprep.float32_bytes(h.model)) if stack is not None else None
                warn.append(kbitprep.plan_line(holder.model, said=True, own_checkpointing=own, autocast=autocasts,
                                               extra_bytes=extra))
        elif kbitprep.prepared_signs(real_trainer.model):
            warn.append(kbitprep.plan_line(real_trainer.model, said=False, own_checkpointing=False, autocast=autocasts))

        # a user's own optimizer holds the real parameters: their names find the fake twins
        names = {id(p): n for n, p in holder.model.named_parameters()} if given_optimizer is not None else None

        def fakes() -> Any:  # a real Trainer's tensors swapped for fakes for the duration; a planner-built one's are fake
            if real_trainer is None:
                return contextlib.nullcontext()
            return _fake_parameters(real_trainer.model, mode, half=half)

        if args.fp16 and (found := _half_trainable(holder.model)):
            dtypes = ' and '.join(sorted({str(d).removeprefix('torch.') for d in found.values()}))
            count = stack.count(lambda h: len(_half_trainable(h.model))) if stack is not None else len(found)
            warn.append(f"{FP16_TRAP} {count} {dtypes} trainable tensor(s): add callbacks=[cm.MemoryGuardCallback()]")
            warn.append(f"the GradScaler cannot unscale {dtypes} trainable tensors on a GPU: they are planned in float32, "
                        "as MemoryGuardCallback casts them (planned)")
        micro = int(args.per_device_train_batch_size)
        warn += _position_limit(holder.model, seq)
        trace_notes: list[str] = []
        say(f"tracing one training step: batch {micro} x {seq:,} tokens")
        installed = installed_long_context(holder.model)
        if installed is not None:
            warn.append(installed.describe() + ": traced")
        if stack is not None:
            trace, long_costs = stack.trace(args, micro, seq, tgt, mode, trace_notes)
            emulated = None
        else:
            with _args_of(holder, args), fakes(), _rows_kept(holder, args, trace_notes), \
                    _target_attention(tgt, args) as sdpa, \
                    trl_activation_offloading(holder, args, cuda=tgt.cuda, notes=trace_notes) as emulated, \
                    offloaded_inputs(holder.model, cuda=tgt.cuda) as long_costs:
                trace, _n = _trace_step(holder, args, micro, seq, cuda=tgt.cuda, mode=mode, notes=trace_notes,
                                        param_names=names)
            trace.hidden_bytes = sdpa.hidden_bytes if sdpa is not None else 0
        warn += trace_notes
        loaded = _frozen_dtype(real_trainer.model) if real_trainer is not None else _model_dtype(
            args, _resolve(model), model, dtype)
        recipe = _with_base_dtype(recipe, loaded, warn)
        if recipe.lora_rank and isinstance(getattr(lora, "target_modules", None), str):  # a regex or 'all-linear'
            matched = _matched_lora_targets(holder.model)
            recipe = recipe.with_(lora_targets=matched or (lora.target_modules,))
        name = _model_name(holder.model, model)
        batch = micro * int(args.gradient_accumulation_steps)
        device_costs: list[Cost] = []
        if tgt.cuda:
            # both cuBLAS workspaces (forward's thread and the autograd thread) and cuBLASLt's, as `cm.plan` counts them
            device_costs = [Cost("CUDA context", tgt.cuda_context_bytes, tgt.context_source),
                            *cuda_workspace_costs(tgt.compute_capability)]
            if trace.hidden_bytes:  # the trace holds the math kernel's scores and what it frees inside its ops
                warn.append(math_attention_warning(tgt))
        if bnb is not None and tgt.cuda and getattr(bnb, "load_in_4bit", False):
            from colab_memopt.planning.quantized import trainer_four_bit_costs

            # bitsandbytes' CUDA gemm_4bit dequantizes the whole weight inside the op (forward; backward's recompute)
            recomputes = bool(args.gradient_checkpointing) or _checkpointing_on(holder.model)
            device_costs += trainer_four_bit_costs(holder.model, bnb, micro * seq, recomputes=recomputes, half=half)
        if bnb is not None:
            from colab_memopt.planning.quantized import quantization_scale_bytes

            with mode:
                scales = (stack.count(lambda h: quantization_scale_bytes(h.model, cuda_rounding=tgt.cuda))
                          if stack is not None else quantization_scale_bytes(holder.model, cuda_rounding=tgt.cuda))
            if scales:
                device_costs.append(Cost("quantization scales", scales,
                                         "bitsandbytes' absmax and row scales kept beside the quantized weights (outside the "
                                         "parameters, which the trace counts)", in_allocator=True))
        warn += padded_mask_warning(args, micro, seq, trace.peak_bytes)
        warn = list(dict.fromkeys(warn))  # each trace (two depths for a stack) says its findings once
        result = Plan(
            model=name, batch=batch, seq_len=seq, recipe=recipe.to_dict(), target=tgt, method="trace",
            peak_bytes=trace.peak_bytes, by_category=trace.by_category, by_phase=trace.by_phase,
            by_phase_category=trace.phase_categories, device_costs=device_costs,
            host_costs=_host_costs(recipe, batch, seq) + long_costs + activation_offload_cost(emulated),
            headroom_fraction=headroom, analytic_peak_bytes=0,
            warnings=[w for w in warn if not is_derivation(w)], notes=[w for w in warn if is_derivation(w)],
            next_call=("cm.fit_trainer(args, model=..., lora=..., target=...) finds the cheapest change that fits"
                       if real_trainer is None else "cm.fit_trainer(trainer, target=...) finds the cheapest change that fits"),
            optimizer_impl=(f"your {type(given_optimizer).__name__} (optimizers=)" if given_optimizer is not None
                            and not any(n.startswith("your optimizers=") for n in trace_notes)
                            else f"the Trainer's optim={optim!r}") + (" (torch's CUDA choice)" if tgt.cuda else ""),
            defaults=[*libdefaults.checkpointing_line(args, bool(args.gradient_checkpointing)),
                      *libdefaults.loss_line(args, holder.model),
                      *(libdefaults.load_dtype_line(args, model, dtype, loaded) if real_trainer is None else [])],
        )
        if stack is not None and stack.whole is None:
            result.notes.append(stack.shape.describe())
        if find_max_batch:
            with fakes(), trl_activation_offloading(holder, args, cuda=tgt.cuda, notes=[]), progress("largest batch"):
                result.max_batch = _max_micro_batch(holder, args, seq, tgt, result, trace, mode, names, stack)
    result.seconds = time.perf_counter() - start
    return result


def padded_mask_warning(args: Any, micro: int, seq: int, peak_bytes: int) -> list[str]:
    """Return the line for what padded rows add, where it matters (1% of the step's peak or more).

    The plan's rows are full, so transformers passes SDPA no mask. A micro-batch of several rows of other lengths is
    padded: transformers then builds a (batch, 1, T, T) bool mask and SDPA's memory-efficient kernel a 16-bit copy
    of it (3 bytes per entry), both alive through the attention's backward. One row, packing and padding_free never
    pad."""
    from colab_memopt.core.measure import format_bytes

    if micro < 2 or getattr(args, "packing", False) or getattr(args, "padding_free", False):
        return []
    mask = 3 * micro * seq * seq
    if mask < 0.01 * peak_bytes:
        return []
    return [f"per_device_train_batch_size={micro} with padded rows: +{format_bytes(mask)} for the attention mask "
            "(planned: full rows)"]


# What plan_trainer says only to show how a figure was derived: a setting planned as it is set, a library's code path
# traced in its place. Nothing there is for the user to change, so it goes to `plan.notes` (`explain()`), not to the
# warnings printed first, which each name a setting to change or one the plan cannot follow.
_DERIVATION_STARTS = ("fp16 autocast is traced as bf16", "TRL's fused LM head is traced", "the model loaded in ",
                      "optim='adamw_torch_fused': planned with", "attention runs SDPA's math kernel",
                      "the GradScaler cannot unscale")
_DERIVATION_ENDS = ("planned as set", "planned as set)", "planned on the modules peft picks for it")


def is_derivation(line: str) -> bool:
    """Return whether a plan_trainer finding only says how a figure was derived (for `plan.notes`, not the warnings)."""
    return line.startswith(_DERIVATION_STARTS) or line.endswith(_DERIVATION_ENDS)


def _matched_lora_targets(model: Any) -> tuple[str, ...]:
    """Return the module names (last part, as LoraConfig's target_modules lists them) peft put adapters on."""
    names = getattr(model, "targeted_module_names", None) or []
    return tuple(sorted({str(n).rsplit(".", 1)[-1] for n in names}))


def _check_long_context(value: Any, args: Any) -> None:
    """Refuse a long_context= that is not a `LongContext`, or settings that checkpoint the layers themselves."""
    if not isinstance(value, LongContext):
        raise TypeError(f"long_context must be a cm.LongContext(...), got {type(value).__name__}")
    if getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", False)):
        raise ValueError("gradient_checkpointing=True with long_context=: cm.long_context checkpoints the layers "
                         "itself, with their inputs in host RAM; set gradient_checkpointing=False")


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
    init = getattr(args, "model_init_kwargs", None)
    if given and init is not None:  # checked for any model: one given as a config or a module does not read it (TRL)
        if not isinstance(init, dict):
            raise ValueError(f"model_init_kwargs must be a dict such as {{'dtype': 'float16'}}, got {init!r}")
        for key in ("dtype", "torch_dtype"):
            if key in init:
                _dtype_value(init[key], f"model_init_kwargs[{key!r}]")


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


def _resolve(model: Any) -> Any:
    from colab_memopt.techniques import architectures

    if isinstance(model, nn.Module):  # callable, so it was taken for a function that builds the model, and called
        raise TypeError(f"model= got a {type(model).__name__} already built: give what builds it (its name, folder, "
                        "Hugging Face id or config: model.config), or plan the Trainer built on it: "
                        "cm.plan_trainer(trainer)")
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
                     param_names: dict[int, str] | None = None, stack: _StackHolders | None = None) -> int:
    """Return the largest per_device_train_batch_size that fits: linear in the batch from two traces, then confirmed."""
    budget = plan.device_limit_bytes - sum(c.bytes for c in plan.device_costs)
    micro = int(args.per_device_train_batch_size)

    def peak(b: int) -> int:
        changed = _changed_args(args, {"per_device_train_batch_size": b})
        if stack is not None:
            return stack.trace(changed, b, seq_len, tgt, mode, [])[0].peak_bytes
        # traced as the plan's own step is: a padding-free (packing) collator's row as full rows, whose sizes are
        # known (its sequence starts come from `nonzero()`, a size no fake tensor knows)
        with _args_of(trainer, changed), _rows_kept(trainer, changed, []), _target_attention(tgt, args):
            return _trace_step(trainer, changed, b, seq_len, cuda=tgt.cuda, mode=mode, param_names=param_names)[0].peak_bytes

    peaks: dict[int, int] = {micro: trace.peak_bytes}

    def known(b: int) -> int:  # each batch traced once
        if b not in peaks:
            say(f"trace at per_device_train_batch_size={b}")
            peaks[b] = peak(b)
        return peaks[b]

    other = micro + 1
    p1, p2 = peaks[micro], known(other)
    per_sample = max(p2 - p1, 1)
    guess = max(0, micro + (budget - p1) // per_sample)
    if guess == 0 or known(guess) <= budget:
        return int(guess)
    # the guess is over: bisect between the largest batch known to fit (0: none) and the guess (the need grows with
    # the batch), log2 traces where stepping down one batch at a time took one trace per batch
    lo = max((b for b, n in peaks.items() if n <= budget and b < guess), default=0)
    hi = min(b for b, n in peaks.items() if n > budget)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if known(mid) <= budget else (lo, mid)
    return int(lo)


def _stack_shape(model: Any, args: Any, lora: Any, long_context: Any) -> Any:
    """Return the `stack.StackShape` a planner-built Trainer's model is traced with (two shallow copies, the rest of
    its blocks counted), or None where the whole model is traced: few blocks, blocks that do not repeat, a model
    given as a factory, `long_context` with the last blocks kept on the device (`keep_blocks`), or TRL's activation
    offloading. `long_context`'s blocks repeat in units of its `checkpoint_interval` (one host copy per unit)."""
    if not _FAST_STACK or getattr(args, "activation_offloading", False):
        return None
    period = _checkpointed_every(args)
    if long_context is not None:
        if long_context.keep_blocks:
            return None
        period = math.lcm(period, long_context.checkpoint_interval)
    from colab_memopt.planning.faketrace import shape_model
    from colab_memopt.planning.stack import stack_shape
    from colab_memopt.techniques import architectures

    spec = architectures.resolve_model(model)
    if spec.source == "factory":
        return None
    try:
        return stack_shape(shape_model(spec.build), spec=spec, period=period)
    except NotRepeating:
        return None


def _checkpointed_every(args: Any) -> int:
    """Return the n of the settings' `every_n_layers` checkpointing (layers 0, n, 2n, ... checkpointed: the blocks
    repeat in units of n), 1 where every layer or none is checkpointed."""
    if not getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", False)):
        return 1
    kwargs = getattr(args, "activation_checkpointing_kwargs", getattr(args, "gradient_checkpointing_kwargs", None)) or {}
    every = kwargs.get("every_n_layers", 1) if isinstance(kwargs, dict) else 1
    return every if isinstance(every, int) and not isinstance(every, bool) and every >= 1 else 1


# Whether planner-built Trainers of deep models trace two shallow copies and count the rest of the stack (tests turn
# it off to compare with the whole trace).
_FAST_STACK = True


class _StackHolders:
    """Two planner-built Trainers of a model's first few blocks (`stack.STACK_UNITS` units): their steps traced and
    carried to the whole stack (`stack.extrapolate`); where the blocks turn out not to repeat, the whole model's
    Trainer is built and traced instead, saying why. `build(blocks)` builds the Trainer (None: the whole model)."""

    def __init__(self, shape: Any, build: Any) -> None:
        self.shape, self.build = shape, build
        self.small, self.large = (build(shape.depth(k)) for k in STACK_UNITS)
        self.whole: Any = None

    def trace(self, args: Any, micro: int, seq: int, tgt: Target, mode: Any,
              notes: list[str]) -> tuple[_Trace, list[Cost]]:
        """Return the whole model's step and its host lines (`cm.long_context`'s offloaded inputs, one per unit:
        carried to the whole stack like the step's bytes)."""
        from colab_memopt.planning.stack import extrapolate

        if self.whole is None:
            try:
                (small, small_host), (large, large_host) = (self._trace(h, args, micro, seq, tgt, mode, notes)
                                                            for h in (self.small, self.large))
                trace = extrapolate(small, large, self.shape)
                trace.hidden_bytes = max(small.hidden_bytes, large.hidden_bytes)
                if [c.name for c in small_host] != [c.name for c in large_host]:
                    raise NotRepeating("the host lines of the two copies differ")
                host = [dataclasses.replace(c, bytes=self.shape.extrapolate(c.bytes, d.bytes))
                        for c, d in zip(small_host, large_host)]
                return trace, host
            except NotRepeating as exc:
                say(f"the blocks do not repeat as counting needs ({exc}): tracing all {self.shape.n_blocks}")
                self.whole = self.build(None)
        return self._trace(self.whole, args, micro, seq, tgt, mode, notes, period=None)

    def _trace(self, holder: Any, args: Any, micro: int, seq: int, tgt: Target, mode: Any, notes: list[str],
               period: Any = "stack") -> tuple[_Trace, list[Cost]]:
        with _args_of(holder, args), _rows_kept(holder, args, notes), _target_attention(tgt, args) as sdpa, \
                offloaded_inputs(holder.model, cuda=tgt.cuda) as host:
            trace = _trace_step(holder, args, micro, seq, cuda=tgt.cuda, mode=mode, notes=notes,
                                period=self.shape.period if period == "stack" else None)[0]
        trace.hidden_bytes = sdpa.hidden_bytes if sdpa is not None else 0
        return trace, host

    def count(self, fn: Any) -> int:
        """Return `fn(holder)` for the whole model: affine in the depth, from the two copies."""
        return self.shape.extrapolate(fn(self.small), fn(self.large))


def _half_trainable(model: Any) -> dict[str, torch.dtype]:
    from colab_memopt.techniques.precision import half_trainable

    return half_trainable(model)


FP16_TRAP = "fp16=True with"  # how plan_trainer's warning about bf16/fp16 trainable weights begins
