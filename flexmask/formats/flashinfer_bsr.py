"""A mask as FlashInfer's classic ``BlockSparseAttentionWrapper`` takes it: one BSR matrix
(SciPy's ``bsr_matrix`` layout) for every head, any block size ``(R, C)``, and a ``mask`` of
each listed block's elements (``flashinfer/sparse.py``: ``BlockSparseAttentionWrapper.plan``
and its ``mask`` argument; ``tests/attention/test_block_sparse.py``'s reference,
``bsr_matrix((mask, indices, indptr)).toarray()`` as the custom mask)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.formats._tiles import own_dims_codes, tile_bits


@dataclass(frozen=True, eq=False)
class FlashInferBSRMask:
    """``BlockSparseAttentionWrapper.plan``'s sparse arguments for one mask.

    Block row ``i`` (queries ``[i * R, min((i + 1) * R, M))``) attends the key blocks
    ``indices[indptr[i] : indptr[i + 1]]`` (keys ``[j * C, (j + 1) * C)``), ascending;
    listed block ``k`` attends where ``mask[k]`` (bool ``(nnz, R, C)``) is True — None when
    every listed block is attended whole. One matrix serves every batch row and head (the
    wrapper has no batch; ``num_qo_heads`` and ``num_kv_heads`` only shape the call).
    """

    indptr: Tensor
    indices: Tensor
    mask: Tensor | None
    M: int
    N: int
    R: int
    C: int

    def plan_kwargs(self) -> dict[str, Any]:
        """``indptr``, ``indices``, ``M``, ``N``, ``R``, ``C`` and ``mask`` for
        ``BlockSparseAttentionWrapper.plan`` (the heads, head_dim and dtypes are yours)."""
        return {
            "indptr": self.indptr,
            "indices": self.indices,
            "M": self.M,
            "N": self.N,
            "R": self.R,
            "C": self.C,
            "mask": self.mask,
        }

    def __repr__(self) -> str:
        masked = "None" if self.mask is None else f"bool{list(self.mask.shape)}"
        return (
            f"FlashInferBSRMask(M={self.M}, N={self.N}, R={self.R}, C={self.C}, "
            f"nnz={self.indices.numel()}, mask={masked})"
        )


def to_flashinfer_bsr(
    mask: Mask,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    q_block: int = 64,
    kv_block: int = 64,
    q_offset: int = 0,
    kv_offset: int = 0,
    device: torch.device | str | None = None,
) -> FlashInferBSRMask:
    """Lower a mask to ``flashinfer.BlockSparseAttentionWrapper``'s BSR and block masks.

    Any mask lowers whose every batch row and head attend alike on the window (the wrapper
    takes one BSR matrix for all heads and no batch): the blocks are flexmask's structural
    BlockMask at ``(R, C) = (q_block, kv_block)``, each partial block's elements its
    ``mask`` entry (evaluated on those tiles only), each full block's all True. FlashInfer
    needs ``N`` (``KV_LEN``) divisible by ``C``.

    Args:
        mask: the mask.
        B, H: batch rows and query heads it is checked for (every one must attend alike).
        Q_LEN, KV_LEN: ``M`` and ``N`` (KV_LEN None: Q_LEN).
        q_block, kv_block: ``R`` and ``C``.
        q_offset, kv_offset: the window of queries and keys lowered (a decode step).
        device: where the tensors live (None: the mask's device, else CPU).

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_flashinfer_bsr
        >>> mask = flexmask.causal() & flexmask.document([5, 11])
        >>> f = to_flashinfer_bsr(mask, 1, 1, 16, q_block=4, kv_block=4)
        >>> f.indptr.tolist(), f.indices.tolist(), tuple(f.mask.shape)
        ([0, 1, 3, 5, 8], [0, 0, 1, 1, 2, 1, 2, 3], (8, 4, 4))
    """
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (flexmask.causal(), document(...), ...), "
            f"got {type(mask).__name__}"
        )
    B, H = check_int(B, "B", minimum=1), check_int(H, "H", minimum=1)
    Q_LEN = check_int(Q_LEN, "Q_LEN", minimum=1)
    KV_LEN = Q_LEN if KV_LEN is None else check_int(KV_LEN, "KV_LEN", minimum=1)
    R = check_int(q_block, "q_block", minimum=1)
    C = check_int(kv_block, "kv_block", minimum=1)
    q_offset = check_int(q_offset, "q_offset", minimum=0)
    kv_offset = check_int(kv_offset, "kv_offset", minimum=0)
    if KV_LEN % C:
        raise ValueError(
            f"KV_LEN must be a multiple of kv_block for FlashInfer's BlockSparseAttentionWrapper "
            f"(its N is divisible by C): got KV_LEN={KV_LEN}, kv_block={C}"
        )
    dev = torch.device(device) if device is not None else (mask.device or torch.device("cpu"))
    rows, heads, codes = own_dims_codes(
        mask, B, H, (Q_LEN, KV_LEN), (R, C), (q_offset, kv_offset), dev
    )
    every = codes.flatten(0, 1)  # (rows * heads, M, N)
    m, n = (every[0] == 1).nonzero(as_tuple=True)
    zero = torch.zeros_like(m)

    def bits_of(b: int, h: int) -> Tensor:
        return tile_bits(
            mask,
            (zero + b, zero + h, m, n),
            block=(R, C),
            lengths=(Q_LEN, KV_LEN),
            reach=max(q_offset + Q_LEN, kv_offset + KV_LEN),
            offsets=(q_offset, kv_offset),
        )

    bits = bits_of(0, 0)
    for other in range(1, rows * heads):
        b, h = divmod(other, heads)
        if not torch.equal(every[other], every[0]) or not torch.equal(bits_of(b, h), bits):
            raise ValueError(
                f"{mask!r} cannot be lowered to FlashInfer's BlockSparseAttentionWrapper: "
                f"batch row {b}, head {h} attends otherwise than row 0, head 0, and the "
                f"wrapper takes one BSR matrix for every head and no batch. Plan one wrapper "
                f"per row (a mask of that row), or use to_flashinfer (BSR rows per batch row "
                f"and KV head)"
            )
    listed = every[0] > 0
    counts = listed.sum(-1)
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=dev)
    indptr[1:] = counts.cumsum(0)
    _, indices = listed.nonzero(as_tuple=True)
    block_mask: Tensor | None = None
    if m.numel():
        # Listed blocks in (row, key block) order; the partial ones carry their bits.
        block_mask = torch.ones(indices.numel(), R, C, dtype=torch.bool, device=dev)
        slot = torch.cumsum(listed.view(-1), 0).view(listed.shape) - 1
        block_mask[slot[m, n]] = bits
    return FlashInferBSRMask(
        indptr=indptr.to(torch.int32),
        indices=indices.to(torch.int32).contiguous(),
        mask=block_mask,
        M=Q_LEN,
        N=KV_LEN,
        R=R,
        C=C,
    )
