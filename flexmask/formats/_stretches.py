"""``to_magi`` by stretches of queries: the interval algebra run once per stretch, not per
query.

Most masks' lines change shape at a few places: a document's at its bounds, a tree's at the
starts of its runs, a window's nowhere. Between two such places every end of every leaf's
intervals moves by 0 or 1 per line (an affine function of the line), so the leaves' lines on
a stretch are given by their values at its first line and their steps. The operators
(``&``, ``|``, ``~``, the window's clip) compare those ends with one another and with the
window's bounds, each comparison ``x - y <= t`` for a small ``t``; ``x - y`` moves by -1, 0
or 1 per line, so each comparison changes at most once on a stretch, at a line read off its
values. Cut there, every comparison holds or fails on a whole stretch, so the operator's
answer on it is affine too: ``_structure``'s own interval operators, evaluated at each
stretch's first line and one line on, give its values and steps. Work is per stretch (per
document, per run of a tree), not per query; Magi's cut then reads a few lines a stretch
(``compressed``).

A leaf says where its lines change shape with ``Mask.line_breaks``; a leaf that does not
(the default) sends the whole mask down the per-query path (``_structure.lines``), as does
a stretch whose steps come out other than 0 or 1 (a broken promise is never silently used).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.algebra import Mask, fold, pick
from flexmask.formats._structure import (
    _BIG,
    Window,
    _clip_normalized,
    _complement,
    _intersect,
    _normalize,
    _union,
    one_mask_for_all_heads,
)

STRETCHES_FROM = 1 << 15
"""Lines (queries times rows that differ) from which ``to_magi`` reads stretches: below
it, reading every line costs less than the stretches' fixed cost, several dozen small torch
calls (docs/costs.md, "The thresholds in the code")."""

_FAR = 1 << 60
"""Windows reaching past this position take the per-token path: below it no difference of
two ends (each within ``INF`` of a position) overflows int64."""

_NEVER = 1 << 40  # a threshold no difference reaches: pads the tables below


def _thresholds(same: list[int], lo_hi: list[int], hi_lo: list[int], ties: int) -> Tensor:
    """``(2, 2, T + 1)``: per kinds of ``x`` and ``y`` (0 a start, 1 an end) the ``t`` to
    cut at, padded with ``_NEVER``, and last the lines a same-kind cut must leave after it
    (``ties``: 1 where only which of two is greater matters, so a tie on a stretch's last
    line needs no cut of its own)."""
    width = max(len(same), len(lo_hi), len(hi_lo))
    table = torch.full((2, 2, width + 1), _NEVER, dtype=torch.int64)
    for (i, j), ts in (((0, 0), same), ((1, 1), same), ((0, 1), lo_hi), ((1, 0), hi_lo)):
        table[i, j, : len(ts)] = torch.tensor(ts)
        table[i, j, -1] = ties if i == j else 0
    return table


# The ``t`` of the comparisons ``x - y <= t`` an operator's answer turns on, by the kinds of
# ``x`` and ``y`` (a start ``lo`` or an end ``hi``; the window's first line is a start, its
# last an end). An intersection, a union or a clip, normalized, is unique given which
# intervals are empty (``lo - hi <= 0``), which overlap or touch (``lo - hi <= 1``) and
# which start is least and which end greatest: there only the value matters, equal where
# the two tie, so the cut goes where ``x`` (stepping up) reaches ``y`` (``<= -1``), and
# none where that is a stretch's last line. A complement adds its gaps at the window's ends
# (``hi - last <= -1``), where a tie does matter. ``hi - lo <= t`` is ``lo - hi <= -t - 1``
# read from the other side.
_JOIN = _thresholds([-1], [0, 1], [-2, -1], ties=1)
_GAPS = _thresholds([-1, 0, 1], [-1, 0, 1, 2], [-3, -2, -1, 0], ties=0)

Pair = tuple[Tensor, Tensor]


class Stretches(NamedTuple):
    """Per row, stretches of lines on which each slot's ends are affine: stretch ``m`` of
    row ``r`` holds lines ``[start[r, m], start[r, m + 1])`` (the last up to the window's
    length), and line ``start + i`` of it attends ``[lo + i * dlo, hi + i * dhi]`` per slot,
    steps 0 or 1. ``start`` ``(R, M)`` is sorted from 0, padded with the length (stretches
    of no line); ``lo``, ``hi``, ``dlo``, ``dhi`` are ``(R, M, K)`` int64, empty slots
    ``(_BIG, -_BIG)`` with no steps, last, as ``lines`` lays them out."""

    start: Tensor
    lo: Tensor
    hi: Tensor
    dlo: Tensor
    dhi: Tensor


class _PerToken(Exception):
    """Raised where the stretches cannot answer: the caller reads every line instead."""


def stretch_lines(
    mask: Mask, win: Window, *, transpose: bool, fmt: str
) -> tuple[Stretches, int] | None:
    """The lines of ``lines(mask, win, transpose=...)`` as stretches (local indices, clipped
    to the window) and their count of lines, or None where a leaf cannot say where its
    lines change shape (the per-token path answers then). Raises what ``lines_at`` raises."""
    if transpose:
        line_first, n, first, length = win.kv_offset, win.kv_len, win.q_offset, win.q_len
    else:
        line_first, n, first, length = win.q_offset, win.q_len, win.kv_offset, win.kv_len
    last = first + length - 1
    if int(line_first.max()) + n > _FAR or int(last.max()) > _FAR:
        return None
    try:
        seg = _stretches(mask, line_first, n, first, last, transpose, fmt)
        if _sticks_out(seg, n, first, last):
            seg = _apply(lambda a: _clip_normalized(a, first, last), [seg], n, (first, last))
    except _PerToken:
        return None
    if not bool(first.any()):  # local indices are the absolute ones
        return seg, n
    # Local indices, as ``lines`` gives them.
    real = seg.lo <= seg.hi
    shift = first.view(-1, 1, 1)
    rows = max(seg.lo.shape[0], shift.shape[0])
    seg = _rows(seg, rows)
    lo = pick(real.expand_as(seg.lo), seg.lo - shift, _BIG)
    hi = pick(real.expand_as(seg.hi), seg.hi - shift, -_BIG)
    return seg._replace(lo=lo, hi=hi), n


def _sticks_out(seg: Stretches, n: int, first: Tensor, last: Tensor) -> bool:
    """Whether some real interval of a stretch of lines reaches outside ``[first, last]``
    (``(R, 1)``)."""
    length = _lengths(seg.start, n).unsqueeze(-1)
    real = (seg.lo <= seg.hi) & (length > 0)
    out = seg.lo < first.unsqueeze(-1)
    out |= seg.hi + seg.dhi * (length - 1) > last.unsqueeze(-1)
    return bool((out & real).any())


def _stretches(
    mask: Mask, line_first: Tensor, n: int, first: Tensor, last: Tensor, transpose: bool, fmt: str
) -> Stretches:
    return fold(
        mask,
        lambda node: _leaf_stretches(node, line_first, n, first, last, transpose, fmt),
        lambda a, b: _apply(_intersect, [a, b], n),
        lambda a, b: _apply(_union, [a, b], n),
        lambda a: _apply(lambda x: _complement(x, first, last), [a], n, (first, last), _GAPS),
    )


def _leaf_stretches(
    mask: Mask, line_first: Tensor, n: int, first: Tensor, last: Tensor, transpose: bool, fmt: str
) -> Stretches:
    if mask.head_cycle > 1:  # per_head: its heads' one mask, if they agree
        one = one_mask_for_all_heads(mask, fmt)
        return _stretches(one, line_first, n, first, last, transpose, fmt)
    breaks = mask.line_breaks(transpose=transpose)
    if breaks is None:
        raise _PerToken
    if breaks.shape[1]:
        starts = _starts(breaks.to(torch.int64) - line_first, n)
    else:  # the same shape on every line (a rule): one stretch
        starts = torch.zeros(1, 1, dtype=torch.int64)
    pos = line_first + starts
    answer = mask.lines_at(torch.cat([pos, pos + 1], 1), transpose=transpose, fmt=fmt)
    lo, hi = answer.lo, answer.hi
    if not answer.normalized:
        lo, hi = _normalize(lo, hi)
    return _sampled(starts, lo, hi, n)


def _apply(
    op: Callable[..., Pair],
    parts: list[Stretches],
    n: int,
    bounds: tuple[Tensor, ...] = (),
    thresholds: Tensor = _JOIN,
) -> Stretches:
    """``op`` (an interval operator of ``_structure`` on ``(R, N, K)`` lists) on stretches:
    the parts brought onto common stretches, cut where a comparison of two of their ends
    (or of an end with the window's ``bounds``, ``(R, 1)``) may change, the operator read at
    each stretch's first line and one on, equal neighbours merged."""
    rows = max([p.start.shape[0] for p in parts] + [b.shape[0] for b in bounds])
    parts = [_rows(p, rows) for p in parts]
    several = [p.start for p in parts if p.start.shape[1] > 1]
    if len(several) > 1:
        starts = _starts(torch.cat(several, 1), n)
    else:  # one part has stretches, the others one each (rules: causal, a window)
        starts = several[0] if several else parts[0].start
    based = [_rebased(p, starts) for p in parts]
    cuts = _crossings(based, starts, n, [b.expand(rows, 1) for b in bounds], thresholds)
    if cuts is not None:
        starts = _starts(torch.cat([starts, cuts], 1), n)
        based = [_rebased(p, starts) for p in parts]
    args = [(torch.cat([b.lo, b.lo + b.dlo], 1), torch.cat([b.hi, b.hi + b.dhi], 1)) for b in based]
    lo, hi = op(*args)
    out = _sampled(starts, lo, hi, n)
    return out if cuts is None else _merged(out, n)


def _rows(seg: Stretches, rows: int) -> Stretches:
    if seg.start.shape[0] == rows:
        return seg
    return Stretches(*(t.expand(rows, *t.shape[1:]) for t in seg))


def _lengths(starts: Tensor, n: int) -> Tensor:
    """Lines per stretch: the next start (or ``n``) less its own."""
    return torch.cat([starts[:, 1:], torch.full_like(starts[:, :1], n)], 1) - starts


def _starts(candidates: Tensor, n: int) -> Tensor:
    """``(R, M)`` distinct sorted starts in ``[0, n)`` from ``(R, D)`` candidates (any
    values; those outside are dropped), 0 first, padded with ``n``."""
    zero = torch.zeros(candidates.shape[0], 1, dtype=torch.int64)
    c = torch.cat([zero, candidates.clamp(0, n)], 1).sort(1).values
    c[:, 1:].masked_fill_(c[:, 1:] == c[:, :-1], n)  # repeats, and 0 for those before 0
    c = c.sort(1).values
    width = int((c < n).sum(1).max())
    return c[:, :width]


def _rebased(seg: Stretches, starts: Tensor) -> Stretches:
    """``seg`` on the finer stretches ``starts`` (each inside one of ``seg``'s)."""
    if seg.start.shape[1] == 1:  # one stretch from line 0
        steps = starts.unsqueeze(-1)
        dlo, dhi = (d.expand(-1, starts.shape[1], -1) for d in (seg.dlo, seg.dhi))
        return Stretches(starts, seg.lo + dlo * steps, seg.hi + dhi * steps, dlo, dhi)
    if seg.start is starts:
        return seg
    which = torch.searchsorted(seg.start.contiguous(), starts.contiguous(), right=True).sub_(1)
    steps = (starts - seg.start.gather(1, which)).unsqueeze(-1)
    index = which.unsqueeze(-1).expand(-1, -1, seg.lo.shape[-1])
    dlo, dhi = seg.dlo.gather(1, index), seg.dhi.gather(1, index)
    lo = seg.lo.gather(1, index) + dlo * steps
    hi = seg.hi.gather(1, index) + dhi * steps
    return Stretches(starts, lo, hi, dlo, dhi)


def _crossings(
    based: list[Stretches], starts: Tensor, n: int, bounds: list[Tensor], thresholds: Tensor
) -> Tensor | None:
    """``(R, C)`` lines where a comparison ``x - y <= t`` of two ends (of real slots, or the
    ``bounds``: the window's first and last line) may change inside a stretch, for the
    ``t`` of ``thresholds`` by kind; None for none. Only ends whose steps differ cross:
    their difference moves by one per line."""
    values, steps, real, kinds = [], [], [], []
    for b in based:
        slot_real = b.lo <= b.hi
        values += [b.lo, b.hi]
        steps += [b.dlo, b.dhi]
        real += [slot_real, slot_real]
        kinds += [0] * b.lo.shape[-1] + [1] * b.hi.shape[-1]
    shape = (*starts.shape, 1)
    for bound_kind, bound in enumerate(bounds):
        values.append(bound.unsqueeze(-1).expand(shape))
        steps.append(torch.zeros(shape, dtype=torch.int64))
        real.append(torch.ones(shape, dtype=torch.bool))
        kinds.append(bound_kind)
    v, s, ok = torch.cat(values, -1), torch.cat(steps, -1), torch.cat(real, -1)
    length = _lengths(starts, n)
    ok &= (length >= 2).unsqueeze(-1)  # a stretch of one line has nothing to cut
    pairs = (s.unsqueeze(-1) - s.unsqueeze(-2) == 1).logical_and_(ok.unsqueeze(-1))
    pairs &= ok.unsqueeze(-2)
    flat = pairs.view(-1).nonzero().view(-1)
    if not flat.numel():
        return None
    # Flat indices of (R, M, E, E): x = (r, m, i), y = (r, m, j).
    ends = v.shape[-1]
    j = flat % ends
    x = flat.div(ends, rounding_mode="floor")
    stretch = x.div(ends, rounding_mode="floor")  # r * M + m
    y = stretch * ends + j
    kind = torch.tensor(kinds)
    # x - y = d0 + line: ``<= t`` holds up to line t - d0, changes at t - d0 + 1.
    v = v.view(-1)
    d0 = (v.index_select(0, x) - v.index_select(0, y)).clamp_(-n - 8, n + 8)
    table = thresholds[kind[x % ends], kind[j]]
    at = table[:, :-1] - d0.unsqueeze(-1) + 1
    room = length.view(-1).index_select(0, stretch) - table[:, -1]
    inside = (at > 0) & (at < room.unsqueeze(-1))
    line = (starts.reshape(-1).index_select(0, stretch).unsqueeze(-1) + at)[inside]
    if not line.numel():
        return None
    row = stretch.div(starts.shape[1], rounding_mode="floor").unsqueeze(-1).expand_as(at)[inside]
    # One row of cuts per row, padded past the lines (``_starts`` drops them).
    counts = torch.bincount(row, minlength=starts.shape[0])
    out = torch.full((starts.shape[0], int(counts.max())), n, dtype=torch.int64)
    order = torch.argsort(row, stable=True)
    row, line = row[order], line[order]
    out[row, torch.arange(row.numel()) - (counts.cumsum(0) - counts)[row]] = line
    return out


def _sampled(starts: Tensor, lo: Tensor, hi: Tensor, n: int) -> Stretches:
    """Stretches from a normalized answer at each stretch's first line and the line after
    (``lo``, ``hi`` ``(R, 2M, K)``: first lines, then next lines). Raises ``_PerToken``
    where a stretch of two or more lines does not step by 0 or 1 with its slots' emptiness
    kept. Stretches of no line keep what they were given (nothing reads them)."""
    rows = max(starts.shape[0], lo.shape[0])
    if starts.shape[0] != rows:
        starts = starts.expand(rows, -1)
    if lo.shape[0] != rows:
        lo, hi = lo.expand(rows, -1, -1), hi.expand(rows, -1, -1)
    lo0, lo1 = lo.chunk(2, 1)
    hi0, hi1 = hi.chunk(2, 1)
    dlo, dhi = lo1 - lo0, hi1 - hi0
    real = lo0 <= hi0
    # Bad: steps other than 0 or 1 on a real slot, or a slot real on one line only. Empty
    # slots are (_BIG, -_BIG) on both lines (normalized): no steps.
    bad = torch.bitwise_or(dlo, dhi).bitwise_and_(-2).ne_(0).logical_and_(real)
    bad |= real != (lo1 <= hi1)
    if bool(bad.any()):
        length = _lengths(starts, n).unsqueeze(-1)
        if bool((bad & (length >= 2)).any()):
            raise _PerToken
        # One line: no steps of its own where the next line is not affine with it.
        keep = real & ~bad
        dlo, dhi = dlo * keep, dhi * keep
    if lo0.shape[-1] > 1:  # the slots some stretch of lines uses
        length = _lengths(starts, n).unsqueeze(-1)
        used = (real & (length > 0)).flatten(0, 1).any(0).nonzero()
        slots = int(used.max()) + 1 if used.numel() else 1
        lo0, hi0, dlo, dhi = lo0[..., :slots], hi0[..., :slots], dlo[..., :slots], dhi[..., :slots]
    return Stretches(starts, lo0, hi0, dlo, dhi)


def _joins(seg: Stretches, length: Tensor, per_slot: bool) -> tuple[Tensor, Tensor, Tensor] | None:
    """Which neighbouring stretches join into one affine stretch, and the steps it takes;
    None where none does.

    Returns ``join`` ``(R, M - 1)`` (``(R, M - 1, K)`` ``per_slot``): stretch ``m + 1``
    carries stretch ``m`` on (a slot empty in both, or real in both and stepping across
    their bound as each steps inside); and the ``(R, M, K)`` steps ``dlo``, ``dhi`` each
    stretch takes when it leads the ones joined to it. A stretch of one line has no steps
    of its own: where both its bounds would join with different steps the later one does
    not (a joined stretch is affine throughout). Stretches of no line join the one before."""
    lo, hi, dlo, dhi = seg.lo, seg.hi, seg.dlo, seg.dhi
    real = lo <= hi
    span = length.unsqueeze(-1)
    before, after = span[:, :-1], span[:, 1:]
    # The step from stretch m's last line to stretch m + 1's first.
    step_lo = lo[:, 1:] - lo[:, :-1] - dlo[:, :-1] * (before - 1)
    step_hi = hi[:, 1:] - hi[:, :-1] - dhi[:, :-1] * (before - 1)
    both = real[:, 1:] & real[:, :-1]
    ok = both & ((torch.bitwise_or(step_lo, step_hi) & -2) == 0)
    if per_slot and not bool(ok.any()):
        return None
    ok &= (before < 2) | (step_lo == dlo[:, :-1]) & (step_hi == dhi[:, :-1])
    ok &= (after < 2) | (step_lo == dlo[:, 1:]) & (step_hi == dhi[:, 1:])
    if not per_slot:  # (a slot's own stretches: empty ones and those of no line emit nothing)
        ok |= ~(real[:, 1:] | real[:, :-1])
        ok |= after == 0
        ok = ok.all(-1, keepdim=True)
    if not bool(ok.any()):
        return None
    step_lo, step_hi = step_lo * both, step_hi * both  # empty slots: no step
    differ = (step_lo[:, 1:] != step_lo[:, :-1]) | (step_hi[:, 1:] != step_hi[:, :-1])
    if not per_slot:
        differ = differ.any(-1, keepdim=True)
    join = ok.clone()
    join[:, 1:] &= ~((before[:, 1:] == 1) & differ & ok[:, :-1])
    lead = join & (after > 0)  # a stretch of no line sets no step
    dlo, dhi = dlo.clone(), dhi.clone()
    dlo[:, :-1] = torch.where(lead, step_lo, dlo[:, :-1])
    dhi[:, :-1] = torch.where(lead, step_hi, dhi[:, :-1])
    return (join if per_slot else join[..., 0]), dlo, dhi


def _merged(seg: Stretches, n: int) -> Stretches:
    """Neighbouring stretches whose every slot carries on merged into one; stretches of no
    line dropped."""
    if seg.start.shape[1] == 1:
        return seg
    joins = _joins(seg, _lengths(seg.start, n), per_slot=False)
    if joins is None:
        return seg
    join, dlo, dhi = joins
    keep = torch.ones_like(seg.start, dtype=torch.bool)
    keep[:, 1:] = ~join
    return _compacted(seg._replace(dlo=dlo, dhi=dhi), keep, n)


def _compacted(seg: Stretches, keep: Tensor, n: int) -> Stretches:
    """The kept stretches of each row, first, padded with stretches of no line."""
    width = int(keep.sum(1).max())
    if width == keep.shape[1] and bool(keep.all()):
        return seg
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    kept = keep.gather(1, order)
    index = order.unsqueeze(-1).expand(-1, -1, seg.lo.shape[-1])
    slot_kept = kept.unsqueeze(-1)
    return Stretches(
        pick(kept, seg.start.gather(1, order), n),
        pick(slot_kept, seg.lo.gather(1, index), _BIG),
        pick(slot_kept, seg.hi.gather(1, index), -_BIG),
        seg.dlo.gather(1, index) * slot_kept,
        seg.dhi.gather(1, index) * slot_kept,
    )


_KEPT = 4
"""Lines a stretch keeps for the slices' cut (``compressed``): its first two and last two."""


def compressed(seg: Stretches, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The stretches as few lines for ``magi._slices``'s cut, one row per (row, slot):
    every stretch's first two and last two lines (all of a shorter one), the lines between
    dropped and every later end moved back by what the dropped lines' steps added.

    The cut reads only the steps from line to line and which lines attend: dropping lines
    from the middle of a stretch removes repeats of one step from a stretch of at least
    three like it, which moves no cut (a run that enters it takes it to its end), so the
    slices are the cut of every line, shortened. Returns ``lo``, ``hi`` ``(R * K, N', 1)``,
    each line's place in the window ``(R * K, N')`` and what was taken off its ends (add
    back to a slice's first key at its first line, to its last at its last line)."""
    rows, count, slots = seg.lo.shape
    length = _lengths(seg.start, n).unsqueeze(-1)  # (R, M, 1)
    # Each stretch's lines j = 0..3 at their offsets in it (the last two after the drop).
    j = torch.arange(_KEPT)
    dropped = (length - _KEPT).clamp(min=0)
    late = j >= 2
    offset = j + late * dropped  # (R, M, 4)
    kept = j < length
    # Taken off every line: the drops of the stretches before, and its own past it.
    own = late * dropped  # (R, M, 4)
    before_lo = (seg.dlo * dropped).cumsum(1) - seg.dlo * dropped  # (R, M, K)
    before_hi = (seg.dhi * dropped).cumsum(1) - seg.dhi * dropped
    taken_lo = before_lo.unsqueeze(2) + seg.dlo.unsqueeze(2) * own.unsqueeze(-1)  # (R, M, 4, K)
    taken_hi = before_hi.unsqueeze(2) + seg.dhi.unsqueeze(2) * own.unsqueeze(-1)
    # Ends moved back unequally could leave a start past its end: every start of a row's
    # slot moves back by as much more as its ends ever lead (steps unchanged).
    lead = (taken_hi - taken_lo) * kept.unsqueeze(-1)
    taken_lo = taken_lo + lead.amax((1, 2), keepdim=True)
    at = offset.unsqueeze(-1)
    lo = seg.lo.unsqueeze(2) + seg.dlo.unsqueeze(2) * at - taken_lo
    hi = seg.hi.unsqueeze(2) + seg.dhi.unsqueeze(2) * at - taken_hi
    line = seg.start.unsqueeze(-1) + offset
    # Each row's kept lines first, in order (a line left out would break a run).
    kept = kept.view(rows, -1)
    width = max(int(kept.sum(1).max()), 1)
    order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)[:, :width]
    used = kept.gather(1, order)
    pick_lines = order.unsqueeze(-1).expand(-1, -1, slots)

    def laid(values: Tensor, fill: int) -> Tensor:  # (R, M, 4, K) -> (R * K, N', 1)
        out = values.reshape(rows, -1, slots).gather(1, pick_lines)
        out = torch.where(used.unsqueeze(-1), out, fill)
        return out.transpose(1, 2).reshape(rows * slots, width, 1)

    return (
        laid(lo, _BIG),
        laid(hi, -_BIG),
        line.view(rows, -1).gather(1, order).repeat_interleave(slots, 0),
        laid(taken_lo, 0)[..., 0],
        laid(taken_hi, 0)[..., 0],
    )
