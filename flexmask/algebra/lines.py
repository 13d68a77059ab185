"""What a node answers a lowering to another kernel's format (``flexmask.formats``) with:
the intervals each line attends (``Node.lines_at``), what it is to a varlen kernel
(``Node.varlen_part``), or a refusal that names it and the format (``cannot_lower``).

A piece writes its answers with the helpers here; ``flexmask.formats`` intersects, joins
and complements them for ``&``, ``|`` and ``~`` and reads each format from the result.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

INF = 1 << 61
"""Stands for an unbounded interval end; every real position and length is below it."""
UNUSED = 1 << 62
"""Marks an unused slot of an interval list: ``lo = UNUSED``, ``hi = -UNUSED``."""


class LineIntervals(NamedTuple):
    """A node's answer to ``lines_at``: per row and per line, the positions of the other
    side it attends as intervals ``[lo, hi]`` (inclusive, absolute positions).

    ``lo`` and ``hi`` are ``(R, N, k)`` int64: R rows (1 where no row differs), N lines (the
    positions asked about), k slots. A slot with ``lo > hi`` is empty; an end may be
    ``+-INF`` (unbounded: the lowering clips it to its window). Slots may overlap and come
    in any order unless ``normalized``.
    """

    lo: Tensor
    hi: Tensor
    normalized: bool = False
    """True when the lists are already sorted, disjoint and non-adjacent, empty slots last
    as ``(UNUSED, -UNUSED)``, and the last slot used on some line: the lowering keeps them
    as they are."""


class VarlenPart(NamedTuple):
    """What one factor of an ``&`` is to a varlen kernel (``Node.varlen_part``): a kernel's
    rule (causal, a sliding window), a partition of the positions into sequences, or
    nothing at all. The defaults constrain nothing (``full()``)."""

    segment_ids: list[Tensor] | None = None
    """A partition (documents, chunks, padding): per row (one, or one per batch row), the
    part of each absolute position ``0..length`` as int64, -1 outside every part; each id
    ``>= 0`` is one contiguous run of positions."""
    causal: bool = False
    """The kernel's causal rule: ``kv <= q``."""
    window: Tensor | None = None
    """Sliding window sizes (``|q - kv| < size``), one or one per row, at most ``INF``."""
    attends_nowhere: bool = False
    """No query attends any key (``empty()``, a window of 0)."""


def cannot_lower(node: object, fmt: str, reason: str) -> ValueError:
    """The error a node raises for a format it cannot be written in exactly: it names the
    node (its repr), the format and why, and says what to use instead."""
    return ValueError(f"{node!r} cannot be lowered to {fmt}: {reason}")


def one_interval(lo: Tensor, hi: Tensor) -> LineIntervals:
    """One interval per line: ``lo`` and ``hi`` broadcast to ``(R, N)``, as one slot."""
    lo, hi = torch.broadcast_tensors(lo, hi)
    return LineIntervals(lo.unsqueeze(-1), hi.unsqueeze(-1))


def run_at(starts: Tensor, ends: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """The run ``[start, end)`` of sorted, disjoint runs (``(R, D)`` starts and exclusive
    ends, padded past every position) holding each position of ``pos`` (``(R, N)``), as an
    inclusive ``(lo, hi)``, or empty ``(INF, -INF)``: a document's or a span's line."""
    rows = max(starts.shape[0], ends.shape[0], pos.shape[0])
    starts, ends, pos = (t.expand(rows, *t.shape[1:]).to(torch.int64) for t in (starts, ends, pos))
    first = _range_start(pos)
    if first is not None:  # every row asks about first + [0, N): read off running maxima
        start, end = _latest_runs(starts, ends, first, pos.shape[1])
        inside = pos < end
    else:
        k = _ends_at_or_before(ends, pos).clamp(max=ends.shape[1] - 1)
        start, end = starts.gather(1, k), ends.gather(1, k)
        inside = (start <= pos) & (pos < end)
    if bool(inside.all()):  # runs that cover every position asked about (documents, spans)
        return start, end - 1
    return pick(inside, start, INF), pick(inside, end - 1, -INF)


def _range_start(pos: Tensor) -> int | None:
    """``a`` where every row of ``pos`` is ``a + [0, N)`` with ``a >= 0`` (a lowering's
    window), else None."""
    if not pos.numel():
        return None
    low = int(pos[0, 0])
    expected = torch.arange(low, low + pos.shape[1])
    return low if low >= 0 and bool((pos == expected).all()) else None


def _latest_runs(starts: Tensor, ends: Tensor, first: int, n: int) -> tuple[Tensor, Tensor]:
    """For positions ``first + [0, n)`` of every row, the start and end of the last run
    starting at or before each (start -1 and end -1 before the first run): runs are sorted
    and disjoint, so both are running maxima of the runs' bounds marked at their starts."""
    top = first + n
    at = starts.clamp(max=top)  # runs starting past the window: marked in a last column
    marked_start = torch.full((starts.shape[0], top + 1), -1, dtype=torch.int64)
    marked_end = torch.full((starts.shape[0], top + 1), -1, dtype=torch.int64)
    marked_start.scatter_reduce_(1, at, starts, "amax")
    marked_end.scatter_reduce_(1, at, ends, "amax")
    start = marked_start.cummax(1).values[:, first:top]
    end = marked_end.cummax(1).values[:, first:top]
    return start, end


def _ends_at_or_before(ends: Tensor, pos: Tensor) -> Tensor:
    """``searchsorted(ends, pos, right=True)`` per row (``(R, D)`` sorted ends >= 0, ``(R, N)``
    positions): how many ends lie at or before each position. Where the positions cover
    most of ``[0, their largest]`` (a lowering asks about every query of a window) a count
    of end marks and one gather answer, O(positions), where torch's batched search costs
    several times more."""
    if not pos.numel():
        return torch.zeros(pos.shape, dtype=torch.int64)
    low, top = (int(v) for v in torch.aminmax(pos))
    if low < 0 or (top + 2) * pos.shape[0] > 4 * pos.numel():
        return torch.searchsorted(ends.contiguous(), pos.contiguous(), right=True)
    marks = torch.zeros(ends.shape[0], top + 2, dtype=torch.int64)
    marks.scatter_add_(1, ends.clamp(max=top + 1), torch.ones_like(ends))  # past: top + 1
    return marks.cumsum_(1).gather(1, pos)


def pick(keep: Tensor, x: Tensor, other: Tensor | int) -> Tensor:
    """``torch.where(keep, x, other)`` as int64 arithmetic, for values within ``+-UNUSED``
    (no difference overflows). Same result, cheaper: torch.where's CPU kernel costs several
    int64 adds, and the lowerings pick per line at every query."""
    diff = x.to(torch.int64) - other
    if diff.shape == keep.shape:  # one fresh tensor, not two
        return diff.mul_(keep).add_(other)
    return (diff * keep).add_(other)
