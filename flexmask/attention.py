"""The kernel call: flex_attention with a handle, a BlockMask or a mask expression.

On a device whose flex_attention kernel has a backward, torch's kernel runs — compiled once
per process (static shapes: one graph per sequence length and mask kind) unless compilation
is turned off. On the CPU, where torch has no backward, a call that needs gradients runs the
differentiable block-sparse path driven by the same BlockMask. A no-grad CPU call runs it
too (or SDPA, where that is faster) unless compilation was asked for — ``compile=True``,
``set_compile(True)`` or ``FLEXMASK_COMPILE=1`` — because the first compiled CPU call costs
20-40 s per sequence length and mask kind: worth it for many calls, not for one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

from flexmask.algebra.mask import Mask
from flexmask.backends.block_sparse.api import block_sparse_attention
from flexmask.pieces import Full
from flexmask.runtime.cache import default_cache
from flexmask.runtime.lazy import LazyBlockMask

ENV_COMPILE = "FLEXMASK_COMPILE"
BLOCK_SPARSE_OPTIONS = (
    "threads",
    "memory_budget",
    "recompute",
    "max_chunk_elements",
    "backend",
    "mod_eval",
)
"""block_sparse_attention's options that flex_attention passes through where that path runs."""

_compiled: Callable[..., Any] | None = None
_compiled_lock = threading.Lock()
_logger = logging.getLogger("flexmask")
_announced: set[tuple] = set()
"""Shapes whose first compiled call has been announced in this process."""
_compile_default: bool | None = None


def set_compile(enabled: bool | None) -> None:
    """Turns compilation of torch's flex_attention on or off for this process.

    None returns to the default, read from FLEXMASK_COMPILE (``0``/``false``/``off`` turns
    it off; on otherwise).
    """
    global _compile_default
    _compile_default = None if enabled is None else bool(enabled)


def compile_enabled() -> bool:
    """Whether flexmask.flex_attention compiles torch's kernel by default."""
    if _compile_default is not None:
        return _compile_default
    raw = os.environ.get(ENV_COMPILE, "1").strip().lower()
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(
        f"environment variable {ENV_COMPILE}={raw!r} must be 1/0, true/false or on/off"
    )


def _compile_requested() -> bool | None:
    """The process's explicit choice (``set_compile`` or FLEXMASK_COMPILE set), else None."""
    if _compile_default is not None:
        return _compile_default
    if ENV_COMPILE in os.environ:
        return compile_enabled()
    return None


def compiled_flex_attention() -> Callable[..., Any]:
    """torch's flex_attention compiled once for the process, with static shapes.

    Static because, measured with torch 2.13 on CPU, automatic dynamic shapes kick in on the
    second sequence length and the CPU kernel then failed to build; bucket sequence lengths
    (e.g. pack to a few fixed ``max_len``) so each length compiles once.
    """
    global _compiled
    with _compiled_lock:
        if _compiled is None:
            _compiled = torch.compile(torch_flex_attention, dynamic=False)
        return _compiled


def _announce_compile(query: Tensor, key: Tensor) -> None:
    """One log line, once per process and shape, before a call that may compile for minutes.

    A WARNING, so it shows without any logging set up: the wait would otherwise look like a
    hang. ``logging.getLogger("flexmask").setLevel(logging.ERROR)`` silences it.
    """
    shape = (query.device.type, tuple(query.shape), tuple(key.shape), query.dtype)
    with _compiled_lock:
        if shape in _announced:
            return
        _announced.add(shape)
    _logger.warning(
        "flexmask: compiling flex_attention for query %s, key %s (%s) on %s; the first call "
        "of each shape takes ~20-50 s on a CPU (%s=0 or flexmask.set_compile(False) turns "
        "compilation off)",
        tuple(query.shape),
        tuple(key.shape),
        str(query.dtype).removeprefix("torch."),
        query.device.type,
        ENV_COMPILE,
    )


def resolve_block_mask(
    block_mask: LazyBlockMask | BlockMask | Mask | None, query: Tensor, key: Tensor
) -> BlockMask | None:
    """A BlockMask from whatever the caller passed (shapes of a Mask come from q and k).

    A handle gives its built, plain BlockMask: the compiled kernel then sees the same type
    whether a handle or a BlockMask was passed (one graph for both).
    """
    if isinstance(block_mask, LazyBlockMask):  # before BlockMask: a handle is one too
        return block_mask.block_mask
    if block_mask is None or isinstance(block_mask, BlockMask):
        return block_mask
    if isinstance(block_mask, Mask):
        return default_cache().get(
            block_mask,
            query.shape[0],
            query.shape[1],
            query.shape[-2],
            key.shape[-2],
            query.device,
        )
    raise TypeError(
        "block_mask must be a flexmask handle (flexmask.lazy), a torch BlockMask, a flexmask "
        f"Mask or None, got {type(block_mask).__name__}"
    )


def _full_block_mask(query: Tensor, key: Tensor) -> BlockMask:
    return default_cache().get(Full(), 1, 1, query.shape[-2], key.shape[-2], query.device)


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: LazyBlockMask | BlockMask | Mask | None = None,
    score_mod: Callable[..., Tensor] | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    compile: bool | None = None,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """FlexAttention with a lazy handle, a BlockMask or a mask expression.

    Args:
        query: (B, Hq, Q_LEN, D). key, value: (B, Hkv, KV_LEN, D).
        block_mask: a ``flexmask.lazy`` handle (built on first use, shared by every layer
            that passes it), a torch BlockMask, a flexmask Mask (built through the
            process-wide cache for the shapes of ``query`` and ``key``), or None.
        score_mod: as for torch's flex_attention.
        scale, enable_gqa: as for torch's flex_attention.
        return_lse: also return the log-sum-exp of the scores, ``(B, Hq, Q_LEN)``, as torch's
            flex_attention does: natural log, float32 (float64 for float64 inputs), ``-inf``
            for a query that attends nothing (its output is 0).
        compile: compile torch's kernel (once per process); None follows ``set_compile`` /
            FLEXMASK_COMPILE where either is set, and otherwise compiles on accelerators but
            not on the CPU (whose first compiled call takes 20-40 s): a no-grad CPU call then
            runs the block-sparse path, or SDPA where that is faster.
        **kwargs: passed to torch's flex_attention (e.g. ``kernel_options``); where the
            block-sparse path runs (the CPU with gradients or compile off) its options
            instead — ``threads``, ``memory_budget``, ``recompute``, ``max_chunk_elements``,
            ``backend``, ``mod_eval`` (see ``flexmask.block_sparse.block_sparse_attention``);
            those raise TypeError where torch's kernel runs.

    Returns:
        The attention output, (B, Hq, Q_LEN, Dv); with ``return_lse`` the pair (output, lse).
        A batch of size 0 gives empty tensors, like torch's.

    Example:
        >>> import flexmask, torch
        >>> q = k = v = torch.randn(1, 2, 300, 16)
        >>> mask = flexmask.causal() & flexmask.document([100, 200])
        >>> out = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q, k, v, attn_mask=mask.to_dense(1, 1, 300, 300))
        >>> torch.allclose(out, ref, atol=1e-5)
        True
    """
    resolved = resolve_block_mask(block_mask, query, key)
    # The Mask behind the BlockMask, where flexmask built it: the block-sparse path reads
    # partial blocks from its intervals and recognises plain causal from its key.
    structure = block_mask.mask if isinstance(block_mask, LazyBlockMask) else block_mask
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    on_cpu = query.device.type == "cpu"
    if compile is None:
        requested = _compile_requested()
        use_compile = (not on_cpu) if requested is None else requested
    else:
        use_compile = compile
    # torch has no flex backward on the CPU, and its uncompiled CPU forward materialises the
    # full score matrix and re-traces the mask for every new BlockMask: the block-sparse path
    # serves both cases, driven by the same BlockMask.
    knobs = {name: kwargs.pop(name) for name in BLOCK_SPARSE_OPTIONS if name in kwargs}
    if on_cpu and (needs_grad or not use_compile):
        if kwargs:
            raise TypeError(
                f"on the CPU flexmask runs its block-sparse path here (gradients needed or "
                f"compile off), which takes none of torch's extra flex_attention options; got "
                f"{sorted(kwargs)} (it takes {', '.join(BLOCK_SPARSE_OPTIONS)})"
            )
        if resolved is None:
            resolved = _full_block_mask(query, key)
        return block_sparse_attention(
            query,
            key,
            value,
            resolved,
            score_mod=score_mod,
            scale=scale,
            enable_gqa=enable_gqa,
            return_lse=return_lse,
            mask=structure if isinstance(structure, Mask) else None,
            **knobs,
        )
    if knobs:
        raise TypeError(
            f"{sorted(knobs)} tune flexmask's block-sparse CPU path, but torch's flex_attention "
            f"kernel runs this call (device {query.device.type}, compile={use_compile}): drop "
            f"them, or pass compile=False on the CPU"
        )
    if use_compile:
        _announce_compile(query, key)
    fn = (
        compiled_flex_attention() if use_compile else cast(Callable[..., Any], torch_flex_attention)
    )
    return fn(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=resolved,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=return_lse,
        **kwargs,
    )
