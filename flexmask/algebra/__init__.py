"""The mask algebra: ``Mask`` nodes (``And``, ``Or``, ``Not``), the piece protocol and the
mask_mod objects they lower to. Pieces themselves live in ``flexmask.pieces``: they classify
tiles, so they stand on ``flexmask.blocks``.

What a piece answers, and with what (``protocol``, ``lines``, ``mods``), is exported here for
pieces written outside flexmask (docs/contributing.md, "A new piece").
"""

from flexmask.algebra.dense import open_empty_rows, zero_empty_rows
from flexmask.algebra.evaluate import vmap_broadcast
from flexmask.algebra.interval_mods import (  # noqa: F401 (names of _INTERNAL)
    TAIL,
    Atom,
    ConstBound,
    Formula,
    Join,
    QBound,
    ValueBound,
    mask_mod_at,
    one_range,
)
from flexmask.algebra.lines import (
    INF,
    UNUSED,
    LineIntervals,
    VarlenPart,
    cannot_lower,
    one_interval,
    pick,
    run_at,
)
from flexmask.algebra.mask import And, Composite, Leaf, Mask, MaskMod, Not, Or, ShiftedMod
from flexmask.algebra.mods import Lowered, MaskModFn
from flexmask.algebra.protocol import BlockColumns, Extent, Intervals, TileGrid, Window
from flexmask.algebra.walk import conjuncts, fold, leaves

__all__ = [
    "And",
    "Atom",
    "ConstBound",
    "Formula",
    "Join",
    "QBound",
    "ValueBound",
    "BlockColumns",
    "Composite",
    "Extent",
    "INF",
    "Intervals",
    "Leaf",
    "LineIntervals",
    "Lowered",
    "Mask",
    "MaskMod",
    "MaskModFn",
    "Not",
    "Or",
    "ShiftedMod",
    "TileGrid",
    "UNUSED",
    "VarlenPart",
    "Window",
    "cannot_lower",
    "conjuncts",
    "fold",
    "leaves",
    "one_interval",
    "open_empty_rows",
    "pick",
    "run_at",
    "vmap_broadcast",
    "zero_empty_rows",
]

# Shared with the other flexmask packages (the builders' choice of mask_mod, the tables'
# tail), not an API for pieces written outside flexmask.
_INTERNAL = ["TAIL", "mask_mod_at", "one_range"]
