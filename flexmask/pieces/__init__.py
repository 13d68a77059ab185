"""The pieces of the mask algebra, one per module."""

from flexmask.pieces.causal import Causal, causal
from flexmask.pieces.constant import Empty, Full, empty, full
from flexmask.pieces.custom import FromMaskMod, from_mask_mod
from flexmask.pieces.document import Document, document
from flexmask.pieces.padding import Padding, padding
from flexmask.pieces.prefix import Prefix, prefix
from flexmask.pieces.sliding_window import SlidingWindow, sliding_window
from flexmask.pieces.tree import Tree, tree

__all__ = [
    "Causal",
    "Document",
    "Empty",
    "FromMaskMod",
    "Full",
    "Padding",
    "Prefix",
    "SlidingWindow",
    "Tree",
    "causal",
    "document",
    "empty",
    "from_mask_mod",
    "full",
    "padding",
    "prefix",
    "sliding_window",
    "tree",
]
