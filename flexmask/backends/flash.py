"""torch's fused CPU flash-attention kernel, as the CPU backends that call it directly
(``slices``, ``decode``) find and feed it: its forward and backward ops, the dtypes it
takes, and the shapes it must not be given (it aborts the process on some)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from flexmask.backends.request import Request

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""What torch's CPU flash kernel takes."""

_FORWARD_ARGS = ["query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"]
_BACKWARD_ARGS = ["grad_out", "query", "key", "value", "out", "logsumexp", *_FORWARD_ARGS[3:]]


@functools.lru_cache(maxsize=1)
def flash_ops() -> tuple[Any, Any] | None:
    """torch's CPU flash kernel and its backward (private aten ops, present in every torch
    this package supports), or None where a torch lacks them or calls them otherwise than
    this module does (then the backends calling it refuse every call)."""
    ops = torch.ops.aten
    try:
        forward = ops._scaled_dot_product_flash_attention_for_cpu.default
        backward = ops._scaled_dot_product_flash_attention_for_cpu_backward.default
    except (AttributeError, RuntimeError):
        return None
    signatures = [
        ([a.name for a in op._schema.arguments], len(op._schema.returns))
        for op in (forward, backward)
    ]
    if signatures != [(_FORWARD_ARGS, 2), (_BACKWARD_ARGS, 3)]:
        return None
    return forward, backward


def shape_problem(request: Request) -> str | None:
    """Why torch's CPU flash kernel cannot take these tensors, or None. The kernel aborts the
    process on some bad shapes (no heads: a division by zero), so anything but the plain
    case is refused here, and the path that takes the call instead names what is wrong."""
    q, k, v = request.query, request.key, request.value
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "query, key and value must be 4-D tensors (B, H, seq_len, head_dim)"
    if q.dtype not in DTYPES or not q.dtype == k.dtype == v.dtype:
        return f"torch's CPU flash kernel takes one dtype of {[str(d) for d in DTYPES]}"
    if min(*q.shape, *k.shape, *v.shape) < 1:
        return "a dimension of query, key or value is 0"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        return "query, key and value must share B; key and value their heads and length"
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return "torch's CPU flash kernel needs one head_dim for query, key and value"
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv and not (request.enable_gqa and hq % hkv == 0):
        return "query heads must equal key heads, or be a multiple of them with enable_gqa"
    return None
