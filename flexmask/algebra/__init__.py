"""The mask algebra: ``Mask`` nodes (``And``, ``Or``, ``Not``), the piece protocol and the
mask_mod objects they lower to. Pieces themselves live in ``flexmask.pieces``: they classify
tiles, so they stand on ``flexmask.blocks``.

What a piece answers, and with what (``protocol``, ``lines``, ``mods``), is exported here for
pieces written outside flexmask (docs/contributing.md, "A new piece").
"""

from flexmask.algebra.lines import (
    INF,
    LineIntervals,
    VarlenPart,
    cannot_lower,
    one_interval,
    run_at,
)
from flexmask.algebra.mask import And, Mask, Not, Or
from flexmask.algebra.mods import Lowered, MaskModFn
from flexmask.algebra.protocol import Extent, Intervals, TileGrid, Window

__all__ = [
    "INF",
    "And",
    "Extent",
    "Intervals",
    "LineIntervals",
    "Lowered",
    "Mask",
    "MaskModFn",
    "Not",
    "Or",
    "TileGrid",
    "VarlenPart",
    "Window",
    "cannot_lower",
    "one_interval",
    "run_at",
]
