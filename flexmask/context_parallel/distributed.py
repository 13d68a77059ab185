"""The torch.distributed side: all-gather keys and values, shard buffers with torch's helpers.

Keys and values go through torch's own ``flex_cp_allgather`` op (the one ``_ContextParallel``
uses): its backward reduce-scatters the key/value gradients, so every rank gets the gradient
of its own shard summed over all ranks' queries. Gloo serves it on the CPU, where flexmask
attends through its block-sparse path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import torch.distributed.distributed_c10d as c10d
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _context_parallel_shard
from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import (
    flex_cp_allgather,
)
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.attention import flex_attention
from flexmask.context_parallel.agreement import agree
from flexmask.context_parallel.exchange import (
    check_exchange_group,
    exchange_kv,
    resolve_exchange,
)
from flexmask.context_parallel.exchange_plan import KVExchange

if TYPE_CHECKING:
    from flexmask.context_parallel.lazy import LazyShard
    from flexmask.context_parallel.rank_shard import CPShard


def _process_group(group: Any) -> c10d.ProcessGroup:
    """The process group of ``group``: None (the default group), a 1-D DeviceMesh, or a
    ProcessGroup. Local: no collective."""
    if group is None:
        return c10d._get_default_group()
    if callable(getattr(group, "get_group", None)):  # a DeviceMesh
        return group.get_group()
    if isinstance(group, c10d.ProcessGroup):
        return group
    raise TypeError(
        f"group must be None (the default group), a 1-D DeviceMesh or a ProcessGroup, got "
        f"{type(group).__name__} {group!r}"
    )


def _check_before_gather(
    query: Any, key: Any, value: Any, shard: Any, seq_dim: Any, group: Any
) -> tuple[BlockMask, int, c10d.ProcessGroup]:
    """Every check that this rank can make alone, made before the all-gather: a rank whose
    keys or values do not fit its shard raises here, instead of entering a collective that
    aborts the process (gloo: "Received data size doesn't match expected size") or leaves
    the other ranks waiting. Returns the BlockMask, ``seq_dim`` as a dim of ``key`` and the
    process group."""
    from flexmask.context_parallel.lazy import LazyShard
    from flexmask.context_parallel.rank_shard import CPShard

    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(shard, (CPShard, LazyShard, BlockMask)):
        raise TypeError(
            f"shard must be this rank's CPShard (flexmask.shard), a LazyShard, its "
            f"BlockMask or its KVExchange (plan_exchange), got {type(shard).__name__}"
        )
    dim = check_int(seq_dim, "seq_dim")
    if key.dim() < 2 or not -key.dim() <= dim < key.dim() or dim % key.dim() != key.dim() - 2:
        raise ValueError(
            f"seq_dim={dim} must be the keys' sequence dim, which flex_attention reads as the "
            f"second to last: 2 (or -2) for (B, H, S, D) keys, got key of shape "
            f"{tuple(key.shape)}"
        )
    dim %= key.dim()
    if value.dim() != key.dim() or value.shape[:-1] != key.shape[:-1]:
        raise ValueError(
            f"value must match key in every dim but the last, (B, H, S), got key of shape "
            f"{tuple(key.shape)} and value of shape {tuple(value.shape)}"
        )
    process_group = _process_group(group)
    world = c10d.get_world_size(process_group)
    if isinstance(shard, (CPShard, LazyShard)):
        shard_world = shard.world_size
        if shard_world != world:
            raise ValueError(
                f"shard was made for world_size={shard_world}, but group has {world} ranks: "
                "pass the group the shard was made for"
            )
    block_mask = shard if isinstance(shard, BlockMask) else shard.block_mask
    q_len, kv_len = block_mask.seq_lengths
    if query.dim() < 2 or query.shape[-2] != q_len:
        raise ValueError(
            f"query must hold this rank's {q_len} queries on dim -2 (the shard's rows), got "
            f"shape {tuple(query.shape)}"
        )
    if kv_len % world or key.shape[dim] * world != kv_len:
        raise ValueError(
            f"key and value must hold this rank's slice of the keys on dim {dim}: the shard "
            f"attends {kv_len} keys gathered from {world} ranks, so {kv_len / world:g} per "
            f"rank; got key of shape {tuple(key.shape)}. Every rank must pass a slice of that "
            "length (CPShard.shard_tensor / shard_kv give it)"
        )
    return block_mask, dim, process_group


@overload
def cp_flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    shard: CPShard | LazyShard | BlockMask | KVExchange,
    group: Any = None,
    *,
    seq_dim: int = 2,
    exchange: str = "auto",
    return_lse: Literal[False] = False,
    **kwargs: Any,
) -> Tensor: ...


@overload
def cp_flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    shard: CPShard | LazyShard | BlockMask | KVExchange,
    group: Any = None,
    *,
    seq_dim: int = 2,
    exchange: str = "auto",
    return_lse: Literal[True],
    **kwargs: Any,
) -> tuple[Tensor, Tensor]: ...


def cp_flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    shard: CPShard | LazyShard | BlockMask | KVExchange,
    group: Any = None,
    *,
    seq_dim: int = 2,
    exchange: str = "auto",
    return_lse: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """flex_attention of this rank's queries against every rank's keys and values.

    Args:
        query, key, value: this rank's shards, (B, H, S / W, D), e.g. from
            ``CPShard.shard_tensor``.
        shard: this rank's ``CPShard`` (or a lazy one, or its BlockMask), or its
            ``KVExchange`` (``flexmask.context_parallel.plan_exchange``: the shard and the
            plan to receive only the keys and values its queries read).
        group: the context-parallel ``DeviceMesh`` or process group (None: the default).
        seq_dim: the sequence dimension of key and value: 2 (or -2), where flex_attention
            reads it.
        exchange: ``"auto"`` — a ``KVExchange`` exchanges only the needed keys unless that
            would move more than half of the all-gather to some rank (its ``needed``), any
            other shard all-gathers; ``"needed"`` — only the needed keys (a ``KVExchange``,
            or a lazy shard planned from its recipe); ``"all_gather"`` — every key.
        return_lse: also return the log-sum-exp of the scores, as ``flexmask.flex_attention``.
        **kwargs: passed to ``flexmask.flex_attention`` (score_mod, scale, compile, ...).

    Returns:
        This rank's attention output, (B, H, S / W, Dv); differentiable in all three inputs.
        With ``return_lse`` the pair (output, lse).

    Raises:
        ValueError / TypeError: where this rank's inputs do not fit its shard (keys or
            values of another length, a wrong ``seq_dim``, a group of another size), this
            rank's own error; every other rank raises a ValueError naming this one.
        ValueError: on every rank alike, where the ranks disagree on anything that decides
            the result: (dims, B, H, S, D, dtype) of query, key or value, the shard's lengths,
            block size, arguments, mask (a fingerprint of its pieces and data) or
            permutation, the path (exchange or all-gather), the exchange's split sizes. The
            error names the first field that differs and each rank's value. Both come from
            one small all-gather of fixed size made before any key or value moves (on both
            paths). See docs/context-parallel.md for what it cannot see.
    """
    try:
        plan = resolve_exchange(shard, exchange)
        own = shard.shard if isinstance(shard, KVExchange) else shard  # what the keys follow
        block_mask, seq_dim, process_group = _check_before_gather(
            query, key, value, own, seq_dim, group
        )
        world = c10d.get_world_size(process_group)
        if plan is not None:
            check_exchange_group(plan, world, c10d.get_rank(process_group))
    except (TypeError, ValueError):
        _share_refusal(query, key, value, group)
        raise
    # Every rank learns every other's inputs before anything moves: nothing reaches gloo
    # (or NCCL) with tensors, masks or paths that disagree.
    agree(query, key, value, own, plan, False, process_group, world)
    if plan is not None:
        needed_key, needed_value = exchange_kv(
            key.contiguous(), value.contiguous(), plan, seq_dim, process_group
        )
        return flex_attention(
            query,
            needed_key,
            needed_value,
            block_mask=plan.block_mask,
            return_lse=return_lse,
            **kwargs,
        )
    full_key, full_value = flex_cp_allgather(
        key.contiguous(), value.contiguous(), seq_dim, c10d._get_process_group_name(process_group)
    )
    return flex_attention(
        query, full_key, full_value, block_mask=block_mask, return_lse=return_lse, **kwargs
    )


def _share_refusal(query: Any, key: Any, value: Any, group: Any) -> None:
    """This rank refused its inputs: it says so in the agreement's all-gather, so that every
    other rank raises too instead of waiting in a collective for it, then its caller raises
    its own error. Where there is no group to tell (none initialized, or ``group`` itself is
    what was refused) the error is this rank's alone."""
    try:
        process_group = _process_group(group)
        world = c10d.get_world_size(process_group)
    except (TypeError, ValueError, RuntimeError):
        return
    agree(query, key, value, None, None, True, process_group, world)


def shard_buffers(
    shard: CPShard,
    mesh: Any,
    buffers: Sequence[Any] | Mapping[str, Any],
    seq_dims: Sequence[int] | Mapping[str, int],
) -> Any:
    """torch's ``_context_parallel_shard`` with flexmask's shard for every mask buffer.

    Tensors are padded to the shard's length and sharded by torch with the shard's balancer;
    BlockMask / Mask / lazy-shard entries become this rank's prebuilt BlockMask (torch does
    not rebuild it). The drop-in for torchtitan-style ``cp_shard``.
    """
    from flexmask.context_parallel.lazy import LazyShard
    from flexmask.context_parallel.rank_shard import CPShard

    if not isinstance(shard, CPShard):
        raise TypeError(f"shard must be a CPShard (flexmask.shard), got {type(shard).__name__}")
    for arg, given in (("buffers", buffers), ("seq_dims", seq_dims)):
        if isinstance(given, (str, bytes)) or not isinstance(given, (Sequence, Mapping)):
            raise TypeError(
                f"{arg} must be a list (or a dict by name), one entry per buffer, got {given!r}"
            )
    is_map = isinstance(buffers, Mapping)
    items: list[tuple[str | int, Any]] = (
        list(buffers.items()) if isinstance(buffers, Mapping) else list(enumerate(buffers))
    )
    names = [name for name, _ in items]
    if len(seq_dims) != len(names):
        raise ValueError(
            f"seq_dims must give one dim per buffer ({len(names)}), got {len(seq_dims)}"
        )
    dims: dict[str | int, int] = (
        {name: dim for name, dim in seq_dims.items()}
        if isinstance(seq_dims, Mapping)
        else dict(enumerate(seq_dims))
    )
    tensors: list[tuple[str | int, Tensor]] = []
    tensor_dims: list[int] = []
    out: dict[str | int, Any] = {}
    for name, item in items:
        if name not in dims:
            raise ValueError(f"seq_dims gives no dim for buffers[{name!r}]")
        dim = dims[name]
        if isinstance(item, (BlockMask, Mask, LazyShard)):
            out[name] = shard.block_mask
        elif isinstance(item, Tensor):
            tensors.append((name, shard.pad(item, dim)))
            tensor_dims.append(dim)
        else:
            raise TypeError(
                f"buffers[{name!r}] must be a tensor, a BlockMask, a flexmask Mask or a lazy "
                f"shard, got {type(item).__name__}"
            )
    if tensors:
        sharded = _context_parallel_shard(
            mesh, [t for _, t in tensors], tensor_dims, load_balancer=shard.balancer
        )
        out.update({name: t for (name, _), t in zip(tensors, sharded, strict=False)})
    return {n: out[n] for n in names} if is_map else [out[n] for n in names]


def unshard(shard: CPShard, mesh: Any, buffers: Sequence[Tensor], seq_dims: Sequence[int]):
    """torch's ``context_parallel_unshard`` with the shard's balancer, padding dropped."""
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    from flexmask.context_parallel.rank_shard import CPShard

    if not isinstance(shard, CPShard):
        raise TypeError(f"shard must be a CPShard (flexmask.shard), got {type(shard).__name__}")
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"seq_dims must give one dim per buffer ({len(buffers)}), got {len(seq_dims)}"
        )
    # Checked here, before torch's all-gather: a bad dim raises on this rank alone.
    seq_dims = [shard._dim(t, d, "unshard") for t, d in zip(buffers, seq_dims, strict=True)]

    full = context_parallel_unshard(mesh, list(buffers), list(seq_dims), shard.balancer)
    return [t.narrow(d, 0, shard.seq_length) for t, d in zip(full, seq_dims, strict=False)]
