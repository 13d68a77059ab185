"""Decode masks at rectangular block shapes (FA4's (256, 128) among them): ``decode_mask``
and every step of ``DecodeMasks`` (build, reuse and append paths) equal torch's
``create_block_mask`` of the same window — a lookup into the dense training mask, written
plainly, at each row's query positions — on all eight tensors."""

from __future__ import annotations

import random

import numpy as np
import pytest

import flexmask
from flexmask.blocks import same_blocks
from tests import oracle

SHAPES = [(256, 128), (128, 64), (64, 128)]
CAPACITY = 700
LENGTHS = [300, 41, 200, 159]


def _parents(n: int) -> list[int]:
    rng = random.Random(11)
    return [-1] + [
        rng.randrange(max(0, i - 30), i) if rng.random() > 0.05 else -1 for i in range(1, n)
    ]


def _case(name: str) -> tuple[flexmask.Mask, np.ndarray]:
    n = CAPACITY
    causal = oracle.causal(n, n)
    if name == "causal":
        return flexmask.causal(), causal
    if name == "documents":
        return flexmask.causal() & flexmask.document(LENGTHS), causal & oracle.document(
            LENGTHS, n, n
        )
    if name == "window":
        return flexmask.causal() & flexmask.sliding_window(70), causal & oracle.sliding_window(
            70, n, n
        )
    if name == "tree":
        parents = _parents(n)
        return flexmask.causal() & flexmask.tree(parents), causal & oracle.tree(parents, n, n)
    if name == "prefix_lm":
        return flexmask.causal() | flexmask.prefix(90), causal | oracle.prefix(90, n, n)
    raise AssertionError(name)


NAMES = ["causal", "documents", "window", "tree", "prefix_lm"]


def _expanded(block_mask, batch: int, heads: int):
    fields = []
    for name in oracle.BLOCK_FIELDS:
        t = getattr(block_mask, name)
        fields.append(t.expand(batch, heads, *t.shape[2:]).contiguous())
    return type(block_mask)(
        block_mask.seq_lengths,
        *fields,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
    )


def _check(ours, dense, lens, q_len, heads, block, context):
    rows = np.broadcast_to(dense, (len(lens), heads, *dense.shape))
    reference = oracle.torch_build(rows, None, None, q_len, CAPACITY, block, q_offset=lens)
    ours = _expanded(ours, len(lens), heads)
    oracle.assert_same_block_mask(ours, reference, context, own_storage=False)
    assert same_blocks(ours, reference), context


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", NAMES)
def test_decode_mask_equals_torch(name, shape):
    mask, dense = _case(name)
    for lens, q_len in [([0, 255], 1), ([127, 300], 37), ([1, 129], 300), ([400], 300)]:
        got = flexmask.decode_mask(mask, lens, q_len, CAPACITY, heads=2, block_size=shape)
        assert tuple(got.BLOCK_SIZE) == shape
        _check(got, dense, lens, q_len, 2, shape, f"{name} {shape} {lens} q_len={q_len}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["causal", "documents", "window", "tree"])
def test_every_step_of_a_generation_equals_torch(name, shape):
    """Steps that cross both block sizes, with q_len below the q block (the reuse and
    append paths) and above it (every step built)."""
    mask, dense = _case(name)
    for start, q_len, count in [([120, 250], 1, 14), ([60, 190], 9, 8), ([0, 10], 260, 2)]:
        steps = flexmask.DecodeMasks(mask, start, CAPACITY, q_len=q_len, block_size=shape)
        for step in steps:
            context = f"{name} {shape} {step}"
            _check(step.block_mask, dense, step.cache_lens, q_len, 1, shape, context)
            if step.index == count:
                break
        moved = steps.at([start[0] + q_len, start[1]])  # rows that move apart
        _check(moved.block_mask, dense, moved.cache_lens, q_len, 1, shape, f"{name} at")
        if q_len == 1 and name in ("causal", "documents", "window"):
            assert steps.appends + steps.reuses > 0, (name, steps.builds)
