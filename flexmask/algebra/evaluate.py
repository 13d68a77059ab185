"""The one vmap evaluator: a scalar-style ``mask_mod``/``score_mod`` called on broadcasting
index tensors, as flex_attention calls it, used by ``from_mask_mod``'s evaluator and by the
backends alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


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
