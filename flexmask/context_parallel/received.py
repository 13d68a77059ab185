"""What one rank's shard reads of the keys: the key positions its queries attend (whole blocks
where a tile is full, the attended keys of a partial tile), and its BlockMask remapped onto
the keys it receives.

A shard's BlockMask has every key as its columns, in the permuted (all-gathered) order. A
rank that receives only what it reads holds its listed key blocks, in that same order, laid
end to end: block ``j`` of the shard becomes block ``k`` of the received keys, ``k`` counting
the listed blocks before ``j``. Inside a partial block only the keys some query attends are
sent; the others stay zero in the received buffer, where the mask hides them from every
query (a masked key adds nothing to an output and gets no gradient).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import vmap_broadcast
from flexmask.blocks import EMPTY, FULL, PARTIAL, kv_codes
from flexmask.builders import ShardMaskMod

# Tiles whose mask is evaluated at once to find the keys a partial tile's queries attend:
# bounds the (tiles, q block, kv block) temporaries to a few MB at 128 x 128 blocks.
_TILES_AT_ONCE = 64


class Needed(NamedTuple):
    """The keys one rank reads: its listed key blocks (ascending; the received BlockMask's
    columns) and the positions inside them its queries attend (ascending, < KV_LEN)."""

    blocks: Tensor
    positions: Tensor


class ReceivedKeysMaskMod:
    """A shard's mask_mod over the received keys: key ``kv_idx`` of the received buffer is
    the shard's key ``kv_position[kv_idx]``. The lookup holds whole blocks, so the padding
    of the last block reads what the shard's own mask_mod reads there."""

    def __init__(self, mask_mod: Any, kv_position: Tensor) -> None:
        self.mask_mod = mask_mod
        self.kv_position = kv_position

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.mask_mod(b, h, q_idx, self.kv_position[kv_idx])


def needed_keys(block_mask: BlockMask) -> Needed:
    """The key blocks ``block_mask`` lists and the key positions its queries attend.

    A block listed full by some tile is read whole. A block listed only as partial is read
    where one of its tiles' queries attends a key: the mask is evaluated on those tiles
    (about one tile per query block for documents and windows), so a rank receives only the
    keys it attends, not the rest of their blocks.
    """
    q_len, kv_len = (int(n) for n in block_mask.seq_lengths)
    q_block, kv_block = (int(n) for n in block_mask.BLOCK_SIZE)
    codes = kv_codes(block_mask)
    num_kv = codes.shape[-1]
    lines = codes.reshape(-1, num_kv)
    listed = (lines != EMPTY).any(0)
    whole = (lines == FULL).any(0)
    keys = torch.zeros(num_kv, kv_block, dtype=torch.int32, device=codes.device)
    keys[whole] = 1
    b, h, i, j = ((codes == PARTIAL) & ~whole).nonzero(as_tuple=True)
    if b.numel():
        q_offsets = torch.arange(q_block, device=codes.device)
        kv_offsets = torch.arange(kv_block, device=codes.device)
        for start in range(0, b.numel(), _TILES_AT_ONCE):
            at = slice(start, start + _TILES_AT_ONCE)
            q_idx = i[at, None] * q_block + q_offsets  # (tiles, q block)
            kv_idx = j[at, None] * kv_block + kv_offsets  # (tiles, kv block)
            attended = _evaluate(
                block_mask.mask_mod,
                b[at, None, None],
                h[at, None, None],
                q_idx.clamp(max=q_len - 1)[:, :, None],
                kv_idx[:, None, :],
            )
            # Rows past Q_LEN (the last block's padding) are dropped by the kernel.
            attended = attended & (q_idx < q_len)[:, :, None]
            keys.index_add_(0, j[at], attended.any(1).to(torch.int32))
    positions = keys.flatten()[:kv_len].nonzero().flatten()
    return Needed(listed.nonzero().flatten(), positions)


def _evaluate(mask_mod: Any, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod`` on broadcasting index tensors, through vmap where it wants scalars."""
    shape = (q_idx.shape[0], q_idx.shape[1], kv_idx.shape[2])
    try:
        result = mask_mod(b, h, q_idx, kv_idx)
        if isinstance(result, Tensor) and tuple(result.shape) == shape:
            return result.bool()
    except Exception:  # a mask_mod written for scalars: vmap gives it those
        pass
    return vmap_broadcast(mask_mod, (b, h, q_idx, kv_idx), shape).bool()


def received_length(blocks: Tensor, kv_block: int, kv_len: int) -> int:
    """Keys in the received buffer: every listed block whole, but the sequence's last block
    as long as it is."""
    count = int(blocks.numel()) * kv_block
    if count and int(blocks[-1]) == math.ceil(kv_len / kv_block) - 1:
        count -= math.ceil(kv_len / kv_block) * kv_block - kv_len
    return count


def received_block_mask(block_mask: BlockMask, blocks: Tensor) -> BlockMask:
    """``block_mask`` over the received keys: its listed key ``blocks`` (ascending) laid end
    to end. Each row lists the same tiles in the same order, its kv indices renumbered; each
    listed column keeps its q lists."""
    q_len, kv_len = (int(n) for n in block_mask.seq_lengths)
    kv_block = int(block_mask.BLOCK_SIZE[1])
    num_kv = math.ceil(kv_len / kv_block)
    count = int(blocks.numel())
    device = block_mask.kv_num_blocks.device
    blocks = blocks.to(device)
    renumber = torch.zeros(num_kv, dtype=torch.int64, device=device)
    renumber[blocks] = torch.arange(count, device=device)

    def kv_side(indices: Tensor) -> Tensor:
        # Entries past a row's count are never read; the listed ones are all in ``blocks``,
        # so at most ``count`` per row.
        return renumber[indices.long()][..., :count].to(torch.int32).contiguous()

    def q_side(tensor: Tensor | None) -> Tensor | None:
        return None if tensor is None else tensor[:, :, blocks].contiguous()

    full = block_mask.full_kv_indices
    kv_position = (blocks[:, None] * kv_block + torch.arange(kv_block, device=device)).flatten()
    mask_mod = block_mask.mask_mod
    if isinstance(mask_mod, ShardMaskMod):  # one lookup instead of two on every evaluation
        received_mod: Any = ShardMaskMod(
            mask_mod.mask_mod, mask_mod.q_index, mask_mod.kv_index[:, kv_position].contiguous()
        )
    else:
        received_mod = ReceivedKeysMaskMod(mask_mod, kv_position)
    return BlockMask(
        seq_lengths=(q_len, received_length(blocks, kv_block, kv_len)),
        kv_num_blocks=block_mask.kv_num_blocks,
        kv_indices=kv_side(block_mask.kv_indices),
        full_kv_num_blocks=block_mask.full_kv_num_blocks,
        full_kv_indices=None if full is None else kv_side(full),
        q_num_blocks=q_side(block_mask.q_num_blocks),
        q_indices=q_side(block_mask.q_indices),
        full_q_num_blocks=q_side(block_mask.full_q_num_blocks),
        full_q_indices=q_side(block_mask.full_q_indices),
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=received_mod,
    )
