"""fileio: result files written whole or not at all, read back naming a broken one."""

import ast
import json
from pathlib import Path

import pytest

from colab_memopt import fileio


def test_fileio_imports_nothing_else_from_the_package():
    tree = ast.parse(Path(fileio.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("colab_memopt")]


def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    fileio.write_json(path, {"a": 1})
    fileio.write_json(path, {"a": 2})
    assert fileio.read_json(path) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_failing_save_keeps_the_previous_file(tmp_path):
    path = tmp_path / "claims.md"
    fileio.atomic_write_text(path, "old\n")

    def crash(p):
        p.write_text("ne")
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        fileio.atomic_write(path, crash)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["claims.md"]


def test_write_json_refuses_nan_naming_where(tmp_path):
    with pytest.raises(ValueError, match=r"\{'rows\[1\].err': 'nan'\}"):
        fileio.write_json(tmp_path / "b.json", {"rows": [{"err": 1.0}, {"err": float("nan")}]})
    assert not list(tmp_path.iterdir())


def test_read_json_names_the_broken_file(tmp_path):
    (tmp_path / "e.json").write_text("")
    (tmp_path / "h.json").write_text('{"a": ')
    with pytest.raises(ValueError, match=r"e.json is empty"):
        fileio.read_json(tmp_path / "e.json")
    with pytest.raises(ValueError, match=r"h.json is not valid JSON"):
        fileio.read_json(tmp_path / "h.json")
    with pytest.raises(ValueError, match=r"is a folder, not a JSON file"):
        fileio.read_json(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"nope.json does not exist"):
        fileio.read_json(tmp_path / "nope.json")


def test_writing_into_a_missing_folder_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"its folder .*nope does not exist"):
        fileio.atomic_write_text(tmp_path / "nope" / "x.md", "x")
    assert json.loads(fileio.to_json([1])) == [1]


def test_the_written_file_keeps_its_mode_or_gets_the_umasks(tmp_path):
    import os

    umask = os.umask(0o022)
    try:
        fresh = fileio.atomic_write_text(tmp_path / "new.md", "x")
        assert fresh.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
        kept = tmp_path / "kept.md"
        kept.write_text("old")
        kept.chmod(0o640)
        fileio.atomic_write_text(kept, "new")
        assert kept.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(umask)


# -- files several processes write, writers killed at any moment (reliability probe 4) ----------------------------

_WRITER = r"""
import sys
from colab_memopt.core.fileio import update_json
path, name, start, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for i in range(start, start + count):
    key = f"{name}-{i}"
    update_json(path, lambda old: {**old, "steps": old.get("steps", []) + [key], "blob": "x" * 20000}, empty={})
    print(key, flush=True)  # written: from here on it must survive
"""


def _writer(path, name, start, count):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name, str(start), str(count)],
                            stdout=subprocess.PIPE, text=True)


def test_two_writers_adding_to_one_file_keep_every_result(tmp_path):
    """Probe 4: two processes adding to one results.json without a lock kept 41-48 of 50 results."""
    path = tmp_path / "results.json"
    writers = [_writer(path, name, 0, 25) for name in ("a", "b")]
    confirmed = [line.strip() for w in writers for line in w.communicate(timeout=300)[0].splitlines()]
    assert [w.returncode for w in writers] == [0, 0]
    steps = fileio.read_json(path)["steps"]
    assert len(confirmed) == 50 and sorted(steps) == sorted(confirmed)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == ["results.json"]


def test_a_writer_killed_at_random_moments_loses_nothing_written_before(tmp_path):
    """SIGKILL a writer (a Colab runtime reset) at random moments, 25 times, a second writer racing it: the file is
    always whole JSON and holds every result either writer had finished."""
    import random
    import signal
    import time

    path = tmp_path / "results.json"
    rng = random.Random(0)
    confirmed: set[str] = set()
    for attempt in range(25):
        victim = _writer(path, f"k{attempt}", 0, 1000)
        other = _writer(path, f"o{attempt}", 0, 3)
        first = victim.stdout.readline().strip()  # it writes: kill it at a random moment of its next writes
        time.sleep(rng.uniform(0.0, 0.2))
        victim.send_signal(signal.SIGKILL)
        confirmed |= {first} | {line.strip() for line in victim.communicate(timeout=60)[0].splitlines()}
        confirmed |= {line.strip() for line in other.communicate(timeout=300)[0].splitlines()}
        assert other.returncode == 0
        steps = set(fileio.read_json(path)["steps"])  # whole JSON after every kill
        assert confirmed <= steps, sorted(confirmed - steps)[:5]
    assert len(confirmed) > 25 * 4  # the victims wrote before they were killed (the test can fail)


def test_a_broken_file_is_set_aside_named_and_the_new_results_written(tmp_path):
    """Probe 4: a results.json cut short stopped every later result from being written (JSONDecodeError)."""
    path = tmp_path / "results.json"
    path.write_text('{"steps": [{"step": "unit", "status": "pass')
    with pytest.warns(RuntimeWarning, match=r"results.json is not valid JSON .*kept as results.json.broken-"):
        fileio.update_json(path, lambda old: {"steps": old.get("steps", []) + ["planner"]}, empty={})
    assert fileio.read_json(path) == {"steps": ["planner"]}
    aside = [p for p in tmp_path.iterdir() if ".broken-" in p.name]
    assert len(aside) == 1 and aside[0].read_text() == '{"steps": [{"step": "unit", "status": "pass'
    path.write_text("")  # a second broken file does not replace the first one set aside
    with pytest.warns(RuntimeWarning, match="is empty"):
        fileio.update_json(path, lambda old: {"steps": []}, empty={})
    assert len([p for p in tmp_path.iterdir() if ".broken-" in p.name]) == 2


def test_a_killed_lock_holder_does_not_block_the_next_writer(tmp_path):
    import subprocess
    import sys
    import time

    path = tmp_path / "r.json"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom colab_memopt.core.fileio import locked\n"
                               f"with locked({str(path)!r}):\n    print('held', flush=True)\n    time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(TimeoutError, match=r"\.r\.json\.lock"):
        with fileio.locked(path, timeout_s=0.2):
            pass
    holder.kill()
    holder.wait()
    start = time.monotonic()
    fileio.update_json(path, lambda old: [1], empty=[])
    assert fileio.read_json(path) == [1] and time.monotonic() - start < 5


def test_a_dead_writers_partial_file_is_swept_a_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = tmp_path / f".r.json.{dead.pid}.abc123.partial"
    live = tmp_path / f".r.json.{os.getppid()}.def456.partial"
    for p in (old, live):
        p.write_text("half")
        os.utime(p, (p.stat().st_atime - 120, p.stat().st_mtime - 120))
    fileio.write_json(tmp_path / "r.json", {})
    assert not old.exists() and live.exists()


def test_replace_files_keeps_other_files_and_removes_an_earlier_saves_stale_shards(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "model-00001-of-00002.safetensors").write_text("old shard")
    (folder / "model.safetensors.index.json").write_text("{}")

    def save(tmp):
        (tmp / "model.safetensors").write_text("new")
        (tmp / "config.json").write_text("{}")

    written = fileio.replace_files(folder, save, stale=["model*.safetensors", "model.safetensors.index.json"])
    assert sorted(p.name for p in written) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]

    def crash(tmp):
        (tmp / "model.safetensors").write_text("ne")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        fileio.replace_files(folder, crash, stale=["model*.safetensors"])
    assert (folder / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]


_WRITES = {"write_text", "write_bytes", "dump", "save", "save_pretrained", "save_file", "copy", "copy2", "copyfile"}


def _unsafe_writes(source: str) -> list[int]:
    """Return the lines of `source` that write a file outside a saver handed to this module: a call named in _WRITES
    (or open() for writing) whose nearest enclosing function is neither a lambda nor a def named `save` nor a
    def that a lambda handed to atomic_write / replace_files calls (merge's `_write_shard`)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    savers = {"save"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "atomic_write", "replace_files"):
            for arg in node.args[1:2]:
                savers |= {getattr(c.func, "id", "") for c in ast.walk(arg) if isinstance(arg, ast.Lambda)
                           and isinstance(c, ast.Call)}
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        mode = next((a.value for a in node.args[1:2] if isinstance(a, ast.Constant)), None)
        writes = name in _WRITES or (name == "open" and isinstance(mode, str) and set(mode) & set("wax"))
        if not writes or (name == "save" and not isinstance(node.func, ast.Attribute)):
            continue
        owner = getattr(getattr(node.func, "value", None), "id", "")
        if (name == "dump" and owner != "json") or (name.startswith("copy") and owner != "shutil"):
            continue
        scope = parents.get(node)
        while scope is not None and not isinstance(scope, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = parents.get(scope)
        if not (isinstance(scope, ast.Lambda) or getattr(scope, "name", "") in savers):
            bad.append(node.lineno)
    return bad


def test_every_file_the_package_writes_goes_through_this_module():
    """Issue 44: results, adapters, merged shards, configs, gpucheck's results.json, claims.md, summary and archive are
    written under a temporary name and renamed into place (gpucheck.py's only open() is a step's log, streamed)."""
    root = Path(fileio.__file__).resolve().parents[1]
    found = {}
    for path in sorted(root.rglob("*.py")):
        if path.name in ("fileio.py", "gpucheck.py"):
            continue
        lines = _unsafe_writes(path.read_text())
        if lines:
            found[str(path.relative_to(root))] = lines
    assert not found, found
    assert _unsafe_writes("import json\ndef f(p, d):\n    json.dump(d, open(p, 'w'))\n") == [3, 3]
    assert _unsafe_writes("def f(p):\n    atomic_write(p, lambda t: t.write_text('x'))\n") == []
    shard = "def _shard(t):\n    open(t, 'wb').write(b'')\n"
    assert _unsafe_writes(shard + "def f(p):\n    atomic_write(p, lambda t: _shard(t))\n") == []
    assert _unsafe_writes(shard + "def f(p):\n    _shard(p)\n") == [2]
