"""A rank's ``CPShard`` from its plan: the balancer's permutation (cached per balancer and
block size) and the rank's rows of the BlockMask, written by ``builders.cp_shard``, by
``per_document`` for a per-document balancer's own mask, or as a window where the keys are
not the queries' sequence."""

from __future__ import annotations

import threading

import cachetools
import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer

from flexmask.algebra import Mask
from flexmask.blocks import BlockGrid
from flexmask.builders import KeyOrder, build_shard, cpu_threads
from flexmask.builders import build as build_window
from flexmask.context_parallel import per_document
from flexmask.context_parallel.balance import PerDocumentBalancer, balancer_indices
from flexmask.context_parallel.plan import ShardPlan
from flexmask.context_parallel.rank_shard import CPShard
from flexmask.pieces import padding

# Permutations and their key orders by balancer content key and block size: every rank of a
# step (and, simulated in one process, every rank) shares them; a few steps' worth is kept.
_PERMUTATIONS: cachetools.LRUCache = cachetools.LRUCache(maxsize=8)
_PERMUTATIONS_LOCK = threading.Lock()


def _permutation(
    lb: _LoadBalancer | None, padded: int, block: int
) -> tuple[Tensor, tuple[KeyOrder, ...]]:
    """The balancer's indices (int64, CPU; read-only, shared) and each row's KeyOrder at
    the key block size ``block``, cached when the balancer has a content ``key`` (else
    made every call)."""
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


def build_rank_shard(plan: ShardPlan) -> CPShard:
    """The shard ``plan`` describes, built now (no cache: ``ShardCache`` calls this)."""
    mask, Q_LEN = plan.mask, plan.Q_LEN
    world, rank, (q_block, kv_block), device = plan.world, plan.rank, plan.block, plan.device
    lb, padded, key, kv_length = plan.balancer, plan.padded, plan.key, plan.kv_length
    with cpu_threads(device):
        indices, keys = _permutation(lb, padded, kv_block)
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
                q_block,
                kv_block,
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
                built, lengths, indices, keys[0].runs, rank, world, plan.block
            )
        else:
            block_mask = build_shard(built, whole, indices, rank, world, keys)
    return CPShard(block_mask, indices, lb, rank, world, Q_LEN, padded, key)
