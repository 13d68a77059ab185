"""BlockMask tensors in closed form for masks whose queries each attend one kv interval.

An ``&`` of interval pieces (causal, document, sliding window, prefix, padding, full, empty)
gives query ``q`` of each batch row one kv interval ``[lo(q), hi(q)]``. Each of these pieces
declares (``Mask._has_monotone_intervals``) that, on a prefix of the positions (its domain;
past it the piece attends nowhere),

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
    """(starts, lengths) of the partial blocks (the non-empty run minus the full run: up to
    two runs) and of the full blocks (one run), each ``(R, n, runs)``."""
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


def _write(sets: list[tuple[Tensor, Tensor]], outs: list[Tensor]) -> list[Tensor]:
    """Writes sets made of disjoint ascending runs (``starts[..., r]``, ``lengths[..., r]``
    blocks, possibly none) into index tensors ``outs[g] (R, n, m)``, one row per set, and
    returns their counts (int32, ``(R, n)``).

    Each row lists its set ascending, as torch's do. Entries past the count are read by no
    one (kernels, ``to_dense`` and ``from_kv_blocks`` stop at the count); they keep ``m - 1``,
    a valid index that torch's ``BlockMask._adjust`` recount never takes for a block. Only
    the listed entries are written — O(listed blocks), no ranking of every tile — all of
    the sets expanded together, one scatter per tensor.
    """
    first_slots, values, run_lens, counts = [], [], [], []
    for (starts, lengths), out in zip(sets, outs, strict=True):
        m = out.shape[-1]
        counts.append(lengths.sum(-1, dtype=torch.int32))
        rows = torch.arange(out.numel() // m, device=out.device).view(*out.shape[:-1], 1)
        first_slots.append((rows * m + lengths.cumsum(-1) - lengths).reshape(-1))
        values.append(starts.reshape(-1))
        run_lens.append(lengths.reshape(-1))
    run_len = torch.cat(run_lens)
    totals = torch.stack([n.sum() for n in run_lens]).tolist()
    first_entry = run_len.cumsum(0) - run_len
    # Entry e of run r goes to slot first_slot[r] + (e - first_entry[r]) and holds
    # start[r] + (e - first_entry[r]): one slot shift and one value shift per run.
    shifts = torch.stack([torch.cat(first_slots) - first_entry, torch.cat(values) - first_entry])
    shifts = shifts.repeat_interleave(run_len, dim=1, output_size=sum(totals))
    slot_value = shifts + torch.arange(sum(totals), device=run_len.device)
    slots, value = slot_value[0], slot_value[1].to(torch.int32)
    for out, slot, val in zip(outs, slots.split(totals), value.split(totals), strict=True):
        out.view(-1).scatter_(0, slot, val)
    return counts


def _outputs(rows: int, n: int, m: int, device: torch.device) -> list[Tensor]:
    """The (partial, full) index tensors of one side, ``(rows, n, m)``, every entry m - 1."""
    return [torch.full((rows, n, m), m - 1, dtype=torch.int32, device=device) for _ in range(2)]


def ordered_sides(mask: Mask, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """Both sides' tensors (kv side per q block row, q side per kv block column), shaped
    ``(R, 1, n[, m])`` for R = B when the mask depends on the row, else 1."""
    rows = grid.batch if mask.batch_dependent else 1
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    # The outputs first: allocated before the build's temporaries, they do not land on
    # memory the temporaries just returned to the system (fewer fresh pages on the CPU).
    outs = _outputs(rows, nq, nkv, grid.device) + _outputs(rows, nkv, nq, grid.device)
    runs = row_runs(mask, grid)
    counts = _write([*_sets(runs), *_sets(column_runs(runs, grid))], outs)
    kv_p, kv_f, q_p, q_f = (
        (count.unsqueeze(1), out.unsqueeze(1)) for count, out in zip(counts, outs, strict=True)
    )
    return Ordered(*kv_p, *kv_f), Ordered(*q_p, *q_f)
