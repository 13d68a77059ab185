"""Tree attention: a token attends to itself and its ancestors (shared-prefix packing)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_parents, digest, is_nested, source_device
from flexmask.algebra.mask import Extent, Lowered, Window
from flexmask.blocks.codes import CODE_DTYPE, EMPTY, constant_codes
from flexmask.blocks.grid import BlockGrid
from flexmask.pieces._base import (
    Piece,
    PieceMod,
    WindowMod,
    held_start,
    tracing,
    window_positions,
    window_rows,
)


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
    ranks where a block's ranks are not one run (``_classify_ranked``): no tile evaluated.
    """

    __slots__ = ("parents", "ranks", "ends", "preorder", "per_row")

    settles_every_tile = True
    """``classify_tiles`` returns EMPTY, PARTIAL or FULL for every tile, never UNDECIDED
    (the build then skips looking for undecided tiles)."""

    @property
    def carries_batch_data(self) -> bool:
        return True

    _arg = "parents"

    def __init__(self, parents: Any) -> None:
        per_row = is_nested(parents)
        rows_in = list(parents) if per_row else [parents]
        self.parents = [
            check_parents(p, f"parents[{i}]" if per_row else "parents")
            for i, p in enumerate(rows_in)
        ]
        self.per_row = per_row
        ranks, ends, preorder = zip(*(_ranks_and_ends(p) for p in self.parents), strict=True)
        self.ranks, self.ends, self.preorder = list(ranks), list(ends), list(preorder)
        super().__init__(
            ("tree", digest(*self.parents), per_row),
            rows=len(self.parents) if per_row else None,
            device=source_device(parents),
            natural=max(p.numel() for p in self.parents),
        )

    def check(self, extent: Extent) -> None:
        super().check(extent)
        longest = max(p.numel() for p in self.parents)
        if longest > extent.length:
            raise ValueError(
                f"parents has {longest} tokens, more than the sequence length "
                f"{extent.length_name}={extent.length}"
            )

    def _lookups(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(R, length + 1) int32 rank and subtree end per position.

        Past the tree, rank = position and end = 0: such a kv is nobody's ancestor and such
        a q has a rank beyond every subtree, so neither attends.

        The last length's pair is kept with the device copies (``_placed``, never pickled):
        a build reads them twice (its mask_mod and its tiles), and a re-build again. Read
        only: the BlockMask's mask_mod holds them.
        """
        if tracing():  # tensors made under a trace are the trace's: never kept
            return self._make_lookups(length, device)
        names = (f"lookup rank {length}", f"lookup end {length}")
        rank, end = (self._placed.get((name, device)) for name in names)
        if rank is not None and end is not None:
            return rank, end
        for stale in [k for k in self._placed if k[0].startswith("lookup ")]:
            del self._placed[stale]  # one length kept: memory stays O(tree)
        rank, end = self._make_lookups(length, device)
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

    def _make_lookups(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        rows = len(self.parents)
        rank = torch.arange(length + 1, dtype=torch.int32).repeat(rows, 1)
        end = torch.zeros(rows, length + 1, dtype=torch.int32)
        for row in range(rows):
            n = self.parents[row].numel()
            rank[row, :n] = self.ranks[row]
            end[row, :n] = self.ends[row]
        return rank.to(device), end.to(device)

    def classify_tiles(self, grid: BlockGrid) -> Tensor:
        longest = max(p.numel() for p in self.parents)
        if _least(grid.q_offset) >= longest or _least(grid.kv_offset) >= longest:
            # A side wholly past the tree: its queries attend nothing, or its keys are
            # nobody's ancestor. Every tile is EMPTY, with no lookups over the window's
            # reach (which may be near 2**63).
            return constant_codes(EMPTY, grid.device)
        if not all(self.preorder):
            # Rank space is exact for any layout; rows already in preorder lose nothing to it
            # but a few passes, so mixed batches take it for every row.
            return self._classify_ranked(grid)
        device = grid.device
        rows = len(self.parents)
        nq, nkv, kv_block = grid.num_q_blocks, grid.num_kv_blocks, grid.kv_block
        length = self._tile_length(grid)
        _, end = self._lookups(length, device)  # int32
        end = end[:, grid.kv_offset : grid.kv_end]
        pad = nkv * kv_block - grid.kv_len
        # Per kv block: the largest and smallest subtree end over its in-range tokens.
        max_end = torch.nn.functional.pad(end, (0, pad), value=0) if pad else end
        max_end = max_end.reshape(rows, nkv, kv_block).amax(-1).view(rows, 1, nkv)
        min_end = torch.nn.functional.pad(end, (0, pad), value=length + 1) if pad else end
        min_end = min_end.reshape(rows, nkv, kv_block).amin(-1).view(rows, 1, nkv)
        # In preorder, kv attends q iff kv <= q < end[kv]: for a kv block not after the q
        # block, some q attends iff some end reaches past the block's first query (a token
        # on both sides inside the tree has end > itself >= that query: q == kv attends).
        # The block-index conditions are shared by the rows: one (nq, nkv) pass each.
        q_first = grid.q_first.view(1, nq, 1).to(torch.int32)
        q_last = grid.q_last.view(1, nq, 1).to(torch.int32)
        kv_first = grid.kv_first.view(1, 1, nkv).to(torch.int32)
        kv_last = grid.kv_last.view(1, 1, nkv).to(torch.int32)
        # Each test as "lo <= hi" (a strict one on block bounds less one):
        # full: q_last < min_end and kv_last <= q_first; nonempty: q_first < max_end and
        # kv_first <= q_last.
        tests = (
            (q_last, min_end - 1),
            (kv_last, q_first),
            (q_first, max_end - 1),
            (kv_first, q_last),
        )
        if rows * nq * nkv <= 2 * _CHUNKED_FROM:  # one pass: chunks pay off later
            chunks, step = [(0, nq, nkv)], nq
        else:
            # Large grids a chunk of q blocks at a time (as in ``_classify_ranked``): kv
            # blocks after a chunk's last query are EMPTY, unread; the work in reused buffers.
            chunks, step = _chunks(grid, rows)
        parts = _chunk_parts(tests, chunks, nq)
        codes = torch.empty(rows, nq, nkv, dtype=CODE_DTYPE, device=device)
        work = _work(rows * step * nkv, device, parts[0][0][0].dtype)
        for (first, last, cols), part in zip(chunks, parts, strict=True):
            codes[:, first:last, cols:] = EMPTY
            if cols == 0:
                continue
            _tested_codes(codes[:, first:last, :cols], part, work)
        return codes.view(rows, 1, nq, nkv)

    def _classify_ranked(self, grid: BlockGrid) -> Tensor:
        """Exact codes for any parent-before-child layout, in rank space.

        kv attends q iff ``rank[q]`` lies in kv's subtree ``[rank[kv], end[kv])``. So a
        tile is full iff every kv's subtree holds every q's rank: ``max rank(kv) <=
        min rank(q)`` and ``min end(kv) > max rank(q)`` — exact from per-block extremes.
        It is non-empty iff some q's rank lies in the union ``U`` of its kv block's
        subtrees. Subtrees nest or are disjoint, so ``U`` is the one interval
        ``[lo, hi)`` when the block's lowest rank roots a subtree reaching its highest end
        (a block inside one branch: the common case of insertion order, checked with no
        sort). Where that holds and the q block's ranks are one run, the extremes decide
        the tile; the other tiles are settled by a search of a few ranks in ``U``, sorted
        for those kv blocks alone: the tokens a q block attends are its own tokens and the
        ancestors of its *external parents* (parents outside the block), and ``p``'s
        ancestors meet a kv block iff ``rank[p]`` is in ``U``.
        """
        device = grid.device
        length = self._tile_length(grid)
        rows, big = len(self.parents), length + 2
        nq, nkv, q_block, kv_block = (
            grid.num_q_blocks,
            grid.num_kv_blocks,
            grid.q_block,
            grid.kv_block,
        )
        rank, end = self._lookups(length, device)  # int32: every pass below is half
        sizes = torch.tensor([p.numel() for p in self.parents], device=device, dtype=torch.int32)

        def blocks(values: Tensor, first: int, last: int, n: int, size: int, fill: int) -> Tensor:
            part = values[:, first:last]
            if n * size != last - first:
                part = torch.nn.functional.pad(part, (0, n * size - (last - first)), value=fill)
            return part.reshape(rows, n, size)

        kv_first, q_first = grid.kv_offset, grid.q_offset
        if not isinstance(kv_first, int) or not isinstance(q_first, int):
            # Trees are not monotone: build._row_by_row gives each row a grid of int offsets.
            raise RuntimeError("tree classifies one window at a time: per-row offsets reached it")
        kv_end, q_end = kv_first + grid.kv_len, q_first + grid.q_len  # grid.kv_end, as ints
        # Per kv block. Past the tree rank = position and end = 0, padding end = 0: such a
        # kv roots no subtree. U's bounds over the tokens in the tree.
        kv_rank = blocks(rank, kv_first, kv_end, nkv, kv_block, -1)
        kv_end_b = blocks(end, kv_first, kv_end, nkv, kv_block, 0)
        max_rank_all = kv_rank.amax(-1)  # -1 pads: only in-range tokens count
        min_end_all = (
            kv_end_b.amin(-1)
            if nkv * kv_block == grid.kv_len
            else blocks(end, kv_first, kv_end, nkv, kv_block, big).amin(-1)
        )
        # U's least rank is the block's least rank, read with no pass to pick the tokens in
        # the tree: those past it have rank = position, above every rank in it, so they
        # never win a block that holds one; a block that holds none has U empty (u_hi = 0)
        # whatever u_lo is. Only the -1 padding of the last block is read around.
        u_lo = kv_rank.amin(-1)
        if nkv * kv_block != grid.kv_len:
            last_held = grid.kv_len - (nkv - 1) * kv_block
            u_lo[:, -1] = kv_rank[:, -1, :last_held].amin(-1)
        u_hi = kv_end_b.amax(-1)  # ends of tokens outside the tree are 0
        # The subtree end of the block's least-ranked token, read by its rank (ranks are a
        # permutation of the positions): no argmin, which costs ~9x the amin (1.26 against
        # 0.14 ms over (8, 1024, 128), one run).
        end_by_rank = self._end_by_rank(length, device)
        u_run = end_by_rank.gather(1, u_lo.to(torch.int64)) >= u_hi
        # Per q block: extremes of its ranks, and of those in the tree — the kv blocks'
        # where both sides' blocks are the same tokens (a square build): two reductions
        # over the grid's ranks fewer (0.3-0.5 ms each at 131k B=8).
        same = (q_first, q_end, q_block) == (kv_first, kv_end, kv_block)
        q_ranks = kv_rank if same else blocks(rank, q_first, q_end, nq, q_block, -1)
        max_q_all = max_rank_all if same else q_ranks.amax(-1)
        # A token is in the tree iff its position is below the tree's size (the ranks in
        # it are a permutation of 0..size-1; past it a rank is the position): so each q
        # block's tokens in the tree are a prefix of it, counted from block bounds alone.
        # Their greatest rank is the block's where it holds no other (padding is -1), -1
        # where it holds none, and read token by token only in the one block per row that
        # the tree's end cuts.
        block_first = grid.q_first.view(1, nq)
        in_range = (q_end - block_first).clamp_(max=q_block)  # (1, nq)
        in_tree = (sizes.view(-1, 1).clamp(max=q_end) - block_first).clamp_(min=0)
        in_tree = torch.minimum(in_tree, in_range)  # (R, nq)
        max_q = torch.where(in_tree == in_range, max_q_all, -1)
        max_q.masked_fill_(in_tree == 0, -1)
        cut = ((in_tree > 0) & (in_tree < in_range)).nonzero()
        if cut.numel():
            row, block = cut.unbind(1)
            held = torch.arange(q_block, device=device) < in_tree[row, block].unsqueeze(1)
            max_q[row, block] = torch.where(held, q_ranks[row, block], -1).amax(-1)
        # The least rank of the block's tokens (padding aside). Past the tree a rank is the
        # position, above every rank in it: where the block holds tokens of the tree this
        # is the least of theirs, and where it holds none it is >= the tree's size, past
        # every subtree's end (no tile of it is non-empty) — so it serves as both.
        if same:  # U's least rank is the same least over the same tokens
            full_min_q = u_lo
        elif nq * q_block == grid.q_len:
            full_min_q = q_ranks.amin(-1)
        else:
            full_min_q = blocks(rank, q_first, q_end, nq, q_block, big).amin(-1)
        min_q = full_min_q
        q_run = (max_q - min_q + 1 == in_tree) | (max_q < 0)
        # Tiles, a chunk of q blocks at a time: ancestors come first, so no kv block after a
        # chunk's last query attends it and those tiles stay EMPTY, unread (about half the
        # grid); each chunk's flags fit the cache in a few small buffers reused (a pass over
        # the whole grid per compare wrote fresh pages: half its cost at 131k B=8).
        exact = bool(q_run.all()) and bool(u_run.all())
        if rows * nq * nkv > _CHUNKED_FROM:
            chunks, step = _chunks(grid, rows)
        else:  # small grids in one pass: a chunk's dozen calls cost more than they save
            chunks, step = [(0, nq, nkv)], nq
        codes = torch.empty(rows, nq, nkv, dtype=CODE_DTYPE, device=device)  # each tile once
        # Each test as "lo <= hi" (strict ones on ends less one), per q block / kv block:
        # full: max rank(kv) <= min rank(q), max rank(q) < min end(kv); nonempty: U's least
        # rank <= max rank(q), min rank(q) < U's end.
        q_lo, q_hi = full_min_q.unsqueeze(-1), max_q_all.unsqueeze(-1)
        tests = (
            (max_rank_all.unsqueeze(1), q_lo),
            (q_hi, min_end_all.sub(1).unsqueeze(1)),
            (u_lo.to(torch.int32).unsqueeze(1), max_q.unsqueeze(-1)),
            (min_q.unsqueeze(-1), u_hi.sub(1).unsqueeze(1)),
        )
        parts = _chunk_parts(tests, chunks, nq)
        flag = parts[0][0][0].dtype
        work = _work(rows * min(step, nq) * nkv, device, flag, 3 if exact else 4)
        # Where a side is not one run the hull test is a candidate only: 0/1 flags of the
        # sides that are, in the tests' dtype (as ``_tested_codes``: no bools).
        q_run_flag = q_run.to(flag).unsqueeze(-1)
        u_run_flag = u_run.to(flag).unsqueeze(1)
        unsure_tiles: list[Tensor] = []
        for (first, last, cols), part in zip(chunks, parts, strict=True):
            codes[:, first:last, cols:] = EMPTY
            if cols == 0:
                continue
            if exact:  # the extremes decide every tile: codes from int32 arithmetic
                _tested_codes(codes[:, first:last, :cols], part, work)
                continue
            shape = torch.Size((rows, last - first, cols))
            full, nonempty, sure, unsure = (work[i, : shape.numel()].view(shape) for i in range(4))
            _test_pair(full, part[0], part[1], sure)
            _test_pair(nonempty, part[2], part[3], sure)
            # No kv block after the q block attends it: where the hull test is exact it is
            # already EMPTY there, so this changes only the candidates.
            nonempty &= torch.le(
                grid.kv_first.reshape(1, 1, nkv)[..., :cols],
                grid.q_last.reshape(1, nq, 1)[:, first:last],
                out=sure[:1, : last - first, :cols],
            )
            # sure: the hull test is exact (both sides one run) or the tile is FULL (exact).
            torch.bitwise_and(q_run_flag[:, first:last], u_run_flag[..., :cols], out=sure)
            sure |= full
            torch.gt(nonempty, sure, out=unsure)  # candidate, not settled: searched below
            tiles = unsure.nonzero()
            tiles[:, 1] += first
            unsure_tiles.append(tiles)
            # codes_from(nonempty & (exact or full), full): full implies nonempty.
            nonempty &= sure
            nonempty |= full
            codes[:, first:last, :cols] = nonempty.add_(full)
        if unsure_tiles and sum(t.shape[0] for t in unsure_tiles):
            tiles = torch.cat(unsure_tiles)
            parents = self._external_parents(grid, rank.to(torch.int64))
            found = _search_subtrees(tiles, parents, kv_rank, kv_end_b, big)
            codes[tuple(tiles.unbind(1))] = found.to(codes.dtype)  # PARTIAL (1) or EMPTY (0)
        # Tiles holding one token on both sides inside the tree contain q == kv: a few
        # tiles near the diagonal, listed once and set per row (at least PARTIAL). Where
        # both sides' blocks are the same tokens those are the diagonal's, set through a
        # strided view (0.21 against 0.47 ms for index tensors over (8, 1024, 1024) codes
        # out of cache, and no search for the band).
        if same:
            on_diagonal = codes.diagonal(0, 1, 2)  # (R, nq), block i's first token below
            held = grid.q_first.view(1, nq) < sizes.view(-1, 1)
            torch.maximum(on_diagonal, held.to(CODE_DTYPE), out=on_diagonal)
            return codes.view(rows, 1, nq, nkv)
        band, band_lo = _band(grid)
        diagonal = band_lo.view(1, -1) < sizes.view(-1, 1)  # (R, tiles in the band)
        on_band = codes[:, band[:, 0], band[:, 1]]
        codes[:, band[:, 0], band[:, 1]] = torch.maximum(on_band, diagonal.to(CODE_DTYPE))
        return codes.view(rows, 1, nq, nkv)

    def _tile_length(self, grid: BlockGrid) -> int:
        """Positions the tile lookups cover: the grid's length, shared with its mask_mod's
        and every row's window (one lookup kept); for a window far from position 0
        (``lookup_window``) the tree and the window's own positions only. Both its sides
        then start inside the tree (``classify_tiles`` settles the others at once), so
        that is O(tree + Q + KV)."""
        if grid.lookup_window is None:
            return grid.length
        longest = max(p.numel() for p in self.parents)
        return max(_most(grid.q_end), _most(grid.kv_end), longest)

    def _external_parents(self, grid: BlockGrid, rank: Tensor) -> Tensor:
        """(R, nq, c) ranks of each q block's external parents (-1 pads), c the most any
        block has: the parents outside the block of its tokens in the tree."""
        rows, nq, q_block = len(self.parents), grid.num_q_blocks, grid.q_block
        q_first, q_end = grid.q_offset, grid.q_end
        parent = torch.full((rows, self._tile_length(grid)), -1, dtype=torch.int64)
        for row, p in enumerate(self.parents):
            parent[row, : p.numel()] = p
        parent = parent.to(grid.device)[:, q_first:q_end]
        parent = torch.nn.functional.pad(parent, (0, nq * q_block - grid.q_len), value=-1)
        parent = parent.view(rows, nq, q_block)
        block_first = grid.q_first.view(1, nq, 1)
        outside = torch.where(parent < block_first, parent, -1)
        count = int((outside >= 0).sum(-1).max())
        outside = outside.sort(-1, descending=True).values[..., : max(count, 1)]
        return torch.where(
            outside >= 0,
            rank.gather(1, outside.clamp(min=0).view(rows, -1)).view(outside.shape),
            -1,
        )

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        if window is not None:
            # Each side's lookups at its own positions: a window near 2**63 holds O(Q + KV).
            rows = window_rows(window, len(self.parents))
            q_rank, _ = self._window_lookups(window.q_start, window.q_len, rows, device)
            kv_rank, kv_end = self._window_lookups(window.kv_start, window.kv_len, rows, device)
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

    def _window_lookups(
        self, start: int | Tensor, length: int, rows: int, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """Rank and subtree end of one window side's positions, (rows, length + 1) int32
        with a last (sentinel) column. Past the tree, and there, rank is the tree's size
        (at least every subtree end: such a q attends nothing) and end is 0 (such a kv is
        nobody's ancestor)."""
        longest = max(p.numel() for p in self.parents)
        rank = torch.full((len(self.parents), longest + 1), longest, dtype=torch.int32)
        end = torch.zeros(len(self.parents), longest + 1, dtype=torch.int32)
        for row, parents in enumerate(self.parents):
            rank[row, : parents.numel()] = self.ranks[row]
            end[row, : parents.numel()] = self.ends[row]
        positions = window_positions(start, length, device).expand(rows, -1)
        at = torch.nn.functional.pad(positions.clamp(max=longest), (0, 1), value=longest)
        rank, end = rank.to(device).expand(rows, -1), end.to(device).expand(rows, -1)
        return rank.gather(1, at), end.gather(1, at)

    def __repr__(self) -> str:
        if self.per_row:
            return f"tree(<{len(self.parents)} rows>)"
        p = self.parents[0]
        return f"tree({p.tolist()})" if p.numel() <= 16 else f"tree(<{p.numel()} tokens>)"


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


def _most(end: int | Tensor) -> int:
    """The largest of a grid's window ends (an int, or one per row)."""
    return int(end.max()) if isinstance(end, Tensor) else end


def _least(offset: int | Tensor) -> int:
    """The smallest of a grid's offsets (an int, or one per row)."""
    return int(offset.min()) if isinstance(offset, Tensor) else offset


_CHUNK_TILES = 1 << 19
"""Tiles per chunk of q blocks in ``Tree._classify_ranked``: its flag buffers stay in cache."""

_CHUNKED_FROM = 1 << 18
"""Grids of more tiles than this are classified in chunks of q blocks (``_CHUNK_TILES``)."""


def _chunks(grid: BlockGrid, rows: int) -> tuple[list[tuple[int, int, int]], int]:
    """Chunks of q blocks ``(first, last, cols)`` (at least 4, at most ``_CHUNK_TILES`` tiles
    over the rows), ``cols`` the kv blocks starting at or before the chunk's last query (the
    others are after every query of it), and the most q blocks a chunk holds."""
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    step = max(1, min(_CHUNK_TILES // max(1, rows * nkv), -(-nq // 4)))
    stops = list(range(step, nq, step)) + [nq]
    reach = torch.searchsorted(grid.kv_first.reshape(nkv), grid.q_last.reshape(nq), right=True)
    reach_at = reach[torch.tensor(stops, device=grid.device) - 1].tolist()
    return list(zip(range(0, nq, step), stops, reach_at, strict=True)), step


def _part(
    tests: tuple[tuple[Tensor, Tensor], ...], first: int, last: int, cols: int
) -> tuple[tuple[Tensor, Tensor], ...]:
    """The tests' operands on q blocks ``first:last`` and kv blocks ``:cols``: each sliced
    along the dimensions it holds (a q block's per-row value has one kv column, a kv
    block's one q row, which broadcast)."""

    def part(t: Tensor) -> Tensor:
        t = t[..., first:last, :] if t.shape[-2] > 1 else t
        return t[..., :cols] if t.shape[-1] > 1 else t

    return tuple((part(lo), part(hi)) for lo, hi in tests)


def _work(tiles: int, device: torch.device, dtype: torch.dtype, count: int = 3) -> Tensor:
    """``count`` 0/1 flag buffers of ``tiles`` entries in the tests' ``dtype`` (see
    ``_narrowed``) for ``_tested_codes`` (three) or the inexact branch of
    ``Tree._classify_ranked`` (four), reused across chunks (a chunk's fit the cache)."""
    return torch.empty(count, tiles, dtype=dtype, device=device)


_NARROW = torch.iinfo(torch.int16).max
"""Chunks whose q-side values span less than this are compared as int16 (``_chunk_parts``)."""


def _chunk_parts(
    tests: tuple[tuple[Tensor, Tensor], ...], chunks: list[tuple[int, int, int]], nq: int
) -> list[tuple[tuple[Tensor, Tensor], ...]]:
    """Each chunk's tests ``lo <= hi`` (one side per q block ``(r, nq, 1)``, the other per
    kv block ``(r, 1, m)``) on its q blocks ``first:last`` and kv blocks ``:cols``, as
    int16 where every chunk's q-side values span less than ``_NARROW``, else int32.

    Narrowing is exact: in a chunk whose q-side values lie in ``[a, b]`` a kv-side value
    below ``a`` compares as ``a - 1`` does and one above ``b`` as ``b + 1``, so the kv side
    is clamped to ``[a - 1, b + 1]`` and both sides less ``a - 1`` fit int16. It pays:
    torch's CPU compare is vectorized only into its operands' dtype — an int32 compare
    into int8 flags computes int32 and casts (213 us on an (8, 64, 1024) chunk, one run),
    int16 into int16 takes 30 us. Ranking the values instead costs more than it saves
    (torch's CPU sort of (8, 8192) int32 took 3.5 ms)."""
    count = len(chunks)
    step = chunks[0][1] - chunks[0][0]
    narrowed: list[tuple[Tensor, Tensor, bool]] = []
    for lo, hi in tests:
        q_is_lo = lo.shape[-2] == nq and lo.shape[-1] == 1
        q, kv = (lo, hi) if q_is_lo else (hi, lo)
        r = q.shape[0]
        pad = count * step - nq
        q_rows = q.reshape(r, nq)
        if pad:
            low = torch.nn.functional.pad(q_rows, (0, pad), value=torch.iinfo(q.dtype).max)
            high = torch.nn.functional.pad(q_rows, (0, pad), value=torch.iinfo(q.dtype).min)
        else:
            low = high = q_rows
        base = low.view(r, count, step).amin(-1).sub_(1).unsqueeze(-1)  # (r, chunks, 1)
        top = high.view(r, count, step).amax(-1).add_(1).unsqueeze(-1)
        if int((top - base).max()) > _NARROW:
            return [_part(tests, first, last, cols) for first, last, cols in chunks]
        kv_n = torch.minimum(torch.maximum(kv, base), top).sub_(base).to(torch.int16)
        q_n = q_rows.view(r, -1) - base.repeat_interleave(step, 1).view(r, -1)[:, :nq]
        narrowed.append((q_n.to(torch.int16).view(r, nq, 1), kv_n, q_is_lo))
    parts = []
    for index, (first, last, cols) in enumerate(chunks):
        part = []
        for q_n, kv_n, q_is_lo in narrowed:
            q_side = q_n[:, first:last]
            kv_side = kv_n[:, index : index + 1, :cols]
            part.append((q_side, kv_side) if q_is_lo else (kv_side, q_side))
        parts.append(tuple(part))
    return parts


def _test_pair(
    flags: Tensor, first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor], other: Tensor
) -> None:
    """0/1 ``flags`` (a view at the chunk's shape, in the operands' dtype): where both
    tests ``lo <= hi`` hold. The first is written at the whole shape, the second at the
    shape its operands broadcast to (a block-bound test is shared by the rows) into the
    front of ``other``."""
    torch.le(first[0].expand(flags.shape), first[1], out=flags)
    lo, hi = second  # 3-d, each dimension 1 or the chunk's (no torch.broadcast_shapes:
    # its Python costs ~8 us a call, 0.27 ms a build at 131k B=8)
    flags &= torch.le(
        lo,
        hi,
        out=other[tuple(slice(0, max(a, b)) for a, b in zip(lo.shape, hi.shape, strict=True))],
    )


def _tested_codes(out: Tensor, tests: tuple[tuple[Tensor, Tensor], ...], work: Tensor) -> None:
    """Tile codes into ``out`` (int8 ``(R, n, m)``, a view of the grid) from four tests
    ``lo <= hi`` of operands that broadcast to it (per q block, per kv block, per row or
    shared by the rows): FULL where the first two hold, else PARTIAL where the last two
    hold, else EMPTY — ``codes_from(nonempty, full)``, whose full implies nonempty.

    The flags are 0/1 in the operands' dtype (int16 from ``_narrowed``), not bools nor
    int8: torch's CPU compare is vectorized only into its operands' dtype (int32 operands
    into bools take its scalar loop; into int8 they are computed as int32 and cast). One
    cast at the end writes the codes. The first test of each pair is written at the
    chunk's whole shape; the second may be shared by the rows (block bounds)."""
    shape = out.shape
    full, nonempty, other = (work[i, : shape.numel()].view(shape) for i in range(3))
    _test_pair(full, tests[0], tests[1], other)
    _test_pair(nonempty, tests[2], tests[3], other)
    out.copy_(full.add_(nonempty))


def _band(grid: BlockGrid) -> tuple[Tensor, Tensor]:
    """The tiles whose q and kv token ranges overlap, ``(k, 2)`` (q block, kv block), and
    the first token of each overlap: per q block a short range of kv blocks, found by two
    binary searches (block bounds ascend), not a pass over the tile grid."""
    nq, nkv, device = grid.num_q_blocks, grid.num_kv_blocks, grid.device
    q_lo, q_hi = grid.q_first.reshape(nq), grid.q_last.reshape(nq)
    kv_lo, kv_hi = grid.kv_first.reshape(nkv), grid.kv_last.reshape(nkv)
    first = torch.searchsorted(kv_hi.contiguous(), q_lo)  # first kv block ending at/after q
    last = torch.searchsorted(kv_lo.contiguous(), q_hi, right=True) - 1
    width = int((last - first + 1).clamp(min=0).max()) if nq else 0
    kv_tile = first.view(-1, 1) + torch.arange(width, device=device)
    inside = kv_tile <= last.view(-1, 1)
    q_tile = torch.arange(nq, device=device).view(-1, 1).expand_as(kv_tile)[inside]
    kv_tile = kv_tile[inside]
    return torch.stack([q_tile, kv_tile], 1), torch.maximum(kv_lo[kv_tile], q_lo[q_tile])


def _search_subtrees(
    tiles: Tensor, parents: Tensor, kv_rank: Tensor, kv_end: Tensor, big: int
) -> Tensor:
    """For tiles ``(k, 3)`` = (row, q block, kv block): does some external parent's rank lie
    in the kv block's union of subtrees? The kv blocks these tiles name have their subtrees
    sorted by rank, with the running max of their ends (rank x is in U iff the running end
    at the last rank <= x exceeds x); one search over those blocks laid end to end, each
    block's keys shifted past the previous block's. Tokens outside the tree stay among the
    keys: their end is 0 (they cover nothing), padding's rank -1 sorts first and a rank past
    the tree (its position) sorts after every rank a parent can have."""
    rows, nkv, kv_block = kv_rank.shape
    named = tiles[:, 0] * nkv + tiles[:, 2]
    blocks, which = torch.unique(named, return_inverse=True)
    u_rank = kv_rank.reshape(rows * nkv, kv_block)[blocks].to(torch.int64)
    u_rank, order = u_rank.sort(-1)
    u_end = kv_end.reshape(rows * nkv, kv_block)[blocks].to(torch.int64).gather(-1, order)
    u_end = u_end.cummax(-1).values
    stride = big + 1
    line = torch.arange(blocks.numel(), device=u_rank.device).view(-1, 1)
    keys = (line * stride + u_rank).view(-1)
    ends = u_end.reshape(-1)
    found = torch.empty(tiles.shape[0], dtype=torch.bool, device=tiles.device)
    per_chunk = max(1, (1 << 20) // parents.shape[-1])
    for start in range(0, tiles.shape[0], per_chunk):
        row, q_tile, _ = tiles[start : start + per_chunk].unbind(1)
        ranks = parents[row, q_tile]  # (k, c)
        block = which[start : start + per_chunk].view(-1, 1)
        at = torch.searchsorted(keys, block * stride + ranks, right=True) - 1
        inside = (ranks >= 0) & (at >= block * kv_block)
        covered = inside & (ends[at.clamp(min=0)] > ranks)
        found[start : start + per_chunk] = covered.any(-1)
    return found


def _ranks_and_ends(parents: Tensor) -> tuple[Tensor, Tensor, bool]:
    """Preorder rank and subtree end (exclusive, in rank space) of every token.

    Fast path, vectorised: if the layout is already a preorder, the subtree of v is the run
    after v up to the first u > v with parents[u] < v; a sparse table of range minima and
    binary lifting find that u for all v in O(N log N). The layout is a preorder iff every
    token lies inside its parent's run. Otherwise an O(N) depth-first walk renumbers it.
    """
    n = parents.numel()
    levels = max(1, (n + 1).bit_length())
    padded = torch.full((n + 1 + (1 << levels),), -2, dtype=torch.int64)
    padded[:n] = parents
    table = [padded]
    for k in range(1, levels):
        prev = table[-1]
        half = 1 << (k - 1)
        table.append(torch.minimum(prev[:-half], prev[half:]))
    v = torch.arange(n, dtype=torch.int64)
    pos = v + 1
    for k in range(levels - 1, -1, -1):
        stay_inside = table[k][pos] >= v
        pos = torch.where(stay_inside, pos + (1 << k), pos)
    end = pos.clamp(max=n)
    child = parents >= 0
    if bool((v[child] < end[parents[child]]).all()):
        return v, end, True
    return (*_renumber(parents), False)


def _renumber(parents: Tensor) -> tuple[Tensor, Tensor]:
    n = parents.numel()
    parent_list = parents.tolist()
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for i, p in enumerate(parent_list):
        (children[p] if p >= 0 else roots).append(i)
    order: list[int] = []
    stack = roots[::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    size = [1] * n
    for i in range(n - 1, -1, -1):  # parents come before children
        if parent_list[i] >= 0:
            size[parent_list[i]] += size[i]
    rank = torch.empty(n, dtype=torch.int64)
    rank[torch.tensor(order)] = torch.arange(n)
    return rank, rank + torch.tensor(size)


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
