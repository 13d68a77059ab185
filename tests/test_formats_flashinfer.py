"""``to_flashinfer`` is exact or refuses: FlashInfer's block-sparse format, written plainly
below from ``flashinfer/attention/prims_ts/block_sparse.py`` (``BlockSparseTSWrapper.run``:
``block_indptr [B, Hkv, ceil(Sq / q_block_size) + 1]`` indexing one flat ``block_indices``,
``kv_valid_bits [B, ceil(Skv / 32)]`` uint32) and its tests' reference
(``tests/attention/test_attention_ts_block_sparse.py``: ``_make_bsr``, ``_pack_token_mask``,
``_reference``), gives back the mask's dense form; a mask that format cannot hold is refused,
and the tests decide which from the dense oracle alone.

FlashInfer's rule, per batch row ``b``, query head ``hq`` (KV head ``hq // group``) and
query ``q``: key ``kv`` is attended iff its block ``kv // kv_block_size`` is among the row's
``block_indices[block_indptr[b, hk, m] : block_indptr[b, hk, m + 1]]``, bit ``kv % 32`` of
``kv_valid_bits[b, kv // 32]`` is set, and, for ``mask_type == "causal"``, ``kv < Skv - Sq +
q + 1``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.formats import (
    FlashInferBSRMask,
    FlashInferMask,
    FlashInferVariableMask,
    to_flashinfer,
    to_flashinfer_bsr,
    to_flashinfer_variable,
)
from tests import oracle
from tests.strategies import expressions, leaves, selected_dense

SETTINGS = settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def flashinfer_dense(f: FlashInferMask, batch: int, heads: int) -> np.ndarray:
    """(B, H, Q, KV) as FlashInfer's prims_ts kernel attends, read from the tensors."""
    q_len, kv_len = f.seq_lengths
    group = heads // f.num_kv_heads
    indptr, indices = f.block_indptr.tolist(), f.block_indices.tolist()
    if f.kv_valid_bits is None:
        valid = np.ones((batch, kv_len), dtype=bool)
    else:
        words = f.kv_valid_bits.to(torch.int64).numpy()
        valid = np.array(
            [[(words[b, kv // 32] >> (kv % 32)) & 1 for kv in range(kv_len)] for b in range(batch)],
            dtype=bool,
        )
    out = np.zeros((batch, heads, q_len, kv_len), dtype=bool)
    for b in range(batch):
        for hq in range(heads):
            row = indptr[b][hq // group]
            for m in range(len(row) - 1):
                blocks = indices[row[m] : row[m + 1]]
                assert blocks == sorted(set(blocks)), "ids not strictly increasing"
                for q in range(m * f.q_block_size, min((m + 1) * f.q_block_size, q_len)):
                    for kv in range(kv_len):
                        attended = kv // f.kv_block_size in blocks and valid[b, kv]
                        if f.mask_type == "causal":
                            attended &= kv < kv_len - q_len + q + 1
                        out[b, hq, q, kv] = attended
    return out


def expressible(want: np.ndarray, group: int, block: tuple[int, int]) -> bool:
    """Whether FlashInfer's format can hold the dense mask, decided from it alone: query heads
    of a KV head agree, and every block with an attended pair attends exactly the keys some
    query of the row attends (and, for the causal form, those on or before the bottom-right
    diagonal) — a listed block's keys outside that set would be attended, inside it must."""
    batch, heads, q_len, kv_len = want.shape
    for h in range(heads):
        if not np.array_equal(want[:, h], want[:, h - h % group]):
            return False
    valid = want.any(axis=(1, 2))  # (B, KV): some query, some head
    q = np.arange(q_len)[:, None]
    kv = np.arange(kv_len)[None, :]
    q_block, kv_block = block
    for rule in (np.ones((q_len, kv_len), bool), kv < kv_len - q_len + q + 1):
        if (want & ~rule).any():
            continue
        ok = True
        for m in range(0, q_len, q_block):
            for n in range(0, kv_len, kv_block):
                tile = want[:, :, m : m + q_block, n : n + kv_block]
                listed = tile.any(axis=(2, 3), keepdims=True)
                expect = (
                    listed
                    & valid[:, None, None, n : n + kv_block]
                    & rule[m : m + q_block, n : n + kv_block]
                )
                ok &= bool(np.array_equal(tile, np.broadcast_to(expect, tile.shape)))
        if ok:
            return True
    return False


# q_block * group a multiple of 8, key blocks FlashInfer takes.
GROUPS = st.sampled_from([1, 2, 4, 8])
KV_BLOCKS = st.sampled_from([8, 16, 32, 64])


@st.composite
def q_blocks(draw, group: int):
    return draw(st.sampled_from([k * 8 // group for k in (1, 2, 4) if k * 8 % group == 0]))


@st.composite
def maybe_selected(draw, batch: int, length: int, mask, dense):
    """The expression, or it ``&`` / ``|`` a router's picked key tiles (``selected``)."""
    if not draw(st.booleans()):
        return mask, dense
    picked, picked_ref = draw(leaves(batch, length, ("selected",)))
    if draw(st.booleans()):
        return mask & picked, lambda q, kv: dense(q, kv) & picked_ref(q, kv)[:, None]
    return mask | picked, lambda q, kv: dense(q, kv) | picked_ref(q, kv)[:, None]


@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=GROUPS,
    q_len=st.one_of(st.integers(1, 4), st.integers(5, 40)),
    kv_len=st.integers(1, 70),
    kv_block=KV_BLOCKS,
)
def test_flashinfer_is_exact_or_refuses(data, batch, kv_heads, group, q_len, kv_len, kv_block):
    """Random compositions (B and H > 1, GQA, windows at the end of the keys as decode
    takes them, lengths not block multiples): lowered exactly where the format holds the
    mask, refused with the format named where it cannot."""
    heads = kv_heads * group
    q_block = data.draw(q_blocks(group))
    q_offset = data.draw(st.sampled_from([0, max(kv_len - q_len, 0)]))
    n = max(q_offset + q_len, kv_len)
    mask, dense = data.draw(expressions(batch, heads, n, max_leaves=3))
    mask, dense = data.draw(maybe_selected(batch, n, mask, dense))
    want = dense(n, n)[:, :, q_offset : q_offset + q_len, :kv_len]
    holds = expressible(want, group, (q_block, kv_block))
    try:
        f = to_flashinfer(
            mask,
            batch,
            heads,
            q_len,
            kv_len,
            q_block=q_block,
            kv_block=kv_block,
            num_kv_heads=kv_heads,
            q_offset=q_offset,
        )
    except ValueError as error:
        assert "cannot be lowered to FlashInfer" in str(error), str(error)
        assert not holds, f"{mask} refused but expressible: {error}"
        event("refused")
        return
    assert holds, f"{mask} lowered but not expressible"
    event(f"lowered {f.mask_type}")
    check_layout(f, batch, kv_heads, q_len, kv_len)
    np.testing.assert_array_equal(flashinfer_dense(f, batch, heads), want, str(mask))


@st.composite
def aligned_masks(draw, batch: int, length: int, block: int):
    """(mask, dense (B, L, L)): masks the format holds at blocks of ``block`` — causal,
    prefix, full or empty, with documents of block-multiple lengths, one per row or shared."""
    kind = draw(st.sampled_from(["causal", "prefix", "full", "empty"]))
    base, base_ref = draw(leaves(batch, length, (kind,)))
    per_row = draw(st.booleans())
    rows = []
    for _ in range(batch if per_row else 1):
        cuts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
        rows.append([c * block for c in cuts])
    docs = flexmask.document(rows if per_row else rows[0], truncate=True)
    if kind == "prefix":  # a prefix inside documents: keys below it, its own
        return base, base_ref
    mask = base & docs
    return (
        mask,
        lambda q, kv: (
            base_ref(q, kv)
            & np.stack([oracle.document(rows[r if per_row else 0], q, kv) for r in range(batch)])
        ),
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=GROUPS,
    kv_block=st.sampled_from([8, 16]),
    length=st.integers(1, 90),
)
def test_block_aligned_documents_lower(data, batch, kv_heads, group, kv_block, length):
    """Documents whose boundaries fall on block edges (both sides) lower on every row, the
    causal ones with ``mask_type="causal"``, padding past them as invalid keys."""
    heads = kv_heads * group
    q_block = kv_block
    if (q_block * group) % 8:
        return
    mask, dense = data.draw(aligned_masks(batch, length, kv_block))
    want = np.repeat(dense(length, length)[:, None], heads, axis=1)
    f = to_flashinfer(
        mask, batch, heads, length, q_block=q_block, kv_block=kv_block, num_kv_heads=kv_heads
    )
    check_layout(f, batch, kv_heads, length, length)
    np.testing.assert_array_equal(flashinfer_dense(f, batch, heads), want, str(mask))


def check_layout(f: FlashInferMask, batch: int, kv_heads: int, q_len: int, kv_len: int) -> None:
    """The tensors' dtypes and shapes as ``validate_block_sparse_metadata`` checks them."""
    num_q = -(-q_len // f.q_block_size)
    assert f.block_indptr.dtype == f.block_indices.dtype == torch.int32
    assert tuple(f.block_indptr.shape) == (batch, kv_heads, num_q + 1)
    assert f.block_indptr.is_contiguous() and f.block_indices.dim() == 1
    flat = f.block_indptr.view(-1, num_q + 1)
    # One running offset: each row of (b, hk) starts where the one before it ended.
    assert int(flat[0, 0]) == 0 and int(flat[-1, -1]) == f.block_indices.numel()
    assert torch.equal(flat[1:, 0], flat[:-1, -1])
    num_kv = -(-kv_len // f.kv_block_size)
    assert f.block_indices.numel() == 0 or int(f.block_indices.max()) < num_kv
    if f.kv_valid_bits is not None:
        assert f.kv_valid_bits.dtype == torch.uint32
        assert tuple(f.kv_valid_bits.shape) == (batch, -(-kv_len // 32))
    assert f.mask_type in ("dense", "causal")


def test_decode_window_with_documents_and_gqa():
    """A speculative step: 4 queries at the end of 300 keys, 2 KV heads of 4 query heads,
    one row in documents; key blocks of 8 (cheap for a drafter)."""
    docs = [[120, 150, 30], [300]]
    mask = flexmask.causal() & flexmask.document(docs)
    f = to_flashinfer(mask, 2, 8, 4, 300, q_block=2, kv_block=8, num_kv_heads=2, q_offset=296)
    assert f.mask_type == "causal"
    want = np.stack([oracle.document(d, 300, 300) & oracle.causal(300, 300) for d in docs])[
        :, None, 296:300
    ]
    np.testing.assert_array_equal(flashinfer_dense(f, 2, 8), np.repeat(want, 8, axis=1))
    # Row 0 attends its last document's keys only: 4 blocks of 8 and one bit per key.
    assert f.block_indices[: int(f.block_indptr[0, 0, 1])].tolist() == [33, 34, 35, 36, 37]
    assert f.kv_valid_bits is not None and f.max_blocks_per_row == 38


def test_valid_bits_only_where_a_listed_block_holds_an_unattended_key():
    """Padding on block edges: its keys lie in no listed block, so no bits; padding inside
    a block: bits, one per key, set for the keys some query attends."""
    whole = to_flashinfer(
        flexmask.causal() & flexmask.document([32]), 1, 1, 64, q_block=16, kv_block=16
    )
    assert whole.kv_valid_bits is None and whole.block_indptr[0, 0].tolist() == [0, 1, 3, 3, 3]
    cut = to_flashinfer(flexmask.prefix(30), 1, 1, 64, q_block=16, kv_block=16)
    assert cut.kv_valid_bits is not None
    assert [hex(int(w)) for w in cut.kv_valid_bits[0]] == ["0x3fffffff", "0x0"]
    np.testing.assert_array_equal(
        flashinfer_dense(cut, 1, 1), oracle.prefix(30, 64, 64)[None, None]
    )


def test_per_head_groups_lower_per_kv_head():
    """Each KV head's group of query heads has its mask (per_head with group_size); one
    mask_type serves every head."""
    mask = flexmask.per_head(
        flexmask.causal(), flexmask.causal() & flexmask.document([16, 16]), group_size=2
    )
    f = to_flashinfer(mask, 1, 4, 32, q_block=8, kv_block=8, num_kv_heads=2)
    docs = oracle.document([16, 16], 32, 32) & oracle.causal(32, 32)
    want = np.stack([oracle.causal(32, 32)] * 2 + [docs] * 2)[None]
    np.testing.assert_array_equal(flashinfer_dense(f, 1, 4), want)
    assert f.mask_type == "causal"


def test_heads_that_differ_elsewhere_may_share_a_row():
    """Heads are compared on the window lowered: causal and full agree on one query at the
    end of its keys (a decode step), so they share a KV head there, and not on a longer one."""
    mask = flexmask.per_head(flexmask.causal(), flexmask.full())
    f = to_flashinfer(mask, 1, 8, 1, 20, q_block=1, kv_block=8, num_kv_heads=1, q_offset=19)
    np.testing.assert_array_equal(flashinfer_dense(f, 1, 8), np.ones((1, 8, 1, 20), bool))
    with pytest.raises(ValueError, match=r"head 1 attends otherwise than head 0"):
        to_flashinfer(mask, 1, 8, 2, 20, q_block=1, kv_block=8, num_kv_heads=1, q_offset=18)


def test_router_picks_on_the_block_grid_lower():
    """NSA's selected blocks under causal: picks of (q_block, kv_block) tiles are whole
    blocks, the diagonal the causal rule; per row picks, 2 KV heads."""
    picks = torch.tensor([[[0, -1], [1, 0], [2, 0]], [[0, 0], [-1, -1], [1, 2]]])
    mask = flexmask.causal() & flexmask.selected(picks, tile=(16, 8))
    f = to_flashinfer(mask, 2, 2, 48, q_block=16, kv_block=8, num_kv_heads=2)
    want = np.stack(
        [selected_dense(picks[r].tolist(), 16, 8, 48, 48) & oracle.causal(48, 48) for r in (0, 1)]
    )
    np.testing.assert_array_equal(flashinfer_dense(f, 2, 2), np.repeat(want[:, None], 2, 1))
    assert f.mask_type == "causal" and f.max_blocks_per_row == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: to_flashinfer(
                flexmask.causal() & flexmask.document([20, 44]),
                1,
                1,
                64,
                q_block=16,
                kv_block=16,
            ),
            r"queries 16\.\.31, keys 0\.\.15\).*no per-element mask.*to_fa4",
        ),
        (
            lambda: to_flashinfer(flexmask.sliding_window(12), 1, 1, 64, q_block=8, kv_block=8),
            r"cannot be lowered to FlashInfer's block-sparse format",
        ),
        (
            lambda: to_flashinfer(
                flexmask.per_head(flexmask.causal(), flexmask.full()),
                1,
                2,
                64,
                q_block=8,
                kv_block=8,
                num_kv_heads=1,
            ),
            r"query heads 0\.\.1 share KV head 0.*group_size=2",
        ),
        (
            lambda: to_flashinfer(flexmask.causal(), 1, 1, 64, kv_block=12),
            r"kv_block must be 8, 16, 32 or a multiple of 64.*got 12",
        ),
        (
            lambda: to_flashinfer(flexmask.causal(), 1, 2, 64, q_block=2, num_kv_heads=1),
            r"q_block \* \(H // num_kv_heads\) must be a multiple of 8",
        ),
        (
            lambda: to_flashinfer(flexmask.causal(), 1, 3, 64, num_kv_heads=2),
            r"num_kv_heads must divide H",
        ),
        (
            lambda: to_flashinfer(flexmask.causal(), 1, 1, 64, q_block=0),
            r"q_block",
        ),
        (
            # flexmask's causal() is top-left; FlashInfer's rule is bottom-right.
            lambda: to_flashinfer(flexmask.causal(), 1, 1, 40, 64, q_block=8, kv_block=8),
            r"cannot be lowered to FlashInfer",
        ),
    ],
    ids=[
        "document inside a block",
        "window edge",
        "heads of a group differ",
        "key block",
        "query tile",
        "kv heads",
        "q_block",
        "top-left causal",
    ],
)
def test_refusals_name_what_is_missing(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_type_errors():
    with pytest.raises(TypeError, match="flexmask Mask"):
        to_flashinfer(lambda b, h, q, kv: q >= kv, 1, 1, 8)  # type: ignore[arg-type]


def test_keywords_are_flashinfers():
    f = to_flashinfer(flexmask.prefix(30), 2, 2, 40, 64, q_block=8, kv_block=8)
    assert set(f.kwargs()) == {
        "block_indptr",
        "block_indices",
        "q_block_size",
        "kv_block_size",
        "kv_valid_bits",
        "mask_type",
    }
    plan = f.plan_kwargs()
    assert plan["batch_size"] == 2 and plan["seq_len_q"] == 40 and plan["seq_len_kv"] == 64
    assert plan["use_kv_valid_bits"] and plan["max_blocks_per_row"] == 4
    assert plan["num_qo_heads"] == plan["num_kv_heads"] == 2
    assert set(f.run_kwargs()) == {"block_indptr", "block_indices", "kv_valid_bits"}
    assert "FlashInferMask(block_indptr=int32[2, 2, 6]" in repr(f)


# ------------------------------------------------- the classic BlockSparseAttentionWrapper
def bsr_dense(f: FlashInferBSRMask, batch: int, heads: int) -> np.ndarray:
    """(B, H, M, N) as ``BlockSparseAttentionWrapper`` attends: SciPy's
    ``bsr_matrix((mask, indices, indptr)).toarray()`` (the wrapper's tests' reference),
    the last block row cut to M; the same matrix for every row and head."""
    dense = np.zeros((f.M, f.N), dtype=bool)
    indptr, indices = f.indptr.tolist(), f.indices.tolist()
    assert len(indptr) == -(-f.M // f.R) + 1 and f.N % f.C == 0
    for i in range(len(indptr) - 1):
        row = indices[indptr[i] : indptr[i + 1]]
        assert row == sorted(set(row))
        for k in range(indptr[i], indptr[i + 1]):
            j = indices[k]
            block = np.ones((f.R, f.C), bool) if f.mask is None else f.mask[k].numpy()
            rows = min(f.R, f.M - i * f.R)
            dense[i * f.R : i * f.R + rows, j * f.C : (j + 1) * f.C] = block[:rows]
    return np.broadcast_to(dense, (batch, heads, f.M, f.N))


@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.sampled_from([1, 2]),
    q_len=st.integers(1, 30),
    kv_blocks=st.integers(1, 6),
    block=st.sampled_from([1, 2, 3, 4, 8, (2, 4), (4, 3), (8, 2)]),
)
def test_flashinfer_bsr_is_exact_or_refuses(data, batch, heads, q_len, kv_blocks, block):
    """Any mask whose rows and heads attend alike lowers (partial blocks carry their bits);
    one that differs by row or head is refused, decided from the oracle."""
    q_block, kv_block = block if isinstance(block, tuple) else (block, block)
    kv_len = kv_blocks * kv_block
    q_offset = data.draw(st.sampled_from([0, max(kv_len - q_len, 0)]))
    n = max(q_offset + q_len, kv_len)
    mask, dense = data.draw(expressions(batch, heads, n, max_leaves=3))
    mask, dense = data.draw(maybe_selected(batch, n, mask, dense))
    want = dense(n, n)[:, :, q_offset : q_offset + q_len, :kv_len]
    alike = bool((want == want[:1, :1]).all())
    try:
        f = to_flashinfer_bsr(
            mask,
            batch,
            heads,
            q_len,
            kv_len,
            q_block=q_block,
            kv_block=kv_block,
            q_offset=q_offset,
        )
    except ValueError as error:
        assert "one BSR matrix for every head and no batch" in str(error), str(error)
        assert not alike, f"{mask} refused but alike on every row and head"
        event("refused")
        return
    assert alike, f"{mask} lowered though its rows or heads differ"
    event("lowered" if f.mask is not None else "lowered, every block whole")
    assert f.indptr.dtype == f.indices.dtype == torch.int32
    np.testing.assert_array_equal(bsr_dense(f, batch, heads), want, str(mask))


def test_flashinfer_bsr_errors_and_keywords():
    with pytest.raises(ValueError, match=r"KV_LEN must be a multiple of kv_block.*N is divisible"):
        to_flashinfer_bsr(flexmask.causal(), 1, 1, 10, q_block=4, kv_block=4)
    with pytest.raises(ValueError, match=r"batch row 1, head 0 attends otherwise"):
        to_flashinfer_bsr(flexmask.document([[4, 4], [8]]), 2, 1, 8, q_block=4, kv_block=4)
    with pytest.raises(TypeError, match="flexmask Mask"):
        to_flashinfer_bsr(lambda b, h, q, kv: q >= kv, 1, 1, 8)  # type: ignore[arg-type]
    f = to_flashinfer_bsr(flexmask.document([8, 8]), 1, 1, 16, q_block=8, kv_block=8)
    assert f.mask is None and f.plan_kwargs()["indices"].tolist() == [0, 1]
    assert set(f.plan_kwargs()) == {"indptr", "indices", "M", "N", "R", "C", "mask"}
    assert repr(f) == "FlashInferBSRMask(M=16, N=16, R=8, C=8, nnz=2, mask=None)"


# ------------------------------------------------ the VariableBlockSparseAttentionWrapper
def variable_dense(f: FlashInferVariableMask, batch: int) -> np.ndarray:
    """(B, H, Q, KV) as ``VariableBlockSparseAttentionWrapper`` attends: its tests'
    ``_block_mask_to_element_mask`` (the map expanded by ``repeat_interleave`` with the
    block sizes), per KV head, the same for every batch row."""
    per_kv = [
        np.repeat(
            np.repeat(f.block_mask_map[h].numpy(), f.block_row_sz[h].numpy(), axis=0),
            f.block_col_sz[h].numpy(),
            axis=1,
        )
        for h in range(f.num_kv_heads)
    ]
    group = f.num_qo_heads // f.num_kv_heads
    heads = np.stack([per_kv[h // group] for h in range(f.num_qo_heads)])
    return np.broadcast_to(heads, (batch, *heads.shape))


@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2]),
    q_len=st.integers(1, 30),
    kv_len=st.integers(1, 30),
)
def test_flashinfer_variable_is_exact_or_refuses(data, batch, kv_heads, group, q_len, kv_len):
    """The coarsest blocks of any interval mask whose rows and a group's heads attend alike
    (router picks among them); refused where they differ, decided from the oracle."""
    heads = kv_heads * group
    q_offset = data.draw(st.sampled_from([0, max(kv_len - q_len, 0)]))
    n = max(q_offset + q_len, kv_len)
    mask, dense = data.draw(expressions(batch, heads, n, max_leaves=3))
    mask, dense = data.draw(maybe_selected(batch, n, mask, dense))
    want = dense(n, n)[:, :, q_offset : q_offset + q_len, :kv_len]
    alike = bool((want == want[:1]).all()) and all(
        np.array_equal(want[:, h], want[:, h - h % group]) for h in range(heads)
    )
    try:
        f = to_flashinfer_variable(
            mask, batch, heads, q_len, kv_len, num_kv_heads=kv_heads, q_offset=q_offset
        )
    except ValueError as error:
        message = str(error)
        assert "VariableBlockSparseAttentionWrapper" in message, message
        # A leaf with no intervals to read (from_mask_mod) is refused whatever it attends.
        assert not alike or "cannot read intervals" in message, f"{mask} refused: {message}"
        event("refused")
        return
    assert alike, f"{mask} lowered though its rows or a group's heads differ"
    assert f.block_row_sz.dtype == f.block_col_sz.dtype == torch.int32
    assert (
        int(f.block_row_sz.sum(-1).min()) == q_len and int(f.block_col_sz.sum(-1).max()) == kv_len
    )
    np.testing.assert_array_equal(variable_dense(f, batch), want, str(mask))
    event("lowered")


def _later(b, h, q_idx, kv_idx):
    return kv_idx >= q_idx


def test_flashinfer_variable_blocks_are_few_and_errors_name_the_cause():
    """Documents with a prefix: one block per run of alike rows and columns; a causal mask
    past MAX_BLOCKS, rows that differ and a user mask_mod are refused."""
    mask = flexmask.prefix(10) | flexmask.document([300, 212])
    f = to_flashinfer_variable(mask, 2, 4, 512, num_kv_heads=2)
    assert f.block_row_sz[0].tolist() == [300, 212] and f.block_col_sz[0].tolist() == [10, 290, 212]
    assert set(f.plan_kwargs()) == {
        "block_mask_map",
        "block_row_sz",
        "block_col_sz",
        "num_qo_heads",
        "num_kv_heads",
    }
    with pytest.raises(ValueError, match=r"9000 x 9000 variable blocks.*MAX_BLOCKS"):
        to_flashinfer_variable(flexmask.causal(), 1, 1, 9000)
    with pytest.raises(ValueError, match=r"batch rows attend differently.*no batch"):
        to_flashinfer_variable(flexmask.document([[4, 4], [8]]), 2, 1, 8)
    with pytest.raises(ValueError, match=r"from_mask_mod"):
        to_flashinfer_variable(flexmask.from_mask_mod(_later, key="later"), 1, 1, 8)
    with pytest.raises(ValueError, match=r"num_kv_heads must divide H"):
        to_flashinfer_variable(flexmask.causal(), 1, 3, 8, num_kv_heads=2)


@pytest.mark.gpu
def test_flashinfer_kernel_matches_the_reference_attention():
    """The real prims_ts kernel (Blackwell, flashinfer installed) with these arguments
    against the float64 reference attention on the dense mask: causal documents on block
    edges, keys no query attends inside a key block (kv_valid_bits), GQA, the last 64
    queries."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prims = pytest.importorskip("flashinfer.attention.prims_ts")
    batch, heads, kv_heads, q_len, kv_len, dim = 2, 8, 2, 64, 320, 128
    # Document starts on the query blocks (256 + 16 k) or before the window's queries: the
    # keys before a start inside a key block are attended by no query (kv_valid_bits).
    mask = flexmask.causal() & flexmask.document([[100, 188, 32], [200, 120]])
    f = to_flashinfer(
        mask,
        batch,
        heads,
        q_len,
        kv_len,
        q_block=16,
        kv_block=16,
        num_kv_heads=kv_heads,
        q_offset=kv_len - q_len,
        device="cuda",
    )
    assert f.kv_valid_bits is not None and f.mask_type == "causal"
    q = torch.randn(batch, q_len, heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn(batch, kv_len, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    out = prims.block_sparse_attention(q, k, v, **f.kwargs())
    want = mask.to_dense(batch, heads, kv_len, kv_len)[:, :, kv_len - q_len :]
    ref, _ = oracle.attention(*(t.transpose(1, 2).cpu() for t in (q, k, v)), want)
    torch.testing.assert_close(out.float().cpu(), ref.transpose(1, 2).float(), atol=2e-2, rtol=2e-2)
