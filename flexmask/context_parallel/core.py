"""``shard``, its result ``CPShard``, the rank-aware ``ShardCache`` and lazy shards: the
entry points the package docstring (``flexmask.context_parallel``) describes."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cachetools
import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import INT64_MAX, check_device, check_int
from flexmask.algebra.mask import Mask
from flexmask.blocks.grid import BlockGrid, block_sizes
from flexmask.blocks.read import block_mask_nbytes
from flexmask.builders.cp_shard import KeyOrder, build_shard
from flexmask.builders.create import build as build_window
from flexmask.builders.create import cpu_threads
from flexmask.context_parallel import per_document
from flexmask.context_parallel.balance import (
    HeadTailBalancer,
    MaskAwareBalancer,
    PerDocumentBalancer,
    PTRRBalancer,
    _check_cost,
    _round_up,
    balancer_indices,
    balancer_key,
)
from flexmask.pieces import padding
from flexmask.runtime.cache import KeyedCache
from flexmask.runtime.lazy import BuiltOnRead
from flexmask.runtime.spec import Spec, make_spec

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

    def _dim(self, tensor: Any, seq_dim: Any, method: str) -> int:
        """``seq_dim`` as a dim of ``tensor`` (negative ones counted from the end), or a
        TypeError/ValueError naming the argument of ``method``."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{method}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        dim = check_int(seq_dim, "seq_dim")
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(
                f"{method}: seq_dim={dim} is not a dim of a tensor of shape "
                f"{tuple(tensor.shape)}: pass one in [{-tensor.dim()}, {tensor.dim()})"
            )
        return dim % tensor.dim()

    def _rows_match(self, tensor: Tensor, seq_dim: int, method: str) -> None:
        rows = self.indices.shape[0]
        if rows > 1 and (seq_dim == 0 or tensor.shape[0] != rows):
            raise ValueError(
                f"{method}: this shard has one permutation per batch row ({rows} rows), so the "
                f"tensor must be batch first with {rows} rows and its sequence on another dim; "
                f"got shape {tuple(tensor.shape)} with seq_dim={seq_dim}"
            )

    def pad(self, tensor: Tensor, seq_dim: int) -> Tensor:
        """``tensor`` zero-padded along ``seq_dim`` to ``padded_length``."""
        seq_dim = self._dim(tensor, seq_dim, "pad")
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
        seq_dim = self._dim(tensor, seq_dim, "shard_tensor")
        self._rows_match(tensor, seq_dim, "shard_tensor")
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
        seq_dim = self._dim(tensor, seq_dim, "shard_kv")
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
        seq_dim = self._dim(gathered, seq_dim, "restore")
        self._rows_match(gathered, seq_dim, "restore")
        if gathered.shape[seq_dim] != self.padded_length:
            raise ValueError(
                f"restore: gathered has {gathered.shape[seq_dim]} positions on dim {seq_dim}, "
                f"but every rank's slices gathered make padded_length = {self.padded_length}"
            )
        index = torch.argsort(self.indices, dim=-1).to(gathered.device)
        if seq_dim == 0:
            return gathered.index_select(0, index[0]).narrow(0, 0, self.seq_length)
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
    if not isinstance(balancer, str) or balancer not in BALANCERS:
        raise ValueError(
            f"balancer must be 'head_tail', 'mask_aware', 'ptrr', None or a torch _LoadBalancer "
            f"(e.g. flexmask.PerDocumentBalancer(...)), got {balancer!r}"
        )
    if balancer == "head_tail":
        return HeadTailBalancer(seq_length, world, device)
    # "mask_aware" or "ptrr". Costing every query block reads the whole mask: made once per
    # mask and group, not once per rank (ranks simulated in one process, or a shard rebuilt
    # per step).
    key = (balancer, mask.key, B, H, seq_length, world, block, device.type, device.index)
    with _PERMUTATIONS_LOCK:
        found = _BALANCERS.get(key)
    if found is None:
        kind = MaskAwareBalancer if balancer == "mask_aware" else PTRRBalancer
        found = kind(mask, B, H, seq_length, world, block, device=device)
        with _PERMUTATIONS_LOCK:
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


def _block(BLOCK_SIZE: Any) -> int:
    """One block size for queries and keys (they are permuted alike), parsed as every
    build parses it (``blocks.grid.block_sizes``)."""
    if isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) != 2:
        raise ValueError(f"BLOCK_SIZE must be an int or an (n, n) pair, got {BLOCK_SIZE!r}")
    q_block, kv_block = block_sizes(BLOCK_SIZE)
    if kv_block != q_block:
        raise ValueError(
            f"BLOCK_SIZE must be an int or an (n, n) pair (queries and keys are permuted "
            f"alike, so their blocks are one size), got {tuple(BLOCK_SIZE)!r}"
        )
    return q_block


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


class _Plan(NamedTuple):
    """A shard's arguments, validated (Python ints, a torch.device, a resolved balancer),
    the spec of the whole (padded) sequence it is cut from — the mask validated there, once
    — and its cache key: made at the call, before anything is built."""

    mask: Mask
    B: int | None
    H: int | None
    Q_LEN: int
    world: int
    rank: int
    block: int
    device: torch.device
    balancer: _LoadBalancer | None
    padded: int
    key: tuple
    kv_length: int | None
    spec: Spec


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
) -> _Plan:
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
    # Any balancer pads to at most a multiple of 2 W BLOCK_SIZE: refused before it is made.
    _check_positions(
        Q_LEN, 2 * world * block, f"Q_LEN={Q_LEN} with world_size={world}, BLOCK_SIZE={block}"
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
    spec = make_spec(mask, B, H, padded, padded, device, (block, block), sized=False)
    return _Plan(mask, B, H, Q_LEN, world, rank, block, device, lb, padded, key, None, spec)


def _plan_other_keys(
    mask: Mask,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    world: int,
    rank: int,
    balancer: Any,
    block: int,
    device: torch.device,
) -> _Plan:
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
    _check_positions(Q_LEN, block, f"Q_LEN={Q_LEN} with BLOCK_SIZE={block}")
    _check_positions(KV_LEN, block, f"KV_LEN={KV_LEN} with BLOCK_SIZE={block}")
    where = (device.type, device.index)
    key = ("cp_shard", world, rank, ("none",), B, H, Q_LEN, ("kv", KV_LEN), block, where, mask.key)
    spec = make_spec(mask, B, H, Q_LEN, KV_LEN, device, (block, block), sized=False)
    return _Plan(mask, B, H, Q_LEN, world, rank, block, device, None, Q_LEN, key, KV_LEN, spec)


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
        _check_permutation(indices, lb)
    made = indices, tuple(KeyOrder.of(row, block) for row in indices)
    if isinstance(key, tuple):
        with _PERMUTATIONS_LOCK:
            _PERMUTATIONS[(key, block)] = made
    return made


def _check_permutation(indices: Tensor, lb: _LoadBalancer) -> None:
    """Each row of a balancer's indices must hold every position once (O(S) per row):
    anything else would index past the sequence or drop tokens."""
    length = indices.shape[-1]
    for i, row in enumerate(indices):
        seen = torch.zeros(length, dtype=torch.bool)
        inside = bool(((row >= 0) & (row < length)).all())
        if inside:
            seen[row] = True
        if not inside or not bool(seen.all()):
            raise ValueError(
                f"balancer {type(lb).__name__}'s indices row {i} is not a permutation of "
                f"range({length}): each position must appear exactly once"
            )


def _own_documents(lb: _LoadBalancer | None, mask: Mask, whole: BlockGrid) -> list[int] | None:
    """The documents of a per-document balancer of one row that shards its own mask
    ``causal() & document(lengths)`` on the CPU as one row and head, else None. That shard
    is written in closed form from the documents (``per_document``) instead of from every
    query's interval (``segments``)."""
    if not isinstance(lb, PerDocumentBalancer) or lb.rows != 1:
        return None
    if whole.device.type != "cpu" or whole.reduced(mask) != (1, 1):
        return None
    lengths = lb.seq_length_per_doc[0]
    return lengths if per_document.own_mask(mask, lengths) else None


def _build(plan: _Plan) -> CPShard:
    mask, Q_LEN = plan.mask, plan.Q_LEN
    world, rank, block, device = plan.world, plan.rank, plan.block, plan.device
    lb, padded, key, kv_length = plan.balancer, plan.padded, plan.key, plan.kv_length
    with cpu_threads(device):
        indices, keys = _permutation(lb, padded, block)
        if kv_length is not None:  # contiguous query rows against keys in their order
            # Validated against the whole Q_LEN x KV_LEN mask (the spec); the rank's window
            # of it is built with lookups over the whole sequence.
            whole = plan.spec.grid(sized=False)
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
        whole = plan.spec.grid(sized=False)
        lengths = _own_documents(lb, built, whole)
        if lengths is not None:
            block_mask = per_document.build(
                built, lengths, indices, keys[0].runs, rank, world, block
            )
        else:
            block_mask = build_shard(built, whole, indices, rank, world, keys)
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
    if cache is not None and not isinstance(cache, ShardCache):
        raise TypeError(
            f"cache must be a flexmask ShardCache or None (build every call), got "
            f"{type(cache).__name__}"
        )
    plan = _plan(mask, B, H, Q_LEN, KV_LEN, world_size, rank, mesh, balancer, BLOCK_SIZE, device)
    if cache is None:
        return _build(plan)
    return cache.get_or_build(plan.key, lambda: _build(plan))


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


_DEFAULT_SHARD_CACHE: ShardCache | None = None
_DEFAULT_SHARD_CACHE_LOCK = threading.Lock()


def default_shard_cache() -> ShardCache:
    """The process-wide ShardCache: lazy shards made without one, or unpickled, use it."""
    global _DEFAULT_SHARD_CACHE
    with _DEFAULT_SHARD_CACHE_LOCK:
        if _DEFAULT_SHARD_CACHE is None:
            _DEFAULT_SHARD_CACHE = ShardCache()
        return _DEFAULT_SHARD_CACHE


class LazyShard(BuiltOnRead):
    """A shard to be: built through a ShardCache on first use, dropped on release.

    Like ``LazyBlockMask`` it *is* a torch ``BlockMask`` (both are ``BuiltOnRead``): the
    rank's local BlockMask goes wherever one goes (``flex_attention``, ``shape``,
    ``kv_num_blocks``...), and its first read of a BlockMask field builds the shard.
    ``shard`` is the whole ``CPShard`` (the permutation to shard q/k/v with, too).

    Holds only the recipe (mask, shape, group, balancer) and its spec, validated when made
    (the mask once, against the whole padded sequence); its key is computed once, then, and
    carries world size, rank and balancer. It pickles that recipe (a mesh as the world size
    and rank it gave, ``BLOCK_SIZE`` as torch's ``(q, kv)`` pair), never the built shard nor
    the cache, which are process-local: an unpickled handle is validated again, as a new
    call, and builds through ``default_shard_cache()``.

    Example:
        >>> import flexmask
        >>> h = flexmask.lazy_shard(flexmask.causal(), 1, 1, 512, world_size=2, rank=1,
        ...                         BLOCK_SIZE=64, cache=flexmask.ShardCache())
        >>> h.built, h.BLOCK_SIZE
        (False, (64, 64))
        >>> h.kv_num_blocks.shape, h.built     # a BlockMask field: read from the build
        (torch.Size([1, 1, 4]), True)
    """

    # The recipe, in the order it pickles.
    _RECIPE: tuple[str, ...] = (
        *("mask", "B", "H", "Q_LEN", "KV_LEN", "world_size", "rank", "balancer"),
        *("BLOCK_SIZE", "device", "key"),
    )
    __slots__ = (*_RECIPE, "spec", "cache", "_plan", "_shard")

    def __init__(
        self,
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
        BLOCK_SIZE: int | tuple[int, int] = 128,
        device: torch.device | str | None = None,
        cache: ShardCache | None = None,
    ) -> None:
        # torch's BlockMask.__init__ is not called: it would set the fields this handle
        # reads from its build.
        if cache is not None and not isinstance(cache, ShardCache):
            raise TypeError(
                f"cache must be a flexmask ShardCache or None (the process-wide one), got "
                f"{type(cache).__name__}"
            )
        plan = _plan(
            mask, B, H, Q_LEN, KV_LEN, world_size, rank, mesh, balancer, BLOCK_SIZE, device
        )
        # The argument, not the resolved balancer: a name stays a name (made where built).
        self._set_plan(plan, balancer)
        self.cache = cache

    def _set_plan(self, plan: _Plan, balancer: Any) -> None:
        self._plan = plan
        self.spec = plan.spec
        self.mask, self.B, self.H, self.Q_LEN = plan.mask, plan.B, plan.H, plan.Q_LEN
        self.KV_LEN = plan.kv_length
        self.world_size, self.rank = plan.world, plan.rank
        self.balancer = balancer
        self.BLOCK_SIZE, self.device = (plan.block, plan.block), plan.device
        self.key = plan.key
        self._shard: CPShard | None = None

    @property
    def built(self) -> bool:
        """True while the handle holds its shard."""
        return self._shard is not None

    @property
    def shard(self) -> CPShard:
        """The ``CPShard``: built (or fetched from the cache) on first use, then held."""
        if self._shard is None:
            plan = self._plan
            self._shard = self._cache().get_or_build(plan.key, lambda: _build(plan))
        return self._shard

    @property
    def block_mask(self) -> BlockMask:
        """The rank's plain BlockMask (``shard.block_mask``)."""
        return self.shard.block_mask

    def release(self) -> None:
        """Drops the shard, and its cache entry."""
        self._shard = None
        self._cache().discard(self.key)

    def _cache(self) -> ShardCache:
        return self.cache if self.cache is not None else default_shard_cache()

    def __enter__(self) -> LazyShard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in self._RECIPE)

    def __setstate__(self, state: tuple) -> None:
        # A loaded recipe is a new call: validated, once, as when the handle was made.
        recipe = dict(zip(self._RECIPE, state, strict=True))
        plan = _plan(
            recipe["mask"],
            recipe["B"],
            recipe["H"],
            recipe["Q_LEN"],
            recipe["KV_LEN"],
            recipe["world_size"],
            recipe["rank"],
            None,
            recipe["balancer"],
            recipe["BLOCK_SIZE"],
            recipe["device"],
        )
        if plan.key != recipe["key"]:
            raise ValueError(
                f"this LazyShard was pickled with key {recipe['key']!r}, but its recipe makes "
                f"{plan.key!r} here: unpickle it where the same flexmask makes the same shard"
            )
        self._set_plan(plan, recipe["balancer"])
        self.cache = None

    def __repr__(self) -> str:
        return (
            f"LazyShard({self.mask!r}, B={self.B}, H={self.H}, Q_LEN={self.Q_LEN}, "
            f"KV_LEN={self.KV_LEN}, world_size={self.world_size}, rank={self.rank}, "
            f"balancer={self.balancer!r}, BLOCK_SIZE={self.BLOCK_SIZE}, built={self.built})"
        )


def lazy_shard(
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
    BLOCK_SIZE: int | tuple[int, int] = 128,
    device: torch.device | str | None = None,
    cache: ShardCache | None = None,
) -> LazyShard:
    """A rank-aware lazy handle: ``flexmask.shard`` on first use, through ``cache``.

    Takes ``shard``'s arguments, checked now (a misspelled keyword is a TypeError here, not
    at first use). ``cache``: the ShardCache to build through (None: the process-wide one,
    ``default_shard_cache()``). The handle pickles its recipe, not the shard.

    Example:
        >>> import flexmask
        >>> cache = flexmask.ShardCache()
        >>> h = flexmask.lazy_shard(flexmask.causal(), 1, 1, 512, cache=cache,
        ...                         world_size=2, rank=1)
        >>> h.key in cache, h.block_mask.shape, h.key in cache
        (False, (1, 1, 256, 512), True)
    """
    return LazyShard(
        mask,
        B,
        H,
        Q_LEN,
        KV_LEN,
        world_size=world_size,
        rank=rank,
        mesh=mesh,
        balancer=balancer,
        BLOCK_SIZE=BLOCK_SIZE,
        device=device,
        cache=cache,
    )


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
    if not masks or not all(isinstance(m, Mask) for m in masks):
        raise TypeError(f"masks must be a flexmask Mask or a non-empty list of them, got {masks!r}")
    world_size = check_int(world_size, "world_size", minimum=1)
    partial_cost = _check_cost(partial_cost)
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
