"""Calling a ``mask_mod`` or ``score_mod`` on index tensors: by broadcasting where the
function allows it, else through ``torch.vmap`` (``algebra.evaluate``, the one evaluator)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from flexmask.algebra import vmap_broadcast


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
