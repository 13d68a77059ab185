"""Block geometry and the three-valued block algebra the builder runs on.

A BlockMask splits the (q, kv) plane into ``q_block x kv_block`` tiles. Every piece of a mask
classifies each tile as EMPTY (no element attends), FULL (every in-range element attends) or
PARTIAL (some do), from its own structure. Combining classifications with ``&``, ``|`` and ``~``
is exact except where two PARTIAL tiles meet: the result is then UNDECIDED and the builder
evaluates the mask on those tiles alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # EMPTY=0, PARTIAL=1, FULL=2 is the sum of the two flags (full implies nonempty).
    return nonempty.view(CODE_DTYPE) + full.view(CODE_DTYPE)


def constant_codes(code: int, device: torch.device) -> Tensor:
    """A (1, 1, 1, 1) code tensor that broadcasts over any block grid."""
    return torch.full((1, 1, 1, 1), code, dtype=CODE_DTYPE, device=device)


def _table(rule) -> list[int]:
    return [rule(a, b) for a in range(4) for b in range(4)]


def _and_rule(a: int, b: int) -> int:
    if EMPTY in (a, b):
        return EMPTY  # EMPTY wins
    if a == FULL:
        return b  # FULL is neutral
    return a if b == FULL else UNDECIDED  # two partial tiles may or may not overlap


def _or_rule(a: int, b: int) -> int:
    if FULL in (a, b):
        return FULL
    if a == EMPTY:
        return b
    return a if b == EMPTY else UNDECIDED


_AND = torch.tensor(_table(_and_rule), dtype=CODE_DTYPE)
_OR = torch.tensor(_table(_or_rule), dtype=CODE_DTYPE)
_NOT = torch.tensor([FULL, PARTIAL, EMPTY, UNDECIDED], dtype=CODE_DTYPE)


def _lookup(table: Tensor, index: Tensor) -> Tensor:
    # One gather over the grid instead of a chain of where/eq passes.
    flat = index.reshape(-1).to(torch.int32)
    return table.to(index.device).index_select(0, flat).view(index.shape)


def and_codes(a: Tensor, b: Tensor) -> Tensor:
    """Block codes of ``a & b``: EMPTY wins, FULL is neutral, PARTIAL & PARTIAL is undecided."""
    return _lookup(_AND, a * 4 + b)


def or_codes(a: Tensor, b: Tensor) -> Tensor:
    """Block codes of ``a | b``: FULL wins, EMPTY is neutral, PARTIAL | PARTIAL is undecided."""
    return _lookup(_OR, a * 4 + b)


def not_codes(a: Tensor) -> Tensor:
    """Block codes of ``~a``: EMPTY and FULL swap, PARTIAL and UNDECIDED stay."""
    return _lookup(_NOT, a)


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
    q_offset: int | Tensor = 0
    """The grid's rows are positions ``[q_offset, q_offset + q_len)`` of the mask: an int, or
    per batch row a ``(B, 1)`` int64 tensor (then ``q_first``/``q_last`` are ``(B, 1, nq, 1)``)."""
    kv_offset: int | Tensor = 0
    """Its columns are positions ``[kv_offset, kv_offset + kv_len)``; likewise."""
    reach: int = 0
    """One past the furthest position of any row (lookups are padded to it)."""
    refined: list[int] = field(default_factory=lambda: [0], compare=False)
    """Tiles refined so far in this build (a one-item list: the grid itself is frozen)."""

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
        q_offset: int | list[int] = 0,
        kv_offset: int | list[int] = 0,
        reach: int = 0,
    ) -> BlockGrid:
        """The tiles of ``[q_offset, q_offset + q_len) x [kv_offset, kv_offset + kv_len)``;
        offsets are ints, or lists with one per batch row (validated by the caller).
        Lookups are padded to the furthest position of any row, at least ``reach``."""
        num_q = -(-q_len // q_block)
        num_kv = -(-kv_len // kv_block)
        per_row = isinstance(q_offset, list) or isinstance(kv_offset, list)
        rows = batch if per_row else 1

        def offset(value: int | list[int]) -> int | Tensor:
            if not per_row:
                return value  # type: ignore[return-value]
            rows = value if isinstance(value, list) else [value] * batch
            return torch.tensor(rows, dtype=torch.int64).to(device).view(-1, 1)

        q_off, kv_off = offset(q_offset), offset(kv_offset)
        q_reach = max(q_offset) if isinstance(q_offset, list) else q_offset
        kv_reach = max(kv_offset) if isinstance(kv_offset, list) else kv_offset
        reach = max(q_reach + q_len, kv_reach + kv_len, reach)
        # Token bounds are positions of the whole mask: tiles start at the offsets.
        q_first = torch.arange(num_q, device=device) * q_block + q_off
        kv_first = torch.arange(num_kv, device=device) * kv_block + kv_off
        q_last = torch.minimum(q_first + (q_block - 1), torch.as_tensor(q_off + q_len - 1))
        kv_last = torch.minimum(kv_first + (kv_block - 1), torch.as_tensor(kv_off + kv_len - 1))
        return cls(
            batch=batch,
            heads=heads,
            q_len=q_len,
            kv_len=kv_len,
            q_block=q_block,
            kv_block=kv_block,
            device=device,
            q_first=q_first.view(rows, 1, num_q, 1),
            q_last=q_last.view(rows, 1, num_q, 1),
            kv_first=kv_first.view(rows, 1, 1, num_kv),
            kv_last=kv_last.view(rows, 1, 1, num_kv),
            q_offset=q_off,
            kv_offset=kv_off,
            reach=reach,
        )

    @property
    def per_row_offsets(self) -> bool:
        """True when the window differs between batch rows (offsets per row)."""
        return isinstance(self.q_offset, Tensor)

    @property
    def num_q_blocks(self) -> int:
        return self.q_first.shape[2]

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_first.shape[3]

    @property
    def q_end(self) -> int | Tensor:
        """One past the grid's last query position (in the whole mask; per row a tensor)."""
        return self.q_offset + self.q_len

    @property
    def kv_end(self) -> int | Tensor:
        """One past the grid's last kv position (in the whole mask; per row a tensor)."""
        return self.kv_offset + self.kv_len

    @property
    def length(self) -> int:
        """Lookups are padded to this length: every position a kernel may reach is below it."""
        return self.reach

    def kv_tile(self, position: Tensor) -> Tensor:
        """The kv tile (column) of whole-mask kv positions (floor; may be out of range)."""
        return (position - self.kv_offset).div(self.kv_block, rounding_mode="floor")

    def demote_incomplete(self, codes: Tensor) -> Tensor:
        """FULL → PARTIAL on tiles that run past either end, in place (codes is contiguous).

        torch pads the last tiles with masked elements, so only complete tiles can be FULL.
        Only the last tile row and column can be incomplete, so only they are touched.
        """
        edges = []
        if self.q_len % self.q_block:
            edges.append(codes[:, :, -1, :])
        if self.kv_len % self.kv_block:
            edges.append(codes[:, :, :, -1])
        for edge in edges:
            edge.masked_fill_(edge == FULL, PARTIAL)
        return codes
