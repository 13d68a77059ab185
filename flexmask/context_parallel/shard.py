"""One rank's BlockMask under context parallelism, built from structure.

Rank ``r`` keeps rows ``[r * S / W, (r + 1) * S / W)`` of the permuted mask and attends every
column in the permuted (all-gathered) key order. Those rows are a few runs of consecutive
original queries and the permuted columns a few runs of consecutive original keys: the shard
is one offset build per query run (rows ``[start, start + length)`` of the mask, every key),
its key tiles re-ordered by the column runs, then written as a BlockMask with each row's
blocks listed ascending (unset blocks after, ascending: torch's order).

When every run starts and ends on a block boundary the offset builds are at ``BLOCK_SIZE``
and the cost is the rank's own blocks. Otherwise they are at the largest tile ``g`` that
divides every run boundary and ``BLOCK_SIZE``, and each block is read from its ``(BLOCK_SIZE /
g)**2`` tiles: full if all are full, empty if all are empty (still exact, slower by that
factor).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.build.create import create_block_mask
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


def _tile(block: int, total: int, local_end: int, q: tuple, kv: tuple) -> int:
    """The largest tile dividing ``block`` and every run boundary (a run that ends at the end
    in both orders may end mid-tile: the last tile is cut there in both)."""
    values = [block]
    for (local, orig, lengths), end in ((q, local_end), (kv, total)):
        ends_both = (orig + lengths == total) & (local + lengths == end)
        values += local.tolist() + orig.tolist() + lengths[~ends_both].tolist()
    return math.gcd(*values)  # plain ints: numpy is not a dependency


def _dense(num: Tensor, indices: Tensor, n: int) -> Tensor:
    """Blocks listed by (num, indices) as a dense bool grid (..., rows, n)."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num.unsqueeze(-1)
    out = torch.zeros(*indices.shape[:-1], n + 1, dtype=torch.bool, device=indices.device)
    out.scatter_(-1, torch.where(listed, indices.long(), n), True)
    return out[..., :n]


def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """torch's ``_dense_to_ordered`` (set blocks ascending, then unset ones) in one cumsum."""
    dense = dense.contiguous()
    n = dense.shape[-1]
    count = torch.cumsum(dense, dim=-1, dtype=torch.int32)
    num = count[..., -1] if n else torch.zeros(dense.shape[:-1], dtype=torch.int32)
    col = torch.arange(n, dtype=torch.int32, device=dense.device)
    position = torch.where(dense, count - 1, num.unsqueeze(-1) + col - count)
    indices = torch.empty_like(position)
    indices.scatter_(-1, position.long(), col.expand_as(position).contiguous())
    return num.contiguous(), indices


def _row_grids(
    mask: Mask,
    B: int | None,
    H: int | None,
    perm: Tensor,
    rank: int,
    world: int,
    block: int,
    device: torch.device,
    row: int | None,
) -> tuple[Tensor, Tensor]:
    """(partial, full) bool grids of one permutation row: (rows, heads, n_q, n_kv) at block."""
    total = perm.numel()
    local_len = total // world
    q_perm = perm[rank * local_len : (rank + 1) * local_len]
    q_runs, kv_runs = runs(q_perm), runs(perm)
    tile = _tile(block, total, local_len, q_runs, kv_runs)
    full_parts, some_parts = [], []
    for start, length in zip(q_runs[1].tolist(), q_runs[2].tolist(), strict=False):
        bm = create_block_mask(mask, B, H, length, total, device, tile, q_offset=start)
        n_kv = bm.kv_indices.shape[-1]
        full = _dense(bm.full_kv_num_blocks, bm.full_kv_indices, n_kv)
        some = _dense(bm.kv_num_blocks, bm.kv_indices, n_kv) | full
        if row is not None:
            full, some = full[row : row + 1], some[row : row + 1]
        elif not mask.batch_dependent:  # B reduced to 1 where the mask ignores it
            full, some = full[:1], some[:1]
        if not mask.head_dependent:
            full, some = full[:, :1], some[:, :1]
        full_parts.append(full)
        some_parts.append(some)
    full, some = torch.cat(full_parts, dim=2), torch.cat(some_parts, dim=2)
    # Permuted key tile j is original key tile perm[j * tile] // tile.
    kv_tiles = perm[::tile].to(full.device) // tile
    full, some = full[..., kv_tiles], some[..., kv_tiles]
    if tile != block:
        full, some = _coarsen(full, tile, block), _coarsen(some, tile, block, any_=True)
    return some & ~full, full


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
) -> BlockMask:
    """The BlockMask of rank ``rank``'s rows of ``mask`` under the permutation ``indices``."""
    total = indices.shape[-1]
    if indices.shape[0] == 1:
        partial, full = _row_grids(mask, B, H, indices[0], rank, world, block, device, None)
    else:
        grids = [
            _row_grids(
                mask,
                B,
                H,
                indices[row],
                rank,
                world,
                block,
                device,
                row if mask.batch_dependent else 0,
            )
            for row in range(indices.shape[0])
        ]
        partial = torch.cat([g[0] for g in grids])
        full = torch.cat([g[1] for g in grids])
    local_len = total // world
    kv_num, kv_idx = ordered(partial)
    full_kv_num, full_kv_idx = ordered(full)
    q_num, q_idx = ordered(partial.transpose(-2, -1))
    full_q_num, full_q_idx = ordered(full.transpose(-2, -1))
    q_index = _padded_lookup(
        indices[:, rank * local_len : (rank + 1) * local_len], math.ceil(local_len / block) * block
    )
    kv_index = _padded_lookup(indices, math.ceil(total / block) * block)
    return BlockMask(
        (local_len, total),
        kv_num,
        kv_idx,
        full_kv_num,
        full_kv_idx,
        q_num,
        q_idx,
        full_q_num,
        full_q_idx,
        BLOCK_SIZE=(block, block),
        mask_mod=ShardMaskMod(mask.mask_mod, q_index.to(device), kv_index.to(device)),
    )


def _padded_lookup(index: Tensor, length: int) -> Tensor:
    # Rows past the end (padding of the last block) read the last index; the kernel drops them.
    pad = length - index.shape[-1]
    if pad <= 0:
        return index.contiguous()
    return torch.cat([index, index[:, -1:].expand(-1, pad)], dim=-1).contiguous()
