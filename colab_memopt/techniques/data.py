"""A real text corpus that needs no download: the Python standard library's own source files, or yours.

Byte-level tokens (vocabulary 256), a deterministic train/validation split, and seeded batches.
The text differs between Python versions, so losses are comparable within one environment.
`load_corpus(source=...)` takes your own text instead: a text file, a folder of text files, or a
`datasets` dataset; `tokenizer=` tokenizes it with a model's tokenizer (a tokenizer object, or a
Hugging Face id or folder to read one from), byte tokens where there is none.
"""

from __future__ import annotations

import functools
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from colab_memopt.core.console import quiet

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
    tokenizer: str = "bytes"  # what made the tokens: 'bytes', or the tokenizer's name

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


TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".tsv", ".html", ".xml", ".tex", "")


def load_corpus(
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = 0.1,
    *,
    source: Any = None,
    tokenizer: Any = None,
    text_column: str | None = None,
) -> TextCorpus:
    """Return a corpus, at most `max_bytes` of text, the last `val_fraction` held out.

    Args:
        max_bytes: bytes of text read (>= 1024).
        val_fraction: the held-out tail, in (0, 0.5).
        source: None (the standard library's source files), a text file, a JSON Lines file (`.jsonl`:
            the `text_column` of each record, default 'text'), a folder of text files (read
            in sorted order, recursively, files ending in one of `TEXT_SUFFIXES`), or a `datasets`
            Dataset / DatasetDict (its 'train' split; the `text_column`, default 'text' or the first
            string column).
        tokenizer: None (byte tokens, vocabulary 256), a tokenizer (anything with `encode` and a
            length), or a Hugging Face id or folder to load one from with `AutoTokenizer`: byte
            tokens, said in `.tokenizer`, where none can be loaded.

    Example:
        >>> corpus = load_corpus()
        >>> x = corpus.batch(8, 64)  # (8, 64) byte tokens
        >>> mine = load_corpus(source="my_notes.txt", tokenizer="HuggingFaceTB/SmolLM2-135M")
    """
    _check(max_bytes, val_fraction)
    if source is None and tokenizer is None:
        return _stdlib_corpus(max_bytes, val_fraction)
    raw, where = (_stdlib_text(max_bytes) if source is None else _read_text(source, max_bytes, text_column))
    if not raw:
        raise ValueError(f"the corpus source {where} holds no text")
    _check_text(raw, where)
    tok, tok_name = _tokenizer(tokenizer)
    if tok is None:
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        vocab = 256
    else:
        text = raw.decode("utf-8", errors="replace")
        replaced = text.count("\ufffd") - raw.count("\ufffd".encode())
        if replaced:
            import warnings

            warnings.warn(f"{where}: {replaced} byte sequence(s) are not UTF-8 (Latin-1 or another encoding?) and became "
                          "U+FFFD before tokenizing: convert the text to UTF-8 to keep them", stacklevel=2)
        try:
            ids = tok.encode(text, add_special_tokens=False)
        except TypeError:  # a tokenizer whose encode() takes the text alone
            ids = tok.encode(text)
        tokens = torch.tensor(ids, dtype=torch.int32)  # (N,) token ids
        vocab = len(tok)
        if len(tokens) and (int(tokens.max()) >= vocab or int(tokens.min()) < 0):
            raise ValueError(f"the tokenizer {tok_name!r} returned token ids up to {int(tokens.max())} (and down to "
                             f"{int(tokens.min())}), outside its len() of {vocab}: an embedding of {vocab} rows cannot take them")
    n_val = int(len(tokens) * val_fraction)
    if n_val < 2:
        raise ValueError(f"the corpus from {where} has {len(tokens)} tokens: too few for a validation split "
                         f"of {val_fraction}; give more text")
    return TextCorpus(train=tokens[:-n_val].clone(), val=tokens[-n_val:].clone(), source=where, vocab_size=vocab,
                      tokenizer=tok_name)


def _check(max_bytes: int, val_fraction: float) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1024:
        raise ValueError(f"max_bytes must be an integer >= 1024, got {max_bytes!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction must be a number in (0, 0.5), got {val_fraction!r}")


def _check_text(raw: bytes, where: str) -> None:
    """Raise ValueError if `raw` looks binary: NUL bytes in its first 8 kB, or mostly not UTF-8 there."""
    head = raw[:8192]
    if b"\x00" in head:
        raise ValueError(f"{where} looks binary (NUL bytes in its first 8 kB), not text: give a text file")
    text = head.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - head.count("\ufffd".encode())
    if bad > 0.3 * max(1, len(text)):  # Latin-1 prose has a few percent; random bytes over half
        raise ValueError(f"{where} looks binary ({bad} of its first {len(head)} bytes are not UTF-8), not text: give a text file")


def _read_text(source: Any, max_bytes: int, text_column: str | None) -> tuple[bytes, str]:
    """Return (at most `max_bytes` of UTF-8 text, where it came from) from a file, a folder or a dataset."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.is_file() and path.suffix.lower() == ".jsonl":
            return _jsonl_text(path, max_bytes, text_column)
        if path.is_file():
            with open(path, "rb") as f:  # at most max_bytes: a 20 GB dump must not be read whole
                return f.read(max_bytes), f"text file {path}"
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not files:
                raise ValueError(f"the folder {str(path)!r} holds no text files (suffixes {TEXT_SUFFIXES})")
            chunks, total = [], 0
            for f in files:
                with open(f, "rb") as handle:
                    chunks.append(handle.read(max_bytes - total))
                total += len(chunks[-1])
                if total >= max_bytes:
                    break
            return b"".join(chunks), f"{len(chunks)} text files of {path}"
        raise ValueError(f"corpus source {str(source)!r} is neither a file nor a folder")
    if hasattr(source, "column_names"):
        return _dataset_text(source, max_bytes, text_column)
    raise TypeError(f"source must be None, a text file, a folder or a datasets Dataset, got {type(source).__name__}")


def _jsonl_text(path: Path, max_bytes: int, text_column: str | None) -> tuple[bytes, str]:
    """Return the `text_column` (default 'text') of a JSON Lines file's records, joined by blank lines."""
    import json

    column = text_column or "text"
    chunks, total = [], 0
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {number} is not JSON: {exc}") from None
            if not isinstance(record, dict) or column not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path} line {number} has no {column!r} field (it has {keys}); give text_column=")
            data = (str(record[column]) + "\n\n").encode("utf-8")[: max_bytes - total]
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
    return b"".join(chunks), f"JSON Lines file {path}, field {column!r} ({len(chunks)} records)"


def _dataset_text(dataset: Any, max_bytes: int, text_column: str | None) -> tuple[bytes, str]:
    names = dataset.column_names
    if isinstance(names, dict):  # a DatasetDict: {split: [columns]}
        if "train" not in names:
            raise ValueError(f"the dataset has no 'train' split; splits: {sorted(names)}")
        dataset, names = dataset["train"], names["train"]
    column = text_column or ("text" if "text" in names else None)
    if column is None:
        features = getattr(dataset, "features", {}) or {}
        column = next((c for c in names if getattr(features.get(c), "dtype", None) in ("string", "large_string")), None)
    if column is None or column not in names:
        raise ValueError(f"no text column {text_column or 'text'!r} in the dataset; columns: {list(names)} (give text_column=)")
    chunks, total = [], 0
    for row in dataset:
        data = (str(row[column]) + "\n\n").encode("utf-8")[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks), f"dataset column {column!r} ({len(chunks)} rows)"


def _tokenizer(tokenizer: Any) -> tuple[Any, str]:
    """Return (a tokenizer or None for bytes, its name)."""
    if tokenizer is None:
        return None, "bytes"
    if isinstance(tokenizer, (str, Path)):
        try:
            with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
                from transformers import AutoTokenizer

            local = Path(tokenizer).expanduser().exists()
            tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=local or _offline())
        except Exception as exc:  # noqa: BLE001 - no tokenizer there: byte tokens, and say why
            return None, f"bytes (no tokenizer at {str(tokenizer)!r}: {type(exc).__name__})"
        return tok, getattr(tok, "name_or_path", str(tokenizer)) or str(tokenizer)
    if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "__len__")):
        raise TypeError(f"tokenizer must be None, an id or folder, or a tokenizer with encode() and len(), got {type(tokenizer).__name__}")
    return tokenizer, getattr(tokenizer, "name_or_path", type(tokenizer).__name__) or type(tokenizer).__name__


def _offline() -> bool:
    """Return True where the Hugging Face hub cannot be reached (so loading does not retry for half a minute)."""
    from colab_memopt.techniques.architectures import _hub_reachable

    return not _hub_reachable()


def _stdlib_text(max_bytes: int) -> tuple[bytes, str]:
    chunks, total = [], 0
    for path in stdlib_source_files():
        with open(path, "rb") as f:
            chunks.append(f.read(max_bytes - total))
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks), f"{len(chunks)} files of {Path(sysconfig.get_paths()['stdlib'])}"


@functools.lru_cache(maxsize=4)
def _stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.1) -> TextCorpus:
    """Return the standard-library corpus (cached: every notebook reads the same one)."""
    _check(max_bytes, val_fraction)
    raw, source = _stdlib_text(max_bytes)
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = int(len(tokens) * val_fraction)
    return TextCorpus(
        train=tokens[:-n_val].clone(),
        val=tokens[-n_val:].clone(),
        source=source,
    )
