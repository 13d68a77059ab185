"""A tree's tile codes, exact and with no tile evaluated: from per-block extremes of the
subtree ends in preorder (``classify_preorder``), in rank space for any layout
(``classify_ranked``), where a search of sorted subtrees settles the tiles the extremes
leave open.

The lookups (``flexmask.pieces.tree_lookups``) are int32 ``(R, length + 1)`` rank and
subtree end per position; the vectorized tests are in ``flexmask.pieces.tree_chunks``.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.algebra import BlockColumns, TileGrid
from flexmask.blocks import CODE_DTYPE, EMPTY, side_by_side
from flexmask.pieces.tree_chunks import (
    band,
    chunk_parts,
    chunks_of,
    pair_holds,
    tested_codes,
    work_buffers,
)


class Tuning(NamedTuple):
    """How the classification cuts its work (``flexmask.pieces.tree`` holds the values)."""

    chunk_tiles: int
    """Tiles per chunk of q blocks: a chunk's flag buffers stay in cache."""
    chunked_from: int
    """Grids of more tiles than this are classified in chunks of q blocks."""
    narrow: int
    """Chunks whose q-side values span less than this are compared as int16."""
    search: Callable[..., Tensor]
    """The exact search of sorted subtrees (``tree_chunks.search_subtrees``)."""


def _chunking(
    grid: TileGrid, rows: int, one_pass: bool, tuning: Tuning
) -> tuple[list[tuple[int, int, int]], int]:
    """One chunk of every q block for a small grid (a chunk's dozen calls would cost more
    than they save), else chunks of q blocks: kv blocks after a chunk's last query are
    EMPTY, unread, and its work fits the cache in a few small buffers reused (a pass over
    the whole grid per compare writes fresh pages)."""
    if one_pass:
        return [(0, grid.num_q_blocks, grid.num_kv_blocks)], grid.num_q_blocks
    return chunks_of(grid, rows, tuning.chunk_tiles)


def classify_preorder(grid: TileGrid, end: Tensor, tuning: Tuning) -> Tensor:
    """Exact codes of a tree laid out in preorder, from its subtree ends ``end`` alone."""
    device, rows = grid.device, end.shape[0]
    length = end.shape[1] - 1
    nq, nkv, kv_block = grid.num_q_blocks, grid.num_kv_blocks, grid.kv_block
    end = end[:, grid.kv_offset : grid.kv_end]
    pad = nkv * kv_block - grid.kv_len
    # Per kv block: the largest and smallest subtree end over its in-range tokens.
    max_end = torch.nn.functional.pad(end, (0, pad), value=0) if pad else end
    max_end = max_end.reshape(rows, nkv, kv_block).amax(-1).view(rows, 1, nkv)
    min_end = torch.nn.functional.pad(end, (0, pad), value=length + 1) if pad else end
    min_end = min_end.reshape(rows, nkv, kv_block).amin(-1).view(rows, 1, nkv)
    # In preorder, kv attends q iff kv <= q < end[kv]: for a kv block not after the q
    # block, some q attends iff some end reaches past the block's first query (a token
    # on both sides inside the tree has end > itself >= that query: q == kv attends).
    # The block-index conditions are shared by the rows: one (nq, nkv) pass each.
    q_first = grid.q_first.view(1, nq, 1).to(torch.int32)
    q_last = grid.q_last.view(1, nq, 1).to(torch.int32)
    kv_first = grid.kv_first.view(1, 1, nkv).to(torch.int32)
    kv_last = grid.kv_last.view(1, 1, nkv).to(torch.int32)
    # Each test as "lo <= hi" (a strict one on block bounds less one):
    # full: q_last < min_end and kv_last <= q_first; nonempty: q_first < max_end and
    # kv_first <= q_last.
    tests = (
        (q_last, min_end - 1),
        (kv_last, q_first),
        (q_first, max_end - 1),
        (kv_first, q_last),
    )
    chunks, step = _chunking(grid, rows, rows * nq * nkv <= 2 * tuning.chunked_from, tuning)
    parts = chunk_parts(tests, chunks, nq, tuning.narrow)
    codes = torch.empty(rows, nq, nkv, dtype=CODE_DTYPE, device=device)

    def classified(todo: range) -> None:
        work = work_buffers(rows * step * nkv, device, parts[0][0][0].dtype)
        for index in todo:
            first, last, cols = chunks[index]
            codes[:, first:last, cols:] = EMPTY
            if cols:
                tested_codes(codes[:, first:last, :cols], parts[index], work)

    # Long grids: the chunks in two halves of about equal tiles, each on its own thread.
    tiles = [(last - first) * cols for first, last, cols in chunks]
    total = sum(tiles)
    half = next(i for i, done in enumerate(accumulate(tiles), 1) if 2 * done >= total)
    side_by_side(
        lambda: classified(range(half)),
        lambda: classified(range(half, len(chunks))),
        rows * nq * nkv,
        device,
    )
    return codes.view(rows, 1, nq, nkv)


def preorder_columns(grid: TileGrid, end: Tensor) -> BlockColumns:
    """``classify_preorder``'s tiles as runs down the columns, from the same four tests.

    Each test compares a kv block's value with a q block's bound, and the q blocks' bounds
    grow down the column: so the q blocks that pass both tests of a kind are one run, found
    by a binary search per column — nonempty from the first q block whose last query
    reaches the kv block's first key to the last whose first query is below the block's
    largest subtree end; full from the first whose first query is at or past the block's
    last key to the last whose last query is below its smallest subtree end. O(rows x kv
    blocks x log q blocks): no tile is classified. Scalar offsets only (``q_first`` one
    row of q blocks)."""
    rows, length = end.shape[0], end.shape[1] - 1
    nq, nkv, kv_block = grid.num_q_blocks, grid.num_kv_blocks, grid.kv_block
    end = end[:, grid.kv_offset : grid.kv_end]
    pad = nkv * kv_block - grid.kv_len
    max_end = torch.nn.functional.pad(end, (0, pad), value=0) if pad else end
    max_end = max_end.reshape(rows, nkv, kv_block).amax(-1).to(torch.int64)
    min_end = torch.nn.functional.pad(end, (0, pad), value=length + 1) if pad else end
    min_end = min_end.reshape(rows, nkv, kv_block).amin(-1).to(torch.int64)
    q_first, q_last = grid.q_first.reshape(nq), grid.q_last.reshape(nq)
    kv_first = grid.kv_first.reshape(1, nkv).expand(rows, nkv)
    kv_last = grid.kv_last.reshape(1, nkv).expand(rows, nkv)
    # The first q block passing "q_last >= kv_first", one past the last passing
    # "q_first <= max_end - 1"; then the full tests' "q_first >= kv_last" and
    # "q_last <= min_end - 1".
    first = torch.searchsorted(q_last, kv_first.contiguous())
    stop = torch.searchsorted(q_first, max_end - 1, right=True)
    full_first = torch.searchsorted(q_first, kv_last.contiguous())
    full_stop = torch.searchsorted(q_last, min_end - 1, right=True)
    return BlockColumns(first, stop - 1, full_first, full_stop - 1)


def _by_block(values: Tensor, first: int, last: int, n: int, size: int, fill: int) -> Tensor:
    """Positions ``first:last`` of per-row lookups as ``(R, n, size)`` blocks, the last
    padded with ``fill``."""
    part = values[:, first:last]
    if n * size != last - first:
        part = torch.nn.functional.pad(part, (0, n * size - (last - first)), value=fill)
    return part.reshape(values.shape[0], n, size)


class _KvBlocks(NamedTuple):
    """Per kv block (``(R, nkv)``; ``rank`` and ``end`` ``(R, nkv, kv_block)``)."""

    rank: Tensor
    end: Tensor
    max_rank: Tensor
    min_end: Tensor
    u_lo: Tensor
    """The least rank of the union ``U`` of the block's subtrees."""
    u_hi: Tensor
    """One past its greatest rank."""
    u_run: Tensor
    """``U`` is the one interval ``[u_lo, u_hi)``: the hull tests are exact."""


def _kv_blocks(grid: TileGrid, rank: Tensor, end: Tensor, end_by_rank: Tensor) -> _KvBlocks:
    """Per kv block: its ranks' and ends' extremes, and ``U``'s bounds."""
    nkv, kv_block, big = grid.num_kv_blocks, grid.kv_block, rank.shape[1] + 1
    kv_first = int(grid.kv_offset)
    kv_end = kv_first + grid.kv_len  # grid.kv_end, as an int
    # Past the tree rank = position and end = 0, padding end = 0: such a kv roots no
    # subtree. U's bounds over the tokens in the tree.
    kv_rank = _by_block(rank, kv_first, kv_end, nkv, kv_block, -1)
    kv_end_b = _by_block(end, kv_first, kv_end, nkv, kv_block, 0)
    max_rank_all = kv_rank.amax(-1)  # -1 pads: only in-range tokens count
    min_end_all = (
        kv_end_b.amin(-1)
        if nkv * kv_block == grid.kv_len
        else _by_block(end, kv_first, kv_end, nkv, kv_block, big).amin(-1)
    )
    # U's least rank is the block's least rank, read with no pass to pick the tokens in
    # the tree: those past it have rank = position, above every rank in it, so they
    # never win a block that holds one; a block that holds none has U empty (u_hi = 0)
    # whatever u_lo is. Only the -1 padding of the last block is read around.
    u_lo = kv_rank.amin(-1)
    if nkv * kv_block != grid.kv_len:
        last_held = grid.kv_len - (nkv - 1) * kv_block
        u_lo[:, -1] = kv_rank[:, -1, :last_held].amin(-1)
    u_hi = kv_end_b.amax(-1)  # ends of tokens outside the tree are 0
    # The subtree end of the block's least-ranked token, read by its rank (ranks are a
    # permutation of the positions): no argmin, which costs several times the amin.
    u_run = end_by_rank.gather(1, u_lo.to(torch.int64)) >= u_hi
    return _KvBlocks(kv_rank, kv_end_b, max_rank_all, min_end_all, u_lo, u_hi, u_run)


class _QBlocks(NamedTuple):
    """Per q block (``(R, nq)``)."""

    max_all: Tensor
    """The greatest rank of its tokens (padding -1)."""
    max_in_tree: Tensor
    """The greatest rank of its tokens in the tree (-1: none)."""
    min: Tensor
    """The least rank of its tokens."""
    run: Tensor
    """Its tokens in the tree have ranks that are one run (or it holds none)."""


def _q_blocks(grid: TileGrid, rank: Tensor, sizes: Tensor, kv: _KvBlocks, same: bool) -> _QBlocks:
    """Per q block: its ranks' extremes, over its tokens and over those in the tree. Where
    both sides' blocks are the same tokens (a square build), the kv blocks' (two
    reductions over the grid's ranks fewer)."""
    device, nq, q_block, big = grid.device, grid.num_q_blocks, grid.q_block, rank.shape[1] + 1
    q_first = int(grid.q_offset)
    q_end = q_first + grid.q_len
    q_ranks = kv.rank if same else _by_block(rank, q_first, q_end, nq, q_block, -1)
    max_q_all = kv.max_rank if same else q_ranks.amax(-1)
    # A token is in the tree iff its position is below the tree's size (the ranks in
    # it are a permutation of 0..size-1; past it a rank is the position): so each q
    # block's tokens in the tree are a prefix of it, counted from block bounds alone.
    # Their greatest rank is the block's where it holds no other (padding is -1), -1
    # where it holds none, and read token by token only in the one block per row that
    # the tree's end cuts.
    block_first = grid.q_first.view(1, nq)
    in_range = (q_end - block_first).clamp_(max=q_block)  # (1, nq)
    in_tree = (sizes.view(-1, 1).clamp(max=q_end) - block_first).clamp_(min=0)
    in_tree = torch.minimum(in_tree, in_range)  # (R, nq)
    max_q = torch.where(in_tree == in_range, max_q_all, -1)
    max_q.masked_fill_(in_tree == 0, -1)
    cut = ((in_tree > 0) & (in_tree < in_range)).nonzero()
    if cut.numel():
        row, block = cut.unbind(1)
        held = torch.arange(q_block, device=device) < in_tree[row, block].unsqueeze(1)
        max_q[row, block] = torch.where(held, q_ranks[row, block], -1).amax(-1)
    # The least rank of the block's tokens (padding aside). Past the tree a rank is the
    # position, above every rank in it: where the block holds tokens of the tree this
    # is the least of theirs, and where it holds none it is >= the tree's size, past
    # every subtree's end (no tile of it is non-empty) — so it serves as both.
    if same:  # U's least rank is the same least over the same tokens
        min_q = kv.u_lo
    elif nq * q_block == grid.q_len:
        min_q = q_ranks.amin(-1)
    else:
        min_q = _by_block(rank, q_first, q_end, nq, q_block, big).amin(-1)
    q_run = (max_q - min_q + 1 == in_tree) | (max_q < 0)
    return _QBlocks(max_q_all, max_q, min_q, q_run)


def classify_ranked(
    grid: TileGrid,
    parents: list[Tensor],
    rank: Tensor,
    end: Tensor,
    end_by_rank: Tensor,
    tuning: Tuning,
) -> Tensor:
    """Exact codes for any parent-before-child layout, in rank space.

    kv attends q iff ``rank[q]`` lies in kv's subtree ``[rank[kv], end[kv])``. So a
    tile is full iff every kv's subtree holds every q's rank: ``max rank(kv) <=
    min rank(q)`` and ``min end(kv) > max rank(q)`` — exact from per-block extremes.
    It is non-empty iff some q's rank lies in the union ``U`` of its kv block's
    subtrees. Subtrees nest or are disjoint, so ``U`` is the one interval
    ``[lo, hi)`` when the block's lowest rank roots a subtree reaching its highest end
    (a block inside one branch: the common case of insertion order, checked with no
    sort). Where that holds and the q block's ranks are one run, the extremes decide
    the tile; the other tiles are settled by a search of a few ranks in ``U``, sorted
    for those kv blocks alone: the tokens a q block attends are its own tokens and the
    ancestors of its *external parents* (parents outside the block), and ``p``'s
    ancestors meet a kv block iff ``rank[p]`` is in ``U``.

    ``rank``, ``end`` and ``end_by_rank`` are the ``(R, length + 1)`` int32 lookups (every
    pass below is half an int64's).
    """
    if not isinstance(grid.kv_offset, int) or not isinstance(grid.q_offset, int):
        # Trees are not monotone: sides._row_by_row gives each row a grid of int offsets.
        raise RuntimeError("tree classifies one window at a time: per-row offsets reached it")
    sizes = torch.tensor([p.numel() for p in parents], device=grid.device, dtype=torch.int32)
    kv = _kv_blocks(grid, rank, end, end_by_rank)
    same = (grid.q_offset, grid.q_len, grid.q_block) == (
        grid.kv_offset,
        grid.kv_len,
        grid.kv_block,
    )
    q = _q_blocks(grid, rank, sizes, kv, same)
    codes, unsure = _hull_codes(grid, kv, q, tuning)
    if unsure.shape[0]:
        external = external_parents(grid, parents, rank.to(torch.int64))
        found = tuning.search(unsure, external, kv.rank, kv.end, rank.shape[1] + 1)
        codes[tuple(unsure.unbind(1))] = found.to(codes.dtype)  # PARTIAL (1) or EMPTY (0)
    _mark_diagonal(codes, grid, sizes, same)
    return codes.view(codes.shape[0], 1, grid.num_q_blocks, grid.num_kv_blocks)


def _hull_codes(
    grid: TileGrid, kv: _KvBlocks, q: _QBlocks, tuning: Tuning
) -> tuple[Tensor, Tensor]:
    """``(R, nq, nkv)`` codes from the blocks' extremes (ancestors come first, so no kv
    block after a chunk's last query attends it: those tiles stay EMPTY, unread), and the
    ``(k, 3)`` tiles (row, q block, kv block) they leave open, for the search."""
    device, rows = grid.device, kv.max_rank.shape[0]
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    exact = bool(q.run.all()) and bool(kv.u_run.all())
    chunks, step = _chunking(grid, rows, rows * nq * nkv <= tuning.chunked_from, tuning)
    codes = torch.empty(rows, nq, nkv, dtype=CODE_DTYPE, device=device)  # each tile once
    # Each test as "lo <= hi" (strict ones on ends less one), per q block / kv block:
    # full: max rank(kv) <= min rank(q), max rank(q) < min end(kv); nonempty: U's least
    # rank <= max rank(q), min rank(q) < U's end.
    q_lo, q_hi = q.min.unsqueeze(-1), q.max_all.unsqueeze(-1)
    tests = (
        (kv.max_rank.unsqueeze(1), q_lo),
        (q_hi, kv.min_end.sub(1).unsqueeze(1)),
        (kv.u_lo.to(torch.int32).unsqueeze(1), q.max_in_tree.unsqueeze(-1)),
        (q.min.unsqueeze(-1), kv.u_hi.sub(1).unsqueeze(1)),
    )
    parts = chunk_parts(tests, chunks, nq, tuning.narrow)
    flag = parts[0][0][0].dtype
    work = work_buffers(rows * min(step, nq) * nkv, device, flag, 3 if exact else 4)
    # Where a side is not one run the hull test is a candidate only: 0/1 flags of the
    # sides that are, in the tests' dtype (as ``tested_codes``: no bools).
    runs = (q.run.to(flag).unsqueeze(-1), kv.u_run.to(flag).unsqueeze(1))
    unsure: list[Tensor] = []
    for (first, last, cols), part in zip(chunks, parts, strict=True):
        codes[:, first:last, cols:] = EMPTY
        if cols == 0:
            continue
        if exact:  # the extremes decide every tile: codes from int32 arithmetic
            tested_codes(codes[:, first:last, :cols], part, work)
            continue
        unsure.append(_candidates(grid, codes, part, work, runs, (first, last, cols)))
    if not unsure:
        return codes, torch.zeros(0, 3, dtype=torch.int64, device=device)
    return codes, torch.cat(unsure)


def _candidates(
    grid: TileGrid,
    codes: Tensor,
    part: tuple[tuple[Tensor, Tensor], ...],
    work: Tensor,
    runs: tuple[Tensor, Tensor],
    chunk: tuple[int, int, int],
) -> Tensor:
    """One chunk's codes where the hull tests are not exact: FULL where they say so,
    PARTIAL where they hold and both sides are one run, else EMPTY; the tiles left open
    (hull non-empty, not settled) are returned for the search, ``(k, 3)``."""
    first, last, cols = chunk
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    shape = torch.Size((codes.shape[0], last - first, cols))
    full, nonempty, sure, unsure = (work[i, : shape.numel()].view(shape) for i in range(4))
    pair_holds(full, part[0], part[1], sure)
    pair_holds(nonempty, part[2], part[3], sure)
    # No kv block after the q block attends it: where the hull test is exact it is
    # already EMPTY there, so this changes only the candidates.
    nonempty &= torch.le(
        grid.kv_first.reshape(1, 1, nkv)[..., :cols],
        grid.q_last.reshape(1, nq, 1)[:, first:last],
        out=sure[:1, : last - first, :cols],
    )
    # sure: the hull test is exact (both sides one run) or the tile is FULL (exact).
    q_run, u_run = runs
    torch.bitwise_and(q_run[:, first:last], u_run[..., :cols], out=sure)
    sure |= full
    torch.gt(nonempty, sure, out=unsure)  # candidate, not settled: searched below
    tiles = unsure.nonzero()
    tiles[:, 1] += first
    # codes_from(nonempty & (exact or full), full): full implies nonempty.
    nonempty &= sure
    nonempty |= full
    codes[:, first:last, :cols] = nonempty.add_(full)
    return tiles


def _mark_diagonal(codes: Tensor, grid: TileGrid, sizes: Tensor, same: bool) -> None:
    """Tiles holding one token on both sides inside the tree contain q == kv: at least
    PARTIAL. A few tiles near the diagonal, listed once and set per row; where both
    sides' blocks are the same tokens those are the diagonal's, set through a strided view
    (no index tensors, no search for the band)."""
    nq = grid.num_q_blocks
    if same:
        on_diagonal = codes.diagonal(0, 1, 2)  # (R, nq), block i's first token below
        held = grid.q_first.view(1, nq) < sizes.view(-1, 1)
        torch.maximum(on_diagonal, held.to(CODE_DTYPE), out=on_diagonal)
        return
    tiles, tiles_lo = band(grid)
    diagonal = tiles_lo.view(1, -1) < sizes.view(-1, 1)  # (R, tiles in the band)
    on_band = codes[:, tiles[:, 0], tiles[:, 1]]
    codes[:, tiles[:, 0], tiles[:, 1]] = torch.maximum(on_band, diagonal.to(CODE_DTYPE))


def external_parents(grid: TileGrid, parents: list[Tensor], rank: Tensor) -> Tensor:
    """(R, nq, c) ranks of each q block's external parents (-1 pads), c the most any
    block has: the parents outside the block of its tokens in the tree. ``rank`` is the
    ``(R, length + 1)`` int64 rank lookup."""
    rows, nq, q_block = len(parents), grid.num_q_blocks, grid.q_block
    q_first, q_end = grid.q_offset, grid.q_end
    parent = torch.full((rows, rank.shape[1] - 1), -1, dtype=torch.int64)
    for row, p in enumerate(parents):
        parent[row, : p.numel()] = p
    parent = parent.to(grid.device)[:, q_first:q_end]
    parent = torch.nn.functional.pad(parent, (0, nq * q_block - grid.q_len), value=-1)
    parent = parent.view(rows, nq, q_block)
    block_first = grid.q_first.view(1, nq, 1)
    outside = torch.where(parent < block_first, parent, -1)
    count = int((outside >= 0).sum(-1).max())
    outside = outside.sort(-1, descending=True).values[..., : max(count, 1)]
    return torch.where(
        outside >= 0,
        rank.gather(1, outside.clamp(min=0).view(rows, -1)).view(outside.shape),
        -1,
    )
