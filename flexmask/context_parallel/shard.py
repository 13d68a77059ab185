"""One rank's BlockMask under context parallelism, built from structure.

Rank ``r`` keeps rows ``[r * S / W, (r + 1) * S / W)`` of the permuted mask and attends every
column in the permuted (all-gathered) key order. Those rows are a few runs of consecutive
original queries and the permuted columns a few runs of consecutive original keys. The
shard is written with each row's blocks listed ascending (unset blocks after, ascending:
torch's order), in one of three ways, all exact:

* runs (``_closed_form_sides``): a closed-form mask (``flexmask.build.closed_form``) whose
  runs are whole blocks and whose rows ascend — the rank's blocks are a grid of their own,
  each row's block runs cut each key run into permuted runs, and both sides are written as
  runs laid end to end: O(the rank's blocks), no tile grid;
* pieces (``_piece_sides``): a closed-form mask otherwise — the rows and keys cut at block
  and run boundaries, two comparisons per pair of pieces, then blocks;
* tiles (``_tile_sides``): any other mask — each query run's window classified (at the
  largest tile dividing every run boundary and ``BLOCK_SIZE``), key tiles permuted, and
  each block read from its tiles.

A row's ``KeyOrder`` (the key runs) is the same on every rank: ``core`` caches it with the
balancer's permutation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.build.classify import classify_blocks
from flexmask.build.closed_form import Runs, line_runs, row_runs
from flexmask.build.codes import EMPTY, FULL
from flexmask.build.grid import BlockGrid, make_grid
from flexmask.build.write import (
    Ordered,
    expand_runs,
    ordered_from_codes,
    ordered_from_flags,
    ordered_lines,
)
from flexmask.context_parallel.segments import segment_sides
from flexmask.mask import Mask


class ShardMaskMod:
    """The shard's mask_mod: local query and permuted key indices, mapped back, then asked.

    The lookups are tensors of fixed shape padded to whole blocks, so a new permutation of
    the same length does not recompile a compiled kernel.
    """

    def __init__(self, mask_mod: Any, q_index: Tensor, kv_index: Tensor) -> None:
        self.mask_mod = mask_mod
        self.q_index = q_index
        self.kv_index = kv_index

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        row = b * (self.q_index.shape[0] > 1)
        return self.mask_mod(b, h, self.q_index[row, q_idx], self.kv_index[row, kv_idx])


def runs(perm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Maximal runs of consecutive values in ``perm``: (local starts, original starts, lengths)."""
    n = perm.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    breaks = torch.ones(n, dtype=torch.bool)
    breaks[1:] = perm[1:] != perm[:-1] + 1
    local = torch.nonzero(breaks).flatten().cpu()
    lengths = torch.diff(local, append=torch.tensor([n]))
    return local, perm.cpu()[local], lengths


def _tile(block: int, total: int, local_end: int, q: tuple | None, kv: tuple | None) -> int:
    """The largest tile dividing ``block`` and every run boundary (a run that ends at the end
    in both orders may end mid-tile: the last tile is cut there in both)."""
    values = [block]
    for run, end in ((q, local_end), (kv, total)):
        if run is None:
            continue
        local, orig, lengths = run
        ends_both = (orig + lengths == total) & (local + lengths == end)
        values += local.tolist() + orig.tolist() + lengths[~ends_both].tolist()
    return math.gcd(*values)  # plain ints: numpy is not a dependency


@dataclass(frozen=True)
class KeyOrder:
    """The gathered keys of one permutation row: the same on every rank, so built once per
    balancer (``flexmask.context_parallel.core`` caches it with the permutation).

    Attributes:
        perm: the permutation row (int64, CPU); runs: its runs (``runs``).
        blocks: where the runs fall on block boundaries (but at the very end), the original
            kv block of each permuted block; else None.
        segments: then the runs in blocks: (permuted start, original start, length).
    """

    perm: Tensor
    runs: tuple[Tensor, Tensor, Tensor]
    blocks: Tensor | None
    segments: tuple[Tensor, Tensor, Tensor] | None

    @classmethod
    def of(cls, perm: Tensor, block: int) -> KeyOrder:
        kv_runs = runs(perm)
        total = perm.numel()
        if _tile(block, total, total, None, kv_runs) != block:
            return cls(perm, kv_runs, None, None)
        blocks = perm[::block].div(block, rounding_mode="floor")
        return cls(perm, kv_runs, blocks, runs(blocks))


@dataclass(frozen=True)
class _Layout:
    """Where one permutation row puts rank ``rank``'s queries, against its ``keys``.

    ``aligned``: every run of the rows and of the keys starts and ends on a block boundary
    (but at the very end) and the rank's query blocks ascend in the original order. Then
    local q block ``i`` is original block ``q_blocks[i]``.
    """

    q_perm: Tensor
    q_runs: tuple[Tensor, Tensor, Tensor]
    block: int
    tile: int
    keys: KeyOrder
    q_blocks: Tensor | None = None

    @property
    def aligned(self) -> bool:
        return self.q_blocks is not None

    @classmethod
    def of(cls, keys: KeyOrder, rank: int, world: int, block: int) -> _Layout:
        total = keys.perm.numel()
        local_len = total // world
        q_perm = keys.perm[rank * local_len : (rank + 1) * local_len]
        q_runs = runs(q_perm)
        tile = _tile(block, total, local_len, q_runs, keys.runs)
        if tile != block:
            return cls(q_perm, q_runs, block, tile, keys)
        q_blocks = q_perm[::block].div(block, rounding_mode="floor")
        if q_blocks.numel() > 1 and not bool((q_blocks[1:] > q_blocks[:-1]).all()):
            return cls(q_perm, q_runs, block, tile, keys)
        return cls(q_perm, q_runs, block, tile, keys, q_blocks)


def _closed_form_sides(mask: Mask, whole: BlockGrid, layout: _Layout) -> tuple[Ordered, Ordered]:
    """Both sides of an aligned shard of a closed-form mask, from the runs of its rows.

    The rank's query blocks, ascending, are a grid of their own (``closed_form.row_runs``
    needs only rows in ascending order: the intervals stay monotone along any subset of
    them). Each row's non-empty and full runs of original kv blocks cut every key segment
    into at most two partial runs and one full run in permuted order; each permuted kv
    column's rows are two binary searches, as in ``closed_form.column_runs``. Both sides
    are then runs laid end to end, expanded in one pass: no tile grid, no mask evaluation,
    O(rank's blocks) plus the runs.
    """
    keys = layout.keys
    assert layout.q_blocks is not None and keys.blocks is not None and keys.segments is not None
    q_first = (layout.q_blocks * whole.q_block).to(whole.device)
    q_last = torch.clamp(q_first + (whole.q_block - 1), max=whole.q_len - 1)
    grid = replace(
        whole, q_first=q_first.view(1, 1, -1, 1), q_last=q_last.view(1, 1, -1, 1), refined=[0]
    )
    row = row_runs(mask, grid)  # (R, nq local) runs of original kv blocks
    rows, nq = row.first.shape
    nkv = whole.num_kv_blocks
    kv_blocks = keys.blocks.to(whole.device)
    kv_p, kv_f = (
        torch.empty((rows, nq, nkv), dtype=torch.int32, device=whole.device) for _ in range(2)
    )
    q_p, q_f = (
        torch.empty((rows, nkv, nq), dtype=torch.int32, device=whole.device) for _ in range(2)
    )
    num_segments = keys.segments[0].numel()
    if 8 * num_segments <= nkv:
        (kv_ps, kv_pl), (kv_fs, kv_fl) = _segment_line_runs(row, keys.segments, whole.device)
        expand_runs(kv_p.view(-1), kv_ps, kv_pl)
        expand_runs(kv_f.view(-1), kv_fs, kv_fl)
        kv_counts = (
            kv_pl[..., : 2 * num_segments].sum(-1, dtype=torch.int32),
            kv_fl[..., :num_segments].sum(-1, dtype=torch.int32),
        )
    else:  # keys cut into many segments: one compare per element beats runs per segment
        c = kv_blocks.view(1, 1, nkv)
        full = (row.full_first.unsqueeze(-1) <= c) & (c <= row.full_last.unsqueeze(-1))
        some = (row.first.unsqueeze(-1) <= c) & (c <= row.last.unsqueeze(-1))
        num_p, kv_p = ordered_lines(some & ~full)
        num_f, kv_f = ordered_lines(full)
        kv_counts = (num_p, num_f)
    # Column j is original kv block kv_blocks[j]: its rows are ranges (row runs ascend).
    c = kv_blocks.view(1, nkv).expand(rows, nkv).contiguous()
    columns = Runs(
        torch.searchsorted(row.last.contiguous(), c),
        torch.searchsorted(row.first.contiguous(), c, right=True).sub_(1),
        torch.searchsorted(row.full_last.contiguous(), c),
        torch.searchsorted(row.full_first.contiguous(), c, right=True).sub_(1),
    )
    (q_ps, q_pl), (q_fs, q_fl) = line_runs(Runs(*(t.reshape(-1) for t in columns)), nq)
    expand_runs(q_p.view(-1), q_ps, q_pl)
    expand_runs(q_f.view(-1), q_fs, q_fl)
    q_counts = (
        q_pl[:, :2].sum(1, dtype=torch.int32).view(rows, nkv),
        q_fl[:, 0].to(torch.int32).view(rows, nkv),
    )
    return (
        Ordered(
            kv_counts[0].view(rows, 1, nq),
            kv_p.view(rows, 1, nq, nkv),
            kv_counts[1].view(rows, 1, nq),
            kv_f.view(rows, 1, nq, nkv),
        ),
        Ordered(
            q_counts[0].view(rows, 1, nkv),
            q_p.view(rows, 1, nkv, nq),
            q_counts[1].view(rows, 1, nkv),
            q_f.view(rows, 1, nkv, nq),
        ),
    )


# Past this many (piece, run) pairs per block of the shard a dense pass over its blocks is
# cheaper than the segments' events (measured at S = 1M: a pair costs ~10 block compares).
DENSE_PAIRS_PER_BLOCK = 1 / 8


def _closed_form_shard(mask: Mask, whole: BlockGrid, layout: _Layout) -> tuple[Ordered, Ordered]:
    """A closed-form mask's shard: from runs where its blocks are whole and its keys cut
    into few segments; else from segments (``segments.segment_sides``: the pieces' ranges
    per run they touch) unless those are about as many as the shard's blocks, then by one
    dense pass (aligned: a compare per block; not: ``_piece_sides``)."""
    keys = layout.keys
    nkv = whole.num_kv_blocks
    if layout.aligned and keys.segments is not None and 8 * keys.segments[0].numel() <= nkv:
        return _closed_form_sides(mask, whole, layout)
    rows, _ = whole.reduced(mask)
    total = keys.perm.numel()
    q_idx = layout.q_perm.to(whole.device).view(1, -1).expand(rows, -1).contiguous()
    lo, hi = mask._intervals(q_idx, torch.arange(rows, device=whole.device).view(-1, 1), whole)  # type: ignore[misc]
    lo = lo.clamp(min=0).expand_as(q_idx).cpu()
    hi = hi.clamp(max=total - 1).expand_as(q_idx).cpu()
    nq = -(-layout.q_perm.numel() // layout.block)
    made = segment_sides(
        lo,
        hi,
        layout.q_perm,
        layout.q_runs,
        keys.perm,
        keys.runs,
        layout.block,
        max_pairs=int(nq * nkv * DENSE_PAIRS_PER_BLOCK),
    )
    if made is None:
        return (
            _closed_form_sides(mask, whole, layout)
            if layout.aligned
            else _piece_sides(mask, whole, layout)
        )
    return tuple(Ordered(*(t.to(whole.device) for t in side)) for side in made)  # type: ignore[return-value]


def _segment_line_runs(
    row: Runs, segments: tuple[Tensor, Tensor, Tensor], device: torch.device
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Each kv-side line as runs in permuted order, torch's: the partial blocks of every
    segment (two runs each), then the unset ones (three each); the full blocks (one run
    each), then the rest (two each). ``row``'s runs are of original blocks; a segment holds
    original blocks ``[orig, orig + length)`` at permuted ``[start, start + length)``."""
    start, orig, length = (t.to(device).view(1, 1, -1) for t in segments)
    last_in = length - 1
    a = (row.first.unsqueeze(-1) - orig).clamp_(min=0)
    z = torch.minimum(row.last.unsqueeze(-1) - orig, last_in)
    fa = (row.full_first.unsqueeze(-1) - orig).clamp_(min=0)
    fz = torch.minimum(row.full_last.unsqueeze(-1) - orig, last_in)
    # An empty run is [0, -1]; an empty full run sits just past the non-empty one, so that
    # the partial blocks are [a, fa) and (fz, z] and the unset ones [0, a), [fa, fz], (z, L).
    some, has_full = a <= z, fa <= fz
    a, z = torch.where(some, a, 0), torch.where(some, z, -1)
    fa, fz = torch.where(has_full, fa, z + 1), torch.where(has_full, fz, z)
    full_len = fz - fa + 1

    def laid(listed: list[tuple[Tensor, Tensor]], unlisted: list[tuple[Tensor, Tensor]]):
        # (R, nq, segments, runs) flattened: segment by segment, the listed ones first.
        return tuple(
            torch.cat([torch.stack([r[k] for r in group], -1).flatten(-2) for group in parts], -1)
            for k in range(2)
            for parts in [(listed, unlisted)]
        )

    partial = laid(
        [(a + start, fa - a), (fz + 1 + start, z - fz)],
        [(start.expand_as(a), a), (fa + start, full_len), (z + 1 + start, last_in - z)],
    )
    full = laid(
        [(fa + start, full_len)],
        [(start.expand_as(a), fa), (fz + 1 + start, last_in - fz)],
    )
    return partial, full


def _piece_sides(mask: Mask, whole: BlockGrid, layout: _Layout) -> tuple[Ordered, Ordered]:
    """Both sides of a closed-form mask whose runs are not whole blocks, or whose rows do not
    ascend (torch's per-document order): from pieces, not tiles.

    Cut at block boundaries and at run boundaries, the rank's rows are q pieces and the
    permuted keys kv pieces, each a range of consecutive original positions inside one
    block. A q piece's attending queries have touching monotone intervals, so what it
    attends is one interval (the smallest ``lo`` and largest ``hi`` of its attending
    queries), and it covers a kv range iff its largest ``lo`` and smallest ``hi`` do.
    Every (q piece, kv piece) pair is then two comparisons, and a block is non-empty if
    any of its pairs is, full if all are and the block is complete. The work is
    O(S / W) intervals plus (blocks + runs)² / W pairs: no tile grid, no mask evaluation.
    """
    block, perm, q_perm = layout.block, layout.keys.perm, layout.q_perm
    total, local_len, dev = perm.numel(), q_perm.numel(), whole.device
    rows, _ = whole.reduced(mask)

    def pieces(order: Tensor, run_starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = order.numel()
        cut = torch.zeros(n, dtype=torch.bool)
        cut[::block] = True
        cut[run_starts] = True
        starts = torch.nonzero(cut).flatten()
        lengths = torch.diff(starts, append=torch.tensor([n]))
        return starts, lengths, starts.div(block, rounding_mode="floor")

    q_starts, q_lens, q_block_of = pieces(q_perm, layout.q_runs[0])
    kv_starts, kv_lens, kv_block_of = pieces(perm, layout.keys.runs[0])
    # Every local query's interval, clipped to the keys; reduced over its piece.
    q_idx = q_perm.to(dev).view(1, -1).expand(rows, -1).contiguous()
    row = torch.arange(rows, device=dev).view(rows, 1)
    lo, hi = mask._intervals(q_idx, row, whole)  # type: ignore[misc]
    lo, hi = lo.clamp(min=0).expand_as(q_idx), hi.clamp(max=total - 1).expand_as(q_idx)
    attends = lo <= hi
    piece = torch.zeros(local_len, dtype=torch.int64)
    piece[q_starts[1:]] = 1
    piece = piece.cumsum(0).to(dev).view(1, -1).expand(rows, -1)
    n_q = q_starts.numel()

    def reduce(values: Tensor, how: str, fill: int) -> Tensor:
        out = torch.full((rows, n_q), fill, dtype=values.dtype, device=dev)
        return out.scatter_reduce_(1, piece, values, how, include_self=False)

    some_lo = reduce(torch.where(attends, lo, total), "amin", total)
    some_hi = reduce(torch.where(attends, hi, -1), "amax", -1)
    every = reduce(attends.to(torch.int64), "amin", 0).bool()
    cover_lo, cover_hi = reduce(lo, "amax", total), reduce(hi, "amin", -1)
    ka = perm[kv_starts].to(dev).view(1, 1, -1)
    kz = ka + kv_lens.to(dev).view(1, 1, -1) - 1
    some = torch.maximum(some_lo.unsqueeze(-1), ka) <= torch.minimum(some_hi.unsqueeze(-1), kz)
    full = every.unsqueeze(-1) & (cover_lo.unsqueeze(-1) <= ka) & (cover_hi.unsqueeze(-1) >= kz)
    # Pairs to blocks: counts per block on both axes (pieces of a block are consecutive).
    nq, nkv = -(-local_len // block), -(-total // block)
    q_of, kv_of = q_block_of.to(dev), kv_block_of.to(dev)

    def blocks(pairs: Tensor) -> Tensor:
        per_kv = torch.zeros((rows, n_q, nkv), dtype=torch.int32, device=dev)
        per_kv.index_add_(2, kv_of, pairs.to(torch.int32))
        out = torch.zeros((rows, nq, nkv), dtype=torch.int32, device=dev)
        return out.index_add_(1, q_of, per_kv)

    q_count = torch.bincount(q_of, minlength=nq)
    kv_count = torch.bincount(kv_of, minlength=nkv)
    q_complete = torch.zeros(nq, dtype=torch.int64, device=dev).index_add_(0, q_of, q_lens.to(dev))
    kv_complete = torch.zeros(nkv, dtype=torch.int64, device=dev)
    kv_complete.index_add_(0, kv_of, kv_lens.to(dev))
    complete = (q_complete == block).view(-1, 1) & (kv_complete == block).view(1, -1)
    some_b = blocks(some) > 0
    full_b = (blocks(full) == q_count.view(-1, 1) * kv_count.view(1, -1)) & complete
    return ordered_from_flags((some_b & ~full_b).unsqueeze(1), full_b.unsqueeze(1))


def _tile_sides(mask: Mask, whole: BlockGrid, layout: _Layout) -> tuple[Ordered, Ordered]:
    """Both sides from the classified tiles of the rank's query runs (R, heads, ...).

    Each query run is a window of the whole mask, cut at the layout's tile (which divides
    every run boundary): pieces classify it as any build (``flexmask.build.classify``; only
    tiles the structure leaves undecided are refined), against every original key tile.
    The runs' codes are stacked in local order, key tiles put in permuted order and, when
    the tile is below ``BLOCK_SIZE``, read back as blocks.
    """
    tile, perm, block = layout.tile, layout.keys.perm, layout.block
    total = perm.numel()
    parts = []
    for start, length in zip(layout.q_runs[1].tolist(), layout.q_runs[2].tolist(), strict=True):
        # A run may end inside a tile only at the end of the mask: the window's last tile
        # row is then incomplete there too, and demoted as torch would.
        grid = BlockGrid.make(
            whole.batch, whole.heads, length, total, tile, tile, whole.device, q_offset=start
        )
        parts.append(classify_blocks(mask, grid).codes)
    codes = torch.cat(parts, dim=2)
    codes = codes[..., perm[::tile].div(tile, rounding_mode="floor").to(codes.device)]
    if tile == block:
        return ordered_from_codes(codes)
    full = _coarsen(codes == FULL, tile, block)
    some = _coarsen(codes != EMPTY, tile, block, any_=True)
    return ordered_from_flags(some & ~full, full)


def _coarsen(grid: Tensor, tile: int, block: int, any_: bool = False) -> Tensor:
    """Tiles to blocks: all (full) or any (non-empty); tiles past the end count as not set."""
    f = block // tile
    rows, heads, n_q, n_kv = grid.shape
    pad_q, pad_kv = -n_q % f, -n_kv % f
    grid = torch.nn.functional.pad(grid, (0, pad_kv, 0, pad_q), value=False)
    grid = grid.view(rows, heads, (n_q + pad_q) // f, f, (n_kv + pad_kv) // f, f)
    return grid.any(dim=(3, 5)) if any_ else grid.all(dim=(3, 5))


def build_shard(
    mask: Mask,
    B: int | None,
    H: int | None,
    indices: Tensor,
    rank: int,
    world: int,
    block: int,
    device: torch.device,
    keys: Sequence[KeyOrder] | None = None,
) -> BlockMask:
    """The BlockMask of rank ``rank``'s rows of ``mask`` under the permutation ``indices``
    (``keys``: its rows' ``KeyOrder``s at ``block``, if already made)."""
    total = indices.shape[-1]
    local_len = total // world
    # Validates the mask against the whole sequence once; every row's build reuses it.
    whole = make_grid(mask, B, H, total, total, device, block)
    sides = []
    for row in range(indices.shape[0]):
        keep = None if indices.shape[0] == 1 else (row if mask.batch_dependent else 0)
        perm = indices[row]
        layout = _Layout.of(
            KeyOrder.of(perm, block) if keys is None else keys[row], rank, world, block
        )
        closed_form = mask._has_monotone_intervals() and not mask.head_dependent
        if not closed_form:
            kv, q = _tile_sides(mask, whole, layout)
        else:
            kv, q = _closed_form_shard(mask, whole, layout)
        if keep is not None:
            kv, q = (Ordered(*(t[keep : keep + 1] for t in side)) for side in (kv, q))
        elif not mask.batch_dependent:  # B reduced to 1 where the mask ignores it
            kv, q = (Ordered(*(t[:1] for t in side)) for side in (kv, q))
        sides.append((kv, q))
    if len(sides) == 1:
        kv, q = sides[0]
    else:
        kv = Ordered(*(torch.cat(parts) for parts in zip(*(s[0] for s in sides), strict=True)))
        q = Ordered(*(torch.cat(parts) for parts in zip(*(s[1] for s in sides), strict=True)))
    q_index = _padded_lookup(
        indices[:, rank * local_len : (rank + 1) * local_len], math.ceil(local_len / block) * block
    )
    kv_index = _padded_lookup(indices, math.ceil(total / block) * block)
    return BlockMask(
        (local_len, total),
        kv.partial_num,
        kv.partial_idx,
        kv.full_num,
        kv.full_idx,
        q.partial_num,
        q.partial_idx,
        q.full_num,
        q.full_idx,
        BLOCK_SIZE=(block, block),
        mask_mod=ShardMaskMod(mask.mask_mod, q_index.to(device), kv_index.to(device)),
    )


def _padded_lookup(index: Tensor, length: int) -> Tensor:
    # Rows past the end (padding of the last block) read the last index; the kernel drops them.
    pad = length - index.shape[-1]
    if pad <= 0:
        return index.contiguous()
    return torch.cat([index, index[:, -1:].expand(-1, pad)], dim=-1).contiguous()
