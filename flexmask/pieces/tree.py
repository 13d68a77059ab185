"""Tree attention: a token attends to itself and its ancestors (shared-prefix packing).

The piece is split by job: its order (``tree_order``: preorder rank and subtree end), its
lookups and mask_mods (``tree_lookups``), its tile codes (``tree_tiles``, with the
vectorized tests of ``tree_chunks``) and its lines for the lowerings (``tree_lines``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import source_device
from flexmask.algebra import (
    UNUSED,
    BlockColumns,
    Extent,
    LineIntervals,
    Lowered,
    TileGrid,
    VarlenPart,
    Window,
    cannot_lower,
)
from flexmask.blocks import EMPTY, constant_codes
from flexmask.pieces._base import Piece, held_start, tracing, window_rows
from flexmask.pieces.tree_chunks import search_subtrees
from flexmask.pieces.tree_keys import parent_rows
from flexmask.pieces.tree_lines import Runs, forest_runs, tree_breaks, tree_lines
from flexmask.pieces.tree_lookups import TreeMod, TreeWindowMod, position_lookups, window_lookups
from flexmask.pieces.tree_order import ranks_and_ends_rows
from flexmask.pieces.tree_tiles import Tuning, classify_preorder, classify_ranked, preorder_columns

_CPU = torch.device("cpu")

# How the tile classification and the lowerings' lines cut their work, read at every call
# (so a test may set them here to take the chunked, wide, tensor or counted paths on small
# trees).
_CHUNK_TILES = 1 << 19
"""Tiles per chunk of q blocks: a chunk's flag buffers stay in cache."""

_CHUNKED_FROM = 1 << 18
"""Grids of more tiles than this are classified in chunks of q blocks (``_CHUNK_TILES``)."""

_NARROW = torch.iinfo(torch.int16).max
"""Chunks whose q-side values span less than this are compared as int16."""

_COLUMNS_FROM = 1 << 12
"""Grids of at least this many tiles (rows x q blocks x kv blocks) in preorder are written
from their columns (``block_columns``); smaller ones classify their tiles, whose few calls
cost less than the columns' searches and sort (docs/costs.md, "The thresholds in the code")."""

_search_subtrees = search_subtrees
"""The exact search of the tiles the extremes leave open (rank space)."""

_FEW_RUNS = 256
"""Trees of at most this many runs of consecutive positions have their lines' run tables
built from Python lists (one shared-prefix group at 8k has 8 runs, a row of several
groups 12-15), larger ones with torch ops (``tree_lines``)."""


class Tree(Piece):
    """kv is q or an ancestor of q in a token-level tree; positions past the tree are masked.

    ::

        parents=[-1, 0, 1, 0, 3]    (0 → 1 → 2 and 0 → 3 → 4)
                          ■ ⬚ ⬚ ⬚ ⬚
                          ■ ■ ⬚ ⬚ ⬚
                          ■ ■ ■ ⬚ ⬚
                          ■ ⬚ ⬚ ■ ⬚
                          ■ ⬚ ⬚ ■ ■

    The ancestor test is two lookups in O(N) memory: with ``rank`` the preorder number of a
    token and ``end`` one past the last rank of its subtree, kv is an ancestor-or-self of q
    iff ``rank[kv] <= rank[q] < end[kv]``. When the tokens are laid out in preorder (as
    ``flexmask.pack_tree`` lays them out) ``rank`` is the position itself and blocks are
    classified exactly from the per-block extremes of ``end``; other layouts (insertion order)
    in rank space, from per-block extremes of ``rank`` and ``end`` and a search of a few
    ranks where a block's ranks are not one run (``tree_tiles``): no tile evaluated.
    """

    __slots__ = ("_flat", "_lengths", "_parents", "per_row", "_order")

    settles_every_tile = True
    """``classify_tiles`` returns EMPTY, PARTIAL or FULL for every tile, never UNDECIDED
    (the build then skips looking for undecided tiles)."""

    @property
    def carries_batch_data(self) -> bool:
        return True

    _arg = "parents"

    def __init__(self, parents: Any) -> None:
        # The key and the checks only (``tree_keys``): a re-made tree that hits the cache
        # never widens its parents to int64 nor computes its order.
        made = parent_rows(parents)
        self._flat = made.flat
        self._lengths = made.lengths
        self.per_row = made.per_row
        self._parents: list[Tensor] | None = None
        self._order: tuple[list[Tensor], list[Tensor], list[bool]] | None = None
        super().__init__(
            ("tree", made.digest, made.per_row),
            rows=len(made.lengths) if made.per_row else None,
            # A tensor's device, or a row's; never a scan of one list's every value.
            device=source_device(parents) if made.per_row or isinstance(parents, Tensor) else None,
            natural=max(made.lengths),
        )

    @property
    def parents(self) -> list[Tensor]:
        """Each row's parents as int64 on the CPU: widened from the narrow copy the key was
        made of at the first build that reads them, then kept."""
        if self._parents is not None:
            return self._parents
        exporting = _exporting()
        with _outside_export() if exporting else contextlib.nullcontext():
            parents = list(self._flat.to(torch.int64).split(self._lengths))
        if exporting or not tracing():  # a trace's own tensors are never kept
            self._parents = parents
        return parents

    def _ordered(self) -> tuple[list[Tensor], list[Tensor], list[bool]]:
        """Each row's preorder rank, subtree end and whether it is laid out in preorder
        (``ranks_and_ends``): computed at the first build that reads them, then kept."""
        if self._order is not None:
            return self._order
        exporting = _exporting()
        with _outside_export() if exporting else contextlib.nullcontext():
            order = ranks_and_ends_rows(self.parents)
        if exporting or not tracing():  # a trace's own tensors are never kept
            self._order = order
        return order

    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        # Derived from the narrow copy: recomputed, never pickled.
        del state["_parents"], state["_order"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self._parents = None
        self._order = None

    @property
    def ranks(self) -> list[Tensor]:
        """Each row's preorder rank of every token."""
        return self._ordered()[0]

    @property
    def ends(self) -> list[Tensor]:
        """Each row's subtree end (exclusive, in rank space) of every token."""
        return self._ordered()[1]

    @property
    def preorder(self) -> list[bool]:
        """Whether each row's tokens are laid out in preorder (``flexmask.pack_tree``'s)."""
        return self._ordered()[2]

    def check(self, extent: Extent) -> None:
        # Before the shared check: a tree takes no truncation (cut at the end, a node would
        # lose the ancestors its lookups are built from only if they came later: never, but
        # the lookups are made for every parent), so it says so in its own words.
        longest = self.natural_length  # read at every cache hit: never widens the parents
        if longest > extent.length:
            raise ValueError(
                f"parents has {longest} tokens, more than the sequence length "
                f"{extent.length_name}={extent.length}"
            )
        super().check(extent)

    def _lookups(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(R, length + 1) int32 rank and subtree end per position (``position_lookups``).

        The last length's pair is kept with the device copies (``_placed``, never pickled):
        a build reads them twice (its mask_mod and its tiles), and a re-build again. Read
        only: the BlockMask's mask_mod holds them.
        """
        if tracing():  # tensors made under a trace are the trace's: never kept
            return position_lookups(self.parents, self.ranks, self.ends, length, device)
        names = (f"lookup rank {length}", f"lookup end {length}")
        rank, end = (self._placed.get((name, device)) for name in names)
        if rank is not None and end is not None:
            return rank, end
        for stale in [k for k in self._placed if k[0].startswith("lookup ")]:
            del self._placed[stale]  # one length kept: memory stays O(tree)
        rank, end = position_lookups(self.parents, self.ranks, self.ends, length, device)
        self._placed[(names[0], device)], self._placed[(names[1], device)] = rank, end
        return rank, end

    def _end_by_rank(self, length: int, device: torch.device) -> Tensor:
        """(R, length + 1) int32 subtree end of the token of each rank (``end`` permuted by
        ``rank``, a permutation of the positions): kept with the length's rank and end."""
        rank, end = self._lookups(length, device)
        if tracing():
            return torch.empty_like(end).scatter_(1, rank.to(torch.int64), end)
        name = (f"lookup end by rank {length}", device)
        kept = self._placed.get(name)
        if kept is None:
            kept = torch.empty_like(end).scatter_(1, rank.to(torch.int64), end)
            self._placed[name] = kept
        return kept

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        longest = self.natural_length
        if _least(grid.q_offset) >= longest or _least(grid.kv_offset) >= longest:
            # A side wholly past the tree: its queries attend nothing, or its keys are
            # nobody's ancestor. Every tile is EMPTY, with no lookups over the window's
            # reach (which may be near 2**63).
            return constant_codes(EMPTY, grid.device)
        length = self._tile_length(grid)
        rank, end = self._lookups(length, grid.device)
        tuning = Tuning(_CHUNK_TILES, _CHUNKED_FROM, _NARROW, _search_subtrees)
        if all(self.preorder):
            return classify_preorder(grid, end, tuning)
        # Rank space is exact for any layout; rows already in preorder lose nothing to it
        # but a few passes, so mixed batches take it for every row.
        end_by_rank = self._end_by_rank(length, grid.device)
        return classify_ranked(grid, self.parents, rank, end, end_by_rank, tuning)

    def block_columns(self, grid: TileGrid) -> BlockColumns | None:
        # In preorder a key attends the queries of its subtree, one run of positions: each
        # kv block column is one run of q blocks (``preorder_columns``). Other layouts, and
        # the cases ``classify_tiles`` settles without lookups, take the tiles.
        if not all(self.preorder):
            return None
        if not isinstance(grid.q_offset, int) or not isinstance(grid.kv_offset, int):
            return None  # per-row offsets: a row of q blocks each
        longest = self.natural_length
        if grid.q_offset >= longest or grid.kv_offset >= longest:
            return None
        rows = len(self.parents) if self.per_row else 1
        if rows * grid.num_q_blocks * grid.num_kv_blocks < _COLUMNS_FROM:
            return None
        _, end = self._lookups(self._tile_length(grid), grid.device)
        return preorder_columns(grid, end)

    def _tile_length(self, grid: TileGrid) -> int:
        """Positions the tile lookups cover: the grid's length, shared with its mask_mod's
        and every row's window (one lookup kept); for a window far from position 0
        (``lookup_window``) the tree and the window's own positions only. Both its sides
        then start inside the tree (``classify_tiles`` settles the others at once), so
        that is O(tree + Q + KV)."""
        if grid.lookup_window is None:
            return grid.length
        return max(_most(grid.q_end), _most(grid.kv_end), self.natural_length)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        if window is not None:
            # Each side's lookups at its own positions: a window near 2**63 holds O(Q + KV).
            rows = window_rows(window, len(self.parents))
            data = self.parents, self.ranks, self.ends
            q_rank, _ = window_lookups(*data, window.q_start, window.q_len, rows, device)
            kv_rank, kv_end = window_lookups(*data, window.kv_start, window.kv_len, rows, device)
            per_row = self.per_row or rows > 1
            if not per_row:
                q_rank, kv_rank, kv_end = q_rank[0], kv_rank[0], kv_end[0]
            starts = held_start(window.q_start, device), held_start(window.kv_start, device)
            window_mod = TreeWindowMod(q_rank, kv_rank, kv_end, *starts, per_row)
            return Lowered(window_mod, window_mod)
        rank, end = self._lookups(length, device)
        if self.per_row:
            mod = TreeMod(rank, end, per_row=True)
        else:
            mod = TreeMod(rank[0], end[0], per_row=False)
        return Lowered(mod, mod)

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        if transpose and not all(self.preorder):
            raise cannot_lower(
                self,
                f"{fmt} in this token order",
                "the queries attending a key are its subtree, which is one run of positions "
                "only when the tokens are laid out in preorder (as flexmask.pack_tree lays "
                "them out). Reorder the tokens, or use to_magi / create_block_mask",
            )
        runs = None if transpose else self._line_runs()
        lo, hi = tree_lines(self.parents, self.ends, pos, transpose, _FEW_RUNS, runs)
        # Ancestor runs come sorted, disjoint and non-adjacent (root first): kept as they
        # are where their last slot is used somewhere (no slot to cut).
        return LineIntervals(lo, hi, not transpose and bool(lo[..., -1].ne(UNUSED).any()))

    def line_breaks(self, *, transpose: bool) -> Tensor | None:
        if transpose and not all(self.preorder):
            return None  # lines_at refuses, naming the layout
        if transpose:
            return tree_breaks(self.parents, self.ends)
        return tree_breaks(self.parents, None, self._line_runs())

    def _line_runs(self) -> Runs:
        """The rows' runs of consecutive positions laid end to end (``forest_runs``): kept
        with the lookups (never pickled), as the order is, since a lowering reads them
        twice and a re-lowering of the same tree again."""
        if tracing():
            return forest_runs(self.parents)
        names = (("line runs start", _CPU), ("line runs up", _CPU))
        start, up = (self._placed.get(name) for name in names)
        if start is None or up is None:
            start, up = forest_runs(self.parents)
            self._placed[names[0]], self._placed[names[1]] = start, up
        return Runs(start, up)

    def varlen_part(self, length: int) -> VarlenPart:
        raise cannot_lower(
            self,
            "varlen",
            "a tree's queries attend their ancestors, which are not one block per document "
            "(use to_magi, or flexmask.create_block_mask)",
        )

    def __repr__(self) -> str:
        if self.per_row:
            return f"tree(<{len(self._lengths)} rows>)"
        n = self._lengths[0]
        return f"tree({self._flat.tolist()})" if n <= 16 else f"tree(<{n} tokens>)"


def _most(end: int | Tensor) -> int:
    """The largest of a grid's window ends (an int, or one per row)."""
    return int(end.max()) if isinstance(end, Tensor) else end


def _least(offset: int | Tensor) -> int:
    """The smallest of a grid's offsets (an int, or one per row)."""
    return int(offset.min()) if isinstance(offset, Tensor) else offset


def tree(parents: Any) -> Tree:
    """Tree (shared-prefix) attention: kv is q itself or one of q's ancestors.

    Args:
        parents: token-level parent array: ``parents[i] < i``, or -1 for a root — one array
            (list or 1-D integer tensor) for every row, or a list with one per batch row.
            Positions at or beyond ``len(parents)`` are masked.

    Raises:
        ValueError: an empty array, or a parent that is not an earlier token or -1.
        TypeError: non-integer parents.

    Example:
        >>> import flexmask
        >>> print(flexmask.tree([-1, 0, 1, 0, 3]).show(5))
        ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚
        ■ ⬚ ⬚ ■ ⬚
        ■ ⬚ ⬚ ■ ■
    """
    return Tree(parents)


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting is not None and is_exporting())


@contextlib.contextmanager
def _outside_export() -> Iterator[None]:
    """The order computed on the parents' real values while ``torch.export`` traces: the
    mask was made outside the program (its parents are constants of it), and its order, a
    property of those constants, is data the program reads, not a step it traces (tracing
    it would guard on their values)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), unset_fake_temporarily(), torch._C.DisableTorchFunction():
        yield
