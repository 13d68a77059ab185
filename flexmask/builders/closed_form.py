"""BlockMask tensors in closed form for masks whose queries each attend one kv interval.

An ``&`` of interval pieces (causal, document, sliding window, chunked, prefix, padding,
full, empty, and ``|``-unions of causal, prefix and full such as the prefix-LM
``causal() | prefix(n)``, whose intervals all start at key 0, or of causal or full with spans
such as text with images ``causal() | spans(ids)``, proved in ``flexmask.algebra.mask.Or``) gives
query ``q`` of each batch row one kv interval
``[lo(q), hi(q)]``. Each of these pieces declares (``Piece.interval_shape``, read through
``Mask.has_monotone_intervals``) that, on a prefix of the positions (its domain; past it the
piece attends nowhere),

* ``lo`` never decreases and ``lo(q) <= q``, and
* ``hi`` never decreases and is either ``>= q`` or constant.

Then, along each batch row of their intersection (also after clipping to ``[0, KV_LEN)``):

1. the queries that attend somewhere are a prefix: a query attends nowhere only when ``lo``
   exceeds a constant ``hi`` (a ``hi >= q`` can't be below ``lo <= q``), and ``lo`` grows;
2. ``lo`` and ``hi`` never decrease over that prefix (a max and a min of such functions);
3. consecutive intervals touch: ``lo(q + 1) <= q + 1 <= hi(q) + 1`` for a ``hi >= q``, and
   ``lo(q + 1) <= hi(q + 1) = hi(q)`` for a constant one.

So for the q block ``i`` with queries ``a..z``, its non-empty tiles are one run — the union of
touching monotone intervals is ``[lo(a), hi(last attending query)]`` — and its full tiles are
another — the complete tiles inside ``[max lo, min hi] = [lo(z), hi(a)]``, when every query
attends and the block is complete. The runs' ends never decrease down the block rows, so each
kv column's blocks are runs too, found by binary search. The whole BlockMask follows from the
intervals at the two edge queries of every q block: no tile grid, no ranking, no evaluation,
and the work is O(rows x blocks) plus writing the output.

``tests/test_build_closed_form.py`` checks the three properties on every query of random
intersections, and the tensors against torch's ``create_block_mask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.algebra import Mask
from flexmask.blocks import BlockGrid, Ordered, expand_runs, index_tensors, side_by_side


class Runs(NamedTuple):
    """Per block row ``(R, n)``: the run ``[first, last]`` of non-empty blocks and the run
    ``[full_first, full_last]`` of full blocks inside it (empty when first > last). All four
    never decrease along ``n``."""

    first: Tensor
    last: Tensor
    full_first: Tensor
    full_last: Tensor


def clipped(mask: Mask, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> tuple[Tensor, Tensor]:
    """The mask's interval at each query, clipped to the grid's kv window ``[k0, k1]``.

    Both bounds never decrease over all the window's queries, those that attend nowhere
    included: a query past the prefix that attends (its own interval empty, such as a piece's
    ``[1, 0]`` past the documents or the padding) gets the empty ``[k1 + 1, k1]``, and ``lo``
    is capped at ``k1 + 1``. So ``hi >= k0`` holds on a suffix of the queries
    (``special_blocks`` finds where it begins): a past query's own ``[1, 0]`` would read as
    "hi still below k0" and hide a block whose attending queries all lie inside it.
    """
    lo, hi = mask.intervals_at(q_idx, row, grid)  # type: ignore[misc]
    shape = q_idx.shape
    k0, k1 = grid.kv_offset, grid.kv_end - 1
    past = (lo > hi).expand(shape)
    lo = torch.where(past, k1 + 1, lo.clamp(min=k0).clamp(max=k1 + 1).expand(shape))
    hi = torch.where(past, k1, hi.clamp(max=k1).expand(shape))
    return lo, hi


def special_blocks(
    lo_a: Tensor, hi_a: Tensor, lo_z: Tensor, hi_z: Tensor, start: int | Tensor
) -> Tensor:
    """``(..., rows, 1 or 2)``: per row, the blocks whose queries may attend only in part,
    from the clipped intervals at every block's first and last query (``(..., rows, nq)``) and
    the kv window's start (the block where ``hi`` first reaches it may begin late).

    argmax: the first such block, 0 if none — any block evaluated query by query is exact,
    so a spare one costs nothing but its work.
    """
    stops = ((lo_a <= hi_a) & (lo_z > hi_z)).to(torch.int8).argmax(-1, keepdim=True)
    if isinstance(start, int) and start == 0:
        return stops  # kv from 0: the attending queries are a prefix, no block begins late
    begins = (hi_z >= start).to(torch.int8).argmax(-1, keepdim=True)
    return torch.cat([begins, stops], -1)


def row_runs(mask: Mask, grid: BlockGrid, *, in_range: bool = False) -> Runs:
    """The runs of every q block row of a mask with monotone intervals, from the intervals
    of each block's first and last query, and of every query of two blocks per row: where
    the attending queries begin and where they end.

    Full runs are torch's by default: complete tiles only (torch pads the last tile row and
    column with masked elements). With ``in_range`` a tile is full when every element inside
    the lengths attends, incomplete edge tiles included: the codes ``classify`` combines
    with other codes (a ``~`` turns such a full edge tile empty, where torch's demoted
    partial one would stay partial); it demotes the edge tiles once, at the end.

    Clipped to the grid's kv window ``[k0, k1]``, the queries that attend are a range, not
    only a prefix: ``hi >= k0`` holds on a suffix (hi never decreases), ``lo <= hi`` and
    ``lo <= k1`` on a prefix. Inside that range the clipped intervals stay monotone and
    touching. So a block whose edge queries both attend is attended by all its queries; only
    the block where ``hi`` first reaches ``k0`` and the first block whose last query stops
    attending can be cut inside — those two are evaluated query by query.
    """
    dev = grid.device
    nq, nkv, kb, qb = grid.num_q_blocks, grid.num_kv_blocks, grid.kv_block, grid.q_block
    rows, _ = grid.reduced(mask)
    first_q = grid.q_first.view(-1, nq).expand(rows, nq)  # per-row offsets: (B, nq)
    last_q = grid.q_last.view(-1, nq).expand(rows, nq)
    row = torch.arange(rows, device=dev).view(rows, 1)
    lo, hi = clipped(mask, torch.cat([first_q, last_q], 1), row, grid)
    lo_a, lo_z = lo[:, :nq], lo[:, nq:]
    hi_a, hi_z = hi[:, :nq], hi[:, nq:]
    a_attends, z_attends = lo_a <= hi_a, lo_z <= hi_z
    special = special_blocks(lo_a, hi_a, lo_z, hi_z, grid.kv_offset)
    count = special.shape[1]
    inside = first_q.gather(1, special).unsqueeze(-1) + torch.arange(qb, device=dev)
    q_end = grid.q_end.view(-1, 1, 1) if isinstance(grid.q_end, Tensor) else grid.q_end
    inside = inside.clamp(max=q_end - 1).view(rows, count * qb)  # repeats the last query
    lo_in, hi_in = (t.view(rows, count, qb) for t in clipped(mask, inside, row, grid))
    attends = lo_in <= hi_in
    first_in = attends.to(torch.int8).argmax(-1, keepdim=True)
    last_in = (qb - 1) - attends.flip(-1).to(torch.int8).argmax(-1, keepdim=True)
    some = a_attends.scatter(1, special, attends.any(-1))
    every = (a_attends & z_attends).scatter(1, special, attends.all(-1))
    lo_first = lo_a.scatter(1, special, lo_in.gather(-1, first_in).squeeze(-1))
    hi_reach = hi_z.scatter(1, special, hi_in.gather(-1, last_in).squeeze(-1))
    # Empty rows before the attending range get the empty run [0, -1], those after it
    # [nkv, nkv - 1]: run ends then never decrease down the rows (``column_runs``).
    before = some.cumsum(1) == 0
    first = torch.where(some, grid.kv_tile(lo_first), torch.where(before, 0, nkv))
    last = torch.where(some, grid.kv_tile(hi_reach), torch.where(before, -1, nkv - 1))
    # Full: tiles inside [lo(z), hi(a)], in complete blocks whose queries all attend. As hi
    # is clipped below the grid's kv end, the last tile counts only if it is complete
    # (in range: also when incomplete, if hi(a) reaches the kv end).
    complete = every if in_range else every & (first_q + qb <= grid.q_end)
    before = complete.cumsum(1) == 0
    full_first = grid.kv_tile(lo_z + (kb - 1))
    full_last = grid.kv_tile(hi_a + 1).sub_(1)
    if in_range:
        full_last = torch.where(hi_a >= grid.kv_end - 1, nkv - 1, full_last)
    full_first = torch.where(complete, full_first, torch.where(before, 0, nkv))
    full_last = torch.where(complete, full_last, torch.where(before, -1, nkv - 1))
    return Runs(first, last, full_first, full_last)


def _rows_contiguous(target: Tensor) -> bool:
    """True if each row ``target[r]`` of an ``(R, n, m)`` tensor is contiguous."""
    _, n, m = target.shape
    return (m <= 1 or target.stride(2) == 1) and (n <= 1 or target.stride(1) == m)


def column_runs(runs: Runs, grid: BlockGrid) -> Runs:
    """The same runs down each kv block column: block row i is in column j's non-empty run
    iff ``first[i] <= j <= last[i]``; both bounds never decrease in i, so the rows that
    qualify are a range found by two binary searches (likewise for the full run)."""
    rows = runs.first.shape[0]
    j = torch.arange(grid.num_kv_blocks, device=grid.device).expand(rows, -1).contiguous()
    first = torch.searchsorted(runs.last.contiguous(), j)
    last = torch.searchsorted(runs.first.contiguous(), j, right=True).sub_(1)
    full_first = torch.searchsorted(runs.full_last.contiguous(), j)
    full_last = torch.searchsorted(runs.full_first.contiguous(), j, right=True).sub_(1)
    return Runs(first, last, full_first, full_last)


def line_runs(runs: Runs, m: int) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Every line written whole, in torch's order: the set blocks ascending, then the unset
    ones ascending (what ``torch.argsort(dense, descending=True, stable=True)`` gives).

    Returns ``(partial_starts, partial_lens)``, ``(N, 5)``: the partial blocks (up to two runs,
    the non-empty run minus the full run) then the rest of the line (three runs: before the
    non-empty run, the full run, after the non-empty run); and ``(full_starts, full_lens)``,
    ``(N, 3)``: the full run, then the blocks before and after it. Each line's lengths add up
    to ``m``, so the lines laid end to end are the whole tensor.
    """
    has_full = runs.full_first <= runs.full_last
    # Without full blocks, put the empty full run just past the non-empty one, so that the
    # partial blocks come out as one run and the unset ones as the runs around it.
    full_first = torch.where(has_full, runs.full_first, runs.last + 1)
    full_last = torch.where(has_full, runs.full_last, runs.last)
    # An empty line (first > last) lists nothing: its unset blocks are [0, first) and
    # [last + 1, m), which touch (first <= last + 1 on both sides, ``column_runs``).
    before = (full_first - runs.first).clamp_(min=0)
    after = (runs.last - full_last).clamp_(min=0)
    full_len = (full_last - full_first + 1).clamp_(min=0)
    head = runs.first.clamp(max=m)
    tail = (m - 1 - runs.last).clamp_(min=0)
    zero = torch.zeros_like(head)
    partial = (
        torch.stack([runs.first, full_last + 1, zero, full_first, runs.last + 1], -1),
        torch.stack([before, after, head, full_len, tail], -1),
    )
    full = (
        torch.stack([full_first, zero, full_last + 1], -1),
        torch.stack([full_len, full_first.clamp(max=m), (m - 1 - full_last).clamp_(min=0)], -1),
    )
    return partial, full


def write_lines(partial: Tensor, full: Tensor, lines: Runs, m: int) -> tuple[Tensor, Tensor]:
    """One side's two index tensors ``(R, n, m)`` (int32, every row contiguous) written in
    place from its lines' runs ``(R, n)`` (``line_runs``), and its counts ``(R, 1, n)``."""
    rows = partial.shape[0]
    (p_starts, p_lens), (f_starts, f_lens) = line_runs(Runs(*(t.reshape(-1) for t in lines)), m)
    for target, starts, lens in ((partial, p_starts, p_lens), (full, f_starts, f_lens)):
        if target.is_contiguous():
            expand_runs(target.view(-1), starts, lens)
            continue
        # A head's slice of (R, H, n, m): each row's lines are contiguous, rows are not.
        n = target.shape[1]
        for row in range(rows):
            part = slice(row * n, (row + 1) * n)
            expand_runs(target[row].view(-1), starts[part], lens[part])
    return (
        p_lens[:, :2].sum(1, dtype=torch.int32).view(rows, 1, -1),
        f_lens[:, 0].to(torch.int32).view(rows, 1, -1),
    )


def ordered_sides(
    mask: Mask, grid: BlockGrid, out: Sequence[Tensor] | None = None
) -> tuple[Ordered, Ordered]:
    """Both sides' tensors (kv side per q block row, q side per kv block column), shaped
    ``(R, 1, n[, m])`` for R = B when the mask depends on the row, else 1.

    Every line of both sides (R x nq kv-side rows of nkv blocks, then R x nkv q-side
    columns of nq blocks) is a set of at most two runs of partial blocks and one run of full
    blocks. Each index tensor is written whole, equal to torch's: the listed blocks
    ascending, then the unlisted ones ascending (``BlockMask._adjust`` reads the unlisted
    tail, so it must be torch's). Each tensor is runs laid end to end (``line_runs``),
    expanded in one pass (``write.expand_runs``): O(entries) with a small constant, no tile
    grid and no sort.

    ``out``: the four index tensors to write instead of new ones (kv partial, q partial,
    kv full, q full), each int32 ``(R, n, m)`` with every row contiguous: one head's slice
    of a larger ``(R, H, n, m)`` layout (``sides._by_head``), written in place, row by row
    where the rows are not laid end to end (H > 1).
    """
    rows, _ = grid.reduced(mask)
    nq, nkv, dev = grid.num_q_blocks, grid.num_kv_blocks, grid.device
    # The outputs first: allocated before the build's temporaries, they do not land on
    # memory the temporaries just returned to the system (fewer fresh pages on the CPU).
    shapes = ((nq, nkv), (nkv, nq), (nq, nkv), (nkv, nq))
    targets = index_tensors([(rows, n, m) for n, m in shapes], dev) if out is None else list(out)
    for target, (n, m) in zip(targets, shapes, strict=True):
        if target.shape != (rows, n, m) or not _rows_contiguous(target):
            raise ValueError(
                f"out: each index tensor must be {(rows, n, m)} with contiguous rows, got "
                f"{tuple(target.shape)} with stride {target.stride()}"
            )
    kv_p, q_p, kv_f, q_f = targets
    runs = row_runs(mask, grid)
    # Each side written on its own thread where the grid is long (the q side's column runs
    # with it).
    (kv_pn, kv_fn), (q_pn, q_fn) = side_by_side(
        lambda: write_lines(kv_p, kv_f, runs, nkv),
        lambda: write_lines(q_p, q_f, column_runs(runs, grid), nq),
        rows * nq * nkv,
        dev,
    )
    counts = (kv_pn, q_pn, kv_fn, q_fn)
    return (
        Ordered(counts[0], kv_p.unsqueeze(1), counts[2], kv_f.unsqueeze(1)),
        Ordered(counts[1], q_p.unsqueeze(1), counts[3], q_f.unsqueeze(1)),
    )
