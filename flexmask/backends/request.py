"""What a backend is handed: one attention call, its mask already lowered.

``flexmask.attention`` makes it once per call: the BlockMask resolved from a handle, a Mask
(through the cache) or a BlockMask, and the Mask behind it where flexmask built it. A
backend trusts it: the mask was validated when its spec was made, not again here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra.mask import Mask


class Deferred:
    """A BlockMask built when a backend first asks for it: a call that brought a Mask or a
    handle (not a BlockMask) builds none where its backend lowers the Mask itself
    (``slices``, ``varlen``), which at 131k and B = 8 is ~150 ms and 128 MiB of index
    tensors. ``flexmask.attention`` checks a handle's lengths and device against the tensors
    from its recipe first, so deferring its build defers no error."""

    __slots__ = ("_build", "_value")

    def __init__(self, build: Callable[[], BlockMask]) -> None:
        self._build: Callable[[], BlockMask] | None = build
        self._value: BlockMask | None = None

    def __call__(self) -> BlockMask:
        if self._build is not None:
            self._value, self._build = self._build(), None
        assert self._value is not None
        return self._value


def check_fits(
    lengths: tuple[int, int], device: torch.device | None, query: Tensor, key: Tensor
) -> None:
    """A BlockMask made for ``lengths`` (Q_LEN, KV_LEN) on ``device`` (None: any) must be
    used with a query and key of those lengths on that device, as torch's flex_attention
    requires; raises ValueError naming both otherwise."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if tuple(lengths) != (q_len, kv_len):
        raise ValueError(
            f"block_mask was built for (Q_LEN, KV_LEN)={tuple(lengths)} but query and key "
            f"give ({q_len}, {kv_len}); build it for these lengths"
        )
    if device is not None and (
        device.type != query.device.type
        or (device.index is not None and device.index != query.device.index)
    ):
        raise ValueError(
            f"block_mask must be on query's device ({query.device}), got {device}; use "
            f"block_mask.to(device)"
        )


class Request(NamedTuple):
    """One attention call as the backends see it."""

    query: Tensor
    key: Tensor
    value: Tensor
    block_mask: BlockMask | Deferred | None
    """The lowered BlockMask, or its deferred build (``built``); None means every query
    attends every key."""
    mask: Mask | None
    """The Mask flexmask built ``block_mask`` from (its intervals, its key), else None."""
    score_mod: Callable[..., Tensor] | None
    scale: float | None
    enable_gqa: bool
    return_lse: bool
    compile: bool
    """Whether torch's kernel is to be compiled (resolved from compile=, set_compile, env)."""
    options: dict[str, Any]
    """Backend options (``threads``, ``backend``, ...) and torch's extra kwargs, as given."""

    def built(self) -> Request:
        """This request with its BlockMask built, for a backend that reads it."""
        if isinstance(self.block_mask, Deferred):
            return self._replace(block_mask=self.block_mask())
        return self

    @property
    def on_cpu(self) -> bool:
        return self.query.device.type == "cpu"

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (self.query, self.key, self.value)
        )
