"""Evaluation: the mean validation loss of a model on the corpus, at a forward-only precision.

The training step (`train`), phase-aware training (`phases`) and the notebooks all evaluate through
`evaluate`, so a validation loss means the same thing everywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from colab_memopt.data import TextCorpus
from colab_memopt.precision import forward_context


@torch.no_grad()
def evaluate(
    model: nn.Module,
    corpus: TextCorpus,
    *,
    batch_size: int,
    seq_len: int,
    batches: int = 4,
    seed: int = 1234,
    precision: str = "fp32",
) -> float:
    """Return the mean validation loss over `batches` seeded batches.

    `precision` is the forward-only phase's own: 'fp32', 'fp16-autocast' or 'bf16-autocast'.
    """
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches must be an integer >= 1 (validation batches to average), got {batches!r}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    it = corpus.batches(batch_size, seq_len, split="val", seed=seed, device=device)
    with forward_context(precision, device):
        losses = [model(x, labels=x).loss.float().item() for x, _ in zip(it, range(batches))]
    model.train(was_training)
    return sum(losses) / len(losses)

