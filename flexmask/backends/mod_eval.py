"""Calling a ``mask_mod`` or ``score_mod`` on index tensors: by broadcasting where the
function allows it, else through ``torch.vmap`` — the backend's one evaluator."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def broadcasts(fn: Callable[..., Tensor], args: Sequence[Tensor], shape: tuple[int, ...]) -> bool:
    """True when ``fn`` accepts broadcasting index tensors and answers in ``shape``."""
    try:
        result = fn(*args)
    except Exception:  # any failure means "needs scalars": the vmap path will tell if it is real
        return False
    return isinstance(result, Tensor) and fits(result, shape)


def fits(result: Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(result.shape, shape) == torch.Size(shape)
    except RuntimeError:
        return False


def call_mod(
    fn: Callable[..., Tensor],
    args: Sequence[Tensor],
    shape: tuple[int, ...],
    mod_eval: str,
    name: str,
) -> Tensor:
    if mod_eval == "vmap":
        result = vmap_broadcast(fn, args, shape)
    else:
        result = fn(*args)
        if not isinstance(result, Tensor) or not fits(result, shape):
            got = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
            raise ValueError(
                f"{name} called with broadcasting index tensors returned {got}, which does not "
                f"broadcast to the scores' shape {shape}; pass mod_eval='vmap' to call it on "
                "scalars as flex_attention does"
            )
    if name == "mask_mod" and result.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor, got dtype {result.dtype}")
    return result


def vmap_broadcast(
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
