"""What the foreign formats read of a mask: the one module that looks inside the expression
tree (``And``/``Or``/``Not`` nodes and each piece's data).

Two views, both exact and neither evaluating the mask on every (query, key) pair:

* ``lines`` — for every batch row and every query (or, transposed, every key) of a window,
  the keys (queries) it attends as a short sorted list of disjoint intervals. Each piece
  gives its own intervals from its data; ``&``, ``|`` and ``~`` intersect, join and
  complement the lists. Magi's slices and FlashMask's column bounds are read from it.
* ``varlen_plan`` — an ``&`` of causal/window rules and of partitions (documents, chunks,
  padding): what a varlen kernel can run. Anything else is refused with a ValueError naming
  the piece.

The restructuring of the algebra into new modules is a one-file follow-up here: nothing else
in ``flexmask.formats`` imports the algebra's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flexmask._validate import check_int
from flexmask.algebra.mask import And, Extent, Mask, Not, Or
from flexmask.pieces import (
    Causal,
    Chunked,
    Document,
    Empty,
    FromMaskMod,
    Full,
    Padding,
    PerHead,
    Prefix,
    SlidingWindow,
    Spans,
    Tree,
)

INF = 1 << 61
"""Stands for an unbounded interval end; every real position and length is below it."""
_BIG = 1 << 62  # marks an empty slot of an interval list: lo = _BIG, hi = -_BIG


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
    """Checked arguments of a lowering, the mask validated against them (rows, heads, tree
    sizes), as the builder validates them."""
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (e.g. flexmask.causal() & flexmask.document(lens)), "
            f"got {type(mask).__name__}"
        )
    batch = (mask.rows or 1) if B is None else check_int(B, "B", minimum=1)
    heads = None if H is None else check_int(H, "H", minimum=1)
    q_len = check_int(Q_LEN, "Q_LEN", minimum=1)
    kv_len = q_len if KV_LEN is None else check_int(KV_LEN, "KV_LEN", minimum=1)
    q_off = _offsets(q_offset, "q_offset", batch)
    kv_off = _offsets(kv_offset, "kv_offset", batch)
    length = max(int(q_off.max()) + q_len, int(kv_off.max()) + kv_len)
    name = "max(q_offset + Q_LEN, kv_offset + KV_LEN)"
    mask.check(Extent(batch, heads, length, torch.device("cpu"), name))
    return Window(batch, q_len, kv_len, q_off, kv_off)


def _offsets(value: Any, name: str, batch: int) -> Tensor:
    if isinstance(value, Tensor) and value.dim() == 1 or isinstance(value, Sequence):
        items = value.tolist() if isinstance(value, Tensor) else list(value)
        if len(items) != batch:
            raise ValueError(
                f"{name} must be one int for every row or one per row (B={batch}), got "
                f"{len(items)} values"
            )
        values = [check_int(v, f"{name}[{i}]", minimum=0) for i, v in enumerate(items)]
        return torch.tensor(values, dtype=torch.int64).view(-1, 1)
    return torch.tensor([[check_int(value, name, minimum=0)]], dtype=torch.int64)


# ---------------------------------------------------------------------------- heads
def head_masks(mask: Mask, heads: int) -> tuple[list[Mask], list[int]]:
    """The distinct masks of the heads and, per head, which one it uses: ``per_head`` nodes
    replaced by the mask of that head. A mask without ``per_head`` is one mask."""
    if not _has_per_head(mask):
        return [mask], [0] * heads
    distinct: list[Mask] = []
    which = []
    for h in range(heads):
        m = _at_head(mask, h)
        if m not in distinct:
            distinct.append(m)
        which.append(distinct.index(m))
    return distinct, which


def _has_per_head(mask: Mask) -> bool:
    if isinstance(mask, PerHead):
        return True
    if isinstance(mask, And | Or):
        return any(_has_per_head(c) for c in mask.children)
    if isinstance(mask, Not):
        return _has_per_head(mask.child)
    return False


def _at_head(mask: Mask, h: int) -> Mask:
    if isinstance(mask, PerHead):
        return _at_head(mask.masks[(h // mask.group_size) % len(mask.masks)], h)
    if isinstance(mask, And):
        return And.of(*(_at_head(c, h) for c in mask.children))
    if isinstance(mask, Or):
        return Or.of(*(_at_head(c, h) for c in mask.children))
    if isinstance(mask, Not):
        return ~_at_head(mask.child, h)
    return mask


def one_mask_for_all_heads(mask: Mask, fmt: str) -> Mask:
    """The mask every head uses, or a ValueError naming the ``per_head`` that differs."""
    if not _has_per_head(mask):
        return mask
    cycle = _head_cycle(mask)
    distinct, _ = head_masks(mask, cycle)
    if len(distinct) == 1:
        return distinct[0]
    raise ValueError(
        f"{_first(mask, PerHead)!r} cannot be lowered to {fmt}: its heads attend differently, "
        f"and {fmt} takes one mask for every head. Lower each head group separately, or use "
        f"flexmask.create_block_mask (flex_attention) or to_flashmask (per-head columns)"
    )


def _head_cycle(mask: Mask) -> int:
    """Heads after which every ``per_head`` in the mask repeats."""
    import math

    cycle = 1
    stack = [mask]
    while stack:
        m = stack.pop()
        if isinstance(m, PerHead):
            cycle = math.lcm(cycle, m.cycle)
            stack.extend(m.masks)
        elif isinstance(m, And | Or):
            stack.extend(m.children)
        elif isinstance(m, Not):
            stack.append(m.child)
    return cycle


def _first(mask: Mask, kind: type) -> Mask:
    stack = [mask]
    while stack:
        m = stack.pop(0)
        if isinstance(m, kind):
            return m
        if isinstance(m, And | Or):
            stack.extend(m.children)
        elif isinstance(m, Not):
            stack.append(m.child)
        elif isinstance(m, PerHead):
            stack.extend(m.masks)
    return mask


# ---------------------------------------------------------------------------- interval lists
def _normalize(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Sorted, disjoint, non-adjacent intervals (joined where they overlap or touch), empty
    slots last, as few slots as the fullest line needs (at least one)."""
    valid = lo <= hi
    lo, hi = _pick(valid, lo, _BIG), _pick(valid, hi, -_BIG)
    # Most lists hold one or two intervals (a piece, an & of pieces, a tree's prompt and
    # own run): merged elementwise, as the general path below would, without its sort, cummax
    # and scatters along a last dimension of 1-2 (each several times an elementwise pass).
    if lo.shape[-1] == 1:
        return lo, hi
    if lo.shape[-1] == 2:
        return _normalize_two(lo, hi)
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


def _normalize_two(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """``_normalize`` of two intervals per line, empty ones already at (_BIG, -_BIG)."""
    lo0, lo1, hi0, hi1 = lo[..., 0], lo[..., 1], hi[..., 0], hi[..., 1]
    swap = lo1 < lo0  # the stable sort's order: by lo, the first slot first on a tie
    a_lo, b_lo = torch.minimum(lo0, lo1), torch.maximum(lo0, lo1)
    a_hi, b_hi = _pick(swap, hi1, hi0), _pick(swap, hi0, hi1)
    # The second joins the first when it overlaps or touches it (an empty second never does:
    # its lo is _BIG; an empty first means both are empty).
    join = (b_lo <= b_hi) & (b_lo <= a_hi + 1)
    a_hi = torch.maximum(a_hi, _pick(join, b_hi, -_BIG))
    apart = ~join
    b_lo, b_hi = _pick(apart, b_lo, _BIG), _pick(apart, b_hi, -_BIG)
    if not bool((b_lo <= b_hi).any()):
        return a_lo.unsqueeze(-1), a_hi.unsqueeze(-1)
    return torch.stack([a_lo, b_lo], -1), torch.stack([a_hi, b_hi], -1)


def _pick(keep: Tensor, x: Tensor, other: Tensor | int) -> Tensor:
    """``torch.where(keep, x, other)`` as int64 arithmetic, for values within +-_BIG (no
    difference overflows). Same result; torch.where's CPU kernel costs several adds (150
    against 22 us for an int64 add of 24k elements, torch 2.13, load 4.4 on 2 cores), and the
    lowerings pick per line at every query."""
    return ((x.to(torch.int64) - other) * keep).add_(other)


def _broadcast(*tensors: Tensor) -> list[Tensor]:
    rows = max(t.shape[0] for t in tensors)
    return [t.expand(rows, *t.shape[1:]) for t in tensors]


def _intersect(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    a_lo, a_hi, b_lo, b_hi = _broadcast(*a, *b)
    lo = torch.maximum(a_lo.unsqueeze(-1), b_lo.unsqueeze(-2)).flatten(-2)
    hi = torch.minimum(a_hi.unsqueeze(-1), b_hi.unsqueeze(-2)).flatten(-2)
    return _normalize(lo, hi)


def _union(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    a_lo, a_hi, b_lo, b_hi = _broadcast(*a, *b)
    return _normalize(torch.cat([a_lo, b_lo], -1), torch.cat([a_hi, b_hi], -1))


def _clip(lists: tuple[Tensor, Tensor], first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    lo, hi, first, last = _broadcast(*lists, first.unsqueeze(-1), last.unsqueeze(-1))
    return _normalize(torch.maximum(lo, first), torch.minimum(hi, last))


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


def lines(mask: Mask, win: Window, *, transpose: bool = False) -> Lines:
    """Each query's attended keys (each key's attending queries with ``transpose``), local.

    The mask must be the same on every head (see ``head_masks``). Raises ValueError for a
    ``from_mask_mod`` leaf (no structure to read).
    """
    if transpose:
        pos = win.kv_offset + torch.arange(win.kv_len).view(1, -1)
        first, length = win.q_offset, win.q_len
    else:
        pos = win.q_offset + torch.arange(win.q_len).view(1, -1)
        first, length = win.kv_offset, win.kv_len
    last = first + length - 1
    lo, hi = _lines(mask, pos, first, last, transpose)
    # _lines' lists are normalized (sorted, empty slots last at (_BIG, -_BIG)): the clip
    # changes nothing when none sticks out of the window (a tree's, a document's).
    if bool((lo[..., 0] < first).any() | (hi > last.unsqueeze(-1)).any()):
        lo, hi = _clip((lo, hi), first, last)
    lo, hi, first = _broadcast(lo, hi, first.unsqueeze(-1))
    if not bool(first.any()):  # local indices are the absolute ones
        return Lines(lo, hi)
    empty = lo > hi
    return Lines(_pick(~empty, lo - first, _BIG), _pick(~empty, hi - first, -_BIG))


def _lines(
    mask: Mask, pos: Tensor, first: Tensor, last: Tensor, transpose: bool
) -> tuple[Tensor, Tensor]:
    if isinstance(mask, And):
        parts = [_lines(c, pos, first, last, transpose) for c in mask.children]
        out = parts[0]
        for part in parts[1:]:
            out = _intersect(out, part)
        return out
    if isinstance(mask, Or):
        parts = [_lines(c, pos, first, last, transpose) for c in mask.children]
        out = parts[0]
        for part in parts[1:]:
            out = _union(out, part)
        return out
    if isinstance(mask, Not):
        return _complement(_lines(mask.child, pos, first, last, transpose), first, last)
    if isinstance(mask, PerHead):
        return _lines(one_mask_for_all_heads(mask, "this format"), pos, first, last, transpose)
    lo, hi = _piece(mask, pos, transpose)
    if isinstance(mask, Tree) and not transpose and bool(lo[..., -1].ne(_BIG).any()):
        return lo, hi  # already normalized: root first, its last slot used (_ancestor_runs)
    return _normalize(lo, hi)


def _row_values(piece: Any) -> Tensor:
    """(R, 1) values of a one-int-per-row piece, clamped far below int64's edge."""
    return piece.values.clamp(max=INF).view(-1, 1)


def _one(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    lo, hi = torch.broadcast_tensors(lo, hi)
    return lo.unsqueeze(-1), hi.unsqueeze(-1)


def _piece(piece: Mask, pos: Tensor, transpose: bool) -> tuple[Tensor, Tensor]:
    """(R, N, k) intervals of one piece at absolute line positions ``pos`` ((R, N))."""
    if isinstance(piece, Full):
        return _one(torch.full_like(pos, -INF), torch.full_like(pos, INF))
    if isinstance(piece, Empty):
        return _one(torch.full_like(pos, INF), torch.full_like(pos, -INF))
    if isinstance(piece, Causal):
        if transpose:  # key kv is attended by queries q >= kv
            return _one(pos, torch.full_like(pos, INF))
        return _one(torch.full_like(pos, -INF), pos)
    if isinstance(piece, Padding):
        size = _row_values(piece)
        inside = pos < size
        return _one(torch.where(inside, -INF, INF), torch.where(inside, size - 1, -INF))
    if isinstance(piece, SlidingWindow):
        size = _row_values(piece)
        some = size > 0
        return _one(torch.where(some, pos - size + 1, INF), torch.where(some, pos + size - 1, -INF))
    if isinstance(piece, Prefix):
        size = _row_values(piece)
        if transpose:
            inside = pos < size
            return _one(torch.where(inside, -INF, INF), torch.where(inside, INF, -INF))
        return _one(torch.full_like(pos, -INF), size - 1)
    if isinstance(piece, Chunked):
        size = _row_values(piece).clamp(min=1)
        start = pos.div(size, rounding_mode="floor") * size
        return _one(start, start + size - 1)
    if isinstance(piece, Document):
        starts, ends = _document_bounds(piece)
        return _one(*_runs_at(starts, ends, pos))
    if isinstance(piece, Spans):
        return _one(*_runs_at(piece._starts, piece._ends, pos))
    if isinstance(piece, Tree):
        return _tree(piece, pos, transpose)
    if isinstance(piece, FromMaskMod):
        raise ValueError(
            f"{piece!r} cannot be lowered to this format: a from_mask_mod leaf is a function "
            f"flexmask cannot read intervals from. Write the mask with flexmask's pieces, or "
            f"use flexmask.create_block_mask (flex_attention)"
        )
    raise ValueError(f"{piece!r} cannot be lowered to this format: unknown mask kind")


def _document_bounds(piece: Document) -> tuple[Tensor, Tensor]:
    """(R, D) document starts and exclusive ends, padded with empty documents at INF."""
    ends = [lens.cumsum(0).clamp(max=INF) for lens in piece.seq_lens]
    starts = [(e - lens).clamp(max=INF) for e, lens in zip(ends, piece.seq_lens, strict=True)]
    pad = torch.nn.utils.rnn.pad_sequence
    return (
        pad(starts, batch_first=True, padding_value=INF),
        pad(ends, batch_first=True, padding_value=INF),
    )


def _runs_at(starts: Tensor, ends: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """The run ``[start, end)`` (sorted, disjoint runs) holding each position, or empty."""
    starts, ends, pos = (t.to(torch.int64) for t in _broadcast(starts, ends, pos))
    k = torch.searchsorted(ends.contiguous(), pos.contiguous(), right=True)
    k = k.clamp(max=ends.shape[1] - 1)
    start, end = starts.gather(1, k), ends.gather(1, k)
    inside = (start <= pos) & (pos < end)
    return _pick(inside, start, INF), _pick(inside, end - 1, -INF)


def _tree(piece: Tree, pos: Tensor, transpose: bool) -> tuple[Tensor, Tensor]:
    rows = []
    for r in range(max(len(piece.parents), pos.shape[0])):
        parents = piece.parents[min(r, len(piece.parents) - 1)]
        tree_row = min(r, len(piece.parents) - 1)
        p = pos[min(r, pos.shape[0] - 1)]
        n = parents.numel()
        if transpose:
            inside = (p >= 0) & (p < n)
            at = p.clamp(0, n - 1)
            if not piece.preorder[tree_row]:
                raise ValueError(
                    f"{piece!r} cannot be lowered to this format in this token order: the "
                    f"queries attending a key are its subtree, which is one run of positions "
                    f"only when the tokens are laid out in preorder (as flexmask.pack_tree "
                    f"lays them out). Reorder the tokens, or use to_magi / create_block_mask"
                )
            end = piece.ends[tree_row][at]
            rows.append((torch.where(inside, p, INF), torch.where(inside, end - 1, -INF)))
            continue
        rows.append(_ancestor_runs(parents, p))
    if transpose:
        lo = torch.stack([r[0] for r in rows])
        hi = torch.stack([r[1] for r in rows])
        return lo.unsqueeze(-1), hi.unsqueeze(-1)
    if len(rows) == 1:
        return rows[0][0].unsqueeze(0), rows[0][1].unsqueeze(0)
    # Slot-major like each row's (see _ancestor_runs), viewed as (R, N, width).
    width = max(r[0].shape[-1] for r in rows)
    lo = torch.full((len(rows), width, pos.shape[-1]), _BIG, dtype=torch.int64)
    hi = torch.full((len(rows), width, pos.shape[-1]), -_BIG, dtype=torch.int64)
    for r, (row_lo, row_hi) in enumerate(rows):
        lo[r, : row_lo.shape[-1]] = row_lo.t()
        hi[r, : row_hi.shape[-1]] = row_hi.t()
    return lo.transpose(1, 2), hi.transpose(1, 2)


def _ancestor_runs(parents: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """(N, D) the ancestors of the nodes at positions ``pos`` (>= 0; itself included) as runs
    of consecutive positions, root first, (_BIG, -_BIG) after them and for positions past
    the tree.

    A run continues while a token's parent is the token before it (so runs are disjoint and
    non-adjacent, and root first is sorted: what _normalize keeps without sorting). Every node
    of a run has the same ancestors outside it, so the chains are followed once per run (a
    shared-prefix tree has a few runs per group), then read per line.
    """
    n = parents.numel()
    breaks = parents != torch.arange(-1, n - 1)
    breaks[0] = True
    start = breaks.nonzero().view(-1)
    runs = start.numel()
    # The run of each node, and a last, empty one for positions past the tree.
    run = torch.cat([breaks.cumsum(0) - 1, start.new_full((1,), runs)])
    up = parents[start].to(torch.int64)  # the last ancestor before each run, -1 at a root
    if runs <= _FEW_RUNS:
        table_lo, table_hi = _run_tables_listed(start, up, run, n)
    else:
        table_lo, table_hi = _run_tables(start, up, run, n)
    width = table_lo.shape[1]
    # Read per line slot-major ((width, N), then viewed as (N, width)): a lowering walks each
    # slot along the lines, and flat 1-d reads are the cheapest gathers here. A line's own
    # run ends at the line (the table holds the run's last node): every other slot ends
    # before it, so one minimum writes it.
    at = pos.clamp(max=n)
    flat = run.index_select(0, at) + (runs + 1) * torch.arange(width).view(-1, 1)
    lo = table_lo.t().reshape(-1).index_select(0, flat.view(-1)).view(width, -1)
    hi = table_hi.t().reshape(-1).index_select(0, flat.view(-1)).view(width, -1)
    return lo.t(), torch.minimum(hi, at).t()


_FEW_RUNS = 256
"""Trees of at most this many runs have their run tables built from Python lists: a few
list operations per run cost less than the ~60 torch calls of the vectorized build (one
shared-prefix group at 8k has 8 runs, a row of several groups 12-15)."""


def _run_tables(start: Tensor, up: Tensor, run: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Per run (and a last, empty one for positions past the tree): its ancestor runs root
    first, then itself up to its last node, as ``(runs + 1, width)`` lo and hi."""
    chain_lo, chain_hi = [], []
    depth = torch.zeros_like(start)
    node = up
    while bool((node >= 0).any()):  # nearest ancestor run first
        alive = node >= 0
        above = run[node.clamp(min=0)]
        chain_lo.append(torch.where(alive, start[above], _BIG))
        chain_hi.append(torch.where(alive, node, -_BIG))
        depth += alive
        node = torch.where(alive, up[above], -1)
    width = len(chain_lo) + 1
    end = torch.cat([start[1:], start.new_full((1,), n)]) - 1
    table_lo = torch.stack([*chain_lo, torch.full_like(start, _BIG)], -1)
    table_hi = torch.stack([*chain_hi, torch.full_like(start, -_BIG)], -1)
    slot = torch.arange(width)
    own = depth.view(-1, 1)
    index = torch.where(slot < own, own - 1 - slot, width - 1)
    table_lo = torch.where(slot == own, start.view(-1, 1), table_lo.gather(1, index))
    table_hi = torch.where(slot == own, end.view(-1, 1), table_hi.gather(1, index))
    return (
        torch.cat([table_lo, torch.full((1, width), _BIG)]),
        torch.cat([table_hi, torch.full((1, width), -_BIG)]),
    )


def _run_tables_listed(start: Tensor, up: Tensor, run: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``_run_tables`` from Python lists: a run's ancestors are those of the run holding its
    parent, then that run up to the parent (runs are numbered in position order, so that
    run's chain is already made)."""
    starts, ups = start.tolist(), up.tolist()
    ends = [s - 1 for s in starts[1:]] + [n - 1]
    holder = run.index_select(0, up.clamp(min=0)).tolist()
    chains: list[list[tuple[int, int]]] = []
    for parent, r in zip(ups, holder, strict=True):
        chains.append([] if parent < 0 else [*chains[r], (starts[r], parent)])
    width = max(len(c) for c in chains) + 1
    lo_rows, hi_rows = [], []
    for chain, first, last in zip(chains, starts, ends, strict=True):
        pad = width - 1 - len(chain)
        lo_rows.append([a for a, _ in chain] + [first] + [_BIG] * pad)
        hi_rows.append([b for _, b in chain] + [last] + [-_BIG] * pad)
    lo_rows.append([_BIG] * width)
    hi_rows.append([-_BIG] * width)
    return torch.tensor(lo_rows), torch.tensor(hi_rows)


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


_VARLEN_REFUSALS = {
    Tree: "a tree's queries attend their ancestors, which are not one block per document "
    "(use to_magi, or flexmask.create_block_mask)",
    Prefix: "a prefix is visible to queries outside its block, which a varlen kernel's "
    "one-block-per-sequence layout cannot express (use to_flashmask or to_magi)",
    Spans: "bidirectional spans inside causal text need two rules in one sequence "
    "(use to_flashmask or to_magi)",
    FromMaskMod: "a from_mask_mod leaf has no structure flexmask can read",
}


def varlen_plan(mask: Mask, length: int) -> VarlenPlan:
    """The segments and the rule of an ``&`` of causal, full, sliding_window, document,
    chunked and padding pieces (a ``per_head`` whose heads agree counts as its mask);
    a ValueError naming the first other piece."""
    mask = one_mask_for_all_heads(mask, "varlen")
    leaves = list(mask.children) if isinstance(mask, And) else [mask]
    causal = False
    windows: list[Tensor] = []
    window_piece: Mask | None = None
    causal_piece: Mask | None = None
    ids: list[Tensor] | None = None
    nothing = False
    for leaf in leaves:
        if isinstance(leaf, PerHead):
            leaf = one_mask_for_all_heads(leaf, "varlen")
        if isinstance(leaf, Full):
            continue
        if isinstance(leaf, Empty):
            nothing = True
        elif isinstance(leaf, Causal):
            causal, causal_piece = True, leaf
        elif isinstance(leaf, SlidingWindow):
            windows.append(leaf.values.clamp(max=INF))
            window_piece = leaf
        elif isinstance(leaf, Document | Chunked | Padding):
            ids = _combine_ids(ids, _partition_ids(leaf, length))
        elif isinstance(leaf, Or | Not | And):
            kind = "a union (|)" if isinstance(leaf, Or) else "a complement (~)"
            raise ValueError(
                f"{leaf!r} cannot be lowered to varlen: {kind} is not one causal or "
                f"bidirectional block per sequence; varlen takes an & of causal(), "
                f"sliding_window(), document(), chunked() and padding() (use to_magi or "
                f"to_flashmask for other masks)"
            )
        else:
            reason = next(
                (r for kind, r in _VARLEN_REFUSALS.items() if isinstance(leaf, kind)),
                "varlen takes an & of causal(), sliding_window(), document(), chunked() and "
                "padding()",
            )
            raise ValueError(f"{leaf!r} cannot be lowered to varlen: {reason}")
    size: int | None = None
    if windows:
        values = torch.cat([w.view(-1) for w in windows])
        if len(windows) > 1 or values.numel() > 1:
            per_row = torch.stack(
                [w.view(-1).expand(max(v.numel() for v in windows)) for w in windows]
            ).amin(0)
            if not bool((per_row == per_row[0]).all()):
                raise ValueError(
                    f"{window_piece!r} cannot be lowered to varlen: its window differs between "
                    f"rows ({per_row.tolist()}), and a varlen call takes one window_size for "
                    f"every sequence (lower each row separately)"
                )
            size = int(per_row[0])
        else:
            size = int(values[0])
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


def _partition_ids(piece: Mask, length: int) -> list[Tensor]:
    """Per row, the part of each absolute position ``0..length`` (-1 outside every part)."""
    pos = torch.arange(length + 1)
    if isinstance(piece, Document):
        starts, ends = _document_bounds(piece)
        out = []
        for r in range(starts.shape[0]):
            doc = torch.searchsorted(ends[r].contiguous(), pos, right=True)
            inside = doc < len(piece.seq_lens[r])
            out.append(torch.where(inside, doc, -1))
        return out
    size = _row_values(piece)  # Chunked or Padding
    if isinstance(piece, Chunked):
        return [pos.div(s, rounding_mode="floor") for s in size.view(-1)]
    return [torch.where(pos < s, 0, -1) for s in size.view(-1)]


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
