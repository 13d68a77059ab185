"""The grouped kernel's shortcuts against a dense reference: a q block whose kv blocks are
one run is read and written through views (also with inputs laid out (B, S, H, D) and then
transposed, as models hold them, and with GQA), and only the runs of columns that need a
mask are masked (a document's first and last block, not the full ones between)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexmask.backends.block_sparse import kernel
from flexmask.backends.block_sparse.api import block_sparse_attention
from tests import oracle


def long_documents(b, h, q_idx, kv_idx):
    # Documents of 150 and 170 tokens over blocks of 16: each row's first and last kv
    # blocks are partial, the ones between full.
    doc_q, doc_kv = (q_idx >= 150).long(), (kv_idx >= 150).long()
    return (doc_q == doc_kv) & (q_idx >= kv_idx)


def transposed_qkv(batch, q_heads, kv_heads, seq_len, seed=0):
    """q, k, v made (B, S, H, D) and transposed to (B, H, S, D): not contiguous."""
    generator = torch.Generator().manual_seed(seed)

    def randn(heads, dim):
        made = torch.randn(batch, seq_len, heads, dim, generator=generator, dtype=torch.float64)
        return made.requires_grad_()

    q, k, v = randn(q_heads, 16), randn(kv_heads, 16), randn(kv_heads, 16)
    grad_out = torch.randn(batch, q_heads, seq_len, 16, generator=generator, dtype=torch.float64)
    return (q, k, v), grad_out


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (4, 2)])
@pytest.mark.parametrize("max_chunk_elements", [1 << 20, 16 * 16 * 10])
def test_views_and_mask_runs_equal_the_dense_reference(
    monkeypatch, q_heads, kv_heads, max_chunk_elements
):
    seq_len = 320
    block_mask = create_block_mask(
        long_documents, None, None, seq_len, seq_len, device="cpu", BLOCK_SIZE=16
    )
    made = []
    make_groups = kernel.make_groups
    monkeypatch.setattr(kernel, "make_groups", lambda *a: made.extend(make_groups(*a)) or made)
    leaves, grad_out = transposed_qkv(2, q_heads, kv_heads, seq_len)
    q, k, v = (t.transpose(1, 2) for t in leaves)
    assert not q.is_contiguous()
    out = block_sparse_attention(
        q,
        k,
        v,
        block_mask,
        enable_gqa=q_heads != kv_heads,
        backend="sparse",
        max_chunk_elements=max_chunk_elements,
    )
    # The shortcuts were taken: groups of one q block on views, rows with two mask runs.
    assert any(g.single is not None for g in made)
    assert any(len(g.mask_spans) >= 2 for g in made)
    dense = oracle.block_mask_meaning(block_mask, 2, q_heads, seq_len, seq_len)
    expected, _ = oracle.attention(q, k, v, dense)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    got = torch.autograd.grad(out, leaves, grad_out)
    want = torch.autograd.grad(expected, leaves, grad_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)
