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
  no mask at all; otherwise one bool mask (full blocks, ``mask_mod`` on partial ones, the
  ``KV_LEN`` edge) is built at the mask's own batch/head size and applied by one
  ``masked_fill_``. Softmax is written out in place (``amax``, ``sub_``, ``exp_``, ``sum``;
  the output is divided after the product, the probabilities only when kept), so rows with
  no key need no special pass: their ``lse`` is ``-inf`` and output 0.
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

from flexmask.backends.block_sparse.threads import run_groups
from flexmask.blocks.codes import EMPTY, FULL, PARTIAL


class Group(NamedTuple):
    """q blocks that list the same number of kv blocks, and those kv blocks per q block."""

    blocks: Tensor  # (n,) q block indices, long
    columns: Tensor  # (n, W) kv block indices per q block, ascending, long
    kinds: Tensor  # (Bm, Hkv | 1, G | 1, n, W) int8 block kinds at those positions
    # Positions [first, stop) among the W columns that need a mask (a partial block, one
    # absent for some batch/head, or the ragged last block); None when none does.
    mask_span: tuple[int, int] | None


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
"""Evaluates mask_mod for a group: bool broadcastable to (B, Hkv, G, n, Q_BLOCK, W, KV_BLOCK)."""


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
    """Splits the q blocks into groups of equal listed width, each under ``max_elements``.

    ``kinds`` is (Bm, Hkv | 1, G | 1, NQ, NKV). A q block's columns are the kv blocks listed
    for any batch row or head (usually the same for all); q blocks that list nothing are left
    out (their output is 0 and lse ``-inf``).
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
    rows_per_block = layout.batch * layout.kv_heads * layout.group * layout.q_block
    groups: list[Group] = []
    for width in torch.unique(widths).tolist():
        if width == 0:
            continue
        blocks = (widths == width).nonzero().flatten()
        per_block = rows_per_block * width * layout.kv_block
        step = max(1, max_elements // per_block)
        for start in range(0, blocks.numel(), step):
            part = blocks[start : start + step]
            columns = order[part, :width]
            group_kinds = kinds[..., part[:, None], columns]
            needs_mask = (group_kinds == PARTIAL).flatten(0, 2).any(dim=0)  # (n, W)
            if per_row > 1:
                needs_mask |= ~uniform[part[:, None], columns]
            if ragged:
                needs_mask |= columns == num_kv_blocks - 1
            positions = needs_mask.any(dim=0).nonzero().flatten().tolist()
            span = (positions[0], positions[-1] + 1) if positions else None
            groups.append(Group(part, columns, group_kinds, span))
    return groups


def _gather_rows(tensor: Tensor, blocks: Tensor, layout: Layout) -> Tensor:
    """(B, Hkv, G, NQ, Q_BLOCK, X) -> (B * Hkv * n, G * Q_BLOCK, X) for the group's q blocks."""
    picked = tensor.index_select(3, blocks)
    batch, kv_heads, group, n, q_block, width = picked.shape
    return picked.transpose(2, 3).reshape(batch * kv_heads * n, group * q_block, width)


def _gather_columns(tensor: Tensor, columns: Tensor) -> Tensor:
    """(B, Hkv, NKV, KV_BLOCK, X) -> (B * Hkv * n, W * KV_BLOCK, X) for each q block's columns."""
    batch, kv_heads, _, kv_block, width = tensor.shape
    n, w = columns.shape
    picked = tensor.index_select(2, columns.flatten())
    return picked.view(batch * kv_heads * n, w * kv_block, width)


def _scatter_rows(target: Tensor, blocks: Tensor, rows: Tensor, layout: Layout) -> None:
    """Inverse of :func:`_gather_rows`: writes the group's rows into ``target`` in place."""
    batch, kv_heads, group, _, q_block, width = target.shape
    n = blocks.numel()
    rows = rows.view(batch, kv_heads, n, group, q_block, width).transpose(2, 3)
    target.index_copy_(3, blocks, rows)


def _add_columns(target: Tensor, columns: Tensor, grads: Tensor) -> None:
    """Adds each q block's column gradients into ``target`` (B, Hkv, NKV, KV_BLOCK, X)."""
    batch, kv_heads, _, kv_block, width = target.shape
    grads = grads.view(batch, kv_heads, columns.numel(), kv_block, width)
    target.index_add_(2, columns.flatten(), grads)


def _refused(group: Group, layout: Layout, source: MaskSource) -> Tensor:
    """The group's bool mask of refused pairs over its mask span, broadcastable to the scores
    viewed as (B, Hkv, n, G, Q_BLOCK, span * KV_BLOCK); built at the mask's own batch/head
    size. Absent blocks, ``mask_mod`` (or the intervals) on partial ones, and kv tokens past
    ``KV_LEN`` are refused."""
    assert group.mask_span is not None
    first, stop = group.mask_span
    span = group._replace(columns=group.columns[:, first:stop], kinds=group.kinds[..., first:stop])
    n, width = span.columns.shape
    kv_tokens = span.columns[:, :, None] * layout.kv_block + torch.arange(layout.kv_block)
    kv_tokens = kv_tokens.to(span.kinds.device).view(1, 1, 1, n, 1, width, layout.kv_block)
    kinds = span.kinds[..., None, :, None]  # (Bm, Hk, Gm, n, 1, w, 1)
    if isinstance(source, Bounds):
        # Every block kind as one interval per (query, column): full [0, KV_LEN), absent
        # empty, partial the query's own; then three passes over the elements in all.
        rows = source.lo.size(0)
        lo = source.lo.index_select(1, span.blocks).view(rows, 1, 1, n, layout.q_block, 1, 1)
        hi = source.hi.index_select(1, span.blocks).view(rows, 1, 1, n, layout.q_block, 1, 1)
        lo = torch.where(kinds == FULL, 0, torch.where(kinds == PARTIAL, lo, layout.kv_len))
        hi = torch.where(kinds == PARTIAL, hi, layout.kv_len - 1).clamp(max=layout.kv_len - 1)
        refused = (kv_tokens < lo) | (kv_tokens > hi)
    else:
        allowed = kinds == FULL
        if bool((span.kinds == PARTIAL).any()):
            allowed = allowed | ((kinds == PARTIAL) & source(span))
        if bool((kv_tokens >= layout.kv_len).any()):
            allowed = allowed & (kv_tokens < layout.kv_len)
        refused = ~allowed
    refused = refused.expand(*refused.shape[:-1], layout.kv_block)  # a block-level mask
    shape = refused.shape
    refused = refused.reshape(*shape[:5], shape[5] * shape[6])
    return refused.transpose(2, 3)  # (b, hk, n, g, Q_BLOCK or 1, w * KV_BLOCK)


def _masked_scores(
    queries: Tensor, keys: Tensor, refused: Tensor | None, group: Group, layout: Layout
) -> Tensor:
    """Scores of a group, (B * Hkv * n, G * Q_BLOCK, W * KV_BLOCK), refused pairs at -inf."""
    scores = torch.bmm(queries, keys.transpose(1, 2))
    if refused is not None and group.mask_span is not None:
        first, stop = group.mask_span
        view = scores.view(
            layout.batch,
            layout.kv_heads,
            group.blocks.numel(),
            layout.group,
            layout.q_block,
            scores.size(-1),
        )
        view[..., first * layout.kv_block : stop * layout.kv_block].masked_fill_(refused, -math.inf)
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
) -> tuple[Tensor, Tensor, list[Tensor | None], list[Tensor | None]]:
    """Output and lse in the blocked layouts, with the probabilities and masks kept per group
    while they fit ``save_budget`` bytes (None where they will be rebuilt).

    ``q_blocks`` is (B, Hkv, G, NQ, Q_BLOCK, D), already multiplied by the scale; ``k_blocks``
    and ``v_blocks`` are (B, Hkv, NKV, KV_BLOCK, D | Dv); all in the working dtype. The groups
    are shared among ``workers`` threads (see :func:`run_groups`).
    """
    batch, kv_heads, group, num_q_blocks, q_block, _ = q_blocks.shape
    out = q_blocks.new_zeros(batch, kv_heads, group, num_q_blocks, q_block, v_blocks.size(-1))
    lse = q_blocks.new_full((batch, kv_heads, group, num_q_blocks, q_block, 1), -math.inf)
    saved_probs: list[Tensor | None] = [None] * len(groups)
    saved_masks: list[Tensor | None] = [None] * len(groups)
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
        queries = _gather_rows(q_blocks, g.blocks, layout)
        keys = _gather_columns(k_blocks, g.columns)
        values = _gather_columns(v_blocks, g.columns)
        refused = None if g.mask_span is None else _refused(g, layout, mask_fn)
        probs = _masked_scores(queries, keys, refused, g, layout)
        row_max = probs.amax(dim=-1, keepdim=True)
        # A row with no allowed key has max -inf: subtracting 0 instead leaves exp(-inf) = 0,
        # so its sum is 0, its output 0 and its lse log(0) = -inf, with no NaN on the way.
        row_max = torch.where(row_max == -math.inf, 0.0, row_max)
        probs.sub_(row_max).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        group_lse = row_max + total.log()
        total = torch.where(total == 0, 1.0, total)
        # The output is normalised after the product (rows x Dv, not rows x columns): the
        # probabilities themselves only when they are kept for the backward.
        _scatter_rows(out, g.blocks, torch.bmm(probs, values).div_(total), layout)
        _scatter_rows(lse, g.blocks, group_lse, layout)
        if keep_probs[index]:
            saved_probs[index] = probs.div_(total)
        elif refused is not None and mask_budget.take(refused.numel()):
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
    saved_masks: list[Tensor | None],
    workers: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the scaled query, key and value blocks (same layouts as the inputs).

    With P the probabilities and dO the output gradient: dV = Pᵀ dO, dP = dO Vᵀ,
    dS = P ⊙ (dP - rowsum(dO ⊙ O) + dlse), dQ = dS K, dK = dSᵀ Q.
    """
    # rowsum(dO * O) is the softmax's correction term, once for every row.
    correction = (grad_out * out).sum(dim=-1, keepdim=True)
    if grad_lse is not None:
        correction = correction - grad_lse
    safe_lse = torch.where(lse == -math.inf, 0.0, lse)
    grad_q = torch.zeros_like(q_blocks)
    # Each q block is in one group, so threads write disjoint rows of grad_q; kv blocks are
    # shared between groups, so each thread adds into its own grad_k and grad_v.
    grad_kv: dict[int, tuple[Tensor, Tensor]] = {}

    def one(index: int) -> None:
        g = groups[index]
        probs, refused = saved_probs[index], saved_masks[index]
        saved_probs[index] = saved_masks[index] = None  # freed as the backward goes
        worker = threading.get_ident()
        if worker not in grad_kv:
            grad_kv[worker] = (torch.zeros_like(k_blocks), torch.zeros_like(v_blocks))
        grad_k, grad_v = grad_kv[worker]
        queries = _gather_rows(q_blocks, g.blocks, layout)
        keys = _gather_columns(k_blocks, g.columns)
        values = _gather_columns(v_blocks, g.columns)
        if probs is None:
            if refused is None and g.mask_span is not None:
                refused = _refused(g, layout, mask_fn)
            probs = _masked_scores(queries, keys, refused, g, layout)
            probs.sub_(_gather_rows(safe_lse, g.blocks, layout)).exp_()
        grad_rows = _gather_rows(grad_out, g.blocks, layout)
        _add_columns(grad_v, g.columns, torch.bmm(probs.transpose(1, 2), grad_rows))
        grad_scores = torch.bmm(grad_rows, values.transpose(1, 2))
        grad_scores.sub_(_gather_rows(correction, g.blocks, layout)).mul_(probs)
        del probs
        _scatter_rows(grad_q, g.blocks, torch.bmm(grad_scores, keys), layout)
        _add_columns(grad_k, g.columns, torch.bmm(grad_scores.transpose(1, 2), queries))

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
    rows = layout.batch * layout.kv_heads * n * layout.group * layout.q_block
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
        none: list[Tensor | None] = [None] * len(ctx.groups)
        probs, masks = ctx.probs or none, ctx.masks or list(none)
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
