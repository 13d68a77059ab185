"""A tree in preorder is written from its kv block columns (``builders.columns``): each column
one run of attending q blocks with one full run inside, the rows read across from them, no
tile grid. Checked against torch's build of the dense oracle (``oracle.tree``: a query
attends its ancestors and itself), with the path asserted taken, over the corners: lengths
that are not block multiples on either side, offsets on both axes, trees shorter than the
window (rows that attend nothing), tiny blocks (rows of many short runs) and rectangular
ones, B and H > 1 with a tree per row; other layouts take the tiles."""

from __future__ import annotations

import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flexmask
from flexmask.builders import columns
from tests import oracle
from tests.strategies import preorder_tree


def _counting(counts: dict[str, int]):
    """``columns.ordered_sides``, counting its builds in ``counts["columns"]``."""
    real = columns.ordered_sides

    def spy(*args):
        counts["columns"] += 1
        return real(*args)

    return spy


TREE = sys.modules["flexmask.pieces.tree"]  # the package re-exports a function tree


@pytest.fixture
def taken(monkeypatch):
    """Counts the builds written from columns, taken from any size."""
    counts = {"columns": 0}
    monkeypatch.setattr(columns, "ordered_sides", _counting(counts))
    monkeypatch.setattr(TREE, "_COLUMNS_FROM", 0)
    return counts


def _window(trees, batch, heads, q_len, kv_len, q_off, kv_off) -> np.ndarray:
    span = max(q_off + q_len, kv_off + kv_len)
    out = np.zeros((batch, heads, q_len, kv_len), dtype=bool)
    for b in range(batch):
        whole = oracle.tree(trees[b % len(trees)], span, span)
        out[b, :] = whole[q_off : q_off + q_len, kv_off : kv_off + kv_len]
    return out


@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.integers(1, 2),
    block=st.sampled_from([1, 2, 16, 32, (16, 8), (8, 32), (4, 1)]),
)
def test_preorder_trees_from_columns_match_torch(data, batch, heads, block):
    counts = {"columns": 0}
    per_row = data.draw(st.booleans(), label="per row")
    seeds = data.draw(st.lists(st.integers(0, 10**6), min_size=batch, max_size=batch))
    sizes = data.draw(st.lists(st.integers(1, 150), min_size=batch, max_size=batch))
    trees = [preorder_tree(n, s) for n, s in zip(sizes, seeds, strict=True)]
    trees = trees if per_row else trees[:1]
    longest = max(len(p) for p in trees)
    q_off = data.draw(st.integers(0, longest - 1), label="q_offset")
    kv_off = data.draw(st.integers(0, longest - 1), label="kv_offset")
    q_len = data.draw(st.integers(1, longest + 40 - q_off), label="q_len")
    kv_len = data.draw(st.integers(max(1, longest - kv_off), longest + 40 - kv_off), label="kv_len")
    mask = flexmask.tree(trees if per_row else trees[0])
    with (
        mock.patch.object(columns, "ordered_sides", _counting(counts)),
        mock.patch.object(TREE, "_COLUMNS_FROM", 0),
    ):
        ours = flexmask.create_block_mask(
            mask, batch, heads, q_len, kv_len, "cpu", block, q_offset=q_off, kv_offset=kv_off
        )
    want = oracle.torch_build(
        _window(trees, batch, heads, q_len, kv_len, q_off, kv_off), block=block
    )
    oracle.assert_same_block_mask(ours, want, f"{trees} q_off={q_off} kv_off={kv_off} {block}")
    assert counts["columns"] == 1, "the columns path was not taken"


def test_a_batch_of_long_trees_matches_torch_on_two_threads(taken, monkeypatch):
    """Long enough that both sides are written side by side (``blocks.pair``)."""
    monkeypatch.setattr("flexmask.blocks.pair.SPLIT_FROM", 1)
    monkeypatch.setenv("FLEXMASK_BUILD_THREADS", "2")
    trees = [preorder_tree(1000, 3), preorder_tree(777, 4)]
    ours = flexmask.create_block_mask(flexmask.tree(trees), 2, 1, 1030, 1001, "cpu", 16)
    want = oracle.torch_build(_window(trees, 2, 1, 1030, 1001, 0, 0), block=16)
    oracle.assert_same_block_mask(ours, want)
    assert taken == {"columns": 1}


@pytest.mark.parametrize(
    ("parents", "why"),
    [([-1, 0, 0, 1], "insertion order"), ([[-1, 0, 1], [-1, 0, 0, 1]], "a row not in preorder")],
)
def test_other_layouts_take_the_tiles(taken, parents, why):
    mask = flexmask.tree(parents)
    batch = 2 if isinstance(parents[0], list) else 1
    ours = flexmask.create_block_mask(mask, batch, 1, 4, 4, "cpu", 1)
    rows = parents if batch == 2 else [parents]
    oracle.assert_same_block_mask(
        ours, oracle.torch_build(_window(rows, batch, 1, 4, 4, 0, 0), block=1)
    )
    assert taken == {"columns": 0}, why


def test_per_row_offsets_build_each_row_from_its_columns(taken):
    trees = [preorder_tree(100, 1)]
    mask = flexmask.tree(trees[0])
    ours = flexmask.create_block_mask(mask, 2, 1, 60, 100, "cpu", 16, q_offset=[0, 30])
    for row, q_off in enumerate((0, 30)):
        want = oracle.torch_build(_window(trees, 1, 1, 60, 100, q_off, 0), block=16)
        oracle.assert_same_block_mask(ours[row : row + 1], want, f"row {row}", own_storage=False)
    assert taken == {"columns": 2}  # a row's window at a time


@pytest.mark.parametrize(("length", "batch", "path"), [(1024, 1, 0), (2048, 8, 0), (4096, 8, 1)])
def test_small_grids_classify_their_tiles(monkeypatch, length, batch, path):
    """Below ``_COLUMNS_FROM`` tiles the columns' fixed calls cost more than classifying."""
    counts = {"columns": 0}
    monkeypatch.setattr(columns, "ordered_sides", _counting(counts))
    trees = [preorder_tree(length, seed) for seed in range(batch)]
    ours = flexmask.create_block_mask(flexmask.tree(trees), batch, 1, length, length, "cpu")
    want = oracle.torch_build(_window(trees, batch, 1, length, length, 0, 0), block=128)
    oracle.assert_same_block_mask(ours, want)
    assert counts["columns"] == path
