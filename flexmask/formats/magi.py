"""A mask as MagiAttention takes it: slices of (query range, key range, mask type)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flexmask._validate import check_device, torch_order
from flexmask.algebra import Mask
from flexmask.formats._stretches import STRETCHES_FROM, Stretches, compressed, stretch_lines
from flexmask.formats._structure import Window, lines, one_mask_for_all_heads, sequences, window

FULL, CAUSAL, INVCAUSAL, BICAUSAL = 0, 1, 2, 3
"""MagiAttention's ``attn_type_map`` values (``AttnMaskType.to_int_type``)."""

# A slice's type from how its rows' first and last attended keys move from one query to the
# next, 0 or 1 each: 2 * (first's step) + (last's step). Magi's causal is bottom-right aligned
# (the last key grows with the query), inverse causal top-left aligned (the first key does).


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


@torch_order
def to_magi(
    mask: Mask,
    B: int | None,
    H: int | None,
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
        H: number of heads (None: 1); the mask must be one for every head.
        Q_LEN, KV_LEN: query and key lengths of the window (KV_LEN None: Q_LEN). The order
            is torch's ``(mask, B, H, Q_LEN, KV_LEN)``; the pre-0.2 ``(mask, B, Q_LEN)``
            warns, and ``(mask, B, Q_LEN, KV_LEN)`` with Q_LEN != KV_LEN raises.
        q_offset, kv_offset: the window's first query and key position, an int or one per row.
        device: where the returned tensors live (None: the mask's device, else CPU).

    Raises:
        ValueError: a ``from_mask_mod`` leaf or a ``per_head`` whose heads differ, naming it.

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_magi
        >>> m = to_magi(flexmask.causal() & flexmask.document([3, 2]), 2, 1, 5, 5)
        >>> m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist()
        ([[0, 3], [3, 5], [5, 8], [8, 10]], [[0, 3], [3, 5], [5, 8], [8, 10]], [1, 1, 1, 1])
    """
    win = window(mask, B, H, Q_LEN, KV_LEN, q_offset, kv_offset)
    return magi_of(mask, win, device)


def magi_of(mask: Mask, win: Window, device: torch.device | str | None = None) -> MagiMask:
    """``to_magi`` of a window already checked against the mask (``window``, or
    ``validated_window`` for a call whose mask was validated once for its sizes)."""
    dev = check_device(device, mask.device)
    one = one_mask_for_all_heads(mask, "MagiAttention")
    asked = win.q_len * max(mask.rows or 1, win.q_offset.shape[0])  # lines read per token
    stretches = None
    sequences = _sequence_slices(one, win) if asked >= STRETCHES_FROM else None
    if sequences is None and asked >= STRETCHES_FROM:
        stretches = stretch_lines(one, win, transpose=False, fmt="MagiAttention")
    if sequences is not None:
        rows, (row, q, k, t) = sequences
    elif stretches is not None:  # slices read off stretches of queries, never every query
        rows = stretches[0].lo.shape[0]
        row, q, k, t = _stretch_slices(*stretches)
    else:
        lo, hi = lines(one, win, fmt="MagiAttention")
        row, q, k, t = _slices(lo, hi)
        rows = lo.shape[0]
    if rows < win.batch:
        # Batch row b takes the slices of mask row min(b, R - 1): the last row's repeated.
        counts = torch.bincount(row, minlength=rows)
        use = torch.arange(win.batch).clamp(max=rows - 1)
        per_batch = counts[use]
        row = torch.repeat_interleave(torch.arange(win.batch), per_batch)
        first = (torch.cumsum(counts, 0) - counts)[use]
        at = torch.arange(row.numel()) - (torch.cumsum(per_batch, 0) - per_batch - first)[row]
        q, k, t = q[at], k[at], t[at]
    # Rows laid end to end: (B * Q_LEN) queries and (B * KV_LEN) keys.
    shift = row.view(-1, 1)
    q_ranges = (q + shift * win.q_len).to(torch.int32)
    k_ranges = (k + shift * win.kv_len).to(torch.int32)
    return MagiMask(
        q_ranges=q_ranges.to(dev),
        k_ranges=k_ranges.to(dev),
        attn_type_map=t.to(torch.int32).to(dev),
        max_seqlen_q=int((q_ranges[:, 1] - q_ranges[:, 0]).max()) if len(q_ranges) else 0,
        max_seqlen_k=int((k_ranges[:, 1] - k_ranges[:, 0]).max()) if len(k_ranges) else 0,
        total_q=win.batch * win.q_len,
        total_k=win.batch * win.kv_len,
    )


def _sequence_slices(
    mask: Mask, win: Window
) -> tuple[int, tuple[Tensor, Tensor, Tensor, Tensor]] | None:
    """``(rows, (row, q, k, type))`` of a mask a varlen kernel runs with no window
    (``sequences``): one slice per sequence, causal or full, where the lines' algebra would
    run per stretch (per document). None for any other mask or window: the lines say."""
    found = sequences(mask, win)
    if found is None:
        return None
    if bool((found.last == found.first).any()):
        # A sequence of one token: the greedy cut joins it to its neighbour's first token
        # (a bi-causal diagonal of two), where one slice a sequence would not. The lines
        # cut it, so that a mask's slices do not depend on its size.
        return None
    q = torch.stack([found.first, found.last + 1], 1)
    kind = torch.full_like(found.first, CAUSAL if found.causal else FULL)
    return found.ids.shape[0], (found.row, q, q.clone(), kind)


def _slices(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every row's slices from its ``(R, N, K)`` intervals, as (row, q range, k range, type)
    sorted by (row, first query, first key): each track (the k-th interval of every query of
    a row) cut greedily into maximal runs of one shape, the first run starting at the track's
    first attending query and each next run at the first attending query after the last.

    The greedy cut is read from the steps between neighbouring queries, not walked query by
    query (this runs once per training step, ~N Python iterations cost as much as the
    attention at 8k). A step ``j`` (query j to j + 1) is *usable* when both queries attend and
    both ends move by 0 or 1; maximal stretches of usable steps of one kind are *segments*.
    A run starting inside a segment takes it to its end, so runs are segments entered at
    their first step or, when the segment before ends at the step just before (its run took
    this segment's first query), at their second; a segment of one step entered at its second
    step is skipped. Within a chain of touching one-step segments after an entered segment the
    skipped ones alternate, which a running maximum gives. Every attending query no entered
    segment's run covers is a run of its own (a full slice of one query).
    """
    rows, n, tracks = lo.shape
    width = n + 1
    # One line per (row, track), in row-major then track order, each followed by an empty
    # query so that no step joins two lines. Ends in int32 (half the bytes of every pass
    # below): real ones are key positions, below 2**31 as Magi's int32 ranges are; those of
    # empty slots (+-2**62) wrap to values no step reads (both its queries must attend).
    # Each written once into its padded layout (a lowering's tensors are per token: every
    # pass and every fresh allocation shows in its cost), the steps' tests in place.
    valid = _padded_lines(lo <= hi, torch.bool)
    first, last = _padded_lines(lo, torch.int32), _padded_lines(hi, torch.int32)
    step_first, step_last = first.diff(), last.diff()
    # Usable: both queries attend and both steps are 0 or 1 (no bit but the lowest set).
    usable = (step_first | step_last).bitwise_and_(-2) == 0
    usable &= valid[:-1]
    usable &= valid[1:]
    # The kind of a usable step plus one (1 full ... 4 bi-causal), 0 for the others (whose
    # steps, of unread ends, may have wrapped).
    code = step_first.mul_(2).add_(step_last).add_(1).mul_(usable)
    # Segments: maximal stretches [a, b] of usable steps of one kind.
    change = F.pad(code, (1, 1)).diff() != 0
    a = (usable & change[:-1]).nonzero().view(-1)
    b = (usable & change[1:]).nonzero().view(-1)
    if a.numel() <= _FEW_SEGMENTS:
        return _slices_listed(a.tolist(), b.tolist(), code, valid, first, last, width, tracks)
    seg_kind = code.index_select(0, a) - 1
    # Touching: the segment before ends at the step just before this one starts.
    touching = torch.zeros_like(a, dtype=torch.bool)
    touching[1:] = b[:-1] == a[1:] - 1
    # In a chain of touching one-step segments, the k-th (counting from 1 after the last
    # segment that is not one) is skipped when k is odd: the segment before it is entered.
    chained = touching & (a == b)
    if bool(chained.any()):
        index = torch.arange(a.numel())
        chain_start = torch.where(chained, 0, index).cummax(0).values
        entered = ~(chained & ((index - chain_start) % 2 == 1))
        before_entered = torch.ones_like(entered)
        before_entered[1:] = entered[:-1]
        late = touching & before_entered
        a, b, seg_kind, late = a[entered], b[entered], seg_kind[entered], late[entered]
    else:
        late = touching  # every segment entered: one touching the one before at its second step
    start = a + late
    end = b + 1
    # Attending queries no entered segment's run covers: one-query runs (full slices).
    attending = int(valid.sum())
    if attending != int((end - start).sum()) + start.numel():
        alone = _uncovered(valid, start, end)
        start = torch.cat([start, alone])
        end = torch.cat([end, alone])
        seg_kind = torch.cat([seg_kind, torch.zeros_like(alone)])
    line = start.div(width, rounding_mode="floor")
    row = line.div(tracks, rounding_mode="floor")
    q_start = start - line * width
    k_start = first.index_select(0, start)
    # By (row, first query, first key): positions and lengths stay below 2**31 (Magi's
    # ranges are int32), so the key fits in an int64.
    order = torch.argsort((row * width + q_start) * (1 << 31) + k_start)
    q = torch.stack([q_start, q_start + (end - start) + 1], 1)[order]
    k = torch.stack([k_start, last.index_select(0, end) + 1], 1).to(torch.int64)[order]
    return row[order], q, k, seg_kind[order]


_FEW_LINKED = 256
"""Up to this many stretches joined to a neighbour by a usable step, their slices are cut by
a walk over Python lists; beyond, every stretch's few lines go through ``_slices``."""


def _stretch_slices(seg: Stretches, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``_slices`` of stretches of lines (``_stretches``): the same slices, same order.

    A step from one stretch to the next that no run can take (an end moving by other than
    0 or 1, or a slot empty on one side) ends every run, so a stretch with no usable step
    to either neighbour is one slice of its own (all its steps are one kind). Stretches
    joined by usable steps (a shared prompt's slot across responses, a one-token document
    stepping into the next) are cut as the greedy walk cuts them: a few by a walk over
    stretches in Python, many by ``_slices`` over four lines a stretch (``compressed``)."""
    rows, count, slots = seg.lo.shape
    start = seg.start.repeat_interleave(slots, 0) if slots > 1 else seg.start
    lo, hi, dlo, dhi = (t.transpose(1, 2).reshape(rows * slots, count) for t in seg[1:])
    length = torch.cat([start[:, 1:], torch.full_like(start[:, :1], n)], 1) - start
    real = (lo <= hi) & (length > 0)
    linked = torch.zeros_like(real)
    if count > 1:
        last_lo, last_hi = lo + dlo * (length - 1), hi + dhi * (length - 1)
        step_lo, step_hi = lo[:, 1:] - last_lo[:, :-1], hi[:, 1:] - last_hi[:, :-1]
        usable = real[:, 1:] & real[:, :-1]
        usable &= (torch.bitwise_or(step_lo, step_hi) & -2) == 0
        linked[:, 1:] |= usable
        linked[:, :-1] |= usable
    chained = int(linked.sum())
    if chained > _FEW_LINKED:
        return _compressed_slices(seg, n)
    line, m = (real & ~linked).nonzero().unbind(1)
    q0, size, k0, d_hi = start[line, m], length[line, m], lo[line, m], dhi[line, m]
    k1 = hi[line, m] + d_hi * (size - 1) + 1
    kind = (dlo[line, m] * 2 + d_hi) * (size > 1)  # one query: full, as the walk says
    if chained:
        walked = _walk_chains(linked, usable, start, length, lo, hi, dlo, dhi)
        line = torch.cat([line, walked[:, 0]])
        q0, size = torch.cat([q0, walked[:, 1]]), torch.cat([size, walked[:, 2]])
        k0, k1 = torch.cat([k0, walked[:, 3]]), torch.cat([k1, walked[:, 4]])
        kind = torch.cat([kind, walked[:, 5]])
    row = line.div(slots, rounding_mode="floor") if slots > 1 else line
    q, k = torch.stack([q0, q0 + size], 1), torch.stack([k0, k1], 1)
    if slots > 1 or chained:  # by row, first query, first key
        order = torch.argsort((row * (n + 1) + q0) * (1 << 31) + k0)
        row, q, k, kind = row[order], q[order], k[order], kind[order]
    return row, q, k, kind


def _walk_chains(
    linked: Tensor,
    usable: Tensor,
    start: Tensor,
    length: Tensor,
    lo: Tensor,
    hi: Tensor,
    dlo: Tensor,
    dhi: Tensor,
) -> Tensor:
    """The greedy walk's runs over chains of stretches joined by usable steps, a stretch at
    a time: ``(S, 6)`` line, first query, queries, first key, key end, type."""
    line, m = linked.nonzero().unbind(1)
    nxt = torch.zeros_like(line, dtype=torch.bool)
    inner = m < usable.shape[1]
    nxt[inner] = usable[line[inner], m[inner]]
    table = torch.stack(
        [line, start[line, m], length[line, m], lo[line, m], hi[line, m], dlo[line, m]]
        + [dhi[line, m], nxt.long()],
        1,
    ).tolist()
    found: list[list[int]] = []
    chain: list[list[int]] = []
    for entry in table:
        chain.append(entry)
        if not entry[7]:  # no usable step to the next: the chain ends here
            found += _chain_runs(chain)
            chain = []
    return torch.tensor(found, dtype=torch.int64).view(-1, 6)


def _chain_runs(chain: list[list[int]]) -> list[list[int]]:
    """The greedy walk (``_slices``) over one chain of stretches ``[line, start, length, lo,
    hi, dlo, dhi, _]``: a run takes steps while they are of its first step's kind; the next
    starts on the line after it. Within a stretch every step is its own kind, so a run
    crosses a stretch in one move."""
    out = []
    a, q = 0, chain[0][1]
    while True:
        first_a, first_q, shape = a, q, None
        while True:
            _, s, size, lo, hi, dlo, dhi, _ = chain[a]
            last = s + size - 1
            if q < last:
                if shape is not None and shape != (dlo, dhi):
                    break
                shape, q = (dlo, dhi), last
                continue
            if a + 1 == len(chain):
                break
            nxt = chain[a + 1]  # the step onto the next stretch (usable in a chain)
            step = (nxt[3] - lo - dlo * (size - 1), nxt[4] - hi - dhi * (size - 1))
            if shape is not None and step != shape:
                break
            shape, a, q = step, a + 1, nxt[1]
        here, there = chain[first_a], chain[a]
        k0 = here[3] + here[5] * (first_q - here[1])
        k1 = there[4] + there[6] * (q - there[1]) + 1
        kind = 0 if shape is None else 2 * shape[0] + shape[1]
        out.append([here[0], first_q, q - first_q + 1, k0, k1, kind])
        _, s, size, *_ = chain[a]
        if q < s + size - 1:
            q += 1
        elif a + 1 < len(chain):
            a, q = a + 1, chain[a + 1][1]
        else:
            return out


def _compressed_slices(seg: Stretches, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``_slices`` of every stretch's few lines (``compressed``), back in the window's."""
    slots = seg.lo.shape[-1]
    lo, hi, line, taken_lo, taken_hi = compressed(seg, n)
    row, q, k, t = _slices(lo, hi)
    # Back to the window's queries and keys; rows of (row, slot) back to rows.
    first, last = q[:, 0], q[:, 1] - 1
    q = torch.stack([line[row, first], line[row, last] + 1], 1)
    k = torch.stack([k[:, 0] + taken_lo[row, first], k[:, 1] + taken_hi[row, last]], 1)
    row = row.div(slots, rounding_mode="floor")
    if slots > 1:  # by row, first query, first key, as _slices orders them
        order = torch.argsort((row * (n + 1) + q[:, 0]) * (1 << 31) + k[:, 0])
        row, q, k, t = row[order], q[order], k[order], t[order]
    return row, q, k, t


def _padded_lines(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``(R, N, K)`` as one flat line per (row, track), each followed by one zero (an empty
    query: no step joins two lines), in ``dtype``."""
    rows, n, tracks = x.shape
    out = torch.empty(rows, tracks, n + 1, dtype=dtype)
    out[..., :n] = x.transpose(1, 2)
    out[..., n] = 0
    return out.view(-1)


def _uncovered(valid: Tensor, start: Tensor, end: Tensor) -> Tensor:
    """The attending queries (``valid``) in none of the runs ``[start, end]``: each becomes a
    one-query run (a full slice)."""
    edges = torch.zeros(valid.numel() + 1, dtype=torch.int64)
    edges.index_put_(
        (torch.cat([start, end + 1]),),
        torch.cat([torch.ones_like(start), -torch.ones_like(end)]),
        accumulate=True,
    )
    return (valid & (edges.cumsum(0)[:-1] == 0)).nonzero().view(-1)


_FEW_SEGMENTS = 256
"""Up to this many segments, the slices are cut from Python lists: ~15 torch calls instead
of ~45 on tensors of a few elements (one shared-prefix group at 8k has 10 segments, 5 rows
of 8 groups 80)."""


def _slices_listed(
    a: list[int],
    b: list[int],
    code: Tensor,
    valid: Tensor,
    first: Tensor,
    last: Tensor,
    width: int,
    tracks: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The end of ``_slices`` for few segments ``[a, b]``, walked in order: a segment that
    touches an entered one is entered at its second step, or skipped if it has one step."""
    kinds = (code.index_select(0, torch.tensor(a, dtype=torch.int64)) - 1).tolist()
    starts, ends, types = [], [], []
    before, entered = -2, False
    for seg_a, seg_b, kind in zip(a, b, kinds, strict=True):
        late = entered and before == seg_a - 1
        entered = not (late and seg_a == seg_b)
        if entered:
            starts.append(seg_a + late)
            ends.append(seg_b + 1)
            types.append(kind)
        before = seg_b
    start, end = torch.tensor(starts, dtype=torch.int64), torch.tensor(ends, dtype=torch.int64)
    # Attending queries no entered segment's run covers: one-query runs (full slices).
    if int(valid.sum()) != sum(ends) - sum(starts) + len(starts):
        alone = _uncovered(valid, start, end)
        start, end = torch.cat([start, alone]), torch.cat([end, alone])
        starts, ends = start.tolist(), end.tolist()
        types += [FULL] * alone.numel()
    k_first = first.index_select(0, start).tolist()
    k_last = last.index_select(0, end).tolist()
    found = []
    for s, e, t, k0, k1 in zip(starts, ends, types, k_first, k_last, strict=True):
        line, q = divmod(s, width)
        found.append((line // tracks, q, k0, q + e - s + 1, k1 + 1, t))
    found.sort()
    return (
        torch.tensor([f[0] for f in found], dtype=torch.int64),
        torch.tensor([(f[1], f[3]) for f in found], dtype=torch.int64).view(-1, 2),
        torch.tensor([(f[2], f[4]) for f in found], dtype=torch.int64).view(-1, 2),
        torch.tensor([f[5] for f in found], dtype=torch.int64),
    )
