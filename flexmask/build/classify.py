"""Classification: every tile's code from structure, then refinement of undecided tiles.

Leaves (pieces) classify their own tiles (``Piece._classify``); ``&``, ``|`` and ``~`` combine
codes here. A sub-expression with monotone intervals (an ``&`` of interval pieces inside a
union, say) takes its exact codes from its closed-form row runs instead. Tiles two partial
codes leave UNDECIDED are refined at a cost proportional to their count, cheapest first: when
the expression (or an ``&`` inside it) has one kv interval per query, from those intervals —
O(q_block) per tile; otherwise by evaluating the mask on those tiles alone —
O(q_block * kv_block) per tile, never the whole Q×KV grid.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.build.closed_form import Runs, row_runs
from flexmask.build.codes import (
    CODE_DTYPE,
    EMPTY,
    FULL,
    PARTIAL,
    UNDECIDED,
    and_codes,
    codes_from,
    not_codes,
    or_codes,
)
from flexmask.build.grid import BlockGrid
from flexmask.build.unions import UnionRuns, union_operands, union_row_runs
from flexmask.mask import And, Mask, MaskMod, Not, Or

# Undecided tiles are processed this many elements at a time (1 Mi per intermediate).
REFINE_CHUNK_ELEMENTS = 1 << 20


class Classified(NamedTuple):
    """Final tile codes (EMPTY / PARTIAL / FULL) and how many tiles needed evaluation."""

    codes: Tensor
    """(R, Hh, nq, nkv) int8, R = B if the mask depends on the row else 1; Hh likewise."""
    refined: int
    """Tiles the structure left undecided and the mask_mod was evaluated on."""


def classify(mask: Mask, grid: BlockGrid) -> Tensor:
    """Block codes of every tile from structure, broadcastable to (rows, heads, nq, nkv):
    leaves answer for themselves; ``&``, ``|`` and ``~`` combine their children's codes.
    May hold UNDECIDED where two partial tiles meet (``classify_blocks`` settles them)."""
    if isinstance(mask, Not):
        return not_codes(classify(mask.child, grid))
    if isinstance(mask, (And, Or)) and mask._has_monotone_intervals():
        # Its closed-form runs are its exact codes, whatever its pieces' tiles would say.
        return codes_from_runs(row_runs(mask, grid), grid)
    if isinstance(mask, Or) and (operands := union_operands(mask)) is not None:
        rows, _ = grid.reduced(mask)
        return codes_from_union_runs(union_row_runs(*operands, grid, rows), grid)
    if isinstance(mask, Or):
        codes = classify(mask.children[0], grid)
        for child in mask.children[1:]:
            codes = or_codes(codes, classify(child, grid))
        return codes
    if isinstance(mask, And):
        codes = classify(mask.children[0], grid)
        for child in mask.children[1:]:
            codes = and_codes(codes, classify(child, grid))
        # Two partial tiles met. If every child is an interval per query, their intersection
        # settles those tiles here, so an expression above (an `|`, a `~`) sees exact codes.
        if int(codes.max()) == UNDECIDED and mask._has_intervals():
            rows, _ = grid.reduced(mask)
            codes = codes.expand(rows, *codes.shape[1:]).contiguous()
            refine_by_intervals(codes, (codes == UNDECIDED).nonzero(), mask, grid)
        return codes
    return mask._classify(grid)  # type: ignore[attr-defined]


def codes_from_runs(runs: Runs, grid: BlockGrid) -> Tensor:
    """(R, 1, nq, nkv) codes of an ``&`` (or a from-zero ``|``) of interval pieces from its
    closed-form row runs (``closed_form.row_runs``):
    exact, so an expression above it (an ``|``, a ``~``) combines exact codes without
    classifying each piece and refining where two partial pieces meet."""
    rows = runs.first.shape[0]
    kv_tile = torch.arange(grid.num_kv_blocks, device=grid.device).view(1, 1, -1)

    def inside(first: Tensor, last: Tensor) -> Tensor:
        return (first.unsqueeze(-1) <= kv_tile) & (kv_tile <= last.unsqueeze(-1))

    codes = codes_from(inside(runs.first, runs.last), inside(runs.full_first, runs.full_last))
    return codes.view(rows, 1, grid.num_q_blocks, grid.num_kv_blocks)


def codes_from_union_runs(runs: UnionRuns, grid: BlockGrid) -> Tensor:
    """(R, 1, nq, nkv) exact codes of an ``|`` of two monotone masks from its runs
    (``unions.union_row_runs``)."""
    kv_tile = torch.arange(grid.num_kv_blocks, device=grid.device)
    inside = (runs.starts.unsqueeze(-1) <= kv_tile) & (kv_tile < runs.stops.unsqueeze(-1))
    codes = codes_from(inside[:, :, :2].any(2), inside[:, :, 2:].any(2))
    return codes.unsqueeze(1)


def classify_blocks(mask: Mask, grid: BlockGrid) -> Classified:
    """Every tile's final code: structure first, the mask_mod only on undecided tiles."""
    grid.refined[0] = 0
    rows, heads = grid.reduced(mask)
    shape = (rows, heads, grid.num_q_blocks, grid.num_kv_blocks)
    codes = classify(mask, grid).expand(shape).contiguous()
    undecided = (codes == UNDECIDED).nonzero() if int(codes.max()) == UNDECIDED else None
    if undecided is not None:
        if mask._has_intervals():
            refine_by_intervals(codes, undecided, mask, grid)
        else:
            refine_by_evaluation(
                codes, undecided, mask._lower(grid.length, grid.device).evaluate, grid
            )
    return Classified(grid.demote_incomplete(codes), grid.refined[0])


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
