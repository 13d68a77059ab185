"""Classification: every tile's code from structure, then refinement of undecided tiles.

Leaves (pieces) classify their own tiles (``Piece.classify_tiles``); ``&``, ``|`` and ``~`` combine
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

from flexmask.algebra import And, Leaf, Mask, MaskMod, Or, fold
from flexmask.blocks import (
    CODE_DTYPE,
    EMPTY,
    FULL,
    PARTIAL,
    UNDECIDED,
    BlockGrid,
    and_codes,
    codes_from,
    not_codes,
    or_codes,
)
from flexmask.builders.closed_form import Runs, row_runs
from flexmask.builders.unions import UnionRuns, union_operands, union_row_runs

# Undecided tiles are processed this many elements at a time (1 Mi per intermediate).
REFINE_CHUNK_ELEMENTS = 1 << 20


class Classified(NamedTuple):
    """Tile codes and how many tiles needed refinement to get them: the count belongs to
    this result, so it is returned with it."""

    codes: Tensor
    """(R, Hh, nq, nkv) int8, R = B if the mask depends on the row else 1; Hh likewise.
    EMPTY / PARTIAL / FULL from ``classify_blocks``; ``classify`` may leave UNDECIDED."""
    refined: int
    """Tiles the structure left undecided and that were refined (by intervals or by
    evaluating the mask_mod)."""


def classify(mask: Mask, grid: BlockGrid) -> Classified:
    """Block codes of every tile from structure, broadcastable to (rows, heads, nq, nkv):
    leaves answer for themselves; ``&``, ``|`` and ``~`` combine their children's codes
    (``algebra.fold``). May hold UNDECIDED where two partial tiles meet
    (``classify_blocks`` settles them)."""

    def leaf(node: Mask) -> Classified:
        if (parts := node.head_parts(grid.heads)) is not None:
            return Classified(per_head_codes(node, *parts, grid), 0)
        if not isinstance(node, Leaf):
            raise TypeError(f"cannot classify {type(node).__name__}: not a piece nor an operator")
        return Classified(node.classify_tiles(grid), 0)

    def whole(node: Mask) -> Classified | None:
        if node.has_monotone_intervals():
            # Its closed-form runs are its exact codes, whatever its pieces' tiles would say.
            # In range, as every code here: full where every element inside the lengths
            # attends, so a `~` above empties such an edge tile (classify_blocks demotes the
            # edge tiles once, at the end; torch's runs would leave it partial).
            return Classified(codes_from_runs(row_runs(node, grid, in_range=True), grid), 0)
        if isinstance(node, Or) and (operands := union_operands(node)) is not None:
            rows, _ = grid.reduced(node)
            runs = union_row_runs(*operands, grid, rows, in_range=True)
            return Classified(codes_from_union_runs(runs, grid), 0)
        return None

    def settle(node: Mask, combined: Classified) -> Classified:
        # Two partial tiles met. If every child of an `&` is an interval per query, their
        # intersection settles those tiles here, so an expression above (an `|`, a `~`)
        # sees exact codes.
        codes, refined = combined
        if isinstance(node, And) and int(codes.max()) == UNDECIDED and node.has_intervals():
            rows, _ = grid.reduced(node)
            codes = codes.expand(rows, *codes.shape[1:]).contiguous()
            refined += refine_by_intervals(codes, (codes == UNDECIDED).nonzero(), node, grid)
        return Classified(codes, refined)

    return fold(
        mask,
        leaf,
        lambda a, b: Classified(and_codes(a.codes, b.codes), a.refined + b.refined),
        lambda a, b: Classified(or_codes(a.codes, b.codes), a.refined + b.refined),
        lambda a: Classified(not_codes(a.codes), a.refined),
        whole=whole,
        settle=settle,
    )


def per_head_codes(mask: Mask, distinct: tuple[Mask, ...], heads_of: list[Tensor], grid: BlockGrid):
    """Codes of a mask that is one of several masks on each head (``per_head``): each
    distinct mask classified once (for every head, if it depends on the head itself), its
    codes written to the heads that use it. Tiles a mask leaves UNDECIDED stay so: the build
    refines them with the whole mask's evaluator, which picks by head."""
    rows = grid.batch if mask.batch_dependent or grid.per_row_offsets else 1
    shape = (rows, grid.heads, grid.num_q_blocks, grid.num_kv_blocks)
    out = torch.empty(shape, dtype=CODE_DTYPE, device=grid.device)
    for part, heads in zip(distinct, heads_of, strict=True):
        if heads.numel() == 0:
            continue
        codes = classify(part, grid).codes.expand(shape)
        index = heads.to(grid.device)
        out.index_copy_(1, index, codes.index_select(1, index))
    return out


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
    rows, heads = grid.reduced(mask)
    shape = (rows, heads, grid.num_q_blocks, grid.num_kv_blocks)
    structure = classify(mask, grid)
    codes, refined = structure.codes.expand(shape).contiguous(), structure.refined
    # A leaf that settles every tile itself (``settles_every_tile``, a tree) leaves none
    # UNDECIDED: no pass over the grid to look.
    settled = isinstance(mask, Leaf) and mask.settles_every_tile
    if not settled and int(codes.max()) == UNDECIDED:
        undecided = (codes == UNDECIDED).nonzero()
        if mask.has_intervals():
            refined += refine_by_intervals(codes, undecided, mask, grid)
        else:
            evaluate = mask.lower_at(grid.length, grid.device, grid.lookup_window).evaluate
            refined += refine_by_evaluation(codes, undecided, evaluate, grid)
    return Classified(grid.demote_incomplete(codes), refined)


def refine_by_evaluation(codes: Tensor, tiles: Tensor, evaluate: MaskMod, grid: BlockGrid) -> int:
    """Evaluates the mask on the given tiles only and writes their exact codes in place;
    returns how many tiles that was."""
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
    return tiles.shape[0]


def refine_by_intervals(codes: Tensor, tiles: Tensor, mask: Mask, grid: BlockGrid) -> int:
    """Exact codes of undecided tiles from each query's kv interval: O(q_block) per tile;
    returns how many tiles that was.

    A tile attends somewhere iff one of its in-range queries' intervals meets the tile's kv
    range, and everywhere iff every in-range query's interval covers that range. Intervals
    are asked for at those queries only.
    """
    dev = grid.device
    per_chunk = max(1, REFINE_CHUNK_ELEMENTS // grid.q_block)
    for chunk in torch.split(tiles, per_chunk):
        row, _, q_tile, kv_tile = chunk.unbind(1)
        q_idx = grid.q_first.view(-1)[q_tile].view(-1, 1) + torch.arange(grid.q_block, device=dev)
        in_range = q_idx < grid.q_end
        q_idx = q_idx.clamp(max=grid.q_end - 1)
        intervals = mask.intervals_at(q_idx, row.view(-1, 1), grid)
        assert intervals is not None  # callers check mask.has_intervals()
        lo, hi = intervals
        kv_first = grid.kv_first.view(-1)[kv_tile].view(-1, 1)
        kv_last = grid.kv_last.view(-1)[kv_tile].view(-1, 1)
        meets = (torch.maximum(lo, kv_first) <= torch.minimum(hi, kv_last)) & in_range
        covers = ((lo <= kv_first) & (hi >= kv_last)) | ~in_range
        some, every = meets.any(1), covers.all(1)
        code = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(CODE_DTYPE)
        codes[tuple(chunk.unbind(1))] = code
    return tiles.shape[0]


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
