"""The block-sparse backend: flexmask's own differentiable attention over a BlockMask's
tiles, for CPUs and for devices without a compiled flex_attention.

* ``api`` — ``block_sparse_attention``: its options checked, then SDPA, grouped or score_mod;
* ``grouped`` — the driver of the grouped kernel (no ``score_mod``): slices, partial-block masks;
* ``kernel`` — the grouped kernel over gathered kv tiles, with its own backward;
* ``score_mod`` — the chunked, checkpointed kernel that evaluates a ``score_mod``.

How its groups share the CPU (``ThreadChoice``) is ``flexmask.backends.threads``, shared with
the slices backend.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.backends.block_sparse.api import (
    DEFAULT_MAX_CHUNK_ELEMENTS,
    block_sparse_attention,
    kernel_of,
)
from flexmask.backends.request import Request
from flexmask.pieces import Full
from flexmask.runtime import default_cache

NAME = "block_sparse"
OPTIONS = (
    "threads",
    "memory_budget",
    "recompute",
    "max_chunk_elements",
    "kernel",
    "mod_eval",
    "backend",
)
"""block_sparse_attention's options that flexmask.flex_attention passes through (``backend``:
``kernel``'s name before 0.2, with a DeprecationWarning)."""


def can_take(request: Request) -> str | None:
    # Any CPU call (the order asks the cheaper CPU backends before it).
    if not request.on_cpu:
        return f"it serves the CPU, and this call is on {request.query.device.type}"
    return None


def lower(request: Request) -> Request:
    """The BlockMask built, and no mask made the full one (from the cache). Its options were
    checked before it was asked (``backends.refusal``)."""
    request = request.built()
    if request.block_mask is None:
        q_len, kv_len = request.query.shape[-2], request.key.shape[-2]
        full = default_cache().get(Full(), 1, 1, q_len, kv_len, request.query.device)
        request = request._replace(block_mask=full)
    return request


def kernel_name(request: Request) -> str:
    assert isinstance(request.block_mask, BlockMask)  # lower() built or made one
    return kernel_of(*_arguments(request), mask=request.mask, **request.options)


def _arguments(request: Request) -> tuple:
    return (
        request.query,
        request.key,
        request.value,
        request.block_mask,
        request.score_mod,
        request.scale,
        request.enable_gqa,
        request.return_lse,
    )


def attend(request: Request) -> Tensor | tuple[Tensor, Tensor]:
    assert isinstance(request.block_mask, BlockMask)  # lower() built or made one
    return block_sparse_attention(
        request.query,
        request.key,
        request.value,
        request.block_mask,
        score_mod=request.score_mod,
        scale=request.scale,
        enable_gqa=request.enable_gqa,
        return_lse=request.return_lse,
        mask=request.mask,
        **request.options,
    )


__all__ = [
    "DEFAULT_MAX_CHUNK_ELEMENTS",
    "NAME",
    "OPTIONS",
    "attend",
    "block_sparse_attention",
    "can_take",
    "kernel_name",
    "lower",
]
