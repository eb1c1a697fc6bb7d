"""What each technique costs in step time, measured on this device, and a recipe's expected slowdown.

`measure_technique_costs` times one training step of the reference model with each technique of
`TECHNIQUES` turned on alone (the same `Recipe.build` + `train.make_train_step` path every
notebook measures), each step right after a plain fp32 AdamW step so that a busy machine slows both
alike, and returns the median of the pairs' ratios, with the device named.
`benchmarks/technique_costs.py` writes them to `colab_memopt/technique_costs.json` (package data);
`expected_slowdown` multiplies the ratios of the techniques a recipe turns on. A technique with no
measured ratio counts as 1.0 and is named in the result's `unmeasured`.

A new technique (a new Recipe field) plugs in with one entry in `TECHNIQUES`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from colab_memopt.fileio import read_json
from colab_memopt.recipe import Recipe

# The default ratios ship inside the package (package data), so an installed wheel has them.
COSTS_FILE = Path(__file__).resolve().parent / "technique_costs.json"

# Technique name -> the Recipe fields that turn it on (each measured alone against Recipe()).
# A recipe "uses" a technique when all its fields match; 'lora' and 'qlora' are the training modes.
TECHNIQUES: dict[str, dict[str, Any]] = {
    "fp16-autocast": dict(precision="fp16-autocast"),
    "bf16-autocast": dict(precision="bf16-autocast"),
    "checkpoint-selective": dict(checkpointing="selective"),
    "checkpoint-every-8": dict(checkpointing="every_n", checkpoint_interval=8),
    "checkpoint-every-4": dict(checkpointing="every_n", checkpoint_interval=4),
    "checkpoint-every-2": dict(checkpointing="every_n", checkpoint_interval=2),
    "checkpoint-full": dict(checkpointing="full", checkpoint_interval=1),
    "adamw8bit": dict(optimizer="adamw8bit"),
    "paged_adamw8bit": dict(optimizer="paged_adamw8bit"),
    "accumulation-2": dict(accumulation_steps=2),
    "accumulation-4": dict(accumulation_steps=4),
    "lora": dict(lora_rank=16, quantization=None),
    "qlora": dict(lora_rank=16, quantization="nf4"),
}
# Techniques that only add work to the plain step: recomputation, the same tokens in more and smaller
# passes, (de)quantizing the optimizer state. No device runs them faster than the plain step, so a ratio
# measured below 1 is timing noise; `expected_slowdown` counts it as 1.0 and names it. Precision and
# LoRA can really be faster (tensor cores; no weight gradients), so their ratios are taken as measured.
ADDS_WORK = frozenset({"checkpoint-selective", "checkpoint-every-8", "checkpoint-every-4", "checkpoint-every-2",
                       "checkpoint-full", "adamw8bit", "paged_adamw8bit", "accumulation-2", "accumulation-4"})
# Fields whose default value means "off": a recipe with another value there needs a measured technique.
_DEFAULTS = {f: getattr(Recipe(), f) for f in ("precision", "checkpointing", "optimizer", "accumulation_steps", "lora_rank", "quantization")}


@dataclass
class TechniqueCosts:
    """Measured step-time ratios (technique / plain fp32 AdamW) and where they were measured."""

    ratios: dict[str, float]
    device: str
    model: str
    batch: int
    seq_len: int
    step_seconds: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "model": self.model, "batch": self.batch, "seq_len": self.seq_len,
            "rounds": self.rounds, "ratios": self.ratios, "step_seconds": self.step_seconds, "source": self.source,
        }


@dataclass
class Slowdown:
    """A recipe's expected step-time ratio against plain fp32 training, and what it is made of."""

    ratio: float
    parts: dict[str, float]
    unmeasured: list[str]
    device: str
    floored: list[str] = field(default_factory=list)  # in ADDS_WORK and measured below 1: counted as 1.0

    @property
    def n_techniques(self) -> int:
        """Return how many techniques the recipe turns on (measured or not)."""
        return len(self.parts) + len(self.unmeasured)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    import platform

    return f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def measure_technique_costs(
    *,
    model_size: str = "small",
    batch: int = 8,
    seq_len: int = 128,
    rounds: int = 5,
    device: str = "auto",
    techniques: Iterable[str] | None = None,
    seed: int = 0,
    n_layer: int | None = 8,
) -> TechniqueCosts:
    """Time one training step per technique against the plain step, on this device; return the ratios.

    `n_layer` overrides the reference model's depth (8 by default, so that checkpointing every 2nd,
    4th and 8th block differ). Techniques that cannot run here (e.g. bitsandbytes on a machine without it) are left out of
    `ratios` and named in `source`.
    """
    from colab_memopt.data import load_corpus
    from colab_memopt.env import pick_device
    from colab_memopt.models import build_model
    from colab_memopt.train import make_train_step

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    names = list(TECHNIQUES) if techniques is None else list(techniques)
    unknown = [n for n in names if n not in TECHNIQUES]
    if unknown:
        raise ValueError(f"unknown technique(s) {unknown}; choose from {list(TECHNIQUES)}")
    dev = pick_device(device)
    corpus = load_corpus()
    steps, failed = {}, []
    for name in ["baseline", *names]:
        recipe = Recipe() if name == "baseline" else Recipe().with_(**TECHNIQUES[name])
        try:
            overrides = {} if n_layer is None else {"n_layer": n_layer}
            model, opt = recipe.build(build_model(model_size, device=dev, seed=seed, **overrides))
            step = make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq_len, seed=seed, recipe=recipe)
            step()  # warm-up: optimizer state, kernels
            steps[name] = step
        except Exception as exc:  # noqa: BLE001 - a technique this machine cannot run is reported, not fatal
            if name == "baseline":
                raise
            failed.append(f"{name} ({type(exc).__name__}: {str(exc)[:80]})")
    def timed(step) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    # Each technique's step right after a plain step, round after round: the pair sees the same load,
    # so the ratio per pair is fair on a busy machine; the median over rounds drops the outliers.
    times: dict[str, list[float]] = {n: [] for n in steps}
    pair_ratios: dict[str, list[float]] = {n: [] for n in steps if n != "baseline"}
    for _ in range(rounds):
        for name, step in steps.items():
            if name == "baseline":
                continue
            base = timed(steps["baseline"])
            t = timed(step)
            times["baseline"].append(base)
            times[name].append(t)
            pair_ratios[name].append(t / base)
    ratios = {n: statistics.median(r) for n, r in pair_ratios.items()}
    source = (f"measure_technique_costs(model_size={model_size!r}, n_layer={n_layer}, batch={batch}, seq_len={seq_len}, "
              f"rounds={rounds})")
    if failed:
        source += "; not measurable here: " + ", ".join(failed)
    return TechniqueCosts(
        ratios=ratios, device=_device_name(dev), model=model_size, batch=batch, seq_len=seq_len,
        step_seconds={n: statistics.median(t) for n, t in times.items()}, rounds=rounds, source=source,
    )


def load_technique_costs(path: str | Path | None = None) -> TechniqueCosts:
    """Read measured ratios (default: the package's technique_costs.json); say how to make them if absent."""
    p = Path(path) if path is not None else COSTS_FILE
    if not p.exists():
        raise FileNotFoundError(
            f"no measured technique costs at {p}: run `python benchmarks/technique_costs.py` on the device "
            "(or pass costs=measure_technique_costs(...))"
        )
    d = read_json(p)  # a folder, an unreadable or a broken file: a ValueError naming it
    how = "write it with `python benchmarks/technique_costs.py`"
    if not isinstance(d, dict):
        raise ValueError(f"{p} must hold a JSON object with {list(_COSTS_KEYS)}, got a {type(d).__name__}; {how}")
    missing = [k for k in _COSTS_KEYS if k not in d]
    if missing:
        raise ValueError(f"{p} lacks {missing} (a technique costs file has {list(_COSTS_KEYS)}); {how}")
    ratios = d["ratios"]
    bad = {k: v for k, v in ratios.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")} \
        if isinstance(ratios, dict) else ratios
    if not isinstance(ratios, dict) or bad:
        raise ValueError(f"{p}: 'ratios' must map technique names to finite step-time ratios > 0, got {bad!r}")
    return TechniqueCosts(
        ratios={k: float(v) for k, v in ratios.items()}, device=str(d["device"]), model=d["model"], batch=d["batch"],
        seq_len=d["seq_len"], step_seconds=d.get("step_seconds", {}), rounds=d.get("rounds", 0), source=d.get("source", str(p)),
    )


_COSTS_KEYS = ("ratios", "device", "model", "batch", "seq_len")


def techniques_used(recipe: Recipe | dict[str, Any]) -> tuple[list[str], list[str]]:
    """Return (techniques of `TECHNIQUES` the recipe turns on, fields set off-default that none of them covers)."""
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(dict(recipe))
    if rec.lora_rank and rec.lora_rank != TECHNIQUES["lora"]["lora_rank"]:  # any rank reuses the measured one's ratio
        rec = rec.with_(lora_rank=TECHNIQUES["lora"]["lora_rank"])
    used = [n for n, f in TECHNIQUES.items() if all(getattr(rec, k) == v for k, v in f.items())]
    covered = {k for n in used for k in TECHNIQUES[n]}
    uncovered = [f"{k}={getattr(rec, k)!r}" for k, v in _DEFAULTS.items() if getattr(rec, k) != v and k not in covered]
    return used, uncovered


def expected_slowdown(recipe: Recipe | dict[str, Any], costs: TechniqueCosts) -> Slowdown:
    """Return the product of the measured ratios of the techniques the recipe turns on.

    Ratios measured alone are multiplied as if independent (an approximation: the notebooks measure
    pairs where it matters). A technique the recipe uses but `costs` lacks counts as 1.0 and is named.
    A technique of `ADDS_WORK` measured below 1.0 (timing noise) counts as 1.0 and is named in `floored`.
    LoRA's rank is matched on the measured rank only; another rank reuses that ratio.
    """
    rec = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(dict(recipe))
    used, uncovered = techniques_used(rec)
    measured = {n: costs.ratios[n] for n in used if n in costs.ratios}
    floored = [n for n, r in measured.items() if n in ADDS_WORK and r < 1.0]
    parts = {n: 1.0 if n in floored else r for n, r in measured.items()}
    unmeasured = [n for n in used if n not in costs.ratios] + uncovered
    ratio = 1.0
    for r in parts.values():
        ratio *= r
    return Slowdown(ratio, parts, unmeasured, costs.device, floored)
