"""The mask algebra: ``Mask`` nodes (``And``, ``Or``, ``Not``), the piece protocol and the
mask_mod objects they lower to. Pieces themselves live in ``flexmask.pieces``: they classify
tiles, so they stand on ``flexmask.blocks``."""

from flexmask.algebra.mask import And, Mask, Not, Or

__all__ = ["And", "Mask", "Not", "Or"]
