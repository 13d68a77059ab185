"""The kernel call: flex_attention with a handle, a BlockMask or a mask expression.

Every call is checked once (``backends.request.make_request``) and handed to the first
backend of one order per device (``backends.order``) that takes it, for ``flex_attention``
and ``attention("auto")`` alike. On an accelerator torch's kernel runs — compiled once per
process (static shapes: one graph per sequence length and mask kind) unless compilation is
turned off. On the CPU, where torch has no backward and a first compiled call costs 20-40 s,
flexmask's backends run: a few queries against a cache (``decode``), torch's fused CPU flash
kernel once per slice of the mask (documents, trees, prefix masks: ``slices``), else the
differentiable block-sparse path driven by the same BlockMask (or SDPA where that is
faster). torch's compiled CPU kernel runs where asked by name (``attention(..., "flex",
compile=True)``). ``explain`` says which backend and which kernel a call gets.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask import backends
from flexmask.algebra import Mask
from flexmask.backends import (  # noqa: F401 - re-exported
    ENV_COMPILE,
    Deferred,
    Request,
    attend_checked,
    check_fits,
    check_tensors,
    compiled_flex_attention,
    make_request,
)
from flexmask.builders import BlockStats, block_stats, build, built_from
from flexmask.runtime import LazyBlockMask, Spec, default_cache, make_spec

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


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Callable[..., Tensor] | None = None,
    block_mask: LazyBlockMask | BlockMask | Mask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    compile: bool | None = None,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """torch's ``flex_attention``, taking a lazy handle or a mask expression as its mask too.

    The signature and semantics are torch's — the same positional order, ``block_mask=``,
    ``kernel_options=``, ``return_lse`` — so code written for torch's call runs unchanged;
    :func:`attention` is flexmask's own call (``mask=``, ``backend=``).

    Args:
        query: (B, Hq, Q_LEN, D). key, value: (B, Hkv, KV_LEN, D).
        score_mod: as for torch's flex_attention.
        block_mask: a ``flexmask.lazy`` handle (built on first use, shared by every layer
            that passes it), a torch BlockMask, a flexmask Mask (built through the
            process-wide cache for the shapes of ``query`` and ``key``), or None.
        scale, enable_gqa: as for torch's flex_attention: any finite ``scale`` (0 gives every
            attended key the same weight), any truthy ``enable_gqa``.
        return_lse: also return the log-sum-exp of the scores, ``(B, Hq, Q_LEN)``, as torch's
            flex_attention does: natural log, float32 (float64 for float64 inputs), ``-inf``
            for a query that attends nothing (its output is 0).
        kernel_options: torch's kernel options (``BACKEND``, block sizes, ...), passed to
            torch's kernel unchanged on accelerators. On the CPU flexmask's own backends run
            the call and these GPU tuning knobs are ignored (checked to be a dict or None).
        compile: where torch's kernel runs, compile it (once per process); None follows
            ``set_compile`` / FLEXMASK_COMPILE where either is set, and otherwise compiles on
            accelerators but not on the CPU (whose first compiled call takes 20-40 s). On
            the CPU flexmask's backends take the call first, whatever ``compile`` says.
        **kwargs: the block-sparse path's options (``threads``, ``memory_budget``,
            ``recompute``, ``max_chunk_elements``, ``kernel``, ``mod_eval``: see
            ``flexmask.block_sparse.block_sparse_attention``; a call with them runs that
            path). A keyword no backend takes is a TypeError naming the right one.

    Before 0.2 this call took ``(query, key, value, block_mask, score_mod)`` and ``mask=``:
    a mask given where ``score_mod`` goes, or as ``mask=``, still works this release with a
    DeprecationWarning.

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
    score_mod, block_mask = _torch_order(score_mod, block_mask, kwargs)
    options = _flex_options(query, kernel_options, kwargs)
    request = _request(
        query, key, value, block_mask, score_mod, scale, enable_gqa, return_lse, compile, options
    )
    # The first backend of the device's order that takes the call, as attention("auto"):
    # on accelerators torch's kernel; on the CPU the slices backend where the mask is a few
    # big slices, else the block-sparse path, driven by the same BlockMask.
    return _run(backends.choose(request), request)


_MASKS = (LazyBlockMask, BlockMask, Mask)
_BOTH_MASKS = (
    "got both block_mask= and mask=, which are one argument under two names: pass one "
    "(flex_attention's is torch's block_mask=, attention's and explain's mask=)"
)


def _torch_order(score_mod: Any, block_mask: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(score_mod, block_mask)`` of a flex_attention call, read in torch's order; a mask
    where ``score_mod`` goes (the pre-0.2 order) or given as ``mask=`` is taken with a
    DeprecationWarning — a mask is never a score_mod, so neither can be misread."""
    if isinstance(score_mod, _MASKS):
        if isinstance(block_mask, _MASKS):
            raise TypeError(
                "flex_attention takes torch's order (query, key, value, score_mod, "
                "block_mask): got a mask for both score_mod and block_mask"
            )
        _deprecated(
            "flex_attention(query, key, value, block_mask, score_mod) is the pre-0.2 order: "
            "it takes torch's (query, key, value, score_mod, block_mask); pass block_mask= by "
            "keyword"
        )
        score_mod, block_mask = block_mask, score_mod
    if "mask" in kwargs:
        mask = kwargs.pop("mask")
        if block_mask is not None and mask is not None:
            raise TypeError(_BOTH_MASKS)
        _deprecated(
            "flex_attention(mask=...) is deprecated: flex_attention takes torch's "
            "block_mask=; mask= is flexmask.attention's name"
        )
        block_mask = mask if block_mask is None else block_mask
    return score_mod, block_mask


def _flex_options(query: Any, kernel_options: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The backend options of a flex_attention call: torch's ``kernel_options`` where torch's
    kernel may run (not on the CPU, where flexmask's backends ignore GPU tuning), and the
    block-sparse path's options; ``backend=`` is that path's kernel switch's old name, never
    a flexmask backend's (``attention`` picks those)."""
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(
            f"kernel_options must be a dict of torch's kernel options or None, got "
            f"{type(kernel_options).__name__}"
        )
    if "backend" in kwargs and kwargs["backend"] not in ("auto", "sparse", "sdpa"):
        raise TypeError(
            f"flex_attention takes torch's arguments; backend={kwargs['backend']!r} names a "
            f"flexmask backend, which flexmask.attention(query, key, value, mask, "
            f"backend={kwargs['backend']!r}) runs (flex_attention's backend= was the "
            "block-sparse path's kernel switch, now kernel=)"
        )
    on_cpu = isinstance(query, Tensor) and query.device.type == "cpu"
    if kernel_options is not None and not on_cpu:
        return {**kwargs, "kernel_options": kernel_options}
    return dict(kwargs)


def _deprecated(message: str) -> None:
    warnings.warn(message, DeprecationWarning, stacklevel=4)


def _run(backend: Any, request: Request) -> Tensor | tuple[Tensor, Tensor]:
    """One call through ``backend``: an empty call's result without a kernel; on the CPU,
    no masked-out non-finite value reaching an output (``backends.finite``)."""
    if request.empty:
        return request.empty_result()
    return attend_checked(backend, backend.lower(request))


def _one_mask(block_mask: Any, mask: Any) -> Any:
    """The mask of an ``attention`` or ``explain`` call: ``mask``; ``block_mask=`` (torch's
    name, which these took as well before 0.2) with a DeprecationWarning."""
    if block_mask is None:
        return mask
    if mask is not None:
        raise TypeError(_BOTH_MASKS)
    _deprecated(
        "attention(block_mask=...) and explain(block_mask=...) are deprecated: they take "
        "mask= (flex_attention takes torch's block_mask=)"
    )
    return block_mask


def _request(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: LazyBlockMask | BlockMask | Mask | None,
    score_mod: Callable[..., Tensor] | None,
    scale: float | None,
    enable_gqa: bool,
    return_lse: bool,
    compile: bool | None,
    options: dict[str, Any],
) -> Request:
    """One call as the backends see it, checked once (``make_request``): the BlockMask
    resolved (for a Mask, deferred until a backend reads it: the slices backend lowers the
    Mask itself), the Mask behind it kept."""
    backends.check_options(options)
    resolved: BlockMask | Deferred | None
    if isinstance(mask, LazyBlockMask) and _edited(mask):
        mask = mask.block_mask  # its tensors edited in place: its blocks say what is attended
    if isinstance(mask, Mask):
        # Validated here, once, whichever backend runs: its spec builds the BlockMask where
        # a backend reads one, and a backend lowering the Mask itself (slices, varlen)
        # trusts it (``formats.validated_window``).
        check_tensors(query, key, value, bool(enable_gqa))
        spec = _spec(mask, query, key)
        resolved = Deferred(lambda: default_cache().get_spec(spec)[1], spec) if spec else None
    elif isinstance(mask, LazyBlockMask):
        # A handle checked against the tensors by its recipe, so that a backend lowering its
        # Mask (slices, varlen) never builds it: a handle builds where a backend reads it.
        _check_fits(mask, query, key)
        given = mask
        resolved = Deferred(lambda: cast(BlockMask, resolve_block_mask(given, query, key)))
    else:
        _check_fits(mask, query, key)
        resolved = resolve_block_mask(mask, query, key)
    # The Mask behind the BlockMask, where flexmask built it: the block-sparse path reads
    # partial blocks from its intervals and recognises plain causal from its key.
    structure = mask.mask if isinstance(mask, LazyBlockMask) else mask
    if compile is None:
        requested = _compile_requested()
        use_compile = (query.device.type != "cpu") if requested is None else requested
    else:
        use_compile = compile
    return make_request(
        query,
        key,
        value,
        resolved,
        structure if isinstance(structure, Mask) else None,
        score_mod,
        scale,
        enable_gqa,
        return_lse,
        use_compile,
        options,
    )


def _spec(mask: Mask, query: Tensor, key: Tensor) -> Spec | None:
    """The spec of a Mask for this call's sizes (the mask validated against them), or None
    for an empty call (no BlockMask is read)."""
    batch, heads, q_len = query.shape[:3]
    kv_len = key.shape[-2]
    if min(batch, heads, q_len, kv_len) == 0:
        return None
    return make_spec(mask, batch, heads, q_len, kv_len, query.device)


def _edited(handle: LazyBlockMask) -> bool:
    """Whether the handle holds a BlockMask whose tensors were edited in place (through the
    handle's fields, which are the built BlockMask's)."""
    return handle.built and built_from(handle.block_mask, blocks=True) is None


def _check_fits(mask: Any, query: Any, key: Any) -> None:
    """A BlockMask or a handle is made for one pair of lengths and one device; it must be
    used with those, whichever backend runs (one that lowers the Mask behind it would
    otherwise lower it for the tensors' lengths, not the ones it was built for). Checked
    here for every call (``make_plan`` checks a BlockMask given to the block-sparse path
    directly the same way); tensors that are not (B, H, S, D) are left to the backends."""
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (query, key)):
        return
    device: torch.device | None
    if isinstance(mask, LazyBlockMask):  # its recipe: reading a BlockMask field would build
        # The dims of the BlockMask it builds: B (H) is 1 where the mask ignores the row (head).
        built = mask.spec.reduced()
        lengths, dims = (mask.Q_LEN, mask.KV_LEN), (built.batch, built.heads)
        device = None if mask.device is None else torch.device(mask.device)  # None: query's
        structure: Mask | None = mask.mask
    elif isinstance(mask, BlockMask):
        lengths, device = (mask.seq_lengths[0], mask.seq_lengths[1]), mask.kv_num_blocks.device
        dims = (mask.kv_num_blocks.size(0), mask.kv_num_blocks.size(1))
        structure = built_from(mask)
    else:
        return
    per_row = structure is not None and structure.batch_dependent
    check_fits(lengths, device, query, key, dims, per_row)


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: LazyBlockMask | BlockMask | Mask | None = None,
    backend: str = "auto",
    *,
    score_mod: Callable[..., Tensor] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    compile: bool | None = None,
    block_mask: LazyBlockMask | BlockMask | Mask | None = None,
    **options: Any,
) -> backends.Choice:
    """Which backend :func:`attention` would run for this call, the kernel it calls, and
    why each other one cannot; runs no attention (a Mask's BlockMask may be built, where the
    chosen backend reads it to decide its kernel). Arguments as for :func:`attention`.

    ``choice.blocks`` reads the call's BlockMask at its block shape (building a Mask's): the
    mask's exact density and its shares of non-empty and partial blocks, which kernels
    choose on (:func:`flexmask.builders.block_stats`); None without a mask.

    Example:
        >>> import flexmask, torch
        >>> q = k = v = torch.randn(1, 2, 256, 16, requires_grad=True)
        >>> choice = flexmask.explain(q, k, v, flexmask.causal() & flexmask.document([100, 156]))
        >>> choice.backend
        'slices'
        >>> choice.kernel.split(", ")[-1]  # torch's CPU flash kernel, once per document
        '2 calls'
        >>> print(choice.refused["varlen"])
        varlen_attn and flash-attn run on CUDA only, and this call is on cpu
        >>> print(choice.blocks)
        density 0.2639 (17296 of 65536 pairs); blocks of 128 x 128: 75.00% non-empty, 75.00% partial
    """
    mask = _one_mask(block_mask, mask)
    request = _request(
        query, key, value, mask, score_mod, scale, enable_gqa, return_lse, compile, options
    )
    choice = _choice(request, backend)
    if request.block_mask is None or request.empty:
        return choice
    return choice._replace(blocks=_block_stats(request, mask))


def _block_stats(request: Request, mask: Any) -> BlockStats:
    """``block_stats`` of the call's BlockMask. One not built yet (the chosen backend lowers
    the Mask itself) is built here from its spec outside every cache: explain leaves the
    cache, and a handle's build count, as the call would."""
    deferred = request.block_mask
    if isinstance(deferred, Deferred) and not deferred.built:
        spec = deferred.spec or (mask.spec if isinstance(mask, LazyBlockMask) else None)
        if spec is not None:
            return block_stats(build(spec.mask, spec.reduced().grid()))
    built = request.built().block_mask
    assert isinstance(built, BlockMask)  # not None: explain asks only where a mask is
    return block_stats(built)


def _choice(request: Request, backend: str, with_kernel: bool = True) -> backends.Choice:
    """The backend for the call; ``with_kernel``: and what it will call (explain's question,
    which may cost a build and a plan; a call that runs asks its backend nothing more)."""
    if backend == "auto":
        return backends.rank(request, with_kernel=with_kernel)
    if backend not in backends.TABLE:
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(backends.TABLE)}, got {backend!r}"
        )
    return backends.rank(request, (backend,), with_kernel=with_kernel)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: LazyBlockMask | BlockMask | Mask | None = None,
    backend: str = "auto",
    *,
    score_mod: Callable[..., Tensor] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    compile: bool | None = None,
    block_mask: LazyBlockMask | BlockMask | Mask | None = None,
    **options: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with a mask, run by the fastest backend that can take it on this device.

    Args:
        query: (B, Hq, Q_LEN, D). key, value: (B, Hkv, KV_LEN, D).
        mask: a ``flexmask.lazy`` handle, a torch BlockMask, a flexmask Mask (built through
            the process-wide cache for the shapes of ``query`` and ``key``), or None (every
            query attends every key). ``block_mask=``, its name before 0.2 too, warns.
        backend: ``"auto"`` asks the backends in ``flexmask.backends.AUTO``'s order for the
            device (fastest first, as measured by ``benchmarks/bench_backends.py``) and runs
            the first that takes the call; or a name of ``flexmask.backends.TABLE``
            (``"flex"``, ``"slices"``, ``"block_sparse"``, ``"sdpa"``, ``"varlen"``), which raises
            ValueError saying why where that backend cannot run the call.
        score_mod, scale, enable_gqa, return_lse, compile: as for :func:`flex_attention`.
        **options: the chosen backend's options (e.g. ``threads`` for block_sparse).

    Returns:
        The output (B, Hq, Q_LEN, Dv), or (output, lse) with ``return_lse``. Every backend
        gives a query that attends nothing 0 (and zero gradients).

    Raises:
        ValueError: the named backend (or, with ``"auto"``, every backend) cannot run the
            call; the message says why (:func:`explain` shows it without running anything).

    Example:
        >>> import flexmask, torch
        >>> q = k = v = torch.randn(2, 2, 300, 16)
        >>> mask = flexmask.causal() & flexmask.document([100, 200])
        >>> out = flexmask.attention(q, k, v, mask)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q, k, v, attn_mask=mask.to_dense(1, 1, 300, 300))
        >>> torch.allclose(out, ref, atol=1e-5)
        True
    """
    mask = _one_mask(block_mask, mask)
    request = _request(
        query, key, value, mask, score_mod, scale, enable_gqa, return_lse, compile, options
    )
    choice = _choice(request, backend, with_kernel=False)
    if not choice.backend:
        refusals = "; ".join(f"{name}: {reason}" for name, reason in choice.refused.items())
        what = "no attention backend can" if backend == "auto" else f"backend={backend!r} cannot"
        raise ValueError(f"{what} run this call ({refusals})")
    return _run(backends.TABLE[choice.backend], request)
