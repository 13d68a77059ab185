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

import sys
from typing import Any

from flexmask._deprecated import MovedModule, moved
from flexmask.algebra import Mask
from flexmask.attention import attention, compile_enabled, explain, flex_attention, set_compile
from flexmask.blocks import same_blocks
from flexmask.builders import create_block_mask, diff, explain_build
from flexmask.formats import to_fa4, to_flashmask, to_magi, to_varlen
from flexmask.inference import DecodeMasks, decode_mask, speculative_tree
from flexmask.packing import (
    PackedDataset,
    PackingCollator,
    check_batch,
    pack,
    pack_one_tree,
    pack_tree_batch,
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
    selected,
    sliding_window,
    spans,
    tree,
)
from flexmask.plotting import plot
from flexmask.runtime import MaskCache, cache_clear, cache_info, lazy

# The function ``flexmask.plot`` would hide a module of the same name (``import
# flexmask.plot as m`` gave the function): the module is ``flexmask.plotting``, and its old
# path answers with a DeprecationWarning. Registered here, not as a file, so that importing
# it never rebinds ``flexmask.plot`` to a module.
sys.modules[f"{__name__}.plot"] = MovedModule(f"{__name__}.plot", "flexmask.plotting")

__version__ = "0.1.0"

# Context parallelism stands on torch.distributed, which some torch builds lack: its names
# are imported on first use (PEP 562), so ``import flexmask`` neither needs nor loads it.
_CONTEXT_PARALLEL = ("cp_flex_attention", "lazy_shard", "shard")

_RENAMED = {
    # 0.1 name -> (its home, its name there). flexmask's front door lists the calls a task
    # starts from; the classes they return and the options they take live in the task's
    # package (docs/reference.md). Each old spelling warns for one release.
    "And": ("flexmask.algebra", "And"),
    "Or": ("flexmask.algebra", "Or"),
    "Not": ("flexmask.algebra", "Not"),
    "LazyBlockMask": ("flexmask.runtime", "LazyBlockMask"),
    "CacheInfo": ("flexmask.runtime", "CacheInfo"),
    "default_cache": ("flexmask.runtime", "default_cache"),
    "PackedBatch": ("flexmask.packing", "PackedBatch"),
    "TreePack": ("flexmask.packing", "TreePack"),
    "TreeBatch": ("flexmask.packing", "TreeBatch"),
    "SequenceLogProbs": ("flexmask.packing", "SequenceLogProbs"),
    "BatchReport": ("flexmask.packing", "BatchReport"),
    "pack_tree": ("flexmask", "pack_one_tree"),
    "pack_trees": ("flexmask", "pack_tree_batch"),
    "VarlenMask": ("flexmask.formats", "VarlenMask"),
    "FlashMask": ("flexmask.formats", "FlashMask"),
    "MagiMask": ("flexmask.formats", "MagiMask"),
    "FA4Mask": ("flexmask.formats", "FA4Mask"),
    "DecodeStep": ("flexmask.inference", "DecodeStep"),
    "CPShard": ("flexmask.context_parallel", "CPShard"),
    "HeadTailBalancer": ("flexmask.context_parallel", "HeadTailBalancer"),
    "LayerWeightedBalancer": ("flexmask.context_parallel", "LayerWeightedBalancer"),
    "MaskAwareBalancer": ("flexmask.context_parallel", "MaskAwareBalancer"),
    "PTRRBalancer": ("flexmask.context_parallel", "PTRRBalancer"),
    "PerDocumentBalancer": ("flexmask.context_parallel", "PerDocumentBalancer"),
    "ShardCache": ("flexmask.context_parallel", "ShardCache"),
}


def _context_parallel_available() -> bool:
    import torch.distributed

    return torch.distributed.is_available()


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        return moved(__name__, name, _RENAMED)
    if name not in _CONTEXT_PARALLEL:
        raise AttributeError(f"module 'flexmask' has no attribute {name!r}")
    try:
        from flexmask import context_parallel
    except ImportError as error:
        raise ImportError(
            f"flexmask.{name} needs torch.distributed (context parallelism), which this torch "
            f"build lacks (torch.distributed.is_available() is "
            f"{_context_parallel_available()}): {error}. Install a torch build with "
            "distributed support; the rest of flexmask works without it."
        ) from error
    value = getattr(context_parallel, name)
    globals()[name] = value
    return value


_MOVED = {
    # class (its module now) -> where 0.1.0 pickled it from: files saved by 0.1.0 name these.
    "flexmask.algebra.mods.AndMod": "flexmask.algebra.mask.AndMod",
    "flexmask.algebra.mods.OrMod": "flexmask.algebra.mask.OrMod",
    "flexmask.algebra.mods.NotMod": "flexmask.algebra.mask.NotMod",
    "flexmask.algebra.mods.ShiftedMod": "flexmask.algebra.mask.ShiftedMod",
    "flexmask.algebra.mods._NaryMod": "flexmask.algebra.mask._NaryMod",
    "flexmask.builders.provenance._Built": "flexmask.builders.create._Built",
    "flexmask.pieces.tree_lookups.TreeMod": "flexmask.pieces.tree.TreeMod",
    "flexmask.context_parallel.lazy.LazyShard": "flexmask.context_parallel.core.LazyShard",
}


def safe_globals() -> list[type | tuple[type, str]]:
    """The classes a saved flexmask object may hold, for ``torch.load(weights_only=True)``.

    torch's default loader refuses any class it was not told of — its own ``BlockMask``
    included. Give it these: every flexmask mask class (pieces, ``And``/``Or``/``Not``), every
    mask_mod class a built BlockMask holds, the record of what it was built from,
    ``LazyBlockMask``, and torch's ``BlockMask``. Only
    classes are listed (no function is called on load beyond building these objects from
    their saved state), and for a class that moved since 0.1.0 also ``(class, "its old
    path")``, so files saved by 0.1.0 load. A ``from_mask_mod`` leaf holds your function: add
    it to the list too.
    Classes of modules imported later (``flexmask.context_parallel``) join the list once
    imported.

    Example:
        >>> import io, torch, flexmask
        >>> mask = flexmask.causal() & flexmask.document([100, 156])
        >>> buffer = io.BytesIO()
        >>> torch.save(mask, buffer)
        >>> _ = buffer.seek(0)
        >>> with torch.serialization.safe_globals(flexmask.safe_globals()):
        ...     loaded = torch.load(buffer)       # weights_only=True, torch's default
        >>> loaded == mask
        True
    """
    from torch.nn.attention.flex_attention import BlockMask

    from flexmask.algebra import MaskModFn
    from flexmask.builders import BUILT_RECORD
    from flexmask.runtime import LazyBlockMask

    found: set[type] = {LazyBlockMask, BlockMask, BUILT_RECORD}
    pending: list[type] = [Mask, MaskModFn]
    sub: type
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub not in found:
                pending.append(sub)
                if sub.__module__.split(".")[0] == "flexmask":
                    found.add(sub)
    lazy_shard = sys.modules.get("flexmask.context_parallel.lazy")
    if lazy_shard is not None:
        found.add(lazy_shard.LazyShard)
    ordered = sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
    listed: list[type | tuple[type, str]] = list(ordered)
    for cls in ordered:
        old = _MOVED.get(f"{cls.__module__}.{cls.__qualname__}")
        if old is not None:
            listed.append((cls, old))
    return listed


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_CONTEXT_PARALLEL))


# Grouped by task as docs/reference.md groups them; tests/test_docs_reference.py keeps the
# two in step.
__all__ = [
    # build a mask and its BlockMask
    "Mask",
    "causal",
    "document",
    "padding",
    "sliding_window",
    "prefix",
    "chunked",
    "spans",
    "selected",
    "per_head",
    "tree",
    "full",
    "empty",
    "from_mask_mod",
    "create_block_mask",
    "lazy",
    "same_blocks",
    "explain_build",
    "diff",
    "MaskCache",
    "cache_info",
    "cache_clear",
    "safe_globals",
    "plot",
    # attend
    "flex_attention",
    "attention",
    "explain",
    "set_compile",
    "compile_enabled",
    # pack
    "pack",
    "pack_one_tree",
    "pack_tree_batch",
    "PackingCollator",
    "PackedDataset",
    # check
    "check_batch",
    # lower to other kernels' formats
    "to_varlen",
    "to_flashmask",
    "to_magi",
    "to_fa4",
    # decode
    "decode_mask",
    "DecodeMasks",
    "speculative_tree",
    # scale out (context parallelism; only where torch.distributed is)
    *(_CONTEXT_PARALLEL if _context_parallel_available() else ()),
]
