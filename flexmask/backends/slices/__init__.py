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

import contextlib
import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.backends.flash import DTYPES  # noqa: F401 - the dtypes this backend takes
from flexmask.backends.flash import flash_ops as _flash_ops
from flexmask.backends.flash import shape_problem as _shape_problem
from flexmask.backends.request import Request, positive_scale
from flexmask.backends.slices.calls import (  # noqa: F401 - the calls' parts, for their tests
    BAND_ROWS,
    Call,
    Slices,
    _first_touch,
    _first_touch_any,
    _first_touches,
    _gaps,
    kernel_calls,
    slices_of,
)
from flexmask.backends.threads import one_thread, others_busy
from flexmask.builders import built_from
from flexmask.formats import magi_of, validated_window
from flexmask.pieces import Full
from flexmask.runtime import on_cache_clear

NAME = "slices"
OPTIONS: tuple[str, ...] = ()

# A slice costs one kernel call forward and one backward (plus a merge where it shares its
# queries) whatever its size, so below some size per call the block-sparse path, whose cost
# follows its 128-token blocks, is the cheaper one: at 64 queries a call slices won most
# cases measured, at 128 all (docs/costs.md, "The thresholds in the code").
MIN_ROWS_PER_CALL = 64


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
    with _threads(lowered):
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
    return slices_of(magi, batch, q_len, kv_len, per_row)


on_cache_clear(_lowered.cache_clear)


def too_many(lowered: Slices) -> str | None:
    """Why the block-sparse path is the cheaper one for these calls, or None."""
    if len(lowered) <= max(8, lowered.rows_covered // MIN_ROWS_PER_CALL):
        return None
    return (
        f"its {len(lowered)} kernel calls average {lowered.rows_covered // len(lowered)} "
        f"queries, fewer than {MIN_ROWS_PER_CALL}: the block-sparse path is cheaper"
    )


def _threads(lowered: Slices) -> contextlib.AbstractContextManager[None]:
    """One intra-op thread while other processes keep a core busy, where there are several
    kernel calls: the calls and merges are many short ops, each of whose threads would wait
    for a descheduled one (the block-sparse path's reason for its workers). One call over
    every query (plain causal, full) is the very op SDPA's ``is_causal`` runs: it keeps
    torch's threads, as SDPA does, so it costs what SDPA costs on the same cores."""
    if len(lowered.calls) > 1 and others_busy():
        return one_thread()
    return contextlib.nullcontext()


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
        with _threads(ctx.lowered):
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
