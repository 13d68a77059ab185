"""The builders: from a mask expression to torch's BlockMask, one module per stage, in the
order data flows (docs/blocks.md describes the same pipeline). They stand on
``flexmask.blocks`` (codes, the grid, the BlockMask reader and writer):

* ``classify`` — tiles classified from structure (pieces answer, ``& | ~`` combine codes),
  undecided tiles refined;
* ``closed_form`` — masks whose rows are monotone intervals, written with no tile grid;
* ``unions`` — an ``|`` of two such masks: two runs per row and per column, no tile grid;
* ``sides`` — which of those paths writes a build's two sides;
* ``create`` — the entry point, ``create_block_mask``, running the stages in that order, with
  ``size_check`` (refusing what cannot fit), ``torch_flags`` (torch's build flags),
  ``zero_sizes`` (B=0 or H=0), ``threads`` (one thread per CPU build) and ``provenance``
  (the Mask recorded on the BlockMask it built);
* ``segments``, ``cp_shard`` — a context-parallel rank's rows of the BlockMask, per segment.
"""

from flexmask.builders.classify import classify_blocks
from flexmask.builders.closed_form import row_runs
from flexmask.builders.cp_shard import KeyOrder, ShardMaskMod, build_shard
from flexmask.builders.create import build, create_block_mask
from flexmask.builders.provenance import BUILT_RECORD, built_from
from flexmask.builders.segments import write_runs
from flexmask.builders.spec import Spec, make_grid, make_spec
from flexmask.builders.threads import cpu_threads
from flexmask.builders.zero_sizes import emptied

__all__ = [
    "Spec",
    "BUILT_RECORD",
    "KeyOrder",
    "ShardMaskMod",
    "build",
    "build_shard",
    "built_from",
    "classify_blocks",
    "cpu_threads",
    "create_block_mask",
    "emptied",
    "make_grid",
    "make_spec",
    "row_runs",
    "write_runs",
]
