"""Blocks: what a BlockMask is made of, below every builder.

* ``codes`` — block codes (EMPTY / PARTIAL / FULL / UNDECIDED) and their ``& | ~`` tables;
* ``grid`` — validated arguments laid out as tiles: block sizes, device, query/kv offsets;
* ``runs`` — runs of equal codes along a grid's lines, found, and runs expanded into values;
* ``write`` — torch's eight tensors, byte-identical to its ``create_block_mask``;
* ``memory`` — the tensors a build writes into, large ones on huge pages;
* ``pair`` — a long build's two sides written at once, one on a second thread;
* ``read`` — the one reader of a BlockMask (either side's codes, its listed counts, bytes,
  ``same_blocks``).
"""

from flexmask.blocks.codes import (  # noqa: F401 (names of _INTERNAL)
    CODE_DTYPE,
    EMPTY,
    FULL,
    PARTIAL,
    UNDECIDED,
    and_codes,
    codes_from,
    constant_codes,
    not_codes,
    or_codes,
)
from flexmask.blocks.grid import BlockGrid, block_sizes, offsets, per_row  # noqa: F401 (names of _INTERNAL)
from flexmask.blocks.memory import advise_huge_pages, huge_pages_on, index_tensors  # noqa: F401 (names of _INTERNAL)
from flexmask.blocks.pair import side_by_side  # noqa: F401 (names of _INTERNAL)
from flexmask.blocks.read import (  # noqa: F401 (names of _INTERNAL)
    BLOCK_FIELDS,
    WRITE_ORDER_FIELDS,
    block_mask_nbytes,
    kv_codes,
    kv_lists,
    listed_counts,
    q_codes,
    same_blocks,
)
from flexmask.blocks.runs import expand_runs, exporting  # noqa: F401 (names of _INTERNAL)
from flexmask.blocks.write import (  # noqa: F401 (names of _INTERNAL)
    TORCH_DEFAULTS,
    Flags,
    Ordered,
    assemble,
    empty_sides,
    ordered_from_codes,
    ordered_from_flags,
    ordered_lines,
    q_side_from_codes,
    q_side_from_line_runs,
)

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "block_mask_nbytes",
    "kv_codes",
    "q_codes",
    "same_blocks",
]

# What other flexmask packages use and users need not: not an API, it may change in any
# release (tests/test_structure.py lets siblings import these beside __all__; ruff reads only
# __all__, hence the noqa on their imports).
_INTERNAL = [
    "BLOCK_FIELDS",
    "BlockGrid",
    "CODE_DTYPE",
    "Flags",
    "Ordered",
    "TORCH_DEFAULTS",
    "UNDECIDED",
    "WRITE_ORDER_FIELDS",
    "advise_huge_pages",
    "and_codes",
    "assemble",
    "block_sizes",
    "codes_from",
    "constant_codes",
    "empty_sides",
    "expand_runs",
    "kv_lists",
    "exporting",
    "huge_pages_on",
    "index_tensors",
    "listed_counts",
    "not_codes",
    "offsets",
    "or_codes",
    "ordered_from_codes",
    "ordered_from_flags",
    "ordered_lines",
    "per_row",
    "q_side_from_codes",
    "q_side_from_line_runs",
    "side_by_side",
]
