"""Write files whole or not at all, and read them back naming the file that is broken.

Every file the package writes (a notebook's JSON, build/results.json, build/claims.md, the README
index, benchmark and rank results, saved models and adapters, configs) goes through this module:

- `atomic_write(path, save)`: the content goes to a temporary file with a unique name in the same
  folder, is flushed and fsynced, then `os.replace`d over the target. A crash, a kill or a full disk
  leaves either the previous file or the new one, never a truncated one, and a concurrent reader
  sees one or the other.
- `update_json(path, update)`: read, change and write a JSON file that several processes add to,
  under an exclusive lock (`locked`), so that no writer's result replaces another's. A broken file
  found there is moved aside (`set_aside`), named in a warning, and the new content written.
- `replace_files(folder, save)`: a library's own saver (`save_pretrained`) writes into a staging
  folder beside the target; each file then replaces its namesake by `os.replace`, and weight files
  of an earlier save that the new one did not write are removed. Each file is whole at every moment.

This module imports nothing else from colab_memopt: every layer of the package may use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
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
# A temporary file whose writer (the pid in its name) is gone is removed once untouched for this long: a writer in
# another pid namespace (a container sharing the folder) looks gone, but a live one keeps its file fresh.
DEAD_WRITER_SECONDS = 60


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _newest_mtime(path: Path) -> float:
    if not path.is_dir():
        return path.stat().st_mtime
    times = [path.stat().st_mtime]
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                times.append(os.stat(os.path.join(root, name)).st_mtime)
    return max(times)


def _stale(tmp: Path, now: float, older_than_s: float) -> bool:
    """Return whether a temporary file or staging folder is a killed writer's: untouched for `older_than_s`, or
    its writer's pid (`.<name>.<pid>.<random>.partial`) gone and untouched for `DEAD_WRITER_SECONDS`."""
    age = now - _newest_mtime(tmp)
    parts = tmp.name.rsplit(".", 3)  # ['.<name>', '<pid>', '<random>', 'partial']
    pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
    return age > older_than_s or (pid is not None and pid != os.getpid() and not _pid_alive(pid)
                                  and age > min(older_than_s, DEAD_WRITER_SECONDS))


def sweep_partials(path: str | Path, older_than_s: float = STALE_PARTIAL_SECONDS) -> list[Path]:
    """Remove the temporary files (and staging folders) that killed writers of `path` left
    (`.<name>.*.partial`: untouched for `older_than_s` seconds, or their writer's process gone);
    return those removed. `atomic_write` and `replace_files` call it before each write."""
    import glob

    path = Path(path)
    removed = []
    now = time.time()
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        try:
            if _stale(tmp, now, older_than_s):
                if tmp.is_dir():
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink()
                removed.append(tmp)
        except OSError:  # another writer removed or replaced it meanwhile
            continue
    return removed


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}."


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
    fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".partial", dir=folder)
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


# -- files several processes update: a lock, a read of what is there, a whole write --------------------------------

LOCK_TIMEOUT_SECONDS = 600.0


def lock_path(path: str | Path) -> Path:
    """Return the lock file `locked(path)` takes: `.<name>.lock` beside `path` (left in place: it holds no data)."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def locked(path: str | Path, timeout_s: float = LOCK_TIMEOUT_SECONDS) -> Iterator[Path]:
    """Hold an exclusive lock on `path` (an `fcntl.flock` of `lock_path(path)`) while the block runs.

    The operating system releases it when the holder ends, killed or not, so a killed writer never
    blocks the next. Where the file system has no locks (some network mounts), the block runs
    unlocked with a warning. Raises TimeoutError naming the lock file after `timeout_s` seconds.
    """
    import fcntl

    lock = lock_path(path)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has held {lock} for over {timeout_s:.0f} s: wait for it to "
                                       "finish, or remove the lock file if no such process runs") from None
                time.sleep(0.01)
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                warnings.warn(f"{lock}: this file system takes no locks ({exc.strerror}): {Path(path).name} is "
                              "updated without one, so two processes writing it at once may lose a result",
                              RuntimeWarning, stacklevel=3)
                break
        yield lock
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def set_aside(path: str | Path, reason: str) -> Path:
    """Move a broken `path` to `<name>.broken-<time>` in its folder, warn naming both, and return the new name.

    Nothing is deleted: the broken content stays there for a person to read or repair."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        aside = path.with_name(f"{path.name}.broken-{stamp}" + (f"-{n}" if n else ""))
        try:
            os.link(path, aside)  # never over an earlier broken copy
        except FileExistsError:
            continue
        except OSError:  # no hard links here: a rename to a name checked free
            if aside.exists():
                continue
            os.replace(path, aside)
            break
        path.unlink()
        break
    else:
        raise FileExistsError(f"cannot set {path} aside: 1000 broken copies of it are there already")
    _fsync_dir(path.parent)
    warnings.warn(f"{path} {reason}: kept as {aside.name} beside it; the new results are written in its place",
                  RuntimeWarning, stacklevel=3)
    return aside


def read_json_or_set_aside(path: str | Path, empty: Any = None) -> Any:
    """Return the JSON in `path`, or `empty` where there is no file; a broken file is set aside (`set_aside`,
    with a warning naming it) and `empty` returned, so a writer goes on recording."""
    path = Path(path)
    try:
        return read_json(path)
    except FileNotFoundError:
        return empty
    except ValueError:
        if path.is_dir():
            raise
        try:
            empty_file = not path.read_bytes().strip()
        except OSError:  # unreadable (permissions): not ours to move
            raise
        set_aside(path, "is empty" if empty_file else "is not valid JSON (cut short by a crash?)")
        return empty


def update_json(path: str | Path, update: Callable[[Any], Any], *, empty: Any = None,
                timeout_s: float = LOCK_TIMEOUT_SECONDS) -> Any:
    """Change a JSON file several processes write: under `locked(path)`, read what is there (`empty` if nothing,
    or if it is broken: then it is set aside, named in a warning), write `update(current)` whole, return it.

    Example (each process adds its own step; none replaces another's):
        >>> update_json("build/results.json", lambda old: {**old, "steps": old.get("steps", []) + [step]}, empty={})
    """
    path = Path(path)
    with locked(path, timeout_s):
        new = update(read_json_or_set_aside(path, empty))
        write_json(path, new)
    return new


# -- folders a library saves into (save_pretrained): each file replaced whole ----------------------------------------

def replace_files(folder: str | Path, save: Callable[[Path], Any], *, stale: Iterable[str] = ()) -> list[Path]:
    """Save into `folder` without ever leaving a cut-short file there: `save(staging)` writes into a fresh staging
    folder inside `folder` (same file system); every file it wrote is fsynced and then `os.replace`d over its
    namesake in `folder`; files matching a `stale` glob (an earlier save's weight shards) that this save did not
    write are removed last. Other files in `folder` are left alone. Return the files written.

    A kill or a full disk during `save` leaves the earlier save as it was; one between two renames leaves each
    file whole (the earlier save's or the new one's). If `save` raises, the staging folder is removed.

    Example:
        >>> replace_files("out", lambda tmp: model.save_pretrained(tmp), stale=["model*.safetensors*"])
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "save"  # staging folders are `.save.<pid>.<random>.partial`
    sweep_partials(marker)
    staging = Path(tempfile.mkdtemp(prefix=_temp_prefix(marker), suffix=".partial", dir=folder))
    try:
        save(staging)
        written = sorted(p for p in staging.rglob("*") if p.is_file())
        if not written:
            raise RuntimeError(f"the save into {folder} wrote no file")
        for p in written:
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
        _fsync_dir(staging)
        targets = []
        for p in written:
            target = folder / p.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(p, _mode_for(target))
            os.replace(p, target)
            targets.append(target)
        _fsync_dir(folder)
        names = {t.relative_to(folder) for t in targets}
        for pattern in stale:
            for old in folder.glob(pattern):
                if old.is_file() and old.relative_to(folder) not in names:
                    old.unlink()
        _fsync_dir(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return targets


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
