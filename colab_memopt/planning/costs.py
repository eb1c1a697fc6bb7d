"""What each technique costs in step time on the target's device class, and a recipe's expected slowdown.

Costs belong to a device class, never to the machine that happens to plan: 'cpu',
't4' (sm_75: fp16 tensor cores, no native bf16) and 'ampere+' (sm_80 and later: native bf16).
`costs_for_target(target)` returns the table of the target's class, each row with its source:
measured (the package's `technique_costs.json` for 'cpu', written by `benchmarks/technique_costs.py`
on this 2-core CPU; `technique_costs_t4.json` / `technique_costs_ampere.json` once `make test-gpu`
measured them on a GPU, labelled with the GPU and any emulation) or, until measured, a PRIOR from a
published figure with its citation (`PRIORS`). A CPU-measured ratio is never applied to a CUDA target.

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

from colab_memopt.core.fileio import read_json
from colab_memopt.training.recipe import Recipe

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
DEVICE_CLASSES = ("cpu", "t4", "ampere+")
# The measured table of each class, package data (absent until measured on that class).
COSTS_FILES = {"cpu": COSTS_FILE, "t4": COSTS_FILE.with_name("technique_costs_t4.json"),
               "ampere+": COSTS_FILE.with_name("technique_costs_ampere.json")}


@dataclass(frozen=True)
class Prior:
    """A step-time ratio taken from published figures until it is measured on the device class, and where from."""

    ratio: float
    citation: str


_CHEN = ("Chen et al. 2016, 'Training Deep Nets with Sublinear Memory Cost' (arXiv:1604.06174): checkpointing costs "
         "one extra forward pass; with backward about twice a forward, a step of 3 forward-costs becomes 4 (x1.33); "
         "Hugging Face's gradient-checkpointing guide says ~20% slower")
_GPU_COMMON: dict[str, Prior] = {
    "checkpoint-full": Prior(4 / 3, _CHEN),
    "checkpoint-every-2": Prior(1 + 1 / 6, "derived from checkpoint-full's x1.33 (" + _CHEN.split(",")[0] + "): half the blocks recomputed"),
    "checkpoint-every-4": Prior(1 + 1 / 12, "derived from checkpoint-full's x1.33 (" + _CHEN.split(",")[0] + "): a quarter of the blocks recomputed"),
    "checkpoint-every-8": Prior(1 + 1 / 24, "derived from checkpoint-full's x1.33 (" + _CHEN.split(",")[0] + "): an eighth of the blocks recomputed"),
    "checkpoint-selective": Prior(1.05, "Korthikanti et al. 2022 (arXiv:2205.05198): selective recomputation of the cheap "
                                        "ops costs 2.7% more FLOPs on GPT-3; taken at x1.05 (elementwise ops are memory-bound)"),
    "adamw8bit": Prior(1.0, "Dettmers et al. 2022, '8-bit Optimizers via Block-wise Quantization' (ICLR, arXiv:2110.02861): "
                            "block-wise quantization is processed in parallel, 'yielding faster optimization'; counted x1.00"),
    "paged_adamw8bit": Prior(1.0, "Dettmers et al. 2023, QLoRA (arXiv:2305.14314): paged optimizers move pages to host "
                                  "memory only when the GPU runs out; otherwise the 8-bit step (x1.00)"),
    "accumulation-2": Prior(1.0, "assumption, no published figure: the same FLOPs per optimizer step in 2 smaller passes"),
    "accumulation-4": Prior(1.0, "assumption, no published figure: the same FLOPs per optimizer step in 4 smaller passes"),
    "lora": Prior(0.75, "Hu et al. 2021, LoRA (arXiv:2106.09685, section 4.2): 25% faster training than full fine-tuning "
                        "on GPT-3 175B, no gradients for the frozen weights"),
    "qlora": Prior(1.0, "LoRA's x0.75 (Hu et al. 2021) times the dequantization of every 4-bit weight in forward and "
                        "backward, taken at x1.33: 'no speed improvement compared to LoRA; actually slower' "
                        "(Lightning-AI/litgpt#595); up to 5x slower reported in allenai/open-instruct#109"),
}
# Priors per device class: ratios to a plain fp32 AdamW step on that class, until `make test-gpu` measures them.
PRIORS: dict[str, dict[str, Prior]] = {
    "cpu": {},  # the CPU table is measured here (technique_costs.json)
    "t4": {
        "fp16-autocast": Prior(0.5, "NVIDIA T4 datasheet: 65 TFLOPS fp16 on tensor cores vs 8.1 TFLOPS fp32 (8x on "
                                    "matmuls, peak); taken at 2x for the whole step (only the matmuls speed up)"),
        "bf16-autocast": Prior(2.0, "sm_75 has no bf16 tensor cores: bf16 matmuls run emulated, at less than half the "
                                    "speed of fp32 on a Colab T4 (openxla/xla#12429)"),
        **_GPU_COMMON,
    },
    "ampere+": {
        "fp16-autocast": Prior(0.5, "NVIDIA A100 datasheet: 312 TFLOPS fp16/bf16 on tensor cores vs 19.5 TFLOPS fp32 "
                                    "(16x on matmuls, peak); taken at 2x for the whole step (only the matmuls speed up)"),
        "bf16-autocast": Prior(0.5, "NVIDIA A100 datasheet: bf16 tensor cores at fp16's 312 TFLOPS vs 19.5 TFLOPS fp32; "
                                    "taken at 2x for the whole step, as fp16"),
        **_GPU_COMMON,
    },
}
# The host link offloaded tensors cross on a T4 host (for offload candidates): PCIe 3.0 x16.
PCIE3_X16_BYTES_PER_S = Prior(15.75e9, "PCIe 3.0 x16: 8 GT/s x 16 lanes x 128b/130b = 15.75 GB/s per direction "
                                       "(PCI-SIG); a T4 is a PCIe 3.0 x16 card (NVIDIA T4 datasheet); real copies reach less")


def device_class(target: Any) -> str:
    """Return the cost table's device class of a target: 'cpu', 't4' (CUDA below sm_80) or 'ampere+' (sm_80 on).

    `target` is a `targets.Target` (or anything with `cuda` and `compute_capability`); a CUDA target whose
    capability is not known counts as 't4' (no native bf16 assumed).
    """
    if not getattr(target, "cuda", True):
        return "cpu"
    cc = getattr(target, "compute_capability", None)
    return "ampere+" if cc is not None and tuple(cc) >= (8, 0) else "t4"


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
    # The device class the ratios describe (None: not said, e.g. made-up ratios in a test) and, per
    # technique, 'measured' or 'prior' with its citation (rows absent from `kinds` are measured).
    device_class: str | None = None
    kinds: dict[str, str] = field(default_factory=dict)
    citations: dict[str, str] = field(default_factory=dict)

    def kind(self, technique: str) -> str:
        """Return 'measured' or 'prior' for a technique of the table."""
        return self.kinds.get(technique, "measured")

    def row_source(self, technique: str) -> str:
        """Return where a row comes from: 'measured on <device>' or 'prior: <citation>'."""
        if self.kind(technique) == "prior":
            return f"prior: {self.citations.get(technique, '')}"
        return f"measured on {self.device}"

    @property
    def table(self) -> str:
        """Return a one-line name of the table: its class and what its rows are."""
        kinds = set(self.kinds.get(t, "measured") for t in self.ratios)
        what = " + ".join(k for k in ("measured", "prior") if k in kinds) or "empty"
        return f"{self.device_class or 'unclassed'} table ({what}; {self.device})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "model": self.model, "batch": self.batch, "seq_len": self.seq_len,
            "rounds": self.rounds, "ratios": self.ratios, "step_seconds": self.step_seconds, "source": self.source,
            "device_class": self.device_class, "kinds": {t: self.kind(t) for t in self.ratios}, "citations": self.citations,
        }


@dataclass
class Slowdown:
    """A recipe's expected step-time ratio against plain fp32 training, and what it is made of."""

    ratio: float
    parts: dict[str, float]
    unmeasured: list[str]
    device: str
    floored: list[str] = field(default_factory=list)  # in ADDS_WORK and measured below 1: counted as 1.0
    sources: dict[str, str] = field(default_factory=dict)  # technique -> 'measured on ...' or 'prior: <citation>'
    kinds: dict[str, str] = field(default_factory=dict)  # technique -> 'measured' or 'prior'

    @property
    def n_techniques(self) -> int:
        """Return how many techniques the recipe turns on (measured or not)."""
        return len(self.parts) + len(self.unmeasured)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        from colab_memopt.core.env import device_label

        return f"cuda: {device_label(device)}"  # "<gpu> emulating t4" under CM_EMULATE=t4 (env.apply_emulation)
    import platform

    return f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def measured_device_class(device: torch.device) -> str:
    """Return the device class a measurement on `device` stands for: 'cpu', or the GPU's (its emulation's) class."""
    if device.type != "cuda":
        return "cpu"
    from colab_memopt.core.env import bf16_native, emulated_gpu

    if emulated_gpu(device) == "t4":
        return "t4"
    return "ampere+" if bf16_native(device) else "t4"


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
    from colab_memopt.techniques.data import load_corpus
    from colab_memopt.core.env import pick_device
    from colab_memopt.techniques.models import build_model
    from colab_memopt.training.train import make_train_step

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
        device_class=measured_device_class(dev),
    )


# A step-time ratio outside these bounds is not a measurement of a technique (1e308 overflows every product).
RATIO_BOUNDS = (0.01, 100.0)


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
    lo, hi = RATIO_BOUNDS
    bad = {k: v for k, v in ratios.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi} \
        if isinstance(ratios, dict) else ratios
    if not isinstance(ratios, dict) or bad:
        raise ValueError(f"{p}: 'ratios' must map technique names to step-time ratios in [{lo}, {hi}], got {bad!r}")
    known = set(TECHNIQUES).union(*(PRIORS[c] for c in PRIORS))
    unknown = sorted(k for k in ratios if k not in known)
    if unknown:
        raise ValueError(f"{p}: unknown technique name(s) {unknown} in 'ratios'; the names are {sorted(known)}")
    cls = d.get("device_class")
    if cls is None and path is None:
        cls = "cpu"  # the package's default table, measured on this project's CPU (benchmarks/technique_costs.py)
    if cls is None:
        raise ValueError(f"{p} has no 'device_class' (one of {DEVICE_CLASSES}): a ratio measured on one device class "
                         "never stands for another, so a cost file must say where it was measured; "
                         "benchmarks/technique_costs.py writes it")
    if cls is not None and cls not in DEVICE_CLASSES:
        raise ValueError(f"{p}: 'device_class' must be one of {DEVICE_CLASSES}, got {cls!r}")
    return TechniqueCosts(
        ratios={k: float(v) for k, v in ratios.items()}, device=str(d["device"]), model=d["model"], batch=d["batch"],
        seq_len=d["seq_len"], step_seconds=d.get("step_seconds", {}), rounds=d.get("rounds", 0), source=d.get("source", str(p)),
        device_class=cls,
    )


def prior_costs(cls: str) -> TechniqueCosts:
    """Return the priors of a device class (published figures, each with its citation) as a cost table."""
    if cls not in DEVICE_CLASSES:
        raise ValueError(f"device class must be one of {DEVICE_CLASSES}, got {cls!r}")
    priors = PRIORS[cls]
    return TechniqueCosts(
        ratios={t: p.ratio for t, p in priors.items()}, device=f"{cls} (priors: published figures, not measured)",
        model="-", batch=0, seq_len=0, source="costs.PRIORS", device_class=cls,
        kinds={t: "prior" for t in priors}, citations={t: p.citation for t, p in priors.items()},
    )


def costs_for_class(cls: str, path: str | Path | None = None) -> TechniqueCosts:
    """Return the cost table of a device class: its measured rows (package data, or `path`), priors for the rest.

    A measured file must be of the same class (its 'device_class'; the package's `technique_costs.json` is 'cpu').
    """
    priors = prior_costs(cls)
    file = Path(path) if path is not None else COSTS_FILES[cls]
    if not file.exists():
        if path is not None or cls == "cpu":
            load_technique_costs(file)  # raises FileNotFoundError naming the file and how to make it
        return priors
    measured = load_technique_costs(None if path is None and cls == "cpu" else file)
    if measured.device_class != cls:
        raise ValueError(f"{file} holds ratios of device class {measured.device_class!r} ({measured.device}), not "
                         f"{cls!r}: a measurement on one device class never stands for another (benchmarks/technique_costs.py "
                         "writes 'device_class', the class of the device it ran on)")
    ratios = {**priors.ratios, **measured.ratios}
    kinds = {**priors.kinds, **{t: "measured" for t in measured.ratios}}
    citations = {t: c for t, c in priors.citations.items() if kinds[t] == "prior"}
    device = measured.device + (f"; priors for {sorted(t for t in kinds if kinds[t] == 'prior')}" if citations else "")
    return TechniqueCosts(ratios=ratios, device=device, model=measured.model, batch=measured.batch, seq_len=measured.seq_len,
                          step_seconds=measured.step_seconds, rounds=measured.rounds, source=measured.source,
                          device_class=cls, kinds=kinds, citations=citations)


def costs_for_target(target: Any, costs: TechniqueCosts | None = None) -> TechniqueCosts:
    """Return the cost table for a target (`targets.Target`): `costs` if given and of its class, else its class's table.

    Raises ValueError when `costs` names another device class (a CPU measurement for a CUDA target).
    """
    cls = device_class(target)
    if costs is None:
        return costs_for_class(cls)
    if costs.device_class is not None and costs.device_class != cls:
        raise ValueError(
            f"the technique costs were measured on a {costs.device_class!r} device ({costs.device}) and the target "
            f"{getattr(target, 'name', target)!r} is of class {cls!r}: ratios of one device class never stand for "
            f"another; leave costs=None (the {cls} table) or pass a table of class {cls!r}"
        )
    return costs


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
    return Slowdown(ratio, parts, unmeasured, costs.device, floored,
                    {n: costs.row_source(n) for n in parts}, {n: costs.kind(n) for n in parts})
