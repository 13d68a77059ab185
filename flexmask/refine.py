"""Exact codes for tiles the structure left UNDECIDED, at a cost proportional to their count.

Two ways, cheapest first: when the expression (or an ``&`` inside it) has one kv interval per
query, from those intervals — O(q_block) per tile; otherwise by evaluating the mask on the
tiles alone — O(q_block * kv_block) per tile, never the whole Q×KV grid.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.blocks import CODE_DTYPE, EMPTY, FULL, PARTIAL, BlockGrid
from flexmask.mask import Mask, MaskMod

# Undecided tiles are processed this many elements at a time (1 Mi per intermediate).
REFINE_CHUNK_ELEMENTS = 1 << 20


def refine_by_evaluation(codes: Tensor, tiles: Tensor, evaluate: MaskMod, grid: BlockGrid) -> None:
    """Evaluates the mask on the given tiles only and writes their exact codes in place."""
    grid.refined[0] += tiles.shape[0]
    q_tile, kv_tile = tiles[:, 2], tiles[:, 3]
    complete = (grid.q_first.view(-1)[q_tile] + grid.q_block <= grid.q_end) & (
        grid.kv_first.view(-1)[kv_tile] + grid.kv_block <= grid.kv_end
    )
    per_chunk = max(1, REFINE_CHUNK_ELEMENTS // (grid.q_block * grid.kv_block))
    for part, clip in ((tiles[complete], False), (tiles[~complete], True)):
        if part.numel() == 0:
            continue
        for chunk in torch.split(part, per_chunk):
            codes[tuple(chunk.unbind(1))] = _evaluate_tiles(chunk, evaluate, grid, clip)


def refine_by_intervals(codes: Tensor, tiles: Tensor, mask: Mask, grid: BlockGrid) -> None:
    """Exact codes of undecided tiles from each query's kv interval: O(q_block) per tile.

    A tile attends somewhere iff one of its in-range queries' intervals meets the tile's kv
    range, and everywhere iff every in-range query's interval covers that range. Intervals
    are asked for at those queries only.
    """
    grid.refined[0] += tiles.shape[0]
    dev = grid.device
    per_chunk = max(1, REFINE_CHUNK_ELEMENTS // grid.q_block)
    for chunk in torch.split(tiles, per_chunk):
        row, _, q_tile, kv_tile = chunk.unbind(1)
        q_idx = grid.q_first.view(-1)[q_tile].view(-1, 1) + torch.arange(grid.q_block, device=dev)
        in_range = q_idx < grid.q_end
        q_idx = q_idx.clamp(max=grid.q_end - 1)
        intervals = mask._intervals(q_idx, row.view(-1, 1), grid)
        assert intervals is not None  # callers check mask._has_intervals()
        lo, hi = intervals
        kv_first = grid.kv_first.view(-1)[kv_tile].view(-1, 1)
        kv_last = grid.kv_last.view(-1)[kv_tile].view(-1, 1)
        meets = (torch.maximum(lo, kv_first) <= torch.minimum(hi, kv_last)) & in_range
        covers = ((lo <= kv_first) & (hi >= kv_last)) | ~in_range
        some, every = meets.any(1), covers.all(1)
        code = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(CODE_DTYPE)
        codes[tuple(chunk.unbind(1))] = code


def _evaluate_tiles(chunk: Tensor, evaluate: MaskMod, grid: BlockGrid, clip: bool) -> Tensor:
    """Codes of k tiles from one evaluation on (k, q_block, kv_block) broadcasting indices."""
    dev = grid.device
    row, head, q_tile, kv_tile = chunk.unbind(1)
    q_first = grid.q_first.view(-1)[q_tile].view(-1, 1, 1)
    kv_first = grid.kv_first.view(-1)[kv_tile].view(-1, 1, 1)
    q_idx = q_first + torch.arange(grid.q_block, device=dev).view(1, -1, 1)
    kv_idx = kv_first + torch.arange(grid.kv_block, device=dev).view(1, 1, -1)
    shape = (chunk.shape[0], grid.q_block, grid.kv_block)
    if not clip:
        attends = evaluate(row.view(-1, 1, 1), head.view(-1, 1, 1), q_idx, kv_idx)
        attends = attends.expand(shape).reshape(shape[0], -1)
        some, every = attends.any(1), attends.all(1)
    else:
        # Tiles past an end: clamp the indices (lookups are sized to the sequence) and count
        # only in-range elements.
        in_range = ((q_idx < grid.q_end) & (kv_idx < grid.kv_end)).expand(shape)
        attends = evaluate(
            row.view(-1, 1, 1),
            head.view(-1, 1, 1),
            q_idx.clamp(max=grid.q_end - 1),
            kv_idx.clamp(max=grid.kv_end - 1),
        )
        attends = attends.expand(shape) & in_range
        some = attends.flatten(1).any(1)
        every = (attends | ~in_range).flatten(1).all(1)
    code = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY))
    return code.to(CODE_DTYPE)
