"""A mask as PaddlePaddle's FlashMask takes it: per key column, the rows it masks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_device
from flexmask.algebra import Mask
from flexmask.formats._stretches import STRETCHES_FROM, stretch_lines
from flexmask.formats._structure import Window, head_masks, lines, sequences, window


@dataclass(frozen=True, eq=False)
class FlashMask:
    """``startend_row_indices`` and ``causal`` of ``paddle.nn.functional.flashmask_attention``.

    ``startend_row_indices`` is int32 ``(B, H or 1, KV_LEN, C)``; per key column ``j`` its
    values mask rows (queries) as paddle documents them:

    * ``causal=True``, C = 1 ``[LTS]``: rows ``>= LTS`` and rows ``< j``;
    * ``causal=True``, C = 2 ``[LTS, LTE]``: rows in ``[LTS, LTE)`` and rows ``< j``;
    * ``causal=False``, C = 2 ``[LTS, UTE]``: rows ``>= LTS`` and rows ``< UTE``;
    * ``causal=False``, C = 4 ``[LTS, LTE, UTS, UTE]``: rows in ``[LTS, LTE)`` and in
      ``[UTS, UTE)``.
    """

    startend_row_indices: Tensor
    causal: bool

    @property
    def columns(self) -> int:
        """C: 1, 2 or 4 bounds per key column."""
        return self.startend_row_indices.shape[-1]

    def __repr__(self) -> str:
        return (
            f"FlashMask(startend_row_indices=int32{list(self.startend_row_indices.shape)}, "
            f"causal={self.causal})"
        )


def to_flashmask(
    mask: Mask,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    device: torch.device | str | None = None,
) -> FlashMask:
    """Lower a mask to FlashMask's column form, the most compact that is exact, or refuse.

    For each key column the queries attending it are read from the mask's structure; the
    form is the smallest of (causal, 1 column), (causal, 2), (bidirectional, 2),
    (bidirectional, 4) that holds every column: causal forms when no query attends a later
    key (only with ``Q_LEN == KV_LEN``, where top-left and bottom-right causal agree), and at
    most two masked row intervals per column. Heads that differ (``per_head``) give one
    column set per head, else the head dimension is 1 (FlashMask broadcasts it).

    Args:
        mask: the mask.
        B: batch size (None: the mask's rows, else 1).
        H: number of heads (None: 1).
        Q_LEN, KV_LEN: query and key lengths of the window (KV_LEN None: Q_LEN).
        q_offset, kv_offset: the window's first query and key position, an int or one per row.
        device: where the tensor lives (None: the mask's device, else CPU).

    Raises:
        ValueError: a column whose queries need more than two masked row intervals (naming
            the column and its rows), a ``from_mask_mod`` leaf, or a tree not laid out in
            preorder.

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_flashmask
        >>> f = to_flashmask(flexmask.causal() & flexmask.document([4, 3, 3]), 1, 1, 10)
        >>> f.causal, f.startend_row_indices[0, 0, :, 0].tolist()   # paddle's document example
        (True, [4, 4, 4, 4, 7, 7, 7, 10, 10, 10])
    """
    heads = 1 if H is None else H
    win = window(mask, B, heads, Q_LEN, KV_LEN, q_offset, kv_offset)
    dev = check_device(device, mask.device)
    distinct, which = head_masks(mask, heads)
    square = win.q_len == win.kv_len
    asked = win.kv_len * max(mask.rows or 1, win.kv_offset.shape[0])  # columns per token
    if square and len(distinct) == 1 and asked >= STRETCHES_FROM:
        lts = _sequence_columns(distinct[0], win)
        if lts is None:
            lts = _causal_columns(distinct[0], win)
        if lts is not None:  # the first form, read off stretches of columns
            out = lts[:, None, :, None].expand(win.batch, 1, -1, 1)
            return FlashMask(out.contiguous().to(dev), True)
    columns = [_attending(m, win) for m in distinct]
    for causal, width in ((True, 1), (True, 2), (False, 2), (False, 4)):
        if causal and not square:
            continue
        built = [_bounds(lo, hi, win.q_len, causal, width) for lo, hi in columns]
        if all(b is not None for b in built):
            found = [b for b in built if b is not None]
            height = max(b.shape[0] for b in found)  # head masks whose rows differ or not
            found = [b.expand(height, *b.shape[1:]) for b in found]
            out = torch.stack([found[w] for w in which], 1) if len(found) > 1 else found[0][:, None]
            out = out.expand(win.batch, *out.shape[1:]).to(torch.int32).contiguous()
            return FlashMask(out.to(dev), causal)
    for (lo, hi), m in zip(columns, distinct, strict=True):
        masked = _masked(lo, hi, win.q_len)
        count = (masked[0] <= masked[1]).sum(-1)
        if bool((count > 2).any()):
            r, j = (int(i) for i in (count > 2).nonzero()[0])
            rows = [
                [int(a), int(z) + 1]
                for a, z in zip(masked[0][r, j], masked[1][r, j], strict=True)
                if a <= z
            ]
            raise ValueError(
                f"{m!r} cannot be lowered to FlashMask: key column {j} (batch row {r}) masks "
                f"the query rows {rows}, {len(rows)} intervals, and FlashMask masks at most two "
                f"per column (one below, one above the diagonal). Use to_magi or "
                f"flexmask.create_block_mask"
            )
    raise AssertionError("unreachable: the four-column form holds two intervals per column")


def _attending(mask: Mask, win: Window) -> tuple[Tensor, Tensor]:
    """Per mask row (one when no row differs: the bounds are expanded to the batch once
    they are made, not computed again for every batch row), each column's queries."""
    lo, hi = lines(mask, win, transpose=True, fmt="FlashMask")
    return lo, hi


def _sequence_columns(mask: Mask, win: Window) -> Tensor | None:
    """``(R, KV)`` int32 the causal one-bound form's ``LTS`` of a causal mask a varlen kernel
    runs with no window (``sequences``): a column of a sequence is attended by the queries
    from it to the sequence's end, a column in none by no query (``LTS = j``). None for any
    other mask or window."""
    found = sequences(mask, win)
    if found is None or not found.causal:
        return None
    inside = found.ids >= 0
    # Each position's sequence, counted over the rows laid end to end (row-major, as the
    # sequences are listed): the sequence ends read by it.
    begins = torch.zeros_like(found.ids)
    begins[found.row, found.first] = 1
    which = (begins.flatten().cumsum(0) - 1).view_as(found.ids).clamp_(min=0)
    ends = (found.last + 1).to(torch.int32)
    column = torch.arange(found.ids.shape[1], dtype=torch.int32).expand_as(found.ids)
    if not ends.numel():
        return column.contiguous()
    return torch.where(inside, ends[which], column)


def _causal_columns(mask: Mask, win: Window) -> Tensor | None:
    """``(R, KV)`` int32 the causal one-bound form's ``LTS`` (what ``_bounds(..., True, 1)``
    gives), read off stretches of key columns (``_stretches``), or None where the mask's
    columns do not say where they change or do not fit that form (the per-column path then
    tries every form). A column attended by the queries ``[j, LTS)`` or by none (``LTS =
    j``) fits: on a stretch, its first attending query is the column itself throughout."""
    found = stretch_lines(mask, win, transpose=True, fmt="FlashMask")
    if found is None or found[0].lo.shape[-1] != 1:
        return None  # a column attended by two runs of queries: another form
    seg, n = found
    start = seg.start
    lo, hi, dlo, dhi = (t[..., 0] for t in seg[1:])
    length = torch.cat([start[:, 1:], torch.full_like(start[:, :1], n)], 1) - start
    real = (lo <= hi) & (length > 0)
    if not bool((~real | (lo == start) & ((dlo == 1) | (length == 1))).all()):
        return None
    # Per stretch: LTS at its first column and its step; none attending: LTS = j.
    step = torch.where(real, dhi, 1)
    base = (torch.where(real, hi + 1, start) - step * start).to(torch.int32)
    # Each column's stretch: a count of the stretches' starts (padding ones past the row).
    marks = torch.zeros(start.shape[0], n + 1, dtype=torch.int64)
    marks.scatter_(1, start[:, 1:], 1)
    which = marks[:, :n].cumsum_(1)
    column = torch.arange(n, dtype=torch.int32)
    return base.gather(1, which).add_(step.to(torch.int32).gather(1, which).mul_(column))


def _masked(lo: Tensor, hi: Tensor, q_len: int) -> tuple[Tensor, Tensor]:
    """Per column, the row intervals no query attends: the gaps of the attending ones."""
    empty = lo > hi
    lo = torch.where(empty, q_len, lo)
    hi = torch.where(empty, q_len, hi)
    gap_lo = torch.cat([torch.zeros_like(lo[..., :1]), hi + 1], -1)
    gap_hi = torch.cat([lo - 1, torch.full_like(lo[..., :1], q_len - 1)], -1)
    return gap_lo, gap_hi.clamp(max=q_len - 1)


def _bounds(lo: Tensor, hi: Tensor, q_len: int, causal: bool, width: int) -> Tensor | None:
    """``(R, KV, width)`` bounds of one form, or None if some column does not fit it."""
    j = torch.arange(lo.shape[1]).view(1, -1)
    real = lo <= hi
    count = real.sum(-1)
    a0, z0 = lo[..., 0], hi[..., 0]  # first attending run (valid where count >= 1)
    n = q_len
    if causal:
        # Rows above the diagonal are masked by the flag: no query may attend a later key.
        if not bool(((count == 0) | (a0 >= j)).all()):
            return None
        if width == 1:  # attending rows are [j, LTS)
            fits = (count == 0) | ((count == 1) & (a0 == j))
            if not bool(fits.all()):
                return None
            lts = torch.where(count == 0, j, z0 + 1)
            return lts.unsqueeze(-1)
        # [LTS, LTE) masked below the diagonal: attending is [j, LTS) and [LTE, Q).
        last = torch.where(real, hi, -1).amax(-1)  # last attending row (-1: none)
        a1 = lo[..., 1] if lo.shape[-1] > 1 else torch.full_like(a0, q_len)
        two = (count == 2) & (a0 == j) & (last == q_len - 1)
        first_run = (count == 1) & (a0 == j)
        tail_run = (count == 1) & (a0 > j) & (z0 == q_len - 1)
        if not bool(((count == 0) | two | first_run | tail_run).all()):
            return None
        lts = torch.where(two | first_run, z0 + 1, j)
        lte = torch.where(two, a1, torch.where(tail_run, a0, n))
        return torch.stack([lts, lte], -1)
    if width == 2:  # attending rows are [UTE, LTS)
        if not bool((count <= 1).all()):
            return None
        lts = torch.where(count == 0, 0, z0 + 1)
        ute = torch.where(count == 0, 0, a0)
        return torch.stack([lts, ute], -1)
    gap_lo, gap_hi = _masked(lo, hi, q_len)
    gaps = gap_lo <= gap_hi
    if not bool((gaps.sum(-1) <= 2).all()):
        return None
    # The first masked interval above, the last below: [UTS, UTE) and [LTS, LTE).
    big = torch.full_like(gap_lo, q_len + 1)
    order = torch.where(gaps, gap_lo, big).sort(-1)
    starts = order.values
    ends = torch.where(gaps, gap_hi + 1, -1).gather(-1, order.indices)
    count_gaps = gaps.sum(-1)
    zero = torch.zeros_like(a0)
    uts = torch.where(count_gaps == 2, starts[..., 0], zero)
    ute = torch.where(count_gaps == 2, ends[..., 0], zero)
    lts = torch.where(
        count_gaps == 2, starts[..., 1], torch.where(count_gaps == 1, starts[..., 0], n)
    )
    lte = torch.where(count_gaps == 2, ends[..., 1], torch.where(count_gaps == 1, ends[..., 0], n))
    return torch.stack([lts, lte, uts, ute], -1)
