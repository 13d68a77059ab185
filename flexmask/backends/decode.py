"""The decode backend: a few queries against a long KV cache, on the CPU, in one kernel call.

A decode step (one query per row) or a speculative verify (a few dozen) reads the whole
cache once; what the call costs is the cache's bytes, so any per-call work beyond one pass
over the keys shows. This backend makes the dense mask of the step's BlockMask — full blocks
0, unlisted blocks ``-inf``, ``mask_mod`` evaluated on the partial blocks only (a decode row
has one or two) — as an additive ``(B | 1, H | 1, Q, keys)`` mask, and runs torch's fused CPU
flash kernel once, on the keys from the first listed block to the end of the last: a cache
written up to half its capacity is read up to half.

::

    one query row, block 128, capacity 512
    its blocks          FULL       FULL       PARTIAL              ⬚
    additive mask       0 ... 0    0 ... 0    mask_mod: 0 / -inf   (not read)
    keys read           [0 ......................................... 384)

It reads any BlockMask (decode_mask's, DecodeMasks' steps, handles, Masks through the cache,
torch's own) the way flex_attention does: each row's first ``count`` indices, a block listed
both partial and full as full, ``mask_mod`` called with the real batch and head indices. A
row that attends nothing gives 0 and a log-sum-exp of ``-inf``.

It refuses: more than ``MAX_QUERY_ROWS`` queries (the block-sparse and slices paths then
skip unlisted tiles for less), gradients (a decode step runs without them), ``score_mod``,
options, and tensors the kernel does not take.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.backends.flash import DTYPES, flash_ops
from flexmask.backends.flash import shape_problem as _shape_problem
from flexmask.backends.mod_eval import call_mod
from flexmask.backends.request import Request, dims_problem
from flexmask.backends.threads import one_thread, others_busy
from flexmask.blocks import EMPTY, FULL, PARTIAL, kv_codes
from flexmask.runtime import on_cache_clear

NAME = "decode"
OPTIONS: tuple[str, ...] = ()

# Queries per call this backend takes. Its one kernel call scores every key of the listed
# span for every query, where the block-sparse path skips the unlisted tiles inside it (a
# tree's other branches); with few queries the per-call work that path adds costs more than
# the scores skipped: up to this many it was the fastest for every mask measured, past it
# not for trees (``benchmarks/bench_decode.py --only rows``; docs/costs.md, "The thresholds
# in the code").
MAX_QUERY_ROWS = 64


def _flash_op() -> Any | None:
    """torch's CPU flash kernel's forward, or None where this torch lacks it."""
    ops = flash_ops()
    return None if ops is None else ops[0]


class AdditiveMask(NamedTuple):
    """A call's mask as the kernel takes it."""

    mask: Tensor | None
    """Additive ``(B | 1, H | 1, Q, stop - start)`` in the query's dtype (0 attended, -inf
    not); None where every query attends every key of the span."""
    start: int
    """First key of the span the kernel reads (the first listed block's)."""
    stop: int
    """One past the last key of the span; ``start == stop`` where no query attends any key."""


def can_take(request: Request) -> str | None:
    if not request.on_cpu:
        return f"it runs torch's CPU flash kernel, and this call is on {request.query.device.type}"
    if _flash_op() is None:
        return "this torch has no aten._scaled_dot_product_flash_attention_for_cpu"
    if request.score_mod is not None:
        return "it takes no score_mod"
    if request.needs_grad:
        return "it runs without gradients (a decode step); this call needs them"
    problem = _shape_problem(request)
    if problem is not None:
        return problem
    q_len = request.query.shape[-2]
    if q_len > MAX_QUERY_ROWS:
        return (
            f"it takes calls of up to {MAX_QUERY_ROWS} queries (a decode step, a speculative "
            f"verify), and this call has {q_len}"
        )
    if isinstance(request.block_mask, BlockMask):
        return _dims_problem(request.block_mask, request.query)
    return None


def lower(request: Request) -> Request:
    """The BlockMask built (None: every key) and read into the kernel's additive mask."""
    request = request.built()
    q, k = request.query, request.key
    block_mask = request.block_mask
    if block_mask is None:
        lowered = AdditiveMask(None, 0, k.size(2))
    else:
        assert isinstance(block_mask, BlockMask)  # built above
        problem = _dims_problem(block_mask, q)
        if problem is not None:
            raise ValueError(f"backend 'decode' cannot run this call: {problem}")
        with torch.no_grad():
            lowered = additive_mask(block_mask, q.size(0), q.size(1), q.dtype)
    return request._replace(lowered=lowered)


def attend(request: Request) -> Tensor | tuple[Tensor, Tensor]:
    """One call of torch's CPU flash kernel on the listed span of the cache."""
    lowered: AdditiveMask = request.lowered
    q = request.query
    batch, heads, q_len = q.shape[:3]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if lowered.start == lowered.stop:  # nothing attended: flex_attention's 0 and -inf
        out = q.new_zeros(batch, heads, q_len, request.value.size(-1))
        lse = q.new_full((batch, heads, q_len), float("-inf"), dtype=lse_dtype)
        return (out, lse) if request.return_lse else out
    span = slice(lowered.start, lowered.stop)
    # The kernel reads the last dimension as if its stride were 1 (torch's public entry
    # points make it so before calling it); only the span read is copied.
    q, k, v = (
        x if x.stride(-1) == 1 else x.contiguous()
        for x in (q, request.key[:, :, span], request.value[:, :, span])
    )
    op = _flash_op()
    assert op is not None  # can_take checked
    # One intra-op thread while other processes keep a core busy: the kernel's threads meet
    # at a barrier, and one descheduled thread stalls the call (a decode step a hundredfold).
    threads = one_thread() if others_busy() else contextlib.nullcontext()
    with torch.no_grad(), threads:
        out, lse = op(q, k, v, 0.0, False, attn_mask=lowered.mask, scale=request.scale)
        if not request.return_lse:
            return out
        lse = lse.to(lse_dtype)
        if lowered.mask is not None:
            # The kernel gives a row that attends nothing an output of 0 but an lse of 0.
            empty = (lowered.mask == 0).any(-1).logical_not_()
            lse = lse.masked_fill_(empty, float("-inf"))
    return out, lse


def kernel_name(request: Request) -> str:
    """What ``attend`` calls for this lowered request, in words."""
    lowered: AdditiveMask = request.lowered
    q_len, kv_len = request.query.shape[-2], request.key.shape[-2]
    if lowered.start == lowered.stop:
        return "none: no query attends any key (the output is 0)"
    if lowered.mask is None:
        what = "no mask"
    else:
        batch, heads = lowered.mask.shape[:2]
        what = f"a ({batch}, {heads}, {q_len}, {lowered.stop - lowered.start}) additive mask"
    return (
        f"torch's CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu), one "
        f"call with {what} from the BlockMask's blocks, on keys [{lowered.start}, "
        f"{lowered.stop}) of {kv_len}"
    )


def _dims_problem(block_mask: BlockMask, query: Tensor) -> str | None:
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    return dims_problem((mask_batch, mask_heads), query)


def additive_mask(
    block_mask: BlockMask, batch: int, heads: int, dtype: torch.dtype
) -> AdditiveMask:
    """The BlockMask's dense mask for its queries, as the kernel's additive mask over the keys
    of its listed blocks' span.

    ``batch`` and ``heads`` are the query's: ``mask_mod`` is called with those indices, as
    flex_attention calls it, and the mask keeps a dim of 1 where neither the BlockMask nor
    ``mask_mod`` depends on it. What the block lists say is read once per BlockMask and kept
    while its tensors are unchanged (``_readings``); ``mask_mod`` is called every time (what
    it reads, a decode step's cache lengths, changes in place between calls).
    """
    reading = _readings.get(block_mask, batch, heads, dtype)
    if reading.per_block is None:
        return AdditiveMask(None, 0, 0)  # no key attended
    q_len, kv_block = reading.q_len, reading.kv_block
    per_block = reading.per_block  # (Bm, Hm, Q | 1, W, 1)
    span = reading.stop - reading.start
    if reading.args is None:
        mask = per_block.expand(-1, -1, q_len, -1, kv_block).reshape(
            *per_block.shape[:2], q_len, -1
        )
        return AdditiveMask(mask[..., :span], reading.start, reading.stop)
    by_mask_mod = _call_mask_mod(block_mask.mask_mod, reading.args, reading.shape)
    assert reading.full is not None and reading.partial is not None and reading.at is not None
    attended = (  # (B | Bm | 1, H | Hm | 1, P, r, kv_block)
        by_mask_mod if reading.all_partial else reading.full | (reading.partial & by_mask_mod)
    )
    values = torch.where(attended, reading.zero, reading.minus_inf)
    dims = tuple(max(a, b) for a, b in zip(per_block.shape[:2], values.shape[:2], strict=True))
    width = per_block.size(3)
    mask = per_block.expand(*dims, q_len, width, kv_block).clone()
    rows, columns = reading.at
    mask[:, :, rows, columns, :] = values.expand(*dims, *values.shape[2:])
    return AdditiveMask(
        mask.view(*dims, q_len, width * kv_block)[..., :span], reading.start, reading.stop
    )


class _Reading(NamedTuple):
    """What a BlockMask's block lists say for one query shape: every part of the additive
    mask but ``mask_mod``'s values."""

    q_len: int
    kv_block: int
    start: int
    stop: int
    zero: Tensor
    minus_inf: Tensor
    per_block: Tensor | None = None
    """``(Bm, Hm, Q | 1, W, 1)``: 0 for the full blocks of the span, -inf for the others (a
    partial block's values are written over it); None where no block is listed."""
    args: tuple[Tensor, ...] | None = None
    """``mask_mod``'s (b, h, q_idx, kv_idx) for the P partial (q block, kv block) pairs,
    broadcasting to ``shape``; None where no block is partial."""
    shape: tuple[int, ...] = ()
    full: Tensor | None = None
    """``(Bm, Hm, P, 1, 1)`` bool: the pair is a full block of that batch row and head."""
    partial: Tensor | None = None
    """The same for partial: ``mask_mod`` decides (neither: unlisted there)."""
    all_partial: bool = False
    """Every pair partial for every batch row and head (a decode step's usual case)."""
    at: tuple[Tensor, Tensor] | None = None
    """Where the pairs' values go in the ``(.., Q, W, kv_block)`` mask: rows (P, r) and
    block columns (P, 1)."""


def _read(block_mask: BlockMask, batch: int, heads: int, dtype: torch.dtype) -> _Reading:
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = (int(size) for size in block_mask.BLOCK_SIZE)
    codes = kv_codes(block_mask)  # (Bm, Hm, NQ, NKV)
    device = codes.device
    zero = torch.zeros((), dtype=dtype, device=device)
    minus_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
    listed = (codes != EMPTY).flatten(0, 2).any(0).nonzero()
    if listed.numel() == 0:
        return _Reading(q_len, kv_block, 0, 0, zero, minus_inf)
    first, last = int(listed[0]), int(listed[-1])
    codes = codes[..., first : last + 1]
    start, stop = first * kv_block, min((last + 1) * kv_block, kv_len)
    if codes.size(2) > 1:  # each query row reads its own q block's codes
        rows = torch.arange(q_len, device=device).div_(q_block, rounding_mode="floor")
        row_codes = codes.index_select(2, rows)
    else:
        row_codes = codes
    per_block = torch.where(row_codes == FULL, zero, minus_inf).unsqueeze(-1)
    pairs = (codes == PARTIAL).flatten(0, 1).any(0).nonzero()  # (P, 2): q block, kv block
    if pairs.numel() == 0:
        return _Reading(q_len, kv_block, start, stop, zero, minus_inf, per_block)
    q_rows, kv_cols = pairs[:, 0], pairs[:, 1]
    count, rows_per_block = pairs.size(0), min(q_block, q_len)
    q_idx = q_rows[:, None] * q_block + torch.arange(rows_per_block, device=device)
    q_idx = q_idx.clamp_(max=q_len - 1)  # a last q block past Q_LEN: its last row again
    kv_idx = (kv_cols[:, None] + first) * kv_block + torch.arange(kv_block, device=device)
    args = (
        torch.arange(batch, device=device).view(-1, 1, 1, 1, 1),
        torch.arange(heads, device=device).view(1, -1, 1, 1, 1),
        q_idx.view(1, 1, count, rows_per_block, 1),
        kv_idx.clamp_(max=kv_len - 1).view(1, 1, count, 1, kv_block),  # past KV_LEN: cut off
    )
    picked = codes[:, :, q_rows, kv_cols][..., None, None]  # (Bm, Hm, P, 1, 1)
    return _Reading(
        q_len,
        kv_block,
        start,
        stop,
        zero,
        minus_inf,
        per_block,
        args=args,
        shape=(batch, heads, count, rows_per_block, kv_block),
        full=picked == FULL,
        partial=picked == PARTIAL,
        all_partial=bool((picked == PARTIAL).all()),
        at=(q_idx, kv_cols[:, None]),
    )


class _Entry(NamedTuple):
    owner: weakref.ReferenceType[BlockMask]
    tensors: tuple[weakref.ReferenceType[Tensor] | None, ...]
    state: tuple
    """Lengths, block sizes, and each read tensor's id and version."""
    reading: _Reading


class _Readings:
    """The last few BlockMasks' readings, each kept while that very BlockMask holds those very
    index tensors at the versions read (an in-place edit, DecodeMasks' append path, bumps
    them; weak references, so a freed BlockMask's reused id never matches). Inference tensors
    keep no version: theirs are read every call. Entries leave only through ``popitem``."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()

    def get(self, block_mask: BlockMask, batch: int, heads: int, dtype: torch.dtype) -> _Reading:
        fields = [getattr(block_mask, name) for name in _READ_FIELDS]
        if any(t is not None and t.is_inference() for t in fields):
            return _read(block_mask, batch, heads, dtype)
        key = (id(block_mask), batch, heads, dtype)
        state = (
            tuple(block_mask.seq_lengths),
            tuple(block_mask.BLOCK_SIZE),
            *((None, None) if t is None else (id(t), t._version) for t in fields),
        )
        entry = self._entries.get(key)
        if (
            entry is not None
            and entry.state == state
            and entry.owner() is block_mask
            and all(ref is None or ref() is t for ref, t in zip(entry.tensors, fields, strict=True))
        ):
            self._entries.move_to_end(key)
            return entry.reading
        reading = _read(block_mask, batch, heads, dtype)
        tensors = tuple(None if t is None else weakref.ref(t) for t in fields)
        self._entries[key] = _Entry(weakref.ref(block_mask), tensors, state, reading)
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return reading

    def clear(self) -> None:
        while self._entries:
            self._entries.popitem()


_READ_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
"""The tensors ``kv_codes`` reads."""

_readings = _Readings(maxsize=8)
"""One per process: the BlockMasks of a step (a model's layers share one, or alternate a few)."""
on_cache_clear(_readings.clear)


def _call_mask_mod(fn: Any, args: tuple[Tensor, ...], shape: tuple[int, ...]) -> Tensor:
    """``fn`` on broadcasting index tensors where it takes them (one call), else under vmap as
    flex_attention calls it."""
    try:
        result = fn(*args)
    except Exception:  # needs scalars: the vmap call below raises if the error is real
        result = None
    if (
        isinstance(result, Tensor)
        and result.dtype == torch.bool
        and result.dim() <= len(shape)
        and all(n in (1, m) for n, m in zip(reversed(result.shape), reversed(shape), strict=False))
    ):
        return result
    return call_mod(fn, args, shape, "vmap", "mask_mod")


__all__ = [
    "DTYPES",
    "MAX_QUERY_ROWS",
    "NAME",
    "OPTIONS",
    "AdditiveMask",
    "additive_mask",
    "attend",
    "can_take",
    "kernel_name",
    "lower",
]
