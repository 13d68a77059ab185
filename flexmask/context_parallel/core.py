"""The public entry points that shard now: ``shard`` (one rank's ``CPShard``, through a
``ShardCache`` or built) and ``imbalance`` (every rank's shard, costed).

The shard's parts live in one module each — ``rank_shard`` (``CPShard``), ``plan`` (the
arguments validated once), ``build`` (the permutation and the rank's rows),
``shard_cache`` (``ShardCache``), ``lazy`` (``LazyShard``) — and are importable from here
too, as before they were split out (a pickle made then names this module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer

from flexmask._validate import check_int, lengths
from flexmask.algebra import Mask
from flexmask.context_parallel.balance import _check_cost
from flexmask.context_parallel.build import build_rank_shard
from flexmask.context_parallel.lazy import LazyShard, lazy_shard
from flexmask.context_parallel.plan import plan_shard
from flexmask.context_parallel.rank_shard import CPShard
from flexmask.context_parallel.shard_cache import ShardCache, default_shard_cache

__all__ = [
    "CPShard",
    "LazyShard",
    "ShardCache",
    "default_shard_cache",
    "imbalance",
    "lazy_shard",
    "shard",
]


def shard(
    mask: Mask,
    B: int | None = None,
    H: int | None = None,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    mesh: Any = None,
    balancer: str | _LoadBalancer | None = "head_tail",
    BLOCK_SIZE: int | tuple[int, int] = 128,
    device: torch.device | str | None = None,
    cache: ShardCache | None = None,
) -> CPShard:
    """This rank's BlockMask shard and the permutation to shard q/k/v with.

    Args:
        mask: a flexmask expression over the whole (global) sequence.
        B, H: as for ``create_block_mask``.
        Q_LEN: global sequence length. KV_LEN: None (the same), or another key length with
            ``balancer=None``, as torch builds it: rank ``r`` keeps query rows
            ``[r Q_LEN / W, (r + 1) Q_LEN / W)`` (Q_LEN a multiple of W) against every key in
            its own order; ``shard_kv`` gives the rank's contiguous key slice.
        world_size, rank: the context-parallel group; or ``mesh``, a 1-D ``DeviceMesh``.
        balancer: ``"head_tail"`` (torch's), ``"mask_aware"`` (flexmask's, from this mask's
            block costs), ``"ptrr"`` (torch's PTRR, its block counts from structure), None
            (contiguous slices), or a ``_LoadBalancer`` instance —
            ``PerDocumentBalancer``, a multi-mask ``MaskAwareBalancer``, or torch's own.
        BLOCK_SIZE: any block size, an int or torch's ``(Q, KV)`` pair, square or not
            (FA4 on Blackwell: ``(256, 128)``); the local length need not be a multiple of
            either. Queries and keys are permuted alike, so the balancers that deal blocks
            (mask-aware, PTRR) deal units of ``lcm(Q, KV)`` tokens: whole blocks on both
            sides.
        device: where the BlockMask lives.
        cache: a ``ShardCache`` to look the shard up in (None: build every call).

    Returns:
        A ``CPShard``. A ``Q_LEN`` the balancer does not divide (head-tail: ``2W``,
        mask-aware and PTRR: ``W * lcm(Q, KV)``, which is ``W * BLOCK_SIZE`` for an int,
        None: ``W``; a per-document balancer's documents already sum to it) is padded up;
        the padding tokens attend nothing and nobody attends them (the mask is
        ``& padding(Q_LEN)``), and ``shard_tensor`` / ``restore`` add and drop them.

    Example:
        >>> import flexmask, torch
        >>> mask = flexmask.causal() & flexmask.document([100, 156])
        >>> s = flexmask.shard(mask, 1, 1, 256, world_size=2, rank=1, BLOCK_SIZE=64)
        >>> s.block_mask.shape, s.indices[0, s.local][::64].tolist()
        ((1, 1, 128, 256), [64, 128])
        >>> fa4 = flexmask.shard(flexmask.causal(), 1, 1, 1000, world_size=2, rank=0,
        ...                      balancer="mask_aware", BLOCK_SIZE=(256, 128))
        >>> fa4.padded_length, fa4.block_mask.BLOCK_SIZE, fa4.block_mask.shape
        (1024, (256, 128), (1, 1, 512, 1024))
    """
    if cache is not None and not isinstance(cache, ShardCache):
        raise TypeError(
            f"cache must be a flexmask ShardCache or None (build every call), got "
            f"{type(cache).__name__}"
        )
    Q_LEN = lengths(Q_LEN, KV_LEN, "shard")[0]
    plan = plan_shard(
        mask, B, H, Q_LEN, KV_LEN, world_size, rank, mesh, balancer, BLOCK_SIZE, device
    )
    if cache is None:
        return build_rank_shard(plan)
    return cache.get_or_build(plan.key, lambda: build_rank_shard(plan))


def imbalance(
    masks: Mask | Sequence[Mask],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    world_size: int,
    balancer: str | _LoadBalancer | None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    partial_cost: float = 1.0,
) -> float:
    """Max rank cost / mean rank cost of a balancer, from every rank's shard (full blocks +
    ``partial_cost`` × partial blocks, summed over masks, rows and heads) at ``BLOCK_SIZE``
    (an int or a ``(Q, KV)`` pair, as for ``shard``)."""
    masks = (masks,) if isinstance(masks, Mask) else tuple(masks)
    if not masks or not all(isinstance(m, Mask) for m in masks):
        raise TypeError(f"masks must be a flexmask Mask or a non-empty list of them, got {masks!r}")
    world_size = check_int(world_size, "world_size", minimum=1)
    partial_cost = _check_cost(partial_cost)
    costs = torch.stack(
        [
            shard_costs(mask, B, H, Q_LEN, world_size, balancer, BLOCK_SIZE, partial_cost)
            for mask in masks
        ]
    ).sum(0)
    mean = float(costs.mean())
    return float(costs.max()) / mean if mean else 1.0


def shard_costs(
    mask: Mask,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    world_size: int,
    balancer: Any,
    BLOCK_SIZE: int | tuple[int, int],
    partial_cost: float,
) -> Tensor:
    """``(world_size,)`` float64: each rank's shard of ``mask`` costed as full blocks +
    ``partial_cost`` x partial blocks, summed over rows and heads (a BlockMask broadcast over
    B or H counts once per row or head)."""
    costs = torch.zeros(world_size, dtype=torch.float64)
    for rank in range(world_size):
        bm = shard(
            mask,
            B,
            H,
            Q_LEN,
            world_size=world_size,
            rank=rank,
            balancer=balancer,
            BLOCK_SIZE=BLOCK_SIZE,
        ).block_mask
        full = bm.full_kv_num_blocks
        if full is None:  # flexmask's shards always write the full side
            raise RuntimeError("shard returned a BlockMask without its full blocks")
        rows = (B or 1) if bm.kv_num_blocks.shape[0] == 1 else 1
        heads = (H or 1) if bm.kv_num_blocks.shape[1] == 1 else 1
        work = full.sum(dtype=torch.float64) + partial_cost * bm.kv_num_blocks.sum(
            dtype=torch.float64
        )
        costs[rank] = float(work) * rows * heads
    return costs
