"""B=0 or H=0: torch builds a BlockMask whose tensors are ``(0, H, ...)`` or ``(B, 0, ...)``;
flexmask builds one row or head (``no_rows_or_heads``) and empties it (``emptied``)."""

from __future__ import annotations

from typing import Any

from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.blocks import BLOCK_FIELDS, WRITE_ORDER_FIELDS
from flexmask.builders.provenance import carry_record


def no_rows_or_heads(mask: Mask, B: Any, H: Any) -> tuple[Any, Any] | None:
    """For B=0 or H=0 (torch builds an empty BlockMask for those): the B and H to build one
    row or head with and then empty (``emptied``); None otherwise."""
    batch = None if B is None else check_int(B, "B", minimum=0)
    heads = None if H is None else check_int(H, "H", minimum=0)
    if batch != 0 and heads != 0:
        return None
    if batch == 0 and mask.rows is not None:
        raise ValueError(
            f"B=0 but the mask's data is given for {mask.rows} batch rows: pass B={mask.rows} "
            f"(or None), or data shared by every row for an empty batch"
        )
    return (1 if batch == 0 else B), (1 if heads == 0 else H)


def emptied(block_mask: BlockMask, B: Any, H: Any) -> BlockMask:
    """``block_mask`` with its batch (B=0) or head (H=0) dimension emptied: torch's
    create_block_mask for B=0 or H=0 has every tensor ``(0, H, ...)`` or ``(B, 0, ...)``."""
    rows = 0 if B is not None and int(B) == 0 else None
    heads = 0 if H is not None and int(H) == 0 else None
    fields: dict[str, Any] = dict.fromkeys(BLOCK_FIELDS)
    for name in (*BLOCK_FIELDS, *WRITE_ORDER_FIELDS):
        tensor = getattr(block_mask, name, None)
        if tensor is None:  # separate_full_blocks=False, or no write order
            continue
        if rows is not None:
            tensor = tensor[:0]
        if heads is not None:
            tensor = tensor[:, :0]
        fields[name] = tensor.contiguous()
    spt = getattr(block_mask, "dq_kv_order_spt", None)
    if spt is not None:
        fields["dq_kv_order_spt"] = spt
    out = BlockMask(
        seq_lengths=block_mask.seq_lengths,
        **fields,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
    )
    carry_record(block_mask, out)
    return out
