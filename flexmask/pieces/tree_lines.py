"""A tree's lines for the lowerings (``Tree.lines_at``): each query's ancestors as runs of
consecutive positions, root first; transposed, each key's subtree, one run in preorder."""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.algebra import INF, UNUSED


def tree_lines(
    parents: list[Tensor], ends: list[Tensor], pos: Tensor, transpose: bool, few_runs: int
) -> tuple[Tensor, Tensor]:
    """(R, N, k) intervals of the tree at absolute line positions ``pos`` ((R, N)): the
    ancestor runs of each query, or (``transpose``, laid out in preorder) the subtree of
    each key, ``[key, end - 1]``. Ancestor runs are sorted, disjoint and non-adjacent, unused
    slots last at ``(UNUSED, -UNUSED)``; their tables are built from Python lists for trees
    of at most ``few_runs`` runs (a few list operations per run cost less than the ~60 torch
    calls of the vectorized build), with torch ops for more."""
    rows = []
    for r in range(max(len(parents), pos.shape[0])):
        tree_row = min(r, len(parents) - 1)
        p = pos[min(r, pos.shape[0] - 1)]
        if transpose:
            n = parents[tree_row].numel()
            inside = (p >= 0) & (p < n)
            end = ends[tree_row][p.clamp(0, n - 1)]
            rows.append((torch.where(inside, p, INF), torch.where(inside, end - 1, -INF)))
            continue
        rows.append(ancestor_runs(parents[tree_row], p, few_runs))
    if transpose:
        lo = torch.stack([r[0] for r in rows])
        hi = torch.stack([r[1] for r in rows])
        return lo.unsqueeze(-1), hi.unsqueeze(-1)
    if len(rows) == 1:
        return rows[0][0].unsqueeze(0), rows[0][1].unsqueeze(0)
    # Slot-major like each row's (see ancestor_runs), viewed as (R, N, width).
    width = max(r[0].shape[-1] for r in rows)
    lo = torch.full((len(rows), width, pos.shape[-1]), UNUSED, dtype=torch.int64)
    hi = torch.full((len(rows), width, pos.shape[-1]), -UNUSED, dtype=torch.int64)
    for r, (row_lo, row_hi) in enumerate(rows):
        lo[r, : row_lo.shape[-1]] = row_lo.t()
        hi[r, : row_hi.shape[-1]] = row_hi.t()
    return lo.transpose(1, 2), hi.transpose(1, 2)


def ancestor_runs(parents: Tensor, pos: Tensor, few_runs: int) -> tuple[Tensor, Tensor]:
    """(N, D) the ancestors of the nodes at positions ``pos`` (>= 0; itself included) as runs
    of consecutive positions, root first, (UNUSED, -UNUSED) after them and for positions past
    the tree.

    A run continues while a token's parent is the token before it (so runs are disjoint and
    non-adjacent, and root first is sorted: what a lowering keeps without sorting). Every
    node of a run has the same ancestors outside it, so the chains are followed once per run
    (a shared-prefix tree has a few runs per group), then read per line.
    """
    n = parents.numel()
    breaks = parents != torch.arange(-1, n - 1)
    breaks[0] = True
    start = breaks.nonzero().view(-1)
    runs = start.numel()
    # The run of each node, and a last, empty one for positions past the tree.
    run = torch.cat([breaks.cumsum(0) - 1, start.new_full((1,), runs)])
    up = parents[start].to(torch.int64)  # the last ancestor before each run, -1 at a root
    if runs <= few_runs:
        table_lo, table_hi = _run_tables_listed(start, up, run, n)
    else:
        table_lo, table_hi = _run_tables(start, up, run, n)
    width = table_lo.shape[1]
    # Read per line slot-major ((width, N), then viewed as (N, width)): a lowering walks each
    # slot along the lines, and flat 1-d reads are the cheapest gathers here. A line's own
    # run ends at the line (the table holds the run's last node): every other slot ends
    # before it, so one minimum writes it.
    at = pos.clamp(max=n)
    flat = run.index_select(0, at) + (runs + 1) * torch.arange(width).view(-1, 1)
    lo = table_lo.t().reshape(-1).index_select(0, flat.view(-1)).view(width, -1)
    hi = table_hi.t().reshape(-1).index_select(0, flat.view(-1)).view(width, -1)
    return lo.t(), torch.minimum(hi, at).t()


def _run_tables(start: Tensor, up: Tensor, run: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Per run (and a last, empty one for positions past the tree): its ancestor runs root
    first, then itself up to its last node, as ``(runs + 1, width)`` lo and hi."""
    chain_lo, chain_hi = [], []
    depth = torch.zeros_like(start)
    node = up
    while bool((node >= 0).any()):  # nearest ancestor run first
        alive = node >= 0
        above = run[node.clamp(min=0)]
        chain_lo.append(torch.where(alive, start[above], UNUSED))
        chain_hi.append(torch.where(alive, node, -UNUSED))
        depth += alive
        node = torch.where(alive, up[above], -1)
    width = len(chain_lo) + 1
    end = torch.cat([start[1:], start.new_full((1,), n)]) - 1
    table_lo = torch.stack([*chain_lo, torch.full_like(start, UNUSED)], -1)
    table_hi = torch.stack([*chain_hi, torch.full_like(start, -UNUSED)], -1)
    slot = torch.arange(width)
    own = depth.view(-1, 1)
    index = torch.where(slot < own, own - 1 - slot, width - 1)
    table_lo = torch.where(slot == own, start.view(-1, 1), table_lo.gather(1, index))
    table_hi = torch.where(slot == own, end.view(-1, 1), table_hi.gather(1, index))
    return (
        torch.cat([table_lo, torch.full((1, width), UNUSED)]),
        torch.cat([table_hi, torch.full((1, width), -UNUSED)]),
    )


def _run_tables_listed(start: Tensor, up: Tensor, run: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``_run_tables`` from Python lists: a run's ancestors are those of the run holding its
    parent, then that run up to the parent (runs are numbered in position order, so that
    run's chain is already made)."""
    starts, ups = start.tolist(), up.tolist()
    ends = [s - 1 for s in starts[1:]] + [n - 1]
    holder = run.index_select(0, up.clamp(min=0)).tolist()
    chains: list[list[tuple[int, int]]] = []
    for parent, r in zip(ups, holder, strict=True):
        chains.append([] if parent < 0 else [*chains[r], (starts[r], parent)])
    width = max(len(c) for c in chains) + 1
    lo_rows, hi_rows = [], []
    for chain, first, last in zip(chains, starts, ends, strict=True):
        pad = width - 1 - len(chain)
        lo_rows.append([a for a, _ in chain] + [first] + [UNUSED] * pad)
        hi_rows.append([b for _, b in chain] + [last] + [-UNUSED] * pad)
    lo_rows.append([UNUSED] * width)
    hi_rows.append([-UNUSED] * width)
    return torch.tensor(lo_rows), torch.tensor(hi_rows)
