"""The grouped driver (no ``score_mod``): the plan in the kernel's blocked layouts, the
mask of a group's partial blocks from the Mask's intervals or its ``mask_mod``."""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.algebra import Mask
from flexmask.backends.block_sparse import kernel
from flexmask.backends.mod_eval import broadcasts, call_mod
from flexmask.backends.plan import Plan, pad_to_blocks
from flexmask.backends.threads import one_thread
from flexmask.blocks import PARTIAL, BlockGrid


def grouped_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: Plan,
    mod_eval: str,
    max_chunk_elements: int,
    save_budget: int,
    needs_grad: bool,
    bounds: kernel.Bounds | None,
    threads: int,
) -> tuple[Tensor, Tensor]:
    """The grouped kernel (``kernel``), in and out of its blocked layouts.

    One call for every batch row and kv head: a group batches its q blocks over all of them
    where that stays under ``max_chunk_elements`` scores, and runs a part of the (batch row,
    kv head) pairs otherwise (at B=4, Hq=32, 8k one q block would be 33 Mi scores, 128 MiB
    per temporary), so memory is bounded without a call per slice."""
    layout = kernel.Layout(
        batch=plan.batch,
        kv_heads=plan.kv_heads,
        group=plan.group,
        q_len=plan.q_len,
        kv_len=plan.kv_len,
        q_block=plan.q_block,
        kv_block=plan.kv_block,
        scale=plan.scale,
        working_dtype=plan.working_dtype,
    )
    groups = kernel.make_groups(plan.kinds.cpu(), layout, max_chunk_elements)
    mask_fn: kernel.MaskSource = bounds or group_mask_fn(plan, groups, query.device, mod_eval)
    batch, kv_heads, group = plan.batch, plan.kv_heads, plan.group
    q_blocks = pad_to_blocks(query, plan.q_block).to(plan.working_dtype) * plan.scale
    q_blocks = q_blocks.reshape(batch, kv_heads, group, -1, plan.q_block, plan.head_dim)
    q_blocks = q_blocks.contiguous()
    k_blocks = pad_to_blocks(key, plan.kv_block).to(plan.working_dtype)
    # Contiguous, so a q block's run of kv blocks is one view (keys of a (B, S, H, D) model
    # arrive transposed) and the gradients' runs are views too.
    k_blocks = k_blocks.reshape(batch, kv_heads, -1, plan.kv_block, plan.head_dim).contiguous()
    v_blocks = pad_to_blocks(value, plan.kv_block).to(plan.working_dtype)
    v_blocks = v_blocks.reshape(batch, kv_heads, -1, plan.kv_block, plan.value_dim).contiguous()
    if needs_grad:
        out, lse = kernel.BlockSparseFunction.apply(
            q_blocks, k_blocks, v_blocks, groups, layout, mask_fn, save_budget, threads
        )
    else:
        with torch.no_grad():
            out, lse, _, _ = kernel.forward(
                q_blocks, k_blocks, v_blocks, groups, layout, mask_fn, 0, threads
            )
    out = out.reshape(batch, plan.q_heads, -1, plan.value_dim)[:, :, : plan.q_len]
    lse = lse.reshape(batch, plan.q_heads, -1)[:, :, : plan.q_len]
    return out.to(query.dtype), lse


def interval_bounds(mask: Mask, plan: Plan) -> kernel.Bounds | None:
    """Each query's kv interval from ``mask``'s structure, over the queries padded to whole q
    blocks (padding rows take the last query's): None where its rows are not intervals."""
    if not mask.has_intervals():
        return None
    # The mask is the one the BlockMask was built from (``api._checked_mask``), validated
    # when its spec was made: its grid is laid out, not checked again.
    grid = BlockGrid.make(
        plan.batch,
        plan.q_heads,
        plan.q_len,
        plan.kv_len,
        plan.q_block,
        plan.kv_block,
        plan.kinds.device,
    )
    rows, _ = grid.reduced(mask)
    num_q_blocks = plan.kinds.size(3)
    q_idx = torch.arange(num_q_blocks * plan.q_block, device=grid.device)
    q_idx = q_idx.clamp(max=plan.q_len - 1).expand(rows, -1)
    found = mask.intervals_at(q_idx, torch.arange(rows, device=grid.device).view(rows, 1), grid)
    if found is None:
        return None
    lo, hi = (t.expand(rows, -1).reshape(rows, num_q_blocks, plan.q_block) for t in found)
    return kernel.Bounds(lo.cpu(), hi.cpu())


class IntervalMod:
    """``lo[q_idx] <= kv_idx <= hi[q_idx]``: the mask_mod of a mask whose rows are intervals,
    from its bounds (per batch row when they differ); index arithmetic, broadcasts."""

    def __init__(self, bounds: kernel.Bounds) -> None:
        self.lo = bounds.lo.flatten(1)
        self.hi = bounds.hi.flatten(1)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        row = b if self.lo.size(0) > 1 else torch.zeros_like(b)
        return (kv_idx >= self.lo[row, q_idx]) & (kv_idx <= self.hi[row, q_idx])


def group_mask_fn(
    plan: Plan, groups: list[kernel.Group], device: torch.device, mod_eval: str
) -> kernel.MaskFn:
    """mask_mod over a group's (q block, column) tiles for its pairs of (batch row, kv head),
    broadcasting or through vmap: bool broadcastable to (p, G, n, Q_BLOCK, W, KV_BLOCK)."""
    layout = kernel.Layout(
        plan.batch,
        plan.kv_heads,
        plan.group,
        plan.q_len,
        plan.kv_len,
        plan.q_block,
        plan.kv_block,
        plan.scale,
        plan.working_dtype,
    )
    heads = torch.arange(plan.group, device=device)
    q_offsets = torch.arange(plan.q_block, device=device)
    kv_offsets = torch.arange(plan.kv_block, device=device)

    def arguments(group: kernel.Group) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        n, width = group.columns.shape
        batch, kv_head = kernel.pair_indices(group, layout, device)
        pairs = batch.numel()
        b = batch.view(pairs, 1, 1, 1, 1, 1)
        h = (kv_head[:, None] * plan.group + heads).view(pairs, plan.group, 1, 1, 1, 1)
        q_idx = group.blocks.to(device)[:, None] * plan.q_block + q_offsets
        kv_idx = group.columns.to(device)[:, :, None] * plan.kv_block + kv_offsets
        q_idx = q_idx.clamp(max=plan.q_len - 1).view(1, 1, n, plan.q_block, 1, 1)
        kv_idx = kv_idx.clamp(max=plan.kv_len - 1).view(1, 1, n, 1, width, plan.kv_block)
        shape = (pairs, plan.group, n, plan.q_block, width, plan.kv_block)
        return (b, h, q_idx, kv_idx), shape

    how = mod_eval
    if how == "auto":
        how = "broadcast"
        probe = next((g for g in groups if bool((g.kinds == PARTIAL).any())), None)
        if probe is not None:
            with torch.no_grad():
                if not broadcasts(plan.mask_mod, *arguments(probe)):
                    how = "vmap"

    def mask_fn(group: kernel.Group) -> Tensor:
        args, shape = arguments(group)
        return call_mod(plan.mask_mod, args, shape, how, "mask_mod")

    return mask_fn


# Scores-sized elements of mask_mod read back at once by recovered_bounds (64 Ki: bools and
# int64 positions of a few blocks, far under one group of the kernel).
RECOVER_ELEMENTS = 1 << 16


def recovered_bounds(plan: Plan, mod_eval: str) -> kernel.Bounds | None:
    """Each query's kv interval inside its partial blocks, read back from ``mask_mod`` where
    no Mask says so (a BlockMask torch built, or one flexmask built and torch then moved):
    None unless, for every batch row and head, the pairs ``mask_mod`` allows in a query's
    partial blocks are exactly those of one interval ``[lo, hi]``.

    Full blocks are all allowed and unlisted ones refused whatever ``mask_mod`` says, so an
    interval that holds on the partial blocks is all the kernel needs: ``mask_mod`` is called
    once here, on the partial blocks only (as one forward would), and the forward and
    backward then mask with two comparisons per element. Exactness is checked, not assumed:
    the allowed count of every row must equal the size of its interval on those blocks.
    """
    kinds = plan.kinds  # (Bm, Hkv | 1, G | 1, NQ, NKV)
    if kinds.size(1) * kinds.size(2) > 1 or not bool(plan.partial.any()):
        return None  # blocks that differ per head, or no partial block to mask
    if kinds.device.type != "cpu":
        return _read_back(plan, mod_eval)
    # A few hundred small ops: on torch's intra-op threads each would wait for a thread the
    # OS took away on a busy machine (a tree's read-back a hundredfold slower).
    with one_thread():
        return _read_back(plan, mod_eval)


def _read_back(plan: Plan, mod_eval: str) -> kernel.Bounds | None:
    """:func:`recovered_bounds` after its early exits."""
    kinds = plan.kinds
    device = kinds.device
    rows, cols = plan.partial.to(device).nonzero().unbind(1)
    count = rows.numel()
    num_q_blocks = kinds.size(3)
    size = plan.batch if kinds.size(0) > 1 else 1  # grows to B if mask_mod reads b
    beyond = plan.kv_len  # lo of a query that allows nothing: refuses the whole block
    lo = torch.full((size, num_q_blocks, plan.q_block), beyond, dtype=torch.long, device=device)
    hi = torch.full_like(lo, -1)
    allowed_count = torch.zeros_like(lo)
    how = mod_eval
    # Partial blocks a few at a time: memory stays near RECOVER_ELEMENTS, not their sum.
    step = max(1, RECOVER_ELEMENTS // (plan.batch * plan.q_block * plan.kv_block))
    for start in range(0, count, step):
        tile_rows, tile_cols = rows[start : start + step], cols[start : start + step]
        tiles = tile_rows.numel()
        q_idx = tile_rows[:, None] * plan.q_block + torch.arange(plan.q_block, device=device)
        kv_idx = tile_cols[:, None] * plan.kv_block + torch.arange(plan.kv_block, device=device)
        args = (
            torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1),
            torch.arange(plan.q_heads, device=device).view(1, -1, 1, 1, 1),
            q_idx.clamp(max=plan.q_len - 1).view(1, 1, tiles, plan.q_block, 1),
            kv_idx.clamp(max=plan.kv_len - 1).view(1, 1, tiles, 1, plan.kv_block),
        )
        shape = (plan.batch, plan.q_heads, tiles, plan.q_block, plan.kv_block)
        if how == "auto":
            how = "broadcast" if broadcasts(plan.mask_mod, args, shape) else "vmap"
        allowed = call_mod(plan.mask_mod, args, shape, how, "mask_mod")
        allowed = allowed.reshape((1,) * (5 - allowed.dim()) + tuple(allowed.shape))
        if allowed.size(1) > 1:
            if not bool((allowed == allowed[:, :1]).all()):
                return None  # intervals that differ per head: Bounds hold one per query
            allowed = allowed[:, :1]
        # Pairs that count: in a block partial for that batch row, inside KV_LEN.
        here = (kinds[:, 0, 0, tile_rows, tile_cols] == PARTIAL)[:, :, None, None]
        kv_at = kv_idx.view(1, tiles, 1, plan.kv_block)
        allowed = allowed[:, 0] & here & (kv_at < plan.kv_len)
        if allowed.size(0) > size:
            lo, hi, allowed_count = (
                t.expand(allowed.size(0), -1, -1).clone() for t in (lo, hi, allowed_count)
            )
            size = allowed.size(0)
        allowed = allowed.expand(size, tiles, plan.q_block, plan.kv_block)
        lo_tile = torch.where(allowed, kv_at, beyond).amin(dim=-1)  # (rows, tiles, Q_BLOCK)
        hi_tile = torch.where(allowed, kv_at, -1).amax(dim=-1)
        count_tile = allowed.sum(dim=-1)
        if not bool(((count_tile == 0) | (count_tile == hi_tile - lo_tile + 1)).all()):
            return None  # a gap inside one block: no interval (found before reading the rest)
        index = tile_rows.view(1, tiles, 1).expand(size, tiles, plan.q_block)
        lo.scatter_reduce_(1, index, lo_tile, "amin")
        hi.scatter_reduce_(1, index, hi_tile, "amax")
        allowed_count.index_add_(1, tile_rows, count_tile)
    # The interval's size on the query's partial blocks (inside KV_LEN), block by block.
    here = (kinds[:, 0, 0, rows, cols] == PARTIAL)[:, :, None]  # (Bm, count, 1)
    first = (cols * plan.kv_block).view(1, count, 1)
    last = ((cols + 1) * plan.kv_block).clamp(max=plan.kv_len).view(1, count, 1) - 1
    overlap = torch.minimum(hi[:, rows], last) - torch.maximum(lo[:, rows], first) + 1
    overlap = overlap.clamp(min=0) * here
    if not bool((torch.zeros_like(lo).index_add_(1, rows, overlap) == allowed_count).all()):
        return None
    return kernel.Bounds(lo.cpu(), hi.cpu())
