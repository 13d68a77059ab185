"""Padding: each batch row has ``lengths[b]`` real tokens followed by padding."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask.algebra import (
    INF,
    Atom,
    Formula,
    Intervals,
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


class Padding(RowValuePiece):
    """``q_idx < lengths[b] and kv_idx < lengths[b]``.

    ::

        length=3: ■ ■ ■ ⬚
                  ■ ■ ■ ⬚
                  ■ ■ ■ ⬚
                  ⬚ ⬚ ⬚ ⬚
    """

    __slots__ = ()
    interval_shape = "monotone"

    @property
    def carries_batch_data(self) -> bool:
        return True

    _arg = "lengths"
    _kind = "padding"
    # docs/algebra.md "Lengths past the sequence": a length equal to the sequence is no
    # padding at all; one past it was counted for other rows and raises unless truncated.

    @property
    def data_reach(self) -> int:
        return int(self.values.max())

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        length = self._row_values(grid)
        nonempty = (grid.q_first < length) & (grid.kv_first < length)
        full = (grid.q_last < length) & (grid.kv_last < length)
        return codes_from(nonempty, full)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = PaddingMod(self._captured(device), self.per_row)
        return Lowered(mod, mod)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        row_len = self._at_rows(row, grid)
        inside = q_idx < row_len
        # Padding queries attend nothing: the empty interval [1, 0].
        lo = torch.where(inside, 0, 1)
        hi = torch.where(inside, row_len - 1, 0)
        return Intervals(lo, hi)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        size = self._line_values()
        inside = pos < size  # the same both ways: real tokens attend real tokens
        return one_interval(torch.where(inside, -INF, INF), torch.where(inside, size - 1, -INF))

    def line_breaks(self, *, transpose: bool) -> Tensor:
        return self._line_values()  # real tokens attend the real ones, padding nothing

    def interval_form(self) -> Formula:
        # kv_idx < length where q_idx < length, else below 0 (a padded query attends nothing).
        return Atom(True, ValueBound(self, "below_value"))

    def varlen_part(self, length: int) -> VarlenPart:
        # One sequence per row: its real tokens (part 0), padding in none.
        pos = torch.arange(length + 1)
        return VarlenPart(segment_ids=[torch.where(pos < s, 0, -1) for s in self._line_values()])


class PaddingMod(PieceMod):
    """padding's mask_mod: ``q_idx < lengths[b] and kv_idx < lengths[b]``."""

    __slots__ = ("lengths",)
    _name = "padding"

    def __init__(self, lengths: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.lengths = lengths

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        row_len = self._value(self.lengths, b)
        return (q_idx < row_len) & (kv_idx < row_len)


def padding(lengths: Any, *, truncate: bool = False) -> Padding:
    """Mask out padding: tokens at or after ``lengths[b]`` neither attend nor are attended.

    Args:
        lengths: real length of each batch row, or one int for every row, >= 0: 0 is a
            fully padded row, which attends nothing; the sequence's length is a row without
            padding. A length past the sequence raises where the mask is used, unless
            ``truncate``.
        truncate: read a length past the sequence as the sequence (no padding in that row;
            docs/algebra.md), up to ``2**63 - 1``.

    Raises:
        ValueError: a negative length or one that does not fit in int64, naming ``lengths``.
        TypeError: a length that is not an integer.

    Example:
        >>> import flexmask
        >>> print((flexmask.causal() & flexmask.padding([3, 2])).show(4, batch=1))
        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ⬚ ⬚ ⬚ ⬚
        ⬚ ⬚ ⬚ ⬚
    """
    return Padding(lengths, "lengths", truncate=truncate)
