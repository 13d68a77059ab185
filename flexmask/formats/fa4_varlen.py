"""A mask with documents as FlashAttention-4's varlen block sparsity takes it: one block
grid per sequence (flash-attn's ``flash_attn/cute/block_sparsity.py``, ``block_sparse_utils.py``
``_get_curr_blocksparse_tensors_varlen`` and ``seqlen_info.py`` ``SeqlenInfoQK``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_int
from flexmask.algebra import Mask, conjuncts
from flexmask.blocks import BlockGrid
from flexmask.builders import build, make_spec
from flexmask.formats._tiles import tile_bits, tile_codes


@dataclass(frozen=True, eq=False)
class FA4VarlenMask:
    """FlashAttention-4's varlen block-sparse arguments: sequences packed end to end, each
    with its own block grid starting at its first token.

    Sequence ``s`` is the queries ``q_index[cu_seqlens_q[s]:cu_seqlens_q[s + 1]]`` and keys
    ``k_index[cu_seqlens_k[s]:cu_seqlens_k[s + 1]]`` (flat ``b * Q_LEN + q`` and ``b *
    KV_LEN + kv``); its ``M_s = ceil(len_q / q_block)`` query blocks and ``N_s = ceil(len_k
    / kv_block)`` key blocks are numbered from its start. FA4 reads, for head ``h`` and
    query block ``m`` of sequence ``s``:

    * ``mask_block_cnt[h, cu_total_m_blocks[s] + m]`` (int32 ``(H, total_m_blocks)``) and
      the first that many entries of ``mask_block_idx[h, cu_block_idx_offsets[s] + m * N_s
      :]`` (int32 ``(H, total_n_blocks)``, ``total_n_blocks = sum M_s * N_s``): the key
      blocks masked by ``mask_mod``;
    * ``full_block_cnt`` / ``full_block_idx`` alike: the key blocks attended whole;
    * any other key block of the sequence is skipped, and no key of another sequence is
      seen.

    ``mask_mod(batch, head, m_idx, n_idx, seqlen_info, aux_tensors)`` gets the sequence
    as ``batch`` and its local positions; it reads only ``aux_tensors``: ``[0]`` the number
    of each partial tile, laid out as ``mask_block_idx`` (0: none), ``[1]``
    ``cu_block_idx_offsets``, ``[2]`` each sequence's ``N_s`` and ``[3]`` the bool tiles
    ``(1 + tiles, q_block, kv_block)`` (tile 0 attends nothing). Forward only: the
    backward's varlen block sparsity is not written here.
    """

    mask_block_cnt: Tensor
    mask_block_idx: Tensor
    full_block_cnt: Tensor
    full_block_idx: Tensor
    cu_total_m_blocks: Tensor
    cu_block_idx_offsets: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_index: Tensor
    k_index: Tensor
    aux_tensors: tuple[Tensor, Tensor, Tensor, Tensor]
    block_size: tuple[int, int]
    seq_lengths: tuple[int, int]
    batch: int

    def mask_mod(
        self, batch: Tensor, head: Tensor, m_idx: Tensor, n_idx: Tensor, seqlen_info: Any, aux
    ) -> Tensor:
        """True where query ``m_idx`` of sequence ``batch`` attends its key ``n_idx`` (local
        positions), read from ``aux`` (FA4's ``aux_tensors``) alone; valid on listed partial
        blocks."""
        tile_of, offsets, n_blocks, tiles = aux[0], aux[1], aux[2], aux[3]
        q_block, kv_block = self.block_size
        flat = offsets[batch] + (m_idx // q_block) * n_blocks[batch] + n_idx // kv_block
        return tiles[tile_of[head, flat], m_idx % q_block, n_idx % kv_block]

    def block_sparse_fields(self) -> dict[str, Any]:
        """The fields of FA4's ``BlockSparseTensorsTorch`` for a varlen call, by name."""
        return {
            "mask_block_cnt": self.mask_block_cnt,
            "mask_block_idx": self.mask_block_idx,
            "full_block_cnt": self.full_block_cnt,
            "full_block_idx": self.full_block_idx,
            "cu_total_m_blocks": self.cu_total_m_blocks,
            "cu_block_idx_offsets": self.cu_block_idx_offsets,
            "block_size": self.block_size,
        }

    def kwargs(self) -> dict[str, Any]:
        """The keywords of ``flash_attn.cute.flash_attn_varlen_func(q, k, v, **kwargs)`` for
        packed ``q``/``k``/``v`` (``pack_q``, ``pack_k``): ``cu_seqlens_q``,
        ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``, ``block_sparse_tensors``,
        ``mask_mod`` and ``aux_tensors``.

        Raises:
            ImportError: flash-attn's CuTe package (``flash_attn.cute``) is not installed.
        """
        try:
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        except ImportError as error:
            raise ImportError(
                "FA4VarlenMask.kwargs() needs flash-attn's CuTe interface (flash_attn.cute, "
                "CUDA only); block_sparse_fields() gives the same tensors by name without it"
            ) from error
        return {
            "cu_seqlens_q": self.cu_seqlens_q,
            "cu_seqlens_k": self.cu_seqlens_k,
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
            "block_sparse_tensors": BlockSparseTensorsTorch(**self.block_sparse_fields()),
            "mask_mod": self.mask_mod,
            "aux_tensors": list(self.aux_tensors),
        }

    def pack_q(self, x: Tensor) -> Tensor:
        """``(B, Q_LEN, ...)`` queries (or output grads) as the packed ``(total_q, ...)``."""
        return x.reshape(-1, *x.shape[2:])[self.q_index]

    def pack_k(self, x: Tensor) -> Tensor:
        """``(B, KV_LEN, ...)`` keys or values as the packed ``(total_k, ...)``."""
        return x.reshape(-1, *x.shape[2:])[self.k_index]

    def unpack(self, out: Tensor) -> Tensor:
        """The packed ``(total_q, ...)`` output back to ``(B, Q_LEN, ...)``; queries in no
        sequence (they attend nothing) are 0, as flex_attention gives them."""
        full = out.new_zeros(self.batch * self.seq_lengths[0], *out.shape[1:])
        full[self.q_index] = out
        return full.view(self.batch, self.seq_lengths[0], *out.shape[1:])

    def __repr__(self) -> str:
        return (
            f"FA4VarlenMask(sequences={self.cu_seqlens_q.numel() - 1}, "
            f"mask_block_idx=int32{list(self.mask_block_idx.shape)}, "
            f"block_size={self.block_size}, partial_tiles={self.aux_tensors[3].shape[0] - 1})"
        )


def to_fa4_varlen(
    mask: Mask,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    q_block: int = 256,
    kv_block: int = 128,
    device: torch.device | str | None = None,
) -> FA4VarlenMask:
    """Lower a mask to FlashAttention-4's varlen block sparsity: one sequence per document.

    The sequences are the parts of the mask's partitions — the ``document``, ``chunked`` and
    ``padding`` factors of its top-level ``&`` (no factor: one sequence per row); every
    other factor (causal, windows, prefixes, trees, ``from_mask_mod``, per-head masks) is
    kept inside each sequence, where its blocks are flexmask's structural BlockMask of that
    sequence's window (its grid starting at the sequence's first token, as FA4 numbers
    them) and its partial tiles' bits go to ``mask_mod``'s aux tensors. Tokens in no part
    (padding) are left out of the packed layout; ``unpack`` gives them 0. The index tensors
    are each sequence's own grid, ``sum M_s * N_s`` entries, not the ``(B, M, N)`` of the
    whole row.

    FA4 runs varlen block sparsity with ``q_block`` equal to its query tile
    (``q_stage * tile_m``: 256 on Blackwell, 128 on Hopper) and ``kv_block`` a multiple of
    its key tile.

    Args:
        mask: the mask (``&`` a partition to get more than one sequence per row).
        B: batch size (rows).
        H: number of query heads.
        Q_LEN, KV_LEN: query and key lengths of each row (KV_LEN None: Q_LEN); a sequence's
            queries are its positions below Q_LEN, its keys those below KV_LEN.
        q_block, kv_block: the query and key block sizes.
        device: where the tensors live (None: the mask's device, else CPU).

    Example:
        >>> import flexmask
        >>> mask = flexmask.causal() & flexmask.document([300, 200, 12])   # 12: padding
        >>> f = flexmask.formats.to_fa4_varlen(mask, 1, 1, 520, q_block=256, kv_block=128)
        >>> f.cu_seqlens_q.tolist(), f.cu_total_m_blocks.tolist(), f.cu_block_idx_offsets.tolist()
        ([0, 300, 500, 512], [0, 2, 3, 4], [0, 6, 8, 9])
        >>> f.full_block_cnt[0].tolist(), f.mask_block_cnt[0].tolist()
        ([0, 0, 0, 0], [2, 3, 2, 1])
    """
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (flexmask.causal() & flexmask.document(...), ...), "
            f"got {type(mask).__name__}"
        )
    B, H = check_int(B, "B", minimum=1), check_int(H, "H", minimum=1)
    Q_LEN = check_int(Q_LEN, "Q_LEN", minimum=1)
    KV_LEN = Q_LEN if KV_LEN is None else check_int(KV_LEN, "KV_LEN", minimum=1)
    q_block = check_int(q_block, "q_block", minimum=1)
    kv_block = check_int(kv_block, "kv_block", minimum=1)
    dev = torch.device(device) if device is not None else (mask.device or torch.device("cpu"))
    # Validated once, for the whole rows; each sequence's window is then built as is.
    make_spec(mask, B, H, Q_LEN, KV_LEN, dev, (q_block, kv_block), sized=False)
    length = max(Q_LEN, KV_LEN)
    row, start, end = _sequences(mask, B, length)
    len_q = (end.clamp(max=Q_LEN) - start).clamp(min=0)
    len_k = (end.clamp(max=KV_LEN) - start).clamp(min=0)
    # A sequence with no key (past KV_LEN) attends nothing: left out, as padding is.
    keep = (len_q > 0) & (len_k > 0)
    row, start, len_q, len_k = row[keep], start[keep], len_q[keep], len_k[keep]
    m_blocks = -(-len_q // q_block)
    n_blocks = -(-len_k // kv_block)
    heads = H if mask.head_dependent else 1
    lists, tile_of, bits = _grids(
        mask, B, heads, (row, start, len_q, len_k), (q_block, kv_block), length, dev
    )
    cu_m = _cumulative(m_blocks, dev)
    cu_idx = _cumulative(m_blocks * n_blocks, dev)
    cnt, idx, full_cnt, full_idx = (t.expand(H, -1).contiguous() for t in lists)
    tile_of = tile_of.expand(H, -1).contiguous()
    tiles = torch.cat([torch.zeros(1, q_block, kv_block, dtype=torch.bool, device=dev), bits])
    q_index = _flat_positions(row, start, len_q, Q_LEN, dev)
    k_index = _flat_positions(row, start, len_k, KV_LEN, dev)
    return FA4VarlenMask(
        mask_block_cnt=cnt,
        mask_block_idx=idx,
        full_block_cnt=full_cnt,
        full_block_idx=full_idx,
        cu_total_m_blocks=cu_m,
        cu_block_idx_offsets=cu_idx,
        cu_seqlens_q=_cumulative(len_q, dev),
        cu_seqlens_k=_cumulative(len_k, dev),
        max_seqlen_q=int(len_q.max()) if len_q.numel() else 0,
        max_seqlen_k=int(len_k.max()) if len_k.numel() else 0,
        q_index=q_index,
        k_index=k_index,
        aux_tensors=(tile_of, cu_idx, n_blocks.to(torch.int32).to(dev), tiles.contiguous()),
        block_size=(q_block, kv_block),
        seq_lengths=(Q_LEN, KV_LEN),
        batch=B,
    )


def _grids(
    mask: Mask,
    batch: int,
    heads: int,
    windows: tuple[Tensor, Tensor, Tensor, Tensor],
    block: tuple[int, int],
    length: int,
    dev: torch.device,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Every sequence's lists, laid out as FA4 reads them (``(heads, total_m_blocks)``
    counts, ``(heads, total_n_blocks)`` indices, partial then full), the number of each
    partial tile in the indices' layout, and the tiles' bits. A sequence the mask cannot
    tell from one before it (the same window of a row-independent mask) reuses its lists
    and tiles: built and evaluated once."""
    row, start, len_q, len_k = windows
    sides: list[list[Tensor]] = [[], [], [], []]  # partial counts, indices, full ones
    numbers: list[Tensor] = []  # each sequence's tile numbers, flattened as its indices
    found: list[list[Tensor]] = [[], [], [], []]  # each new partial tile: window, head, m, n
    seen: dict[tuple[int, int, int, int], tuple[list[Tensor], Tensor]] = {}
    total = 0
    for s in range(row.numel()):
        window = (int(row[s]), int(start[s]), int(len_q[s]), int(len_k[s]))
        key = window if mask.batch_dependent else (0, *window[1:])
        if key not in seen:
            codes = _codes(mask, batch, heads, window, block, length, dev)
            grid = [t for code in (1, 2) for t in _lists(codes, code)]
            partial = codes == 1
            h, m, n = partial.nonzero(as_tuple=True)
            number = torch.zeros(codes.shape, dtype=torch.int32, device=dev)
            number[h, m, n] = torch.arange(
                total + 1, total + h.numel() + 1, dtype=torch.int32, device=dev
            )
            total += h.numel()
            for into, values in zip(found, (torch.full_like(h, s), h, m, n), strict=True):
                into.append(values)
            seen[key] = (grid, number.flatten(1))
        grid, number = seen[key]
        for side, part in zip(sides, grid, strict=True):
            side.append(part.flatten(1))
        numbers.append(number)
    lists = [
        torch.cat(parts, 1).to(torch.int32) if parts else torch.zeros(heads, 0, dtype=torch.int32)
        for parts in sides
    ]
    tile_of = (torch.cat(numbers, 1) if numbers else torch.zeros(heads, 0, dtype=torch.int32)).to(
        dev
    )
    seq, head, m, n = (
        torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=dev)
        for parts in found
    )
    bits = tile_bits(
        mask,
        (row.to(dev)[seq], head, m, n),
        block=block,
        lengths=(len_q.to(dev)[seq], len_k.to(dev)[seq]),
        reach=length,
        offsets=(start.to(dev)[seq], start.to(dev)[seq]),
    )
    return [t.to(dev) for t in lists], tile_of, bits


def _sequences(mask: Mask, batch: int, length: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(row, start, end)`` of each sequence, row-major: the runs of positions that share
    a part of every partition factor of the mask's top-level ``&`` (a factor that is none,
    or cannot say, is kept inside the sequences)."""
    parts: list[Tensor] = []
    for factor in conjuncts(mask):
        try:
            part = factor.varlen_part(length)
        except ValueError:  # a factor with no varlen form: not a partition
            continue
        if part.segment_ids is not None:
            ids = torch.stack([i[:length] for i in part.segment_ids])
            parts.append(ids.expand(batch, length) if ids.shape[0] == 1 else ids)
    if not parts:
        ids = torch.zeros(batch, length, dtype=torch.int64)
        parts.append(ids)
    stacked = torch.stack(parts)  # (factors, B, length)
    inside = (stacked >= 0).all(0)
    changed = torch.ones(batch, length, dtype=torch.bool)
    changed[:, 1:] = (stacked[..., 1:] != stacked[..., :-1]).any(0)
    begins = inside & (changed | ~torch.cat([inside[:, :1], inside[:, :-1]], 1))
    after = torch.cat([begins[:, 1:] | ~inside[:, 1:], torch.ones_like(begins[:, :1])], 1)
    ends = inside & after
    row, start = begins.nonzero().unbind(1)
    end = ends.nonzero()[:, 1] + 1  # row-major both: the i-th run ends at the i-th end
    return row, start, end


def _codes(
    mask: Mask,
    batch: int,
    heads: int,
    window: tuple[int, int, int, int],
    block: tuple[int, int],
    length: int,
    dev: torch.device,
) -> Tensor:
    """``(H, M_s, N_s)`` codes of one sequence's ``(row, start, len_q, len_k)`` window, its
    grid starting at ``start``."""
    row, start, len_q, len_k = window
    if mask.batch_dependent:
        offset: int | list[int] = [start if r == row else 0 for r in range(batch)]
    else:
        offset, batch, row = start, 1, 0
    grid = BlockGrid.make(batch, heads, len_q, len_k, *block, dev, offset, offset, reach=length)
    codes = tile_codes(build(mask, grid), batch, heads)
    return codes[row]


def _lists(codes: Tensor, code: int) -> tuple[Tensor, Tensor]:
    """Per (head, query block) how many key blocks have ``code``, and their indices first,
    ascending (the rest 0), as FA4 reads ``cnt`` entries of a row."""
    picked = codes == code
    count = picked.sum(-1)
    n = torch.arange(codes.shape[-1], device=codes.device)
    order = torch.where(picked, n, n + codes.shape[-1]).argsort(-1)
    return count, torch.where(n < count.unsqueeze(-1), order, 0)


def _cumulative(sizes: Tensor, dev: torch.device) -> Tensor:
    out = torch.zeros(sizes.numel() + 1, dtype=torch.int64)
    out[1:] = sizes.cumsum(0)
    return out.to(torch.int32).to(dev)


def _flat_positions(
    row: Tensor, start: Tensor, lengths: Tensor, row_len: int, dev: torch.device
) -> Tensor:
    """Each sequence's positions as flat indices ``row * row_len + position``, packed."""
    if not lengths.numel():
        return torch.zeros(0, dtype=torch.int64, device=dev)
    first = row * row_len + start
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    firsts = torch.zeros_like(lengths)
    firsts[1:] = lengths.cumsum(0)[:-1]
    within = torch.arange(int(lengths.sum())) - firsts[owner]
    return (first[owner] + within).to(dev)
