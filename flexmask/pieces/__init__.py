"""The pieces of the mask algebra, one per module (the tree's split by job: ``tree_*``).

``Piece`` and ``PieceMod`` are the bases a piece is written on, inside flexmask or outside
it (docs/contributing.md, "A new piece").
"""

from flexmask.pieces._base import Piece, PieceMod
from flexmask.pieces.causal import Causal, causal
from flexmask.pieces.chunked import Chunked, chunked
from flexmask.pieces.constant import Empty, Full, empty, full
from flexmask.pieces.custom import FromMaskMod, VmappedMod, from_mask_mod
from flexmask.pieces.dilated import Dilated, dilated
from flexmask.pieces.document import Document, document
from flexmask.pieces.global_tokens import GlobalTokens, global_tokens
from flexmask.pieces.padding import Padding, padding
from flexmask.pieces.per_head import PerHead, per_head
from flexmask.pieces.position_window import PositionWindow
from flexmask.pieces.prefix import Prefix, prefix
from flexmask.pieces.selected import Selected, selected
from flexmask.pieces.sliding_window import SlidingWindow, sliding_window
from flexmask.pieces.spans import Spans, spans
from flexmask.pieces.tree import Tree, tree

__all__ = [
    "Causal",
    "Chunked",
    "Dilated",
    "Document",
    "Empty",
    "FromMaskMod",
    "Full",
    "GlobalTokens",
    "Padding",
    "PerHead",
    "Piece",
    "PieceMod",
    "PositionWindow",
    "Prefix",
    "Selected",
    "SlidingWindow",
    "Spans",
    "Tree",
    "VmappedMod",
    "causal",
    "chunked",
    "dilated",
    "document",
    "empty",
    "from_mask_mod",
    "full",
    "global_tokens",
    "padding",
    "per_head",
    "prefix",
    "selected",
    "sliding_window",
    "spans",
    "tree",
]
