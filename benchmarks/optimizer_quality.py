"""Loss of each full fine-tuning optimizer after the same steps as fp32 AdamW, and its measured state bytes.

    python benchmarks/optimizer_quality.py [--size small] [--steps 50] [--batch 8] [--seq 128]

Each optimizer of `OPTIMIZERS_COMPARED` trains the reference model (same seed, same initial weights,
same batches of the real-text corpus of `colab_memopt.techniques.data`, the recipe's default learning rate) for
the same number of steps on this CPU, in fp32; then the validation loss (`evaluation.evaluate`, the same
batches for all). `loss_gap_pct` is the % above fp32 AdamW's validation loss. Also measured, after the
last step: the optimizer-state bytes the memory tracker sees (`measure.measure_step`) against
`estimate.optimizer_state_bytes`, per parameter. GaLore's and APOLLO's ranks keep their defaults' share of
the capacity rows' width (`rank_for`), so the small model is not trained at full rank.
Writes benchmarks/results/optimizer_quality.json (read by benchmarks/capacity.py) and prints a table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from pathlib import Path

from typing import Any

import torch

import colab_memopt as cm
from colab_memopt import estimate
from colab_memopt.core.fileio import write_json
from colab_memopt.techniques.lowstate import PROJECTED
from colab_memopt.planning.candidates import FULL_CANDIDATES, PURE16

OUT = Path(__file__).resolve().parent / "results" / "optimizer_quality.json"
BASELINE = "adamw"
# GaLore's and APOLLO's ranks are scaled to the model's width with the share their defaults have of
# Llama-3.2-1B's width (2048), the capacity rows' base: GaLore 128/2048, APOLLO 256/2048 (APOLLO-Mini: 1).
CAPACITY_WIDTH = 2048
OPTIMIZERS_COMPARED = ["adamw", "adamw8bit", "galore_adamw8bit", "galore_adamw8bit_in_backward", "apollo", "apollo_mini",
                       "torchao_adamw8bit", "torchao_adamw4bit", "badam"]


# 16-bit weights without a master copy (capacity.FULL_CANDIDATES), measured under the candidate's name: bf16
# here (this CPU emulates fp16 matmuls slowly; the update rounding is the same code). LOMO is plain SGD
# fused into backward and moves nothing at AdamW's 1e-3: it runs at 0.05, the best of 0.05/0.1/0.2/0.4 on
# this model (notebook 16's sweep); AdaLomo's step is relative to the weight's scale (as Adafactor's): 3e-2,
# notebook 16's rate (at 1e-3 it ends 69% above AdamW after 50 steps); AdamW + Kahan at the shared rate.
LEARNING_RATES = {"lomo": 0.05, "adalomo": 3e-2}
SIXTEEN_BIT = {
    label: {**fields, "precision": "bf16", **({"lr": LEARNING_RATES[fields["optimizer"]]} if fields["optimizer"] in LEARNING_RATES else {})}
    for label, fields in FULL_CANDIDATES.items() if fields.get("precision") == PURE16
}


def rank_for(name: str, width: int) -> int | None:
    """Return the projection rank at `width` with the default rank's share of `CAPACITY_WIDTH` (None: no rank)."""
    base = name.removesuffix("_in_backward")
    if base not in PROJECTED or base == "apollo_mini":
        return None
    return max(1, round(width * PROJECTED[base] / CAPACITY_WIDTH))


def run(name: str, *, size: str, steps: int, batch: int, seq: int, corpus: cm.TextCorpus, seed: int = 0) -> dict:
    """Train one optimizer and return its losses, time and measured state bytes."""
    torch.manual_seed(seed)
    width = cm.build_model(size).config.d_model
    recipe = (cm.Recipe.from_dict(SIXTEEN_BIT[name]) if name in SIXTEEN_BIT
              else cm.Recipe(optimizer=name, optimizer_rank=rank_for(name, width)))
    model, opt = recipe.build(cm.build_model(size))
    n_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    log = cm.train(model, opt, corpus, steps=steps, batch_size=batch, seq_len=seq, seed=seed, recipe=recipe)
    seconds = time.perf_counter() - start
    step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq, seed=seed + 1, recipe=recipe)
    report = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = (None if name in SIXTEEN_BIT  # their model state is pinned by notebook 16 and tests/test_rounding.py
                else estimate.optimizer_state_bytes(trainable, name, model=model, rank=recipe.optimizer_rank))
    measured = report.resident_bytes["optimizer_state"]
    return {
        "optimizer": name, "optimizer_rank": recipe.optimizer_rank, "lr": recipe.lr, "precision": recipe.precision, "final_train_loss": log.train_loss[-1], "val_loss": log.val_loss,
        "train_loss": log.train_loss, "train_seconds": seconds, "params": n_params,
        "state_bytes_measured": measured, "state_bytes_expected": expected,
        "state_bytes_per_param": measured / n_params,
        "state_matches_expectation": None if expected is None else measured == expected,
    }


# -- fine-tuning from a trained checkpoint, 8-bit weights (int8train) against AdamW -------------------------------
# Each method with the learning rates swept (its best by validation loss is reported). bf16 stands for the T4's fp16
# here (the same code; this CPU emulates fp16 matmuls slowly), as for the 16-bit rows above.
FINETUNE_METHODS = {
    "AdamW fp32": ({"optimizer": "adamw"}, (3e-4, 1e-3, 3e-3)),
    "AdamW, 16-bit weights + Kahan": ({"optimizer": "adamw", "precision": "bf16", "update_rounding": "kahan"}, (3e-4, 1e-3, 3e-3)),
    "LOMO, 16-bit weights": ({"optimizer": "lomo", "precision": "bf16"}, (0.01, 0.03, 0.1)),
    "LOMO, int8 weights": ({"optimizer": "lomo", "precision": "bf16", "weight_dtype": "int8"}, (0.01, 0.03, 0.1)),
    "AdaLomo, int8 weights": ({"optimizer": "adalomo", "precision": "bf16", "weight_dtype": "int8"}, (1e-3, 3e-3, 1e-2)),
}
FINETUNE_BASELINE = "AdamW fp32"


def finetune_text() -> Path:
    """Return the second text: the standard library's `pydoc_data/topics.py` (the English help topics of `help()`)."""
    import sysconfig

    path = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: the fine-tuning text ships with CPython's standard library")
    return path


def finetune_rows(*, size: str, pretrain_steps: int, steps: int, batch: int, seq: int, seed: int = 0,
                  methods: list[str] | None = None, save: Any = None) -> dict:
    """Pretrain with fp32 AdamW on the standard library's code, then fine-tune on its help text with each method
    (and train each from scratch on the help text), each at every learning rate of its sweep."""
    methods = methods or list(FINETUNE_METHODS)
    code = cm.load_corpus()
    text = cm.load_corpus(source=finetune_text())
    torch.manual_seed(seed)
    base = cm.build_model(size)
    pre_recipe = cm.Recipe(optimizer="adamw", lr=1e-3)
    _, pre_opt = pre_recipe.build(base)
    start = time.perf_counter()
    pre_log = cm.train(base, pre_opt, code, steps=pretrain_steps, batch_size=batch, seq_len=seq, seed=seed, recipe=pre_recipe)
    checkpoint = {k: v.detach().clone() for k, v in base.state_dict().items()}
    before = cm.evaluate(base, text, batch_size=batch, seq_len=seq)
    out = {"model": size, "pretrain": {"text": code.source, "optimizer": "adamw", "lr": 1e-3, "steps": pretrain_steps,
                                       "val_loss": pre_log.val_loss, "seconds": time.perf_counter() - start},
           "finetune_text": text.source, "val_loss_before_finetuning": before, "steps": steps, "batch": batch, "seq_len": seq,
           "baseline": FINETUNE_BASELINE, "rows": []}
    best_lr: dict[str, float] = {}
    for start_from in ("checkpoint", "scratch"):
        for name in methods:
            fields, lrs = FINETUNE_METHODS[name]
            if start_from == "scratch":  # from scratch: the fine-tuning's best rate only (this CPU's time is short)
                lrs = (best_lr[name],)
            sweep = []
            for lr in lrs:
                torch.manual_seed(seed)
                model = cm.build_model(size)
                if start_from == "checkpoint":
                    model.load_state_dict(checkpoint)
                recipe = cm.Recipe.from_dict({**fields, "lr": lr})
                model, opt = recipe.build(model)
                t0 = time.perf_counter()
                log = cm.train(model, opt, text, steps=steps, batch_size=batch, seq_len=seq, seed=seed + 1, recipe=recipe)
                sweep.append({"lr": lr, "val_loss": log.val_loss, "final_train_loss": log.train_loss[-1],
                              "seconds": time.perf_counter() - t0})
                print(f"  {start_from:10s} {name:32s} lr {lr:<7g} val {log.val_loss:.4f}", flush=True)
            best = min(sweep, key=lambda r: r["val_loss"])
            best_lr.setdefault(name, best["lr"])
            out["rows"].append({"method": name, "start": start_from, "recipe": fields, "best_lr": best["lr"],
                                "val_loss": best["val_loss"], "sweep": sweep})
            if save is not None:  # the rows so far (a long run on a busy machine can be cut short)
                save(out)
    return add_gaps(out)


def add_gaps(out: dict) -> dict:
    """Set each row's `loss_gap_pct`: % above the baseline's validation loss from the same start (if it ran)."""
    for start_from in ("checkpoint", "scratch"):
        ref = next((r["val_loss"] for r in out["rows"] if r["method"] == FINETUNE_BASELINE and r["start"] == start_from), None)
        for r in out["rows"]:
            if r["start"] == start_from and ref is not None:
                r["loss_gap_pct"] = 100 * (r["val_loss"] - ref) / ref
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS_COMPARED + list(SIXTEEN_BIT))
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--finetune-only", action="store_true",
                        help="only run the fine-tune-from-a-checkpoint comparison (8-bit weights) and add it to the JSON as 'finetune'")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    args = parser.parse_args(argv)
    if args.finetune_only:
        from colab_memopt.core.fileio import read_json

        warnings.simplefilter("ignore")
        data = read_json(args.out) if Path(args.out).exists() else {}
        data["finetune"] = finetune_rows(size=args.size, pretrain_steps=args.pretrain_steps, steps=args.steps,
                                         batch=args.batch, seq=args.seq)
        write_json(args.out, data)
        for r in data["finetune"]["rows"]:
            print(f"{r['start']:10s} {r['method']:32s} lr {r['best_lr']:<7g} val {r['val_loss']:.4f} gap {r['loss_gap_pct']:+.2f}%")
        print(f"wrote {args.out}")
        return 0
    if BASELINE not in args.optimizers:
        raise SystemExit(f"--optimizers must include the baseline {BASELINE!r}")
    warnings.simplefilter("ignore")
    corpus = cm.load_corpus()
    rows = []
    for name in args.optimizers:
        rows.append(run(name, size=args.size, steps=args.steps, batch=args.batch, seq=args.seq, corpus=corpus))
        r = rows[-1]
        print(f"  {name:30s} val {r['val_loss']:.4f}  train {r['final_train_loss']:.4f}  "
              f"state {r['state_bytes_per_param']:.3f} B/param  {r['train_seconds']:.1f} s", flush=True)
    base = next(r for r in rows if r["optimizer"] == BASELINE)["val_loss"]
    for r in rows:
        r["loss_gap_pct"] = 100 * (r["val_loss"] - base) / base
    out = {
        "model": args.size, "steps": args.steps, "batch": args.batch, "seq_len": args.seq,
        "lr": cm.Recipe().lr, "precision": "fp32 (16-bit-weight rows: bf16, each row says)", "baseline": BASELINE,
        "device": f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "note": ("the same seed, initial weights, batches and learning rate for all; BAdam trains one block per "
                 "50 steps (the package's default), last block first, and never the embeddings"),
        "rows": rows,
    }
    write_json(args.out, out)
    print(f"{'optimizer':30s} {'val loss':>9s} {'gap %':>7s} {'state B/param':>14s}")
    for r in rows:
        print(f"{r['optimizer']:30s} {r['val_loss']:9.4f} {r['loss_gap_pct']:7.2f} {r['state_bytes_per_param']:14.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
