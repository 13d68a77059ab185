"""FlashAttention-4's varlen block sparsity (``to_fa4_varlen``) and compact index tensors
(``to_fa4(..., compact=True)``) are exact: the semantics, written plainly below from flash-attn's
``flash_attn/cute`` — ``block_sparse_utils.py`` ``_get_curr_blocksparse_tensors_varlen``
(count ``mask_block_cnt[head, m_block_offset + m]``, indices from
``block_idx_offset + m * num_n_blocks``), ``seqlen_info.py`` ``SeqlenInfoQK.create``
(``m_block_offset = cu_total_m_blocks[batch]``, ``block_idx_offset =
cu_block_idx_offsets[batch]``, ``num_n_blocks = ceil(seqlen_k / tile_n)``),
``compute_block_sparsity.py`` (``cu_block_idx_offsets`` the running sum of ``M_b * N_b``) and
``block_sparsity.py``'s note "Allow Compact block sparse indices" (a row's first ``cnt``
entries are all FA4 reads) — give back the mask's dense form on random masks.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.formats import FA4VarlenMask, to_fa4, to_fa4_varlen
from tests import oracle
from tests.strategies import expressions, leaves
from tests.test_formats_fa4 import fa4_dense
from tests.test_formats_flashinfer import maybe_selected

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fa4_varlen_dense(f: FA4VarlenMask, batch: int, heads: int) -> np.ndarray:
    """(B, H, Q, KV) as FA4's varlen forward attends: per sequence, its query blocks' listed
    key blocks, partial ones through ``mask_mod`` (sequence index and local positions),
    mapped back to rows by the packed layout."""
    q_len, kv_len = f.seq_lengths
    q_block, kv_block = f.block_size
    cu_q, cu_k = f.cu_seqlens_q.tolist(), f.cu_seqlens_k.tolist()
    out = np.zeros((batch, heads, q_len, kv_len), dtype=bool)
    for s in range(len(cu_q) - 1):
        len_q, len_k = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        rows = [divmod(int(i), q_len) for i in f.q_index[cu_q[s] : cu_q[s + 1]]]
        keys = [divmod(int(i), kv_len) for i in f.k_index[cu_k[s] : cu_k[s + 1]]]
        (b,) = {r for r, _ in rows} | {r for r, _ in keys}  # one row per sequence
        num_n = -(-len_k // kv_block)  # SeqlenInfoQK.num_n_blocks
        m_offset = int(f.cu_total_m_blocks[s])
        idx_offset = int(f.cu_block_idx_offsets[s])
        for h in range(heads):
            for m in range(-(-len_q // q_block)):
                start = idx_offset + m * num_n
                lists = (
                    (f.mask_block_cnt, f.mask_block_idx, False),
                    (f.full_block_cnt, f.full_block_idx, True),
                )
                seen: set[int] = set()
                for cnt, idx, full in lists:
                    count = int(cnt[h, m_offset + m])
                    for n in idx[h, start : start + count].tolist():
                        assert n not in seen and 0 <= n < num_n
                        seen.add(n)
                        for lq in range(m * q_block, min((m + 1) * q_block, len_q)):
                            for lk in range(n * kv_block, min((n + 1) * kv_block, len_k)):
                                if not full:
                                    t = torch.tensor
                                    bit = f.mask_mod(
                                        t(s), t(h), t(lq), t(lk), None, list(f.aux_tensors)
                                    )
                                    if not bool(bit):
                                        continue
                                out[b, h, rows[lq][1], keys[lk][1]] = True
    return out


def check_layout(f: FA4VarlenMask, heads: int) -> None:
    """Shapes and cumulative tensors as FA4 derives them from the sequence lengths
    (``compute_block_sparsity``'s loop over ``cu_seqlens_q``/``cu_seqlens_k``)."""
    q_block, kv_block = f.block_size
    cu_q, cu_k = f.cu_seqlens_q.tolist(), f.cu_seqlens_k.tolist()
    cu_m, cu_idx = [0], [0]
    for s in range(len(cu_q) - 1):
        m_blocks = -(-(cu_q[s + 1] - cu_q[s]) // q_block)
        n_blocks = -(-(cu_k[s + 1] - cu_k[s]) // kv_block)
        cu_m.append(cu_m[-1] + m_blocks)
        cu_idx.append(cu_idx[-1] + m_blocks * n_blocks)
    assert f.cu_total_m_blocks.tolist() == cu_m
    assert f.cu_block_idx_offsets.tolist() == cu_idx
    for t in (f.mask_block_cnt, f.full_block_cnt, f.mask_block_idx, f.full_block_idx):
        assert t.dtype == torch.int32 and t.dim() == 2 and t.shape[0] == heads
    assert f.mask_block_cnt.shape[1] == f.full_block_cnt.shape[1] == cu_m[-1]
    assert f.mask_block_idx.shape[1] == f.full_block_idx.shape[1] == cu_idx[-1]
    for t in (f.cu_total_m_blocks, f.cu_block_idx_offsets, f.cu_seqlens_q, f.cu_seqlens_k):
        assert t.dtype == torch.int32
    lengths = np.diff(cu_q)
    assert f.max_seqlen_q == (int(lengths.max()) if lengths.size else 0)
    assert bool((np.diff(cu_q) > 0).all()) and bool((np.diff(cu_k) > 0).all())


BLOCKS = st.sampled_from([1, 2, 3, 4, 8, (2, 4), (4, 3), (8, 3), (3, 1)])


@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.sampled_from([1, 2]),
    q_len=st.integers(1, 23),
    kv_len=st.integers(1, 23),
    block=BLOCKS,
)
def test_fa4_varlen_equals_the_dense_mask(data, batch, heads, q_len, kv_len, block):
    """Random compositions, usually inside documents (one set per row or shared) or
    padding: each sequence's grid starts at its first token, rows attending nothing are
    left out, lengths are rarely block multiples."""
    if data.draw(st.booleans()):
        kv_len = q_len
    q_block, kv_block = block if isinstance(block, tuple) else (block, block)
    n = max(q_len, kv_len)
    mask, dense = data.draw(expressions(batch, heads, n, max_leaves=2))
    mask, dense = data.draw(maybe_selected(batch, n, mask, dense))
    parts = data.draw(st.sampled_from([(), ("document",), ("padding",), ("document", "padding")]))
    for kind in parts:
        part, part_ref = data.draw(leaves(batch, n, (kind,)))
        mask, dense = (
            mask & part,
            lambda q, kv, a=dense, p=part_ref: a(q, kv) & p(q, kv)[:, None],
        )
    want = dense(n, n)[:, :, :q_len, :kv_len]
    np.testing.assert_array_equal(mask.to_dense(batch, heads, q_len, kv_len).numpy(), want)
    f = to_fa4_varlen(mask, batch, heads, q_len, kv_len, q_block=q_block, kv_block=kv_block)
    check_layout(f, heads)
    np.testing.assert_array_equal(fa4_varlen_dense(f, batch, heads), want, str(mask))


def test_documents_per_row_with_rectangular_blocks():
    """Rows with different documents, a key side shorter than the queries, padding: one
    sequence per document, its grid from its own start, at Blackwell's (256, 128) shape
    scaled down to (8, 4)."""
    docs = [[10, 7, 13], [20, 5]]  # row 1: 5 tokens of padding
    mask = flexmask.causal() & flexmask.document(docs)
    f = to_fa4_varlen(mask, 2, 3, 30, 27, q_block=8, kv_block=4)
    assert f.cu_seqlens_q.tolist() == [0, 10, 17, 30, 50, 55]
    assert f.cu_seqlens_k.tolist() == [0, 10, 17, 27, 47, 52]
    check_layout(f, 3)
    want = np.stack([oracle.document(d, 30, 27) & oracle.causal(30, 27) for d in docs])
    np.testing.assert_array_equal(fa4_varlen_dense(f, 2, 3), np.repeat(want[:, None], 3, 1))
    # Queries 27..29 of row 0's last document have keys there (10 + 7 + 10): they attend.
    assert f.q_index.numel() == 55


def test_no_partition_is_one_sequence_per_row():
    mask = flexmask.sliding_window(5) & flexmask.causal()
    f = to_fa4_varlen(mask, 2, 1, 19, q_block=4, kv_block=8)
    assert f.cu_seqlens_q.tolist() == [0, 19, 38]
    np.testing.assert_array_equal(
        fa4_varlen_dense(f, 2, 1),
        np.broadcast_to(oracle.sliding_window(5, 19, 19) & oracle.causal(19, 19), (2, 1, 19, 19)),
    )


def test_pack_and_unpack_follow_the_layout():
    mask = flexmask.document([[3, 4], [2]], truncate=True)
    f = to_fa4_varlen(mask, 2, 1, 8, q_block=2, kv_block=2)
    x = torch.arange(16.0).view(2, 8, 1)
    packed = f.pack_q(x)
    assert packed.view(-1).tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert torch.equal(f.pack_k(x), packed)
    back = f.unpack(packed)
    assert back.view(2, 8).tolist() == [[0, 1, 2, 3, 4, 5, 6, 0], [8, 9, 0, 0, 0, 0, 0, 0]]


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="flexmask Mask"):
        to_fa4_varlen(lambda b, h, q, kv: q >= kv, 1, 1, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_block"):
        to_fa4_varlen(flexmask.causal(), 1, 1, 8, kv_block=0)
    with pytest.raises(ValueError, match="B"):
        to_fa4_varlen(flexmask.document([[4, 4], [8]]), 3, 1, 8)


def test_kwargs_are_fa4s_varlen_keywords(monkeypatch):
    f = to_fa4_varlen(flexmask.causal() & flexmask.document([300, 212]), 1, 2, 512)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "flash_attn", None)
        with pytest.raises(ImportError, match="block_sparse_fields"):
            f.kwargs()
    fake = types.ModuleType("flash_attn.cute.block_sparsity")
    fake.BlockSparseTensorsTorch = lambda **fields: fields  # type: ignore[attr-defined]
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.block_sparsity", fake)
    kwargs = f.kwargs()
    assert set(kwargs) == {
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "block_sparse_tensors",
        "mask_mod",
        "aux_tensors",
    }
    sparse = kwargs["block_sparse_tensors"]
    assert sparse["cu_total_m_blocks"] is f.cu_total_m_blocks
    assert sparse["cu_block_idx_offsets"] is f.cu_block_idx_offsets
    assert sparse["block_size"] == (256, 128) and kwargs["max_seqlen_q"] == 300
    assert "FA4VarlenMask(sequences=2" in repr(f)


# ------------------------------------------------------------------ compact index tensors
@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.sampled_from([1, 2, 4]),
    q_len=st.integers(1, 23),
    kv_len=st.integers(1, 23),
    q_block=st.sampled_from([1, 2, 3, 4, 8]),
    kv_block=st.sampled_from([1, 2, 4, 5]),
)
def test_compact_indices_equal_the_dense_mask(data, batch, heads, q_len, kv_len, q_block, kv_block):
    """FA4 reads a row's first ``cnt`` entries: the compact tensors (last dimension the
    longest count) and the compact tile lookup give the same mask."""
    n = max(q_len, kv_len)
    mask, dense = data.draw(expressions(batch, heads, n, max_leaves=3))
    mask, dense = data.draw(maybe_selected(batch, n, mask, dense))
    f = to_fa4(mask, batch, heads, q_len, kv_len, q_block=q_block, kv_block=kv_block, compact=True)
    for cnt, idx in (
        (f.mask_block_cnt, f.mask_block_idx),
        (f.full_block_cnt, f.full_block_idx),
        (f.mask_block_cnt_bwd, f.mask_block_idx_bwd),
        (f.full_block_cnt_bwd, f.full_block_idx_bwd),
    ):
        assert idx.shape[:3] == cnt.shape and idx.shape[3] == max(int(cnt.max()), 1)
    np.testing.assert_array_equal(
        fa4_dense(f, batch, heads), dense(n, n)[:, :, :q_len, :kv_len], str(mask)
    )


def test_compact_indices_of_a_window_grow_with_the_window():
    """A sliding window over 16k tokens: the compact tensors hold O(N * w) entries, the
    dense ones O(N^2); the tile lookup is compact too."""
    mask = flexmask.causal() & flexmask.sliding_window(1024)
    dense = to_fa4(mask, 1, 1, 16384, q_block=256, kv_block=128)
    compact = to_fa4(mask, 1, 1, 16384, q_block=256, kv_block=128, compact=True)
    assert dense.mask_block_idx.shape == (1, 1, 64, 128)
    assert compact.mask_block_idx.shape[-1] <= 4 and compact.full_block_idx.shape[-1] <= 8
    # Tile numbers from a row's first partial block to its last: the window's width.
    assert compact.aux_tensors[0].shape[-1] <= 1024 // 128 + 2
    assert torch.equal(compact.mask_block_cnt, dense.mask_block_cnt)
    width = compact.mask_block_idx.shape[-1]
    assert torch.equal(compact.mask_block_idx, dense.mask_block_idx[..., :width])


@pytest.mark.gpu
def test_fa4_varlen_kernel_matches_the_reference_attention():
    """The real kernel (flash_attn.cute's varlen forward, Blackwell/Hopper) on the packed
    tokens with these arguments, unpacked, against the float64 reference on the dense mask."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cute = pytest.importorskip("flash_attn.cute")
    batch, heads, length, dim = 2, 2, 1000, 64
    mask = (flexmask.causal() & flexmask.sliding_window(300)) & flexmask.document(
        [[300, 650, 50], [1000]]
    )
    block = (256, 128) if torch.cuda.get_device_capability()[0] >= 10 else (128, 128)
    f = to_fa4_varlen(
        mask, batch, heads, length, q_block=block[0], kv_block=block[1], device="cuda"
    )
    q, k, v = (
        torch.randn(batch, length, heads, dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    out = cute.flash_attn_varlen_func(f.pack_q(q), f.pack_k(k), f.pack_k(v), **f.kwargs())
    out = f.unpack(out[0] if isinstance(out, tuple) else out)
    ref, _ = oracle.attention(
        *(t.transpose(1, 2).cpu() for t in (q, k, v)), mask.to_dense(batch, heads, length, length)
    )
    torch.testing.assert_close(out.float().cpu(), ref.transpose(1, 2).float(), atol=2e-2, rtol=2e-2)
