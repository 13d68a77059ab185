"""Sliding-window (local) attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask.algebra import (
    INF,
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
from flexmask.pieces.position_window import PositionWindow


class SlidingWindow(RowValuePiece):
    """``|q_idx - kv_idx| < size``.

    ::

        size=2:  ■ ■ ⬚ ⬚
                 ■ ■ ■ ⬚
                 ⬚ ■ ■ ■
                 ⬚ ⬚ ■ ■
    """

    __slots__ = ()
    interval_shape = "monotone"
    _arg = "size"
    _kind = "sliding_window"

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        size = self._row_values(grid)
        zero = torch.zeros((), dtype=torch.int64, device=grid.device)
        nearest = torch.maximum(
            torch.maximum(grid.kv_first - grid.q_last, grid.q_first - grid.kv_last), zero
        )
        farthest = torch.maximum(grid.q_last - grid.kv_first, grid.kv_last - grid.q_first)
        return codes_from(nearest < size, farthest < size)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = SlidingWindowMod(self._captured(device), self.per_row)
        return Lowered(mod, mod)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        size = self._at_rows(row, grid)  # clamped to the sequence: no overflow below
        # A window of 0 attends nothing: the explicit empty interval [1, 0], not
        # [q + 1, q - 1], whose lo > q would break the closed form's lo(q) <= q.
        some = size > 0
        lo = torch.where(some, q_idx - size + 1, 1)
        hi = torch.where(some, q_idx + size - 1, 0)
        return Intervals(lo, hi)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        size = self._line_values()  # symmetric: the same both ways
        some = size > 0
        return one_interval(
            torch.where(some, pos - size + 1, INF), torch.where(some, pos + size - 1, -INF)
        )

    def line_breaks(self, *, transpose: bool) -> Tensor:
        return torch.zeros(1, 0, dtype=torch.int64)  # each row's one band, on every line

    def interval_form(self) -> Formula:
        # q - size < kv_idx < q + size; a size of 0 gives q + 1 <= kv < q: nothing.
        lo, hi = ValueBound(self, "q-value+1"), ValueBound(self, "q+value")
        return Join(True, (Atom(False, lo), Atom(True, hi)))

    def varlen_part(self, length: int) -> VarlenPart:
        return VarlenPart(window=self.values.clamp(max=INF))


class SlidingWindowMod(PieceMod):
    """sliding_window's mask_mod: ``|q_idx - kv_idx| < size[b]``."""

    __slots__ = ("size",)
    _name = "sliding_window"

    def __init__(self, size: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.size = size

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() < self._value(self.size, b)


def sliding_window(size: Any, positions: Any = None) -> SlidingWindow | PositionWindow:
    """Local attention within ``size`` positions on either side: ``|q_idx - kv_idx| < size``.

    Combine with ``causal()`` for causal local attention. With ``positions``, distance is
    measured in them, ``|positions[q_idx] - positions[kv_idx]| < size``: in a packed
    shared-prefix tree a response's tokens sit after its siblings', far from its prompt in
    packed positions but not in its own sequence, so a model's local layers take the tree's
    depths (``pack_trees``' ``position_ids``): ``tree(parents) & sliding_window(w,
    positions=position_ids)`` attends the ancestors less than ``w`` levels up.

    Args:
        size: window size >= 0, one int for every row or a list with one per batch row.
            0 attends nothing; a window at least the sequence length is full attention
            (any size up to ``2**63 - 1``, e.g. ``sys.maxsize`` for "no window"): clipped to
            the sequence, as every piece's lengths are (docs/algebra.md).
        positions: None (packed positions), or every token's position: ints in
            ``[0, 2**62)``, one sequence for every row or one per batch row (a ``(B, n)``
            tensor), at least as many as the sequence is long.

    Raises:
        ValueError: a negative size, or one that does not fit in int64; positions out of
            range, rows of different lengths, or (at a build) fewer than the sequence.
        TypeError: a size or a position that is not an integer.

    Example:
        >>> import flexmask
        >>> print((flexmask.causal() & flexmask.sliding_window(2)).show(4))
        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ⬚ ■ ■ ⬚
        ⬚ ⬚ ■ ■
    """
    if positions is not None:
        return PositionWindow(size, positions)
    return SlidingWindow(size, "size")
