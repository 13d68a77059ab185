"""Context parallelism on torch.distributed: every rank builds only its own BlockMask shard.

``flexmask.shard(mask, B, H, Q_LEN, KV_LEN, world_size=W, rank=r, balancer=...)`` returns
rank ``r``'s ``CPShard``: its BlockMask — rows ``[r S/W, (r+1) S/W)`` of the permuted mask,
columns in the permuted (all-gathered) key order, exactly the blocks torch's
``_create_cp_block_mask`` gives for the same mask_mod and balancer — and the permutation to
shard q/k/v, labels and positions with. No collective: the same inputs give every rank the
same permutation and the same cache key.
"""

from flexmask.context_parallel.balance import (
    HeadTailBalancer,
    MaskAwareBalancer,
    PerDocumentBalancer,
    PTRRBalancer,
)
from flexmask.context_parallel.core import imbalance, shard
from flexmask.context_parallel.distributed import cp_flex_attention, shard_buffers, unshard
from flexmask.context_parallel.exchange_plan import (
    KVExchange,
    exchange_from_block_masks,
    plan_exchange,
)
from flexmask.context_parallel.hybrid import LayerImbalance, LayerWeightedBalancer, layer_imbalance
from flexmask.context_parallel.lazy import LazyShard, lazy_shard
from flexmask.context_parallel.rank_shard import CPShard
from flexmask.context_parallel.shard_cache import ShardCache, default_shard_cache

__all__ = [
    "CPShard",
    "HeadTailBalancer",
    "KVExchange",
    "LayerImbalance",
    "LayerWeightedBalancer",
    "LazyShard",
    "MaskAwareBalancer",
    "PTRRBalancer",
    "PerDocumentBalancer",
    "ShardCache",
    "cp_flex_attention",
    "default_shard_cache",
    "exchange_from_block_masks",
    "imbalance",
    "layer_imbalance",
    "lazy_shard",
    "plan_exchange",
    "shard",
    "shard_buffers",
    "unshard",
]
