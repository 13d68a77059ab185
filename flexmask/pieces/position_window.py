"""A sliding window measured in given positions: a tree's depths, a packed batch's position ids.

``sliding_window(size)`` measures distance in packed positions. Where tokens that are
neighbours in their own sequence sit far apart in the packed one — the responses of a
shared-prefix tree, each after its siblings — a model's local layers measure what its
positional encoding measures: ``sliding_window(size, positions=position_ids)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask._validate import digest, int_vector, is_nested, scalar_or_rows, source_device
from flexmask.algebra import Extent, Lowered, TileGrid, Window
from flexmask.blocks import CODE_DTYPE, EMPTY, FULL, PARTIAL, UNDECIDED
from flexmask.pieces._base import Piece, PieceMod

# Positions stay below this so that a difference of two never nears int64's edge.
MAX_POSITION = 2**62


class PositionWindow(Piece):
    """``|positions[q_idx] - positions[kv_idx]| < size``.

    ::

        positions=[0, 1, 2, 1, 2], size=2 (a prompt token, then two answers of two tokens)
                 ■ ■ ⬚ ■ ⬚
                 ■ ■ ■ ■ ■
                 ⬚ ■ ■ ■ ■
                 ■ ■ ■ ■ ■
                 ⬚ ■ ■ ■ ■
    """

    __slots__ = ("sizes", "positions", "per_row", "_given_per_row")
    _arg = "positions"

    @property
    def carries_batch_data(self) -> bool:
        return True

    def __init__(self, size: Any, positions: Any) -> None:
        sizes, sizes_per_row = scalar_or_rows(size, "size", minimum=0)
        table, positions_per_row = _positions(positions)
        given = ((sizes.numel(), sizes_per_row), (table.shape[0], positions_per_row))
        rows = {n for n, per_row in given if per_row}
        if len(rows) > 1:
            raise ValueError(
                f"size is given for {sizes.numel()} batch rows and positions for "
                f"{table.shape[0]}: give both for the same rows, or one of them for all rows"
            )
        self.per_row = bool(rows)
        self._given_per_row = (sizes_per_row, positions_per_row)
        self.sizes = sizes
        self.positions = table
        size_key = tuple(sizes.tolist()) if sizes_per_row else int(sizes[0])
        super().__init__(
            ("sliding_window_positions", size_key, tuple(table.shape), digest(table)),
            rows=rows.pop() if rows else None,
            device=source_device(positions),
            natural=table.shape[-1],
        )

    def check(self, extent: Extent) -> None:
        super().check(extent)
        if self.natural_length < extent.length:
            raise ValueError(
                f"positions holds {self.natural_length} positions per row, fewer than the "
                f"sequence length {extent.length_name}={extent.length}: give one position for "
                f"every token (a packed batch's position_ids)"
            )

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        # The positions cover every token (``check``): a window reads them where it lies.
        table = self._on("positions", device)
        if table.shape[-1] < length:  # past the last token: the kernel never reads these
            table = torch.nn.functional.pad(table, (0, length - table.shape[-1]))
        sizes = self._on("sizes", device)
        if self.per_row:
            rows = max(table.shape[0], sizes.numel())
            mod = PositionWindowMod(table.expand(rows, -1), sizes.expand(rows), True)
        else:
            mod = PositionWindowMod(table[0], sizes[0], False)
        return Lowered(mod, mod)

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        # Each tile's least and greatest position per side. A tile is full when the
        # farthest pair is within the window, empty when the nearest possible one is not;
        # in between it holds an attending pair for sure only where both sides' positions
        # leave no integer out (then the nearest values are both there): else undecided,
        # and the build evaluates the tile.
        q_lo, q_hi, q_whole = self._tile_extremes(grid.q_first, grid.q_last, grid.q_block, grid)
        kv_lo, kv_hi, kv_whole = self._tile_extremes(
            grid.kv_first.transpose(-1, -2), grid.kv_last.transpose(-1, -2), grid.kv_block, grid
        )
        kv_lo, kv_hi, kv_whole = (t.transpose(-1, -2) for t in (kv_lo, kv_hi, kv_whole))
        size = self._on("sizes", grid.device).view(-1, 1, 1, 1)
        zero = torch.zeros((), dtype=torch.int64, device=grid.device)
        nearest = torch.maximum(torch.maximum(kv_lo - q_hi, q_lo - kv_hi), zero)
        farthest = torch.maximum(q_hi - kv_lo, kv_hi - q_lo)
        shape = torch.broadcast_shapes(nearest.shape, size.shape)
        codes = torch.full(shape, UNDECIDED, dtype=CODE_DTYPE, device=grid.device)
        codes.masked_fill_(q_whole & kv_whole, PARTIAL)
        codes.masked_fill_(farthest < size, FULL)
        codes.masked_fill_(nearest >= size, EMPTY)
        return codes

    def _tile_extremes(
        self, first: Tensor, last: Tensor, block: int, grid: TileGrid
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per tile ``[first, last]`` (``(1 | B, 1, n, 1)`` whole-mask positions): its least
        and greatest position and whether its positions skip no integer between them — read
        as a walk in token order whose every step is at most 1 (a sufficient test)."""
        table = self._on("positions", grid.device)
        rows = max(table.shape[0], first.shape[0])
        steps = torch.arange(block, device=grid.device)
        index = torch.minimum(first + steps, last)  # (r, 1, n, block): repeats past the end
        index = index.expand(rows, *index.shape[1:]).flatten(1)
        values = table.expand(rows, -1).gather(1, index).view(rows, 1, -1, block)
        whole = (values.diff(dim=-1).abs() <= 1).all(-1, keepdim=True)
        return values.amin(-1, keepdim=True), values.amax(-1, keepdim=True), whole

    def __repr__(self) -> str:
        sizes_per_row, positions_per_row = self._given_per_row
        size = self.sizes.tolist() if sizes_per_row else int(self.sizes[0])
        rows, n = self.positions.shape
        shape = f"{rows} x {n}" if positions_per_row else f"{n}"
        return f"sliding_window({size}, positions=<{shape} positions {self.key[-1][:8]}>)"


class PositionWindowMod(PieceMod):
    """The mask_mod: ``|positions[b, q_idx] - positions[b, kv_idx]| < size[b]``."""

    __slots__ = ("positions", "size")
    _name = "sliding_window_positions"

    def __init__(self, positions: Tensor, size: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.positions = positions
        self.size = size

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        apart = self._lookup(self.positions, b, q_idx) - self._lookup(self.positions, b, kv_idx)
        return apart.abs() < self._value(self.size, b)


def _positions(positions: Any) -> tuple[Tensor, bool]:
    """``(R, n)`` int64 positions (R = 1 shared) and whether they were given per row."""
    if isinstance(positions, Tensor) and positions.dim() == 2:
        rows = [int_vector(row, f"positions[{i}]") for i, row in enumerate(positions.unbind(0))]
        per_row = True
    elif is_nested(positions):
        rows = [int_vector(row, f"positions[{i}]") for i, row in enumerate(positions)]
        per_row = True
    else:
        rows = [int_vector(positions, "positions")]
        per_row = False
    if not rows:
        raise ValueError("positions must hold at least one batch row, got none")
    lengths = {row.numel() for row in rows}
    if len(lengths) > 1:
        raise ValueError(
            f"positions must give every batch row the same number of positions, got "
            f"{sorted(lengths)}: one position per token of the padded batch"
        )
    if 0 in lengths:
        raise ValueError("positions must hold at least one position per row, got an empty row")
    table = torch.stack(rows)
    low, high = int(table.min()), int(table.max())
    if low < 0 or high >= MAX_POSITION:
        name = "positions" if not per_row else "positions[...]"
        bad = low if low < 0 else high
        raise ValueError(f"{name} must lie in [0, 2**62), got {bad}")
    return table, per_row
