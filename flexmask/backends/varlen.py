"""The varlen backend: FlashAttention's variable-length kernels on packed tokens.

``flash_attn.flash_attn_varlen_func`` where flash-attn is installed, else torch's
``torch.nn.attention.varlen.varlen_attn``. The mask is lowered exactly by
``flexmask.formats.to_varlen`` (documents, causal, one sliding window, padding: each
document becomes one kernel sequence) or the call is refused with its reason. q, k and v are
gathered from ``(B, H, S, D)`` into the packed ``(total, H, D)`` layout and the output
scattered back; a query in no sequence (padding, or one that attends nothing) gets 0 and zero
gradients, the policy of every other backend (flex_attention's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flexmask.algebra import Mask
from flexmask.backends.request import Request
from flexmask.formats import VarlenMask, validated_window, varlen_of
from flexmask.pieces import Full
from flexmask.runtime import on_cache_clear

NAME = "varlen"
OPTIONS: tuple[str, ...] = ()
DTYPES = (torch.float16, torch.bfloat16)
"""What both kernels take."""


def flash_attn_varlen_func() -> Callable[..., Any] | None:
    """flash-attn's ``flash_attn_varlen_func``, or None where flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func as kernel
    except ImportError:
        return None
    return kernel  # type: ignore[no-any-return]


def torch_varlen_attn() -> Callable[..., Any] | None:
    """torch's ``varlen_attn`` (torch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def can_take(request: Request) -> str | None:
    if request.query.device.type != "cuda":
        return (
            f"varlen_attn and flash-attn run on CUDA only, and this call is on "
            f"{request.query.device.type}"
        )
    if flash_attn_varlen_func() is None and torch_varlen_attn() is None:
        return (
            "neither flash-attn (pip install flash-attn) nor torch.nn.attention.varlen."
            "varlen_attn (torch >= 2.10) is installed"
        )
    if request.score_mod is not None:
        return "the varlen kernels take no score_mod"
    if request.return_lse:
        return "flexmask's varlen backend returns no log-sum-exp"
    if request.query.dtype not in DTYPES:
        return f"the varlen kernels take float16 or bfloat16, got {request.query.dtype}"
    if request.mask is None and request.block_mask is not None:
        return "it lowers a flexmask Mask, and this call brings a BlockMask without one"
    lowered = _lower(request)
    return lowered if isinstance(lowered, str) else None


def lower(request: Request) -> Request:
    """The mask lowered by ``to_varlen``: handed to ``attend`` as the Request's ``lowered``."""
    lowered = _lower(request)
    if isinstance(lowered, str):
        raise ValueError(f"backend 'varlen' cannot run this call: {lowered}")
    return request._replace(lowered=lowered)


def kernel_name(request: Request) -> str:
    if flash_attn_varlen_func() is not None:
        return "flash_attn.flash_attn_varlen_func on packed tokens"
    return "torch.nn.attention.varlen.varlen_attn on packed tokens"


def attend(request: Request) -> Tensor:
    """Gather to packed tokens, run the kernel, scatter back (zeros where no sequence)."""
    lowered: VarlenMask = request.lowered
    q, k, v = (x.transpose(1, 2) for x in (request.query, request.key, request.value))
    packed_q, packed_k, packed_v = lowered.pack_q(q), lowered.pack_kv(k), lowered.pack_kv(v)
    flash = flash_attn_varlen_func()
    if flash is not None:
        out = flash(
            packed_q, packed_k, packed_v, softmax_scale=request.scale, **lowered.flash_attn_kwargs()
        )
    else:
        kernel = torch_varlen_attn()
        if kernel is None:  # can_take refused this; lower() was called without it
            raise RuntimeError("neither flash-attn nor torch's varlen_attn is installed")
        out = kernel(
            packed_q,
            packed_k,
            packed_v,
            scale=request.scale,
            enable_gqa=request.enable_gqa,
            **lowered.varlen_attn_kwargs(),
        )
    return lowered.unpack(out).transpose(1, 2)


def _lower(request: Request) -> VarlenMask | str:
    mask = request.mask if request.mask is not None else Full()
    batch, q_len, kv_len = request.query.shape[0], request.query.shape[-2], request.key.shape[-2]
    return _lowered(mask, batch, q_len, kv_len, request.query.device)


@functools.lru_cache(maxsize=8)
def _lowered(
    mask: Mask, batch: int, q_len: int, kv_len: int, device: torch.device
) -> VarlenMask | str:
    """``to_varlen``'s result, or its refusal; kept for the few calls of one step (can_take,
    then lower; every layer of a model) — a Mask hashes by its content."""
    try:
        return varlen_of(mask, validated_window(batch, q_len, kv_len), device)
    except ValueError as err:
        return str(err)


on_cache_clear(_lowered.cache_clear)
