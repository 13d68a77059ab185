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

from flexmask.attention import flex_attention
from flexmask.mask import Mask

if TYPE_CHECKING:
    from flexmask.context_parallel.core import CPShard, LazyShard


def _group_name(group: Any) -> str:
    if group is None:
        group = c10d._get_default_group()
    elif hasattr(group, "get_group"):  # a DeviceMesh
        group = group.get_group()
    return c10d._get_process_group_name(group)


@overload
def cp_flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    shard: CPShard | LazyShard | BlockMask,
    group: Any = None,
    *,
    seq_dim: int = 2,
    return_lse: Literal[False] = False,
    **kwargs: Any,
) -> Tensor: ...


@overload
def cp_flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    shard: CPShard | LazyShard | BlockMask,
    group: Any = None,
    *,
    seq_dim: int = 2,
    return_lse: Literal[True],
    **kwargs: Any,
) -> tuple[Tensor, Tensor]: ...


def cp_flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    shard: CPShard | LazyShard | BlockMask,
    group: Any = None,
    *,
    seq_dim: int = 2,
    return_lse: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """flex_attention of this rank's queries against every rank's keys and values.

    Args:
        query, key, value: this rank's shards, (B, H, S / W, D), e.g. from
            ``CPShard.shard_tensor``.
        shard: this rank's ``CPShard`` (or a lazy one, or its BlockMask).
        group: the context-parallel ``DeviceMesh`` or process group (None: the default).
        seq_dim: the sequence dimension of key and value.
        return_lse: also return the log-sum-exp of the scores, as ``flexmask.flex_attention``.
        **kwargs: passed to ``flexmask.flex_attention`` (score_mod, scale, compile, ...).

    Returns:
        This rank's attention output, (B, H, S / W, Dv); differentiable in all three inputs.
        With ``return_lse`` the pair (output, lse).
    """
    block_mask = shard if isinstance(shard, BlockMask) else shard.block_mask
    full_key, full_value = flex_cp_allgather(
        key.contiguous(), value.contiguous(), seq_dim, _group_name(group)
    )
    return flex_attention(
        query, full_key, full_value, block_mask=block_mask, return_lse=return_lse, **kwargs
    )


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
    from flexmask.context_parallel.core import LazyShard

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

    full = context_parallel_unshard(mesh, list(buffers), list(seq_dims), shard.balancer)
    return [t.narrow(d, 0, shard.seq_length) for t, d in zip(full, seq_dims, strict=False)]
