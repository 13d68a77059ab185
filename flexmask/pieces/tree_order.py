"""A tree's order: the preorder rank and subtree end of every token, from its parents.

kv is an ancestor-or-self of q iff ``rank[kv] <= rank[q] < end[kv]``: two O(N) lookups
answer the tree mask, and in preorder (``rank`` the position itself) whole tiles are
classified from per-block extremes of ``end`` (``flexmask.pieces.tree_tiles``).
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import Tensor

RUNS_FROM = 8
"""Rows whose tokens are at least this many per run of consecutive positions (chains: a
response's tokens each the parent of the next) take their ends from the runs
(``_ends_by_runs``); bushier rows keep the per-token search (``ranks_and_ends``)."""

_FEW_RUNS = 1 << 15
"""At most this many runs over all rows are searched at once (the search's table holds
``log2(runs)`` copies of them); more go row by row."""


def ranks_and_ends_rows(rows: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[bool]]:
    """``ranks_and_ends`` of every row (int64 parents, each row's roots -1), from the runs
    of consecutive positions of all rows at once where their tokens come in long runs.

    A token's subtree end is the first later token whose parent lies before it
    (``ranks_and_ends``); only a run's first token can be one (inside a run each token's
    parent is the token before it), so the search is over the runs, not the tokens
    (``_ends_by_runs``): per run, where its whole subtree ends, and per token, the first
    run hanging off an earlier token of its own run. The ends are constant between run
    starts and the tokens such runs hang off, so they are written as those pieces. An RL
    batch's trees (a prompt and its responses, each a run) at 131k tokens, B = 8: 56 runs,
    where the per-token search read 1M tokens 18 times (docs/costs.md, "A tree's order").
    A row is in preorder iff every run lies inside its parent's subtree (checked at run
    starts: a token inside a run lies inside its parent's, the token before it)."""
    sizes = [p.numel() for p in rows]
    total = sum(sizes)
    firsts, ups = [], []
    for p, n in zip(rows, sizes, strict=True):
        breaks = p != torch.arange(-1, n - 1, dtype=torch.int64)
        if n:
            breaks[0] = True  # a root at 0: its parent -1 is "the token before it"
        first = breaks.nonzero().squeeze(1)
        firsts.append(first)
        ups.append(p.index_select(0, first))
    counts = [f.numel() for f in firsts]
    if total == 0 or sum(counts) * RUNS_FROM > total or sum(counts) > _FEW_RUNS:
        return _by_row(rows)
    base = [0, *accumulate(sizes)]
    starts = torch.cat([f + b for f, b in zip(firsts, base, strict=False)])
    up = torch.cat([torch.where(u >= 0, u + b, -1) for u, b in zip(ups, base, strict=False)])
    end = _ends_by_runs(up, starts, total)
    # In preorder iff each run's first token lies inside its parent's subtree.
    hanging = up >= 0
    outside = hanging & (starts >= end.index_select(0, up.clamp(min=0)))
    run_row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(counts))
    bad = set(run_row[outside].tolist())
    ranks, ends, preorder = [], [], []
    for r, (p, n) in enumerate(zip(rows, sizes, strict=True)):
        if r in bad:
            rank, row_end = renumber(p)
        else:
            rank, row_end = torch.arange(n, dtype=torch.int64), end[base[r] : base[r + 1]] - base[r]
        ranks.append(rank)
        ends.append(row_end)
        preorder.append(r not in bad)
    return ranks, ends, preorder


def _by_row(rows: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[bool]]:
    ranks, ends, preorder = zip(*(ranks_and_ends(p) for p in rows), strict=True)
    return list(ranks), list(ends), list(preorder)


def _ends_by_runs(up: Tensor, starts: Tensor, n: int) -> Tensor:
    """Every token's first later token whose parent lies before it (``n`` if none), from
    the runs of consecutive positions of a forest of ``n`` tokens: each run's first token
    (``starts``, ascending, the first at 0) and its parent (``up``, -1 at a root). For
    token v of run r that is the earlier of:

    * where r's subtree ends: the first later run whose parent lies before r's first
      token (no run begins inside r after its first token, so none between r and v); a
      search over the runs (``_first_below``);
    * the first run hanging off a token of r before v (a child comes after its parent, so
      after v too): each such run marks the token after its parent, and the least mark
      so far along r holds from there to the next mark or run.

    Both change only at run starts and marks: the ends are written as those pieces."""
    runs = starts.numel()
    run_end = torch.cat([starts, starts.new_full((1,), n)]).index_select(
        0, _first_below(up, starts)
    )
    # Marks: a run hanging off token t of a run marks t + 1, where t + 1 is in that run.
    hanging = up >= 0
    parent, child = up[hanging], starts[hanging]
    after = parent + 1
    at = torch.searchsorted(starts, after)
    inside = (at >= runs) | (starts.index_select(0, at.clamp(max=runs - 1)) != after)
    after, child = after[inside], child[inside]
    # Pieces: the runs and the marks, by position; a mark at a run's start cannot occur.
    cuts = torch.cat([starts, after])
    value = torch.cat([starts.new_full((runs,), n), child])
    order = torch.argsort(cuts * (n + 1) + value)  # by position, the least mark first
    cuts, value = cuts[order], value[order]
    keep = torch.ones_like(cuts, dtype=torch.bool)
    keep[1:] = cuts[1:] != cuts[:-1]  # one piece per position: its least mark
    cuts, value = cuts[keep], value[keep]
    run = torch.searchsorted(starts, cuts, right=True) - 1
    # The least mark so far along each run (reset at each run: its values less r times a
    # bound above all of them), then the run's own subtree end.
    shift = run * (n + 1)
    least = value.sub(shift).cummin(0).values.add_(shift)
    piece = torch.minimum(least, run_end.index_select(0, run))
    length = torch.diff(cuts, append=cuts.new_full((1,), n))
    return torch.repeat_interleave(piece, length)


def _first_below(values: Tensor, limits: Tensor) -> Tensor:
    """Per index r: the first j > r with ``values[j] < limits[r]`` (``len(values)`` if none),
    by a sparse table of range minima and binary lifting: O(R log R)."""
    count = values.numel()
    levels = max(1, (count + 1).bit_length())
    padded = torch.full((count + 1 + (1 << levels),), -2, dtype=torch.int64)
    padded[:count] = values
    table = [padded]
    for k in range(1, levels):
        prev = table[-1]
        half = 1 << (k - 1)
        table.append(torch.minimum(prev[:-half], prev[half:]))
    index = torch.arange(count, dtype=torch.int64)
    pos = index + 1
    for k in range(levels - 1, -1, -1):
        stay = table[k][pos] >= limits
        pos = torch.where(stay, pos + (1 << k), pos)
    return pos.clamp(max=count)


def ranks_and_ends(parents: Tensor) -> tuple[Tensor, Tensor, bool]:
    """Preorder rank and subtree end (exclusive, in rank space) of every token.

    Fast path, vectorised: if the layout is already a preorder, the subtree of v is the run
    after v up to the first u > v with parents[u] < v; a sparse table of range minima and
    binary lifting find that u for all v in O(N log N). The layout is a preorder iff every
    token lies inside its parent's run. Otherwise an O(N) depth-first walk renumbers it.
    """
    v = torch.arange(parents.numel(), dtype=torch.int64)
    end = _first_below(parents, v)
    child = parents >= 0
    if bool((v[child] < end[parents[child]]).all()):
        return v, end, True
    return (*renumber(parents), False)


def renumber(parents: Tensor) -> tuple[Tensor, Tensor]:
    """Preorder rank and subtree end of a layout that is not a preorder (insertion order):
    an O(N) depth-first walk from the roots, children in position order."""
    n = parents.numel()
    parent_list = parents.tolist()
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for i, p in enumerate(parent_list):
        (children[p] if p >= 0 else roots).append(i)
    order: list[int] = []
    stack = roots[::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    size = [1] * n
    for i in range(n - 1, -1, -1):  # parents come before children
        if parent_list[i] >= 0:
            size[parent_list[i]] += size[i]
    rank = torch.empty(n, dtype=torch.int64)
    rank[torch.tensor(order)] = torch.arange(n)
    return rank, rank + torch.tensor(size)
