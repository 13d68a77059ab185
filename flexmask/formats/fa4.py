"""A mask as FlashAttention-4 (flash-attn's ``flash_attn/cute``) takes it: block sparsity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.builders import create_block_mask
from flexmask.formats._tiles import tile_bits


@dataclass(frozen=True, eq=False)
class FA4Mask:
    """FlashAttention-4's block-sparse arguments for one mask at one block shape.

    The forward reads, per (batch, head, query block ``m``), int32 tensors:

    * ``mask_block_cnt (B, H, m_blocks)`` / ``mask_block_idx (B, H, m_blocks, n_blocks)``:
      the first ``cnt`` entries are the partial key blocks, where ``mask_mod`` is applied
      elementwise;
    * ``full_block_cnt`` / ``full_block_idx``: the key blocks attended whole, no mask_mod;
    * a key block in neither list is skipped.

    The ``*_bwd`` tensors are the same per key block (``(B, H, n_blocks)`` counts, query
    block indices ``(B, H, n_blocks, m_blocks)``), FA4's ``block_sparse_tensors_bwd``.

    ``mask_mod(batch, head, m_idx, n_idx, seqlen_info, aux_tensors)`` is FA4's calling
    convention (torch's is ``(b, h, q_idx, kv_idx)`` with data in the closure): the data the
    mask reads comes in ``aux_tensors``. Here that data is each partial block's own bits —
    ``aux_tensors[0]`` the int32 ``(B, H, m_blocks, n_blocks)`` number of each partial tile
    (0: not a partial tile) and ``aux_tensors[1]`` the bool ``(1 + tiles, q_block,
    kv_block)`` tiles (tile 0 attends nothing) — so the body is two lookups, exact for any
    mask, and the memory is one tile per partial block, never ``Q_LEN × KV_LEN``. Lowered
    with ``compact=True`` the index tensors' last dimension is the longest list, and the
    tile numbers are compact too: ``aux_tensors[0]`` is ``(B, H, m_blocks, width)`` from each
    row's first partial key block, ``aux_tensors[2]`` (int32 ``(B, H, m_blocks)``).
    """

    mask_block_cnt: Tensor
    mask_block_idx: Tensor
    full_block_cnt: Tensor
    full_block_idx: Tensor
    mask_block_cnt_bwd: Tensor
    mask_block_idx_bwd: Tensor
    full_block_cnt_bwd: Tensor
    full_block_idx_bwd: Tensor
    aux_tensors: tuple[Tensor, ...]
    block_size: tuple[int, int]
    seq_lengths: tuple[int, int]

    def mask_mod(
        self, batch: Tensor, head: Tensor, m_idx: Tensor, n_idx: Tensor, seqlen_info: Any, aux
    ) -> Tensor:
        """True where query ``m_idx`` attends key ``n_idx``, read from ``aux`` (FA4's
        ``aux_tensors``) alone; valid on the partial blocks the tensors list."""
        tile_of, tiles = aux[0], aux[1]
        q_block, kv_block = self.block_size
        m, n = m_idx // q_block, n_idx // kv_block
        if len(aux) == 3:  # compact: a row's tiles numbered from its first partial block
            n = n - aux[2][batch, head, m]
        return tiles[tile_of[batch, head, m, n], m_idx % q_block, n_idx % kv_block]

    def block_sparse_fields(self, backward: bool = False) -> dict[str, Any]:
        """The fields of FA4's ``BlockSparseTensorsTorch`` (``block_sparsity.py``), by name."""
        tail = "_bwd" if backward else ""
        fields: dict[str, Any] = {
            name: getattr(self, name + tail)
            for name in ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx")
        }
        fields["block_size"] = self.block_size
        return fields

    def kwargs(self) -> dict[str, Any]:
        """The keywords of ``flash_attn.cute.flash_attn_func`` for this mask:
        ``block_sparse_tensors``, ``block_sparse_tensors_bwd``, ``mask_mod``,
        ``aux_tensors``.

        Raises:
            ImportError: flash-attn's CuTe package (``flash_attn.cute``) is not installed.
        """
        try:
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        except ImportError as error:
            raise ImportError(
                "FA4Mask.kwargs() needs flash-attn's CuTe interface (flash_attn.cute, CUDA "
                "only); block_sparse_fields() gives the same tensors by name without it"
            ) from error
        return {
            "block_sparse_tensors": BlockSparseTensorsTorch(**self.block_sparse_fields()),
            "block_sparse_tensors_bwd": BlockSparseTensorsTorch(
                **self.block_sparse_fields(backward=True)
            ),
            "mask_mod": self.mask_mod,
            "aux_tensors": list(self.aux_tensors),
        }

    def __repr__(self) -> str:
        return (
            f"FA4Mask(mask_block_idx=int32{list(self.mask_block_idx.shape)}, "
            f"block_size={self.block_size}, partial_tiles={self.aux_tensors[1].shape[0] - 1})"
        )


def to_fa4(
    mask: Mask,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    q_block: int = 256,
    kv_block: int = 128,
    device: torch.device | str | None = None,
    compact: bool = False,
) -> FA4Mask:
    """Lower a mask to FlashAttention-4's block-sparse arguments at ``(q_block, kv_block)``.

    The block lists are flexmask's own structural BlockMask at that block shape (its kv side
    for the forward, its q side for the backward), so a block is listed full, partial or not
    at all exactly as ``flexmask.create_block_mask`` classifies it; only the partial blocks'
    bits are evaluated, for ``mask_mod``'s aux tensors. FA4 on Blackwell runs query blocks of
    256 with key blocks of 128 (the default); any rectangular shape is accepted.

    Args:
        mask: the mask.
        B: batch size.
        H: number of heads.
        Q_LEN, KV_LEN: query and key lengths (KV_LEN None: Q_LEN).
        q_block, kv_block: the query and key block sizes.
        device: where the tensors live (None: the mask's device, else CPU).
        compact: index tensors only as long as the longest list (``mask_block_idx``'s last
            dimension the largest ``mask_block_cnt``, at least 1; likewise the full and
            backward ones), which FA4 accepts since it reads ``cnt`` entries of a row
            (``block_sparsity.py``: "Allow Compact block sparse indices"): a sliding window
            of ``w`` keys holds ``O(N * w)`` indices instead of ``O(N^2)``.

    Example:
        >>> import flexmask
        >>> f = flexmask.to_fa4(flexmask.causal(), 1, 1, 512, 512, q_block=256, kv_block=128)
        >>> f.full_block_cnt[0, 0].tolist(), f.mask_block_cnt[0, 0].tolist()
        ([0, 2], [2, 2])
        >>> f.mask_block_idx[0, 0, 1, :2].tolist()
        [2, 3]
    """
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (flexmask.causal(), document(...), ...), "
            f"got {type(mask).__name__}"
        )
    B, H, Q_LEN = check_int(B, "B"), check_int(H, "H"), check_int(Q_LEN, "Q_LEN")
    KV_LEN = Q_LEN if KV_LEN is None else check_int(KV_LEN, "KV_LEN")
    q_block = check_int(q_block, "q_block", minimum=1)
    kv_block = check_int(kv_block, "kv_block", minimum=1)
    dev = torch.device(device) if device is not None else (mask.device or torch.device("cpu"))
    bm = create_block_mask(mask, B, H, Q_LEN, KV_LEN, device=dev, BLOCK_SIZE=(q_block, kv_block))
    sides = _sides(bm)
    if compact:
        sides = [_narrowed(t, sides[i - 1]) if i % 2 else t for i, t in enumerate(sides)]
    mask_cnt, mask_idx, full_cnt, full_idx, q_mask_cnt, q_mask_idx, q_full_cnt, q_full_idx = (
        _int32(t) for t in sides
    )
    aux = _partial_tiles(mask, bm, B, H, Q_LEN, KV_LEN, q_block, kv_block, compact)
    return FA4Mask(
        mask_block_cnt=mask_cnt,
        mask_block_idx=mask_idx,
        full_block_cnt=full_cnt,
        full_block_idx=full_idx,
        mask_block_cnt_bwd=q_mask_cnt,
        mask_block_idx_bwd=q_mask_idx,
        full_block_cnt_bwd=q_full_cnt,
        full_block_idx_bwd=q_full_idx,
        aux_tensors=aux,
        block_size=(q_block, kv_block),
        seq_lengths=(Q_LEN, KV_LEN),
    )


def _sides(bm: BlockMask) -> list[Tensor]:
    """Partial then full, kv side then q side; a missing full side lists nothing."""
    out = []
    for num, idx in (("kv_num_blocks", "kv_indices"), ("q_num_blocks", "q_indices")):
        partial_num, partial_idx = getattr(bm, num), getattr(bm, idx)
        full_num, full_idx = getattr(bm, "full_" + num), getattr(bm, "full_" + idx)
        if full_num is None or full_idx is None:
            full_num, full_idx = torch.zeros_like(partial_num), torch.zeros_like(partial_idx)
        out += [partial_num, partial_idx, full_num, full_idx]
    return out


def _narrowed(index: Tensor, count: Tensor) -> Tensor:
    """The first ``max(count)`` (at least 1) entries of each list: all a kernel reads."""
    longest = max(int(count.max()) if count.numel() else 0, 1)
    return index[..., : min(longest, index.shape[-1])]


def _int32(tensor: Tensor) -> Tensor:
    return tensor.to(torch.int32).contiguous()


def _partial_tiles(
    mask: Mask,
    bm: BlockMask,
    B: int,
    H: int,
    q_len: int,
    kv_len: int,
    q_block: int,
    kv_block: int,
    compact: bool = False,
) -> tuple[Tensor, ...]:
    """The number of each partial tile (0: none) and the tiles' bits, tile 0 all False; with
    ``compact``, the numbers from each row's first partial key block and those firsts."""
    count, index = bm.kv_num_blocks.long(), bm.kv_indices.long()
    dev = index.device
    num_kv = -(-kv_len // kv_block)
    listed = torch.arange(index.shape[-1], device=dev) < count.unsqueeze(-1)
    b, h, m, slot = listed.nonzero(as_tuple=True)
    n = index[b, h, m, slot]
    first = torch.zeros(0, dtype=torch.int64, device=dev)
    if compact:
        # Never a (B, H, m_blocks, n_blocks) table: each row's tiles sit between its first
        # and last partial block, a window's few.
        first = torch.full(index.shape[:3], num_kv, dtype=torch.int64, device=dev)
        first = (
            first.view(-1)
            .scatter_reduce(0, (b * index.shape[1] + h) * index.shape[2] + m, n, "amin")
            .view(index.shape[:3])
        )
        first = torch.where(first == num_kv, 0, first)
        width = int((n - first[b, h, m]).max()) + 1 if n.numel() else 1
        tile_of = torch.zeros(*index.shape[:3], width, dtype=torch.int32, device=dev)
        tile_of[b, h, m, n - first[b, h, m]] = torch.arange(
            1, b.numel() + 1, dtype=torch.int32, device=dev
        )
    else:
        tile_of = torch.zeros(*index.shape[:3], num_kv, dtype=torch.int32, device=dev)
        tile_of[b, h, m, n] = torch.arange(1, b.numel() + 1, dtype=torch.int32, device=dev)
    bits = tile_bits(
        mask,
        (b, h, m, n),
        block=(q_block, kv_block),
        lengths=(q_len, kv_len),
        reach=max(q_len, kv_len),
    )
    tiles = torch.cat([torch.zeros(1, q_block, kv_block, dtype=torch.bool, device=dev), bits])
    out: tuple[Tensor, ...] = (tile_of.expand(B, H, -1, -1).contiguous(), tiles.contiguous())
    if compact:
        out += (first.to(torch.int32).expand(B, H, -1).contiguous(),)
    return out
