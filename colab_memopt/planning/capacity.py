"""The largest model that fits a target, per preset, training mode and sequence length.

Each model is built once on the `meta` device (no memory) and every recipe is costed with the
analytic estimate (`estimate.training_step_bytes`, the planner's fallback path: milliseconds per
recipe, where a trace of an 8B model takes tens of seconds on a CPU), plus the target's CUDA context,
against the target's memory less the headroom. `recommend` confirms a chosen recipe with a trace.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from colab_memopt.core.console import quiet
from colab_memopt.core.progress import say, shows_progress
from colab_memopt.planning import estimate

from colab_memopt.techniques import architectures
from colab_memopt.planning.targets import DEFAULT_HEADROOM, get_target
from colab_memopt.training.presets import MODES, PRESETS, preset_fields
from colab_memopt.training.recipe import Recipe
from colab_memopt.planning.candidates import FULL_CANDIDATES, INT8_CANDIDATES, PURE16, full_candidates  # noqa: F401 - re-exported
from colab_memopt.planning.candidates import LONG_CONTEXT_TILE_TOKENS, long_context_recipe  # noqa: F401 - re-exported


@dataclass
class Fit:
    """One (model, recipe) costed on a target."""

    model: str
    params: int
    mode: str
    seq_len: int
    recipe_name: str
    need_bytes: int
    limit_bytes: int
    recipe: Recipe | None = None

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.limit_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recipe"] = _short(self.recipe) if self.recipe is not None else None
        return {**d, "fits": self.fits}

    def categories(self, batch: int = 1) -> dict[str, int]:
        """Return the analytic peak's bytes by category for this fit's recipe."""
        assert self.recipe is not None
        return estimate.training_step_bytes(_meta_model(self.model), batch, self.seq_len, self.recipe).by_category


# Architectures made by `scaled` (a named architecture with another depth), by name.
_SCALED: dict[str, architectures.Architecture] = {}


def scaled(base: str, num_layers: int) -> str:
    """Return the name of `base` (a real architecture) with `num_layers` blocks, usable by the functions here."""
    if base not in architectures.ARCHITECTURES:
        raise ValueError(f"unknown architecture {base!r}; choose one of {list(architectures.ARCHITECTURES)}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    arch = architectures.ARCHITECTURES[base]
    key = "n_layer" if arch.family == "gpt2" else "num_hidden_layers"
    name = f"{base}-{num_layers}L"
    _SCALED[name] = architectures.Architecture(name, arch.family, {**arch.config, key: num_layers}, f"{arch.source}, {num_layers} layers")
    return name


@lru_cache(maxsize=64)
def _meta_model(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return _SCALED[name].build() if name in _SCALED else architectures.model_factory(name)()


def base_name(name: str) -> str:
    """Return the named architecture a (possibly `scaled`) model name comes from."""
    return name.rsplit("-", 1)[0] if name in _SCALED else name


def model_params(name: str) -> int:
    """Return the parameter count of a named model (built on the meta device)."""
    return sum(p.numel() for p in {id(p): p for p in _meta_model(name).parameters()}.values())


def need_bytes(name: str, recipe: Recipe, *, batch: int = 1, seq_len: int = 512, target: Any = "t4") -> int:
    """Return the analytic device need of one training step: tensors at the peak plus the CUDA context."""
    tgt = get_target(target)
    peak = estimate.training_step_bytes(_meta_model(name), batch, seq_len, recipe).peak_bytes
    return peak + (tgt.cuda_context_bytes if tgt.cuda else 0)


def fit(name: str, recipe_name: str, recipe: Recipe, *, mode: str, seq_len: int, batch: int = 1,
        target: Any = "t4", headroom: float = DEFAULT_HEADROOM) -> Fit:
    """Return the `Fit` of one model and recipe on a target."""
    tgt = get_target(target)
    return Fit(name, model_params(name), mode, seq_len, recipe_name,
               need_bytes(name, recipe, batch=batch, seq_len=seq_len, target=tgt), int(tgt.device_bytes * (1 - headroom)), recipe)




def best_fit(name: str, *, mode: str, seq_len: int, batch: int = 1, target: Any = "t4", headroom: float = DEFAULT_HEADROOM,
             candidates: str = "all") -> Fit:
    """Return the leanest candidate recipe for a model: the best chance to fit.

    `candidates`: 'all' (`recommend.candidate_recipes`, and for full fine-tuning `full_candidates` too),
    'recommend' (only `recommend`'s), or a name of `FULL_CANDIDATES` or `INT8_CANDIDATES` (only that one's
    recipes; 'all' leaves out 8-bit weights, which `recommend` offers only when nothing else fits).
    """
    from colab_memopt.planning.candidates import candidate_recipes

    tgt = get_target(target)
    named = {**FULL_CANDIDATES, **INT8_CANDIDATES}
    if candidates not in ("all", "recommend") and candidates not in named:
        raise ValueError(f"candidates must be 'all', 'recommend' or one of {list(named)}, got {candidates!r}")
    recipes: list[Recipe] = []
    if candidates in ("all", "recommend"):
        recipes += candidate_recipes(batch, target=tgt, mode=mode, model=base_name(name))
    if mode == "full" and candidates != "recommend":
        pick = FULL_CANDIDATES if candidates == "all" else {candidates: named[candidates]}
        recipes += [r for _, r in full_candidates(target=tgt, model=base_name(name), extra=pick)]
    if not recipes:
        raise ValueError(f"no candidate recipe for mode {mode!r} and candidates {candidates!r}")
    fits = [fit(name, _short(r), r, mode=mode, seq_len=seq_len, batch=batch, target=tgt, headroom=headroom)
            for r in recipes]
    return min(fits, key=lambda f: f.need_bytes)


def largest_scaled(base: str, *, mode: str, seq_len: int, batch: int = 1, target: Any = "t4",
                   headroom: float = DEFAULT_HEADROOM, max_layers: int = 256, candidates: str = "all") -> tuple[Fit | None, Fit | None]:
    """Return (the deepest `base`-shaped model that fits under its leanest recipe, the next depth that does not).

    Bisects the number of blocks: a coarse search over model size at the base's width. `candidates` as in `best_fit`.
    """
    def probe(n: int) -> Fit:
        return best_fit(scaled(base, n), mode=mode, seq_len=seq_len, batch=batch, target=target, headroom=headroom,
                        candidates=candidates)

    lo_fit = probe(1)
    if not lo_fit.fits:
        return None, lo_fit
    lo, hi, hi_fit = 1, max_layers, probe(max_layers)
    if hi_fit.fits:
        return hi_fit, None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        f = probe(mid)
        if f.fits:
            lo, lo_fit = mid, f
        else:
            hi, hi_fit = mid, f
    return lo_fit, hi_fit


def _resolves(model: str) -> bool:
    """Return whether `model` is a name, id, folder or config.json that `architectures.resolve_model` takes."""
    try:
        architectures.resolve_model(model)
    except ValueError:
        return False
    return True


def _short(recipe: Recipe) -> str:
    base = Recipe().to_dict()
    return ", ".join(f"{k}={v}" for k, v in recipe.to_dict().items() if base[k] != v) or "baseline"


def capacity_table(
    models: list[str],
    *,
    seq_lens: tuple[int, ...] = (512, 2048),
    modes: tuple[str, ...] = tuple(MODES),
    presets: tuple[str, ...] = tuple(PRESETS),
    batch: int = 1,
    target: Any = "t4",
    headroom: float = DEFAULT_HEADROOM,
) -> list[dict[str, Any]]:
    """Return one row per (preset, mode, seq_len): the largest model of `models` that fits, and its need.

    Rows also hold the smallest model that does not fit and by how much it is short.
    """
    unknown = [m for m in models if m not in _SCALED and not _resolves(m)]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {architectures.model_names()}, "
                         "or give a Hugging Face id, a folder or a config.json")
    ordered = sorted(models, key=model_params)
    rows = []
    for preset in presets:
        for mode in modes:
            for seq in seq_lens:
                fits = [fit(m, preset, Recipe.preset(preset, target=get_target(target), mode=mode, model=base_name(m)),
                            mode=mode, seq_len=seq, batch=batch, target=target, headroom=headroom) for m in ordered]
                ok = [f for f in fits if f.fits]
                miss = [f for f in fits if not f.fits]
                largest, first_miss = (ok[-1] if ok else None), (miss[0] if miss else None)
                rows.append({
                    "preset": preset, "mode": mode, "seq_len": seq,
                    "largest_model": largest.model if largest else None,
                    "largest_params": largest.params if largest else 0,
                    "largest_need_bytes": largest.need_bytes if largest else None,
                    "next_model": first_miss.model if first_miss else None,
                    "next_short_bytes": first_miss.need_bytes - first_miss.limit_bytes if first_miss else None,
                    "limit_bytes": fits[0].limit_bytes,
                })
    return rows


def largest_scaled_for(base: str, recipe: Recipe, *, seq_len: int, batch: int = 1, target: Any = "t4",
                       headroom: float = DEFAULT_HEADROOM, max_layers: int = 256, trace: bool = True) -> dict[str, Any]:
    """Return the deepest `base`-shaped model (`scaled`) that one recipe trains on `target`, and its need.

    The depth is bisected with the analytic estimate (milliseconds per depth), then, with `trace`,
    corrected by the planner's trace (`planner.plan(method='trace')`, exact on the CPU): one trace at
    the analytic answer, a step by the per-layer slope to where the trace says the boundary is, and
    traces one layer at a time until the deepest traced fit and the shallowest traced miss are
    neighbours. Where the step cannot be traced (the planner falls back to its analytic estimate, e.g.
    torch's foreach Adafactor asks a tensor for its value) the analytic answer is returned, with
    `planned_by` 'analytic' and the planner's reason in `note`. Depths start at 2 blocks (checkpointing looks for a stack of two or more). Returns a
    dict: layers (0: not even 2 fit), params, need_bytes, limit_bytes, planned_by ('trace' or
    'analytic'), next_params (one layer more, which does not fit; None at `max_layers`), traces.

    Example:
        >>> largest_scaled_for("llama-3.1-8b", Recipe(precision="bf16", optimizer="lomo", checkpointing="full"), seq_len=2048)
    """
    from colab_memopt.planning.planner import plan

    tgt = get_target(target)
    limit = int(tgt.device_bytes * (1 - headroom))

    def analytic(n: int) -> int:
        return need_bytes(scaled(base, n), recipe, batch=batch, seq_len=seq_len, target=tgt)

    if analytic(2) > limit:
        return {"layers": 0, "params": 0, "need_bytes": analytic(2), "limit_bytes": limit, "planned_by": "analytic",
                "next_params": model_params(scaled(base, 2)), "traces": 0}
    lo, hi = 2, max_layers
    if analytic(hi) <= limit:
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if analytic(mid) <= limit else (lo, mid)
    layers, need, method, traces = lo, analytic(lo), "analytic", 0
    if trace:
        cache: dict[int, int] = {}

        class _Untraceable(Exception):
            pass

        def traced(n: int) -> int:
            if n not in cache:
                name = scaled(base, n)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    p = plan(lambda: _SCALED[name].build(), batch, seq_len=seq_len, recipe=recipe, target=tgt,
                             headroom=headroom, find_max_batch=False, method="auto")
                if p.method != "trace":
                    raise _Untraceable("; ".join(p.warnings))
                cache[n] = p.device_need_bytes
            return cache[n]

        slope = max(1, analytic(3) - analytic(2))  # bytes per block
        try:
            first = traced(layers)
        except _Untraceable as exc:
            return {"layers": layers, "params": model_params(scaled(base, layers)), "need_bytes": need,
                    "limit_bytes": limit, "planned_by": "analytic", "note": str(exc)[:300],
                    "next_params": model_params(scaled(base, layers + 1)) if layers < max_layers else None, "traces": 0}
        guess = layers + (limit - first) // slope if first <= limit else layers - -(-(first - limit) // slope)
        n = min(max(2, guess), max_layers)
        while n > 2 and traced(n) > limit:
            n -= 1
        while n < max_layers and traced(n) <= limit and traced(n + 1) <= limit:
            n += 1
        if traced(n) <= limit:
            layers, need, method, traces = n, traced(n), "trace", len(cache)
        else:
            layers, need, method, traces = 0, traced(n), "trace", len(cache)
    return {"layers": layers, "params": model_params(scaled(base, layers)) if layers else 0, "need_bytes": need,
            "limit_bytes": limit, "planned_by": method,
            "next_params": model_params(scaled(base, layers + 1)) if layers < max_layers else None, "traces": traces}


# -- 17_long_context: the longest sequence a model trains at on a target ---------------------------

@dataclass
class LongestSequence:
    """The longest sequence (a multiple of `step_tokens`) whose planned step fits a target, and its plan's figures."""

    model: str
    mode: str
    recipe: dict[str, Any]
    max_seq_len: int  # 0: not even `step_tokens` fits
    step_tokens: int
    limit_tokens: int  # the model's own maximum (or the search's cap)
    method: str  # 'trace' or 'analytic': how the plans at the boundary were made
    device_need_bytes: int | None  # at max_seq_len (None when nothing fits)
    host_need_bytes: int | None
    offloaded_checkpoint_bytes: int | None
    first_miss: dict[str, Any] | None  # the next length up: its device and host need, and what it is short of
    plans: int
    seconds: float
    converged: bool
    # the checkpoints split between device and host at max_seq_len (None: no split searched)
    offload_keep_blocks: int | None = None
    limited_by: str | None = None  # what stops the next length: 'device memory', 'host RAM', both, or the cap
    breakdown: dict[str, Any] | None = None  # at the first miss: device and host costs, largest categories
    note: str | None = None  # what the search changed or where it stopped early (a step above the cap, max_plans)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@shows_progress("longest sequence")
@quiet()
def longest_sequence(model: str, recipe: Recipe | None = None, *, mode: str = "", batch: int = 1, target: Any = "t4",
                     step_tokens: int = 1024, headroom: float = DEFAULT_HEADROOM, method: str = "auto",
                     host_base_bytes: int | None = None, max_tokens: int | None = None,
                     guess_tokens: int | None = None, max_plans: int = 16,
                     split_checkpoints: bool = False) -> LongestSequence:
    """Return the longest multiple of `step_tokens` at which `plan` says one step of `recipe` fits `target`.

    Device memory and host RAM both must fit (`Plan.fits`). The search starts at `guess_tokens` (default:
    the analytic estimate's answer, which costs a few seconds) and the next length, then plans where the line
    through the spare bytes of the plans nearest the boundary reaches 0 (`_secant_search`), until a length fits and
    the next does not: each probe is one `plan` (a trace on fake tensors where the recipe traces). `host_base_bytes` replaces the planner's
    "this process" line (this Python process's RSS) by a fixed figure, e.g. a fresh process's.
    `split_checkpoints` (recipe with checkpointing='offload'): at a length where the host cannot hold one copy
    per block (the analytic host RAM, exact for the copies), one copy per 2, 4, ... blocks goes there instead
    (`checkpoint_interval`: two-level offload, each block checkpointed again on the device); with one per block,
    a length also fits when some blocks' checkpoints kept on the device make both memories fit
    (`planner.offload_split`, decided from the all-offloaded plan); the answer's length is planned again with
    that split, and `offload_keep_blocks` says it. The answer's `recipe` holds the interval and the split.

    `recipe=None` runs the longest-context round of `mode` ('full', 'lora' or 'qlora'): `long_context_recipe`
    with the checkpoints split where the host is short (`split_checkpoints=True`).

    Example:
        >>> longest_sequence("llama-3.2-1b", Recipe(precision="fp16-autocast", checkpointing="offload",
        ...                                         loss_chunk_tokens=128)).max_seq_len
        >>> longest_sequence("llama-3.1-8b", mode="qlora", target="t4")  # the round's recipe, split checkpoints
    """
    import time
    import warnings

    from colab_memopt.planning.planner import plan
    from colab_memopt.planning.targets import check_headroom

    if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1:
        raise ValueError(f"step_tokens must be an integer >= 1, got {step_tokens!r}")
    check_max_plans(max_plans)
    check_headroom(headroom)
    if recipe is None:
        if mode not in MODES:
            raise ValueError(f"longest_sequence without a recipe needs mode one of {list(MODES)}, got {mode!r}")
        recipe, split_checkpoints = long_context_recipe(model, mode, target), True
    start = time.perf_counter()
    tgt = get_target(target)
    limit = architectures.max_seq_len(model)
    if max_tokens is not None:
        limit = min(limit, max_tokens)
    notes = []
    if step_tokens > limit:  # no multiple of the step under the cap: search below it, in steps of a power of two
        asked, step_tokens = step_tokens, 1 << max(0, (limit // 8).bit_length() - 1)
        notes.append(f"the step ({asked} tokens) is above the {limit}-token cap: searched in steps of {step_tokens}")
    top = limit // step_tokens
    plans: dict[int, Any] = {}

    from colab_memopt.planning.planner import offload_split

    split = split_checkpoints and recipe.checkpointing == "offload"
    if split:
        recipe = recipe.with_(offload_keep_blocks=0)
        n_blocks = estimate._dims(_meta_model(model))["layers"]

    def plan_at(units: int, rec: Recipe, how: str = method) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = plan(model, batch, seq_len=units * step_tokens, recipe=rec, target=tgt, headroom=headroom,
                     find_max_batch=False, method=how)
        if host_base_bytes is not None:
            p.host_costs = [c for c in p.host_costs if c.name != "this process"]
            from colab_memopt.planning.prediction import Cost

            p.host_costs.insert(0, Cost("base process", host_base_bytes, "given (host_base_bytes)"))
        return p

    def recipe_at(units: int) -> Recipe:
        """The recipe planned at a length: with split checkpoints, one host copy per block while the host holds
        them (by the analytic host RAM, exact for the copies), else per 2, 4, ... blocks (two-level offload)."""
        if not split:
            return recipe
        k = 1
        while k < n_blocks:
            if plan_at(units, recipe.with_(checkpoint_interval=k), "analytic").fits_host:
                break
            k = min(2 * k, n_blocks)
        return recipe.with_(checkpoint_interval=k)

    def planned(units: int) -> Any:
        if units not in plans:
            last = ""
            if plans:  # the verdict of the plan before, in the same line
                prev = list(plans)[-1]
                last = f" ({prev * step_tokens:,} tokens {'fit' if plans[prev].fits else 'do not fit'})"
            say(f"{mode + ': ' if mode else ''}plan {len(plans) + 1} of at most {max_plans}: {units * step_tokens:,} "
                f"tokens{last}")
            plans[units] = plan_at(units, recipe_at(units))
        return plans[units]

    def split_of(p: Any) -> int | None:  # a split of one checkpoint per block; two-level copies are not split
        return offload_split(p, n_blocks) if p.recipe.get("checkpoint_interval", 1) == 1 else None

    def fits(units: int) -> bool:
        if units > top:
            return False
        p = planned(units)
        return p.fits or (split and split_of(p) is not None)

    if guess_tokens is None:  # the analytic answer, by the search's own test (both memories, the split): a first guess
        def fits_analytic(units: int) -> bool:
            p = plan_at(units, recipe_at(units), "analytic")
            return p.fits or (split and split_of(p) is not None)

        lo, hi = 0, top + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits_analytic(mid) else (lo, mid)
        guess = max(1, lo)
    else:
        guess = max(1, guess_tokens // step_tokens)
    units, converged = _secant_search(fits, lambda u: _spare_bytes(plans[u], split) if u in plans else None,
                                      min(guess, top), top, max_plans)
    best = plans.get(units)
    keep = None
    if split and best is not None:
        recipe = Recipe.from_dict(best.recipe)  # the answer's own recipe (its checkpoint_interval)
        keep = (split_of(best) or 0) if not best.fits else 0
        if keep:  # the answer planned with its split: its own figures, not the bound it was chosen by
            recipe = recipe.with_(offload_keep_blocks=keep)
            best = plan_at(units, recipe)
            if not best.fits:
                converged = False
    miss_units = min((u for u in plans if u > units), default=units + 1)  # the nearest length planned above
    miss = plans.get(miss_units)
    first_miss, limited_by, breakdown = None, None, None
    if miss is not None:
        first_miss = {"seq_len": miss_units * step_tokens, "device_need_bytes": miss.device_need_bytes,
                      "host_need_bytes": miss.host_need_bytes, "fits_device": miss.fits_device, "fits_host": miss.fits_host}
        one_per_block = split and miss.recipe.get("checkpoint_interval", 1) == 1
        limited_by, breakdown = limit_breakdown(miss, n_blocks if one_per_block else None)
    elif units >= top:
        first_miss = {"seq_len": None, "why": f"the search's cap of {limit} tokens (the model's maximum or max_tokens)"}
        limited_by = "the sequence cap"
    if not converged:
        notes.append(f"the search stopped after {len(plans)} plans (max_plans={max_plans}) before the boundary: "
                     "a longer sequence may fit; raise max_plans (--max-plans)")
    ref = best if best is not None else next(iter(plans.values()), None)
    host_off = None
    if best is not None:
        host_off = sum(c.bytes for c in best.host_costs if c.name == "offloaded checkpoints")
    return LongestSequence(
        model=model, mode=mode, recipe=_changed_fields(recipe), max_seq_len=units * step_tokens, step_tokens=step_tokens,
        limit_tokens=limit, method=ref.method if ref is not None else "none",
        device_need_bytes=best.device_need_bytes if best is not None else None,
        host_need_bytes=best.host_need_bytes if best is not None else None, offloaded_checkpoint_bytes=host_off,
        first_miss=first_miss, plans=len(plans), seconds=time.perf_counter() - start, converged=converged,
        offload_keep_blocks=keep, limited_by=limited_by, breakdown=breakdown, note="; ".join(notes) or None,
    )


def _spare_bytes(p: Any, split: bool) -> int:
    """Return what a plan leaves spare: the device's free bytes, and the host's (with the checkpoints split, what the
    device keeps of them moves between the two: their sum)."""
    device = p.device_limit_bytes - p.device_need_bytes
    host = p.host_limit_bytes - p.host_need_bytes
    return min(device, device + host) if split else min(device, host)


def _secant_search(fits: Callable[[int], bool], spare: Callable[[int], int | None], start: int, top: int,
                   max_plans: int) -> tuple[int, bool]:
    """Return (the largest length in [1, top] that fits, 0 if none; whether the boundary was found), each probe one
    plan (`fits`): from `start` and the next length, then where the line through the spare bytes of the nearest
    plans on each side reaches 0 (the need grows about linearly with the length: activations and checkpoints per
    token), halving the bracket instead when a side moved twice in a row; doubling up (or halving down) while the
    boundary is not bracketed and no line points to it. Llama-3.1-8B QLoRA on a T4: 5 plans from the analytic
    guess (17,408 tokens) to 53,248, where galloping from it took 12; 3 to 8 on most curves tests/test_capacity.py
    tries."""
    lo, hi = 0, top + 1  # the longest that fits, the shortest that does not (top + 1: none yet)
    seen: dict[int, int | None] = {}
    moved: list[str] = []
    u = max(1, min(start, top))
    for _ in range(max_plans):
        ok = fits(u)
        seen[u] = spare(u)
        if ok:
            lo = max(lo, u)
        else:
            hi = min(hi, u)
        moved.append("lo" if ok else "hi")
        if hi - lo <= 1:
            return lo, True
        u = _next_length(lo, hi, top, seen, moved)
    return lo, False


def _next_length(lo: int, hi: int, top: int, seen: dict[int, int | None], moved: list[str]) -> int:
    """Return the next length `_secant_search` plans: strictly between `lo` and `hi`."""
    def root(a: int, b: int) -> float | None:  # where the line through (a, spare a) and (b, spare b) reaches 0
        sa, sb = seen.get(a), seen.get(b)
        if sa is None or sb is None or sa == sb:
            return None
        return a + sa * (b - a) / (sa - sb)

    if 0 < lo and hi <= top:  # bracketed: the line between the two sides, or the middle after two moves of one side
        at = None if moved[-2:] in (["lo", "lo"], ["hi", "hi"]) else root(lo, hi)
        guess = (lo + hi) // 2 if at is None else math.floor(at)
    elif lo == 0:  # nothing fits yet: down, along the two shortest that do not fit, else to half
        below = sorted(u for u in seen if u >= hi)[:2]
        at = root(*below) if len(below) == 2 else None
        guess = hi - 1 if len(below) < 2 else (hi // 2 if at is None or at >= hi else math.floor(at))
    else:  # everything planned fits: up, along the two longest that fit, else to double
        above = sorted(u for u in seen if u <= lo)[-2:]
        at = root(*above) if len(above) == 2 else None
        guess = lo + 1 if len(above) < 2 else (2 * lo if at is None or at <= lo else math.floor(at))
    return max(lo + 1, min(hi - 1, top, guess))


def check_max_plans(max_plans: Any, name: str = "max_plans") -> int:
    """Return `max_plans` if it is an integer >= 1, else raise ValueError naming it."""
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise ValueError(f"{name} must be an integer >= 1 (plans per search), got {max_plans!r}")
    return max_plans


def limit_breakdown(p: Any, n_blocks: int | None = None) -> tuple[str, dict[str, Any]]:
    """Return what stops a plan that does not fit ('device memory', 'host RAM' or both) and its traced breakdown.

    The breakdown has each memory's need, limit and excess (bytes), the device peak's categories, the host
    lines, and, with `n_blocks` (checkpoints that may be split), the blocks' worth of checkpoints the host
    is over and the device could still take (`planner.offload_split`'s terms).
    """
    device_over = p.device_need_bytes - p.device_limit_bytes
    host_over = p.host_need_bytes - p.host_limit_bytes
    out: dict[str, Any] = {
        "device_need_bytes": p.device_need_bytes, "device_limit_bytes": p.device_limit_bytes, "device_over_bytes": device_over,
        "host_need_bytes": p.host_need_bytes, "host_limit_bytes": p.host_limit_bytes, "host_over_bytes": host_over,
        "device_categories": dict(sorted(p.by_category.items(), key=lambda kv: -kv[1])),
        "device_costs": {c.name: c.bytes for c in p.device_costs},
        "host_costs": {c.name: c.bytes for c in p.host_costs},
    }
    offloaded = out["host_costs"].get("offloaded checkpoints", 0)
    if n_blocks and offloaded:
        per_block = -(-offloaded // n_blocks)
        out["checkpoint_block_bytes"] = per_block
        out["blocks_host_must_shed"] = max(0, -(-host_over // per_block))
        out["blocks_device_can_take"] = max(0, -device_over // per_block)
        # a split moves blocks from host to device: the memory that still runs short after the best split
        if out["blocks_host_must_shed"] > out["blocks_device_can_take"]:
            short = out["blocks_host_must_shed"] * per_block - max(0, -device_over)
            out["short_after_split_bytes"] = short
    what = [w for w, over in (("device memory", device_over > 0), ("host RAM", host_over > 0)) if over]
    if n_blocks and offloaded and not device_over > 0 and host_over > 0:
        what = ["device memory and host RAM together (no split of the checkpoints fits both)"]
    return " and ".join(what) or "nothing (it fits)", out


def _changed_fields(recipe: Recipe) -> dict[str, Any]:
    base = Recipe().to_dict()
    return {k: v for k, v in recipe.to_dict().items() if base[k] != v}


@dataclass
class ContextReport:
    """The longest trainable sequence per mode on a target (`longest_context`), each with its recipe."""

    model: str
    target: str
    results: dict[str, LongestSequence]
    skipped: dict[str, str]  # mode -> why it cannot be planned (a family without LoRA targets, ...)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "results": {m: r.to_dict() for m, r in self.results.items()},
                "skipped": self.skipped}

    def __str__(self) -> str:
        """Return the answer first: the longest sequence per mode, then the settings that reach it as `SFTConfig` /
        `LoraConfig` lines and what no Trainer setting says; lines of at most 100 characters (`explain()`: all)."""
        from colab_memopt.planning.hfconfig import recipe_settings
        from colab_memopt.core.measure import format_bytes
        from colab_memopt.planning.recommender import FINETUNE_LR
        from colab_memopt.core.wording import call_lines, wrap

        words = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}
        how = " and ".join(sorted({"traced" if r.method == "trace" else "estimated" for r in self.results.values()}))
        lines = [f"{self.model} on {self.target}, batch 1: the longest trainable sequence ({how})"]
        for mode, r in self.results.items():
            name = words.get(mode, mode)
            if not r.max_seq_len:
                lines += wrap(f"{name}: nothing fits at {r.step_tokens:,} tokens ({r.limited_by or 'see first_miss'})")
                continue
            nxt = (r.first_miss or {}).get("seq_len")
            lines += wrap(f"{name}: {r.max_seq_len:,} tokens, device {format_bytes(r.device_need_bytes or 0)}, host "
                          f"{format_bytes(r.host_need_bytes or 0)}"
                          + (f"; next limit: {r.limited_by}" + (f" at {nxt:,}" if nxt else "") if r.limited_by else ""))
            settings = recipe_settings(r.recipe, 1, r.max_seq_len)
            settings["training_args"]["learning_rate"] = FINETUNE_LR["lora" if settings["lora"] else "full"]
            lines += call_lines("SFTConfig", settings["training_args"])
            if settings["lora"]:
                lines += call_lines("LoraConfig", settings["lora"])
            if settings["bnb"]:
                lines += call_lines("BitsAndBytesConfig", settings["bnb"])
            beyond = [m.split(" (", 1)[0] for m in settings["not_expressible"]]
            if beyond:
                lines += wrap("beyond a Trainer setting (colab_memopt's training loop runs them): " + ", ".join(beyond),
                              first="  ", rest="    ")
        lines += [line for m, why in self.skipped.items() for line in wrap(f"{words.get(m, m)}: not planned: {why}")]
        lines.append("the recipes, limits and search notes: .explain() (command line: --verbose)")
        return "\n".join(lines)

    def explain(self) -> str:
        """Return every mode's recipe fields, next limit and search note (what `--verbose` prints)."""
        from colab_memopt.core.measure import format_bytes

        methods = ", ".join(sorted({r.method for r in self.results.values()}))
        lines = [f"longest trainable sequence: {self.model} on {self.target}, batch 1 (planned: {methods})"]
        for mode, r in self.results.items():
            if not r.max_seq_len:
                lines.append(f"  {mode:5s}  nothing fits at {r.step_tokens} tokens ({r.limited_by or 'see first_miss'})")
                lines += [f"         note: {r.note}"] if r.note else []
                continue
            split = f", {r.offload_keep_blocks} blocks' checkpoints kept on the device" if r.offload_keep_blocks else ""
            lines.append(f"  {mode:5s}  {r.max_seq_len:>7,} tokens  device {format_bytes(r.device_need_bytes or 0)}, "
                         f"host {format_bytes(r.host_need_bytes or 0)}{split}")
            lines.append(f"         recipe {r.recipe}")
            if r.limited_by:
                nxt = (r.first_miss or {}).get("seq_len")
                lines.append(f"         next limit: {r.limited_by}" + (f" at {nxt:,} tokens" if nxt else ""))
            if r.note:
                lines.append(f"         note: {r.note}")
        lines += [f"  {mode:5s}  not planned: {why}" for mode, why in self.skipped.items()]
        return "\n".join(lines)


@shows_progress("context")
@quiet()
def longest_context(model: str, *, target: Any = "t4", modes: tuple[str, ...] = tuple(MODES), step_tokens: int = 1024,
                    max_plans: int = 12, method: str = "auto", host_base_bytes: int | None = None) -> ContextReport:
    """Return the longest trainable sequence of `model` on `target` for each mode, with the recipe that reaches it.

    Each mode runs `longest_sequence(model, mode=mode)`: the longest-context round's recipe (`long_context_recipe`:
    offloaded checkpoints split where the host is short, the loss by chunks, the MLP by tiles), searched by plans
    in steps of `step_tokens`. A mode the model cannot train (no LoRA targets) is left out with its reason.
    What `python -m colab_memopt context` prints.

    Example:
        >>> print(longest_context("llama-3.2-1b", modes=("full",)))
    """
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes must be among {list(MODES)}, got {m!r}")
    check_max_plans(max_plans)
    architectures.resolve_model(model)  # an unknown model: its own error, not one per mode
    results, skipped = {}, {}
    for m in modes:
        try:
            recipe = long_context_recipe(model, m, target)
        except ValueError as exc:  # e.g. a family with no LoRA targets: the mode cannot train, say why
            skipped[m] = str(exc)
            continue
        say(f"{m}: searching the longest sequence")
        results[m] = longest_sequence(model, recipe, mode=m, target=target, step_tokens=step_tokens, max_plans=max_plans,
                                      method=method, host_base_bytes=host_base_bytes, split_checkpoints=True)
    if not results:
        raise ValueError(f"no mode of {list(modes)} can be planned for {model!r}: {skipped}")
    return ContextReport(model, get_target(target).name, results, skipped)


RESULTS_DIR = Path(__file__).resolve().with_name("results")  # package data: the benchmarks' tables the notebooks show


def shipped_table(name: str) -> dict[str, Any] | None:
    """Return a table shipped with the package ('capacity' or 'context'), or None where this install lacks it.

    `benchmarks/capacity.py` and `benchmarks/context.py` write them; notebooks 15-17 show them.

    Example:
        >>> cm.capacity.shipped_table("context")["rows"][0]["model"]
    """
    import json

    if name not in ("capacity", "context"):
        raise ValueError(f"shipped_table takes 'capacity' or 'context', got {name!r}")
    path = RESULTS_DIR / f"{name}.json"
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    table["stale_target"] = stale_target(table)
    return table


def _table_target(table: dict[str, Any]) -> dict[str, Any]:
    """Return the target a shipped table was planned for: its name, device and host bytes, CUDA context, margin."""
    stored = table.get("target")
    if isinstance(stored, dict):  # context.json keeps the target whole
        return dict(stored)
    return {"name": stored, "device_bytes": table.get("device_bytes"), "host_bytes": table.get("host_bytes"),
            "cuda_context_bytes": table.get("cuda_context_bytes"), "headroom": table.get("headroom")}


def stale_target(table: dict[str, Any]) -> str | None:
    """Return None where a shipped table was planned for today's definition of its target (total, host RAM, CUDA
    context, margin); else one sentence saying what it was planned for and what the target is today.

    A table planned for an older definition still says what fit then; its figures are not today's plan.
    """
    from colab_memopt.core.measure import format_bytes

    then = _table_target(table)
    try:
        now_target = get_target(then.get("name") or "")
    except ValueError:
        return f"planned for a target this version does not define ({then.get('name')!r})"
    now = {"device_bytes": now_target.device_bytes, "host_bytes": now_target.host_bytes,
           "cuda_context_bytes": now_target.cuda_context_bytes, "headroom": DEFAULT_HEADROOM}
    differ = [k for k, v in now.items() if then.get(k) is not None and then[k] != v]
    if not differ:
        return None

    def says(d: dict[str, Any]) -> str:
        parts = [f"{format_bytes(d['device_bytes'])} total" if d.get("device_bytes") else None,
                 f"{format_bytes(d['cuda_context_bytes'])} CUDA context" if d.get("cuda_context_bytes") else None,
                 f"{d['headroom']:.0%} margin" if d.get("headroom") is not None else None,
                 f"{format_bytes(d['host_bytes'])} host RAM" if d.get("host_bytes") else None]
        return ", ".join(p for p in parts if p)

    return (f"planned for a {now_target.name} of {says(then)}; today's {now_target.name} is {says(now)}: "
            "these rows are what fit then, not today's plan")
