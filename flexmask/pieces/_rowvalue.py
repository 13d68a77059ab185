"""Pieces parametrised by one integer per batch row (or one for all rows)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask._validate import scalar_or_rows, source_device
from flexmask.algebra import INF, TileGrid
from flexmask.pieces._base import Piece, per_row_view


class RowValuePiece(Piece):
    """Holds ``values``: int64 of shape (R,) with ``per_row``, else shape (1,).

    Values are ints >= 0 (0 is well defined for every such piece: it attends nothing, or
    nothing beyond another piece) that fit in int64. A value past the sequence means "the
    whole sequence" (docs/algebra.md, "Lengths past the sequence") and is clamped to it
    wherever arithmetic is done on it.
    """

    __slots__ = ("values", "per_row")
    _kind = ""

    def __init__(self, value: Any, name: str, minimum: int = 0, truncate: bool = False) -> None:
        values, per_row = scalar_or_rows(value, name, minimum=minimum)
        self.values = values
        self.per_row = per_row
        key_data = tuple(values.tolist()) if per_row else int(values[0])
        super().__init__(
            (self._kind, key_data),
            rows=values.numel() if per_row else None,
            device=source_device(value),
            natural=0,  # a value past the sequence is clipped, never a length to build at
            truncate=truncate,
        )

    @property
    def carries_batch_data(self) -> bool:
        return self.per_row  # one value per row describes this batch; one for all is static

    def _row_values(self, grid: TileGrid) -> Tensor:
        """(R, 1, 1, 1) values on the grid's device, for block classification."""
        return per_row_view(self._on("values", grid.device), self.per_row)

    def _at_rows(self, row: Tensor, grid: TileGrid) -> Tensor:
        """(k, 1) values for the given (k, 1) batch rows, clamped to the sequence length.

        A value >= ``grid.length`` already covers every position (no distance or index in
        the grid reaches it), so the clamp changes no mask; it keeps interval arithmetic such
        as ``q_idx - size + 1`` far from int64 overflow for sizes up to ``2**63 - 1``.
        """
        values = self._on("values", grid.device).clamp(max=grid.length)
        return values[row] if self.per_row else values[0].expand_as(row)

    def interval_value(self, length: int, device: torch.device) -> Tensor:
        """What its interval form reads (``ValueBound``): ``(R,)`` int32, clamped to the
        length (no bound near int32's edge; a value past the sequence is the sequence)."""
        return self._on("values", device).clamp(max=length).to(torch.int32)

    def _line_values(self) -> Tensor:
        """(R, 1) values for a lowering's lines (``lines_at``), clamped to ``INF``: far below
        int64's edge, past every position a lowering reads."""
        return self.values.clamp(max=INF).view(-1, 1)

    def _captured(self, device: torch.device) -> Tensor:
        """What the mask_mod captures: 0-d (shared) or (R,) (per row); never a Python int,
        so new values of the same shape do not recompile."""
        values = self._on("values", device)
        return values if self.per_row else values[0]

    def __repr__(self) -> str:
        data = self.values.tolist() if self.per_row else int(self.values[0])
        return f"{self._kind}({data})"
