"""tests/test_structure.py's layering, with the imports made only for annotations (under
``if TYPE_CHECKING:``) counted too: no import cycle at all, and the algebra (masks and the
piece protocol) imports nothing from the layers above it — the grid a piece classifies is
the algebra's ``TileGrid`` protocol, which ``blocks.grid.BlockGrid`` satisfies."""

from __future__ import annotations

import ast

from tests.test_structure import ROOT, _cycles, _module_name, layer_of


def every_import_graph() -> dict[str, set[str]]:
    """Module -> the flexmask modules it imports, at run time or for annotations."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        graph[name].add(f"{target}.{alias.name}")
                    elif target in modules:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
    return graph


def test_no_import_cycle_even_for_annotations():
    graph = every_import_graph()
    assert len(graph) > 20
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_algebra_imports_nothing_above_it_even_for_annotations():
    graph = every_import_graph()
    upward = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        if name.startswith("flexmask.algebra")
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]
    assert not upward, "\n".join(upward)


def test_the_check_sees_annotation_imports(tmp_path, monkeypatch):
    package = tmp_path / "flexmask"
    (package / "algebra").mkdir(parents=True)
    (package / "blocks").mkdir()
    (package / "__init__.py").write_text("")
    (package / "algebra" / "__init__.py").write_text("")
    (package / "blocks" / "__init__.py").write_text("")
    (package / "algebra" / "mask.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from flexmask.blocks.grid import BlockGrid\n"
    )
    (package / "blocks" / "grid.py").write_text("from flexmask.algebra.mask import Mask\n")
    monkeypatch.setattr("tests.test_structure.ROOT", package)
    monkeypatch.setattr(f"{__name__}.ROOT", package)
    graph = every_import_graph()
    assert "flexmask.blocks.grid" in graph["flexmask.algebra.mask"]
    assert _cycles(graph)
