"""Names that moved or were renamed in 0.2 (issue 41) keep working for one release: each old
spelling returns the same object as the new one and warns, naming the line to write; and
``flexmask.plot`` (the function) no longer hides the module it lives in."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest
import torch

import flexmask

ROOT_MOVES = [
    ("And", "flexmask.algebra"),
    ("Or", "flexmask.algebra"),
    ("Not", "flexmask.algebra"),
    ("LazyBlockMask", "flexmask.runtime"),
    ("CacheInfo", "flexmask.runtime"),
    ("default_cache", "flexmask.runtime"),
    ("PackedBatch", "flexmask.packing"),
    ("TreePack", "flexmask.packing"),
    ("TreeBatch", "flexmask.packing"),
    ("SequenceLogProbs", "flexmask.packing"),
    ("BatchReport", "flexmask.packing"),
    ("VarlenMask", "flexmask.formats"),
    ("FlashMask", "flexmask.formats"),
    ("MagiMask", "flexmask.formats"),
    ("FA4Mask", "flexmask.formats"),
    ("DecodeStep", "flexmask.inference"),
]
CP_MOVES = [
    "CPShard",
    "HeadTailBalancer",
    "LayerWeightedBalancer",
    "MaskAwareBalancer",
    "PTRRBalancer",
    "PerDocumentBalancer",
    "ShardCache",
]


def _old(module: str, name: str) -> object:
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name}") as caught:
        value = getattr(importlib.import_module(module), name)
    assert caught[0].filename == __file__, "the warning points at the caller's line"
    return value


@pytest.mark.parametrize(("name", "home"), ROOT_MOVES)
def test_a_name_that_left_the_root_still_imports_with_a_warning(name, home):
    assert name not in flexmask.__all__
    value = _old("flexmask", name)
    assert value is getattr(importlib.import_module(home), name)
    assert name in importlib.import_module(home).__all__


@pytest.mark.parametrize("name", CP_MOVES)
def test_context_parallel_names_moved_to_their_package(name):
    context_parallel = pytest.importorskip("flexmask.context_parallel")
    assert _old("flexmask", name) is getattr(context_parallel, name)


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("flexmask", "pack_tree", "pack_one_tree"),
        ("flexmask", "pack_trees", "pack_tree_batch"),
        ("flexmask.packing", "pack_tree", "pack_one_tree"),
        ("flexmask.packing", "pack_trees", "pack_tree_batch"),
    ],
)
def test_the_tree_packers_are_named_for_what_they_return(module, old, new):
    package = importlib.import_module(module)
    assert _old(module, old) is getattr(package, new)
    assert old not in package.__all__ and new in package.__all__
    sequences = [[1, 2, 3], [1, 2, 4]]
    if new == "pack_one_tree":
        assert getattr(package, new)(sequences).tokens.dim() == 1  # one trie: 1-D tokens
    else:
        assert getattr(package, new)(sequences, max_tokens=4).tokens.dim() == 2  # (B, max)


def test_from_import_of_an_old_name_works():
    with pytest.warns(DeprecationWarning, match="pack_one_tree"):
        from flexmask import pack_tree  # noqa: F401


def test_an_unknown_name_is_an_attribute_error_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
            flexmask.nothing  # noqa: B018
        with pytest.raises(AttributeError):
            flexmask.packing.nothing  # noqa: B018


def test_magi_types_are_named_for_magi():
    from flexmask import blocks, formats

    assert (formats.MAGI_FULL, formats.MAGI_CAUSAL) == (0, 1)
    assert (formats.MAGI_INVCAUSAL, formats.MAGI_BICAUSAL) == (2, 3)
    assert "FULL" not in formats.__all__ and "FULL" in blocks.__all__
    mask = flexmask.causal()
    magi = flexmask.to_magi(mask, 1, 1, 8, 8)
    assert magi.attn_type_map.tolist() == [formats.MAGI_CAUSAL]


def test_the_formats_window_is_internal():
    from flexmask.algebra import Window

    assert _old("flexmask.formats", "Window") is not Window


def test_plot_is_the_function_and_plotting_the_module():
    """``import flexmask.plot as m`` gave the function, so the module's other names
    (``block_classes``) could not be reached from its own path."""
    import flexmask.plotting as plotting

    assert callable(flexmask.plot) and flexmask.plot is plotting.plot
    assert plotting.block_classes.__module__ == "flexmask.plotting"
    with pytest.warns(DeprecationWarning, match="flexmask.plotting"):
        from flexmask.plot import block_classes
    assert block_classes is plotting.block_classes
    old = importlib.import_module("flexmask.plot")  # the old path, as a module
    assert old is not plotting.plot and flexmask.plot is plotting.plot


def test_the_old_plot_path_keeps_the_function_in_a_fresh_process():
    """The first import of ``flexmask.plot`` in a process must not rebind ``flexmask.plot``
    to a module (a submodule import sets its parent's attribute)."""
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from flexmask.plot import block_classes\n"
        "import flexmask\n"
        "assert callable(flexmask.plot), flexmask.plot\n"
        "import flexmask.plot as p\n"
        "assert p is flexmask.plot\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_flexmask_warns_nothing():
    code = "import flexmask, flexmask.packing, flexmask.formats, flexmask.plotting"
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, timeout=120)


def test_a_moved_class_still_pickles_by_its_home():
    batch = flexmask.pack([[1, 2, 3], [4, 5]], max_len=5)
    assert type(batch).__module__.startswith("flexmask.packing")
    assert torch.equal(batch.tokens, flexmask.pack([[1, 2, 3], [4, 5]], max_len=5).tokens)
