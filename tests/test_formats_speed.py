"""The lowerings' vectorised paths (issue #32) against plain references: ``to_varlen``'s
sequences read from every row at once, and the check it skips where queries and keys are
the same positions, over windows with per-row offsets that differ between rows, rows that
attend nothing, and B > the mask's rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.algebra import INF
from flexmask.algebra.lines import _ends_at_or_before, run_at
from flexmask.backends import slices
from flexmask.backends.slices import calls as slice_calls
from flexmask.formats import BICAUSAL, FULL, INVCAUSAL, to_flashmask, to_magi, to_varlen
from flexmask.formats._structure import (
    _clip,
    _clip_normalized,
    _intersect,
    _normalize,
    _union,
)
from tests.strategies import leaves

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VARLEN_KINDS = ("causal", "window", "document", "padding", "chunked", "full", "empty")


def varlen_dense(v) -> np.ndarray:
    """(B, Q, KV) by flash-attn's documented rule, written plainly: query i of a sequence
    with sq queries and sk keys sees key j when j <= i + sk - sq (causal) and
    i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded)."""
    out = np.zeros((v.batch * v.q_len, v.batch * v.kv_len), dtype=bool)
    cu_q, cu_k = v.cu_seqlens_q.tolist(), v.cu_seqlens_k.tolist()
    q_index, k_index = v.q_index.tolist(), v.k_index.tolist()
    left, right = v.window_size
    for s in range(len(cu_q) - 1):
        sq, sk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(sq):
            for j in range(sk):
                d = i + sk - sq
                if v.causal and j > d or left >= 0 and j < d - left or right >= 0 and j > d + right:
                    continue
                out[q_index[cu_q[s] + i], k_index[cu_k[s] + j]] = True
    blocks = []
    for b in range(v.batch):
        rows = out[b * v.q_len : (b + 1) * v.q_len]
        mine = rows[:, b * v.kv_len : (b + 1) * v.kv_len]
        assert rows.sum() == mine.sum(), "a sequence crosses batch rows"
        blocks.append(mine)
    return np.stack(blocks)


@st.composite
def masks(draw, batch: int, length: int):
    """(mask, dense(n, n) -> (B, n, n)): an & of 1..3 pieces varlen may take."""
    mask, ref = draw(leaves(batch, length, VARLEN_KINDS))
    for _ in range(draw(st.integers(0, 2))):
        other, other_ref = draw(leaves(batch, length, VARLEN_KINDS))
        mask, ref = mask & other, (lambda q, kv, a=ref, b=other_ref: a(q, kv) & b(q, kv))
    return mask, ref


@SETTINGS
@given(data=st.data(), batch=st.integers(1, 4), aligned=st.booleans())
def test_varlen_per_row_offsets_equal_the_oracle_or_refuse(data, batch, aligned):
    q_len = data.draw(st.integers(1, 17))
    q_off = [data.draw(st.integers(0, 9)) for _ in range(batch)]
    if aligned:  # the same positions on both sides, each row its own: no check runs
        kv_len, kv_off = q_len, list(q_off)
    else:  # queries end where their keys end (decode, chunked prefill)
        extra = data.draw(st.integers(0, min(q_off)))
        kv_len, kv_off = q_len + extra, [q - extra for q in q_off]
    length = max(max(q_off) + q_len, max(kv_off) + kv_len)
    mask, dense = data.draw(masks(batch, length + 2))
    try:
        v = to_varlen(mask, batch, None, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
    except ValueError as error:
        assert not aligned or "differs between rows" in str(error), (mask, error)
        return
    full = dense(length, length)
    want = np.stack(
        [full[b, q_off[b] : q_off[b] + q_len, kv_off[b] : kv_off[b] + kv_len] for b in range(batch)]
    )
    np.testing.assert_array_equal(varlen_dense(v), want, str(mask))
    lens = (v.cu_seqlens_q[1:] - v.cu_seqlens_q[:-1]).tolist()
    assert v.max_seqlen_q == max(lens, default=0) and min(lens, default=1) > 0
    k_lens = (v.cu_seqlens_k[1:] - v.cu_seqlens_k[:-1]).tolist()
    assert v.max_seqlen_k == max(k_lens, default=0) and min(k_lens, default=1) > 0
    # Sequences run in order: by batch row, then first query.
    assert v.q_index.tolist() == sorted(v.q_index.tolist())


def test_varlen_rows_that_attend_nothing_leave_no_sequence():
    mask = (
        flexmask.causal()
        & flexmask.document([[3, 2], [4]], truncate=True)
        & flexmask.padding([0, 4], truncate=True)
    )
    v = to_varlen(mask, 2, None, 6, 6)
    assert v.cu_seqlens_q.tolist() == [0, 4] and v.q_index.tolist() == [6, 7, 8, 9]
    assert v.k_index.tolist() == [6, 7, 8, 9]
    nothing = to_varlen(flexmask.empty() & flexmask.document([3, 2], truncate=True), 3, None, 5, 5)
    assert nothing.num_sequences == 0 and nothing.q_index.numel() == 0
    assert nothing.cu_seqlens_q.tolist() == [0] and nothing.max_seqlen_q == 0


def test_varlen_many_per_row_documents_match_a_loop():
    """B = 8 rows of ~100 documents each: the sequences are every row's documents in order."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        lens = torch.randint(1, 40, (200,), generator=gen).tolist()
        total, out = 0, []
        for n in lens:
            if total + n > 2000:
                break
            out.append(n)
            total += n
        rows.append(out)
    v = to_varlen(flexmask.causal() & flexmask.document(rows, truncate=True), 8, None, 2048, 2048)
    want = [0]
    for lens in rows:
        for n in lens:
            want.append(want[-1] + n)
    assert v.cu_seqlens_q.tolist() == want == v.cu_seqlens_k.tolist()
    index = [b * 2048 + i for b, lens in enumerate(rows) for i in range(sum(lens))]
    assert v.q_index.tolist() == index == v.k_index.tolist()
    assert v.max_seqlen_q == max(max(lens) for lens in rows)


# ----------------------------------------------------------------- interval algebra fast paths
@st.composite
def normalized_lists(draw, rows: int, lines: int, slots: int):
    """A normalized (R, N, K) list (``_normalize`` of random intervals, some empty, some
    unbounded) with K <= slots."""
    value = st.one_of(st.integers(-6, 30), st.sampled_from([-(1 << 61), 1 << 61]))
    shape = (rows, lines, slots)
    lo = torch.tensor(
        draw(st.lists(value, min_size=rows * lines * slots, max_size=rows * lines * slots))
    )
    hi = torch.tensor(
        draw(st.lists(value, min_size=rows * lines * slots, max_size=rows * lines * slots))
    )
    return _normalize(lo.view(shape), hi.view(shape))


def _general_intersect(a, b):
    rows = max(a[0].shape[0], b[0].shape[0])
    a_lo, a_hi, b_lo, b_hi = (t.expand(rows, *t.shape[1:]) for t in (*a, *b))
    lo = torch.maximum(a_lo.unsqueeze(-1), b_lo.unsqueeze(-2)).flatten(-2)
    hi = torch.minimum(a_hi.unsqueeze(-1), b_hi.unsqueeze(-2)).flatten(-2)
    return _normalize(lo, hi)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), lines=st.integers(1, 6), slots=st.integers(1, 3))
def test_intersect_union_and_clip_fast_paths_equal_the_general_merge(data, lines, slots):
    rows_a, rows_b = data.draw(st.sampled_from([(1, 1), (1, 3), (3, 1), (3, 3)]))
    a = data.draw(normalized_lists(rows_a, lines, slots))
    one = data.draw(normalized_lists(rows_b, lines, 1))
    for got, want in (
        (_intersect(a, one), _general_intersect(a, one)),
        (_intersect(one, a), _general_intersect(a, one)),
    ):
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    other = data.draw(normalized_lists(rows_a, lines, 1))
    got = _union(one, other)
    rows = max(rows_a, rows_b)
    want = _normalize(
        torch.cat([one[0].expand(rows, -1, -1), other[0].expand(rows, -1, -1)], -1),
        torch.cat([one[1].expand(rows, -1, -1), other[1].expand(rows, -1, -1)], -1),
    )
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    first = torch.tensor([[data.draw(st.integers(-3, 10))] for _ in range(rows_b)])
    last = first + data.draw(st.integers(-1, 20))
    got, want = _clip_normalized(a, first, last), _clip(a, first, last)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


@given(
    spans=st.lists(
        st.tuples(st.sampled_from([-1, 0, 1]), st.integers(0, 12), st.integers(0, 6)),
        max_size=12,
    ),
    ordered=st.booleans(),
)
def test_first_touch_in_start_order_equals_the_general_walk(spans, ordered):
    spans = [(row, start, start + n) for row, start, n in spans]
    spans.sort(key=lambda s: s[0] if not ordered else s)  # rows ascending, as calls run
    row, start, end = (torch.tensor([s[i] for s in spans], dtype=torch.int64) for i in range(3))
    got = slices._first_touches(row, start, end, 20).tolist()
    assert tuple(got) == slices._first_touch_any(spans)
    if all(end > start for _, start, end in spans):  # empty spans cover nothing to compare
        assert tuple(got) == reference_first(spans, 20)


# The slices backend's lowering as it was written before issue #32, call by call: the
# reference its vectorised one must equal.
def reference_calls(magi, q_len, kv_len, per_row):
    calls = []
    for (qs, qe), (ks, ke), kind in zip(
        magi.q_ranges.tolist(), magi.k_ranges.tolist(), magi.attn_type_map.tolist(), strict=True
    ):
        row = qs // q_len if per_row else None
        if row is not None:
            qs, qe, ks, ke = (
                qs - row * q_len,
                qe - row * q_len,
                ks - row * kv_len,
                ke - row * kv_len,
            )
        if kind == FULL:
            calls.append((row, qs, qe, ks, ke, False, None))
            continue
        if kind in (INVCAUSAL, BICAUSAL):
            width = (ke - ks) - (qe - qs) + 1 if kind == BICAUSAL else 0
            if kind == BICAUSAL and width < 1:
                continue
            if kind == INVCAUSAL:
                qe = min(qe, qs + ke - ks)
            for start in range(qs, qe, slices.BAND_ROWS):
                stop = min(start + slices.BAND_ROWS, qe)
                last = stop - 1 + ke - qe if kind == BICAUSAL else ke - 1
                calls.append((row, start, stop, start + ks - qs, last + 1, False, width))
            continue
        n, m = qe - qs, ke - ks
        if m > n:
            calls.append((row, qs, qe, ks, ke - n, False, None))
            calls.append((row, qs, qe, ke - n, ke, True, None))
        else:
            calls.append((row, qe - m, qe, ks, ke, True, None))
    return calls


def reference_gaps(rows, length, written):
    """Per row, the maximal runs of positions in ``[0, length)`` no written span covers,
    read off a dense coverage array."""
    gaps = []
    for row in rows:
        covered = np.zeros(length, dtype=bool)
        for r, start, end in written:
            if r == row:
                covered[start:end] = True
        at = 0
        while at < length:
            if covered[at]:
                at += 1
                continue
            stop = at
            while stop < length and not covered[stop]:
                stop += 1
            gaps.append((row, at, stop))
            at = stop
    return tuple(gaps)


def reference_first(spans, length):
    """Per ``(row, start, end)`` in order: whether no earlier span of its row covers any of
    its positions, read off a dense array of the positions covered so far."""
    covered = {}
    first = []
    for row, start, end in spans:
        seen = covered.setdefault(row, np.zeros(length, dtype=bool))
        first.append(not bool(seen[start:end].any()))
        seen[start:end] = True
    return tuple(first)


def reference_lowered(mask, batch, q_len, kv_len):
    per_row = mask.rows is not None and mask.rows > 1
    magi = to_magi(mask, batch if per_row else 1, None, q_len, kv_len)
    calls = reference_calls(magi, q_len, kv_len, per_row)
    ordered = sorted(calls, key=lambda c: (-1 if c[0] is None else c[0], c[1], c[3]))
    first = reference_first([c[:3] for c in ordered], q_len)
    keys = [(c[0], c[3], c[4]) for c in ordered]
    first_keys = reference_first(keys, kv_len)
    rows = list(range(batch)) if per_row else [None]
    covered = int((magi.q_ranges[:, 1] - magi.q_ranges[:, 0]).sum()) if calls else 0
    return slices.Slices(
        tuple(ordered),
        first,
        first_keys,
        reference_gaps(rows, q_len, [c[:3] for c, f in zip(ordered, first, strict=True) if f]),
        reference_gaps(rows, kv_len, [k for k, f in zip(keys, first_keys, strict=True) if f]),
        covered,
    )


@pytest.mark.parametrize("few", [slice_calls.FEW_SLICES, 0])
@SETTINGS
@given(data=st.data(), batch=st.integers(1, 3), length=st.integers(1, 40))
def test_slices_lowering_equals_the_call_by_call_reference(few, data, batch, length):
    """Both ways of cutting the calls (Python lists for few slices, one table for many)."""
    kinds = ("causal", "full", "empty", "window", "prefix", "padding", "document", "tree")
    mask, _ = data.draw(leaves(batch, length, kinds))
    for _ in range(data.draw(st.integers(0, 2))):
        other, _ = data.draw(leaves(batch, length, kinds))
        mask = mask & other if data.draw(st.booleans()) else mask | other
    kv_len = data.draw(st.sampled_from([length, length + 3]))
    slices._lowered.cache_clear()
    saved, slice_calls.FEW_SLICES = slice_calls.FEW_SLICES, few
    try:
        got = slices._lowered(mask, batch, length, kv_len)
    finally:
        slice_calls.FEW_SLICES = saved
        slices._lowered.cache_clear()
    assert got == reference_lowered(mask, batch, length, kv_len), mask
    magi = to_magi(mask, batch if (mask.rows or 1) > 1 else 1, None, length, kv_len)
    per_row = (mask.rows or 1) > 1
    table = slice_calls._call_table(magi, length, kv_len, per_row)
    assert slice_calls._as_calls(table) == slices.kernel_calls(magi, length, kv_len, per_row)


def test_slices_lowering_of_long_bands_and_many_documents():
    """Windows whose bands run past BAND_ROWS, inverse-causal and bi-causal slices, and
    B = 4 rows of many documents, against the reference."""
    cases = [
        (flexmask.causal() & flexmask.sliding_window(300), 1, 1500, 1500),
        (flexmask.sliding_window(100), 2, 900, 900),
        (~flexmask.causal() | flexmask.sliding_window(3), 1, 700, 700),
        (
            flexmask.causal()
            & flexmask.document([[7] * 100, [13] * 50, [1] * 650, [650]], truncate=True),
            4,
            700,
            700,
        ),
    ]
    for mask, batch, q_len, kv_len in cases:
        slices._lowered.cache_clear()
        assert slices._lowered(mask, batch, q_len, kv_len) == reference_lowered(
            mask, batch, q_len, kv_len
        ), mask


def test_a_document_running_past_int_bounds_starts_where_it_starts():
    """A document longer than any sequence (lengths up to 2**63 - 1 are clipped to it) starts
    after the ones before it: its queries attend only its own keys."""
    mask = flexmask.causal() & flexmask.document([5, 2**62], truncate=True)
    m = to_magi(mask, 1, None, 9, 9)
    assert m.q_ranges.tolist() == [[0, 5], [5, 9]] == m.k_ranges.tolist()
    assert to_varlen(mask, 1, None, 9, 9).cu_seqlens_q.tolist() == [0, 5, 9]
    f = to_flashmask(mask, 1, 1, 9)
    assert f.startend_row_indices.view(-1).tolist() == [5] * 5 + [9] * 4


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 3),
    dense=st.booleans(),
)
def test_ends_at_or_before_equals_torchs_search(data, rows, dense):
    """The count of end marks against ``torch.searchsorted(right=True)``: ends repeated
    (empty runs), padded past every position, positions covering their range or sparse."""
    width = data.draw(st.integers(1, 6))
    ends = []
    for _ in range(rows):
        row = sorted(data.draw(st.lists(st.integers(0, 30), min_size=width, max_size=width)))
        pad = data.draw(st.integers(0, width - 1))
        ends.append(row[: width - pad] + [(1 << 61)] * pad)
    ends_t = torch.tensor(ends, dtype=torch.int64)
    if dense:
        start = data.draw(st.integers(0, 5))
        pos = (start + torch.arange(data.draw(st.integers(1, 25)))).expand(rows, -1)
    else:
        pos = torch.tensor(
            [data.draw(st.lists(st.integers(0, 200), min_size=3, max_size=3)) for _ in range(rows)]
        )
    want = torch.searchsorted(ends_t, pos.contiguous(), right=True)
    assert torch.equal(_ends_at_or_before(ends_t, pos), want)


def test_flashmask_heads_whose_rows_differ_stack_per_batch_row():
    """Bounds are made per mask row and expanded to the batch afterwards: a head whose mask
    differs by row beside one that does not."""
    docs = flexmask.causal() & flexmask.document([[2, 3], [4, 1]], truncate=True)
    f = to_flashmask(flexmask.per_head(docs, flexmask.causal()), 2, 2, 5)
    alone_docs = to_flashmask(docs, 2, 1, 5).startend_row_indices
    alone_causal = to_flashmask(flexmask.causal(), 2, 1, 5).startend_row_indices
    assert f.causal and f.startend_row_indices.shape == (2, 2, 5, 1)
    assert torch.equal(f.startend_row_indices[:, :1], alone_docs)
    assert torch.equal(f.startend_row_indices[:, 1:], alone_causal)
    assert alone_causal[:, 0, :, 0].tolist() == [[5] * 5, [5] * 5]
    assert alone_docs[:, 0, :, 0].tolist() == [[2, 2, 5, 5, 5], [4, 4, 4, 4, 5]]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), rows=st.integers(1, 3), dense=st.booleans())
def test_run_at_equals_a_plain_walk(data, rows, dense):
    """``run_at`` (running maxima for a window's positions, a search otherwise) against a
    walk over the runs: sorted, disjoint, some empty, gaps between them, padded past every
    position."""
    width = data.draw(st.integers(1, 5))
    starts, ends = [], []
    for _ in range(rows):
        at, row_s, row_e = 0, [], []
        for _ in range(data.draw(st.integers(0, width))):
            at += data.draw(st.integers(0, 3))
            size = data.draw(st.integers(0, 5))
            row_s.append(at)
            row_e.append(at + size)
            at += size
        pad = width - len(row_s)
        starts.append(row_s + [INF] * pad)
        ends.append(row_e + [INF] * pad)
    starts_t, ends_t = torch.tensor(starts), torch.tensor(ends)
    if dense:
        pos = data.draw(st.integers(0, 4)) + torch.arange(data.draw(st.integers(1, 30)))
        pos = pos.view(1, -1).expand(rows, -1)
    else:
        pos = torch.tensor([data.draw(st.lists(st.integers(0, 30), min_size=4, max_size=4))])
        pos = pos.expand(rows, -1)
    lo, hi = run_at(starts_t, ends_t, pos)
    for r in range(rows):
        for i, p in enumerate(pos[r].tolist()):
            runs = [(s, e) for s, e in zip(starts[r], ends[r], strict=True) if s <= p < e]
            want = (runs[0][0], runs[0][1] - 1) if runs else (INF, -INF)
            assert (int(lo[r, i]), int(hi[r, i])) == want, (starts[r], ends[r], p)
