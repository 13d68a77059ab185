"""Trees in any parent-before-child layout (insertion order, BFS, random) are classified from
structure: whole-tensor equal to torch's build and to the dense oracle, with no tile evaluated,
over B and H > 1, per-row trees, offsets and block sizes that do not divide the lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.blocks.grid import make_grid
from flexmask.builders.classify import classify_blocks
from tests import oracle

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
    oracle.assert_same_block_mask(ours, oracle.torch_blocks(window, block), context)
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
        reference = oracle.torch_blocks(oracle.stack([dense, dense]), block)
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
    oracle.assert_same_block_mask(ours, oracle.torch_blocks(dense, 64), "tree")


def test_mixed_rows_preorder_and_not():
    """A batch whose rows mix a preorder tree and an insertion-order one."""
    pre = [-1, 0, 1, 2, 1, 4, 0, 6, 7]
    ins = [-1, 0, 1, 2, 1, 4, 2, 6, 3]  # 6 hangs off 2, after 1's other branch: not preorder
    mask = flexmask.tree([pre, ins])
    assert mask.preorder == [True, False]
    ours = flexmask.create_block_mask(mask, 2, 2, 12, 12, "cpu", (4, 2))
    dense = oracle.stack([oracle.tree(pre, 12, 12), oracle.tree(ins, 12, 12)], heads=2)
    oracle.assert_same_block_mask(ours, oracle.torch_blocks(dense, (4, 2)), "mixed")
