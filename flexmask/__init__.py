"""flexmask: cheap, composable, safe FlexAttention masks.

Compose a mask from pieces with ``&``, ``|`` and ``~``; build its BlockMask from structure
(no Q×KV evaluation).

Example:
    >>> import flexmask
    >>> mask = flexmask.causal() & flexmask.document([3, 2])
    >>> bm = flexmask.create_block_mask(mask, 1, 1, 5, 5, device="cpu")
    >>> bm.kv_num_blocks.tolist()
    [[[1]]]
"""

from flexmask.attention import compile_enabled, flex_attention, set_compile
from flexmask.build import create_block_mask, same_blocks
from flexmask.cache import CacheInfo, MaskCache, cache_clear, cache_info, default_cache
from flexmask.context_parallel import (
    CPShard,
    HeadTailBalancer,
    MaskAwareBalancer,
    PerDocumentBalancer,
    ShardCache,
    cp_flex_attention,
    lazy_shard,
    shard,
)
from flexmask.inference import DecodeMasks, decode_mask, speculative_tree
from flexmask.lazy import LazyBlockMask, lazy
from flexmask.mask import And, Mask, Not, Or
from flexmask.packing import (
    PackedBatch,
    PackedDataset,
    PackingCollator,
    SequenceLogProbs,
    TreeBatch,
    TreePack,
    pack,
    pack_tree,
    pack_trees,
)
from flexmask.pieces import (
    causal,
    chunked,
    document,
    empty,
    from_mask_mod,
    full,
    padding,
    per_head,
    prefix,
    sliding_window,
    spans,
    tree,
)
from flexmask.plot import plot

__version__ = "0.1.0"

__all__ = [
    "CPShard",
    "HeadTailBalancer",
    "MaskAwareBalancer",
    "PerDocumentBalancer",
    "ShardCache",
    "cp_flex_attention",
    "lazy_shard",
    "shard",
    "And",
    "CacheInfo",
    "DecodeMasks",
    "decode_mask",
    "speculative_tree",
    "LazyBlockMask",
    "PackedBatch",
    "PackedDataset",
    "PackingCollator",
    "SequenceLogProbs",
    "TreeBatch",
    "TreePack",
    "pack",
    "pack_tree",
    "pack_trees",
    "MaskCache",
    "cache_clear",
    "cache_info",
    "compile_enabled",
    "default_cache",
    "flex_attention",
    "lazy",
    "set_compile",
    "Mask",
    "Not",
    "Or",
    "causal",
    "chunked",
    "create_block_mask",
    "same_blocks",
    "document",
    "empty",
    "from_mask_mod",
    "full",
    "padding",
    "per_head",
    "plot",
    "prefix",
    "sliding_window",
    "spans",
    "tree",
]
