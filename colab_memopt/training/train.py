"""The training step every notebook measures: one step function for every recipe.

Baseline and technique run through the same step with one option changed, so a measured difference
is the technique's and nothing else's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from colab_memopt.techniques.accumulation import accumulate_gradients, micro_batch_sizes, split_micro_batches
from colab_memopt.techniques.data import TextCorpus
from colab_memopt.techniques.evaluation import evaluate
from colab_memopt.techniques.loss import apply_chunked_loss
# Optimizers by name live with the optimizers, evaluation in its own module; both re-exported here,
# where earlier code found them.
from colab_memopt.techniques.optimizers import OPTIMIZERS, OptimizerInBackward, make_optimizer  # noqa: F401
from colab_memopt.techniques.lomo import fused_step, is_fused_backward
from colab_memopt.techniques.precision import autocast_context, forward_context, make_grad_scaler

if TYPE_CHECKING:
    from colab_memopt.training.recipe import Recipe

def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    input_ids: torch.Tensor,
    *,
    precision: str = "fp32",
    accumulation_steps: int = 1,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """Run one training step on a batch of token ids (B, T) and return the loss.

    Gradients are released at the start of the step (`set_to_none=True`), as in PyTorch's own
    training loops, so they stay alive from one backward to the next step's start.

    Args:
        precision: 'fp32', 'fp16-autocast', 'bf16-autocast' or 'bf16' (see `colab_memopt.techniques.precision`);
            the forward runs under autocast for the autocast ones.
        accumulation_steps: split the batch (the effective batch) into this many micro-batches and
            accumulate their gradients before one optimizer step (see `colab_memopt.techniques.accumulation`).
        scaler: a GradScaler for 'fp16-autocast' (`precision.make_grad_scaler`).
    """
    if scaler is not None and isinstance(optimizer, OptimizerInBackward):
        raise ValueError("a GradScaler (fp16-autocast) cannot drive an optimizer that steps inside backward "
                         "(OptimizerInBackward): it would update with unscaled-away gradients and skip no overflow")
    if is_fused_backward(optimizer):  # LOMO / AdaLomo: backward and update in one call, no gradients kept
        if accumulation_steps != 1 or scaler is not None:
            raise ValueError("LOMO / AdaLomo update inside their own backward: they take no gradient accumulation "
                             f"(got accumulation_steps={accumulation_steps}) and no external loss scaler")
        with autocast_context(precision, input_ids.device):
            loss = model(input_ids, labels=input_ids).loss
        fused_step(optimizer, loss)
        return loss.item()
    optimizer.zero_grad(set_to_none=True)
    if accumulation_steps == 1 and precision == "fp32" and scaler is None:
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        return loss.item()
    micro = split_micro_batches(input_ids, accumulation_steps)
    autocast = autocast_context(precision, input_ids.device)
    loss_value = accumulate_gradients(model, micro, autocast=autocast, scaler=scaler)
    if scaler is not None:
        scaler.step(optimizer)  # unscales; skips the step when a gradient is inf or NaN
        scaler.update()
    else:
        optimizer.step()
    return loss_value


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: TextCorpus,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    recipe: Recipe | None = None,
) -> Callable[[], float]:
    """Return a zero-argument step function that trains on the next seeded batch of the corpus.

    `batch_size` is the effective batch: the rows of one optimizer step, whatever
    `recipe.accumulation_steps` splits it into. `recipe` carries the step-side techniques
    (precision/autocast with its GradScaler, gradient accumulation); the model-side ones
    (pure bf16 weights, checkpointing, attention) are applied by `Recipe.build` before the step is
    made. The loss is `model(x, labels=x).loss`; with `recipe.loss_chunk_tokens` it is computed by
    chunks of tokens from the final hidden states and the head's weight (`loss.apply_chunked_loss`,
    installed by `Recipe.build` and here, for a model built without it). The step function carries `effective_batch` and `micro_batch_sizes` attributes.
    """
    precision = getattr(recipe, "precision", "fp32")
    accumulation_steps = getattr(recipe, "accumulation_steps", 1)
    sizes = micro_batch_sizes(batch_size, accumulation_steps)
    device = next(model.parameters()).device
    scaler = None if is_fused_backward(optimizer) else make_grad_scaler(precision, device)  # LOMO scales itself
    batches = corpus.batches(batch_size, seq_len, seed=seed, device=device)
    if recipe is not None and recipe.loss_chunk_tokens is not None and not recipe.uses_deepspeed:
        apply_chunked_loss(model, recipe.loss_chunk_tokens)  # a no-op where Recipe.build installed it
    if recipe is not None and recipe.uses_deepspeed:  # notebook 10: the model is a DeepSpeed engine
        from colab_memopt.techniques.zero import engine_train_step

        return lambda: engine_train_step(model, next(batches))
    if recipe is not None and recipe.phase_offload is not None:  # notebook 14: phase-aware training
        from colab_memopt.techniques.phases import PhaseConfig, PhaseTrainer

        trainer = PhaseTrainer(model, optimizer, PhaseConfig(offload=recipe.phase_offload))

        def phased_step() -> float:
            return trainer.step(next(batches)).loss

        return phased_step

    def step() -> float:
        return train_step(
            model, optimizer, next(batches), precision=precision, accumulation_steps=accumulation_steps, scaler=scaler
        )

    step.effective_batch = batch_size  # type: ignore[attr-defined]
    step.micro_batch_sizes = sizes  # type: ignore[attr-defined]
    step.scaler = scaler  # type: ignore[attr-defined]
    return step


def make_eval_step(
    model: nn.Module,
    corpus: TextCorpus,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 1234,
    recipe: Recipe | None = None,
) -> Callable[[], float]:
    """Return a zero-argument forward-only step (no gradients) on validation batches, at the recipe's
    evaluation precision (`Recipe.forward_precision`), for measuring a forward-only phase."""
    precision = recipe.forward_precision() if recipe is not None else "fp32"
    device = next(model.parameters()).device
    batches = corpus.batches(batch_size, seq_len, split="val", seed=seed, device=device)

    @torch.no_grad()
    def step() -> float:
        x = next(batches)
        with forward_context(precision, device):
            return model(x, labels=x).loss.item()

    return step


@dataclass
class TrainLog:
    """Losses of a short training run."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: float = float("nan")


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: TextCorpus,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    recipe: Recipe | None = None,
) -> TrainLog:
    """Train for `steps` steps on the corpus and return the loss curve and a final validation loss.

    The recipe's step-side techniques apply to the training steps; evaluation runs at
    `recipe.forward_precision()`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    step = make_train_step(model, optimizer, corpus, batch_size=batch_size, seq_len=seq_len, seed=seed, recipe=recipe)
    log = TrainLog()
    for _ in range(steps):
        log.train_loss.append(step())
    eval_precision = recipe.forward_precision() if recipe is not None else "fp32"
    log.val_loss = evaluate(model, corpus, batch_size=batch_size, seq_len=seq_len, precision=eval_precision)
    return log


def run_steps(step: Callable[[], float], steps: int, *, log_every: int = 10,
              print_fn: Callable[[str], None] = print) -> list[float]:
    """Call `step` `steps` times and return its losses, printing progress every `log_every` steps.

    Each progress line gives the step, the mean loss since the last line and the seconds so far;
    `log_every=0` prints nothing. A non-finite loss stops the run with a ValueError naming the step.

    Example:
        >>> losses = run_steps(make_train_step(model, opt, corpus, batch_size=4, seq_len=256), 100, log_every=20)
        step  20/100  loss 3.412  (4.1 s)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0:
        raise ValueError(f"log_every must be an integer >= 0 (0: silent), got {log_every!r}")
    import math
    import time

    losses: list[float] = []
    logged = 0  # losses already summarised in a progress line
    start = time.perf_counter()
    width = len(str(steps))
    for i in range(1, steps + 1):
        loss = float(step())
        if not math.isfinite(loss):
            raise ValueError(f"the loss at step {i} is {loss}: lower the learning rate or check the data")
        losses.append(loss)
        if log_every and (i % log_every == 0 or i == steps):
            recent, logged = losses[logged:], i
            print_fn(f"step {i:{width}d}/{steps}  loss {sum(recent) / len(recent):.3f}  ({time.perf_counter() - start:.1f} s)")
    return losses
