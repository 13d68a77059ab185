"""The two constant masks: attend everywhere, attend nowhere."""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.algebra import (
    INF,
    Atom,
    ConstBound,
    Formula,
    Intervals,
    LineIntervals,
    Lowered,
    TileGrid,
    VarlenPart,
    Window,
    one_interval,
)
from flexmask.blocks import EMPTY, FULL, constant_codes
from flexmask.pieces._base import Piece, PieceMod


class Full(Piece):
    """Every query attends every key.

    ::

        ■ ■ ■
        ■ ■ ■
        ■ ■ ■
    """

    __slots__ = ()
    interval_shape = "diagonal"

    def __init__(self) -> None:
        super().__init__(("full",))

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        return constant_codes(FULL, grid.device)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = FullMod()
        return Lowered(mod, mod)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        lo = torch.zeros_like(q_idx)
        return Intervals(lo, lo + grid.kv_end)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        return one_interval(torch.full_like(pos, -INF), torch.full_like(pos, INF))

    def line_breaks(self, *, transpose: bool) -> Tensor:
        return torch.zeros(1, 0, dtype=torch.int64)  # the same on every line

    def varlen_part(self, length: int) -> VarlenPart:
        return VarlenPart()  # no constraint

    def interval_form(self) -> Formula:
        # kv_idx >= 0, never a constant True: inductor reads a mask_mod that returns a
        # constant as no mask at all, and FLASH then ignored the block lists (pytorch
        # #188322) — a BlockMask over lengths that are no block multiple, or a window,
        # carries structure that a no-op would drop.
        return Atom(False, ConstBound(0))

    def __repr__(self) -> str:
        return "full()"


class Empty(Piece):
    """No query attends any key (every output row is zero).

    ::

        ⬚ ⬚ ⬚
        ⬚ ⬚ ⬚
        ⬚ ⬚ ⬚
    """

    __slots__ = ()
    interval_shape = "monotone"

    def __init__(self) -> None:
        super().__init__(("empty",))

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        return constant_codes(EMPTY, grid.device)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = EmptyMod()
        return Lowered(mod, mod)

    def attends_nowhere(self) -> bool:
        return True

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        hi = torch.zeros_like(q_idx)
        return Intervals(hi + 1, hi)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        return one_interval(torch.full_like(pos, INF), torch.full_like(pos, -INF))

    def line_breaks(self, *, transpose: bool) -> Tensor:
        return torch.zeros(1, 0, dtype=torch.int64)  # the same on every line

    def varlen_part(self, length: int) -> VarlenPart:
        return VarlenPart(attends_nowhere=True)

    def interval_form(self) -> Formula:
        return Atom(True, ConstBound(0))  # kv_idx < 0: one (empty) interval

    def __repr__(self) -> str:
        return "empty()"


class FullMod(PieceMod):
    """full's mask_mod: true at every (in-range) index."""

    __slots__ = ()
    _name = "full"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= 0) & (kv_idx >= 0)


class EmptyMod(PieceMod):
    """empty's mask_mod: false everywhere."""

    __slots__ = ()
    _name = "empty"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx < 0) & (kv_idx < 0)


def full() -> Full:
    """Attend everywhere (bidirectional attention); the identity of ``&``.

    Example:
        >>> import flexmask
        >>> print(flexmask.full().show(2))
        ■ ■
        ■ ■
        >>> (flexmask.full() & flexmask.causal()).to_dense(1, 1, 3, 3).equal(
        ...     flexmask.causal().to_dense(1, 1, 3, 3))
        True
    """
    return Full()


def empty() -> Empty:
    """Attend nowhere; the identity of ``|``.

    Example:
        >>> import flexmask
        >>> print(flexmask.empty().show(2))
        ⬚ ⬚
        ⬚ ⬚
    """
    return Empty()
