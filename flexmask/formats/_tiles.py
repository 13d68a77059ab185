"""The bits of chosen tiles of a mask: what a block-sparse format's per-element part reads.

A block-sparse lowering lists blocks from flexmask's structural BlockMask; only the tiles it
lists as partial need their elements, and only those are evaluated here (one
``q_block x kv_block`` tile each, never ``Q_LEN x KV_LEN``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.blocks import kv_codes
from flexmask.builders import create_block_mask


def own_dims_codes(
    mask: Mask,
    B: int,
    H: int,
    lengths: tuple[int, int],
    block: tuple[int, int],
    offsets: tuple[int, int],
    device: torch.device,
) -> tuple[int, int, Tensor]:
    """``(rows, heads, codes)``: the tile codes of the mask's structural BlockMask built at
    the dims it tells apart — B (H) cut to 1 where the mask ignores the row (head), so rows
    and heads it does not tell apart are built once and share their lists."""
    rows = B if mask.batch_dependent else 1
    heads = H if mask.head_dependent else 1
    bm = create_block_mask(
        mask,
        rows,
        heads,
        *lengths,
        device=device,
        BLOCK_SIZE=block,
        q_offset=offsets[0],
        kv_offset=offsets[1],
    )
    return rows, heads, tile_codes(bm, rows, heads)


def tile_codes(bm: BlockMask, batch: int, heads: int) -> Tensor:
    """Every tile's code (0 empty, 1 partial, 2 full) as the kv side lists it, int8
    ``(B, H, num_q_blocks, num_kv_blocks)`` (broadcast rows and heads expanded)."""
    codes = kv_codes(bm)
    return codes.expand(batch, heads, *codes.shape[2:])


def tile_bits(
    mask: Mask,
    tiles: tuple[Tensor, Tensor, Tensor, Tensor],
    *,
    block: tuple[int, int],
    lengths: tuple[Tensor | int, Tensor | int],
    reach: int,
    offsets: tuple[Tensor | int, Tensor | int] = (0, 0),
) -> Tensor:
    """``(P, q_block, kv_block)`` bool: the mask on each tile ``(b, h, m, n)`` of a window of
    ``lengths`` queries and keys starting at ``offsets`` (each an int, or one per tile),
    False past the window's lengths. ``reach``: the length the mask's lookups are made for
    (the whole sequence the window lies in)."""
    b, h, m, n = tiles
    q_block, kv_block = block
    count = b.numel()
    # The mask's comparisons run on int64 tiles: a few hundred tiles at a time keeps their
    # temporaries to tens of MB however many tiles a long sequence has.
    step = max(1, _CHUNK // (q_block * kv_block))
    evaluate = mask.lower_at(max(reach, 1), b.device).evaluate
    if count <= step:
        return _bits(mask, evaluate, tiles, block, lengths, offsets)
    out = torch.empty(count, q_block, kv_block, dtype=torch.bool, device=b.device)
    for lo in range(0, count, step):
        part = slice(lo, lo + step)
        out[part] = _bits(
            mask,
            evaluate,
            (b[part], h[part], m[part], n[part]),
            block,
            tuple(x[part] if isinstance(x, Tensor) else x for x in lengths),
            tuple(x[part] if isinstance(x, Tensor) else x for x in offsets),
        )
    return out


_CHUNK = 1 << 21
"""Elements of the tiles evaluated at once."""


def _bits(
    mask: Mask,
    evaluate: Callable[..., Tensor],
    tiles: tuple[Tensor, Tensor, Tensor, Tensor],
    block: tuple[int, int],
    lengths: tuple[Tensor | int, ...],
    offsets: tuple[Tensor | int, ...],
) -> Tensor:
    b, h, m, n = tiles
    q_block, kv_block = block
    dev = b.device
    q_len, kv_len = (x.view(-1, 1, 1) if isinstance(x, Tensor) else x for x in lengths)
    if b.numel() == 0:
        return torch.zeros(0, q_block, kv_block, dtype=torch.bool, device=dev)
    q = m.view(-1, 1, 1) * q_block + torch.arange(q_block, device=dev).view(1, -1, 1)
    kv = n.view(-1, 1, 1) * kv_block + torch.arange(kv_block, device=dev).view(1, 1, -1)
    inside = (q < q_len) & (kv < kv_len)
    q_off, kv_off = (o.view(-1, 1, 1) if isinstance(o, Tensor) else o for o in offsets)
    # Only real rows and heads index the mask's data: one that does not depend on them is
    # evaluated at row (head) 0.
    rows = b if mask.batch_dependent else torch.zeros_like(b)
    heads = h if mask.head_dependent else torch.zeros_like(h)
    bits = evaluate(
        rows.view(-1, 1, 1),
        heads.view(-1, 1, 1),
        torch.minimum(q, torch.as_tensor(q_len - 1, device=dev)) + q_off,
        torch.minimum(kv, torch.as_tensor(kv_len - 1, device=dev)) + kv_off,
    )
    return bits.expand(b.numel(), q_block, kv_block) & inside
