"""``block_stats`` (and the reports that carry it: ``explain_build``, ``explain``) against
independent counts: density pair by pair on the expression's plain numpy reference, block
shares by summing the lists of torch's own ``create_block_mask`` of the mask's mask_mod (torch
classifies an edge block by the padded tile it evaluates; the kernels read its lists)."""

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.builders import block_stats
from tests.oracle import torch_build
from tests.strategies import expressions

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def torch_shares(bm) -> tuple[Fraction, Fraction]:
    """(non-empty, partial) shares of the blocks torch's BlockMask lists, summed plainly."""
    batch, heads, num_q = bm.kv_num_blocks.shape
    num_kv = -(-bm.seq_lengths[1] // bm.BLOCK_SIZE[1])
    blocks = batch * heads * num_q * num_kv
    partial = int(bm.kv_num_blocks.sum())
    full = 0 if bm.full_kv_num_blocks is None else int(bm.full_kv_num_blocks.sum())
    return Fraction(partial + full, blocks), Fraction(partial, blocks)


@SETTINGS
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    q_block=st.sampled_from([1, 2, 3, 8, 16]),
    kv_block=st.sampled_from([1, 4, 5, 16]),
)
def test_stats_equal_the_dense_count(data, batch, heads, q_block, kv_block):
    q_len, kv_len = data.draw(st.integers(1, 37)), data.draw(st.integers(1, 37))
    mask, dense = data.draw(expressions(batch, heads, max(q_len, kv_len) + 2))
    want = dense(q_len, kv_len).astype(bool)
    bm = flexmask.create_block_mask(
        mask, batch, heads, q_len, kv_len, device="cpu", BLOCK_SIZE=(q_block, kv_block)
    )
    stats = block_stats(bm)
    b, h = bm.kv_num_blocks.shape[:2]  # its own B and H: 1 where the mask ignores them
    assert stats.pairs == b * h * q_len * kv_len
    assert stats.blocks == b * h * -(-q_len // q_block) * -(-kv_len // kv_block)
    assert Fraction(stats.attended, stats.pairs) == Fraction(int(want.sum()), want.size), mask
    theirs = torch_build(mask.mask_mod, batch, heads, q_len, kv_len, block=(q_block, kv_block))
    nonempty, partial = torch_shares(theirs)
    assert Fraction(stats.partial + stats.full, stats.blocks) == nonempty, mask
    assert Fraction(stats.partial, stats.blocks) == partial, mask
    assert stats.nonempty_share == float(nonempty) and stats.partial_share == float(partial)


def _scalar_only(b, h, q_idx, kv_idx):
    # For scalars only: torch.stack needs equal shapes, so broadcasting index tensors fail
    # and the vmap path (torch's own) reads it.
    return (q_idx >= kv_idx) & (torch.stack([q_idx, -kv_idx]).sum(0) % 3 != 1)


def test_a_torch_block_mask_and_a_scalar_mask_mod():
    q_len, kv_len = 50, 43
    bm = torch_create_block_mask(_scalar_only, 1, 1, q_len, kv_len, device="cpu", BLOCK_SIZE=16)
    q = np.arange(q_len)[:, None]
    kv = np.arange(kv_len)[None, :]
    stats = block_stats(bm)
    assert stats.attended == int(((q >= kv) & ((q - kv) % 3 != 1)).sum())
    assert (
        Fraction(stats.partial + stats.full, stats.blocks),
        Fraction(stats.partial, stats.blocks),
    ) == torch_shares(bm)


def test_an_empty_mask_and_the_reports():
    stats = block_stats(flexmask.create_block_mask(flexmask.empty(), 1, 1, 9, 9, device="cpu"))
    assert (stats.attended, stats.partial, stats.full, stats.density) == (0, 0, 0, 0.0)
    report = flexmask.explain_build(flexmask.causal(), 2, 1, 300, device="cpu", BLOCK_SIZE=64)
    assert report.stats.attended == 2 * 300 * 301 // 2 and report.stats.pairs == 2 * 300 * 300
    assert "density 0.5017" in str(report)
    q = k = v = torch.randn(2, 2, 100, 8)
    choice = flexmask.explain(q, k, v, flexmask.causal() & flexmask.document([[60, 40], [100]]))
    assert choice.blocks.attended == 60 * 61 // 2 + 40 * 41 // 2 + 100 * 101 // 2
    assert "mask: density" in repr(choice)
    assert flexmask.explain(q, k, v).blocks is None


def test_stats_refuse_what_is_not_a_block_mask():
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        block_stats(flexmask.causal())
