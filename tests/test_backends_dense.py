"""The dense lowerings and their one rule for a query that attends nothing, against plain
references: ``Mask.to_dense`` and the SDPA backend's dense mask of a BlockMask equal the
oracle's dense mask (rows that attend nothing all False), and attention over it gives 0
and zero gradients on those rows, as a reference that never touches them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flexmask
from flexmask.algebra.dense import open_empty_rows, zero_empty_rows
from flexmask.backends.dense import dense_mask, sdpa_attention
from flexmask.backends.plan import make_plan
from tests import oracle

# (mask, dense oracle per batch row (S, S)) — each has rows that attend nothing.
S = 75  # not a multiple of the block size


def cases():
    return [
        (
            "causal & padding(50)",
            flexmask.causal() & flexmask.padding(50),
            lambda b: oracle.causal(S, S) & oracle.padding(50, S, S),
        ),
        (
            "document & ~causal",  # each document's first token attends nothing
            flexmask.document([30, 45]) & ~flexmask.causal(),
            lambda b: oracle.document([30, 45], S, S) & ~oracle.causal(S, S),
        ),
        (
            "per-row padding",
            flexmask.causal() & flexmask.padding([40, 75]),
            lambda b: oracle.causal(S, S) & oracle.padding([40, 75][b], S, S),
        ),
    ]


def _reference_dense(fn, batch, heads):
    return torch.from_numpy(oracle.stack([fn(b) for b in range(batch)], heads))


@pytest.mark.parametrize("case", cases(), ids=lambda c: c[0])
def test_to_dense_and_the_sdpa_dense_mask_equal_the_oracle_with_empty_rows(case):
    _, mask, fn = case
    batch, heads = 2, 3
    expected = _reference_dense(fn, batch, heads)
    assert (~expected.any(-1)).any()  # the case has rows that attend nothing
    assert torch.equal(mask.to_dense(batch, heads, S, S), expected)
    block_mask = flexmask.create_block_mask(mask, batch, heads, S, S, "cpu", BLOCK_SIZE=16)
    q = k = v = torch.zeros(batch, heads, S, 8)
    plan = make_plan(q, k, v, block_mask, None, None, False, "auto")
    got = dense_mask(plan, "auto").expand(batch, heads, S, S)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", cases(), ids=lambda c: c[0])
def test_sdpa_gives_zero_and_no_gradient_where_a_query_attends_nothing(case):
    _, mask, fn = case
    batch, heads = 2, 2
    dense = _reference_dense(fn, batch, heads)
    torch.manual_seed(0)
    inputs = [torch.randn(batch, heads, S, 8, dtype=torch.float64) for _ in range(3)]
    ours = [t.clone().requires_grad_() for t in inputs]
    theirs = [t.clone().requires_grad_() for t in inputs]
    block_mask = flexmask.create_block_mask(mask, batch, heads, S, S, "cpu", BLOCK_SIZE=16)
    plan = make_plan(*ours, block_mask, None, None, False, "auto")
    out = sdpa_attention(*ours, plan, "auto", causal=False)
    expected = oracle.attention(*theirs, dense)[0]
    torch.testing.assert_close(out, expected)
    weight = torch.randn_like(expected)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    empty = ~dense.any(-1)
    assert bool((out[empty] == 0).all()) and bool((ours[0].grad[empty] == 0).all())
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_open_empty_rows_allocates_nothing_when_every_row_has_a_key():
    dense = torch.from_numpy(np.tril(np.ones((4, 4), dtype=bool)))[None, None]
    opened, has_key = open_empty_rows(dense)
    assert opened is dense and has_key is None
    out = torch.randn(1, 1, 4, 2)
    assert zero_empty_rows(out, None) is out
