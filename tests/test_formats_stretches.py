"""``to_magi`` by stretches of queries (``flexmask.formats._stretches``), and ``to_flashmask``
by stretches of key columns, are exact: on random
masks (every piece, ``&``, ``|``, ``~``, offsets on both axes, per-row offsets, B > 1) its
slices give back the independent dense oracle through Magi's documented geometry
(``magi_dense``), and they are the very slices of the per-query path (the greedy cut). The
FlashMask's causal one-bound form read off stretches of columns gives back the oracle through
paddle's ``flashmask_to_densemask`` and is the per-column path's tensor. The stretches
themselves, written out line by line, are the per-query lines both ways (keys per
query, queries per key), which checks every piece's ``line_breaks`` in both directions.

Every test here lowers by stretches whatever the size (``STRETCHES_FROM`` set to 0), both
ways of cutting stretches joined by a usable step; the benchmark's masks are a few of the
cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.formats import _stretches, flashmask, magi, to_flashmask, to_magi
from flexmask.formats._structure import lines, window
from tests import oracle
from tests.strategies import expressions, insertion_tree, negated_compounds, preorder_tree
from tests.test_formats import flashmask_dense, magi_dense, windowed

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BIG = 1 << 62


@pytest.fixture(autouse=True, params=["walk", "lines"])
def by_stretches(request, monkeypatch):
    """Every lowering here reads stretches, however few its lines; stretches joined by a
    usable step cut by the walk over stretches, or (``lines``) by ``_slices`` over a few
    lines of every stretch."""
    monkeypatch.setattr(magi, "STRETCHES_FROM", 0)
    monkeypatch.setattr(flashmask, "STRETCHES_FROM", 0)
    if request.param == "lines":
        monkeypatch.setattr(magi, "_FEW_LINKED", -1)


def per_query(mask, batch, *lengths, **offsets):
    """``to_magi(mask, batch, 1, *lengths)`` by the per-query path, as it runs below
    ``STRETCHES_FROM``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(magi, "STRETCHES_FROM", 1 << 62)
        return to_magi(mask, batch, None, *lengths, *lengths[-1:] * (2 - len(lengths)), **offsets)


def same_slices(got, want) -> None:
    for name in ("q_ranges", "k_ranges", "attn_type_map"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a, b), (name, a.tolist(), b.tolist())
    assert (got.max_seqlen_q, got.max_seqlen_k) == (want.max_seqlen_q, want.max_seqlen_k)


def written_out(stretches, n: int) -> list[list[list[tuple[int, int]]]]:
    """Per row and line, the intervals the stretches say, walked plainly line by line."""
    seg = stretches
    rows = []
    for r in range(seg.start.shape[0]):
        starts = [s for s in seg.start[r].tolist() if s < n]
        out = []
        for m, s in enumerate(starts):
            end = starts[m + 1] if m + 1 < len(starts) else n
            for i in range(end - s):
                line = []
                for k in range(seg.lo.shape[-1]):
                    lo = int(seg.lo[r, m, k]) + i * int(seg.dlo[r, m, k])
                    hi = int(seg.hi[r, m, k]) + i * int(seg.dhi[r, m, k])
                    if lo <= hi:
                        line.append((lo, hi))
                out.append(line)
        assert len(out) == n
        rows.append(out)
    return rows


def listed(lo, hi) -> list[list[list[tuple[int, int]]]]:
    return [
        [
            [(a, b) for a, b in zip(lo[r, q].tolist(), hi[r, q].tolist(), strict=True) if a <= b]
            for q in range(lo.shape[1])
        ]
        for r in range(lo.shape[0])
    ]


@st.composite
def offsets(draw, batch: int):
    """An offset: 0, one for every row, or one per row."""
    kind = draw(st.sampled_from(["zero", "shared", "per_row"]))
    if kind == "zero":
        return 0
    if kind == "shared":
        return draw(st.integers(0, 6))
    return [draw(st.integers(0, 6)) for _ in range(batch)]


def _most(offset) -> int:
    return max(offset) if isinstance(offset, list) else offset


# ----------------------------------------------------------------- against the dense oracle
@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    q_len=st.integers(1, 19),
    kv_len=st.integers(1, 19),
)
def test_magi_by_stretches_equals_the_oracle_and_the_per_query_cut(data, batch, q_len, kv_len):
    q_off, kv_off = data.draw(offsets(batch)), data.draw(offsets(batch))
    n = max(_most(q_off) + q_len, _most(kv_off) + kv_len)
    mask, dense = data.draw(expressions(batch, 1, n, max_leaves=4))
    kwargs = {"q_offset": q_off, "kv_offset": kv_off}
    try:
        m = to_magi(mask, batch, None, q_len, kv_len, **kwargs)
    except ValueError as error:
        assert "from_mask_mod" in str(error), error
        with pytest.raises(ValueError, match="from_mask_mod"):
            per_query(mask, batch, q_len, kv_len, **kwargs)
        return
    want = windowed(lambda a, b: dense(a, b)[:, 0], batch, q_len, kv_len, q_off, kv_off)
    np.testing.assert_array_equal(magi_dense(m, batch, q_len, kv_len), want, str(mask))
    same_slices(m, per_query(mask, batch, q_len, kv_len, **kwargs))


@SETTINGS
@given(data=st.data(), batch=st.integers(1, 3), heads=st.sampled_from([1, 2]))
def test_flashmask_by_stretches_equals_the_oracle_and_the_per_column_path(data, batch, heads):
    length = data.draw(st.integers(1, 19))
    q_off, kv_off = data.draw(offsets(batch)), data.draw(offsets(batch))
    n = max(_most(q_off), _most(kv_off)) + length
    mask, dense = data.draw(expressions(batch, heads, n, max_leaves=4))
    kwargs = {"q_offset": q_off, "kv_offset": kv_off}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flashmask, "STRETCHES_FROM", 1 << 62)
        try:
            want = to_flashmask(mask, batch, heads, length, **kwargs)
        except ValueError:
            with pytest.raises(ValueError):
                patch.undo()
                to_flashmask(mask, batch, heads, length, **kwargs)
            return
    got = to_flashmask(mask, batch, heads, length, **kwargs)
    assert got.causal == want.causal
    assert torch.equal(got.startend_row_indices, want.startend_row_indices), str(mask)
    oracle = np.stack(
        [
            windowed(lambda a, b, h=h: dense(a, b)[:, h], batch, length, length, q_off, kv_off)
            for h in range(heads)
        ],
        1,
    )
    s = got.startend_row_indices
    assert s.dtype == torch.int32
    np.testing.assert_array_equal(
        np.broadcast_to(flashmask_dense(s, got.causal, length), oracle.shape), oracle, str(mask)
    )


@SETTINGS
@given(data=st.data(), batch=st.integers(1, 3), length=st.integers(1, 17))
def test_negated_masks_by_stretches(data, batch, length):
    mask, dense = data.draw(negated_compounds(batch, 1, length))
    try:
        m = to_magi(mask, batch, None, length, length)
    except ValueError as error:
        assert "from_mask_mod" in str(error), error
        return
    np.testing.assert_array_equal(
        magi_dense(m, batch, length, length), dense(length, length)[:, 0], str(mask)
    )
    same_slices(m, per_query(mask, batch, length, length))


@SETTINGS
@given(data=st.data(), batch=st.integers(1, 3), length=st.integers(1, 24))
def test_stretches_written_out_are_the_lines_both_ways(data, batch, length):
    q_off, kv_off = data.draw(offsets(batch)), data.draw(offsets(batch))
    q_len, kv_len = length, data.draw(st.integers(1, 24))
    n = max(_most(q_off) + q_len, _most(kv_off) + kv_len)
    mask, _ = data.draw(expressions(batch, 1, n, max_leaves=4))
    try:
        win = window(mask, batch, None, q_len, kv_len, q_off, kv_off)
    except ValueError:
        return  # heads that differ: nothing to lower
    for transpose in (False, True):
        try:
            want = lines(mask, win, transpose=transpose)
        except ValueError:
            continue  # a mask_mod, or a tree out of preorder (transposed)
        got = _stretches.stretch_lines(mask, win, transpose=transpose, fmt="test")
        if got is None:  # a leaf that does not say where its lines change
            continue
        rows = written_out(*got)
        expected = listed(want.lo, want.hi)
        # A mask whose rows agree may be answered once for every row.
        expected = (
            expected * (len(rows) // len(expected)) if len(expected) < len(rows) else expected
        )
        rows = rows * (len(expected) // len(rows)) if len(rows) < len(expected) else rows
        assert rows == expected, (str(mask), transpose)


# ----------------------------------------------------------------- the benchmark's shapes
def _documents(count: int, length: int, seed: int, empty: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(length - 1, generator=gen)[: count - 1].sort().values + 1).tolist()
    bounds = [0, *cuts, length]
    lens = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    for i in range(empty):  # empty samples between documents
        lens.insert((7 * i) % len(lens), 0)
    return lens


@pytest.mark.parametrize("q_offset", [0, [0, 5, 17]])
def test_per_row_documents_window_sinks_and_trees(q_offset):
    batch, n = 3, 300
    docs = [_documents(9 + r, n, r, empty=r) for r in range(batch)]
    parents = [preorder_tree(n, r) for r in range(batch)]
    shuffled = [insertion_tree(n, r, 4) for r in range(batch)]
    masks = [
        flexmask.causal() & flexmask.document(docs),
        flexmask.causal() & flexmask.sliding_window(37),
        flexmask.causal() & (flexmask.sliding_window(37) | flexmask.prefix([5, 0, 12])),
        flexmask.tree(parents),
        flexmask.tree(parents) & flexmask.padding([300, 250, 1]),
        flexmask.tree(shuffled) | flexmask.prefix(3),
        ~flexmask.document(docs) & flexmask.causal(),
    ]
    q_len = n - (max(q_offset) if isinstance(q_offset, list) else q_offset)
    for mask in masks:
        m = to_magi(mask, batch, None, q_len, n, q_offset=q_offset)
        same_slices(m, per_query(mask, batch, q_len, n, q_offset=q_offset))
        if q_offset != 0 or mask is masks[5]:  # FlashMask: square, trees in preorder
            continue
        got = to_flashmask(mask, batch, 1, n)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(flashmask, "STRETCHES_FROM", 1 << 62)
            want = to_flashmask(mask, batch, 1, n)
        assert got.causal == want.causal
        assert torch.equal(got.startend_row_indices, want.startend_row_indices), str(mask)
    # The documents and the tree take the columns' stretches (FlashMask's first form).
    for mask in masks[0], masks[3]:
        assert flashmask._causal_columns(mask, window(mask, batch, 1, n, n)) is not None


def test_rows_attending_nothing_and_past_every_document():
    mask = (
        flexmask.causal() & flexmask.document([[3, 0, 2], [0], [10]]) & flexmask.padding([5, 9, 4])
    )
    m = to_magi(mask, 3, None, 12, 12)
    np.testing.assert_array_equal(
        magi_dense(m, 3, 12, 12),
        magi_dense(per_query(mask, 3, 12), 3, 12, 12),
    )
    same_slices(m, per_query(mask, 3, 12))


def test_a_piece_that_does_not_say_takes_the_per_query_path():
    # A leaf that does not say where its lines change (the default, None): the whole mask
    # is read per query, and lowers all the same.
    class Opaque(type(flexmask.causal())):
        def line_breaks(self, *, transpose):
            return None

    mask = Opaque() & flexmask.document([4, 4])
    win = window(mask, 1, None, 8, 8)
    assert _stretches.stretch_lines(mask, win, transpose=False, fmt="test") is None
    same_slices(
        to_magi(mask, 1, None, 8, 8),
        to_magi(flexmask.causal() & flexmask.document([4, 4]), 1, None, 8, 8),
    )


def test_sequences_are_one_slice_each_read_off_their_segments():
    """A mask a varlen kernel runs with no window (causal or not, documents, chunks, padding)
    takes one slice per sequence from its segments, no lines read: the slices of the
    per-query cut and of the dense oracle. A sequence of one token leaves it to the lines
    (the cut joins it to its neighbour's first token), so a mask's slices never depend on
    its size."""
    batch, n = 3, 120
    docs = [[30, 2, 47, 41], [120], [5, 60, 9, 20]]
    cases = [
        (flexmask.causal() & flexmask.document(docs), lambda b: oracle.causal(n, n)
         & oracle.document(docs[b], n, n)),
        (flexmask.document(docs), lambda b: oracle.document(docs[b], n, n)),
        (flexmask.causal() & flexmask.chunked(8) & flexmask.padding([120, 100, 3]),
         lambda b: oracle.causal(n, n) & oracle.chunked(8, n, n)
         & oracle.padding([120, 100, 3][b], n, n)),
    ]  # fmt: skip
    for mask, rows in cases:
        assert magi._sequence_slices(mask, window(mask, batch, None, n, n)) is not None
        m = to_magi(mask, batch, None, n, n)
        same_slices(m, per_query(mask, batch, n, n))
        want = np.stack([rows(b) for b in range(batch)])
        np.testing.assert_array_equal(magi_dense(m, batch, n, n), want, str(mask))
        # FlashMask's causal form, from the same sequences where they are causal.
        causal = mask is not cases[1][0]
        assert (flashmask._sequence_columns(mask, window(mask, batch, 1, n, n)) is None) != causal
        got = to_flashmask(mask, batch, 1, n)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(flashmask, "STRETCHES_FROM", 1 << 62)
            per_column = to_flashmask(mask, batch, 1, n)
        assert got.causal == per_column.causal
        assert torch.equal(got.startend_row_indices, per_column.startend_row_indices)
        dense = flashmask_dense(got.startend_row_indices, got.causal, n)[:, 0]
        np.testing.assert_array_equal(dense, want, str(mask))
    one_token = flexmask.causal() & flexmask.document([[30, 1, 89]] * batch)
    assert magi._sequence_slices(one_token, window(one_token, batch, None, n, n)) is None
    same_slices(to_magi(one_token, batch, None, n, n), per_query(one_token, batch, n, n))
