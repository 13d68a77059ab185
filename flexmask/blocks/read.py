"""Reading a BlockMask: the one place that reads its tensors — which blocks it lists, its
bytes, and whether two list the same blocks — for the builder's tests, plot, cache and the
block-sparse path alike.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.blocks.codes import CODE_DTYPE, FULL, PARTIAL

SIDES = (
    ("kv_num_blocks", "kv_indices"),
    ("full_kv_num_blocks", "full_kv_indices"),
    ("q_num_blocks", "q_indices"),
    ("full_q_num_blocks", "full_q_indices"),
)
"""The (counts, indices) pairs of a BlockMask: kv side partial and full, then q side."""

BLOCK_FIELDS = tuple(name for side in SIDES for name in side)
"""The eight tensors of a BlockMask, in torch's constructor order."""

WRITE_ORDER_FIELDS = ("dq_write_order", "dq_write_order_full")
"""The dQ write-order tensors torch >= 2.13 adds with ``compute_dq_write_order=True``."""


def block_mask_nbytes(block_mask: BlockMask) -> int:
    """Bytes held by a BlockMask's tensors, each storage counted once (views share one)."""
    seen: dict[int, int] = {}
    for name in BlockMask._TENSOR_ATTRS if hasattr(BlockMask, "_TENSOR_ATTRS") else ():
        tensor = getattr(block_mask, name, None)
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def kv_codes(block_mask: BlockMask) -> Tensor:
    """Every tile's code (EMPTY / PARTIAL / FULL, int8) as the BlockMask lists it, from its kv
    side: ``(B, H, num_q_blocks, num_kv_blocks)`` for its own B and H (1 where it broadcasts).
    Only each row's first ``count`` indices are read, as the kernels read them."""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    num_q, num_kv = -(-q_len // q_block), -(-kv_len // kv_block)
    batch, heads = block_mask.kv_num_blocks.shape[:2]
    device = block_mask.kv_num_blocks.device
    # One spare column takes the unlisted entries; it is dropped at the end.
    codes = torch.zeros(batch, heads, num_q, num_kv + 1, dtype=CODE_DTYPE, device=device)
    sides = [(block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL)]
    if block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None:
        sides.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL))
    for num_blocks, indices, code in sides:
        count = num_blocks[:, :, :num_q].long()
        index = indices[:, :, :num_q].long()
        listed = torch.arange(index.shape[-1], device=device) < count.unsqueeze(-1)
        if index.shape[-1]:
            codes.scatter_(-1, torch.where(listed, index, num_kv), code)
    return codes[..., :num_kv]


def same_blocks(a: BlockMask, b: BlockMask) -> bool:
    """True if two BlockMasks list the same blocks: equal lengths and block sizes, and for
    the partial and full blocks of both sides, equal counts and per row the same indices in
    the same order.

    Entries of the index tensors past each row's count are not compared: kernels,
    ``to_dense`` and ``from_kv_blocks`` never read them (``BlockMask._adjust`` does).
    ``flexmask.create_block_mask`` writes them as torch does — the unlisted blocks
    ascending — so its tensors are also ``torch.equal`` to torch's; this comparison also
    accepts BlockMasks from other writers (``from_kv_blocks`` with any tail).

    Example:
        >>> import flexmask
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> mask = flexmask.causal() & flexmask.document([300, 200])
        >>> ours = flexmask.create_block_mask(mask, 1, 1, 512, 512, device="cpu")
        >>> theirs = create_block_mask(mask.mask_mod, 1, 1, 512, 512, device="cpu")
        >>> flexmask.same_blocks(ours, theirs)
        True
    """
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, BlockMask):
            raise TypeError(
                f"{name} must be a torch BlockMask (from create_block_mask), "
                f"got {type(value).__name__}"
            )
    if tuple(a.seq_lengths) != tuple(b.seq_lengths) or tuple(a.BLOCK_SIZE) != tuple(b.BLOCK_SIZE):
        return False
    for num_name, idx_name in SIDES:
        num_a, num_b = getattr(a, num_name), getattr(b, num_name)
        idx_a, idx_b = getattr(a, idx_name), getattr(b, idx_name)
        if num_a is None or num_b is None:
            if num_a is not num_b:
                return False
            continue
        if num_a.shape != num_b.shape or idx_a.shape != idx_b.shape:
            return False
        if not torch.equal(num_a, num_b.to(num_a.device)):
            return False
        listed = torch.arange(idx_a.shape[-1], device=idx_a.device) < num_a.unsqueeze(-1)
        if not torch.equal(idx_a[listed], idx_b.to(idx_a.device)[listed]):
            return False
    return True
