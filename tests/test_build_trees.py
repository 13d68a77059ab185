"""Tree masks built from structure, equal to torch's build as whole tensors.

Trees in any parent-before-child layout (insertion order, BFS, random) are classified from
structure: whole-tensor equal to torch's build and to the dense oracle, with no tile evaluated,
over B and H > 1, per-row trees, offsets and block sizes that do not divide the lengths.

The fast tree classifier (no sort unless a kv block spans several branches) against
torch's own ``create_block_mask``, whole tensors: AReaL-style insertion-order trees at B > 1
with lengths that are not a multiple of the block, and layouts that force the search of
sorted subtrees (kv blocks over several branches, q blocks whose ranks are not one run).

Trees in insertion order whose end cuts a block: the tree filling a length that is not a
multiple of the block size (the last kv and q blocks padded), or ending inside a block with
positions past it, per row at different places — whole tensors equal to torch's build, with
and without the search of sorted subtrees settling tiles, the tiles classified in one pass or
a chunk of q blocks at a time (as grids of over 256k tiles are).

Tree builds that reuse the piece's kept rank/end lookups (one length at a time, with the
device copies) and take each q block's least rank from one pass: against torch's own
``create_block_mask`` as whole tensors, across lengths in turn and after a pickle.
"""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.blocks.codes import UNDECIDED
from flexmask.builders import make_grid
from flexmask.builders.classify import classify_blocks
from tests import oracle
from tests.strategies import insertion_tree as _insertion_tree
from tests.strategies import preorder_tree

BLOCKS = st.sampled_from([16, 32, 128, (16, 8), (8, 32)])


@st.composite
def insertion_order(draw, max_tokens: int = 160) -> list[int]:
    """Sequences inserted one by one into a trie, tokens numbered as inserted (AReaL's
    layout): each sequence shares a prefix of an earlier one, then appends new tokens. Not a
    preorder as soon as a sequence branches off one that is not the last inserted."""
    parents: list[int] = []
    paths: list[list[int]] = []
    for _ in range(draw(st.integers(1, 8))):
        room = max_tokens - len(parents)
        if room <= 0:
            break
        path: list[int] = []
        if paths:
            base = paths[draw(st.integers(0, len(paths) - 1))]
            path = base[: draw(st.integers(0, len(base)))]
        for _ in range(draw(st.integers(1, min(room, 48)))):
            parents.append(path[-1] if path else -1)
            path.append(len(parents) - 1)
        paths.append(path)
    return parents


@st.composite
def any_order(draw, max_tokens: int = 160) -> list[int]:
    """Any parent-before-child array: mostly chains (runs of ``i - 1``) with random jumps."""
    n = draw(st.integers(1, max_tokens))
    chain = draw(st.floats(0.0, 1.0))
    jumps = draw(st.lists(st.integers(0, 1 << 30), min_size=n, max_size=n))
    return [-1] + [i - 1 if (j % 100) < chain * 100 else j % i for i, j in enumerate(jumps) if i]


def _offsets(draw, batch: int, span: int, name: str):
    if draw(st.booleans(), label=f"{name} per row"):
        return draw(st.lists(st.integers(0, span), min_size=batch, max_size=batch), label=name)
    return draw(st.integers(0, span), label=name)


def _rows(offset, batch: int) -> list[int]:
    return list(offset) if isinstance(offset, list) else [offset] * batch


@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.integers(1, 2),
    block=BLOCKS,
)
def test_trees_in_any_order_match_oracle_and_torch(data, batch, heads, block):
    layout = data.draw(st.sampled_from([insertion_order(), any_order()]))
    per_row = data.draw(st.booleans(), label="per row")
    trees = [data.draw(layout, label="parents") for _ in range(batch if per_row else 1)]
    longest = max(len(p) for p in trees)
    q_len = data.draw(st.integers(1, longest + 20), label="q_len")
    kv_len = data.draw(st.integers(1, longest + 20), label="kv_len")
    q_off = _offsets(data.draw, batch, 24, "q_offset")
    kv_off = _offsets(data.draw, batch, 24, "kv_offset")
    # The tree must fit the positions the build can reach.
    kv_len = max(kv_len, longest - max(_rows(kv_off, batch)))
    span = max(max(_rows(q_off, batch)) + q_len, max(_rows(kv_off, batch)) + kv_len)

    mask = flexmask.tree(trees if per_row else trees[0])
    window = np.zeros((batch, heads, q_len, kv_len), dtype=bool)
    for b in range(batch):
        whole = oracle.tree(trees[b if per_row else 0], span, span)
        qo, ko = _rows(q_off, batch)[b], _rows(kv_off, batch)[b]
        window[b, :] = whole[qo : qo + q_len, ko : ko + kv_len]
    ours = flexmask.create_block_mask(
        mask, batch, heads, q_len, kv_len, "cpu", block, q_offset=q_off, kv_offset=kv_off
    )
    context = f"{trees} q_offset={q_off} kv_offset={kv_off} block={block}"
    oracle.assert_same_block_mask(ours, oracle.torch_build(window, block=block), context)
    if q_off == 0 and kv_off == 0:
        theirs = torch_create_block_mask(mask.mask_mod, batch, heads, q_len, kv_len, "cpu", block)
        oracle.assert_same_block_mask(ours, theirs, context + " (torch on mask.mask_mod)")


@given(data=st.data(), block=BLOCKS)
def test_non_preorder_trees_in_expressions(data, block):
    """A non-preorder tree's exact codes feed ``&``, ``|`` and ``~`` like any piece's."""
    parents = data.draw(insertion_order(96), label="parents")
    n = len(parents)
    length = data.draw(st.integers(n, n + 40), label="length")
    tree, dense_tree = flexmask.tree(parents), oracle.tree(parents, length, length)
    prefix = data.draw(st.integers(0, length), label="prefix")
    window = data.draw(st.integers(1, length), label="window")
    cases = {
        "tree & causal": (tree & flexmask.causal(), dense_tree & oracle.causal(length, length)),
        "tree | prefix": (
            tree | flexmask.prefix(prefix),
            dense_tree | oracle.prefix(prefix, length, length),
        ),
        "tree & window": (
            tree & flexmask.sliding_window(window),
            dense_tree & oracle.sliding_window(window, length, length),
        ),
        "~tree": (~tree, ~dense_tree),
    }
    for name, (mask, dense) in cases.items():
        ours = flexmask.create_block_mask(mask, 2, 1, length, length, "cpu", block)
        reference = oracle.torch_build(oracle.stack([dense, dense]), block=block)
        oracle.assert_same_block_mask(ours, reference, f"{name} {parents} block={block}")


@pytest.mark.parametrize(
    "parents",
    [
        [-1] + [(i - 1) // 2 for i in range(1, 700)],  # BFS numbering of a binary heap
        [-1] + [i - 1 if i % 50 else i // 3 for i in range(1, 900)],  # runs branching back
    ],
    ids=["heap", "runs"],
)
def test_non_preorder_trees_need_no_evaluation(parents):
    mask = flexmask.tree(parents)
    assert mask.preorder == [False]
    n = len(parents)
    grid = make_grid(mask, 1, 1, n, n, "cpu", 64)
    assert classify_blocks(mask, grid).refined == 0
    ours = flexmask.create_block_mask(mask, 1, 1, n, n, "cpu", 64)
    dense = oracle.stack([oracle.tree(parents, n, n)])
    oracle.assert_same_block_mask(ours, oracle.torch_build(dense, block=64), "tree")


def test_mixed_rows_preorder_and_not():
    """A batch whose rows mix a preorder tree and an insertion-order one."""
    pre = [-1, 0, 1, 2, 1, 4, 0, 6, 7]
    ins = [-1, 0, 1, 2, 1, 4, 2, 6, 3]  # 6 hangs off 2, after 1's other branch: not preorder
    mask = flexmask.tree([pre, ins])
    assert mask.preorder == [True, False]
    ours = flexmask.create_block_mask(mask, 2, 2, 12, 12, "cpu", (4, 2))
    dense = oracle.stack([oracle.tree(pre, 12, 12), oracle.tree(ins, 12, 12)], heads=2)
    oracle.assert_same_block_mask(ours, oracle.torch_build(dense, block=(4, 2)), "mixed")


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
        reference = oracle.torch_build(oracle.stack([window]), block=16)
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
        reference = oracle.torch_build(oracle.stack([window]), block=16)
        oracle.assert_same_block_mask(ours, reference, f"offsets q={q_off} kv={kv_off}")


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
    trees = [_insertion_tree(n, seed=r, sequences=sequences) for r, n in enumerate(sizes)]
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
        return [_insertion_tree(n, seed=seed + r, sequences=sequences) for r, n in enumerate(sizes)]
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
        theirs = oracle.torch_build(
            mask.mask_mod, 2, 2, q_len, kv_len, 16, q_offset=q_offset, kv_offset=kv_offset
        )
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
        theirs = oracle.torch_build(
            mask.mask_mod, 3, 1, q_len, kv_len, (16, 8), q_offset=q_offset, kv_offset=kv_offset
        )
        oracle.assert_same_block_mask(ours, theirs, f"{layout} narrow={narrow} q={q_len}")


def test_a_tree_rebuilt_at_other_lengths_matches_torch_each_time():
    """The lookups depend on the length (padded past the tree): 700 -> 1000 -> 700 -> 1000
    must not reuse the other length's pair. Insertion order (rank space), rows that differ,
    lengths off the block, the last q block partly past the tree."""
    trees = [insertion_tree(650, seed=1, sequences=7), insertion_tree(611, seed=2, sequences=4)]
    mask = flexmask.tree(trees)
    for length in (700, 1000, 700, 1000):
        for q_len, kv_len in ((length, length), (length - 37, length)):
            ours = flexmask.create_block_mask(mask, 2, 2, q_len, kv_len, "cpu", 16)
            theirs = torch_create_block_mask(mask.mask_mod, 2, 2, q_len, kv_len, "cpu", 16)
            oracle.assert_same_block_mask(ours, theirs, f"q={q_len} kv={kv_len}")


def test_a_pickled_tree_leaves_its_lookups_behind_and_still_matches_torch():
    parents = insertion_tree(500, seed=3, sequences=6)
    mask = flexmask.tree(parents)
    flexmask.create_block_mask(mask, 1, 1, 512, 512, "cpu", 32)
    blob = pickle.dumps(mask)
    assert len(blob) < len(pickle.dumps(flexmask.tree(parents))) + 64  # no lookups in it
    again = pickle.loads(blob)
    ours = flexmask.create_block_mask(again, 1, 1, 512, 512, "cpu", 32)
    theirs = torch_create_block_mask(again.mask_mod, 1, 1, 512, 512, "cpu", 32)
    oracle.assert_same_block_mask(ours, theirs, "after pickle")


def test_blocks_wholly_past_a_short_tree_list_nothing():
    """A tree shorter than the sequence by several blocks: those q blocks' least rank is a
    position past the tree (no padding to hide it), and torch lists nothing for them."""
    parents = [-1, 0, 1, 1, 0, 4, 2, 6] * 1 + list(range(7, 7 + 90))
    mask = flexmask.tree([parents, insertion_tree(300, seed=4, sequences=3)])
    for q_len in (256, 300):
        ours = flexmask.create_block_mask(mask, 2, 1, q_len, 300, "cpu", 16)
        theirs = torch_create_block_mask(mask.mask_mod, 2, 1, q_len, 300, "cpu", 16)
        oracle.assert_same_block_mask(ours, theirs, f"short tree q={q_len}")
        assert (
            int(ours.kv_num_blocks[0, 0, 10:].sum() + ours.full_kv_num_blocks[0, 0, 10:].sum()) == 0
        )
