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
def parent_lists(draw, max_len: int = 40, min_len: int = 1) -> list[int]:
    n = draw(st.integers(min_len, max_len))
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
    # The digest reads int16 up to 32768 tokens and int32 past: long chains differing in
    # their last parent, and a tree one token longer, are all other keys.
    for n in (32767, 32768, 32769):
        chain = [-1, *range(n - 1)]
        changed = chain[:-1] + [-1]
        assert flexmask.tree(chain).key != flexmask.tree(changed).key
        assert flexmask.tree(chain).key == flexmask.tree(torch.tensor(chain)).key
    assert flexmask.tree(list(range(-1, 32766))).key != flexmask.tree(list(range(-1, 32767))).key
    assert flexmask.tree(list(range(-1, 32767))).key != flexmask.tree(list(range(-1, 32768))).key


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
    tree_module = importlib.import_module("flexmask.pieces.tree")
    monkeypatch.setattr(tree_module, "ranks_and_ends_rows", refuse)
    remade = flexmask.tree(torch.tensor(ROWS))
    assert cache.get(remade, 3, 1, 8, 8, "cpu", 4) is built
    assert remade._parents is None  # nor widens its narrow copy to int64
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


# --- the piece's own copy, the narrowed key, exact list conversion --------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda rows: torch.tensor(rows),
        lambda rows: torch.tensor(rows, dtype=torch.int16),
        lambda rows: torch.tensor(rows).t().contiguous().t(),  # a non-contiguous table
        lambda rows: [torch.tensor(r, dtype=torch.int32) for r in rows],
    ],
    ids=["table", "int16-table", "strided-table", "int32-rows"],
)
def test_later_edits_of_the_tensor_given_change_nothing(make):
    given = make(ROWS)
    mask = flexmask.tree(given)
    cache = flexmask.MaskCache()
    built = cache.get(mask, 3, 1, 8, 8, "cpu", 4)
    for row in given if isinstance(given, list) else given.unbind(0):
        row.fill_(-1)  # every token a root: another tree
    assert mask.key == flexmask.tree([list(r) for r in ROWS]).key
    assert [p.tolist() for p in mask.parents] == ROWS
    assert cache.get(flexmask.tree(ROWS), 3, 1, 8, 8, "cpu", 4) is built
    oracle = flexmask.tree([list(r) for r in ROWS]).to_dense(3, 1, 8, 8, "cpu")
    assert torch.equal(mask.to_dense(3, 1, 8, 8, "cpu"), oracle)


@st.composite
def given_rows(draw) -> tuple[list[list[int]], str]:
    """Rows of random parents and how they are given; a table needs rows of one length."""
    how = draw(st.sampled_from(["lists", "tuples", "int64-rows", "int16-rows", "table"]))
    if how == "table":
        n = draw(st.integers(1, 30))
        return draw(st.lists(parent_lists(n, n), min_size=1, max_size=4)), how
    return draw(st.lists(parent_lists(max_len=30), min_size=1, max_size=4)), how


def _give(rows: list[list[int]], how: str):
    if how == "tuples":
        return [tuple(r) for r in rows]
    if how == "table":
        return torch.tensor(rows)
    if how.endswith("-rows"):
        dtype = torch.int64 if how == "int64-rows" else torch.int16
        return [torch.tensor(r, dtype=dtype) for r in rows]
    return [list(r) for r in rows]


@settings(max_examples=80, deadline=None)
@given(case=given_rows(), data=st.data())
def test_one_value_changed_anywhere_is_another_key_however_given(case, data):
    rows, how = case
    key = flexmask.tree(_give(rows, how)).key
    assert key == flexmask.tree([list(r) for r in rows]).key  # the oracle: plain lists
    row = data.draw(st.integers(0, len(rows) - 1), label="row")
    token = data.draw(st.integers(0, len(rows[row]) - 1), label="token")
    parent = data.draw(st.integers(-1, token - 1).filter(lambda p: p != rows[row][token]))
    changed = [list(r) for r in rows]
    changed[row][token] = parent
    assert flexmask.tree(_give(changed, how)).key != key
    if how != "table":  # one token more or fewer in one row
        longer = [list(r) for r in rows]
        longer[row].append(-1)
        assert flexmask.tree(_give(longer, how)).key != key
        if len(rows[row]) > 1:
            shorter = [list(r) for r in rows]
            shorter[row].pop()
            assert flexmask.tree(_give(shorter, how)).key != key


@pytest.mark.parametrize(
    ("parents", "error", "message"),
    [
        ([[-1, 0], [-1, True]], TypeError, r"parents\[1\]\[1\] must be an int, got True \(bool\)"),
        ([[-1, 0], (-1, False)], TypeError, r"parents\[1\]\[1\] must be an int, got False"),
        ([-1, 0.0], TypeError, r"parents\[1\] must be an int, got 0\.0 \(float\)"),
        ([[-1], [-1, 1.5]], TypeError, r"parents\[1\]\[1\] must be an int, got 1\.5"),
        ([[-1], [-1, None]], TypeError, r"parents\[1\]\[1\] must be an int, got None"),
        ([[-1, 2**63]], ValueError, r"parents\[0\]\[1\] must fit in a signed 64-bit integer"),
        ([-1, -(2**63) - 1], ValueError, r"parents\[1\] must fit in a signed 64-bit integer"),
        ([[-1], [-1, 2**70]], ValueError, r"parents\[1\]\[1\] must fit in a signed 64-bit"),
        ([[-1, 0], [-1, 2**63 - 1]], ValueError, r"parents\[1\]\[1\]=9223372036854775807 is not"),
        ([[-1, 0], [-1, 2**32]], ValueError, r"parents\[1\]\[1\]=4294967296 is not a valid"),
        ([[-1, 0], [-1, -(2**32)]], ValueError, r"parents\[1\]\[1\]=-4294967296 is not a valid"),
        # The last token of the longest int16 tree: its own parent, a difference of 0.
        ([-1, *range(32766), 32767], ValueError, r"parents\[32767\]=32767 is not a valid"),
        (torch.tensor([-1, 0.0]), TypeError, r"parents must hold integers, got dtype"),
        ([torch.tensor([-1]), torch.tensor([True])], TypeError, r"parents\[1\] must hold int"),
        (torch.zeros(2, device="meta", dtype=torch.int64), ValueError, r"parents is a meta"),
    ],
)
def test_bad_values_in_lists_and_tensors_are_named(parents, error, message):
    with pytest.raises(error, match=message):
        flexmask.tree(parents)


def test_numpy_and_tensor_scalars_in_lists_are_read_as_their_ints():
    rows = [[-1, np.int64(0), np.int32(1)], [-1, torch.tensor(0), 1]]
    assert flexmask.tree(rows).key == flexmask.tree([[-1, 0, 1], [-1, 0, 1]]).key


def test_the_parents_read_back_as_int64_rows_and_pickle_narrow():
    rows = [[-1, *range(40)], [-1, 0, 0]]
    mask = flexmask.tree(torch.tensor([-1, *range(40)], dtype=torch.int16))
    assert mask.parents[0].dtype == torch.int64 and mask.parents[0].tolist() == rows[0]
    per_row = flexmask.tree(rows)
    assert [p.tolist() for p in per_row.parents] == rows
    fresh = len(pickle.dumps(flexmask.tree(rows)))
    flexmask.create_block_mask(per_row, 2, 1, 41, 41, "cpu", 8)  # widens, orders
    assert len(pickle.dumps(per_row)) == fresh  # neither kept in a pickle
    copy = pickle.loads(pickle.dumps(per_row))
    assert copy == per_row and [p.tolist() for p in copy.parents] == rows


def test_busy_cores_key_on_one_thread_and_give_torchs_threads_back(monkeypatch):
    tree_keys = importlib.import_module("flexmask.pieces.tree_keys")
    rows = [[-1, *range(99)], [-1, *([0] * 99)]]
    quiet = flexmask.tree(torch.tensor(rows)).key
    seen = []
    real_narrowed = tree_keys._narrowed

    def narrowed(values, lengths):
        seen.append(torch.get_num_threads())
        return real_narrowed(values, lengths)

    monkeypatch.setattr(tree_keys, "others_busy", lambda busy: True)
    monkeypatch.setattr(tree_keys, "_narrowed", narrowed)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert flexmask.tree(torch.tensor(rows)).key == quiet
        assert seen == [1] and torch.get_num_threads() == 2
        with pytest.raises(ValueError, match=r"parents\[1\]\[2\]=5"):
            flexmask.tree([[-1, 0, 1], [-1, 0, 5]])
        assert torch.get_num_threads() == 2  # given back after an error too
    finally:
        torch.set_num_threads(before)
