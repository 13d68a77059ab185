"""Bidirectional spans (image patches): tokens of one span attend each other both ways."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask._validate import digest, int_vector, is_nested, source_device
from flexmask.algebra import (
    Intervals,
    LineIntervals,
    Lowered,
    TileGrid,
    VarlenPart,
    Window,
    cannot_lower,
    one_interval,
    run_at,
)
from flexmask.blocks import codes_from
from flexmask.pieces._base import (
    Piece,
    PieceMod,
    SameIdWindowMod,
    same_id_window,
    window_positions,
)

_PAST = 1 << 62  # pads span starts and ends: past every position


class Spans(Piece):
    """q and kv lie in the same span; tokens with id -1 (and past the ids) are in none.

    ::

        ids=[-1, 0, 0, -1, 1]:  ⬚ ⬚ ⬚ ⬚ ⬚
                                ⬚ ■ ■ ⬚ ⬚
                                ⬚ ■ ■ ⬚ ⬚
                                ⬚ ⬚ ⬚ ⬚ ⬚
                                ⬚ ⬚ ⬚ ⬚ ■
    """

    __slots__ = ("per_row", "_span_ids", "_starts", "_ends", "_num_spans", "_reach")
    # Each query's interval is empty or its own span [start, end], which holds the query;
    # spans are disjoint runs. Not monotone alone (a token outside every span between two
    # spans attends nowhere), but a union with causal() is: see ``Mask.attends_around_self``.
    interval_shape = "around_self"
    _arg = "ids"

    def __init__(self, ids: Any, truncate: bool = False) -> None:
        per_row = is_nested(ids)
        rows_in = list(ids) if per_row else [ids]
        bounds = []
        for i, row in enumerate(rows_in):
            name = f"ids[{i}]" if per_row else "ids"
            bounds.append(_span_bounds(int_vector(row, name), name))
        self.per_row = per_row
        # Each row's span starts and ends (exclusive), (R, max spans + 1), padded past every
        # position (the extra column keeps a row without spans searchable), span counts (R,)
        # and canonical ids: span k of its row, -1 outside every span. Spans given different
        # ids but lying in the same places are the same mask.
        self._starts = _padded([s for s, _, _ in bounds])
        self._ends = _padded([e for _, e, _ in bounds])
        self._num_spans = torch.tensor([s.numel() for s, _, _ in bounds])
        self._span_ids = torch.nn.utils.rnn.pad_sequence(
            [canonical for _, _, canonical in bounds], batch_first=True, padding_value=-1
        )
        natural = self._span_ids.shape[1]
        # Where the last span of any row ends: ids of -1 past it say nothing of the sequence.
        self._reach = max((int(e.max()) for _, e, _ in bounds if e.numel()), default=0)
        starts_ends = [torch.stack([s, e]) for s, e, _ in bounds]
        if per_row:
            key_data: tuple = ("rows", natural, digest(*starts_ends))
        else:
            key_data = (natural, tuple(map(tuple, starts_ends[0].tolist())))
        super().__init__(
            ("spans", key_data),
            rows=len(bounds) if per_row else None,
            device=source_device(ids),
            natural=natural,
            truncate=truncate,
        )

    @property
    def data_reach(self) -> int:
        return int(getattr(self, "_reach", self._natural))

    @property
    def carries_batch_data(self) -> bool:
        return True

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
        firsts = torch.cat([grid.q_first.reshape(-1, nq), grid.kv_first.reshape(-1, nkv)], 1)
        lasts = torch.cat([grid.q_last.reshape(-1, nq), grid.kv_last.reshape(-1, nkv)], 1)
        # Rows: the spans' (per-row ids) or the window's (per-row offsets), whichever differ.
        rows = max(self._starts.shape[0], firsts.shape[0])
        starts = self._on("_starts", grid.device).expand(rows, -1).contiguous()
        ends = self._on("_ends", grid.device).expand(rows, -1).contiguous()
        firsts = firsts.expand(rows, -1).contiguous()
        lasts = lasts.expand(rows, -1).contiguous()
        # The spans meeting [first, last] are the index range [first span ending after
        # first, last span starting at or before last]: spans are sorted, disjoint runs.
        lo = torch.searchsorted(ends, firsts, right=True)
        hi = torch.searchsorted(starts, lasts, right=True) - 1
        # Full needs one span to hold a side's whole range: the span of `first` (the one lo
        # points at, clamped to the padding column) holds it and ends after `last`.
        k = lo.clamp(max=ends.shape[1] - 1)
        whole = torch.where((starts.gather(1, k) <= firsts) & (ends.gather(1, k) > lasts), k, -1)
        q_lo, kv_lo = lo[:, :nq].view(rows, 1, nq, 1), lo[:, nq:].view(rows, 1, 1, nkv)
        q_hi, kv_hi = hi[:, :nq].view(rows, 1, nq, 1), hi[:, nq:].view(rows, 1, 1, nkv)
        q_whole = whole[:, :nq].view(rows, 1, nq, 1)
        kv_whole = whole[:, nq:].view(rows, 1, 1, nkv)
        nonempty = torch.maximum(q_lo, kv_lo) <= torch.minimum(q_hi, kv_hi)
        return codes_from(nonempty, (q_whole == kv_whole) & (q_whole >= 0))

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        if window is not None:
            return same_id_window(self, window, self._span_ids.shape[0], device, SpansWindowMod)
        # int32 span ids padded with -1 to length + 1 (the last entry is the sentinel indices
        # past the lookup are clamped onto): one shape for every batch of this length.
        # Ids past the sequence are clipped off (docs/algebra.md): no index reaches them.
        span_ids = self._on("_span_ids", device)[:, :length]
        ids = torch.full((span_ids.shape[0], length + 1), -1, dtype=torch.int32, device=device)
        ids[:, : span_ids.shape[1]] = span_ids
        mod = SpansMod(ids if self.per_row else ids[0], self.per_row)
        return Lowered(mod, mod)

    def _window_ids(
        self, start: int | Tensor, length: int, rows: int, device: torch.device
    ) -> Tensor:
        """Span ids of one window side's positions, -1 outside every span and in a last
        (sentinel) column: (rows, length + 1) int32."""
        positions = window_positions(start, length, device).expand(rows, -1)
        # One -1 column past the ids: every position at or past them reads it.
        ids = torch.nn.functional.pad(self._on("_span_ids", device), (0, 1), value=-1)
        at = positions.clamp(max=ids.shape[1] - 1)
        found = ids.expand(rows, -1).gather(1, at)
        return torch.nn.functional.pad(found, (0, 1), value=-1)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        device = grid.device
        lookup_row = row.view(-1) if self.per_row else torch.zeros_like(row.view(-1))
        starts = self._on("_starts", device)[lookup_row]
        ends = self._on("_ends", device)[lookup_row]
        q_idx = q_idx.expand(lookup_row.shape[0], -1)
        k = torch.searchsorted(ends, q_idx.contiguous(), right=True).clamp(max=ends.shape[1] - 1)
        start = starts.gather(1, k)
        inside = start <= q_idx
        # Outside every span: the empty [1, 0] (a union with causal() is then [0, q]).
        lo = torch.where(inside, start, 1)
        hi = torch.where(inside, ends.gather(1, k) - 1, 0)
        return Intervals(lo, hi)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        # Symmetric: a token's span, both ways; outside every span, nothing.
        return one_interval(*run_at(self._starts, self._ends, pos))

    def varlen_part(self, length: int) -> VarlenPart:
        raise cannot_lower(
            self,
            "varlen",
            "bidirectional spans inside causal text need two rules in one sequence "
            "(use to_flashmask or to_magi)",
        )

    def __repr__(self) -> str:
        if self.per_row:
            return f"spans(<{self._span_ids.shape[0]} rows>)"
        return f"spans({self._span_ids[0].tolist()})"


class SpansMod(PieceMod):
    """spans' mask_mod: q and kv have the same span id, and q has one.

    ``span_id`` is int32 ``(R, length + 1)`` per row, ``(length + 1,)`` shared, -1 outside
    every span; its last entry is a -1 sentinel that indices past the lookup are clamped onto.
    """

    __slots__ = ("span_id",)
    _name = "spans"

    def __init__(self, span_id: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.span_id = span_id

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        last = self.span_id.shape[-1] - 1
        q_span = self._lookup(self.span_id, b, q_idx.clamp(max=last))
        return (q_span == self._lookup(self.span_id, b, kv_idx.clamp(max=last))) & (q_span >= 0)


class SpansWindowMod(SameIdWindowMod):
    """spans's mask_mod on a window: q and kv have the same span id, and q has one."""

    __slots__ = ()
    _name = "spans"


def _span_bounds(ids: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor]:
    """Starts, ends (exclusive) and canonical ids (span index, -1 outside) of one row's ids,
    checked: ids are >= -1, and each id >= 0 is one contiguous run."""
    bad = (ids < -1).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"{name}[{i}] must be a span id >= 0, or -1 for a token in no span, got {int(ids[i])}"
        )
    n = ids.numel()
    changes = torch.ones(n, dtype=torch.bool)
    if n > 1:
        changes[1:] = ids[1:] != ids[:-1]
    run_starts = (changes & (ids >= 0)).nonzero().view(-1)
    run_ids = ids[run_starts]
    unique, counts = torch.unique(run_ids, return_counts=True)
    if (counts > 1).any():
        span = int(unique[counts > 1][0])
        where = run_starts[run_ids == span].tolist()
        raise ValueError(
            f"{name}: span {span} must be contiguous (one run of tokens, as an image's patches "
            f"are), but it starts again at positions {where}; give each run its own id"
        )
    # A run ends where the next change begins.
    change_at = changes.nonzero().view(-1)
    next_change = torch.cat([change_at[1:], torch.tensor([n])])
    run_ends = next_change[torch.searchsorted(change_at, run_starts)]
    canonical = torch.full((n,), -1, dtype=torch.int32)
    if run_starts.numel():
        span_of = torch.searchsorted(run_starts, torch.arange(n), right=True) - 1
        inside = (span_of >= 0) & (torch.arange(n) < run_ends[span_of.clamp(min=0)])
        canonical = torch.where(inside, span_of, -1).to(torch.int32)
    return run_starts, run_ends, canonical


def _padded(rows: list[Tensor]) -> Tensor:
    """(R, max + 1) int64, each row padded past every position."""
    width = max(r.numel() for r in rows) + 1
    out = torch.full((len(rows), width), _PAST, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def spans(ids: Any, *, truncate: bool = False) -> Spans:
    """Bidirectional groups: tokens with the same id ``>= 0`` attend each other both ways;
    a token with id -1 (or past the ids) is in no span and attends nothing here.

    Each span must be contiguous — one run of tokens, as an image's patches are — so that a
    query attends one interval of keys. ``causal() | spans(ids)`` is the mask of text with
    images (Gemma 3, PaliGemma): causal text, each image bidirectional; it is written in
    closed form, and ``& document(seq_lens)`` keeps it inside documents.

    Args:
        ids: one id per token — a list (or 1-D integer tensor or array) for every batch row,
            or a list of lists (or a 2-D tensor or array) with one list per row. Only where
            ids change matters: ``[0, 0, -1, 1]`` and ``[7, 7, -1, 3]`` are the same mask.
            A span reaching past the sequence raises where the mask is used, unless
            ``truncate``; ids of -1 past it are ignored; positions past the ids are in no
            span.
        truncate: cut a span that reaches past the sequence at its end (docs/algebra.md).

    Raises:
        ValueError: an id below -1, or an id whose tokens are not one contiguous run; each
            names the ``ids`` entry.
        TypeError: non-integer ids.

    Example:
        >>> import flexmask
        >>> print((flexmask.causal() | flexmask.spans([-1, 0, 0, 0, -1])).show(5))
        ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ■ ■ ⬚
        ■ ■ ■ ■ ⬚
        ■ ■ ■ ■ ⬚
        ■ ■ ■ ■ ■
    """
    return Spans(ids, truncate)
