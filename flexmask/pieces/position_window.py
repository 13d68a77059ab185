"""A sliding window measured in given positions: a tree's depths, a packed batch's position ids.

``sliding_window(size)`` measures distance in packed positions. Where tokens that are
neighbours in their own sequence sit far apart in the packed one — the responses of a
shared-prefix tree, each after its siblings — a model's local layers measure what its
positional encoding measures: ``sliding_window(size, positions=position_ids)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from flexmask._validate import digest, int_vector, is_nested, scalar_or_rows, source_device
from flexmask.algebra import Extent, Lowered, TileGrid, Window
from flexmask.blocks import CODE_DTYPE, EMPTY, PARTIAL, UNDECIDED, codes_from
from flexmask.pieces._base import Piece, PieceMod

# Positions stay below this so that a difference of two never nears int64's edge.
MAX_POSITION = 2**62
# Runs per tile read exactly (``classify_tiles``): a tree's depths in preorder change run
# only where a branch ends, once or twice in a block of most trees.
RUNS = 3


class _Runs(NamedTuple):
    lo: Tensor
    """``(r, n)`` each tile's least position."""
    hi: Tensor
    """``(r, n)`` its greatest."""
    runs_lo: Tensor
    """``(r, n, RUNS)`` each run's least position (the first run's again where it has fewer)."""
    runs_hi: Tensor
    """``(r, n, RUNS)`` each run's greatest, likewise."""
    known: Tensor
    """``(r, n)`` whether the tile has at most RUNS runs (else the last ones are merged)."""
    one_run: Tensor
    """``(r, n)`` whether it is one run (its range is then its positions, all of them)."""


class PositionWindow(Piece):
    """``|positions[q_idx] - positions[kv_idx]| < size``; with ``keys_ahead``,
    ``positions[q_idx] - positions[kv_idx] < size`` (keys at later positions attend whatever
    their distance: transformers' one-sided ``sliding_window_overlay``).

    ::

        positions=[0, 1, 2, 1, 2], size=2 (a prompt token, then two answers of two tokens)
                 ■ ■ ⬚ ■ ⬚
                 ■ ■ ■ ■ ■
                 ⬚ ■ ■ ■ ■
                 ■ ■ ■ ■ ■
                 ⬚ ■ ■ ■ ■
    """

    __slots__ = ("sizes", "positions", "per_row", "keys_ahead", "_given_per_row")
    _arg = "positions"

    @property
    def carries_batch_data(self) -> bool:
        return True

    def __init__(self, size: Any, positions: Any, *, keys_ahead: bool = False) -> None:
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
        self.keys_ahead = bool(keys_ahead)
        size_key = tuple(sizes.tolist()) if sizes_per_row else int(sizes[0])
        super().__init__(
            (
                "sliding_window_positions",
                size_key,
                self.keys_ahead,
                tuple(table.shape),
                digest(table),
            ),
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
        sizes = self._on("sizes", device).clamp(max=MAX_POSITION)  # the same mask: see the mod
        if self.per_row:
            rows = max(table.shape[0], sizes.numel())
            mod = PositionWindowMod(
                table.expand(rows, -1), sizes.expand(rows), True, self.keys_ahead
            )
        else:
            mod = PositionWindowMod(table[0], sizes[0], False, self.keys_ahead)
        return Lowered(mod, mod)

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        # Each tile's positions, per side, as a few runs in token order whose steps are at
        # most 1: each run holds every integer between its least and greatest, so the
        # nearest pair of two tiles is the nearest pair of their runs' ranges. A tile is
        # full when its farthest pair is within the window, empty when even its ranges'
        # nearest is not; in between it is read from the runs (exact where each side has at
        # most RUNS of them, else undecided: the build evaluates it).
        # One-sided, the tiles' extremes say it all (below): no runs read.
        runs = not self.keys_ahead
        q = self._tile_runs(grid.q_first, grid.q_last, grid.q_block, grid, runs)
        kv = self._tile_runs(
            grid.kv_first.transpose(-1, -2),
            grid.kv_last.transpose(-1, -2),
            grid.kv_block,
            grid,
            runs,
        )
        # As comparisons of each key tile's bounds with bounds around the query tile's,
        # made per tile: the passes over every pair of tiles write bools, not differences.
        # Sizes are held below 2**62, as positions are: no bound wraps.
        size = self._on("sizes", grid.device).clamp(max=MAX_POSITION).view(-1, 1)
        kv_lo, kv_hi = kv.lo.unsqueeze(-2), kv.hi.unsqueeze(-2)  # (r, 1, nkv)
        reach_hi = (q.hi + size).unsqueeze(-1)  # (r, nq, 1): keys below it may attend
        reach_lo = (q.lo - size).unsqueeze(-1)  # keys above it may attend
        some = kv_hi > reach_lo
        full = kv_lo > (q.hi - size).unsqueeze(-1)
        if self.keys_ahead:
            # One-sided, a tile attends somewhere iff its least query position less its
            # greatest key position is below the size: its ranges say it exactly.
            return codes_from(some, full).unsqueeze(1)
        some &= (kv_lo < reach_hi) & (size > 0).unsqueeze(-1)  # nor keys too far ahead
        full &= kv_hi < (q.lo + size).unsqueeze(-1)
        codes = codes_from(some, full)
        # Partial as its ranges say where both tiles are one run each (most tiles); the
        # others' runs are read pair by pair.
        one_run = q.one_run.unsqueeze(-1) & kv.one_run.unsqueeze(-2)
        between = (some & ~full & ~one_run).nonzero()
        if between.numel():
            row, qi, ki = between.unbind(1)
            q_row, kv_row = (
                row.clamp(max=q.runs_lo.shape[0] - 1),
                row.clamp(max=kv.runs_lo.shape[0] - 1),
            )
            a_lo, a_hi = q.runs_lo[q_row, qi].unsqueeze(-1), q.runs_hi[q_row, qi].unsqueeze(-1)
            b_lo, b_hi = kv.runs_lo[kv_row, ki].unsqueeze(-2), kv.runs_hi[kv_row, ki].unsqueeze(-2)
            gaps = torch.maximum(b_lo - a_hi, a_lo - b_hi).clamp_(min=0).flatten(1).amin(1)
            size_at = size.view(-1)[row.clamp(max=size.numel() - 1)]
            known = q.known[q_row, qi] & kv.known[kv_row, ki]
            settled = torch.where(gaps < size_at, PARTIAL, EMPTY).to(CODE_DTYPE)
            codes[row, qi, ki] = torch.where(known, settled, UNDECIDED).to(CODE_DTYPE)
        return codes.unsqueeze(1)

    def _tile_runs(
        self, first: Tensor, last: Tensor, block: int, grid: TileGrid, runs: bool
    ) -> _Runs:
        """The runs of each tile ``[first, last]`` (``(1 | B, 1, n, 1)`` whole-mask
        positions): maximal stretches of tokens whose positions step by at most 1. Without
        ``runs``, its extremes only (the run fields are the extremes again, none known)."""
        table = self._on("positions", grid.device)
        rows = max(table.shape[0], first.shape[0])
        steps = torch.arange(block, device=grid.device)
        index = torch.minimum(first + steps, last)  # (r, 1, n, block): repeats past the end
        index = index.expand(rows, *index.shape[1:]).flatten(1)
        values = table.expand(rows, -1).gather(1, index).view(rows, -1, block)
        lo, hi = values.amin(-1), values.amax(-1)
        if not runs:
            none = torch.zeros_like(lo, dtype=torch.bool)
            return _Runs(lo, hi, lo.unsqueeze(-1), hi.unsqueeze(-1), none, none)
        breaks = values.diff(dim=-1).abs_() > 1
        run = torch.nn.functional.pad(breaks.cumsum(-1), (1, 0))  # run of each token
        known = run[..., -1] < RUNS
        one_run = run[..., -1] == 0
        run = run.clamp_(max=RUNS - 1)
        # A tile with fewer runs repeats its first in the others' slots: the nearest pair
        # is the same, and no bound is ever a sentinel whose differences could wrap.
        first_run = values[..., :1].expand(*values.shape[:-1], RUNS)
        runs_lo = first_run.clone().scatter_reduce_(-1, run, values, "amin", include_self=False)
        runs_hi = first_run.clone().scatter_reduce_(-1, run, values, "amax", include_self=False)
        absent = run[..., -1:] < torch.arange(RUNS, device=grid.device)
        runs_lo = torch.where(absent, runs_lo[..., :1], runs_lo)
        runs_hi = torch.where(absent, runs_hi[..., :1], runs_hi)
        return _Runs(lo, hi, runs_lo, runs_hi, known, one_run)

    def __repr__(self) -> str:
        sizes_per_row, positions_per_row = self._given_per_row
        size = self.sizes.tolist() if sizes_per_row else int(self.sizes[0])
        rows, n = self.positions.shape
        shape = f"{rows} x {n}" if positions_per_row else f"{n}"
        ahead = ", keys_ahead=True" if self.keys_ahead else ""
        return f"sliding_window({size}, positions=<{shape} positions {self.key[-1][:8]}>{ahead})"


class PositionWindowMod(PieceMod):
    """The mask_mod: ``|positions[b, q_idx] - positions[b, kv_idx]| < size[b]`` (with
    ``keys_ahead``, ``positions[b, q_idx] - positions[b, kv_idx] < size[b]``)."""

    __slots__ = ("positions", "size", "keys_ahead")
    _name = "sliding_window_positions"

    def __init__(self, positions: Tensor, size: Tensor, per_row: bool, keys_ahead: bool) -> None:
        super().__init__(per_row)
        self.positions = positions
        self.size = size
        self.keys_ahead = keys_ahead

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # As bounds on the key's position around the query's: each side's lookups are the
        # size of its own indices, and the one pass over every (q, kv) pair is two
        # comparisons, not a difference, its abs and a comparison (a third of the time on
        # a build's refined tiles). The size is held below 2**62 (every position is), so
        # the bounds stay inside int64.
        at = self._lookup(self.positions, b, q_idx)
        size = self._value(self.size, b)
        kv = self._lookup(self.positions, b, kv_idx)
        if self.keys_ahead:
            return kv > at - size
        return (kv > at - size) & (kv < at + size)


def _positions(positions: Any) -> tuple[Tensor, bool]:
    """``(R, n)`` int64 positions (R = 1 shared) and whether they were given per row."""
    if isinstance(positions, Tensor) and positions.dim() == 2:
        # One copy of the whole table (a batch's position_ids), checked as one.
        table = int_vector(positions.reshape(-1), "positions").view(positions.shape)
        per_row = True
    else:
        per_row = is_nested(positions)
        if per_row:
            rows = [int_vector(row, f"positions[{i}]") for i, row in enumerate(positions)]
        else:
            rows = [int_vector(positions, "positions")]
        if not rows:
            raise ValueError("positions must hold at least one batch row, got none")
        lengths = {row.numel() for row in rows}
        if len(lengths) > 1:
            raise ValueError(
                f"positions must give every batch row the same number of positions, got "
                f"{sorted(lengths)}: one position per token of the padded batch"
            )
        table = torch.stack(rows)
    if table.shape[0] == 0:
        raise ValueError("positions must hold at least one batch row, got none")
    if table.shape[1] == 0:
        raise ValueError("positions must hold at least one position per row, got an empty row")
    low, high = int(table.min()), int(table.max())
    if low < 0 or high >= MAX_POSITION:
        name = "positions" if not per_row else "positions[...]"
        bad = low if low < 0 else high
        raise ValueError(f"{name} must lie in [0, 2**62), got {bad}")
    return table, per_row
