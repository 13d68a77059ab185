"""Keys and values moved by a ``KVExchange``: one all-to-all with split sizes forward (each rank
receives what its queries read), the reverse backward (each key's gradient summed back to
the rank that owns it), as one autograd Function.

Keys and values of one dtype travel in one message (concatenated on the last dim); the
received buffer holds the shard's listed key blocks end to end, zero where a partial block's
key is attended by no query of this rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.attention.flex_attention import BlockMask

from flexmask.context_parallel.exchange_plan import (
    EXCHANGES,
    KVExchange,
    exchange_for_plan,
)
from flexmask.context_parallel.lazy import LazyShard
from flexmask.context_parallel.rank_shard import CPShard


def resolve_exchange(shard: Any, exchange: Any) -> KVExchange | None:
    """The plan ``cp_flex_attention`` exchanges with, or None for the all-gather. Local: no
    collective, and the same answer on every rank given the same arguments.

    ``"auto"``: a ``KVExchange``'s own choice (its ``needed``); a shard without a plan
    all-gathers. ``"needed"``: a ``KVExchange``, or a lazy shard's plan made from its recipe;
    a ``CPShard`` or BlockMask has no recipe to plan from (a ValueError says what to pass).
    ``"all_gather"``: always the all-gather.
    """
    if not isinstance(exchange, str) or exchange not in EXCHANGES:
        raise ValueError(
            f"exchange must be 'auto' (the plan's choice), 'needed' (only the keys each rank "
            f"reads) or 'all_gather', got {exchange!r}"
        )
    if exchange == "all_gather":
        return None
    if isinstance(shard, KVExchange):
        return shard if exchange == "needed" or shard.needed else None
    if exchange == "auto":
        return None
    if isinstance(shard, LazyShard):
        return exchange_for_plan(shard._plan, shard.shard)
    if not isinstance(shard, (CPShard, BlockMask)):
        return None  # not a shard: cp_flex_attention's checks name what it must be
    raise ValueError(
        f"exchange='needed' plans from every rank's shard, which a {type(shard).__name__} "
        "cannot rebuild: pass flexmask.context_parallel.plan_exchange(mask, ...) (a "
        "KVExchange; it holds the shard) or a lazy shard (flexmask.lazy_shard)"
    )


def check_exchange_group(plan: KVExchange, world: int, rank: int) -> None:
    """A plan made for another group or rank would send other split sizes than its peers
    expect (gloo aborts the process on a size mismatch): refused before any collective."""
    if (plan.world_size, plan.rank) != (world, rank):
        raise ValueError(
            f"the exchange plan was made for rank {plan.rank} of {plan.world_size}, but this "
            f"process is rank {rank} of {world} in group: plan for this rank and group"
        )


class _ExchangeKeys(torch.autograd.Function):
    """Tensors of one dtype that differ only in their last dim (keys and values), moved in
    one message: only the rows sent are gathered and packed, never the whole slices."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, plan: KVExchange, dim: int, group: Any, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.plan, ctx.dim, ctx.group = plan, dim, group
        ctx.shapes = [t.shape for t in tensors]
        index = plan.send_index.to(tensors[0].device)
        outgoing = torch.cat([t.index_select(dim, index) for t in tensors], dim=-1)
        incoming = _all_to_all(outgoing, dim, plan.recv_counts, plan.send_counts, group)
        widths = [t.shape[-1] for t in tensors]
        if plan.recv_slots is None:
            return tuple(part.contiguous() for part in incoming.split(widths, dim=-1))
        slots = plan.recv_slots.to(incoming.device)
        out = []
        for part, tensor in zip(incoming.split(widths, dim=-1), tensors, strict=True):
            shape = list(tensor.shape)
            shape[dim] = int(plan.block_mask.seq_lengths[1])
            out.append(tensor.new_zeros(shape).index_copy_(dim, slots, part))
        return tuple(out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        plan, dim = ctx.plan, ctx.dim
        some = next(g for g in grads if g is not None)
        parts = []
        for grad, shape in zip(grads, ctx.shapes, strict=True):
            if grad is None:  # an output that reached no loss
                size = list(shape)
                size[dim] = sum(plan.recv_counts)
                parts.append(some.new_zeros(size))
            elif plan.recv_slots is not None:
                parts.append(grad.index_select(dim, plan.recv_slots.to(grad.device)))
            else:
                parts.append(grad)
        outgoing = torch.cat(parts, dim=-1)
        incoming = _all_to_all(outgoing, dim, plan.send_counts, plan.recv_counts, ctx.group)
        index = plan.send_index.to(incoming.device)
        widths = [shape[-1] for shape in ctx.shapes]
        local = [
            incoming.new_zeros(shape).index_add_(dim, index, part)
            for part, shape in zip(incoming.split(widths, dim=-1), ctx.shapes, strict=True)
        ]
        return (None, None, None, *local)


def _all_to_all(
    tensor: Tensor, dim: int, receive: tuple[int, ...], send: tuple[int, ...], group: Any
) -> Tensor:
    """``tensor``'s rows on ``dim``, ``send[o]`` of them to rank ``o`` in order, swapped for
    ``receive[o]`` rows from each rank ``o``: one ``all_to_all_single`` (which splits on dim 0)."""
    outgoing = tensor.movedim(dim, 0).contiguous()
    shape = list(outgoing.shape)
    shape[0] = sum(receive)
    incoming = outgoing.new_empty(shape)
    dist.all_to_all_single(incoming, outgoing, list(receive), list(send), group=group)
    return incoming.movedim(0, dim)


def exchange_kv(
    key: Tensor, value: Tensor, plan: KVExchange, dim: int, group: Any
) -> tuple[Tensor, Tensor]:
    """``key`` and ``value`` (this rank's slices on ``dim``) → the keys and values
    ``plan.block_mask`` attends; differentiable. One all-to-all each way where both have
    one dtype (their rows packed side by side), else one per tensor."""
    if key.dtype != value.dtype:
        (moved_key,) = _ExchangeKeys.apply(plan, dim, group, key)
        (moved_value,) = _ExchangeKeys.apply(plan, dim, group, value)
        return moved_key, moved_value
    moved_key, moved_value = _ExchangeKeys.apply(plan, dim, group, key, value)
    return moved_key, moved_value
