"""Write result files whole or not at all, and read them back naming the file that is broken.

Every file the project writes as a result (a notebook's JSON, build/results.json, build/claims.md,
the README index, benchmark results, rank results) goes through `atomic_write`: the content goes to a
temporary file in the same folder, is flushed and fsynced, then `os.replace`d over the target. A
crash, a kill or a full disk leaves either the previous file or the new one, never a truncated one,
and a concurrent reader sees one or the other.

This module imports nothing else from colab_memopt: every layer of the package may use it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some file systems do not open folders; the rename is done either way
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


# A temporary file untouched for this long is a killed writer's, not a live one's (a live write keeps writing).
STALE_PARTIAL_SECONDS = 3600


def sweep_partials(path: str | Path, older_than_s: float = STALE_PARTIAL_SECONDS) -> list[Path]:
    """Remove the temporary files that killed writers of `path` left (`.<name>.*.partial`, older than
    `older_than_s` seconds); return those removed. `atomic_write` calls it before each write."""
    import glob
    import time

    path = Path(path)
    removed = []
    now = time.time()
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        try:
            if now - tmp.stat().st_mtime > older_than_s:
                tmp.unlink()
                removed.append(tmp)
        except OSError:  # another writer removed or replaced it meanwhile
            continue
    return removed


def atomic_write(path: str | Path, save: Callable[[Path], None]) -> Path:
    """Write `path` whole: `save(tmp)` writes a temporary file in the same folder, which then replaces `path`.

    The temporary file is fsynced before the rename, and removed if `save` raises (the previous
    `path`, if any, is then left as it was). Return `path`.

    Example:
        >>> atomic_write("rank0.pt", lambda p: torch.save(result, p))
    """
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot write {path}: its folder {folder} does not exist or is not a folder")
    sweep_partials(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=folder)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        save(tmp)
        with open(tmp, "rb+") as f:  # flush what `save` wrote (through any library) to the disk
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(path))  # mkstemp makes 0600; keep the file's mode, or the umask's default
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` whole or not at all; return `path`."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def nonfinite_paths(value: Any, prefix: str = "") -> dict[str, str]:
    """Return {'a.b[2]': 'nan'} for every NaN or infinite float inside nested dicts and lists."""
    out: dict[str, str] = {}
    if isinstance(value, float) and not math.isfinite(value):
        out[prefix or "(value)"] = repr(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(nonfinite_paths(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(nonfinite_paths(v, f"{prefix}[{i}]"))
    return out


def to_json(data: Any, *, where: str = "the data") -> str:
    """Return strict JSON text (indent 2, trailing newline); refuse NaN and infinity, naming where they are."""
    bad = nonfinite_paths(data)
    if bad:
        raise ValueError(f"{where} holds values JSON cannot represent: {bad}; write them as None (null) with a reason")
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


def write_json(path: str | Path, data: Any) -> Path:
    """Write `data` as strict JSON to `path` whole or not at all (NaN and infinity refused, named); return `path`."""
    return atomic_write_text(path, to_json(data, where=f"{path}"))


def read_json(path: str | Path) -> Any:
    """Return the JSON in `path`; a missing, unreadable or broken file raises ValueError naming it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        what = "is empty" if not text.strip() else f"is not valid JSON ({exc})"
        raise ValueError(f"{path} {what}: it may have been cut short by a crash; re-create it") from exc
