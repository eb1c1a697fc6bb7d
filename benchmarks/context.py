"""The longest sequence each named architecture trains at on a free Colab T4, per mode and recipe.

    python benchmarks/context.py [--models llama-3.1-8b ...] [--modes full lora qlora] [--recipes ...]

For each (model, mode full/LoRA/QLoRA, recipe): the longest multiple of 1024 tokens at batch 1 whose
PLANNED step fits a T4, device memory (14.56 GiB less the planner's 5% headroom, with the CUDA context
and cuBLAS workspace) and host RAM (12.7 GB less 5%) both (`capacity.longest_sequence`: a first guess
from the analytic estimate, then plans where the line through the spare bytes of the nearest plans reaches 0,
each a trace on fake tensors where the recipe traces; every row says which method it used). The host RAM counts a fresh Python process
that imports the training stack (measured here, in a subprocess), one batch of token ids and the
offloaded checkpoints; not the loading of real weights (these models have random weights).

Recipes (all fp16 autocast, traced in fp16 autocast; 8-bit AdamW for full fine-tuning, AdamW for the
adapters; LoRA rank 16 on the family's projections, QLoRA with an nf4 base):
- checkpoint-full: every block checkpointed, its input kept on the device; the plain loss.
- offload: every block checkpointed, its input in host RAM (checkpointing='offload').
- chunked-loss: checkpoint-full with the loss by chunks of 128 tokens (loss_chunk_tokens).
- offload+chunked-loss: both.
- offload+chunked-loss+fp16-base (LoRA and QLoRA only): both, with the frozen base (its embeddings and
  head included) stored in fp16 (`Recipe.base_dtype`, the recommender's default on a T4).
- offload+chunked-loss+in-backward (full fine-tuning only): both, in fp32 with 8-bit AdamW stepping each
  parameter inside backward (`adamw8bit_in_backward`): no full set of gradients is held.
- offload-split+chunked-loss+fp16-base+tiled-mlp (LoRA and QLoRA) and offload-split+chunked-loss+in-backward+
  tiled-mlp (full fine-tuning): as above, with each block's MLP run by tiles of 4,096 tokens
  (`Recipe.mlp_tile_tokens`, `tiling`) and the checkpoints split between device and host where all of them do
  not fit the host (`longest_sequence(split_checkpoints=True)`, `planner.offload_split`; the row's
  `offload_keep_blocks`). These rows search in steps of 4,096 tokens from the targets up (each 8B plan takes
  minutes on 2 shared cores), and say what limits the next step (`limited_by`, `breakdown`).
- long-context-round (every mode): `capacity.long_context_recipe`, what `python -m colab_memopt context` plans: as
  the tiled rows, with each Llama-style RMSNorm by tiles (`Recipe.norm_tile_tokens`: its 16-bit input and a scale
  per token saved, not an fp32 copy), grouped-query K/V repeated before SDPA (`attention='sdpa_repeated_kv'`: a T4
  runs the O(T) kernel only so), and where the host cannot hold one checkpoint per block, one per 2, 4, ... blocks
  (`checkpoint_interval`, two-level offload). Rows say `attention_rule`; grouped-query rows without it were planned
  with the O(T) kernel for calls a T4 runs with math: kept, marked `stale`, and left out of `best` and `targets`.
`--tiled-block` measures (not plans) one checkpointed Llama-shaped block's forward and backward on the CPU,
its MLP untiled and tiled (`tiling.measure_tiled_block`): the peak saved and the time it costs.
Each plan is cached in build/context_cache.json, so an interrupted run resumes. Writes
colab_memopt/planning/results/context.json after every row (package data: notebook 17 reads it from an installed
package too) and prints the table last.
Targets: Llama-3.1-8B QLoRA >= 49,152 tokens (stretch 65,536); Llama-3.2-1B full >= 32,768.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from colab_memopt import __version__ as cm_version
from colab_memopt.techniques.architectures import ARCHITECTURES
from colab_memopt.planning.capacity import longest_sequence
from colab_memopt.core.fileio import write_json
from colab_memopt.techniques.loss import DEFAULT_CHUNK_TOKENS
from colab_memopt.core.measure import format_bytes
from colab_memopt.planning.targets import get_target
from colab_memopt.training.presets import mixed_precision, mode_fields
from colab_memopt.training.recipe import Recipe
from colab_memopt.planning.candidates import long_context_recipe

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "colab_memopt" / "planning" / "results" / "context.json"  # shipped in the wheel (pyproject package-data)
CACHE = ROOT / "build" / "context_cache.json"
# The targets first, then the rest, smallest first.
MODELS = ["llama-3.1-8b", "llama-3.2-1b", "smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "gpt2", "qwen2.5-1.5b",
          "smollm2-1.7b", "llama-3.2-3b"]
RECIPES = {
    "checkpoint-full": dict(checkpointing="full"),
    "offload": dict(checkpointing="offload"),
    "chunked-loss": dict(checkpointing="full", loss_chunk_tokens=DEFAULT_CHUNK_TOKENS),
    "offload+chunked-loss": dict(checkpointing="offload", loss_chunk_tokens=DEFAULT_CHUNK_TOKENS),
    # Full fine-tuning only: fp32 (an optimizer that steps inside backward cannot run under fp16's GradScaler),
    # each gradient freed as soon as its parameter steps, so no full set of gradients is ever held.
    "offload+chunked-loss+in-backward": dict(checkpointing="offload", loss_chunk_tokens=DEFAULT_CHUNK_TOKENS,
                                             precision="fp32", optimizer="adamw8bit_in_backward"),
}
# LoRA and QLoRA (the recommender's default on a T4): the frozen base, embeddings and head included, in fp16.
RECIPES["offload+chunked-loss+fp16-base"] = dict(checkpointing="offload", loss_chunk_tokens=DEFAULT_CHUNK_TOKENS,
                                                  base_dtype="fp16")
# the MLP by sequence tiles, the checkpoints split between device and host
MLP_TILE_TOKENS = 4096
RECIPES["offload-split+chunked-loss+fp16-base+tiled-mlp"] = dict(
    RECIPES["offload+chunked-loss+fp16-base"], mlp_tile_tokens=MLP_TILE_TOKENS)
RECIPES["offload-split+chunked-loss+in-backward+tiled-mlp"] = dict(
    RECIPES["offload+chunked-loss+in-backward"], mlp_tile_tokens=MLP_TILE_TOKENS)
# The longest-context round (`capacity.long_context_recipe`, what `python -m colab_memopt context` plans): as the
# tiled row above, with each Llama-style RMSNorm by tiles (norm_tile_tokens), grouped-query K/V repeated before SDPA
# (a T4 runs the O(T) kernel only so), and where the host cannot hold one checkpoint per block, one per 2, 4, ...
# blocks (checkpoint_interval, two-level offload). Each row's `recipe` holds what it used.
ROUND = "long-context-round"
RECIPES[ROUND] = dict(RECIPES["offload-split+chunked-loss+fp16-base+tiled-mlp"], norm_tile_tokens=MLP_TILE_TOKENS,
                      attention="sdpa_repeated_kv (grouped-query models)",
                      checkpoint_interval="1, else 2, 4, ... where the host cannot hold one copy per block")
RECIPE_MODES = {"offload+chunked-loss+in-backward": ("full",), "offload+chunked-loss+fp16-base": ("lora", "qlora"),
                "offload-split+chunked-loss+fp16-base+tiled-mlp": ("lora", "qlora"),
                "offload-split+chunked-loss+in-backward+tiled-mlp": ("full",)}
SPLIT_RECIPES = {"offload-split+chunked-loss+fp16-base+tiled-mlp", "offload-split+chunked-loss+in-backward+tiled-mlp", ROUND}
TARGETS = {("llama-3.1-8b", "qlora"): (49152, 65536), ("llama-3.2-1b", "full"): (32768, None)}
STEP_TOKENS = 1024
SPLIT_STEP_TOKENS = 4096  # the tiled-MLP rows: a coarse step, from the target up
# the tiled block measured on the CPU: Llama-3.1-8B's proportions (intermediate 3.5 x hidden, 4 query heads per
# key/value head) at a width the CPU runs in seconds
TILED_BLOCK = dict(hidden_size=256, intermediate_size=896, num_attention_heads=8, num_key_value_heads=2,
                   tokens=2048, tile_tokens=256)
STACK = "import torch, transformers, peft, bitsandbytes, colab_memopt"
# Rows planned since the planner runs each SDPA call with the kernel the T4 picks (`attention.TargetAttention`: a
# grouped-query call without a mask runs math, T x T scores) carry this; older rows of grouped-query models were
# planned with the O(T) kernel, which a T4 runs only with K/V repeated: they are kept, marked stale, out of `best`.
ATTENTION_RULE = "t4 kernel per call"


def fresh_process_rss() -> int:
    """Return the RSS (bytes) of a fresh Python process that has imported the training stack."""
    code = f"{STACK}\nfrom colab_memopt.core.measure import host_memory\nprint(host_memory().rss_bytes)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ.copy())
    return int(out.stdout.strip().splitlines()[-1])


def recipe_for(mode: str, model: str, name: str, target: str = "t4") -> Recipe:
    if name == ROUND:
        return long_context_recipe(model, mode, target)
    optimizer = "adamw8bit" if mode == "full" else "adamw"
    return Recipe.from_dict({"precision": mixed_precision(target), "optimizer": optimizer, **RECIPES[name],
                             **mode_fields(mode, model)})  # the recipe's own precision and optimizer win


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--modes", nargs="+", default=["qlora", "full", "lora"])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--max-plans", type=int, default=12)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--cache", nargs="+", default=[str(CACHE)],
                        help="the plans' cache (JSON; the first is written); rows found in any are not planned again")
    parser.add_argument("--cached-only", action="store_true", help="plan nothing: write the rows the caches hold")
    parser.add_argument("--guess-tokens", type=int, default=None,
                        help="start the tiled-MLP rows' search here instead of at the target (rows already cached are "
                             "planned again; a cached row's plan at the target is kept as the row's 'at_target')")
    parser.add_argument("--tiled-block", action="store_true",
                        help="measure the tiled MLP on one Llama-shaped block (CPU) into the results; plan nothing")
    args = parser.parse_args(argv)
    if args.tiled_block:
        return _tiled_block(args.out)
    cache_path = Path(args.cache[0])
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    tgt = get_target("t4")
    base_rss = fresh_process_rss()
    cache: dict[str, dict] = {}
    for path in map(Path, reversed(args.cache)):
        cache.update(json.loads(path.read_text()) if path.exists() else {})
    rows, not_planned = [], []
    order = [(m, mode) for m in args.models for mode in args.modes]
    order.sort(key=lambda mm: (0 if mm in TARGETS else 1, args.models.index(mm[0]), args.modes.index(mm[1])))
    for model, mode in order:
        for name in args.recipes:
            if mode not in RECIPE_MODES.get(name, (mode,)):
                continue
            key = f"{model}|{mode}|{name}"
            earlier = cache.pop(key, None) if args.guess_tokens and name in SPLIT_RECIPES else None
            if key in cache:
                row = cache[key]
            elif args.cached_only:
                not_planned.append(key)
                continue
            else:
                try:
                    recipe = recipe_for(mode, model, name)  # a family without LoRA targets: a row saying so
                    split = name in SPLIT_RECIPES
                    guess = (args.guess_tokens or TARGETS.get((model, mode), (None,))[0]) if split else None
                    res = longest_sequence(model, recipe, mode=mode, target=tgt,
                                           step_tokens=SPLIT_STEP_TOKENS if split else STEP_TOKENS,
                                           host_base_bytes=base_rss, max_plans=args.max_plans,
                                           split_checkpoints=split, guess_tokens=guess)
                    row = {"recipe_name": name, **res.to_dict(), "host_base_bytes": base_rss, "attention_rule": ATTENTION_RULE}
                    need = TARGETS.get((model, mode), (None,))[0]
                    if earlier and need and row["max_seq_len"] < need and (earlier.get("first_miss") or {}).get("seq_len") == need:
                        # the earlier search's plan at the target: what stops the target, traced
                        row["at_target"] = {"first_miss": earlier["first_miss"], "limited_by": earlier.get("limited_by"),
                                            "breakdown": earlier.get("breakdown")}
                except Exception as exc:  # noqa: BLE001 - a row that cannot be planned says why
                    row = {"model": model, "mode": mode, "recipe_name": name, "recipe": RECIPES[name],
                           "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
                cache[key] = row
                cache_path.parent.mkdir(parents=True, exist_ok=True)
                cache_path.write_text(json.dumps(cache, indent=1))
            rows.append(row)
            print(f"{model:14s} {mode:6s} {name:22s} max {row.get('max_seq_len', '-')!s:>7s} "
                  f"({row.get('method', row.get('error', ''))}, {row.get('plans', 0)} plans, {row.get('seconds', 0):.0f} s) "
                  f"device {format_bytes(row.get('device_need_bytes') or 0)} host {format_bytes(row.get('host_need_bytes') or 0)}",
                  flush=True)
            _write(args.out, rows, tgt, base_rss, start, not_planned)
    _write(args.out, rows, tgt, base_rss, start, not_planned)
    return 0


def _grouped_query(model: str) -> bool:
    cfg = ARCHITECTURES[model].config
    return cfg.get("num_key_value_heads", cfg.get("num_attention_heads")) != cfg.get("num_attention_heads")


def _write(out: str, rows: list[dict], tgt, base_rss: int, start: float, not_planned: list[str]) -> None:
    best: dict[str, dict] = {}
    for r in rows:
        if r.get("attention_rule") != ATTENTION_RULE and _grouped_query(r["model"]):
            r["stale"] = ("planned with SDPA's O(T) kernel for grouped-query attention, which a T4 runs only with K/V "
                          "repeated (attention='sdpa_repeated_kv'): shorter in truth; not in best")
            continue
        k = f"{r['model']}/{r['mode']}"
        if "max_seq_len" in r and (k not in best or r["max_seq_len"] > best[k]["max_seq_len"]):
            best[k] = {"max_seq_len": r["max_seq_len"], "recipe_name": r["recipe_name"], "recipe": r["recipe"],
                       "at_target": r.get("at_target"),
                       "host_need_bytes": r["host_need_bytes"], "device_need_bytes": r["device_need_bytes"],
                       "method": r["method"], "offload_keep_blocks": r.get("offload_keep_blocks"),
                       "limited_by": r.get("limited_by")}
    targets = []
    for (model, mode), (need, stretch) in TARGETS.items():
        got = best.get(f"{model}/{mode}")
        if got is None:
            continue
        targets.append({"model": model, "mode": mode, "target_tokens": need, "stretch_tokens": stretch,
                        "max_seq_len": got["max_seq_len"], "met": got["max_seq_len"] >= need,
                        "stretch_met": None if stretch is None else got["max_seq_len"] >= stretch,
                        "recipe_name": got["recipe_name"], "method": got["method"],
                        "limited_by": got.get("limited_by"), "at_target": got.get("at_target")})
    previous = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    write_json(out, {
        "target": {"name": tgt.name, "device_bytes": tgt.device_bytes, "host_bytes": tgt.host_bytes,
                   "cuda_context_bytes": tgt.cuda_context_bytes, "headroom": 0.05},
        "batch": 1, "step_tokens": STEP_TOKENS, "host_base_bytes": base_rss,
        "host_base_source": f"RSS of a fresh `python -c '{STACK}'` on this machine (each row keeps the figure it used)",
        "device": f"planned on {platform.machine()} CPU ({os.cpu_count()} threads), torch {torch.__version__}, "
                  f"colab_memopt {cm_version}",
        "recipes": RECIPES, "recipe_modes": RECIPE_MODES, "rows": rows, "best": best, "targets": targets,
        "not_planned": not_planned,
        "seconds": time.perf_counter() - start,
        **({"tiled_mlp": previous["tiled_mlp"]} if "tiled_mlp" in previous else {}),
    })


def _tiled_block(out: str) -> int:
    """Measure one checkpointed Llama-shaped block, its MLP untiled and tiled, and add it to the results."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from colab_memopt.techniques.tiling import measure_tiled_block

    dims = {k: v for k, v in TILED_BLOCK.items() if k not in ("tokens", "tile_tokens")}
    config = LlamaConfig(**dims, attn_implementation="sdpa")
    res = measure_tiled_block(lambda: LlamaDecoderLayer(config, 0), TILED_BLOCK["tokens"], TILED_BLOCK["tile_tokens"],
                              hidden=config.hidden_size, repeat=3)
    res.update({"block": {**dims, "family": "llama", "dtype": "fp32"},
                "device": f"measured on {platform.machine()} CPU ({os.cpu_count()} threads, shared), torch {torch.__version__}",
                "load_average_after": os.getloadavg()[0],  # the step times are only as good as the machine was quiet
                "what": "one checkpointed decoder block's forward + backward (its recomputation included), "
                        "measure.measure_step, median of 3 timed steps"})
    results = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    results["tiled_mlp"] = res
    write_json(out, results)
    print(f"tiled MLP: peak {format_bytes(res['untiled_peak_bytes'])} -> {format_bytes(res['tiled_peak_bytes'])} "
          f"({res['saving_pct']:.1f}% saved), time {res['untiled_seconds']:.2f} s -> {res['tiled_seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
