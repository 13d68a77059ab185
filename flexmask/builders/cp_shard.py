"""One rank's BlockMask under context parallelism, built from structure.

Rank ``r`` keeps rows ``[r * S / W, (r + 1) * S / W)`` of the permuted mask and attends every
column in the permuted (all-gathered) key order. Those rows are a few runs of consecutive
original queries and the permuted columns a few runs of consecutive original keys. The
shard is written with each row's blocks listed ascending (unset blocks after, ascending:
torch's order), in one of three ways, all exact:

* runs (``_closed_form_sides``): a closed-form mask (``flexmask.builders.closed_form``) whose
  runs are whole blocks and whose rows ascend — the rank's blocks are a grid of their own,
  each row's block runs cut each ascending piece of the keys into permuted runs, and both
  sides are written as runs laid end to end, each index tensor in one pass
  (``segments.write_runs``): O(the rank's blocks x key pieces) besides the output, no
  tile grid;
* segments (``flexmask.builders.segments``): a closed-form mask otherwise — rows
  and keys cut at block and run boundaries into pieces, each piece's intervals met with
  the runs they touch (binary searches), the blocks of every line found from range events:
  O(pieces + touched runs) plus writing the output; where whole blocks touch so many runs
  that it is cheaper, the runs path's kv side compares every block instead;
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

from flexmask.algebra import Mask
from flexmask.blocks import (
    EMPTY,
    FULL,
    BlockGrid,
    Ordered,
    index_tensors,
    ordered_from_codes,
    ordered_from_flags,
    ordered_lines,
)
from flexmask.builders.classify import classify_blocks
from flexmask.builders.closed_form import Runs, line_runs, row_runs
from flexmask.builders.segments import (
    Columns,
    Pieces,
    pair_count,
    segment_sides,
    side,
    write_runs,
)


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
    balancer (``flexmask.context_parallel.build`` caches it with the permutation).

    Attributes:
        perm: the permutation row (int64, CPU); runs: its runs (``runs``).
        blocks: where the runs fall on block boundaries (but at the very end), the original
            kv block of each permuted block; else None.
        pieces: then the blocks cut where they stop ascending (every balancer here deals
            each rank its blocks in ascending order: a few pieces, at most W for any
            balancer, not the thousands of runs of one that deals single blocks), as
            ``(key, piece_start, piece_end)``: ``key`` ``(nkv,)`` ascending, piece ``p``'s
            blocks as ``p * (nkv + 2) + block`` (one binary search finds, in every piece
            at once, the permuted blocks of an original range); its permuted blocks
            ``[piece_start[p], piece_end[p])``.
    """

    perm: Tensor
    runs: tuple[Tensor, Tensor, Tensor]
    blocks: Tensor | None
    pieces: tuple[Tensor, Tensor, Tensor] | None

    @classmethod
    def of(cls, perm: Tensor, block: int) -> KeyOrder:
        kv_runs = runs(perm)
        total = perm.numel()
        if _tile(block, total, total, None, kv_runs) != block:
            return cls(perm, kv_runs, None, None)
        blocks = perm[::block].div(block, rounding_mode="floor")
        n = blocks.numel()
        drops = torch.zeros(n, dtype=torch.int64)
        drops[1:] = blocks[1:] < blocks[:-1]
        piece = drops.cumsum(0)
        starts = torch.nonzero(drops).flatten()
        starts = torch.cat([starts.new_zeros(1), starts])
        ends = torch.cat([starts[1:], starts.new_tensor([n])])
        return cls(perm, kv_runs, blocks, (piece * (n + 2) + blocks, starts, ends))


@dataclass(frozen=True)
class _Layout:
    """Where one permutation row puts rank ``rank``'s queries, against its ``keys``.

    ``block``: (q_block, kv_block). ``tile``: the largest tile dividing both and every run
    boundary. ``aligned``: every run of the rows starts and ends on a query block boundary,
    every run of the keys on a key block boundary (but at the very end), and the rank's
    query blocks ascend in the original order. Then local q block ``i`` is original block
    ``q_blocks[i]``.
    """

    q_perm: Tensor
    q_runs: tuple[Tensor, Tensor, Tensor]
    block: tuple[int, int]
    tile: int
    keys: KeyOrder
    q_blocks: Tensor | None = None

    @property
    def aligned(self) -> bool:
        return self.q_blocks is not None

    @classmethod
    def of(cls, keys: KeyOrder, rank: int, world: int, block: tuple[int, int]) -> _Layout:
        q_block, kv_block = block
        total = keys.perm.numel()
        local_len = total // world
        q_perm = keys.perm[rank * local_len : (rank + 1) * local_len]
        q_runs = runs(q_perm)
        tile = _tile(math.gcd(q_block, kv_block), total, local_len, q_runs, keys.runs)
        if keys.blocks is None or _tile(q_block, total, local_len, q_runs, None) != q_block:
            return cls(q_perm, q_runs, block, tile, keys)
        q_blocks = q_perm[::q_block].div(q_block, rounding_mode="floor")
        if q_blocks.numel() > 1 and not bool((q_blocks[1:] > q_blocks[:-1]).all()):
            return cls(q_perm, q_runs, block, tile, keys)
        return cls(q_perm, q_runs, block, tile, keys, q_blocks)


def _closed_form_sides(
    mask: Mask,
    whole: BlockGrid,
    layout: _Layout,
    keep: int | None = None,
    into: tuple[Tensor, ...] | None = None,
) -> tuple[Ordered, Ordered]:
    """Both sides of an aligned shard of a closed-form mask, from the runs of its rows
    (only batch row ``keep`` of them where given: one permutation row's shard), the index
    tensors written into ``into`` (kv partial, kv full, q partial, q full) where given.

    The rank's query blocks, ascending, are a grid of their own (``closed_form.row_runs``
    needs only rows in ascending order: the intervals stay monotone along any subset of
    them). Each row's non-empty and full runs of original kv blocks cut every ascending
    piece of the keys (``KeyOrder.pieces``) into at most two partial runs and one full run
    in permuted order (``_piece_line_runs``); each permuted kv column's rows are two binary
    searches, as in ``closed_form.column_runs``. Both sides are then runs laid end to end,
    each index tensor written in one pass (``segments.write_runs``): no tile grid, no mask
    evaluation, O(rank's blocks x pieces) besides the output. Keys in many pieces (a
    balancer that deals blocks out of order) give the kv side from segments instead —
    each row's runs met with the key runs they touch (``_segment_kv_side``) — or, where
    rows touch that many, by one compare per block.
    """
    keys = layout.keys
    assert layout.q_blocks is not None and keys.blocks is not None and keys.pieces is not None
    q_first = (layout.q_blocks * whole.q_block).to(whole.device)
    q_last = torch.clamp(q_first + (whole.q_block - 1), max=whole.q_len - 1)
    grid = replace(whole, q_first=q_first.view(1, 1, -1, 1), q_last=q_last.view(1, 1, -1, 1))
    row = row_runs(mask, grid)  # (R, nq local) runs of original kv blocks
    if keep is not None:  # written for that row alone
        row = Runs(*(t[keep : keep + 1] for t in row))
    rows, nq = row.first.shape
    nkv = whole.num_kv_blocks
    kv_blocks = keys.blocks.to(whole.device)
    shapes = ((rows, nq, nkv), (rows, nq, nkv), (rows, nkv, nq), (rows, nkv, nq))
    if into is None:
        into = tuple(index_tensors(shapes, whole.device))
    kv_p, kv_f, q_p, q_f = (t.view(shape) for t, shape in zip(into, shapes, strict=True))
    num_pieces = keys.pieces[1].numel()
    if num_pieces <= nkv * PIECES_PER_BLOCK:
        (kv_ps, kv_pl), (kv_fs, kv_fl) = _piece_line_runs(row, keys.pieces, nkv, whole.device)
        write_runs(kv_p.view(-1), kv_ps, kv_pl)
        write_runs(kv_f.view(-1), kv_fs, kv_fl)
        kv_counts = (
            kv_pl[..., : 2 * num_pieces].sum(-1, dtype=torch.int32),
            kv_fl[..., :num_pieces].sum(-1, dtype=torch.int32),
        )
    elif (made := _segment_kv_side(row, keys, whole, (kv_p, kv_f))) is not None:
        kv_counts = made  # many segments, each row touching few: ranges per touched run
    else:  # rows touch many of many segments: one compare per element beats runs
        c = kv_blocks.view(1, 1, nkv)
        full = (row.full_first.unsqueeze(-1) <= c) & (c <= row.full_last.unsqueeze(-1))
        some = (row.first.unsqueeze(-1) <= c) & (c <= row.last.unsqueeze(-1))
        num_p, dense_p = ordered_lines(some & ~full)
        num_f, dense_f = ordered_lines(full)
        kv_p.copy_(dense_p)
        kv_f.copy_(dense_f)
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
    write_runs(q_p.view(-1), q_ps, q_pl)
    write_runs(q_f.view(-1), q_fs, q_fl)
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


# Up to this many ascending key pieces per kv block, an aligned shard's kv side is written
# as runs per piece (``_piece_line_runs``: 5 per piece and q block); past it, from segments
# or by one compare per block. Every balancer here deals each rank its blocks ascending
# (at most W pieces).
PIECES_PER_BLOCK = 1 / 8

# Past this many (q block, key run) pairs per block, an aligned shard's kv side is cheaper
# written by one compare per block than from segments (``_closed_form_sides``). Measured at
# S = 1M, W = 8, BLOCK_SIZE = 128 (causal & sliding windows under PTRR): a pair costs
# ~0.2 us, the dense pass ~70 ms more than the segments' fixed cost: even near 1 in 26.
DENSE_PAIRS_PER_BLOCK = 1 / 24


def _closed_form_shard(
    mask: Mask,
    whole: BlockGrid,
    layout: _Layout,
    keep: int | None = None,
    into: tuple[Tensor, ...] | None = None,
) -> tuple[Ordered, Ordered]:
    """A closed-form mask's shard: from runs where its blocks are whole and its rows ascend
    (``_closed_form_sides``), else from segments (``segments.segment_sides``: each piece's
    ranges per run it touches). Batch row ``keep`` alone where given, else every row; the
    index tensors written into ``into`` where given (as ``_closed_form_sides``)."""
    if layout.aligned:
        return _closed_form_sides(mask, whole, layout, keep, into)
    keys = layout.keys
    rows = whole.reduced(mask)[0] if keep is None else 1
    total = keys.perm.numel()
    q_idx = layout.q_perm.to(whole.device).view(1, -1).expand(rows, -1).contiguous()
    row = torch.arange(rows, device=whole.device).view(-1, 1)
    if keep is not None:
        row = row + keep
    lo, hi = mask.intervals_at(q_idx, row, whole)  # type: ignore[misc]
    lo = lo.clamp(min=0).expand_as(q_idx).cpu()
    hi = hi.clamp(max=total - 1).expand_as(q_idx).cpu()
    made = segment_sides(lo, hi, layout.q_perm, layout.q_runs, keys.perm, keys.runs, layout.block)
    kv, q = (Ordered(*(t.to(whole.device) for t in side)) for side in made)
    if into is not None:
        for target, index in zip(into, (kv[1], kv[3], q[1], q[3]), strict=True):
            target.view(index.shape).copy_(index)
    return kv, q


def _segment_kv_side(
    row: Runs, keys: KeyOrder, whole: BlockGrid, out: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor] | None:
    """The kv side of an aligned shard from segments (``segments.side``), each q block one
    piece whose intervals are its runs of original kv blocks, written into ``out``; None
    past ``DENSE_PAIRS_PER_BLOCK`` (q block, key run) pairs per block. Returns the counts."""
    rows, nq = row.first.shape
    block, total = whole.kv_block, keys.perm.numel()

    def positions(first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
        return (first * block).cpu(), torch.clamp((last + 1) * block, max=total).sub_(1).cpu()

    some_lo, some_hi = positions(row.first, row.last)
    cover_lo, cover_hi = positions(row.full_first, row.full_last)
    pieces = Pieces(torch.arange(nq), some_lo, some_hi, cover_lo, cover_hi)
    cols = Columns.of(keys.runs, total, block)
    if pair_count(cols, some_lo, some_hi) > nq * whole.num_kv_blocks * DENSE_PAIRS_PER_BLOCK:
        return None
    # row_runs gives incomplete q blocks no full run: every line may count as complete here.
    on_cpu = whole.device.type == "cpu"
    num_p, idx_p, num_f, idx_f = side(
        pieces, cols, nq, torch.ones(nq, dtype=torch.bool), out if on_cpu else None
    )
    if not on_cpu:
        out[0].copy_(idx_p)
        out[1].copy_(idx_f)
    return num_p.to(whole.device), num_f.to(whole.device)


def _piece_line_runs(
    row: Runs, pieces: tuple[Tensor, Tensor, Tensor], nkv: int, device: torch.device
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Each kv-side line as runs in permuted order, torch's: the partial blocks of every
    piece (two runs each), then the unset ones (three each); the full blocks (one run
    each), then the rest (two each). ``row``'s runs are of original blocks; a piece's
    blocks ascend, so the ones inside an original range are one permuted range, found by
    a binary search in ``key`` (``KeyOrder.pieces``) for the piece's bounds. Every tensor
    here is ``(R, nq, pieces)`` int32."""
    key, start, end = pieces
    key = key.to(device)
    base = (torch.arange(start.numel(), device=device) * (nkv + 2)).view(1, 1, -1)
    start, end = (t.to(device=device, dtype=torch.int32).view(1, 1, -1) for t in (start, end))

    def at(bound: Tensor, right: bool) -> Tensor:
        return torch.searchsorted(key, base + bound.unsqueeze(-1), right=right, out_int32=True)

    # Permuted [a, z) non-empty and [fa, fz) full in each piece. An empty row lists nothing
    # (a = z at the piece's start); an empty full run sits at z: the partial blocks are then
    # [a, fa) and [fz, z), the unset ones [start, a), [fa, fz), [z, end).
    some, has_full = row.first <= row.last, row.full_first <= row.full_last
    a = torch.where(some.unsqueeze(-1), at(row.first, False), start)
    z = torch.where(some.unsqueeze(-1), at(row.last, True), start)
    fa = torch.where(has_full.unsqueeze(-1), at(row.full_first, False), z)
    fz = torch.where(has_full.unsqueeze(-1), at(row.full_last, True), z)

    def laid(listed: list[tuple[Tensor, Tensor]], unlisted: list[tuple[Tensor, Tensor]]):
        # (R, nq, pieces, runs) flattened: piece by piece, the listed ones first.
        return tuple(
            torch.cat([torch.stack([r[k] for r in group], -1).flatten(-2) for group in parts], -1)
            for k in range(2)
            for parts in [(listed, unlisted)]
        )

    start = start.expand_as(a)
    partial = laid(
        [(a, fa - a), (fz, z - fz)],
        [(start, a - start), (fa, fz - fa), (z, end - z)],
    )
    full = laid([(fa, fz - fa)], [(start, fa - start), (fz, end - fz)])
    return partial, full


def _tile_sides(mask: Mask, whole: BlockGrid, layout: _Layout) -> tuple[Ordered, Ordered]:
    """Both sides from the classified tiles of the rank's query runs (R, heads, ...).

    Each query run is a window of the whole mask, cut at the layout's tile (which divides
    every run boundary): pieces classify it as any build (``flexmask.builders.classify``; only
    tiles the structure leaves undecided are refined), against every original key tile.
    The runs' codes are stacked in local order, key tiles put in permuted order and, when
    the tile is below ``BLOCK_SIZE``, read back as blocks.
    """
    tile, perm, (q_block, kv_block) = layout.tile, layout.keys.perm, layout.block
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
    if tile == q_block == kv_block:
        return ordered_from_codes(codes)
    factors = (q_block // tile, kv_block // tile)
    full = _coarsen(codes == FULL, factors)
    some = _coarsen(codes != EMPTY, factors, any_=True)
    return ordered_from_flags(some & ~full, full)


def _coarsen(grid: Tensor, factors: tuple[int, int], any_: bool = False) -> Tensor:
    """Tiles to blocks of ``factors`` (q, kv) tiles: all (full) or any (non-empty); tiles
    past the end count as not set."""
    f_q, f_kv = factors
    rows, heads, n_q, n_kv = grid.shape
    pad_q, pad_kv = -n_q % f_q, -n_kv % f_kv
    grid = torch.nn.functional.pad(grid, (0, pad_kv, 0, pad_q), value=False)
    grid = grid.view(rows, heads, (n_q + pad_q) // f_q, f_q, (n_kv + pad_kv) // f_kv, f_kv)
    return grid.any(dim=(3, 5)) if any_ else grid.all(dim=(3, 5))


def build_shard(
    mask: Mask,
    whole: BlockGrid,
    indices: Tensor,
    rank: int,
    world: int,
    keys: Sequence[KeyOrder] | None = None,
) -> BlockMask:
    """The BlockMask of rank ``rank``'s rows of ``mask`` under the permutation ``indices``,
    on ``whole``: the grid of the whole permuted sequence, made from
    a spec that validated the mask (``flexmask.builders.spec``); every row's build reuses it
    and nothing here checks the mask again. Its blocks may be rectangular: queries are cut
    at its query block, keys at its key block. ``keys``: the rows' ``KeyOrder``s at the key
    block size, if already made."""
    total = indices.shape[-1]
    local_len = total // world
    block, device = (whole.q_block, whole.kv_block), whole.device
    q_block, kv_block = block
    if whole.q_len != total or whole.kv_len != total:
        raise ValueError(
            f"whole must be the grid of the whole permuted sequence ({total} x {total}), got "
            f"{whole.q_len} x {whole.kv_len}"
        )
    closed_form = mask.has_monotone_intervals() and not mask.head_dependent
    num_rows = indices.shape[0]
    outputs = None
    if closed_form and num_rows > 1:  # each row writes its slice: no copy to join them
        nq, nkv = math.ceil(local_len / q_block), whole.num_kv_blocks
        outputs = index_tensors(
            [(num_rows, 1, n, m) for n, m in ((nq, nkv), (nq, nkv), (nkv, nq), (nkv, nq))], device
        )
    sides = []
    for row in range(num_rows):
        keep = None if num_rows == 1 else (row if mask.batch_dependent else 0)
        perm = indices[row]
        layout = _Layout.of(
            KeyOrder.of(perm, kv_block) if keys is None else keys[row], rank, world, block
        )
        if closed_form:  # only the kept row written
            into = None if outputs is None else tuple(t[row] for t in outputs)
            kv, q = _closed_form_shard(mask, whole, layout, keep, into)
        else:
            kv, q = _tile_sides(mask, whole, layout)
            if keep is not None:
                kv, q = (Ordered(*(t[keep : keep + 1] for t in side)) for side in (kv, q))
        if keep is None and not mask.batch_dependent:  # B reduced to 1 where the mask ignores it
            kv, q = (Ordered(*(t[:1] for t in side)) for side in (kv, q))
        sides.append((kv, q))
    if len(sides) == 1:
        kv, q = sides[0]
    else:
        kv, q = (
            Ordered(*(torch.cat(parts) for parts in zip(*(s[k] for s in sides), strict=True)))
            if outputs is None
            else Ordered(
                torch.cat([s[k][0] for s in sides]),
                outputs[2 * k],
                torch.cat([s[k][2] for s in sides]),
                outputs[2 * k + 1],
            )
            for k in range(2)
        )
    q_index = _padded_lookup(
        indices[:, rank * local_len : (rank + 1) * local_len],
        math.ceil(local_len / q_block) * q_block,
    )
    kv_index = _padded_lookup(indices, math.ceil(total / kv_block) * kv_block)
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
        BLOCK_SIZE=block,
        mask_mod=ShardMaskMod(mask.mask_mod, q_index.to(device), kv_index.to(device)),
    )


def _padded_lookup(index: Tensor, length: int) -> Tensor:
    # Rows past the end (padding of the last block) read the last index; the kernel drops them.
    pad = length - index.shape[-1]
    if pad <= 0:
        return index.contiguous()
    return torch.cat([index, index[:, -1:].expand(-1, pad)], dim=-1).contiguous()
