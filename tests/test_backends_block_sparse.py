"""block_sparse_attention against independent oracles.

Oracles, none of which share code with the module under test:

* ``scaled_dot_product_attention`` with a dense bool mask from torch's ``create_mask`` (vmap
  evaluation of the mask_mod), for outputs and gradients. SDPA's answer for a row with no
  allowed key is backend-dependent (NaN on the math path, 0 on CPU flash), so the oracle lets
  such rows attend everywhere and then multiplies them by 0: value 0 and gradient 0, which is
  what flex defines.
* torch's ``flex_attention`` forward on CPU (eager), for outputs and the logsumexp.
* a dense mask assembled block by block with Python loops from a BlockMask's lists, for the
  tests where block structure and mask_mod disagree (full blocks, unlisted blocks).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    create_mask,
    flex_attention,
)

import flexmask
from flexmask.backends import threads as block_sparse_threads
from flexmask.backends.block_sparse import kernel
from flexmask.backends.block_sparse.api import block_sparse_attention
from flexmask.backends.dense import choose_backend
from flexmask.backends.plan import make_plan
from tests import oracle

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:return_lse is deprecated"),
]


# --- attn-gym style mask_mods: lookups built outside, bodies are indexing and comparisons ----


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window_size):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window_size)

    return sliding_window


def generate_prefix_lm(prefix_length):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (q_idx >= kv_idx)

    return prefix_lm


def generate_doc_causal(document_id):
    # document_id has exactly one entry per token: the kernel must clamp padding indices.
    def doc_causal(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    return doc_causal


def document_ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def generate_per_batch_head(kv_lengths, windows):
    """Batch b sees keys below kv_lengths[b]; head h sees a window of windows[h] around q."""

    def per_batch_head(b, h, q_idx, kv_idx):
        return (kv_idx < kv_lengths[b]) & ((q_idx - kv_idx).abs() <= windows[h])

    return per_batch_head


def generate_with_empty_rows(q_len):
    # Every 7th query row and a whole stretch of q blocks see nothing.
    def with_empty_rows(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx % 7 != 3) & ((q_idx < 40) | (q_idx >= 90))

    return with_empty_rows


def generate_table(table):
    def from_table(b, h, q_idx, kv_idx):
        return table[b, h, q_idx, kv_idx]

    return from_table


# --- oracles ---------------------------------------------------------------------------------


def sdpa_oracle(q, k, v, mask, scale=None):
    """SDPA output with flex's convention for empty rows: output 0, gradient 0."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    has_key = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, scale=scale)
    return out * has_key


def flex_forward(q, k, v, block_mask, **kwargs):
    """flex_attention's CPU forward, eager (no compile: same math, no per-case compile cost)."""
    previous = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        return flex_attention(
            q.detach(), k.detach(), v.detach(), block_mask=block_mask, return_lse=True, **kwargs
        )
    finally:
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = previous


def random_qkv(batch, q_heads, kv_heads, q_len, kv_len, dtype=torch.float64, head_dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    q = randn(batch, q_heads, q_len, head_dim)
    k = randn(batch, kv_heads, kv_len, head_dim)
    v = randn(batch, kv_heads, kv_len, head_dim + 2)  # Dv != D on purpose
    grad_out = torch.randn(batch, q_heads, q_len, head_dim + 2, generator=generator, dtype=dtype)
    return q, k, v, grad_out


def grads(out, grad_out, inputs):
    return torch.autograd.grad(out, inputs, grad_out)


def assert_matches_oracles(q, k, v, grad_out, block_mask, dense, atol, **kwargs):
    """Output, gradients and lse of the sparse kernel (with an lse gradient too), and output
    and gradients of the SDPA backend, against the dense oracles."""
    enable_gqa = q.size(1) != k.size(1)
    out, lse = block_sparse_attention(
        q, k, v, block_mask, enable_gqa=enable_gqa, return_lse=True, **kwargs
    )
    expected = sdpa_oracle(q, k, v, dense)
    torch.testing.assert_close(out, expected, atol=atol, rtol=0)
    retained = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    wanted = torch.autograd.grad(expected, (q, k, v), grad_out, retain_graph=True)
    for got, want in zip(retained, wanted, strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
    expected_lse = oracle.attention(q, k, v, dense)[1].to(q.dtype)
    torch.testing.assert_close(lse, expected_lse, atol=atol, rtol=0)
    # The lse is differentiable: a loss on both outputs, against the same loss on the oracles.
    lse_weight = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1), dtype=lse.dtype)

    def loss(o, lse_):
        return (o * grad_out).sum() + (lse_.masked_fill(lse_ == -math.inf, 0) * lse_weight).sum()

    for got, want in zip(
        torch.autograd.grad(loss(out, lse), (q, k, v)),
        torch.autograd.grad(loss(expected, expected_lse), (q, k, v), retain_graph=True),
        strict=True,
    ):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
    kwargs.pop("backend", None)
    by_sdpa = block_sparse_attention(
        q, k, v, block_mask, enable_gqa=enable_gqa, backend="sdpa", **kwargs
    )
    torch.testing.assert_close(by_sdpa, expected, atol=atol, rtol=0)
    for got, want in zip(
        grads(by_sdpa, grad_out, (q, k, v)), grads(expected, grad_out, (q, k, v)), strict=True
    ):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
    return out, lse


# --- named cases ----------------------------------------------------------------------------

# (name, mask_mod factory, B, Hq, Hkv, Q_LEN, KV_LEN, BLOCK_SIZE, mask per batch/head)
CASES = [
    ("causal", lambda q, kv: causal, 1, 1, 1, 300, 300, (128, 128), False),
    ("causal-64x32", lambda q, kv: causal, 2, 2, 2, 129, 129, (64, 32), False),
    ("causal-len1", lambda q, kv: causal, 1, 2, 2, 1, 1, (128, 128), False),
    ("causal-q>kv", lambda q, kv: causal, 1, 2, 2, 300, 129, (64, 32), False),
    ("causal-q<kv", lambda q, kv: causal, 2, 1, 1, 127, 300, (16, 16), False),
    (
        "document-gqa",
        lambda q, kv: generate_doc_causal(document_ids([50, 7, 130, 113])),
        2,
        4,
        2,
        300,
        300,
        (16, 16),
        False,
    ),
    (
        "document-127",
        lambda q, kv: generate_doc_causal(document_ids([1, 60, 66])),
        1,
        2,
        2,
        127,
        127,
        (32, 64),
        False,
    ),
    (
        "sliding-window",
        lambda q, kv: generate_sliding_window(24),
        1,
        2,
        2,
        129,
        129,
        (16, 16),
        False,
    ),
    ("prefix-lm", lambda q, kv: generate_prefix_lm(37), 2, 1, 1, 129, 129, (64, 32), False),
    (
        "per-batch-head-gqa",
        lambda q, kv: generate_per_batch_head(
            torch.tensor([300, 170]), torch.tensor([3, 20, 64, 500])
        ),
        2,
        4,
        2,
        127,
        300,
        (32, 64),
        True,
    ),
    (
        "per-batch-head",
        lambda q, kv: generate_per_batch_head(torch.tensor([100, 29]), torch.tensor([0, 9])),
        2,
        2,
        2,
        129,
        129,
        (16, 16),
        True,
    ),
    ("empty-rows", lambda q, kv: generate_with_empty_rows(q), 1, 2, 2, 129, 129, (16, 16), False),
    (
        "empty-rows-128",
        lambda q, kv: generate_with_empty_rows(q),
        2,
        1,
        1,
        300,
        300,
        (128, 128),
        False,
    ),
]


def build_case(case, dtype=torch.float64, seed=0):
    _, factory, batch, q_heads, kv_heads, q_len, kv_len, block_size, per_bh = case
    mask_mod = factory(q_len, kv_len)
    block_mask = create_block_mask(
        mask_mod,
        batch if per_bh else None,
        q_heads if per_bh else None,
        q_len,
        kv_len,
        device="cpu",
        BLOCK_SIZE=block_size,
    )
    dense = create_mask(mask_mod, batch, q_heads, q_len, kv_len, device="cpu")
    q, k, v, grad_out = random_qkv(batch, q_heads, kv_heads, q_len, kv_len, dtype, seed=seed)
    return block_mask, dense, q, k, v, grad_out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_sdpa_and_flex(case):
    block_mask, dense, q, k, v, grad_out = build_case(case)
    out, lse = assert_matches_oracles(q, k, v, grad_out, block_mask, dense, atol=1e-10)

    flex_out, flex_lse = flex_forward(q, k, v, block_mask, enable_gqa=q.size(1) != k.size(1))
    torch.testing.assert_close(out, flex_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, flex_lse, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", ["causal-64x32", "document-gqa", "per-batch-head-gqa"])
def test_float32(name):
    case = next(c for c in CASES if c[0] == name)
    block_mask, dense, q, k, v, grad_out = build_case(case, dtype=torch.float32)
    out, _ = assert_matches_oracles(q, k, v, grad_out, block_mask, dense, atol=1e-5)
    assert out.dtype == torch.float32


def test_flex_compiled_forward_agrees():
    """One case through flex's default CPU path (compiled), not only the eager debug path."""
    case = next(c for c in CASES if c[0] == "document-gqa")
    block_mask, _, q, k, v, _ = build_case(case)
    expected = flex_attention(
        q.detach(), k.detach(), v.detach(), block_mask=block_mask, enable_gqa=True
    )
    got = block_sparse_attention(q, k, v, block_mask, enable_gqa=True)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


def test_empty_rows_are_zero_with_zero_gradient():
    case = next(c for c in CASES if c[0] == "empty-rows")
    block_mask, dense, q, k, v, grad_out = build_case(case)
    out, lse = block_sparse_attention(q, k, v, block_mask, return_lse=True)
    dq, dk, dv = grads(out, grad_out, (q, k, v))
    empty = ~dense.any(-1)
    assert empty.any() and (~empty).any()
    assert (out[empty] == 0).all()
    assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    assert (dq[empty] == 0).all()
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize(
    ("max_chunk_elements", "recompute"),
    [(1, True), (1, False), (20_000, True), (1 << 22, False)],
)
def test_chunking_and_recompute_do_not_change_the_result(recompute, max_chunk_elements):
    case = next(c for c in CASES if c[0] == "document-gqa")
    block_mask, dense, q, k, v, grad_out = build_case(case)
    assert_matches_oracles(
        q,
        k,
        v,
        grad_out,
        block_mask,
        dense,
        atol=1e-10,
        recompute=recompute,
        max_chunk_elements=max_chunk_elements,
    )


def _widest_pair_chunk(block_mask, group):
    """Scores of one q block at its widest for one (batch row, kv head): the unit in which
    block_sparse_attention slices batch rows and kv heads."""
    listed = block_mask.to_dense().flatten(0, 1).bool().any(0)
    q_block, kv_block = block_mask.BLOCK_SIZE
    return group * q_block * int(listed.sum(-1).max()) * kv_block


@pytest.mark.parametrize("pairs", [1, 2, 3, 5])
@pytest.mark.parametrize("name", ["per-batch-head-gqa", "per-batch-head"])
def test_batch_and_head_slices_equal_the_oracle(monkeypatch, name, pairs):
    """Where one q block over every batch row and head would exceed max_chunk_elements, its
    groups run ``pairs`` (batch row, kv head) pairs each (a part of the heads, or whole
    rows): a mask that differs per batch row and head, GQA, and Q_LEN != KV_LEN give the
    oracle's output, lse and gradients, and every pair of every wide q block is run once."""
    case = next(c for c in CASES if c[0] == name)
    block_mask, dense, q, k, v, grad_out = build_case(case)
    group = q.size(1) // k.size(1)
    made = []
    make_groups = kernel.make_groups
    monkeypatch.setattr(kernel, "make_groups", lambda *a: made.extend(make_groups(*a)) or made)
    assert_matches_oracles(
        q,
        k,
        v,
        grad_out,
        block_mask,
        dense,
        atol=1e-10,
        backend="sparse",
        max_chunk_elements=pairs * _widest_pair_chunk(block_mask, group),
    )
    batch, kv_heads = q.size(0), k.size(1)
    widest = max(g.columns.size(1) for g in made)
    runs: dict[int, list[int]] = {}
    for g in made:
        if g.columns.size(1) == widest:
            for block in g.blocks.tolist():
                runs.setdefault(block, []).extend(range(*g.pairs))
            assert g.pairs[1] - g.pairs[0] <= pairs
    assert runs and all(sorted(r) == list(range(batch * kv_heads)) for r in runs.values())
    split = any(g.pairs != (0, batch * kv_heads) for g in made)
    assert split == (pairs < batch * kv_heads)


def test_batch_slices_read_each_rows_intervals():
    """A flexmask mask with other documents on each batch row (intervals per row, no
    mask_mod call) sliced one row at a time equals the dense oracle."""
    lengths = [[50, 7, 130, 113], [300], [1, 1, 298]]
    mask = flexmask.causal() & flexmask.document(lengths)
    block_mask = flexmask.create_block_mask(mask, 3, 1, 300, 300, "cpu", BLOCK_SIZE=32)
    dense = create_mask(mask.mask_mod, 3, 1, 300, 300, device="cpu")
    q, k, v, grad_out = random_qkv(3, 2, 2, 300, 300)
    assert_matches_oracles(
        q,
        k,
        v,
        grad_out,
        block_mask,
        dense,
        atol=1e-10,
        backend="sparse",
        mask=mask,
        max_chunk_elements=_widest_pair_chunk(block_mask, 1),
    )


def test_mask_broadcast_over_batch_and_heads_equals_per_head_mask():
    mask_mod = generate_doc_causal(document_ids([40, 89]))
    q, k, v, _ = random_qkv(2, 3, 3, 129, 129)
    shared = create_block_mask(mask_mod, None, None, 129, 129, device="cpu", BLOCK_SIZE=32)
    per_head = create_block_mask(mask_mod, 2, 3, 129, 129, device="cpu", BLOCK_SIZE=32)
    torch.testing.assert_close(
        block_sparse_attention(q, k, v, shared), block_sparse_attention(q, k, v, per_head)
    )


def test_partial_blocks_are_masked_by_mask_mod():
    """With separate_full_blocks=False every block is partial: mask_mod must decide it all."""
    mask_mod = generate_sliding_window(40)
    block_mask = create_block_mask(
        mask_mod, None, None, 129, 129, device="cpu", BLOCK_SIZE=32, separate_full_blocks=False
    )
    assert block_mask.full_kv_num_blocks is None
    q, k, v, grad_out = random_qkv(1, 2, 2, 129, 129)
    dense = create_mask(mask_mod, 1, 2, 129, 129, device="cpu")
    assert_matches_oracles(q, k, v, grad_out, block_mask, dense, atol=1e-10)


def test_full_blocks_skip_mask_mod():
    """Blocks declared full are attended entirely, whatever mask_mod says there."""
    q_len = kv_len = 96
    block_mask = create_block_mask(causal, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=32)
    # Move the diagonal (partial) blocks into the full lists: causal's upper triangles inside
    # them must now be attended.
    dense_blocks = block_mask.to_dense()[0, 0]
    diagonal = torch.eye(3, dtype=torch.bool)
    partial = torch.zeros_like(dense_blocks)
    full = dense_blocks.bool() | diagonal

    def ordered(blocks):
        num = blocks.sum(-1).int()[None, None]
        idx = torch.argsort(blocks.int(), dim=-1, descending=True, stable=True).int()[None, None]
        return num, idx

    declared = BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=32,
        mask_mod=causal,
        seq_lengths=(q_len, kv_len),
    )
    dense = oracle.block_mask_meaning(declared, 1, 2, q_len, kv_len)
    assert dense[0, 0, 0, 31] and not causal(0, 0, torch.tensor(0), torch.tensor(31))
    q, k, v, grad_out = random_qkv(1, 2, 2, q_len, kv_len)
    assert_matches_oracles(q, k, v, grad_out, declared, dense, atol=1e-10)


def test_unlisted_blocks_are_skipped_even_where_mask_mod_allows():
    q_len, kv_len = 70, 90
    num = torch.tensor([[[1, 0, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[2, 0, 0], [0, 0, 0], [0, 1, 0]]]], dtype=torch.int32)
    block_mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=32, seq_lengths=(q_len, kv_len))
    dense = oracle.block_mask_meaning(block_mask, 1, 1, q_len, kv_len)
    assert not dense[:, :, 32:64].any()  # the middle q block lists nothing
    q, k, v, grad_out = random_qkv(1, 1, 1, q_len, kv_len)
    assert_matches_oracles(q, k, v, grad_out, block_mask, dense, atol=1e-10)


def test_kv_blocks_far_apart_are_gathered():
    """Columns that are not one contiguous run take the gather path instead of a slice."""
    from flexmask.backends.block_sparse.score_mod import plan_chunks

    def sink_and_recent(b, h, q_idx, kv_idx):  # attention sinks plus a causal local window
        return (kv_idx < 16) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 16))

    block_mask = create_block_mask(
        sink_and_recent, None, None, 200, 200, device="cpu", BLOCK_SIZE=16
    )
    q, k, v, grad_out = random_qkv(2, 2, 2, 200, 200)
    plan = make_plan(q, k, v, block_mask, None, None, False, "auto")
    assert any(c.first_column is None for c in plan_chunks(plan, 1 << 22))  # score_mod path
    layout = kernel.Layout(2, 2, 1, 200, 200, 16, 16, 1.0, torch.float64)
    groups = kernel.make_groups(plan.kinds, layout, 1 << 22)
    assert any(bool((g.columns.diff(dim=-1) > 1).any()) for g in groups)  # grouped kernel
    dense = create_mask(sink_and_recent, 2, 2, 200, 200, device="cpu")
    assert_matches_oracles(q, k, v, grad_out, block_mask, dense, atol=1e-10)


# --- mods that only work under vmap, and score_mod ------------------------------------------


def causal_by_stack(b, h, q_idx, kv_idx):
    # torch.stack needs equal shapes: fine on vmap's scalars, an error on broadcast indices.
    return torch.stack([q_idx, kv_idx]).diff(dim=0).squeeze(0) <= 0


def test_vmap_only_mask_mod_falls_back_to_vmap():
    block_mask = create_block_mask(
        causal_by_stack, None, None, 129, 129, device="cpu", BLOCK_SIZE=32
    )
    q, k, v, grad_out = random_qkv(2, 2, 2, 129, 129)
    dense = create_mask(causal, 2, 2, 129, 129, device="cpu")
    assert_matches_oracles(q, k, v, grad_out, block_mask, dense, atol=1e-10)
    with pytest.raises(RuntimeError):
        block_sparse_attention(q, k, v, block_mask, mod_eval="broadcast", backend="sparse")


def test_broadcast_and_vmap_evaluation_agree():
    case = next(c for c in CASES if c[0] == "per-batch-head-gqa")
    block_mask, _, q, k, v, grad_out = build_case(case)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    results = []
    for mod_eval in ("broadcast", "vmap"):
        out = block_sparse_attention(q, k, v, block_mask, alibi, enable_gqa=True, mod_eval=mod_eval)
        results.append((out, *grads(out, grad_out, (q, k, v))))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mod_eval", ["auto", "vmap"])
def test_score_mod_matches_flex_and_dense(mod_eval):
    case = next(c for c in CASES if c[0] == "document-gqa")
    block_mask, dense, q, k, v, grad_out = build_case(case)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)

    def alibi_and_drop(score, b, h, q_idx, kv_idx):
        # Query rows 5 and 6 get -inf everywhere from score_mod: flex returns 0 for them.
        dropped = (q_idx == 5) | (q_idx == 6)
        return torch.where(dropped, -math.inf, score - slopes[h] * (q_idx - kv_idx))

    out = block_sparse_attention(
        q, k, v, block_mask, alibi_and_drop, enable_gqa=True, mod_eval=mod_eval
    )
    flex_out, _ = flex_forward(q, k, v, block_mask, score_mod=alibi_and_drop, enable_gqa=True)
    torch.testing.assert_close(out, flex_out, atol=1e-10, rtol=0)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    # Rows of -inf scores attend nothing (flex's rule): the reference is told so by the mask.
    dropped = torch.zeros(300, 1, dtype=torch.bool)
    dropped[5:7] = True
    expected = oracle.attention(q, k, v, dense & ~dropped, score_mod=alibi)[0]
    assert (out[:, :, 5:7] == 0).all()
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    for got, want in zip(
        grads(out, grad_out, (q, k, v)), grads(expected, grad_out, (q, k, v)), strict=True
    ):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_soft_capping_score_mod_gradients():
    """tanh saves its output for the backward: masking must not write into it in place."""
    block_mask = create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    q, k, v, grad_out = random_qkv(1, 2, 2, 256, 256)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return 0.5 * torch.tanh(score / 0.5)

    dense = create_mask(causal, 1, 2, 256, 256, device="cpu")
    expected = oracle.attention(q, k, v, dense, score_mod=soft_cap)[0]
    # One q block per chunk: every slot is in use, so only mask_mod's in-place fill masks.
    out = block_sparse_attention(q, k, v, block_mask, soft_cap, max_chunk_elements=1)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    for got, want in zip(
        grads(out, grad_out, (q, k, v)), grads(expected, grad_out, (q, k, v)), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_scale_and_no_grad_and_low_precision():
    case = next(c for c in CASES if c[0] == "causal-64x32")
    block_mask, dense, q, k, v, _ = build_case(case)
    out = block_sparse_attention(q, k, v, block_mask, scale=0.3)
    expected = sdpa_oracle(q, k, v, dense, scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(block_sparse_attention(q, k, v, block_mask, scale=0.3), out)
    low = block_sparse_attention(
        *(t.detach().to(torch.bfloat16) for t in (q, k, v)), block_mask, scale=0.3
    )
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), expected, atol=5e-2, rtol=0)


# --- random cases ---------------------------------------------------------------------------

BLOCK_SIZES = [(16, 16), (32, 64), (64, 32), (128, 128)]


@settings(max_examples=15, deadline=None)
@given(
    q_len=st.integers(1, 300),
    kv_len=st.integers(1, 300),
    block_size=st.sampled_from(BLOCK_SIZES),
    heads=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2)]),
    batch=st.integers(1, 2),
    density=st.sampled_from([0.02, 0.3, 0.9]),
    structured=st.booleans(),
    per_bh=st.booleans(),
    max_chunk_elements=st.sampled_from([1, 20_000, 1 << 22]),
    recompute=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_masks_match_sdpa(
    q_len,
    kv_len,
    block_size,
    heads,
    batch,
    density,
    structured,
    per_bh,
    max_chunk_elements,
    recompute,
    seed,
):
    q_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    table = torch.rand(batch, q_heads, q_len, kv_len, generator=generator) < density
    if structured:  # random documents and a window on top, so some blocks come out full
        doc = torch.randint(0, 3, (max(q_len, kv_len),), generator=generator).cumsum(0)
        window = int(torch.randint(1, 200, (), generator=generator))
        pos_q, pos_kv = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
        table |= (doc[:q_len, None] == doc[None, :kv_len]) & ((pos_q - pos_kv).abs() < window)
    mask_mod = generate_table(table if per_bh else table[:1, :1].expand_as(table))
    block_mask = create_block_mask(
        mask_mod,
        batch if per_bh else None,
        q_heads if per_bh else None,
        q_len,
        kv_len,
        device="cpu",
        BLOCK_SIZE=block_size,
    )
    dense = table if per_bh else table[:1, :1].expand_as(table)
    q, k, v, grad_out = random_qkv(batch, q_heads, kv_heads, q_len, kv_len, seed=seed)
    assert_matches_oracles(
        q,
        k,
        v,
        grad_out,
        block_mask,
        dense,
        atol=1e-10,
        max_chunk_elements=max_chunk_elements,
        recompute=recompute,
    )


# --- memory ---------------------------------------------------------------------------------


def _peak_extra_bytes():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "_memory.py"
    spec = importlib.util.spec_from_file_location("_flexmask_bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.peak_extra_bytes


def test_memory_scales_with_active_blocks_not_seq_len_squared():
    seq_len, window = 2048, 64
    # Built by hand (create_block_mask would evaluate all S x S pairs): with blocks as wide as
    # the window, q block i needs kv blocks i - 1 and i.
    rows = torch.arange(seq_len // window)
    kv_indices = torch.zeros(rows.numel(), rows.numel(), dtype=torch.long)  # BlockMask's layout
    kv_indices[:, 0] = (rows - 1).clamp(min=0)
    kv_indices[1:, 1] = rows[1:]
    kv_num_blocks = torch.full_like(rows, 2)
    kv_num_blocks[0] = 1
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks.int()[None, None],
        kv_indices.int()[None, None],
        BLOCK_SIZE=window,
        mask_mod=generate_sliding_window(window),
        seq_lengths=(seq_len, seq_len),
    )
    q, k, v = (torch.randn(1, 1, seq_len, 16, requires_grad=True) for _ in range(3))
    peak_extra_bytes = _peak_extra_bytes()

    def peak(recompute):
        def forward_backward():
            block_sparse_attention(q, k, v, block_mask, recompute=recompute).sum().backward()

        return peak_extra_bytes(forward_backward)[0]

    dense_scores = seq_len * seq_len * 4
    kept, recomputed = peak(recompute=False), peak(recompute=True)
    assert kept < dense_scores / 2, f"peak {kept / 2**20:.1f} MiB"
    # With recompute only the inputs' gradients and one chunk are ever alive.
    assert recomputed < min(kept, dense_scores / 8), f"peak {recomputed / 2**20:.1f} MiB"


# --- validation -----------------------------------------------------------------------------


def _valid_inputs():
    q, k, v, _ = random_qkv(1, 2, 2, 40, 50, dtype=torch.float32)
    block_mask = create_block_mask(causal, None, None, 40, 50, device="cpu", BLOCK_SIZE=16)
    return dict(query=q, key=k, value=v, block_mask=block_mask)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            lambda a: a.update(query=a["query"].detach().numpy()),
            TypeError,
            "query must be a torch.Tensor",
        ),
        (lambda a: a.update(key=a["key"][0]), ValueError, "key must be 4-D"),
        (lambda a: a.update(value=a["value"].int()), TypeError, "value must have a floating"),
        (lambda a: a.update(key=a["key"].double()), TypeError, "key.dtype must equal"),
        (lambda a: a.update(key=a["key"][..., :4]), ValueError, "key's head_dim"),
        (lambda a: a.update(value=a["value"][:, :, :10]), ValueError, "value must have key's"),
        (lambda a: a.update(key=torch.cat([a["key"]] * 2)), ValueError, "batch size"),
        (
            lambda a: a.update(key=a["key"][:, :1], value=a["value"][:, :1]),
            ValueError,
            "enable_gqa=True",
        ),
        (
            lambda a: a.update(
                key=a["key"][:, :1].expand(1, 3, 50, 8),
                value=a["value"][:, :1].expand(1, 3, 50, 10),
                enable_gqa=True,
            ),
            ValueError,
            "multiple of",
        ),
        (lambda a: a.update(block_mask="causal"), TypeError, "block_mask must be a"),
        (lambda a: a.update(query=a["query"][:, :, :39]), ValueError, "block_mask was built for"),
        (lambda a: a.update(score_mod=3), TypeError, "score_mod must be callable"),
        (lambda a: a.update(scale="0.1"), TypeError, "scale must be a float"),
        (lambda a: a.update(mod_eval="jit"), ValueError, "mod_eval must be one of"),
        (lambda a: a.update(max_chunk_elements=0), ValueError, "max_chunk_elements must be >= 1"),
        (lambda a: a.update(threads=0), ValueError, "threads must be an int >= 1"),
        (lambda a: a.update(threads=2.0), ValueError, "threads must be an int >= 1"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, match):
    arguments = _valid_inputs()
    change(arguments)
    with pytest.raises(error, match=match):
        block_sparse_attention(**arguments)


def test_block_mask_with_too_many_heads_is_rejected():
    arguments = _valid_inputs()
    arguments["block_mask"] = create_block_mask(causal, 1, 3, 40, 50, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="batch and head dims must each be 1 or match"):
        block_sparse_attention(**arguments)


def test_mask_mod_must_return_bool():
    arguments = _valid_inputs()
    arguments["block_mask"] = BlockMask.from_kv_blocks(
        torch.ones(1, 1, 3, dtype=torch.int32),
        torch.zeros(1, 1, 3, 1, dtype=torch.int32),
        BLOCK_SIZE=16,
        mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx,
        seq_lengths=(40, 50),
    )
    with pytest.raises(TypeError, match="mask_mod must return a bool tensor"):
        block_sparse_attention(**arguments)


# --- memory budget, backend choice, return_lse and B=0 ---------------------------------------


@pytest.mark.parametrize("memory_budget", [0, 40_000, 1 << 30])
def test_memory_budget_keeps_some_groups_and_rebuilds_the_rest(memory_budget):
    case = next(c for c in CASES if c[0] == "document-gqa")
    block_mask, dense, q, k, v, grad_out = build_case(case)
    assert_matches_oracles(
        q,
        k,
        v,
        grad_out,
        block_mask,
        dense,
        atol=1e-10,
        memory_budget=memory_budget,
        max_chunk_elements=20_000,
    )


def test_backend_choice_follows_density_and_size():
    def choice(mask_mod, seq_len):
        block_mask = create_block_mask(mask_mod, None, None, seq_len, seq_len, device="cpu")
        q = k = v = torch.zeros(1, 1, seq_len, 8)
        return choose_backend(make_plan(q, k, v, block_mask, None, None, False, "auto"))

    lengths = [40] * 51 + [2048 - 40 * 51]
    assert choice(generate_doc_causal(document_ids(lengths)), 2048) == "sparse"
    assert choice(causal, 2048) == "sdpa"  # half the blocks: SDPA's fused kernel wins
    assert choice(generate_doc_causal(document_ids([10] * 20)), 200) == "sdpa"  # tiny


@pytest.mark.parametrize("backend", ["auto", "sparse", "sdpa"])
def test_every_backend_matches_the_oracle(backend):
    """A dense mask (causal) and a sparse one, each through every backend, float32."""
    for mask_mod in (causal, generate_doc_causal(document_ids([100, 300, 112]))):
        block_mask = create_block_mask(mask_mod, None, None, 512, 512, device="cpu", BLOCK_SIZE=64)
        q, k, v, grad_out = random_qkv(1, 2, 2, 512, 512, dtype=torch.float32)
        dense = create_mask(mask_mod, 1, 2, 512, 512, device="cpu")
        out = block_sparse_attention(q, k, v, block_mask, backend=backend)
        expected = sdpa_oracle(q, k, v, dense)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        for got, want in zip(
            grads(out, grad_out, (q, k, v)), grads(expected, grad_out, (q, k, v)), strict=True
        ):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_flexmask_flex_attention_returns_lse_like_torch():
    """return_lse on the CPU path: torch's shape, dtype and values, -inf where nothing is seen."""
    case = next(c for c in CASES if c[0] == "empty-rows")
    block_mask, dense, q, k, v, _ = build_case(case)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            out, lse = flexmask.flex_attention(q, k, v, block_mask, return_lse=True, compile=False)
        flex_out, flex_lse = flex_forward(q, k, v, block_mask)
        assert lse.shape == flex_lse.shape and lse.dtype == flex_lse.dtype
        torch.testing.assert_close(out, flex_out, atol=1e-10, rtol=0)
        torch.testing.assert_close(lse, flex_lse, atol=1e-10, rtol=0)
        torch.testing.assert_close(
            lse, oracle.attention(q, k, v, dense)[1].to(q.dtype), atol=1e-10, rtol=0
        )
        assert torch.isneginf(lse[~dense.any(-1)]).all()
    low = flexmask.flex_attention(
        *(t.detach().float() for t in (q, k, v)), block_mask, return_lse=True, compile=False
    )[1]
    assert low.dtype == torch.float32


def test_batch_of_zero_gives_empty_results_like_torch():
    block_mask = create_block_mask(causal, None, None, 100, 100, device="cpu", BLOCK_SIZE=32)
    q, k, v, _ = random_qkv(0, 2, 2, 100, 100, dtype=torch.float32)
    out, lse = flexmask.flex_attention(q, k, v, block_mask, return_lse=True)  # needs grad
    flex_out, flex_lse = flex_forward(q, k, v, block_mask)
    assert out.shape == flex_out.shape == (0, 2, 100, 10)
    # torch 2.13 returns no lse at all for B=0 (None); an empty one keeps the tuple usable.
    assert flex_lse is None or flex_lse.shape == (0, 2, 100)
    assert lse.shape == (0, 2, 100) and lse.dtype == torch.float32
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


# --- threads: groups dealt to threads of one intra-op thread each ----------------------------


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", ["document-gqa", "empty-rows"])
def test_threads_share_the_groups_exactly(name, threads):
    """Any number of threads gives the oracle's output, lse and gradients (fp64, 1e-10), with
    small groups so that every thread gets some; torch's thread count is left as it was."""
    case = next(c for c in CASES if c[0] == name)
    block_mask, dense, q, k, v, grad_out = build_case(case)
    before = torch.get_num_threads()
    assert_matches_oracles(
        q,
        k,
        v,
        grad_out,
        block_mask,
        dense,
        atol=1e-10,
        threads=threads,
        max_chunk_elements=2_000,
        memory_budget=20_000,
    )
    assert torch.get_num_threads() == before


def test_threads_none_takes_both_ways_exactly(monkeypatch):
    """threads=None runs each kind of call in the calling thread with torch's threads or on
    single-threaded workers, as a fresh ThreadChoice picks: the oracle's output, lse and
    gradients every time, both ways taken for the forward and the backward, and torch's
    thread count left as it was."""
    from flexmask.backends import threads as block_sparse_kernel

    choice = block_sparse_kernel.ThreadChoice(first=1, most=2)
    monkeypatch.setattr(block_sparse_kernel, "CHOICE", choice)
    taken = []
    pick = choice.pick
    monkeypatch.setattr(
        choice, "pick", lambda kind: taken.append((kind[0], pick(kind))) or taken[-1][1]
    )
    case = next(c for c in CASES if c[0] == "document-gqa")
    block_mask, dense, q, k, v, grad_out = build_case(case)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(4):
            assert_matches_oracles(
                q, k, v, grad_out, block_mask, dense, atol=1e-10, max_chunk_elements=2_000
            )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert {(d, w) for d in ("forward", "backward") for w in ("torch", "workers")} <= set(taken)


def test_threads_are_a_cpu_matter():
    """On the CPU threads=None measures (AUTO) and an int is kept; on another device the
    groups run in the calling thread (helper threads would launch on their own stream)."""
    from flexmask.backends.threads import kernel_workers

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert kernel_workers(None, cpu) == block_sparse_threads.AUTO
    assert kernel_workers(3, cpu) == 3
    assert kernel_workers(None, cuda) == kernel_workers(3, cuda) == 1


def test_thread_choice_follows_the_faster_way():
    """Each way is measured once, the faster one runs, the other is tried again after
    ``first`` calls and then at doubling intervals up to ``most`` while it loses; a probe that
    wins takes over, and an incumbent that slows past the other's cost gives way unprobed."""
    from flexmask.backends.threads import ThreadChoice

    choice, kind = ThreadChoice(first=2, most=8), ("forward", 20)
    cost = {"torch": 1.0, "workers": 3.0}

    def run(n):
        ways = []
        for _ in range(n):
            way = choice.pick(kind)
            choice.record(kind, way, cost[way])
            ways.append(way)
        return ways

    assert run(2) == ["torch", "workers"]
    assert choice.way(kind) == "torch"
    # Probes after 2 calls, then 4, then 8, then every 8.
    ways = run(2 + 1 + 4 + 1 + 8 + 1 + 8 + 1)
    probes = [i for i, w in enumerate(ways) if w == "workers"]
    assert probes == [2, 7, 16, 25], ways
    cost["workers"] = 0.5  # the cores became free for the workers: the next probe wins
    ways = run(9)
    assert ways[-1] == "workers" and choice.way(kind) == "workers"
    cost["workers"] = 5.0  # and busy again: the incumbent's own cost hands back at once
    run(2)
    assert choice.way(kind) == "torch"
    assert choice.way(("backward", 20)) is None  # kinds are separate


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_threads_follow_the_callers_grad_and_inference_mode(mode):
    """Grad and inference mode are per thread; the helper threads take the caller's (an
    inference-mode output written from a thread outside it would raise)."""
    case = next(c for c in CASES if c[0] == "document-gqa")
    block_mask, dense, q, k, v, _ = build_case(case)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        out = block_sparse_attention(
            q, k, v, block_mask, enable_gqa=True, threads=2, max_chunk_elements=2_000
        )
        expected = sdpa_oracle(q, k, v, dense)
    assert not out.requires_grad
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


def test_an_error_in_a_helper_thread_reaches_the_caller():
    calls = []

    def failing(b, h, q_idx, kv_idx):
        calls.append(q_idx.max())
        if len(calls) > 1:  # the read-back passes; the groups' own calls fail, on every thread
            raise RuntimeError("mask_mod failed")
        # Every other key: rows that are not intervals, so the groups call mask_mod.
        return (q_idx >= kv_idx) & (kv_idx % 2 == 0)

    block_mask = create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=32)
    block_mask.mask_mod = failing
    q, k, v, _ = random_qkv(1, 2, 2, 256, 256, dtype=torch.float32)
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="mask_mod failed"):
        block_sparse_attention(
            q, k, v, block_mask, backend="sparse", threads=2, mod_eval="broadcast"
        )
    assert torch.get_num_threads() == before


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_inherit_the_thread_choice_lock():
    """A DataLoader worker forked while another thread holds the choice's lock gets a free
    lock: its attention calls do not hang."""
    import os
    import threading

    from flexmask.backends import threads as block_sparse_kernel

    held, release = threading.Event(), threading.Event()

    def hold():
        with block_sparse_kernel.CHOICE.lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the lock can be taken at once
            os._exit(0 if block_sparse_kernel.CHOICE.lock.acquire(timeout=5) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0
