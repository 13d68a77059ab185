"""Differentiable block-sparse attention in plain torch ops, for CPUs (where flex has no backward).

``torch.nn.attention.flex_attention.flex_attention`` runs its forward on CPU but raises in the
backward. :func:`block_sparse_attention` computes the same thing from the same
:class:`~torch.nn.attention.flex_attention.BlockMask`, touching only the blocks it lists, with
ordinary differentiable ops, so autograd gives gradients for query, key and value.

How it is laid out, and why:

* **Chunks of q blocks share their kv columns.** Consecutive q blocks are grouped into a chunk;
  the chunk attends to the union of the kv blocks its q blocks list (its *columns*), and a small
  per-block map (absent / partial / full) says which (q block, column) pairs count. For causal,
  document, window and prefix masks that union is a contiguous run of blocks, so keys and values
  are *sliced*, not gathered: no copies forward, and no scatter-add backward (the slow part of
  a gather on CPU). Other masks fall back to ``index_select`` over whole kv blocks.
* **Chunks bound the temporaries and the waste.** A chunk grows while its scores stay under
  ``max_chunk_elements`` and at least half of its (q block, column) pairs are listed, so the
  work stays proportional to the listed blocks and memory to one chunk, never ``Q_LEN x KV_LEN``.
* **Recompute by default.** Each chunk runs under non-reentrant activation checkpointing, so
  autograd keeps only the inputs and rebuilds one chunk at a time in the backward: memory is
  ``O(Q_LEN x D)`` plus one chunk, at the cost of a second forward. ``recompute=False`` keeps
  every chunk's activations instead (``O(Q_LEN x active kv tokens)``) and skips that forward.
* **mask_mod only where it matters.** It is evaluated on the columns that are partial for some
  q block of the chunk, and applied only to partial pairs; full blocks are taken as
  all-allowed, exactly as flex's kernels do. Padding past ``Q_LEN``/``KV_LEN`` is clamped
  before the call (so lookups sized to the length are safe) and masked after it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

from flexmask.algebra.mask import Mask
from flexmask.backends.block_sparse import kernel
from flexmask.blocks.grid import make_grid
from flexmask.builders.create import built_from
from flexmask.pieces.causal import Causal

Backend = Literal["auto", "sparse", "sdpa"]
"""Which kernel runs: see :func:`block_sparse_attention` and :func:`choose_backend`."""

_BACKENDS = ("auto", "sparse", "sdpa")

ModEval = Literal["auto", "broadcast", "vmap"]
"""How ``mask_mod``/``score_mod`` are evaluated: see :func:`block_sparse_attention`."""

_MOD_EVALS = ("auto", "broadcast", "vmap")

# 1 Mi elements: 4 MiB per fp32 score-sized temporary; softmax and its backward keep a handful
# alive at once, so one chunk peaks near 25 MiB. benchmarks/bench_chunk.py (2 cores, forward +
# backward, 256 Ki-4 Mi): against 4 Mi, 1 Mi took 0.81-1.08x the time at B=1, H=4, 2k-8k
# (geometric mean 0.91: a group's temporaries stay in cache, and more groups deal evenly to
# the threads) and 0.87-1.08x at B=4, H=8 (0.99, noise: a q block there is already a chunk);
# 512 Ki gained no more, and 256 Ki lost up to 1.14x (more groups, more Python per element).
DEFAULT_MAX_CHUNK_ELEMENTS = 1 << 20

# Probabilities kept for the backward by default (recompute=None): enough to skip the rebuild
# for every group up to ~8k tokens x 4 heads of a sparse mask, small next to a training step.
DEFAULT_MEMORY_BUDGET = 256 << 20

# choose_backend: SDPA with a dense mask wins on a CPU above this share of listed blocks, or
# below this many (query, key) pairs in all (measured: benchmarks/bench_cpu_backward.py, S 2k
# and 8k). With several threads the sparse path's many separate ops each wait for the slowest
# thread, which on a shared machine costs more than the work saved: measured on 2 loaded
# cores it lost from 26% listed at 8k (an RL tree, 1.37x) and won below 20%. With one thread
# there is no such wait and it won up to 43% listed (0.42-0.54x SDPA at 2k).
SDPA_MIN_DENSITY = 0.5
SDPA_MAX_PAIRS = 256 * 256

# A chunk stops growing when fewer than this share of its (q block, column) pairs are listed:
# the union of columns is computed for every q block of the chunk, listed or not.
_MIN_CHUNK_DENSITY = 0.5

# Block kinds in the per-chunk map.
_ABSENT, _PARTIAL, _FULL = 0, 1, 2


def block_sparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: BlockMask,
    score_mod: Callable[..., Tensor] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    *,
    mod_eval: ModEval = "auto",
    recompute: bool | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
    backend: Backend = "auto",
    mask: Mask | None = None,
    threads: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse attention with flex_attention's semantics, differentiable on any device.

    Same result as ``flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
    return_lse)`` evaluated by flex's kernels: for each q block only the kv blocks in
    ``block_mask.kv_indices[..., :kv_num_blocks]`` (``mask_mod`` applied) and
    ``block_mask.full_kv_indices[..., :full_kv_num_blocks]`` (no ``mask_mod``) are attended.
    A query row with no allowed key gets output 0 and lse ``-inf``, and zero gradients.

    Note:
        flex's own CPU forward (the eager math reference) applies ``mask_mod`` to every pair and
        ignores the block lists, so the two differ for a BlockMask whose lists disagree with
        its ``mask_mod`` (a block left out, or declared full where ``mask_mod`` refuses some
        pairs). ``create_block_mask`` never builds such masks. A block listed as both partial
        and full counts once, as full.

    Args:
        query: ``(B, Hq, Q_LEN, D)``, floating point.
        key: ``(B, Hkv, KV_LEN, D)``, same dtype and device as ``query``.
        value: ``(B, Hkv, KV_LEN, Dv)``, same dtype and device as ``query``.
        block_mask: built for ``(Q_LEN, KV_LEN)``, e.g. by ``create_block_mask``. Its batch and
            head dims may be 1 (broadcast) or ``B`` and ``Hq``; ``BLOCK_SIZE`` may be any
            ``(Q_BLOCK, KV_BLOCK)`` and the lengths need not be multiples of it.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to
            ``scale * q @ k^T`` before masking, as in flex. ``None`` leaves scores unchanged.
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv``; query head ``h`` reads kv head
            ``h // (Hq // Hkv)``.
        return_lse: also return the natural-log logsumexp of the masked scores,
            ``(B, Hq, Q_LEN)``, float32 (float64 for float64 inputs), as flex does on CPU.
        mod_eval: how the mods are called. ``"broadcast"`` calls them once with broadcasting
            index tensors (``b`` shaped ``(B, 1, ...)``, ``h`` ``(1, Hkv, G, 1, ...)``, and so
            on): the fast path, right for mods made of elementwise ops and indexing, which is all
            flexmask produces. ``"vmap"`` nests ``torch.vmap`` over every index dim so each call
            sees 0-d tensors, like ``create_mask`` does; this is right for any mod flex accepts.
            ``"auto"`` (default) tries broadcasting once per call, on one chunk, and
            switches to vmap if the mod raises or returns a result that does not broadcast to
            the scores' shape. A mod that *reduces* over its inputs returns a plausible shape
            under broadcasting yet a wrong value, which no check can see: pass ``"vmap"``.
        recompute: what the backward rebuilds. ``None`` (default) keeps the probabilities of
            as many groups of q blocks as fit ``memory_budget`` and rebuilds the rest from the
            saved log-sum-exp (one matmul and one ``exp`` per group); ``True`` keeps none
            (memory ``O(Q_LEN x D)`` plus one group); ``False`` keeps them all. With a
            ``score_mod`` the backward goes through autograd: ``True``/``None`` checkpoint
            each chunk, ``False`` keeps every chunk's activations.
        memory_budget: bytes of probabilities kept for the backward when ``recompute`` is
            None (default 256 MiB).
        max_chunk_elements: bound on the number of scores one group (chunk) of q blocks
            holds (``B x Hq x rows x columns``): batch rows and kv heads are split into
            separate calls where one q block would exceed it; one q block of one batch row
            and kv head is never split, so that much may exceed it.
        backend: ``"sparse"`` runs the block-sparse kernel; ``"sdpa"`` builds the dense bool
            mask the BlockMask means (``mask_mod`` evaluated on partial blocks only) and calls
            ``scaled_dot_product_attention``; ``"auto"`` (default) picks SDPA where it is
            faster on a CPU — a mask whose listed blocks cover most of the grid, or a tiny
            one — and the sparse kernel otherwise (see :func:`choose_backend`). The result is
            the same either way. ``return_lse`` and ``score_mod`` always run the sparse path.
            A mask that is exactly causal with ``Q_LEN == KV_LEN`` runs SDPA with
            ``is_causal=True`` (no dense mask, half the work) under ``"auto"`` and ``"sdpa"``.
        mask: the flexmask Mask ``block_mask`` was built from, as a check: a BlockMask built
            by flexmask (``flexmask.create_block_mask`` or the cache, with no ``q_offset``/
            ``kv_offset``) records its Mask, and a ``mask`` with another key raises
            ValueError. Where that Mask's rows are kv intervals (causal, document, sliding
            window, prefix, padding and their ``&``), partial blocks are masked from each
            query's interval ``[lo, hi]`` instead of calling ``mask_mod`` on every pair, and
            plain causal is recognised from its key — with or without ``mask``. A BlockMask
            flexmask did not build (torch's, a window, one made by ``.to()`` or slicing)
            records nothing: ``mask`` is then not used, and ``mask_mod`` decides.
        threads: how many threads share the sparse kernel's groups of q blocks, each running
            its ops on one intra-op thread. Unlike torch's intra-op threads, which meet at the
            end of every small op, they meet once per forward and once per backward, so a core
            taken by another process costs its share of the work, not a stall per op. ``1``
            runs everything in the calling thread on one intra-op thread. ``None`` measures:
            each kind of call runs either in the calling thread with torch's intra-op threads
            (faster on free cores) or on ``torch.get_num_threads()`` such workers (faster on
            busy ones), whichever ran it faster lately, trying the other now and then
            (``block_sparse_kernel.ThreadChoice``). The result is the same every way. On
            other devices than the CPU the groups run in the calling thread, on its stream.

    Returns:
        The output ``(B, Hq, Q_LEN, Dv)`` in ``query.dtype``, and with ``return_lse`` the pair
        ``(output, lse)``.

    Raises:
        TypeError: an argument of the wrong type or dtype (named in the message).
        ValueError: shapes that do not fit together, a ``block_mask`` built for other lengths,
            or a ``mask`` other than the one flexmask built ``block_mask`` from.

    Example:
        >>> import torch
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> block_mask = create_block_mask(causal, None, None, 300, 300, device="cpu")
        >>> q, k, v = (torch.randn(1, 2, 300, 16, requires_grad=True) for _ in range(3))
        >>> out = block_sparse_attention(q, k, v, block_mask)
        >>> out.sum().backward()
        >>> out.shape, q.grad.shape
        (torch.Size([1, 2, 300, 16]), torch.Size([1, 2, 300, 16]))
    """
    if isinstance(max_chunk_elements, bool) or not isinstance(max_chunk_elements, numbers.Integral):
        raise TypeError(
            f"max_chunk_elements must be an int, got {type(max_chunk_elements).__name__}"
        )
    max_chunk_elements = int(max_chunk_elements)  # numpy integers too
    if max_chunk_elements < 1:
        raise ValueError(f"max_chunk_elements must be >= 1, got {max_chunk_elements}")
    if recompute is not None and not isinstance(recompute, bool):
        raise TypeError(f"recompute must be True, False or None, got {recompute!r}")
    if (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, numbers.Integral)  # numpy integers too
        or memory_budget < 0
    ):
        raise ValueError(f"memory_budget must be an int of bytes >= 0, got {memory_budget!r}")
    memory_budget = int(memory_budget)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
            raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
        threads = int(threads)  # numpy integers too
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be the flexmask Mask block_mask was built from, or None, got "
            f"{type(mask).__name__}"
        )
    plan = _plan(query, key, value, block_mask, score_mod, scale, enable_gqa, mod_eval)
    workers = _kernel_workers(threads, query.device)
    mask = _checked_mask(block_mask, mask)
    if plan.batch == 0:
        return _empty_batch(query, key, value, return_lse)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    bounds = None if mask is None else interval_bounds(mask, plan)
    if bounds is not None:
        # Every later evaluation of the mask (dense mask, score_mod path) reads the intervals.
        plan = replace(plan, mask_mod=_IntervalMod(bounds))

    if score_mod is None and not return_lse and backend != "sparse":
        causal = is_causal(plan, mask)
        if backend == "auto":
            backend = "sdpa" if causal else choose_backend(plan)
        if backend == "sdpa":
            return _sdpa_attention(query, key, value, plan, mod_eval, causal)
    if score_mod is None:
        save_budget = {None: memory_budget, True: 0, False: 1 << 62}[recompute]
        out, lse = _grouped_attention(
            query,
            key,
            value,
            plan,
            mod_eval,
            max_chunk_elements,
            save_budget,
            needs_grad,
            bounds,
            workers,
        )
        return (out, lse) if return_lse else out
    return _chunked_attention(
        query,
        key,
        value,
        plan,
        mod_eval,
        recompute is not False,
        max_chunk_elements,
        needs_grad,
        return_lse,
    )


def _kernel_workers(threads: int | None, device: torch.device) -> int:
    """``workers`` for the kernel. Its threads are a CPU matter (torch's intra-op threads);
    elsewhere the groups run in the calling thread, which also keeps them on the caller's
    stream (a helper thread would launch on its own default stream, unordered with it)."""
    if device.type != "cpu":
        return 1
    return kernel.AUTO if threads is None else threads


def _checked_mask(block_mask: BlockMask, mask: Mask | None) -> Mask | None:
    """The Mask whose structure may stand in for ``block_mask``'s mask_mod: the one flexmask
    built it from (``mask``, when given, must have its key), else None.

    Partial blocks read from another mask's intervals would be silently wrong, so ``mask`` is
    checked, not trusted: against the Mask a flexmask build recorded on the BlockMask (one key
    comparison). A BlockMask flexmask did not build — torch's, a window, one torch derived by
    ``.to()`` or slicing, one whose ``mask_mod`` was replaced — has nothing to check against
    and takes the ``mask_mod`` path, whatever ``mask`` says.
    """
    source = built_from(block_mask)
    if mask is not None and source is not None and mask.key != source.key:
        raise ValueError(
            f"mask must be the Mask block_mask was built from, {source!r}, got {mask!r}; pass "
            "that one, or mask=None (the BlockMask knows its own)"
        )
    return source


def choose_backend(plan: _Plan, mask: Mask | None = None) -> Literal["sparse", "sdpa"]:
    """``"sdpa"`` where SDPA is faster on a CPU, else ``"sparse"``.

    SDPA's fused CPU kernel does every (query, key) pair but without the sparse path's extra
    passes over the scores, so it wins when the listed blocks cover most of the grid
    (``SDPA_MIN_DENSITY``: half of them) and on tiny problems (``SDPA_MAX_PAIRS``), where
    per-group overhead dominates; and on plain causal, where ``is_causal=True`` skips the upper
    triangle without any mask. On an idle 2-core machine (B=1, H=4, D=64) the sparse path beat
    SDPA with 43% of blocks listed (0.55× its time at 2k) and 26–31% (trees, 0.3–0.53×); on a
    loaded one its many small ops wait on busy cores — see docs/cpu-training.md.
    """
    if plan.q_len * plan.kv_len <= SDPA_MAX_PAIRS or is_causal(plan, mask):
        return "sdpa"
    listed = (plan.kinds != _ABSENT).flatten(0, 2).any(dim=0)
    return "sdpa" if float(listed.float().mean()) >= SDPA_MIN_DENSITY else "sparse"


def dense_mask(plan: _Plan, mod_eval: str) -> Tensor:
    """The bool mask ``(B | 1, Hq | 1, Q_LEN, KV_LEN)`` the plan's BlockMask means: full blocks
    True, unlisted False, and ``mask_mod`` evaluated on the partial blocks only."""
    kinds = plan.kinds  # (Bm, Hkv | 1, G | 1, NQ, NKV)
    pairs = (kinds == _PARTIAL).flatten(0, 2).any(dim=0).nonzero()
    rows, cols = pairs[:, 0], pairs[:, 1]
    full = (kinds == _FULL)[..., :, None, :, None]
    if rows.numel():
        count, device = rows.numel(), kinds.device
        q_idx = rows[:, None] * plan.q_block + torch.arange(plan.q_block, device=device)
        kv_idx = cols[:, None] * plan.kv_block + torch.arange(plan.kv_block, device=device)
        args = (
            torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1),
            torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, plan.group, 1, 1, 1),
            q_idx.clamp(max=plan.q_len - 1).view(1, 1, 1, count, plan.q_block, 1),
            kv_idx.clamp(max=plan.kv_len - 1).view(1, 1, 1, count, 1, plan.kv_block),
        )
        shape = (plan.batch, plan.kv_heads, plan.group, count, plan.q_block, plan.kv_block)
        how = mod_eval
        if how == "auto":
            how = "broadcast" if _broadcasts(plan.mask_mod, args, shape) else "vmap"
        by_mask_mod = _call_mod(plan.mask_mod, args, shape, how, "mask_mod")
        picked = kinds[..., rows, cols][..., None, None]  # (Bm, Hk, Gm, count, 1, 1)
        values = (picked == _FULL) | ((picked == _PARTIAL) & by_mask_mod)
        dims = torch.broadcast_shapes(full.shape[:3], values.shape[:3])
        blocked = (full.size(3), plan.q_block, full.size(5), plan.kv_block)
        dense = full.expand(*dims, *blocked).clone()
        dense[..., rows, :, cols, :] = values.expand(*dims, *values.shape[3:]).movedim(3, 0)
    else:
        dense = full.expand(*full.shape[:4], plan.q_block, full.size(5), plan.kv_block)
    b, hk, g = dense.shape[:3]
    dense = dense.reshape(b, hk * g, dense.size(3) * plan.q_block, -1)
    return dense[:, :, : plan.q_len, : plan.kv_len]


def is_causal(plan: _Plan, mask: Mask | None = None) -> bool:
    """True when the plan's BlockMask means exactly ``q_idx >= kv_idx`` with ``Q_LEN ==
    KV_LEN``, so SDPA's ``is_causal=True`` computes the same thing.

    Known when ``mask`` (the Mask the BlockMask was built from) is ``causal()``; otherwise
    checked from the BlockMask itself: its block lists must be causal's (every batch row and
    head) and ``mask_mod`` must equal ``q_idx >= kv_idx`` on its partial blocks — the
    diagonal, so the check costs ``Q_LEN x KV_BLOCK`` evaluations, and only when the lists
    are causal's (``causal() & sliding_window(w)`` with ``w >= Q_LEN`` is taken for causal).
    """
    if plan.q_len != plan.kv_len:
        return False
    if isinstance(mask, Causal):
        return True
    # Other masks can still be exactly causal on this grid (a sliding window at least as
    # long as the sequence, say): the check below is cheap when the block lists differ.
    q_first = torch.arange(0, plan.q_len, plan.q_block)
    kv_first = torch.arange(0, plan.kv_len, plan.kv_block)
    q_last = (q_first + plan.q_block - 1).clamp(max=plan.q_len - 1)
    kv_last = (kv_first + plan.kv_block - 1).clamp(max=plan.kv_len - 1)
    complete = (q_last - q_first + 1 == plan.q_block)[:, None] & (
        kv_last - kv_first + 1 == plan.kv_block
    )
    full = complete & (kv_last[None, :] <= q_first[:, None])
    nonempty = kv_first[None, :] <= q_last[:, None]
    expected = torch.where(full, _FULL, torch.where(nonempty, _PARTIAL, _ABSENT))
    if not bool((plan.kinds.cpu() == expected.to(torch.int8)).all()):
        return False
    pairs = (plan.kinds == _PARTIAL).flatten(0, 2).any(dim=0).nonzero()
    count, device = pairs.size(0), plan.kinds.device
    q_idx = pairs[:, :1] * plan.q_block + torch.arange(plan.q_block, device=device)
    kv_idx = pairs[:, 1:] * plan.kv_block + torch.arange(plan.kv_block, device=device)
    inside = (q_idx < plan.q_len)[:, :, None] & (kv_idx < plan.kv_len)[:, None, :]
    q_idx = q_idx.clamp(max=plan.q_len - 1).view(1, 1, 1, count, plan.q_block, 1)
    kv_idx = kv_idx.clamp(max=plan.kv_len - 1).view(1, 1, 1, count, 1, plan.kv_block)
    args = (
        torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1),
        torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, plan.group, 1, 1, 1),
        q_idx,
        kv_idx,
    )
    shape = (plan.batch, plan.kv_heads, plan.group, count, plan.q_block, plan.kv_block)
    try:
        with torch.no_grad():
            how = "broadcast" if _broadcasts(plan.mask_mod, args, shape) else "vmap"
            by_mask_mod = _call_mod(plan.mask_mod, args, shape, how, "mask_mod")
    except Exception:  # not provably causal: the general paths will raise if it is an error
        return False
    causal = (q_idx >= kv_idx).view(count, plan.q_block, plan.kv_block)
    return bool(((by_mask_mod == causal) | ~inside).all())


def _sdpa_attention(
    query: Tensor, key: Tensor, value: Tensor, plan: _Plan, mod_eval: str, causal: bool
) -> Tensor:
    """SDPA with the dense mask (or ``is_causal``); rows with no key get 0 and zero gradients,
    as in flex."""
    if causal:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=plan.scale, enable_gqa=plan.group > 1
        )
    mask = dense_mask(plan, mod_eval)
    has_key = mask.any(dim=-1, keepdim=True)
    all_have_keys = bool(has_key.all())
    if not all_have_keys:
        mask = mask | ~has_key  # attend anywhere, then zeroed: finite values and gradients
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=plan.scale, enable_gqa=plan.group > 1
    )
    return out if all_have_keys else out * has_key


def _empty_batch(
    query: Tensor, key: Tensor, value: Tensor, return_lse: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """B = 0, as torch's flex_attention: empty output (and lse), still part of the graph."""
    if not isinstance(value, Tensor) or value.dim() != 4:
        raise ValueError("value must be 4-D (B, H, seq_len, head_dim)")
    batch, q_heads, q_len, _ = query.shape
    # Sums of empty tensors are 0: adding them links the empty result to every input.
    link = query.sum() + key.sum() + value.sum()
    out = query.new_zeros(batch, q_heads, q_len, value.size(-1)) + link.to(query.dtype)
    if not return_lse:
        return out
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return out, torch.zeros(batch, q_heads, q_len, dtype=lse_dtype) + link.to(lse_dtype)


def _grouped_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: _Plan,
    mod_eval: str,
    max_chunk_elements: int,
    save_budget: int,
    needs_grad: bool,
    bounds: kernel.Bounds | None,
    threads: int,
) -> tuple[Tensor, Tensor]:
    """The grouped kernel over slices of batch rows and kv heads small enough that one q block
    of a slice, at its widest, holds at most ``max_chunk_elements`` scores (a group batches
    its q blocks over every batch row and head of the slice: at B=4, Hq=32, 8k one q block
    would be 33 Mi scores, 128 MiB per temporary). Attention is independent across batch rows
    and kv heads, so each slice is its own call; the outputs are put back together."""
    widest = max(1, int(plan.listed.sum(dim=-1).max()))
    per_pair = plan.group * plan.q_block * widest * plan.kv_block  # one (batch row, kv head)
    pairs = max(1, max_chunk_elements // per_pair)
    if pairs >= plan.batch * plan.kv_heads:
        return _grouped_slice(
            query,
            key,
            value,
            plan,
            mod_eval,
            max_chunk_elements,
            save_budget,
            needs_grad,
            bounds,
            threads,
        )
    heads_step = min(plan.kv_heads, pairs)
    batch_step = max(1, pairs // plan.kv_heads)
    g = plan.group
    batch_sizes = [min(batch_step, plan.batch - b) for b in range(0, plan.batch, batch_step)]
    head_sizes = [min(heads_step, plan.kv_heads - h) for h in range(0, plan.kv_heads, heads_step)]
    count = len(batch_sizes) * len(head_sizes)
    # split, not indexing: split's backward puts the pieces' gradients together in one
    # tensor, where each indexed piece's backward would write a zero-filled whole.
    rows = zip(
        query.split(batch_sizes), key.split(batch_sizes), value.split(batch_sizes), strict=True
    )
    outs, lses = [], []
    for b0, (q_row, k_row, v_row) in zip(range(0, plan.batch, batch_step), rows, strict=True):
        heads = zip(
            q_row.split([n * g for n in head_sizes], dim=1),
            k_row.split(head_sizes, dim=1),
            v_row.split(head_sizes, dim=1),
            strict=True,
        )
        row_outs, row_lses = [], []
        for h0, (q, k, v) in zip(range(0, plan.kv_heads, heads_step), heads, strict=True):
            b1, h1 = b0 + q.size(0), h0 + k.size(1)
            piece_bounds = None
            if bounds is not None:
                kept = slice(b0, b1) if bounds.lo.size(0) > 1 else slice(None)
                piece_bounds = kernel.Bounds(bounds.lo[kept], bounds.hi[kept])
            out, lse = _grouped_slice(
                q,
                k,
                v,
                _plan_slice(plan, b0, b1, h0, h1),
                mod_eval,
                max_chunk_elements,
                save_budget // count,
                needs_grad,
                piece_bounds,
                threads,
            )
            row_outs.append(out)
            row_lses.append(lse)
        outs.append(torch.cat(row_outs, dim=1))
        lses.append(torch.cat(row_lses, dim=1))
    return torch.cat(outs), torch.cat(lses)


def _plan_slice(plan: _Plan, b0: int, b1: int, h0: int, h1: int) -> _Plan:
    """The plan of batch rows [b0, b1) and kv heads [h0, h1): block kinds cut where they vary
    by row or head, and mask_mod seeing the whole call's batch and query-head indices."""
    kinds = plan.kinds
    if kinds.size(0) > 1:
        kinds = kinds[b0:b1]
    if kinds.size(1) > 1:
        kinds = kinds[:, h0:h1]
    return replace(
        plan,
        batch=b1 - b0,
        kv_heads=h1 - h0,
        q_heads=(h1 - h0) * plan.group,
        kinds=kinds,
        mask_mod=_OffsetMod(plan.mask_mod, b0, h0 * plan.group),
    )


class _OffsetMod:
    """``mask_mod(b + b0, h + h0, q_idx, kv_idx)``: a slice's indices in the whole call."""

    def __init__(self, mask_mod: Callable[..., Tensor], b0: int, h0: int) -> None:
        self.mask_mod, self.b0, self.h0 = mask_mod, b0, h0

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.mask_mod(b + self.b0, h + self.h0, q_idx, kv_idx)


def _grouped_slice(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: _Plan,
    mod_eval: str,
    max_chunk_elements: int,
    save_budget: int,
    needs_grad: bool,
    bounds: kernel.Bounds | None,
    threads: int,
) -> tuple[Tensor, Tensor]:
    """The grouped kernel (``kernel``), in and out of its blocked layouts."""
    layout = kernel.Layout(
        batch=plan.batch,
        kv_heads=plan.kv_heads,
        group=plan.group,
        q_len=plan.q_len,
        kv_len=plan.kv_len,
        q_block=plan.q_block,
        kv_block=plan.kv_block,
        scale=plan.scale,
        working_dtype=plan.working_dtype,
    )
    groups = kernel.make_groups(plan.kinds.cpu(), layout, max_chunk_elements)
    mask_fn: kernel.MaskSource = bounds or _group_mask_fn(plan, groups, query.device, mod_eval)
    batch, kv_heads, group = plan.batch, plan.kv_heads, plan.group
    q_blocks = _pad_to_blocks(query, plan.q_block).to(plan.working_dtype) * plan.scale
    q_blocks = q_blocks.reshape(batch, kv_heads, group, -1, plan.q_block, plan.head_dim)
    k_blocks = _pad_to_blocks(key, plan.kv_block).to(plan.working_dtype)
    k_blocks = k_blocks.reshape(batch, kv_heads, -1, plan.kv_block, plan.head_dim)
    v_blocks = _pad_to_blocks(value, plan.kv_block).to(plan.working_dtype)
    v_blocks = v_blocks.reshape(batch, kv_heads, -1, plan.kv_block, plan.value_dim)
    if needs_grad:
        out, lse = kernel.BlockSparseFunction.apply(
            q_blocks, k_blocks, v_blocks, groups, layout, mask_fn, save_budget, threads
        )
    else:
        with torch.no_grad():
            out, lse, _, _ = kernel.forward(
                q_blocks, k_blocks, v_blocks, groups, layout, mask_fn, 0, threads
            )
    out = out.reshape(batch, plan.q_heads, -1, plan.value_dim)[:, :, : plan.q_len]
    lse = lse.reshape(batch, plan.q_heads, -1)[:, :, : plan.q_len]
    return out.to(query.dtype), lse


def interval_bounds(mask: Mask, plan: _Plan) -> kernel.Bounds | None:
    """Each query's kv interval from ``mask``'s structure, over the queries padded to whole q
    blocks (padding rows take the last query's): None where its rows are not intervals."""
    if not mask._has_intervals():
        return None
    grid = make_grid(
        mask,
        plan.batch,
        plan.q_heads,
        plan.q_len,
        plan.kv_len,
        plan.kinds.device,
        (plan.q_block, plan.kv_block),
    )
    rows, _ = grid.reduced(mask)
    num_q_blocks = plan.kinds.size(3)
    q_idx = torch.arange(num_q_blocks * plan.q_block, device=grid.device)
    q_idx = q_idx.clamp(max=plan.q_len - 1).expand(rows, -1)
    found = mask._intervals(q_idx, torch.arange(rows, device=grid.device).view(rows, 1), grid)
    if found is None:
        return None
    lo, hi = (t.expand(rows, -1).reshape(rows, num_q_blocks, plan.q_block) for t in found)
    return kernel.Bounds(lo.cpu(), hi.cpu())


class _IntervalMod:
    """``lo[q_idx] <= kv_idx <= hi[q_idx]``: the mask_mod of a mask whose rows are intervals,
    from its bounds (per batch row when they differ); index arithmetic, broadcasts."""

    def __init__(self, bounds: kernel.Bounds) -> None:
        self.lo = bounds.lo.flatten(1)
        self.hi = bounds.hi.flatten(1)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        row = b if self.lo.size(0) > 1 else torch.zeros_like(b)
        return (kv_idx >= self.lo[row, q_idx]) & (kv_idx <= self.hi[row, q_idx])


def _group_mask_fn(
    plan: _Plan, groups: list[kernel.Group], device: torch.device, mod_eval: str
) -> kernel.MaskFn:
    """mask_mod over a group's (q block, column) tiles, broadcasting or through vmap."""
    b = torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1, 1)
    h = torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, plan.group, 1, 1, 1, 1)
    q_offsets = torch.arange(plan.q_block, device=device)
    kv_offsets = torch.arange(plan.kv_block, device=device)

    def arguments(group: kernel.Group) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        n, width = group.columns.shape
        q_idx = group.blocks.to(device)[:, None] * plan.q_block + q_offsets
        kv_idx = group.columns.to(device)[:, :, None] * plan.kv_block + kv_offsets
        q_idx = q_idx.clamp(max=plan.q_len - 1).view(1, 1, 1, n, plan.q_block, 1, 1)
        kv_idx = kv_idx.clamp(max=plan.kv_len - 1).view(1, 1, 1, n, 1, width, plan.kv_block)
        shape = (plan.batch, plan.kv_heads, plan.group, n, plan.q_block, width, plan.kv_block)
        return (b, h, q_idx, kv_idx), shape

    how = mod_eval
    if how == "auto":
        how = "broadcast"
        probe = next((g for g in groups if bool((g.kinds == _PARTIAL).any())), None)
        if probe is not None:
            with torch.no_grad():
                if not _broadcasts(plan.mask_mod, *arguments(probe)):
                    how = "vmap"

    def mask_fn(group: kernel.Group) -> Tensor:
        args, shape = arguments(group)
        return _call_mod(plan.mask_mod, args, shape, how, "mask_mod")

    return mask_fn


def _chunked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: _Plan,
    mod_eval: str,
    recompute: bool,
    max_chunk_elements: int,
    needs_grad: bool,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """The autograd path, for a score_mod: chunks of consecutive q blocks, checkpointed."""
    chunks = _chunks(plan, max_chunk_elements)
    mask_eval, score_eval = _resolve_mod_evals(plan, chunks, query, mod_eval)

    # Padded once to whole blocks. The query is split into the chunks' rows in one op, so the
    # backward assembles its gradient once instead of adding a full-size one per chunk.
    q_pieces = _pad_to_blocks(query, plan.q_block).split(
        [(c.stop - c.start) * plan.q_block for c in chunks], dim=2
    )
    keys = _pad_to_blocks(key, plan.kv_block)
    values = _pad_to_blocks(value, plan.kv_block)

    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for chunk, q_piece in zip(chunks, q_pieces, strict=True):
        args = (q_piece, keys, values, plan, chunk, mask_eval, score_eval, return_lse)
        if recompute and needs_grad:
            # Non-reentrant checkpointing: only the arguments are kept; the chunk's scores and
            # probabilities are rebuilt when its backward runs.
            result = checkpoint(
                _chunk_attention, *args, use_reentrant=False, preserve_rng_state=False
            )
        else:
            result = _chunk_attention(*args)
        outs.append(result[0])
        if return_lse:
            lses.append(result[1])
    out = torch.cat(outs, dim=2)
    if return_lse:
        return out, torch.cat(lses, dim=2)
    return out


@dataclass(frozen=True)
class _Plan:
    """Validated sizes and the block-kind map, laid out as (B | 1, Hkv | 1, G | 1, NQ, NKV)."""

    batch: int
    q_heads: int
    kv_heads: int
    group: int  # G = Hq // Hkv
    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    head_dim: int
    value_dim: int
    scale: float
    working_dtype: torch.dtype
    kinds: Tensor  # int8 _ABSENT / _PARTIAL / _FULL per (batch, head, q block, kv block)
    listed: Tensor  # (NQ, NKV) bool on the CPU: listed for some batch and head
    partial: Tensor  # (NQ, NKV) bool on the CPU: partial for some batch and head
    mask_mod: Callable[..., Tensor]
    score_mod: Callable[..., Tensor] | None


class _Chunk(NamedTuple):
    start: int  # first q block
    stop: int  # one past the last q block
    columns: Tensor  # kv blocks attended by some q block of the chunk, ascending, on the CPU
    first_column: int | None  # set when ``columns`` is a contiguous run: slice, don't gather
    partial_columns: tuple[int, int] | None  # positions in ``columns`` spanning partial blocks


class _ChunkIndices(NamedTuple):
    """Index tensors of one chunk, broadcastable to (B, Hkv, G, C, Q_BLOCK, U, KV_BLOCK)."""

    b: Tensor
    h: Tensor
    q_idx: Tensor  # clamped to Q_LEN - 1
    kv_idx: Tensor  # clamped to KV_LEN - 1
    # Listed block and token below KV_LEN: (B | 1, Hkv | 1, G | 1, C, 1, U, KV_BLOCK).
    allowed: Tensor
    kinds: Tensor  # (B | 1, Hkv | 1, G | 1, C, 1, U, 1)


def _plan(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: BlockMask,
    score_mod: Callable[..., Tensor] | None,
    scale: float | None,
    enable_gqa: bool,
    mod_eval: str,
) -> _Plan:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, seq_len, head_dim), got shape {tuple(tensor.shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating-point dtype, got {tensor.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(
                f"{name}.dtype must equal query.dtype ({query.dtype}), got {tensor.dtype}"
            )
        if tensor.device != query.device:
            raise ValueError(
                f"{name} must be on query's device ({query.device}), got {tensor.device}"
            )
    batch, q_heads, q_len, head_dim = query.shape
    if key.size(0) != batch or value.size(0) != batch:
        raise ValueError(
            f"key and value must have query's batch size {batch}, got key {key.size(0)} and "
            f"value {value.size(0)}"
        )
    if key.size(-1) != head_dim:
        raise ValueError(
            f"key's head_dim must equal query's ({head_dim}), got key.shape={tuple(key.shape)}"
        )
    if value.shape[1:3] != key.shape[1:3]:
        raise ValueError(
            f"value must have key's heads and length {tuple(key.shape[1:3])}, "
            f"got value.shape={tuple(value.shape)}"
        )
    kv_heads, kv_len = key.size(1), key.size(2)
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if q_heads == 0 or kv_heads == 0:
        raise ValueError(
            f"query and key/value must have at least one head (H >= 1, as torch's flex_attention "
            f"needs), got query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if not enable_gqa and q_heads != kv_heads:
        raise ValueError(
            f"query has {q_heads} heads but key/value have {kv_heads}; pass enable_gqa=True "
            "for grouped-query attention, or give them the same number of heads"
        )
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(
            f"with enable_gqa=True, query's heads ({q_heads}) must be a multiple of key/value's "
            f"heads ({kv_heads})"
        )
    if q_len == 0 or kv_len == 0:
        raise ValueError(
            f"query and key must hold at least one token, got Q_LEN={q_len}, KV_LEN={kv_len}"
        )
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            f"score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx) or None, "
            f"got {type(score_mod).__name__}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if mod_eval not in _MOD_EVALS:
        raise ValueError(f"mod_eval must be one of {_MOD_EVALS}, got {mod_eval!r}")

    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a torch.nn.attention.flex_attention.BlockMask (for example "
            f"from create_block_mask), got {type(block_mask).__name__}"
        )
    if tuple(block_mask.seq_lengths) != (q_len, kv_len):
        raise ValueError(
            f"block_mask was built for (Q_LEN, KV_LEN)={tuple(block_mask.seq_lengths)} but query "
            f"and key give ({q_len}, {kv_len}); build it for these lengths"
        )
    if block_mask.kv_num_blocks.device != query.device:
        raise ValueError(
            f"block_mask must be on query's device ({query.device}), got "
            f"{block_mask.kv_num_blocks.device}; use block_mask.to(device)"
        )
    q_block, kv_block = (int(s) for s in block_mask.BLOCK_SIZE)
    group = q_heads // kv_heads
    num_q_blocks = -(-q_len // q_block)
    num_kv_blocks = -(-kv_len // kv_block)

    batch_dims: set[tuple[int, int]] = set()
    kinds: Tensor | None = None
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, "kv_indices", _PARTIAL)]
    if block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None:
        lists.append(
            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, "full_kv_indices", _FULL)
        )
    for num, idx, name, kind in lists:
        if num.dim() != 3 or idx.dim() != 4 or idx.shape[:3] != num.shape:
            raise ValueError(
                f"block_mask.{name} must be (B, H, q_blocks, max_blocks), got shape "
                f"{tuple(idx.shape)} with counts of shape {tuple(num.shape)}"
            )
        mask_batch, mask_heads, mask_rows, slots = idx.shape
        if mask_batch not in (1, batch) or mask_heads not in (1, q_heads):
            raise ValueError(
                f"block_mask's batch and head dims must be 1 or match query's ({batch}, "
                f"{q_heads}), got ({mask_batch}, {mask_heads})"
            )
        batch_dims.add((mask_batch, mask_heads))
        if mask_rows < num_q_blocks:
            raise ValueError(
                f"block_mask.{name} has {mask_rows} q blocks but Q_LEN={q_len} needs "
                f"{num_q_blocks} of size {q_block}"
            )
        num = num[:, :, :num_q_blocks].long()
        idx = idx[:, :, :num_q_blocks].long()
        if num.numel() and (int(num.min()) < 0 or int(num.max()) > slots):  # B=0: none
            raise ValueError(f"block_mask's counts for {name} must lie in [0, {slots}]")
        in_use = torch.arange(slots, device=idx.device) < num[..., None]
        if bool((in_use & ((idx < 0) | (idx >= num_kv_blocks))).any()):
            raise ValueError(
                f"block_mask.{name} points outside the {num_kv_blocks} kv blocks of KV_LEN={kv_len}"
            )
        # Slots past the count hold leftovers: send them to a spare column, dropped below.
        idx = torch.where(in_use, idx, num_kv_blocks)
        if kinds is None:
            kinds = torch.zeros(
                mask_batch,
                mask_heads,
                num_q_blocks,
                num_kv_blocks + 1,
                dtype=torch.int8,
                device=idx.device,
            )
        if idx.size(-1):
            # Full after partial, so a block listed in both counts once, as full.
            kinds.scatter_(-1, idx, kind)
    if len(batch_dims) != 1:
        raise ValueError(
            "block_mask's kv_indices and full_kv_indices must have the same batch and head dims, "
            f"got {sorted(batch_dims)}"
        )
    assert kinds is not None  # the partial lists always exist
    kinds = kinds[..., :num_kv_blocks]
    listed = (kinds != _ABSENT).flatten(0, 1).any(dim=0).cpu()
    partial = (kinds == _PARTIAL).flatten(0, 1).any(dim=0).cpu()
    # Heads split as (Hkv, G) so a per-query-head map lines up with grouped kv heads.
    mask_batch, mask_heads = kinds.shape[:2]
    if mask_heads == q_heads:
        kinds = kinds.view(mask_batch, kv_heads, group, num_q_blocks, num_kv_blocks)
    else:
        kinds = kinds.view(mask_batch, 1, 1, num_q_blocks, num_kv_blocks)

    return _Plan(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        group=group,
        q_len=q_len,
        kv_len=kv_len,
        q_block=q_block,
        kv_block=kv_block,
        head_dim=head_dim,
        value_dim=value.size(-1),
        scale=float(scale),
        working_dtype=torch.float64 if query.dtype == torch.float64 else torch.float32,
        kinds=kinds,
        listed=listed,
        partial=partial,
        mask_mod=block_mask.mask_mod,
        score_mod=score_mod,
    )


def _chunks(plan: _Plan, max_elements: int) -> list[_Chunk]:
    """Groups consecutive q blocks while the chunk fits the budget and stays dense enough."""
    num_q_blocks = plan.listed.size(0)
    counts = plan.listed.sum(dim=-1).tolist()

    def cost(q_blocks: int, columns: int) -> int:
        return plan.batch * plan.q_heads * q_blocks * plan.q_block * columns * plan.kv_block

    chunks: list[_Chunk] = []
    start = 0
    while start < num_q_blocks:
        stop, union, listed = start + 1, plan.listed[start], counts[start]
        while stop < num_q_blocks:
            grown = union | plan.listed[stop]
            width = int(grown.sum())
            q_blocks = stop + 1 - start
            if cost(q_blocks, width) > max_elements or (
                listed + counts[stop] < _MIN_CHUNK_DENSITY * q_blocks * width
            ):
                break
            stop, union, listed = stop + 1, grown, listed + counts[stop]
        columns = union.nonzero().flatten()
        if columns.numel() == 0:
            columns = torch.zeros(1, dtype=torch.long)  # nothing listed: one absent column
        first, last = int(columns[0]), int(columns[-1])
        contiguous = last - first + 1 == columns.numel()
        partial = plan.partial[start:stop, columns].any(dim=0).nonzero().flatten().tolist()
        partial_span = (partial[0], partial[-1] + 1) if partial else None
        first_column = first if contiguous else None
        chunks.append(_Chunk(start, stop, columns, first_column, partial_span))
        start = stop
    return chunks


def _chunk_indices(plan: _Plan, chunk: _Chunk, device: torch.device) -> _ChunkIndices:
    columns = chunk.columns.to(device)
    num_blocks, num_columns = chunk.stop - chunk.start, columns.numel()
    kinds = plan.kinds[..., chunk.start : chunk.stop, :].index_select(-1, columns)
    kinds = kinds.unsqueeze(-2).unsqueeze(-1)  # (B | 1, Hkv | 1, G | 1, C, 1, U, 1)
    kv_tokens = columns[:, None] * plan.kv_block + torch.arange(plan.kv_block, device=device)
    kv_tokens = kv_tokens.view(1, 1, 1, 1, 1, num_columns, plan.kv_block)
    q_tokens = torch.arange(chunk.start * plan.q_block, chunk.stop * plan.q_block, device=device)
    return _ChunkIndices(
        b=torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1, 1),
        h=torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, plan.group, 1, 1, 1, 1),
        q_idx=q_tokens.clamp(max=plan.q_len - 1).view(1, 1, 1, num_blocks, plan.q_block, 1, 1),
        kv_idx=kv_tokens.clamp(max=plan.kv_len - 1),
        allowed=(kinds != _ABSENT) & (kv_tokens < plan.kv_len),
        kinds=kinds,
    )


def _pad_to_blocks(tensor: Tensor, block: int) -> Tensor:
    """Zero-pads dim 2 (the sequence) up to a multiple of ``block``."""
    missing = -tensor.size(2) % block
    return torch.nn.functional.pad(tensor, (0, 0, 0, missing)) if missing else tensor


def _chunk_attention(
    q_piece: Tensor,
    keys: Tensor,
    values: Tensor,
    plan: _Plan,
    chunk: _Chunk,
    mask_eval: str,
    score_eval: str,
    return_lse: bool,
) -> tuple[Tensor, ...]:
    """Attention for the q blocks of one chunk: (out rows,) or (out rows, lse rows).

    ``q_piece`` holds the chunk's query rows (padded to whole q blocks); ``keys``/``values`` are
    the whole key and value padded to whole kv blocks.
    """
    batch, kv_heads, group = plan.batch, plan.kv_heads, plan.group
    q_block, kv_block = plan.q_block, plan.kv_block
    num_blocks, num_columns = chunk.stop - chunk.start, chunk.columns.numel()
    idx = _chunk_indices(plan, chunk, q_piece.device)

    # Query heads of one kv head side by side: one (G * C * Q_BLOCK, D) matrix per kv head, so
    # each (batch, kv head) is a single large matmul.
    queries = q_piece.reshape(batch, kv_heads, -1, plan.head_dim)
    queries = queries.to(plan.working_dtype) * plan.scale
    if chunk.first_column is not None:
        lo = chunk.first_column * kv_block
        keys = keys[:, :, lo : lo + num_columns * kv_block]
        values = values[:, :, lo : lo + num_columns * kv_block]
    else:

        def gather(tensor: Tensor) -> Tensor:
            blocks = tensor.reshape(batch, kv_heads, -1, kv_block * tensor.size(-1))
            picked = blocks.index_select(2, chunk.columns.to(blocks.device))
            return picked.view(batch, kv_heads, num_columns * kv_block, tensor.size(-1))

        keys, values = gather(keys), gather(values)
    keys, values = keys.to(plan.working_dtype), values.to(plan.working_dtype)

    full_shape = (batch, kv_heads, group, num_blocks, q_block, num_columns, kv_block)
    scores = (queries @ keys.transpose(-1, -2)).view(full_shape)
    if plan.score_mod is not None:
        scores = _call_mod(
            plan.score_mod,
            (scores, idx.b, idx.h, idx.q_idx, idx.kv_idx),
            full_shape,
            score_eval,
            "score_mod",
        )
        if scores.shape != full_shape:
            scores = scores.expand(full_shape)

    # Absent blocks and tokens past KV_LEN first, from a block-level mask that broadcasts (and
    # is skipped when everything is allowed); then mask_mod, in place, on the span of columns
    # that are partial somewhere, applied only to the partial pairs.
    if not bool(idx.allowed.all()):
        scores = torch.where(idx.allowed, scores, -math.inf)
    elif chunk.partial_columns is not None and plan.score_mod is not None:
        # score_mod's result may be saved for its backward, or be an expanded view: the
        # in-place fill below must write into a tensor of our own.
        scores = scores.clone(memory_format=torch.contiguous_format)
    if chunk.partial_columns is not None:
        first, stop = chunk.partial_columns
        by_mask_mod = _call_mod(
            plan.mask_mod,
            (idx.b, idx.h, idx.q_idx, idx.kv_idx[..., first:stop, :]),
            (*full_shape[:-2], stop - first, kv_block),
            mask_eval,
            "mask_mod",
        )
        refused = (idx.kinds[..., first:stop, :] == _PARTIAL) & ~by_mask_mod
        scores[..., first:stop, :].masked_fill_(refused, -math.inf)
    scores = scores.view(*full_shape[:-2], -1)

    # Rows with nothing allowed (by mask or by a score_mod returning -inf) would make softmax
    # 0/0; zeroing their scores keeps every intermediate finite, so forward and gradient are
    # exactly 0 there instead of NaN. Checked first: most chunks have none, and the fix costs
    # two passes over the scores.
    empty_rows = scores.amax(dim=-1, keepdim=True) == -math.inf
    has_empty_rows = bool(empty_rows.any())
    if has_empty_rows:
        scores = scores.masked_fill(empty_rows, 0.0)
    probs = torch.softmax(scores, dim=-1)
    if has_empty_rows:
        probs = probs.masked_fill(empty_rows, 0.0)
    out = probs.view(batch, kv_heads, -1, num_columns * kv_block) @ values
    out = out.view(batch, plan.q_heads, -1, plan.value_dim)
    valid_rows = min(plan.q_len, chunk.stop * q_block) - chunk.start * q_block
    out = out[:, :, :valid_rows].to(q_piece.dtype)
    if not return_lse:
        return (out,)
    lse = torch.logsumexp(scores, dim=-1)
    if has_empty_rows:
        lse = lse.masked_fill(empty_rows.squeeze(-1), -math.inf)
    return out, lse.view(batch, plan.q_heads, -1)[:, :, :valid_rows]


def _resolve_mod_evals(
    plan: _Plan, chunks: list[_Chunk], query: Tensor, mod_eval: str
) -> tuple[str, str]:
    """Turns ``"auto"`` into ``"broadcast"`` or ``"vmap"`` by probing one chunk per mod.

    Probing here, outside autograd and checkpointing, keeps every chunk's forward the same
    sequence of ops on its first run and on its recompute.
    """
    if mod_eval != "auto":
        return mod_eval, mod_eval
    mask_eval = score_eval = "broadcast"
    with torch.no_grad():
        probe = next((c for c in chunks if c.partial_columns is not None), None)
        if probe is not None:
            idx = _chunk_indices(plan, probe, query.device)
            first, stop = probe.partial_columns  # type: ignore[misc]
            shape = (
                plan.batch,
                plan.kv_heads,
                plan.group,
                probe.stop - probe.start,
                plan.q_block,
                stop - first,
                plan.kv_block,
            )
            args = (idx.b, idx.h, idx.q_idx, idx.kv_idx[..., first:stop, :])
            if not _broadcasts(plan.mask_mod, args, shape):
                mask_eval = "vmap"
        if plan.score_mod is not None:
            probe = chunks[0]
            idx = _chunk_indices(plan, probe, query.device)
            shape = (
                plan.batch,
                plan.kv_heads,
                plan.group,
                probe.stop - probe.start,
                plan.q_block,
                probe.columns.numel(),
                plan.kv_block,
            )
            score = torch.zeros(shape, dtype=plan.working_dtype, device=query.device)
            if not _broadcasts(plan.score_mod, (score, idx.b, idx.h, idx.q_idx, idx.kv_idx), shape):
                score_eval = "vmap"
    return mask_eval, score_eval


def _broadcasts(fn: Callable[..., Tensor], args: Sequence[Tensor], shape: tuple[int, ...]) -> bool:
    """True when ``fn`` accepts broadcasting index tensors and answers in ``shape``."""
    try:
        result = fn(*args)
    except Exception:  # any failure means "needs scalars": the vmap path will tell if it is real
        return False
    return isinstance(result, Tensor) and _fits(result, shape)


def _fits(result: Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(result.shape, shape) == torch.Size(shape)
    except RuntimeError:
        return False


def _call_mod(
    fn: Callable[..., Tensor],
    args: Sequence[Tensor],
    shape: tuple[int, ...],
    mod_eval: str,
    name: str,
) -> Tensor:
    if mod_eval == "vmap":
        result = _vmap_broadcast(fn, args, shape)
    else:
        result = fn(*args)
        if not isinstance(result, Tensor) or not _fits(result, shape):
            got = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
            raise ValueError(
                f"{name} called with broadcasting index tensors returned {got}, which does not "
                f"broadcast to the scores' shape {shape}; pass mod_eval='vmap' to call it on "
                "scalars as flex_attention does"
            )
    if name == "mask_mod" and result.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor, got dtype {result.dtype}")
    return result


def _vmap_broadcast(
    fn: Callable[..., Tensor], args: Sequence[Tensor], shape: tuple[int, ...]
) -> Tensor:
    """Calls ``fn`` elementwise on 0-d tensors over the broadcast of ``args`` (which is ``shape``).

    One ``torch.vmap`` level per dim of ``shape`` longer than 1, the way
    ``flex_attention._vmap_for_bhqkv`` nests them, with ``in_dims=None`` for the arguments that
    are broadcast along that dim, so index tensors are never expanded in memory.
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    ndim = len(shape)
    args = [a.reshape((1,) * (ndim - a.dim()) + tuple(a.shape)) for a in args]
    mapped_dims = [d for d in range(ndim) if shape[d] != 1]
    squeezed = [a.reshape([s for s in a.shape if s != 1]) for a in args]
    mapped = fn
    for d in reversed(mapped_dims):
        in_dims = tuple(0 if a.size(d) != 1 else None for a in args)
        mapped = torch.vmap(mapped, in_dims=in_dims)
    # Inside vmap, ``lookup[q_idx]`` must become aten.index to batch; this mode does that.
    with TransformGetItemToIndex():
        result = mapped(*squeezed)
    return result.reshape(shape)
