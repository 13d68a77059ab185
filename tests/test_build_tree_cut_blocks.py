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
from flexmask.blocks.codes import UNDECIDED
from flexmask.blocks.grid import make_grid
from tests import oracle
from tests.strategies import insertion_tree, preorder_tree

tree_module = sys.modules["flexmask.pieces.tree"]  # the package re-exports a function tree


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


def _trees(layout, sizes, seed, sequences, branchy_seed):
    """One tree per size: in preorder, in insertion order, or branchy (each node's parent
    drawn uniformly from the nodes before it)."""
    if layout == "preorder":
        return [preorder_tree(n, seed=seed + r) for r, n in enumerate(sizes)]
    if layout == "insertion":
        return [insertion_tree(n, seed=seed + r, sequences=sequences) for r, n in enumerate(sizes)]
    gen = torch.Generator().manual_seed(branchy_seed)
    return [
        [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)] for n in sizes
    ]


@pytest.mark.parametrize("layout", ["preorder", "insertion", "branchy"])
def test_trees_build_without_looking_for_undecided_tiles(layout, chunked):
    """A tree settles every tile itself (``settles_every_tile``), so the build skips its
    look for UNDECIDED tiles: its tile codes hold none, and the whole tensors still equal
    torch's — rows that differ, two heads, lengths off the block, windows at offsets."""
    mask = flexmask.tree(_trees(layout, [389, 250], seed=10, sequences=9, branchy_seed=7))
    assert mask.settles_every_tile
    grid = make_grid(mask, 2, 2, 389, 389, "cpu", 16, 0, 0)
    assert int(mask.classify_tiles(grid).max()) < UNDECIDED
    for q_len, kv_len, q_offset, kv_offset in ((389, 389, 0, 0), (130, 260, 259, 5)):
        ours = flexmask.create_block_mask(
            mask, 2, 2, q_len, kv_len, "cpu", 16, q_offset=q_offset, kv_offset=kv_offset
        )

        def shifted(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset):
            return mask.mask_mod(b, h, q_idx + q_offset, kv_idx + kv_offset)

        theirs = torch_create_block_mask(shifted, 2, 2, q_len, kv_len, "cpu", 16)
        oracle.assert_same_block_mask(ours, theirs, f"{layout} q={q_len}+{q_offset}")


@pytest.mark.parametrize("narrow", [1, 40, None], ids=["int32", "some chunks too wide", "int16"])
@pytest.mark.parametrize("layout", ["preorder", "insertion", "branchy"])
def test_narrowed_and_wide_compares_match_torch(layout, narrow, chunked, monkeypatch):
    """Tile tests compared as int16 (each chunk's values shifted, kv ones clamped just past
    the chunk's q-side range) or left int32 where some chunk's range is wider than int16
    counts (forced here by a small limit): whole tensors equal torch's either way, for
    every layout, windows at offsets and lengths off the block."""
    if narrow is not None:
        monkeypatch.setattr(tree_module, "_NARROW", narrow)
    mask = flexmask.tree(_trees(layout, [463, 300, 97], seed=20, sequences=11, branchy_seed=11))
    for q_len, kv_len, q_offset, kv_offset in ((463, 463, 0, 0), (150, 301, 313, 7)):
        ours = flexmask.create_block_mask(
            mask, 3, 1, q_len, kv_len, "cpu", (16, 8), q_offset=q_offset, kv_offset=kv_offset
        )

        def shifted(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset):
            return mask.mask_mod(b, h, q_idx + q_offset, kv_idx + kv_offset)

        theirs = torch_create_block_mask(shifted, 3, 1, q_len, kv_len, "cpu", (16, 8))
        oracle.assert_same_block_mask(ours, theirs, f"{layout} narrow={narrow} q={q_len}")
