"""BlockMask tensors in closed form for masks whose queries each attend one kv interval.

An ``&`` of interval pieces (causal, document, sliding window, prefix, padding, full, empty,
and ``|``-unions of causal, prefix and full such as the prefix-LM ``causal() | prefix(n)``,
whose intervals all start at key 0) gives query ``q`` of each batch row one kv interval
``[lo(q), hi(q)]``. Each of these pieces declares (``Piece._interval_shape``, read through
``Mask._has_monotone_intervals``) that, on a prefix of the positions (its domain; past it the
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

``tests/test_ranges.py`` checks the three properties on every query of random intersections,
and the tensors against torch's ``create_block_mask``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.blocks import BlockGrid
from flexmask.mask import Mask


class Runs(NamedTuple):
    """Per block row ``(R, n)``: the run ``[first, last]`` of non-empty blocks and the run
    ``[full_first, full_last]`` of full blocks inside it (empty when first > last). All four
    never decrease along ``n``."""

    first: Tensor
    last: Tensor
    full_first: Tensor
    full_last: Tensor


class Ordered(NamedTuple):
    """torch's tensors of one side of a BlockMask: counts ``(..., n)`` and indices
    ``(..., n, m)`` of the partial blocks, then of the full ones; int32."""

    partial_num: Tensor
    partial_idx: Tensor
    full_num: Tensor
    full_idx: Tensor


def _clipped(mask: Mask, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> tuple[Tensor, Tensor]:
    lo, hi = mask._intervals(q_idx, row, grid)  # type: ignore[misc]
    shape = q_idx.shape
    return lo.clamp(min=0).expand(shape), hi.clamp(max=grid.kv_len - 1).expand(shape)


def row_runs(mask: Mask, grid: BlockGrid) -> Runs:
    """The runs of every q block row of a mask with monotone intervals, from the intervals
    of each block's first and last query (and of one block per row, where the attending
    prefix of the queries ends)."""
    dev = grid.device
    nq, nkv, kb = grid.num_q_blocks, grid.num_kv_blocks, grid.kv_block
    rows = grid.batch if mask.batch_dependent else 1
    first_q = grid.q_first.view(1, nq)
    last_q = grid.q_last.view(1, nq)
    row = torch.arange(rows, device=dev).view(rows, 1)
    edges = torch.cat([first_q, last_q], 1).expand(rows, 2 * nq)
    lo, hi = _clipped(mask, edges, row, grid)
    lo_a, lo_z = lo[:, :nq], lo[:, nq:]
    hi_a, hi_z = hi[:, :nq], hi[:, nq:]
    starts = lo_a <= hi_a  # the block's first query attends: the block is non-empty
    ends = lo_z <= hi_z  # its last one too: every query of the block attends
    # At most one block per row starts attending and stops inside: find where it stops.
    hi_reach = hi_z
    cut = starts & ~ends
    if bool(cut.any()):
        block = cut.to(torch.int8).argmax(1, keepdim=True)  # (rows, 1)
        inside = grid.q_first.view(-1)[block] + torch.arange(grid.q_block, device=dev)
        inside = inside.clamp(max=grid.q_len - 1)
        lo_in, hi_in = _clipped(mask, inside, row, grid)
        attending = (lo_in <= hi_in).sum(1, keepdim=True)  # a prefix of the block
        hi_last = hi_in.gather(1, (attending - 1).clamp(min=0))
        hi_reach = torch.where(cut, hi_last, hi_z)
    no_block = torch.tensor(nkv, device=dev)
    first = torch.where(starts, lo_a.div(kb, rounding_mode="floor"), no_block)
    last = torch.where(starts, hi_reach.div(kb, rounding_mode="floor"), no_block - 1)
    # Full: tiles inside [lo(z), hi(a)], in complete blocks whose queries all attend. As hi
    # is clipped below KV_LEN, the last tile counts only if it is complete.
    complete = ends & (first_q + grid.q_block <= grid.q_len)
    full_first = (lo_z + (kb - 1)).div(kb, rounding_mode="floor")
    full_last = (hi_a + 1).div(kb, rounding_mode="floor").sub_(1)
    full_first = torch.where(complete, full_first, no_block)
    full_last = torch.where(complete, full_last, no_block - 1)
    return Runs(first, last, full_first, full_last)


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


def _sets(runs: Runs) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(starts, lengths) of the partial blocks of every line (the non-empty run minus the
    full run: up to two runs, ``(N, 2)``) and of its full blocks (one run, ``(N, 1)``)."""
    has_full = runs.full_first <= runs.full_last
    # Without full blocks, put the empty full run just past the non-empty one, so that the
    # partial blocks come out as one run.
    full_first = torch.where(has_full, runs.full_first, runs.last + 1)
    full_last = torch.where(has_full, runs.full_last, runs.last)
    before = (full_first - runs.first).clamp_(min=0)
    after = (runs.last - full_last).clamp_(min=0)
    partial = (
        torch.stack([runs.first, full_last + 1], -1),
        torch.stack([before, after], -1),
    )
    full = (full_first.unsqueeze(-1), (full_last - full_first + 1).clamp_(min=0).unsqueeze(-1))
    return partial, full


def _full_of(rows: int, n: int, m: int, device: torch.device) -> Tensor:
    return torch.full((rows, n, m), m - 1, dtype=torch.int32, device=device)


def ordered_sides(mask: Mask, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """Both sides' tensors (kv side per q block row, q side per kv block column), shaped
    ``(R, 1, n[, m])`` for R = B when the mask depends on the row, else 1.

    Every line of both sides (R x nq kv-side rows of nkv blocks, then R x nkv q-side
    columns of nq blocks) is a set of at most two runs of partial blocks and one run of full
    blocks. Each line lists its set ascending, as torch's do. Entries past the count are
    read by no one (kernels, ``to_dense`` and ``from_kv_blocks`` stop at the count); they keep
    ``m - 1``, a valid index that torch's ``BlockMask._adjust`` recount never takes for a
    block. Only the listed entries are written — O(listed blocks), no ranking of every tile —
    all four tensors' entries expanded together.
    """
    rows = grid.batch if mask.batch_dependent else 1
    nq, nkv, dev = grid.num_q_blocks, grid.num_kv_blocks, grid.device
    # The outputs first: allocated before the build's temporaries, they do not land on
    # memory the temporaries just returned to the system (fewer fresh pages on the CPU).
    # Order: kv partial, q partial, kv full, q full — the order entries are expanded in.
    outs = [
        _full_of(rows, nq, nkv, dev),
        _full_of(rows, nkv, nq, dev),
        _full_of(rows, nq, nkv, dev),
        _full_of(rows, nkv, nq, dev),
    ]
    runs = row_runs(mask, grid)
    cols = column_runs(runs, grid)
    lines = Runs(
        *(torch.cat([a.reshape(-1), b.reshape(-1)]) for a, b in zip(runs, cols, strict=True))
    )
    (p_start, p_len), (f_start, f_len) = _sets(lines)
    kv_lines = rows * nq
    # Where each line begins in its own tensor.
    line_base = torch.cat(
        [torch.arange(kv_lines, device=dev) * nkv, torch.arange(rows * nkv, device=dev) * nq]
    )
    run_len = torch.cat([p_len.reshape(-1), f_len.reshape(-1)])
    first_slot = torch.cat(
        [(line_base.unsqueeze(1) + p_len.cumsum(1) - p_len).reshape(-1), line_base]
    )
    starts = torch.cat([p_start.reshape(-1), f_start.reshape(-1)])
    ends = run_len.cumsum(0)
    # The entries of each tensor, in order: partial runs are 2 per line, full runs 1.
    lines_all = kv_lines + rows * nkv
    last_runs = [2 * kv_lines, 2 * lines_all, 2 * lines_all + kv_lines, 3 * lines_all]
    bounds = [0, *ends[torch.tensor(last_runs, device=dev) - 1].tolist()]
    totals = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    # Entry e of run r goes to slot e + (first_slot[r] - first_entry[r]) and holds
    # e + (start[r] - first_entry[r]): per run one slot shift and one value shift, written
    # as a cumsum of ones plus the shifts' jumps where each run begins (runs that are empty
    # jump at the same place; the jumps add up).
    total = bounds[-1]
    if total:
        first_entry = ends - run_len
        shift = torch.stack([first_slot - first_entry, starts - first_entry])
        jump = torch.diff(shift, dim=1, prepend=torch.zeros_like(shift[:, :1]))
        inside = first_entry < total  # empty runs at the very end jump nowhere
        steps = torch.ones(2, total, dtype=torch.int64, device=dev)
        steps[:, :1] = 0
        steps.scatter_add_(1, first_entry.clamp(max=total - 1).expand(2, -1), jump * inside)
        slot_value = steps.cumsum_(1)
        slots, values = slot_value[0], slot_value[1].to(torch.int32)
        for out, slot, value in zip(outs, slots.split(totals), values.split(totals), strict=True):
            out.view(-1).scatter_(0, slot, value)
    p_count = p_len.sum(1, dtype=torch.int32)
    f_count = f_len.squeeze(1).to(torch.int32)
    counts = [
        p_count[:kv_lines].view(rows, 1, nq).clone(),
        p_count[kv_lines:].view(rows, 1, nkv).clone(),
        f_count[:kv_lines].view(rows, 1, nq).clone(),
        f_count[kv_lines:].view(rows, 1, nkv).clone(),
    ]
    kv_p, q_p, kv_f, q_f = (out.unsqueeze(1) for out in outs)
    return (
        Ordered(counts[0], kv_p, counts[2], kv_f),
        Ordered(counts[1], q_p, counts[3], q_f),
    )
