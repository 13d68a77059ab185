"""Chunked local attention (Llama 4): a query attends only within its own chunk."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask.algebra import (
    Atom,
    Formula,
    Intervals,
    Join,
    LineIntervals,
    Lowered,
    TileGrid,
    ValueBound,
    VarlenPart,
    Window,
    one_interval,
)
from flexmask.blocks import codes_from
from flexmask.pieces._base import PieceMod
from flexmask.pieces._rowvalue import RowValuePiece


class Chunked(RowValuePiece):
    """``q_idx // size == kv_idx // size``.

    ::

        size=2:  ■ ■ ⬚ ⬚
                 ■ ■ ⬚ ⬚
                 ⬚ ⬚ ■ ■
                 ⬚ ⬚ ■ ■
    """

    __slots__ = ()
    # Query q attends [size * (q // size), size * (q // size) + size - 1]: lo never
    # decreases and is <= q, hi never decreases and is >= q (build.closed_form).
    interval_shape = "monotone"
    _arg = "size"
    _kind = "chunked"

    def __init__(self, size: Any) -> None:
        super().__init__(size, "size", minimum=1)

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        # Chunk ids grow along the sequence, so a tile's chunks are a range on each side:
        # the tile attends somewhere iff the two ranges overlap, everywhere iff both sides
        # lie in one and the same chunk. Only tile edges are divided, never every token.
        size = self._row_values(grid).clamp(max=max(grid.length, 1))
        q0, q1 = grid.q_first // size, grid.q_last // size
        k0, k1 = grid.kv_first // size, grid.kv_last // size
        nonempty = (q0 <= k1) & (k0 <= q1)
        return codes_from(nonempty, (q0 == q1) & (k0 == k1) & (q0 == k0))

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = ChunkedMod(self._captured(device), self.per_row)
        return Lowered(mod, mod)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        size = self._at_rows(row, grid).clamp(min=1)  # clamped to the sequence: no overflow
        lo = q_idx.div(size, rounding_mode="floor") * size
        return Intervals(lo, lo + size - 1)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        size = self._line_values().clamp(min=1)  # symmetric: the same both ways
        start = pos.div(size, rounding_mode="floor") * size
        return one_interval(start, start + size - 1)

    def interval_form(self) -> Formula:
        # (q // size) * size <= kv_idx < (q // size) * size + size: q's chunk.
        lo, hi = ValueBound(self, "chunk"), ValueBound(self, "chunk+value")
        return Join(True, (Atom(False, lo), Atom(True, hi)))

    def varlen_part(self, length: int) -> VarlenPart:
        # One sequence per chunk.
        pos = torch.arange(length + 1)
        size = self._line_values()
        return VarlenPart(segment_ids=[pos.div(s, rounding_mode="floor") for s in size.view(-1)])


class ChunkedMod(PieceMod):
    """chunked's mask_mod: ``q_idx // size[b] == kv_idx // size[b]``."""

    __slots__ = ("size",)
    _name = "chunked"

    def __init__(self, size: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.size = size

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        size = self._value(self.size, b)
        return (q_idx // size) == (kv_idx // size)


def chunked(size: Any) -> Chunked:
    """Chunked local attention, as in Llama 4's local layers: the sequence is cut into chunks
    of ``size`` tokens from position 0, and a query attends every key of its own chunk,
    ``q_idx // size == kv_idx // size``.

    ``causal() & chunked(size)`` is Llama 4's mask: causal within each chunk. Both are
    written in closed form (each query attends one interval of keys).

    Args:
        size: chunk length >= 1, one int for every row or a list with one per batch row. A
            chunk at least the sequence length is full attention (any size up to
            ``2**63 - 1``): clipped to the sequence, as every piece's lengths are
            (docs/algebra.md).

    Raises:
        ValueError: a size below 1, or one that does not fit in int64; each names ``size``.
        TypeError: a size that is not an integer.

    Example:
        >>> import flexmask
        >>> print((flexmask.causal() & flexmask.chunked(2)).show(5))
        ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚
        ⬚ ⬚ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ⬚
        ⬚ ⬚ ⬚ ⬚ ■
    """
    return Chunked(size)
