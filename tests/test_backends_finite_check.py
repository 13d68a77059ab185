"""The CPU backends' cheap finiteness test (``backends.finite._all_finite``): a sum per
tensor, never True where an entry is NaN or infinite, and False — the exact path, only
slower — where finite values overflow the sum; the outputs stay the reference's."""

from __future__ import annotations

import pytest
import torch

import flexmask
from flexmask.backends.finite import _all_finite
from tests import oracle


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_nan_or_infinity_is_seen(dtype):
    x = torch.randn(2, 3, 40, 8).to(dtype)
    assert _all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 2, 17, 5] = bad
        assert not _all_finite(x, y) and not _all_finite(y)
    both = x.clone()
    both[0, 0, 0, 0], both[1, 1, 1, 1] = float("inf"), float("-inf")  # the sum is NaN
    assert not _all_finite(both)


def test_finite_values_whose_sum_overflows_take_the_exact_path():
    big = torch.full((1, 1, 16, 4), 3e38)
    assert not _all_finite(big)  # conservative: finite, but the sum is inf
    assert _all_finite(torch.full((1, 1, 16, 4), 60000.0, dtype=torch.float16))  # f32 sum


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("backend", ["slices", "block_sparse", "sdpa"])
def test_outputs_with_an_overflowing_sum_are_the_reference(backend, grad):
    mask = flexmask.causal() & flexmask.document([40, 24]) & flexmask.padding(60)
    q, k = (torch.randn(1, 2, 64, 8, requires_grad=grad) for _ in range(2))
    v = torch.full((1, 2, 64, 8), 1e36).requires_grad_(grad)  # the sum of v overflows
    assert not _all_finite(v)  # the exact path: nothing but time differs
    out = flexmask.attention(q, k, v, mask, backend)
    want = oracle.attention(q, k, v, mask.to_dense(1, 2, 64, 64))[0].float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=0)
    if grad:
        out.sum().backward()
        assert bool(torch.isfinite(q.grad).all()) and bool(torch.isfinite(k.grad).all())


@pytest.mark.parametrize("backend", ["slices", "block_sparse", "sdpa"])
def test_a_nan_query_row_sends_nothing_to_a_value_it_does_not_attend(backend):
    """A row whose own query holds NaN (head 1, row 0, attending key 0 alone) beside a NaN
    value in another head (head 0, key 1): the exact rows' correction for the NaN value
    took its finite stand-in outside the where, so that row's NaN output gradient reached
    head 1's value at key 1 through 0 * nan (found by the fuzz: test_every_axis_at_once_many)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 14, 8, generator=gen) for _ in range(3))
    q[0, 1, 0, 0] = v[0, 0, 1, 0] = float("nan")
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    mask = flexmask.causal()
    out = flexmask.attention(q, k, v, mask, backend)
    grad = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    dense = mask.to_dense(1, 2, 14, 14)
    want = oracle.attention_outcome(q, k, v, dense, grad_out=grad)
    # Two of these backends return no lse with gradients: the rule reads the reference's.
    got = oracle.Outcome(out.detach(), want.lse.to(out.dtype), grads)
    assert not oracle.differences(got, want, q, k, v, dense, None)
