"""Any existing mask_mod (attn-gym's, your own) as a leaf of the algebra."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from flexmask.blocks import UNDECIDED, BlockGrid, constant_codes
from flexmask.mask import Lowered, MaskMod
from flexmask.pieces._base import Piece


class FromMaskMod(Piece):
    """A user mask_mod with a caller-given content key. No structure: its blocks are
    classified by evaluating it, except where the rest of the expression decides them."""

    __slots__ = ("fn", "_batch_dependent", "_head_dependent")
    _arg = "from_mask_mod"

    def __init__(
        self, fn: MaskMod, key: Hashable, batch_dependent: bool, head_dependent: bool
    ) -> None:
        self.fn = fn
        self._batch_dependent = batch_dependent
        self._head_dependent = head_dependent
        super().__init__(("mask_mod", key, batch_dependent, head_dependent))

    @property
    def batch_dependent(self) -> bool:
        return self._batch_dependent

    @property
    def head_dependent(self) -> bool:
        return self._head_dependent

    def _classify(self, grid: BlockGrid) -> Tensor:
        return constant_codes(UNDECIDED, grid.device)

    def _lower(self, length: int, device: torch.device) -> Lowered:
        return Lowered(self.fn, _vmapped(self.fn))

    def __repr__(self) -> str:
        return f"from_mask_mod({getattr(self.fn, '__name__', 'fn')}, key={self._key[1]!r})"


def _vmapped(fn: MaskMod) -> MaskMod:
    """Evaluates a scalar-style mask_mod on broadcasting index tensors, as torch's create_mask
    does: one vmap over the flattened broadcast, with tensor indexing turned into index ops."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    def evaluate(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        flat = [t.expand(shape).reshape(-1) for t in (b, h, q_idx, kv_idx)]
        with TransformGetItemToIndex():
            out = torch.vmap(fn)(*flat)
        if out.dtype != torch.bool:
            raise TypeError(
                f"mask_mod {getattr(fn, '__name__', fn)!r} must return a bool tensor, "
                f"got dtype {out.dtype}"
            )
        return out.view(shape)

    return evaluate


def from_mask_mod(
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    key: Hashable = None,
    *,
    batch_dependent: bool = True,
    head_dependent: bool = True,
) -> FromMaskMod:
    """Wraps a plain ``mask_mod(b, h, q_idx, kv_idx) -> bool`` as a flexmask leaf.

    The leaf's blocks are classified by evaluating ``fn`` on the blocks the rest of the
    expression leaves undecided (``causal() & from_mask_mod(f, ...)`` evaluates only the
    lower triangle).

    Args:
        fn: the mask_mod, written for torch's ``create_block_mask``.
        key: a hashable content key: two leaves with equal keys must be the same mask (it is
            what the BlockMask cache is keyed on). Give the data the closure captures, e.g.
            ``key=("my_doc_mask", tuple(offsets.tolist()))``. May be omitted only for a
            module-level function with no captured data (not a lambda or nested function):
            its module and qualified name are the key.
        batch_dependent: False if ``fn`` never reads ``b``: it is then evaluated for one row
            and broadcast. The default assumes it may, which is always correct.
        head_dependent: False if ``fn`` never reads ``h`` (likewise evaluated once).

    Example:
        >>> import flexmask
        >>> from attn_gym.masks import causal_mask
        >>> m = flexmask.from_mask_mod(causal_mask, batch_dependent=False, head_dependent=False)
        >>> m.to_dense(1, 1, 3, 3).equal(flexmask.causal().to_dense(1, 1, 3, 3))
        True
    """
    if not callable(fn):
        raise TypeError(f"fn must be a mask_mod callable, got {type(fn).__name__}")
    if key is None:
        closure = getattr(fn, "__closure__", None)
        has_defaults = bool(getattr(fn, "__defaults__", None))
        qualname = getattr(fn, "__qualname__", "<lambda>")
        anonymous = "<lambda>" in qualname or "<locals>" in qualname
        if not hasattr(fn, "__code__") or closure or has_defaults or anonymous:
            raise TypeError(
                f"from_mask_mod({getattr(fn, '__name__', fn)!r}) needs key=...: only a "
                f"module-level function without captured data names itself; a closure's "
                f"identity is not a "
                f"content key (caches keyed "
                f"on closures never hit, or return stale masks). Pass e.g. "
                f"key=('name', tuple_of_the_captured_values)."
            )
        key = ("fn", fn.__module__, fn.__qualname__)
    try:
        hash(key)
    except TypeError as err:
        raise TypeError(f"key must be hashable (a tuple, str or int), got {key!r}") from err
    return FromMaskMod(fn, key, bool(batch_dependent), bool(head_dependent))
