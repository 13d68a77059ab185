"""A mask as MagiAttention takes it: slices of (query range, key range, mask type)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_device
from flexmask.algebra.mask import Mask
from flexmask.formats._structure import lines, one_mask_for_all_heads, window

FULL, CAUSAL, INVCAUSAL, BICAUSAL = 0, 1, 2, 3
"""MagiAttention's ``attn_type_map`` values (``AttnMaskType.to_int_type``)."""

# A slice's type from how its rows' first and last attended keys move from one query to the
# next: (first moves?, last moves?) -> type. Magi's causal is bottom-right aligned (the last
# key grows with the query), inverse causal top-left aligned (the first key does).
_TYPE = {(0, 0): FULL, (0, 1): CAUSAL, (1, 0): INVCAUSAL, (1, 1): BICAUSAL}


@dataclass(frozen=True, eq=False)
class MagiMask:
    """The mask arguments of MagiAttention's ``flex_flash_attn_func`` (and
    ``magi_attn_flex_key``) for queries and keys flattened as ``(B * Q_LEN)`` and
    ``(B * KV_LEN)`` tokens: slice ``i`` attends queries ``q_ranges[i]`` to keys
    ``k_ranges[i]`` (half-open) with mask type ``attn_type_map[i]``. Slices never cover the
    same (query, key) pair twice; a query in no slice attends nothing.
    """

    q_ranges: Tensor
    """int32 ``(N, 2)``."""
    k_ranges: Tensor
    """int32 ``(N, 2)``."""
    attn_type_map: Tensor
    """int32 ``(N,)``: 0 full, 1 causal, 2 inverse causal, 3 bidirectional causal."""
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    total_k: int

    @property
    def num_slices(self) -> int:
        return self.attn_type_map.numel()

    def flex_flash_attn_kwargs(self) -> dict[str, Any]:
        """Keywords of ``magi_attention.functional.flex_flash_attn_func`` (after q, k, v,
        which are ``(B * S, H, D)``: ``x.flatten(0, 1)`` of a ``(B, S, H, D)`` tensor)."""
        return {
            "q_ranges": self.q_ranges,
            "k_ranges": self.k_ranges,
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
            "attn_type_map": self.attn_type_map,
        }

    def __repr__(self) -> str:
        kinds = torch.bincount(self.attn_type_map.long().cpu(), minlength=4).tolist()
        return (
            f"MagiMask(slices={self.num_slices}, full={kinds[0]}, causal={kinds[1]}, "
            f"inv_causal={kinds[2]}, bi_causal={kinds[3]}, total_q={self.total_q}, "
            f"total_k={self.total_k})"
        )


def to_magi(
    mask: Mask,
    B: int | None,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    device: torch.device | str | None = None,
) -> MagiMask:
    """Lower a mask to MagiAttention's slices, exactly, or refuse.

    Each query's attended keys are read from the mask's structure as a few intervals; runs
    of queries whose first and last keys stay put or move one key per query become one slice
    (full, causal, inverse causal or bi-causal), so a causal document is one slice, a sliding
    window a causal head and a bi-causal body, and a shared-prefix tree (an RL group: prompt,
    responses) one causal slice for the prompt and its first response plus, for each other
    response, a full slice onto the prompt and a causal slice of its own — adjacent responses'
    prompt slices merged into one. Any mask of flexmask's pieces lowers (irregular ones into
    more slices); refused are ``from_mask_mod`` leaves and heads that differ (Magi takes one
    mask for every head). Slices follow Magi's documented types: causal is bottom-right
    aligned, inverse causal top-left aligned, bi-causal both.

    Args:
        mask: the mask.
        B: batch size (None: the mask's rows, else 1). Rows are laid end to end.
        Q_LEN, KV_LEN: query and key lengths of the window (KV_LEN None: Q_LEN).
        q_offset, kv_offset: the window's first query and key position, an int or one per row.
        device: where the returned tensors live (None: the mask's device, else CPU).

    Raises:
        ValueError: a ``from_mask_mod`` leaf or a ``per_head`` whose heads differ, naming it.

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_magi
        >>> m = to_magi(flexmask.causal() & flexmask.document([3, 2]), 2, 5)
        >>> m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist()
        ([[0, 3], [3, 5], [5, 8], [8, 10]], [[0, 3], [3, 5], [5, 8], [8, 10]], [1, 1, 1, 1])
    """
    win = window(mask, B, None, Q_LEN, KV_LEN, q_offset, kv_offset)
    dev = check_device(device, mask.device)
    lo, hi = lines(one_mask_for_all_heads(mask, "MagiAttention"), win)
    per_row = [_slices(lo[r], hi[r]) for r in range(lo.shape[0])]
    q_out, k_out, types = [], [], []
    for b in range(win.batch):
        q, k, t = per_row[min(b, len(per_row) - 1)]
        q_out.append(q + b * win.q_len)
        k_out.append(k + b * win.kv_len)
        types.append(t)
    q_ranges = torch.cat(q_out).to(torch.int32)
    k_ranges = torch.cat(k_out).to(torch.int32)
    return MagiMask(
        q_ranges=q_ranges.to(dev),
        k_ranges=k_ranges.to(dev),
        attn_type_map=torch.cat(types).to(torch.int32).to(dev),
        max_seqlen_q=int((q_ranges[:, 1] - q_ranges[:, 0]).max()) if len(q_ranges) else 0,
        max_seqlen_k=int((k_ranges[:, 1] - k_ranges[:, 0]).max()) if len(k_ranges) else 0,
        total_q=win.batch * win.q_len,
        total_k=win.batch * win.kv_len,
    )


def _slices(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Slices of one row from its ``(N, K)`` intervals: each track (the k-th interval of
    every query) cut greedily into runs of one shape."""
    q_all, k_all, t_all = [], [], []
    for track in range(lo.shape[1]):
        first, last = lo[:, track].tolist(), hi[:, track].tolist()
        for start, end, shape in _runs(first, last):
            if shape is None:
                shape = (0, 0)
            q_all.append((start, end + 1))
            stop = last[end] if shape[1] else last[start]
            k_all.append((first[start], stop + 1))
            t_all.append(_TYPE[shape])
    if not q_all:
        empty = torch.zeros(0, 2, dtype=torch.int64)
        return empty, empty, torch.zeros(0, dtype=torch.int64)
    order = sorted(range(len(q_all)), key=lambda i: (q_all[i][0], k_all[i][0]))
    return (
        torch.tensor([q_all[i] for i in order], dtype=torch.int64),
        torch.tensor([k_all[i] for i in order], dtype=torch.int64),
        torch.tensor([t_all[i] for i in order], dtype=torch.int64),
    )


def _runs(first: list[int], last: list[int]):
    """Greedy maximal runs ``(start, end, shape)`` of queries with an interval whose ends
    move by a constant 0 or 1 per query; ``shape`` is None for a single query."""
    n = len(first)
    q = 0
    while q < n:
        if first[q] > last[q]:
            q += 1
            continue
        start, shape = q, None
        while q + 1 < n and first[q + 1] <= last[q + 1]:
            step = (first[q + 1] - first[q], last[q + 1] - last[q])
            if step not in _TYPE or (shape is not None and step != shape):
                break
            shape = step
            q += 1
        yield start, q, shape
        q += 1
