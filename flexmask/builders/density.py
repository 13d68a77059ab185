"""How dense a BlockMask is, exactly, at its block shape: the numbers kernels choose on.

FlashMask v4 picks its backward kernel at a density of 0.42, FA4's 2-CTA backward wants
(256, 256) blocks, and a block-sparse kernel's time follows the share of blocks it visits and
the share it must mask elementwise. :func:`block_stats` reads them off a BlockMask: the block
shares from its kv side's lists (as the kernels read them), the attended pairs from the full
blocks' in-bounds areas plus the partial blocks' own bits, evaluated tile by tile (never the
``Q_LEN x KV_LEN`` grid: at most ``_TILE_BITS`` bits at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import vmap_broadcast
from flexmask.blocks import kv_lists

# Bits of partial tiles evaluated at once: 16M bools (and their index tensors) bound the
# memory of a long mask's statistics, whatever its number of partial blocks.
_TILE_BITS = 1 << 24


@dataclass(frozen=True)
class BlockStats:
    """A mask's density and its block shares at one block shape, over the BlockMask's own B
    and H (1 where it broadcasts).

    ``density`` is exact: attended (query, key) pairs over all ``Q_LEN x KV_LEN`` pairs.
    ``nonempty_share`` and ``partial_share`` count blocks as the kernels visit them: a
    non-empty block is listed (partial or full), a partial one runs the mask_mod.
    """

    block_size: tuple[int, int]
    blocks: int
    """B x H x q blocks x kv blocks."""
    partial: int
    full: int
    attended: int
    """Attended (b, h, q, kv) pairs."""
    pairs: int
    """B x H x Q_LEN x KV_LEN."""

    @property
    def density(self) -> float:
        return self.attended / self.pairs if self.pairs else 0.0

    @property
    def nonempty_share(self) -> float:
        return (self.partial + self.full) / self.blocks if self.blocks else 0.0

    @property
    def partial_share(self) -> float:
        return self.partial / self.blocks if self.blocks else 0.0

    def __str__(self) -> str:
        q_block, kv_block = self.block_size
        return (
            f"density {self.density:.4f} ({self.attended} of {self.pairs} pairs); blocks of "
            f"{q_block} x {kv_block}: {self.nonempty_share:.2%} non-empty, "
            f"{self.partial_share:.2%} partial"
        )


def block_stats(block_mask: BlockMask, mask_mod: Callable[..., Tensor] | None = None) -> BlockStats:
    """Density and block shares of ``block_mask`` at its own block shape.

    Args:
        block_mask: any BlockMask (flexmask's or torch's).
        mask_mod: what the partial blocks' bits are read from (default: the BlockMask's own
            ``mask_mod``, as the kernel reads them). Called with broadcasting index tensors
            where it accepts them, else through ``torch.vmap`` on scalars, as flex_attention
            calls it.

    Example:
        >>> import flexmask
        >>> bm = flexmask.create_block_mask(flexmask.causal(), 1, 1, 256, 256, device="cpu")
        >>> stats = flexmask.builders.block_stats(bm)
        >>> stats.partial, stats.full, stats.attended, round(stats.density, 4)
        (2, 1, 32896, 0.502)
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}")
    fn = block_mask.mask_mod if mask_mod is None else mask_mod
    q_len, kv_len = (int(n) for n in block_mask.seq_lengths)
    q_block, kv_block = (int(n) for n in block_mask.BLOCK_SIZE)
    batch, heads, num_q = (int(n) for n in block_mask.kv_num_blocks.shape)
    num_kv = -(-kv_len // kv_block)
    counts: dict[str, int] = {"partial": 0, "full": 0}
    attended = 0
    for count, index, name, _ in kv_lists(block_mask):
        b, h, m, n = _listed(count, index, num_q)
        full = name == "full_kv_indices"
        counts["full" if full else "partial"] += b.numel()
        if full:
            rows = (q_len - m * q_block).clamp(max=q_block)
            cols = (kv_len - n * kv_block).clamp(max=kv_block)
            attended += int((rows * cols).sum())
        else:
            attended += _partial_bits(fn, (b, h, m, n), (q_len, kv_len), (q_block, kv_block))
    return BlockStats(
        (q_block, kv_block),
        batch * heads * num_q * num_kv,
        counts["partial"],
        counts["full"],
        attended,
        batch * heads * q_len * kv_len,
    )


def _listed(count: Tensor, index: Tensor, num_q: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(b, h, m, n) of every listed block: each q block's first ``count`` indices."""
    count, index = count.long()[..., :num_q], index.long()[..., :num_q, :]
    listed = torch.arange(index.shape[-1], device=index.device) < count.unsqueeze(-1)
    b, h, m, slot = listed.nonzero(as_tuple=True)
    return b, h, m, index[b, h, m, slot]


def _partial_bits(
    fn: Callable[..., Tensor],
    where: tuple[Tensor, Tensor, Tensor, Tensor],
    lengths: tuple[int, int],
    block: tuple[int, int],
) -> int:
    """Attended pairs of the listed partial tiles, evaluated a bounded number at a time."""
    (b, h, m, n), (q_len, kv_len), (q_block, kv_block) = where, lengths, block
    step = max(1, _TILE_BITS // (q_block * kv_block))
    total = 0
    dev = b.device
    q_in = torch.arange(q_block, device=dev).view(1, -1, 1)
    kv_in = torch.arange(kv_block, device=dev).view(1, 1, -1)
    for start in range(0, b.numel(), step):
        tiles = slice(start, start + step)
        q = m[tiles].view(-1, 1, 1) * q_block + q_in
        kv = n[tiles].view(-1, 1, 1) * kv_block + kv_in
        inside = (q < q_len) & (kv < kv_len)
        args = (
            b[tiles].view(-1, 1, 1),
            h[tiles].view(-1, 1, 1),
            q.clamp(max=q_len - 1),
            kv.clamp(max=kv_len - 1),
        )
        total += int((_evaluate(fn, args, tuple(inside.shape)) & inside).sum())
    return total


def _evaluate(
    fn: Callable[..., Tensor], args: tuple[Tensor, ...], shape: tuple[int, ...]
) -> Tensor:
    """``fn`` on index tensors: by broadcasting where it answers in ``shape``, else by vmap
    (a mask_mod written for scalars, as torch's may be)."""
    try:
        result = fn(*args)
        if isinstance(result, Tensor) and torch.broadcast_shapes(result.shape, shape) == shape:
            return result.to(torch.bool).expand(shape)
    except Exception:  # any failure means "needs scalars": vmap tells if it is real
        pass
    return vmap_broadcast(fn, args, shape).to(torch.bool)
