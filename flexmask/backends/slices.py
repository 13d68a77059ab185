"""The slices backend: torch's fused CPU flash kernel, once per MagiAttention slice.

A mask whose queries attend a few key intervals lowers exactly to MagiAttention's slices
(``flexmask.formats.to_magi``): a query range, a key range, and full or causal. Each slice is
one call of torch's CPU flash-attention kernel on *views* of q, k and v — no gather, no mask
tensor, and a causal slice skips its upper triangle inside the kernel — so documents, a
shared-prefix tree (an RL group: the prompt once, each response onto it) and prefix-LM masks
cost what their attended pairs cost at the fused kernel's speed. Slices that share queries
merge by their log-sum-exps (the online-softmax rule); the backward calls the kernel's own
backward once per slice with the merged output and log-sum-exp, which gives each slice its
exact share of the gradient (ring attention's rule).

A sliding window's body (Magi's bi-causal slice) and inverse-causal slices run in calls of
``BAND_ROWS`` queries, each onto just the keys they see, under one small additive band mask.

It refuses, so that the block-sparse path takes the call: many small slices (a tree of tiny
nodes, tiny documents: per-call overhead), ``score_mod``, a BlockMask without the Mask it was
built from, heads that differ, ``return_lse`` with gradients, and the block-sparse path's own
options.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.backends.flash import DTYPES  # noqa: F401 - the dtypes this backend takes
from flexmask.backends.flash import flash_ops as _flash_ops
from flexmask.backends.flash import shape_problem as _shape_problem
from flexmask.backends.request import Request, positive_scale
from flexmask.backends.threads import one_thread, others_busy
from flexmask.builders import built_from
from flexmask.formats import BICAUSAL, CAUSAL, FULL, INVCAUSAL, magi_of, validated_window
from flexmask.pieces import Full
from flexmask.runtime import on_cache_clear

NAME = "slices"
OPTIONS: tuple[str, ...] = ()

# A banded slice (a sliding window's body, inverse causal) runs in calls of this many
# queries, each onto the keys its queries see, with a (rows, keys) additive mask: the band's
# waste is (rows - 1) / (rows - 1 + width) of the scores, and smaller calls run the kernel
# less efficiently. Causal window 1024, H=4, D=64, fwd+bwd, one thread, load ~3: 8k 944 /
# 722 / 655 / 922 ms at 64 / 128 / 256 / 512 rows (block-sparse 1017 ms); 2k 188 / 177 /
# 129 ms at 64 / 128 / 256 (block-sparse 195 ms, SDPA with the dense mask 248 ms).
BAND_ROWS = 256

# A slice costs one kernel call forward and one backward (plus a merge where it shares its
# queries) whatever its size, so below some size per call the block-sparse path, whose cost
# follows its 128-token blocks, is the cheaper one. Causal documents of one size at 2k and
# 8k, D=64/H=4 and D=16/H=2, one thread, load ~4.7, slices' time over block-sparse's
# (fwd+bwd; no-grad fwd): 16-token documents 1.14-2.84x; 0.34-2.07x, 32: 0.25-1.22x;
# 0.26-1.08x, 64: 0.52-1.38x; 0.44-0.58x, 128: 0.61-0.91x; 0.33-0.57x.
MIN_ROWS_PER_CALL = 64

Call = tuple[int | None, int, int, int, int, bool, int | None]
"""``(row, q_start, q_end, k_start, k_end, causal, band)``: batch row ``row`` (None: every
row), queries ``[q_start, q_end)`` onto keys ``[k_start, k_end)``; top-left causal where
``causal``; where ``band`` is not None, query ``a`` of the call sees key ``b`` (both counted
from the call's first) only for ``a <= b``, and ``b <= a + band - 1`` where ``band > 0``
(an additive mask, one per shape, shared by the calls)."""


class Slices(NamedTuple):
    """Kernel calls of one mask, in local positions. Calls cover each (query, key) pair at
    most once."""

    calls: tuple[Call, ...]
    first: tuple[bool, ...]
    """Per call: no earlier call touches its queries, so its output is written, not merged
    (and its queries' gradient written, not added)."""
    first_keys: tuple[bool, ...]
    """Per call: no earlier call touches its keys, so their gradients are written, not added."""
    query_gaps: tuple[tuple[int | None, int, int], ...]
    """``(row, start, end)``: queries no first call writes (zeroed before the calls add)."""
    key_gaps: tuple[tuple[int | None, int, int], ...]
    """The same for keys and the first-keys calls."""
    rows_covered: int
    """Query rows summed over the slices (a query in two slices counts twice)."""

    def __len__(self) -> int:
        return len(self.calls)


def kernel_calls(magi: Any, q_len: int, kv_len: int, per_row: bool) -> list[Call]:
    """MagiAttention's slices as calls of torch's CPU kernel (every type of slice has one).

    ``to_magi`` lays batch rows end to end (row ``b``'s queries from ``b * q_len``, its keys
    from ``b * kv_len``); a call keeps the row and local positions. Magi's causal is
    bottom-right aligned, torch's CPU kernel's top-left: a causal slice with more keys than
    queries is a full slice onto its first keys plus a square causal one onto its last; one
    with fewer keys than queries leaves its first queries out (they see none of its keys).
    Inverse-causal and bi-causal slices (query ``i`` from key ``i + ks - qs``; bi-causal up
    to ``i + ke - qe``) run in calls of ``BAND_ROWS`` queries, each onto just the keys its
    queries see, under a band mask.
    """
    return _as_calls(_call_table(magi, q_len, kv_len, per_row))


def _call_table(magi: Any, q_len: int, kv_len: int, per_row: bool) -> Tensor:
    """``kernel_calls`` as an ``(N, 7)`` int64 table in the same order: row (-1: every row),
    queries, keys, causal (0 or 1), band (-1: none). Every slice's calls at once: a step lowers
    a mask per micro-batch, and a Python walk over a thousand slices costs more than the
    BlockMask build it stands in for."""
    kind = magi.attn_type_map.to(torch.int64).cpu()
    bad = (kind < FULL) | (kind > BICAUSAL)
    if bool(bad.any()):
        raise RuntimeError(
            f"to_magi returned slice type {int(kind[bad][0])}, not one of Magi's four"
        )
    qs, qe = magi.q_ranges.to(torch.int64).cpu().unbind(1)
    ks, ke = magi.k_ranges.to(torch.int64).cpu().unbind(1)
    row = qs.div(q_len, rounding_mode="floor") if per_row else torch.full_like(qs, -1)
    if per_row:
        qs, qe, ks, ke = qs - row * q_len, qe - row * q_len, ks - row * kv_len, ke - row * kv_len
    n, m = qe - qs, ke - ks
    causal = kind == CAUSAL
    if bool(((kind == FULL) | causal & (m <= n)).all()):  # documents, trees: a call a slice
        q_first = torch.where(causal, qe - m, qs)
        return torch.stack([row, q_first, qe, ks, ke, causal.long(), torch.full_like(qs, -1)], 1)
    bi = kind == BICAUSAL
    banded = bi | (kind == INVCAUSAL)
    split = (kind == CAUSAL) & (m > n)  # a full call onto the first keys, a causal one
    # Band width: bi-causal query i sees [i + ks - qs, i + ke - qe]; inverse causal from
    # i + ks - qs to the slice's last key (0: no upper edge), and queries past qs + m see no
    # key of the slice. A bi-causal slice no query sees a key of has no call.
    width = torch.where(bi, m - n + 1, 0)
    q_stop = torch.where(bi, qe, torch.minimum(qe, qs + m))
    bands = (q_stop - qs + BAND_ROWS - 1).div(BAND_ROWS, rounding_mode="floor").clamp(min=0)
    count = torch.where(banded, torch.where(bi & (width < 1), 0, bands), 1 + split.long())
    at = torch.repeat_interleave(torch.arange(count.numel()), count)
    j = torch.arange(at.numel()) - (count.cumsum(0) - count)[at]  # the call's place in its slice
    a, b, c, d, n, m, banded = qs[at], qe[at], ks[at], ke[at], n[at], m[at], banded[at]
    first_of_split, second_of_split = split[at] & (j == 0), split[at] & (j == 1)
    start = a + j * BAND_ROWS
    stop = torch.minimum(start + BAND_ROWS, q_stop[at])
    band_end = torch.where(bi[at], stop + d - b, d)
    causal = (kind[at] == CAUSAL) & ~first_of_split
    columns = [
        row[at],
        torch.where(banded, start, torch.where(causal & ~second_of_split, b - m, a)),
        torch.where(banded, stop, b),
        torch.where(banded, start + c - a, torch.where(second_of_split, d - n, c)),
        torch.where(banded, band_end, torch.where(first_of_split, d - n, d)),
        causal.long(),
        torch.where(banded, width[at], -1),
    ]
    return torch.stack(columns, 1)


def _as_calls(table: Tensor) -> list[Call]:
    # Column by column (zip, not a conversion per field of every call): a row of -1 and a
    # band of -1 are None.
    n = table.shape[0]
    row, qs, qe, ks, ke, _, band = table.unbind(1)
    rows: list[Any] = (
        [None] * n if bool((row < 0).all()) else [None if r < 0 else r for r in row.tolist()]
    )
    if bool((band >= 0).any()):
        bands: list[Any] = [None if w < 0 else w for w in band.tolist()]
    else:
        bands = [None] * n
    causal = (table[:, 5] != 0).tolist()
    columns = (rows, qs.tolist(), qe.tolist(), ks.tolist(), ke.tolist(), causal, bands)
    return list(zip(*columns, strict=True))


def can_take(request: Request) -> str | None:
    if not request.on_cpu:
        return f"it runs torch's CPU flash kernel, and this call is on {request.query.device.type}"
    if _flash_ops() is None:
        return (
            "this torch has no aten._scaled_dot_product_flash_attention_for_cpu and backward "
            "taking the arguments this backend passes"
        )
    if request.score_mod is not None:
        return "torch's flash kernel takes no score_mod"
    if request.return_lse and request.needs_grad:
        return "it returns the log-sum-exp only without gradients"
    shapes = _shape_problem(request)
    if shapes is not None:
        return shapes
    lowered = _lower(request)
    return lowered if isinstance(lowered, str) else too_many(lowered)


def lower(request: Request) -> Request:
    """The mask's kernel calls, handed to ``attend`` as the Request's ``lowered``."""
    lowered = _shape_problem(request) or _lower(request)
    if not isinstance(lowered, str):
        lowered = too_many(lowered) or lowered
    if isinstance(lowered, str):
        raise ValueError(f"backend 'slices' cannot run this call: {lowered}")
    return request._replace(lowered=lowered)


def kernel_name(request: Request) -> str:
    calls = len(request.lowered)
    if not calls:
        return "none: no query attends any key (the output is 0)"
    return (
        f"torch's CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu), "
        f"{calls} call{'s' if calls != 1 else ''}"
    )


def attend(request: Request) -> Tensor | tuple[Tensor, Tensor]:
    lowered: Slices = request.lowered
    # The kernel's preconditions, which torch's public entry points meet before calling it:
    # a unit stride on the last dimension (else wrong outputs), and a positive scale (a
    # masked score is -inf before scaling: 0 or a negative scale makes it NaN or +inf).
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in request.query_key_value)
    q, scale = positive_scale(q, request.scale)
    with _threads():
        out, lse = _SliceAttention.apply(q, k, v, lowered, scale)
    return (out, lse) if request.return_lse else out


def _lower(request: Request) -> Slices | str:
    mask = request.mask
    if mask is None and request.block_mask is None:
        mask = Full()
    elif mask is None:
        built = request.block_mask
        mask = built_from(built, blocks=True) if isinstance(built, BlockMask) else None
        if mask is None:
            return (
                "it lowers a flexmask Mask, and this call brings a BlockMask without one (torch's, "
                "derived from flexmask's, or edited in place)"
            )
    batch, q_len, kv_len = request.query.shape[0], request.query.shape[-2], request.key.shape[-2]
    return _lowered(mask, batch, q_len, kv_len)


@functools.lru_cache(maxsize=16)
def _lowered(mask: Mask, batch: int, q_len: int, kv_len: int) -> Slices | str:
    """The kernel calls, or why there are none: kept for the calls of one step (can_take,
    then lower; every layer of a model) — a Mask hashes by its content."""
    per_row = mask.rows is not None and mask.rows > 1
    try:
        # The Mask of a checked call: validated once (its spec or handle), not again here.
        magi = magi_of(mask, validated_window(batch if per_row else 1, q_len, kv_len))
    except ValueError as err:
        return str(err)
    table = _call_table(magi, q_len, kv_len, per_row)
    covered = int((magi.q_ranges[:, 1] - magi.q_ranges[:, 0]).sum()) if len(table) else 0
    # The order they run: by batch row, then first query (merging by log-sum-exp does not
    # depend on the order), then first key; stable, so calls of one slice keep theirs.
    row, qs, _, ks, _ = table[:, :5].unbind(1)
    table = table[torch.sort(((row + 1) * (q_len + 1) + qs) * (kv_len + 1) + ks, stable=True)[1]]
    row, qs, qe, ks, ke = table[:, :5].unbind(1)
    first = _first_touches(row, qs, qe, q_len)
    first_keys = _first_touches(row, ks, ke, kv_len)
    rows: list[int | None] = list(range(batch)) if per_row else [None]
    return Slices(
        tuple(_as_calls(table)),
        tuple(first.tolist()),
        tuple(first_keys.tolist()),
        _gaps_of(rows, q_len, row[first], qs[first], qe[first]),
        _gaps_of(rows, kv_len, row[first_keys], ks[first_keys], ke[first_keys]),
        covered,
    )


on_cache_clear(_lowered.cache_clear)


def _first_touch(spans: list[tuple[int | None, int, int]]) -> tuple[bool, ...]:
    """Per ``(row, start, end)`` in order: no earlier span of its row overlaps it."""
    row, start, end = _columns(spans)
    return tuple(_first_touches(row, start, end, int(end.max()) if end.numel() else 0).tolist())


def _first_touches(row: Tensor, start: Tensor, end: Tensor, length: int) -> Tensor:
    """``_first_touch`` of spans ``[start, end)`` below ``length``, row -1 for every row."""
    # Spans in order of their row, then start (every query span, and the key spans of
    # documents and windows): an earlier span overlaps iff it reaches past this start, so a
    # running reach answers (each row's positions shifted past the rows before it).
    later = (row[1:] > row[:-1]) | (row[1:] == row[:-1]) & (start[1:] >= start[:-1])
    if not bool(later.all() & (end > start).all()):
        spans = list(zip(row.tolist(), start.tolist(), end.tolist(), strict=True))
        return torch.tensor(_first_touch_any(spans), dtype=torch.bool).view(-1)
    base = (row + 1) * (length + 1)
    reach = (base + end).cummax(0).values
    return base + start >= torch.cat([reach.new_full((1,), -1), reach[:-1]])


def _columns(spans: list[tuple[int | None, int, int]]) -> tuple[Tensor, Tensor, Tensor]:
    table = torch.tensor([(-1 if r is None else r, a, b) for r, a, b in spans], dtype=torch.int64)
    row, start, end = table.view(-1, 3).unbind(1)
    return row, start, end


def _first_touch_any(spans: list[tuple[int | None, int, int]]) -> tuple[bool, ...]:
    """Per ``(row, start, end)`` in any order: no earlier span of its row overlaps it."""
    starts: dict[int | None, list[int]] = {}  # per row, the union of the spans so far:
    ends: dict[int | None, list[int]] = {}  # disjoint, sorted intervals
    first = []
    for row, start, end in spans:
        s, e = starts.setdefault(row, []), ends.setdefault(row, [])
        lo = bisect.bisect_right(e, start)  # the first interval ending after ``start``
        hi = bisect.bisect_left(s, end)  # past the last one starting before ``end``
        first.append(lo == hi)
        if lo < hi:
            start, end = min(start, s[lo]), max(end, e[hi - 1])
        s[lo:hi], e[lo:hi] = [start], [end]
    return tuple(first)


def _gaps(
    rows: list[int | None], length: int, written: list[tuple[int | None, int, int]]
) -> tuple[tuple[int | None, int, int], ...]:
    """Per row, the positions in ``[0, length)`` outside every written span (the spans of
    first calls, which do not overlap)."""
    return _gaps_of(rows, length, *_columns(written))


def _gaps_of(
    rows: list[int | None], length: int, row: Tensor, start: Tensor, end: Tensor
) -> tuple[tuple[int | None, int, int], ...]:
    """Per row, by position, the positions in ``[0, length)`` outside every span
    ``[start, end)`` of that row (the spans of first calls, which do not overlap; row -1:
    every row, ``None`` in ``rows``)."""
    order = torch.argsort((row + 1) * (length + 1) + start)
    row, start, end = row[order], start[order], end[order]
    opens = torch.ones_like(row, dtype=torch.bool)  # the first span of its row
    opens[1:] = row[1:] != row[:-1]
    closes = torch.ones_like(opens)  # the last
    closes[:-1] = opens[1:]
    before = torch.where(opens, 0, torch.cat([end.new_zeros(1), end[:-1]]))
    inner, tail = start > before, closes & (end < length)
    keys = [-1 if r is None else r for r in rows]
    bare = torch.tensor(sorted(set(keys) - set(row.tolist())), dtype=torch.int64)
    gap_row = torch.cat([row[inner], row[tail], bare])
    gap_lo = torch.cat([before[inner], end[tail], torch.zeros_like(bare)])
    gap_hi = torch.cat(
        [start[inner], torch.full_like(end[tail], length), bare.new_full(bare.shape, length)]
    )
    order = torch.argsort((gap_row + 1) * (length + 1) + gap_lo)
    return tuple(
        (None if r < 0 else r, lo, hi)
        for r, lo, hi in zip(
            gap_row[order].tolist(), gap_lo[order].tolist(), gap_hi[order].tolist(), strict=True
        )
    )


def too_many(lowered: Slices) -> str | None:
    """Why the block-sparse path is the cheaper one for these calls, or None."""
    if len(lowered) <= max(8, lowered.rows_covered // MIN_ROWS_PER_CALL):
        return None
    return (
        f"its {len(lowered)} kernel calls average {lowered.rows_covered // len(lowered)} "
        f"queries, fewer than {MIN_ROWS_PER_CALL}: the block-sparse path is cheaper"
    )


def _threads() -> contextlib.AbstractContextManager[None]:
    """One intra-op thread while other processes keep a core busy: the kernel calls and
    merges are many short ops, each of whose threads would wait for a descheduled one (the
    block-sparse path's reason for its workers); torch's threads otherwise."""
    return one_thread() if others_busy() else contextlib.nullcontext()


class _SliceAttention(torch.autograd.Function):
    """Forward: one flash call per slice, merged into the rows' output by log-sum-exp.
    Backward: the kernel's backward per slice, given the merged output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, lowered, scale):  # type: ignore[override]
        forward_op, _ = _flash_ops()  # type: ignore[misc]
        batch, heads, q_len, _ = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        calls = lowered.calls
        ctx.lowered, ctx.scale = lowered, scale
        if len(calls) == 1 and calls[0][:3] == (None, 0, q_len) and calls[0][6] is None:
            # One call for every query (causal, full): the kernel's own output, unmerged.
            _, _, _, ks, ke, causal, _ = calls[0]
            out, lse = forward_op(q, k[:, :, ks:ke], v[:, :, ks:ke], 0.0, causal, scale=scale)
            lse = lse.to(acc)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mark_non_differentiable(lse)
            return out, lse
        out = q.new_empty(batch, heads, q_len, v.shape[-1], dtype=acc)
        lse = q.new_empty(batch, heads, q_len, dtype=acc)
        for row, start, end in lowered.query_gaps:  # queries that see no key
            b = slice(None) if row is None else slice(row, row + 1)
            out[b, :, start:end] = 0
            lse[b, :, start:end] = float("-inf")
        for (row, qs, qe, ks, ke, causal, band), first in zip(calls, lowered.first, strict=True):
            b = slice(None) if row is None else slice(row, row + 1)
            o, part_lse = forward_op(
                q[b, :, qs:qe],
                k[b, :, ks:ke],
                v[b, :, ks:ke],
                0.0,
                causal,
                attn_mask=_band(band, qe - qs, ke - ks, q.dtype),
                scale=scale,
            )
            seen, rows = lse[b, :, qs:qe], out[b, :, qs:qe]
            if first:  # nothing to merge with yet
                rows.copy_(o)
                seen.copy_(part_lse)
                continue
            merged = torch.logaddexp(seen, part_lse)
            rows.mul_((seen - merged).exp_().unsqueeze(-1))
            rows.add_(o.to(acc) * (part_lse - merged).exp_().unsqueeze(-1))
            seen.copy_(merged)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):  # type: ignore[override]
        with _threads():
            return _SliceAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):  # type: ignore[no-untyped-def]
        _, backward_op = _flash_ops()  # type: ignore[misc]
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        lowered = ctx.lowered
        calls = lowered.calls
        if len(calls) == 1 and calls[0][:5] == (None, 0, q.shape[2], 0, k.shape[2]):
            # One call over every query and key (plain causal, full): its gradients as they are.
            causal, band = calls[0][5:]
            return (
                *backward_op(
                    grad_out,
                    q,
                    k,
                    v,
                    out,
                    lse,
                    0.0,
                    causal,
                    attn_mask=_band(band, q.shape[2], k.shape[2], q.dtype),
                    scale=ctx.scale,
                ),
                None,
                None,
            )
        # Written by the first call to touch them, added to by the rest; zero where none does.
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for grads, gaps in ((dq,), lowered.query_gaps), ((dk, dv), lowered.key_gaps):
            for row, start, end in gaps:
                b = slice(None) if row is None else slice(row, row + 1)
                for grad in grads:
                    grad[b, :, start:end] = 0
        for (row, qs, qe, ks, ke, causal, band), first, first_keys in zip(
            calls, lowered.first, lowered.first_keys, strict=True
        ):
            b = slice(None) if row is None else slice(row, row + 1)
            gq, gk, gv = backward_op(
                grad_out[b, :, qs:qe],
                q[b, :, qs:qe],
                k[b, :, ks:ke],
                v[b, :, ks:ke],
                out[b, :, qs:qe],
                lse[b, :, qs:qe],  # float32 (float64 for float64), as the kernel keeps it
                0.0,
                causal,
                attn_mask=_band(band, qe - qs, ke - ks, q.dtype),
                scale=ctx.scale,
            )
            _write_or_add(dq[b, :, qs:qe], gq, first)
            _write_or_add(dk[b, :, ks:ke], gk, first_keys)
            _write_or_add(dv[b, :, ks:ke], gv, first_keys)
        return dq, dk, dv, None, None


def _write_or_add(into: Tensor, part: Tensor, first: bool) -> None:
    if first:
        into.copy_(part)
    else:
        into.add_(part)


def _band(band: int | None, rows: int, keys: int, dtype: torch.dtype) -> Tensor | None:
    """A call's additive band mask. A bi-causal band's is the top-left ``(rows, keys)`` corner
    of one mask per band width and dtype (the band is the same relative to any call's first
    query and key), kept across calls and layers rather than rebuilt by each."""
    if band is None:
        return None
    if not band:
        # Inverse causal (no upper edge): as wide as its keys, which vary by call and may be
        # the whole sequence, so built for the call, not kept.
        return _band_mask.__wrapped__(0, rows, keys, dtype)
    # A bi-causal call of BAND_ROWS queries sees at most BAND_ROWS - 1 + band keys.
    height = max(rows, BAND_ROWS)
    return _band_mask(band, height, max(height - 1 + band, keys), dtype)[:rows, :keys]


@functools.lru_cache(maxsize=8)
def _band_mask(band: int, height: int, width: int, dtype: torch.dtype) -> Tensor:
    query = torch.arange(height).view(-1, 1)
    key = torch.arange(width).view(1, -1)
    seen = key >= query
    if band:
        seen &= key <= query + band - 1
    return torch.zeros(height, width, dtype=dtype).masked_fill_(~seen, float("-inf"))


on_cache_clear(_band_mask.cache_clear)


__all__ = [
    "DTYPES",
    "MIN_ROWS_PER_CALL",
    "NAME",
    "OPTIONS",
    "Slices",
    "attend",
    "can_take",
    "kernel_name",
    "lower",
]
