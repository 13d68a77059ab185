"""docs/reference.md and the front doors agree: every name the page lists imports from the path
it is listed under (without a DeprecationWarning) and is in that front door's ``__all__``;
every name of ``flexmask.__all__`` is on the page; no name means two things across the
packages' ``__all__``s; and ``flexmask.__all__`` stays small enough to hold in one's head."""

from __future__ import annotations

import importlib
import pkgutil
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

import flexmask

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
MAX_ROOT_NAMES = 45
"""Issue 41: the root's names a user holds in their head, grouped by task."""


def listed_paths(text: str) -> list[str]:
    """Every dotted path the page documents: each ``::: path`` line, and ``path.member`` for
    each ``- member`` of its (indented) ``members:`` list — a ``:::`` whose members are
    listed documents them, not itself."""
    paths: list[str] = []
    current: str | None = None
    members: list[str] = []

    def close() -> None:
        if current is not None:
            paths.extend([f"{current}.{m}" for m in members] or [current])

    for line in text.splitlines():
        directive = re.match(r"^::: ([\w.]+)\s*$", line)
        member = re.match(r"^\s+- (\w+)\s*$", line)
        if directive:
            close()
            current, members = directive.group(1), []
        elif member and current is not None:
            members.append(member.group(1))
        elif line.strip() and not line[:1].isspace():  # prose: the directive's options ended
            close()
            current, members = None, []
    close()
    return paths


def resolve(path: str) -> tuple[str, str, Any]:
    """``(module, name, value)`` for a dotted path as a user imports it: the longest prefix
    that is a module, then one attribute of it (``from module import name``)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if cut != len(parts) - 1:
            raise AssertionError(f"{path}: {module_name} has no submodule {parts[cut]}")
        return module_name, parts[-1], getattr(module, parts[-1])
    raise AssertionError(f"{path}: no module to import it from")


PATHS = listed_paths(REFERENCE.read_text(encoding="utf-8"))


def test_the_page_lists_names():
    assert len(PATHS) > 80, PATHS
    assert "flexmask.context_parallel.shard_buffers" in PATHS  # a members list is read
    assert "flexmask.pack" in PATHS


def test_the_parser_reads_directives_and_members():
    text = (
        "::: a.b\n::: c.d\n    options:\n      show_root_heading: false\n      members:\n"
        "        - e\n        - f\n\nText.\n\n::: g.h\n"
    )
    assert listed_paths(text) == ["a.b", "c.d.e", "c.d.f", "g.h"]


@pytest.mark.parametrize("path", PATHS)
def test_every_listed_name_imports_as_documented(path):
    if path.startswith("flexmask.context_parallel"):
        pytest.importorskip("torch.distributed")
    if path.startswith("flexmask.integrations.transformers"):
        pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # not through an old spelling
        module_name, name, value = resolve(path)
        exec(f"from {module_name} import {name}", {})
    assert not any(part.startswith("_") for part in path.split(".")), f"{path} is private"
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    if exported is not None and module_name.count(".") <= 1:  # a front door: its __all__
        assert name in exported, f"{path} is documented but not in {module_name}.__all__"
    assert value is not None


def test_flexmask_all_is_on_the_page():
    documented = set()
    for path in PATHS:
        try:
            documented.add(id(resolve(path)[2]))
        except (AssertionError, ImportError, AttributeError):
            continue  # test_every_listed_name_imports_as_documented names it
    missing = [n for n in flexmask.__all__ if id(getattr(flexmask, n)) not in documented]
    assert not missing, f"in flexmask.__all__ but not in docs/reference.md: {missing}"


def task_table(text: str) -> dict[str, list[str]]:
    """The page's table of ``flexmask.__all__`` by task: task -> its names."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`") and not cells[0].startswith("task"):
            rows[cells[0]] = re.findall(r"`(\w+)`", cells[1])
    return rows


def test_the_task_table_is_flexmask_all():
    """The page groups ``flexmask.__all__`` by task (build, attend, pack, check, lower, decode,
    scale out), each name in one group, none left out."""
    table = task_table(REFERENCE.read_text(encoding="utf-8"))
    assert {"attend", "pack", "check", "scale out"} <= set(table), table
    names = [name for group in table.values() for name in group]
    assert len(names) == len(set(names)), names
    import torch.distributed

    expected = set(flexmask.__all__) | (
        set() if torch.distributed.is_available() else {"shard", "lazy_shard", "cp_flex_attention"}
    )
    assert set(names) == expected, set(names) ^ expected


def test_flexmask_all_is_small_and_has_no_duplicate():
    assert len(flexmask.__all__) <= MAX_ROOT_NAMES, len(flexmask.__all__)
    assert len(set(flexmask.__all__)) == len(flexmask.__all__)


def front_doors() -> list[str]:
    return ["flexmask"] + [
        f"flexmask.{m.name}" for m in pkgutil.iter_modules(flexmask.__path__) if m.ispkg
    ]


def test_no_name_means_two_things_across_packages():
    """``FULL`` was a block code in ``flexmask.blocks`` and Magi's type 0 in
    ``flexmask.formats``; ``Window`` two classes; ``Spec`` exported twice."""
    meaning: dict[str, dict[int, list[str]]] = {}
    for door in front_doors():
        module = importlib.import_module(door)
        for name in getattr(module, "__all__", ()):
            meaning.setdefault(name, {}).setdefault(id(getattr(module, name)), []).append(door)
    clashes = {name: list(doors.values()) for name, doors in meaning.items() if len(doors) > 1}
    assert not clashes, clashes


def test_internal_names_are_apart_from_all():
    for door in front_doors():
        module = importlib.import_module(door)
        internal = set(getattr(module, "_INTERNAL", ()))
        assert not internal & set(getattr(module, "__all__", ())), door
        for name in internal:
            assert hasattr(module, name), f"{door}._INTERNAL lists {name}, which it lacks"


def test_readme_links_every_page_of_the_site():
    """A reader of the README finds every page (docs/leaks.md was linked from nowhere)."""
    root = REFERENCE.parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(docs/([\w/.-]+\.md)(?:#[\w-]*)?\)", readme))
    pages = {str(p.relative_to(root / "docs")) for p in (root / "docs").rglob("*.md")}
    assert pages - linked == set(), f"pages the README does not link: {sorted(pages - linked)}"


def test_readme_says_how_to_install_without_a_wheel():
    readme = (REFERENCE.parent.parent / "README.md").read_text(encoding="utf-8")
    assert "pip install -e" in readme and "git+" in readme
    assert "not on PyPI" in readme
