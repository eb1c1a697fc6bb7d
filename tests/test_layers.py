"""The package's layers: one folder each (colab_memopt.tooling.layers), no import cycle, no import from a lower
layer to a higher one, and nothing at the top of the package but the facade, the command line's entry and the folders."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import colab_memopt
from colab_memopt.tooling.layers import ENTRY, FACADE, LAYERS, Layer, layer_of, read_layers

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "colab_memopt"
CONTRIBUTING = PACKAGE_DIR.parent / "CONTRIBUTING.md"  # the module table, for contributors


def _module_files(package_dir: Path) -> dict[str, Path]:
    """Return module stem -> file: the top's files (the facade, the entry) and every layer folder's modules."""
    files = {p.stem: p for p in package_dir.glob("*.py")}
    for folder in sorted(p for p in package_dir.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        for path in folder.glob("*.py"):
            if path.stem != "__init__":
                assert path.stem not in files, f"two modules named {path.stem}: {files[path.stem]} and {path}"
                files[path.stem] = path
    return files


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Return module -> the package's modules it imports, reading every import statement of every file.

    Modules are named by their stems (unique across the folders). Function-level imports and `if TYPE_CHECKING:`
    imports count too: a lazy import is still a dependency, and a cycle through one is still a cycle. `from pkg
    import name` where `name` is not a module is an import of the facade (`__init__`); `from pkg.folder import name`
    imports the module `name`.
    """
    package = package_dir.name
    files = _module_files(package_dir)
    folders = {p.name for p in package_dir.iterdir() if p.is_dir()}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == package:
                        parts = parts[2:] if len(parts) > 2 and parts[1] in folders else parts[1:]
                        targets.append(parts[0] if parts else FACADE)
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{path}: use absolute imports (from {package}.<folder>.<module> import ...)"
                parts = (node.module or "").split(".")
                if parts[0] != package:
                    continue
                if len(parts) > 1 and parts[1] in folders:
                    parts = [package] + parts[2:]
                if len(parts) > 1:
                    targets.append(parts[1])
                else:
                    names = [a.name for a in node.names]
                    in_folder = (node.module or "").count(".") == 1
                    targets += [n if (in_folder or n in files) and n in files else FACADE for n in names]
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
    rank[facade] = rank[ENTRY] = len(layers)
    out = []
    for a in sorted(graph):
        if a in (facade, ENTRY):
            continue
        for b in sorted(graph[a]):
            if rank.get(b, -1) > rank[a]:
                name_b = layers[rank[b]].name if rank[b] < len(layers) else "the facade"
                out.append(f"{a} ({layers[rank[a]].name}) -> {b} ({name_b})")
    return out


GRAPH = import_graph(PACKAGE_DIR)


def test_the_package_top_holds_the_facade_the_entry_and_one_folder_per_layer():
    top = sorted(p.name for p in PACKAGE_DIR.iterdir() if p.name != "__pycache__")
    assert top == sorted(["__init__.py", "__main__.py", *colab_memopt.LAYER_FOLDERS]), top
    assert [layer.name for layer in LAYERS] == list(colab_memopt.LAYER_FOLDERS)
    for layer in LAYERS:
        init = PACKAGE_DIR / layer.name / "__init__.py"
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree) or ""
        assert layer.purpose and "Holds:" in doc and "May import:" in doc, f"{init}: say what it holds and may import"
        assert all(isinstance(n, ast.Expr) for n in tree.body), f"{init} runs code: keep it a docstring (lazy imports)"


def test_every_module_is_in_exactly_one_layer():
    declared = [m for layer in LAYERS for m in layer.modules]
    assert len(declared) == len(set(declared)), f"declared twice: {sorted(m for m in declared if declared.count(m) > 1)}"
    present = set(GRAPH) - {FACADE, ENTRY}
    assert present == set(declared)
    assert layer_of("measure") == 0 and layer_of("cli") == len(LAYERS) - 1
    with pytest.raises(KeyError, match="'nope' is in no layer"):
        layer_of("nope")


def test_a_module_may_import_only_what_its_folder_says():
    """Each folder's docstring names the layers it may import; the graph keeps to them."""
    allowed = {}
    for index, layer in enumerate(LAYERS):
        doc = ast.get_docstring(ast.parse((PACKAGE_DIR / layer.name / "__init__.py").read_text())) or ""
        said = doc.split("May import:", 1)[1]
        below = {other.name for other in LAYERS[:index]}
        allowed[layer.name] = below if "every layer below" in said else {
            other.name for other in LAYERS if f"colab_memopt.{other.name}" in said}
        allowed[layer.name].add(layer.name)
    rank = {m: layer.name for layer in LAYERS for m in layer.modules}
    bad = [f"{a} ({rank[a]}) -> {b} ({rank[b]})" for a in GRAPH if a in rank for b in GRAPH[a]
           if b in rank and rank[b] not in allowed[rank[a]]]
    assert bad == []


def test_the_package_has_no_import_cycle():
    assert import_cycles(GRAPH) == []


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(GRAPH, LAYERS) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "colab_memopt"
    pkg.mkdir()
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_a_planted_cycle_is_found_even_through_a_function_level_import(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from colab_memopt.x import a\n",
        "x/__init__.py": "",
        "x/a.py": "from colab_memopt.x.b import g\n\ndef f():\n    return g()\n",
        "x/b.py": "def g():\n    from colab_memopt.x import a\n    return a\n",
        "x/c.py": "import colab_memopt.x.a\n",
    })
    graph = import_graph(pkg)
    assert graph["a"] == {"b"} and graph["b"] == {"a"} and graph["c"] == {"a"}
    assert import_cycles(graph) == [["a", "b"]]


def test_a_planted_upward_import_and_a_facade_import_are_found(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from colab_memopt.bottom.low import x\nfrom colab_memopt.top.high import y\n",
        "bottom/__init__.py": '"""The bottom."""\n',
        "bottom/low.py": "x = 1\n\ndef f():\n    from colab_memopt.top.high import y\n    return y\n",
        "top/__init__.py": '"""The top."""\n',
        "top/high.py": "from colab_memopt.bottom.low import x\ny = x\n",
        "bottom/other.py": "import colab_memopt as cm\n",
    })
    layers = read_layers(pkg, ("bottom", "top"))
    assert layers == (Layer("bottom", "The bottom.", ("low", "other")), Layer("top", "The top.", ("high",)))
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
    assert order == sorted(order), "CONTRIBUTING.md module rows are not in layer order (colab_memopt.tooling.layers.LAYERS)"
