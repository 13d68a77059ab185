"""The grouped driver (no ``score_mod``): the plan sliced to what the kernel takes, the
mask of a group's partial blocks from the Mask's intervals or its ``mask_mod``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from flexmask.algebra.mask import Mask
from flexmask.backends.block_sparse import kernel
from flexmask.backends.mod_eval import broadcasts, call_mod
from flexmask.backends.plan import Plan, pad_to_blocks
from flexmask.blocks.codes import PARTIAL
from flexmask.blocks.grid import BlockGrid


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
    """The grouped kernel over slices of batch rows and kv heads small enough that one q block
    of a slice, at its widest, holds at most ``max_chunk_elements`` scores (a group batches
    its q blocks over every batch row and head of the slice: at B=4, Hq=32, 8k one q block
    would be 33 Mi scores, 128 MiB per temporary). Attention is independent across batch rows
    and kv heads, so each slice is its own call; the outputs are put back together."""
    widest = max(1, int(plan.listed.sum(dim=-1).max()))
    per_pair = plan.group * plan.q_block * widest * plan.kv_block  # one (batch row, kv head)
    pairs = max(1, max_chunk_elements // per_pair)
    if pairs >= plan.batch * plan.kv_heads:
        return grouped_slice(
            query,
            key,
            value,
            plan,
            mod_eval,
            max_chunk_elements,
            save_budget,
            needs_grad,
            bounds,
            threads,
        )
    heads_step = min(plan.kv_heads, pairs)
    batch_step = max(1, pairs // plan.kv_heads)
    g = plan.group
    batch_sizes = [min(batch_step, plan.batch - b) for b in range(0, plan.batch, batch_step)]
    head_sizes = [min(heads_step, plan.kv_heads - h) for h in range(0, plan.kv_heads, heads_step)]
    count = len(batch_sizes) * len(head_sizes)
    # split, not indexing: split's backward puts the pieces' gradients together in one
    # tensor, where each indexed piece's backward would write a zero-filled whole.
    rows = zip(
        query.split(batch_sizes), key.split(batch_sizes), value.split(batch_sizes), strict=True
    )
    outs, lses = [], []
    for b0, (q_row, k_row, v_row) in zip(range(0, plan.batch, batch_step), rows, strict=True):
        heads = zip(
            q_row.split([n * g for n in head_sizes], dim=1),
            k_row.split(head_sizes, dim=1),
            v_row.split(head_sizes, dim=1),
            strict=True,
        )
        row_outs, row_lses = [], []
        for h0, (q, k, v) in zip(range(0, plan.kv_heads, heads_step), heads, strict=True):
            b1, h1 = b0 + q.size(0), h0 + k.size(1)
            piece_bounds = None
            if bounds is not None:
                kept = slice(b0, b1) if bounds.lo.size(0) > 1 else slice(None)
                piece_bounds = kernel.Bounds(bounds.lo[kept], bounds.hi[kept])
            out, lse = grouped_slice(
                q,
                k,
                v,
                plan_slice(plan, b0, b1, h0, h1),
                mod_eval,
                max_chunk_elements,
                save_budget // count,
                needs_grad,
                piece_bounds,
                threads,
            )
            row_outs.append(out)
            row_lses.append(lse)
        outs.append(torch.cat(row_outs, dim=1))
        lses.append(torch.cat(row_lses, dim=1))
    return torch.cat(outs), torch.cat(lses)


def plan_slice(plan: Plan, b0: int, b1: int, h0: int, h1: int) -> Plan:
    """The plan of batch rows [b0, b1) and kv heads [h0, h1): block kinds cut where they vary
    by row or head, and mask_mod seeing the whole call's batch and query-head indices."""
    kinds = plan.kinds
    if kinds.size(0) > 1:
        kinds = kinds[b0:b1]
    if kinds.size(1) > 1:
        kinds = kinds[:, h0:h1]
    return replace(
        plan,
        batch=b1 - b0,
        kv_heads=h1 - h0,
        q_heads=(h1 - h0) * plan.group,
        kinds=kinds,
        mask_mod=OffsetMod(plan.mask_mod, b0, h0 * plan.group),
    )


class OffsetMod:
    """``mask_mod(b + b0, h + h0, q_idx, kv_idx)``: a slice's indices in the whole call."""

    def __init__(self, mask_mod: Callable[..., Tensor], b0: int, h0: int) -> None:
        self.mask_mod, self.b0, self.h0 = mask_mod, b0, h0

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.mask_mod(b + self.b0, h + self.h0, q_idx, kv_idx)


def grouped_slice(
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
    """The grouped kernel (``kernel``), in and out of its blocked layouts."""
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
    k_blocks = pad_to_blocks(key, plan.kv_block).to(plan.working_dtype)
    k_blocks = k_blocks.reshape(batch, kv_heads, -1, plan.kv_block, plan.head_dim)
    v_blocks = pad_to_blocks(value, plan.kv_block).to(plan.working_dtype)
    v_blocks = v_blocks.reshape(batch, kv_heads, -1, plan.kv_block, plan.value_dim)
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
    """mask_mod over a group's (q block, column) tiles, broadcasting or through vmap."""
    b = torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1, 1)
    h = torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, plan.group, 1, 1, 1, 1)
    q_offsets = torch.arange(plan.q_block, device=device)
    kv_offsets = torch.arange(plan.kv_block, device=device)

    def arguments(group: kernel.Group) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        n, width = group.columns.shape
        q_idx = group.blocks.to(device)[:, None] * plan.q_block + q_offsets
        kv_idx = group.columns.to(device)[:, :, None] * plan.kv_block + kv_offsets
        q_idx = q_idx.clamp(max=plan.q_len - 1).view(1, 1, 1, n, plan.q_block, 1, 1)
        kv_idx = kv_idx.clamp(max=plan.kv_len - 1).view(1, 1, 1, n, 1, width, plan.kv_block)
        shape = (plan.batch, plan.kv_heads, plan.group, n, plan.q_block, width, plan.kv_block)
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
