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
* ``segments``, ``cp_shard`` — a context-parallel rank's rows of the BlockMask, per segment;
* ``explain``, ``differences`` — builds you can see into: which path a build takes and why
  (``explain_build``), and the first block where two BlockMasks part (``diff``).
"""

from flexmask.builders.classify import classify_blocks  # noqa: F401 (names of _INTERNAL)
from flexmask.builders.closed_form import row_runs  # noqa: F401 (names of _INTERNAL)
from flexmask.builders.cp_shard import KeyOrder, ShardMaskMod, build_shard  # noqa: F401 (names of _INTERNAL)
from flexmask.builders.create import build, create_block_mask  # noqa: F401 (names of _INTERNAL)
from flexmask.builders.density import BlockStats, block_stats
from flexmask.builders.differences import BlockDifference, diff
from flexmask.builders.explain import BuildReport, explain_build
from flexmask.builders.provenance import BUILT_RECORD, built_from  # noqa: F401 (names of _INTERNAL)
from flexmask.builders.segments import write_runs  # noqa: F401 (names of _INTERNAL)
from flexmask.builders.sides import Route
from flexmask.builders.spec import Spec, make_grid, make_spec  # noqa: F401 (names of _INTERNAL)
from flexmask.builders.threads import cpu_threads  # noqa: F401 (names of _INTERNAL)
from flexmask.builders.zero_sizes import emptied  # noqa: F401 (names of _INTERNAL)

__all__ = [
    "BlockDifference",
    "BlockStats",
    "BuildReport",
    "Route",
    "block_stats",
    "create_block_mask",
    "diff",
    "explain_build",
]

# What other flexmask packages use and users need not: not an API, it may change in any
# release (tests/test_structure.py lets siblings import these beside __all__; ruff reads only
# __all__, hence the noqa on their imports).
_INTERNAL = [
    "Spec",
    "BUILT_RECORD",
    "KeyOrder",
    "ShardMaskMod",
    "build",
    "build_shard",
    "built_from",
    "classify_blocks",
    "cpu_threads",
    "emptied",
    "make_grid",
    "make_spec",
    "row_runs",
    "write_runs",
]
