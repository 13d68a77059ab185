"""Selected blocks (NSA, DSA, MoBA): each query tile attends the key tiles a router picked."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from flexmask._validate import INT64_MAX, check_int, digest, source_device
from flexmask.algebra import (
    INF,
    UNUSED,
    Extent,
    Formula,
    LineIntervals,
    Lowered,
    TileGrid,
    VarlenPart,
    Window,
    cannot_lower,
)
from flexmask.blocks import codes_from
from flexmask.pieces._base import Piece, PieceMod

_LAYOUTS = "[n_q_tiles, k], [B, n_q_tiles, k] or [B, H, n_q_tiles, k]"


class Selected(Piece):
    """``kv_idx // kv_tile`` is among the picks of ``q_idx // q_tile`` (in its row and head).

    ::

        tile=2, indices=[[0, -1], [0, 2]]:  ■ ■ ⬚ ⬚ ⬚ ⬚
                                            ■ ■ ⬚ ⬚ ⬚ ⬚
                                            ■ ■ ⬚ ⬚ ■ ■
                                            ■ ■ ⬚ ⬚ ■ ■

    ``picks`` is the canonical form of the router's indices: ``(R, Hd, n, k)`` int64, each
    list sorted ascending without repeats, -1 after the picks, no trailing list or column
    that picks nothing; R (Hd) is 1 where the indices are shared by every row (head).
    """

    __slots__ = ("picks", "q_tile", "kv_tile", "per_row", "per_head", "_reach", "_tiles")
    _arg = "indices"

    def __init__(
        self,
        picks: Tensor,
        q_tile: int,
        kv_tile: int,
        device: torch.device | None = None,
        truncate: bool = False,
    ) -> None:
        self.picks = picks
        self.q_tile = q_tile
        self.kv_tile = kv_tile
        self.per_row = picks.shape[0] > 1
        self.per_head = picks.shape[1] > 1
        # The furthest query tile that picks something and the furthest key tile picked.
        last_q = picks.shape[2] - 1
        last_kv = int(picks.max()) if picks.numel() else -1
        self._tiles = (last_q, last_kv)
        # The first position of each: data past the sequence starts there (``check``).
        self._reach = max(
            last_q * q_tile + 1 if last_q >= 0 else 0,
            last_kv * kv_tile + 1 if last_kv >= 0 else 0,
        )
        key = ("selected", (q_tile, kv_tile), tuple(picks.shape), digest(picks))
        super().__init__(
            key,
            rows=picks.shape[0] if self.per_row else None,
            device=device,
            # Lookups made at this length cover every tile the data names (``mask_mod``).
            natural=self._reach,
            truncate=truncate,
        )

    # ------------------------------------------------------------------ what it depends on
    @property
    def head_dependent(self) -> bool:
        return self.per_head

    @property
    def carries_batch_data(self) -> bool:
        return True  # a router's picks describe one batch: they rarely recur

    @property
    def data_reach(self) -> int:
        return self._reach

    @property
    def head_cycle(self) -> int:
        return self.picks.shape[1]

    def at_head(self, head: int) -> Selected:
        if not self.per_head:
            return self
        one = self.picks[:, head % self.picks.shape[1]].unsqueeze(1)
        return Selected(*_trimmed(one), self.q_tile, self.kv_tile, self._device, self._truncate)

    def check(self, extent: Extent) -> None:
        heads = self.picks.shape[1]
        if self.per_head and extent.heads is not None and extent.heads != heads:
            raise ValueError(
                f"indices hold picks for {heads} heads but H={extent.heads}: give one list per "
                f"head ([B, H, n_q_tiles, k]) or one for every head ([B, n_q_tiles, k]); a "
                f"router that picks per kv head serves its query heads with "
                f"indices.repeat_interleave(H // H_kv, dim=1)"
            )
        if not self._truncate:
            self._check_reach(extent)
        super().check(extent)

    def _check_reach(self, extent: Extent) -> None:
        # Picks made for longer sequences would be cut silently (tensors read as
        # (B, S, H, D) where (B, H, S, D) was meant): say which tile reaches past the end.
        length, (last_q, last_kv) = extent.length, self._tiles
        sides = (
            ("key", last_kv, self.kv_tile, "picks key tile"),
            ("query", last_q, self.q_tile, "holds picks for query tile"),
        )
        for side, last, tile, what in sides:
            if last >= 0 and last * tile >= length:
                raise ValueError(
                    f"selected's indices {what} {last} (positions from {last * tile}), past "
                    f"the sequence {extent.length_name} = {length}, which has "
                    f"{-(-length // tile)} {side} tiles of {tile} tokens: give indices made for "
                    f"this sequence (entries < {-(-length // self.kv_tile)} key tiles, picks "
                    f"for < {-(-length // self.q_tile)} query tiles), or pass "
                    f"selected(..., truncate=True) to drop picks past its end"
                )

    # ------------------------------------------------------------------ the dense lookup
    def _dense(
        self, q_start: int, q_count: int, kv_start: int, kv_count: int, device: torch.device
    ) -> Tensor:
        """``(R, Hd, q_count, kv_count)`` bool: whether query tile ``q_start + i`` picked key
        tile ``kv_start + j``; tiles past the data pick nothing. One scatter of the picks of
        those query tiles: O(q_count * (k + kv_count)), never more tiles than asked for."""
        picks = self._on("picks", device)
        rows, heads = picks.shape[:2]
        stop = min(q_start + q_count, picks.shape[2])
        part = picks[:, :, q_start:stop] if q_start < stop else picks[:, :, :0]
        # The picks in the asked columns at their column, every other one in a dropped column.
        inside = (part >= kv_start) & (part < kv_start + kv_count)
        column = torch.where(inside, part - kv_start, kv_count)
        out = torch.zeros(rows, heads, q_count, kv_count + 1, dtype=torch.bool, device=device)
        if column.numel():
            out[:, :, : column.shape[2]].scatter_(3, column, True)
        return out[..., :kv_count]

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        # A block covers query tiles [q_first // q_tile, q_last // q_tile] and key tiles
        # [kv_first // kv_tile, kv_last // kv_tile] (token bounds clipped to the lengths):
        # it attends somewhere iff some pair of them is picked, everywhere iff every pair is
        # — whatever the block size is to the tile size. Both reduce the picked tiles over
        # each block's span of query tiles, then of key tiles: no token evaluated.
        q0, q1 = grid.q_first // self.q_tile, grid.q_last // self.q_tile
        k0, k1 = grid.kv_first // self.kv_tile, grid.kv_last // self.kv_tile
        # Only the tiles the grid touches (a window far from 0 touches few).
        q_low, q_high = int(q0.min()), int(q1.max())
        kv_low, kv_high = int(k0.min()), int(k1.max())
        picked = self._dense(q_low, q_high - q_low + 1, kv_low, kv_high - kv_low + 1, grid.device)
        q0, q1, k0, k1 = q0 - q_low, q1 - q_low, k0 - kv_low, k1 - kv_low
        codes = []
        # Windows per batch row (offsets per row) span tiles of their own: row by row.
        for row in range(q0.shape[0]):
            own = picked if picked.shape[0] == 1 or q0.shape[0] == 1 else picked[row : row + 1]
            some, every = _over_spans(own, own, q0[row].view(-1), q1[row].view(-1), dim=2)
            some, every = _over_spans(some, every, k0[row].view(-1), k1[row].view(-1), dim=3)
            codes.append(codes_from(some, every))
        return codes[0] if len(codes) == 1 else torch.cat(codes)

    settles_every_tile = True  # every code above is exact: no tile left to refine

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        # One shape per length (a compiled kernel sees the same table for every batch of
        # this length); on a window far from 0, the data's own tiles (positions past them
        # read the last, empty, entry).
        if window is None:
            q_count, kv_count = -(-length // self.q_tile), -(-length // self.kv_tile)
        else:
            q_count = min(self._tiles[0] + 1, -(-length // self.q_tile))
            kv_count = min(self._tiles[1] + 1, -(-length // self.kv_tile))
        table = self._dense(0, q_count, 0, kv_count, device)
        # One last row and column that pick nothing: indices past the table land there.
        table = torch.nn.functional.pad(table, (0, 1, 0, 1))
        if not self.per_head:
            table = table[:, 0]
        if not self.per_row:
            table = table[0]
        q_tile = torch.tensor(self.q_tile, dtype=torch.int64, device=device)
        kv_tile = torch.tensor(self.kv_tile, dtype=torch.int64, device=device)
        mod = SelectedMod(table, q_tile, kv_tile, self.per_row, self.per_head)
        return Lowered(mod, mod)

    def interval_form(self) -> Formula | None:
        # A query's keys are up to k runs of tiles, and which ones is data, not arithmetic
        # on q: the interval form (one table per bound) would hold k start and k end tables
        # of the sequence's length, and torch packs at most 8 intervals. The table lookup
        # of SelectedMod is the mask_mod kept.
        return None

    # ------------------------------------------------------------------ lowerings (formats)
    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        if self.per_head:
            raise cannot_lower(
                self, fmt, "its heads pick differently (lower head by head: at_head)"
            )
        line_tile, other_tile = self._sides(transpose)
        groups = _tile_runs(self._pairs(transpose))
        rows = max(self.picks.shape[0], pos.shape[0])
        pos = pos.expand(rows, -1).to(torch.int64)
        tile = pos.div(line_tile, rounding_mode="floor")
        slots = max(groups.first.shape[1], 1)
        lo = torch.full((rows, pos.shape[1], slots), UNUSED, dtype=torch.int64)
        hi = torch.full_like(lo, -UNUSED)
        for row in range(rows):
            own = groups.row == (row if self.per_row else 0)
            if not bool(own.any()) or not groups.first.shape[1]:
                continue
            line, first, last = groups.line[own], groups.first[own], groups.last[own]
            at = torch.searchsorted(line, tile[row]).clamp(max=line.numel() - 1)
            found = (line[at] == tile[row]).unsqueeze(-1) & (first[at] >= 0)
            # Positions of the other side, clamped to INF: no window reaches past it.
            start = (first[at] * other_tile).clamp(max=INF)
            end = ((last[at] + 1) * other_tile - 1).clamp(max=INF)
            lo[row] = torch.where(found, start, UNUSED)
            hi[row] = torch.where(found, end, -UNUSED)
        return LineIntervals(lo, hi)

    def line_breaks(self, *, transpose: bool) -> Tensor:
        # Every line of one tile attends alike: lines change only where a tile that picks
        # (or is picked) starts or ends.
        line_tile, _ = self._sides(transpose)
        tiles = torch.unique(self._pairs(transpose)[1])
        return torch.cat([tiles * line_tile, (tiles + 1) * line_tile]).clamp(max=INF).view(1, -1)

    def varlen_part(self, length: int) -> VarlenPart:
        raise cannot_lower(
            self,
            "varlen",
            "picked key tiles are no partition of the sequence into sequences; use "
            "to_flashmask or to_magi (their lists of intervals), or flexmask.create_block_mask",
        )

    def _sides(self, transpose: bool) -> tuple[int, int]:
        """(tile of a line, tile of the other side): queries' lines, or keys' transposed."""
        return (self.kv_tile, self.q_tile) if transpose else (self.q_tile, self.kv_tile)

    def _pairs(self, transpose: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Every pick as (row, line tile, other tile) of head 0, sorted by the three."""
        picks = self.picks[:, 0]
        row, q_tile, slot = (picks >= 0).nonzero().unbind(1)
        kv_tile = picks[row, q_tile, slot]
        line, other = (kv_tile, q_tile) if transpose else (q_tile, kv_tile)
        # Stable sorts from the last key to the first: lexicographic (row, line, other).
        order = torch.arange(row.numel())
        for key in (other, line, row):
            order = order[torch.sort(key[order], stable=True).indices]
        return row[order], line[order], other[order]

    def __repr__(self) -> str:
        rows, heads, n, k = self.picks.shape
        tile = self.q_tile if self.q_tile == self.kv_tile else (self.q_tile, self.kv_tile)
        shape = f"{rows} rows, " if self.per_row else ""
        shape += f"{heads} heads, " if self.per_head else ""
        return f"selected(<{shape}{n} query tiles x {k} picks>, tile={tile})"


class _Runs(NamedTuple):
    """Per (row, line tile) that attends something — groups sorted by (row, line) — its runs
    of consecutive tiles of the other side, ``first``/``last`` ``(G, slots)``, -1 in the
    slots it does not use."""

    row: Tensor
    line: Tensor
    first: Tensor
    last: Tensor


def _tile_runs(pairs: tuple[Tensor, Tensor, Tensor]) -> _Runs:
    """The picks (sorted, unique) cut into runs of consecutive tiles per (row, line)."""
    row, line, other = pairs
    n = row.numel()
    if n == 0:
        none = torch.zeros(0, dtype=torch.int64)
        return _Runs(none, none, none.view(0, 0), none.view(0, 0))
    new_group = torch.ones(n, dtype=torch.bool)
    new_group[1:] = (row[1:] != row[:-1]) | (line[1:] != line[:-1])
    new_run = new_group.clone()
    new_run[1:] |= other[1:] != other[:-1] + 1
    group = new_group.cumsum(0) - 1
    run = new_run.cumsum(0) - 1
    run_group = group[new_run]
    # A run's slot: its rank among its group's runs.
    group_first_run = torch.zeros(int(group[-1]) + 1, dtype=torch.int64)
    group_first_run.scatter_reduce_(0, run_group, run[new_run], "amin", include_self=False)
    slot = run[new_run] - group_first_run[run_group]
    slots = int(slot.max()) + 1
    first = torch.full((group_first_run.numel(), slots), -1, dtype=torch.int64)
    last = torch.full_like(first, -1)
    first[run_group, slot] = other[new_run]
    ends = torch.ones(n, dtype=torch.bool)
    ends[:-1] = new_run[1:]
    last[run_group, slot] = other[ends]
    return _Runs(row[new_group], line[new_group], first, last)


def _over_spans(
    some: Tensor, every: Tensor, first: Tensor, last: Tensor, dim: int
) -> tuple[Tensor, Tensor]:
    """``some`` OR-ed and ``every`` AND-ed over each span ``[first[n], last[n]]`` of tiles
    along ``dim`` (2 or 3): ``(.., n, ..)`` each."""
    count = first.numel()
    width = int(last[0] - first[0]) + 1
    steps = torch.arange(count, device=first.device) * width + first[0]
    if bool((first == steps).all() & (last == torch.minimum(steps + width - 1, last[-1])).all()):
        # Blocks of whole tiles from a tile edge (a block a multiple of the tile, or equal
        # to it): the spans lie end to end, every one as wide but the last; padded with
        # tiles that change no OR (False) and no AND (True), they are a view of the table.
        start, stop = int(first[0]), int(last[-1]) + 1
        pad = [0, 0] * (3 - dim) + [0, count * width - (stop - start)]
        some = torch.nn.functional.pad(some.narrow(dim, start, stop - start), pad, value=False)
        every = torch.nn.functional.pad(every.narrow(dim, start, stop - start), pad, value=True)
        shape = (count, width)
        return some.unflatten(dim, shape).any(dim + 1), every.unflatten(dim, shape).all(dim + 1)
    # Any other spans (a tile wider than the block, tiles across block edges): at most
    # ``block // tile + 2`` tiles each, read as that many, the last repeated where a span
    # is shorter (a repeat changes no OR and no AND). Whole rows are copied: the key side
    # is transposed to rows first.
    width = int((last - first).max()) + 1
    steps = torch.arange(width, device=first.device)
    index = torch.minimum(first.view(-1, 1) + steps, last.view(-1, 1)).view(-1)
    if dim == 3:
        some, every = some.transpose(2, 3).contiguous(), every.transpose(2, 3).contiguous()
    some = some.index_select(2, index).unflatten(2, (count, width)).any(3)
    every = every.index_select(2, index).unflatten(2, (count, width)).all(3)
    if dim == 3:
        return some.transpose(2, 3), every.transpose(2, 3)
    return some, every


class SelectedMod(PieceMod):
    """selected's mask_mod: the picked table at (row, head, query tile, key tile).

    ``table`` is bool ``([R,] [H,] n_q + 1, n_kv + 1)`` (R, H only where they differ): its
    last row and column pick nothing, and tile numbers past the table are clamped onto them.
    The tile sizes are 0-d tensors, never Python ints (a new size does not recompile)."""

    __slots__ = ("table", "q_tile", "kv_tile", "per_head")
    _name = "selected"

    def __init__(
        self, table: Tensor, q_tile: Tensor, kv_tile: Tensor, per_row: bool, per_head: bool
    ) -> None:
        super().__init__(per_row)
        self.table = table
        self.q_tile = q_tile
        self.kv_tile = kv_tile
        self.per_head = per_head

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_tile = (q_idx // self.q_tile).clamp(max=self.table.shape[-2] - 1)
        kv_tile = (kv_idx // self.kv_tile).clamp(max=self.table.shape[-1] - 1)
        # The layout (per row, per head) is fixed by the piece, never by a tensor's value.
        if self.per_head:
            if self.per_row:
                return self.table[b, h, q_tile, kv_tile]
            return self.table[h, q_tile, kv_tile]
        if self.per_row:
            return self.table[b, q_tile, kv_tile]
        return self.table[q_tile, kv_tile]


def _tiles(tile: Any) -> tuple[int, int]:
    """(q_tile, kv_tile) from an int or a pair, each >= 1."""
    if isinstance(tile, (tuple, list)):
        if len(tile) != 2:
            raise ValueError(
                f"tile must be an int or a (q_tile, kv_tile) pair, got {tile!r} ({len(tile)} "
                f"values)"
            )
        return check_int(tile[0], "tile[0]", minimum=1), check_int(tile[1], "tile[1]", minimum=1)
    size = check_int(tile, "tile", minimum=1)
    return size, size


def _as_indices(indices: Any) -> tuple[Tensor, int]:
    """The router's indices as a ``(R, H, n_q_tiles, k)`` int64 CPU tensor, checked, and
    the rank they were given in."""
    if isinstance(indices, Tensor):
        if indices.is_meta:
            raise ValueError(
                f"indices is a meta tensor (shape {tuple(indices.shape)}), which holds no "
                f"values to read: pass it on a real device (e.g. 'cpu')"
            )
        values = indices.detach()
    else:
        try:
            values = torch.as_tensor(indices)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(
                f"indices must be an integer tensor (or nested lists of ints) of shape "
                f"{_LAYOUTS}, got {type(indices).__name__}: {error}"
            ) from error
        if values.numel() == 0 and values.dtype.is_floating_point:
            values = values.to(torch.int64)  # [] and [[]]: no picks, no dtype to read
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise TypeError(
            f"indices must hold integer key tile numbers (-1 for no pick), got dtype {values.dtype}"
        )
    if values.dim() not in (2, 3, 4):
        raise ValueError(
            f"indices must have shape {_LAYOUTS} (the key tiles each query tile picks), got "
            f"shape {tuple(values.shape)}"
        )
    if values.dtype == torch.uint64:  # .to(int64) would wrap values >= 2**63
        values = torch.tensor(values.tolist()) if values.numel() else values.to(torch.int64)
    rank = values.dim()
    if rank > 2 and 0 in values.shape[:-2]:
        raise ValueError(
            f"indices of shape {tuple(values.shape)} hold no batch row or head: the B and H "
            f"dimensions of {_LAYOUTS} are at least 1"
        )
    values = values.to("cpu", torch.int64, copy=True)
    if rank == 3:  # [B, n_q_tiles, k]: one list per row, shared by the heads
        values = values.unsqueeze(1)
    while values.dim() < 4:
        values = values.unsqueeze(0)
    return values, rank


def _checked(values: Tensor, rank: int, q_tile: int, kv_tile: int) -> None:
    bad = (values < -1).nonzero()
    if bad.numel():
        at = tuple(bad[0].tolist())
        where = ", ".join(map(str, at[4 - rank :]))
        raise ValueError(
            f"indices[{where}] = {int(values[at])}: an entry is a key tile number >= 0, or -1 "
            f"for no pick (a top-k list's padding)"
        )
    if values.numel() and (int(values.max()) + 1) * kv_tile - 1 > INT64_MAX:
        raise ValueError(
            f"indices holds key tile {int(values.max())}, whose positions ({kv_tile} per tile) "
            f"do not fit in int64: no sequence reaches it"
        )
    if values.shape[2] * q_tile - 1 > INT64_MAX:
        raise ValueError(
            f"indices holds {values.shape[2]} query tiles of {q_tile} tokens: past int64"
        )


def _trimmed(values: Tensor) -> tuple[Tensor]:
    """The canonical picks: each list sorted, repeats and -1 dropped to the end as -1, no
    slot or trailing query tile that picks nothing, so equal picks are one key."""
    big = torch.where(values < 0, INT64_MAX, values).sort(-1).values
    repeat = torch.zeros_like(big, dtype=torch.bool)
    repeat[..., 1:] = big[..., 1:] == big[..., :-1]
    big = torch.where(repeat, INT64_MAX, big).sort(-1).values
    picks = torch.where(big == INT64_MAX, -1, big)
    used = picks >= 0
    width = int(used.sum(-1).max()) if picks.numel() else 0
    tiles = used.any(-1).flatten(0, 1).any(0).nonzero()
    count = int(tiles.max()) + 1 if tiles.numel() else 0
    return (picks[:, :, :count, :width].contiguous(),)


def selected(indices: Any, *, tile: Any, truncate: bool = False) -> Selected:
    """Sparse attention whose structure is data: each query tile attends the key tiles a
    router picked for it (NSA's selected blocks, DeepSeek's DSA top-k, MoBA's gates).

    Positions are cut into tiles from position 0, ``q_tile`` queries and ``kv_tile`` keys
    each; query ``q`` attends key ``kv`` iff ``kv // kv_tile`` is among the picks of query
    tile ``q // q_tile`` (in the query's batch row and head). The tiles need not be the
    BlockMask's blocks: any tile and ``BLOCK_SIZE`` build exactly, from the picks, with no
    element evaluated. NSA's attention is ``causal() & (selected(idx, tile=64) |
    sliding_window(512))`` and the like; ``&``, ``|`` and ``~`` compose as with any piece.

    Args:
        indices: integer key tile numbers, ``[n_q_tiles, k]`` (every row and head),
            ``[B, n_q_tiles, k]`` (per batch row) or ``[B, H, n_q_tiles, k]`` (per row and
            head) — a tensor, an array or nested lists. Entry ``[..., i, :]`` lists the key
            tiles query tile ``i`` attends; -1 is no pick (the padding of a top-k list) and
            repeats count once. A batch or head dimension of size 1 is shared by every row
            (head), as torch broadcasts a BlockMask's. Query tiles past ``n_q_tiles`` pick
            nothing. Entries are validated where the mask is used: a pick at or past the
            sequence's key tiles (``ceil(max(Q_LEN, KV_LEN) / kv_tile)``), or picks listed for a
            query tile past its end, raise unless ``truncate``.
        tile: the tile size, an int or a ``(q_tile, kv_tile)`` pair, each >= 1 (NSA's
            selection block, 64; 1 picks single keys, as DSA's top-k does).
        truncate: drop picks past the sequence instead of raising where the mask is used
            (docs/algebra.md, "Lengths past the sequence").

    Raises:
        TypeError: indices that are not integers, or a tile that is not an int.
        ValueError: indices of another rank, an entry below -1 (naming it), a tile below 1;
            where the mask is used, a batch (head) dimension that is neither 1 nor B (H), or
            a pick past the sequence without ``truncate``.

    The build reads a table of every (query tile, key tile) pair per row and head,
    ``ceil(S / q_tile) * ceil(S / kv_tile)`` bools, what the mask_mod looks up too.

    Example:
        >>> import flexmask, torch
        >>> picks = torch.tensor([[0, -1], [0, 2], [1, 1]])   # 3 query tiles, top-2
        >>> print(flexmask.selected(picks, tile=2).show(6))
        ■ ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ■ ■
        ■ ■ ⬚ ⬚ ■ ■
        ⬚ ⬚ ■ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ⬚ ⬚
        >>> bm = flexmask.create_block_mask(flexmask.causal() & flexmask.selected(
        ...     torch.tensor([[0], [0], [1]]), tile=128), 1, 1, 384, 384, device="cpu")
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
        ([[[1, 0, 0]]], [[[0, 1, 1]]])
    """
    q_tile, kv_tile = _tiles(tile)
    values, rank = _as_indices(indices)
    _checked(values, rank, q_tile, kv_tile)
    return Selected(*_trimmed(values), q_tile, kv_tile, source_device(indices), truncate)
