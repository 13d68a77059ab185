"""A BlockMask that records no flexmask Mask (torch's own, or one torch moved): the
block-sparse path reads each query's interval on the partial blocks back from ``mask_mod``
once, and masks with it; or, where the rows there are not intervals, calls ``mask_mod`` as
before. Either way outputs, lse and gradients equal a dense reference written from flex's
documented semantics (listed full blocks all allowed, partial blocks by ``mask_mod``,
unlisted refused; a row with no key gives 0)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexmask.backends.block_sparse import grouped
from flexmask.backends.block_sparse.api import block_sparse_attention
from tests import oracle


def qkv(batch, q_heads, kv_heads, q_len, kv_len, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q = randn(batch, q_heads, q_len, 16).requires_grad_()
    k = randn(batch, kv_heads, kv_len, 16).requires_grad_()
    v = randn(batch, kv_heads, kv_len, 12).requires_grad_()
    return q, k, v, randn(batch, q_heads, q_len, 12)


def documents_per_row(q_len, kv_len):
    """Document-causal, other documents on each batch row (mask_mod reads b)."""
    ids = torch.stack(
        [
            torch.repeat_interleave(torch.arange(3), torch.tensor([50, 7, kv_len - 57])),
            torch.repeat_interleave(torch.arange(2), torch.tensor([kv_len - 90, 90])),
        ]
    )
    shift = kv_len - q_len  # queries are the last q_len tokens

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + shift
        return (ids[b, q_pos] == ids[b, kv_idx]) & (q_pos >= kv_idx)

    return mask_mod


def window(size):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < size)

    return mask_mod


def late_causal(start):
    """Rows before ``start`` attend nothing (their blocks partly listed)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx >= start)

    return mask_mod


INTERVAL_CASES = [
    # (name, mask_mod, batch, block-mask batch, Hq, Hkv, Q_LEN, KV_LEN, BLOCK_SIZE)
    ("documents-per-row-gqa", documents_per_row(300, 300), 2, 2, 4, 2, 300, 300, 32),
    ("documents-last-queries", documents_per_row(130, 300), 2, 2, 2, 2, 130, 300, 32),
    ("window-odd-blocks", window(37), 1, None, 3, 3, 211, 211, (32, 16)),
    ("rows-attending-nothing", late_causal(45), 3, None, 2, 1, 150, 150, 32),
]


@pytest.mark.parametrize("case", INTERVAL_CASES, ids=[c[0] for c in INTERVAL_CASES])
def test_intervals_read_back_from_mask_mod_equal_the_dense_reference(monkeypatch, case):
    _, mask_mod, batch, mask_batch, q_heads, kv_heads, q_len, kv_len, block = case
    block_mask = create_block_mask(
        mask_mod, mask_batch, None, q_len, kv_len, device="cpu", BLOCK_SIZE=block
    )

    def refuse(*args, **kwargs):
        raise AssertionError("mask_mod path taken")

    read_back = []
    recovered_bounds = grouped.recovered_bounds
    monkeypatch.setattr(grouped, "group_mask_fn", refuse)
    monkeypatch.setattr(
        "flexmask.backends.block_sparse.api.recovered_bounds",
        lambda *a: read_back.append(recovered_bounds(*a)) or read_back[-1],
    )
    q, k, v, grad_out = qkv(batch, q_heads, kv_heads, q_len, kv_len)
    out, lse = block_sparse_attention(
        q, k, v, block_mask, enable_gqa=q_heads != kv_heads, return_lse=True, backend="sparse"
    )
    assert read_back and read_back[0] is not None
    dense = oracle.block_mask_meaning(block_mask, batch, q_heads, q_len, kv_len)
    expected, expected_lse = oracle.attention(q, k, v, dense)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, expected_lse.to(lse.dtype), atol=1e-10, rtol=0)
    # An lse gradient on the rows that attend something (lse -inf has none).
    weights = expected_lse.isfinite().to(lse.dtype)
    got = torch.autograd.grad((out, lse), (q, k, v), (grad_out, weights))
    finite_lse = expected_lse.nan_to_num(neginf=0.0)
    want = torch.autograd.grad((expected, finite_lse), (q, k, v), (grad_out, weights))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)


def every_third_refused(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (kv_idx % 3 != 1)


def per_head_window(b, h, q_idx, kv_idx):
    # Head 0 causal, head 1 a window of 5: the block lists (built at h=0) are causal's.
    return (q_idx >= kv_idx) & ((h == 0) | (q_idx - kv_idx < 5))


def sinks_and_window(b, h, q_idx, kv_idx):
    # Each block holds one run, but a row's runs in two partial blocks leave a gap between.
    return (kv_idx < 20) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 20))


@pytest.mark.parametrize("mask_mod", [every_third_refused, per_head_window, sinks_and_window])
def test_rows_that_are_not_intervals_leave_mask_mod_to_decide(monkeypatch, mask_mod):
    """Gaps inside a partial block or between two, or intervals that differ per head under
    head-broadcast lists: no bounds, mask_mod is called by the groups, and the result is
    still exact."""
    block_mask = create_block_mask(mask_mod, None, None, 170, 170, device="cpu", BLOCK_SIZE=32)
    called = []
    group_mask_fn = grouped.group_mask_fn
    monkeypatch.setattr(grouped, "group_mask_fn", lambda *a: called.append(1) or group_mask_fn(*a))
    q, k, v, grad_out = qkv(2, 2, 2, 170, 170)
    out = block_sparse_attention(q, k, v, block_mask, backend="sparse")
    assert called
    dense = oracle.block_mask_meaning(block_mask, 2, 2, 170, 170)
    expected, _ = oracle.attention(q, k, v, dense)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(expected, (q, k, v), grad_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)


def test_score_mod_with_intervals_read_back():
    """The score_mod path masks partial blocks with the intervals read back too."""

    def bias(score, b, h, q_idx, kv_idx):
        return score - 0.05 * (q_idx - kv_idx) + 0.1 * h

    mask_mod = documents_per_row(300, 300)
    block_mask = create_block_mask(mask_mod, 2, None, 300, 300, device="cpu", BLOCK_SIZE=32)
    q, k, v, grad_out = qkv(2, 2, 2, 300, 300)
    out = block_sparse_attention(q, k, v, block_mask, score_mod=bias)
    dense = oracle.block_mask_meaning(block_mask, 2, 2, 300, 300)
    expected, _ = oracle.attention(q, k, v, dense, score_mod=bias)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(expected, (q, k, v), grad_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)


def test_the_read_back_runs_on_one_intra_op_thread():
    """Its many small ops would each wait for a descheduled intra-op thread on a busy
    machine; the caller's thread count is restored after."""
    seen = []
    inner = window(37)

    def counting(b, h, q_idx, kv_idx):
        seen.append(torch.get_num_threads())
        return inner(b, h, q_idx, kv_idx)

    block_mask = create_block_mask(inner, None, None, 211, 211, device="cpu", BLOCK_SIZE=32)
    block_mask.mask_mod = counting
    plan_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v, _ = qkv(1, 2, 2, 211, 211)
        block_sparse_attention(q, k, v, block_mask, backend="sparse", threads=1)
        assert seen and seen[0] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(plan_threads)
