"""Writing torch's BlockMask tensors: the last stage of a build.

Both sides (kv blocks per q block row, q blocks per kv block column), partial and full, each
line listing its blocks ascending and then the unlisted ones ascending — byte-identical to
torch's ``create_block_mask`` — as contiguous ``(B, H, ...)`` tensors with a storage each;
with torch's build flags (``Flags``) the sides merged into one and the dQ write order.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra.mask import MaskMod
from flexmask.blocks.codes import FULL, PARTIAL
from flexmask.blocks.grid import BlockGrid


class Flags(NamedTuple):
    """torch's ``create_block_mask`` flags that change the tensors it writes (torch 2.13);
    the defaults are what every torch writes."""

    separate_full_blocks: bool = True
    """False: every nonempty block is listed as partial, and the full sides are None."""
    compute_dq_write_order: bool = False
    """True: ``dq_write_order`` (and ``dq_write_order_full``) are written too."""
    dq_kv_order: bool = True
    """The order those rank kv blocks in: True descending (torch's "SPT"), False ascending."""


TORCH_DEFAULTS = Flags()
"""What every torch writes without flags."""


class Ordered(NamedTuple):
    """torch's tensors of one side of a BlockMask: counts ``(..., n)`` and indices
    ``(..., n, m)`` of the partial blocks, then of the full ones; int32."""

    partial_num: Tensor
    partial_idx: Tensor
    full_num: Tensor
    full_idx: Tensor


def exporting() -> bool:
    """True while ``torch.export`` traces: shapes must not follow tensor values then."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # torch >= 2.4
    return bool(is_exporting is not None and is_exporting())


class _Runs(NamedTuple):
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
    of two (chunks of 16, 1024 blocks a line at 131k) — torch's CPU int64 division and
    remainder take ~10x a shift (250 against 25 us on 67k runs, one run)."""
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
    from their maxima (a reduction, ~5x faster than torch's CPU ``nonzero`` per word:
    0.42 against 2.0 ms over 1M words, one run), then ``nonzero`` over those groups alone.
    Run starts cluster (a tree's grid is 8-28% non-empty at 131k): 19-22k groups of 65k
    hold one; where over half the groups do, one ``nonzero`` over every word."""
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


def _kv_runs(grid: Tensor) -> _Runs | None:
    """Runs along the rows of a contiguous ``(G, rows, cols)`` grid: lines are its rows."""
    cols = grid.shape[-1]
    found = _run_starts(grid, along_rows=False)
    if found is None:
        return None
    starts = found.to(_narrow(grid.numel()))
    length = torch.diff(starts, append=starts.new_tensor([grid.numel()]))
    value = grid.view(-1).index_select(0, found).to(starts.dtype)
    return _Runs(*_div_mod(starts, cols), length, value)


def _q_runs(grid: Tensor) -> _Runs | None:
    """Runs down the columns of a contiguous ``(G, rows, cols)`` grid: lines are its
    columns (the transposed grid's rows), found on the grid as it lies."""
    starts = _run_starts(grid, along_rows=True)
    if starts is None:
        return None
    return _q_runs_at(starts, grid.view(-1).index_select(0, starts), grid.shape)


def q_runs_from_kv(kv: _Runs, shape: torch.Size) -> _Runs | None:
    """The runs down the columns of a ``(G, rows, cols)`` grid of codes (the q side's)
    from its runs along the rows (``kv``: in line order, each line's first at column 0,
    none empty; equal neighbours may stay apart), without the grid: None when they are
    many (over one in eight tiles, as ``_run_starts``).

    A q-side run starts at tile (i, j) iff i is a plane's first row or rows i - 1 and i
    hold different codes at j. Both rows are constant between their run starts, so they
    differ on whole intervals between the points of both rows' starts merged: row i's own
    (A) and row i - 1's moved one row down (B), one sort of keys ``row * cols + col``. At
    each merged point the last A and the last B at or before it (a running max) are the
    runs of rows i and i - 1 that hold it. The intervals where their codes differ are
    expanded into their tiles; the planes' first rows start a run at every column, with
    their own runs' codes. At 131k B=8 this replaces the int8 codes of a union (4.2 ms)
    and their pass down the columns."""
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
    if count * 8 > total:
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


def _q_runs_at(starts: Tensor, code: Tensor, shape: torch.Size) -> _Runs:
    """The q side's runs of a ``(G, rows, cols)`` grid from the flat positions where they
    start (any order) and the code there, in the transposed grid's order."""
    g_rows, rows, cols = shape
    total = g_rows * rows * cols
    plane, tile = _div_mod(starts, rows * cols)
    row, col = _div_mod(tile, cols)
    # The start's flat position in the transposed grid: line-major, as the output lists.
    key = (plane * cols + col) * rows + row
    # int32 keys sort in half the time (37k: 0.51 against 1.10 ms)
    transposed, order = key.to(_narrow(total)).sort()
    length = torch.diff(transposed, append=transposed.new_tensor([total]))
    value = code.index_select(0, order).to(transposed.dtype)
    return _Runs(*_div_mod(transposed, rows), length, value)


def _line_places(runs: _Runs) -> tuple[Tensor, Tensor]:
    """For each run, the index of its line's first run and how many runs of its line come
    before it: what ranking a side's partial and full tensors both read (found once)."""
    dtype = runs.line.dtype
    line_first = (runs.col == 0).nonzero().squeeze(1).to(dtype)  # each line's first run
    first_of_mine = line_first.index_select(0, runs.line)
    before_in_line = torch.arange(runs.line.numel(), dtype=dtype, device=runs.line.device)
    return first_of_mine, before_in_line.sub_(first_of_mine)


def _listed_from_runs(
    runs: _Runs, code: int, shape: torch.Size, places: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """(num_blocks, indices) of the tiles holding ``code``, lines along ``shape[-1]``: each
    line's runs of ``code`` in column order, then its other runs in column order; each
    run's rank in that order comes from running counts over the runs (no sort), and the
    ranked runs are expanded in one pass (``expand_runs``). ``places``: the runs'
    ``_line_places``, when the caller lists another code from the same runs."""
    lines = shape.numel() // shape[-1]
    line, col, length = runs.line, runs.col, runs.length
    first_of_mine, before_in_line = _line_places(runs) if places is None else places
    is_set = runs.value == code
    dtype = line.dtype  # the runs' (``_narrow``)
    set_count = is_set.to(dtype)
    count = torch.zeros(lines, dtype=dtype, device=line.device)
    count.index_add_(0, line, torch.where(is_set, length, 0))  # no multiply: ~3x a where
    # Runs before each one: overall, then set ones; less those of earlier lines.
    set_before = set_count.cumsum(0, dtype=dtype).sub_(set_count)
    set_before_in_line = set_before - set_before.index_select(0, first_of_mine)
    set_in_line = torch.zeros(lines, dtype=dtype, device=line.device)
    set_in_line.index_add_(0, line, set_count)
    rank = first_of_mine + torch.where(
        is_set,
        set_before_in_line,
        set_in_line.index_select(0, line) + before_in_line - set_before_in_line,
    )
    rank = rank.to(torch.int64)  # index_copy_ takes int64 indices only
    ranked_col = torch.empty_like(col).index_copy_(0, rank, col)
    ranked_length = torch.empty_like(length).index_copy_(0, rank, length)
    indices = torch.empty(shape, dtype=torch.int32, device=line.device)
    expand_runs(indices.view(-1), ranked_col, ranked_length, nonempty=True)
    return count.to(torch.int32).view(shape[:-1]), indices


_CHUNK = 16
"""Entries per chunk of ``_expand_runs_chunked``: each chunk is written as its first entry
plus ``0..15``; chunks a run begins inside are then written again, whole."""


def _expand_runs_chunked(out: Tensor, starts: Tensor, lens: Tensor) -> None:
    """``expand_runs`` for runs that are all nonempty, in one write of ``out``: every chunk
    of ``_CHUNK`` entries takes the run of its first entry (found from a count of the runs
    begun by then), as a broadcast add that runs as fast as a fill; the chunks a run begins
    inside are then rewritten whole, from a small table of them (a row per such chunk:
    its first value, 1 per entry and each run's jump where it begins, summed along the
    row), and the last partial chunk entry by entry. No cumsum over the output."""
    total = out.numel()
    k = _CHUNK
    first = lens.cumsum(0, dtype=lens.dtype).sub_(lens)
    offset = starts - first  # entry p of run r holds p + offset[r]
    jump = torch.diff(offset, prepend=offset.new_zeros(1))
    chunks = total // k
    if chunks:
        # Chunk c's first entry c*k holds c*k + offset[r], r the last run begun by then (the
        # last with ceil(first/k) <= c): a running sum of k per chunk and each run's jump in
        # offset at the chunk it takes over — one cumsum over the chunks, in the output's
        # dtype where its values fit (they are the output's values: entries of out).
        wide = out.dtype if total < (1 << 31) else torch.int64
        at_chunk = _div_mod(first.add(k - 1), k, mod=False)[0].clamp_(max=chunks)
        base = torch.full((chunks + 1,), k, dtype=wide, device=out.device)
        base[0] = 0
        base.scatter_add_(0, at_chunk, jump.to(wide))
        base = base[:chunks].cumsum(0, dtype=wide)
        steps = torch.arange(k, dtype=out.dtype, device=out.device)
        rows = out[: chunks * k].view(chunks, k)
        torch.add(base.to(out.dtype).view(chunks, 1), steps, out=rows)
        # Runs begun inside a chunk: entry j of that chunk is its first value plus j plus
        # the jumps of the runs begun inside it up to j. Each such chunk once, as a row of
        # a table: its first value, then 1 per entry and 1 + jump where a run begins (no
        # two runs begin at one entry: they are nonempty), summed along the row.
        inside = _div_mod(first, k, div=False)[1]
        # A run that carries on its predecessor's values (no jump: two unlisted runs side
        # by side in a line) leaves its chunk as the broadcast wrote it: a quarter to a
        # half fewer chunks rewritten in an insertion-order tree at 131k.
        begun = ((inside != 0) & (jump != 0) & (first < chunks * k)).nonzero().squeeze(1)
        if begun.numel():
            chunk = _div_mod(first.index_select(0, begun), k, mod=False)[0]
            which, row = torch.unique_consecutive(chunk, return_inverse=True)
            which = which.to(torch.int64)  # index_copy_ takes int64 indices only
            table = torch.ones((which.numel(), k), dtype=wide, device=out.device)
            table[:, 0] = base.index_select(0, which)
            table.index_put_(
                (row, inside.index_select(0, begun).to(torch.int64)),
                jump.index_select(0, begun).to(wide).add_(1),
            )
            rows.index_copy_(0, which, table.cumsum_(1).to(out.dtype))
    tail = chunks * k
    if tail < total:
        # The last partial chunk: the runs that reach into it, each from its first entry
        # there (fewer than ``_CHUNK`` entries in all).
        last = torch.searchsorted(first, first.new_tensor([tail]), right=True)
        reach = slice(int(last) - 1, None)
        at = first[reach].clamp(min=tail)
        _expand_runs_cumsum(out[tail:], at + offset[reach], first[reach] + lens[reach] - at)


def ordered_lines(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks, indices) of a bool grid, byte-identical to torch's stable argsort order:
    the set columns ascending, then the unset ones ascending.

    Lines of a block grid are mostly a few runs of set and unset columns: each run's place
    in its line's output is found from run lengths alone, and the runs are expanded in one
    pass (``expand_runs``). Grids with many short runs are ranked column by column instead."""
    # Under torch.export the run counts below (nonzero) would be data-dependent shapes.
    if blocks.numel() == 0 or exporting():
        return _ranked(blocks)
    n = blocks.shape[-1]
    runs = _kv_runs(blocks.reshape(1, -1, n))
    if runs is None:
        return _ranked(blocks)
    return _listed_from_runs(runs, 1, blocks.shape)


def _ranked(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``ordered_lines`` column by column: a cumsum ranks each column and one scatter writes it."""
    n = blocks.shape[-1]
    if n == 0:  # lines with no columns list nothing
        count = torch.zeros(blocks.shape[:-1], dtype=torch.int32, device=blocks.device)
        return count, torch.empty(blocks.shape, dtype=torch.int32, device=blocks.device)
    ones = blocks.cumsum(-1, dtype=torch.int32)  # set columns up to and including each one
    count = ones[..., -1:]
    col1 = torch.arange(1, n + 1, dtype=torch.int32, device=blocks.device)
    # One-based rank: a set column is the ones-th; an unset one follows all `count` set ones
    # and the (col1 - ones) unset ones up to it.
    rank = torch.where(blocks, ones, (count + col1) - ones).to(torch.int64).sub_(1)
    indices = torch.empty(blocks.shape, dtype=torch.int32, device=blocks.device)
    indices.scatter_(-1, rank, (col1 - 1).expand(blocks.shape))
    return count.squeeze(-1).contiguous(), indices


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
    first_entry = lens.cumsum(0) - lens
    # A run's jump: its start less the value the run before it stopped at (1 before the
    # first: the cumsum of the ones alone would start there).
    stop = starts + lens
    jump = starts - torch.cat([stop.new_ones(1), stop[:-1]])
    inside = first_entry < total  # empty runs at the very end jump nowhere
    out.fill_(1)
    out.scatter_add_(0, first_entry.clamp(max=total - 1), (jump * inside).to(out.dtype))
    out.cumsum_(0)


def ordered_from_codes(codes: Tensor) -> tuple[Ordered, Ordered]:
    """torch's (kv side, q side) ordered tensors from final tile codes ``(R, Hh, nq, nkv)``.

    One pass per side finds the runs of equal codes (the q side's on the transposed int8
    codes); the partial and the full tensors of that side are both placed from those runs."""
    if codes.numel() == 0 or exporting():
        return ordered_from_flags(codes == PARTIAL, codes == FULL)
    grid = codes.reshape(-1, *codes.shape[-2:])
    return _side(_kv_runs(grid), codes, codes.shape), q_side_from_codes(codes)


def q_side_from_codes(codes: Tensor) -> Ordered:
    """torch's q side alone (per kv block column) from final tile codes ``(R, Hh, nq, nkv)``
    (contiguous, not empty): the runs down the columns found on the codes as they lie
    (``_q_runs``); for builds whose kv side comes from runs already (``unions``)."""
    if exporting():
        flipped = codes.transpose(-2, -1).contiguous()
        return Ordered(*ordered_lines(flipped == PARTIAL), *ordered_lines(flipped == FULL))
    q_shape = torch.Size((*codes.shape[:-2], codes.shape[-1], codes.shape[-2]))
    runs = _q_runs(codes.reshape(-1, *codes.shape[-2:]))
    return _side(runs, codes.transpose(-2, -1), q_shape)


def q_side_from_line_runs(
    line: Tensor, col: Tensor, length: Tensor, value: Tensor, shape: torch.Size
) -> Ordered | None:
    """torch's q side alone from the runs of codes along the block rows of a grid of
    ``shape`` ``(R, Hh, nq, nkv)`` — int64 ``line`` (block row, counted over R and Hh),
    ``col``, ``length`` and ``value`` (the code), in line order, none empty — with no grid
    of codes (``q_runs_from_kv``); None where the q side's runs are many (the caller ranks
    its codes instead). For builds whose rows come as runs (``unions``)."""
    grid = torch.Size((shape[:-2].numel(), shape[-2], shape[-1]))
    runs = q_runs_from_kv(_Runs(line, col, length, value), grid)
    if runs is None:
        return None
    return _side(runs, None, torch.Size((*shape[:-2], shape[-1], shape[-2])))


def _side(runs: _Runs | None, codes: Tensor | None, shape: torch.Size) -> Ordered:
    """One side's tensors from its runs of codes (lines along ``shape[-1]``; ``codes`` as
    that side reads them), or ranked column by column where the runs were many (None)."""
    if runs is None:
        assert codes is not None  # runs are None only where a grid of codes was read
        return Ordered(*_ranked(codes == PARTIAL), *_ranked(codes == FULL))
    places = _line_places(runs)
    return Ordered(
        *_listed_from_runs(runs, PARTIAL, shape, places),
        *_listed_from_runs(runs, FULL, shape, places),
    )


def ordered_from_flags(partial: Tensor, full: Tensor) -> tuple[Ordered, Ordered]:
    """Both sides from the partial and full tiles as booleans ``(R, Hh, nq, nkv)``."""
    kv = Ordered(*ordered_lines(partial), *ordered_lines(full))
    q = Ordered(
        *ordered_lines(partial.transpose(-2, -1).contiguous()),
        *ordered_lines(full.transpose(-2, -1).contiguous()),
    )
    return kv, q


def empty_sides(rows: int, heads: int, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """A grid with no q or no kv blocks (Q_LEN or KV_LEN 0): nothing listed; every line is
    its unlisted blocks ascending, as torch writes them."""
    nq, nkv, dev = grid.num_q_blocks, grid.num_kv_blocks, grid.device

    def side(n: int, m: int) -> tuple[Tensor, Tensor]:
        count = torch.zeros((rows, heads, n), dtype=torch.int32, device=dev)
        order = torch.arange(m, dtype=torch.int32, device=dev).expand(rows, heads, n, m)
        return count, order.contiguous()

    kv_num, kv_idx = side(nq, nkv)
    q_num, q_idx = side(nkv, nq)
    return (
        Ordered(kv_num, kv_idx, kv_num.clone(), kv_idx.clone()),
        Ordered(q_num, q_idx, q_num.clone(), q_idx.clone()),
    )


def listed(num_blocks: Tensor, indices: Tensor, n: int) -> Tensor:
    """The blocks one side lists, as a bool grid ``(..., lines, n)``: the first
    ``num_blocks`` indices of each line, the tail read as the kernels read it (not at all)."""
    grid = torch.zeros((*indices.shape[:-1], n + 1), dtype=torch.bool, device=indices.device)
    used = torch.arange(indices.shape[-1], device=indices.device) < num_blocks.unsqueeze(-1)
    # One spare column takes the unlisted entries; it is dropped at the end.
    grid.scatter_(-1, torch.where(used, indices.long(), n), True)
    return grid[..., :n]


def merged(kv: Ordered, num_kv: int) -> tuple[Ordered, Ordered, Tensor]:
    """``separate_full_blocks=False``: every listed block as partial on both sides, the full
    sides emptied (``assemble`` leaves them None); and the listed grid."""
    blocks = listed(kv.partial_num, kv.partial_idx, num_kv) | listed(
        kv.full_num, kv.full_idx, num_kv
    )
    kv_num, kv_idx = ordered_lines(blocks)
    q_num, q_idx = ordered_lines(blocks.transpose(-2, -1).contiguous())
    none = kv_num[..., :0]
    return Ordered(kv_num, kv_idx, none, none), Ordered(q_num, q_idx, none, none), blocks


def write_order(blocks: Tensor, q_indices: Tensor, descending: bool) -> Tensor:
    """torch's ``dq_write_order`` of one q side: for each kv block column ``n`` and each entry
    ``m`` of its q indices (the unlisted tail included), the rank of kv block ``n`` among the
    blocks q block row ``m`` lists (``blocks``, partial and full) — ascending, or descending
    with ``descending`` — int32 ``(..., num_kv, num_q)``, as torch 2.13 computes it."""
    counts = blocks.to(torch.int32).cumsum(-1)  # int64: blocks listed up to each column
    rank = counts - blocks.to(counts.dtype)
    if descending:
        rank = counts[..., -1:] - 1 - rank
    by_column = rank.to(torch.int32).transpose(-2, -1)  # (..., num_kv, num_q)
    return by_column.gather(-1, q_indices.long())


def assemble(
    kv: Ordered, q: Ordered, grid: BlockGrid, mask_mod: MaskMod, flags: Flags = TORCH_DEFAULTS
) -> BlockMask:
    """torch's BlockMask from both sides' ordered tensors, each ``(B, H, ...)`` contiguous
    with a storage of its own, as torch's: an in-place edit of one row or head changes that
    one, and ``PagedAttention`` can view them.

    Sides come as counts ``(R, Hh, n)`` and indices ``(R, Hh, n, m)`` with R in {1, B},
    Hh in {1, H}; rows and heads the mask ignores are copied out here. (The cache builds
    on a grid with B or H reduced to 1 instead: flex_attention broadcasts those.)

    ``flags`` as torch's ``create_block_mask`` takes them: ``separate_full_blocks=False``
    lists every block as partial with the full sides None; ``compute_dq_write_order``
    adds ``dq_write_order`` (``_full``) from the listed blocks, ``dq_kv_order`` kept as torch
    keeps it (``dq_kv_order_spt``).
    """
    b, h, nq, nkv = grid.batch, grid.heads, grid.num_q_blocks, grid.num_kv_blocks

    def whole(t: Tensor, *shape: int) -> Tensor:
        return t.expand(b, h, *shape).contiguous()

    blocks = None
    if not flags.separate_full_blocks:
        kv, q, blocks = merged(kv, nkv)
    fields: dict[str, Any] = {
        "kv_num_blocks": whole(kv.partial_num, nq),
        "kv_indices": whole(kv.partial_idx, nq, nkv),
        "q_num_blocks": whole(q.partial_num, nkv),
        "q_indices": whole(q.partial_idx, nkv, nq),
    }
    full = flags.separate_full_blocks
    fields["full_kv_num_blocks"] = whole(kv.full_num, nq) if full else None
    fields["full_kv_indices"] = whole(kv.full_idx, nq, nkv) if full else None
    fields["full_q_num_blocks"] = whole(q.full_num, nkv) if full else None
    fields["full_q_indices"] = whole(q.full_idx, nkv, nq) if full else None
    if flags.compute_dq_write_order:  # only torches that take the flag get here
        if blocks is None:
            blocks = listed(kv.partial_num, kv.partial_idx, nkv) | listed(
                kv.full_num, kv.full_idx, nkv
            )
        order = write_order(blocks, q.partial_idx, flags.dq_kv_order)
        fields["dq_write_order"] = whole(order, nkv, nq)
        if full:
            order = write_order(blocks, q.full_idx, flags.dq_kv_order)
            fields["dq_write_order_full"] = whole(order, nkv, nq)
        fields["dq_kv_order_spt"] = flags.dq_kv_order
    return BlockMask(
        seq_lengths=(grid.q_len, grid.kv_len),
        **fields,
        BLOCK_SIZE=(grid.q_block, grid.kv_block),
        mask_mod=mask_mod,
    )
