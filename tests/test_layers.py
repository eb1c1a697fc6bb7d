"""The package's layers (colab_memopt.layers): no import cycle, no import from a lower layer to a higher one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from colab_memopt.layers import FACADE, LAYERS, Layer, layer_of

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "colab_memopt"
CONTRIBUTING = PACKAGE_DIR.parent / "CONTRIBUTING.md"  # the module table, for contributors


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Return module -> the package's modules it imports, reading every import statement of every file.

    Function-level imports and `if TYPE_CHECKING:` imports count too: a lazy import is still a
    dependency, and a cycle through one is still a cycle. `from pkg import name` where `name` is not a
    module is an import of the facade (`__init__`).
    """
    package = package_dir.name
    modules = {p.stem for p in package_dir.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module in modules:
        tree = ast.parse((package_dir / f"{module}.py").read_text(), filename=f"{module}.py")
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == package:
                        targets.append(parts[1] if len(parts) > 1 else FACADE)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from . import x / from .x import y
                    base = (node.module or "").split(".")[0]
                    parts = [package] + ([base] if base else [])
                else:
                    parts = (node.module or "").split(".")
                if parts[0] != package:
                    continue
                if len(parts) > 1:
                    targets.append(parts[1])
                else:
                    targets += [a.name if a.name in modules else FACADE for a in node.names]
            graph[module].update(t for t in targets if t != module)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected groups of two or more modules (Tarjan): each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def upward_imports(graph: dict[str, set[str]], layers: tuple[Layer, ...], facade: str = FACADE) -> list[str]:
    """Return 'a (layer) -> b (higher layer)' for every import from a lower layer to a higher one.

    Importing the facade counts as importing the top: only the facade itself may gather every layer.
    """
    rank = {m: i for i, layer in enumerate(layers) for m in layer.modules}
    rank[facade] = len(layers)
    out = []
    for a in sorted(graph):
        if a == facade:
            continue
        for b in sorted(graph[a]):
            if rank.get(b, -1) > rank[a]:
                name_b = layers[rank[b]].name if rank[b] < len(layers) else "the facade"
                out.append(f"{a} ({layers[rank[a]].name}) -> {b} ({name_b})")
    return out


GRAPH = import_graph(PACKAGE_DIR)


def test_every_module_is_in_exactly_one_layer():
    declared = [m for layer in LAYERS for m in layer.modules]
    assert len(declared) == len(set(declared)), f"declared twice: {sorted(m for m in declared if declared.count(m) > 1)}"
    present = set(GRAPH) - {FACADE}
    assert present - set(declared) == set(), "modules in no layer: add them to colab_memopt.layers.LAYERS"
    assert set(declared) - present == set(), "layers name modules that do not exist"
    assert layer_of("measure") == 0 and layer_of("__main__") == len(LAYERS) - 1
    with pytest.raises(KeyError, match="'nope' is in no layer"):
        layer_of("nope")


def test_the_package_has_no_import_cycle():
    assert import_cycles(GRAPH) == []


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(GRAPH, LAYERS) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "colab_memopt"
    pkg.mkdir()
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_a_planted_cycle_is_found_even_through_a_function_level_import(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from colab_memopt import a\n",
        "a.py": "from colab_memopt.b import g\n\ndef f():\n    return g()\n",
        "b.py": "def g():\n    from colab_memopt import a\n    return a\n",
        "c.py": "from colab_memopt import a\n",
    })
    graph = import_graph(pkg)
    assert graph["a"] == {"b"} and graph["b"] == {"a"} and graph["c"] == {"a"}
    assert import_cycles(graph) == [["a", "b"]]


def test_a_planted_upward_import_and_a_facade_import_are_found(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from colab_memopt.low import x\nfrom colab_memopt.high import y\n",
        "low.py": "x = 1\n\ndef f():\n    from colab_memopt.high import y\n    return y\n",
        "high.py": "from colab_memopt.low import x\ny = x\n",
        "other.py": "import colab_memopt as cm\n",
    })
    layers = (Layer("bottom", "", ("low", "other")), Layer("top", "", ("high",)))
    graph = import_graph(pkg)
    assert import_cycles(graph) == [["high", "low"]]
    assert upward_imports(graph, layers) == ["low (bottom) -> high (top)", "other (bottom) -> __init__ (the facade)"]


def test_the_readme_module_table_follows_the_layers():
    """Every module has one row in CONTRIBUTING.md's module table, and the rows come in layer order."""
    rows = [line for line in CONTRIBUTING.read_text().splitlines() if line.startswith("| `")]
    order: list[int] = []
    seen: list[str] = []
    for row in rows:
        first_cell = row.split("|")[1]
        names = re.findall(r"`([\w_]+)`", first_cell)
        names = [n for n in names if n in GRAPH or n in {m for layer in LAYERS for m in layer.modules}]
        seen += names
        order += [layer_of(n) for n in names]
    declared = [m for layer in LAYERS for m in layer.modules]
    assert sorted(seen) == sorted(declared), f"missing: {sorted(set(declared) - set(seen))}, twice: {sorted(n for n in seen if seen.count(n) > 1)}"
    assert order == sorted(order), "CONTRIBUTING.md module rows are not in layer order (colab_memopt.layers.LAYERS)"
