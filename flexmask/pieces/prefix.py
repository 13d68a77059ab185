"""A bidirectional prefix: every query sees the first ``length`` keys."""

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
    cannot_lower,
    one_interval,
)
from flexmask.blocks import codes_from
from flexmask.pieces._base import PieceMod
from flexmask.pieces._rowvalue import RowValuePiece


class Prefix(RowValuePiece):
    """``kv_idx < length[b]``.

    ::

        length=2: ■ ■ ⬚ ⬚
                  ■ ■ ⬚ ⬚
                  ■ ■ ⬚ ⬚
                  ■ ■ ⬚ ⬚
    """

    __slots__ = ()
    interval_shape = "from_zero"
    _arg = "length"
    _kind = "prefix"

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        length = self._row_values(grid)
        return codes_from(grid.kv_first < length, grid.kv_last < length)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = PrefixMod(self._captured(device), self.per_row)
        return Lowered(mod, mod)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        # [0, length - 1]: for length 0 the empty [0, -1], still starting at key 0, so a
        # union with causal or full stays exact (causal() | prefix(0) is causal).
        hi = (self._at_rows(row, grid) - 1).expand_as(q_idx)
        return Intervals(torch.zeros_like(q_idx), hi)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        size = self._line_values()
        if transpose:  # a key in the prefix is attended by every query, the others by none
            inside = pos < size
            return one_interval(torch.where(inside, -INF, INF), torch.where(inside, INF, -INF))
        return one_interval(torch.full_like(pos, -INF), size - 1)

    def line_breaks(self, *, transpose: bool) -> Tensor:
        # Every query attends the prefix; transposed, the keys past it are attended by none.
        if transpose:
            return self._line_values()
        return torch.zeros(1, 0, dtype=torch.int64)

    def interval_form(self) -> Formula:
        return Atom(True, ValueBound(self, "value"))  # kv_idx < length[b]

    def varlen_part(self, length: int) -> VarlenPart:
        raise cannot_lower(
            self,
            "varlen",
            "a prefix is visible to queries outside its block, which a varlen kernel's "
            "one-block-per-sequence layout cannot express (use to_flashmask or to_magi)",
        )


class PrefixMod(PieceMod):
    """prefix's mask_mod: ``kv_idx < length[b]``."""

    __slots__ = ("length",)
    _name = "prefix"

    def __init__(self, length: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.length = length

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < self._value(self.length, b)


def prefix(length: Any) -> Prefix:
    """Keys before ``length`` are visible to every query: ``kv_idx < length[b]``.

    ``causal() | prefix(n)`` is a prefix-LM: bidirectional over the first n tokens, causal after.

    Args:
        length: prefix length >= 0, one int or one per batch row. 0 attends nothing
            (``causal() | prefix(0)`` is causal); a prefix at least the sequence length
            covers every key (full attention), up to ``2**63 - 1``: clipped to the sequence,
            as every piece's lengths are (docs/algebra.md).

    Raises:
        ValueError: a negative length, or one that does not fit in int64.
        TypeError: a length that is not an integer.

    Example:
        >>> import flexmask
        >>> print((flexmask.causal() | flexmask.prefix(2)).show(4))
        ■ ■ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ■ ■ ■ ⬚
        ■ ■ ■ ■
    """
    return Prefix(length, "length")
