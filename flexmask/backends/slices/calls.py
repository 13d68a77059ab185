"""The slices backend's kernel calls: MagiAttention's slices (``flexmask.formats.to_magi``)
as calls of torch's CPU flash kernel, in the order they run, with which of them write their
queries' and keys' rows first and which rows no call writes.

A step lowers a mask per micro-batch, so this runs once per step: up to ``FEW_SLICES``
slices it walks them in Python (a few microseconds each), beyond it every slice's calls are
one int64 table (a walk over a thousand per-row documents cost more than the BlockMask build
it stands in for; ~150 small torch calls cost more than a walk over a few dozen).
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flexmask.formats import BICAUSAL, CAUSAL, FULL, INVCAUSAL

# A banded slice (a sliding window's body, inverse causal) runs in calls of this many
# queries, each onto the keys its queries see, with a (rows, keys) additive mask: the band's
# waste is (rows - 1) / (rows - 1 + width) of the scores, and smaller calls run the kernel
# less efficiently; 256 was the fastest measured (docs/costs.md, "The thresholds in the
# code").
BAND_ROWS = 256


Call = tuple[int | None, int, int, int, int, bool, int | None]
"""``(row, q_start, q_end, k_start, k_end, causal, band)``: batch row ``row`` (None: every
row), queries ``[q_start, q_end)`` onto keys ``[k_start, k_end)``; top-left causal where
``causal``; where ``band`` is not None, query ``a`` of the call sees key ``b`` (both counted
from the call's first) only for ``a <= b``, and ``b <= a + band - 1`` where ``band > 0``
(an additive mask, one per shape, shared by the calls)."""


class Slices(NamedTuple):
    """Kernel calls of one mask, in local positions. Calls cover each (query, key) pair at
    most once."""

    calls: tuple[Call, ...]
    first: tuple[bool, ...]
    """Per call: no earlier call touches its queries, so its output is written, not merged
    (and its queries' gradient written, not added)."""
    first_keys: tuple[bool, ...]
    """Per call: no earlier call touches its keys, so their gradients are written, not added."""
    query_gaps: tuple[tuple[int | None, int, int], ...]
    """``(row, start, end)``: queries no first call writes (zeroed before the calls add)."""
    key_gaps: tuple[tuple[int | None, int, int], ...]
    """The same for keys and the first-keys calls."""
    rows_covered: int
    """Query rows summed over the slices (a query in two slices counts twice)."""

    def __len__(self) -> int:
        return len(self.calls)


def kernel_calls(magi: Any, q_len: int, kv_len: int, per_row: bool) -> list[Call]:
    """MagiAttention's slices as calls of torch's CPU kernel (every type of slice has one).

    ``to_magi`` lays batch rows end to end (row ``b``'s queries from ``b * q_len``, its keys
    from ``b * kv_len``); a call keeps the row and local positions. Magi's causal is
    bottom-right aligned, torch's CPU kernel's top-left: a causal slice with more keys than
    queries is a full slice onto its first keys plus a square causal one onto its last; one
    with fewer keys than queries leaves its first queries out (they see none of its keys).
    Inverse-causal and bi-causal slices (query ``i`` from key ``i + ks - qs``; bi-causal up
    to ``i + ke - qe``) run in calls of ``BAND_ROWS`` queries, each onto just the keys its
    queries see, under a band mask.
    """
    calls: list[Call] = []
    for (qs, qe), (ks, ke), kind in zip(
        magi.q_ranges.tolist(), magi.k_ranges.tolist(), magi.attn_type_map.tolist(), strict=True
    ):
        row = qs // q_len if per_row else None
        if row is not None:
            qs, qe = qs - row * q_len, qe - row * q_len
            ks, ke = ks - row * kv_len, ke - row * kv_len
        if kind == FULL:
            calls.append((row, qs, qe, ks, ke, False, None))
        elif kind in (INVCAUSAL, BICAUSAL):
            # Band width: bi-causal query i sees [i + ks - qs, i + ke - qe]; inverse causal
            # from i + ks - qs to the slice's last key (0: no upper edge).
            width = (ke - ks) - (qe - qs) + 1 if kind == BICAUSAL else 0
            if kind == BICAUSAL and width < 1:
                continue  # no query sees a key (to_magi makes none such)
            if kind == INVCAUSAL:
                qe = min(qe, qs + ke - ks)  # queries past it would see no key of this slice
            for start in range(qs, qe, BAND_ROWS):
                stop = min(start + BAND_ROWS, qe)
                last = stop - 1 + ke - qe if kind == BICAUSAL else ke - 1
                calls.append((row, start, stop, start + ks - qs, last + 1, False, width))
        elif kind == CAUSAL:
            n, m = qe - qs, ke - ks
            if m > n:
                calls.append((row, qs, qe, ks, ke - n, False, None))
                calls.append((row, qs, qe, ke - n, ke, True, None))
            else:
                calls.append((row, qe - m, qe, ks, ke, True, None))
        else:
            raise RuntimeError(f"to_magi returned slice type {kind}, not one of Magi's four")
    return calls


FEW_SLICES = 128
"""Up to this many Magi slices, the calls are cut from Python lists."""


def slices_of(magi: Any, batch: int, q_len: int, kv_len: int, per_row: bool) -> Slices:
    """The kernel calls of a mask's Magi slices (``to_magi`` of ``batch`` rows if
    ``per_row``, else of one row for every row)."""
    rows: list[int | None] = list(range(batch)) if per_row else [None]
    covered = int((magi.q_ranges[:, 1] - magi.q_ranges[:, 0]).sum())
    if magi.attn_type_map.numel() <= FEW_SLICES:
        # The order they run: by batch row, then first query (merging by log-sum-exp does
        # not depend on the order), then first key; stable, so calls of a slice keep theirs.
        ordered = sorted(
            kernel_calls(magi, q_len, kv_len, per_row),
            key=lambda c: (-1 if c[0] is None else c[0], c[1], c[3]),
        )
        first = _first_touch([c[:3] for c in ordered])
        keys = [(c[0], c[3], c[4]) for c in ordered]
        first_keys = _first_touch(keys)
        return Slices(
            tuple(ordered),
            first,
            first_keys,
            _gaps(rows, q_len, [c[:3] for c, f in zip(ordered, first, strict=True) if f]),
            _gaps(rows, kv_len, [c for c, f in zip(keys, first_keys, strict=True) if f]),
            covered if ordered else 0,
        )
    table = _call_table(magi, q_len, kv_len, per_row)
    row, qs, _, ks, _ = table[:, :5].unbind(1)
    table = table[torch.sort(((row + 1) * (q_len + 1) + qs) * (kv_len + 1) + ks, stable=True)[1]]
    row, qs, qe, ks, ke = table[:, :5].unbind(1)
    first_t = _first_touches(row, qs, qe, q_len)
    keys_t = _first_touches(row, ks, ke, kv_len)
    return Slices(
        tuple(_as_calls(table)),
        tuple(first_t.tolist()),
        tuple(keys_t.tolist()),
        _gaps_of(rows, q_len, row[first_t], qs[first_t], qe[first_t]),
        _gaps_of(rows, kv_len, row[keys_t], ks[keys_t], ke[keys_t]),
        covered if len(table) else 0,
    )


def _call_table(magi: Any, q_len: int, kv_len: int, per_row: bool) -> Tensor:
    """``kernel_calls`` as an ``(N, 7)`` int64 table in the same order: row (-1: every row),
    queries, keys, causal (0 or 1), band (-1: none). Every slice's calls at once: a step lowers
    a mask per micro-batch, and a Python walk over a thousand slices costs more than the
    BlockMask build it stands in for."""
    kind = magi.attn_type_map.to(torch.int64).cpu()
    bad = (kind < FULL) | (kind > BICAUSAL)
    if bool(bad.any()):
        raise RuntimeError(
            f"to_magi returned slice type {int(kind[bad][0])}, not one of Magi's four"
        )
    qs, qe = magi.q_ranges.to(torch.int64).cpu().unbind(1)
    ks, ke = magi.k_ranges.to(torch.int64).cpu().unbind(1)
    row = qs.div(q_len, rounding_mode="floor") if per_row else torch.full_like(qs, -1)
    if per_row:
        qs, qe, ks, ke = qs - row * q_len, qe - row * q_len, ks - row * kv_len, ke - row * kv_len
    n, m = qe - qs, ke - ks
    causal = kind == CAUSAL
    if bool(((kind == FULL) | causal & (m <= n)).all()):  # documents, trees: a call a slice
        q_first = torch.where(causal, qe - m, qs)
        return torch.stack([row, q_first, qe, ks, ke, causal.long(), torch.full_like(qs, -1)], 1)
    bi = kind == BICAUSAL
    banded = bi | (kind == INVCAUSAL)
    split = (kind == CAUSAL) & (m > n)  # a full call onto the first keys, a causal one
    # Band width: bi-causal query i sees [i + ks - qs, i + ke - qe]; inverse causal from
    # i + ks - qs to the slice's last key (0: no upper edge), and queries past qs + m see no
    # key of the slice. A bi-causal slice no query sees a key of has no call.
    width = torch.where(bi, m - n + 1, 0)
    q_stop = torch.where(bi, qe, torch.minimum(qe, qs + m))
    bands = (q_stop - qs + BAND_ROWS - 1).div(BAND_ROWS, rounding_mode="floor").clamp(min=0)
    count = torch.where(banded, torch.where(bi & (width < 1), 0, bands), 1 + split.long())
    at = torch.repeat_interleave(torch.arange(count.numel()), count)
    j = torch.arange(at.numel()) - (count.cumsum(0) - count)[at]  # the call's place in its slice
    a, b, c, d, n, m, banded = qs[at], qe[at], ks[at], ke[at], n[at], m[at], banded[at]
    first_of_split, second_of_split = split[at] & (j == 0), split[at] & (j == 1)
    start = a + j * BAND_ROWS
    stop = torch.minimum(start + BAND_ROWS, q_stop[at])
    band_end = torch.where(bi[at], stop + d - b, d)
    causal = (kind[at] == CAUSAL) & ~first_of_split
    columns = [
        row[at],
        torch.where(banded, start, torch.where(causal & ~second_of_split, b - m, a)),
        torch.where(banded, stop, b),
        torch.where(banded, start + c - a, torch.where(second_of_split, d - n, c)),
        torch.where(banded, band_end, torch.where(first_of_split, d - n, d)),
        causal.long(),
        torch.where(banded, width[at], -1),
    ]
    return torch.stack(columns, 1)


def _as_calls(table: Tensor) -> list[Call]:
    # Column by column (zip, not a conversion per field of every call): a row of -1 and a
    # band of -1 are None.
    n = table.shape[0]
    row, qs, qe, ks, ke, _, band = table.unbind(1)
    rows: list[Any] = (
        [None] * n if bool((row < 0).all()) else [None if r < 0 else r for r in row.tolist()]
    )
    if bool((band >= 0).any()):
        bands: list[Any] = [None if w < 0 else w for w in band.tolist()]
    else:
        bands = [None] * n
    causal = (table[:, 5] != 0).tolist()
    columns = (rows, qs.tolist(), qe.tolist(), ks.tolist(), ke.tolist(), causal, bands)
    return list(zip(*columns, strict=True))


def _first_touch(spans: list[tuple[int | None, int, int]]) -> tuple[bool, ...]:
    """Per ``(row, start, end)`` in order: no earlier span of its row overlaps it."""
    # Spans in order of their start within each row (every query span, and the key spans of
    # documents and windows): an earlier span overlaps iff it reaches past this start, so a
    # running reach per row answers, without the general walk's searches.
    reach: dict[int | None, tuple[int, int]] = {}  # per row: (last start, furthest end)
    first = []
    for row, start, end in spans:
        last_start, furthest = reach.get(row, (start, start))
        if start < last_start or end <= start:
            return _first_touch_any(spans)
        first.append(row not in reach or start >= furthest)
        reach[row] = (start, max(furthest, end))
    return tuple(first)


def _first_touches(row: Tensor, start: Tensor, end: Tensor, length: int) -> Tensor:
    """``_first_touch`` of spans ``[start, end)`` below ``length``, row -1 for every row."""
    # Spans in order of their row, then start (every query span, and the key spans of
    # documents and windows): an earlier span overlaps iff it reaches past this start, so a
    # running reach answers (each row's positions shifted past the rows before it).
    later = (row[1:] > row[:-1]) | (row[1:] == row[:-1]) & (start[1:] >= start[:-1])
    if not bool(later.all() & (end > start).all()):
        spans = list(zip(row.tolist(), start.tolist(), end.tolist(), strict=True))
        return torch.tensor(_first_touch_any(spans), dtype=torch.bool).view(-1)
    base = (row + 1) * (length + 1)
    reach = (base + end).cummax(0).values
    return base + start >= torch.cat([reach.new_full((1,), -1), reach[:-1]])


def _first_touch_any(spans: list[tuple[int | None, int, int]]) -> tuple[bool, ...]:
    """Per ``(row, start, end)`` in any order: no earlier span of its row overlaps it."""
    starts: dict[int | None, list[int]] = {}  # per row, the union of the spans so far:
    ends: dict[int | None, list[int]] = {}  # disjoint, sorted intervals
    first = []
    for row, start, end in spans:
        s, e = starts.setdefault(row, []), ends.setdefault(row, [])
        lo = bisect.bisect_right(e, start)  # the first interval ending after ``start``
        hi = bisect.bisect_left(s, end)  # past the last one starting before ``end``
        first.append(lo == hi)
        if lo < hi:
            start, end = min(start, s[lo]), max(end, e[hi - 1])
        s[lo:hi], e[lo:hi] = [start], [end]
    return tuple(first)


def _gaps(
    rows: list[int | None], length: int, written: list[tuple[int | None, int, int]]
) -> tuple[tuple[int | None, int, int], ...]:
    """Per row, the positions in ``[0, length)`` outside every written span (the spans of
    first calls, which do not overlap)."""
    spans: dict[int | None, list[tuple[int, int]]] = {row: [] for row in rows}
    for row, start, end in written:
        spans[row].append((start, end))
    gaps = []
    for row in rows:
        at = 0
        for start, end in sorted(spans[row]):
            if start > at:
                gaps.append((row, at, start))
            at = end
        if at < length:
            gaps.append((row, at, length))
    return tuple(gaps)


def _gaps_of(
    rows: list[int | None], length: int, row: Tensor, start: Tensor, end: Tensor
) -> tuple[tuple[int | None, int, int], ...]:
    """Per row, by position, the positions in ``[0, length)`` outside every span
    ``[start, end)`` of that row (the spans of first calls, which do not overlap; row -1:
    every row, ``None`` in ``rows``)."""
    if int((end - start).sum()) == length * len(rows):
        return ()  # disjoint spans inside the rows that add up to them: no gap (documents)
    order = torch.argsort((row + 1) * (length + 1) + start)
    row, start, end = row[order], start[order], end[order]
    opens = torch.ones_like(row, dtype=torch.bool)  # the first span of its row
    opens[1:] = row[1:] != row[:-1]
    closes = torch.ones_like(opens)  # the last
    closes[:-1] = opens[1:]
    before = torch.where(opens, 0, torch.cat([end.new_zeros(1), end[:-1]]))
    inner, tail = start > before, closes & (end < length)
    keys = [-1 if r is None else r for r in rows]
    bare = torch.tensor(sorted(set(keys) - set(row.tolist())), dtype=torch.int64)
    gap_row = torch.cat([row[inner], row[tail], bare])
    gap_lo = torch.cat([before[inner], end[tail], torch.zeros_like(bare)])
    gap_hi = torch.cat(
        [start[inner], torch.full_like(end[tail], length), bare.new_full(bare.shape, length)]
    )
    order = torch.argsort((gap_row + 1) * (length + 1) + gap_lo)
    return tuple(
        (None if r < 0 else r, lo, hi)
        for r, lo, hi in zip(
            gap_row[order].tolist(), gap_lo[order].tolist(), gap_hi[order].tolist(), strict=True
        )
    )
