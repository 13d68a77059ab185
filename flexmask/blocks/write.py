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


def ordered_lines(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks, indices) of a bool grid, byte-identical to torch's stable argsort order:
    the set columns ascending, then the unset ones ascending.

    Lines of a block grid are mostly a few runs of set and unset columns: each run's place
    in its line's output is found from run lengths alone, and the runs are expanded in one
    pass (``expand_runs``). Grids with many short runs are ranked column by column instead."""
    n = blocks.shape[-1]
    # Under torch.export the run counts below (nonzero) would be data-dependent shapes.
    if blocks.numel() == 0 or exporting():
        return _ranked(blocks)
    lines = blocks.numel() // n
    flat = blocks.reshape(lines, n)
    change = torch.ones_like(flat)
    torch.ne(flat[:, 1:], flat[:, :-1], out=change[:, 1:])
    starts = change.view(-1).nonzero().squeeze(1)  # every line starts a run at column 0
    if starts.numel() * 8 > flat.numel():
        return _ranked(blocks)
    total = flat.numel()
    col = starts % n
    line = starts.div(n, rounding_mode="floor")
    length = torch.diff(starts, append=starts.new_tensor([total]))
    value = flat.view(-1)[starts]
    set_length = length * value
    set_until = set_length.cumsum(0)
    count = torch.zeros(lines, dtype=torch.int64, device=blocks.device)
    count.index_add_(0, line, set_length)
    # Set entries before each run in its line: the running sum less the line's earlier lines.
    line_start = set_until - set_length
    set_before = line_start - line_start[col == 0][line]
    place = line * n + torch.where(value, set_before, count[line] + col - set_before)
    order = place.argsort()
    indices = torch.empty(blocks.shape, dtype=torch.int32, device=blocks.device)
    expand_runs(indices.view(-1), col[order], length[order])
    return count.to(torch.int32).view(blocks.shape[:-1]), indices


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


def expand_runs(out: Tensor, starts: Tensor, lens: Tensor) -> None:
    """Writes runs ``(N, r)`` laid end to end into ``out`` (flat int32 of ``lens.sum()``
    entries): entry ``e`` of run ``k`` holds ``starts[k] + e``. A cumsum of ones, with each
    run's jump in value added where it begins — empty runs jump at the same place and their
    jumps add up — so the cost is one pass over the output, no gather and no sort."""
    starts, lens = starts.reshape(-1), lens.reshape(-1)
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
    """torch's (kv side, q side) ordered tensors from final tile codes ``(R, Hh, nq, nkv)``."""
    return ordered_from_flags(codes == PARTIAL, codes == FULL)


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
