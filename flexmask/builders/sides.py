"""Which path writes a build's two sides: the closed form (``closed_form``, ``unions``), each
distinct mask of a ``per_head`` once, each row's window where rows have their own offsets,
or the classified tiles (``classify``) — the dispatch ``build`` runs."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.algebra import Mask
from flexmask.blocks import BlockGrid, Ordered, empty_sides, index_tensors, ordered_from_codes
from flexmask.builders import closed_form, columns, unions
from flexmask.builders.classify import classify_blocks


def in_closed_form(mask: Mask) -> bool:
    """True if the build writes ``mask`` from intervals at block edges, no tiles: monotone
    intervals (``closed_form``) or an ``|`` of two such (``unions``)."""
    return mask.has_monotone_intervals() or unions.union_operands(mask) is not None


class Sides(NamedTuple):
    """Both sides' ordered tensors of a build, and how many tiles it refined."""

    kv: Ordered
    q: Ordered
    refined: int
    """Tiles the structure left undecided (0 on the closed form)."""


def ordered_sides(mask: Mask, grid: BlockGrid) -> Sides:
    """Both sides' ordered tensors: in closed form from the intervals at block edges where
    the mask's intervals are monotone (``closed_form``) or it is an ``|`` of two such
    (``unions``), from a piece's runs down its columns where it gives them (``columns``: a
    tree in preorder), else from the classified tiles."""
    if grid.num_q_blocks == 0 or grid.num_kv_blocks == 0:
        return Sides(*empty_sides(*grid.reduced(mask), grid), 0)
    if mask.has_monotone_intervals():
        return Sides(*closed_form.ordered_sides(mask, grid), 0)
    if unions.union_operands(mask) is not None:
        return Sides(*unions.union_sides(mask, grid), 0)
    parts = mask.head_parts(grid.heads)
    if parts is not None:
        return _by_head(mask, parts, grid)
    by_columns = mask.block_columns(grid)
    if by_columns is not None:
        return Sides(*columns.ordered_sides(by_columns, grid), 0)
    codes, refined = classify_blocks(mask, grid)
    return Sides(*ordered_from_codes(codes), refined)


def _by_head(mask: Mask, parts: tuple[tuple[Mask, ...], list[Tensor]], grid: BlockGrid) -> Sides:
    """A mask that is one of several masks on each head (``per_head``): each distinct mask
    that some head uses built once on its own path, and its tensors copied (broadcast over
    the rows) into each of its heads' slices of torch's ``(rows, H, ...)`` layout — one
    write of the output past the parts' own. A part in closed form whose rows are the
    output's writes its index tensors straight into its first head's slice (row by row
    where B > 1 and H > 1): tensors of its own would cost fresh pages, as much as the copy
    at long lengths; only its other heads are copies. The output is ordinary memory, a
    storage per tensor, as torch's."""
    masks, heads = parts
    rows = grid.reduced(mask)[0]
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    shapes = ((nq,), (nq, nkv), (nq,), (nq, nkv), (nkv,), (nkv, nq), (nkv,), (nkv, nq))
    out = index_tensors([(rows, grid.heads, *shape) for shape in shapes], grid.device)
    refined = 0
    for part, index in zip(masks, heads, strict=True):
        head_list = index.tolist()
        if not head_list:  # H shorter than the cycle: no head uses this mask
            continue
        direct = part.has_monotone_intervals() and grid.reduced(part)[0] == rows
        if direct:  # index tensors in order kv partial, q partial, kv full, q full
            targets = [out[i].select(1, head_list[0]) for i in (1, 5, 3, 7)]
            kv, q = closed_form.ordered_sides(part, grid, out=targets)
            part_refined = 0
        else:
            kv, q, part_refined = ordered_sides(part, grid)
        refined += part_refined
        for field, (target, source) in enumerate(zip(out, (*kv, *q), strict=True)):
            for head in head_list:
                if direct and field % 2 and head == head_list[0]:
                    continue  # written in place
                target.select(1, head).copy_(source.select(1, head if source.shape[1] > 1 else 0))
    return Sides(Ordered(*out[:4]), Ordered(*out[4:]), refined)


def build_sides(mask: Mask, grid: BlockGrid) -> Sides:
    """Both sides of a build on ``grid``: row by row where rows have their own offsets and
    the mask is off the closed form (which takes per-row offsets in one), else at once."""
    if grid.per_row_offsets and not in_closed_form(mask):
        return _row_by_row(mask, grid)
    return ordered_sides(mask, grid)


def _row_by_row(mask: Mask, grid: BlockGrid) -> Sides:
    """Per-row windows on the tile path: each row's window built with its own offsets and
    its row kept (B builds; the closed form takes per-row offsets in one)."""
    q_off = grid.q_offset.view(-1).tolist()  # type: ignore[union-attr]
    kv_off = grid.kv_offset.view(-1).tolist()  # type: ignore[union-attr]
    parts, refined = [], 0
    for row in range(grid.batch):
        one = BlockGrid.make(
            grid.batch,
            grid.heads,
            grid.q_len,
            grid.kv_len,
            grid.q_block,
            grid.kv_block,
            grid.device,
            q_offset=q_off[row],
            kv_offset=kv_off[row],
            reach=grid.length,  # the lookups every row's window shares
        )
        kv, q, one_refined = ordered_sides(mask, one)
        parts.append([t[row : row + 1] if t.shape[0] > 1 else t for t in (*kv, *q)])
        refined += one_refined
    stacked = [torch.cat(column) for column in zip(*parts, strict=True)]
    return Sides(Ordered(*stacked[:4]), Ordered(*stacked[4:]), refined)
