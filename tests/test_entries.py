"""One entry per audience: ``flexmask.flex_attention`` is torch's signature and semantics,
``flexmask.attention`` and ``explain`` flexmask's own call (``mask=``, ``backend=``); the
pre-0.2 forms warn for a release, and nothing is read with a second meaning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexmask
from flexmask.block_sparse import block_sparse_attention
from tests import oracle

S = 160
MASK = flexmask.causal() & flexmask.document([100, 60])


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, S, 16, generator=g) for _ in range(3)]


def score_mod(score, b, h, q_idx, kv_idx):
    return score + 0.01 * (q_idx - kv_idx) * (h + 1)


def torch_eager(*args, **kwargs):
    """torch's own flex_attention, eager on the CPU (its mask_mod decides every pair)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not compiled" notice
        return torch_flex.flex_attention(*args, **kwargs)


def test_flex_attention_takes_torchs_positional_order():
    """(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
    kernel_options), positionally, with torch's result for a torch BlockMask and for a Mask."""
    q, k, v = qkv()
    bm = torch_flex.create_block_mask(MASK.mask_mod, 1, 1, S, S, "cpu", BLOCK_SIZE=32)
    want_out, want_lse = torch_eager(q, k, v, score_mod, bm, 0.3, False, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for given in (bm, MASK, flexmask.lazy(MASK, 1, 1, S, S, "cpu")):
            out, lse = flexmask.flex_attention(q, k, v, score_mod, given, 0.3, False, True, None)
            torch.testing.assert_close(out, want_out, atol=2e-5, rtol=0)
            torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=0)


def test_the_pre_0_2_order_warns_and_means_what_it_meant():
    """A mask where torch's score_mod goes is never a score_mod: read as the old
    (query, key, value, block_mask, score_mod), with a DeprecationWarning."""
    q, k, v = qkv(1)
    want = flexmask.flex_attention(q, k, v, score_mod, block_mask=MASK)
    with pytest.warns(DeprecationWarning, match="torch's \\(query, key, value, score_mod"):
        old = flexmask.flex_attention(q, k, v, MASK, score_mod)
    assert old.equal(want)
    with pytest.warns(DeprecationWarning, match="block_mask="):
        by_old_name = flexmask.flex_attention(q, k, v, score_mod, mask=MASK)
    assert by_old_name.equal(want)
    with pytest.raises(TypeError, match="a mask for both"):
        flexmask.flex_attention(q, k, v, MASK, MASK)
    with pytest.raises(TypeError, match="one argument under two names"):
        flexmask.flex_attention(q, k, v, block_mask=MASK, mask=MASK)


def test_backend_means_one_thing():
    """``backend=`` names a flexmask backend in attention and explain; in flex_attention it
    was the block-sparse path's kernel switch (now ``kernel=``): a backend's name there is a
    TypeError pointing at attention, the old switch's values warn."""
    q, k, v = qkv(2)
    want, _ = oracle.attention(q, k, v, MASK.to_dense(2, 2, S, S))
    with pytest.raises(
        TypeError, match=r"flexmask.attention\(query, key, value, mask, backend='slices'\)"
    ):
        flexmask.flex_attention(q, k, v, block_mask=MASK, backend="slices")
    with pytest.warns(DeprecationWarning, match="renamed kernel="):
        old = flexmask.flex_attention(q, k, v, block_mask=MASK, backend="sdpa")
    new = flexmask.flex_attention(q, k, v, block_mask=MASK, kernel="sdpa")
    assert old.equal(new)
    torch.testing.assert_close(new.double(), want, atol=2e-5, rtol=0)
    kernel = flexmask.explain(q, k, v, MASK, "block_sparse", kernel="sdpa").kernel
    assert kernel.startswith("torch's scaled_dot_product_attention"), kernel
    bm = flexmask.create_block_mask(MASK, 1, 1, S, S, "cpu")
    with pytest.warns(DeprecationWarning, match="renamed kernel="):
        direct = block_sparse_attention(q, k, v, bm, backend="sparse")
    assert direct.equal(block_sparse_attention(q, k, v, bm, kernel="sparse"))
    with pytest.raises(TypeError, match="pass kernel= only"):
        block_sparse_attention(q, k, v, bm, kernel="sdpa", backend="sparse")
    with pytest.raises(ValueError, match="kernel must be one of"):
        block_sparse_attention(q, k, v, bm, kernel="slices")


def test_attention_and_explain_take_mask():
    q, k, v = qkv(3)
    want = flexmask.attention(q, k, v, mask=MASK)
    with pytest.warns(DeprecationWarning, match="take mask="):
        assert flexmask.attention(q, k, v, block_mask=MASK).equal(want)
    with pytest.warns(DeprecationWarning, match="take mask="):
        assert flexmask.explain(q, k, v, block_mask=MASK).backend == "slices"


def test_kernel_options_on_the_cpu_are_ignored_and_checked():
    """torch's GPU kernel options: the CPU backends run the call without them."""
    q, k, v = qkv(4)
    plain = flexmask.flex_attention(q, k, v, block_mask=MASK)
    tuned = flexmask.flex_attention(q, k, v, block_mask=MASK, kernel_options={"BACKEND": "FLASH"})
    assert tuned.equal(plain)
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        flexmask.flex_attention(q, k, v, block_mask=MASK, kernel_options="FLASH")
