"""A tree's lines for the lowerings (``Tree.lines_at``): each query's ancestors as runs of
consecutive positions, root first; transposed, each key's subtree, one run in preorder."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.algebra import INF, UNUSED, pick


def tree_lines(
    parents: list[Tensor],
    ends: list[Tensor],
    pos: Tensor,
    transpose: bool,
    few_runs: int,
    runs: Runs | None = None,
) -> tuple[Tensor, Tensor]:
    """(R, N, k) intervals of the tree at absolute line positions ``pos`` ((R, N)): the
    ancestor runs of each query, or (``transpose``, laid out in preorder) the subtree of
    each key, ``[key, end - 1]``. Ancestor runs are sorted, disjoint and non-adjacent, unused
    slots last at ``(UNUSED, -UNUSED)``; their tables are built from Python lists for trees
    of at most ``few_runs`` runs (a few list operations per run cost less than the ~60 torch
    calls of the vectorized build), with torch ops for more.

    Every row at once: the rows' trees laid end to end as one forest (each row's roots stay
    roots), each row's lines read at its own offset, so the reads are one pass, not one per
    row (a lowering's ~30 small torch calls a row cost more than the reads). ``runs``: the
    forest's runs (``forest_runs``) where the caller keeps them."""
    rows = max(len(parents), pos.shape[0])
    if not transpose and pos.shape[-1] * 4 > max(p.numel() for p in parents):
        return _row_by_row(parents, pos, rows, few_runs)
    sizes = torch.tensor([p.numel() for p in parents])
    base = sizes.cumsum(0) - sizes
    total = int(sizes.sum())
    tree_row = torch.arange(rows).clamp(max=len(parents) - 1)
    p = pos.expand(rows, -1)
    inside = (p >= 0) & (p < sizes[tree_row].view(-1, 1))
    offset = base[tree_row].view(-1, 1)
    at = torch.where(inside, p + offset, total)  # past a row's tree: past the forest
    if transpose:
        end = torch.cat([e + b for e, b in zip(ends, base.tolist(), strict=True)])
        last = torch.cat([end, end.new_full((1,), total)]).index_select(0, at.view(-1)) - 1
        lo = torch.where(inside, p, INF)
        hi = torch.where(inside, last.view(at.shape) - offset, -INF)
        return lo.unsqueeze(-1), hi.unsqueeze(-1)
    lo, hi = ancestor_runs(runs or _runs(parents, base), at.view(-1), total, few_runs)
    if len(parents) > 1:  # back to each row's positions (slot-major: contiguous passes)
        real = lo <= hi
        shift = offset.expand(rows, pos.shape[-1]).reshape(-1)
        lo, hi = pick(real, lo - shift, UNUSED), pick(real, hi - shift, -UNUSED)
    # Slot-major, viewed as (R, N, width).
    width = lo.shape[0]
    return lo.t().reshape(rows, -1, width), hi.t().reshape(rows, -1, width)


def _row_by_row(
    parents: list[Tensor], pos: Tensor, rows: int, few_runs: int
) -> tuple[Tensor, Tensor]:
    """``tree_lines`` of lines that are most of a tree's positions (every query of a
    window): each row's own runs read at its own positions, the run of every position one
    cumulative count (a search per line costs more where every line is asked about)."""
    found = []
    for r in range(rows):
        tree = parents[min(r, len(parents) - 1)]
        n = tree.numel()
        breaks = tree != torch.arange(-1, n - 1)
        breaks[0] = True
        start = breaks.nonzero().view(-1)
        runs = Runs(start, tree.index_select(0, start).to(torch.int64))
        run = torch.cat([breaks.cumsum(0) - 1, torch.tensor([start.numel()])])
        p = pos[min(r, pos.shape[0] - 1)]
        at = p.clamp(max=n)  # positions are >= 0; past the tree, its last (empty) run
        found.append(ancestor_runs(runs, at, n, few_runs, run.index_select(0, at)))
    width = max(lo.shape[0] for lo, _ in found)
    lo = torch.full((rows, width, pos.shape[-1]), UNUSED, dtype=torch.int64)
    hi = torch.full((rows, width, pos.shape[-1]), -UNUSED, dtype=torch.int64)
    for r, (row_lo, row_hi) in enumerate(found):
        lo[r, : row_lo.shape[0]] = row_lo
        hi[r, : row_hi.shape[0]] = row_hi
    return lo.transpose(1, 2), hi.transpose(1, 2)


class Runs(NamedTuple):
    """The runs of the rows' trees laid end to end (``tree_lines``): where each starts and
    the last ancestor before it (-1 at a root), in the forest's positions."""

    start: Tensor
    up: Tensor


def forest_runs(parents: list[Tensor]) -> Runs:
    """The runs of the rows' trees laid end to end (``tree_lines``, ``tree_breaks``): what
    a tree keeps for its lowerings, which read them twice each (its lines and where they
    change)."""
    sizes = torch.tensor([p.numel() for p in parents])
    return _runs(parents, sizes.cumsum(0) - sizes)


def _runs(parents: list[Tensor], base: Tensor) -> Runs:
    """A run continues while a token's parent is the token before it; each row's first
    token starts one. One comparison per token, no per-token offsets (only the runs' own
    parents are moved to the forest's positions)."""
    longest = max(p.numel() for p in parents)
    before = torch.arange(-1, longest - 1)
    breaks = torch.cat([p != before[: p.numel()] for p in parents])
    breaks[base[base < breaks.numel()]] = True
    start = breaks.nonzero().view(-1)
    up = torch.cat(parents).index_select(0, start).to(torch.int64)
    if len(parents) > 1:
        row = torch.searchsorted(base, start, right=True) - 1
        up = torch.where(up >= 0, up + base[row], -1)
    return Runs(start, up)


def tree_breaks(
    parents: list[Tensor], ends: list[Tensor] | None, runs: Runs | None = None
) -> Tensor:
    """``(R, D)`` the positions where a tree's lines change shape (``Tree.line_breaks``),
    padded with ``INF``: where a run starts (its ancestors outside the run change) or,
    transposed (``ends`` given, laid out in preorder), where the subtree end changes; and
    each row's length (past the tree, none). Every row at once, as ``tree_lines`` reads.
    ``runs``: the forest's runs (``forest_runs``) where the caller keeps them."""
    sizes = torch.tensor([p.numel() for p in parents])
    base = sizes.cumsum(0) - sizes
    if ends is None:
        at = (runs or _runs(parents, base)).start
    else:
        # Each row's first column starts a stretch; then where the subtree end changes.
        first = torch.ones(1, dtype=torch.bool)
        change = torch.cat([torch.cat([first, e[1:] != e[:-1]]) for e in ends])
        at = change.nonzero().view(-1)
    row = torch.searchsorted(base, at, right=True) - 1
    if len(parents) == 1:
        return torch.cat([at, sizes]).view(1, -1)
    # Each row's breaks, then its size (past its tree), in one (R, D) table.
    local = torch.cat([at - base[row], sizes])
    row = torch.cat([row, torch.arange(len(parents))])
    counts = torch.bincount(row, minlength=len(parents))
    order = torch.argsort(row, stable=True)
    row, local = row[order], local[order]
    out = torch.full((len(parents), int(counts.max())), INF, dtype=torch.int64)
    out[row, torch.arange(row.numel()) - (counts.cumsum(0) - counts)[row]] = local
    return out


def ancestor_runs(
    runs: Runs, pos: Tensor, n: int, few_runs: int, run: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(D, N) (slot-major) the ancestors of the nodes at positions ``pos`` (>= 0, ``n``
    past the tree; itself included) as runs of consecutive positions, root first, (UNUSED,
    -UNUSED) after them and for positions past the tree.

    Runs are disjoint and non-adjacent, and root first is sorted: what a lowering keeps
    without sorting. Every node of a run has the same ancestors outside it, so the chains
    are followed once per run (a shared-prefix tree has a few runs per group), then read
    per line. ``run``: the run of each position, where the caller has it.
    """
    start, up = runs
    count = start.numel()
    if count <= few_runs:
        table_lo, table_hi = _run_tables_listed(start, up, n)
    else:
        table_lo, table_hi = _run_tables(start, up, n)
    width = table_lo.shape[1]
    # Read per line slot-major ((width, N), then viewed as (N, width)): a lowering walks each
    # slot along the lines, and flat 1-d reads are the cheapest gathers here. A line's own
    # run ends at the line (the table holds the run's last node): every other slot ends
    # before it, so one minimum writes it. Past the tree: the last, empty run.
    at = pos.clamp(max=n)
    if run is None:  # the run of each line, given or searched
        run = torch.where(at < n, _run_of(start, at), count)
    flat = run + (count + 1) * torch.arange(width).view(-1, 1)
    lo = table_lo.t().reshape(-1).index_select(0, flat.view(-1)).view(width, -1)
    hi = table_hi.t().reshape(-1).index_select(0, flat.view(-1)).view(width, -1)
    return lo, torch.minimum(hi, at)


def _run_of(start: Tensor, pos: Tensor) -> Tensor:
    """The run holding each position (``>= 0``, inside the tree)."""
    return torch.searchsorted(start, pos.contiguous(), right=True) - 1


def _run_tables(start: Tensor, up: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Per run (and a last, empty one for positions past the tree): its ancestor runs root
    first, then itself up to its last node, as ``(runs + 1, width)`` lo and hi."""
    chain_lo, chain_hi = [], []
    depth = torch.zeros_like(start)
    node = up
    while bool((node >= 0).any()):  # nearest ancestor run first
        alive = node >= 0
        above = _run_of(start, node.clamp(min=0))
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


def _run_tables_listed(start: Tensor, up: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``_run_tables`` from Python lists: a run's ancestors are those of the run holding its
    parent, then that run up to the parent (runs are numbered in position order, so that
    run's chain is already made)."""
    starts, ups = start.tolist(), up.tolist()
    ends = [s - 1 for s in starts[1:]] + [n - 1]
    holder = _run_of(start, up.clamp(min=0)).tolist()
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
