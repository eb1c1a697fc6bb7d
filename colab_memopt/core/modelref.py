"""What a model given as text names: a Hugging Face id ('org/name') or a local path, told apart without importing
torch or transformers (the command line refuses a bad --model with it before the planner is imported).

This module imports nothing else from colab_memopt: every layer of the package may use it.
"""

from __future__ import annotations

from pathlib import Path


def is_hub_id(text: str) -> bool:
    """Return whether `text` has the shape of a Hugging Face id: 'org/name', not a relative or absolute path."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and all(text.split("/"))


def local_path(text: str) -> Path:
    """Return `text` as a path with '~' expanded (kept as given for a '~user' that does not exist)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        return Path(text)
