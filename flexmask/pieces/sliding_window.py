"""Sliding-window (local) attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask.blocks import BlockGrid, codes_from
from flexmask.mask import Intervals, Lowered
from flexmask.pieces._base import PieceMod
from flexmask.pieces._rowvalue import RowValuePiece


class SlidingWindow(RowValuePiece):
    """``|q_idx - kv_idx| < size``.

    ::

        size=2:  ■ ■ ⬚ ⬚
                 ■ ■ ■ ⬚
                 ⬚ ■ ■ ■
                 ⬚ ⬚ ■ ■
    """

    __slots__ = ()
    _interval_shape = "monotone"
    _arg = "size"
    _kind = "sliding_window"
    _limit_by_length = False  # a window wider than the sequence is just full attention

    def _classify(self, grid: BlockGrid) -> Tensor:
        size = self._row_values(grid)
        zero = torch.zeros((), dtype=torch.int64, device=grid.device)
        nearest = torch.maximum(
            torch.maximum(grid.kv_first - grid.q_last, grid.q_first - grid.kv_last), zero
        )
        farthest = torch.maximum(grid.q_last - grid.kv_first, grid.kv_last - grid.q_first)
        return codes_from(nearest < size, farthest < size)

    def _lower(self, length: int, device: torch.device) -> Lowered:
        mod = SlidingWindowMod(self._captured(device), self.per_row)
        return Lowered(mod, mod)

    def _intervals(self, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> Intervals:
        size = self._at_rows(row, grid)
        return Intervals(q_idx - size + 1, q_idx + size - 1)


class SlidingWindowMod(PieceMod):
    """sliding_window's mask_mod: ``|q_idx - kv_idx| < size[b]``."""

    __slots__ = ("size",)
    _name = "sliding_window"

    def __init__(self, size: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.size = size

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() < self._value(self.size, b)


def sliding_window(size: Any) -> SlidingWindow:
    """Local attention within ``size`` positions on either side: ``|q_idx - kv_idx| < size``.

    Combine with ``causal()`` for causal local attention.

    Args:
        size: window size >= 1, one int for every row or a list with one per batch row.

    Example:
        >>> import flexmask
        >>> print((flexmask.causal() & flexmask.sliding_window(2)).show(4))
        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ⬚ ■ ■ ⬚
        ⬚ ⬚ ■ ■
    """
    return SlidingWindow(size, "size")
