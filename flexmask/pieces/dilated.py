"""Dilated attention: a query attends the keys a multiple of ``dilation`` away."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask.algebra import (
    INF,
    LineIntervals,
    Lowered,
    TileGrid,
    VarlenPart,
    Window,
    cannot_lower,
    one_interval,
)
from flexmask.blocks import codes_from
from flexmask.pieces._base import PieceMod
from flexmask.pieces._rowvalue import RowValuePiece


class Dilated(RowValuePiece):
    """``(q_idx - kv_idx) % dilation == 0``.

    ::

        dilation=2:  ■ ⬚ ■ ⬚
                     ⬚ ■ ⬚ ■
                     ■ ⬚ ■ ⬚
                     ⬚ ■ ⬚ ■
    """

    __slots__ = ()
    _arg = "dilation"
    _kind = "dilated"

    def __init__(self, dilation: Any) -> None:
        super().__init__(dilation, "dilation", minimum=1)

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        # A block's differences q - kv are every integer of [lo, hi] (both sides are runs of
        # positions): it attends somewhere iff a multiple of d lies in that range, everywhere
        # iff every integer there is one — d == 1, or a single difference (a 1 x 1 block).
        # Arithmetic on the bounds, no token evaluated. Positions are >= 0, so lo and hi fit
        # in int64; the next multiple is found from lo's remainder, never lo + d.
        d = self._row_values(grid)
        lo = grid.q_first - grid.kv_last
        hi = grid.q_last - grid.kv_first
        to_next = torch.remainder(d - torch.remainder(lo, d), d)  # lo + to_next: a multiple
        nonempty = to_next <= hi - lo
        full = nonempty & ((d == 1) | (lo == hi))
        return codes_from(nonempty, full)

    settles_every_tile = True  # every code above is exact: no tile left to refine

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = DilatedMod(self._captured(device), self.per_row)
        return Lowered(mod, mod)

    # ------------------------------------------------------------------ lowerings (formats)
    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        if bool((self.values == 1).all()):  # no dilation: every key, one interval
            return one_interval(torch.full_like(pos, -INF), torch.full_like(pos, INF))
        # A query's keys are every d-th position: as many intervals as the sequence has
        # keys / d, which no interval format holds in few slots. The mask_mod is kept.
        raise cannot_lower(
            self,
            fmt,
            "a dilated query attends every d-th key, one interval each (no format's few "
            "intervals per line hold them); use flexmask.create_block_mask (flex_attention)",
        )

    def line_breaks(self, *, transpose: bool) -> Tensor:
        return torch.zeros(1, 0, dtype=torch.int64)  # only reached with dilation 1: full

    def varlen_part(self, length: int) -> VarlenPart:
        if bool((self.values == 1).all()):
            return VarlenPart()  # dilation 1 constrains nothing
        raise cannot_lower(
            self,
            "varlen",
            "every d-th key is neither a varlen kernel's rule nor a partition into sequences; "
            "use flexmask.create_block_mask (flex_attention)",
        )


class DilatedMod(PieceMod):
    """dilated's mask_mod: ``(q_idx - kv_idx) % dilation[b] == 0``."""

    __slots__ = ("dilation",)
    _name = "dilated"

    def __init__(self, dilation: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.dilation = dilation

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.remainder(q_idx - kv_idx, self._value(self.dilation, b)) == 0


def dilated(dilation: Any) -> Dilated:
    """Dilated attention: a query attends the keys a multiple of ``dilation`` positions
    away, ``(q_idx - kv_idx) % dilation == 0``.

    ``sliding_window(w + 1) & dilated(d)`` is attn-gym's
    ``generate_dilated_sliding_window(w, d)`` (every d-th key within w positions). The build
    decides every block from arithmetic on its bounds, with no element evaluated. A query
    attends one interval per d-th key, so the interval formats (``to_flashmask``,
    ``to_magi``, ``to_varlen``) refuse it, naming it, unless ``dilation`` is 1.

    Args:
        dilation: the step >= 1, one int for every row or a list with one per batch row. 1
            attends every key; one at least the sequence length attends only the diagonal.

    Raises:
        ValueError: a dilation below 1, or one that does not fit in int64, naming
            ``dilation``.
        TypeError: a dilation that is not an integer.

    Example:
        >>> import flexmask
        >>> from flexmask.pieces import dilated
        >>> print((flexmask.sliding_window(4) & dilated(2)).show(5))
        ■ ⬚ ■ ⬚ ⬚
        ⬚ ■ ⬚ ■ ⬚
        ■ ⬚ ■ ⬚ ■
        ⬚ ■ ⬚ ■ ⬚
        ⬚ ⬚ ■ ⬚ ■
    """
    return Dilated(dilation)
