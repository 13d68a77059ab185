"""Both sides of a closed-form shard from segments: O(pieces + touched runs + output).

A side's lines (kv side: the rank's q blocks; q side: the permuted kv blocks) are cut into
*pieces*, ranges of consecutive original positions inside one block, and its columns are
the *runs* of the other axis's permutation (consecutive original positions at consecutive
permuted ones). For a mask with monotone intervals (``flexmask.builders.closed_form``) each
piece attends one original interval and covers another (every position of the piece
attends all of it). Such an interval meets a range of runs in original order (two binary
searches), and inside each run it is one permuted interval: so a piece's blocks are a few
ranges of column blocks, one per run it touches, never a loop over all column pieces.

A line's state along its columns then follows from range events: non-empty where any of
its pieces' ranges lies, full where each piece's covered ranges (merged where they touch
across runs) hold the whole block and the line is complete. The events, sorted by line and
column block, cut every line into segments of one state, and each index tensor is those
segments laid out in torch's order (listed blocks ascending, then the others) and expanded
in one pass (``write_runs``).

The keys attending a query are an interval, and so are the queries attending a key
(``[u(k), v(k)]`` with ``u`` the first query whose ``hi`` reaches ``k`` and ``v`` the last
whose ``lo`` does: the attending queries are a prefix along which ``lo`` and ``hi`` never
decrease), so the q side is the same computation with the axes swapped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.blocks import Ordered, index_tensors

# Tile widths ``write_runs`` picks from, widest first: a wider tile is fewer template rows
# to copy, a narrower one fewer tiles cut by a run boundary (computed apart).
_TILE_WIDTHS = (64, 32, 16, 8)


def write_runs(out: Tensor, starts: Tensor, lens: Tensor) -> None:
    """Writes runs laid end to end into ``out`` (flat int32 of ``lens.sum()`` entries): entry
    ``e`` of run ``k`` holds ``starts[k] + e``; ``starts >= 0``. One pass over ``out``.

    ``out`` is cut into tiles of ``w`` entries. A tile inside one run is ``w`` consecutive
    values: a window of ``arange(top)``. The few tiles a run boundary cuts are computed
    apart, on their own entries (a running sum from the value at their start and the jumps
    at the boundaries inside), and laid after it. One ``index_select`` of those windows
    (rows of an overlapping view), one per tile, then writes every entry of ``out`` once.
    Temporaries: per run, per tile (``numel / w``), and the cut tiles (under 1/16).
    """
    total = out.numel()
    if total == 0:
        return
    # Positions and values fit int32 below 2^31 entries (values are below the line length).
    index = torch.int32 if total < 2**31 - 2 * _TILE_WIDTHS[0] else torch.int64
    starts, lens = starts.reshape(-1).to(index), lens.reshape(-1).to(index)
    first = lens.cumsum(0, dtype=index) - lens  # where each run begins in ``out``
    # Where the value stops counting up by one, the jump there (an empty run's start is
    # arbitrary: its jump and the next run's meet at one place and add up).
    jump = starts[1:] - (starts[:-1] + lens[:-1])
    moved = torch.nonzero(jump).flatten()
    where, jump = first.index_select(0, moved + 1), jump.index_select(0, moved)
    top = int((starts + lens).max())  # above every value
    # Tiles as wide as keeps the cut ones under 1/16 of ``out``.
    w = next((w for w in _TILE_WIDTHS if 16 * where.numel() * w <= total), _TILE_WIDTHS[-1])
    tiles = -(-total // w)  # the last one may be short
    # The value at each tile's start: the first run's start, w per tile before it and the
    # jumps at or before it, as one running sum.
    at_start = torch.full((tiles + 1,), w, dtype=index)
    at_start[0] = starts[0]
    at_start.index_add_(0, (where + (w - 1)).div_(w, rounding_mode="floor"), jump)
    at_start = at_start[:tiles].cumsum_(0)
    # Cut tiles: a jump inside (not at the start), or the short last tile.
    inside = torch.nonzero(where % w).flatten()
    where, jump = where.index_select(0, inside), jump.index_select(0, inside)
    tile_of = where.div(w, rounding_mode="floor")
    cut = tile_of if total % w == 0 else torch.cat([tile_of, tile_of.new_tensor([tiles - 1])])
    cut = torch.unique(cut)  # sorted
    # The template: values 0..top-1, then the cut tiles, read as overlapping rows of w (row s
    # is entries [s, s + w)): a whole tile starting at value v is row v (v + w <= top), cut
    # tile j row top + j * w. Small (top + cut entries), each entry written in place.
    top = max(top, w)
    values = torch.empty(top + cut.numel() * w, dtype=torch.int32)
    torch.arange(top, dtype=torch.int32, out=values[:top])
    rows = values[top:].view(cut.numel(), w)
    rows.fill_(1)
    rows[:, 0] = at_start.index_select(0, cut)
    at = torch.searchsorted(cut, tile_of).mul_(w).add_(where % w)
    rows.view(-1).index_add_(0, at, jump.to(torch.int32))
    rows.cumsum_(1)
    template = values.as_strided((values.numel() - w + 1, w), (1, 1))
    whole = total // w
    pick = at_start[:whole]
    whole_cut = cut[: cut.numel() - (total % w != 0)]
    pick[whole_cut] = torch.arange(top, top + whole_cut.numel() * w, w, dtype=index)
    torch.index_select(template, 0, pick, out=out[: whole * w].view(whole, w))
    if total % w:
        out[whole * w :].copy_(rows[-1, : total % w])


class Pieces(NamedTuple):
    """One side's line pieces, ``(R, n)`` intervals in the columns' original positions
    (empty where ``lo > hi``), ``line`` the line block of each piece ``(n,)``."""

    line: Tensor
    some_lo: Tensor
    some_hi: Tensor
    cover_lo: Tensor
    cover_hi: Tensor


class Columns(NamedTuple):
    """The column axis: its runs sorted by original start (permuted start, original start,
    original last), its length and block size."""

    perm_start: Tensor
    orig_start: Tensor
    orig_last: Tensor
    length: int
    block: int

    @classmethod
    def of(cls, runs: tuple[Tensor, Tensor, Tensor], length: int, block: int) -> Columns:
        local, orig, lengths = runs
        order = torch.argsort(orig)
        orig = orig[order]
        return cls(local[order], orig, orig + lengths[order] - 1, length, block)

    @property
    def num_blocks(self) -> int:
        return -(-self.length // self.block)


def cut(order: Tensor, run_starts: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Pieces of an axis in permuted order: cut at blocks and runs. (starts, lengths)."""
    n = order.numel()
    cuts = torch.zeros(n, dtype=torch.bool)
    cuts[::block] = True
    cuts[run_starts] = True
    starts = torch.nonzero(cuts).flatten()
    return starts, torch.diff(starts, append=torch.tensor([n]))


def _pairs(cols: Columns, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every (piece, run) whose intersection is non-empty: the flat piece index and the
    intersection as permuted positions ``[x0, x1]``."""
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    first = torch.searchsorted(cols.orig_last, lo)
    last = torch.searchsorted(cols.orig_start, hi, right=True)
    count = torch.where(lo <= hi, (last - first).clamp_(min=0), 0)
    src = torch.repeat_interleave(torch.arange(lo.numel()), count)
    # (index_select: torch's advanced indexing costs several times more on 1-D tensors.)
    k = (first - (count.cumsum(0) - count)).index_select(0, src) + torch.arange(src.numel())
    orig_start = cols.orig_start.index_select(0, k)
    shift = cols.perm_start.index_select(0, k) - orig_start
    x0 = torch.maximum(lo.index_select(0, src), orig_start).add_(shift)
    x1 = torch.minimum(hi.index_select(0, src), cols.orig_last.index_select(0, k)).add_(shift)
    return src, x0, x1


def pair_count(cols: Columns, lo: Tensor, hi: Tensor) -> int:
    """How many (piece, run) pairs ``_pairs`` would list (to choose a path before it)."""
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    first = torch.searchsorted(cols.orig_last, lo)
    last = torch.searchsorted(cols.orig_start, hi, right=True)
    return int(torch.where(lo <= hi, (last - first).clamp_(min=0), 0).sum())


def _covered(src: Tensor, x0: Tensor, x1: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """Whole column blocks inside each piece's covered positions (its runs' intervals merged
    where they touch in permuted order): (piece, first block, last block), non-empty."""
    if src.numel() == 0:
        return src, src, src
    order = torch.argsort(src * (int(x1.max()) + 2) + x0)
    src, x0, x1 = (t.index_select(0, order) for t in (src, x0, x1))
    begins = torch.ones_like(src, dtype=torch.bool)
    begins[1:] = (src[1:] != src[:-1]) | (x0[1:] != x1[:-1] + 1)
    starts = torch.nonzero(begins).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([src.numel()])]) - 1
    first = (x0.index_select(0, starts) + block - 1).div_(block, rounding_mode="floor")
    last = (x1.index_select(0, ends) + 1).div_(block, rounding_mode="floor") - 1
    keep = torch.nonzero(first <= last).flatten()
    return (
        src.index_select(0, starts).index_select(0, keep),
        first.index_select(0, keep),
        last.index_select(0, keep),
    )


def _listed_first(line: Tensor, listed: Tensor, line_start: Tensor) -> Tensor:
    """The order that puts each line's listed segments first, then the others, each in
    their order (a stable partition by line, as a sort would give, in O(segments)):
    segment ``s`` goes to ``placed[s]``; ``line_start[l]`` is line ``l``'s first segment."""
    n = line.numel()
    listed_until = listed.to(torch.int64).cumsum(0)  # listed segments up to s, inclusive
    start = line_start.index_select(0, line)
    before = listed_until.index_select(0, start) - listed.index_select(0, start).to(torch.int64)
    listed_in_line = listed_until - before  # inclusive count inside the line
    ends = torch.cat([line_start[1:], line_start.new_tensor([n])]) - 1
    line_listed = listed_until.index_select(0, ends) - before.index_select(0, line_start)
    rank = torch.arange(n) - start
    dest = torch.where(
        listed,
        start + listed_in_line - 1,
        start + line_listed.index_select(0, line) + (rank - listed_in_line),
    )
    return torch.empty_like(dest).scatter_(0, dest, torch.arange(n))


def side(
    pieces: Pieces,
    cols: Columns,
    num_lines: int,
    complete: Tensor,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One side's (partial_num, partial_idx, full_num, full_idx), ``(R, lines[, blocks])``.

    ``complete``: (lines,) whether each line block holds a whole block of positions (an
    incomplete one is never full, as torch pads it with masked positions). ``out``: the
    two index tensors to write into (int32, CPU), else new ones.
    """
    rows, n = pieces.some_lo.shape
    block, m = cols.block, cols.num_blocks
    line_of = (torch.arange(rows).view(rows, 1) * num_lines + pieces.line.view(1, n)).reshape(-1)
    per_line = torch.bincount(pieces.line, minlength=num_lines)
    src, x0, x1 = _pairs(cols, pieces.some_lo, pieces.some_hi)
    some_line = line_of.index_select(0, src)
    full_src, full_first, full_last = _covered(
        *_pairs(cols, pieces.cover_lo, pieces.cover_hi), block
    )
    full_line = line_of.index_select(0, full_src)
    lines = torch.arange(rows * num_lines)
    # Events keyed by (line, column block), each a change of the two counts packed in one
    # int64 (non-empty ranges + 2^32 full ranges); a line's own ends cut it at 0 and m.
    width = m + 1
    key = torch.cat(
        [
            some_line * width + x0.div_(block, rounding_mode="floor"),
            some_line * width + x1.div_(block, rounding_mode="floor") + 1,
            full_line * width + full_first,
            full_line * width + full_last + 1,
            lines * width,
            lines * width + m,
        ]
    )
    ns, nf, nl = some_line.numel(), full_line.numel(), lines.numel()
    delta = torch.cat(
        [
            key.new_ones(ns),
            key.new_full((ns,), -1),
            key.new_full((nf,), 1 << 32),
            key.new_full((nf,), -(1 << 32)),
            key.new_zeros(2 * nl),
        ]
    )
    key, order = torch.sort(key)
    # Every line's changes add up to zero, so a running sum is each line's own; after the
    # last change at a column block both counts are true (>= 0) and unpack exactly.
    counts = delta.index_select(0, order).cumsum_(0)
    length = torch.diff(key, append=key.new_tensor([key[-1]]))
    # A segment runs to the next event of its line; the line's end event (at m) starts none.
    kept = torch.nonzero((length > 0) & (key % width != m)).flatten()
    key, length, counts = (t.index_select(0, kept) for t in (key, length, counts))
    line, at = key.div(width, rounding_mode="floor"), key % width
    block_of_line = line % num_lines
    full_count = counts.bitwise_right_shift(32)
    is_full = (full_count == per_line.index_select(0, block_of_line)) & complete.index_select(
        0, block_of_line
    )
    is_partial = ((counts - (full_count << 32)) > 0) & ~is_full
    # Every line has a segment at column 0: where each line's segments begin.
    line_start = torch.nonzero(at == 0).flatten()
    made = []
    for k, listed in enumerate((is_partial, is_full)):
        num = torch.zeros(rows * num_lines, dtype=torch.int64).index_add_(0, line, length * listed)
        placed = _listed_first(line, listed, line_start)
        idx = index_tensors([(rows, num_lines, m)], line.device)[0] if out is None else out[k]
        write_runs(idx.view(-1), at.index_select(0, placed), length.index_select(0, placed))
        made += [num.to(torch.int32).view(rows, num_lines), idx]
    return made[0], made[1], made[2], made[3]


def q_pieces(lo: Tensor, hi: Tensor, starts: Tensor, block: int, total: int) -> Pieces:
    """The kv side's pieces: the rank's local queries (``q_perm``, their original
    positions; ``lo``/``hi`` ``(R, local)`` their clipped intervals) cut at ``starts``.
    A piece attends the union of its queries' intervals (they touch), and covers their
    intersection where every one of them attends."""
    rows, local = lo.shape
    piece = torch.zeros(local, dtype=torch.int64)
    piece[starts[1:]] = 1
    piece = piece.cumsum(0).view(1, -1).expand(rows, -1)
    attends = lo <= hi
    n = starts.numel()

    def reduce(values: Tensor, how: str, fill: int) -> Tensor:
        out = torch.full((rows, n), fill, dtype=values.dtype)
        return out.scatter_reduce_(1, piece, values, how, include_self=False)

    every = reduce(attends.to(torch.int64), "amin", 0).bool()
    cover_lo = torch.where(every, reduce(lo, "amax", total), total)
    cover_hi = torch.where(every, reduce(hi, "amin", -1), -1)
    return Pieces(
        starts.div(block, rounding_mode="floor"),
        reduce(torch.where(attends, lo, total), "amin", total),
        reduce(torch.where(attends, hi, -1), "amax", -1),
        cover_lo,
        cover_hi,
    )


def kv_pieces(
    lo: Tensor,
    hi: Tensor,
    q_perm: Tensor,
    kv_first: Tensor,
    starts: Tensor,
    lengths: Tensor,
    block: int,
    total: int,
) -> Pieces:
    """The q side's pieces: permuted keys cut at ``starts`` (``kv_first`` their first
    original key; each piece ``lengths`` consecutive keys). The local queries attending
    key ``k`` are those, in original order, from the first whose ``hi`` reaches ``k`` to
    the last whose ``lo`` does (``lo``/``hi`` ``(R, local)`` in ``q_perm``'s order)."""
    rows = lo.shape[0]
    q_sorted, order = torch.sort(q_perm)
    lo, hi = lo[:, order], hi[:, order]
    attends = lo <= hi  # a prefix of the sorted queries; the rest sort last with a big lo/hi
    lo = torch.where(attends, lo, total).contiguous()
    hi = torch.where(attends, hi, total).contiguous()
    k0 = kv_first.view(1, -1).expand(rows, -1).contiguous()
    k1 = k0 + (lengths.view(1, -1) - 1)

    def first(k: Tensor) -> Tensor:  # first sorted query with hi >= k
        return torch.searchsorted(hi, k)

    def last(k: Tensor) -> Tensor:  # last sorted query with lo <= k
        return torch.searchsorted(lo, k, right=True) - 1

    def interval(a: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
        valid = a <= z
        top = q_sorted.numel() - 1
        a_q = q_sorted[a.clamp(max=top)]
        z_q = q_sorted[z.clamp(min=0)]
        return torch.where(valid, a_q, total), torch.where(valid, z_q, -1)

    some_lo, some_hi = interval(first(k0), last(k1))
    cover_lo, cover_hi = interval(first(k1), last(k0))
    return Pieces(starts.div(block, rounding_mode="floor"), some_lo, some_hi, cover_lo, cover_hi)


def complete_lines(length: int, block: int) -> Tensor:
    """(lines,) whether each block of an axis of ``length`` positions is whole."""
    lines = -(-length // block)
    return (torch.arange(lines) + 1) * block <= length


def segment_sides(
    lo: Tensor,
    hi: Tensor,
    q_perm: Tensor,
    q_runs: tuple[Tensor, Tensor, Tensor],
    kv_perm: Tensor,
    kv_runs: tuple[Tensor, Tensor, Tensor],
    block: int | tuple[int, int],
) -> tuple[Ordered, Ordered]:
    """Both sides of a shard from the clipped intervals ``lo``/``hi`` ``(R, local)`` of the
    rank's queries (``q_perm`` order) against the keys in ``kv_perm`` order, at ``block``
    (an int, or ``(q_block, kv_block)``: queries are cut at query blocks, keys at key
    blocks)."""
    q_block, kv_block = (block, block) if isinstance(block, int) else block
    total, local = kv_perm.numel(), q_perm.numel()
    q_starts, _ = cut(q_perm, q_runs[0], q_block)
    kv_starts, kv_lens = cut(kv_perm, kv_runs[0], kv_block)
    queries = q_pieces(lo, hi, q_starts, q_block, total)
    keys = kv_pieces(lo, hi, q_perm, kv_perm[kv_starts], kv_starts, kv_lens, kv_block, total)
    nq, nkv = -(-local // q_block), -(-total // kv_block)
    kv = side(queries, Columns.of(kv_runs, total, kv_block), nq, complete_lines(local, q_block))
    q = side(keys, Columns.of(q_runs, local, q_block), nkv, complete_lines(total, kv_block))
    rows = lo.shape[0]
    return (
        Ordered(*(t.view(rows, 1, *t.shape[1:]) for t in kv)),
        Ordered(*(t.view(rows, 1, *t.shape[1:]) for t in q)),
    )
