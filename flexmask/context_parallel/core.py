"""``shard``, its result ``CPShard``, the rank-aware ``ShardCache`` and lazy shards: the
entry points the package docstring (``flexmask.context_parallel``) describes."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cachetools
import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer
from torch.nn.attention.flex_attention import BlockMask

from flexmask.build.create import build as build_window
from flexmask.build.create import cpu_threads
from flexmask.build.grid import BlockGrid, make_grid
from flexmask.build.read import block_mask_nbytes
from flexmask.cache import KeyedCache
from flexmask.context_parallel.balance import (
    HeadTailBalancer,
    MaskAwareBalancer,
    PTRRBalancer,
    balancer_indices,
    balancer_key,
)
from flexmask.context_parallel.shard import KeyOrder, build_shard
from flexmask.mask import Mask
from flexmask.pieces import padding

BALANCERS = ("head_tail", "mask_aware", "ptrr", None)


@dataclass(frozen=True, eq=False)
class CPShard:
    """One rank's share of a context-parallel attention.

    Attributes:
        block_mask: the local BlockMask, ``(B, H, padded_length / W, padded_length)``; B and H
            are 1 where the mask ignores them.
        indices: (1 or B, padded_length) int64: ``x[..., indices, ...]`` is the permuted
            sequence; this rank keeps the slice ``local`` of it.
        balancer: the ``_LoadBalancer`` that gave ``indices`` (pass it to torch's
            ``_context_parallel_shard`` / ``context_parallel_unshard``), or None.
        seq_length: real sequence length; padded_length: what it is padded to (zeros
            appended by ``shard_tensor``; those tokens neither attend nor are attended).
        kv_length: the key/value length where it differs from the query length (then
            ``balancer`` is None: keys stay in their order, see ``shard_kv``), else None.
    """

    block_mask: BlockMask
    indices: Tensor
    balancer: _LoadBalancer | None
    rank: int
    world_size: int
    seq_length: int
    padded_length: int
    key: tuple = field(repr=False)
    kv_length: int | None = None

    @property
    def local(self) -> slice:
        size = self.padded_length // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def pad(self, tensor: Tensor, seq_dim: int) -> Tensor:
        """``tensor`` zero-padded along ``seq_dim`` to ``padded_length``."""
        extra = self.padded_length - tensor.shape[seq_dim]
        if extra < 0:
            raise ValueError(
                f"tensor has {tensor.shape[seq_dim]} positions on dim {seq_dim}, more than "
                f"the sharded sequence ({self.padded_length})"
            )
        if extra == 0:
            return tensor
        shape = list(tensor.shape)
        shape[seq_dim] = extra
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=seq_dim)

    def shard_tensor(self, tensor: Tensor, seq_dim: int) -> Tensor:
        """This rank's slice of ``tensor`` (batch first), padded and permuted: no collective."""
        tensor = self.pad(tensor, seq_dim)
        index = self.indices[:, self.local].to(tensor.device)
        if seq_dim == 0:
            return tensor.index_select(0, index[0])
        shape = [1] * tensor.dim()
        shape[0], shape[seq_dim] = index.shape[0], index.shape[1]
        target = list(tensor.shape)
        target[seq_dim] = index.shape[1]
        return torch.gather(tensor, seq_dim, index.view(shape).expand(target))

    def shard_kv(self, tensor: Tensor, seq_dim: int) -> Tensor:
        """This rank's slice of a key/value tensor: ``shard_tensor`` where keys and queries
        share the sequence, else (``kv_length`` set) the contiguous ``kv_length / W``
        positions torch's ``_context_parallel_shard`` keeps without a balancer."""
        if self.kv_length is None:
            return self.shard_tensor(tensor, seq_dim)
        if tensor.shape[seq_dim] != self.kv_length or self.kv_length % self.world_size:
            raise ValueError(
                f"tensor has {tensor.shape[seq_dim]} positions on dim {seq_dim}; keys of "
                f"this shard need kv_length = {self.kv_length}, a multiple of world_size = "
                f"{self.world_size} (the all-gather joins equal slices)"
            )
        size = self.kv_length // self.world_size
        return tensor.narrow(seq_dim, self.rank * size, size)

    def restore(self, gathered: Tensor, seq_dim: int) -> Tensor:
        """A gathered (permuted, padded) tensor back in the original order, unpadded."""
        index = torch.argsort(self.indices, dim=-1).to(gathered.device)
        shape = [1] * gathered.dim()
        shape[0], shape[seq_dim] = index.shape[0], index.shape[1]
        out = torch.gather(gathered, seq_dim, index.view(shape).expand(gathered.shape))
        return out.narrow(seq_dim, 0, self.seq_length)


# Permutations and their key orders by balancer content key and block size, and mask-aware
# balancers made from "mask_aware" by mask and group: every rank of a
# step (and, simulated in one process, every rank) shares them; a few steps' worth is kept.
_PERMUTATIONS: cachetools.LRUCache = cachetools.LRUCache(maxsize=8)
_PERMUTATIONS_LOCK = threading.Lock()
_BALANCERS: cachetools.LRUCache = cachetools.LRUCache(maxsize=8)


def _resolve_balancer(
    balancer: Any,
    mask: Mask,
    B: int | None,
    H: int | None,
    seq_length: int,
    world: int,
    block: int,
    device: torch.device,
) -> _LoadBalancer | None:
    if balancer is None or isinstance(balancer, _LoadBalancer):
        return balancer
    if balancer == "head_tail":
        return HeadTailBalancer(seq_length, world, device)
    if balancer in ("mask_aware", "ptrr"):
        # Costing every query block reads the whole mask: made once per mask and group,
        # not once per rank (ranks simulated in one process, or a shard rebuilt per step).
        key = (balancer, mask.key, B, H, seq_length, world, block, device.type, device.index)
        with _PERMUTATIONS_LOCK:
            found = _BALANCERS.get(key)
        if found is None:
            kind = MaskAwareBalancer if balancer == "mask_aware" else PTRRBalancer
            found = kind(mask, B, H, seq_length, world, block, device=device)
            with _PERMUTATIONS_LOCK:
                _BALANCERS[key] = found
        return found
    raise ValueError(
        f"balancer must be 'head_tail', 'mask_aware', 'ptrr', None or a torch _LoadBalancer (e.g. "
        f"flexmask.PerDocumentBalancer(...)), got {balancer!r}"
    )


def _world_and_rank(world_size: Any, rank: Any, mesh: Any) -> tuple[int, int]:
    if mesh is not None:
        if world_size is not None or rank is not None:
            raise ValueError("pass either mesh or world_size and rank, not both")
        return mesh.size(), mesh.get_local_rank()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (or pass mesh), got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    return world_size, rank


def _block(BLOCK_SIZE: Any) -> int:
    if isinstance(BLOCK_SIZE, tuple) and len(BLOCK_SIZE) == 2 and BLOCK_SIZE[0] == BLOCK_SIZE[1]:
        BLOCK_SIZE = BLOCK_SIZE[0]
    if isinstance(BLOCK_SIZE, bool) or not isinstance(BLOCK_SIZE, int) or BLOCK_SIZE < 1:
        raise ValueError(
            f"BLOCK_SIZE must be an int >= 1 (or an (n, n) pair: queries and keys are permuted "
            f"alike), got {BLOCK_SIZE!r}"
        )
    return BLOCK_SIZE


def _plan(
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
) -> tuple:
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
    world, rank = _world_and_rank(world_size, rank, mesh)
    block = _block(BLOCK_SIZE)
    if isinstance(Q_LEN, bool) or not isinstance(Q_LEN, int) or Q_LEN < 1:
        raise ValueError(f"Q_LEN must be an int >= 1, got {Q_LEN!r}")
    device = torch.device("cpu" if device is None else device)
    if KV_LEN is not None and KV_LEN != Q_LEN:
        return _plan_other_keys(mask, B, H, Q_LEN, KV_LEN, world, rank, balancer, block, device)
    lb = _resolve_balancer(balancer, mask, B, H, Q_LEN, world, block, device)
    padded = getattr(lb, "padded_length", None)
    if padded is None:
        if lb is None:
            padded = -(-Q_LEN // world) * world
        else:
            padded = balancer_indices(lb).shape[-1]
            if padded != Q_LEN:
                raise ValueError(
                    f"balancer permutes {padded} positions but Q_LEN is {Q_LEN}: build the "
                    "balancer for this sequence length"
                )
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
    return world, rank, block, device, lb, padded, key, None


def _plan_other_keys(
    mask: Mask,
    B: Any,
    H: Any,
    Q_LEN: int,
    KV_LEN: Any,
    world: int,
    rank: int,
    balancer: Any,
    block: int,
    device: torch.device,
) -> tuple:
    """KV_LEN != Q_LEN, as torch's ``_create_cp_block_mask`` builds it: without a balancer
    only. Rank ``r`` keeps query rows ``[r Q_LEN / W, (r + 1) Q_LEN / W)`` against all
    KV_LEN keys in their own order (contiguous kv slices, all-gathered)."""
    if isinstance(KV_LEN, bool) or not isinstance(KV_LEN, int) or KV_LEN < 1:
        raise ValueError(f"KV_LEN must be None or an int >= 1, got {KV_LEN!r}")
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
    where = (device.type, device.index)
    key = ("cp_shard", world, rank, ("none",), B, H, Q_LEN, ("kv", KV_LEN), block, where, mask.key)
    return world, rank, block, device, None, Q_LEN, key, KV_LEN


def _permutation(
    lb: _LoadBalancer | None, padded: int, block: int
) -> tuple[Tensor, tuple[KeyOrder, ...]]:
    """The balancer's indices (int64, CPU; read-only, shared) and each row's KeyOrder,
    cached when the balancer has a content ``key`` (else made every call)."""
    key = ("none", padded) if lb is None else getattr(lb, "key", None)
    if isinstance(key, tuple):
        with _PERMUTATIONS_LOCK:
            found = _PERMUTATIONS.get((key, block))
        if found is not None:
            return found
    if lb is None:
        indices = torch.arange(padded).view(1, -1)
    else:
        indices = balancer_indices(lb).to(torch.int64).cpu()
    made = indices, tuple(KeyOrder.of(row, block) for row in indices)
    if isinstance(key, tuple):
        with _PERMUTATIONS_LOCK:
            _PERMUTATIONS[(key, block)] = made
    return made


def _build(mask: Mask, B: Any, H: Any, Q_LEN: int, plan: tuple) -> CPShard:
    world, rank, block, device, lb, padded, key, kv_length = plan
    with cpu_threads(device):
        indices, keys = _permutation(lb, padded, block)
        if kv_length is not None:  # contiguous query rows against keys in their order
            # Validated against the whole Q_LEN x KV_LEN mask; the rank's window of it is
            # built with lookups over the whole sequence.
            whole = make_grid(mask, B, H, Q_LEN, kv_length, device, block)
            local = Q_LEN // world
            grid = BlockGrid.make(
                whole.batch,
                whole.heads,
                local,
                kv_length,
                block,
                block,
                whole.device,
                q_offset=rank * local,
                reach=whole.length,
            )
            block_mask = build_window(mask, grid)
            return CPShard(block_mask, indices, lb, rank, world, Q_LEN, padded, key, kv_length)
        built = mask if padded == Q_LEN else mask & padding(Q_LEN)
        block_mask = build_shard(built, B, H, indices, rank, world, block, device, keys)
    return CPShard(block_mask, indices, lb, rank, world, Q_LEN, padded, key)


def shard(
    mask: Mask,
    B: int | None = None,
    H: int | None = None,
    Q_LEN: int = 128,
    KV_LEN: int | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    mesh: Any = None,
    balancer: str | _LoadBalancer | None = "head_tail",
    BLOCK_SIZE: int = 128,
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
        BLOCK_SIZE: any block size; the local length need not be a multiple of it.
        device: where the BlockMask lives.
        cache: a ``ShardCache`` to look the shard up in (None: build every call).

    Returns:
        A ``CPShard``. A ``Q_LEN`` the balancer does not divide (head-tail: ``2W``,
        mask-aware and PTRR: ``W * BLOCK_SIZE``, None: ``W``) is padded up; the padding
        tokens attend nothing and nobody attends them (the mask is ``& padding(Q_LEN)``), and
        ``shard_tensor`` / ``restore`` add and drop them.

    Example:
        >>> import flexmask, torch
        >>> mask = flexmask.causal() & flexmask.document([100, 156])
        >>> s = flexmask.shard(mask, 1, 1, 256, world_size=2, rank=1, BLOCK_SIZE=64)
        >>> s.block_mask.shape, s.indices[0, s.local][::64].tolist()
        ((1, 1, 128, 256), [64, 128])
    """
    plan = _plan(mask, B, H, Q_LEN, KV_LEN, world_size, rank, mesh, balancer, BLOCK_SIZE, device)
    if cache is None:
        return _build(mask, B, H, Q_LEN, plan)
    return cache.get_or_build(plan[6], lambda: _build(mask, B, H, Q_LEN, plan))


class ShardCache(KeyedCache):
    """An LRU of CPShards keyed by (world size, rank, balancer, shape, mask): rank-aware.

    Every rank computes the same key for the same inputs, no collective needed; a key never
    matches another rank's shard. Bounded by entries and by bytes of BlockMask tensors.

    Example:
        >>> import flexmask
        >>> cache = flexmask.ShardCache(maxsize=4)
        >>> a = flexmask.shard(flexmask.causal(), 1, 1, 512, world_size=2, rank=0, cache=cache)
        >>> b = flexmask.shard(flexmask.causal(), 1, 1, 512, world_size=2, rank=0, cache=cache)
        >>> a is b, cache.info().hits
        (True, 1)
    """

    def __init__(self, maxsize: int = 32, maxbytes: int | None = None) -> None:
        super().__init__(maxsize, maxbytes, lambda shard: block_mask_nbytes(shard.block_mask))


class LazyShard:
    """A shard to be: built through a ShardCache on first use, dropped on release.

    Holds only the recipe (mask, shape, group, balancer); its key is computed once, when
    made, and carries world size, rank and balancer.
    """

    def __init__(
        self, mask: Mask, B: Any, H: Any, Q_LEN: int, *, cache: ShardCache, **kwargs: Any
    ) -> None:
        if not isinstance(cache, ShardCache):
            raise TypeError(f"cache must be a flexmask ShardCache, got {type(cache).__name__}")
        self.mask, self.B, self.H, self.Q_LEN = mask, B, H, Q_LEN
        self.kwargs, self.cache = kwargs, cache
        plan = _plan(
            mask,
            B,
            H,
            Q_LEN,
            kwargs.get("KV_LEN"),
            kwargs.get("world_size"),
            kwargs.get("rank"),
            kwargs.get("mesh"),
            kwargs.get("balancer", "head_tail"),
            kwargs.get("BLOCK_SIZE", 128),
            kwargs.get("device"),
        )
        self.key = plan[6]
        self._shard: CPShard | None = None

    @property
    def shard(self) -> CPShard:
        if self._shard is None:
            self._shard = shard(
                self.mask, self.B, self.H, self.Q_LEN, cache=self.cache, **self.kwargs
            )
        return self._shard

    @property
    def block_mask(self) -> BlockMask:
        return self.shard.block_mask

    def release(self) -> None:
        self._shard = None
        self.cache.discard(self.key)


def lazy_shard(
    mask: Mask, B: Any = None, H: Any = None, Q_LEN: int = 128, *, cache: ShardCache, **kwargs: Any
) -> LazyShard:
    """A rank-aware lazy handle: ``flexmask.shard`` on first use, through ``cache``.

    Takes ``shard``'s keyword arguments (world_size/rank or mesh, balancer, BLOCK_SIZE,
    device).

    Example:
        >>> import flexmask
        >>> cache = flexmask.ShardCache()
        >>> h = flexmask.lazy_shard(flexmask.causal(), 1, 1, 512, cache=cache,
        ...                         world_size=2, rank=1)
        >>> h.key in cache, h.block_mask.shape, h.key in cache
        (False, (1, 1, 256, 512), True)
    """
    return LazyShard(mask, B, H, Q_LEN, cache=cache, **kwargs)


def imbalance(
    masks: Mask | Sequence[Mask],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    world_size: int,
    balancer: str | _LoadBalancer | None,
    BLOCK_SIZE: int = 128,
    partial_cost: float = 1.0,
) -> float:
    """Max rank cost / mean rank cost of a balancer, from every rank's shard (full blocks +
    ``partial_cost`` × partial blocks, summed over masks, rows and heads)."""
    masks = (masks,) if isinstance(masks, Mask) else tuple(masks)
    costs = torch.zeros(world_size, dtype=torch.float64)
    for mask in masks:
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
            if bm.full_kv_num_blocks is None:  # flexmask's shards always write the full side
                raise RuntimeError("shard returned a BlockMask without its full blocks")
            rows = (B or 1) if bm.kv_num_blocks.shape[0] == 1 else 1
            heads = (H or 1) if bm.kv_num_blocks.shape[1] == 1 else 1
            work = bm.full_kv_num_blocks.sum() + partial_cost * bm.kv_num_blocks.sum()
            costs[rank] += float(work) * rows * heads
    mean = float(costs.mean())
    return float(costs.max()) / mean if mean else 1.0
