"""A tree's content key: equal parents give equal keys (and cache hits) however they are
given; any difference in a parent, a row or a row's length gives another key; bad parents
are refused when the tree is made; a hit never computes the tree's order."""

from __future__ import annotations

import importlib
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexmask

ROWS = [[-1, 0, 1, 0, 3], [-1, 0, 0, 2, -1], [-1, 0, -1, 1, 2]]  # the last not in preorder


@st.composite
def parent_lists(draw, max_len: int = 40) -> list[int]:
    n = draw(st.integers(1, max_len))
    return [draw(st.integers(-1, i - 1)) for i in range(n)]


@pytest.mark.parametrize(
    "make",
    [
        lambda rows: [list(r) for r in rows],
        lambda rows: [torch.tensor(r) for r in rows],
        lambda rows: torch.tensor(rows),
        lambda rows: torch.tensor(rows, dtype=torch.int32),
        lambda rows: np.array(rows),
        lambda rows: [np.array(r) for r in rows],
    ],
    ids=["lists", "tensors", "table", "int32-table", "numpy-table", "numpy-rows"],
)
def test_equal_trees_given_any_way_have_equal_keys_and_hit(make):
    reference = flexmask.tree([list(r) for r in ROWS])
    remade = flexmask.tree(make(ROWS))
    assert remade.key == reference.key and remade == reference
    assert hash(remade) == hash(reference)
    cache = flexmask.MaskCache()
    built = cache.get(reference, 3, 1, 8, 8, "cpu", 4)
    assert cache.get(remade, 3, 1, 8, 8, "cpu", 4) is built
    assert (cache.info().hits, cache.info().misses) == (1, 1)


def test_one_shared_tree_is_keyed_the_same_from_a_list_or_a_tensor():
    assert flexmask.tree(ROWS[0]).key == flexmask.tree(torch.tensor(ROWS[0])).key
    # One row per batch row is another mask than one tree shared by every row.
    assert flexmask.tree(ROWS[0]).key != flexmask.tree([ROWS[0]]).key


@pytest.mark.parametrize(
    "other",
    [
        [[-1, 0, 1, 0, 2], ROWS[1], ROWS[2]],  # one parent changed
        [ROWS[0], ROWS[1], [-1, 0, -1, 1, 1]],  # one parent changed in the last row
        [ROWS[1], ROWS[0], ROWS[2]],  # two rows swapped
        [ROWS[0], ROWS[1]],  # a row fewer
        [ROWS[0], ROWS[1], ROWS[2] + [4]],  # a token more in one row
        [ROWS[0], ROWS[1], ROWS[2], [-1]],  # a row more
    ],
)
def test_trees_that_differ_anywhere_have_different_keys_and_miss(other):
    mask, changed = flexmask.tree(ROWS), flexmask.tree(other)
    assert mask.key != changed.key and mask != changed
    cache = flexmask.MaskCache()
    cache.get(mask, len(ROWS), 1, 8, 8, "cpu", 4)
    cache.get(changed, len(other), 1, 8, 8, "cpu", 4)
    assert cache.info().misses == 2


def test_the_same_values_cut_into_other_rows_have_another_key():
    # Concatenated, both are [-1, -1, -1]: the rows' lengths are part of the key.
    assert flexmask.tree([[-1], [-1, -1]]).key != flexmask.tree([[-1, -1], [-1]]).key
    assert flexmask.tree([[-1, -1, -1]]).key != flexmask.tree([[-1], [-1], [-1]]).key


def test_trees_either_side_of_the_narrowed_digest_types_keep_distinct_keys():
    # The digest reads int16 up to 32767 tokens and int32 past: long chains differing in
    # their last parent, and a tree one token longer, are all other keys.
    for n in (32767, 32768, 32769):
        chain = [-1, *range(n - 1)]
        changed = chain[:-1] + [-1]
        assert flexmask.tree(chain).key != flexmask.tree(changed).key
        assert flexmask.tree(chain).key == flexmask.tree(torch.tensor(chain)).key
    assert flexmask.tree(list(range(-1, 32766))).key != flexmask.tree(list(range(-1, 32767))).key


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(parent_lists(), min_size=1, max_size=4), data=st.data())
def test_random_trees_equal_keys_iff_equal_parents(rows, data):
    same = flexmask.tree([torch.tensor(r) for r in rows])
    assert flexmask.tree([list(r) for r in rows]).key == same.key
    row = data.draw(st.integers(0, len(rows) - 1), label="row")
    token = data.draw(st.integers(0, len(rows[row]) - 1), label="token")
    parent = data.draw(st.integers(-1, token - 1), label="new parent")
    changed = [list(r) for r in rows]
    changed[row][token] = parent
    assert (flexmask.tree(changed).key == same.key) == (changed == rows)


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([-1, 0, 2], r"parents\[2\]=2 is not a valid parent"),
        ([-1, 0, -2], r"parents\[2\]=-2 is not a valid parent"),
        ([-1, 65536], r"parents\[1\]=65536 is not a valid parent"),  # not wrapped to int16
        ([-1, 2**40], r"parents\[1\]=1099511627776 is not a valid parent"),
        ([[-1, 0], [-1, 1]], r"parents\[1\]\[1\]=1 is not a valid parent"),
        ([[-1, 0], [-1, 0, 0, 5]], r"parents\[1\]\[3\]=5 is not a valid parent"),
        (torch.tensor([[-1, 0, 1], [-1, 0, 3]]), r"parents\[1\]\[2\]=3 is not a valid parent"),
        ([[-1], []], r"parents\[1\] must hold at least one token"),
        ([], r"parents must hold at least one token"),
        (torch.zeros(0, 3, dtype=torch.int64), r"at least one batch row"),
        (torch.zeros(2, 0, dtype=torch.int64), r"parents\[0\] must hold at least one token"),
    ],
)
def test_bad_parents_are_refused_when_the_tree_is_made(parents, message):
    with pytest.raises(ValueError, match=message):
        flexmask.tree(parents)


@pytest.mark.parametrize(
    "parents", [[-1, True], [-1, 0.0], torch.tensor([-1.0, 0.0]), [[-1, 0], [-1, "0"]]]
)
def test_parents_that_are_not_integers_are_refused(parents):
    with pytest.raises(TypeError, match="parents"):
        flexmask.tree(parents)


def test_a_hit_never_computes_the_order(monkeypatch):
    cache = flexmask.MaskCache()
    built = cache.get(flexmask.tree(ROWS), 3, 1, 8, 8, "cpu", 4)

    def refuse(parents):
        raise AssertionError("the order was computed for a hit")

    # The module, not the package's ``tree`` function of the same name.
    monkeypatch.setattr(importlib.import_module("flexmask.pieces.tree"), "ranks_and_ends", refuse)
    remade = flexmask.tree(torch.tensor(ROWS))
    assert cache.get(remade, 3, 1, 8, 8, "cpu", 4) is built
    with pytest.raises(AssertionError, match="order was computed"):
        flexmask.create_block_mask(remade, 3, 1, 8, 8, "cpu", 4)  # a build needs it


def test_the_order_is_computed_once_and_left_out_of_pickles():
    mask = flexmask.tree(ROWS)
    assert mask.preorder == [True, True, False]
    assert mask.ranks is mask.ranks  # kept after the first read
    assert mask.ranks[2].tolist() == [0, 1, 3, 2, 4]
    copy = pickle.loads(pickle.dumps(mask))
    assert copy == mask and copy.preorder == mask.preorder
    fresh = len(pickle.dumps(flexmask.tree(ROWS)))
    assert len(pickle.dumps(mask)) == fresh  # no ranks or ends in it


@pytest.mark.parametrize("given_as", ["lists", "table"])
def test_a_remade_tree_builds_the_same_block_mask_as_the_first(given_as):
    rows = [[-1, *range(40)], [-1, 0, 1, 0, 3, *range(4, 40)], [-1, *([0] * 40)]]
    first = flexmask.tree(rows)
    again = flexmask.tree(torch.tensor(rows) if given_as == "table" else [list(r) for r in rows])
    a = flexmask.create_block_mask(first, 3, 1, 41, 41, "cpu", 8)
    b = flexmask.create_block_mask(again, 3, 1, 41, 41, "cpu", 8)
    assert torch.equal(a.to_dense(), b.to_dense())
    assert torch.equal(first.to_dense(3, 1, 41, 41, "cpu"), again.to_dense(3, 1, 41, 41, "cpu"))
