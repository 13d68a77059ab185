"""The build: from a mask expression to torch's BlockMask, one module per stage, in the order
data flows (docs/blocks.md describes the same pipeline):

* ``codes`` — block codes (EMPTY / PARTIAL / FULL / UNDECIDED) and their ``& | ~`` tables;
* ``grid`` — validated arguments laid out as tiles: block sizes, device, query/kv offsets;
* ``classify`` — tiles classified from structure (pieces answer, ``& | ~`` combine codes),
  undecided tiles refined;
* ``closed_form`` — masks whose rows are monotone intervals, written with no tile grid;
* ``unions`` — an ``|`` of two such masks: two runs per row and per column, no tile grid;
* ``write`` — torch's eight tensors, byte-identical to its ``create_block_mask``;
* ``read`` — reading a BlockMask back (codes, bytes, ``same_blocks``);
* ``create`` — the entry point, ``create_block_mask``, running the stages in that order.
"""

from flexmask.build.create import build, create_block_mask
from flexmask.build.grid import BlockGrid, make_grid
from flexmask.build.read import block_mask_nbytes, kv_codes, same_blocks

__all__ = [
    "BlockGrid",
    "block_mask_nbytes",
    "build",
    "create_block_mask",
    "kv_codes",
    "make_grid",
    "same_blocks",
]
