"""Writing torch's BlockMask tensors: the last stage of a build.

Both sides (kv blocks per q block row, q blocks per kv block column), partial and full, each
line listing its blocks ascending and then the unlisted ones ascending — byte-identical to
torch's ``create_block_mask`` — as contiguous ``(B, H, ...)`` tensors with a storage each;
with torch's build flags (``Flags``) the sides merged into one and the dQ write order. Each
line's runs of equal codes (found by ``runs``) are ranked into that order and expanded once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import MaskMod
from flexmask.blocks.codes import FULL, PARTIAL
from flexmask.blocks.grid import BlockGrid
from flexmask.blocks.memory import index_tensors
from flexmask.blocks.pair import side_by_side
from flexmask.blocks.runs import CodeRuns, expand_runs, exporting, kv_runs, q_runs, q_runs_from_kv


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


def _line_places(runs: CodeRuns) -> tuple[Tensor, Tensor]:
    """For each run, the index of its line's first run and how many runs of its line come
    before it: what ranking a side's partial and full tensors both read (found once)."""
    dtype = runs.line.dtype
    line_first = (runs.col == 0).nonzero().squeeze(1).to(dtype)  # each line's first run
    first_of_mine = line_first.index_select(0, runs.line)
    before_in_line = torch.arange(runs.line.numel(), dtype=dtype, device=runs.line.device)
    return first_of_mine, before_in_line.sub_(first_of_mine)


def _listed_from_runs(
    runs: CodeRuns, code: int, shape: torch.Size, places: tuple[Tensor, Tensor] | None = None
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
    count.index_add_(0, line, torch.where(is_set, length, 0))  # a where: faster than a multiply
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
    (indices,) = index_tensors([shape], line.device)
    expand_runs(indices.view(-1), ranked_col, ranked_length, nonempty=True)
    return count.to(torch.int32).view(shape[:-1]), indices


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
    runs = kv_runs(blocks.reshape(1, -1, n))
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
    (indices,) = index_tensors([blocks.shape], blocks.device)
    indices.scatter_(-1, rank, (col1 - 1).expand(blocks.shape))
    return count.squeeze(-1).contiguous(), indices


def ordered_from_codes(codes: Tensor) -> tuple[Ordered, Ordered]:
    """torch's (kv side, q side) ordered tensors from final tile codes ``(R, Hh, nq, nkv)``.

    One pass per side finds the runs of equal codes (the q side's on the transposed int8
    codes); the partial and the full tensors of that side are both placed from those runs.
    The two sides are written side by side on long grids (``pair.side_by_side``)."""
    if codes.numel() == 0 or exporting():
        return ordered_from_flags(codes == PARTIAL, codes == FULL)
    grid = codes.reshape(-1, *codes.shape[-2:])
    return side_by_side(
        lambda: _side(kv_runs(grid), codes, codes.shape),
        lambda: q_side_from_codes(codes),
        codes.numel(),
        codes.device,
    )


def q_side_from_codes(codes: Tensor) -> Ordered:
    """torch's q side alone (per kv block column) from final tile codes ``(R, Hh, nq, nkv)``
    (contiguous, not empty): the runs down the columns found on the codes as they lie
    (``q_runs``); for builds whose kv side comes from runs already (``unions``)."""
    if exporting():
        flipped = codes.transpose(-2, -1).contiguous()
        return Ordered(*ordered_lines(flipped == PARTIAL), *ordered_lines(flipped == FULL))
    q_shape = torch.Size((*codes.shape[:-2], codes.shape[-1], codes.shape[-2]))
    runs = q_runs(codes.reshape(-1, *codes.shape[-2:]))
    return _side(runs, codes.transpose(-2, -1), q_shape)


def q_side_from_line_runs(
    line: Tensor, col: Tensor, length: Tensor, value: Tensor, shape: torch.Size, *, few: bool = True
) -> Ordered | None:
    """torch's q side alone from the runs of codes along the block rows of a grid of
    ``shape`` ``(R, Hh, nq, nkv)`` — int64 ``line`` (block row, counted over R and Hh),
    ``col``, ``length`` and ``value`` (the code), in line order, none empty — with no grid
    of codes (``q_runs_from_kv``); None where the q side's runs are many and ``few`` asks
    for few (the caller ranks its codes instead). For builds whose rows come as runs
    (``unions``), or whose columns do (``builders.columns``, with no codes to rank: any
    number of runs)."""
    grid = torch.Size((shape[:-2].numel(), shape[-2], shape[-1]))
    runs = q_runs_from_kv(CodeRuns(line, col, length, value), grid, few=few)
    if runs is None:
        return None
    return _side(runs, None, torch.Size((*shape[:-2], shape[-1], shape[-2])))


def _side(runs: CodeRuns | None, codes: Tensor | None, shape: torch.Size) -> Ordered:
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
        if t.shape == (b, h, *shape) and t.is_contiguous():
            return t
        (out,) = index_tensors([(b, h, *shape)], t.device, t.dtype)
        return out.copy_(t.expand(b, h, *shape))

    blocks = None
    if not flags.separate_full_blocks:
        kv, q, blocks = merged(kv, nkv)
    full = flags.separate_full_blocks

    def side(o: Ordered, n: int, m: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        return (
            whole(o.partial_num, n),
            whole(o.partial_idx, n, m),
            whole(o.full_num, n) if full else None,
            whole(o.full_idx, n, m) if full else None,
        )

    # Sides built on a grid with B or H reduced to 1 are copied out, each on its own thread
    # where the output is long.
    copies = kv.partial_idx.shape[:2] != (b, h)
    kv_out, q_out = side_by_side(
        lambda: side(kv, nq, nkv),
        lambda: side(q, nkv, nq),
        b * h * nq * nkv if copies else 0,
        kv.partial_idx.device,
    )
    fields: dict[str, Any] = {}
    for prefix, values in (("kv", kv_out), ("q", q_out)):
        num, idx, full_num, full_idx = values
        fields.update(
            {
                f"{prefix}_num_blocks": num,
                f"{prefix}_indices": idx,
                f"full_{prefix}_num_blocks": full_num,
                f"full_{prefix}_indices": full_idx,
            }
        )
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
