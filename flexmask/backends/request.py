"""What a backend is handed: one attention call, its mask already lowered.

``flexmask.attention`` makes it once per call: the BlockMask resolved from a handle, a Mask
(through the cache) or a BlockMask, and the Mask behind it where flexmask built it. A
backend trusts it: the mask was validated when its spec was made, not again here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.builders import Spec


class Deferred:
    """A BlockMask built when a backend first asks for it: a call that brought a Mask or a
    handle (not a BlockMask) builds none where its backend lowers the Mask itself
    (``slices``, ``varlen``), which at 131k and B = 8 is ~150 ms and 128 MiB of index
    tensors. ``flexmask.attention`` checks a handle's lengths and device against the tensors
    from its recipe first, so deferring its build defers no error."""

    __slots__ = ("_build", "_value", "spec")

    def __init__(self, build: Callable[[], BlockMask], spec: Spec | None = None) -> None:
        self._build: Callable[[], BlockMask] | None = build
        self._value: BlockMask | None = None
        # A bare Mask's validated spec: its block shape is flexmask's to choose (a kernel
        # that requires another builds the same spec so, checked once); a handle's recipe
        # or a BlockMask is the caller's (None).
        self.spec = spec

    @property
    def built(self) -> bool:
        """Whether the BlockMask has been built (asked for) already."""
        return self._build is None

    def __call__(self) -> BlockMask:
        if self._build is not None:
            self._value, self._build = self._build(), None
        assert self._value is not None
        return self._value


def dims_problem(dims: tuple[int, int], query: Tensor, per_row: bool = False) -> str | None:
    """Why a mask made for ``dims`` (its batch and head dims) cannot serve ``query``, or None:
    each must be 1 (shared by every row or head) or the query's (B, Hq). torch's GPU kernels
    index a BlockMask's rows by ``b % B_mask`` and run any size; a mask of 2 rows under 3
    query rows would give row 2 row 0's documents, so every flexmask backend refuses it,
    through this one check. ``per_row``: the mask's data is given per batch row (its
    mask_mod reads row ``b`` of it), so a B of 1 cannot stand for other rows either."""
    mask_batch, mask_heads = (int(d) for d in dims)
    batch, heads = query.shape[:2]
    if per_row and mask_batch != batch:
        return (
            f"block_mask was built from per-row data for {mask_batch} batch row(s), but query "
            f"has B={batch}: its mask_mod reads row b of that data, so it serves only "
            f"{mask_batch} row(s); give the data for B={batch} rows"
        )
    if mask_batch in (1, batch) and mask_heads in (1, heads):
        return None
    return (
        f"block_mask's batch and head dims must each be 1 or match query's (B, Hq) = "
        f"({batch}, {heads}), got ({mask_batch}, {mask_heads}): build the mask for this "
        f"batch (B={batch} or 1) and these heads (H={heads} or 1)"
    )


def check_fits(
    lengths: tuple[int, int],
    device: torch.device | None,
    query: Tensor,
    key: Tensor,
    dims: tuple[int, int] | None = None,
    per_row: bool = False,
) -> None:
    """A BlockMask made for ``lengths`` (Q_LEN, KV_LEN) on ``device`` (None: any) and, where
    given, for ``dims`` (its B and H; ``per_row``: see ``dims_problem``) must be used with a
    query and key of those lengths on that device, as torch's flex_attention requires;
    raises ValueError naming both otherwise."""
    if dims is not None:
        problem = dims_problem(dims, query, per_row)
        if problem is not None:
            raise ValueError(problem)
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


def check_tensors(query: Any, key: Any, value: Any, enable_gqa: bool) -> None:
    """The tensors of one call, as torch's flex_attention takes them: 4-D, one floating dtype,
    one device, one batch size; key's head_dim is query's; value has key's heads and length;
    query's heads a multiple of key's with ``enable_gqa``, else equal. Raises TypeError or
    ValueError naming the tensor. Sizes of 0 pass: the call's output is then empty (B, H or
    Q_LEN of 0) or every query attends nothing (KV_LEN of 0)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, seq_len, head_dim), got shape {tuple(tensor.shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating-point dtype, got {tensor.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(
                f"{name}.dtype must equal query.dtype ({query.dtype}), got {tensor.dtype}"
            )
        if tensor.device != query.device:
            raise ValueError(
                f"{name} must be on query's device ({query.device}), got {tensor.device}"
            )
    batch, q_heads, _, head_dim = query.shape
    if key.size(0) != batch or value.size(0) != batch:
        raise ValueError(
            f"key and value must have query's batch size {batch}, got key {key.size(0)} and "
            f"value {value.size(0)}"
        )
    if key.size(-1) != head_dim:
        raise ValueError(
            f"key's head_dim must equal query's ({head_dim}), got key.shape={tuple(key.shape)}"
        )
    if value.shape[1:3] != key.shape[1:3]:
        raise ValueError(
            f"value must have key's heads and length {tuple(key.shape[1:3])}, "
            f"got value.shape={tuple(value.shape)}"
        )
    kv_heads = key.size(1)
    if kv_heads == 0 and q_heads:
        raise ValueError(
            f"key and value have no heads but query has {q_heads}: give key and value at "
            f"least one head, got key.shape={tuple(key.shape)}"
        )
    if not enable_gqa and q_heads != kv_heads:
        raise ValueError(
            f"query has {q_heads} heads but key/value have {kv_heads}; pass enable_gqa=True "
            "for grouped-query attention, or give them the same number of heads"
        )
    if kv_heads and q_heads % kv_heads != 0:
        raise ValueError(
            f"with enable_gqa=True, query's heads ({q_heads}) must be a multiple of key/value's "
            f"heads ({kv_heads})"
        )


def check_scale(scale: Any) -> float | None:
    """``scale`` as torch's flex_attention takes it: None (``1 / sqrt(head_dim)``) or any
    finite real number — 0 (every attended key weighs the same) and negatives included."""
    if scale is None:
        return None
    if isinstance(scale, Tensor) and scale.dim() == 0 and scale.dtype.is_floating_point:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a float or None (None: 1 / sqrt(head_dim)), got {scale!r} "
            f"({type(scale).__name__})"
        )
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


def make_request(
    query: Any,
    key: Any,
    value: Any,
    block_mask: BlockMask | Deferred | None,
    mask: Mask | None,
    score_mod: Any,
    scale: Any,
    enable_gqa: Any,
    return_lse: Any,
    compile: bool,
    options: dict[str, Any],
) -> Request:
    """The one check of a call, before any backend sees it: the same calls are valid, with the
    same messages, whichever backend then runs. Flags are read as torch reads them (any
    truthy value), ``scale`` becomes a float."""
    enable_gqa, return_lse = bool(enable_gqa), bool(return_lse)
    check_tensors(query, key, value, enable_gqa)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            f"score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx) or None, "
            f"got {type(score_mod).__name__}"
        )
    return Request(
        query,
        key,
        value,
        block_mask,
        mask,
        score_mod,
        check_scale(scale),
        enable_gqa,
        return_lse,
        compile,
        options,
    )


def positive_scale(query: Tensor, scale: float | None) -> tuple[Tensor, float | None]:
    """``(query, scale)`` for a kernel that needs a positive scale (torch's fused CPU flash
    kernel scales after masking: a 0 or negative scale turns a masked ``-inf`` into NaN or
    ``+inf``): where ``scale <= 0`` the query is scaled instead and the kernel's scale is 1.
    The scores are the same products; the gradient reaches ``query`` through the product."""
    if scale is None or scale > 0:
        return query, scale
    return query * scale, 1.0


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
    lowered: Any = None
    """What the backend's ``lower`` made of the mask for its ``attend`` (slices' kernel calls,
    varlen's packed layout); None before ``lower``."""

    def built(self) -> Request:
        """This request with its BlockMask built, for a backend that reads it."""
        if isinstance(self.block_mask, Deferred):
            return self._replace(block_mask=self.block_mask())
        return self

    @property
    def query_key_value(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.query, self.key, self.value

    @property
    def empty(self) -> bool:
        """No output element, or no key to attend: the call's result is known without a
        kernel (``empty_result``)."""
        q, k, v = self.query, self.key, self.value
        return min(q.shape[0], q.shape[1], q.shape[2], k.shape[2], v.shape[-1]) == 0

    def empty_result(self) -> Tensor | tuple[Tensor, Tensor]:
        """The output of an ``empty`` call, as torch's flex_attention gives it where it gives
        one: an empty tensor where B, Hq or Q_LEN is 0; where KV_LEN is 0 every query attends
        nothing, so 0 (lse -inf). Sums of none of the inputs' elements (exactly 0, whatever
        they hold) link it to them for autograd: zero gradients."""
        q, k, v = self.query, self.key, self.value
        batch, heads, q_len = q.shape[:3]
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        link = q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum()
        out = q.new_zeros(batch, heads, q_len, v.size(-1)) + link.to(q.dtype)
        if not self.return_lse:
            return out
        lse = torch.full((batch, heads, q_len), float("-inf"), dtype=lse_dtype, device=q.device)
        return out, lse + link.detach().to(lse_dtype)

    @property
    def on_cpu(self) -> bool:
        return self.query.device.type == "cpu"

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (self.query, self.key, self.value)
        )
