"""The largest model that fits a free Colab T4, per training mode and sequence length, under the best recipe.

    python benchmarks/capacity.py [--target t4] [--seq 512 2048]

For full fine-tuning, LoRA and QLoRA at each sequence length: the largest of the named real
architectures that fits under the leanest candidate recipe of `recommend` (batch 1, 10% headroom),
and a coarse search over size: the base architecture's depth bisected (Llama-3.2-1B's shape for full
fine-tuning, Llama-3.1-8B's for the adapters). Every figure is the analytic estimate (the planner's
fallback path; a trace of an 8B model takes tens of seconds here), plus the target's CUDA context.
Full fine-tuning also considers the recipes of `capacity.FULL_CANDIDATES` (GaLore 8-bit per
layer, APOLLO, APOLLO-Mini, torchao's 8-bit and 4-bit AdamW, BAdam, each with every precision and
checkpointing option it allows; and 16-bit weights without a master copy: AdamW with Kahan-compensated
updates, LOMO, AdaLomo) and 8-bit weights (`capacity.INT8_CANDIDATES`: AdaLomo or LOMO with int8 weights,
16-bit compute, scaled on Llama-3.1-8B's width); its rows list the largest model each candidate fits
(`candidates`) and which one wins, with the candidate optimizer's loss gap to fp32 AdamW measured by
benchmarks/optimizer_quality.py on this CPU (benchmarks/results/optimizer_quality.json: from scratch, and
for 8-bit weights fine-tuned from a trained checkpoint, key 'finetune'). The named models for full
fine-tuning try 8-bit weights where no recipe with 16-bit weights fits (as `recommend` does), and the
largest named one is confirmed by the planner's trace (`planner.plan(method='trace')`), stepping down a
model while the trace says it does not fit.
Writes colab_memopt/planning/results/capacity.json (package data: notebook 16 reads it from an installed package too)
and prints the table last.
Targets: full fine-tuning of >= 2B parameters at 512 tokens; QLoRA of >= 8B at 2048 tokens;
full fine-tuning of >= 4B at 2048 tokens (with 16-bit weights or almost no optimizer state).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from colab_memopt import capacity
from colab_memopt.core.fileio import write_json
from colab_memopt.core.measure import format_bytes
from colab_memopt.planning.targets import get_target

OUT = Path(__file__).resolve().parent.parent / "colab_memopt" / "planning" / "results" / "capacity.json"  # shipped in the wheel
MODELS = ["smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "llama-3.2-1b", "qwen2.5-1.5b", "smollm2-1.7b", "llama-3.2-3b", "llama-3.1-8b"]
SCALE_BASE = {"full": "llama-3.2-1b", "lora": "llama-3.1-8b", "qlora": "llama-3.1-8b"}
INT8_SCALE_BASE = "llama-3.1-8b"  # 8-bit weights: at Llama-3.2-1B's width the depth would run past any real model
TARGETS = {("full", 512): 2e9, ("full", 2048): 4e9, ("qlora", 2048): 8e9}
QUALITY = Path(__file__).resolve().parent / "results" / "optimizer_quality.json"
QUALITY_GAP_PCT = 3.0  # the capacity recipe should end within 3% of fp32 AdamW's loss


def _loss_gaps(path: Path = QUALITY) -> dict[str, dict]:
    """Return optimizer -> its row of benchmarks/optimizer_quality.json (empty if not run)."""
    from colab_memopt.core.fileio import read_json

    if not path.exists():
        return {}
    data = read_json(path)
    meta = {k: data[k] for k in ("model", "steps", "batch", "seq_len", "device")}
    return {r["optimizer"]: {"loss_gap_pct": r["loss_gap_pct"], "val_loss": r["val_loss"], **meta} for r in data["rows"]}


def _finetune_gaps(path: Path = QUALITY) -> dict[str, dict]:
    """Return method -> its fine-tuning row (from a trained checkpoint) of optimizer_quality.json's 'finetune'."""
    from colab_memopt.core.fileio import read_json

    if not path.exists():
        return {}
    ft = read_json(path).get("finetune") or {}
    return {r["method"]: {"loss_gap_pct": r["loss_gap_pct"], "val_loss": r["val_loss"], "best_lr": r["best_lr"],
                          "model": ft.get("model"), "steps": ft.get("steps")}
            for r in ft.get("rows", []) if r.get("start") == "checkpoint"}


GAP_FROM_SCRATCH = "optimizer_quality.json rows: from scratch"
GAP_FINETUNE = "optimizer_quality.json finetune: from a trained checkpoint, each method at its best learning rate"


def _gap(cand: str, recipe, gaps: dict[str, dict], ft_gaps: dict[str, dict]) -> tuple[float | None, str | None]:
    """Return (loss gap % to fp32 AdamW, where it was measured) of a candidate, or (None, None) if not measured.

    8-bit weights: the fine-tuning row of the candidate's own name (their only measurement); the others: the
    from-scratch row of the candidate's name (16-bit weights), else of its optimizer (fp32 weights)."""
    weight_dtype = getattr(recipe, "weight_dtype", None) if recipe is not None else None
    if cand in capacity.INT8_CANDIDATES or weight_dtype == "int8":
        name = cand if cand in capacity.INT8_CANDIDATES else next(
            (n for n, f in capacity.INT8_CANDIDATES.items() if f["optimizer"] == recipe.optimizer), cand)
        row = ft_gaps.get(name)
        return (row["loss_gap_pct"], GAP_FINETUNE) if row else (None, None)
    optimizer = recipe.optimizer if recipe is not None else ""
    if not cand and recipe is not None and recipe.precision in ("fp16", "bf16"):  # a named fit: its 16-bit candidate
        cand = next((n for n, f in capacity.FULL_CANDIDATES.items() if f.get("precision") == capacity.PURE16
                     and f["optimizer"] == optimizer and f.get("update_rounding", recipe.update_rounding) == recipe.update_rounding), "")
    row = gaps.get(cand, gaps.get(optimizer, {}))
    return (row["loss_gap_pct"], GAP_FROM_SCRATCH) if row else (None, None)


def _candidate_rows(seq: int, tgt, gaps: dict[str, dict], ft_gaps: dict[str, dict], *,
                    trace_scaled: bool = True) -> tuple[dict, dict]:
    """Return (per full fine-tuning candidate: the largest scaled model it fits, the winner) at `seq` tokens."""
    out = {}
    recipes = {}
    bases = {}
    for cand in ("recommend", *capacity.FULL_CANDIDATES, *capacity.INT8_CANDIDATES):
        bases[cand] = INT8_SCALE_BASE if cand in capacity.INT8_CANDIDATES else SCALE_BASE["full"]
        deepest, _ = capacity.largest_scaled(bases[cand], mode="full", seq_len=seq, target=tgt, max_layers=128,
                                             candidates=cand)
        optimizer = deepest.recipe.optimizer if deepest else None
        recipes[cand] = deepest.recipe if deepest else None
        gap, source = _gap(cand, deepest.recipe if deepest else None, gaps, ft_gaps)
        out[cand] = {"largest_scaled_params": deepest.params if deepest else 0,
                     "largest_scaled_layers": int(deepest.model.rsplit("-", 1)[1][:-1]) if deepest else 0,
                     "scaled_base": bases[cand],
                     "need_bytes": deepest.need_bytes if deepest else None,
                     "recipe": deepest.recipe_name if deepest else None, "optimizer": optimizer,
                     "loss_gap_pct": gap, "loss_gap_source": source, "planned_by": "analytic"}
    def largest(items):
        return max(items, key=lambda kv: (kv[1]["largest_scaled_params"], -(kv[1]["need_bytes"] or 0)), default=None)

    name, best = largest(out.items())
    # The quality target: within 3% of fp32 AdamW's loss after the same steps (measured gaps only).
    close = largest([kv for kv in out.items() if kv[1]["loss_gap_pct"] is not None and kv[1]["loss_gap_pct"] <= QUALITY_GAP_PCT])
    winner = {"candidate": name, **best}
    winner["within_gap"] = {"max_loss_gap_pct": QUALITY_GAP_PCT, **({"candidate": close[0], **close[1]} if close else {"candidate": None})}
    # The analytic screen is optimistic for some recipes (it under-counts the 16-bit optimizers' transients, and
    # under autocast the checkpointed blocks' fp32 inputs): the winner and the best within the loss gap are traced
    # on fake tensors, fully checkpointed (the leanest activations), depth by depth to the traced boundary.
    done: dict[str, dict] = {}  # the winner is often also the best within the gap: traced once
    for entry in (winner, winner["within_gap"]) if trace_scaled else ():
        cand = entry.get("candidate")
        recipe = recipes.get(cand)
        if recipe is not None and cand not in done:
            done[cand] = capacity.largest_scaled_for(bases[cand], recipe.with_(checkpointing="full"), seq_len=seq,
                                                     target=tgt, headroom=0.10, max_layers=128)
        if cand in done:
            entry["traced"] = {"checkpointing": "full", **done[cand]}
    if not trace_scaled:
        for entry in (winner, winner["within_gap"]):
            entry["note"] = "not traced (--no-trace-scaled): the depth is the analytic estimate's"
    return out, winner


def _named_fit(model: str, mode: str, seq: int, tgt, ft_gaps: dict[str, dict]) -> capacity.Fit:
    """Return the leanest fit of a named model; for full fine-tuning where none with 16-bit weights fits, the
    8-bit-weight candidate that fits with the smallest measured loss gap (else the leanest of them)."""
    f = capacity.best_fit(model, mode=mode, seq_len=seq, target=tgt)
    if mode != "full" or f.fits:
        return f
    int8 = [(cand, capacity.best_fit(model, mode=mode, seq_len=seq, target=tgt, candidates=cand))
            for cand in capacity.INT8_CANDIDATES]
    fitting = [(ft_gaps.get(cand, {}).get("loss_gap_pct", float("inf")), g.need_bytes, g) for cand, g in int8 if g.fits]
    if fitting:
        return min(fitting, key=lambda t: t[:2])[2]
    return min([f, *(g for _, g in int8)], key=lambda g: g.need_bytes)


def _traced_named(fit: capacity.Fit, tgt) -> dict:
    """Return the planner's trace of a named fit (batch 1, the fit's recipe, 10% headroom): need, fits, seconds."""
    from colab_memopt.planning.planner import plan

    try:
        p = plan(fit.model, 1, seq_len=fit.seq_len, recipe=fit.recipe, target=tgt, headroom=0.10, find_max_batch=False,
                 method="trace")
    except Exception as exc:  # noqa: BLE001 - a step the planner cannot trace keeps its analytic answer, saying why
        return {"planned_by": "analytic", "need_bytes": fit.need_bytes, "limit_bytes": fit.limit_bytes, "fits": fit.fits,
                "note": f"not traced: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}", "plan_seconds": None}
    return {"planned_by": p.method, "need_bytes": p.device_need_bytes, "limit_bytes": p.device_limit_bytes,
            "fits": p.fits_device, "host_need_bytes": p.host_need_bytes, "fits_host": p.fits_host, "peak_bytes": p.peak_bytes,
            "plan_seconds": round(p.seconds, 1)}


def _why(fit: capacity.Fit) -> str:
    """Return the categories at the analytic peak of a fit's recipe, largest first."""
    parts = sorted(((c, b) for c, b in fit.categories().items() if b), key=lambda cb: -cb[1])
    return ", ".join(f"{c} {format_bytes(b)}" for c, b in parts)


# -- 8-bit trainable weights (int8train), planned by trace on fake tensors ------------------------------
INT8_RECIPE = {"optimizer": "adalomo", "precision": "fp16", "weight_dtype": "int8", "checkpointing": "full",
               "loss_chunk_tokens": 128}
# (name, our architecture name or the public config.json's fields); Qwen2.5-7B and Mistral-7B are not among
# `architectures.ARCHITECTURES`: their configs are given here, from their model cards' config.json.
INT8_MODELS = [
    ("llama-3.1-8b", "llama-3.1-8b"),
    ("qwen2.5-7b", ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                        max_position_embeddings=131072, tie_word_embeddings=False))),
    ("mistral-7b-v0.3", ("MistralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                               num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                                               max_position_embeddings=32768, tie_word_embeddings=False,
                                               sliding_window=None))),
    ("llama-3.2-3b", "llama-3.2-3b"),
]
INT8_SEQS = {"llama-3.1-8b": (2048, 4096, 512)}


def _int8_model(spec):
    if isinstance(spec, str):
        return spec
    import transformers

    cls, values = spec
    return getattr(transformers, cls)(**values)


def _plan_row(name: str, model, seq: int, recipe, tgt, headroom: float) -> dict:
    from colab_memopt.planning.planner import plan

    from colab_memopt import architectures

    p = plan(model, 1, seq_len=seq, recipe=recipe, target=tgt, headroom=headroom, find_max_batch=False, method="trace")
    with torch.device("meta"):
        params = sum(t.numel() for t in {id(t): t for t in architectures.resolve_model(model).build().parameters()}.values())
    return {"model": name, "params": params, "seq_len": seq, "method": p.method, "fits": p.fits, "fits_device": p.fits_device,
            "fits_host": p.fits_host, "device_need_bytes": p.device_need_bytes, "device_limit_bytes": p.device_limit_bytes,
            "host_need_bytes": p.host_need_bytes, "host_limit_bytes": p.host_limit_bytes,
            "peak_bytes": p.peak_bytes, "by_category": p.by_category, "by_phase": p.by_phase,
            "device_costs": {c.name: c.bytes for c in p.device_costs}, "host_costs": {c.name: c.bytes for c in p.host_costs},
            "analytic_peak_bytes": p.analytic_peak_bytes, "plan_seconds": round(p.seconds, 1)}


def int8_rows(tgt, headroom: float = 0.10, out: str = str(OUT), scaled: bool = True) -> dict:
    """Plan full fine-tuning with 8-bit weights (`INT8_RECIPE`) by trace: the named models, and the deepest
    Llama-3.1-8B-shaped model at 512 and 2,048 tokens; add them to capacity.json under 'int8_weights'."""
    from colab_memopt.core.fileio import read_json
    from colab_memopt.training.recipe import Recipe

    start = time.perf_counter()
    recipe = Recipe.from_dict(INT8_RECIPE)
    data = read_json(out) if Path(out).exists() else {}
    previous = data.get("int8_weights", {})
    section = {"recipe": INT8_RECIPE, "target": tgt.name, "headroom": headroom,
               "method": "planner.plan(method='trace'): the step traced on fake tensors, plus the CUDA context; host RAM "
                         "counted (this process's RSS, the batch in flight)", "named": [], "scaled": []}

    def save() -> None:
        section["seconds"] = round(time.perf_counter() - start, 1)
        data["int8_weights"] = section
        write_json(out, data)

    if previous.get("recipe") == INT8_RECIPE and previous.get("headroom") == headroom:  # resume: keep rows planned before
        section["named"] = list(previous.get("named", []))
        section["scaled"] = list(previous.get("scaled", []))
    done = {(r["model"], r["seq_len"]) for r in section["named"]}

    def named(name: str, spec, seq: int) -> None:
        if (name, seq) in done:
            return
        row = _plan_row(name, _int8_model(spec), seq, recipe, tgt, headroom)
        section["named"].append(row)
        print(f"  {name:16s} {seq:5d}: {'fits' if row['fits'] else 'does NOT fit'}, device "
              f"{format_bytes(row['device_need_bytes'])} of {format_bytes(row['device_limit_bytes'])}, host "
              f"{format_bytes(row['host_need_bytes'])} ({row['plan_seconds']} s)", flush=True)
        save()

    # Most important first (this machine's CPU time is short): the 8B model at 2,048, 4,096 and 512 tokens, the
    # deepest 8B-shaped model (analytic bisection, then one trace at its answer and one a layer deeper), then the
    # other named models. A run resumes where the last one stopped (rows already in the JSON are kept).
    for seq in INT8_SEQS["llama-3.1-8b"]:
        named("llama-3.1-8b", "llama-3.1-8b", seq)
    if scaled and not section["scaled"]:
        for seq in (2048, 512):
            deepest = capacity.largest_scaled_for("llama-3.1-8b", recipe, seq_len=seq, target=tgt, headroom=headroom,
                                                  max_layers=128, trace=False)
            entry = {"base": "llama-3.1-8b", "seq_len": seq, **deepest}
            for key, layers in (("traced_at_answer", deepest["layers"]), ("traced_one_deeper", deepest["layers"] + 1)):
                name = capacity.scaled("llama-3.1-8b", layers)
                row = _plan_row(name, lambda name=name: capacity._SCALED[name].build(), seq, recipe, tgt, headroom)
                entry[key] = {k: row[k] for k in ("params", "fits", "device_need_bytes", "device_limit_bytes",
                                                  "host_need_bytes", "by_category", "plan_seconds")}
                entry[key]["layers"] = layers
            section["scaled"].append(entry)
            a, b = entry["traced_at_answer"], entry["traced_one_deeper"]
            print(f"  llama-3.1-8b shape, {seq} tokens: {deepest['layers']} layers, {deepest['params'] / 1e9:.2f}B by the "
                  f"analytic search; traced: {'fits' if a['fits'] else 'does NOT fit'} ({format_bytes(a['device_need_bytes'])}), "
                  f"one layer deeper {'fits' if b['fits'] else 'does NOT fit'} ({format_bytes(b['device_need_bytes'])})", flush=True)
            save()
    for name, spec in INT8_MODELS:
        for seq in INT8_SEQS.get(name, (2048, 512)):
            named(name, spec, seq)
    fitting = {}
    for row in section["named"]:
        if row["fits"] and row["seq_len"] in (512, 2048):
            fitting.setdefault(row["seq_len"], []).append(row["model"])
    params = {row["model"]: row["params"] for row in section["named"]}
    section["largest_named"] = {str(seq): max(models, key=params.get) for seq, models in fitting.items()}
    save()
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="t4")
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--modes", nargs="+", default=["full", "lora", "qlora"])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--int8-only", action="store_true",
                        help="only plan the 8-bit-weight rows by trace and add them to the JSON as 'int8_weights'")
    parser.add_argument("--no-scaled", action="store_true", help="with --int8-only: skip the deepest-model search")
    parser.add_argument("--no-trace-scaled", action="store_true",
                        help="full fine-tuning: leave the deepest scaled models analytic (the named ones are still traced)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    tgt = get_target(args.target)
    if args.int8_only:
        int8_rows(tgt, out=args.out, scaled=not args.no_scaled)
        print(f"wrote {args.out}")
        return 0
    models = sorted(MODELS, key=capacity.model_params)
    gaps = _loss_gaps()
    ft_gaps = _finetune_gaps()
    rows = []
    for mode in args.modes:
        for seq in args.seq:
            named = None
            first_miss = None
            fits: list[capacity.Fit] = []
            for m in models:
                f = _named_fit(m, mode, seq, tgt, ft_gaps)
                if f.fits:
                    named = f
                    fits.append(f)
                else:
                    first_miss = f
                    break
            traced_named = None
            if mode == "full":  # the largest named model by trace: step down while the trace says it does not fit
                while fits:
                    traced_named = _traced_named(fits[-1], tgt)
                    print(f"  full {seq}: {fits[-1].model} by trace: {format_bytes(traced_named['need_bytes'])} of "
                          f"{format_bytes(traced_named['limit_bytes'])} ({traced_named['plan_seconds']} s)", flush=True)
                    if traced_named["fits"]:
                        break
                    first_miss = fits.pop()
                    traced_named = None
                named = fits[-1] if fits else None
            deepest, too_deep = capacity.largest_scaled(SCALE_BASE[mode], mode=mode, seq_len=seq, target=tgt, max_layers=128)
            best_params = max(named.params if named else 0, deepest.params if deepest else 0)
            row = {
                "mode": mode, "seq_len": seq, "limit_bytes": (named or first_miss).limit_bytes,
                "largest_named_model": named.model if named else None, "largest_named_params": named.params if named else 0,
                "largest_named_need_bytes": named.need_bytes if named else None,
                "largest_named_recipe": named.recipe_name if named else None,
                "next_named_model": first_miss.model if first_miss else None,
                "next_named_short_bytes": first_miss.need_bytes - first_miss.limit_bytes if first_miss else None,
                "scaled_base": SCALE_BASE[mode], "largest_scaled_params": deepest.params if deepest else 0,
                "largest_scaled_layers": int(deepest.model.rsplit("-", 1)[1][:-1]) if deepest else 0,
                "largest_params": best_params,
            }
            if mode == "full":
                row["candidates"], row["winner"] = _candidate_rows(seq, tgt, gaps, ft_gaps, trace_scaled=not args.no_trace_scaled)
                named_gap, named_source = _gap("", named.recipe, gaps, ft_gaps) if named else (None, None)
                row["largest_named_loss_gap_pct"] = named_gap
                row["largest_named_loss_gap_source"] = named_source
                row["largest_named_planned_by"] = traced_named["planned_by"] if traced_named else "analytic"
                row["largest_named_traced"] = traced_named
            goal = TARGETS.get((mode, seq))
            if goal is not None:
                row["target_params"] = goal
                row["target_met"] = best_params >= goal
                if mode == "full" and "traced" in row["winner"]:  # planned by trace where traceable
                    traced = row["winner"]["traced"]
                    row["target_met_by_trace"] = traced["planned_by"] == "trace" and traced["params"] >= goal
                elif mode == "full" and traced_named and traced_named["planned_by"] == "trace":  # the named model's trace
                    row["target_met_by_trace"] = named.params >= goal
                if not row["target_met"]:
                    # The base shape deepened to the target size: what it needs and what dominates.
                    base = SCALE_BASE[mode]
                    per_layer = (capacity.model_params(capacity.scaled(base, 2)) - capacity.model_params(capacity.scaled(base, 1)))
                    layers = max(1, round((goal - capacity.model_params(capacity.scaled(base, 1))) / per_layer) + 1)
                    at_goal = capacity.best_fit(capacity.scaled(base, layers), mode=mode, seq_len=seq, target=tgt)
                    row["at_target"] = {
                        "model": at_goal.model, "params": at_goal.params, "need_bytes": at_goal.need_bytes,
                        "short_bytes": at_goal.need_bytes - at_goal.limit_bytes, "recipe": at_goal.recipe_name,
                        "why": _why(at_goal),
                    }
            rows.append(row)
    seconds = time.perf_counter() - start
    out = {
        "target": tgt.name, "device_bytes": tgt.device_bytes, "host_bytes": tgt.host_bytes, "headroom": 0.10,
        "method": ("analytic estimate (estimate.training_step_bytes) + CUDA context, leanest candidate recipe of recommend(); "
                   "full fine-tuning: the largest named model confirmed by the planner's trace"
                   + ("" if args.no_trace_scaled else ", and the winners' depths")),
        "planned_on": f"cpu ({torch.get_num_threads()} threads)", "seconds": seconds,
        "full_candidates": {**capacity.FULL_CANDIDATES, **capacity.INT8_CANDIDATES},
        "loss_gap_source": (f"benchmarks/results/optimizer_quality.json: validation loss % above fp32 AdamW after the same "
                            f"steps on the reference model on the CPU (each candidate's loss_gap_source says which run: "
                            f"from scratch, or fine-tuned from a trained checkpoint)"
                            if gaps else "not measured (run benchmarks/optimizer_quality.py)"),
        "rows": rows,
    }
    write_json(args.out, out)
    print(f"largest model that fits a {tgt.name} ({format_bytes(tgt.device_bytes)}, 10% headroom), batch 1, analytic plans, "
          f"{seconds:.0f} s:")
    for r in rows:
        line = (f"  {r['mode']:6s} {r['seq_len']:5d}: {r['largest_params'] / 1e9:5.2f}B "
                f"(named: {r['largest_named_model'] or '-'}; {r['scaled_base']} shape: {r['largest_scaled_layers']} layers)")
        if r.get("largest_named_traced"):
            t, gap = r["largest_named_traced"], r["largest_named_loss_gap_pct"]
            line += (f"\n           {r['largest_named_model']} by trace: {format_bytes(t['need_bytes'])} of "
                     f"{format_bytes(t['limit_bytes'])} ({r['largest_named_recipe']}); loss gap "
                     + ("not measured" if gap is None else f"{gap:+.2f}%"))
        if "target_params" in r:
            line += f"  target >= {r['target_params'] / 1e9:.0f}B: " + ("met" if r["target_met"] else "NOT met")
            if "target_met_by_trace" in r and "traced" in r["winner"]:
                t = r["winner"]["traced"]
                line += (f"; traced (winner, full checkpointing): {t['params'] / 1e9:.2f}B, "
                         + ("met" if r["target_met_by_trace"] else "NOT met"))
            elif "target_met_by_trace" in r:
                line += (f"; traced ({r['largest_named_model']}): {r['largest_named_params'] / 1e9:.2f}B, "
                         + ("met" if r["target_met_by_trace"] else "NOT met"))
            if not r["target_met"]:
                a = r["at_target"]
                line += (f"; a {a['params'] / 1e9:.2f}B model needs {format_bytes(a['need_bytes'])}, short by "
                         f"{format_bytes(a['short_bytes'])} under {a['recipe']} ({a['why']}): every recipe here keeps fp32 "
                         "weights (4 bytes per parameter); 16-bit weights without a master copy, or offload, are needed")
        print(line)
        if "winner" in r:
            for cand, c in r["candidates"].items():
                gap = "-" if c["loss_gap_pct"] is None else f"{c['loss_gap_pct']:+.2f}%"
                print(f"           {cand:24s} {c['largest_scaled_params'] / 1e9:5.2f}B  loss gap {gap:>8s}  {c['recipe']}")
            w, close = r["winner"], r["winner"]["within_gap"]
            gap = "not measured" if w["loss_gap_pct"] is None else f"loss gap {w['loss_gap_pct']:+.2f}%"
            print(f"           winner: {w['candidate']} ({w['largest_scaled_params'] / 1e9:.2f}B, {gap}); within "
                  f"{close['max_loss_gap_pct']:.0f}% of fp32 AdamW's loss: "
                  + (f"{close['candidate']} ({close['largest_scaled_params'] / 1e9:.2f}B, {close['loss_gap_pct']:+.2f}%)"
                     if close["candidate"] else "none measured"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
