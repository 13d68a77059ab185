"""``to_cudnn``, ``to_cudnn_bsa`` and ``to_cudnn_topk`` are exact: each cuDNN format's own
documented semantics, written plainly below, gives back the independent dense oracle
(tests/oracle.py, tests/strategies.py) on random masks, or the lowering refuses with a
ValueError that the oracle confirms — never an approximation.

References (NVIDIA/cudnn-frontend):

* flex_attention: ``create_mask_plan``'s docstring (``python/cudnn/flex_attention/plan/
  builder.py``): ``mask_func`` int32 ``[Hmask, nfunc, total_q]``, ``Hmask`` 1 or ``Hq``,
  ``nfunc`` positive odd, each query sees the sample-local keys ``[0,F0) U [F1,F2) U ...``;
  fixed BSHD rows are ``b * Sq + q`` (``plan/validation.py``: ``total_q = B * Sq``), THD rows
  are the samples of ``cu_seqlens_q`` concatenated; the planner flags endpoints outside
  ``[0, Sk]``, an end before its begin, or a begin before the previous end
  (``plan/kernels/q2k_classify.py``).
* BSA: ``docs/fe-oss-apis/bsa.md``: query ``i`` attends the union of the key blocks listed
  for block ``i // block_size`` (the first ``q2k_block_nums`` entries, unique, in
  ``[0, N_kv)``), block ``n`` holding ``block_sizes[n]`` keys from ``n * block_size``.
* sparse_attention: ``python/cudnn/sparse_attention/README.md``: BSHD ``topk_idxs`` hold
  within-sequence ids, ``-1`` an invalid slot, ids unique in a row; entry ``i`` selects keys
  ``[i * g, i * g + g)``, the tail clamped to the KV bound; ``(B, S_q, topk)`` shared by the
  heads or ``(B, S_q, G, topk)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.formats import (
    CudnnBSAMask,
    CudnnMask,
    CudnnTopkMask,
    to_cudnn,
    to_cudnn_bsa,
    to_cudnn_topk,
)
from tests.strategies import expressions, leaves

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- the formats' semantics
def cudnn_dense(c: CudnnMask, batch: int, heads: int, q_len: int, kv_len: int) -> np.ndarray:
    """(B, H, Q, KV) as cuDNN's flex_attention reads ``mask_func`` (and, in THD, the
    samples of ``cu_seqlens_q/k`` mapped back through ``q_index`` / ``k_index``)."""
    f = c.mask_func
    assert f.dtype == torch.int32 and f.dim() == 3 and f.is_contiguous()
    h_mask, n_func, total_q = f.shape
    assert h_mask in (1, heads) and n_func >= 1 and n_func % 2 == 1
    if c.cu_seqlens_q is None:
        assert total_q == batch * q_len
        samples = [(b * q_len, q_len, kv_len) for b in range(batch)]
    else:
        cu_q, cu_k = c.cu_seqlens_q.tolist(), c.cu_seqlens_k.tolist()
        assert c.cu_seqlens_q.dtype == c.cu_seqlens_k.dtype == torch.int32
        assert len(cu_q) == len(cu_k) >= 2 and cu_q[-1] == total_q
        assert c.max_seqlen_q == max(np.diff(cu_q)) and c.max_seqlen_k == max(np.diff(cu_k))
        samples = [
            (cu_q[s], cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]) for s in range(len(cu_q) - 1)
        ]
    flat = np.zeros((heads, batch * q_len, batch * kv_len), dtype=bool)
    for s, (start, sq, sk) in enumerate(samples):
        for t in range(start, start + sq):
            q_flat = t if c.q_index is None else int(c.q_index[t])
            for h in range(heads):
                ends = f[h if h_mask > 1 else 0, :, t].tolist()
                previous = 0
                bounds = [0, *ends]
                for i in range(0, n_func + 1, 2):
                    begin, end = bounds[i], bounds[i + 1]
                    # The planner's validity check, for every interval.
                    assert 0 <= begin <= end <= sk and begin >= previous, (t, ends)
                    previous = end
                    for j in range(begin, end):
                        k_flat = (
                            s * kv_len + j
                            if c.k_index is None
                            else int(c.k_index[int(c.cu_seqlens_k[s]) + j])
                        )
                        flat[h, q_flat, k_flat] = True
    out = np.zeros((batch, heads, q_len, kv_len), dtype=bool)
    for b in range(batch):
        rows = flat[:, b * q_len : (b + 1) * q_len]
        out[b] = rows[:, :, b * kv_len : (b + 1) * kv_len]
        rows[:, :, b * kv_len : (b + 1) * kv_len] = False
        assert not rows.any(), "a query attends a key of another batch row"
    return out


def bsa_dense(s: CudnnBSAMask, batch: int, heads: int, q_len: int, kv_len: int) -> np.ndarray:
    """(B, H, Q, KV) by bsa.md: block ``i // block_size``'s listed key blocks, whole, each
    ``block_sizes[n]`` keys long."""
    bs = s.block_size
    n_q, n_kv = -(-q_len // bs), -(-kv_len // bs)
    index, nums, sizes = s.q2k_block_index, s.q2k_block_nums, s.block_sizes.tolist()
    assert index.dtype == nums.dtype == s.block_sizes.dtype == torch.int32
    assert tuple(index.shape[:3]) == tuple(nums.shape) == (batch, heads, n_q)
    assert index.shape[-1] >= 1 and len(sizes) == n_kv
    out = np.zeros((batch, heads, q_len, kv_len), dtype=bool)
    for b in range(batch):
        for h in range(heads):
            for m in range(n_q):
                listed = index[b, h, m, : int(nums[b, h, m])].tolist()
                assert len(set(listed)) == len(listed) and all(0 <= n < n_kv for n in listed)
                for n in listed:
                    assert 1 <= sizes[n] <= bs
                    out[b, h, m * bs : (m + 1) * bs, n * bs : n * bs + sizes[n]] = True
    return out


def topk_dense(
    t: CudnnTopkMask, batch: int, heads: int, q_len: int, kv_len: int, kv_heads: int | None = None
) -> np.ndarray:
    """(B, H, Q, KV) by sparse_attention's contract: entry ``i`` selects keys
    ``[i * g, i * g + g)`` clamped to the KV bound, ``-1`` none; BSHD rows ``(b, q)`` and
    within-sequence ids, THD rows of ``cu_seqlens_q`` and global ids over the packed
    ``(B * KV_LEN)`` keys; scope ``G`` shared, ``H_q`` or ``H_kv`` (head ``h`` reads group
    ``h // (H_q / H_kv)``)."""
    g, idxs, lengths = t.index_granularity, t.topk_idxs, t.topk_length
    assert idxs.dtype == lengths.dtype == torch.int32
    thd = t.cu_seqlens_q is not None
    if thd:  # back to (B, Q, ...) rows, the sequences checked
        assert t.cu_seqlens_q.tolist() == [b * q_len for b in range(batch + 1)]
        idxs, lengths = (
            idxs.view(batch, q_len, *idxs.shape[1:]),
            lengths.view(batch, q_len, *lengths.shape[1:]),
        )
    shared = idxs.dim() == 3
    assert tuple(idxs.shape[:2]) == (batch, q_len)
    scope = 1 if shared else idxs.shape[2]
    assert scope in (1, heads, kv_heads)
    bound = batch * kv_len if thd else kv_len
    out = np.zeros((batch, heads, q_len, kv_len), dtype=bool)
    for b in range(batch):
        for q in range(q_len):
            for h in range(heads):
                group = h // (heads // scope)
                row = (idxs[b, q] if shared else idxs[b, q, group]).tolist()
                valid = [i for i in row if i != -1]
                length = int(lengths[b, q] if shared else lengths[b, q, group])
                assert valid == row[:length] and len(set(valid)) == len(valid)
                for i in valid:
                    assert 0 <= i * g < bound
                    keys = np.arange(i * g, min(i * g + g, bound))
                    if thd:  # global: every key in this row's sequence
                        assert (keys // kv_len == b).all(), (b, q, i)
                        keys = keys - b * kv_len
                    out[b, h, q, keys] = True
    return out


def _rows(offset, batch: int) -> list[int]:
    return offset if isinstance(offset, list) else [offset] * batch


def reach(q_off, kv_off, q_len: int, kv_len: int, batch: int, least: bool = False) -> int:
    """The positions the windows reach: of the row that reaches furthest (the oracle's
    size) or least (the mask's, whose data must fit every row's window)."""
    pick = min if least else max
    return max(pick(_rows(q_off, batch)) + q_len, pick(_rows(kv_off, batch)) + kv_len)


def windowed(dense, q_off, kv_off, q_len: int, kv_len: int, batch: int) -> np.ndarray:
    """The oracle cut to each row's window."""
    n = reach(q_off, kv_off, q_len, kv_len, batch)
    full = dense(n, n)
    q_offs, kv_offs = _rows(q_off, batch), _rows(kv_off, batch)
    return np.stack(
        [
            full[b, :, q_offs[b] : q_offs[b] + q_len, kv_offs[b] : kv_offs[b] + kv_len]
            for b in range(batch)
        ]
    )


@st.composite
def with_selected(draw, batch: int, heads: int, length: int):
    """``expressions``, half the time combined (``&``, ``|``, ``~``) with a router's picks,
    ``selected(indices, tile=...)`` (tests/strategies.py draws the picks and their plain
    definition)."""
    mask, dense = draw(expressions(batch, heads, length, max_leaves=2))
    if draw(st.booleans()):
        return mask, dense
    picked, ref = draw(leaves(batch, length, ("selected",)))
    picked_dense = lambda q, kv, f=ref: np.repeat(f(q, kv)[:, None], heads, 1)  # noqa: E731
    if draw(st.booleans()):
        picked, picked_dense = ~picked, (lambda q, kv, f=picked_dense: ~f(q, kv))
    if draw(st.booleans()):
        return mask & picked, lambda q, kv: dense(q, kv) & picked_dense(q, kv)
    return mask | picked, lambda q, kv: dense(q, kv) | picked_dense(q, kv)


def offsets(data, batch: int):
    def one():
        if data.draw(st.booleans()):
            return 0
        if data.draw(st.booleans()):
            return data.draw(st.integers(0, 6))
        return data.draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch))

    return one(), one()


# ----------------------------------------------------------------- flex_attention endpoints
@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.sampled_from([1, 2, 4]),
    q_len=st.integers(1, 15),
    kv_len=st.integers(1, 15),
    varlen=st.booleans(),
)
def test_cudnn_endpoints_equal_the_oracle_or_refuse(data, batch, heads, q_len, kv_len, varlen):
    q_off, kv_off = offsets(data, batch)
    n = reach(q_off, kv_off, q_len, kv_len, batch, least=True)
    mask, dense = data.draw(with_selected(batch, heads, n))
    try:
        c = to_cudnn(
            mask, batch, heads, q_len, kv_len, q_offset=q_off, kv_offset=kv_off, varlen=varlen
        )
    except ValueError as error:
        # Only a leaf whose intervals flexmask cannot read.
        assert "from_mask_mod" in str(error), error
        return
    want = windowed(dense, q_off, kv_off, q_len, kv_len, batch)
    np.testing.assert_array_equal(cudnn_dense(c, batch, heads, q_len, kv_len), want, str(mask))
    # The least odd n_func that holds every row: some row needs all of it.
    assert c.varlen == varlen
    intervals = (c.n_func + 1) // 2
    if intervals > 1:
        f = c.mask_func
        last_interval = f[:, -1] > f[:, -2]
        assert bool(last_interval.any())


def test_cudnn_per_row_documents_heads_and_varlen_trim():
    """B > 1 rows with different documents and padding, per_head heads: the fixed form's
    rows are ``b * Q_LEN + q``; the THD form keeps each row's queries up to its last that
    attends and keys up to the last attended."""
    docs = flexmask.document([[3, 4, 2], [5, 1]], truncate=True)
    mask = flexmask.per_head(flexmask.causal() & docs, docs) & flexmask.padding([9, 6])
    batch, heads, n = 2, 4, 10
    want = mask.to_dense(batch, heads, n, n).numpy()
    fixed = to_cudnn(mask, batch, heads, n)
    assert fixed.mask_func.shape[0] == heads and not fixed.varlen
    np.testing.assert_array_equal(cudnn_dense(fixed, batch, heads, n, n), want)
    packed = to_cudnn(mask, batch, heads, n, varlen=True)
    assert packed.cu_seqlens_q.tolist() == [0, 9, 15] == packed.cu_seqlens_k.tolist()
    np.testing.assert_array_equal(cudnn_dense(packed, batch, heads, n, n), want)
    # One mask for every head: H_mask 1.
    assert to_cudnn(flexmask.causal() & docs, batch, heads, n).mask_func.shape[0] == 1


def test_cudnn_pack_and_unpack_round_trip():
    mask = flexmask.causal() & flexmask.padding([3, 5])
    c = to_cudnn(mask, 2, 1, 6, varlen=True)
    x = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1)
    packed = c.pack_q(x)
    assert packed[:, 0].tolist() == [0, 1, 2, 6, 7, 8, 9, 10]
    assert c.unpack(packed)[:, :, 0].tolist() == [[0, 1, 2, 0, 0, 0], [6, 7, 8, 9, 10, 0]]
    assert set(c.kwargs()) == {
        "mask_func",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
    }
    fixed = to_cudnn(mask, 2, 1, 6)
    assert set(fixed.kwargs()) == {"mask_func"}
    assert fixed.pack_q(x) is x and fixed.unpack(x) is x
    with pytest.raises(ValueError, match=r"shape \(B, S, \.\.\.\)"):
        c.pack_kv(torch.zeros(3, 6))
    with pytest.raises(ValueError, match="8 packed queries"):
        c.unpack(torch.zeros(7, 1))
    assert "n_func=1" in repr(c) and "varlen" in repr(c)


def test_cudnn_refusals_name_what_is_missing():
    strided = flexmask.document([2, 2, 2, 2]) | flexmask.chunked(3)
    with pytest.raises(ValueError, match=r"max_intervals=1: query \d+ of batch row 0"):
        to_cudnn(strided | ~flexmask.causal(), 1, 1, 8, max_intervals=1)
    assert to_cudnn(strided, 1, 1, 8, max_intervals=3).n_func <= 5
    custom = flexmask.from_mask_mod(lambda b, h, q, kv: q >= kv, key="mine")
    with pytest.raises(ValueError, match="from_mask_mod"):
        to_cudnn(custom, 1, 1, 8)
    with pytest.raises(TypeError, match="flexmask Mask"):
        to_cudnn(lambda b, h, q, kv: q >= kv, 1, 1, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="varlen must be a bool"):
        to_cudnn(flexmask.causal(), 1, 1, 8, varlen=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_intervals"):
        to_cudnn(flexmask.causal(), 1, 1, 8, max_intervals=0)


# ----------------------------------------------------------------- BSA
def block_aligned(batch: int, block: int):
    """(mask, dense(q_len, kv_len) -> (B, Q, KV)): pieces whose edges fall on multiples of
    ``block`` (or past the window), written plainly with numpy."""
    lengths = st.lists(st.integers(1, 3).map(lambda k: k * block), min_size=1, max_size=3)

    def documents(rows):
        def dense(q_len, kv_len):
            out = []
            for lens in rows:
                ids = np.repeat(np.arange(len(lens)), lens)
                qi = np.concatenate([ids, np.full(max(0, q_len - ids.size), -1)])[:q_len]
                ki = np.concatenate([ids, np.full(max(0, kv_len - ids.size), -2)])[:kv_len]
                out.append(qi[:, None] == ki[None, :])
            return np.stack(out)

        return flexmask.document(rows, truncate=True), dense

    def chunks(size):
        def dense(q_len, kv_len):
            q, kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
            return np.repeat((q // size == kv // size)[None], batch, 0)

        return flexmask.chunked(size), dense

    def prefix(length):
        def dense(q_len, kv_len):
            kv = np.arange(kv_len)[None, :]
            return np.repeat(np.broadcast_to(kv < length, (q_len, kv_len))[None], batch, 0)

        return flexmask.prefix(length), dense

    def padding(rows):
        def dense(q_len, kv_len):
            q, kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
            return np.stack([(q < n) & (kv < n) for n in rows])

        return flexmask.padding(rows, truncate=True), dense

    def picked(rows):
        # selected(indices, tile=block): query block i attends the key blocks it picked.
        picks = torch.tensor(rows, dtype=torch.int64)

        def dense(q_len, kv_len):
            out = []
            for r in range(batch):
                p = picks[r if picks.shape[0] > 1 else 0]
                table = np.zeros((p.shape[0] + 1, -(-kv_len // block) + 8), dtype=bool)
                for i, row in enumerate(p.tolist()):
                    table[i, [j for j in row if j >= 0]] = True
                qt = np.minimum(np.arange(q_len) // block, p.shape[0])  # past the lists: none
                out.append(table[qt][:, np.arange(kv_len) // block])
            return np.stack(out)

        return flexmask.selected(
            picks if picks.shape[0] > 1 else picks[0], tile=block, truncate=True
        ), dense

    pick_lists = st.lists(
        st.lists(st.integers(-1, 4), min_size=2, max_size=2), min_size=1, max_size=5
    )
    return st.one_of(
        st.lists(pick_lists, min_size=1, max_size=1).map(picked),
        st.lists(pick_lists.filter(lambda x: len(x) == 3), min_size=batch, max_size=batch).map(
            picked
        ),
        st.lists(lengths, min_size=batch, max_size=batch).map(documents),
        st.integers(1, 3).map(lambda k: chunks(k * block)),
        st.integers(1, 4).map(lambda k: prefix(k * block)),
        st.lists(st.integers(0, 4).map(lambda k: k * block), min_size=batch, max_size=batch).map(
            padding
        ),
    )


@st.composite
def aligned_expressions(draw, batch: int, heads: int, block: int):
    """(mask, dense -> (B, H, Q, KV)): ``&``, ``|``, ``~`` and ``per_head`` of aligned pieces."""
    mask, ref = draw(block_aligned(batch, block))
    dense = lambda q, kv, f=ref: np.repeat(f(q, kv)[:, None], heads, 1)  # noqa: E731
    for _ in range(draw(st.integers(0, 2))):
        other, other_ref = draw(block_aligned(batch, block))
        other_dense = lambda q, kv, f=other_ref: np.repeat(f(q, kv)[:, None], heads, 1)  # noqa: E731
        op = draw(st.sampled_from(["and", "or", "not", "per_head"]))
        if op == "and":
            mask, dense = mask & other, (lambda q, kv, a=dense, b=other_dense: a(q, kv) & b(q, kv))
        elif op == "or":
            mask, dense = mask | other, (lambda q, kv, a=dense, b=other_dense: a(q, kv) | b(q, kv))
        elif op == "not":
            mask, dense = (
                ~(mask & other),
                (lambda q, kv, a=dense, b=other_dense: ~(a(q, kv) & b(q, kv))),
            )
        elif heads % 2 == 0:

            def dense(q, kv, a=dense, b=other_dense):
                out = a(q, kv).copy()
                out[:, 1::2] = b(q, kv)[:, 1::2]
                return out

            mask = flexmask.per_head(mask, other)
    return mask, dense


def tiles_whole(want: np.ndarray, block: int) -> bool:
    """Whether every (query block, key block) tile of the dense mask is all or nothing."""
    q_len, kv_len = want.shape[-2:]
    for m in range(0, q_len, block):
        for n in range(0, kv_len, block):
            tile = want[..., m : m + block, n : n + block].reshape(*want.shape[:2], -1)
            if (tile.any(-1) & ~tile.all(-1)).any():
                return False
    return True


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.sampled_from([1, 2]),
    block=st.sampled_from([64, 128]),
    q_len=st.integers(1, 300),
    kv_len=st.integers(1, 300),
)
def test_cudnn_bsa_equals_the_oracle_or_refuses(data, batch, heads, block, q_len, kv_len):
    aligned = data.draw(st.booleans())
    if aligned:  # every tile whole (at offsets on the block grid): never refused
        mask, dense = data.draw(aligned_expressions(batch, heads, block))
    else:  # anything: mostly refused, at lengths under a block sometimes exact
        q_len, kv_len = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
        mask, dense = data.draw(expressions(batch, heads, max(q_len, kv_len), max_leaves=2))
    offset = st.one_of(st.just(0), st.integers(0, 2).map(lambda k: k * block), st.integers(0, 9))
    q_off, kv_off = (
        data.draw(offset),
        data.draw(st.one_of(offset, st.lists(offset, min_size=batch, max_size=batch))),
    )
    if not aligned:
        q_off, kv_off = 0, 0  # the mask's data is made for the window
    on_grid = all(
        o % block == 0 for o in [q_off, *(kv_off if isinstance(kv_off, list) else [kv_off])]
    )
    want = windowed(dense, q_off, kv_off, q_len, kv_len, batch)
    try:
        s = to_cudnn_bsa(
            mask, batch, heads, q_len, kv_len, block_size=block, q_offset=q_off, kv_offset=kv_off
        )
    except ValueError as error:
        assert not (aligned and on_grid), error
        if "from_mask_mod" not in str(error):
            assert "attended in part" in str(error), error
            assert not tiles_whole(want, block), str(mask)
        return
    np.testing.assert_array_equal(bsa_dense(s, batch, heads, q_len, kv_len), want, str(mask))
    assert s.kwargs()["allow_empty_block_nums"] == bool((s.q2k_block_nums == 0).any())


def test_cudnn_bsa_offsets_and_edge_blocks():
    """A window into documents of 64: the edge blocks (short queries, short keys) are
    attended whole inside the window, listed, and ``block_sizes`` shortens the last."""
    mask = flexmask.document([64] * 8, truncate=True)
    q_off, kv_off, q_len, kv_len = [64, 128], [0, 64], 150, 200
    s = to_cudnn_bsa(mask, 2, 1, q_len, kv_len, block_size=64, q_offset=q_off, kv_offset=kv_off)
    assert s.block_sizes.tolist() == [64, 64, 64, 8]
    want = windowed(
        lambda q, kv: mask.to_dense(1, 1, q, kv).numpy().repeat(2, 0),
        q_off,
        kv_off,
        q_len,
        kv_len,
        2,
    )
    np.testing.assert_array_equal(bsa_dense(s, 2, 1, q_len, kv_len), want)
    with pytest.raises(ValueError, match=r"keys \[0, 64\) is attended in part"):
        to_cudnn_bsa(mask, 1, 1, 150, 200, block_size=64, kv_offset=1)


def test_cudnn_bsa_errors_name_the_argument():
    with pytest.raises(ValueError, match="block_size must be 64 or 128"):
        to_cudnn_bsa(flexmask.full(), 1, 1, 64, block_size=32)
    with pytest.raises(TypeError, match="flexmask Mask"):
        to_cudnn_bsa(None, 1, 1, 64)  # type: ignore[arg-type]
    empty = to_cudnn_bsa(flexmask.padding([64, 0]), 2, 1, 128, block_size=64)
    assert empty.q2k_block_nums.tolist() == [[[1, 0]], [[0, 0]]]
    assert empty.kwargs()["allow_empty_block_nums"] is True
    assert "block_size=64" in repr(empty)


# ----------------------------------------------------------------- sparse_attention top-k
@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.sampled_from([1, 2]),
    q_len=st.integers(1, 14),
    kv_len=st.integers(1, 14),
)
def test_cudnn_topk_tokens_equal_the_oracle(data, batch, heads, q_len, kv_len):
    """Granularity 1: every mask flexmask reads lowers, offsets, per-head, BSHD and THD,
    one set per KV head group (refused only where a group's heads differ)."""
    q_off, kv_off = offsets(data, batch)
    n = reach(q_off, kv_off, q_len, kv_len, batch, least=True)
    mask, dense = data.draw(with_selected(batch, heads, n))
    varlen = data.draw(st.booleans())
    kv_heads = data.draw(st.sampled_from([None, 1, heads]))
    want = windowed(dense, q_off, kv_off, q_len, kv_len, batch)
    try:
        t = to_cudnn_topk(
            mask,
            batch,
            heads,
            q_len,
            kv_len,
            q_offset=q_off,
            kv_offset=kv_off,
            varlen=varlen,
            kv_heads=kv_heads,
        )
    except ValueError as error:
        if "share KV head" in str(error):
            assert kv_heads == 1 and not (want[:, :1] == want).all(), error
        else:
            assert "from_mask_mod" in str(error), error
        return
    got = topk_dense(t, batch, heads, q_len, kv_len, kv_heads)
    np.testing.assert_array_equal(got, want, str(mask))
    assert (t.cu_seqlens_q is not None) == varlen == ("cu_seqlens_q" in t.kwargs())
    assert t.topk_idxs.shape[-1] == max(1, int(want.sum(-1).max()))


def entries_whole(want: np.ndarray, g: int) -> bool:
    kv_len = want.shape[-1]
    for i in range(0, kv_len, g):
        part = want[..., i : i + g]
        if (part.any(-1) & ~part.all(-1)).any():
            return False
    return True


@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.sampled_from([1, 2]),
    g=st.sampled_from([4, 64]),
)
def test_cudnn_topk_blocks_equal_the_oracle_or_refuse(data, batch, heads, g):
    q_len, kv_len = (
        data.draw(st.integers(1, 40 if g == 4 else 200)),
        data.draw(st.integers(1, 40 if g == 4 else 200)),
    )
    aligned = g == 4 or data.draw(st.booleans())
    if aligned:  # every entry whole, unless causal cuts it
        mask, dense = data.draw(aligned_expressions(batch, heads, g))
    else:
        mask, dense = data.draw(expressions(batch, heads, max(q_len, kv_len), max_leaves=2))
    causal = data.draw(st.booleans())
    if causal:
        mask, dense = (
            mask & flexmask.causal(),
            (lambda q, kv, f=dense: f(q, kv) & np.tril(np.ones((q, kv), bool))),
        )
    want = dense(max(q_len, kv_len), max(q_len, kv_len))[:, :, :q_len, :kv_len]
    try:
        t = to_cudnn_topk(mask, batch, heads, q_len, kv_len, index_granularity=g)
    except ValueError as error:
        assert not (aligned and not causal), error
        if "from_mask_mod" not in str(error):
            assert "not a run of whole entries" in str(error), error
            assert not entries_whole(want, g), str(mask)
        return
    np.testing.assert_array_equal(topk_dense(t, batch, heads, q_len, kv_len), want, str(mask))


def test_cudnn_topk_width_and_refusals():
    mask = flexmask.document([8, 8], truncate=True)
    t = to_cudnn_topk(mask, 1, 1, 16, index_granularity=4, topk=3)
    assert t.topk_idxs.shape == (1, 16, 3) and t.topk_idxs[0, 15].tolist() == [2, 3, -1]
    with pytest.raises(ValueError, match=r"topk=1: query 0 of batch row 0 \(head 0\) attends 2"):
        to_cudnn_topk(flexmask.chunked(8), 1, 1, 16, index_granularity=4, topk=1)
    with pytest.raises(ValueError, match=r"attends the keys \[0, 1\)"):
        to_cudnn_topk(flexmask.causal(), 1, 1, 16, index_granularity=4)
    with pytest.raises(ValueError, match="index_granularity must be one of"):
        to_cudnn_topk(flexmask.causal(), 1, 1, 16, index_granularity=2)
    with pytest.raises(ValueError, match="topk"):
        to_cudnn_topk(flexmask.causal(), 1, 1, 16, topk=0)
    per = to_cudnn_topk(flexmask.per_head(flexmask.causal(), flexmask.full()), 1, 2, 3)
    assert per.topk_idxs.shape == (1, 3, 2, 3) and per.topk_length[0, 0].tolist() == [1, 3]
    assert set(per.kwargs()) == {"topk_idxs", "topk_length", "index_granularity"}
    assert "index_granularity=1" in repr(per)


def test_cudnn_topk_kernel_envelopes():
    """The forms cuDNN's registered kernels serve: DSA (THD, one shared set, g = 1) and the
    GQA substrate (G = H_kv, g of 64): NSA's ``selected(idx, tile=64)`` per KV head group."""
    causal_docs = flexmask.causal() & flexmask.document([[5, 7], [12]], truncate=True)
    dsa = to_cudnn_topk(causal_docs, 2, 4, 12, varlen=True)
    assert dsa.topk_idxs.shape == (24, 12) and dsa.cu_seqlens_q.tolist() == [0, 12, 24]
    assert dsa.topk_idxs[12 + 3].tolist()[:5] == [12, 13, 14, 15, -1]  # row 1: global ids
    want = causal_docs.to_dense(2, 4, 12, 12).numpy()
    np.testing.assert_array_equal(topk_dense(dsa, 2, 4, 12, 12), want)
    picks = torch.tensor([[[[0, -1], [0, 1]], [[1, -1], [0, -1]]]])  # (B=1, H_kv=2, 2, 2)
    mask = flexmask.selected(picks.repeat_interleave(2, 1), tile=64)  # H_q = 4, groups of 2
    gqa = to_cudnn_topk(mask, 1, 4, 128, index_granularity=64, kv_heads=2)
    assert gqa.topk_idxs.shape == (1, 128, 2, 2)
    assert gqa.topk_idxs[0, 100].tolist() == [[0, 1], [0, -1]]
    np.testing.assert_array_equal(
        topk_dense(gqa, 1, 4, 128, 128, kv_heads=2), mask.to_dense(1, 4, 128, 128).numpy()
    )
    with pytest.raises(ValueError, match="query heads 0 and 2 share KV head 0"):
        to_cudnn_topk(mask, 1, 4, 128, index_granularity=64, kv_heads=1)
    with pytest.raises(ValueError, match="H=4 must be a multiple of kv_heads=3"):
        to_cudnn_topk(mask, 1, 4, 128, index_granularity=64, kv_heads=3)
    with pytest.raises(ValueError, match="KV_LEN=100 must be a multiple of index_granularity=64"):
        to_cudnn_topk(flexmask.full(), 2, 1, 100, index_granularity=64, varlen=True)
    with pytest.raises(TypeError, match="varlen must be a bool"):
        to_cudnn_topk(flexmask.full(), 2, 1, 100, varlen="yes")  # type: ignore[arg-type]


# ----------------------------------------------------------------- the kernels themselves
def _sdpa(q, k, v, dense):
    """(B, S, H, D) attention in float32 with a dense (B, H, Q, KV) mask (rows attend)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).float() for t in (q, k, v)), attn_mask=dense
    )
    return out.transpose(1, 2)


@pytest.mark.gpu
def test_cudnn_flex_attention_kernel_matches_dense_attention():
    """cuDNN's flex_attention (SM90/SM100) with ``mask_func``, fixed BSHD and THD, against
    SDPA with the dense mask."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    flex = pytest.importorskip("cudnn.flex_attention")
    batch, heads, length, dim = 2, 2, 384, 64
    mask = flexmask.causal() & flexmask.document([[100, 284], [384]])
    q, k, v = (
        torch.randn(batch, length, heads, dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    want = _sdpa(q, k, v, mask.to_dense(batch, heads, length, length, device="cuda"))
    c = to_cudnn(mask, batch, heads, length, device="cuda")
    plan = flex.create_mask_plan(q=q, k=k, v=v, **c.kwargs())
    out = flex.flex_attn_func(q, k, v, mask_plan=plan)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    padded = mask & flexmask.padding([300, 384])
    p = to_cudnn(padded, batch, heads, length, varlen=True, device="cuda")
    plan = flex.create_mask_plan(q=p.pack_q(q), k=p.pack_kv(k), v=p.pack_kv(v), **p.kwargs())
    out = p.unpack(flex.flex_attn_func(p.pack_q(q), p.pack_kv(k), p.pack_kv(v), mask_plan=plan))
    torch.testing.assert_close(out[0, :300].float(), want[0, :300], atol=2e-2, rtol=2e-2)
    assert not out[0, 300:].any()


@pytest.mark.gpu
def test_cudnn_bsa_kernel_matches_dense_attention():
    """cuDNN's block-sparse attention with these lists against SDPA with the dense mask."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cudnn = pytest.importorskip("cudnn")
    batch, heads, length, dim = 1, 2, 512, 128
    mask = flexmask.document([128, 256, 128]) | flexmask.prefix(128)
    s = to_cudnn_bsa(mask, batch, heads, length, block_size=64, device="cuda")
    q, k, v = (
        torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    out, _ = cudnn.BSA.block_sparse_attention_forward(q, k, v, **s.kwargs())  # (o, lse)
    dense = mask.to_dense(batch, heads, length, length, device="cuda")
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=dense
    )
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
