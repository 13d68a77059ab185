"""The grouped block-sparse kernel behind ``block_sparse_attention`` (no ``score_mod``).

Profiled on the path it replaces (2 CPU cores, B=1, H=4, D=64, fp32, document-causal 2k):
a third of the time was matrix products over columns that a chunk's *union* of kv blocks
added but no q block listed, a third was elementwise passes over the scores (block masks
built per element, ``where``, ``amax``, ``masked_fill``, ``softmax``) and the rest the second
forward of activation checkpointing. So this kernel

* **groups q blocks by how many kv blocks they list**, not by position: every q block of a
  group gathers exactly its own kv blocks (a copy of ``W x KV_BLOCK x D`` per q block, 1/128
  of its products), and the group is one batched matmul over (batch, kv head, q block) with
  the G query heads of a kv head stacked as rows. No product is spent on an unlisted block.
* **masks once, with one pass**: a group whose blocks are all full and inside ``KV_LEN`` takes
  no mask at all; otherwise one bool mask per run of columns that need one (full blocks,
  ``mask_mod`` on partial ones, the ``KV_LEN`` edge) is built at the mask's own batch/head
  size and applied by one ``masked_fill_``: full blocks between them take none. Softmax is
  torch's fused one, in place, after one ``max`` that also gives the lse; rows with no key
  (rare) take one more pass: their ``lse`` is ``-inf``, output 0.
* **reads and writes views where it can**: a group of one q block whose kv blocks are one
  run (most groups of document, window and causal masks) multiplies views of the inputs,
  writes its output and dQ with ``bmm(out=)`` and adds dK, dV with ``baddbmm_`` into their
  rows: no gather, scatter or ``index_add_``. Other groups gather.
* **has its own backward** (the FlashAttention equations): it keeps the output and the
  log-sum-exp, and per group either the probabilities (while they fit ``memory_budget``) or
  nothing, rebuilding them from ``lse`` in one matmul and one ``exp`` — not a whole second
  forward. Gradients of ``lse`` are supported too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flexmask.backends.threads import run_groups
from flexmask.blocks import EMPTY, FULL, PARTIAL


class Group(NamedTuple):
    """q blocks that list the same number of kv blocks, and those kv blocks per q block, for a
    run of (batch row, kv head) pairs."""

    blocks: Tensor  # (n,) q block indices, long
    columns: Tensor  # (n, W) kv block indices per q block, ascending, long
    kinds: Tensor  # (Bm, Hkv | 1, G | 1, n, W) int8 block kinds at those positions
    # Runs [first, stop) of the positions among the W columns that need a mask (a partial
    # block, one absent for some batch/head, or the ragged last block); empty when none does.
    # Apart, not one span: a document's or window's row needs its first and last block
    # masked, and the full blocks between them no mask at all.
    mask_spans: tuple[tuple[int, int], ...]
    # The pairs [first, stop) of (batch row, kv head), numbered b * Hkv + h, this group runs.
    pairs: tuple[int, int]
    # (q block, first kv block) when the group is one q block whose columns are one run:
    # its rows and columns are then views of the inputs, read and written with no gather.
    single: tuple[int, int] | None = None


class Layout(NamedTuple):
    """Sizes the kernel needs (a subset of block_sparse's plan)."""

    batch: int
    kv_heads: int
    group: int
    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    scale: float
    working_dtype: torch.dtype


MaskFn = Callable[[Group], Tensor]
"""Evaluates mask_mod for a group: bool broadcastable to (p, G, n, Q_BLOCK, W, KV_BLOCK) for
its p pairs of (batch row, kv head)."""


class Bounds(NamedTuple):
    """The one kv interval ``[lo, hi]`` each query attends, for masks whose rows are intervals
    (causal, document, window, prefix, padding and their ``&``): ``(rows, NQ, Q_BLOCK)`` int64
    over the queries padded to whole blocks, ``rows`` 1 or B. With them a partial block's mask
    is two comparisons per element, with no call of mask_mod."""

    lo: Tensor
    hi: Tensor


MaskSource = MaskFn | Bounds
"""What decides the pairs of partial blocks: mask_mod (through a MaskFn) or intervals."""


def make_groups(kinds: Tensor, layout: Layout, max_elements: int) -> list[Group]:
    """Splits the q blocks into groups of equal listed width, each under ``max_elements``
    scores where one q block of one (batch row, kv head) pair allows.

    ``kinds`` is (Bm, Hkv | 1, G | 1, NQ, NKV). A q block's columns are the kv blocks listed
    for any batch row or head (usually the same for all); q blocks that list nothing are left
    out (their output is 0 and lse ``-inf``). A q block whose scores over every pair exceed
    the bound is split by pairs of (batch row, kv head) instead.
    """
    num_kv_blocks = kinds.size(-1)
    listed = (kinds != EMPTY).flatten(0, 2).any(dim=0)  # (NQ, NKV)
    widths = listed.sum(dim=-1)
    # Columns of each q block, left-aligned: a stable sort puts listed columns first, in order.
    order = torch.sort((~listed).to(torch.int8), dim=-1, stable=True).indices
    # Ragged tail of the last kv block, or a block listed only for some batch rows / heads,
    # needs a mask; so does any partial block.
    ragged = layout.kv_len % layout.kv_block != 0
    uniform = (kinds == kinds[:1, :1, :1]).flatten(0, 2).all(dim=0)  # (NQ, NKV)
    per_row = kinds.size(0) * kinds.size(1) * kinds.size(2)
    num_pairs = layout.batch * layout.kv_heads
    groups: list[Group] = []
    for width in torch.unique(widths).tolist():
        if width == 0:
            continue
        blocks = (widths == width).nonzero().flatten()
        per_pair = layout.group * layout.q_block * width * layout.kv_block  # one q block
        if num_pairs * per_pair <= max_elements:
            step, pair_step = max_elements // (num_pairs * per_pair), num_pairs
        else:
            step, pair_step = 1, max(1, max_elements // per_pair)
        for start in range(0, blocks.numel(), step):
            part = blocks[start : start + step]
            columns = order[part, :width]
            group_kinds = kinds[..., part[:, None], columns]
            needs_mask = (group_kinds == PARTIAL).flatten(0, 2).any(dim=0)  # (n, W)
            if per_row > 1:
                needs_mask |= ~uniform[part[:, None], columns]
            if ragged:
                needs_mask |= columns == num_kv_blocks - 1
            spans = _runs(needs_mask.any(dim=0).nonzero().flatten().tolist())
            single = None
            if part.numel() == 1 and int(columns[0, -1] - columns[0, 0]) == width - 1:
                single = (int(part[0]), int(columns[0, 0]))
            for first in range(0, num_pairs, pair_step):
                pairs = (first, min(num_pairs, first + pair_step))
                groups.append(Group(part, columns, group_kinds, spans, pairs, single))
    return groups


def _runs(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """Ascending positions as runs ``[first, stop)`` of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return tuple(runs)


def pair_indices(group: Group, layout: Layout, device: torch.device) -> tuple[Tensor, Tensor]:
    """The batch row and kv head of each of the group's pairs, (p,) each."""
    pair = torch.arange(*group.pairs, device=device)
    return pair // layout.kv_heads, pair % layout.kv_heads


def by_pair(tensor: Tensor, group: Group, layout: Layout) -> Tensor:
    """(Bm | 1, Hk | 1, ...) -> (p | 1, ...): the group's pairs of a tensor that may broadcast
    over batch rows or kv heads (one entry left where it broadcasts over both)."""
    if tensor.size(0) == 1 and tensor.size(1) == 1:
        return tensor[0]
    batch, head = pair_indices(group, layout, tensor.device)
    return tensor[batch if tensor.size(0) > 1 else 0, head if tensor.size(1) > 1 else 0]


def _pairs(tensor: Tensor, group: Group) -> Tensor:
    """(B, Hkv, ...) -> (p, ...): the group's pairs, a view (the kernel's tensors are
    contiguous, so batch rows and kv heads flatten into one dim)."""
    return tensor.flatten(0, 1)[group.pairs[0] : group.pairs[1]]


def _rows(tensor: Tensor, group: Group) -> Tensor:
    """The group's rows of ``tensor`` (B, Hkv, G, NQ, Q_BLOCK, X) as (p * n, G * Q_BLOCK, X):
    a view for a single q block (one query head per kv head), else a gather."""
    picked = _pairs(tensor, group)  # (p, G, NQ, Q_BLOCK, X)
    pairs, heads, _, q_block, width = picked.shape
    if group.single is not None:
        return picked[:, :, group.single[0]].reshape(pairs, heads * q_block, width)
    picked = picked.index_select(2, group.blocks)
    return picked.transpose(1, 2).reshape(pairs * group.blocks.numel(), heads * q_block, width)


def _put_rows(target: Tensor, group: Group, rows: Tensor) -> None:
    """Inverse of :func:`_rows`: writes the group's rows into ``target`` in place."""
    picked = _pairs(target, group)  # (p, G, NQ, Q_BLOCK, X)
    pairs, heads, _, q_block, width = picked.shape
    if group.single is not None:
        picked[:, :, group.single[0]].copy_(rows.view(pairs, heads, q_block, width))
        return
    rows = rows.view(pairs, group.blocks.numel(), heads, q_block, width).transpose(1, 2)
    picked.index_copy_(2, group.blocks, rows)


def _put_product(target: Tensor, group: Group, left: Tensor, right: Tensor) -> None:
    """Writes ``left @ right`` (the group's rows) into ``target`` like :func:`_put_rows`; for a
    single q block straight into its rows (``bmm(out=)`` on a view, no copy), where the rows
    are one view (one query head per kv head) and no graph is recorded (a double backward)."""
    picked = _pairs(target, group)  # (p, G, NQ, Q_BLOCK, X)
    pairs, heads, num_q_blocks, q_block, width = picked.shape
    if group.single is None or (heads > 1 and num_q_blocks > 1) or torch.is_grad_enabled():
        _put_rows(target, group, torch.bmm(left, right))
        return
    rows = picked[:, :, group.single[0]].view(pairs, heads * q_block, width)
    torch.bmm(left, right, out=rows)


def _columns(tensor: Tensor, group: Group) -> Tensor:
    """The group's kv blocks of ``tensor`` (B, Hkv, NKV, KV_BLOCK, X) as (p * n, W * KV_BLOCK,
    X): a view for a single q block's run of columns, else a gather."""
    picked = _pairs(tensor, group)  # (p, NKV, KV_BLOCK, X)
    pairs, _, kv_block, width = picked.shape
    n, count = group.columns.shape
    if group.single is not None:
        first = group.single[1]
        return picked[:, first : first + count].reshape(pairs, count * kv_block, width)
    picked = picked.index_select(1, group.columns.flatten())
    return picked.view(pairs * n, count * kv_block, width)


def _add_product(target: Tensor, group: Group, left: Tensor, right: Tensor) -> None:
    """Adds ``left @ right`` (the group's column gradients, (p * n, W * KV_BLOCK, X)) into
    ``target`` (B, Hkv, NKV, KV_BLOCK, X): for a single q block's run of columns by
    ``baddbmm_`` on their view (accumulated by the product itself, no second pass), where no
    graph is recorded; else the product added by ``index_add_``."""
    picked = _pairs(target, group)  # (p, NKV, KV_BLOCK, X)
    pairs, _, kv_block, width = picked.shape
    n, count = group.columns.shape
    if group.single is not None:
        first = group.single[1]
        columns = picked[:, first : first + count]
        if torch.is_grad_enabled():
            columns.add_(torch.bmm(left, right).view(pairs, count, kv_block, width))
        else:
            columns.view(pairs, count * kv_block, width).baddbmm_(left, right)
        return
    grads = torch.bmm(left, right).view(pairs, n * count, kv_block, width)
    picked.index_add_(1, group.columns.flatten(), grads)


def _softmax_(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Probabilities (written over ``scores``) and the log-sum-exp of each row.

    One ``max`` and torch's fused softmax (each row read while it sits in cache) instead of
    five passes over the scores (max, subtract, exp, sum, divide): the lse comes from the
    probability at the row's maximum, ``exp(0) / sum``, so ``lse = max - log(p_max)``. A row
    with no allowed key (all ``-inf``) gets probabilities 0 and lse ``-inf``.
    """
    row_max, at_max = scores.max(dim=-1, keepdim=True)
    probs = torch._softmax(scores, -1, False, out=scores)
    lse = row_max - probs.gather(-1, at_max).log_()
    empty = row_max == -math.inf
    if bool(empty.any()):
        probs.masked_fill_(empty, 0.0)
        lse.masked_fill_(empty, -math.inf)
    return probs, lse


def _refused(group: Group, layout: Layout, source: MaskSource) -> list[Tensor]:
    """The group's bool masks of refused pairs, one per mask span, each broadcastable to the
    scores viewed as (p, n, G, Q_BLOCK, span * KV_BLOCK); built at the mask's own batch/head
    size. Absent blocks, ``mask_mod`` (or the intervals) on partial ones, and kv tokens past
    ``KV_LEN`` are refused."""
    return [_refused_span(group, first, stop, layout, source) for first, stop in group.mask_spans]


def _refused_span(
    group: Group, first: int, stop: int, layout: Layout, source: MaskSource
) -> Tensor:
    """:func:`_refused` over the columns [first, stop)."""
    span = group._replace(columns=group.columns[:, first:stop], kinds=group.kinds[..., first:stop])
    n, width = span.columns.shape
    kv_tokens = span.columns[:, :, None] * layout.kv_block + torch.arange(layout.kv_block)
    kv_tokens = kv_tokens.to(span.kinds.device).view(1, n, 1, 1, width, layout.kv_block)
    kinds = by_pair(span.kinds, span, layout)  # (p | 1, G | 1, n, w)
    kinds = kinds.transpose(1, 2)[:, :, :, None, :, None]  # (p | 1, n, G | 1, 1, w, 1)
    if isinstance(source, Bounds):
        # Every block kind as one interval per (query, column): full [0, KV_LEN), absent
        # empty, partial the query's own; then three passes over the elements in all.
        lo, hi = source.lo, source.hi  # (rows, NQ, Q_BLOCK)
        if lo.size(0) > 1:
            batch, _ = pair_indices(span, layout, lo.device)
            lo, hi = lo[batch], hi[batch]
        rows = lo.size(0)
        lo = lo.index_select(1, span.blocks).view(rows, n, 1, layout.q_block, 1, 1)
        hi = hi.index_select(1, span.blocks).view(rows, n, 1, layout.q_block, 1, 1)
        lo = torch.where(kinds == FULL, 0, torch.where(kinds == PARTIAL, lo, layout.kv_len))
        hi = torch.where(kinds == PARTIAL, hi, layout.kv_len - 1).clamp(max=layout.kv_len - 1)
        refused = (kv_tokens < lo) | (kv_tokens > hi)
    else:
        allowed = kinds == FULL
        if bool((span.kinds == PARTIAL).any()):
            by_mod = source(span)  # broadcastable to (p, G, n, Q_BLOCK, w, KV_BLOCK)
            by_mod = by_mod.reshape((1,) * (6 - by_mod.dim()) + tuple(by_mod.shape))
            allowed = allowed | ((kinds == PARTIAL) & by_mod.transpose(1, 2))
        if bool((kv_tokens >= layout.kv_len).any()):
            allowed = allowed & (kv_tokens < layout.kv_len)
        refused = ~allowed
    refused = refused.expand(*refused.shape[:-1], layout.kv_block)  # a block-level mask
    return refused.flatten(-2)  # (p | 1, n, G | 1, Q_BLOCK | 1, w * KV_BLOCK)


def _masked_scores(
    queries: Tensor, keys: Tensor, refused: list[Tensor], group: Group, layout: Layout
) -> Tensor:
    """Scores of a group, (p * n, G * Q_BLOCK, W * KV_BLOCK), refused pairs at -inf."""
    scores = torch.bmm(queries, keys.transpose(1, 2))
    n = group.blocks.numel()
    view = scores.view(-1, n, layout.group, layout.q_block, scores.size(-1))
    for (first, stop), mask in zip(group.mask_spans, refused, strict=True):
        view[..., first * layout.kv_block : stop * layout.kv_block].masked_fill_(mask, -math.inf)
    return scores


def forward(
    q_blocks: Tensor,
    k_blocks: Tensor,
    v_blocks: Tensor,
    groups: list[Group],
    layout: Layout,
    mask_fn: MaskSource,
    save_budget: int,
    workers: int = 1,
) -> tuple[Tensor, Tensor, list[Tensor | None], list[list[Tensor] | None]]:
    """Output and lse in the blocked layouts, with the probabilities and masks kept per group
    while they fit ``save_budget`` bytes (None where they will be rebuilt).

    ``q_blocks`` is (B, Hkv, G, NQ, Q_BLOCK, D), already multiplied by the scale; ``k_blocks``
    and ``v_blocks`` are (B, Hkv, NKV, KV_BLOCK, D | Dv); all in the working dtype. The groups
    are shared among ``workers`` threads (see :func:`run_groups`).
    """
    # Contiguous, so the (batch row, kv head) pairs of each tensor are one dim of a view.
    q_blocks, k_blocks, v_blocks = (t.contiguous() for t in (q_blocks, k_blocks, v_blocks))
    batch, kv_heads, group, num_q_blocks, q_block, _ = q_blocks.shape
    out = q_blocks.new_zeros(batch, kv_heads, group, num_q_blocks, q_block, v_blocks.size(-1))
    lse = q_blocks.new_full((batch, kv_heads, group, num_q_blocks, q_block, 1), -math.inf)
    saved_probs: list[Tensor | None] = [None] * len(groups)
    saved_masks: list[list[Tensor] | None] = [None] * len(groups)
    # Which groups keep their probabilities is decided up front, in group order, so it does
    # not depend on which thread finishes first; masks of the others share what is left.
    element_size = q_blocks.element_size()
    keep_probs = []
    for g in groups:
        size = scores_numel(g, layout) * element_size
        keep_probs.append(size <= save_budget)
        save_budget -= size if keep_probs[-1] else 0
    mask_budget = _Budget(save_budget)

    def one(index: int) -> None:
        g = groups[index]
        queries = _rows(q_blocks, g)
        keys = _columns(k_blocks, g)
        values = _columns(v_blocks, g)
        refused = _refused(g, layout, mask_fn)
        probs, group_lse = _softmax_(_masked_scores(queries, keys, refused, g, layout))
        _put_product(out, g, probs, values)
        _put_rows(lse, g, group_lse)
        if keep_probs[index]:
            saved_probs[index] = probs
        elif refused and mask_budget.take(sum(mask.numel() for mask in refused)):
            saved_masks[index] = refused

    run_groups(one, [scores_numel(g, layout) for g in groups], workers, "forward")
    return out, lse, saved_probs, saved_masks


def backward(
    q_blocks: Tensor,
    k_blocks: Tensor,
    v_blocks: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    grad_lse: Tensor | None,
    groups: list[Group],
    layout: Layout,
    mask_fn: MaskSource,
    saved_probs: list[Tensor | None],
    saved_masks: list[list[Tensor] | None],
    workers: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the scaled query, key and value blocks (same layouts as the inputs).

    With P the probabilities and dO the output gradient: dV = Pᵀ dO, dP = dO Vᵀ,
    dS = P ⊙ (dP - rowsum(dO ⊙ O) + dlse), dQ = dS K, dK = dSᵀ Q.
    """
    q_blocks, k_blocks, v_blocks = (t.contiguous() for t in (q_blocks, k_blocks, v_blocks))
    grad_out = grad_out.contiguous()
    # rowsum(dO * O) is the softmax's correction term, once for every row.
    correction = (grad_out * out).sum(dim=-1, keepdim=True)
    if grad_lse is not None:
        correction = correction - grad_lse
    safe_lse = torch.where(lse == -math.inf, 0.0, lse)
    grad_q = torch.zeros_like(q_blocks, memory_format=torch.contiguous_format)
    # Each q block is in one group, so threads write disjoint rows of grad_q; kv blocks are
    # shared between groups, so each thread adds into its own grad_k and grad_v.
    grad_kv: dict[int, tuple[Tensor, Tensor]] = {}

    def one(index: int) -> None:
        g = groups[index]
        probs, refused = saved_probs[index], saved_masks[index]
        saved_probs[index] = saved_masks[index] = None  # freed as the backward goes
        worker = threading.get_ident()
        if worker not in grad_kv:
            grad_kv[worker] = (
                torch.zeros_like(k_blocks, memory_format=torch.contiguous_format),
                torch.zeros_like(v_blocks, memory_format=torch.contiguous_format),
            )
        grad_k, grad_v = grad_kv[worker]
        queries = _rows(q_blocks, g)
        keys = _columns(k_blocks, g)
        values = _columns(v_blocks, g)
        if probs is None:
            if refused is None:
                refused = _refused(g, layout, mask_fn)
            probs = _masked_scores(queries, keys, refused, g, layout)
            probs.sub_(_rows(safe_lse, g)).exp_()
        grad_rows = _rows(grad_out, g)
        _add_product(grad_v, g, probs.transpose(1, 2), grad_rows)
        grad_scores = torch.bmm(grad_rows, values.transpose(1, 2))
        grad_scores.sub_(_rows(correction, g)).mul_(probs)
        del probs
        _put_product(grad_q, g, grad_scores, keys)
        _add_product(grad_k, g, grad_scores.transpose(1, 2), queries)

    run_groups(one, [scores_numel(g, layout) for g in groups], workers, "backward")
    if not grad_kv:
        return grad_q, torch.zeros_like(k_blocks), torch.zeros_like(v_blocks)
    parts = list(grad_kv.values())
    grad_k, grad_v = parts[0]
    for other_k, other_v in parts[1:]:
        grad_k.add_(other_k)
        grad_v.add_(other_v)
    return grad_q, grad_k, grad_v


def scores_numel(group: Group, layout: Layout) -> int:
    n, width = group.columns.shape
    rows = (group.pairs[1] - group.pairs[0]) * n * layout.group * layout.q_block
    return rows * width * layout.kv_block


class _Budget:
    """Bytes left to keep, taken by several threads."""

    def __init__(self, left: int) -> None:
        self.left = left
        self.lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self.lock:
            if size > self.left:
                return False
            self.left -= size
            return True


class BlockSparseFunction(torch.autograd.Function):
    """Autograd wrapper: inputs and outputs in the blocked layouts of :func:`forward`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_blocks: Tensor,
        k_blocks: Tensor,
        v_blocks: Tensor,
        groups: list[Group],
        layout: Layout,
        mask_fn: MaskSource,
        save_budget: int,
        workers: int,
    ) -> tuple[Tensor, Tensor]:
        out, lse, probs, masks = forward(
            q_blocks, k_blocks, v_blocks, groups, layout, mask_fn, save_budget, workers
        )
        ctx.save_for_backward(q_blocks, k_blocks, v_blocks, out, lse)
        ctx.groups, ctx.layout, ctx.mask_fn = groups, layout, mask_fn
        ctx.workers = workers
        ctx.probs, ctx.masks = probs, masks
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: Tensor, grad_lse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q_blocks, k_blocks, v_blocks, out, lse = ctx.saved_tensors
        # Kept probabilities serve one backward; a second one (retain_graph) rebuilds them.
        probs = ctx.probs or [None] * len(ctx.groups)
        masks = ctx.masks or [None] * len(ctx.groups)
        ctx.probs = ctx.masks = None
        if grad_lse is not None and not bool(grad_lse.any()):
            grad_lse = None
        grads = backward(
            q_blocks,
            k_blocks,
            v_blocks,
            out,
            lse,
            grad_out,
            grad_lse,
            ctx.groups,
            ctx.layout,
            ctx.mask_fn,
            probs,
            masks,
            ctx.workers,
        )
        return (*grads, None, None, None, None, None)
