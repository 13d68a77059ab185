"""The grid of a build: validated arguments laid out as tiles, on one device, for one window.

The grid describes rows ``[q_offset, q_offset + Q_LEN)`` and columns
``[kv_offset, kv_offset + KV_LEN)`` of a (possibly larger) mask; every token bound it holds is
a position of the whole mask, so pieces classify windows with no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_int
from flexmask.algebra import Extent, Mask, Window
from flexmask.blocks.codes import FULL, PARTIAL


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
    row_offsets: bool = False
    """The caller gave offsets per batch row. Equal ones are built as one int, but the
    window's mask_mod still holds ``(B,)`` offsets, so a compiled kernel sees one shape
    whether the rows' offsets agree this step or not."""

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
        row_offsets: bool = False,
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
            row_offsets=row_offsets or per_row,
        )

    @property
    def per_row_offsets(self) -> bool:
        """True when the window differs between batch rows (offsets per row)."""
        return isinstance(self.q_offset, Tensor)

    def reduced(self, mask: Mask) -> tuple[int, int]:
        """Rows and heads a build of ``mask`` writes: B (H) where the mask — or, for rows, the
        window — differs by row (head), else 1; flex_attention broadcasts the rest."""
        per_row = self.per_row_offsets or self.row_offsets
        rows = self.batch if mask.batch_dependent or per_row else 1
        return rows, self.heads if mask.head_dependent else 1

    @property
    def extent(self) -> Extent:
        """What a mask validates itself against (``Mask.check``)."""
        windowed = self.per_row_offsets or self.q_offset != 0 or self.kv_offset != 0
        name = "max(q_offset + Q_LEN, kv_offset + KV_LEN)" if windowed else "max(Q_LEN, KV_LEN)"
        return Extent(self.batch, self.heads, self.length, self.device, name)

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

    @property
    def lookup_window(self) -> Window | None:
        """What the build's lookups cover (``Mask.lower_at``'s ``window``). None: every
        position below ``length`` — the usual build, and any window whose reach is at most
        ``q_len + kv_len`` (a decode step moves its queries within the KV capacity and keeps
        the lookups). A window farther from position 0: its own positions alone, so a
        window anywhere up to 2**63 - 1 costs O(q_len + kv_len), not O(its reach)."""
        if self.length <= self.q_len + self.kv_len:
            return None

        def start(offset: int | Tensor) -> int | Tensor:
            return offset.view(-1) if isinstance(offset, Tensor) else offset

        return Window(start(self.q_offset), self.q_len, start(self.kv_offset), self.kv_len)

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


def block_sizes(BLOCK_SIZE: Any) -> tuple[int, int]:
    """(q_block, kv_block) from an int or a pair, validated."""
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise ValueError(f"BLOCK_SIZE must be an int or a (Q, KV) pair, got {BLOCK_SIZE!r}")
        q_block = check_int(BLOCK_SIZE[0], "BLOCK_SIZE[0]", minimum=1)
        kv_block = check_int(BLOCK_SIZE[1], "BLOCK_SIZE[1]", minimum=1)
        return q_block, kv_block
    size = check_int(BLOCK_SIZE, "BLOCK_SIZE", minimum=1)
    return size, size


def per_row(value: Any) -> bool:
    """True when a window offset is given per batch row (a list, a (B,) tensor or array)."""
    return not (isinstance(value, Tensor) and value.dim() == 0 or not hasattr(value, "__len__"))


def offsets(value: Any, name: str, batch: int) -> int | list[int]:
    """A window offset: one int >= 0, or one per batch row (a list, or a (B,) tensor or
    array). Per-row values that are all equal are built as one int (``BlockGrid.row_offsets``
    keeps the window's mask_mod per row)."""
    if not per_row(value):
        return check_int(value, name, minimum=0)
    if isinstance(value, Tensor) and value.dim() != 1:
        raise ValueError(f"{name} must be an int or hold one offset per batch row, shape (B,)")
    values = [check_int(v, f"{name}[{i}]", minimum=0) for i, v in enumerate(value)]
    if len(values) != batch:
        raise ValueError(
            f"{name} holds {len(values)} offsets but B={batch}: pass one per batch row, or one "
            f"int for every row"
        )
    return values[0] if len(set(values)) == 1 else values
