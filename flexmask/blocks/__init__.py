"""Blocks: what a BlockMask is made of, below every builder.

* ``codes`` — block codes (EMPTY / PARTIAL / FULL / UNDECIDED) and their ``& | ~`` tables;
* ``grid`` — validated arguments laid out as tiles: block sizes, device, query/kv offsets;
* ``runs`` — runs of equal codes along a grid's lines, found, and runs expanded into values;
* ``write`` — torch's eight tensors, byte-identical to its ``create_block_mask``;
* ``read`` — the one reader of a BlockMask (codes, bytes, ``same_blocks``).
"""

from flexmask.blocks.grid import BlockGrid, make_grid
from flexmask.blocks.read import block_mask_nbytes, kv_codes, same_blocks

__all__ = ["BlockGrid", "block_mask_nbytes", "kv_codes", "make_grid", "same_blocks"]
