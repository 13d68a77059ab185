"""Runs of equal codes along the lines of a grid of tile codes: found (``kv_runs`` along
the rows, ``q_runs`` down the columns, ``q_runs_from_kv`` down the columns from the rows'
runs without the grid) and expanded into consecutive values (``expand_runs``). The writer
(``write``) ranks a line's runs into torch's order; builders that know their runs in
closed form expand them here too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def exporting() -> bool:
    """True while ``torch.export`` traces: shapes must not follow tensor values then."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # torch >= 2.4
    return bool(is_exporting is not None and is_exporting())


class CodeRuns(NamedTuple):
    """The runs of equal codes along each line of one side, in line order then column
    order (every line starts one at column 0); ``(runs,)`` each, ``value`` the code: int32
    on grids whose positions fit it (``_narrow``: every pass over the runs reads half the
    bytes), else int64."""

    line: Tensor
    col: Tensor
    length: Tensor
    value: Tensor


def _div_mod(
    values: Tensor, divisor: int, *, div: bool = True, mod: bool = True
) -> tuple[Tensor, Tensor]:
    """Floor quotient and remainder of non-negative int64 ``values`` by ``divisor`` (those
    asked for; the other is ``values``): by a shift and a mask where ``divisor`` is a power
    of two (chunks of 16, lines of a power-of-two block count), since torch's CPU int64
    division and remainder cost several times a shift."""
    if divisor & (divisor - 1) == 0:
        shift = divisor.bit_length() - 1
        return (
            values >> shift if div else values,
            values & (divisor - 1) if mod else values,
        )
    return (
        values.div(divisor, rounding_mode="floor") if div else values,
        values % divisor if mod else values,
    )


def _narrow(total: int) -> torch.dtype:
    """The dtype runs over ``total`` tiles are held in: int32 where every position, and one
    line past the last, fits it."""
    return torch.int32 if total < (1 << 30) else torch.int64


def _run_starts(grid: Tensor, along_rows: bool) -> Tensor | None:
    """Flat positions (ascending) in a contiguous ``(G, rows, cols)`` grid where a run of
    equal codes begins: along each row (``along_rows`` False: the kv side's lines) or down
    each column (True: the q side's lines, read without transposing the grid). None when
    they are many (over one in eight tiles: a column-by-column rank is cheaper then).

    One pass compares neighbours; starts are found in 8-byte words first (by groups of
    words, ``_nonzero_words``), then only the words that hold a start are read bytewise."""
    total = grid.numel()
    if (
        along_rows
        and grid.shape[2] % 8 == 0
        and grid.dtype.itemsize == 1
        and grid.storage_offset() % 8 == 0
    ):
        return _starts_down_by_words(grid)
    words = (total + 7) // 8
    change_words = torch.empty(words, dtype=torch.int64, device=grid.device)
    change_bytes = change_words.view(torch.bool)
    change_bytes[total:] = False
    change = change_bytes[:total].view(grid.shape)
    if along_rows:
        change[:, 0] = True  # every line starts a run at its first tile
        torch.ne(grid[:, 1:], grid[:, :-1], out=change[:, 1:])
    else:
        change[..., 0] = True
        torch.ne(grid[..., 1:], grid[..., :-1], out=change[..., 1:])
    hit = _nonzero_words(change_words)
    byte = change_bytes.view(words, 8).index_select(0, hit).nonzero()
    starts = hit.index_select(0, byte[:, 0]).mul_(8).add_(byte[:, 1])
    return None if starts.numel() * 8 > total else starts


def _starts_down_by_words(grid: Tensor) -> Tensor | None:
    """``_run_starts`` down the columns of a contiguous ``(G, rows, cols)`` grid of bytes
    whose rows are whole 8-byte words: each word compared with the word above it, into
    one flag per word (an eighth of the flags a byte compare writes, and no pass to read
    them back as words), then only the words that differ compared byte by byte."""
    g_rows, rows, cols = grid.shape
    per_row = cols // 8
    words = grid.view(torch.int64)  # (G, rows, cols / 8)
    count = words.numel()
    flags = torch.empty((count + 7) // 8, dtype=torch.int64, device=grid.device)
    differs = flags.view(torch.bool)
    differs[count:] = False
    by_word = differs[:count].view(words.shape)
    by_word[:, 0] = True  # every column's line starts a run at its first tile
    torch.ne(words[:, 1:], words[:, :-1], out=by_word[:, 1:])
    flagged = _nonzero_words(flags)
    at = differs.view(-1, 8).index_select(0, flagged).nonzero()
    hit = flagged.index_select(0, at[:, 0]).mul_(8).add_(at[:, 1])  # words that differ
    first_row = _div_mod(hit, rows * per_row, div=False)[1] < per_row
    above = torch.where(first_row, hit, hit - per_row)
    as_bytes = grid.reshape(-1, 8)
    changed = as_bytes.index_select(0, hit) != as_bytes.index_select(0, above)
    changed |= first_row.view(-1, 1)
    byte = changed.nonzero()
    starts = hit.index_select(0, byte[:, 0]).mul_(8).add_(byte[:, 1])
    return None if starts.numel() * 8 > grid.numel() else starts


_GROUP = 16
"""Words per group of ``_nonzero_words``' first level (128 tiles of a grid of codes)."""


def _nonzero_words(words: Tensor) -> Tensor:
    """Indices (ascending) of the nonzero entries of flat int64 ``words`` of 0/1 bytes
    (so none is negative), in two levels: the groups of ``_GROUP`` words holding one,
    from their maxima (a reduction, several times faster than torch's CPU ``nonzero`` per
    word), then ``nonzero`` over those groups alone. Run starts cluster (a long tree's grid
    is mostly empty), so most groups hold none; where over half the groups hold one, one
    ``nonzero`` over every word."""
    n = words.numel()
    groups = n // _GROUP
    if groups < 1024:  # small: the first level's calls cost more than they save
        return words.nonzero().squeeze(1)
    head = words[: groups * _GROUP].view(groups, _GROUP)
    held = head.amax(1).nonzero().squeeze(1)
    if held.numel() * 2 > groups:  # dense: gathering the groups would cost more
        return words.nonzero().squeeze(1)
    inner = head.index_select(0, held).view(-1).nonzero().squeeze(1)
    hit = held.index_select(0, _div_mod(inner, _GROUP, mod=False)[0])
    hit.mul_(_GROUP).add_(_div_mod(inner, _GROUP, div=False)[1])
    if groups * _GROUP == n:
        return hit
    tail = words[groups * _GROUP :].nonzero().squeeze(1).add_(groups * _GROUP)
    return torch.cat([hit, tail])


def kv_runs(grid: Tensor) -> CodeRuns | None:
    """Runs along the rows of a contiguous ``(G, rows, cols)`` grid: lines are its rows."""
    cols = grid.shape[-1]
    found = _run_starts(grid, along_rows=False)
    if found is None:
        return None
    starts = found.to(_narrow(grid.numel()))
    length = torch.diff(starts, append=starts.new_tensor([grid.numel()]))
    value = grid.view(-1).index_select(0, found).to(starts.dtype)
    return CodeRuns(*_div_mod(starts, cols), length, value)


def q_runs(grid: Tensor) -> CodeRuns | None:
    """Runs down the columns of a contiguous ``(G, rows, cols)`` grid: lines are its
    columns (the transposed grid's rows), found on the grid as it lies."""
    starts = _run_starts(grid, along_rows=True)
    if starts is None:
        return None
    return _q_runs_at(starts, grid.view(-1).index_select(0, starts), grid.shape)


def q_runs_from_kv(kv: CodeRuns, shape: torch.Size, *, few: bool = True) -> CodeRuns | None:
    """The runs down the columns of a ``(G, rows, cols)`` grid of codes (the q side's)
    from its runs along the rows (``kv``: in line order, each line's first at column 0,
    none empty; equal neighbours may stay apart), without the grid: None when they are
    many (over one in eight tiles, as ``_run_starts``) and ``few`` asks for few (a caller
    with a grid to rank instead).

    A q-side run starts at tile (i, j) iff i is a plane's first row or rows i - 1 and i
    hold different codes at j. Both rows are constant between their run starts, so they
    differ on whole intervals between the points of both rows' starts merged: row i's own
    (A) and row i - 1's moved one row down (B), one sort of keys ``row * cols + col``. At
    each merged point the last A and the last B at or before it (a running max) are the
    runs of rows i and i - 1 that hold it. The intervals where their codes differ are
    expanded into their tiles; the planes' first rows start a run at every column, with
    their own runs' codes. A union's q side so needs no int8 grid of codes and no pass
    down its columns."""
    g_rows, rows, cols = shape
    total = g_rows * rows * cols
    line, col, length, value = kv
    n, dev = line.numel(), line.device
    narrow = _narrow(total)
    a_key = line.to(narrow) * cols + col.to(narrow)
    keys, order = torch.cat([a_key, a_key + cols]).sort(stable=True)
    is_a = order < n
    none = order.new_full((1,), -1).expand_as(order)
    own = torch.where(is_a, order, none).cummax(0).values  # row i's run at each point
    above = torch.where(is_a, none, order - n).cummax(0).values  # row i - 1's
    code = value.index_select(0, own)
    point_line = _div_mod(keys, cols, mod=False)[0]
    # A plane's first row has no row above (a B point there is the last row of the plane
    # before): its starts are added whole below. Ties (A and B at one key) leave the first
    # of the two an empty interval.
    differs = (code != value.index_select(0, above.clamp(min=0))) & (
        _div_mod(point_line, rows, div=False)[1] != 0
    )
    stop = torch.cat([keys[1:], keys.new_full((1,), total)])
    spans = torch.minimum(stop, (point_line + 1) * cols).sub_(keys).clamp_(min=0)
    kept = (differs & (spans > 0)).nonzero().squeeze(1)
    spans, first_rows = spans.index_select(0, kept), g_rows * cols
    count = int(spans.sum()) + first_rows
    if few and count * 8 > total:
        return None
    starts = torch.empty(count, dtype=narrow, device=dev)
    plane_first = torch.arange(g_rows, dtype=narrow, device=dev).mul_(rows * cols).view(-1, 1)
    starts[:first_rows].view(g_rows, cols).copy_(
        plane_first + torch.arange(cols, dtype=narrow, device=dev)
    )
    expand_runs(starts[first_rows:], keys.index_select(0, kept), spans)
    # Codes at the starts: the first rows' runs, each repeated over its columns; then each
    # interval's code of row i.
    top = (_div_mod(line, rows, div=False)[1] == 0).nonzero().squeeze(1)
    codes = torch.cat(
        [
            value.index_select(0, top).repeat_interleave(length.index_select(0, top)),
            code.index_select(0, kept).repeat_interleave(spans),
        ]
    )
    return _q_runs_at(starts, codes, shape)


def _q_runs_at(starts: Tensor, code: Tensor, shape: torch.Size) -> CodeRuns:
    """The q side's runs of a ``(G, rows, cols)`` grid from the flat positions where they
    start (any order) and the code there, in the transposed grid's order."""
    g_rows, rows, cols = shape
    total = g_rows * rows * cols
    plane, tile = _div_mod(starts, rows * cols)
    row, col = _div_mod(tile, cols)
    # The start's flat position in the transposed grid: line-major, as the output lists.
    key = (plane * cols + col) * rows + row
    # As int32 where they fit: torch sorts those faster than int64 keys.
    transposed, order = key.to(_narrow(total)).sort()
    length = torch.diff(transposed, append=transposed.new_tensor([total]))
    value = code.index_select(0, order).to(transposed.dtype)
    return CodeRuns(*_div_mod(transposed, rows), length, value)


_CHUNKED_FROM = 1 << 20
"""Outputs of at least this many entries are expanded in chunks (``_expand_runs_chunked``):
below, its few dozen calls cost more than the cumsum they save."""


def expand_runs(out: Tensor, starts: Tensor, lens: Tensor, nonempty: bool = False) -> None:
    """Writes runs ``(N, r)`` laid end to end into ``out`` (flat int32 of ``lens.sum()``
    entries): entry ``e`` of run ``k`` holds ``starts[k] + e``. Large outputs of long runs
    in one write (``_expand_runs_chunked``); others as a cumsum (``_expand_runs_cumsum``).
    ``nonempty``: the caller knows every run has an entry (no pass to drop empty ones)."""
    starts, lens = starts.reshape(-1), lens.reshape(-1)
    total = out.numel()
    if total < _CHUNKED_FROM or lens.numel() * _CHUNK > total or exporting():
        _expand_runs_cumsum(out, starts, lens)
        return
    if not nonempty:
        kept = lens.nonzero().squeeze(1)
        starts, lens = starts.index_select(0, kept), lens.index_select(0, kept)
    _expand_runs_chunked(out, starts, lens)


def _expand_runs_cumsum(out: Tensor, starts: Tensor, lens: Tensor) -> None:
    """``expand_runs`` as a cumsum of ones, with each run's jump in value added where it
    begins — empty runs jump at the same place and their jumps add up: two passes over the
    output (a fill and the cumsum), no gather and no sort."""
    total = out.numel()
    if total == 0:
        return
    # In the output's dtype, whose entries the values are: an int32 run ending at
    # 2**31 - 1 stops past int32, and its wrapped jump would be wrong in an int64 output.
    starts, lens = starts.to(out.dtype), lens.to(out.dtype)
    first_entry = lens.cumsum(0) - lens
    # A run's jump: its start less the value the run before it stopped at (1 before the
    # first: the cumsum of the ones alone would start there).
    stop = starts + lens
    jump = starts - torch.cat([stop.new_ones(1), stop[:-1]])
    inside = first_entry < total  # empty runs at the very end jump nowhere
    out.fill_(1)
    out.scatter_add_(0, first_entry.clamp(max=total - 1), (jump * inside).to(out.dtype))
    out.cumsum_(0)


_CHUNK = 16
"""Entries per chunk of ``_expand_runs_chunked``: each chunk is written as its first entry
plus ``0..15``; chunks a run begins inside are then written again, whole."""


def _expand_runs_chunked(out: Tensor, starts: Tensor, lens: Tensor) -> None:
    """``expand_runs`` for runs that are all nonempty, in one write of ``out``: every chunk
    of ``_CHUNK`` entries takes the run of its first entry (found from a count of the runs
    begun by then), as a broadcast add that runs as fast as a fill; the chunks a run begins
    inside are then rewritten whole, from a small table of them (a row per such chunk:
    its first value, then 1 per entry plus each run's jump where it begins, summed along
    the row), and the last partial chunk entry by entry. No cumsum over the output."""
    total = out.numel()
    k = _CHUNK
    # Every start is an entry of out and every position is below total: both fit the
    # output's dtype where total does (int32: the passes over the runs read half the bytes).
    wide = out.dtype if total < (1 << 31) else torch.int64
    starts, lens = starts.to(wide), lens.to(wide)
    first = lens.cumsum(0, dtype=wide).sub_(lens)
    offset = starts - first  # entry p of run r holds p + offset[r]
    jump = torch.diff(offset, prepend=offset.new_zeros(1))
    chunks = total // k
    tail = chunks * k
    if chunks:
        # Chunk c's first entry c*k holds c*k + offset[r], r the last run begun by then (the
        # last with ceil(first/k) <= c): a running sum of k per chunk and each run's jump in
        # offset at the chunk it takes over — one cumsum over the chunks.
        at_chunk = _div_mod(first.add(k - 1), k, mod=False)[0].clamp_(max=chunks)
        base = torch.full((chunks + 1,), k, dtype=wide, device=out.device)
        base[0] = 0
        base.scatter_add_(0, at_chunk.to(torch.int64), jump)
        base = base[:chunks].cumsum_(0)
        rows = out[:tail].view(chunks, k)
        steps = torch.arange(k, dtype=out.dtype, device=out.device)
        # One add over the whole output, the rewrite after it: segments of the add, each
        # followed by its rewrites while those rows were in cache, took longer on the CPU
        # (12% on fresh huge pages, 1% on fresh small pages, 8% on a written output).
        torch.add(base.to(out.dtype).view(chunks, 1), steps, out=rows)
        # Runs begun inside a chunk: entry j of that chunk is its first value plus j plus
        # the jumps of the runs begun inside it up to j. A run that carries on its
        # predecessor's values (no jump: two unlisted runs side by side in a line) leaves
        # its chunk as the broadcast wrote it: an insertion-order tree's lines hold many.
        inside = _div_mod(first, k, div=False)[1]
        rewritten = (jump != 0).logical_and_(inside != 0)
        if tail < total:
            rewritten.logical_and_(first < tail)
        begun = rewritten.nonzero().squeeze(1)
        if begun.numel():
            chunk = _div_mod(first.index_select(0, begun), k, mod=False)[0]
            which, row = torch.unique_consecutive(chunk, return_inverse=True)
            which = which.to(torch.int64)  # index_copy_ takes int64 indices only
            table = torch.ones((which.numel(), k), dtype=wide, device=out.device)
            table.view(-1)[::k] = base.index_select(0, which)
            # Flat positions in the table: no two runs begin at one entry (they are
            # nonempty), so each entry takes at most one jump.
            flat = row.mul_(k).add_(inside.index_select(0, begun))
            table.view(-1).scatter_add_(0, flat, jump.index_select(0, begun))
            rows.index_copy_(0, which, table.cumsum_(1).to(out.dtype))
    if tail < total:
        # The last partial chunk: the runs that reach into it, each from its first entry
        # there (fewer than ``_CHUNK`` entries in all).
        last = torch.searchsorted(first, first.new_tensor([tail]), right=True)
        reach = slice(int(last) - 1, None)
        at = first[reach].clamp(min=tail)
        _expand_runs_cumsum(out[tail:], at + offset[reach], first[reach] + lens[reach] - at)
