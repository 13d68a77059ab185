"""Which path writes a build's two sides: the closed form (``closed_form``, ``unions``), each
distinct mask of a ``per_head`` once, each row's window where rows have their own offsets,
or the classified tiles (``classify``) — the dispatch ``build`` runs, recording as it goes
the ``Route`` it took (what ``explain_build`` reports and a built BlockMask keeps)."""

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


class Route(NamedTuple):
    """The path a build took (``flexmask.explain_build`` reports it, ``flexmask.diff`` names
    it): written by the dispatch below as it dispatches, so it says what ran, not what a
    second reading of the mask would guess."""

    path: str
    """One of ``PATHS``' keys."""
    why: str
    """What about the mask (or grid) chose the path."""
    tiles: int = 0
    """Tiles classified from structure (the tile path only: the others make no tile grid)."""
    refined: int = 0
    """Of those, tiles the structure left undecided and that were refined."""
    parts: tuple[Route, ...] = ()
    """Per head mask or per row window: each part's own route, in order."""

    @property
    def total_refined(self) -> int:
        """Refined tiles, the parts' included (what ``build_counted`` returns)."""
        return self.refined + sum(part.total_refined for part in self.parts)

    def plain(self) -> tuple:
        """As nested tuples of str and int: what a pickled BlockMask carries, so that
        ``torch.load(weights_only=True)`` reads it without another class allowed."""
        return (self.path, self.why, self.tiles, self.refined, tuple(p.plain() for p in self.parts))

    @staticmethod
    def from_plain(plain: tuple) -> Route:
        path, why, tiles, refined, parts = plain
        return Route(path, why, tiles, refined, tuple(Route.from_plain(p) for p in parts))


PATHS = {
    "closed form": "an & of interval pieces: each query attends one kv interval, its ends "
    "monotone, so both sides are runs of blocks read from the intervals at block edges (no "
    "tile grid)",
    "unions": "an | of two masks in closed form: at most two runs of blocks per row and per "
    "column, from both operands' intervals (no tile grid)",
    "per head": "per_head: each distinct head mask built once on its own path, copied to "
    "the heads that use it",
    "tree columns": "a tree in preorder: each kv block column is one run of q blocks with one "
    "full run inside (no tile grid)",
    "tiles": "tile classification: no closed form, no per-head parts, no column runs, so "
    "each piece classifies every tile from its data, & | ~ combine the codes, and only the "
    "tiles two partial codes leave undecided are refined",
    "rows": "rows with their own offsets off the closed form: each row's window built on its own",
    "no tiles": "a zero length: no tile to classify, every list empty",
    "torch": "torch's create_block_mask",
}
"""Every path a build can take, and what chooses it."""


def _tiles_why(mask: Mask) -> str:
    how = (
        "from each query's kv interval"
        if mask.has_intervals()
        else "by evaluating the mask_mod on those tiles only"
    )
    return f"{PATHS['tiles']} ({how})"


class Sides(NamedTuple):
    """Both sides' ordered tensors of a build, and the path that wrote them."""

    kv: Ordered
    q: Ordered
    route: Route


def ordered_sides(mask: Mask, grid: BlockGrid) -> Sides:
    """Both sides' ordered tensors: in closed form from the intervals at block edges where
    the mask's intervals are monotone (``closed_form``) or it is an ``|`` of two such
    (``unions``), from a piece's runs down its columns where it gives them (``columns``: a
    tree in preorder), else from the classified tiles."""
    if grid.num_q_blocks == 0 or grid.num_kv_blocks == 0:
        return Sides(*empty_sides(*grid.reduced(mask), grid), Route("no tiles", PATHS["no tiles"]))
    if mask.has_monotone_intervals():
        route = Route("closed form", PATHS["closed form"])
        return Sides(*closed_form.ordered_sides(mask, grid), route)
    if unions.union_operands(mask) is not None:
        return Sides(*unions.union_sides(mask, grid), Route("unions", PATHS["unions"]))
    parts = mask.head_parts(grid.heads)
    if parts is not None:
        return _by_head(mask, parts, grid)
    by_columns = mask.block_columns(grid)
    if by_columns is not None:
        route = Route("tree columns", PATHS["tree columns"])
        return Sides(*columns.ordered_sides(by_columns, grid), route)
    codes, refined = classify_blocks(mask, grid)
    route = Route("tiles", _tiles_why(mask), tiles=codes.numel(), refined=refined)
    return Sides(*ordered_from_codes(codes), route)


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
    routes = []
    for part, index in zip(masks, heads, strict=True):
        head_list = index.tolist()
        if not head_list:  # H shorter than the cycle: no head uses this mask
            continue
        direct = part.has_monotone_intervals() and grid.reduced(part)[0] == rows
        if direct:  # index tensors in order kv partial, q partial, kv full, q full
            targets = [out[i].select(1, head_list[0]) for i in (1, 5, 3, 7)]
            kv, q = closed_form.ordered_sides(part, grid, out=targets)
            routes.append(Route("closed form", PATHS["closed form"]))
        else:
            kv, q, part_route = ordered_sides(part, grid)
            routes.append(part_route)
        for field, (target, source) in enumerate(zip(out, (*kv, *q), strict=True)):
            for head in head_list:
                if direct and field % 2 and head == head_list[0]:
                    continue  # written in place
                target.select(1, head).copy_(source.select(1, head if source.shape[1] > 1 else 0))
    route = Route("per head", PATHS["per head"], parts=tuple(routes))
    return Sides(Ordered(*out[:4]), Ordered(*out[4:]), route)


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
    parts, routes = [], []
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
        kv, q, route = ordered_sides(mask, one)
        parts.append([t[row : row + 1] if t.shape[0] > 1 else t for t in (*kv, *q)])
        routes.append(route)
    stacked = [torch.cat(column) for column in zip(*parts, strict=True)]
    route = Route("rows", PATHS["rows"], parts=tuple(routes))
    return Sides(Ordered(*stacked[:4]), Ordered(*stacked[4:]), route)
