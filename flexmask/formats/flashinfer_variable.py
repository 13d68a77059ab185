"""A mask as FlashInfer's ``VariableBlockSparseAttentionWrapper`` takes it: blocks of
variable size, attended whole or not at all (``flashinfer/sparse.py``:
``VariableBlockSparseAttentionWrapper.plan(block_mask_map, block_row_sz, block_col_sz, ...)``;
``tests/attention/test_block_sparse.py``'s reference expands the map with
``repeat_interleave`` by the block sizes into the element mask)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.formats._structure import Lines, head_masks, lines, window

MAX_BLOCKS = 1 << 26
"""The most blocks ``block_mask_map`` may hold per KV head (a causal mask is one block per
query: its map is the Q×KV grid)."""


@dataclass(frozen=True, eq=False)
class FlashInferVariableMask:
    """``VariableBlockSparseAttentionWrapper.plan``'s block arguments for one mask.

    For KV head ``h``, query block ``i`` is ``block_row_sz[h, i]`` queries (in order, from
    0), key block ``j`` is ``block_col_sz[h, j]`` keys, and the block is attended whole
    where ``block_mask_map[h, i, j]`` (bool ``(num_kv_heads, MB, NB)``), else not at all.
    The wrapper has no batch: one set of blocks serves every batch row.
    """

    block_mask_map: Tensor
    block_row_sz: Tensor
    block_col_sz: Tensor
    num_qo_heads: int
    num_kv_heads: int

    def plan_kwargs(self) -> dict[str, Any]:
        """``block_mask_map``, ``block_row_sz``, ``block_col_sz``, ``num_qo_heads`` and
        ``num_kv_heads`` for ``VariableBlockSparseAttentionWrapper.plan`` (``causal`` left
        False: the map says everything)."""
        return {
            "block_mask_map": self.block_mask_map,
            "block_row_sz": self.block_row_sz,
            "block_col_sz": self.block_col_sz,
            "num_qo_heads": self.num_qo_heads,
            "num_kv_heads": self.num_kv_heads,
        }

    def __repr__(self) -> str:
        return (
            f"FlashInferVariableMask(block_mask_map=bool{list(self.block_mask_map.shape)}, "
            f"attended={int(self.block_mask_map.sum())})"
        )


def to_flashinfer_variable(
    mask: Mask,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    num_kv_heads: int | None = None,
    q_offset: int = 0,
    kv_offset: int = 0,
) -> FlashInferVariableMask:
    """Lower a mask to ``flashinfer.VariableBlockSparseAttentionWrapper``'s blocks, exactly.

    The blocks are the coarsest that hold the mask: a query block is a run of queries that
    attend the same keys, a key block a run of keys the same queries attend (read from the
    mask's intervals per query and per key, never its Q×KV grid), so each block is
    attended whole or not at all. Documents, prefixes, chunks and router-picked tiles give
    few blocks; a causal or windowed mask gives one per query (refused past
    ``MAX_BLOCKS``). All KV heads share the block counts (the union of their boundaries).

    Args:
        mask: the mask (not ``from_mask_mod``: its intervals cannot be read).
        B: batch rows; every row must attend alike (the wrapper has no batch).
        H: query heads (``num_qo_heads``).
        Q_LEN, KV_LEN: query and key lengths (KV_LEN None: Q_LEN).
        num_kv_heads: KV heads (None: H); a group's query heads must attend alike.
        q_offset, kv_offset: the window of queries and keys lowered.

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_flashinfer_variable
        >>> f = to_flashinfer_variable(flexmask.document([300, 212]), 1, 1, 512)
        >>> f.block_row_sz.tolist(), f.block_col_sz.tolist(), f.block_mask_map.int().tolist()
        ([[300, 212]], [[300, 212]], [[[1, 0], [0, 1]]])
    """
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (flexmask.causal(), document(...), ...), "
            f"got {type(mask).__name__}"
        )
    B, H = check_int(B, "B", minimum=1), check_int(H, "H", minimum=1)
    kv_heads = H if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", minimum=1)
    if H % kv_heads:
        raise ValueError(
            f"num_kv_heads must divide H (query heads): got H={H}, num_kv_heads={kv_heads}"
        )
    group = H // kv_heads
    win = window(mask, B, H, Q_LEN, KV_LEN, q_offset, kv_offset)
    distinct, which = head_masks(mask, H)
    fmt = "FlashInfer's VariableBlockSparseAttentionWrapper"
    read: dict[int, Lines] = {}
    for i in sorted(set(which)):
        rows = lines(distinct[i], win, fmt=fmt)
        if not _rows_alike(rows):
            raise ValueError(
                f"{mask!r} cannot be lowered to {fmt}: its batch rows attend differently, and "
                f"the wrapper has no batch. Plan one wrapper per row (a mask of that row), or "
                f"use to_flashinfer (BSR rows per batch row)"
            )
        read[i] = rows
    per_kv = []
    for h in range(kv_heads):
        members = which[h * group : (h + 1) * group]
        if any(not _same(read[j], read[members[0]]) for j in members[1:]):
            raise ValueError(
                f"{mask!r} cannot be lowered to {fmt} with num_kv_heads={kv_heads}: query "
                f"heads {h * group}..{h * group + group - 1} share KV head {h} and one block "
                f"map, but attend differently"
            )
        per_kv.append(read[members[0]])
    q_starts = _row_starts(per_kv, win.q_len)
    kv_starts = _key_starts(per_kv, win.kv_len)
    if q_starts.numel() * kv_starts.numel() > MAX_BLOCKS:
        raise ValueError(
            f"{mask!r} needs {q_starts.numel()} x {kv_starts.numel()} variable blocks for "
            f"{fmt} (over MAX_BLOCKS={MAX_BLOCKS}: its rows change at nearly every query, as "
            f"causal or window masks do); use to_flashinfer or to_flashinfer_bsr"
        )
    maps = []
    for rows in per_kv:
        lo, hi = rows.lo[0, q_starts], rows.hi[0, q_starts]  # (MB, K): a block's first query
        k = kv_starts.view(1, -1, 1)
        maps.append(((lo.unsqueeze(1) <= k) & (k <= hi.unsqueeze(1))).any(-1))
    return FlashInferVariableMask(
        block_mask_map=torch.stack(maps),
        block_row_sz=_sizes(q_starts, win.q_len).expand(kv_heads, -1).contiguous(),
        block_col_sz=_sizes(kv_starts, win.kv_len).expand(kv_heads, -1).contiguous(),
        num_qo_heads=H,
        num_kv_heads=kv_heads,
    )


def _rows_alike(read: Lines) -> bool:
    return read.lo.shape[0] == 1 or bool(
        (read.lo == read.lo[:1]).all() and (read.hi == read.hi[:1]).all()
    )


def _same(a: Lines, b: Lines) -> bool:
    """Whether two heads attend alike: their normalized lists (one per row: rows alike)."""
    return a.lo.shape[1:] == b.lo.shape[1:] and bool(
        torch.equal(a.lo[0], b.lo[0]) and torch.equal(a.hi[0], b.hi[0])
    )


def _row_starts(reads: list[Lines], length: int) -> Tensor:
    """The first query of each run of queries that attend alike in every head: 0 and every
    query whose intervals differ from the one before it (normalized lists: equal lists,
    equal rows)."""
    change = torch.zeros(length, dtype=torch.bool)
    change[0] = True
    for read in reads:
        lo, hi = read.lo[0], read.hi[0]  # (length, K)
        change[1:] |= ((lo[1:] != lo[:-1]) | (hi[1:] != hi[:-1])).any(-1)
    return change.nonzero().view(-1)


def _key_starts(reads: list[Lines], length: int) -> Tensor:
    """The first key of each run of keys the same queries attend, in every head: key ``k``
    is attended otherwise than ``k - 1`` exactly where some query's interval starts at
    ``k`` or ends at ``k - 1`` (its intervals are disjoint and never adjacent)."""
    change = torch.zeros(length + 1, dtype=torch.bool)
    change[0] = True
    for read in reads:
        real = read.lo <= read.hi
        change[read.lo[real].clamp(0, length)] = True
        change[(read.hi[real] + 1).clamp(0, length)] = True
    return change[:length].nonzero().view(-1)


def _sizes(starts: Tensor, length: int) -> Tensor:
    ends = torch.cat([starts[1:], torch.tensor([length])])
    return (ends - starts).to(torch.int32).view(1, -1)
