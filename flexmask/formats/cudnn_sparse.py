"""A mask as cuDNN's index-driven kernels take it: block-sparse attention's key-block lists
(``cudnn.BSA``) and ``sparse_attention``'s per-query top-k entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_device, check_int
from flexmask.algebra import Mask
from flexmask.builders import create_block_mask
from flexmask.formats._structure import window
from flexmask.formats.cudnn import head_lines

BSA_BLOCK_SIZES = (64, 128)
"""cuDNN BSA's ``sparse_block_size`` values (docs/fe-oss-apis/bsa.md)."""

TOPK_GRANULARITIES = (1, 4, 64, 128)
"""cuDNN sparse_attention's ``index_granularity`` values."""


@dataclass(frozen=True, eq=False)
class CudnnBSAMask:
    """The sparse metadata of ``cudnn.BSA.block_sparse_attention_forward`` (and backward).

    Query ``i`` of block ``m = i // block_size`` attends, whole, every key of the first
    ``q2k_block_nums[b, h, m]`` blocks listed in ``q2k_block_index[b, h, m]`` (ascending,
    unique), block ``n`` holding keys ``[n * block_size, n * block_size + block_sizes[n])``;
    nothing else. Per query head (``pack_gqa=False``), one sparse block size for queries and
    keys, no mask inside a block.
    """

    q2k_block_index: Tensor
    """int32 ``(B, H, N_q, K_max)``; entries past the count are 0 (the kernel ignores them)."""
    q2k_block_nums: Tensor
    """int32 ``(B, H, N_q)``; 0 for query blocks that attend nothing."""
    block_sizes: Tensor
    """int32 ``(N_kv,)``: the valid keys of each key block (the last may be short)."""
    block_size: int

    def kwargs(self) -> dict[str, Any]:
        """Keywords of ``block_sparse_attention_forward`` besides ``q, k, v``:
        ``allow_empty_block_nums`` when a query block attends nothing (its output 0)."""
        return {
            "q2k_block_index": self.q2k_block_index,
            "q2k_block_nums": self.q2k_block_nums,
            "block_sizes": self.block_sizes,
            "sparse_block_size": self.block_size,
            "allow_empty_block_nums": bool((self.q2k_block_nums == 0).any()),
            "pack_gqa": False,
        }

    def __repr__(self) -> str:
        return (
            f"CudnnBSAMask(q2k_block_index=int32{list(self.q2k_block_index.shape)}, "
            f"block_size={self.block_size}, blocks={int(self.q2k_block_nums.sum())})"
        )


@dataclass(frozen=True, eq=False)
class CudnnTopkMask:
    """``topk_idxs``, ``topk_length`` and ``index_granularity`` of cuDNN's
    ``sparse_attention_forward_wrapper``, and ``cu_seqlens_q`` in the THD form.

    Query ``q`` of batch row ``b`` (head ``h`` where the heads differ) attends the keys
    ``[i * g, i * g + g)`` (clamped to the sequence's keys) of each entry ``i`` of its row of
    ``topk_idxs``, ``-1`` an unused slot; ``topk_length`` counts the used ones (they come
    first, ascending). BSHD: rows ``(b, q)``, within-sequence ids. THD: row ``b * Q_LEN + q``,
    batch row ``b`` the sequence ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``, and entry ids global
    in the packed keys ``(B * KV_LEN, H_kv, D)``: batch row ``b``'s start at
    ``b * KV_LEN / g`` (``KV_LEN`` a multiple of ``g`` there, so no entry straddles two rows).
    """

    topk_idxs: Tensor
    """int32 ``(*rows, topk)`` shared by every head, or ``(*rows, G, topk)`` with ``G`` the
    query heads or the KV heads; ``rows`` is ``(B, Q_LEN)`` (BSHD) or ``(B * Q_LEN,)``."""
    topk_length: Tensor
    """int32 ``rows`` or ``(*rows, G)``."""
    index_granularity: int
    cu_seqlens_q: Tensor | None = None
    """int32 ``(B + 1,)`` in the THD form, else None."""

    def kwargs(self) -> dict[str, Any]:
        """Keywords of ``sparse_attention_forward_wrapper`` besides ``q, k, v``."""
        out: dict[str, Any] = {
            "topk_idxs": self.topk_idxs,
            "topk_length": self.topk_length,
            "index_granularity": self.index_granularity,
        }
        if self.cu_seqlens_q is not None:
            out["cu_seqlens_q"] = self.cu_seqlens_q
        return out

    def __repr__(self) -> str:
        return (
            f"CudnnTopkMask(topk_idxs=int32{list(self.topk_idxs.shape)}, "
            f"index_granularity={self.index_granularity})"
        )


def _check_mask(mask: Any) -> None:
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (flexmask.causal(), document(...), ...), "
            f"got {type(mask).__name__}"
        )


def to_cudnn_bsa(
    mask: Mask,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    block_size: int = 128,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    device: torch.device | str | None = None,
) -> CudnnBSAMask:
    """Lower a mask to cuDNN block-sparse attention's key-block lists, exactly, or refuse.

    The lists are flexmask's structural BlockMask at ``(block_size, block_size)``: its full
    blocks are listed; a block it calls partial is listed where the mask attends every
    (query, key) pair of it inside ``Q_LEN × KV_LEN`` (an edge block), dropped where it
    attends none, and refused otherwise: BSA attends a listed block whole.

    Args:
        mask: the mask.
        B: batch size (None: the mask's rows, else 1).
        H: number of query heads (None: 1).
        Q_LEN, KV_LEN: query and key lengths of the window (KV_LEN None: Q_LEN).
        block_size: BSA's ``sparse_block_size``, 64 or 128.
        q_offset, kv_offset: the window's first query and key position, an int or one per row.
        device: where the tensors live (None: the mask's device, else CPU).

    Raises:
        ValueError: a block the mask attends in part (naming it), or a leaf whose intervals
            flexmask cannot read (``from_mask_mod``).

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_cudnn_bsa
        >>> s = to_cudnn_bsa(flexmask.document([128, 200]), 1, 1, 328, block_size=64)
        >>> s.q2k_block_nums[0, 0].tolist(), s.q2k_block_index[0, 0, 2].tolist()
        ([2, 2, 4, 4, 4, 4], [2, 3, 4, 5])
        >>> s.block_sizes.tolist()   # the last block holds keys 320..327
        [64, 64, 64, 64, 64, 8]
    """
    _check_mask(mask)
    block_size = check_int(block_size, "block_size")
    if block_size not in BSA_BLOCK_SIZES:
        raise ValueError(
            f"block_size must be 64 or 128 (BSA's sparse_block_size), got {block_size}"
        )
    heads = 1 if H is None else H
    win = window(mask, B, heads, Q_LEN, KV_LEN, q_offset, kv_offset)
    dev = check_device(device, mask.device)
    offsets = {"q_offset": _flat(win.q_offset), "kv_offset": _flat(win.kv_offset)}
    bm = create_block_mask(
        mask, win.batch, heads, win.q_len, win.kv_len, "cpu", block_size, **offsets
    )
    listed = _codes(bm.kv_num_blocks, bm.kv_indices)
    if bm.full_kv_num_blocks is not None and bm.full_kv_indices is not None:
        full = _codes(bm.full_kv_num_blocks, bm.full_kv_indices)
        listed, full = listed & ~full, full
    else:
        full = torch.zeros_like(listed)
    full |= _whole_partials(mask, win, heads, listed, block_size)
    count = full.sum(-1)
    # Ascending block ids first: sort by (not full, id), the unused tail then set to 0.
    n_kv = full.shape[-1]
    order = torch.where(full, 0, n_kv) + torch.arange(n_kv)
    ids = order.sort(-1).values[..., : max(int(count.max()), 1)]
    ids = torch.where(ids < n_kv, ids, 0)
    sizes = (win.kv_len - torch.arange(n_kv) * block_size).clamp(max=block_size)
    return CudnnBSAMask(
        q2k_block_index=ids.to(torch.int32).contiguous().to(dev),
        q2k_block_nums=count.to(torch.int32).contiguous().to(dev),
        block_sizes=sizes.to(torch.int32).to(dev),
        block_size=block_size,
    )


def _flat(offset: Tensor) -> int | list[int]:
    values = offset.view(-1).tolist()
    return values[0] if len(values) == 1 else values


def _codes(num: Tensor, idx: Tensor) -> Tensor:
    """``(B, H, N_q, N_kv)`` bool: the blocks a BlockMask side lists."""
    n_kv = idx.shape[-1]
    used = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
    out = torch.zeros(*idx.shape[:3], n_kv + 1, dtype=torch.bool)
    out.scatter_(-1, torch.where(used, idx.long(), n_kv), True)
    return out[..., :n_kv]


def _whole_partials(mask: Mask, win: Any, heads: int, partial: Tensor, block: int) -> Tensor:
    """Of the blocks ``partial`` lists, those the mask attends whole inside the window;
    refuses a block it attends in part. Reads each block's queries' intervals only."""
    out = torch.zeros_like(partial)
    if not bool(partial.any()):
        return out
    lo, hi = head_lines(mask, win, heads, "cuDNN BSA")
    b, h, m, n = partial.nonzero(as_tuple=True)
    hm = h if lo.shape[0] > 1 else torch.zeros_like(h)
    row = b if lo.shape[1] > 1 else torch.zeros_like(b)
    q = (m.view(-1, 1) * block + torch.arange(block)).clamp(max=win.q_len - 1)  # (T, block)
    valid_q = torch.minimum(m * block + block, torch.tensor(win.q_len)) - m * block
    k0 = (n * block).view(-1, 1, 1)
    k1 = torch.minimum(n * block + block, torch.tensor(win.kv_len)).view(-1, 1, 1)
    lo_t = lo[hm.view(-1, 1), row.view(-1, 1), q]  # (T, block, K)
    hi_t = hi[hm.view(-1, 1), row.view(-1, 1), q]
    # Attended keys of each query inside the block: the intervals' overlaps with it.
    overlap = (torch.minimum(hi_t + 1, k1) - torch.maximum(lo_t, k0)).clamp(min=0).sum(-1)
    first = torch.arange(block) < valid_q.view(-1, 1)  # clamped repeats count once
    attended = torch.where(first, overlap, 0).sum(-1)
    whole = attended == valid_q * (k1.view(-1) - k0.view(-1))
    some = (attended > 0) & ~whole
    if bool(some.any()):
        t = int(some.nonzero()[0, 0])
        bb, hh, mm, nn = (int(x[t]) for x in (b, h, m, n))
        q_end, k_end = min(mm * block + block, win.q_len), min(nn * block + block, win.kv_len)
        raise ValueError(
            f"{mask!r} cannot be lowered to cuDNN BSA at block_size={block}: in batch row "
            f"{bb}, head {hh}, the block of queries [{mm * block}, {q_end}) and keys "
            f"[{nn * block}, {k_end}) is attended in part ({int(attended[t])} of "
            f"{int(valid_q[t]) * (k_end - nn * block)} pairs), and BSA attends a listed block "
            f"whole (no mask inside it). Use to_cudnn (interval endpoints), to_fa4 or "
            f"flexmask.create_block_mask"
        )
    out[b[whole], h[whole], m[whole], n[whole]] = True
    return out


def to_cudnn_topk(
    mask: Mask,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    index_granularity: int = 1,
    topk: int | None = None,
    kv_heads: int | None = None,
    varlen: bool = False,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    device: torch.device | str | None = None,
) -> CudnnTopkMask:
    """Lower a mask to cuDNN sparse_attention's per-query entries (``topk_idxs``), exactly.

    Each query's attended keys are read as intervals from the mask's structure; each must
    begin at a multiple of ``index_granularity`` and end at one or at ``KV_LEN``, and is
    listed as its entries, ascending. ``topk`` is the most entries any query needs (or the
    width asked for). Heads that differ (``per_head``) give one set per query head
    (``G = H_q``), else one set shared by every head; ``kv_heads`` gives one set per KV head
    group (``G = H_kv``, the GQA kernel's scope), refused where a group's heads differ.
    cuDNN's kernels serve THD with one shared set at ``g = 1`` (DSA) and ``G = H_kv`` at
    ``g`` of 4, 64 or 128 (the GQA substrate); the contract itself takes every form.

    Args:
        mask: the mask.
        B: batch size (None: the mask's rows, else 1).
        H: number of query heads (None: 1).
        Q_LEN, KV_LEN: query and key lengths of the window (KV_LEN None: Q_LEN).
        index_granularity: keys per entry, 1, 4, 64 or 128.
        topk: the width of ``topk_idxs`` (None: the least that holds every query); a query
            needing more entries is refused.
        kv_heads: H_kv, for one set per KV head group (``H`` a multiple of it).
        varlen: the THD form (packed rows, global ids and ``cu_seqlens_q``).
        q_offset, kv_offset: the window's first query and key position, an int or one per row.
        device: where the tensors live (None: the mask's device, else CPU).

    Raises:
        ValueError: a query attending part of an entry (naming it and its keys), one needing
            more than ``topk`` entries, heads of one KV group that differ, a THD ``KV_LEN``
            not a multiple of ``index_granularity``, or a leaf flexmask cannot read
            (``from_mask_mod``).

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_cudnn_topk
        >>> t = to_cudnn_topk(flexmask.chunked(4), 1, 1, 10, index_granularity=4)
        >>> t.topk_idxs[0, :, 0].tolist(), t.topk_length[0].tolist()
        ([0, 0, 0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    """
    _check_mask(mask)
    g = check_int(index_granularity, "index_granularity")
    if g not in TOPK_GRANULARITIES:
        raise ValueError(f"index_granularity must be one of {TOPK_GRANULARITIES}, got {g}")
    if topk is not None:
        topk = check_int(topk, "topk", minimum=1)
    if not isinstance(varlen, bool):
        raise TypeError(f"varlen must be a bool, got {varlen!r}")
    heads = 1 if H is None else H
    win = window(mask, B, heads, Q_LEN, KV_LEN, q_offset, kv_offset)
    dev = check_device(device, mask.device)
    if varlen and win.kv_len % g:
        raise ValueError(
            f"KV_LEN={win.kv_len} must be a multiple of index_granularity={g} for the THD "
            f"form: entry ids run over the packed keys of every row, and an entry must not "
            f"hold keys of two rows (pad the keys, or use the BSHD form)"
        )
    lo, hi = head_lines(mask, win, heads, "cuDNN sparse_attention")
    if kv_heads is not None:
        lo, hi = _kv_groups(mask, lo, hi, heads, check_int(kv_heads, "kv_heads", minimum=1))
    _check_aligned(mask, lo, hi, g, win.kv_len)
    real = lo <= hi
    first = torch.where(real, lo // g, 0).to(torch.int32)
    entries = torch.where(real, hi // g - lo // g + 1, 0).to(torch.int32)
    length = entries.sum(-1, dtype=torch.int32)  # (Hm, R, Q)
    _check_topk(mask, length, topk, g)
    width = max(int(length.max()), 1) if topk is None else topk
    idx = _entries(first, entries, width)
    # (B, Q, topk) shared by the heads, else (B, Q, G, topk); rows written out per batch row.
    if idx.shape[0] == 1 and kv_heads is None:
        idxs, lengths = idx[0], length[0]
    else:
        idxs, lengths = idx.permute(1, 2, 0, 3), length.permute(1, 2, 0)
    idxs = idxs.expand(win.batch, *idxs.shape[1:])
    lengths = lengths.expand(win.batch, *lengths.shape[1:])
    cu_seqlens_q = None
    if varlen:  # global ids: row b's keys start at entry b * KV_LEN / g
        start = (torch.arange(win.batch, dtype=torch.int32) * (win.kv_len // g)).view(
            -1, *(1,) * (idxs.dim() - 1)
        )
        idxs = torch.where(idxs >= 0, idxs + start, -1).flatten(0, 1)
        lengths = lengths.flatten(0, 1)
        cu_seqlens_q = (torch.arange(win.batch + 1, dtype=torch.int32) * win.q_len).to(dev)
    return CudnnTopkMask(
        topk_idxs=idxs.contiguous().to(dev),
        topk_length=lengths.contiguous().to(dev),
        index_granularity=g,
        cu_seqlens_q=cu_seqlens_q,
    )


def _kv_groups(
    mask: Mask, lo: Tensor, hi: Tensor, heads: int, kv_heads: int
) -> tuple[Tensor, Tensor]:
    """The intervals per KV head group ``(H_kv, R, Q, K)``: each group's heads must agree."""
    if heads % kv_heads:
        raise ValueError(f"H={heads} must be a multiple of kv_heads={kv_heads} (GQA groups)")
    if lo.shape[0] == 1:
        return lo.expand(kv_heads, *lo.shape[1:]), hi.expand(kv_heads, *hi.shape[1:])
    group = heads // kv_heads
    for h in range(heads):
        first = h - h % group
        if not (torch.equal(lo[h], lo[first]) and torch.equal(hi[h], hi[first])):
            raise ValueError(
                f"{mask!r} cannot be lowered to cuDNN sparse_attention with kv_heads={kv_heads}: "
                f"query heads {first} and {h} share KV head {h // group} but attend "
                f"differently, and G = H_kv gives one set per KV head. Leave kv_heads None "
                f"(one set per query head)"
            )
    return lo[::group], hi[::group]


def _entries(first: Tensor, entries: Tensor, width: int) -> Tensor:
    """``(..., width)`` int32: each row's entries, its slots' runs ``first + [0, entries)``
    laid end to end, -1 after them. One pass per slot (a row has a few intervals)."""
    j = torch.arange(width, dtype=torch.int32)
    out = torch.full((*first.shape[:-1], width), -1, dtype=torch.int32)
    before = torch.zeros_like(first[..., 0]).unsqueeze(-1)
    for slot in range(first.shape[-1]):
        count = entries[..., slot : slot + 1]
        if not bool(count.any()):
            break  # empty slots come last
        inside = (j >= before) & (j < before + count)
        out = torch.where(inside, first[..., slot : slot + 1] + (j - before), out)
        before = before + count
    return out


def _check_aligned(mask: Mask, lo: Tensor, hi: Tensor, g: int, kv_len: int) -> None:
    if g == 1:
        return
    real = lo <= hi
    bad = real & ((lo % g != 0) | (((hi + 1) % g != 0) & (hi + 1 != kv_len)))
    if not bool(bad.any()):
        return
    hm, b, q, s = (int(i) for i in bad.nonzero()[0])
    a, z = int(lo[hm, b, q, s]), int(hi[hm, b, q, s]) + 1
    raise ValueError(
        f"{mask!r} cannot be lowered to cuDNN sparse_attention at index_granularity={g}: "
        f"query {q} of batch row {b} (head {hm}) attends the keys [{a}, {z}), "
        f"which is not a run of whole entries [i * {g}, i * {g} + {g}) (the last clamped to "
        f"KV_LEN={kv_len}). Use a smaller index_granularity, or to_cudnn"
    )


def _check_topk(mask: Mask, length: Tensor, topk: int | None, g: int) -> None:
    if topk is None or not bool((length > topk).any()):
        return
    hm, b, q = (int(i) for i in (length > topk).nonzero()[0])
    raise ValueError(
        f"{mask!r} cannot be lowered to cuDNN sparse_attention with topk={topk}: query {q} of "
        f"batch row {b} (head {hm}) attends {int(length[hm, b, q])} entries of "
        f"{g} keys. Raise topk to {int(length.max())}, or use to_cudnn"
    )
