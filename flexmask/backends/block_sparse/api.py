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

import numbers
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.backends.block_sparse.grouped import (
    IntervalMod,
    grouped_attention,
    interval_bounds,
    recovered_bounds,
)
from flexmask.backends.block_sparse.score_mod import chunked_attention
from flexmask.backends.dense import KERNELS as SDPA_KERNELS
from flexmask.backends.dense import choose_backend, is_causal, sdpa_attention
from flexmask.backends.plan import Plan, make_plan
from flexmask.backends.threads import kernel_workers
from flexmask.builders import built_from
from flexmask.runtime import BuiltOnRead

Backend = Literal["auto", "sparse", "sdpa"]
"""Which kernel runs: see :func:`block_sparse_attention` and :func:`choose_backend`."""

_BACKENDS = ("auto", "sparse", "sdpa")

ModEval = Literal["auto", "broadcast", "vmap"]
"""How ``mask_mod``/``score_mod`` are evaluated: see :func:`block_sparse_attention`."""


# 1 Mi elements: 4 MiB per fp32 score-sized temporary; softmax and its backward keep a handful
# alive at once, so one chunk peaks near 25 MiB. Smaller chunks keep a group's temporaries in
# cache and deal evenly to the threads, down to where the Python per group starts to cost
# (benchmarks/bench_chunk.py; docs/costs.md, "The thresholds in the code").
DEFAULT_MAX_CHUNK_ELEMENTS = 1 << 20

# Probabilities kept for the backward by default (recompute=None): enough to skip the rebuild
# for every group up to ~8k tokens x 4 heads of a sparse mask, small next to a training step.
DEFAULT_MEMORY_BUDGET = 256 << 20


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
    kernel: Backend = "auto",
    mask: Mask | None = None,
    threads: int | None = None,
    backend: Backend | None = None,
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
            holds (``B x Hq x rows x columns``): a group runs a part of the (batch row,
            kv head) pairs where one q block over all of them would exceed it; one q block
            of one batch row and kv head is never split, so that much may exceed it.
        kernel: ``"sparse"`` runs the block-sparse kernel; ``"sdpa"`` builds the dense bool
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
            (``threads.ThreadChoice``). The result is the same every way. On
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
    kernel = kernel_option(kernel, backend, warn=True)
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
            raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
        threads = int(threads)  # numpy integers too
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be the flexmask Mask block_mask was built from, or None, got "
            f"{type(mask).__name__}"
        )
    if isinstance(block_mask, BuiltOnRead):
        # A handle: its built BlockMask, which knows the Mask it came from (the handle's own
        # fields are the same tensors, but not the record of the Mask, so the partial blocks
        # would be evaluated through the mask_mod instead of read from intervals).
        block_mask = block_mask.block_mask
    plan = make_plan(query, key, value, block_mask, score_mod, scale, enable_gqa, mod_eval)
    workers = kernel_workers(threads, query.device)
    mask = _checked_mask(block_mask, mask)
    if plan.batch == 0:
        return _empty_batch(query, key, value, return_lse)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    kernel = route(plan, mask, score_mod, return_lse, kernel, needs_grad)
    if kernel in ("sdpa_causal", "sdpa_dense"):
        return sdpa_attention(query, key, value, plan, mod_eval, kernel == "sdpa_causal")
    bounds = None if mask is None else interval_bounds(mask, plan)
    if bounds is not None:
        # Every later evaluation of the mask (score_mod path, grouped kernel) reads the intervals.
        plan = replace(plan, mask_mod=IntervalMod(bounds))
    if bounds is None:
        # No Mask to say so, or one whose rows are not intervals: mask_mod read once on the
        # partial blocks may still show intervals there, and intervals are what makes a
        # torch-built BlockMask as fast as the same mask from its Mask.
        bounds = recovered_bounds(plan, mod_eval)
        if bounds is not None:
            plan = replace(plan, mask_mod=IntervalMod(bounds))
    if score_mod is None:
        save_budget = {None: memory_budget, True: 0, False: 1 << 62}[recompute]
        out, lse = grouped_attention(
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
    return chunked_attention(
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


KERNELS = {
    **SDPA_KERNELS,
    "grouped": "flexmask's grouped block-sparse kernel (torch ops over the listed tiles)",
    "score_mod": "flexmask's chunked score_mod kernel (torch ops over the listed tiles)",
}
"""What ``block_sparse_attention`` calls, by its route: the words ``explain`` reports."""


def route(
    plan: Plan,
    mask: Mask | None,
    score_mod: Callable[..., Tensor] | None,
    return_lse: bool,
    backend: str,
    needs_grad: bool,
) -> str:
    """Which kernel ``block_sparse_attention`` hands a call to (a key of ``KERNELS``): SDPA
    where it is faster (``choose_backend``) or asked for, else its own kernels."""
    if score_mod is None and not return_lse and backend != "sparse":
        # Decided before the intervals are read: SDPA's dense mask from the BlockMask's own
        # mask_mod (the sdpa backend's ops, nothing more) costs no more than the same mask
        # from the intervals plus reading them (docs/costs.md, "The thresholds in the code").
        causal = is_causal(plan, mask)
        if backend == "auto":
            backend = choose_backend(plan, mask, needs_grad=needs_grad, causal=causal)
        if backend == "sdpa":
            return "sdpa_causal" if causal else "sdpa_dense"
    return "grouped" if score_mod is None else "score_mod"


def kernel_of(
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
    kernel: Backend = "auto",
    mask: Mask | None = None,
    backend: Backend | None = None,
    **_: object,
) -> str:
    """What ``block_sparse_attention`` with these arguments calls (``KERNELS``' words)."""
    kernel = kernel_option(kernel, backend, warn=False)  # the call itself warns
    plan = make_plan(query, key, value, block_mask, score_mod, scale, enable_gqa, mod_eval)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    mask = _checked_mask(block_mask, mask)
    return KERNELS[route(plan, mask, score_mod, return_lse, kernel, needs_grad)]


def kernel_option(kernel: Any, backend: Any, warn: bool) -> Backend:
    """The path's kernel switch, ``kernel=``; ``backend=``, its name before 0.2 (which read
    as a flexmask backend's name everywhere else), with a DeprecationWarning."""
    if backend is not None:
        if kernel != "auto" and kernel != backend:
            raise TypeError(
                f"got kernel={kernel!r} and backend={backend!r}: backend= is kernel='s old "
                "name; pass kernel= only"
            )
        if warn:
            warnings.warn(
                "block_sparse_attention(backend=...) is renamed kernel=... (it picks this "
                f"path's kernel, not a flexmask backend): pass kernel={backend!r}",
                DeprecationWarning,
                stacklevel=3,
            )
        kernel = backend
    if kernel not in _BACKENDS:
        raise ValueError(f"kernel must be one of {_BACKENDS}, got {kernel!r}")
    return cast(Backend, kernel)


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
