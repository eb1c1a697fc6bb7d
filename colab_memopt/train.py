"""The training step every notebook measures, and the optimizers it can use.

Baseline and technique run through the same step with one option changed, so a measured difference
is the technique's and nothing else's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from colab_memopt.data import TextCorpus
from colab_memopt.optimizers import IN_BACKWARD_SUFFIX, LEAN_OPTIMIZERS, OptimizerInBackward, make_lean_optimizer

if TYPE_CHECKING:
    from colab_memopt.recipe import Recipe

BASE_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum")
# Notebook 06 (lean optimizers): colab_memopt.optimizers, and any of these with the step fused into backward.
_FUSABLE = ("adamw", "adam", "sgd", "sgd_momentum", "lion", "adafactor", "adam8bit", "adamw8bit")
OPTIMIZERS = BASE_OPTIMIZERS + LEAN_OPTIMIZERS + tuple(n + IN_BACKWARD_SUFFIX for n in _FUSABLE)


def make_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], *, lr: float = 1e-3, model: nn.Module | None = None
) -> torch.optim.Optimizer:
    """Return an optimizer by name (one of `OPTIMIZERS`).

    'adamw', 'adam', 'sgd', 'sgd_momentum' are PyTorch's; the lean ones live in
    `colab_memopt.optimizers` ('adam_mini' reads parameter names and heads from `model`);
    '<name>_in_backward' fuses that optimizer's step into backward (`optimizers.OptimizerInBackward`).
    """
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
    if name.endswith(IN_BACKWARD_SUFFIX):
        inner = name[: -len(IN_BACKWARD_SUFFIX)]
        return OptimizerInBackward(params, lambda ps: make_optimizer(inner, ps, lr=lr))
    if name in LEAN_OPTIMIZERS:
        return make_lean_optimizer(name, params, lr=lr, model=model)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor) -> float:
    """Run one training step on a batch of token ids (B, T) and return the loss.

    Gradients are released at the start of the step (`set_to_none=True`), as in PyTorch's own
    training loops, so they stay alive from one backward to the next step's start.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    return loss.item()


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

    `recipe` carries the step-side techniques (none yet at this layer: the default is plain fp32);
    the model-side ones are applied by `Recipe.build` before the step is made.
    """
    device = next(model.parameters()).device
    batches = corpus.batches(batch_size, seq_len, seed=seed, device=device)
    if recipe is not None and recipe.uses_deepspeed:  # notebook 10: the model is a DeepSpeed engine
        from colab_memopt.zero import engine_train_step

        return lambda: engine_train_step(model, next(batches))

    def step() -> float:
        return train_step(model, optimizer, next(batches))

    return step


@dataclass
class TrainLog:
    """Losses of a short training run."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: float = float("nan")


@torch.no_grad()
def evaluate(model: nn.Module, corpus: TextCorpus, *, batch_size: int, seq_len: int, batches: int = 4, seed: int = 1234) -> float:
    """Return the mean validation loss over `batches` seeded batches."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    it = corpus.batches(batch_size, seq_len, split="val", seed=seed, device=device)
    losses = [model(x, labels=x).loss.item() for x, _ in zip(it, range(batches))]
    model.train(was_training)
    return sum(losses) / len(losses)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: TextCorpus,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
) -> TrainLog:
    """Train for `steps` steps on the corpus and return the loss curve and a final validation loss."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    step = make_train_step(model, optimizer, corpus, batch_size=batch_size, seq_len=seq_len, seed=seed)
    log = TrainLog()
    for _ in range(steps):
        log.train_loss.append(step())
    log.val_loss = evaluate(model, corpus, batch_size=batch_size, seq_len=seq_len)
    return log
