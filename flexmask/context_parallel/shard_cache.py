"""``ShardCache``: CPShards by their rank-aware key, bounded by entries and bytes, and the
process-wide one lazy shards use by default."""

from __future__ import annotations

import threading

from flexmask.blocks import block_mask_nbytes
from flexmask.runtime import KeyedCache


class ShardCache(KeyedCache):
    """An LRU of CPShards keyed by (world size, rank, balancer, shape, mask): rank-aware.

    Every rank computes the same key for the same inputs, no collective needed; a key never
    matches another rank's shard. Bounded by entries and by bytes of BlockMask tensors.

    Example:
        >>> import flexmask
        >>> cache = flexmask.context_parallel.ShardCache(maxsize=4)
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
