"""The package's shape: no import cycle among flexmask modules, and the build package laid
out in data-flow order with mask.py importing nothing from it."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "flexmask"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module) -> list[ast.stmt]:
    """Import statements that run: everywhere but under ``if TYPE_CHECKING:``."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)  # type: ignore[arg-type]
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        graph[name].add(f"{target}.{alias.name}")
                    elif target in modules:
                        graph[name].add(target)
            else:
                graph[name].update(a.name for a in node.names if a.name in modules)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycle_among_flexmask_modules():
    graph = import_graph()
    assert len(graph) > 20  # the walk found the package
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_mask_imports_nothing_from_the_build():
    graph = import_graph()
    assert not {m for m in graph["flexmask.mask"] if m.startswith("flexmask.build")}
    # ... and the build stages import only earlier stages (data-flow order).
    order = ["codes", "grid", "write", "closed_form", "classify", "read", "create"]
    for later, stage in enumerate(order):
        deps = {m.rsplit(".", 1)[-1] for m in graph[f"flexmask.build.{stage}"]}
        assert not deps & set(order[later + 1 :]), f"build.{stage} imports a later stage"
