"""Regressions of the builder's silent-wrong results (issue #22), each compared as whole
tensors with torch's own ``create_block_mask`` run (uncompiled) on the mask's mask_mod,
shifted to the window as ``create_block_mask``'s docstring defines the offsets."""

from __future__ import annotations

import pytest
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from tests import oracle


def _torchs(mask, q_len, kv_len, q_offset, kv_offset, block):
    """torch's build of ``mod(b, h, q + q_offset, kv + kv_offset)``."""
    span = max(q_offset + q_len, kv_offset + kv_len)
    whole = mask.mask_mod_for(span, span)

    def shifted(b, h, q_idx, kv_idx):
        return whole(b, h, q_idx + q_offset, kv_idx + kv_offset)

    return torch_create_block_mask(shifted, 1, 1, q_len, kv_len, "cpu", BLOCK_SIZE=block)


# A kv offset past 0 and a q block holding every query that attends the window, whose first
# query's keys end before the window and whose last query attends nothing (past the
# padding or the documents): torch lists the block, the closed form listed none.
UNALIGNED_KV_OFFSET = [
    (flexmask.causal() & flexmask.padding(7), 11, 1, 0, 5, 4),
    (flexmask.causal() & flexmask.document([3, 3]), 7, 8, 0, 5, 4),
    (flexmask.document([7, 2]), 10, 11, 2, 8, 4),
    (flexmask.sliding_window(5) & flexmask.document([6, 3, 1]), 12, 6, 0, 9, 4),
    # the same corner on the union path (an operand's runs)
    (flexmask.prefix(1) | (flexmask.causal() & flexmask.padding(7)), 11, 3, 0, 5, 4),
]


@pytest.mark.parametrize(
    "mask, q_len, kv_len, q_offset, kv_offset, block",
    UNALIGNED_KV_OFFSET,
    ids=[f"{c[0]!r}-{c[1]}x{c[2]}-at-{c[3]},{c[4]}-{c[5]}" for c in UNALIGNED_KV_OFFSET],
)
def test_a_block_whose_edge_queries_attend_nothing_is_listed(
    mask, q_len, kv_len, q_offset, kv_offset, block
):
    ours = flexmask.create_block_mask(
        mask, 1, 1, q_len, kv_len, "cpu", block, q_offset=q_offset, kv_offset=kv_offset
    )
    oracle.assert_same_block_mask(
        ours, _torchs(mask, q_len, kv_len, q_offset, kv_offset, block), repr(mask)
    )


# A `~` over an `&` or `|` whose codes came from closed-form runs: the incomplete edge tile
# was already demoted to partial, so `~` kept it partial where torch lists nothing.
NEGATED_COMPOUNDS = [
    (~(flexmask.causal() & flexmask.causal()), 1, 1, 8),
    (~(flexmask.causal() & flexmask.full()), 247, 247, 2),
    (~(flexmask.causal() | flexmask.prefix(3)), 13, 9, 4),
    (~((flexmask.causal() & flexmask.document([5, 6])) | flexmask.prefix(2)), 11, 11, (4, 3)),
]


@pytest.mark.parametrize(
    "mask, q_len, kv_len, block",
    NEGATED_COMPOUNDS,
    ids=[f"{c[0]!r}-{c[1]}x{c[2]}-{c[3]}" for c in NEGATED_COMPOUNDS],
)
def test_a_negated_compound_lists_no_edge_block_torch_would_not(mask, q_len, kv_len, block):
    ours = flexmask.create_block_mask(mask, 1, 1, q_len, kv_len, "cpu", block)
    theirs = torch_create_block_mask(mask.mask_mod, 1, 1, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    oracle.assert_same_block_mask(ours, theirs, repr(mask))
    assert ours.to_string() == theirs.to_string()  # same_blocks, as torch prints them


def test_the_last_row_of_a_negated_compound_lists_nothing():
    # ~(causal() & full()) at 247 with 2-blocks: the last, one-query block attends only
    # keys past itself, which lie in complete tiles; it listed 124 blocks.
    mask = ~(flexmask.causal() & flexmask.full())
    bm = flexmask.create_block_mask(mask, 1, 1, 247, 247, "cpu", 2)
    assert bm.kv_num_blocks[0, 0, -1].item() == 0
    assert bm.full_kv_num_blocks[0, 0, -1].item() == 0
