"""Phase-aware training: full steps, predicted steps, and what a predicted step lets you free.

Notebook 14 measures what this idea saves and costs. Training cycles through phases:

- warmup (`warmup_steps`) and full (`full_steps`): ordinary steps (forward, backward, optimizer);
- predict (up to `max_predict_steps`): forward only. The parameters move by a *predicted* update, the
  moving average of recent full-step updates, and a forward-only loss check gives a confidence
  (reference loss of recent full steps / loss after the predicted update, capped at 1);
- correct (`correction_interval` full steps): follows a predict phase cut short by low confidence.
  A predict phase that reaches `max_predict_steps` is followed by a full phase.

During predict phases nothing is kept for backward (no autograd graph), gradients are freed, and the
optimizer state is offloaded with one of `OFFLOAD_STRATEGIES` and restored `lookahead` steps before
the next full step is known to come (an early end by low confidence restores on demand).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from colab_memopt.techniques.data import TextCorpus
from colab_memopt.core.env import pick_device
from colab_memopt.techniques.evaluation import evaluate

PHASES = ("warmup", "full", "predict", "correct")
FULL_PHASES = ("warmup", "full", "correct")
OFFLOAD_STRATEGIES = ("none", "cpu", "pinned_cpu", "int8", "drop")
PRECISIONS = ("fp32", "bf16")
# A predicted step is forward-only (no GradScaler needed), so it may also run in fp16, the T4's fast
# path; 'auto' picks `env.autocast_dtype` of the device: fp16 below compute capability 8.0, else bf16.
PREDICT_PRECISIONS = ("fp32", "bf16", "fp16", "auto")
# Compute units per step, forward = 1 and backward = 2 (the usual 1:2 FLOP ratio, Kaplan et al. 2020).
FULL_STEP_UNITS, PREDICT_STEP_UNITS = 3, 1
INT8_BLOCK = 256


@dataclass(frozen=True)
class PhaseConfig:
    """Settings of phase-aware training (all validated on construction).

    Attributes:
        warmup_steps, full_steps: full steps before the first predict phase, and per full phase.
        max_predict_steps: the longest predict phase (0 turns prediction off: ordinary training).
        confidence_threshold: in [0, 1]; a predicted step whose confidence falls below it ends the phase.
        correction_interval: full steps of a correct phase.
        offload: what happens to the optimizer state in predict phases, one of OFFLOAD_STRATEGIES.
        lookahead: restore the state this many steps before a full step is due.
        history_beta: in [0, 1); the predicted update is the moving average of full-step updates.
        predict_scale: multiplier of the predicted update.
        full_precision: 'fp32' or 'bf16' (autocast) for full steps.
        predict_precision: 'fp32', 'bf16', 'fp16' or 'auto' (autocast; 'auto': fp16 on a GPU without
            native bf16 such as a T4, bf16 elsewhere) for predicted, forward-only steps.
    """

    warmup_steps: int = 10
    full_steps: int = 4
    max_predict_steps: int = 8
    confidence_threshold: float = 0.97
    correction_interval: int = 2
    offload: str = "cpu"
    lookahead: int = 1
    history_beta: float = 0.8
    predict_scale: float = 1.0
    full_precision: str = "fp32"
    predict_precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "max_predict_steps", "lookahead"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("full_steps", "correction_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold}")
        if not 0.0 <= self.history_beta < 1.0:
            raise ValueError(f"history_beta must be in [0, 1), got {self.history_beta}")
        if not self.predict_scale >= 0:
            raise ValueError(f"predict_scale must be >= 0, got {self.predict_scale}")
        if self.offload not in OFFLOAD_STRATEGIES:
            raise ValueError(f"offload must be one of {OFFLOAD_STRATEGIES}, got {self.offload!r}")
        if self.full_precision not in PRECISIONS:
            raise ValueError(f"full_precision must be one of {PRECISIONS}, got {self.full_precision!r}")
        if self.predict_precision not in PREDICT_PRECISIONS:
            raise ValueError(f"predict_precision must be one of {PREDICT_PRECISIONS}, got {self.predict_precision!r}")


class PhaseScheduler:
    """The phase state machine, on its own so its transitions can be tested.

    Call `advance(confident=...)` once after every step; it returns the next step's phase.
    """

    def __init__(self, config: PhaseConfig) -> None:
        self.config = config
        self.phase = "warmup" if config.warmup_steps else "full"
        self.steps_in_phase = 0

    def _phase_length(self) -> int:
        c = self.config
        return {"warmup": c.warmup_steps, "full": c.full_steps, "correct": c.correction_interval,
                "predict": c.max_predict_steps}[self.phase]

    def advance(self, *, confident: bool = True) -> str:
        """Record one finished step and return the phase of the next."""
        self.steps_in_phase += 1
        c = self.config
        nxt = self.phase
        if self.phase == "predict":
            if not confident:
                nxt = "correct"
            elif self.steps_in_phase >= c.max_predict_steps:
                nxt = "full"
        elif self.steps_in_phase >= self._phase_length():
            nxt = "predict" if c.max_predict_steps > 0 else "full"
        if nxt != self.phase or self.steps_in_phase >= self._phase_length():
            self.phase, self.steps_in_phase = nxt, 0
        return self.phase

    def predict_steps_left(self) -> int | None:
        """Return how many predict steps are left at most in this phase (None outside predict)."""
        if self.phase != "predict":
            return None
        return self.config.max_predict_steps - self.steps_in_phase


# -- optimizer-state offloading ---------------------------------------------------------------------


def quantize_int8(t: torch.Tensor) -> dict[str, torch.Tensor | str | tuple]:
    """Return a block-wise (256 values) absmax int8 code of `t`.

    Signed tensors use int8 in [-127, 127]; non-negative ones (Adam's exp_avg_sq) are stored as
    sqrt in uint8 [0, 255], which halves their dynamic range in bits. Error bound per value: half
    a quantization step of its block (absmax/254 signed; on sqrt, absmax(sqrt)/510).
    """
    flat = t.detach().flatten().float()
    pad = (-flat.numel()) % INT8_BLOCK
    nonneg = bool((flat >= 0).all())
    values = flat.sqrt() if nonneg else flat
    blocks = torch.nn.functional.pad(values, (0, pad)).view(-1, INT8_BLOCK)
    levels = 255.0 if nonneg else 127.0
    scale = (blocks.abs().amax(1) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(blocks / scale[:, None])
    code = q.to(torch.uint8) if nonneg else q.to(torch.int8)
    return {"code": code, "scale": scale, "nonneg": nonneg, "shape": tuple(t.shape), "dtype": t.dtype}


def dequantize_int8(packed: dict, device: torch.device | str | None = None) -> torch.Tensor:
    """Return the tensor an int8 code stands for."""
    values = packed["code"].float() * packed["scale"][:, None]
    if packed["nonneg"]:
        values = values.square()
    n = 1
    for s in packed["shape"]:
        n *= s
    out = values.flatten()[:n].view(packed["shape"]).to(packed["dtype"])
    return out.to(device) if device is not None else out


def int8_error_bound(packed: dict) -> torch.Tensor:
    """Return the per-block bound on |dequantized - original| (on sqrt for non-negative tensors)."""
    return packed["scale"] * 0.5 * (1 + 1e-5) + 1e-12


@dataclass
class OptimizerStateOffloader:
    """Take an optimizer's state off the device and bring it back.

    Strategies: 'none' keeps it; 'cpu' copies it to host memory; 'pinned_cpu' to pinned host memory
    (CUDA only: elsewhere it falls back to 'cpu' and says so in `stats['pinned']`); 'int8' keeps a
    block-wise int8 code on the device (not bit-exact: see `quantize_int8` for the bound); 'drop'
    discards it and the optimizer re-initialises it at the next step (moments zero, step count 0).
    Every strategy but 'int8' and 'drop' restores bit-exactly. Scalar and integer tensors (Adam's
    `step`) are always kept exactly.
    """

    optimizer: torch.optim.Optimizer
    strategy: str = "cpu"
    saved: dict = field(default_factory=dict)
    offloaded: bool = False
    stats: dict = field(default_factory=lambda: {"offloads": 0, "restores": 0, "bytes_freed": 0,
                                                   "transfer_seconds": 0.0, "pinned": False})

    def __post_init__(self) -> None:
        if self.strategy not in OFFLOAD_STRATEGIES:
            raise ValueError(f"strategy must be one of {OFFLOAD_STRATEGIES}, got {self.strategy!r}")

    def _stash(self, t: torch.Tensor) -> tuple:
        if t.dim() == 0 or not t.is_floating_point():
            return ("exact", t.clone(), t.device)
        if self.strategy == "int8":
            return ("int8", quantize_int8(t), t.device)
        pin = self.strategy == "pinned_cpu" and t.device.type == "cuda"
        self.stats["pinned"] = self.stats["pinned"] or pin
        host = t.detach().to("cpu", copy=True)
        return ("host", host.pin_memory() if pin else host, t.device)

    def offload(self) -> None:
        """Free the optimizer state from the device (no-op for 'none' or when already off)."""
        if self.offloaded or self.strategy == "none":
            return
        start = time.perf_counter()
        for p, state in list(self.optimizer.state.items()):
            self.stats["bytes_freed"] += sum(t.numel() * t.element_size() for t in state.values()
                                             if isinstance(t, torch.Tensor) and t.dim() > 0)
            if self.strategy != "drop":
                self.saved[p] = {k: self._stash(v) if isinstance(v, torch.Tensor) else ("value", v, None)
                                 for k, v in state.items()}
            del self.optimizer.state[p]
        self.offloaded = True
        self.stats["offloads"] += 1
        self.stats["transfer_seconds"] += time.perf_counter() - start

    def restore(self) -> None:
        """Put the state back on its device ('drop': leave it to the optimizer to re-initialise)."""
        if not self.offloaded:
            return
        start = time.perf_counter()
        for p, entries in self.saved.items():
            state = {}
            for k, (kind, value, device) in entries.items():
                if kind == "int8":
                    state[k] = dequantize_int8(value, device)
                elif kind == "host":
                    state[k] = value.to(device, non_blocking=value.is_pinned(), copy=True)
                else:
                    state[k] = value
            self.optimizer.state[p] = state
        self.saved = {}
        self.offloaded = False
        self.stats["restores"] += 1
        self.stats["transfer_seconds"] += time.perf_counter() - start

    def device_tensors(self) -> list[torch.Tensor]:
        """Return what the offloaded state still holds on the device (int8 codes and scales)."""
        out = []
        for entries in self.saved.values():
            for kind, value, _ in entries.values():
                if kind == "int8":
                    out += [value["code"], value["scale"]]
        return out


# -- predicting updates -----------------------------------------------------------------------------


class UpdatePredictor:
    """The moving average of full-step parameter updates, applied as the predicted update.

    Holds one buffer per parameter (4 B/param in fp32): the price of prediction. It is updated in
    place around each full step (ema -= (1-beta) p before, += (1-beta) p after), so no copy of the
    parameters is made.
    """

    def __init__(self, params: list[torch.Tensor], beta: float) -> None:
        self.params, self.beta = params, beta
        self.ema = [torch.zeros_like(p) for p in params]
        self.observed = 0

    @torch.no_grad()
    def begin_full_step(self) -> None:
        """Call before a full step's optimizer update."""
        w = 1.0 if self.observed == 0 else 1 - self.beta
        for e, p in zip(self.ema, self.params):
            e.mul_(0.0 if self.observed == 0 else self.beta).sub_(p, alpha=w)

    @torch.no_grad()
    def end_full_step(self) -> None:
        """Call after a full step's optimizer update."""
        w = 1.0 if self.observed == 0 else 1 - self.beta
        for e, p in zip(self.ema, self.params):
            e.add_(p, alpha=w)
        self.observed += 1

    @torch.no_grad()
    def apply(self, scale: float = 1.0) -> None:
        """Move the parameters by the predicted update."""
        for e, p in zip(self.ema, self.params):
            p.add_(e, alpha=scale)


# -- the trainer ---------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """One step of phase-aware training."""

    phase: str
    loss: float
    confidence: float | None = None


def autocast_dtype_for(precision: str, device: torch.device) -> torch.dtype | None:
    """Return the autocast dtype of a phase precision on `device` (None for 'fp32')."""
    from colab_memopt.core.env import autocast_dtype

    if precision == "auto":
        return autocast_dtype(device)
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    dtype = autocast_dtype_for(precision, device)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


class PhaseTrainer:
    """Run phase-aware training on a model whose forward takes `(input_ids, labels=...)` and returns `.loss`.

    Example:
        >>> trainer = PhaseTrainer(model, optimizer, PhaseConfig(offload="cpu"))
        >>> for x in batches: result = trainer.step(x)
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: PhaseConfig | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.config = config or PhaseConfig()
        self.device = next(model.parameters()).device
        self.scheduler = PhaseScheduler(self.config)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.predictor = UpdatePredictor(params, self.config.history_beta)
        self.offloader = OptimizerStateOffloader(optimizer, self.config.offload)
        self.full_losses: deque[float] = deque(maxlen=max(1, self.config.full_steps))
        self.counts = {"full": 0, "predict": 0, "restores_ahead": 0, "restores_on_demand": 0, "low_confidence": 0}
        self.history: list[StepResult] = []

    @property
    def compute_units(self) -> int:
        """Return the compute spent so far: 3 per full step, 1 per predicted (forward-only) step."""
        return FULL_STEP_UNITS * self.counts["full"] + PREDICT_STEP_UNITS * self.counts["predict"]

    def device_tensors(self) -> list[torch.Tensor]:
        """Return tensors the trainer adds on the device (predictor buffers, int8 state): pass to `track=`."""
        return [*self.predictor.ema, *self.offloader.device_tensors()]

    def _full_step(self, input_ids: torch.Tensor) -> float:
        if self.offloader.offloaded:
            self.offloader.restore()
            self.counts["restores_on_demand"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        with _autocast(self.config.full_precision, self.device):
            loss = self.model(input_ids, labels=input_ids).loss
        loss.backward()
        self.predictor.begin_full_step()
        self.optimizer.step()
        self.predictor.end_full_step()
        self.counts["full"] += 1
        value = loss.item()
        self.full_losses.append(value)
        return value

    @torch.no_grad()
    def _predict_step(self, input_ids: torch.Tensor) -> tuple[float, float]:
        if not self.offloader.offloaded and self.scheduler.steps_in_phase == 0:
            self.optimizer.zero_grad(set_to_none=True)  # gradients are not needed until the next full step
            self.offloader.offload()
        self.predictor.apply(self.config.predict_scale)
        with _autocast(self.config.predict_precision, self.device):
            loss = self.model(input_ids, labels=input_ids).loss.float().item()
        reference = sum(self.full_losses) / len(self.full_losses)
        confidence = min(1.0, reference / loss) if loss > 0 else 1.0
        self.counts["predict"] += 1
        return loss, confidence

    def step(self, input_ids: torch.Tensor) -> StepResult:
        """Run one step in the current phase and move the schedule on."""
        phase = self.scheduler.phase
        if phase == "predict" and self.predictor.observed == 0:
            raise RuntimeError("a predict step needs at least one full step first (set warmup_steps or full_steps)")
        if phase in FULL_PHASES:
            result = StepResult(phase, self._full_step(input_ids))
            confident = True
        else:
            loss, confidence = self._predict_step(input_ids)
            confident = confidence >= self.config.confidence_threshold
            self.counts["low_confidence"] += not confident
            result = StepResult(phase, loss, confidence)
        nxt = self.scheduler.advance(confident=confident)
        left = self.scheduler.predict_steps_left()
        if nxt == "predict" and self.offloader.offloaded and left is not None and left <= self.config.lookahead:
            self.offloader.restore()  # ahead of the full step that is due
            self.counts["restores_ahead"] += 1
        self.history.append(result)
        return result


@dataclass
class PhaseLog:
    """A phase-aware training run: per-step results, final validation loss, counts, seconds."""

    steps: list[StepResult]
    val_loss: float
    counts: dict
    compute_units: int
    seconds: float
    offload_stats: dict

    @property
    def predicted_share(self) -> float:
        """Return the share of steps that were predicted."""
        return sum(s.phase == "predict" for s in self.steps) / len(self.steps)


def train_phased(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: TextCorpus,
    config: PhaseConfig,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
) -> PhaseLog:
    """Train `steps` phase-aware steps on the corpus's seeded batches (those `train.train` uses)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    trainer = PhaseTrainer(model, optimizer, config)
    batches = corpus.batches(batch_size, seq_len, seed=seed, device=pick_device(trainer.device))
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(next(batches))
    seconds = time.perf_counter() - start
    trainer.offloader.restore()
    return PhaseLog(
        steps=trainer.history,
        val_loss=evaluate(model, corpus, batch_size=batch_size, seq_len=seq_len),
        counts=dict(trainer.counts),
        compute_units=trainer.compute_units,
        seconds=seconds,
        offload_stats=dict(trainer.offloader.stats),
    )
