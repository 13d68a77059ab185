"""A tree's lookups by position (rank and subtree end) and the mask_mods that read them."""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.pieces._base import PieceMod, WindowMod, window_positions


def position_lookups(
    parents: list[Tensor],
    ranks: list[Tensor],
    ends: list[Tensor],
    length: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """(R, length + 1) int32 rank and subtree end of positions ``0..length``.

    Past the tree, rank = position and end = 0: such a kv is nobody's ancestor and such a q
    has a rank beyond every subtree, so neither attends.
    """
    rows = len(parents)
    rank = torch.arange(length + 1, dtype=torch.int32).repeat(rows, 1)
    end = torch.zeros(rows, length + 1, dtype=torch.int32)
    for row in range(rows):
        n = parents[row].numel()
        rank[row, :n] = ranks[row]
        end[row, :n] = ends[row]
    return rank.to(device), end.to(device)


def window_lookups(
    parents: list[Tensor],
    ranks: list[Tensor],
    ends: list[Tensor],
    start: int | Tensor,
    length: int,
    rows: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Rank and subtree end of one window side's positions, (rows, length + 1) int32
    with a last (sentinel) column. Past the tree, and there, rank is the tree's size
    (at least every subtree end: such a q attends nothing) and end is 0 (such a kv is
    nobody's ancestor)."""
    longest = max(p.numel() for p in parents)
    rank = torch.full((len(parents), longest + 1), longest, dtype=torch.int32)
    end = torch.zeros(len(parents), longest + 1, dtype=torch.int32)
    for row, row_parents in enumerate(parents):
        rank[row, : row_parents.numel()] = ranks[row]
        end[row, : row_parents.numel()] = ends[row]
    positions = window_positions(start, length, device).expand(rows, -1)
    at = torch.nn.functional.pad(positions.clamp(max=longest), (0, 1), value=longest)
    rank, end = rank.to(device).expand(rows, -1), end.to(device).expand(rows, -1)
    return rank.gather(1, at), end.gather(1, at)


class TreeMod(PieceMod):
    """tree's mask_mod: kv is q or an ancestor, ``rank[kv] <= rank[q] < end[kv]``.

    ``rank`` and ``end`` are int32 ``(R, length + 1)`` per row, ``(length + 1,)`` shared;
    indices past the lookup are clamped onto the last entry, which attends nowhere.
    """

    __slots__ = ("rank", "end")
    _name = "tree"

    def __init__(self, rank: Tensor, end: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.rank = rank
        self.end = end

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        last = self.rank.shape[-1] - 1
        q_rank = self._lookup(self.rank, b, q_idx.clamp(max=last))
        kv = kv_idx.clamp(max=last)
        return (self._lookup(self.rank, b, kv) <= q_rank) & (q_rank < self._lookup(self.end, b, kv))


class TreeWindowMod(WindowMod):
    """tree's mask_mod on a window: ``kv_rank[kv] <= q_rank[q] < kv_end[kv]``.

    ``q_rank`` holds the ranks of the window's query positions, ``kv_rank`` and ``kv_end``
    those of its key positions (int32, ``(R, n + 1)`` per row, ``(n + 1,)`` shared); the
    last entries attend nowhere.
    """

    __slots__ = ("q_rank", "kv_rank", "kv_end")
    _name = "tree"

    def __init__(
        self,
        q_rank: Tensor,
        kv_rank: Tensor,
        kv_end: Tensor,
        q_start: Tensor,
        kv_start: Tensor,
        per_row: bool,
    ) -> None:
        super().__init__(q_start, kv_start, per_row)
        self.q_rank = q_rank
        self.kv_rank = kv_rank
        self.kv_end = kv_end

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_rank = self._at(self.q_rank, self.q_start, b, q_idx)
        kv_rank = self._at(self.kv_rank, self.kv_start, b, kv_idx)
        return (kv_rank <= q_rank) & (q_rank < self._at(self.kv_end, self.kv_start, b, kv_idx))
