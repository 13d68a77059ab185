"""BlockMask tensors in closed form for an ``|`` of two masks with monotone intervals.

Each operand ``A``, ``B`` (an ``&`` of interval pieces, a prefix-LM...) gives query ``q`` one
kv interval, clipped to the grid's kv window: ``IA(q) = [loA, hiA]``, ``IB(q) = [loB, hiB]``
(empty when lo > hi), each with the properties ``closed_form`` proves. The union attends
``U(q) = IA(q) ∪ IB(q)``: one interval, or two with a gap between them. Such as the
document-causal prefix-LM ``(causal() & document(l)) | prefix(64)``: a query in a later
document attends the prompt ``[0, 63]`` and its own document ``[start, q]``.

**Non-empty tiles.** A tile is non-empty in the union iff it is in either operand, so each
block row's non-empty tiles are the union of the operands' runs (``closed_form.row_runs``):
at most two runs; each kv column's, the union of their column runs (``column_runs``).

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

**Which queries are read.** Inside a block where each operand's attending is all-or-nothing,
``m``, ``M``, ``gl`` and ``gr`` never decrease, so ``max m = m(z)``, ``min M = M(a)`` and the
gaps (a suffix) are ``[gl(z), gr(z)]`` — the reductions over the two edge queries ``a``,
``z`` give exactly these. The blocks where an operand starts or stops attending inside
(``closed_form.row_runs``: at most two per operand and batch row) are read query by query.
Nothing is evaluated on tiles, and nothing is read back to the host.

The kv side is written from the runs (``ordered_runs``); the q side's full tiles have no
run structure down a column that two binary searches find, so it is ranked from the runs'
flags (``write.ranked``: one cumsum and one scatter per tensor, no sort, no host sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.build.closed_form import Runs, clipped, row_runs, special_blocks
from flexmask.build.grid import BlockGrid
from flexmask.build.write import Ordered, expand_runs, ranked
from flexmask.mask import Mask, Or

# Larger than any position: the neutral value of a min over non-attending queries.
_FAR = 1 << 62


class UnionRuns(NamedTuple):
    """Per block row ``(R, nq)``: two runs of non-empty tiles and two runs of full tiles,
    each ``[start, stop)`` (empty when stop <= start), full runs inside non-empty ones."""

    starts: Tensor
    """(R, nq, 4): non-empty run 1, non-empty run 2, full run 1, full run 2."""
    stops: Tensor


def union_operands(mask: Mask) -> tuple[Mask, Mask] | None:
    """The two operands of an ``|`` this module writes, or None.

    A union of two children with monotone intervals qualifies. Children that attend
    nowhere (``empty()``) drop out, and those that attend from key 0 (or around
    themselves, spans) join as one from-zero union (``causal() | prefix(n)`` is itself
    monotone); two operands must remain (or one, and an ``empty()``). A union that is
    itself monotone (``Or._attends_from_zero``) goes to ``closed_form`` instead.
    """
    if not isinstance(mask, Or) or mask._has_monotone_intervals():
        return None
    distinct = tuple(dict.fromkeys(mask.children))  # a | a is a
    nowhere = [c for c in distinct if c._attends_nowhere()]
    children = tuple(c for c in distinct if not c._attends_nowhere())
    joins = [c._attends_from_zero() or c._attends_around_self() for c in children]
    if sum(joins) >= 2:
        zero = tuple(c for c, j in zip(children, joins, strict=True) if j)
        children = (*(c for c, j in zip(children, joins, strict=True) if not j), Or(zero))
    if len(children) < 2:  # a | empty(), a | a: a, written as a union with either
        children = ((*children, *nowhere) * 2)[:2]
    if len(children) != 2 or not all(c._has_monotone_intervals() for c in children):
        return None
    return children[0], children[1]


def _cover(lo_a: Tensor, hi_a: Tensor, lo_b: Tensor, hi_b: Tensor) -> tuple[Tensor, ...]:
    """Over the last dimension (queries of a block): every query attends, ``max m``,
    ``min M`` and the gaps' union ``[g0, g1]`` (g0 > g1 when no query has a gap)."""
    att_a, att_b = lo_a <= hi_a, lo_b <= hi_b
    every = (att_a | att_b).all(-1)
    m = torch.minimum(lo_a.masked_fill(~att_a, _FAR), lo_b.masked_fill(~att_b, _FAR))
    big_m = torch.maximum(hi_a.masked_fill(~att_a, -1), hi_b.masked_fill(~att_b, -1))
    gl = torch.minimum(hi_a, hi_b).add_(1)
    gr = torch.maximum(lo_a, lo_b).sub_(1)
    gap = att_a & att_b & (gl <= gr)
    g0 = gl.masked_fill_(~gap, _FAR).amin(-1)
    g1 = gr.masked_fill_(~gap, -1).amax(-1)
    return every, m.amax(-1), big_m.amin(-1), g0, g1


def union_row_runs(a: Mask, b: Mask, grid: BlockGrid, rows: int) -> UnionRuns:
    """Both runs of every block row of ``a | b`` (module docstring)."""
    nq, qb, kb, dev = grid.num_q_blocks, grid.q_block, grid.kv_block, grid.device
    first_q = grid.q_first.view(-1, nq).expand(rows, nq)
    last_q = grid.q_last.view(-1, nq).expand(rows, nq)
    row = torch.arange(rows, device=dev).view(rows, 1)
    edges = torch.cat([first_q, last_q], 1)
    lo_a, hi_a = clipped(a, edges, row, grid)
    lo_b, hi_b = clipped(b, edges, row, grid)
    # The blocks where an operand starts or stops attending inside: read query by query.
    special = torch.cat(
        [
            special_blocks(lo_a[:, :nq], hi_a[:, :nq], lo_a[:, nq:], hi_a[:, nq:], grid),
            special_blocks(lo_b[:, :nq], hi_b[:, :nq], lo_b[:, nq:], hi_b[:, nq:], grid),
        ],
        1,
    )
    count = special.shape[1]
    inside = first_q.gather(1, special).unsqueeze(-1) + torch.arange(qb, device=dev)
    q_end = grid.q_end.view(-1, 1, 1) if isinstance(grid.q_end, Tensor) else grid.q_end
    inside = inside.clamp(max=q_end - 1).view(rows, count * qb)  # repeats the last query
    in_a = (t.view(rows, count, qb) for t in clipped(a, inside, row, grid))
    in_b = (t.view(rows, count, qb) for t in clipped(b, inside, row, grid))
    at_edges = _cover(*(t.view(rows, 2, nq).transpose(1, 2) for t in (lo_a, hi_a, lo_b, hi_b)))
    at_special = _cover(*in_a, *in_b)
    every, m, big_m, g0, g1 = (
        e.scatter(1, special, s) for e, s in zip(at_edges, at_special, strict=True)
    )
    complete = every & (first_q + qb <= grid.q_end)
    hull_first = grid.kv_tile(m.masked_fill(~complete, 0) + (kb - 1))
    hull_stop = grid.kv_tile(big_m.masked_fill(~complete, -1) + 1)  # exclusive
    has_gap = g0 <= g1
    gap_first = torch.where(has_gap, grid.kv_tile(g0.clamp(max=grid.kv_end)), hull_stop)
    gap_stop = torch.where(has_gap, grid.kv_tile(g1.clamp(min=-1)) + 1, hull_stop)
    full_stop_1 = torch.minimum(hull_stop, gap_first)
    full_start_2 = torch.maximum(hull_first, gap_stop)
    # Non-empty: the operands' runs (closed_form), ends exclusive.
    runs_a, runs_b = (_expanded(row_runs(op, grid), rows) for op in (a, b))
    starts = torch.stack([runs_a.first, runs_b.first, hull_first, full_start_2], -1)
    stops = torch.stack([runs_a.last + 1, runs_b.last + 1, full_stop_1, hull_stop], -1)
    return UnionRuns(starts, stops)


def _expanded(runs: Runs, rows: int) -> Runs:
    return Runs(*(t.expand(rows, -1) for t in runs))


def ordered_runs(starts: Tensor, stops: Tensor, m: int, out: tuple[Tensor, Tensor]):
    """Writes one side's partial and full index tensors from each line's runs, in torch's
    order (listed blocks ascending, then the rest ascending); returns both counts.

    ``starts``/``stops`` are ``(N, 4)``: two non-empty runs then two full runs per line, any
    of them empty. The runs' ends cut each line into at most nine segments, each wholly in or
    out of every run; a stable sort of the segments by "listed first" is torch's order, and
    the segments are expanded in one pass (``write.expand_runs``).
    """
    n = starts.shape[0]
    points = torch.cat([starts, stops], 1).clamp_(0, m).sort(1).values
    seg_start = torch.cat([points.new_zeros(n, 1), points], 1)
    seg_len = torch.cat([points, points.new_full((n, 1), m)], 1) - seg_start
    x = seg_start.unsqueeze(-1)
    inside = (starts.unsqueeze(1) <= x) & (x < stops.unsqueeze(1))  # (N, 9, 4)
    full = inside[..., 2:].any(-1)
    partial = inside[..., :2].any(-1) & ~full
    counts = []
    for listed, target in zip((partial, full), out, strict=True):
        order = listed.logical_not().to(torch.int8).argsort(dim=1, stable=True)
        expand_runs(target.view(-1), seg_start.gather(1, order), seg_len.gather(1, order))
        counts.append((seg_len * listed).sum(1, dtype=torch.int32))
    return counts


def union_sides(mask: Mask, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """Both sides' tensors of a union ``union_operands`` accepts, shaped ``(R, 1, n[, m])``."""
    operands = union_operands(mask)
    assert operands is not None  # callers check union_operands(mask)
    rows, _ = grid.reduced(mask)
    nq, nkv, dev = grid.num_q_blocks, grid.num_kv_blocks, grid.device
    kv_p, kv_f = (torch.empty((rows, nq, nkv), dtype=torch.int32, device=dev) for _ in range(2))
    runs = union_row_runs(*operands, grid, rows)
    kv_pn, kv_fn = ordered_runs(runs.starts.view(-1, 4), runs.stops.view(-1, 4), nkv, (kv_p, kv_f))
    # The q side: each column's non-empty rows are the operands' column runs; its full rows
    # are ranked from the flags of the row runs, laid out column-major.
    kv = torch.arange(nkv, device=dev).view(1, nkv, 1)
    starts = [t.unsqueeze(1) for t in runs.starts.unbind(-1)]
    stops = [t.unsqueeze(1) for t in runs.stops.unbind(-1)]
    flags = [(s <= kv) & (kv < e) for s, e in zip(starts, stops, strict=True)]
    full = flags[2] | flags[3]
    partial = (flags[0] | flags[1]) & ~full
    q_pn, q_p = ranked(partial)
    q_fn, q_f = ranked(full)
    return (
        Ordered(
            kv_pn.view(rows, 1, nq), kv_p.unsqueeze(1), kv_fn.view(rows, 1, nq), kv_f.unsqueeze(1)
        ),
        Ordered(q_pn.unsqueeze(1), q_p.unsqueeze(1), q_fn.unsqueeze(1), q_f.unsqueeze(1)),
    )
