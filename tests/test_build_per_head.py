"""``per_head`` builds (``sides._by_head``): each distinct mask built once and copied into
its heads' slices of torch's ``(B, H, ...)`` layout, a closed-form part with one row (or
one head) written straight into its first head's slice. Against torch's own
``create_block_mask`` as whole tensors, each with a storage of its own."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.builders import closed_form
from tests import oracle
from tests.test_build_trees import insertion_tree


def _docs(total: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(1, 400, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    return lengths


def _check(mask, B, H, q_len, kv_len, block, context):
    ours = flexmask.create_block_mask(mask, B, H, q_len, kv_len, "cpu", block)
    theirs = torch_create_block_mask(mask.mask_mod, B, H, q_len, kv_len, "cpu", block)
    oracle.assert_same_block_mask(ours, theirs, context)
    return ours


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize(("q_len", "kv_len"), [(1000, 1000), (1000, 777), (613, 1000)])
def test_per_head_of_closed_forms_matches_torch(B, q_len, kv_len):
    docs = [_docs(max(q_len, kv_len), seed) for seed in range(B)]
    mask = flexmask.per_head(
        flexmask.causal() & flexmask.document(docs if B > 1 else docs[0]),
        flexmask.causal() & flexmask.sliding_window(97),
        flexmask.prefix(50) | flexmask.causal(),
    )
    _check(mask, B, 6, q_len, kv_len, 16, f"B={B} q={q_len} kv={kv_len}")


def test_closed_form_part_is_written_in_place_and_exact():
    """One row: both closed-form parts write their first head's slice themselves (``out``),
    and the heads that share them (H=4, two heads each) are copies of it."""
    calls = []
    real = closed_form.ordered_sides

    def spy(mask, grid, out=None):
        calls.append(out is not None)
        return real(mask, grid, out=out)

    mask = flexmask.per_head(
        flexmask.causal() & flexmask.document([300, 411, 290]),
        flexmask.causal() & flexmask.sliding_window(130),
    )
    with mock.patch.object(closed_form, "ordered_sides", spy):
        ours = _check(mask, 1, 4, 1001, 1001, 32, "in place")
    assert calls == [True, True]
    # Each head's tensors are its own: an edit of head 0 leaves head 2 (the same mask) alone.
    before = ours.kv_indices[:, 2].clone()
    ours.kv_indices[:, 0].fill_(-1)
    assert torch.equal(ours.kv_indices[:, 2], before)


@pytest.mark.parametrize(("q_len", "kv_len"), [(1001, 1001), (700, 1001), (1001, 333)])
def test_per_row_closed_form_part_is_written_in_place_row_by_row(q_len, kv_len):
    """B > 1 and H > 1: a head's slice of ``(B, H, n, m)`` is not contiguous, only its rows
    are; a per-row closed-form part writes it row by row (no tensors of its own), the part
    shared by the rows is built once and copied. Exact against torch, and every head's
    tensors its own."""
    calls = []
    real = closed_form.ordered_sides

    def spy(mask, grid, out=None):
        calls.append(out is not None)
        return real(mask, grid, out=out)

    docs = [_docs(max(q_len, kv_len), seed) for seed in (11, 12, 13)]
    mask = flexmask.per_head(
        flexmask.causal() & flexmask.document(docs),
        flexmask.causal() & flexmask.sliding_window(130),
    )
    with mock.patch.object(closed_form, "ordered_sides", spy):
        ours = _check(mask, 3, 4, q_len, kv_len, 32, f"rows q={q_len} kv={kv_len}")
    assert calls == [True, False]  # the per-row part in place; the shared one (1 row) not
    before = ours.q_indices[1, 2].clone()
    ours.q_indices[1, 0].fill_(-1)
    assert torch.equal(ours.q_indices[1, 2], before)


def test_per_head_with_groups_rows_and_a_tile_part_matches_torch():
    """GQA groups (two heads a mask), a per-row part beside one shared by the rows (its
    ``(1, ...)`` tensors broadcast over the rows), and a tree on the tile path."""
    n = 1111
    trees = [insertion_tree(n, seed=3, sequences=6), insertion_tree(n, seed=4, sequences=3)]
    mask = flexmask.per_head(
        flexmask.tree(trees),
        flexmask.causal() & flexmask.sliding_window(200),
        flexmask.causal() & flexmask.document([_docs(n, 7), _docs(n, 8)]),
        group_size=2,
    )
    _check(mask, 2, 6, n, n, 16, "groups")
    _check(mask, 2, 12, n, 900, (16, 32), "groups, two cycles")
