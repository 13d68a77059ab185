"""The vectorized machinery of a tree's tile classification (``flexmask.pieces.tree_tiles``):
chunks of q blocks, compares narrowed to int16, codes from four ``lo <= hi`` tests, the
tiles around the diagonal, and the exact search of sorted subtrees.

Its sizes (tiles per chunk, when to chunk, when to narrow) are given by the caller
(``flexmask.pieces.tree``, which holds them as tunables).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.algebra import TileGrid


def chunks_of(
    grid: TileGrid, rows: int, chunk_tiles: int
) -> tuple[list[tuple[int, int, int]], int]:
    """Chunks of q blocks ``(first, last, cols)`` (at least 4, at most ``chunk_tiles`` tiles
    over the rows), ``cols`` the kv blocks starting at or before the chunk's last query (the
    others are after every query of it), and the most q blocks a chunk holds."""
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    step = max(1, min(chunk_tiles // max(1, rows * nkv), -(-nq // 4)))
    stops = list(range(step, nq, step)) + [nq]
    reach = torch.searchsorted(grid.kv_first.reshape(nkv), grid.q_last.reshape(nq), right=True)
    reach_at = reach[torch.tensor(stops, device=grid.device) - 1].tolist()
    return list(zip(range(0, nq, step), stops, reach_at, strict=True)), step


def _part(
    tests: tuple[tuple[Tensor, Tensor], ...], first: int, last: int, cols: int
) -> tuple[tuple[Tensor, Tensor], ...]:
    """The tests' operands on q blocks ``first:last`` and kv blocks ``:cols``: each sliced
    along the dimensions it holds (a q block's per-row value has one kv column, a kv
    block's one q row, which broadcast)."""

    def part(t: Tensor) -> Tensor:
        t = t[..., first:last, :] if t.shape[-2] > 1 else t
        return t[..., :cols] if t.shape[-1] > 1 else t

    return tuple((part(lo), part(hi)) for lo, hi in tests)


def work_buffers(tiles: int, device: torch.device, dtype: torch.dtype, count: int = 3) -> Tensor:
    """``count`` 0/1 flag buffers of ``tiles`` entries in the tests' ``dtype`` (see
    ``chunk_parts``) for ``tested_codes`` (three) or the inexact branch of the rank-space
    classifier (four), reused across chunks (a chunk's fit the cache)."""
    return torch.empty(count, tiles, dtype=dtype, device=device)


def chunk_parts(
    tests: tuple[tuple[Tensor, Tensor], ...],
    chunks: list[tuple[int, int, int]],
    nq: int,
    narrow: int,
) -> list[tuple[tuple[Tensor, Tensor], ...]]:
    """Each chunk's tests ``lo <= hi`` (one side per q block ``(r, nq, 1)``, the other per
    kv block ``(r, 1, m)``) on its q blocks ``first:last`` and kv blocks ``:cols``, as
    int16 where every chunk's q-side values span less than ``narrow``, else int32.

    Narrowing is exact: in a chunk whose q-side values lie in ``[a, b]`` a kv-side value
    below ``a`` compares as ``a - 1`` does and one above ``b`` as ``b + 1``, so the kv side
    is clamped to ``[a - 1, b + 1]`` and both sides less ``a - 1`` fit int16. It pays:
    torch's CPU compare is vectorized only into its operands' dtype — an int32 compare
    into int8 flags computes int32 and casts (213 us on an (8, 64, 1024) chunk, one run),
    int16 into int16 takes 30 us. Ranking the values instead costs more than it saves
    (torch's CPU sort of (8, 8192) int32 took 3.5 ms)."""
    count = len(chunks)
    step = chunks[0][1] - chunks[0][0]
    narrowed: list[tuple[Tensor, Tensor, bool]] = []
    for lo, hi in tests:
        q_is_lo = lo.shape[-2] == nq and lo.shape[-1] == 1
        q, kv = (lo, hi) if q_is_lo else (hi, lo)
        r = q.shape[0]
        pad = count * step - nq
        q_rows = q.reshape(r, nq)
        if pad:
            low = torch.nn.functional.pad(q_rows, (0, pad), value=torch.iinfo(q.dtype).max)
            high = torch.nn.functional.pad(q_rows, (0, pad), value=torch.iinfo(q.dtype).min)
        else:
            low = high = q_rows
        base = low.view(r, count, step).amin(-1).sub_(1).unsqueeze(-1)  # (r, chunks, 1)
        top = high.view(r, count, step).amax(-1).add_(1).unsqueeze(-1)
        if int((top - base).max()) > narrow:
            return [_part(tests, first, last, cols) for first, last, cols in chunks]
        kv_n = torch.minimum(torch.maximum(kv, base), top).sub_(base).to(torch.int16)
        q_n = q_rows.view(r, -1) - base.repeat_interleave(step, 1).view(r, -1)[:, :nq]
        narrowed.append((q_n.to(torch.int16).view(r, nq, 1), kv_n, q_is_lo))
    parts = []
    for index, (first, last, cols) in enumerate(chunks):
        part = []
        for q_n, kv_n, q_is_lo in narrowed:
            q_side = q_n[:, first:last]
            kv_side = kv_n[:, index : index + 1, :cols]
            part.append((q_side, kv_side) if q_is_lo else (kv_side, q_side))
        parts.append(tuple(part))
    return parts


def pair_holds(
    flags: Tensor, first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor], other: Tensor
) -> None:
    """0/1 ``flags`` (a view at the chunk's shape, in the operands' dtype): where both
    tests ``lo <= hi`` hold. The first is written at the whole shape, the second at the
    shape its operands broadcast to (a block-bound test is shared by the rows) into the
    front of ``other``."""
    torch.le(first[0].expand(flags.shape), first[1], out=flags)
    lo, hi = second  # 3-d, each dimension 1 or the chunk's (no torch.broadcast_shapes:
    # its Python costs ~8 us a call, 0.27 ms a build at 131k B=8)
    flags &= torch.le(
        lo,
        hi,
        out=other[tuple(slice(0, max(a, b)) for a, b in zip(lo.shape, hi.shape, strict=True))],
    )


def tested_codes(out: Tensor, tests: tuple[tuple[Tensor, Tensor], ...], work: Tensor) -> None:
    """Tile codes into ``out`` (int8 ``(R, n, m)``, a view of the grid) from four tests
    ``lo <= hi`` of operands that broadcast to it (per q block, per kv block, per row or
    shared by the rows): FULL where the first two hold, else PARTIAL where the last two
    hold, else EMPTY — ``codes_from(nonempty, full)``, whose full implies nonempty.

    The flags are 0/1 in the operands' dtype (int16 from ``chunk_parts``), not bools nor
    int8: torch's CPU compare is vectorized only into its operands' dtype (int32 operands
    into bools take its scalar loop; into int8 they are computed as int32 and cast). One
    cast at the end writes the codes. The first test of each pair is written at the
    chunk's whole shape; the second may be shared by the rows (block bounds)."""
    shape = out.shape
    full, nonempty, other = (work[i, : shape.numel()].view(shape) for i in range(3))
    pair_holds(full, tests[0], tests[1], other)
    pair_holds(nonempty, tests[2], tests[3], other)
    out.copy_(full.add_(nonempty))


def band(grid: TileGrid) -> tuple[Tensor, Tensor]:
    """The tiles whose q and kv token ranges overlap, ``(k, 2)`` (q block, kv block), and
    the first token of each overlap: per q block a short range of kv blocks, found by two
    binary searches (block bounds ascend), not a pass over the tile grid."""
    nq, nkv, device = grid.num_q_blocks, grid.num_kv_blocks, grid.device
    q_lo, q_hi = grid.q_first.reshape(nq), grid.q_last.reshape(nq)
    kv_lo, kv_hi = grid.kv_first.reshape(nkv), grid.kv_last.reshape(nkv)
    first = torch.searchsorted(kv_hi.contiguous(), q_lo)  # first kv block ending at/after q
    last = torch.searchsorted(kv_lo.contiguous(), q_hi, right=True) - 1
    width = int((last - first + 1).clamp(min=0).max()) if nq else 0
    kv_tile = first.view(-1, 1) + torch.arange(width, device=device)
    inside = kv_tile <= last.view(-1, 1)
    q_tile = torch.arange(nq, device=device).view(-1, 1).expand_as(kv_tile)[inside]
    kv_tile = kv_tile[inside]
    return torch.stack([q_tile, kv_tile], 1), torch.maximum(kv_lo[kv_tile], q_lo[q_tile])


def search_subtrees(
    tiles: Tensor, parents: Tensor, kv_rank: Tensor, kv_end: Tensor, big: int
) -> Tensor:
    """For tiles ``(k, 3)`` = (row, q block, kv block): does some external parent's rank lie
    in the kv block's union of subtrees? The kv blocks these tiles name have their subtrees
    sorted by rank, with the running max of their ends (rank x is in U iff the running end
    at the last rank <= x exceeds x); one search over those blocks laid end to end, each
    block's keys shifted past the previous block's. Tokens outside the tree stay among the
    keys: their end is 0 (they cover nothing), padding's rank -1 sorts first and a rank past
    the tree (its position) sorts after every rank a parent can have."""
    rows, nkv, kv_block = kv_rank.shape
    named = tiles[:, 0] * nkv + tiles[:, 2]
    blocks, which = torch.unique(named, return_inverse=True)
    u_rank = kv_rank.reshape(rows * nkv, kv_block)[blocks].to(torch.int64)
    u_rank, order = u_rank.sort(-1)
    u_end = kv_end.reshape(rows * nkv, kv_block)[blocks].to(torch.int64).gather(-1, order)
    u_end = u_end.cummax(-1).values
    stride = big + 1
    line = torch.arange(blocks.numel(), device=u_rank.device).view(-1, 1)
    keys = (line * stride + u_rank).view(-1)
    ends = u_end.reshape(-1)
    found = torch.empty(tiles.shape[0], dtype=torch.bool, device=tiles.device)
    per_chunk = max(1, (1 << 20) // parents.shape[-1])
    for start in range(0, tiles.shape[0], per_chunk):
        row, q_tile, _ = tiles[start : start + per_chunk].unbind(1)
        ranks = parents[row, q_tile]  # (k, c)
        block = which[start : start + per_chunk].view(-1, 1)
        at = torch.searchsorted(keys, block * stride + ranks, right=True) - 1
        inside = (ranks >= 0) & (at >= block * kv_block)
        covered = inside & (ends[at.clamp(min=0)] > ranks)
        found[start : start + per_chunk] = covered.any(-1)
    return found
