"""A shard's plan: every argument of ``shard`` validated on Python ints, the balancer
resolved (a named one made once per mask and group), the spec of the whole padded sequence
the rank's rows are cut from, and the shard's cache key — all before anything is built."""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import cachetools
import torch
from torch.distributed.tensor.experimental._attention import _LoadBalancer

from flexmask._validate import INT64_MAX, check_device, check_int
from flexmask.algebra import Mask
from flexmask.blocks import block_sizes
from flexmask.context_parallel.balance import (
    HeadTailBalancer,
    MaskAwareBalancer,
    PTRRBalancer,
    _round_up,
    balancer_indices,
    balancer_key,
)
from flexmask.runtime import Spec, make_spec

BALANCERS = ("head_tail", "mask_aware", "ptrr", None)

# Mask-aware and PTRR balancers made from their names, by mask and group: every rank of a
# step (and, simulated in one process, every rank) shares them; a few steps' worth is kept.
_BALANCERS: cachetools.LRUCache = cachetools.LRUCache(maxsize=8)
_BALANCERS_LOCK = threading.Lock()


def _resolve_balancer(
    balancer: Any,
    mask: Mask,
    B: int | None,
    H: int | None,
    seq_length: int,
    world: int,
    block: tuple[int, int],
    device: torch.device,
) -> _LoadBalancer | None:
    if balancer is None or isinstance(balancer, _LoadBalancer):
        return balancer
    if not isinstance(balancer, str) or balancer not in BALANCERS:
        raise ValueError(
            f"balancer must be 'head_tail', 'mask_aware', 'ptrr', None or a torch _LoadBalancer "
            f"(e.g. flexmask.context_parallel.PerDocumentBalancer(...)), got {balancer!r}"
        )
    if balancer == "head_tail":
        return HeadTailBalancer(seq_length, world, device)
    size: int | tuple[int, int] = block[0] if block[0] == block[1] else block
    # "mask_aware" or "ptrr". Costing every query block reads the whole mask: made once per
    # mask and group, not once per rank (ranks simulated in one process, or a shard rebuilt
    # per step).
    key = (balancer, mask.key, B, H, seq_length, world, size, device.type, device.index)
    with _BALANCERS_LOCK:
        found = _BALANCERS.get(key)
    if found is None:
        kind = MaskAwareBalancer if balancer == "mask_aware" else PTRRBalancer
        found = kind(mask, B, H, seq_length, world, size, device=device)
        with _BALANCERS_LOCK:
            _BALANCERS[key] = found
    return found


def _world_and_rank(world_size: Any, rank: Any, mesh: Any) -> tuple[int, int]:
    if mesh is not None:
        if world_size is not None or rank is not None:
            raise ValueError("pass either mesh or world_size and rank, not both")
        if not callable(getattr(mesh, "size", None)) or not callable(
            getattr(mesh, "get_local_rank", None)
        ):
            raise TypeError(
                f"mesh must be a 1-D torch DeviceMesh (or None, with world_size and rank), got "
                f"{type(mesh).__name__} {mesh!r}"
            )
        return mesh.size(), mesh.get_local_rank()
    if world_size is None or rank is None:
        raise ValueError(
            f"pass world_size and rank (or mesh, a 1-D DeviceMesh), got world_size="
            f"{world_size!r} and rank={rank!r}"
        )
    world = check_int(world_size, "world_size", minimum=1)
    rank = check_int(rank, "rank", minimum=0)
    if rank >= world:
        raise ValueError(f"rank must be an int in [0, world_size={world}), got {rank}")
    return world, rank


def _block(BLOCK_SIZE: Any) -> tuple[int, int]:
    """(q_block, kv_block), parsed as every build parses it (``blocks.grid.block_sizes``):
    an int, or torch's (Q, KV) pair, square or not."""
    return block_sizes(BLOCK_SIZE)


def unit(block: tuple[int, int]) -> int:
    """The tokens a balancer deals as one: whole query blocks and whole key blocks alike,
    since keys are permuted with the queries' permutation (the lcm of the two sizes)."""
    return math.lcm(*block)


def _shown(block: tuple[int, int]) -> str:
    return str(block[0]) if block[0] == block[1] else str(block)


# The shard holds int64 positions of the padded sequence, padded again to whole blocks:
# a tensor of more than this many cannot be addressed (its byte size overflows int64).
MAX_POSITIONS = INT64_MAX // 8


def _check_positions(length: int, multiple: int, what: str) -> None:
    """``length`` rounded up to ``multiple`` must be an addressable int64 tensor."""
    padded = _round_up(length, multiple)
    if padded > MAX_POSITIONS:
        raise ValueError(
            f"{what}: padded to a multiple of {multiple}, {padded} positions, more than "
            f"a tensor of int64 positions can hold ({MAX_POSITIONS}); a sequence is far "
            "shorter, and world_size and BLOCK_SIZE far smaller"
        )


def _check_balancer(
    lb: _LoadBalancer, mask: Mask, B: int | None, Q_LEN: int, world: int, rows: int
) -> None:
    """A balancer made for another sequence, group or batch is refused by name."""
    seq_length = getattr(lb, "seq_length", None)
    if isinstance(seq_length, int) and seq_length != Q_LEN:
        raise ValueError(
            f"balancer {type(lb).__name__} was built for a sequence of seq_length={seq_length} "
            f"tokens, but Q_LEN is {Q_LEN}: build the balancer for Q_LEN (e.g. "
            f"HeadTailBalancer({Q_LEN}, {world}), or documents that sum to {Q_LEN})"
        )
    lb_world = getattr(lb, "world_size", None)
    if isinstance(lb_world, int) and lb_world != world:
        raise ValueError(
            f"balancer {type(lb).__name__} was built for world_size={lb_world}, but this "
            f"group has world_size={world}: build it for the group that shards"
        )
    batch = B if B is not None else mask.rows
    if rows > 1 and rows != batch:
        raise ValueError(
            f"balancer {type(lb).__name__} gives {rows} permutations (one per batch row), but "
            f"B is {batch}: pass B={rows}, or a balancer with one row (shared by every row)"
        )


class ShardPlan(NamedTuple):
    """A shard's arguments, validated (Python ints, a torch.device, a resolved balancer),
    the spec of the whole (padded) sequence it is cut from — the mask validated there, once
    — and its cache key: made at the call, before anything is built."""

    mask: Mask
    B: int | None
    H: int | None
    Q_LEN: int
    world: int
    rank: int
    block: tuple[int, int]
    device: torch.device
    balancer: _LoadBalancer | None
    padded: int
    key: tuple
    kv_length: int | None
    spec: Spec


def plan_shard(
    mask: Mask,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    world_size: Any,
    rank: Any,
    mesh: Any,
    balancer: Any,
    BLOCK_SIZE: Any,
    device: Any,
) -> ShardPlan:
    """Every argument validated on Python ints (nothing built but a named balancer)."""
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
    world, rank = _world_and_rank(world_size, rank, mesh)
    block = _block(BLOCK_SIZE)
    Q_LEN = check_int(Q_LEN, "Q_LEN", minimum=1)
    B = None if B is None else check_int(B, "B", minimum=1)
    H = None if H is None else check_int(H, "H", minimum=1)
    device = torch.device("cpu") if device is None else check_device(device)
    KV_LEN = None if KV_LEN is None else check_int(KV_LEN, "KV_LEN", minimum=1)
    if KV_LEN is not None and KV_LEN != Q_LEN:
        return _plan_other_keys(mask, B, H, Q_LEN, KV_LEN, world, rank, balancer, block, device)
    # Any balancer pads to at most a multiple of 2 W lcm(BLOCK_SIZE): refused before it is
    # made.
    _check_positions(
        Q_LEN,
        2 * world * unit(block),
        f"Q_LEN={Q_LEN} with world_size={world}, BLOCK_SIZE={_shown(block)}",
    )
    lb = _resolve_balancer(balancer, mask, B, H, Q_LEN, world, block, device)
    padded = getattr(lb, "padded_length", None)
    indices = None
    if padded is None:
        if lb is None:
            padded = _round_up(Q_LEN, world)
        else:
            indices = balancer_indices(lb)
            if indices.dim() != 2:
                raise ValueError(
                    f"balancer {type(lb).__name__} gives indices of shape "
                    f"{tuple(indices.shape)}; torch's _LoadBalancer contract is (rows, Q_LEN)"
                )
            padded = indices.shape[-1]
            if padded != Q_LEN:
                raise ValueError(
                    f"balancer permutes {padded} positions but Q_LEN is {Q_LEN}: build the "
                    "balancer for this sequence length"
                )
    if lb is not None:
        rows = getattr(lb, "rows", None)
        if not isinstance(rows, int):
            rows = (balancer_indices(lb) if indices is None else indices).shape[0]
        _check_balancer(lb, mask, B, Q_LEN, world, rows)
    if padded % world:
        raise ValueError(f"the balancer's length {padded} does not split into {world} ranks")
    key = (
        "cp_shard",
        world,
        rank,
        balancer_key(lb),
        B,
        H,
        Q_LEN,
        padded,
        block,
        (device.type, device.index),
        mask.key,
    )
    # The mask, checked once against the whole padded sequence the shard is cut from; a
    # rank holds 1/W of its BlockMask, so the whole one's memory bound does not apply.
    spec = make_spec(mask, B, H, padded, padded, device, block, sized=False)
    return ShardPlan(mask, B, H, Q_LEN, world, rank, block, device, lb, padded, key, None, spec)


def _plan_other_keys(
    mask: Mask,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    world: int,
    rank: int,
    balancer: Any,
    block: tuple[int, int],
    device: torch.device,
) -> ShardPlan:
    """KV_LEN != Q_LEN, as torch's ``_create_cp_block_mask`` builds it: without a balancer
    only. Rank ``r`` keeps query rows ``[r Q_LEN / W, (r + 1) Q_LEN / W)`` against all
    KV_LEN keys in their own order (contiguous kv slices, all-gathered)."""
    if balancer is not None:
        raise ValueError(
            f"KV_LEN ({KV_LEN}) != Q_LEN ({Q_LEN}) needs balancer=None, got {balancer!r}: a "
            "balancer permutes keys with the queries' permutation, which only a key sequence "
            "of the queries' length can take (torch's _create_cp_block_mask indexes keys past "
            "Q_LEN out of bounds, and below it lists keys no sharded key tensor holds)"
        )
    if Q_LEN % world:
        raise ValueError(
            f"Q_LEN ({Q_LEN}) must be a multiple of world_size ({world}) when KV_LEN != Q_LEN "
            "(the queries are not padded then): pad the queries"
        )
    _check_positions(Q_LEN, block[0], f"Q_LEN={Q_LEN} with BLOCK_SIZE={_shown(block)}")
    _check_positions(KV_LEN, block[1], f"KV_LEN={KV_LEN} with BLOCK_SIZE={_shown(block)}")
    where = (device.type, device.index)
    key = ("cp_shard", world, rank, ("none",), B, H, Q_LEN, ("kv", KV_LEN), block, where, mask.key)
    spec = make_spec(mask, B, H, Q_LEN, KV_LEN, device, block, sized=False)
    return ShardPlan(mask, B, H, Q_LEN, world, rank, block, device, None, Q_LEN, key, KV_LEN, spec)
