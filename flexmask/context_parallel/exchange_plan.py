"""Which keys and values each rank sends to which: planned from every rank's shard, on every
rank alike, with no communication.

Every rank can build every rank's shard from the same mask and permutation, so every rank
knows what every other one reads (``received.needed_keys``): rank ``r`` sends rank ``o`` the
positions of its own key slice that ``o`` reads, and receives what it reads from each owner.
The same inputs give every rank the same plan — the split sizes of one all-to-all agree,
and so does the choice between it and the all-gather.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cachetools
import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int, lengths
from flexmask.algebra import Mask
from flexmask.context_parallel.build import build_rank_shard
from flexmask.context_parallel.plan import ShardPlan, plan_shard
from flexmask.context_parallel.rank_shard import CPShard
from flexmask.context_parallel.received import (
    Needed,
    needed_keys,
    received_block_mask,
    received_length,
)
from flexmask.runtime import on_cache_clear

EXCHANGES = ("auto", "needed", "all_gather")

NEEDED_AT_MOST = 0.5
"""``exchange="auto"`` exchanges only the needed keys where no rank receives more than this
share of what the all-gather brings it. Moving every key, gloo's all-to-all took 0.9-1.7x its
all-gather's time on 4-8 CPU ranks (NCCL's all-gather is tuned further); below half the
bytes the exchange won in every case measured (benchmarks/bench_cp_exchange.py)."""


@dataclass(frozen=True, eq=False)
class KVExchange:
    """One rank's plan to receive only the keys and values its queries read.

    Attributes:
        shard: this rank's ``CPShard`` (or its BlockMask): every key, in the all-gathered order.
        block_mask: the shard's BlockMask over the received keys (its listed key blocks laid
            end to end, in the same order).
        world_size, rank: the group the plan is for.
        send_index: (n,) int64: positions of this rank's key slice to send, grouped by the
            rank they go to (rank 0's first).
        send_counts: how many of ``send_index`` go to each rank.
        recv_counts: how many keys this rank receives from each rank (itself included).
        recv_slots: where each received key lands among ``block_mask``'s keys; None where
            every one of them is received, in order. Keys not received stay zero: no query of
            this rank attends them.
        received: keys every rank receives from the others (its own slice aside), by rank.
        slice_length: keys per rank's slice (what the all-gather brings from each rank).
        needed: ``exchange="auto"``'s choice, the same on every rank: True where no rank
            receives more than ``NEEDED_AT_MOST`` of what the all-gather brings it.
    """

    shard: CPShard | BlockMask
    block_mask: BlockMask
    world_size: int
    rank: int
    send_index: Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_slots: Tensor | None
    received: tuple[int, ...]
    slice_length: int
    needed: bool

    @property
    def gathered(self) -> int:
        """Keys the all-gather brings each rank from the others: ``(W - 1) * slice_length``."""
        return (self.world_size - 1) * self.slice_length

    def received_bytes(self, key: Tensor, value: Tensor, exchange: str = "needed") -> int:
        """Bytes this rank receives from the others for ``key`` and ``value`` (this rank's
        slices): under the plan (``"needed"``) or the all-gather (``"all_gather"``)."""
        per_key = sum(t.numel() // t.shape[-2] * t.element_size() for t in (key, value))
        count = self.received[self.rank] if exchange == "needed" else self.gathered
        return count * per_key

    def __repr__(self) -> str:
        return (
            f"KVExchange(rank={self.rank}, world_size={self.world_size}, received="
            f"{self.received[self.rank]} of {self.gathered} keys, most received by a rank="
            f"{max(self.received)}, needed={self.needed})"
        )


def exchange_from_block_masks(
    block_masks: Sequence[BlockMask], rank: int, shard: CPShard | None = None
) -> KVExchange:
    """Rank ``rank``'s plan from every rank's shard BlockMask (``block_masks[o]`` rank
    ``o``'s, all of one key length and block size); ``shard``: this rank's ``CPShard``, kept
    on the plan. Pure and local: the same list gives every rank the same plan."""
    world = len(block_masks)
    if not world or not all(isinstance(bm, BlockMask) for bm in block_masks):
        raise TypeError(f"block_masks must be every rank's BlockMask shard, got {block_masks!r}")
    rank = check_int(rank, "rank", minimum=0)
    if rank >= world:
        raise ValueError(f"rank must be in [0, {world}) for {world} block masks, got {rank}")
    kv_len = int(block_masks[0].seq_lengths[1])
    block = tuple(block_masks[0].BLOCK_SIZE)
    for o, bm in enumerate(block_masks):
        if int(bm.seq_lengths[1]) != kv_len or tuple(bm.BLOCK_SIZE) != block:
            raise ValueError(
                f"every rank's shard must attend the same keys in the same blocks: rank 0's "
                f"has KV_LEN={kv_len}, BLOCK_SIZE={block}; rank {o}'s {bm.seq_lengths[1]}, "
                f"{tuple(bm.BLOCK_SIZE)}"
            )
    if kv_len % world:
        raise ValueError(f"KV_LEN={kv_len} does not split into {world} equal key slices")
    needs = [needed_keys(bm) for bm in block_masks]
    return _exchange(needs, block_masks[rank], rank, kv_len // world, shard)


def _exchange(
    needs: Sequence[Needed],
    block_mask: BlockMask,
    rank: int,
    slice_length: int,
    shard: CPShard | None,
) -> KVExchange:
    world = len(needs)
    kv_len = world * slice_length
    edges = torch.arange(world + 1) * slice_length
    mine = slice(rank * slice_length, (rank + 1) * slice_length)
    send, send_counts, received = [], [], []
    for other, need in enumerate(needs):
        cuts = torch.searchsorted(need.positions, edges).tolist()
        send.append(need.positions[cuts[rank] : cuts[rank + 1]] - mine.start)
        send_counts.append(cuts[rank + 1] - cuts[rank])
        received.append(int(need.positions.numel()) - (cuts[other + 1] - cuts[other]))
    blocks, positions = needs[rank]
    recv_counts = torch.searchsorted(positions, edges).diff().tolist()
    kv_block = int(block_mask.BLOCK_SIZE[1])
    slot_of_block = torch.searchsorted(blocks, positions // kv_block)
    slots = slot_of_block * kv_block + positions % kv_block
    length = received_length(blocks, kv_block, kv_len)
    whole = slots.numel() == length  # every key of every listed block: slots are 0..n-1
    most = max(received) if received else 0
    return KVExchange(
        shard=block_mask if shard is None else shard,
        block_mask=received_block_mask(block_mask, blocks),
        world_size=world,
        rank=rank,
        send_index=torch.cat(send) if send else torch.zeros(0, dtype=torch.int64),
        send_counts=tuple(send_counts),
        recv_counts=tuple(recv_counts),
        recv_slots=None if whole else slots,
        received=tuple(received),
        slice_length=slice_length,
        needed=most <= NEEDED_AT_MOST * (world - 1) * slice_length,
    )


# Plans by their rank's shard key: the layers of a step (and, simulated in one process,
# every rank) share one; a few steps' worth is kept.
_EXCHANGES: cachetools.LRUCache = cachetools.LRUCache(maxsize=8)
_EXCHANGES_LOCK = threading.Lock()


def _clear_exchanges() -> None:
    with _EXCHANGES_LOCK:
        _EXCHANGES.clear()


# flexmask.cache_clear() empties the plans with the BlockMasks they were made from.
on_cache_clear(_clear_exchanges)


def plan_exchange(
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
) -> KVExchange:
    """This rank's shard and its plan to receive only the keys and values it reads.

    Takes ``flexmask.shard``'s arguments. Builds every rank's shard (each rank needs to know
    what the others read from it; no collective), keeps this rank's, and plans: pass the
    result to ``cp_flex_attention`` as its shard. Plans are kept by shard key (a few), so the
    layers of a step share one.

    Example:
        >>> import flexmask
        >>> mask = flexmask.causal() & flexmask.document([256, 256, 512])
        >>> ex = flexmask.context_parallel.plan_exchange(
        ...     mask, 1, 1, 1024, world_size=4, rank=2, balancer=None, BLOCK_SIZE=64)
        >>> ex.received, ex.gathered, ex.needed
        ((0, 0, 0, 256), 768, True)
    """
    Q_LEN = lengths(Q_LEN, KV_LEN, "plan_exchange")[0]
    plan = plan_shard(
        mask, B, H, Q_LEN, KV_LEN, world_size, rank, mesh, balancer, BLOCK_SIZE, device
    )
    return exchange_for_plan(plan, None)


def exchange_for_plan(plan: ShardPlan, own: CPShard | None) -> KVExchange:
    """The plan of ``plan``'s rank (its shard ``own`` where already built), cached by the
    shard's key."""
    key = ("cp_exchange", plan.key)
    with _EXCHANGES_LOCK:
        found = _EXCHANGES.get(key)
    if found is not None:
        return found
    shards: list[BlockMask] = []
    mine = own
    for other in range(plan.world):
        if other == plan.rank:
            mine = build_rank_shard(plan) if own is None else own
            shards.append(mine.block_mask)
            continue
        # The resolved balancer: a named one is not made again per rank.
        other_plan = plan_shard(
            plan.mask,
            plan.B,
            plan.H,
            plan.Q_LEN,
            plan.kv_length,
            plan.world,
            other,
            None,
            plan.balancer,
            plan.block,
            plan.device,
        )
        shards.append(build_rank_shard(other_plan).block_mask)
    made = exchange_from_block_masks(shards, plan.rank, mine)
    with _EXCHANGES_LOCK:
        _EXCHANGES[key] = made
    return made
