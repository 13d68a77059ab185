"""The paths bench_build's 131k rows take, forced at sizes torch can check: tiles classified
a chunk of q blocks at a time from int8 flags (``tree._tested_codes``), and index tensors
written a chunk of entries at a time, the chunks a run begins inside rewritten whole from a
table and the last partial chunk entry by entry (``runs._expand_runs_chunked``) — for trees
in insertion order and in preorder, the composed union and ``per_head``, with rows that
differ, two heads and lengths off the block size; whole tensors against torch's own
``create_block_mask``."""

from __future__ import annotations

import sys

import pytest
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.blocks import runs
from flexmask.builders import unions
from tests import oracle
from tests.strategies import insertion_tree, preorder_tree

tree_module = sys.modules["flexmask.pieces.tree"]  # the package re-exports a function tree

Q_LEN, KV_LEN = 1533, 1203  # neither a block multiple; q longer than kv, and square below


@pytest.fixture(params=[3, 16], ids=["chunk 3", "chunk 16"])
def small_chunks(request, monkeypatch):
    """Every output written in chunks of ``request.param`` entries (most runs begin inside
    one, and a partial chunk is left over), every tile grid classified in chunks of a few
    hundred tiles (many chunks, some reaching no kv block)."""
    monkeypatch.setattr(runs, "_CHUNKED_FROM", 0)
    monkeypatch.setattr(runs, "_CHUNK", request.param)
    monkeypatch.setattr(tree_module, "_CHUNKED_FROM", 0)
    monkeypatch.setattr(tree_module, "_CHUNK_TILES", 300)
    monkeypatch.setattr(unions, "_FROM_RUNS_FROM", 0)  # a union's q side from its rows' runs
    return request.param


def _check(mask: flexmask.Mask, batch: int, heads: int, block, context: str) -> None:
    for q_len, kv_len in ((Q_LEN, KV_LEN), (KV_LEN, Q_LEN), (KV_LEN, KV_LEN)):
        ours = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", block)
        theirs = torch_create_block_mask(mask.mask_mod, batch, heads, q_len, kv_len, "cpu", block)
        oracle.assert_same_block_mask(ours, theirs, f"{context} q={q_len} kv={kv_len} {block}")


@pytest.mark.parametrize("block", [16, (32, 16)])
def test_insertion_order_trees_in_small_chunks(block, small_chunks):
    # Rows differ (and end at different places, one inside a block).
    trees = [insertion_tree(KV_LEN - 97 * r, seed=40 + r, sequences=5 + 4 * r) for r in range(3)]
    mask = flexmask.tree(trees)
    assert not any(mask.preorder)  # rank space
    _check(mask, 3, 2, block, f"insertion trees chunk={small_chunks}")


@pytest.mark.parametrize("block", [16, (16, 48)])
def test_preorder_trees_in_small_chunks(block, small_chunks):
    trees = [preorder_tree(KV_LEN - 61 * r, seed=50 + r) for r in range(3)]
    mask = flexmask.tree(trees)
    assert all(mask.preorder)  # the preorder path
    _check(mask, 3, 2, block, f"preorder trees chunk={small_chunks}")


def test_composed_union_in_small_chunks(small_chunks):
    docs = [[400, 333, 470], [900, 303], [KV_LEN]]
    mask = (
        flexmask.causal() & flexmask.document(docs) & flexmask.sliding_window(300)
    ) | flexmask.prefix(64)
    _check(mask, 3, 2, 16, f"composed chunk={small_chunks}")


def test_per_head_of_a_tree_and_a_window_in_small_chunks(small_chunks):
    trees = [insertion_tree(KV_LEN, seed=60, sequences=6), preorder_tree(KV_LEN - 200, seed=61)]
    mask = flexmask.per_head(flexmask.tree(trees), flexmask.causal() & flexmask.sliding_window(250))
    _check(mask, 2, 4, 16, f"per_head chunk={small_chunks}")


@pytest.mark.parametrize(("q_offset", "kv_offset"), [(300, 0), (517, 211), (0, 640)])
def test_insertion_order_tree_windows_in_small_chunks(q_offset, kv_offset, small_chunks):
    # A window's kv blocks start off the tree's first token: each block's least rank and
    # that token's subtree end are read in the window (lengths off the block size too).
    trees = [insertion_tree(KV_LEN, seed=70 + r, sequences=4 + 5 * r) for r in range(2)]
    mask = flexmask.tree(trees)
    q_len, kv_len = KV_LEN - q_offset, KV_LEN - kv_offset
    ours = flexmask.create_block_mask(
        mask, 2, 1, q_len, kv_len, "cpu", 16, q_offset=q_offset, kv_offset=kv_offset
    )
    theirs = oracle.torch_build(
        mask.mask_mod, 2, 1, q_len, kv_len, 16, q_offset=q_offset, kv_offset=kv_offset
    )
    oracle.assert_same_block_mask(ours, theirs, f"window q+{q_offset} kv+{kv_offset}")


def _chain_then_branches(length: int, prefix: int, interleaved: bool) -> list[int]:
    """A chain of ``prefix`` tokens, then two branches off its last token: one after the
    other (a preorder), or 16 tokens of each in turn (insertion order, not a preorder, whose
    blocks of 16 are each one run of ranks: the classifier's exact case)."""
    parents = [-1, *range(prefix - 1)]
    tips = [prefix - 1, prefix - 1]
    count = length - prefix
    for t in range(count):
        branch = (t // 16) % 2 if interleaved else int(t >= count // 2)
        parents.append(tips[branch])
        tips[branch] = len(parents) - 1
    return parents


@pytest.mark.parametrize("interleaved", [False, True], ids=["preorder", "insertion"])
def test_trees_whose_edge_tiles_are_demoted_in_small_chunks(interleaved, small_chunks):
    # Tiles of the last, incomplete q block row or kv block column that every in-range
    # element attends (a chain every later token descends from) are FULL in structure
    # and PARTIAL in torch's: each alone, and both.
    trees = [_chain_then_branches(1210 - 3 * r, 608 - 48 * r, interleaved) for r in range(2)]
    mask = flexmask.tree(trees)
    assert all(mask.preorder) != interleaved
    for q_len, kv_len in ((1520, 590), (1203, 1536), (1533, 1533)):
        ours = flexmask.create_block_mask(mask, 2, 1, q_len, kv_len, "cpu", 16)
        theirs = torch_create_block_mask(mask.mask_mod, 2, 1, q_len, kv_len, "cpu", 16)
        oracle.assert_same_block_mask(ours, theirs, f"edges q={q_len} kv={kv_len}")
