"""Recommend a recipe: the one that fits a target with headroom at the least expected slowdown.

`recommend` enumerates candidate recipes (`candidate_recipes`: the product of `CANDIDATE_AXES`, the training
mode's fields and the accumulation steps that divide the batch), screens them all with the analytic estimate
(one model built on the meta device, milliseconds per recipe), then confirms the cheapest ones that pass with
the planner (`plan`: a trace on fake tensors where the step can be traced) until one fits. For a transformers
model (a name, an id, a folder or a config), a candidate that fits is planned once more as what `recommend`
prints, the SFTConfig / LoraConfig / BitsAndBytesConfig run by TRL's SFTTrainer (`plan_trainer`): its loss and
the metrics it computes from the logits hold more than the package's own loop, and the answer is that plan, or
the next candidate where it does not fit. The slowdown of each candidate is the product of its techniques'
step-time ratios from the cost table of the target's device class (`costs.costs_for_target`: measured on that
class, or published priors with their citations until measured), never a constant typed in and never a CPU
measurement for a CUDA target; the result names the table and each row's source.

The defaults a practitioner would pick: on a CUDA target every candidate computes in the target's autocast
precision (fp16 + GradScaler on a T4, bf16 where native) unless `half_precision=False`, and LoRA and
QLoRA keep the frozen base in that 16-bit dtype (`Recipe.base_dtype`), the adapters in fp32. Mode
'auto' takes full fine-tuning if it fits, else LoRA, else QLoRA (objective 'least_memory': the mode
that needs least), and gives LoRA's and QLoRA's needs side by side. Plans are traced only for the
finalists the analytic screen ranks first, and the planner caches traces within a process.

The candidates themselves (the axes, the lean full fine-tuning recipes, the longest-context round's recipe) are
in `colab_memopt.planning.candidates`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from colab_memopt.planning import estimate
from colab_memopt.planning.costs import Slowdown, TechniqueCosts, costs_for_target, expected_slowdown, techniques_used
from colab_memopt.techniques.loss import DEFAULT_CHUNK_TOKENS
from colab_memopt.core.console import quiet
from colab_memopt.core.measure import format_bytes
from colab_memopt.core.progress import say, shows_progress
from colab_memopt.planning.faketrace import shape_model
from colab_memopt.planning.planner import check_seq_len, max_positions, plan
from colab_memopt.planning.prediction import Plan, describe_estimate_error
from colab_memopt.planning.targets import DEFAULT_HEADROOM, Target, check_headroom, get_target
from colab_memopt.planning.untraced import offloaded_checkpoint_bytes
from colab_memopt.training.presets import MODES, PRESETS, mode_fields, preset_fields
from colab_memopt.training.recipe import Recipe
from colab_memopt.planning.candidates import (
    ACCUMULATION_STEPS,
    FULL_CANDIDATES,
    INT8_CANDIDATES,
    INT8_TRADE,
    candidate_recipes,
    full_candidates,
    long_context_recipe,
    precision_options,
)


OBJECTIVES = ("fastest", "least_memory")


def _no_fit_message(cands: list[Candidate], name: str, mode: str, batch: int, seq_len: int, tgt: Any, limit: int,
                    headroom: float) -> str:
    """Say why no candidate fits with numbers that hold: the leanest *planned* candidate (a screen's figure can be far
    under the trace), and what it is short of: device memory, or host RAM where the device fits."""
    planned = [c for c in cands if c.plan is not None]
    leanest = min(planned or cands, key=lambda c: c.need_bytes)
    how = f"planned ({leanest.plan.method})" if leanest.plan is not None else "by the analytic screen; none was planned"
    if leanest.short_bytes > 0:
        short = (f"needs {format_bytes(leanest.need_bytes)} of device memory ({how}) and {tgt.name} allows {format_bytes(limit)} "
                 f"(short by {format_bytes(leanest.short_bytes)}). It would need a device with at least "
                 f"{format_bytes(int(leanest.need_bytes / (1 - headroom)))}")
    else:
        host_need = leanest.plan.host_need_bytes if leanest.plan is not None else leanest.analytic_host_bytes
        host_limit = leanest.plan.host_limit_bytes if leanest.plan is not None else leanest.host_limit_bytes
        short = (f"fits the device ({format_bytes(leanest.need_bytes)} of {format_bytes(limit)}, {how}) but needs "
                 f"{format_bytes(host_need)} of host RAM where {tgt.name} has {format_bytes(host_limit or 0)}. It would need more host RAM")
    return (f"no recipe fits {name} ({mode}) at batch {batch} x {seq_len} tokens on {tgt.name}: the leanest "
            f"{'planned ' if leanest.plan is not None else ''}candidate, {leanest.name}, {short}, or a smaller batch or sequence, "
            f"{'LoRA/QLoRA (mode=lora or qlora), ' if mode == 'full' else ''}or offloading to host memory.")


class NoRecipeFits(ValueError):
    """No candidate recipe fits the target; the message says what the leanest one would need."""

    def __init__(self, message: str, candidates: list[Candidate]) -> None:
        super().__init__(message)
        self.candidates = candidates


@dataclass
class Candidate:
    """One recipe the recommender considered: what it needs, what it would cost, whether it fits."""

    name: str
    recipe: Recipe
    slowdown: Slowdown
    analytic_need_bytes: int
    limit_bytes: int
    plan: Plan | None = None
    analytic_host_bytes: int = 0  # host RAM the recipe adds (offloaded checkpoints), screened against host_limit_bytes
    host_limit_bytes: int | None = None
    as_trainer: bool = False  # whether `plan` is its printed Trainer settings planned by plan_trainer

    @property
    def need_bytes(self) -> int:
        return self.plan.device_need_bytes if self.plan is not None else self.analytic_need_bytes

    @property
    def fits(self) -> bool:
        """Device memory and host RAM both: the plan's verdict, else the analytic screen's."""
        if self.plan is not None:
            return self.plan.fits
        host_ok = self.host_limit_bytes is None or self.analytic_host_bytes <= self.host_limit_bytes
        return self.analytic_need_bytes <= self.limit_bytes and host_ok

    @property
    def short_bytes(self) -> int:
        return max(0, self.need_bytes - self.limit_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "recipe": _changed(self.recipe), "expected_slowdown": self.slowdown.ratio,
            "slowdown_parts": self.slowdown.parts, "slowdown_kinds": self.slowdown.kinds, "unmeasured": self.slowdown.unmeasured,
            "analytic_need_bytes": self.analytic_need_bytes, "planned_need_bytes": self.plan.device_need_bytes if self.plan else None,
            "method": self.plan.method if self.plan else "analytic screen", "limit_bytes": self.limit_bytes,
            "fits": self.fits, "short_bytes": self.short_bytes,
            "host_need_bytes": self.plan.host_need_bytes if self.plan else self.analytic_host_bytes,
        }

    def line(self) -> str:
        how = f"planned ({self.plan.method})" if self.plan else "screened (analytic)"
        verdict = "fits" if self.fits else f"short by {format_bytes(self.short_bytes)}"
        return f"{self.name:58s} x{self.slowdown.ratio:5.2f}  needs {format_bytes(self.need_bytes):>10s} {how:20s} {verdict}"


@dataclass
class Recommendation:
    """The chosen recipe, its plan and expected slowdown, and every candidate considered."""

    model: str
    batch: int
    seq_len: int
    mode: str
    objective: str
    target: Target
    chosen: Candidate
    candidates: list[Candidate]
    costs_device: str
    reasoning: list[str] = field(default_factory=list)
    costs: TechniqueCosts | None = None  # the table the slowdowns come from (its class, measured or prior rows)
    lora_vs_qlora: dict[str, Any] | None = None  # {'lora': bytes, 'qlora': bytes, 'method': how both were planned}
    passed_over: list[str] = field(default_factory=list)  # mode 'auto': one line per mode passed over (or also fitting)

    @property
    def recipe(self) -> Recipe:
        return self.chosen.recipe

    @property
    def plan(self) -> Plan:
        assert self.chosen.plan is not None
        return self.chosen.plan

    @property
    def warnings(self) -> list[str]:
        """Return the chosen plan's warnings (an analytic fallback, a recipe the trace cannot follow, ...)."""
        return list(self.plan.warnings)

    def trainer_settings(self) -> dict[str, Any]:
        """Return the chosen recipe as Trainer settings: {'training_args': SFTConfig fields, 'lora': LoraConfig fields
        or None, 'bnb': BitsAndBytesConfig fields or None, 'not_expressible': what they cannot say} (`trainer.recipe_settings`)."""
        return trainer_settings(self.recipe, self.batch, self.seq_len)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "batch": self.batch, "seq_len": self.seq_len, "mode": self.mode,
            "objective": self.objective, "target": self.target.name, "chosen": self.chosen.name,
            "recipe": self.recipe.to_dict(), "predicted_peak_bytes": self.plan.peak_bytes,
            "predicted_need_bytes": self.plan.device_need_bytes, "device_limit_bytes": self.plan.device_limit_bytes,
            "method": self.plan.method, "expected_slowdown": self.chosen.slowdown.ratio,
            "slowdown_parts": self.chosen.slowdown.parts, "slowdown_measured_on": self.costs_device,
            "costs": self._costs_dict(),
            "reasoning": self.reasoning, "warnings": self.warnings, "candidates": [c.to_dict() for c in self.candidates],
            "estimate": self.plan.method == "analytic", "estimate_error": self.plan.estimate_error,
            "trainer_settings": self.trainer_settings(), "lora_vs_qlora": self.lora_vs_qlora,
            "passed_over": self.passed_over,
        }

    def _costs_dict(self) -> dict[str, Any]:
        """Return which cost table ranked the candidates, and the source of each row the chosen recipe uses."""
        table = self.costs
        if table is None:
            return {"table": None, "device": self.costs_device}
        kinds = {t: table.kind(t) for t in table.ratios}
        return {
            "device_class": table.device_class, "table": table.table, "device": table.device,
            "measured": sorted(t for t, k in kinds.items() if k == "measured"),
            "prior": sorted(t for t, k in kinds.items() if k == "prior"),
            "chosen_rows": {t: {"ratio": r, "kind": table.kind(t), "source": table.row_source(t)}
                            for t, r in self.chosen.slowdown.parts.items()},
        }

    def step_time(self) -> str:
        """Return the chosen recipe's 'step time xN of an fp32 AdamW step (prior|measured on ...)'."""
        from colab_memopt.core.wording import step_time

        c = self.chosen
        table = self.costs
        return step_time(c.slowdown.ratio, c.slowdown.kinds, table.device if table else self.costs_device,
                         table.device_class if table else None)

    def __str__(self) -> str:
        """Return the answer first: the verdict, the settings to write, the need against the limit, one line per
        figure (at most 100 characters); `explain()` has the reasoning and every candidate."""
        from colab_memopt.core.wording import call_lines, estimate_line, warning_lines, wrap

        p = self.plan
        mode = _MODE_WORDS.get(self.mode, self.mode)
        how = "" if p.method == "trace" else " (ESTIMATE, not traced)"
        lines = wrap(f"{self.model}, batch {self.batch} x {self.seq_len} tokens on {self.target.name}: {mode} fits, "
                     f"need {format_bytes(p.device_need_bytes)} of {format_bytes(p.device_limit_bytes)} usable{how}")
        settings = self.trainer_settings()
        for line in settings.get("install", []):
            lines.append(f"install first: {line}")
        lines.append("write these settings (TRL's SFTConfig):")
        lines += call_lines("SFTConfig", settings["training_args"])
        if settings["lora"]:
            lines += call_lines("LoraConfig", settings["lora"])
        if settings["bnb"]:
            lines += call_lines("BitsAndBytesConfig", settings["bnb"])
        if settings["not_expressible"]:  # the plan holds only with these: say so before any figure
            lines.append("and what no Trainer setting says (the plan needs it; colab_memopt's training loop runs it):")
            for missing in settings["not_expressible"]:
                lines += wrap(missing, first="  ", rest="    ")
        if p.estimate_error:
            lines += wrap(estimate_line(p.estimate_error))
        lines.append(self.step_time())
        if self.lora_vs_qlora:
            d = self.lora_vs_qlora
            saved = d["lora"] - d["qlora"]
            both = "both traced" if d["method"] == "traced" else "both estimated"
            lines.append(f"LoRA vs QLoRA, {both}: LoRA {format_bytes(d['lora'])}, QLoRA "
                         f"{format_bytes(d['qlora'])}: " + (f"QLoRA saves {format_bytes(saved)}, slower" if saved > 0
                                                             else f"QLoRA needs {format_bytes(-saved)} more"))
        for r in self.passed_over:
            lines += wrap(r)
        lines += warning_lines(self.warnings)
        lines.append(f"why, and the {len(self.candidates)} candidates: rec.explain() (command line: --verbose)")
        return "\n".join(lines)

    def explain(self) -> str:
        """Return the whole recommendation: the recipe, the sources of each step-time ratio, the reasoning, the
        plan of the chosen recipe and every candidate considered (what `--verbose` prints)."""
        c = self.chosen
        lines = [
            f"recommendation for {self.model} ({self.mode}), batch {self.batch} x {self.seq_len} tokens on {self.target.name}, "
            f"objective {self.objective}:",
            f"  {c.name}",
            f"  recipe: {_changed(c.recipe)}",
            f"  predicted peak {format_bytes(self.plan.peak_bytes)}, need {format_bytes(self.plan.device_need_bytes)} of "
            f"{format_bytes(self.plan.device_limit_bytes)} usable ({self.plan.method})",
            *([f"  ESTIMATE, NOT TRACED: {describe_estimate_error(self.plan.estimate_error)}"] if self.plan.estimate_error else []),
            f"  {self.step_time()}, from the " + (f"{self.costs.table}" if self.costs is not None
                                                   else f"ratios measured on {self.costs_device}"),
            *[f"    {t} x{r:.2f}: {c.slowdown.sources.get(t, '')}" for t, r in c.slowdown.parts.items()],
            *[f"warning: {w}" for w in self.warnings],
            "reasoning:",
            *[f"  {r}" for r in self.reasoning],
            "candidates considered (cheapest first; xN: step time against an fp32 AdamW step):",
            *[f"  {x.line()}" for x in self.candidates],
            "plan of the chosen recipe:",
            *[f"  {line}" for line in self.plan.explain().splitlines()],
        ]
        return "\n".join(lines)


def _changed(recipe: Recipe) -> dict[str, Any]:
    """Return the fields `Recipe.changed` names, as `to_dict` writes them (JSON-ready)."""
    values = recipe.to_dict()
    return {k: values[k] for k in recipe.changed()}


def _name(recipe: Recipe, target: Any, mode: str, model: str | None = None) -> str:
    used, uncovered = techniques_used(recipe)
    label = " + ".join(used + uncovered) or "fp32 AdamW (baseline)"
    if recipe.weight_dtype is not None and all("weight_dtype" not in u for u in uncovered):  # 8-bit trainable weights
        label += f" + weight_dtype={recipe.weight_dtype!r}"
    for preset in PRESETS:
        if Recipe.from_dict(preset_fields(preset, target=target, mode=mode, model=model)) == recipe:
            label += f"  [preset {preset}]"
    return label


def _applies(recipe: Recipe, model: nn.Module) -> bool:
    """Return True when `Recipe.build` would accept `model` (a meta-device copy) for `recipe`."""
    try:
        recipe.check_model(model)
    except ValueError:
        return False
    return True


def _model(model: Callable[[], nn.Module] | str | Any) -> tuple[str, Callable[[], nn.Module]]:
    from colab_memopt.techniques import architectures

    spec = architectures.resolve_model(model)  # a name, hub id, folder, config.json, config or factory
    return spec.name, spec.build


@shows_progress("recommend")
@quiet()
def recommend(
    model: Callable[[], nn.Module] | str,
    batch: int = 1,
    *,
    seq_len: int | None = None,
    target: str | Target | dict[str, Any] = "t4",
    objective: str = "fastest",
    mode: str = "auto",
    headroom: float = DEFAULT_HEADROOM,
    costs: TechniqueCosts | None = None,
    method: str = "auto",
    max_plans: int = 4,
    half_precision: bool = True,
) -> Recommendation:
    """Return the recipe that fits `target` with `headroom` at the least expected slowdown.

    Args:
        model: a model name (`architectures.model_names()`), a Hugging Face id, a folder or config.json,
            a `PretrainedConfig`, or a zero-argument factory (`architectures.resolve_model`).
        batch: the effective batch (sequences per optimizer step); accumulation may split it.
        seq_len: tokens per sequence (default: the model's maximum).
        target: 't4', 'l4', ... or a `Target` / dict (as `plan` takes).
        objective: 'fastest' (least expected slowdown that fits) or 'least_memory' (smallest need).
        mode: 'full', 'lora' or 'qlora' (what is trained), or 'auto': full fine-tuning if any recipe
            fits, else LoRA, else QLoRA. 'full' by name also tries `FULL_CANDIDATES` (16-bit weights with
            Kahan-compensated updates, LOMO, AdaLomo, GaLore, APOLLO, torchao's low-bit AdamW, BAdam) when
            no ordinary recipe fits (the reasoning says why each mode before was passed over);
            with objective 'least_memory', the mode whose recipe needs least.
        headroom: fraction of device memory kept free.
        costs: a step-time table (default: the table of the target's device class, `costs.costs_for_target`:
            measured rows, published priors for the rest); one of another class is refused.
        method: the planner's method for the confirming plans ('auto', 'trace', 'analytic'); with
            'trace', candidates that cannot be traced (bitsandbytes' 4-bit weights, Adafactor) are skipped.
        max_plans: at most this many candidates are confirmed with the planner.
        half_precision: False forbids 16-bit compute: every candidate trains in fp32 (on a CUDA target the
            default is the target's autocast precision for every candidate).

    Raises:
        NoRecipeFits: no candidate fits; the message names the leanest one's need and the shortfall.
    """
    headroom = check_headroom(headroom)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    kwargs = dict(seq_len=seq_len, target=target, objective=objective, headroom=headroom, costs=costs, method=method,
                  max_plans=max_plans, half_precision=half_precision)
    if mode == "auto":
        return _recommend_auto(model, batch, kwargs)
    # Full fine-tuning asked for by name also tries `FULL_CANDIDATES` (16-bit weights, LOMO, GaLore, ...) when no
    # ordinary recipe fits; mode 'auto' goes to LoRA instead, as the field's guides do.
    return _recommend_mode(model, batch, mode=mode, lean_full=mode == "full", **kwargs)


def _recommend_auto(model: Any, batch: int, kwargs: dict[str, Any]) -> Recommendation:
    """Mode 'auto': full fine-tuning if it fits, else LoRA, else QLoRA; 'least_memory': the least need of all."""
    passed_over: list[str] = []
    short_lines: list[str] = []  # one line per mode passed over, for the printout
    found: list[Recommendation] = []
    for m in MODES:
        try:
            rec = _recommend_mode(model, batch, mode=m, **kwargs)
        except NoRecipeFits as exc:
            passed_over.append(f"mode {m} passed over: {exc}")
            short_lines.append(_passed_over_line(m, exc.candidates))
            if m == list(MODES)[-1] and not found:
                raise NoRecipeFits(" | ".join(passed_over), exc.candidates) from None
            continue
        found.append(rec)
        if kwargs["objective"] == "fastest":
            break
    if kwargs["objective"] == "least_memory":
        rec = min(found, key=lambda r: r.plan.device_need_bytes)
        passed_over += [f"mode {r.mode}: its leanest recipe needs {format_bytes(r.plan.device_need_bytes)} ({r.chosen.name})"
                        for r in found if r is not rec]
        passed_over.append(f"objective least_memory: mode {rec.mode} needs least ({format_bytes(rec.plan.device_need_bytes)})")
    rec = found[-1] if kwargs["objective"] == "fastest" else rec
    rec.reasoning[:0] = passed_over
    rec.passed_over = short_lines + [f"{_MODE_WORDS.get(r.mode, r.mode)} fits too: needs "
                                     f"{format_bytes(r.plan.device_need_bytes)} ({r.chosen.name})" for r in found if r is not rec]
    return rec


_MODE_WORDS = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}


def _passed_over_line(mode: str, cands: list[Candidate]) -> str:
    """Return one short line saying why a mode was passed over: its leanest candidate's need against the limit."""
    planned = [c for c in cands if c.plan is not None]
    if not cands:
        return f"{_MODE_WORDS.get(mode, mode)} does not fit"
    leanest = min(planned or cands, key=lambda c: c.need_bytes)
    how = "traced" if leanest.plan is not None and leanest.plan.method == "trace" else "estimate"
    return (f"{_MODE_WORDS.get(mode, mode)} does not fit: its leanest recipe needs {format_bytes(leanest.need_bytes)} "
            f"of {format_bytes(leanest.limit_bytes)} ({how})")


def _longest_context_round(factory: Any, arch: str | None, batch: int, seq_len: int, mode: str, tgt: Target,
                           headroom: float, method: str, half_precision: bool, meta_model: nn.Module,
                           screened: Callable[..., list[Candidate]], cands: list[Candidate],
                           reasoning: list[str]) -> Candidate | None:
    """Try `capacity.long_context_recipe` (the MLP by tiles, the loss by chunks, the checkpoints offloaded and split
    between device and host by `planner.plan_offload_split`); return its candidate when it fits, else None."""
    from colab_memopt.planning.planner import plan_offload_split

    try:
        rec = long_context_recipe(arch, mode, tgt)
    except ValueError as exc:
        reasoning.append(f"no longest-context round: {exc}")
        return None
    if rec.precision not in precision_options(tgt, half_precision) or not _applies(rec, meta_model):
        return None
    limit = int(tgt.device_bytes * (1 - headroom)) - (tgt.cuda_context_bytes if tgt.cuda else 0)
    states = estimate.training_step_bytes(meta_model, batch, 1, rec).peak_bytes  # at one token: what no length changes
    if states > limit:
        reasoning.append(f"no longest-context round: its recipe needs {format_bytes(states)} at a single token, over the "
                         f"device limit: the sequence is not what does not fit")
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = plan_offload_split(arch if arch is not None else factory, batch, seq_len=seq_len, recipe=rec, target=tgt,
                                   headroom=headroom, method=method)
    keep = split.recipe.get("offload_keep_blocks", 0)
    # planned already (the analytic screen knows neither tiles nor the split, so it does not decide here)
    cand = screened([rec.with_(offload_keep_blocks=keep)])[0]
    cand.plan = split
    cands.append(cand)
    verdict = "fits" if split.fits else "does not fit" + (" the device" if not split.fits_device else "") + (
        " the host" if not split.fits_host else "")
    reasoning.append(f"none of those fits: the longest-context round (mlp_tile_tokens={rec.mlp_tile_tokens}, "
                     f"loss_chunk_tokens={rec.loss_chunk_tokens}, checkpoints offloaded, {keep} blocks' kept on the device "
                     f"by planner.offload_split): need {format_bytes(split.device_need_bytes)} ({split.method}), host "
                     f"{format_bytes(split.host_need_bytes)} -> {verdict}")
    return cand if split.fits else None


def _side_by_side(chosen: Candidate, meta_model: nn.Module, batch: int, seq_len: int, fixed: int, *, model: Any = None,
                  target: Any = None, headroom: float = DEFAULT_HEADROOM, method: str = "auto",
                  trainer_model: Any = None) -> dict[str, Any] | None:
    """Return LoRA's and QLoRA's needs for the chosen recipe, planned the same way (QLoRA often saves less than
    expected): {'lora', 'qlora': bytes, 'method': 'traced' or 'analytic estimate', 'line': the reasoning line}.

    The other one is traced when the chosen one was (trace against trace), as the SFTTrainer runs its printed settings
    where the chosen one was (`trainer_model`); where it cannot be, or the chosen one is an estimate, both are the
    analytic estimate: never a trace against an estimate."""
    r = chosen.recipe
    if not r.lora_rank:
        return None
    other = r.with_(quantization=None) if r.quantization is not None else r.with_(quantization="nf4")
    need, other_need, how = None, None, "analytic estimate"
    if trainer_model is not None:
        other_plan, _ = _trainer_plan(trainer_model, other, batch, seq_len, target, headroom)
        if other_plan is not None and other_plan.method == "trace":
            need, other_need, how = chosen.plan.device_need_bytes, other_plan.device_need_bytes, "traced"
    elif chosen.plan is not None and chosen.plan.method == "trace" and model is not None and method != "analytic":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                other_plan = plan(model, batch, seq_len=seq_len, recipe=other, target=target, headroom=headroom,
                                  find_max_batch=False, method="trace")
            need, other_need, how = chosen.plan.device_need_bytes, other_plan.device_need_bytes, "traced"
        except Exception:  # noqa: BLE001 - what cannot be traced is compared by the estimate, both sides
            need = None
    if need is None:
        need = estimate.training_step_bytes(meta_model, batch, seq_len, r).peak_bytes + fixed
        other_need = estimate.training_step_bytes(meta_model, batch, seq_len, other).peak_bytes + fixed
    lora_need, qlora_need = (other_need, need) if r.quantization is not None else (need, other_need)
    base = f"{r.base_dtype or 'fp32'} base"
    saved = lora_need - qlora_need
    line = (f"LoRA vs QLoRA, this recipe, both {how}: LoRA ({base}) needs {format_bytes(lora_need)}, QLoRA (nf4 base) "
            f"needs {format_bytes(qlora_need)}: QLoRA saves {format_bytes(saved)} ({saved / max(1, lora_need):.0%}); "
            "QLoRA only where LoRA does not fit (or objective least_memory): it dequantizes every weight in forward "
            "and backward")
    return {"lora": lora_need, "qlora": qlora_need, "method": how, "line": line}


def _recommend_mode(
    model: Callable[[], nn.Module] | str,
    batch: int = 1,
    *,
    seq_len: int | None,
    target: str | Target | dict[str, Any],
    objective: str,
    mode: str,
    headroom: float,
    costs: TechniqueCosts | None,
    method: str,
    max_plans: int,
    half_precision: bool,
    lean_full: bool = False,
) -> Recommendation:
    mode_fields(mode)  # validates the mode
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise ValueError(f"max_plans must be an integer >= 1, got {max_plans!r}")
    tgt = get_target(target)
    name, factory = _model(model)
    # The same checks, in the same words, as plan's: a sequence the model cannot take is refused here too.
    from colab_memopt.techniques import architectures

    spec = architectures.resolve_model(model)
    limit = spec.max_seq_len
    if limit is not None:
        seq_len = check_seq_len(limit if seq_len is None else seq_len, limit, name)
        meta_model = shape_model(factory)
    else:
        check_seq_len(seq_len, None, name)
        meta_model = shape_model(factory, "model")
        check_seq_len(seq_len, max_positions(meta_model), type(meta_model).__name__)
    costs = costs_for_target(tgt, costs)  # the target's class: never a CPU measurement for a CUDA target
    limit = int(tgt.device_bytes * (1 - headroom))
    fixed = tgt.cuda_context_bytes if tgt.cuda else 0
    arch = name if not callable(model) else None  # named, id, folder or config: LoRA targets by family
    # A transformers model (a name, an id, a folder or a config): the printed settings are planned with plan_trainer
    trainer_model = model if not callable(model) and spec.config is not None else None
    host_limit = int(tgt.host_bytes * (1 - headroom))

    def screened(recipes: list[Recipe]) -> list[Candidate]:
        out = []
        for rec in recipes:
            need = estimate.training_step_bytes(meta_model, batch, seq_len, rec).peak_bytes + fixed
            out.append(Candidate(_name(rec, tgt, mode, arch), rec, expected_slowdown(rec, costs), need, limit,
                                 analytic_host_bytes=offloaded_checkpoint_bytes(meta_model, batch, seq_len, rec, pinned=tgt.cuda),
                                 host_limit_bytes=host_limit))
        # Fastest: least slowdown, then fewest techniques (equal expected time: take the simpler recipe), then memory.
        key = ((lambda c: (c.slowdown.ratio, c.slowdown.n_techniques, c.analytic_need_bytes)) if objective == "fastest"
               else (lambda c: (c.analytic_need_bytes, c.slowdown.ratio)))
        out.sort(key=key)
        return out

    cands = screened(candidate_recipes(batch, target=tgt, mode=mode, model=arch, half_precision=half_precision))
    precisions = precision_options(tgt, half_precision)
    reasoning = [
        f"{len(cands)} candidates (precision {precisions} x optimizer x checkpointing x accumulation "
        f"{[a for a in ACCUMULATION_STEPS if a <= batch and batch % a == 0]}, mode {mode}); device limit {format_bytes(limit)} "
        f"({format_bytes(tgt.device_bytes)} less {headroom:.0%} headroom)",
        ("precision: " + ("fp32 only (half_precision=False)" if not half_precision else
                          f"{precisions[0]} for every candidate on a CUDA target (tensor cores; 2-byte activations)"
                          if tgt.cuda else f"{precisions} ranked by the {costs.device_class or 'given'} costs")
         + ("; LoRA's frozen base stored in the same 16-bit dtype, adapters fp32" if mode != "full" and half_precision else "")),
        f"step times: products of step-time ratios from the {costs.table} ({'published priors' if costs.source == 'costs.PRIORS' else costs.source})",
    ]
    priors = sorted(t for t in costs.ratios if costs.kind(t) == "prior")
    if priors:
        reasoning.append(f"  priors (published figures, not measured on {costs.device_class}): {priors}")

    def confirm(round_cands: list[Candidate]) -> Candidate | None:
        floored = sorted({n for c in round_cands for n in c.slowdown.floored})
        if floored:
            reasoning.append(f"counted as x1.00: {floored} (measured below 1, but they only add work: timing noise)")
        passed = [c for c in round_cands if c.fits]
        reasoning.append(f"analytic screen: {len(passed)} of {len(round_cands)} fit")
        planned = 0
        # Calibration (a trace takes seconds, so only the finalists are traced): once a traced plan needed more
        # than the analytic screen said, a later candidate with the same checkpointing (the estimate's error is
        # mostly its activations) whose screen, scaled by the smallest such under-estimate seen, is still over
        # the limit is passed over unplanned, so the plans go to candidates that can fit.
        under: dict[tuple[str, int], float] = {}
        passed_over = 0
        found = None
        for c in passed:
            if planned >= max_plans:
                break
            policy = (c.recipe.checkpointing, c.recipe.checkpoint_interval)
            if policy in under and c.analytic_need_bytes * under[policy] > limit:
                passed_over += 1
                continue
            say(f"{_MODE_WORDS.get(mode, mode)}: plan {planned + 1} of at most {min(max_plans, len(passed))}: {c.name}")
            # What is printed is SFTConfig / LoraConfig / BitsAndBytesConfig: where those settings say the whole
            # recipe, it is planned as the SFTTrainer runs them (its loss, its metrics on the logits, its dtype rules)
            # and answered with that plan; colab_memopt's own loop plans it where they cannot. One plan per candidate.
            as_trainer, why_not = (_trainer_plan(trainer_model, c.recipe, batch, seq_len, tgt, headroom)
                                   if trainer_model is not None and method != "analytic" else (None, ""))
            if as_trainer is not None:
                c.plan, c.as_trainer = as_trainer, True
            else:
                if why_not:
                    reasoning.append(f"{c.name}: its printed settings {why_not}: planned in colab_memopt's own loop")
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # the plan keeps its own warnings
                        c.plan = plan(factory if callable(model) else model, batch, seq_len=seq_len, recipe=c.recipe,
                                      target=tgt, headroom=headroom, find_max_batch=False, method=method)
                except Exception as exc:  # noqa: BLE001 - method='trace' skips what cannot be traced, and says so
                    if method != "trace":
                        raise
                    reasoning.append(f"skipped {c.name}: cannot be traced ({type(exc).__name__}) and method='trace'")
                    continue
            planned += 1
            short = [] if c.plan.fits_device else [f"short by {format_bytes(c.short_bytes)}"]
            if not c.plan.fits_host:
                short.append(f"host RAM {format_bytes(c.plan.host_need_bytes)} over {format_bytes(c.plan.host_limit_bytes)}")
            how = "as the SFTTrainer runs its printed settings, plan_trainer" if c.as_trainer else c.plan.method
            reasoning.append(f"planned {c.name}: need {format_bytes(c.plan.device_need_bytes)} ({how}) -> "
                             + ("fits" if c.plan.fits else ", ".join(short)))
            if method != "analytic" and c.plan.method == "analytic":
                why = next((w for w in c.plan.warnings if "analytic estimate" in w), "the step was not traced")
                reasoning.append(f"  fell back from the trace to the analytic estimate: {why}")
            if c.plan.fits:
                found = c
                break
            ratio = c.plan.device_need_bytes / max(1, c.analytic_need_bytes)
            if ratio > 1:
                under[policy] = min(under.get(policy, ratio), ratio)
        if passed_over:
            reasoning.append(f"passed over {passed_over} candidates unplanned: their analytic screen times the smallest "
                             "under-estimate a trace showed for the same checkpointing is above the limit")
        return found

    chosen = confirm(cands)
    if chosen is None and lean_full:  # full fine-tuning asked for by name: optimizers with almost no state
        allowed = precision_options(tgt, half_precision)
        lean = screened([r for _, r in full_candidates(target=tgt, model=arch)
                         if (r.precision in allowed or (half_precision and r.precision in ("fp16", "bf16")))
                         and _applies(r, meta_model)])
        reasoning.append(f"none of those fits: {len(lean)} lean full fine-tuning candidates ({', '.join(FULL_CANDIDATES)}; "
                         "their step times are not in the cost table: counted as x1.00)")
        cands += lean
        chosen = confirm(lean)
    if chosen is None:  # long context: offloaded checkpoints and the chunked loss (notebook 17)
        more = screened([r for r in candidate_recipes(batch, target=tgt, mode=mode, model=arch, long_context=True,
                                                      half_precision=half_precision)
                         if _applies(r, meta_model)])  # e.g. no chunked loss for soft-capped logits
        reasoning.append(f"none of those fits: {len(more)} long-context candidates (checkpointing='offload' with its "
                         f"host RAM within {format_bytes(host_limit)}, loss_chunk_tokens={DEFAULT_CHUNK_TOKENS})")
        cands += more
        chosen = confirm(more)
    if chosen is None:  # the longest-context round (capacity.longest_context's recipe, split checkpoints)
        chosen = _longest_context_round(factory, arch, batch, seq_len, mode, tgt, headroom, method, half_precision,
                                        meta_model, screened, cands, reasoning)
    if chosen is None and lean_full and half_precision:  # 8-bit weights, when no 16-bit-weight recipe fits
        int8 = screened([r for _, r in full_candidates(target=tgt, model=arch, extra=INT8_CANDIDATES)
                         if _applies(r, meta_model)])
        reasoning.append(f"none of those fits: {len(int8)} candidates with 8-bit weights ({', '.join(INT8_CANDIDATES)}). "
                         + INT8_TRADE)
        cands += int8
        chosen = confirm(int8)
    if chosen is None:
        raise NoRecipeFits(_no_fit_message(cands, name, mode, batch, seq_len, tgt, limit, headroom), cands)
    reasoning.append(f"chosen: {chosen.name}, step time x{chosen.slowdown.ratio:.2f} of an fp32 AdamW step"
                     + (f" (not measured: {chosen.slowdown.unmeasured}, counted as 1.0)" if chosen.slowdown.unmeasured else ""))
    side = _side_by_side(chosen, meta_model, batch, seq_len, fixed, model=factory if callable(model) else model,
                         target=tgt, headroom=headroom, method=method,
                         trainer_model=trainer_model if chosen.as_trainer else None)
    if side:
        reasoning.append(side["line"])
    return Recommendation(name, batch, seq_len, mode, objective, tgt, chosen, cands, costs.device, reasoning, costs,
                          lora_vs_qlora={k: v for k, v in side.items() if k != "line"} if side else None)


def trainer_settings(recipe: Recipe, batch: int, seq_len: int) -> dict[str, Any]:
    """Return a recipe as the Trainer settings `recommend` prints (`hfconfig.recipe_settings`), with the learning
    rate for its mode: the recipe's lr is the planner's default (lr plays no part in memory), so a Trainer gets
    2e-4 for LoRA / QLoRA adapters and 2e-5 for full fine-tuning (`finetune_lr`), never 1e-3 for a full fine-tune."""
    from colab_memopt.planning.hfconfig import recipe_settings

    settings = recipe_settings(recipe, batch, seq_len)
    if recipe.lr == Recipe().lr and recipe.optimizer.startswith(_ADAM_LIKE_PREFIXES):
        settings["training_args"]["learning_rate"] = finetune_lr(recipe)
    return settings


def _trainer_plan(model: Any, recipe: Recipe, batch: int, seq_len: int, target: Target,
                  headroom: float) -> tuple[Plan | None, str]:
    """Return (the plan of `recipe`'s printed settings as TRL's SFTTrainer runs them, ''): `plan_trainer` on the
    SFTConfig, LoraConfig and BitsAndBytesConfig `recommend` prints; or (None, why not) where those settings cannot
    say the whole recipe, need a package to install first, or cannot be planned (colab_memopt's own loop then plans it)."""
    from colab_memopt.planning.hfconfig import read_training_config
    from colab_memopt.planning.trainer import plan_trainer

    settings = trainer_settings(recipe, batch, seq_len)
    if settings["not_expressible"]:
        return None, "do not say the whole recipe (the printout names what colab_memopt's own loop adds)"
    if settings["install"]:
        return None, f"need {', '.join(settings['install'])} first (not planned as the SFTTrainer runs them)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan keeps its own warnings; the arguments' deprecation notes are ours
            config = read_training_config(dict(settings["training_args"]), lora=settings["lora"], bnb=settings["bnb"])
            return plan_trainer(config.args, model=model, lora=config.lora, bnb=config.bnb, target=target,
                                headroom=headroom), ""
    except Exception as exc:  # noqa: BLE001 - the loop plans it, and the reasoning says why
        return None, (f"could not be planned as the SFTTrainer runs them "
                      f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")


# Starting learning rates for fine-tuning a pretrained model with an AdamW-like optimizer, by what trains:
# LoRA's adapters start from zero (B = 0) and take about ten times a full fine-tune's rate (2e-4: the QLoRA paper's
# rate for its 7B and 13B models, arXiv:2305.14314; 2e-5: TRL's SFTConfig default, for full fine-tuning).
FINETUNE_LR = {"full": 2e-5, "lora": 2e-4}
_ADAM_LIKE_PREFIXES = ("adam", "paged_adamw", "torchao_adamw", "galore_adamw", "apollo", "badam", "adafactor")


def finetune_lr(recipe: Recipe) -> float:
    """Return a starting learning rate for fine-tuning a pretrained model with `recipe`.

    2e-4 when the recipe trains LoRA adapters (`lora_rank` >= 1: LoRA and QLoRA), 2e-5 for full
    fine-tuning (`FINETUNE_LR`). Both are for AdamW-like optimizers (Adam, AdamW and their 8-bit, paged,
    GaLore, APOLLO, BAdam and Adafactor forms); SGD, Lion, LOMO and AdaLomo train at other scales, so for
    them this raises ValueError asking for a learning rate.

    Example:
        >>> rec = recommend("smollm2-135m", 4, seq_len=512, target="t4")
        >>> recipe = rec.recipe.with_(lr=finetune_lr(rec.recipe))  # 2e-5: auto picks full fine-tuning here
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe, got {type(recipe).__name__}")
    if not recipe.optimizer.startswith(_ADAM_LIKE_PREFIXES):
        raise ValueError(f"finetune_lr knows AdamW-like optimizers' rates, not optimizer={recipe.optimizer!r}'s: "
                         "give the learning rate yourself (lr=...)")
    return FINETUNE_LR["lora" if recipe.lora_rank else "full"]
