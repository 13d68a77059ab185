"""Sequence packing: many short sequences in few rows, kept apart by document and tree masks.

Three ways to stop paying for padding:

* :func:`pack` bin-packs sequences into rows of ``max_len`` tokens. Each sequence (or chunk of
  one) becomes a *document*; the mask ``causal() & document(seq_lens)`` keeps documents from
  seeing each other, and ``position_ids`` restart at 0 in each document, so a causal model gives
  every document exactly what it would give it alone.
* :func:`pack_one_tree` merges sequences that share prefixes into one trie, laid out in
  preorder as 1-D tokens. A shared prefix is computed once; the mask ``tree(parents)`` lets
  each token see exactly its own prefix, so the logits along any sequence's path are the ones
  it would get alone.
* :func:`pack_tree_batch` does the same under a token budget: many tries, one per row of 2-D
  ``(B, max_tokens)`` tokens, and every sequence's log-probs read back in one gather (RL).

Only small metadata (``seq_lens`` / ``parents``) is stored; the BlockMask is built lazily, in
the process that uses it (see :class:`PackingCollator`). :func:`check_batch` checks that a
batch's inputs describe the same documents.
"""

from typing import Any

from flexmask._deprecated import moved
from flexmask.packing.check import BatchReport, Disagreement, check_batch, check_enabled  # noqa: F401 (names of _INTERNAL)
from flexmask.packing.documents import Chunk, PackedBatch, pack
from flexmask.packing.loader import PackedDataset, PackingCollator
from flexmask.packing.rl import SequenceLogProbs, TreeBatch, pack_tree_batch
from flexmask.packing.trie import TreePack, pack_one_tree

_RENAMED = {
    # 0.1's names differed by a letter and returned 1-D against 2-D tokens.
    "pack_tree": ("flexmask.packing", "pack_one_tree"),
    "pack_trees": ("flexmask.packing", "pack_tree_batch"),
}


def __getattr__(name: str) -> Any:
    return moved(__name__, name, _RENAMED)


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
    "pack",
    "pack_one_tree",
    "pack_tree_batch",
]

# What other flexmask packages use and users need not: not an API, it may change in any
# release (tests/test_structure.py lets siblings import these beside __all__; ruff reads only
# __all__, hence the noqa on their imports).
_INTERNAL = ["check_enabled"]
