"""Documents packed back to back: a query attends only within its own document."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import INT64_MAX, checked_sum, digest, int_vector, is_nested, source_device
from flexmask.algebra import (
    INF,
    TAIL,
    Intervals,
    LineIntervals,
    Lowered,
    TileGrid,
    VarlenPart,
    Window,
    one_interval,
    run_at,
)
from flexmask.blocks import codes_from
from flexmask.pieces._base import (
    Piece,
    PieceMod,
    SameIdWindowMod,
    same_id_window,
    tracing,
    window_positions,
)

# Pads document starts and ends: past every position. Positions are below 2**63 - 1 (a
# window ends there at most) and lengths sum to at most 2**63 - 1, so every real bound is a
# position of its own and the padding never is (a bound of 2**62 lost documents that a
# window past it holds).
_PAST = INT64_MAX


class Document(Piece):
    """q and kv lie in the same document; positions past ``sum(seq_lens)`` are in none.

    ::

        seq_lens=[2, 3]:  ■ ■ ⬚ ⬚ ⬚
                          ■ ■ ⬚ ⬚ ⬚
                          ⬚ ⬚ ■ ■ ■
                          ⬚ ⬚ ■ ■ ■
                          ⬚ ⬚ ■ ■ ■
    """

    __slots__ = ("per_row", "_totals", "_flat", "_counts", "_rows_cache", "_bounds")
    interval_shape = "monotone"

    @property
    def carries_batch_data(self) -> bool:
        return True

    _arg = "seq_lens"

    def __init__(self, seq_lens: Any, truncate: bool = False) -> None:
        per_row = is_nested(seq_lens)
        rows_in = list(seq_lens) if per_row else [seq_lens]
        plain = _plain_rows(rows_in)
        if plain is not None:
            # Lists of Python ints, the data path of a loader that re-makes the mask every
            # step: checked in bulk and made into one tensor (per-value checks cost ~1 us each).
            flat = torch.tensor(list(itertools.chain.from_iterable(plain)), dtype=torch.int64)
            counts = [len(r) for r in plain]
            self._totals = [sum(r) for r in plain]
            key_values: list[int] | None = plain[0] if not per_row else None
        else:
            rows = [
                _check_lens(r, f"seq_lens[{i}]" if per_row else "seq_lens")
                for i, r in enumerate(rows_in)
            ]
            # Summed in Python ints before any int64 cumsum can wrap.
            self._totals = [
                checked_sum(r, f"seq_lens[{i}]" if per_row else "seq_lens")
                for i, r in enumerate(rows)
            ]
            flat = torch.cat(rows)
            counts = [r.numel() for r in rows]
            key_values = None
        self.per_row = per_row
        self._flat = flat
        self._counts = counts
        self._rows_cache: list[Tensor] | None = None
        # The lookups (document starts, ends and counts per row) are made on first use, by
        # a build: a mask re-made only to be looked up in the cache never pays for them.
        self._bounds: tuple[Tensor, Tensor, Tensor] | None = None
        # The key is the lengths' content: every row's count and one digest of their bytes
        # (per row), or the lengths themselves; equal however the lengths were given.
        if per_row:
            key_data: tuple = ("rows", tuple(counts), digest(flat))
        else:
            key_data = tuple(key_values if key_values is not None else flat.tolist())
        super().__init__(
            ("document", key_data),
            rows=len(counts) if per_row else None,
            device=source_device(seq_lens),
            natural=max(self._totals),
            truncate=truncate,
        )

    @property
    def data_reach(self) -> int:
        return self._natural  # the longest row's documents, summed

    # A position's interval is its document, which holds it; past the documents the tables
    # start at the length (``interval_tables``): under causal() the end bound is implied.
    interval_holds_query = True

    def __getstate__(self) -> dict[str, object]:
        # The lookups and row views are made again on first use: a pickle holds the lengths.
        return {**super().__getstate__(), "_bounds": None, "_rows_cache": None}

    @property
    def seq_lens(self) -> list[Tensor]:
        """Each row's document lengths (one row when shared), int64."""
        if self._rows_cache is None:
            rows = list(self._flat.split(self._counts))
            if tracing():  # a trace's tensors are never kept
                return rows
            self._rows_cache = rows
        return self._rows_cache

    def _tables(self) -> tuple[Tensor, Tensor, Tensor]:
        """Each row's document starts and ends (R, max documents), padded past every
        position (never a match), and document counts (R,): what every lookup needs.
        Documents may run past the sequence (``truncate=True``: clipped to it); the sums fit
        in int64 (checked), so each row is sorted for search as it is."""
        if self._bounds is None or tracing():
            rows = self.seq_lens
            ends = _padded([r.cumsum(0) for r in rows])
            starts = _padded([r.cumsum(0) - r for r in rows])
            bounds = (starts, ends, torch.tensor(self._counts))
            if tracing():  # a trace's tensors are never kept
                return bounds
            self._bounds = bounds
        return self._bounds

    @property
    def _starts(self) -> Tensor:
        return self._tables()[0]

    @property
    def _ends(self) -> Tensor:
        return self._tables()[1]

    @property
    def _num_docs(self) -> Tensor:
        return self._tables()[2]

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        device = grid.device
        num_docs = self._on("_num_docs", device)
        ends = self._on("_ends", device)
        # Document of a token: the first document whose end lies after it. Only tile edges are
        # looked up (4 x blocks), never every token. Tokens past the data get id num_docs.
        edges = torch.cat(
            [
                grid.q_first.flatten(),
                grid.q_last.flatten(),
                grid.kv_first.flatten(),
                grid.kv_last.flatten(),
            ]
        )
        ids = torch.searchsorted(ends, edges.expand(ends.shape[0], -1).contiguous(), right=True)
        nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
        q0, q1, k0, k1 = torch.split(ids, [nq, nq, nkv, nkv], dim=1)
        rows = ids.shape[0]
        q0, q1 = q0.view(rows, 1, nq, 1), q1.view(rows, 1, nq, 1)
        k0, k1 = k0.view(rows, 1, 1, nkv), k1.view(rows, 1, 1, nkv)
        last_doc = (num_docs - 1).view(rows, 1, 1, 1)
        # Ids are consecutive along the sequence, so the documents in a tile form a range;
        # the tile attends somewhere iff the q and kv ranges share a real document: they
        # overlap, and neither starts past the last document. Folding the per-side tests
        # into the range ends keeps the work on the full tile grid to three comparisons.
        q1 = torch.where(q0 <= last_doc, q1, -1)
        k1 = torch.where(k0 <= last_doc, k1, -1)
        nonempty = (q0 <= k1) & (k0 <= q1)
        # Full: one real document covers both sides.
        q_single = torch.where((q0 == q1) & (q0 <= last_doc), q0, -1)
        k_single = torch.where(k0 == k1, k0, -2)
        return codes_from(nonempty, q_single == k_single)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        if window is not None:
            return same_id_window(self, window, self._ends.shape[0], device, DocumentWindowMod)
        # int32 ids, -1 past the documents; sized by the sequence length, never by the number
        # of documents, so a compiled kernel sees one shape for every batch of this length.
        doc_id = self._doc_ids(length, device)
        mod = DocumentMod(doc_id if self.per_row else doc_id[0], self.per_row)
        return Lowered(mod, mod)

    def _window_ids(
        self, start: int | Tensor, length: int, rows: int, device: torch.device
    ) -> Tensor:
        """Document index of one window side's positions, -1 past the documents and in a
        last (sentinel) column: (rows, length + 1) int32, one search per position."""
        positions = window_positions(start, length, device)
        ends = self._on("_ends", device)
        doc = torch.searchsorted(
            ends.expand(rows, -1).contiguous(), positions.expand(rows, -1).contiguous(), right=True
        )
        num_docs = self._on("_num_docs", device).view(-1, 1)
        doc = torch.where(doc < num_docs, doc, -1).to(torch.int32)
        return torch.nn.functional.pad(doc, (0, 1), value=-1)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        # Only the queried positions: the document of each is one search among its row's
        # document ends; past the documents, the empty interval [1, 0].
        starts, ends = self._on("_starts", grid.device), self._on("_ends", grid.device)
        num_docs = self._on("_num_docs", grid.device)
        lookup_row = row.view(-1) if self.per_row else torch.zeros_like(row.view(-1))
        row_ends = ends[lookup_row]
        doc = torch.searchsorted(row_ends, q_idx.contiguous(), right=True)
        inside = doc < num_docs[lookup_row].view(-1, 1)
        doc = doc.clamp(max=ends.shape[1] - 1)
        lo = torch.where(inside, starts[lookup_row].gather(1, doc), 1)
        # A document running past the sequence ends with it: no bound near int64's edge.
        hi = torch.where(inside, row_ends.gather(1, doc).clamp(max=grid.length) - 1, 0)
        return Intervals(lo, hi)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        # Symmetric: a token's document, both ways; past the documents, nothing.
        return one_interval(*run_at(*self._lowering_bounds(pos.device), pos))

    def line_breaks(self, *, transpose: bool) -> Tensor:
        # A line's document changes where one ends (the next starts there; the first at 0,
        # the last end is past them all): the same both ways.
        return self._lowering_bounds(torch.device("cpu"))[1]

    def varlen_part(self, length: int) -> VarlenPart:
        # One sequence per document: each position's document, -1 past them. A position's
        # document is the number of ends at or before it: a count of end marks, every row at
        # once (O(length); a batched search over every position costs several times more).
        cpu = torch.device("cpu")
        ends = self._on("_ends", cpu).clamp(max=length + 1)  # padding and ends past: no mark
        marks = torch.zeros(ends.shape[0], length + 2, dtype=torch.int64)
        marks.scatter_add_(1, ends, torch.ones_like(ends))
        doc = marks[:, : length + 1].cumsum(1)
        num_docs = self._on("_num_docs", cpu).view(-1, 1)
        return VarlenPart(segment_ids=list(torch.where(doc < num_docs, doc, -1).unbind(0)))

    def _lowering_bounds(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(R, D) document starts and exclusive ends for the lowerings, clamped to and
        padded with ``INF``: the piece's own tables (made once per piece)."""
        starts, ends = self._on("_starts", device), self._on("_ends", device)
        return starts.clamp(max=INF), ends.clamp(max=INF)

    def interval_tables(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        # Each position's document start and end as running sums of steps at the document
        # starts, as _doc_ids counts ids: O(length), no search. Past the documents (and in
        # the tail), start `length` and end 0: empty. Documents of length 0 share a start
        # with the next one and their steps add up to its bounds; bounds past the sequence
        # are clamped to it, and then hold nothing.
        width = length + TAIL
        starts = self._on("_starts", device).clamp(max=length)
        ends = self._on("_ends", device).clamp(max=length)
        num_docs = self._on("_num_docs", device).view(-1, 1)
        real = torch.arange(starts.shape[1], device=device) < num_docs
        # The step at each start: this bound minus the previous document's.
        start_step = torch.diff(starts, dim=1, prepend=torch.zeros_like(starts[:, :1]))
        end_step = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))
        at = torch.where(real, starts, width)  # padding entries: into the dropped column
        # One more step where the documents end (the row's total): to the empty interval.
        last = (num_docs - 1).clamp(min=0)
        total = ends.gather(1, last)
        # int32: every bound is clamped to the length (< 2**31, interval_mods checks).
        i32 = torch.int32
        lo = torch.zeros(starts.shape[0], width + 1, dtype=i32, device=device)
        hi = torch.zeros_like(lo)
        lo.scatter_add_(1, at, torch.where(real, start_step, 0).to(i32))
        hi.scatter_add_(1, at, torch.where(real, end_step, 0).to(i32))
        lo.scatter_add_(1, total, (length - starts.gather(1, last)).to(i32))
        hi.scatter_add_(1, total, (-total).to(i32))
        lo = torch.cumsum(lo, 1, dtype=i32, out=lo)
        hi = torch.cumsum(hi, 1, dtype=i32, out=hi)
        return lo[:, :width], hi[:, :width]

    def _doc_ids(self, length: int, device: torch.device) -> Tensor:
        """Document index of positions 0..length, -1 past the documents: (R, length + 1)
        int32, one cumsum over end markers (O(length)), no search."""
        ends = self._on("_ends", device).clamp(max=length)
        num_docs = self._on("_num_docs", device).view(-1, 1)
        # +1 at each document's end, except the last one's, where the count drops from
        # (documents - 1) to -1. Padding entries add 0.
        d = torch.arange(ends.shape[1], device=device)
        step = torch.where(d < num_docs - 1, 1, torch.where(d == num_docs - 1, -num_docs, 0))
        doc = torch.zeros(ends.shape[0], length + 1, dtype=torch.int32, device=device)
        doc.scatter_add_(1, ends, step.to(torch.int32))
        return torch.cumsum(doc, 1, dtype=torch.int32, out=doc)

    def __repr__(self) -> str:
        if self.per_row:
            return f"document(<{len(self.seq_lens)} rows>)"
        return f"document({self.seq_lens[0].tolist()})"


class DocumentMod(PieceMod):
    """document's mask_mod: q and kv have the same document id, and q has one.

    ``doc_id`` is int32 ``(R, length + 1)`` per row, ``(length + 1,)`` shared; its last entry
    is a -1 sentinel that indices past the lookup are clamped onto.
    """

    __slots__ = ("doc_id",)
    _name = "document"

    def __init__(self, doc_id: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.doc_id = doc_id

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        last = self.doc_id.shape[-1] - 1
        q_doc = self._lookup(self.doc_id, b, q_idx.clamp(max=last))
        return (q_doc == self._lookup(self.doc_id, b, kv_idx.clamp(max=last))) & (q_doc >= 0)


class DocumentWindowMod(SameIdWindowMod):
    """document's mask_mod on a window: q and kv have the same document id, and q has one."""

    __slots__ = ()
    _name = "document"


def _padded(rows: list[Tensor]) -> Tensor:
    """(R, longest) int64 of bounds >= 0, padded with _PAST: marked -1 first, since
    pad_sequence's padding value is a float (2**63 - 1 would round to 2**63 and wrap)."""
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
    return out.masked_fill_(out < 0, _PAST)


def _plain_rows(rows: list[Any]) -> list[list[int]] | None:
    """The rows as lists of Python ints when every row is a non-empty list or tuple of ints
    >= 0 summing within int64, else None (the per-value checks then name the bad entry)."""
    plain = []
    for row in rows:
        if type(row) not in (list, tuple) or not row:
            return None
        if not all(type(v) is int for v in row):  # bool and numpy ints take the checks
            return None
        if min(row) < 0 or sum(row) > INT64_MAX:
            return None
        plain.append(row if type(row) is list else list(row))
    return plain


def _check_lens(value: Any, name: str) -> Tensor:
    lens = int_vector(value, name)
    if lens.numel() == 0:
        raise ValueError(
            f"{name} must list at least one document length, got an empty list (a row with "
            f"no documents is [0])"
        )
    bad = (lens < 0).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"{name}[{i}] must be a document length >= 0, got {int(lens[i])}")
    return lens


def document(seq_lens: Any, *, truncate: bool = False) -> Document:
    """Documents of the given lengths packed back to back from position 0.

    q attends kv iff both lie in the same document; positions at or beyond ``sum(seq_lens)``
    belong to no document and attend nowhere. Documents that run past the sequence raise
    where the mask is used (lengths counted for other rows), unless ``truncate=True`` asks
    for them to be cut at its end (docs/algebra.md). ``causal() & document(seq_lens)`` is the
    usual packed-sequence mask.

    Args:
        seq_lens: document lengths >= 0 — one list (or 1-D integer tensor or array) for every
            batch row, or a list of lists (or a 2-D tensor or array, or a list of 1-D ones)
            with one list per row. A length of 0 is an empty sample: it holds no token and
            changes nothing else.
        truncate: cut documents that run past the sequence at its end (a truncated last
            document) instead of raising where the mask is used.

    Raises:
        ValueError: an empty list, a negative length, or a sum that does not fit in int64;
            each names the ``seq_lens`` entry. Where the mask is used: a row's documents
            summing past the sequence, without ``truncate``.
        TypeError: non-integer lengths.

    Example:
        >>> import flexmask
        >>> print((flexmask.causal() & flexmask.document([2, 3])).show(5))
        ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚
        ⬚ ⬚ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ⬚
        ⬚ ⬚ ■ ■ ■
    """
    return Document(seq_lens, truncate)
