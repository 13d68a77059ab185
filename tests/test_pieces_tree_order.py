"""A tree's order (``flexmask.pieces.tree_order``): every row's preorder rank and subtree end,
from the runs of consecutive positions of all rows at once (``ranks_and_ends_rows``) or
token by token (``ranks_and_ends``), against a plain depth-first walk written here: the
preorder (children in position order) numbers each token, a subtree is every token below
it, and a row is in preorder iff the walk visits its tokens in position order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexmask.pieces import tree_order
from tests.strategies import preorder_tree


def _walk(parents: list[int]) -> tuple[list[int], list[int], bool]:
    """(rank, end, in preorder) by a recursive-free depth-first walk from the roots."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        (children[p] if p >= 0 else roots).append(i)
    rank, size, order = [0] * n, [1] * n, []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    for i in reversed(order):  # children before their parents
        for c in children[i]:
            size[i] += size[c]
    for r, node in enumerate(order):
        rank[node] = r
    return rank, [rank[i] + size[i] for i in range(n)], order == list(range(n))


@st.composite
def rows_of_trees(draw) -> list[list[int]]:
    """1-4 rows, each a preorder tree, sequences inserted into a trie (insertion order),
    a chain, roots only, or any parent-before-child array; 1-200 tokens."""
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 200))
        kind = draw(st.sampled_from(["preorder", "insertion", "chain", "roots", "any"]))
        if kind == "preorder":
            rows.append(preorder_tree(n, draw(st.integers(0, 10**6))))
        elif kind == "chain":
            rows.append([-1, *range(n - 1)])
        elif kind == "roots":
            rows.append([-1] * n)
        elif kind == "any":
            picks = draw(st.lists(st.integers(0, 1 << 20), min_size=n, max_size=n))
            rows.append([-1] + [i - 1 if x % 3 else x % i for i, x in enumerate(picks) if i])
        else:
            parents: list[int] = []
            paths: list[list[int]] = []
            while len(parents) < n:
                path: list[int] = []
                if paths:
                    base = paths[draw(st.integers(0, len(paths) - 1))]
                    path = base[: draw(st.integers(0, len(base)))]
                for _ in range(draw(st.integers(1, n - len(parents)))):
                    parents.append(path[-1] if path else -1)
                    path.append(len(parents) - 1)
                paths.append(path)
            rows.append(parents)
    return rows


@pytest.mark.parametrize("runs_from", [1, tree_order.RUNS_FROM], ids=["runs", "default"])
@given(rows=rows_of_trees())
def test_every_rows_order_is_the_walks(runs_from, rows):
    tensors = [torch.tensor(p, dtype=torch.int64) for p in rows]
    before = tree_order.RUNS_FROM
    tree_order.RUNS_FROM = runs_from  # 1: every batch from its runs, however bushy
    try:
        ranks, ends, preorder = tree_order.ranks_and_ends_rows(tensors)
    finally:
        tree_order.RUNS_FROM = before
    for r, parents in enumerate(rows):
        rank, end, in_preorder = _walk(parents)
        assert ranks[r].tolist() == rank, f"row {r}"
        assert ends[r].tolist() == end, f"row {r}"
        assert preorder[r] == in_preorder, f"row {r}"
        one = tree_order.ranks_and_ends(tensors[r])
        assert (one[0].tolist(), one[1].tolist(), one[2]) == (rank, end, in_preorder)


def test_long_chains_take_the_runs(monkeypatch):
    """A prompt and its responses, each a run: the runs path, not the per-token search."""
    searched = []
    monkeypatch.setattr(tree_order, "ranks_and_ends", lambda p: searched.append(p))
    prompt, responses = 300, [200, 150, 400]
    parents = [-1, *range(prompt - 1)]
    for length in responses:
        parents += [prompt - 1, *range(len(parents), len(parents) + length - 1)]
    ranks, ends, preorder = tree_order.ranks_and_ends_rows([torch.tensor(parents)] * 2)
    assert searched == [] and preorder == [True, True]
    rank, end, _ = _walk(parents)
    assert ranks[1].tolist() == rank and ends[1].tolist() == end


def test_lowerings_keep_the_runs_and_lower_the_same(monkeypatch):
    """The rows' runs (``tree_lines.forest_runs``) are made once per tree, at its first
    lowering, and kept with its lookups: a second lowering reads them and cuts the same
    slices, and a fresh tree of the same parents cuts them too."""
    import sys

    import flexmask
    from flexmask.formats import to_magi

    tree_module = sys.modules["flexmask.pieces.tree"]
    made = []
    real = tree_module.forest_runs

    def counted(parents):
        made.append(len(parents))
        return real(parents)

    monkeypatch.setattr(tree_module, "forest_runs", counted)
    rows = [preorder_tree(40000, seed) for seed in range(2)]  # 80k lines: the stretches
    mask = flexmask.tree(rows)
    first, again = to_magi(mask, 2, None, 40000, 40000), to_magi(mask, 2, None, 40000, 40000)
    fresh = to_magi(flexmask.tree(rows), 2, None, 40000, 40000)
    assert made == [2, 2]  # once per tree
    for other in (again, fresh):
        assert torch.equal(first.q_ranges, other.q_ranges)
        assert torch.equal(first.k_ranges, other.k_ranges)
        assert torch.equal(first.attn_type_map, other.attn_type_map)
