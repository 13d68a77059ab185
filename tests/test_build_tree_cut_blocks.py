"""Trees in insertion order whose end cuts a block: the tree filling a length that is not a
multiple of the block size (the last kv and q blocks padded), or ending inside a block with
positions past it, per row at different places — whole tensors equal to torch's build, with
and without the search of sorted subtrees settling tiles, the tiles classified in one pass or
a chunk of q blocks at a time (as grids of over 256k tiles are)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from tests import oracle

tree_module = sys.modules["flexmask.pieces.tree"]  # the package re-exports a function tree


def insertion_tree(n: int, seed: int, sequences: int) -> list[int]:
    """A trie of ``sequences`` sequences numbered as inserted: each shares a random prefix of a
    random earlier one (not a preorder once a branch lands after unrelated sequences)."""
    gen = torch.Generator().manual_seed(seed)
    parents: list[int] = []
    paths: list[list[int]] = []
    per = max(1, n // sequences)
    while len(parents) < n:
        path: list[int] = []
        if paths:
            base = paths[int(torch.randint(0, len(paths), (1,), generator=gen))]
            path = base[: int(torch.randint(0, len(base) + 1, (1,), generator=gen))]
        for _ in range(min(per, n - len(parents))):
            parents.append(path[-1] if path else -1)
            path.append(len(parents) - 1)
        paths.append(path)
    return parents


@pytest.fixture(params=[False, True], ids=["one pass", "chunks"])
def chunked(request, monkeypatch):
    """Tiles classified in one pass, or in chunks of q blocks whatever the grid's size."""
    if request.param:
        monkeypatch.setattr(tree_module, "_CHUNKED_FROM", 0)
    return request.param


@pytest.mark.parametrize("block", [16, (16, 32), (32, 8)])
@pytest.mark.parametrize("sequences", [4, 40])
def test_tree_ends_inside_blocks_per_row(block, sequences, chunked):
    # Row 0 fills the odd length (its last blocks padded, in the tree); rows 1-3 end inside a
    # block, on a block edge, and one token into a block, with positions past them.
    length = 517
    sizes = [length, 301, 256, 33]
    trees = [insertion_tree(n, seed=r, sequences=sequences) for r, n in enumerate(sizes)]
    mask = flexmask.tree(trees)
    assert not all(mask.preorder)  # every row then classified in rank space
    ours = flexmask.create_block_mask(mask, 4, 2, length, length, "cpu", block)
    theirs = torch_create_block_mask(mask.mask_mod, 4, 2, length, length, "cpu", block)
    oracle.assert_same_block_mask(ours, theirs, f"cut trees block={block} sequences={sequences}")


@pytest.mark.parametrize("seed", range(3))
def test_cut_blocks_reach_the_search(seed, searched, chunked):
    # Branchy trees leave tiles to the search; the kv blocks the tree's end cuts are among
    # those it reads (their tokens past the tree root no subtree).
    gen = torch.Generator().manual_seed(seed)
    sizes = [203, 170]
    trees = [
        [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)] for n in sizes
    ]
    length = 211
    mask = flexmask.tree(trees)
    ours = flexmask.create_block_mask(mask, 2, 1, length, length, "cpu", 16)
    theirs = torch_create_block_mask(mask.mask_mod, 2, 1, length, length, "cpu", 16)
    oracle.assert_same_block_mask(ours, theirs, f"branchy cut trees seed={seed}")
    assert searched[0] > 0


def preorder_tree(n: int, seed: int) -> list[int]:
    """A random tree laid out in preorder: each token's parent is on the path to the token
    before it (its previous token or one of that token's ancestors), or it starts a root."""
    gen = torch.Generator().manual_seed(seed)
    parents: list[int] = []
    path: list[int] = []
    for i in range(n):
        keep = int(torch.randint(0, len(path) + 1, (1,), generator=gen)) if path else 0
        if torch.rand(1, generator=gen).item() < 0.8:
            keep = len(path)  # mostly chains
        path = path[:keep]
        parents.append(path[-1] if path else -1)
        path.append(i)
    return parents


@pytest.mark.parametrize("block", [16, (16, 32), (32, 8)])
def test_preorder_trees_ending_inside_blocks(block, chunked):
    length = 517
    sizes = [length, 301, 256, 33]
    trees = [preorder_tree(n, seed=r) for r, n in enumerate(sizes)]
    mask = flexmask.tree(trees)
    assert all(mask.preorder)  # the preorder path
    ours = flexmask.create_block_mask(mask, 4, 2, length, length, "cpu", block)
    theirs = torch_create_block_mask(mask.mask_mod, 4, 2, length, length, "cpu", block)
    oracle.assert_same_block_mask(ours, theirs, f"preorder trees block={block}")
