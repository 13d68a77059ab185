"""A mask as FlashInfer's block-sparse attention takes it: BSR rows per KV head.

The format is that of ``flashinfer.attention.prims_ts`` (``block_sparse.py``:
``BlockSparseTSWrapper.run`` and ``block_sparse_attention``), read there and in its tests'
reference (``tests/attention/test_attention_ts_block_sparse.py``, ``_reference``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.formats._tiles import own_dims_codes, tile_bits


@dataclass(frozen=True, eq=False)
class FlashInferMask:
    """FlashInfer's block-sparse arguments (``flashinfer.attention.prims_ts``) for one mask.

    Query ``q`` of batch row ``b`` and query head ``hq`` attends key ``kv`` iff, with ``hk =
    hq // (num_qo_heads // num_kv_heads)`` and ``m = q // q_block_size``:

    * key block ``kv // kv_block_size`` is among ``block_indices[block_indptr[b, hk, m] :
      block_indptr[b, hk, m + 1]]`` (each row's ids strictly increasing);
    * bit ``kv % 32`` of ``kv_valid_bits[b, kv // 32]`` is set (None: every key is valid);
    * with ``mask_type == "causal"``, ``kv < KV_LEN - Q_LEN + q + 1`` (bottom-right aligned).

    ``block_indptr`` is int32 ``(B, num_kv_heads, ceil(Q_LEN / q_block_size) + 1)``, offsets
    into the one flat int32 ``block_indices`` (rows in ``(b, hk, m)`` order); ``kv_valid_bits``
    uint32 ``(B, ceil(KV_LEN / 32)``, shared by every head and query of a row.
    """

    block_indptr: Tensor
    block_indices: Tensor
    kv_valid_bits: Tensor | None
    mask_type: str
    q_block_size: int
    kv_block_size: int
    num_qo_heads: int
    num_kv_heads: int
    seq_lengths: tuple[int, int]

    @property
    def max_blocks_per_row(self) -> int:
        """The most key blocks one row lists (``BlockSparseTSWrapper.plan``'s capacity)."""
        counts = self.block_indptr[..., 1:] - self.block_indptr[..., :-1]
        return int(counts.max()) if counts.numel() else 0

    def kwargs(self) -> dict[str, Any]:
        """The keywords of ``flashinfer.attention.prims_ts.block_sparse_attention(q, k, v,
        **kwargs)``: ``block_indptr``, ``block_indices``, ``q_block_size``,
        ``kv_block_size``, ``kv_valid_bits`` and ``mask_type``."""
        return {
            "block_indptr": self.block_indptr,
            "block_indices": self.block_indices,
            "q_block_size": self.q_block_size,
            "kv_block_size": self.kv_block_size,
            "kv_valid_bits": self.kv_valid_bits,
            "mask_type": self.mask_type,
        }

    def plan_kwargs(self, head_dim: int = 128) -> dict[str, Any]:
        """The keywords of ``BlockSparseTSWrapper.plan`` for this mask's geometry, but
        ``device`` and the data types (yours to give)."""
        q_len, kv_len = self.seq_lengths
        return {
            "batch_size": int(self.block_indptr.shape[0]),
            "seq_len_q": q_len,
            "seq_len_kv": kv_len,
            "num_qo_heads": self.num_qo_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": head_dim,
            "q_block_size": self.q_block_size,
            "kv_block_size": self.kv_block_size,
            "max_blocks_per_row": self.max_blocks_per_row,
            "use_kv_valid_bits": self.kv_valid_bits is not None,
            "mask_type": self.mask_type,
        }

    def run_kwargs(self) -> dict[str, Any]:
        """The routing keywords of ``BlockSparseTSWrapper.run(q, k, v, **run_kwargs)``."""
        return {
            "block_indptr": self.block_indptr,
            "block_indices": self.block_indices,
            "kv_valid_bits": self.kv_valid_bits,
        }

    def __repr__(self) -> str:
        bits = "None" if self.kv_valid_bits is None else f"uint32{list(self.kv_valid_bits.shape)}"
        return (
            f"FlashInferMask(block_indptr=int32{list(self.block_indptr.shape)}, "
            f"block_indices=int32[{self.block_indices.numel()}], kv_valid_bits={bits}, "
            f"mask_type={self.mask_type!r}, q_block_size={self.q_block_size}, "
            f"kv_block_size={self.kv_block_size})"
        )


def to_flashinfer(
    mask: Mask,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    q_block: int = 64,
    kv_block: int = 64,
    num_kv_heads: int | None = None,
    q_offset: int = 0,
    kv_offset: int = 0,
    device: torch.device | str | None = None,
) -> FlashInferMask:
    """Lower a mask to FlashInfer's block-sparse format (``prims_ts``), exactly, or refuse.

    The format lists whole key blocks per (row, KV head, query block), and inside them masks
    only by key (``kv_valid_bits``, one bit per key of a row) and, with
    ``mask_type="causal"``, by the bottom-right causal rule; it has no per-element mask. The
    block lists are flexmask's structural BlockMask at ``(q_block, kv_block)``; only its
    partial tiles are evaluated, to read which keys are valid and whether the causal rule
    holds. Keys no query of a row attends are marked invalid, so a padded or sparse key
    side costs no mask. A mask attending part of a block in any other way (a document
    boundary inside a block, a window's far edge) raises a ValueError naming the block:
    choose blocks aligned to it, or lower it with ``to_fa4`` (a per-element ``mask_mod``).

    Args:
        mask: the mask.
        B: batch size.
        H: number of query heads (``num_qo_heads``).
        Q_LEN, KV_LEN: query and key lengths (KV_LEN None: Q_LEN).
        q_block, kv_block: ``q_block_size`` and ``kv_block_size``. FlashInfer takes key
            blocks of 8, 16, 32 or a multiple of 64, and query blocks with ``q_block * H //
            num_kv_heads`` a multiple of 8.
        num_kv_heads: KV heads (GQA; None: H). Query heads ``hq`` of one group (``hq //
            (H // num_kv_heads)``) read one row, so their masks must agree.
        q_offset, kv_offset: lower the window of queries ``[q_offset, q_offset + Q_LEN)``
            and keys ``[kv_offset, kv_offset + KV_LEN)`` of the mask (a decode or
            speculative step: ``q_offset = KV_LEN - Q_LEN``, where ``causal()`` is
            FlashInfer's bottom-right causal rule).
        device: where the tensors live (None: the mask's device, else CPU).

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_flashinfer
        >>> f = to_flashinfer(flexmask.causal(), 1, 1, 64, q_block=16, kv_block=16)
        >>> f.mask_type, f.block_indptr[0, 0].tolist(), f.block_indices.tolist()
        ('causal', [0, 1, 3, 6, 10], [0, 0, 1, 0, 1, 2, 0, 1, 2, 3])

        A draft of 4 tokens over 100 cached ones, in documents: each row's keys are its
        query's document, one bit each.

        >>> mask = flexmask.causal() & flexmask.document([[60, 44], [104]])
        >>> f = to_flashinfer(mask, 2, 8, 4, 104, q_block=4, kv_block=16, num_kv_heads=2,
        ...                   q_offset=100)
        >>> f.mask_type, f.block_indptr[:, 0].tolist(), f.block_indices[:4].tolist()
        ('causal', [[0, 4], [8, 15]], [3, 4, 5, 6])
        >>> [hex(int(w)) for w in f.kv_valid_bits[0]]     # row 0: keys 60..103
        ['0x0', '0xf0000000', '0xffffffff', '0xff']
    """
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (flexmask.causal(), document(...), ...), "
            f"got {type(mask).__name__}"
        )
    B, H = check_int(B, "B", minimum=1), check_int(H, "H", minimum=1)
    Q_LEN = check_int(Q_LEN, "Q_LEN", minimum=1)
    KV_LEN = Q_LEN if KV_LEN is None else check_int(KV_LEN, "KV_LEN", minimum=1)
    q_block = check_int(q_block, "q_block", minimum=1)
    kv_block = check_int(kv_block, "kv_block", minimum=1)
    kv_heads = H if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", minimum=1)
    q_offset = check_int(q_offset, "q_offset", minimum=0)
    kv_offset = check_int(kv_offset, "kv_offset", minimum=0)
    group = _group(H, kv_heads, q_block, kv_block)
    dev = torch.device(device) if device is not None else (mask.device or torch.device("cpu"))
    # Rows (heads) the mask does not tell apart are built once and share their BSR rows.
    rows, heads, every_head = own_dims_codes(
        mask, B, H, (Q_LEN, KV_LEN), (q_block, kv_block), (q_offset, kv_offset), dev
    )
    # A group's first head's lists are the row's; the others must list the same blocks and
    # attend the same pairs in them (checked below, on the window, not on the expression:
    # heads whose masks differ elsewhere may agree here).
    codes = every_head[:, ::group].contiguous() if heads > 1 else every_head
    tiles = (codes == 1).nonzero(as_tuple=True)

    def bits_of(head_in_group: int) -> Tensor:
        return tile_bits(
            mask,
            (tiles[0], tiles[1] * group + head_in_group, tiles[2], tiles[3]),
            block=(q_block, kv_block),
            lengths=(Q_LEN, KV_LEN),
            reach=max(q_offset + Q_LEN, kv_offset + KV_LEN),
            offsets=(q_offset, kv_offset),
        )

    bits = bits_of(0)
    if group > 1 and heads > 1:
        _check_group_heads(mask, every_head, tiles, bits, bits_of, group)
    valid = _valid_keys(codes, tiles, bits, rows, KV_LEN, kv_block)
    block, lengths = (q_block, kv_block), (Q_LEN, KV_LEN)
    # By key alone ("dense") where that is exact; else with the causal rule, where no
    # attended pair lies past its diagonal.
    mask_type = "dense"
    wrong = _first_wrong(tiles, bits, valid, False, block, lengths)
    if wrong is not None:
        if not _causal_holds(codes, tiles, bits, block, lengths):
            raise _cannot(mask, tiles, wrong, block, group, causal=False)
        mask_type = "causal"
        wrong = _first_wrong(tiles, bits, valid, True, block, lengths)
        if wrong is not None:
            raise _cannot(mask, tiles, wrong, block, group, causal=True)
    indptr, indices = _bsr(codes > 0, B, kv_heads)
    return FlashInferMask(
        block_indptr=indptr,
        block_indices=indices,
        kv_valid_bits=_bits_needed(valid, codes, kv_block, B),
        mask_type=mask_type,
        q_block_size=q_block,
        kv_block_size=kv_block,
        num_qo_heads=H,
        num_kv_heads=kv_heads,
        seq_lengths=(Q_LEN, KV_LEN),
    )


def _group(heads: int, kv_heads: int, q_block: int, kv_block: int) -> int:
    """Query heads per KV head; a ValueError for a shape FlashInfer's kernel does not take."""
    if heads % kv_heads:
        raise ValueError(
            f"num_kv_heads must divide H (query heads): got H={heads}, num_kv_heads={kv_heads}"
        )
    group = heads // kv_heads
    if kv_block not in (8, 16, 32) and kv_block % 64:
        raise ValueError(
            f"kv_block must be 8, 16, 32 or a multiple of 64 (FlashInfer's kv_block_size), "
            f"got {kv_block}"
        )
    if (q_block * group) % 8:
        raise ValueError(
            f"q_block * (H // num_kv_heads) must be a multiple of 8 (FlashInfer's Q tile "
            f"stays inside one BSR row): got q_block={q_block}, H // num_kv_heads={group}"
        )
    return group


def _check_group_heads(
    mask: Mask,
    every_head: Tensor,
    tiles: tuple[Tensor, ...],
    bits: Tensor,
    bits_of: Callable[[int], Tensor],
    group: int,
) -> None:
    """A ValueError unless every query head of a KV head's group lists the blocks its first
    head lists and attends the same pairs in the partial ones."""
    batch, heads = every_head.shape[:2]
    kv_heads = heads // group
    grouped = every_head.reshape(batch, kv_heads, group, *every_head.shape[2:])
    differ = (grouped != grouped[:, :, :1]).flatten(3).any(-1).any(0)  # (kv_heads, group)
    for j in range(1, group):
        if bits.shape[0] and not bool(differ[:, j].any()):
            unlike = (bits_of(j) != bits).flatten(1).any(1)
            differ[tiles[1][unlike], j] = True
    if bool(differ.any()):
        head, j = (int(x) for x in differ.nonzero()[0])
        raise ValueError(
            f"{mask!r} cannot be lowered to FlashInfer with num_kv_heads={kv_heads}: query "
            f"heads {head * group}..{head * group + group - 1} share KV head {head} and one "
            f"BSR row, but head {head * group + j} attends otherwise than head "
            f"{head * group}. Give each KV head's group one mask "
            f"(flexmask.per_head(..., group_size={group}))"
        )


def _bsr(listed: Tensor, batch: int, kv_heads: int) -> tuple[Tensor, Tensor]:
    """``block_indptr`` and ``block_indices`` of the listed blocks ``(B or 1, H_kv or 1, M,
    N)`` for ``batch`` rows and ``kv_heads`` heads: rows in ``(b, h, m)`` order, one running
    offset into the flat indices (a row of ``(b, h)`` starts where the one before it
    ended), each row's ids ascending. A row (head) of size 1 is every row's (head's)."""
    rows, heads, num_q = listed.shape[:3]
    dev = listed.device
    counts = listed.sum(-1).view(rows * heads, num_q)
    found = listed.nonzero(as_tuple=True)[3]  # each (b, h)'s ids, in (b, h, m) order
    lengths = counts.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    b = torch.arange(batch, device=dev).view(-1, 1) % rows
    h = torch.arange(kv_heads, device=dev).view(1, -1) % heads
    which = (b * heads + h).view(-1)  # each (b, h) of the call: its built (b, h)
    offsets = torch.zeros(which.numel() * num_q + 1, dtype=torch.int64, device=dev)
    offsets[1:] = counts[which].view(-1).cumsum(0)
    per_head = torch.arange(which.numel(), device=dev).view(-1, 1) * num_q
    indptr = offsets[per_head + torch.arange(num_q + 1, device=dev)].view(batch, kv_heads, -1)
    owner = torch.repeat_interleave(torch.arange(which.numel(), device=dev), lengths[which])
    first = torch.cumsum(lengths[which], 0) - lengths[which]
    within = torch.arange(owner.numel(), device=dev) - first[owner]
    indices = found[starts[which][owner] + within]
    return indptr.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous()


def _valid_keys(
    codes: Tensor,
    tiles: tuple[Tensor, ...],
    bits: Tensor,
    batch: int,
    kv_len: int,
    kv_block: int,
) -> Tensor:
    """``(B, KV_LEN)`` bool: the keys some query of the row attends (any head)."""
    dev = codes.device
    num_kv = codes.shape[3]
    whole = (codes == 2).flatten(1, 2).any(1)  # (B, num_kv): a key block attended whole
    valid = whole.repeat_interleave(kv_block, dim=1)
    if bits.shape[0]:
        some = bits.any(1).to(torch.int32)  # (P, kv_block): keys each tile attends
        seen = torch.zeros(batch, num_kv, kv_block, dtype=torch.int32, device=dev)
        seen.index_put_((tiles[0], tiles[3]), some, accumulate=True)
        valid |= (seen > 0).view(batch, -1)
    return valid[:, :kv_len]


def _causal_holds(
    codes: Tensor,
    tiles: tuple[Tensor, ...],
    bits: Tensor,
    block: tuple[int, int],
    lengths: tuple[int, int],
) -> bool:
    """Whether no attended pair lies past the bottom-right diagonal ``kv <= q + KV - Q``."""
    (q_block, kv_block), (q_len, kv_len) = block, lengths
    shift = kv_len - q_len
    dev = codes.device
    b, h, m, n = (codes == 2).nonzero(as_tuple=True)
    last_kv = torch.clamp((n + 1) * kv_block, max=kv_len) - 1
    if bool((last_kv > m * q_block + shift).any()):
        return False
    if not bits.shape[0]:
        return True
    q = tiles[2].view(-1, 1, 1) * q_block + torch.arange(q_block, device=dev).view(1, -1, 1)
    kv = tiles[3].view(-1, 1, 1) * kv_block + torch.arange(kv_block, device=dev).view(1, 1, -1)
    return not bool((bits & (kv > q + shift)).any())


def _first_wrong(
    tiles: tuple[Tensor, ...],
    bits: Tensor,
    valid: Tensor,
    causal: bool,
    block: tuple[int, int],
    lengths: tuple[int, int],
) -> int | None:
    """The first partial tile whose bits are not its row's ``valid`` keys (and, with
    ``causal``, the bottom-right causal rule), None when every one is."""
    if not bits.shape[0]:
        return None
    (q_block, kv_block), (q_len, kv_len) = block, lengths
    dev = bits.device
    q = tiles[2].view(-1, 1, 1) * q_block + torch.arange(q_block, device=dev).view(1, -1, 1)
    kv = tiles[3].view(-1, 1, 1) * kv_block + torch.arange(kv_block, device=dev).view(1, 1, -1)
    inside = (q < q_len) & (kv < kv_len)
    want = valid[tiles[0].view(-1, 1, 1), kv.clamp(max=kv_len - 1)] & inside
    if causal:
        want &= kv <= q + (kv_len - q_len)
    wrong = (want != bits).flatten(1).any(1).nonzero()
    return int(wrong[0]) if wrong.numel() else None


def _cannot(
    mask: Mask,
    tiles: tuple[Tensor, ...],
    wrong: int,
    block: tuple[int, int],
    group: int,
    causal: bool,
) -> ValueError:
    b, h, m, n = (int(t[wrong]) for t in tiles)
    (q_block, kv_block) = block
    tried = (
        "kv_valid_bits (one bit per key, for every query of a row) and mask_type='causal' "
        "(bottom-right)"
        if causal
        else "kv_valid_bits (one bit per key, for every query of a row), and the causal rule "
        "would drop pairs the mask attends"
    )
    return ValueError(
        f"{mask!r} cannot be lowered to FlashInfer's block-sparse format at q_block="
        f"{q_block}, kv_block={kv_block}: in block (row {b}, KV head {h // group}, queries "
        f"{m * q_block}..{(m + 1) * q_block - 1}, keys {n * kv_block}.."
        f"{(n + 1) * kv_block - 1}) the queries attend different keys, and inside a listed "
        f"block the format masks only with {tried}; it has no per-element mask. Choose "
        f"blocks aligned to the mask's boundaries, or use to_fa4 (a per-element mask_mod) "
        f"or flexmask.create_block_mask"
    )


def _bits_needed(valid: Tensor, codes: Tensor, kv_block: int, batch: int) -> Tensor | None:
    """``kv_valid_bits`` (a key's bit set iff some query of its row attends it) where a
    listed block holds a key no query attends, else None: a key in no listed block is
    never read."""
    listed = (codes > 0).flatten(1, 2).any(1)  # (rows, num_kv): a block some row lists
    read = listed.repeat_interleave(kv_block, dim=1)[:, : valid.shape[1]]
    if bool((valid | ~read).all()):
        return None
    return _pack_bits(valid.expand(batch, -1))


def _pack_bits(valid: Tensor) -> Tensor:
    """``(B, ceil(KV_LEN / 32))`` uint32: bit ``kv % 32`` of word ``kv // 32`` (FlashInfer's
    little-endian token bitmap)."""
    batch, kv_len = valid.shape
    words = -(-kv_len // 32)
    padded = torch.nn.functional.pad(valid, (0, words * 32 - kv_len)).view(batch, words, 32)
    weights = torch.ones(32, dtype=torch.int64, device=valid.device) << torch.arange(
        32, device=valid.device
    )
    return (padded.to(torch.int64) * weights).sum(-1).to(torch.uint32)
