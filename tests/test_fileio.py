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
