"""A check before the first step: the pitfalls people hit on a T4, found before they cost a run.

`doctor(model, optimizer, recipe, target)` returns a `Checkup`: findings, each with a stable `code`,
what was found, why it matters and the fix, printed readably. The codes:

    bf16-not-native              bf16 chosen on a GPU that only emulates it (unsloth#2783)
    fp16-trainable-params        trainable fp16 weights under fp16 autocast: "Attempting to unscale
                                 FP16 gradients" (diffusers#6086)
    bf16-trainable-under-fp16    trainable bf16 weights under fp16 autocast (TRL's QLoRA cast,
                                 trl#4901): the GradScaler fails on CUDA at the first step
    checkpointing-frozen-inputs  LoRA with reentrant checkpointing whose inputs carry no gradient
                                 (peft#137, open-unlearning#178)
    adapters-not-training        after one step, an adapter without a gradient
    does-not-fit                 the plan (cm.plan's, or cm.plan_trainer's for Trainer settings) does not
                                 fit the target; the fix names the recommender or fit_trainer
    checkpoint-interval          a checkpoint_interval too large for the model's blocks: 'every_n'
                                 checkpoints none, 'offload' has no second level
    host-ram-load                host RAM (a 4-bit load: also the GPU) too small for loading the weights,
                                 from the checkpoint's files or hub headers (else assumed: a warning only);
                                 Colab kills the runtime while the model loads (int8 weights: cm.load_int8)
    qlora-small-saving           QLoRA saves little over LoRA for this model and sequence (torchtune#2255)
    deepspeed-op-build           DeepSpeed ops built on first use: minutes and GBs of RAM (DeepSpeed#885)

`model` is a built `nn.Module` (every check), a transformers `Trainer` / TRL `SFTTrainer` (its model,
optimizer and settings), or anything `architectures.resolve_model` takes (a
Hugging Face id, a folder, a config, one of our names: the checks that need no weights). `recipe` is a
`Recipe`, or your `TrainingArguments` / `SFTConfig` (with `lora=`, `bnb=`): a Trainer's run is planned by
`plan_trainer`, a Recipe's by `plan`, so the doctor's need is the figure those print for the same run.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colab_memopt.core import env

from colab_memopt.planning import estimate
from colab_memopt.techniques.architectures import resolve_model
from colab_memopt.core.isolation import isolated
from colab_memopt.core.progress import say, shows_progress
from colab_memopt.core.measure import format_bytes, host_memory
from colab_memopt.planning.planner import plan
from colab_memopt.planning.prediction import describe_estimate_error
from colab_memopt.planning.targets import DEFAULT_HEADROOM, TARGETS, Target, get_target
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.console import quiet, quiet_unless_verbose

CODES = (
    "bf16-not-native", "fp16-trainable-params", "checkpointing-frozen-inputs", "adapters-not-training",
    "bf16-trainable-under-fp16",
    "does-not-fit", "checkpoint-interval", "host-ram-load", "qlora-small-saving", "deepspeed-op-build",
)
SEVERITIES = ("error", "warning", "info")
# Compute capability of each named target's GPU (NVIDIA's CUDA GPUs table): native bf16 from (8, 0) on.
TARGET_CAPABILITY: dict[str, tuple[int, int]] = {"t4": (7, 5), "l4": (8, 9), "a100-40gb": (8, 0),
                                                 "a100-80gb": (8, 0), "h100-80gb": (9, 0)}
# QLoRA is worth its dequantization cost when it saves at least this fraction of LoRA's planned need.
QLORA_MIN_SAVING = 0.10


@dataclass
class Finding:
    """One pitfall: its stable code, what was found, why it matters, and the fix."""

    code: str
    severity: str
    found: str
    why: str
    fix: str
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        """Return the finding, then why and the fix, in lines of at most 100 characters."""
        from colab_memopt.core.wording import wrap

        return "\n".join([*wrap(f"[{self.severity}] {self.code}: {self.found}", rest="    "),
                          *wrap(f"fix: {self.fix}", first="    ", rest="      "),
                          *wrap(f"why: {self.why}", first="    ", rest="      ")])


@dataclass
class Checkup:
    """The doctor's findings for a model, recipe and target, and which checks ran."""

    model: str
    target: str
    findings: list[Finding]
    checked: list[str]
    skipped: dict[str, str]  # check -> why it did not run
    plan: Any = None  # the plan the fit check made: cm.plan's, or cm.plan_trainer's for Trainer settings

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    @property
    def ok(self) -> bool:
        """Return True when no finding is an error."""
        return not any(f.severity == "error" for f in self.findings)

    def __contains__(self, code: str) -> bool:
        return code in self.codes

    def to_dict(self) -> dict[str, Any]:
        fit = None if self.plan is None else {"device_need_bytes": self.plan.device_need_bytes,
                                              "device_limit_bytes": self.plan.device_limit_bytes}
        return {"model": self.model, "target": self.target, "ok": self.ok, "codes": self.codes,
                "findings": [asdict(f) for f in self.findings], "checked": self.checked, "skipped": self.skipped,
                "plan": fit}

    def __str__(self) -> str:
        head = f"doctor: {self.model} on {self.target}: " + (
            f"{len(self.findings)} finding(s)" if self.findings else "no pitfall found")
        from colab_memopt.core.wording import wrap

        lines = [head]
        if self.plan is not None and self.plan.fits_device:  # the figure plan / plan_trainer print for this run
            p = self.plan  # (one that does not fit is does-not-fit's finding, with the same figures)
            lines.append(f"the step fits: batch {p.batch} x {p.seq_len} tokens, need {format_bytes(p.device_need_bytes)} "
                         f"of {format_bytes(p.device_limit_bytes)} usable ({p.method})")
        lines += [str(f) for f in self.findings]
        lines += wrap(f"checked: {', '.join(self.checked)}")
        lines += [line for k, v in self.skipped.items() for line in wrap(f"not checked: {k} ({v})")]
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython prints it readably
        p.text(str(self))


def _target(target: str | Target | dict[str, Any]) -> tuple[Target, tuple[int, int] | None]:
    """Return the target to plan for and its compute capability ('auto': this GPU, else a T4)."""
    if isinstance(target, str) and target == "auto":
        if torch.cuda.is_available():
            dev = torch.device("cuda")
            props = torch.cuda.get_device_properties(dev)
            host = host_memory().total_bytes
            return Target(env.gpu_name(dev) or "cuda", props.total_memory, host, description="this GPU"), env.compute_capability(dev)
        return TARGETS["t4"], TARGET_CAPABILITY["t4"]
    tgt = get_target(target)
    return tgt, TARGET_CAPABILITY.get(tgt.name)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _adapters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in _trainable(model) if "lora_" in n]


# -- the checks; each returns a finding or None ------------------------------------------------------------


def check_bf16(recipe: Recipe | None, model: nn.Module | None, capability: tuple[int, int] | None, target: str) -> Finding | None:
    """bf16-not-native: bf16 weights or autocast on a GPU below compute capability 8.0."""
    if capability is None or capability >= (8, 0):
        return None
    where = []
    if recipe is not None and recipe.precision in ("bf16", "bf16-autocast"):
        where.append(f"recipe.precision={recipe.precision!r}")
    if recipe is not None and recipe.eval_precision == "bf16-autocast":
        where.append("recipe.eval_precision='bf16-autocast'")
    if model is not None:
        # under fp16 autocast, bf16 trainable weights are bf16-trainable-under-fp16's finding (TRL's cast), not a choice
        fp16 = recipe is not None and recipe.precision == "fp16-autocast"
        n = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16 and not (fp16 and p.requires_grad))
        if n:
            where.append(f"{n / 1e6:.1f}M parameters stored in bfloat16")
    if not where:
        return None
    return Finding(
        "bf16-not-native", "error",
        f"bf16 on {target} (compute capability {capability[0]}.{capability[1]}): {'; '.join(where)}",
        "GPUs below sm_80 (a T4 is sm_75) have no bf16 tensor cores: bf16 runs emulated, several times slower, "
        "and torch.cuda.is_bf16_supported() still says True because it counts the emulation",
        "use precision='fp16-autocast' (fp32 master weights + GradScaler): Recipe.preset(..., target='t4') "
        "picks it; load frozen weights in fp16 (load_model does on a T4)",
        {"capability": list(capability), "where": where},
    )


def check_fp16_trainable(recipe: Recipe | None, model: nn.Module) -> Finding | None:
    """fp16-trainable-params: trainable parameters stored in float16 (GradScaler refuses to unscale them)."""
    bad = [n for n, p in _trainable(model) if p.dtype == torch.float16]
    if not bad:
        return None
    under = recipe.precision if recipe is not None else "any precision"
    return Finding(
        "fp16-trainable-params", "error",
        f"{len(bad)} trainable parameter tensor(s) in float16 under {under} (e.g. {bad[0]})",
        "fp16 autocast's GradScaler unscales fp32 gradients only: the first step fails with 'Attempting to unscale FP16 "
        "gradients' (diffusers#6086); without a scaler, updates below fp16's resolution are lost",
        "keep trainable weights in fp32 and let autocast compute in fp16: load the frozen base in fp16 and cast the "
        "adapters to fp32 (`p.data = p.data.float()` for p with requires_grad; load_model does it)",
        {"parameters": bad[:20]},
    )


def check_bf16_trainable_under_fp16(recipe: Recipe | None, model: nn.Module) -> Finding | None:
    """bf16-trainable-under-fp16: trainable bf16 weights under fp16 autocast (GradScaler cannot unscale them on CUDA)."""
    if recipe is None or recipe.precision != "fp16-autocast":
        return None
    bad = [n for n, p in _trainable(model) if p.dtype == torch.bfloat16]
    if not bad:
        return None
    return Finding(
        "bf16-trainable-under-fp16", "error",
        f"{len(bad)} trainable tensor(s) in bfloat16 under fp16 autocast (fp16=True), e.g. {bad[0]}",
        "TRL's SFTTrainer casts a 4-bit or 8-bit model's LoRA weights to bfloat16 whatever fp16 says (trl#4901); "
        "fp16's GradScaler cannot unscale bfloat16 gradients on CUDA: the first step fails with "
        "'_amp_foreach_non_finite_check_and_unscale_cuda not implemented for BFloat16' (on a T4 too)",
        "cast them to float32 before trainer.train(): cm.guard.upcast_trainable(trainer.model), or add "
        "cm.MemoryGuardCallback to the trainer's callbacks (it does so before the first step)",
        {"parameters": bad[:20]},
    )


def _from_trainer(trainer: Any, optimizer: Any, recipe: Any) -> tuple[nn.Module, Any, Any]:
    """Return (model, optimizer, recipe) of a transformers Trainer: its settings read as a Recipe unless one is given."""
    from colab_memopt.planning.hfconfig import trainer_recipe
    from colab_memopt.planning.trainer import _peft_config

    model = trainer.model
    if recipe is None:
        bnb = getattr(getattr(model, "config", None), "quantization_config", None)
        recipe, _ = trainer_recipe(trainer.args, _peft_config(model), None if isinstance(bnb, dict) else bnb)
    return model, optimizer if optimizer is not None else trainer.optimizer, recipe


def _reentrant_checkpointing(model: nn.Module) -> list[str]:
    """Return the modules that checkpoint with the reentrant implementation (transformers' flag or a partial)."""
    out = []
    for name, module in model.named_modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if not getattr(module, "gradient_checkpointing", False) or func is None:
            continue
        keywords = getattr(func, "keywords", {}) or {}
        if keywords.get("use_reentrant", False):
            out.append(name)
    return out


def _inputs_carry_grad(model: nn.Module) -> bool:
    """Return whether the input embeddings' output will require grad (trainable, or forced by a hook)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None:
        return True  # cannot tell: not our pitfall's shape
    if any(p.requires_grad for p in emb.parameters()):
        return True
    return bool(getattr(emb, "_forward_hooks", None)) or hasattr(model, "_require_grads_hook")


def check_checkpointing_inputs(model: nn.Module) -> Finding | None:
    """checkpointing-frozen-inputs: adapters under reentrant checkpointing whose block inputs need no grad."""
    reentrant = _reentrant_checkpointing(model)
    if not reentrant or not _adapters(model) or _inputs_carry_grad(model):
        return None
    from colab_memopt.planning.hfconfig import checkpointing_names

    on, kwargs_name = checkpointing_names()  # the installed transformers' names
    return Finding(
        "checkpointing-frozen-inputs", "error",
        f"LoRA adapters with reentrant gradient checkpointing on {len(reentrant)} module(s), and the input embeddings "
        "are frozen with nothing making their output require grad",
        "reentrant checkpointing (use_reentrant=True) returns outputs without a gradient when none of a block's inputs "
        "requires one: the adapters inside get no gradient and do not train, often without an error (peft#137)",
        "call model.enable_input_require_grads() (or peft's prepare_model_for_kbit_training), or checkpoint with "
        f"use_reentrant=False: model.{on}_enable({kwargs_name}={{'use_reentrant': False}}); "
        "Recipe(checkpointing=...) already uses the non-reentrant one",
        {"modules": reentrant[:10]},
    )


def _probe_step(model: nn.Module, recipe: Recipe | None, seq_len: int) -> str | None:
    """Run one forward and backward on random tokens, leaving the weights and gradients as they were.

    Returns None, or the error the backward raised (e.g. a loss that needs no gradient).
    """
    from colab_memopt.techniques.precision import autocast_context

    params = list(model.parameters())
    device = params[0].device
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 256))
    generator = torch.Generator(device=device).manual_seed(0)  # not the run's RNG
    x = torch.randint(0, vocab, (1, seq_len), device=device, generator=generator)
    precision = recipe.precision if recipe is not None and recipe.precision != "bf16" else "fp32"
    was_training = model.training
    model.train()
    try:
        with autocast_context(precision, device):
            loss = model(x, labels=x).loss
        loss.float().backward()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        model.train(was_training)
    return None


def check_adapters_training(model: nn.Module, recipe: Recipe | None = None, *, seq_len: int = 16) -> Finding | None:
    """adapters-not-training: after one step (the gradients there, else one probe step), an adapter without a gradient."""
    adapters = _adapters(model)
    if not adapters:
        return None
    error = None
    probed = all(p.grad is None for _, p in adapters)
    if probed:
        error = _probe_step(model, recipe, seq_len)
    missing = [n for n, p in adapters if p.grad is None]
    if probed:
        for _, p in _trainable(model):
            p.grad = None
    if not missing and error is None:
        return None
    found = (f"{len(missing)} of {len(adapters)} adapter tensors received no gradient "
             + ("in one probe step" if probed else "in the last step"))
    if error:
        found += f"; the backward failed: {error}"
    return Finding(
        "adapters-not-training", "error", found,
        "an adapter without a gradient keeps its initial value: the fine-tune silently trains fewer layers, or none",
        "make the checkpointed blocks' inputs require grad (model.enable_input_require_grads()) or use non-reentrant "
        "checkpointing; check that the adapters sit on layers the loss depends on",
        {"missing": missing[:20], "probe": probed, "error": error},
    )


def _spec(model: Any) -> Any:
    """Return the `ModelSpec` behind a model (a transformers module's config), or None for others."""
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
            from transformers import PretrainedConfig

        if isinstance(config, PretrainedConfig):
            return resolve_model(config)
        return None
    return resolve_model(model)


def check_checkpoint_interval(recipe: Recipe, module: nn.Module | None, planned: Any) -> Finding | None:
    """checkpoint-interval: a `checkpoint_interval` too large for the model's blocks ('every_n' checkpoints none of
    them; 'offload' makes one segment of all, with no second level): the built model's blocks counted, else the
    plan's own warning of it."""
    import re

    from colab_memopt.techniques.checkpointing import INTERVAL_PITFALL_PATTERN, interval_pitfalls

    if module is not None:
        found = interval_pitfalls(module, recipe.checkpointing, recipe.checkpoint_interval)
    else:
        found = [w for w in getattr(planned, "warnings", None) or [] if re.match(INTERVAL_PITFALL_PATTERN, w)]
    if not found:
        return None
    what, _, why = found[0].partition(": ")
    why, _, fix = why.rpartition("; ")
    return Finding("checkpoint-interval", "warning", what, why, f"{fix} (the recipe's checkpoint_interval)",
                   {"policy": recipe.checkpointing, "checkpoint_interval": recipe.checkpoint_interval})


def check_fit(spec: Any, recipe: Recipe, batch: int, seq_len: int, tgt: Target, method: str,
              headroom: float = DEFAULT_HEADROOM, *, model: Any = None) -> tuple[Finding | None, Any]:
    """does-not-fit: the planner's verdict, the same plan as `cm.plan(model, batch, ...)` (`model`: what the user
    named, else `spec`); the fix names the recommender, which searches the settings that fit (not run here: each
    candidate is another trace)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(spec if model is None else model, batch, seq_len=seq_len, recipe=recipe, target=tgt,
                 find_max_batch=False, method=method, headroom=headroom)
    if p.fits_device:
        return None, p
    named = tgt.name in TARGETS
    fix = (f"cm.recommend({spec.name!r}, {batch}, seq_len={seq_len}, target="
           f"{repr(tgt.name) if named else 'your target'}) finds the settings that fit with the shortest step"
           + (f" (python -m colab_memopt recommend --model {spec.name} --batch {batch} --seq {seq_len} "
              f"--target {tgt.name})" if named else ""))
    return _does_not_fit(p, batch, seq_len, tgt, fix), p


def _does_not_fit(p: Any, batch: int, seq_len: int, tgt: Target, fix: str) -> Finding:
    return Finding(
        "does-not-fit", "error",
        f"the plan needs {format_bytes(p.device_need_bytes)} of device memory at batch {batch} x {seq_len} tokens; "
        f"{tgt.name} allows {format_bytes(p.device_limit_bytes)} ({p.method}"
        + (f"; an estimate, not traced: {describe_estimate_error(p.estimate_error)})" if p.estimate_error else ")"),
        "the first step would run out of memory",
        fix, {"need_bytes": p.device_need_bytes, "limit_bytes": p.device_limit_bytes, "estimate": p.method == "analytic"},
    )


def check_trainer_fit(run: Any, tgt: Target, seq_len: int | None, headroom: float, **given: Any
                      ) -> tuple[Finding | None, Any]:
    """does-not-fit for a Trainer-shaped run: the same plan as `cm.plan_trainer(run, **given, ...)` (`run`: a
    Trainer, or TrainingArguments / SFTConfig with `given`'s model=, lora=, bnb=, dtype=)."""
    import warnings

    from colab_memopt.planning.trainer import plan_trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan_trainer(run, target=tgt, seq_len=seq_len, headroom=headroom,
                         **{k: v for k, v in given.items() if v is not None})
    if p.fits_device:
        return None, p
    call = "cm.fit_trainer(trainer)" if not given else "cm.fit_trainer(args, model=..., lora=..., bnb=...)"
    fix = (f"{call} tries the settings that save memory (fp16, checkpointing, a smaller per-device batch with "
           "more accumulation, a 4-bit base) and returns the first that fits; fit.apply(args) writes them")
    return _does_not_fit(p, p.batch, p.seq_len, tgt, fix), p


def check_host_load(spec: Any, recipe: Recipe, tgt: Target, capability: tuple[int, int] | None,
                    headroom: float) -> Finding | None:
    """host-ram-load: loading the weights needs more host RAM (or, in 4 bits, device memory) than the target has.

    The checkpoint's layout and dtype come from its files or the hub's headers where there are any; a built-in
    name's is its published checkpoint's (dtype known, shards assumed); otherwise an assumption. A load that does
    not fit by an assumed layout is a warning naming what was assumed, never an error. A 4-bit (QLoRA) load is
    checked as transformers runs it: tensor by tensor, each quantized on the GPU as it arrives
    (`loading.quantized_load_bytes`).
    """
    from colab_memopt.training.loadplan import load_host_bytes

    native = bool(capability and capability >= (8, 0))
    process = host_memory().rss_bytes
    limit = tgt.host_usable_bytes(headroom)
    four_bit = recipe.quantization in ("nf4", "fp4") and recipe.quantization_phase == "all"
    if four_bit and recipe.weight_dtype != "int8":
        return _check_four_bit_load(spec, recipe, tgt, native, process, limit, headroom)
    load = load_host_bytes(spec, recipe, "cuda" if tgt.cuda else "cpu", native_bf16=native)
    if process + load.classic_host_bytes <= limit:
        return None
    lean_fits = process + load.host_bytes <= limit
    assumed = f"; {load.layout}: give the model's Hugging Face id or folder to check its files" if load.assumed else ""
    if recipe.weight_dtype == "int8":  # loading.load_int8: one tensor at a time, quantized as it arrives
        dtype = "torch.bfloat16" if native else "torch.float16"
        fix = (f"cm.load_int8(path_or_id, dtype={dtype}) loads one tensor at a time to int8 on the "
               f"{'GPU' if tgt.cuda else 'CPU'}: {format_bytes(load.host_bytes)} of host RAM"
               + ("" if lean_fits else "; even that does not fit: free this process's memory (restart the runtime)"))
    else:
        fix = (f"cm.load_model(...) loads shard by shard from the meta device straight to the GPU in {load.load_dtype}: "
               f"{format_bytes(load.host_bytes)} of host RAM" + ("" if lean_fits else
               "; even that does not fit: save the checkpoint in smaller shards (max_shard_size) or in 16-bit"))
    return Finding(
        "host-ram-load", "error" if not (lean_fits or load.assumed) else "warning",
        f"loading {load.params / 1e6:.0f}M parameters (checkpoint {format_bytes(load.checkpoint_bytes)} in "
        f"{load.checkpoint_dtype}, largest shard {format_bytes(load.largest_shard_bytes)}) the classic way "
        f"needs {format_bytes(load.classic_host_bytes)} of host RAM on top of this process's {format_bytes(process)}; "
        f"{tgt.name} has {format_bytes(limit)} usable{assumed}",
        "host RAM runs out while the model loads, before the first step: Colab kills and restarts the runtime, "
        "everything in memory is lost, and no Python error names memory as the cause",
        fix, load.to_dict(),
    )


def _check_four_bit_load(spec: Any, recipe: Recipe, tgt: Target, native: bool, process: int, host_limit: int,
                         headroom: float) -> Finding | None:
    """host-ram-load for a 4-bit load: transformers' own path, tensor by tensor (loading.quantized_load_bytes)."""
    from colab_memopt.techniques.architectures import ARCHITECTURES
    from colab_memopt.training.loadplan import load_dtype, quantized_load_bytes

    dtype = load_dtype(recipe, "cuda" if tgt.cuda else "cpu", native)
    load = quantized_load_bytes(spec, device="cuda" if tgt.cuda else "cpu", dtype=dtype)
    # a built-in name's shapes are its published config's, in its published dtype: a tensor-by-tensor load
    # needs nothing else of the layout (the shards are mapped, not held)
    assumed = load.source.startswith("assumed") and spec.name not in ARCHITECTURES
    device_need = load.device_bytes + (tgt.cuda_context_bytes if tgt.cuda else 0)
    device_limit = tgt.usable_bytes(headroom)
    host_fits = process + load.host_anon_bytes <= host_limit
    device_fits = not tgt.cuda or device_need <= device_limit
    if host_fits and device_fits and not load.spikes:
        return None
    where = f"{format_bytes(device_need)} on the GPU (CUDA context included) of {format_bytes(device_limit)} usable, " \
        if tgt.cuda else ""
    found = (f"the 4-bit load of {load.model} ({load.checkpoint_dtype} checkpoint, quantized tensor by tensor) needs "
             f"{where}{format_bytes(load.host_anon_bytes)} of host RAM on top of this process's {format_bytes(process)} "
             f"of {format_bytes(host_limit)} usable")
    if assumed:
        found += f"; {load.source}: give the model's Hugging Face id or folder to check its files"
    fix = load.fix or ("free this process's memory (restart the runtime) before loading" if not host_fits else
                       f"a smaller model: its 4-bit weights and its {load.load_dtype} embeddings and head alone "
                       "are more than the GPU holds")
    return Finding(
        "host-ram-load", "warning" if assumed or (host_fits and device_fits) else "error", found,
        "memory runs out while the model loads, before the first step: on the host Colab restarts the runtime "
        "without a Python error; on the GPU from_pretrained raises out of memory",
        fix, {**load.__dict__, "device_need_bytes": device_need, "device_limit_bytes": device_limit,
              "assumed": assumed},
    )


def check_qlora_saving(spec: Any, recipe: Recipe, batch: int, seq_len: int, tgt: Target) -> Finding | None:
    """qlora-small-saving: 4-bit base weights save under `QLORA_MIN_SAVING` of LoRA's need (analytic, both)."""
    if not (recipe.lora_rank and recipe.quantization in ("nf4", "fp4") and recipe.quantization_phase == "all"):
        return None
    with torch.device("meta"):
        shape = spec.build()
    lora = recipe.with_(quantization=None)
    fixed = tgt.cuda_context_bytes if tgt.cuda else 0
    q = estimate.training_step_bytes(shape, batch, seq_len, recipe)
    l = estimate.training_step_bytes(shape, batch, seq_len, lora)
    q_need, l_need = q.peak_bytes + fixed, l.peak_bytes + fixed
    saving = (l_need - q_need) / l_need if l_need else 0.0
    if saving >= QLORA_MIN_SAVING:
        return None
    weights = l.by_category.get("parameters", 0)
    acts = l.by_category.get("activations", 0)
    return Finding(
        "qlora-small-saving", "warning",
        f"QLoRA needs {format_bytes(q_need)} against LoRA's {format_bytes(l_need)}: {saving:.0%} less "
        f"(at batch {batch} x {seq_len} tokens, analytic)",
        f"4-bit shrinks only the frozen weights ({format_bytes(weights)} at LoRA's peak); here activations "
        f"({format_bytes(acts)}) and the CUDA context dominate, and QLoRA dequantizes every weight in every step: "
        "slower for little memory (torchtune#2255)",
        "use LoRA (frozen weights in fp16 on a T4), and cut activations instead: checkpointing, a shorter sequence or "
        "a smaller batch with accumulation",
        {"qlora_need_bytes": q_need, "lora_need_bytes": l_need, "saving_fraction": saving},
    )


def deepspeed_ops(recipe: Recipe, cuda: bool) -> list[str]:
    """Return the DeepSpeed ops a recipe's engine builds on first use: cpu_adam when the optimizer is offloaded,
    fused_adam on a GPU otherwise (on a CPU `zero.initialize` uses PyTorch's AdamW)."""
    if not recipe.uses_deepspeed:
        return []
    if recipe.offload_optimizer:
        return ["cpu_adam"]
    return ["fused_adam"] if cuda else []


def _op_is_built(op: str) -> bool:
    """Return whether a DeepSpeed op is prebuilt in the wheel or already JIT-built in the torch extensions cache."""
    try:
        with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
            from deepspeed.git_version_info import installed_ops
    except ImportError:
        installed_ops = {}
    if installed_ops.get(op):
        return True
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return any(root.glob(f"*/{op}/*.so")) or any(root.glob(f"{op}/*.so"))


def check_deepspeed_ops(recipe: Recipe, cuda: bool) -> Finding | None:
    """deepspeed-op-build: ops the engine will compile on first use (not prebuilt, not in the extensions cache)."""
    missing = [op for op in deepspeed_ops(recipe, cuda) if not _op_is_built(op)]
    if not missing:
        return None
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions"
    return Finding(
        "deepspeed-op-build", "warning",
        f"DeepSpeed will compile {', '.join(missing)} on first use: not prebuilt in the wheel and not in {cache}",
        "the first engine waits while the op compiles (on a 2-core CPU cpu_adam took about 45 s and up to 2 GB of RAM: "
        "FACTS.md); on Colab the build needs ninja and, for GPU ops, a matching nvcc, and fails there often (DeepSpeed#885)",
        f"build once before training (python -c \"from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()\"), "
        f"keep TORCH_EXTENSIONS_DIR on a persistent disk, or install DeepSpeed with DS_BUILD_{missing[0].upper()}=1",
        {"ops": missing, "cache": cache},
    )


def _is_training_args(value: Any) -> bool:
    """Return whether `value` is transformers' TrainingArguments (TRL's SFTConfig too)."""
    if value is None or isinstance(value, (Recipe, dict)):
        return False
    with quiet():
        from transformers import TrainingArguments

    return isinstance(value, TrainingArguments)


# What each check looks at, for the progress lines of a long checkup.
_CHECK_WORDS = {
    "bf16-not-native": "bf16 on this GPU",
    "fp16-trainable-params": "fp16 trainable weights",
    "bf16-trainable-under-fp16": "bf16 trainable weights under fp16",
    "checkpointing-frozen-inputs": "checkpointing with frozen inputs",
    "adapters-not-training": "the adapters train (one probe step)",
    "does-not-fit": "the step fits (a plan of it)",
    "checkpoint-interval": "the checkpointing interval suits the model",
    "host-ram-load": "loading fits in host RAM",
    "qlora-small-saving": "what 4-bit weights save",
    "deepspeed-op-build": "DeepSpeed's ops are built",
}


@shows_progress("doctor")
@quiet_unless_verbose
@isolated
def doctor(
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    recipe: Any = None,
    target: str | Target | dict[str, Any] = "auto",
    *,
    batch: int | None = None,
    seq_len: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    method: str = "auto",
    probe: bool = True,
    verbose: bool = False,
    lora: Any = None,
    bnb: Any = None,
    dtype: Any = None,
) -> Checkup:
    """Check a model, optimizer and recipe for the T4 pitfalls before the first step; return the findings.

    Args:
        model: a built `nn.Module` (all checks), a transformers `Trainer` / TRL `SFTTrainer` (its model and
            optimizer; its settings are the recipe unless `recipe` is given), or a name, Hugging Face id, folder,
            config.json or `PretrainedConfig` (the checks that need no weights: fit, host RAM, QLoRA, DeepSpeed, bf16).
        optimizer: the optimizer (its parameters' dtypes are checked with the model's).
        recipe: the settings that will train: a `Recipe` (or dict; None: plain fp32 AdamW), or your
            `TrainingArguments` / `SFTConfig` with `lora=` (a `LoraConfig`), `bnb=` (a `BitsAndBytesConfig`)
            and `dtype=` as you give them to `cm.plan_trainer`.
        target: 'auto' (this GPU, else a T4), a target name ('t4', 'l4', ...), a `Target` or a dict.
        batch, seq_len: the step planned (batch default 1; seq_len default: min(512, the model's maximum)); a
            Trainer's or TrainingArguments' batch is theirs (per-device batch x accumulation) and its seq_len
            SFTConfig's max_length unless given.
        headroom: fraction of device memory and host RAM kept free.
        method: the planner's method ('auto', 'trace', 'analytic'); Trainer settings are always traced.
        probe: with adapters and no gradients yet, run one forward and backward on random tokens to see
            that every adapter gets a gradient (weights untouched, gradients cleared after).
        verbose: print the checkup, and show the libraries' warnings and log notes (torch's, transformers',
            DeepSpeed's), which are hidden by default: they say nothing about your run.

    The does-not-fit check is the plan `cm.plan` prints for a Recipe, and `cm.plan_trainer` for a Trainer or
    TrainingArguments: the same figures.

    Example:
        >>> print(cm.doctor(model, opt, recipe, target="t4"))
        >>> print(cm.doctor("llama-3.1-8b", recipe=SFTConfig(...), lora=LoraConfig(r=16), bnb=bnb, target="t4"))
    """
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    trainer = args = None
    if hasattr(model, "args") and hasattr(model, "callback_handler"):  # a transformers Trainer
        if recipe is None:
            trainer = model
        model, optimizer, recipe = _from_trainer(model, optimizer, recipe)
    elif _is_training_args(recipe):
        args = recipe
        from colab_memopt.planning.hfconfig import read_lora, trainer_recipe
        from colab_memopt.planning.trainer import _bnb_config

        lora = read_lora(lora) if isinstance(lora, dict) else lora
        bnb = _bnb_config(bnb)
        recipe, _ = trainer_recipe(args, lora, bnb)
    if (trainer is not None or args is not None) and batch is not None:
        raise ValueError(f"batch={batch!r}: with a Trainer or TrainingArguments the batch is theirs "
                         "(per_device_train_batch_size x gradient_accumulation_steps): leave batch out")
    if args is None and (lora is not None or bnb is not None or dtype is not None):
        raise ValueError("lora=, bnb= and dtype= go with TrainingArguments / SFTConfig given as recipe= "
                         "(for a Recipe, use its fields: lora_rank=16, quantization='nf4', base_dtype='fp16')")
    if recipe is not None and not isinstance(recipe, (Recipe, dict)):
        raise TypeError(f"recipe must be a Recipe, a dict of its fields, or TrainingArguments / SFTConfig, got "
                        f"{type(recipe).__name__}")
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(recipe or {})
    batch = 1 if batch is None else batch
    tgt, capability = _target(target)
    module = model if isinstance(model, nn.Module) else None
    spec = _spec(model)
    if spec is not None and module is None:  # planned from a name or folder: the family's LoRA targets, as load_model
        from colab_memopt.training.presets import with_family_lora_targets

        rec = with_family_lora_targets(rec, spec.family)
    name = spec.name if spec is not None else type(model).__name__
    if seq_len is None and trainer is None and args is None:
        seq_len = min(512, spec.max_seq_len or 512) if spec is not None else 512
    findings: list[Finding | None] = []
    checked, skipped = [], {}

    def run(code: str, fn: Any, *args: Any, needs: str | None = None, **kwargs: Any) -> Any:
        if needs:
            skipped[code] = needs
            return None
        checked.append(code)
        say(f"check {len(checked)}: {_CHECK_WORDS.get(code, code)}")
        result = fn(*args, **kwargs)
        findings.append(result[0] if isinstance(result, tuple) else result)
        return result

    run("bf16-not-native", check_bf16, rec, module, capability, tgt.name)
    no_module = "needs a built model" if module is None else None
    if module is not None and optimizer is not None:
        opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not opt_params & {id(p) for p in module.parameters()}:
            skipped["optimizer"] = "the optimizer holds none of the model's parameters"
    run("fp16-trainable-params", check_fp16_trainable, rec, module, needs=no_module)
    run("bf16-trainable-under-fp16", check_bf16_trainable_under_fp16, rec, module, needs=no_module)
    run("checkpointing-frozen-inputs", check_checkpointing_inputs, module, needs=no_module)
    run("adapters-not-training", functools.partial(check_adapters_training, seq_len=min(seq_len or 16, 16)), module,
        rec, needs=no_module or (None if probe or (module is not None and any(p.grad is not None for _, p in _adapters(module)))
                                 else "probe=False and no gradients yet"))
    no_spec = "needs a transformers config or one of our names" if spec is None else None
    if trainer is not None or args is not None:  # the run as plan_trainer plans it: the same figures
        fitted = run("does-not-fit", check_trainer_fit, trainer if trainer is not None else args, tgt, seq_len, headroom,
                     **({} if trainer is not None else {"model": model, "lora": lora, "bnb": bnb, "dtype": dtype}))
        batch, seq_len = fitted[1].batch, fitted[1].seq_len
    else:
        no_trace = rec.untraceable_reason
        fitted = run("does-not-fit", check_fit, spec, rec, batch, seq_len, tgt, "analytic" if no_trace else method, headroom,
            needs=no_spec, model=model if isinstance(model, str) else None)
    run("checkpoint-interval", check_checkpoint_interval, rec, module, fitted[1] if fitted is not None else None)
    run("host-ram-load", check_host_load, spec, rec, tgt, capability, headroom,
        needs=no_spec or (None if spec.config is not None else "the reference model is built, not loaded"))
    run("qlora-small-saving", check_qlora_saving, spec, rec, batch, seq_len, tgt, needs=no_spec)
    run("deepspeed-op-build", check_deepspeed_ops, rec, tgt.cuda)
    result = Checkup(name, tgt.name, [f for f in findings if f is not None], checked, skipped,
                     fitted[1] if fitted is not None else None)
    if verbose:
        print(result)
    return result


def to_json(checkup: Checkup) -> str:
    """Return the checkup as JSON (what the CLI's --json prints)."""
    return json.dumps(checkup.to_dict(), indent=2, default=str)
