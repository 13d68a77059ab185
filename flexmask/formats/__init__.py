"""Exact lowerings of a mask to other kernels' mask formats (no kernel is called here).

* ``to_varlen`` — FlashAttention's varlen kernels (``flash_attn_varlen_func``, torch's
  ``varlen_attn``): ``cu_seqlens``, ``max_seqlen``, ``causal``, ``window_size`` and the
  gather/scatter between ``(B, S)`` rows and packed tokens;
* ``to_flashmask`` — PaddlePaddle's FlashMask: ``startend_row_indices`` and ``causal``;
* ``to_magi`` — MagiAttention: ``q_ranges``, ``k_ranges``, ``attn_type_map``;
* ``to_fa4`` — FlashAttention-4 (``flash_attn.cute``): block-sparse counts and indices, a
  ``mask_mod`` in FA4's convention and its ``aux_tensors``.

Each returns the most compact form that masks exactly what the mask masks, or raises a
ValueError naming the piece (or column) the format cannot express. docs/formats.md has the
support matrix.

Backends lowering the Mask of a checked call (validated once, by its spec or its handle) use
``magi_of`` / ``varlen_of`` with ``validated_window``: the same lowering without validating
the mask again.
"""

from flexmask.formats._structure import Window, validated_window
from flexmask.formats.fa4 import FA4Mask, to_fa4
from flexmask.formats.flashmask import FlashMask, to_flashmask
from flexmask.formats.magi import BICAUSAL, CAUSAL, FULL, INVCAUSAL, MagiMask, magi_of, to_magi
from flexmask.formats.varlen import VarlenMask, to_varlen, varlen_of

__all__ = [
    "BICAUSAL",
    "CAUSAL",
    "FA4Mask",
    "FULL",
    "FlashMask",
    "INVCAUSAL",
    "MagiMask",
    "VarlenMask",
    "Window",
    "magi_of",
    "to_fa4",
    "to_flashmask",
    "to_magi",
    "to_varlen",
    "validated_window",
    "varlen_of",
]
