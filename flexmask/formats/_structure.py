"""What the foreign formats read of a mask: interval algebra over the expression tree.

Two views, both exact and neither evaluating the mask on every (query, key) pair:

* ``lines`` — for every batch row and every query (or, transposed, every key) of a window,
  the keys (queries) it attends as a short sorted list of disjoint intervals. Each leaf
  gives its own intervals from its data (``Mask.lines_at``); ``&``, ``|`` and ``~``
  intersect, join and complement the lists. Magi's slices and FlashMask's column bounds
  are read from it.
* ``varlen_plan`` — an ``&`` of rules (causal, a window) and partitions (documents,
  chunks, padding), each factor saying which it is (``Mask.varlen_part``): what a varlen
  kernel can run. Anything else refuses with a ValueError naming it.

The heads' masks come from each node too (``head_cycle``, ``at_head``). This module knows
the operators (``And``, ``Or``, ``Not``) and no piece: a new piece lowers through it
unchanged (docs/contributing.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from flexmask._validate import check_int
from flexmask.algebra import UNUSED, Mask, conjuncts, fold, leaves, pick
from flexmask.builders import make_spec

_BIG = UNUSED  # marks an empty slot of an interval list: lo = _BIG, hi = -_BIG


class Lines(NamedTuple):
    """Per batch row and per line (query, or key when transposed) the attended positions of
    the other side as sorted, disjoint, non-adjacent intervals ``[lo, hi]`` (inclusive), in
    the window's local indices. ``(R, N, K)`` int64 each, R = 1 when no row differs; empty
    slots (lo > hi) come after the real ones."""

    lo: Tensor
    hi: Tensor


class Window(NamedTuple):
    """The positions a lowering sees: queries ``q_offset + [0, q_len)`` and keys
    ``kv_offset + [0, kv_len)``, offsets one per row (``(R, 1)`` int64) or shared."""

    batch: int
    q_len: int
    kv_len: int
    q_offset: Tensor
    kv_offset: Tensor


def window(
    mask: Mask,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    q_offset: Any = 0,
    kv_offset: Any = 0,
) -> Window:
    """Checked arguments of a lowering, the mask validated against them once (rows, heads,
    tree sizes) by the spec every build makes (``builders.make_spec``): a lowering has rows
    and lengths (each at least 1) and no blocks; with H=None the mask is checked for any
    head count (a format lists its heads' masks apart)."""
    for value, name in ((B, "B"), (H, "H"), (Q_LEN, "Q_LEN"), (KV_LEN, "KV_LEN")):
        if value is not None:
            check_int(value, name, minimum=1)
    kv_len = Q_LEN if KV_LEN is None else KV_LEN
    spec = make_spec(
        mask, B, H, Q_LEN, kv_len, "cpu", 1, q_offset, kv_offset, sized=False, any_heads=True
    )
    return Window(
        spec.batch, spec.q_len, spec.kv_len, _column(spec.q_offset), _column(spec.kv_offset)
    )


def _column(offset: int | tuple[int, ...]) -> Tensor:
    """An offset as the lowerings read it: ``(R, 1)`` int64, R = 1 when shared."""
    return torch.tensor(offset if isinstance(offset, tuple) else (offset,)).view(-1, 1)


def validated_window(batch: int, q_len: int, kv_len: int) -> Window:
    """The window of a call whose mask was validated for these sizes already (a backend
    lowering the Mask of a checked call: the spec or the handle validated it, once)."""
    zero = torch.zeros(1, 1, dtype=torch.int64)
    return Window(batch, q_len, kv_len, zero, zero)


def head_masks(mask: Mask, heads: int) -> tuple[list[Mask], list[int]]:
    """The distinct masks of the heads and, per head, which one it uses (each node's
    ``at_head``: ``per_head`` nodes replaced by the mask of that head). A mask whose heads
    attend alike (``head_cycle`` 1) is one mask."""
    if mask.head_cycle == 1:
        return [mask], [0] * heads
    distinct: list[Mask] = []
    which = []
    for h in range(heads):
        m = mask.at_head(h)
        if m not in distinct:
            distinct.append(m)
        which.append(distinct.index(m))
    return distinct, which


def one_mask_for_all_heads(mask: Mask, fmt: str) -> Mask:
    """The mask every head uses, or a ValueError naming the node whose heads differ."""
    if mask.head_cycle == 1:
        return mask
    distinct, _ = head_masks(mask, mask.head_cycle)
    if len(distinct) == 1:
        return distinct[0]
    raise ValueError(
        f"{_first_by_head(mask)!r} cannot be lowered to {fmt}: its heads attend differently, "
        f"and {fmt} takes one mask for every head. Lower each head group separately, or use "
        f"flexmask.create_block_mask (flex_attention) or to_flashmask (per-head columns)"
    )


def _first_by_head(mask: Mask) -> Mask:
    """The first node, breadth-first through ``&``, ``|`` and ``~``, whose heads differ:
    the ``per_head`` an error names."""
    return next((node for node in leaves(mask) if node.head_cycle > 1), mask)


# ---------------------------------------------------------------------------- interval lists
def _normalize(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Sorted, disjoint, non-adjacent intervals (joined where they overlap or touch), empty
    slots last, as few slots as the fullest line needs (at least one)."""
    valid = lo <= hi
    if not bool(valid.all()):  # most lines of most masks attend: nothing to mark empty
        lo, hi = pick(valid, lo, _BIG), pick(valid, hi, -_BIG)
    # Most lists hold one or two intervals (a piece, an & of pieces, a tree's prompt and
    # own run): merged elementwise, as the general path below would, without its sort, cummax
    # and scatters along a last dimension of 1-2 (each several times an elementwise pass).
    if lo.shape[-1] == 1:
        return lo, hi
    if lo.shape[-1] == 2:
        return _normalize_two(lo[..., 0], hi[..., 0], lo[..., 1], hi[..., 1])
    # Lists already sorted, disjoint and non-adjacent with their empty slots last (a tree's
    # runs, a clip of such lists) need only their all-empty trailing slots cut.
    pairs_ok = valid[..., :-1] & (lo[..., 1:] > hi[..., :-1] + 1)
    if not bool((valid[..., 1:] & ~pairs_ok).any()):
        used = valid.reshape(-1, valid.shape[-1]).any(0).nonzero()
        slots = int(used.max()) + 1 if used.numel() else 1
        return lo[..., :slots], hi[..., :slots]
    lo, order = lo.sort(dim=-1, stable=True)
    hi = hi.gather(-1, order)
    valid = lo <= hi
    reach = hi.cummax(-1).values
    before = torch.cat([torch.full_like(reach[..., :1], -_BIG), reach[..., :-1]], -1)
    starts = valid & (lo > before + 1)
    group = (starts.cumsum(-1) - 1).clamp(min=0)
    slots = max(int(starts.sum(-1).max()) if starts.numel() else 0, 1)
    shape = (*lo.shape[:-1], slots)
    out_lo = torch.full(shape, _BIG, dtype=torch.int64)
    out_hi = torch.full(shape, -_BIG, dtype=torch.int64)
    keep = group < slots
    out_lo.scatter_reduce_(-1, group * keep, torch.where(keep, lo, _BIG), "amin")
    out_hi.scatter_reduce_(-1, group * keep, torch.where(keep, hi, -_BIG), "amax")
    return out_lo, out_hi


def _normalize_two(lo0: Tensor, hi0: Tensor, lo1: Tensor, hi1: Tensor) -> tuple[Tensor, Tensor]:
    """``_normalize`` of two intervals per line, ``[lo0, hi0]`` and ``[lo1, hi1]`` (broadcast
    on the rows), empty ones already at (_BIG, -_BIG)."""
    swap = lo1 < lo0  # the stable sort's order: by lo, the first slot first on a tie
    a_lo, b_lo = torch.minimum(lo0, lo1), torch.maximum(lo0, lo1)
    a_hi = pick(swap, hi1, hi0)
    b_hi = hi0 + hi1 - a_hi  # the other one (exact: int64 wraps and wraps back)
    # The second joins the first when it overlaps or touches it. An empty second (its lo is
    # _BIG) joins only a first reaching _BIG - 1, which no real end does; joined, it would
    # change nothing either (the first keeps its end, the second is dropped).
    join = b_lo <= a_hi + 1
    a_hi = torch.maximum(a_hi, pick(join, b_hi, -_BIG))
    second = ~join & (b_lo <= b_hi)
    if not bool(second.any()):
        return a_lo.unsqueeze(-1), a_hi.unsqueeze(-1)
    b_lo, b_hi = pick(second, b_lo, _BIG), pick(second, b_hi, -_BIG)
    return torch.stack([a_lo, b_lo], -1), torch.stack([a_hi, b_hi], -1)


def _broadcast(*tensors: Tensor) -> list[Tensor]:
    rows = max(t.shape[0] for t in tensors)
    return [t.expand(rows, *t.shape[1:]) for t in tensors]


def _intersect(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Both normalized: the positions in both."""
    if a[0].shape[-1] == 1:
        a, b = b, a
    if b[0].shape[-1] == 1:  # a list and one interval (a rule, a document): a clip per line
        return _clipped(a, b[0], b[1])
    a_lo, a_hi, b_lo, b_hi = _broadcast(*a, *b)
    lo = torch.maximum(a_lo.unsqueeze(-1), b_lo.unsqueeze(-2)).flatten(-2)
    hi = torch.minimum(a_hi.unsqueeze(-1), b_hi.unsqueeze(-2)).flatten(-2)
    return _normalize(lo, hi)


def _clipped(lists: tuple[Tensor, Tensor], first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    """A normalized list clipped to ``[first, last]`` per line (broadcast on the slots).

    Clipping keeps a sorted, disjoint, non-adjacent list so, and an empty slot at
    ``(_BIG, -_BIG)``; only a real slot the clip empties can leave an empty slot before a
    real one, or one not at ``(_BIG, -_BIG)``: where none is, the clipped list is the
    normalized one (which is unique), without ``_normalize``'s passes."""
    lo, hi = torch.maximum(lists[0], first), torch.minimum(lists[1], last)
    # A clip that is empty itself empties every real slot of its line, so this is the one
    # test; with none emptied, every line keeps its slots and the fullest its last one.
    if bool(((lo > hi) & (lists[0] <= lists[1])).any()):
        return _normalize(lo, hi)
    return lo, hi


def _union(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Both normalized: the positions in either."""
    if a[0].shape[-1] == b[0].shape[-1] == 1:  # a rule or a piece each: no list to cat
        return _normalize_two(a[0][..., 0], a[1][..., 0], b[0][..., 0], b[1][..., 0])
    a_lo, a_hi, b_lo, b_hi = _broadcast(*a, *b)
    return _normalize(torch.cat([a_lo, b_lo], -1), torch.cat([a_hi, b_hi], -1))


def _clip(lists: tuple[Tensor, Tensor], first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    lo, hi, first, last = _broadcast(*lists, first.unsqueeze(-1), last.unsqueeze(-1))
    return _normalize(torch.maximum(lo, first), torch.minimum(hi, last))


def _clip_normalized(
    lists: tuple[Tensor, Tensor], first: Tensor, last: Tensor
) -> tuple[Tensor, Tensor]:
    """``_clip`` of a normalized list to one ``[first, last]`` per row (``(R, 1)``)."""
    lo, hi, f, e = _broadcast(*lists, first.unsqueeze(-1), last.unsqueeze(-1))
    return _clipped((lo, hi), f, e)


def _complement(lists: tuple[Tensor, Tensor], first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    """The positions of ``[first, last]`` (per row, ``(R, 1)``) in none of the intervals."""
    lo, hi = _clip(lists, first, last)
    lo, hi, f, e = _broadcast(lo, hi, first.unsqueeze(-1), last.unsqueeze(-1))
    empty = lo > hi
    # Empty slots become one position past the window, so the gaps around them are empty too.
    lo = torch.where(empty, e + 1, lo)
    hi = torch.where(empty, e + 1, hi)
    gap_lo = torch.cat([f.expand_as(lo[..., :1]), hi + 1], -1)
    gap_hi = torch.cat([lo - 1, e.expand_as(lo[..., :1])], -1)
    return _clip((gap_lo, gap_hi), first, last)


def lines(mask: Mask, win: Window, *, transpose: bool = False, fmt: str = "this format") -> Lines:
    """Each query's attended keys (each key's attending queries with ``transpose``), local.

    The mask must be the same on every head (see ``head_masks``). Each leaf answers with
    its own intervals (``Mask.lines_at``); ``&``, ``|`` and ``~`` intersect, join and
    complement them. Raises ValueError, naming the leaf and ``fmt``, for a leaf that cannot
    say (``from_mask_mod``).
    """
    if transpose:
        pos = win.kv_offset + torch.arange(win.kv_len).view(1, -1)
        first, length = win.q_offset, win.q_len
    else:
        pos = win.q_offset + torch.arange(win.q_len).view(1, -1)
        first, length = win.kv_offset, win.kv_len
    last = first + length - 1
    lo, hi = _lines(mask, pos, first, last, transpose, fmt)
    # _lines' lists are normalized (sorted, empty slots last at (_BIG, -_BIG)): the clip
    # changes nothing when none sticks out of the window (a tree's, a document's).
    if bool((lo[..., 0] < first).any() | (hi > last.unsqueeze(-1)).any()):
        lo, hi = _clip_normalized((lo, hi), first, last)
    lo, hi, first = _broadcast(lo, hi, first.unsqueeze(-1))
    if not bool(first.any()):  # local indices are the absolute ones
        return Lines(lo, hi)
    empty = lo > hi
    return Lines(pick(~empty, lo - first, _BIG), pick(~empty, hi - first, -_BIG))


def _lines(
    mask: Mask, pos: Tensor, first: Tensor, last: Tensor, transpose: bool, fmt: str
) -> tuple[Tensor, Tensor]:
    def leaf(node: Mask) -> tuple[Tensor, Tensor]:
        if node.head_cycle > 1:  # per_head: its heads' one mask, if they agree
            return _lines(one_mask_for_all_heads(node, fmt), pos, first, last, transpose, fmt)
        answer = node.lines_at(pos, transpose=transpose, fmt=fmt)
        if answer.normalized:
            return answer.lo, answer.hi
        return _normalize(answer.lo, answer.hi)

    return fold(mask, leaf, _intersect, _union, lambda lines: _complement(lines, first, last))


# ---------------------------------------------------------------------------- varlen
class VarlenPlan(NamedTuple):
    """A mask as a varlen kernel runs it: segments and one rule for all of them."""

    segment_ids: list[Tensor]
    """Per row (one, or one per batch row): the segment of each absolute position
    ``0..length`` as int64, -1 outside every segment; equal ids are one contiguous run."""
    causal: bool
    window: int | None
    """The sliding window size (|q - kv| < window), None for no window."""
    rule_piece: Mask | None
    """The piece that sets the alignment-sensitive rule (causal, else the window), for errors."""


def varlen_plan(mask: Mask, length: int) -> VarlenPlan:
    """The segments and the rule of an ``&`` of factors each a varlen kernel takes: a rule
    (causal, a sliding window), a partition (documents, chunks, padding), nothing or no
    constraint (each factor's ``varlen_part``); a per_head whose heads agree counts as its
    mask. A ValueError naming the first other factor."""
    mask = one_mask_for_all_heads(mask, "varlen")
    factors = conjuncts(mask)
    causal = False
    windows: list[Tensor] = []
    window_piece: Mask | None = None
    causal_piece: Mask | None = None
    ids: list[Tensor] | None = None
    nothing = False
    for leaf in factors:
        part = leaf.varlen_part(length)
        nothing |= part.attends_nowhere
        if part.causal:
            causal, causal_piece = True, leaf
        if part.window is not None:
            windows.append(part.window)
            window_piece = leaf
        if part.segment_ids is not None:
            ids = _combine_ids(ids, part.segment_ids)
    size = _window_size(windows, window_piece)
    if size == 0:
        nothing = True
        size = None
    if ids is None:
        ids = [torch.zeros(length + 1, dtype=torch.int64)]
        ids[0][length] = -1
    if nothing:
        ids = [torch.full_like(i, -1) for i in ids]
    piece = causal_piece if causal else window_piece
    return VarlenPlan(ids, causal, size, piece)


class Sequences(NamedTuple):
    """The sequences of a mask a varlen kernel runs with no window (``sequences``)."""

    causal: bool
    ids: Tensor
    """``(R, L)`` each position's sequence (equal ids one contiguous run), -1 in none."""
    row: Tensor
    """Each sequence's row, in row-major order (as ``first`` and ``last``)."""
    first: Tensor
    """Its first position."""
    last: Tensor
    """Its last position (inclusive)."""


def sequences(mask: Mask, win: Window) -> Sequences | None:
    """The sequences of ``mask`` on a square window at position 0, where it is an ``&`` of
    causal and partitions (documents, chunks, padding) with no sliding window
    (``varlen_plan``): Magi's slices and FlashMask's columns are then read off their runs of
    ids, a few passes over the positions, not off every line. None for any other mask or
    window."""
    if win.q_len != win.kv_len or bool(win.q_offset.any()) or bool(win.kv_offset.any()):
        return None
    try:
        plan = varlen_plan(mask, win.q_len)
    except ValueError:
        return None
    if plan.window is not None:
        return None
    ids = torch.stack([i[: win.q_len] for i in plan.segment_ids])
    edge = torch.full_like(ids[:, :1], -1)
    begins = (ids != torch.cat([edge, ids[:, :-1]], 1)) & (ids >= 0)
    ends = (ids != torch.cat([ids[:, 1:], edge], 1)) & (ids >= 0)
    row, first = begins.nonzero().unbind(1)
    last = ends.nonzero()[:, 1]  # row-major both: the i-th run's end is the i-th end
    return Sequences(plan.causal, ids, row, first, last)


def _window_size(windows: list[Tensor], window_piece: Mask | None) -> int | None:
    """The one window every row and window factor agrees on (their least), None for none;
    a ValueError where it differs between rows (a varlen call takes one)."""
    if not windows:
        return None
    values = torch.cat([w.view(-1) for w in windows])
    if len(windows) == 1 and values.numel() == 1:
        return int(values[0])
    per_row = torch.stack(
        [w.view(-1).expand(max(v.numel() for v in windows)) for w in windows]
    ).amin(0)
    if not bool((per_row == per_row[0]).all()):
        raise ValueError(
            f"{window_piece!r} cannot be lowered to varlen: its window differs between "
            f"rows ({per_row.tolist()}), and a varlen call takes one window_size for "
            f"every sequence (lower each row separately)"
        )
    return int(per_row[0])


def _combine_ids(ids: list[Tensor] | None, new: list[Tensor]) -> list[Tensor]:
    """Parts of two partitions intersected: positions share a part iff they share both.
    Part ids never decrease along a row, so equal pairs are contiguous runs."""
    if ids is None:
        return new
    rows = max(len(ids), len(new))
    out = []
    for r in range(rows):
        a, b = ids[min(r, len(ids) - 1)], new[min(r, len(new) - 1)]
        pair = torch.where((a >= 0) & (b >= 0), a * (int(b.max()) + 1) + b, -1)
        changed = torch.ones_like(pair, dtype=torch.bool)
        changed[1:] = pair[1:] != pair[:-1]
        run = changed.cumsum(0) - 1
        out.append(torch.where(pair >= 0, run, -1))
    return out
