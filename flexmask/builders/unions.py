"""BlockMask tensors in closed form for an ``|`` of two masks with monotone intervals.

Each operand ``A``, ``B`` (an ``&`` of interval pieces, a prefix-LM...) gives query ``q`` one
kv interval, clipped to the grid's kv window: ``IA(q) = [loA, hiA]``, ``IB(q) = [loB, hiB]``
(empty when lo > hi), each with the properties ``closed_form`` proves. The union attends
``U(q) = IA(q) ∪ IB(q)``: one interval, or two with a gap between them. Such as the
document-causal prefix-LM ``(causal() & document(l)) | prefix(64)``: a query in a later
document attends the prompt ``[0, 63]`` and its own document ``[start, q]``.

**Non-empty tiles.** A tile is non-empty in the union iff it is in either operand, so each
block row's non-empty tiles are the union of the operands' runs: at most two runs.

**Full tiles.** Where both intervals are non-empty, ``U(q) = [m, M] \\ G`` with the hull
``m = min(loA, loB)``, ``M = max(hiA, hiB)`` and the gap ``G(q) = [min(hiA, hiB) + 1,
max(loA, loB) - 1]`` (empty when the intervals overlap or touch: check the three ways two
intervals lie, nested, overlapping, apart); where one is empty, ``U(q)`` is the other and
there is no gap. So a complete tile ``[c, d]`` is covered by every query ``q`` of a block iff

    every q attends,  [c, d] ⊂ [max_q m(q), min_q M(q)]  and  [c, d] ∩ ⋃_q G(q) = ∅.

Claim: the gaps of one batch row, over all its queries, share their left end, so ``⋃_q G(q)``
over a block is one interval ``[g0, g1]`` and the block row's full tiles are at most two runs:
the complete tiles of the hull left of the gap's tiles and right of them. Proof: let ``G(q)``
be non-empty, ``X`` the operand of smaller ``hi`` and ``Y`` the other. Then ``loY > hiX + 1``
(``loX <= hiX`` as ``X`` attends), ``loY`` is not the clip ``k0`` (``hiX >= k0``), so
``hiX < loY - 1 <= q - 1`` (``lo <= q``), and ``hiX`` is not the clip ``k1`` either (``Y``
would be empty). So ``hiX(q) = CX < q``: ``X`` is past the point where its ``hi`` is constant
(``closed_form``: a ``hi`` below ``q`` stays constant), and ``gl(q) = min(hiA, hiB) + 1 = CX +
1``. At any later query ``p`` where both attend, ``gl(p) <= hiX(p) + 1 = CX + 1``, and
``gl(p) >= gl(q)`` because the queries where both attend are a range on which every clipped
``lo`` and ``hi`` never decreases. So every gap starts at ``CX + 1``. ∎ Moreover the gap's
right end ``gr = max(loA, loB) - 1`` never decreases there, so the queries with a gap are a
suffix of the range where both attend.

**Which queries are read.** Both operands' intervals are computed once at every query
(``_queries``: O(Q), a few passes). Inside a block where each operand's attending is
all-or-nothing, ``m``, ``M``, ``gl`` and ``gr`` never decrease, so ``max m = m(z)``,
``min M = M(a)`` and the gaps (a suffix) are ``[gl(z), gr(z)]``: the reductions over the
two edge queries ``a``, ``z`` give exactly these. The blocks where an operand starts or
stops attending inside (``closed_form.special_blocks``: at most two per operand and batch
row) are reduced over all their queries.

**Columns.** Transposed, each operand gives kv position ``k`` the range of queries that
attend it, ``[qlo(k), qhi(k)]``, found by binary search over the intervals at every query
(``_transposed``); these never decrease in ``k``, ``qlo(k) <= k``, and ``qhi(k) >= k`` or
is a constant (the operand's last attending query): the properties the proof above uses.
So each kv column's blocks are two non-empty runs and two full runs as well, reduced the
same way over each tile's edge keys and the keys of its two special tiles per operand.

Both sides are written from their runs (``ordered_runs``): no tile is evaluated, nothing is
sorted but a line's nine segments, and nothing is read back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.algebra import Mask, Or
from flexmask.blocks import (
    CODE_DTYPE,
    BlockGrid,
    Ordered,
    codes_from,
    expand_runs,
    exporting,
    index_tensors,
    q_side_from_codes,
    q_side_from_line_runs,
    side_by_side,
)
from flexmask.builders.closed_form import clipped, special_blocks

# Larger than any position: the neutral value of a min over non-attending queries; the sum
# of two stays inside int64.
_FAR = 1 << 60


class UnionRuns(NamedTuple):
    """Per block row ``(R, nq)``: two runs of non-empty tiles and two runs of full tiles,
    each ``[start, stop)`` (empty when stop <= start), full runs inside non-empty ones. The
    runs are read as a union (the full ones may repeat), and their ends may lie outside
    ``[0, n]`` (``_FAR`` over a tile): clamp them to read positions."""

    starts: Tensor
    """(R, nq, 4): non-empty run 1, non-empty run 2, full run 1, full run 2."""
    stops: Tensor


def union_operands(mask: Mask) -> tuple[Mask, Mask] | None:
    """The two operands of an ``|`` this module writes, or None.

    A union of two children with monotone intervals qualifies. Children that attend
    nowhere (``empty()``) drop out, and those that attend from key 0 (or around
    themselves, spans) join as one from-zero union (``causal() | prefix(n)`` is itself
    monotone); two operands must remain (or one, and an ``empty()``). A union that is
    itself monotone (``Or.attends_from_zero``) goes to ``closed_form`` instead.
    """
    if not isinstance(mask, Or) or mask.has_monotone_intervals():
        return None
    distinct = tuple(dict.fromkeys(mask.children))  # a | a is a
    nowhere = [c for c in distinct if c.attends_nowhere()]
    children = tuple(c for c in distinct if not c.attends_nowhere())
    joins = [c.attends_from_zero() or c.attends_around_self() for c in children]
    if sum(joins) >= 2:
        zero = tuple(c for c, j in zip(children, joins, strict=True) if j)
        children = (*(c for c, j in zip(children, joins, strict=True) if not j), Or(zero))
    if len(children) < 2:  # a | empty(), a | a: a, written as a union with either
        children = ((*children, *nowhere) * 2)[:2]
    if len(children) != 2 or not all(c.has_monotone_intervals() for c in children):
        return None
    return children[0], children[1]


def _quantities(lo: Tensor, hi: Tensor) -> Tensor:
    """At every position of ``(2, ..., k)`` intervals (the two operands first), the eight
    quantities ``(8, ..., k)`` whose least value over a line's positions the line's runs
    need — the ones to maximise negated, so that one ``amin`` reduces them all:

    ``[lo0, lo1, -hi0, -hi1, -m, M, -gr, gl]``. Reduced: each operand's least ``lo`` and
    greatest ``hi`` where it attends (``_FAR`` / ``-_FAR`` where it never does), ``max m``
    (``_FAR`` unless every position attends), ``min M``, and the gaps' union ``[g0, g1]`` as
    ``-g1`` and ``g0`` (``g0 > g1`` when no position has a gap).
    """
    attends = lo <= hi
    # Both bounds in "least is wanted" form: [lo, -hi], far where the operand attends nowhere.
    bounds = torch.stack([lo, hi.neg()]).masked_fill_(~attends, _FAR)  # (2, 2, ..., k)
    # Over the operands: least = [m, -M] (hull), greatest = [gr + 1, 1 - gl] (gap).
    # (Elementwise: torch's CPU reductions over so short a dimension cost ~100x more.)
    least, greatest = torch.minimum(*bounds.unbind(1)), torch.maximum(*bounds.unbind(1))
    # A gap gl <= gr where both attend: the sum is 2 * _FAR where either attends nowhere.
    both = greatest.sum(0)
    gap = (both >= 2) & (both < _FAR)
    gaps = (1 - greatest).masked_fill_(~gap, _FAR)
    return torch.cat([bounds.flatten(0, 1), least.neg(), gaps])


def _reduce(lo: Tensor, hi: Tensor) -> Tensor:
    """``(..., 8)``: the least of each of ``_quantities`` over the last dimension, the
    positions of each line."""
    return _quantities(lo, hi).amin(-1).movedim(0, -1)


def _line_runs(
    reduced: Tensor,
    incomplete: bool,
    other_offset: int | Tensor,
    other_block: int,
    in_range_of: int | None = None,
) -> UnionRuns:
    """Each line's two non-empty and two full runs from its reductions (``_reduce``,
    ``(R, n, 8)``); ``incomplete`` when the last line runs past its axis's end (it holds no
    full tile); tiles of the other axis start at ``other_offset``, ``other_block`` wide.

    ``in_range_of``: the other axis's length, for full runs of in-range codes
    (``closed_form.row_runs``): a hull reaching that end covers the last tile of the other
    axis even when it is incomplete (pass ``incomplete=False`` for the last line)."""
    b = other_block
    # Each quantity as the tile bound it gives: one multiply-add and one floor division.
    # Non-empty runs [tile(lo), tile(hi) + 1); the hull's complete tiles [tile(m + b - 1),
    # tile(M + 1)); the gap's tiles [tile(g0), tile(g1) + 1). Where nothing attends the
    # runs come out as [far, -far): empty, in ``ordered_runs`` and ``codes_from_union_runs``.
    shift = [0, 0, b, b, b - 1, 1, b, 0]
    if isinstance(other_offset, int):
        shift = [x - other_offset for x in shift]
    sign_shift = torch.tensor([[1, 1, -1, -1, -1, 1, -1, 1], shift], device=reduced.device)
    bounds = torch.addcmul(sign_shift[1], reduced, sign_shift[0])
    if isinstance(other_offset, Tensor):
        bounds.sub_(other_offset.view(-1, 1, 1))
    if in_range_of is not None:  # the hull's stop M + 1 at the end: past the last tile
        hull = bounds[..., 5]
        hull.masked_fill_(hull >= in_range_of, -(-in_range_of // b) * b)
    tiles = bounds.div_(b, rounding_mode="floor")
    if incomplete:  # only complete tiles can be full: not those of the last line
        tiles[:, -1, 4:6] = 0
    hull_first, hull_stop = tiles[..., 4:5], tiles[..., 5:6]
    gap_stop, gap_first = tiles[..., 6:7], tiles[..., 7:8]
    # Full: the hull less the gap's tiles. Without a gap (gap_first far) the second run
    # repeats the first: runs are read as a union, so that is harmless.
    return UnionRuns(
        torch.cat([tiles[..., 0:2], hull_first, hull_first.maximum(gap_stop)], -1),
        torch.cat([tiles[..., 2:4], hull_stop.minimum(gap_first), hull_stop], -1),
    )


def _lines(edges: tuple[Tensor, Tensor], inside: tuple[Tensor, Tensor], special: Tensor) -> Tensor:
    """``(R, n, 8)`` reductions of every line: over its two edge positions (``edges``, each
    ``(2, R, n, 2)``), and for the ``special`` lines ``(R, s)`` over all their positions
    (``inside``, each ``(2, R, s, block)``) instead. Both sets of positions go through
    ``_quantities`` as one."""
    n, count = edges[0].shape[2], special.shape[1]
    lo, hi = (
        torch.cat([e.flatten(2), i.flatten(2)], -1) for e, i in zip(edges, inside, strict=True)
    )
    quantities = _quantities(lo, hi)  # (8, R, 2n + count * block)
    at_edges = torch.minimum(*quantities[..., : 2 * n].unflatten(-1, (n, 2)).unbind(-1))
    at_special = quantities[..., 2 * n :].unflatten(-1, (count, -1)).amin(-1)
    return at_edges.scatter_(-1, special.expand(8, -1, -1), at_special).movedim(0, -1)


def _queries(a: Mask, b: Mask, grid: BlockGrid, rows: int) -> tuple[Tensor, Tensor]:
    """Both operands' clipped intervals ``lo, hi`` at every query of the grid's blocks,
    ``(2, R, nq * q_block)``: the queries past ``Q_LEN`` repeat the last one."""
    dev = grid.device
    padded = torch.arange(grid.num_q_blocks * grid.q_block, device=dev).clamp_(max=grid.q_len - 1)
    q_idx = (padded + grid.q_offset).expand(rows, -1)
    row = torch.arange(rows, device=dev).view(rows, 1)
    (lo_a, hi_a), (lo_b, hi_b) = clipped(a, q_idx, row, grid), clipped(b, q_idx, row, grid)
    return torch.stack([lo_a, lo_b]), torch.stack([hi_a, hi_b])


def _special(edges: tuple[Tensor, Tensor], start: int | Tensor) -> Tensor:
    """``(R, s)``: both operands' special lines (``closed_form.special_blocks``), from the
    intervals at every line's edges ``(2, R, n, 2)``."""
    lo, hi = edges
    special = special_blocks(lo[..., 0], hi[..., 0], lo[..., 1], hi[..., 1], start)
    return special.permute(1, 0, 2).reshape(special.shape[1], -1)


def union_row_runs(
    a: Mask,
    b: Mask,
    grid: BlockGrid,
    rows: int,
    queries: tuple[Tensor, Tensor] | None = None,
    *,
    in_range: bool = False,
) -> UnionRuns:
    """The runs of every block row of ``a | b``, ``(R, nq, 4)``: reduced over each block's
    first and last query, and over every query of the blocks where an operand starts or
    stops attending (``closed_form.special_blocks``: at most two per operand). Full runs
    are torch's (complete tiles), or with ``in_range`` those of in-range codes
    (``closed_form.row_runs``).

    ``queries``: both operands' intervals at every query (``_queries``), when the caller
    has them; else only those edge queries and the special blocks' are evaluated (as
    ``closed_form.row_runs`` does: O(rows x blocks), not O(rows x queries))."""
    nq, qb = grid.num_q_blocks, grid.q_block
    if queries is not None:
        lo, hi = (t.view(2, rows, nq, qb) for t in queries)
        edges = lo[..., [0, -1]], hi[..., [0, -1]]
        special = _special(edges, grid.kv_offset)
        index = special[None, :, :, None].expand(2, -1, -1, qb)
        inside = lo.gather(2, index), hi.gather(2, index)
    else:
        edges, special, inside = _edge_queries(a, b, grid, rows)
    reduced = _lines(edges, inside, special)
    if in_range:
        return _line_runs(reduced, False, grid.kv_offset, grid.kv_block, grid.kv_len)
    return _line_runs(reduced, grid.q_len % qb != 0, grid.kv_offset, grid.kv_block)


def _edge_queries(
    a: Mask, b: Mask, grid: BlockGrid, rows: int
) -> tuple[tuple[Tensor, Tensor], Tensor, tuple[Tensor, Tensor]]:
    """Both operands' clipped intervals at each q block's first and last query (``edges``,
    each ``(2, R, nq, 2)``), the special blocks ``(R, s)`` they give (``_special``), and
    the intervals at every query of those blocks (``inside``, each ``(2, R, s, q_block)``;
    past ``Q_LEN`` the last query repeats, as in ``_queries``)."""
    nq, qb, dev = grid.num_q_blocks, grid.q_block, grid.device
    first_q = grid.q_first.view(-1, nq).expand(rows, nq)  # per-row offsets: (B, nq)
    last_q = grid.q_last.view(-1, nq).expand(rows, nq)
    row = torch.arange(rows, device=dev).view(rows, 1)
    q_idx = torch.cat([first_q, last_q], 1)

    def both(q: Tensor) -> tuple[Tensor, Tensor]:
        (lo_a, hi_a), (lo_b, hi_b) = clipped(a, q, row, grid), clipped(b, q, row, grid)
        return torch.stack([lo_a, lo_b]), torch.stack([hi_a, hi_b])

    edges = tuple(t.view(2, rows, 2, nq).transpose(-1, -2) for t in both(q_idx))
    special = _special((edges[0], edges[1]), grid.kv_offset)
    count = special.shape[1]
    inside_q = first_q.gather(1, special).unsqueeze(-1) + torch.arange(qb, device=dev)
    q_end = grid.q_end.view(-1, 1, 1) if isinstance(grid.q_end, Tensor) else grid.q_end
    inside_q = inside_q.clamp_(max=q_end - 1).view(rows, count * qb)
    inside = tuple(t.view(2, rows, count, qb) for t in both(inside_q))
    return (edges[0], edges[1]), special, (inside[0], inside[1])


def _transposed(lo: Tensor, hi: Tensor, grid: BlockGrid) -> tuple[Callable, Tensor]:
    """The transposed intervals of both operands from their intervals at every query
    (``(2, R, P)``): for kv positions ``(R, k)``, the queries ``[qlo, qhi]`` of the window
    that attend each, ``(2, R, k)``, by binary search; and each operand's first attending
    query ``(2, R, 1)`` (where ``qhi`` must reach for a column to attend).

    The queries that attend form a range on which ``lo`` and ``hi`` never decrease
    (``closed_form.row_runs``); with -1 before it and far past it, both are sorted, and the
    queries attending ``k`` — those with ``hi >= k`` (a suffix) and ``lo <= k`` (a prefix)
    — are ``[first hi >= k, last lo <= k]``. These transposed intervals have the
    properties the proof uses: ``qlo`` and ``qhi`` never decrease; ``qlo(k) <= k`` (the
    query ``k`` attends ``k`` while ``hi >= q``; once ``hi`` is constant no later query
    reaches further); ``qhi(k) >= k`` or is the last attending query (every attending
    ``q <= k`` has ``lo <= q <= k``), a constant."""
    _, rows, positions = lo.shape
    attends = lo <= hi
    before = attends.cumsum(-1) == 0
    fill = torch.where(before, -1, _FAR)
    # Both operands as rows of one search: (2R, P).
    lo, hi = (torch.where(attends, t, fill).view(2 * rows, positions) for t in (lo, hi))
    reach = before.sum(-1, keepdim=True) + grid.q_offset
    last = grid.q_len - 1  # the padded queries repeat the last one: cut them off

    def at(kv_idx: Tensor) -> tuple[Tensor, Tensor]:
        keys = kv_idx.repeat(2, 1)
        # A key none attends finds no hi >= k: q_lo is past the window, the interval empty.
        q_lo = torch.searchsorted(hi, keys)
        q_hi = torch.searchsorted(lo, keys, right=True).sub_(1).clamp_(max=last)
        return q_lo.view(2, rows, -1) + grid.q_offset, q_hi.view(2, rows, -1) + grid.q_offset

    return at, reach


def union_column_runs(
    a: Mask, b: Mask, grid: BlockGrid, rows: int, queries: tuple[Tensor, Tensor] | None = None
) -> UnionRuns:
    """The runs of every kv tile column of ``a | b``, ``(R, nkv, 4)``: the lines of the
    transposed intervals (``_transposed``), reduced like the rows' over each tile's first
    and last key — the transposed intervals never decrease, so those give the reductions —
    and over every key of the tiles where an operand starts or stops being attended
    (``closed_form.special_blocks``: two per operand)."""
    nkv, kb, dev = grid.num_kv_blocks, grid.kv_block, grid.device
    at, reach = _transposed(*(queries or _queries(a, b, grid, rows)), grid)
    first = grid.kv_first.view(-1, nkv).expand(rows, nkv)
    last = grid.kv_last.view(-1, nkv).expand(rows, nkv)
    at_edges = at(torch.cat([first, last], 1))
    edges = tuple(t.view(2, rows, 2, nkv).transpose(-1, -2) for t in at_edges)
    special = _special(edges, reach)
    count = special.shape[1]
    inside = first.gather(1, special).unsqueeze(-1) + torch.arange(kb, device=dev)
    kv_end = grid.kv_end.view(-1, 1, 1) if isinstance(grid.kv_end, Tensor) else grid.kv_end
    inside = inside.clamp_(max=kv_end - 1).view(rows, count * kb)  # repeats the last key
    at_inside = tuple(t.view(2, rows, count, kb) for t in at(inside))
    reduced = _lines(edges, at_inside, special)
    return _line_runs(reduced, grid.kv_len % kb != 0, grid.q_offset, grid.q_block)


class _Segments(NamedTuple):
    """Each line cut at its runs' ends into nine segments ``(N, 9)``, each wholly in or
    out of every run: where each starts, how long it is, and whether its blocks are
    listed partial or full (``listed``, ``(2, N, 9)``; neither: unlisted)."""

    start: Tensor
    length: Tensor
    listed: Tensor


def _segments(starts: Tensor, stops: Tensor, ends: int | Tensor) -> _Segments:
    """The segments of lines given by their runs (``ordered_runs`` says how)."""
    n = starts.shape[0]
    points = torch.cat([starts, stops], 1).clamp_(min=0)
    points = points.clamp_(max=ends) if isinstance(ends, int) else points.minimum(ends)
    points = points.sort(1).values
    line_end = points.new_full((n, 1), ends) if isinstance(ends, int) else ends
    seg_start = torch.cat([points.new_zeros(n, 1), points], 1)
    seg_len = torch.cat([points, line_end], 1) - seg_start
    x = seg_start.unsqueeze(-1)
    inside = (starts.unsqueeze(1) <= x) & (x < stops.unsqueeze(1))  # (N, 9, 4)
    # Elementwise ors: torch's CPU `any` over a dimension of 2 costs several times more.
    full = inside[..., 2] | inside[..., 3]
    listed = torch.stack([(inside[..., 0] | inside[..., 1]) & ~full, full])  # (2, N, 9)
    return _Segments(seg_start, seg_len, listed)


def ordered_runs(
    starts: Tensor, stops: Tensor, ends: int | Tensor, out: Sequence[Tensor]
) -> list[Tensor]:
    """Writes index tensors from each line's runs, in torch's order (listed blocks ascending,
    then the rest ascending); returns their counts.

    ``starts``/``stops`` are ``(N, 4)``: two non-empty runs then two full runs per line, any
    of them empty; ``ends`` each line's length, an int or ``(N, 1)``. ``out`` is the partial
    tensors, then the full ones in the same order; their lines (over the last dimension),
    laid end to end, are the N lines (both sides of a BlockMask at once). The runs' ends cut
    each line into at most nine segments, each wholly in or out of every run; a stable sort
    of the segments by "listed first" is torch's order, and each tensor's segments are
    expanded in one pass (``runs.expand_runs``).
    """
    return _write_segments(_segments(starts, stops, ends), out)


def _write_segments(segments: _Segments, out: Sequence[Tensor]) -> list[Tensor]:
    """``ordered_runs`` from the lines' segments."""
    seg_start, seg_len, listed = segments
    n = seg_start.shape[0]
    counts = (seg_len * listed).sum(-1, dtype=torch.int32)
    order = (~listed).to(torch.int8).argsort(dim=-1, stable=True)
    lines = [t.numel() // t.shape[-1] if t.numel() else 0 for t in out]
    sizes = [count * seg_start.shape[1] for count in lines]
    seg_start, seg_len = (
        t.expand(2, n, -1).gather(-1, order).view(-1) for t in (seg_start, seg_len)
    )
    for target, first, length in zip(
        out, seg_start.split(sizes), seg_len.split(sizes), strict=True
    ):
        expand_runs(target.view(-1), first, length)
    # A storage each, as torch's (write.assemble keeps contiguous tensors as they are).
    return [count.clone() for count in counts.view(-1).split(lines)]


def union_sides(mask: Mask, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """Both sides' tensors of a union ``union_operands`` accepts, shaped ``(R, 1, n[, m])``.

    The kv side from the block rows' runs (``union_row_runs``, from the edge queries and
    the special blocks' only); the q side from the tile codes those runs give, one byte a
    tile written segment by segment, read down the columns (``write.q_side_from_codes``):
    no interval is evaluated at every query. That path sizes tensors from values (a host
    sync), so under ``torch.export`` (whose shapes must not follow values) and off the CPU
    (where a closed-form build never syncs: tests/test_build_device_seam.py) both sides come from
    runs (``_union_sides_by_columns``)."""
    operands = union_operands(mask)
    assert operands is not None  # callers check union_operands(mask)
    if must_not_sync(grid):
        return _union_sides_by_columns(*operands, grid, grid.reduced(mask)[0])
    rows, _ = grid.reduced(mask)
    nq, nkv, dev = grid.num_q_blocks, grid.num_kv_blocks, grid.device
    # The outputs first (closed_form.ordered_sides says why).
    kv_p, kv_f = index_tensors([(rows, nq, nkv)] * 2, dev)
    runs = union_row_runs(*operands, grid, rows)
    segments = _segments(runs.starts.view(-1, 4), runs.stops.view(-1, 4), nkv)
    # Each side on its own thread where the grid is long: the q side from the same segments.
    (kv_pn, kv_fn), q = side_by_side(
        lambda: _write_segments(segments, (kv_p, kv_f)),
        lambda: _q_side(segments, torch.Size((rows, 1, nq, nkv))),
        rows * nq * nkv,
        dev,
    )
    return (
        Ordered(
            kv_pn.view(rows, 1, nq), kv_p.unsqueeze(1), kv_fn.view(rows, 1, nq), kv_f.unsqueeze(1)
        ),
        q,
    )


_FROM_RUNS_FROM = 1 << 20
"""Grids of at least this many tiles take their q side from the rows' runs (``_q_side``);
below, its two dozen more torch calls cost more than the grid of codes they save (a
small build is bound by its calls: tests/test_build_unions.py)."""


def _q_side(segments: _Segments, shape: torch.Size) -> Ordered:
    """The q side from the block rows' segments, taken as the rows' runs of codes
    (``write.q_side_from_line_runs``: no grid of codes, and no slower than writing its two
    index tensors at long lengths); on small grids, or where the q side's runs are many,
    from the int8 tile codes read down the columns (``write.q_side_from_codes``)."""
    if shape.numel() >= _FROM_RUNS_FROM:
        partial, full = segments.listed
        code = codes_from(partial | full, full).view(-1)
        length = segments.length.view(-1)
        kept = length.nonzero().squeeze(1)
        q = q_side_from_line_runs(
            kept.div(segments.start.shape[1], rounding_mode="floor"),
            segments.start.view(-1).index_select(0, kept),
            length.index_select(0, kept),
            code.index_select(0, kept).to(torch.int64),
            shape,
        )
        if q is not None:
            return q
    return q_side_from_codes(_codes(segments, shape.numel()).view(shape))


def must_not_sync(grid: BlockGrid) -> bool:
    """Whether a union's build must size nothing from values: under ``torch.export`` and on
    an accelerator (on the CPU a read of values is no device sync)."""
    return exporting() or grid.device.type != "cpu"


def _codes(segments: _Segments, total: int) -> Tensor:
    """The int8 tile codes of lines laid end to end (``total`` tiles) from their segments:
    each segment's code less the one before it (in the order the segments are laid, over
    all the lines) added where it begins, and a running sum — two passes over one byte a
    tile. Empty segments add and take back their jump at the same place, and those at the
    very end jump nowhere."""
    partial, full = segments.listed
    code = codes_from(partial | full, full).view(-1)
    length = segments.length.view(-1)
    first = length.cumsum(0).sub_(length)
    jump = torch.diff(code, prepend=code.new_zeros(1))
    out = torch.zeros(total, dtype=CODE_DTYPE, device=code.device)
    out.scatter_add_(0, first.clamp(max=total - 1), jump.masked_fill_(first >= total, 0))
    return out.cumsum_(0)


def _union_sides_by_columns(
    a: Mask, b: Mask, grid: BlockGrid, rows: int
) -> tuple[Ordered, Ordered]:
    """Both sides from runs: the rows' (``union_row_runs``) and the columns' from the
    intervals at every query (``union_column_runs``), written together (``ordered_runs``):
    nothing whose shape follows values, so ``torch.export`` traces it."""
    nq, nkv, dev = grid.num_q_blocks, grid.num_kv_blocks, grid.device
    kv_p, q_p, kv_f, q_f = index_tensors(
        [(rows, n, m) for n, m in ((nq, nkv), (nkv, nq), (nq, nkv), (nkv, nq))], dev
    )
    queries = _queries(a, b, grid, rows)
    runs = union_row_runs(a, b, grid, rows, queries)
    cols = union_column_runs(a, b, grid, rows, queries)
    # Both sides' lines as one list: kv-side rows of nkv blocks, then q-side columns of nq.
    starts, stops = (
        torch.cat([r.view(-1, 4), c.view(-1, 4)]) for r, c in zip(runs, cols, strict=True)
    )
    ends: int | Tensor = nkv
    if nq != nkv:
        ends = torch.full((starts.shape[0], 1), nkv, device=dev)
        ends[rows * nq :] = nq
    kv_pn, q_pn, kv_fn, q_fn = ordered_runs(starts, stops, ends, (kv_p, q_p, kv_f, q_f))
    return (
        Ordered(
            kv_pn.view(rows, 1, nq), kv_p.unsqueeze(1), kv_fn.view(rows, 1, nq), kv_f.unsqueeze(1)
        ),
        Ordered(
            q_pn.view(rows, 1, nkv), q_p.unsqueeze(1), q_fn.view(rows, 1, nkv), q_f.unsqueeze(1)
        ),
    )
