"""Sequence packing: many short sequences in few rows, kept apart by document and tree masks.

Two ways to stop paying for padding:

* :func:`pack` bin-packs sequences into rows of ``max_len`` tokens. Each sequence (or chunk of
  one) becomes a *document*; the mask ``causal() & document(seq_lens)`` keeps documents from
  seeing each other, and ``position_ids`` restart at 0 in each document, so a causal model gives
  every document exactly what it would give it alone.
* :func:`pack_tree` merges sequences that share prefixes into one trie, laid out in preorder.
  A shared prefix is computed once; the mask ``tree(parents)`` lets each token see exactly its
  own prefix, so the logits along any sequence's path are the ones it would get alone.

Only small metadata (``seq_lens`` / ``parents``) is stored; the BlockMask is built lazily, in
the process that uses it (see :class:`PackingCollator`).
"""

from flexmask.packing.check import BatchReport, Disagreement, check_batch, check_enabled
from flexmask.packing.documents import Chunk, PackedBatch, pack
from flexmask.packing.loader import PackedDataset, PackingCollator
from flexmask.packing.rl import SequenceLogProbs, TreeBatch, pack_trees
from flexmask.packing.trie import TreePack, pack_tree

__all__ = [
    "BatchReport",
    "Chunk",
    "Disagreement",
    "PackedBatch",
    "PackedDataset",
    "PackingCollator",
    "SequenceLogProbs",
    "TreeBatch",
    "TreePack",
    "check_batch",
    "check_enabled",
    "pack",
    "pack_tree",
    "pack_trees",
]
