"""Block geometry and the three-valued block algebra the builder runs on.

A BlockMask splits the (q, kv) plane into ``q_block x kv_block`` tiles. Every piece of a mask
classifies each tile as EMPTY (no element attends), FULL (every in-range element attends) or
PARTIAL (some do), from its own structure. Combining classifications with ``&``, ``|`` and ``~``
is exact except where two PARTIAL tiles meet: the result is then UNDECIDED and the builder
evaluates the mask on those tiles alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

EMPTY = 0
PARTIAL = 1
FULL = 2
UNDECIDED = 3

CODE_DTYPE = torch.int8


def codes_from(nonempty: Tensor, full: Tensor) -> Tensor:
    """Turns exact (nonempty, full) booleans into block codes.

    ``full`` must imply ``nonempty``; both broadcast against each other.
    """
    full, nonempty = torch.broadcast_tensors(full, nonempty)
    codes = nonempty.to(CODE_DTYPE)  # EMPTY=0 / PARTIAL=1
    return codes.masked_fill_(full, FULL)


def constant_codes(code: int, device: torch.device) -> Tensor:
    """A (1, 1, 1, 1) code tensor that broadcasts over any block grid."""
    return torch.full((1, 1, 1, 1), code, dtype=CODE_DTYPE, device=device)


def and_codes(a: Tensor, b: Tensor) -> Tensor:
    """Block codes of ``a & b``: EMPTY wins, FULL is neutral, PARTIAL & PARTIAL is undecided."""
    a, b = torch.broadcast_tensors(a, b)
    out = torch.where(a == FULL, b, torch.where(b == FULL, a, UNDECIDED)).to(CODE_DTYPE)
    return out.masked_fill_((a == EMPTY) | (b == EMPTY), EMPTY)


def or_codes(a: Tensor, b: Tensor) -> Tensor:
    """Block codes of ``a | b``: FULL wins, EMPTY is neutral, PARTIAL | PARTIAL is undecided."""
    a, b = torch.broadcast_tensors(a, b)
    out = torch.where(a == EMPTY, b, torch.where(b == EMPTY, a, UNDECIDED)).to(CODE_DTYPE)
    return out.masked_fill_((a == FULL) | (b == FULL), FULL)


def not_codes(a: Tensor) -> Tensor:
    """Block codes of ``~a``: EMPTY and FULL swap, PARTIAL and UNDECIDED stay."""
    return torch.where(a == EMPTY, FULL, torch.where(a == FULL, EMPTY, a)).to(CODE_DTYPE)


@dataclass(frozen=True)
class BlockGrid:
    """The tiles of one build: lengths, block sizes and every tile's first and last token.

    Token bounds are clipped to the lengths, so ``q_last`` of the final q block is
    ``q_len - 1`` even when ``q_len`` is not a multiple of ``q_block``. Shapes broadcast over
    (rows, heads, q blocks, kv blocks): ``q_first``/``q_last`` are ``(1, 1, nq, 1)``,
    ``kv_first``/``kv_last`` are ``(1, 1, 1, nkv)``.
    """

    batch: int
    heads: int
    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    device: torch.device
    q_first: Tensor
    q_last: Tensor
    kv_first: Tensor
    kv_last: Tensor

    @classmethod
    def make(
        cls,
        batch: int,
        heads: int,
        q_len: int,
        kv_len: int,
        q_block: int,
        kv_block: int,
        device: torch.device,
    ) -> BlockGrid:
        num_q = -(-q_len // q_block)
        num_kv = -(-kv_len // kv_block)
        q_first = torch.arange(num_q, device=device) * q_block
        kv_first = torch.arange(num_kv, device=device) * kv_block
        q_last = (q_first + q_block - 1).clamp_(max=q_len - 1)
        kv_last = (kv_first + kv_block - 1).clamp_(max=kv_len - 1)
        return cls(
            batch=batch,
            heads=heads,
            q_len=q_len,
            kv_len=kv_len,
            q_block=q_block,
            kv_block=kv_block,
            device=device,
            q_first=q_first.view(1, 1, -1, 1),
            q_last=q_last.view(1, 1, -1, 1),
            kv_first=kv_first.view(1, 1, 1, -1),
            kv_last=kv_last.view(1, 1, 1, -1),
        )

    @property
    def num_q_blocks(self) -> int:
        return self.q_first.shape[2]

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_first.shape[3]

    @property
    def length(self) -> int:
        """Lookups are padded to this length: every index a kernel may pass is below it."""
        return max(self.q_len, self.kv_len)

    def complete(self) -> Tensor:
        """(1, 1, nq, nkv) bool: tiles that lie wholly inside the sequence.

        torch pads the last tiles with masked elements, so only complete tiles can be FULL.
        """
        q_complete = (self.q_first + self.q_block) <= self.q_len
        kv_complete = (self.kv_first + self.kv_block) <= self.kv_len
        return q_complete & kv_complete
