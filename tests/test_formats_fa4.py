"""``to_fa4`` is exact: FlashAttention-4's block-sparse semantics, written plainly below from
flash-attn's ``flash_attn/cute`` (``block_sparsity.py``: ``BlockSparseTensorsTorch``; the
mask_mods of ``tests/cute/mask_mod_definitions.py``: ``(batch, head, m_idx, n_idx,
seqlen_info, aux_tensors)``), give back the mask's dense form on random masks.

FA4's forward, per (batch, head, query block m): the first ``mask_block_cnt`` entries of
``mask_block_idx`` are key blocks masked elementwise by ``mask_mod``, the first
``full_block_cnt`` of ``full_block_idx`` are attended whole, every other key block is skipped.
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
from flexmask.formats import FA4Mask, to_fa4
from tests.strategies import expressions

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fa4_dense(f: FA4Mask, batch: int, heads: int) -> np.ndarray:
    """(B, H, Q, KV) as FA4's forward masks: listed partial blocks through ``mask_mod`` in
    FA4's calling convention, listed full blocks whole, unlisted blocks skipped."""
    q_len, kv_len = f.seq_lengths
    q_block, kv_block = f.block_size
    out = np.zeros((batch, heads, q_len, kv_len), dtype=bool)
    for b in range(batch):
        for h in range(heads):
            bb = b if f.mask_block_cnt.shape[0] > 1 else 0
            hh = h if f.mask_block_cnt.shape[1] > 1 else 0
            for m in range(f.mask_block_cnt.shape[2]):
                q0, q1 = m * q_block, min((m + 1) * q_block, q_len)
                partial = f.mask_block_idx[bb, hh, m, : int(f.mask_block_cnt[bb, hh, m])]
                full = f.full_block_idx[bb, hh, m, : int(f.full_block_cnt[bb, hh, m])]
                assert not set(partial.tolist()) & set(full.tolist()), "a block listed twice"
                for n in full.tolist():
                    out[b, h, q0:q1, n * kv_block : min((n + 1) * kv_block, kv_len)] = True
                for n in partial.tolist():
                    k0, k1 = n * kv_block, min((n + 1) * kv_block, kv_len)
                    m_idx = torch.arange(q0, q1).view(-1, 1)
                    n_idx = torch.arange(k0, k1).view(1, -1)
                    shape = (q1 - q0, k1 - k0)
                    batch_idx = torch.full(shape, b)
                    head_idx = torch.full(shape, h)
                    bits = f.mask_mod(
                        batch_idx,
                        head_idx,
                        m_idx.expand(shape),
                        n_idx.expand(shape),
                        None,
                        list(f.aux_tensors),
                    )
                    out[b, h, q0:q1, k0:k1] = bits.numpy()
    return out


def check_layout(f: FA4Mask, batch: int, heads: int) -> None:
    q_len, kv_len = f.seq_lengths
    m_blocks, n_blocks = -(-q_len // f.block_size[0]), -(-kv_len // f.block_size[1])
    for name in ("mask_block", "full_block"):
        cnt, idx = getattr(f, name + "_cnt"), getattr(f, name + "_idx")
        assert cnt.dtype == idx.dtype == torch.int32
        assert tuple(cnt.shape) == (batch, heads, m_blocks)
        assert tuple(idx.shape) == (batch, heads, m_blocks, n_blocks)
        assert int(cnt.min()) >= 0 and int(cnt.max()) <= n_blocks
        cnt, idx = getattr(f, name + "_cnt_bwd"), getattr(f, name + "_idx_bwd")
        assert tuple(cnt.shape) == (batch, heads, n_blocks)
        assert tuple(idx.shape) == (batch, heads, n_blocks, m_blocks)


def bwd_codes(f: FA4Mask) -> torch.Tensor:
    """The (B, H, m, n) blocks the backward lists (1 partial, 2 full), from the q side."""
    batch, heads, n_blocks = f.mask_block_cnt_bwd.shape
    m_blocks = f.mask_block_idx_bwd.shape[-1]
    codes = torch.zeros(batch, heads, m_blocks, n_blocks, dtype=torch.int8)
    for code, (cnt, idx) in (
        (1, (f.mask_block_cnt_bwd, f.mask_block_idx_bwd)),
        (2, (f.full_block_cnt_bwd, f.full_block_idx_bwd)),
    ):
        for b in range(batch):
            for h in range(heads):
                for n in range(n_blocks):
                    for m in idx[b, h, n, : int(cnt[b, h, n])].tolist():
                        codes[b, h, m, n] = code
    return codes


def fwd_codes(f: FA4Mask) -> torch.Tensor:
    batch, heads, m_blocks = f.mask_block_cnt.shape
    n_blocks = f.mask_block_idx.shape[-1]
    codes = torch.zeros(batch, heads, m_blocks, n_blocks, dtype=torch.int8)
    for code, (cnt, idx) in (
        (1, (f.mask_block_cnt, f.mask_block_idx)),
        (2, (f.full_block_cnt, f.full_block_idx)),
    ):
        for b in range(batch):
            for h in range(heads):
                for m in range(m_blocks):
                    for n in idx[b, h, m, : int(cnt[b, h, m])].tolist():
                        codes[b, h, m, n] = code
    return codes


@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.sampled_from([1, 2, 4]),
    q_len=st.integers(1, 23),
    kv_len=st.integers(1, 23),
    q_block=st.sampled_from([1, 2, 3, 4, 8, 16]),
    kv_block=st.sampled_from([1, 2, 4, 5, 8]),
)
def test_fa4_equals_the_dense_mask(data, batch, heads, q_len, kv_len, q_block, kv_block):
    if data.draw(st.booleans()):
        kv_len = q_len
    n = max(q_len, kv_len)
    mask, dense = data.draw(expressions(batch, heads, n, max_leaves=3))
    f = to_fa4(mask, batch, heads, q_len, kv_len, q_block=q_block, kv_block=kv_block)
    check_layout(f, batch, heads)
    want = mask.to_dense(batch, heads, q_len, kv_len).numpy()
    np.testing.assert_array_equal(want, dense(n, n)[:, :, :q_len, :kv_len], str(mask))
    np.testing.assert_array_equal(fa4_dense(f, batch, heads), want, str(mask))
    # The backward lists the same blocks, from the key side.
    assert torch.equal(bwd_codes(f), fwd_codes(f))


@pytest.mark.parametrize("block", [(256, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize(
    "mask",
    [
        flexmask.causal(),
        flexmask.causal() & flexmask.document([[300, 200, 9], [100, 409]]),
        flexmask.sliding_window(100),
        ~flexmask.causal(),
        flexmask.tree([-1, 0, 1, 2, 2, 4, 2, 6] * 60 + [-1] * 29),
        flexmask.empty(),
    ],
    ids=["causal", "documents", "window", "negation", "tree", "empty"],
)
def test_fa4_rectangular_blocks_equal_the_structural_build(mask, block):
    """Blackwell's (256, 128) and others: the lists are flexmask's BlockMask at that shape,
    exact at lengths that are not multiples of either block."""
    batch, heads, q_len, kv_len = 2, 2, 509, 509
    f = to_fa4(mask, batch, heads, q_len, kv_len, q_block=block[0], kv_block=block[1])
    check_layout(f, batch, heads)
    bm = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, BLOCK_SIZE=block)
    assert torch.equal(f.mask_block_cnt, bm.kv_num_blocks.int())
    assert torch.equal(f.mask_block_idx, bm.kv_indices.int())
    np.testing.assert_array_equal(
        fa4_dense(f, batch, heads), mask.to_dense(batch, heads, q_len, kv_len).numpy()
    )
    # Only partial blocks carry bits: one tile each, never Q_LEN x KV_LEN.
    assert f.aux_tensors[1].shape == (1 + int(f.mask_block_cnt.sum()), *block)


def test_rows_that_attend_nothing_list_no_block():
    mask = flexmask.causal() & flexmask.padding([5, 0])
    f = to_fa4(mask, 2, 1, 12, 12, q_block=4, kv_block=4)
    assert int(f.mask_block_cnt[1].sum()) == int(f.full_block_cnt[1].sum()) == 0
    assert int(f.mask_block_cnt[0].sum()) + int(f.full_block_cnt[0].sum()) > 0
    np.testing.assert_array_equal(fa4_dense(f, 2, 1), mask.to_dense(2, 1, 12, 12).numpy())


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="flexmask Mask"):
        to_fa4(lambda b, h, q, kv: q >= kv, 1, 1, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="q_block"):
        to_fa4(flexmask.causal(), 1, 1, 8, q_block=0)


def test_kwargs_are_fa4s_keywords(monkeypatch):
    """kwargs() wraps the tensors in FA4's own BlockSparseTensorsTorch (a stand-in here)."""
    f = to_fa4(flexmask.causal(), 1, 2, 300, q_block=256, kv_block=128)
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
        "block_sparse_tensors",
        "block_sparse_tensors_bwd",
        "mask_mod",
        "aux_tensors",
    }
    fwd = kwargs["block_sparse_tensors"]
    assert fwd["block_size"] == (256, 128)
    assert fwd["mask_block_cnt"] is f.mask_block_cnt and fwd["full_block_idx"] is f.full_block_idx
    assert kwargs["block_sparse_tensors_bwd"]["mask_block_idx"] is f.mask_block_idx_bwd
    assert kwargs["mask_mod"] == f.mask_mod
    assert all(a is b for a, b in zip(kwargs["aux_tensors"], f.aux_tensors, strict=True))


@pytest.mark.gpu
def test_fa4_kernel_matches_dense_attention():
    """The real kernel (flash_attn.cute, Blackwell/Hopper) with these arguments against SDPA
    with the dense mask."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cute = pytest.importorskip("flash_attn.cute")
    batch, heads, length, dim = 2, 2, 1000, 64
    mask = flexmask.causal() & flexmask.document([[300, 700], [1000]])
    f = to_fa4(mask, batch, heads, length, device="cuda")
    q, k, v = (
        torch.randn(batch, length, heads, dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    out = cute.flash_attn_func(q, k, v, **f.kwargs())
    out = out[0] if isinstance(out, tuple) else out
    dense = mask.to_dense(batch, heads, length, length, device="cuda")
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).float() for t in (q, k, v)), attn_mask=dense
    ).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# Documents of 6 tokens in row 0, one of 12 in row 1: at blocks of 6 (or 12, or 1) every tile
# is full or empty, so FA4's lists name no partial block and mask_mod is never read.
_DOCS = torch.tensor([[0] * 6 + [1] * 6, [0] * 12])


def _docs_by_row(b, h, q_idx, kv_idx):
    return _DOCS[b, q_idx] == _DOCS[b, kv_idx]


@pytest.mark.parametrize("block", [(6, 6), (3, 6), (6, 2), (1, 1)])
@pytest.mark.parametrize(
    "mask",
    [
        flexmask.from_mask_mod(_docs_by_row, key="fa4 docs by row"),
        flexmask.from_mask_mod(_docs_by_row, key="fa4 docs by row, once", head_dependent=False),
        flexmask.full(),
        flexmask.document([[6, 6], [12]]),
    ],
    ids=["mask_mod by row", "mask_mod, heads broadcast", "full", "documents"],
)
def test_no_partial_tile_lists_full_and_empty_blocks_only(mask, block):
    """A user mask_mod that reads its row (vmapped) raised IndexError at 13fda44 when no tile
    was partial. The reference is written from the documents, not from flexmask."""
    batch, heads, length = 2, 2, 12
    f = to_fa4(mask, batch, heads, length, length, q_block=block[0], kv_block=block[1])
    check_layout(f, batch, heads)
    if isinstance(mask, type(flexmask.full())):
        want = np.ones((batch, heads, length, length), dtype=bool)
    else:
        docs = _DOCS.numpy()
        want = np.broadcast_to(
            (docs[:, None, :, None] == docs[:, None, None, :]), (batch, heads, length, length)
        )
    np.testing.assert_array_equal(fa4_dense(f, batch, heads), want)
    assert int(f.mask_block_cnt.sum()) == int(f.mask_block_cnt_bwd.sum()) == 0
    assert torch.equal(bwd_codes(f), fwd_codes(f))
    # Tile 0 only: what FA4's mask_mod would read for an unlisted block, attending nothing.
    assert f.aux_tensors[1].shape == (1, *block) and not bool(f.aux_tensors[1].any())
    assert not bool(f.aux_tensors[0].any())
