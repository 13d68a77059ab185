"""Causal attention: a query attends to itself and every earlier key."""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.algebra import (
    INF,
    Atom,
    Formula,
    Intervals,
    LineIntervals,
    Lowered,
    QBound,
    TileGrid,
    VarlenPart,
    Window,
    one_interval,
)
from flexmask.blocks import codes_from
from flexmask.pieces._base import Piece, PieceMod


class Causal(Piece):
    """``kv_idx <= q_idx``.

    ::

        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ■ ■ ■ ⬚
        ■ ■ ■ ■
    """

    __slots__ = ()
    interval_shape = "diagonal"

    def __init__(self) -> None:
        super().__init__(("causal",))

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        return codes_from(grid.kv_first <= grid.q_last, grid.kv_last <= grid.q_first)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = CausalMod()
        return Lowered(mod, mod)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        return Intervals(torch.zeros_like(q_idx), q_idx)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        if transpose:  # key kv is attended by queries q >= kv
            return one_interval(pos, torch.full_like(pos, INF))
        return one_interval(torch.full_like(pos, -INF), pos)

    def line_breaks(self, *, transpose: bool) -> Tensor:
        return torch.zeros(1, 0, dtype=torch.int64)  # the same rule on every line

    def varlen_part(self, length: int) -> VarlenPart:
        return VarlenPart(causal=True)

    def interval_form(self) -> Formula:
        return Atom(True, QBound(1))  # kv_idx < q_idx + 1: arithmetic on q, no table

    def __repr__(self) -> str:
        return "causal()"


class CausalMod(PieceMod):
    """causal's mask_mod: ``q_idx >= kv_idx``."""

    __slots__ = ()
    _name = "causal"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx >= kv_idx


def causal() -> Causal:
    """Causal attention: ``kv_idx <= q_idx`` (absolute positions from 0).

    Returns:
        The causal mask, a value: ``causal() == causal()``.

    Example:
        >>> import flexmask
        >>> print(flexmask.causal().show(4))
        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ■ ■ ■ ⬚
        ■ ■ ■ ■
    """
    return Causal()
