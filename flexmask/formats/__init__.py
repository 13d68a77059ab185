"""Exact lowerings of a mask to other kernels' mask formats (no kernel is called here).

* ``to_varlen`` — FlashAttention's varlen kernels (``flash_attn_varlen_func``, torch's
  ``varlen_attn``): ``cu_seqlens``, ``max_seqlen``, ``causal``, ``window_size`` and the
  gather/scatter between ``(B, S)`` rows and packed tokens;
* ``to_flashmask`` — PaddlePaddle's FlashMask: ``startend_row_indices`` and ``causal``;
* ``to_magi`` — MagiAttention: ``q_ranges``, ``k_ranges``, ``attn_type_map``;
* ``to_fa4`` — FlashAttention-4 (``flash_attn.cute``): block-sparse counts and indices, a
  ``mask_mod`` in FA4's convention and its ``aux_tensors``;
* ``to_fa4_varlen`` — FlashAttention-4's varlen block sparsity: one block grid per
  sequence (document), ``cu_total_m_blocks`` and ``cu_block_idx_offsets``;
* ``to_flashinfer`` — FlashInfer's block-sparse attention (``prims_ts``): ``block_indptr``,
  ``block_indices``, ``kv_valid_bits`` and ``mask_type`` per KV head;
* ``to_flashinfer_bsr`` — FlashInfer's ``BlockSparseAttentionWrapper``: one BSR matrix
  (``indptr``, ``indices``, any ``R x C``) and each listed block's ``mask``;
* ``to_flashinfer_variable`` — FlashInfer's ``VariableBlockSparseAttentionWrapper``:
  ``block_mask_map``, ``block_row_sz``, ``block_col_sz`` (blocks attended whole);
* ``to_cudnn`` — cuDNN's flex_attention (``create_mask_plan``): per query, ``mask_func``
  endpoints of visible key intervals, fixed (BSHD) or varlen (THD);
* ``to_cudnn_bsa`` — cuDNN's block-sparse attention (``cudnn.BSA``): ``q2k_block_index``,
  ``q2k_block_nums``, ``block_sizes``;
* ``to_cudnn_topk`` — cuDNN's ``sparse_attention``: ``topk_idxs`` at an
  ``index_granularity``.

Each returns the most compact form that masks exactly what the mask masks, or raises a
ValueError naming the piece (or column) the format cannot express. docs/formats.md has the
support matrix.

Magi's ``attn_type_map`` values are ``MAGI_FULL``, ``MAGI_CAUSAL``, ``MAGI_INVCAUSAL`` and
``MAGI_BICAUSAL``.

Backends lowering the Mask of a checked call (validated once, by its spec or its handle) use
``magi_of`` / ``varlen_of`` with ``validated_window`` (``_INTERNAL``: not for users): the same
lowering without validating the mask again.
"""

from typing import Any

from flexmask._deprecated import moved
from flexmask.formats._structure import validated_window  # noqa: F401 (names of _INTERNAL)
from flexmask.formats.cudnn import CudnnMask, to_cudnn
from flexmask.formats.cudnn_sparse import CudnnBSAMask, CudnnTopkMask, to_cudnn_bsa, to_cudnn_topk
from flexmask.formats.fa4 import FA4Mask, to_fa4
from flexmask.formats.fa4_varlen import FA4VarlenMask, to_fa4_varlen
from flexmask.formats.flashinfer import FlashInferMask, to_flashinfer
from flexmask.formats.flashinfer_bsr import FlashInferBSRMask, to_flashinfer_bsr
from flexmask.formats.flashinfer_variable import FlashInferVariableMask, to_flashinfer_variable
from flexmask.formats.flashmask import FlashMask, to_flashmask
from flexmask.formats.magi import BICAUSAL, CAUSAL, FULL, INVCAUSAL, MagiMask, magi_of, to_magi  # noqa: F401 (names of _INTERNAL)
from flexmask.formats.varlen import VarlenMask, to_varlen, varlen_of  # noqa: F401 (names of _INTERNAL)

# Magi's attn_type_map values, named for the format they belong to: ``FULL`` alone is also
# a block code (flexmask.blocks.FULL).
MAGI_FULL, MAGI_CAUSAL, MAGI_INVCAUSAL, MAGI_BICAUSAL = FULL, CAUSAL, INVCAUSAL, BICAUSAL

_RENAMED = {
    "Window": (
        "flexmask.formats._structure",
        "Window",
        "is internal: the window a lowering reads, which validated_window returns (the piece "
        "protocol's Window is flexmask.algebra.Window)",
    ),
}


def __getattr__(name: str) -> Any:
    return moved(__name__, name, _RENAMED)


__all__ = [
    "CudnnBSAMask",
    "CudnnMask",
    "CudnnTopkMask",
    "FA4Mask",
    "FA4VarlenMask",
    "FlashInferBSRMask",
    "FlashInferMask",
    "FlashInferVariableMask",
    "FlashMask",
    "MAGI_BICAUSAL",
    "MAGI_CAUSAL",
    "MAGI_FULL",
    "MAGI_INVCAUSAL",
    "MagiMask",
    "VarlenMask",
    "to_cudnn",
    "to_cudnn_bsa",
    "to_cudnn_topk",
    "to_fa4",
    "to_fa4_varlen",
    "to_flashinfer",
    "to_flashinfer_bsr",
    "to_flashinfer_variable",
    "to_flashmask",
    "to_magi",
    "to_varlen",
]

# What other flexmask packages use and users need not: not an API, it may change in any
# release (tests/test_structure.py lets siblings import these beside __all__; ruff reads only
# __all__, hence the noqa on their imports). The bare
# Magi names are here while backends/slices spells them so; users write MAGI_*.
_INTERNAL = [
    "BICAUSAL",
    "CAUSAL",
    "FULL",
    "INVCAUSAL",
    "magi_of",
    "validated_window",
    "varlen_of",
]
