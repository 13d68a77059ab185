"""The slices, block_sparse, sdpa and decode backends given a BlockMask of rectangular
blocks (FA4's (256, 128) among them) attend as the dense mask says: outputs and q/k/v
gradients against the reference attention (``oracle.attention``) over the dense mask
written plainly, at lengths that are not multiples of either block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flexmask
from tests import oracle

SHAPES = [(256, 128), (128, 64), (64, 128)]
S = 600
LENGTHS = [230, 70, 300]


def _case(name: str, n: int) -> tuple[flexmask.Mask, np.ndarray]:
    causal = oracle.causal(n, n)
    if name == "documents":
        return flexmask.causal() & flexmask.document(LENGTHS), causal & oracle.document(
            LENGTHS, n, n
        )
    if name == "window":
        return flexmask.causal() & flexmask.sliding_window(150), causal & oracle.sliding_window(
            150, n, n
        )
    if name == "prefix_lm":
        return flexmask.causal() | flexmask.prefix(200), causal | oracle.prefix(200, n, n)
    raise AssertionError(name)


def _tensors(batch, heads, q_len, kv_len, grad):
    gen = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(batch, heads, n, 16, generator=gen).requires_grad_(grad)
        for n in (q_len, kv_len, kv_len)
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["slices", "block_sparse", "sdpa"])
def test_training_backends_at_rectangular_blocks(backend, shape):
    B, H = 2, 2
    for name in ("documents", "window", "prefix_lm"):
        mask, dense = _case(name, S)
        block_mask = flexmask.create_block_mask(mask, B, H, S, S, BLOCK_SIZE=shape)
        assert tuple(block_mask.BLOCK_SIZE) == shape
        q, k, v = _tensors(B, H, S, S, True)
        out = flexmask.attention(q, k, v, block_mask, backend=backend, compile=False)
        q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        want, _ = oracle.attention(q2, k2, v2, torch.from_numpy(dense))
        context = f"{backend} {shape} {name}"
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5, msg=context)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        want_grads = torch.autograd.grad(want, (q2, k2, v2), grad_out.double())
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=2e-5, msg=context)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_backend_at_rectangular_blocks(shape):
    """A decode step's BlockMask (``decode_mask``) through the decode backend: each row's
    queries at ``cache_lens[b] ..`` attend as the dense mask's rows there."""
    lens, q_len = [257, 40], 3
    for name in ("documents", "window", "prefix_lm"):
        mask, dense = _case(name, S)
        block_mask = flexmask.decode_mask(mask, lens, q_len, S, heads=2, block_size=shape)
        q, k, v = _tensors(2, 2, q_len, S, False)
        out = flexmask.attention(q, k, v, block_mask, backend="decode")
        allowed = torch.stack([torch.from_numpy(dense[n : n + q_len]) for n in lens])[:, None]
        want, _ = oracle.attention(q.double(), k.double(), v.double(), allowed)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5, msg=f"{name}")
