"""Where the project lives: the one place that names its repository (badges and the Colab install)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

REPOSITORY = "colab-memopt/colab-memopt"
BRANCH = "main"
REPOSITORY_URL = f"https://github.com/{REPOSITORY}"


def colab_url(notebook_path: str) -> str:
    """Return the 'Open in Colab' URL of a notebook, from its path in the repository."""
    path = PurePosixPath(notebook_path)
    if path.suffix != ".ipynb" or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"notebook_path must be a relative path to an .ipynb file, got {notebook_path!r}")
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/{path}"


def colab_badge(notebook_path: str) -> str:
    """Return the Markdown of the 'Open in Colab' badge for a notebook."""
    return (
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"({colab_url(notebook_path)})"
    )


# Extras a notebook needs beyond `[colab]`: Colab does not preinstall DeepSpeed (notebook 10 imports it).
NOTEBOOK_EXTRAS = {"10_deepspeed_zero": ("colab", "zero"), "16_full_finetuning_on_a_t4": ("colab", "fullft")}
EXTRAS = ("notebooks", "quant", "zero", "fullft", "colab", "dev")


def notebook_extras(stem: str) -> tuple[str, ...]:
    """Return the extras notebook `stem` (e.g. '10_deepspeed_zero') installs on Colab."""
    return NOTEBOOK_EXTRAS.get(stem, ("colab",))


def install_command(extras: Sequence[str] = ("colab",)) -> str:
    """Return the pip command the notebooks' install cell runs on Colab (keeps Colab's torch).

    Example:
        >>> install_command(("colab", "zero"))  # notebook 10's cell
    """
    if isinstance(extras, str) or not extras:
        raise ValueError(f"extras must be a non-empty sequence of names from {EXTRAS}, got {extras!r}")
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown:
        raise ValueError(f"unknown extras {unknown}; allowed: {EXTRAS}")
    return f'pip install -q "colab-memopt[{",".join(extras)}] @ git+{REPOSITORY_URL}@{BRANCH}"'
