"""A tree's order: the preorder rank and subtree end of every token, from its parents.

kv is an ancestor-or-self of q iff ``rank[kv] <= rank[q] < end[kv]``: two O(N) lookups
answer the tree mask, and in preorder (``rank`` the position itself) whole tiles are
classified from per-block extremes of ``end`` (``flexmask.pieces.tree_tiles``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def ranks_and_ends(parents: Tensor) -> tuple[Tensor, Tensor, bool]:
    """Preorder rank and subtree end (exclusive, in rank space) of every token.

    Fast path, vectorised: if the layout is already a preorder, the subtree of v is the run
    after v up to the first u > v with parents[u] < v; a sparse table of range minima and
    binary lifting find that u for all v in O(N log N). The layout is a preorder iff every
    token lies inside its parent's run. Otherwise an O(N) depth-first walk renumbers it.
    """
    n = parents.numel()
    levels = max(1, (n + 1).bit_length())
    padded = torch.full((n + 1 + (1 << levels),), -2, dtype=torch.int64)
    padded[:n] = parents
    table = [padded]
    for k in range(1, levels):
        prev = table[-1]
        half = 1 << (k - 1)
        table.append(torch.minimum(prev[:-half], prev[half:]))
    v = torch.arange(n, dtype=torch.int64)
    pos = v + 1
    for k in range(levels - 1, -1, -1):
        stay_inside = table[k][pos] >= v
        pos = torch.where(stay_inside, pos + (1 << k), pos)
    end = pos.clamp(max=n)
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
