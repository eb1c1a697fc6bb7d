"""Where the project lives: the one place that names its repository (badges and the Colab install)."""

from __future__ import annotations

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


def install_command() -> str:
    """Return the pip command the notebooks' install cell runs on Colab (keeps Colab's torch)."""
    return f'pip install -q "colab-memopt[colab] @ git+{REPOSITORY_URL}@{BRANCH}"'
