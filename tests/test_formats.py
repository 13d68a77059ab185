"""Lowerings to foreign kernel formats (flexmask.formats) are exact: each format's *documented*
semantics, written plainly below, gives back the independent dense oracle (tests/oracle.py)
on random masks, or the lowering refuses with a ValueError — never an approximation.

References, from each format's own docs:
* varlen: flash-attn's ``flash_attn_varlen_func`` docstring (causal and window aligned to
  each sequence's bottom-right corner: query i sees keys up to i + sk - sq) and torch's
  ``varlen_attn`` (window_size (-1, 0) is causal);
* FlashMask: paddle's ``flashmask_to_densemask`` (in ``flashmask_attention``'s docstring);
* Magi: ``flex_flash_attn_func``'s note (causal bottom-right, inverse causal top-left,
  bi-causal both; a (query, key) pair covered twice would be counted twice).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.formats import to_flashmask, to_magi, to_varlen
from tests import oracle
from tests.strategies import expressions, leaves

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- the formats' semantics
def varlen_dense(v, window_size, causal) -> np.ndarray:
    """(B, Q, KV) from cu_seqlens, the gather indices, ``causal`` and ``window_size``, by
    flash-attn's documented rule: query i of a sequence sees keys
    [i + sk - sq - left, i + sk - sq + right] (-1: unbounded), and with causal up to i + sk - sq."""
    out = np.zeros((v.batch * v.q_len, v.batch * v.kv_len), dtype=bool)
    cu_q, cu_k = v.cu_seqlens_q.tolist(), v.cu_seqlens_k.tolist()
    q_index, k_index = v.q_index.tolist(), v.k_index.tolist()
    left, right = window_size
    for s in range(len(cu_q) - 1):
        sq, sk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(sq):
            for j in range(sk):
                ok = True
                if causal and j > i + sk - sq:
                    ok = False
                if left >= 0 and j < i + sk - sq - left:
                    ok = False
                if right >= 0 and j > i + sk - sq + right:
                    ok = False
                if ok:
                    out[q_index[cu_q[s] + i], k_index[cu_k[s] + j]] = True
    blocks = [
        out[b * v.q_len : (b + 1) * v.q_len, b * v.kv_len : (b + 1) * v.kv_len]
        for b in range(v.batch)
    ]
    for b in range(v.batch):  # nothing across rows
        others = np.delete(
            out[b * v.q_len : (b + 1) * v.q_len], np.s_[b * v.kv_len : (b + 1) * v.kv_len], 1
        )
        assert not others.any()
    return np.stack(blocks)


def torch_varlen_dense(v) -> np.ndarray:
    """The same from torch's ``varlen_attn`` keywords: no causal flag, window_size only."""
    kwargs = v.varlen_attn_kwargs()
    assert torch.equal(kwargs["cu_seq_q"], v.cu_seqlens_q)
    return varlen_dense(v, kwargs["window_size"], causal=False)


def flashmask_dense(startend_row_indices: torch.Tensor, causal: bool, q_len: int) -> np.ndarray:
    """paddle's ``flashmask_to_densemask``, with ``q_len`` rows: True where attended."""
    bz, num_head, kv_len, bound_num = startend_row_indices.shape
    masked = np.zeros((bz, num_head, q_len, kv_len), dtype=bool)
    has_end = (causal and bound_num == 2) or ((not causal) and bound_num == 4)
    s = startend_row_indices.tolist()
    for bi in range(bz):
        for hi in range(num_head):
            for j in range(kv_len):
                downstart = s[bi][hi][j][0]
                if has_end:
                    masked[bi, hi, downstart : s[bi][hi][j][1], j] = True
                else:
                    masked[bi, hi, downstart:, j] = True
                if causal:
                    masked[bi, hi, :j, j] = True
                elif has_end:
                    masked[bi, hi, s[bi][hi][j][2] : s[bi][hi][j][3], j] = True
                else:
                    masked[bi, hi, : s[bi][hi][j][1], j] = True
    return ~masked


def magi_dense(m, batch: int, q_len: int, kv_len: int) -> np.ndarray:
    """(B, Q, KV) from Magi's slices, by the types' documented geometry; each pair once."""
    count = np.zeros((batch * q_len, batch * kv_len), dtype=int)
    for (qs, qe), (ks, ke), t in zip(
        m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), strict=True
    ):
        for i in range(qs, qe):
            for j in range(ks, ke):
                causal_ok = j <= i + (ke - qe)
                inv_ok = j >= i + (ks - qs)
                if (
                    t == 0
                    or (t == 1 and causal_ok)
                    or (t == 2 and inv_ok)
                    or (t == 3 and causal_ok and inv_ok)
                ):
                    count[i, j] += 1
    assert count.max(initial=0) <= 1, "a (query, key) pair is covered by two slices"
    assert m.total_q == batch * q_len and m.total_k == batch * kv_len
    return np.stack(
        [
            count[b * q_len : (b + 1) * q_len, b * kv_len : (b + 1) * kv_len] == 1
            for b in range(batch)
        ]
    )


def windowed(dense, batch, q_len, kv_len, q_off, kv_off) -> np.ndarray:
    """(B, Q, KV) of the oracle ``dense(n, n) -> (B, n, n)`` at the window's positions."""
    q_off = q_off if isinstance(q_off, list) else [q_off] * batch
    kv_off = kv_off if isinstance(kv_off, list) else [kv_off] * batch
    n = max(max(q_off) + q_len, max(kv_off) + kv_len)
    full = dense(n, n)
    return np.stack(
        [full[b, q_off[b] : q_off[b] + q_len, kv_off[b] : kv_off[b] + kv_len] for b in range(batch)]
    )


@st.composite
def intersections(draw, batch: int, length: int, kinds: tuple[str, ...], max_leaves: int = 3):
    """(mask, dense): an ``&`` of 1..max_leaves pieces of the given kinds."""
    items = [draw(leaves(batch, length, kinds)) for _ in range(draw(st.integers(1, max_leaves)))]
    mask, ref = items[0]
    for other, other_ref in items[1:]:
        mask, ref = mask & other, (lambda q, kv, a=ref, b=other_ref: a(q, kv) & b(q, kv))
    return mask, ref


VARLEN_KINDS = ("causal", "window", "document", "padding", "chunked", "full")


@st.composite
def varlen_windows(draw, batch: int):
    """(q_len, kv_len, q_offset, kv_offset): a training window (no offsets, Q == KV) or a
    decode / chunked-prefill one (queries end where keys end), offsets shared or per row."""
    q_len = draw(st.integers(1, 23))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return q_len, q_len, 0, 0
    if kind == 1:  # the first queries over more keys: keys past the last query
        return q_len, q_len + draw(st.integers(1, 9)), 0, 0
    start = draw(st.integers(0, 13))
    if draw(st.booleans()):
        return q_len, start + q_len, start, 0
    kv_start = draw(st.integers(0, start))
    return q_len, start + q_len - kv_start, [start] * batch, [kv_start] * batch


# ----------------------------------------------------------------- varlen
@SETTINGS
@given(data=st.data(), batch=st.integers(2, 3))
def test_varlen_equals_the_oracle_or_refuses(data, batch):
    q_len, kv_len, q_off, kv_off = data.draw(varlen_windows(batch))
    span = max(q_len + (max(q_off) if isinstance(q_off, list) else q_off), kv_len)
    mask, dense = data.draw(intersections(batch, span + 2, VARLEN_KINDS))
    try:
        v = to_varlen(mask, batch, None, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
    except ValueError as error:
        # Windows that differ by row; or, with keys past the last query (kv_len > q_len from
        # position 0), a bidirectional window reaching them, which bottom-right alignment
        # cannot place (a causal mask never attends them: they are left out).
        message = str(error)
        past = kv_len > q_len and "causal()" not in repr(mask)
        assert "differs between rows" in message or (past and "bottom-right" in message), (
            mask,
            error,
        )
        return
    want = windowed(dense, batch, q_len, kv_len, q_off, kv_off)
    np.testing.assert_array_equal(varlen_dense(v, v.window_size, v.causal), want, str(mask))
    np.testing.assert_array_equal(torch_varlen_dense(v), want, str(mask))
    assert v.cu_seqlens_q.dtype == v.cu_seqlens_k.dtype == torch.int32
    lens = (v.cu_seqlens_q[1:] - v.cu_seqlens_q[:-1]).tolist()
    assert v.max_seqlen_q == max(lens, default=0) and min(lens, default=1) > 0


@SETTINGS
@given(data=st.data(), batch=st.integers(2, 3), causal=st.booleans())
def test_varlen_packed_documents_never_refused(data, batch, causal):
    """The packed-SFT family: (causal &) per-row documents & padding (& a shared window)."""
    q_len, kv_len, q_off, kv_off = data.draw(varlen_windows(batch))
    span = max(q_len + (max(q_off) if isinstance(q_off, list) else q_off), kv_len)
    mask, dense = data.draw(leaves(batch, span + 2, ("document",)))
    if data.draw(st.booleans()):
        pad, pad_ref = data.draw(leaves(batch, span + 2, ("padding",)))
        mask, dense = mask & pad, (lambda q, kv, a=dense, b=pad_ref: a(q, kv) & b(q, kv))
    if causal:
        mask, dense = (
            flexmask.causal() & mask,
            (lambda q, kv, a=dense: a(q, kv) & oracle.causal(q, kv)),
        )
    if causal and data.draw(st.booleans()):
        size = data.draw(st.integers(1, 9))
        mask = mask & flexmask.sliding_window(size)
        dense = lambda q, kv, a=dense, w=size: a(q, kv) & oracle.sliding_window(w, q, kv)  # noqa: E731
    v = to_varlen(mask, batch, None, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
    want = windowed(dense, batch, q_len, kv_len, q_off, kv_off)
    np.testing.assert_array_equal(varlen_dense(v, v.window_size, v.causal), want, str(mask))


def in_place_dense(v) -> np.ndarray:
    """(B, Q, KV) from torch's ``varlen_attn`` keywords with ``seqused_k``, by its documented
    rule: sequence i's queries are ``q_index[cu_seq_q[i]:cu_seq_q[i+1]]`` (packed), its keys
    the first ``seqused_k[i]`` of the flat ``(B * KV_LEN)`` keys from ``cu_seq_k[i]``, which
    must not run past the next sequence's; window_size (left, right) bottom-right aligned."""
    kwargs = v.varlen_attn_kwargs(keys="in_place")
    cu_q, cu_k = kwargs["cu_seq_q"].tolist(), kwargs["cu_seq_k"].tolist()
    used, (left, right) = kwargs["seqused_k"].tolist(), kwargs["window_size"]
    assert kwargs["cu_seq_k"].dtype == kwargs["seqused_k"].dtype == torch.int32
    assert len(cu_k) == len(cu_q) and cu_k[-1] == v.batch * v.kv_len
    assert kwargs["max_k"] == max(used, default=0)
    out = np.zeros((v.batch * v.q_len, v.batch * v.kv_len), dtype=bool)
    q_index = v.q_index.tolist()
    for s in range(len(cu_q) - 1):
        assert cu_k[s] >= 0 and cu_k[s] + used[s] <= cu_k[s + 1]
        sq, sk = cu_q[s + 1] - cu_q[s], used[s]
        for i in range(sq):
            for j in range(sk):
                if (left < 0 or j >= i + sk - sq - left) and (
                    right < 0 or j <= i + sk - sq + right
                ):
                    out[q_index[cu_q[s] + i], cu_k[s] + j] = True
    rows = [out[b * v.q_len : (b + 1) * v.q_len] for b in range(v.batch)]
    for b, row in enumerate(rows):  # nothing across rows
        assert not np.delete(row, np.s_[b * v.kv_len : (b + 1) * v.kv_len], 1).any()
    return np.stack([row[:, b * v.kv_len : (b + 1) * v.kv_len] for b, row in enumerate(rows)])


@SETTINGS
@given(data=st.data(), batch=st.integers(1, 3), causal=st.booleans())
def test_varlen_keys_in_place_equal_the_oracle(data, batch, causal):
    """Keys read where they lie (``seqused_k``), for packed documents, padding (a KV cache
    whose slots hold more than each row uses) and windows, training and decode windows."""
    q_len, kv_len, q_off, kv_off = data.draw(varlen_windows(batch))
    span = max(q_len + (max(q_off) if isinstance(q_off, list) else q_off), kv_len)
    mask, dense = data.draw(leaves(batch, span + 2, ("document", "padding")))
    if causal:
        mask, dense = (
            flexmask.causal() & mask,
            (lambda q, kv, a=dense: a(q, kv) & oracle.causal(q, kv)),
        )
        if data.draw(st.booleans()):
            size = data.draw(st.integers(1, 9))
            mask = mask & flexmask.sliding_window(size)
            dense = lambda q, kv, a=dense, w=size: a(q, kv) & oracle.sliding_window(w, q, kv)  # noqa: E731
    try:
        v = to_varlen(mask, batch, None, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
    except ValueError as error:  # as test_varlen_equals_the_oracle_or_refuses allows
        assert kv_len > q_len and not causal and "bottom-right" in str(error), error
        return
    want = windowed(dense, batch, q_len, kv_len, q_off, kv_off)
    np.testing.assert_array_equal(in_place_dense(v), want, str(mask))


def test_varlen_keys_in_place_for_a_decode_step():
    # One query per row over the first 5 and 3 of 8 cache slots: the slots as they are.
    v = to_varlen(flexmask.padding([5, 3]), 2, 1, 1, 8, q_offset=[4, 2])
    kwargs = v.varlen_attn_kwargs(keys="in_place")
    assert kwargs["cu_seq_k"].tolist() == [0, 8, 16] and kwargs["seqused_k"].tolist() == [5, 3]
    assert v.varlen_attn_kwargs()["cu_seq_k"].tolist() == [0, 5, 8]  # packed: gathered
    with pytest.raises(ValueError, match="keys must be 'packed' or 'in_place', got 'slots'"):
        v.varlen_attn_kwargs(keys="slots")


def test_varlen_decode_keeps_bottom_right_alignment():
    # One query per row at the end of a 7-token cache: it sees its whole document.
    mask = flexmask.causal() & flexmask.document([[4, 3], [2, 5]], truncate=True)
    v = to_varlen(mask, 2, None, 1, 7, q_offset=6, kv_offset=0)
    assert v.cu_seqlens_q.tolist() == [0, 1, 2] and v.cu_seqlens_k.tolist() == [0, 3, 8]
    assert v.k_index.tolist() == [4, 5, 6, 9, 10, 11, 12, 13]
    assert v.causal and v.window_size == (-1, -1)
    assert v.varlen_attn_kwargs()["window_size"] == (-1, 0)


def test_varlen_gather_scatter_matches_dense_attention():
    """Per-sequence attention by the kernel's rule, through pack/unpack, equals attention
    with the oracle's dense mask (rows that attend nothing give 0, as flex_attention)."""
    torch.manual_seed(0)
    lens = [[3, 4, 2], [5, 1]]
    mask = flexmask.causal() & flexmask.document(lens, truncate=True) & flexmask.sliding_window(3)
    B, S, H, D = 2, 11, 2, 4
    v = to_varlen(mask, B, None, S, S)
    q, k, val = (torch.randn(B, S, H, D, dtype=torch.float64) for _ in range(3))
    pq, pk, pv = v.pack_q(q), v.pack_kv(k), v.pack_kv(val)
    packed = torch.zeros_like(pq)
    allowed = torch.from_numpy(varlen_dense(v, v.window_size, v.causal))
    cu_q, cu_k = v.cu_seqlens_q.tolist(), v.cu_seqlens_k.tolist()
    for s in range(v.num_sequences):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        sq, sk = qs.stop - qs.start, ks.stop - ks.start
        i = torch.arange(sq).view(-1, 1)
        j = torch.arange(sk).view(1, -1)
        keep = (j <= i + sk - sq) & (j >= i + sk - sq - v.window_size[0])
        scores = torch.einsum("qhd,khd->hqk", pq[qs], pk[ks]) / D**0.5
        weights = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num()
        packed[qs] = torch.einsum("hqk,khd->qhd", weights, pv[ks])
    out = v.unpack(packed)
    dense = torch.from_numpy(
        oracle.stack([oracle.document(r, S, S) & oracle.causal(S, S) for r in lens])[:, 0]
        & oracle.sliding_window(3, S, S)
    )
    assert torch.equal(allowed, dense)
    want = oracle.attention(*(t.transpose(1, 2) for t in (q, k, val)), dense[:, None])[0]
    want = want.transpose(1, 2)
    torch.testing.assert_close(out, want)
    assert out[1, 6:].abs().sum() == 0  # padding rows


@pytest.mark.parametrize(
    ("mask", "piece"),
    [
        (
            flexmask.tree([-1, 0, 1, 0, 3]),
            r"tree\(\[-1, 0, 1, 0, 3\]\) cannot be lowered to varlen",
        ),
        (flexmask.causal() | flexmask.prefix(3), r"cannot be lowered to varlen: a union"),
        (flexmask.causal() & flexmask.prefix(3), r"prefix\(3\) cannot be lowered to varlen"),
        (~flexmask.causal(), r"~causal\(\) cannot be lowered to varlen: a complement"),
        (
            flexmask.spans([0, 0, -1], truncate=True) & flexmask.causal(),
            r"spans\(.*cannot be lowered to varlen",
        ),
        (
            flexmask.per_head(flexmask.causal(), flexmask.full()),
            r"per_head.*cannot be lowered to varlen: its heads attend differently",
        ),
        (
            flexmask.sliding_window([2, 3]) & flexmask.causal(),
            r"sliding_window\(\[2, 3\]\) cannot be lowered to varlen: its window differs",
        ),
        (
            flexmask.from_mask_mod(lambda b, h, q, kv: q >= kv, key="mine"),
            r"cannot be lowered to varlen: a from_mask_mod",
        ),
    ],
)
def test_varlen_refuses_naming_the_piece(mask, piece):
    with pytest.raises(ValueError, match=piece):
        to_varlen(mask, 2, None, 6, 6)


def test_varlen_refuses_queries_past_their_keys():
    # 8 queries over 5 keys, causal: queries 5..7 see all 5 keys, which bottom-right
    # alignment (query i sees keys up to i - 3) cannot give.
    with pytest.raises(ValueError, match=r"causal\(\) cannot be lowered to varlen.*bottom-right"):
        to_varlen(flexmask.causal(), 1, None, 8, 5)
    # Bidirectional documents have no alignment: the same window lowers.
    v = to_varlen(flexmask.document([8], truncate=True), 1, None, 8, 5)
    assert v.cu_seqlens_q.tolist() == [0, 8] and v.cu_seqlens_k.tolist() == [0, 5]


def test_per_head_with_one_mask_lowers():
    mask = flexmask.per_head(flexmask.causal(), flexmask.causal()) & flexmask.document(
        [3, 3], truncate=True
    )
    assert to_varlen(mask, 1, None, 6, 6).causal


# ----------------------------------------------------------------- FlashMask
def _flashmask_check(mask, dense, batch, heads, q_len, kv_len, q_off=0, kv_off=0):
    f = to_flashmask(mask, batch, heads, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
    s = f.startend_row_indices
    assert s.dtype == torch.int32 and s.shape[0] == batch and s.shape[2] == kv_len
    assert s.shape[1] in (1, heads) and s.shape[3] in ((1, 2) if f.causal else (2, 4))
    assert int(s.min()) >= 0 and int(s.max()) <= q_len
    got = np.broadcast_to(flashmask_dense(s, f.causal, q_len), (batch, heads, q_len, kv_len))
    np.testing.assert_array_equal(got, dense, str(mask))
    return f


@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(2, 3),
    heads=st.sampled_from([2, 4]),
    q_len=st.integers(1, 17),
    kv_len=st.integers(1, 17),
)
def test_flashmask_equals_the_oracle_or_refuses(data, batch, heads, q_len, kv_len):
    if data.draw(st.booleans()):
        kv_len = q_len
    q_off = data.draw(st.integers(0, 5)) if data.draw(st.booleans()) else 0
    kv_off = data.draw(st.integers(0, 5)) if data.draw(st.booleans()) else 0
    span = max(q_off + q_len, kv_off + kv_len)
    mask, dense = data.draw(expressions(batch, heads, span, max_leaves=3))
    try:
        f = to_flashmask(mask, batch, heads, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
    except ValueError as error:
        assert "cannot be lowered to FlashMask" in str(
            error
        ) or "cannot be lowered to this format" in str(error), error
        return
    n = max(q_off + q_len, kv_off + kv_len)
    want = dense(n, n)[:, :, q_off : q_off + q_len, kv_off : kv_off + kv_len]
    got = flashmask_dense(f.startend_row_indices, f.causal, q_len)
    np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want, str(mask))


FLASHMASK_FAMILIES = ("causal", "window", "document", "padding", "prefix", "chunked", "full")


@SETTINGS
@given(data=st.data(), batch=st.integers(2, 3), length=st.integers(1, 21))
def test_flashmask_interval_masks_never_refused(data, batch, length):
    """One attended run of queries per key (an & of interval pieces, maybe with a prefix-LM
    union): always lowers, to two columns at most."""
    mask, dense = data.draw(intersections(batch, length, FLASHMASK_FAMILIES))
    if data.draw(st.booleans()):
        n = data.draw(st.integers(0, length))
        mask = mask & (flexmask.causal() | flexmask.prefix(n))

        def dense(q, kv, a=dense, n=n):
            return a(q, kv) & (oracle.causal(q, kv) | oracle.prefix(n, q, kv))

    want = np.repeat(dense(length, length)[:, None], 2, 1)
    f = _flashmask_check(mask, want, batch, 2, length, length)
    assert f.columns <= 2


def test_flashmask_paddle_examples():
    """paddle's documented examples, value for value."""
    window = to_flashmask(flexmask.causal() & flexmask.sliding_window(3), 1, 1, 10)
    assert window.causal
    assert window.startend_row_indices.view(-1).tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
    docs = to_flashmask(flexmask.document([4, 3, 3], truncate=True), 1, 1, 10)
    assert not docs.causal
    assert docs.startend_row_indices[0, 0].tolist() == [[4, 0]] * 4 + [[7, 4]] * 3 + [[10, 7]] * 3
    prefix_lm = to_flashmask(flexmask.causal() | flexmask.prefix(5), 1, 1, 10)
    assert not prefix_lm.causal
    want = [[10, 0]] * 5 + [[10, u] for u in range(5, 10)]
    assert prefix_lm.startend_row_indices[0, 0].tolist() == want
    # "Share Question Mask": a 4-token question, two answers of 3 that each see it.
    shared = flexmask.causal() & (flexmask.document([4, 3, 3], truncate=True) | flexmask.prefix(4))
    got = to_flashmask(shared, 1, 1, 10)
    assert got.causal
    assert got.startend_row_indices.view(-1).tolist() == [10, 10, 10, 10, 7, 7, 7, 10, 10, 10]


def test_flashmask_per_head_columns():
    mask = flexmask.per_head(flexmask.causal(), flexmask.causal() & flexmask.sliding_window(2))
    want = np.stack([oracle.causal(6, 6), oracle.causal(6, 6) & oracle.sliding_window(2, 6, 6)])
    f = _flashmask_check(mask, want[None], 1, 2, 6, 6)
    assert f.startend_row_indices.shape == (1, 2, 6, 1)


def test_flashmask_refuses_three_masked_runs():
    # Key 0 is attended by queries 1 and 4 only: masked rows {0}, {2, 3}, {5}.
    mask = (flexmask.chunked(2) & ~flexmask.sliding_window(1)) | (
        ~flexmask.sliding_window(4) & flexmask.sliding_window(5)
    )
    with pytest.raises(ValueError, match=r"key column 0 .*\[\[0, 1\], \[2, 4\], \[5, 6\]\]"):
        to_flashmask(mask, 1, 1, 6)


def test_flashmask_refuses_trees_out_of_preorder():
    with pytest.raises(ValueError, match=r"tree\(.*preorder"):
        to_flashmask(flexmask.tree([-1, 0, 0, 1]), 1, 1, 4)
    f = to_flashmask(flexmask.tree([-1, 0, 1, 0]), 1, 1, 4)  # preorder: subtree runs
    assert f.causal and f.startend_row_indices.view(-1).tolist() == [4, 3, 3, 4]


# ----------------------------------------------------------------- MagiAttention
@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(2, 3),
    q_len=st.integers(1, 17),
    kv_len=st.integers(1, 17),
)
def test_magi_equals_the_oracle_or_refuses(data, batch, q_len, kv_len):
    heads = 2
    q_off = data.draw(st.integers(0, 5)) if data.draw(st.booleans()) else 0
    kv_off = data.draw(st.integers(0, 5)) if data.draw(st.booleans()) else 0
    n = max(q_off + q_len, kv_off + kv_len)
    mask, dense = data.draw(expressions(batch, heads, n, max_leaves=3))
    try:
        m = to_magi(mask, batch, None, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
    except ValueError as error:
        # Only what Magi cannot take: a mask_mod flexmask cannot read, heads that differ.
        assert "from_mask_mod" in str(error) or "heads attend differently" in str(error), error
        return
    want = dense(n, n)[:, :, q_off : q_off + q_len, kv_off : kv_off + kv_len]
    got = magi_dense(m, batch, q_len, kv_len)
    for h in range(heads):
        np.testing.assert_array_equal(got, want[:, h], str(mask))


@SETTINGS
@given(data=st.data(), batch=st.integers(2, 3), length=st.integers(1, 19))
def test_magi_trees_and_spans_never_refused(data, batch, length):
    kinds = ("causal", "window", "document", "padding", "tree", "spans", "prefix", "chunked")
    mask, dense = data.draw(intersections(batch, length, kinds))
    if data.draw(st.booleans()):
        other, other_ref = data.draw(intersections(batch, length, kinds, max_leaves=2))
        mask, dense = mask | other, (lambda q, kv, a=dense, b=other_ref: a(q, kv) | b(q, kv))
    m = to_magi(mask, batch, None, length, length)
    np.testing.assert_array_equal(magi_dense(m, batch, length, length), dense(length, length))


def test_magi_rl_group_is_a_prefix_block_and_causal_responses():
    # A 5-token prompt and three 4-token responses, packed in preorder (flexmask.pack_one_tree).
    parents = [-1, 0, 1, 2, 3] + [4, 5, 6, 7] + [4, 9, 10, 11] + [4, 13, 14, 15]
    m = to_magi(flexmask.tree(parents), 1, None, 17, 17)
    slices = list(
        zip(m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), strict=True)
    )
    # Prompt + first response: one causal slice; the other two responses see the prompt
    # through one merged full slice, and themselves causally.
    assert slices == [
        ([0, 9], [0, 9], 1),
        ([9, 17], [0, 5], 0),
        ([9, 13], [9, 13], 1),
        ([13, 17], [13, 17], 1),
    ]
    np.testing.assert_array_equal(magi_dense(m, 1, 17, 17)[0], oracle.tree(parents, 17, 17))


def test_magi_sliding_window_is_a_causal_head_and_a_bicausal_body():
    m = to_magi(
        flexmask.causal() & flexmask.sliding_window(3) & flexmask.padding([9, 7], truncate=True),
        2,
        None,
        9,
        9,
    )
    slices = list(
        zip(m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), strict=True)
    )
    assert slices == [
        ([0, 3], [0, 3], 1),
        ([3, 9], [1, 9], 3),
        ([9, 12], [9, 12], 1),
        ([12, 16], [10, 16], 3),
    ]
    assert (m.max_seqlen_q, m.max_seqlen_k) == (6, 8)


def test_magi_refuses_differing_heads_and_mask_mods():
    with pytest.raises(ValueError, match=r"per_head.*cannot be lowered to MagiAttention"):
        to_magi(flexmask.per_head(flexmask.causal(), flexmask.full()), 1, None, 4, 4)
    custom = flexmask.from_mask_mod(lambda b, h, q, kv: q >= kv, key="mine")
    with pytest.raises(ValueError, match=r"from_mask_mod"):
        to_magi(custom & flexmask.causal(), 1, None, 4, 4)
