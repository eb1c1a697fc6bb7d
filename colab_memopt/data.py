"""A real text corpus that needs no download: the Python standard library's own source files.

Byte-level tokens (vocabulary 256), a deterministic train/validation split, and seeded batches.
The text differs between Python versions, so losses are comparable within one environment.
"""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 4 * 2**20


def stdlib_source_files() -> list[Path]:
    """Return the standard library's top-level .py files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files in the standard library folder {root}")
    return files


@dataclass
class TextCorpus:
    """Byte tokens split into train and validation parts (uint8 tensors)."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    vocab_size: int = 256

    def _split(self, split: str) -> torch.Tensor:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return self.train if split == "train" else self.val

    def batch(
        self,
        batch_size: int,
        seq_len: int,
        *,
        split: str = "train",
        generator: torch.Generator | None = None,
        device: str | torch.device = "cpu",
    ) -> torch.Tensor:
        """Return `batch_size` random windows of `seq_len` tokens, shape (B, T), dtype long."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        data = self._split(split)
        if seq_len >= len(data):
            raise ValueError(f"seq_len {seq_len} is longer than the {split} split ({len(data)} tokens)")
        starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
        # Gather into a new tensor: a slice would be a view of the whole corpus, and a memory
        # tracker would then bill the corpus's storage to the batch.
        index = starts[:, None] + torch.arange(seq_len)  # (B, T)
        return data[index].long().to(device)

    def batches(
        self,
        batch_size: int,
        seq_len: int,
        *,
        split: str = "train",
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> Iterator[torch.Tensor]:
        """Yield seeded batches forever; the same seed gives the same sequence of batches."""
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield self.batch(batch_size, seq_len, split=split, generator=generator, device=device)


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.1) -> TextCorpus:
    """Return the standard-library corpus, at most `max_bytes` long, the last `val_fraction` held out.

    Example:
        >>> corpus = load_corpus()
        >>> x = corpus.batch(8, 64)  # (8, 64) byte tokens
    """
    if max_bytes < 1024:
        raise ValueError(f"max_bytes must be >= 1024, got {max_bytes}")
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    chunks, total = [], 0
    for path in stdlib_source_files():
        data = path.read_bytes()
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    raw = b"".join(chunks)
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = int(len(tokens) * val_fraction)
    return TextCorpus(
        train=tokens[:-n_val].clone(),
        val=tokens[-n_val:].clone(),
        source=f"{len(chunks)} files of {Path(sysconfig.get_paths()['stdlib'])}",
    )
