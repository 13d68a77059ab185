"""The package's shape: no import cycle among flexmask modules, layers that import only
downward, no private name imported across packages, and no module of several jobs (over 600
lines)."""

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
    # Importing a.b.c runs a.b's __init__ first: an edge to every package above a target
    # that is not above the importer (those are already being imported), the root aside.
    for name in graph:
        above = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        for target in list(graph[name]):
            parts = target.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if package in modules and package not in above and package != name:
                    graph[name].add(package)
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


# The layers, lowest first: a module imports only its own layer and the layers below.
# Pieces stand on blocks (a piece classifies tiles of the grid); the consumers stand on
# everything else and use only public names.
LAYERS: list[tuple[str, ...]] = [
    ("flexmask._validate", "flexmask._cores", "flexmask._deprecated"),
    ("flexmask.algebra",),
    ("flexmask.blocks",),
    ("flexmask.pieces",),
    ("flexmask.builders", "flexmask.formats"),  # formats: lowerings to other kernels' masks
    ("flexmask.runtime",),
    ("flexmask.backends", "flexmask.block_sparse"),
    ("flexmask.attention",),
    (
        "flexmask.packing",
        "flexmask.inference",
        "flexmask.context_parallel",
        "flexmask.integrations",
        "flexmask.gallery",  # mask families by their sources' names, composed of pieces
        "flexmask.plotting",
    ),
    ("flexmask",),
]


def layer_of(module: str) -> int:
    """The layer of a module: its longest matching prefix in ``LAYERS``."""
    best, found = -1, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), rank
    if found < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a higher layer, as "importer -> imported"."""
    return [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]


def _package(module: str, modules: set[str]) -> str:
    """A module's package: itself when it is one (an ``__init__``), else its parent."""
    return module if any(m.startswith(module + ".") for m in modules) else module.rsplit(".", 1)[0]


def private_imports(sources: dict[str, str]) -> list[str]:
    """``from x import _name`` where x is in another package than the importer (a package's
    own ``__init__`` re-exporting counts as inside), and imports of a module named ``_x``
    from outside its package. ``flexmask._validate`` is the shared base (and
    ``flexmask._deprecated`` the front doors' table of old spellings): importing it is
    public; its own underscored names are not."""
    modules = set(sources)
    found = []
    for name, text in sorted(sources.items()):
        own = _package(name, modules)
        for node in _runtime_imports(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "flexmask"
            ):
                continue
            target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                where = _package(full, modules) if full in modules else _package(target, modules)
                inside = where == own or where.startswith(own + ".")
                private_name = alias.name.startswith("_") and alias.name != "__version__"
                private_module = any(
                    part.startswith("_")
                    and part not in ("_validate", "_cores", "_deprecated", "__init__")
                    for part in (full if full in modules else target).split(".")
                )
                if (private_name or private_module) and not inside:
                    found.append(f"{name}: from {target} import {alias.name}")
    return found


def _sources() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in ROOT.rglob("*.py")}


def test_layers_import_only_downward():
    graph = import_graph()
    for name in graph:
        layer_of(name)  # every module is placed
    upward = upward_imports(graph)
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_no_private_import_across_packages():
    leaks = private_imports(_sources())
    assert not leaks, "private names imported across packages:\n" + "\n".join(leaks)


def test_the_layer_and_privacy_checks_can_fail():
    bad = {
        "flexmask.algebra.mask": {"flexmask.builders.create"},
        "flexmask.builders.create": {"flexmask.algebra.mask"},
    }
    assert upward_imports(bad) == ["flexmask.algebra.mask -> flexmask.builders.create"]
    sources = {
        "flexmask.runtime.lazy": "from flexmask.builders.create import _build\n",
        "flexmask.runtime.cache": "from flexmask.runtime.lazy import _handle\n",
        "flexmask.builders.create": "from flexmask.pieces._base import Piece\n",
        "flexmask.pieces._base": "",
        "flexmask.pieces": "from flexmask.pieces._base import Piece\n",
    }
    assert private_imports(sources) == [
        "flexmask.builders.create: from flexmask.pieces._base import Piece",
        "flexmask.runtime.lazy: from flexmask.builders.create import _build",
    ]


def test_no_package_named_build():
    assert not (ROOT / "build").exists()
    assert not (ROOT / "build.py").exists()


SHARED_BACKEND_MODULES = {"request", "finite", "plan", "dense", "flash", "threads", "mod_eval"}
"""flexmask/backends' modules below the backends: what they share (the call, the non-finite
rule, reading a BlockMask, the dense SDPA kernel, threads, calling a mod)."""


def backend_cross_imports(graph: dict[str, set[str]], backends: set[str]) -> list[str]:
    """Edges from one backend (a module or package of flexmask.backends) to another."""

    def backend_of(module: str) -> str | None:
        parts = module.split(".")
        if parts[:2] != ["flexmask", "backends"] or len(parts) < 3:
            return None
        return parts[2] if parts[2] in backends else None

    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if backend_of(name) and backend_of(target) and backend_of(name) != backend_of(target)
    )


def test_no_imports_between_backends():
    """A backend imports the shared modules below the backends, never another backend: each
    can be read, replaced or registered alone (``flexmask.backends.register_backend``)."""
    from flexmask import backends

    names = {module.__name__.split(".")[2] for module in backends.TABLE.values()}
    files = {p.stem for p in (ROOT / "backends").iterdir() if p.suffix == ".py" or p.is_dir()}
    files -= {"__init__", "__pycache__"}
    assert files - names == SHARED_BACKEND_MODULES, files - names
    crossing = backend_cross_imports(import_graph(), names)
    assert not crossing, "imports between backends:\n" + "\n".join(crossing)
    assert backend_cross_imports(
        {"flexmask.backends.flex": {"flexmask.backends.block_sparse"}}, {"flex", "block_sparse"}
    ) == ["flexmask.backends.flex -> flexmask.backends.block_sparse"]


MAX_MODULE_LINES = 600
"""A module longer than this holds several jobs: split it by job (docs/architecture.md)."""


def long_modules(root: pathlib.Path = ROOT, limit: int = MAX_MODULE_LINES) -> list[str]:
    """The modules under ``root`` of more than ``limit`` lines, as "path (lines)", longest
    first."""
    sizes = {path: len(path.read_text().splitlines()) for path in root.rglob("*.py")}
    return [
        f"{path.relative_to(root.parent)} ({lines})"
        for path, lines in sorted(sizes.items(), key=lambda item: -item[1])
        if lines > limit
    ]


def test_no_module_over_600_lines():
    long = long_modules()
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_the_length_check_can_fail(tmp_path):
    package = tmp_path / "flexmask"
    (package / "sub").mkdir(parents=True)
    (package / "short.py").write_text("x = 1\n" * 3)
    (package / "sub" / "long.py").write_text("x = 1\n" * 5)
    assert long_modules(package, limit=4) == [f"{pathlib.Path('flexmask', 'sub', 'long.py')} (5)"]


def long_functions(sources: dict[str, str], limit: int = 80) -> list[str]:
    """``module.function (lines)`` for every function whose code (its docstring aside) runs
    over ``limit`` lines."""
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            first = body[0]
            documented = isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant
            )
            start = (
                (body[1].lineno if len(body) > 1 else first.end_lineno)
                if documented
                else first.lineno
            )
            length = (node.end_lineno or start) - start + 1
            if length > limit:
                found.append(f"{name}.{node.name} ({length})")
    return sorted(found)


def test_no_function_over_80_lines_of_code():
    """Docstrings aside: a function longer than a screen does several jobs."""
    long = long_functions(_sources())
    assert not long, "functions over 80 lines of code:\n" + "\n".join(long)
    assert long_functions({"m": "def f():\n    '''doc'''\n" + "    x = 1\n" * 81}) == ["m.f (81)"]


def _exports(
    path: pathlib.Path, lists: tuple[str, ...] = ("__all__", "_INTERNAL")
) -> set[str] | None:
    """The names a module lists in ``__all__`` (for users) and ``_INTERNAL`` (for the other
    flexmask packages); None where it has neither."""
    found: set[str] | None = None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in lists for t in node.targets
        ):
            found = (found or set()) | set(ast.literal_eval(node.value))
    return found


def back_door_imports(sources: dict[str, str], exports: dict[str, set[str] | None]) -> list[str]:
    """Imports that pass a package's front door: across flexmask's top-level packages
    (``flexmask.blocks``, ``flexmask.runtime``, ...), a name comes from the package itself and
    is in its ``__init__``'s ``__all__`` or ``_INTERNAL`` (for a top-level module such as
    ``flexmask.attention``, its ``__all__`` or, without one, any name without an underscore).
    Subpackages of the root (``from flexmask import pieces``) are their own front door. Every
    import counts, under ``TYPE_CHECKING`` and inside functions too."""

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    found = []
    for name, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                found += [
                    f"{name}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("flexmask.")
                    and top(a.name) != top(name)
                    and a.name != top(a.name)
                ]
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            target = node.module or ""
            if not target.startswith("flexmask.") or top(target) == top(name):
                continue
            door = exports.get(target, set()) if target == top(target) else set()
            for alias in node.names:
                public = alias.name in door if door is not None else alias.name[:1] != "_"
                if not public:
                    found.append(f"{name}: from {target} import {alias.name}")
    return found


def test_packages_are_entered_by_their_front_doors():
    """Each package's ``__init__`` lists what other packages may use: no import across
    packages takes a name from a module inside one, or a name its ``__all__`` leaves out."""
    sources = _sources()
    exports = {
        _module_name(path): _exports(path)
        for path in ROOT.rglob("*.py")
        if _module_name(path).count(".") == 1
    }
    leaks = back_door_imports(sources, exports)
    assert not leaks, "imports past a package's front door:\n" + "\n".join(leaks)


def test_the_front_door_check_can_fail():
    sources = {
        "flexmask.runtime.lazy": (
            "from flexmask.builders import build, secret\n"
            "from flexmask.builders.create import build\n"
            "from flexmask.runtime.cache import default_cache\n"
            "def f():\n    from flexmask.attention import _private, flex_attention\n"
        ),
        "flexmask.formats.fa4": "import flexmask.blocks.read\nfrom flexmask import pieces\n",
    }
    exports = {"flexmask.builders": {"build"}, "flexmask.attention": None}
    assert back_door_imports(sources, exports) == [
        "flexmask.formats.fa4: import flexmask.blocks.read",
        "flexmask.runtime.lazy: from flexmask.builders import secret",
        "flexmask.runtime.lazy: from flexmask.builders.create import build",
        "flexmask.runtime.lazy: from flexmask.attention import _private",
    ]
