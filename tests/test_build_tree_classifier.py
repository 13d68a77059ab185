"""The fast tree classifier (no sort unless a kv block spans several branches) against
torch's own ``create_block_mask``, whole tensors: AReaL-style insertion-order trees at B > 1
with lengths that are not a multiple of the block, and layouts that force the search of
sorted subtrees (kv blocks over several branches, q blocks whose ranks are not one run)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from tests import oracle
from tests.strategies import insertion_tree as _insertion_tree

tree_module = sys.modules["flexmask.pieces.tree"]


def insertion_tree(n: int, seed: int, sequences: int) -> list[int]:
    """Insertion-order tries of sequences of random length (``strategies.insertion_tree``)."""
    return _insertion_tree(n, seed, sequences, random_lengths=True)


def random_tree(n: int, seed: int) -> list[int]:
    """Every token hangs off a uniformly random earlier one: few chains, many branches."""
    gen = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@pytest.mark.parametrize("block", [128, 64, (32, 16)])
def test_insertion_trees_at_batch_match_torch(block):
    length, batch = 1999, 3
    trees = [insertion_tree(length - 7 * b, seed=b, sequences=12) for b in range(batch)]
    mask = flexmask.tree(trees)
    assert mask.preorder == [False] * batch
    ours = flexmask.create_block_mask(mask, batch, 2, length, length, "cpu", block)
    theirs = torch_create_block_mask(mask.mask_mod, batch, 2, length, length, "cpu", block)
    oracle.assert_same_block_mask(ours, theirs, f"insertion trees block={block}")


@pytest.mark.parametrize("seed", range(4))
def test_branchy_trees_take_the_search_and_match_torch(seed, searched):
    n = 611
    trees = [random_tree(n, seed), insertion_tree(n - 50, seed, sequences=60)]
    mask = flexmask.tree(trees)
    ours = flexmask.create_block_mask(mask, 2, 1, n + 5, n + 5, "cpu", 16)
    theirs = torch_create_block_mask(mask.mask_mod, 2, 1, n + 5, n + 5, "cpu", 16)
    oracle.assert_same_block_mask(ours, theirs, f"branchy trees seed={seed}")
    assert searched[0] > 0  # the case this test is for: tiles the extremes left open


def test_offsets_with_branchy_trees_match_the_oracle():
    n = 300
    parents = random_tree(n, 7)
    mask = flexmask.tree(parents)
    whole = oracle.tree(parents, n + 40, n + 40)
    for q_off, kv_off in ((13, 0), (0, 29), (40, 17)):
        q_len, kv_len = n - q_off, n + 40 - kv_off
        ours = flexmask.create_block_mask(
            mask, 1, 1, q_len, kv_len, "cpu", 16, q_offset=q_off, kv_offset=kv_off
        )
        window = whole[q_off : q_off + q_len, kv_off : kv_off + kv_len]
        reference = oracle.torch_blocks(oracle.stack([window]), 16)
        oracle.assert_same_block_mask(ours, reference, f"offsets q={q_off} kv={kv_off}")


def preorder(parents: list[int]) -> list[int]:
    """The same tree renumbered in depth-first preorder (children in index order)."""
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for i, p in enumerate(parents):
        (children[p] if p >= 0 else roots).append(i)
    order: list[int] = []
    stack = roots[::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    new = {old: i for i, old in enumerate(order)}
    return [new[parents[old]] if parents[old] >= 0 else -1 for old in order]


@pytest.mark.parametrize("block", [128, 16, (32, 8), (8, 32)])
def test_preorder_trees_at_batch_match_torch(block):
    trees = [preorder(insertion_tree(700, 3, 9)), preorder(random_tree(650, 4))]
    assert flexmask.tree(trees).preorder == [True, True]
    mask = flexmask.tree(trees)
    for q_len, kv_len in ((701, 701), (333, 709), (709, 517)):
        ours = flexmask.create_block_mask(mask, 2, 2, q_len, kv_len, "cpu", block)
        theirs = torch_create_block_mask(mask.mask_mod, 2, 2, q_len, kv_len, "cpu", block)
        oracle.assert_same_block_mask(ours, theirs, f"preorder q={q_len} kv={kv_len} {block}")


def test_preorder_tree_with_offsets_matches_the_oracle():
    parents = preorder(random_tree(300, 11))
    mask = flexmask.tree(parents)
    whole = oracle.tree(parents, 340, 340)
    for q_off, kv_off in ((13, 0), (0, 29), (40, 17)):
        q_len, kv_len = 300 - q_off, 340 - kv_off
        ours = flexmask.create_block_mask(
            mask, 1, 1, q_len, kv_len, "cpu", 16, q_offset=q_off, kv_offset=kv_off
        )
        window = whole[q_off : q_off + q_len, kv_off : kv_off + kv_len]
        reference = oracle.torch_blocks(oracle.stack([window]), 16)
        oracle.assert_same_block_mask(ours, reference, f"offsets q={q_off} kv={kv_off}")
