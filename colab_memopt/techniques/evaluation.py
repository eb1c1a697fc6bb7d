"""Evaluation: the mean validation loss of a model on the corpus, at a forward-only precision, and what it generates.

The training step (`train`), phase-aware training (`phases`) and the notebooks all evaluate through
`evaluate`, so a validation loss means the same thing everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colab_memopt.techniques.data import TextCorpus
from colab_memopt.techniques.precision import forward_context


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



@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: str,
    *,
    tokenizer: Any = None,
    max_new_tokens: int = 32,
    precision: str = "fp32",
) -> str:
    """Return the model's greedy continuation of `prompt`: the new text only.

    Greedy decoding without a key-value cache, for comparing what a model says before and after
    training (the same prompt gives the same text until the weights change), not for speed.

    Args:
        model: a causal LM whose `model(ids)` returns an object with `.logits` (a transformers model or
            the reference model), in training or evaluation mode (restored afterwards).
        prompt: the text to continue (non-empty).
        tokenizer: None for byte tokens (what `load_corpus` makes without a tokenizer), a tokenizer with
            `encode`, `decode` and a length, or a Hugging Face id or folder to load one from.
        max_new_tokens: tokens to generate (>= 1).
        precision: the forward's precision, 'fp32', 'fp16-autocast' or 'bf16-autocast' (as `evaluate`).

    Example:
        >>> generate(model, "def main():", tokenizer="HuggingFaceTB/SmolLM2-135M", max_new_tokens=20)
    """
    from colab_memopt.techniques.data import _tokenizer

    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    tok, _ = _tokenizer(tokenizer)
    if tok is None:
        ids, vocab = list(prompt.encode("utf-8")), 256
    else:
        ids, vocab = tok.encode(prompt, add_special_tokens=False), len(tok)
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        with forward_context(precision, device):
            for _ in range(max_new_tokens):
                logits = model(x).logits[:, -1, :vocab]  # (1, V): only tokens the tokenizer can decode
                x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
    finally:
        model.train(was_training)
    new = x[0, len(ids):].tolist()
    if tok is None:
        return bytes(new).decode("utf-8", errors="replace")
    return tok.decode(new, skip_special_tokens=True)
