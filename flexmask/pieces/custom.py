"""Any existing mask_mod (attn-gym's, your own) as a leaf of the algebra."""

from __future__ import annotations

import hashlib
import marshal
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from flexmask.algebra import (
    LineIntervals,
    Lowered,
    MaskMod,
    MaskModFn,
    TileGrid,
    VarlenPart,
    Window,
    cannot_lower,
    vmap_broadcast,
)
from flexmask.blocks import UNDECIDED, constant_codes
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

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        return constant_codes(UNDECIDED, grid.device)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        return Lowered(self.fn, VmappedMod(self.fn))

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        raise cannot_lower(
            self,
            fmt,
            "a from_mask_mod leaf is a function flexmask cannot read intervals from. Write the "
            "mask with flexmask's pieces, or use flexmask.create_block_mask (flex_attention)",
        )

    def varlen_part(self, length: int) -> VarlenPart:
        raise cannot_lower(
            self, "varlen", "a from_mask_mod leaf has no structure flexmask can read"
        )

    def __repr__(self) -> str:
        return f"from_mask_mod({getattr(self.fn, '__name__', 'fn')}, key={self._key[1]!r})"


class VmappedMod(MaskModFn):
    """Evaluates a scalar-style mask_mod on broadcasting index tensors, as torch's create_mask
    does, through the one vmap evaluator (``algebra.evaluate``): index tensors are never
    expanded in memory, tensor indexing is turned into index ops."""

    __slots__ = ("fn",)
    _name = "vmapped"

    def __init__(self, fn: MaskMod) -> None:
        self.fn = fn

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        shape = tuple(torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape))
        out = vmap_broadcast(self._tensor_out, (b, h, q_idx, kv_idx), shape)
        if out.dtype != torch.bool:
            raise TypeError(
                f"mask_mod {getattr(self.fn, '__name__', self.fn)!r} must return a bool tensor, "
                f"got dtype {out.dtype}"
            )
        return out.view(shape)

    def _tensor_out(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # vmap's own complaint about a Python value names vmap's out_dims, not the mask_mod.
        out = self.fn(b, h, q_idx, kv_idx)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"mask_mod fn {getattr(self.fn, '__name__', self.fn)!r} must return a bool tensor "
                f"computed from its index arguments, got a Python {type(out).__name__} "
                f"({out!r}): write e.g. q_idx >= kv_idx, or q_idx >= 0 for 'always' "
                f"(flexmask.full() / flexmask.empty() for a constant mask)"
            )
        return out

    def __repr__(self) -> str:
        return f"vmapped({getattr(self.fn, '__name__', self.fn)})"


# What a default value may be for the function to name itself: immutable values marshal
# writes in full. A tensor, list or object default can change in place, unseen.
_FIXED_TYPES = (type(None), bool, int, float, complex, str, bytes)


def _is_fixed(value: object) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_is_fixed(v) for v in value)
    return type(value) in _FIXED_TYPES


def _code_key(fn: Callable[..., Any]) -> tuple | None:
    """The key of a module-level function, from everything about it that can change: its
    code object (bytecode, constants, names, nested code, file and line) and its defaults.
    None when something it depends on is not provably fixed (captured cells, a lambda or a
    nested function, a callable without code, a mutable default)."""
    code = getattr(fn, "__code__", None)
    qualname = getattr(fn, "__qualname__", "<lambda>")
    if not isinstance(code, types.CodeType) or getattr(fn, "__closure__", None):
        return None
    if "<lambda>" in qualname or "<locals>" in qualname:
        return None
    defaults = (getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None))
    kwdefaults = tuple(sorted((defaults[1] or {}).items()))
    if not _is_fixed(defaults[0] or ()) or not _is_fixed(kwdefaults):
        return None
    # marshal version 0: no back-references or interning flags, whose bytes depend on
    # reference counts, so one function always gives one digest.
    h = hashlib.blake2b(digest_size=16)
    h.update(marshal.dumps(code, 0))
    h.update(marshal.dumps((defaults[0], kwdefaults), 0))
    return ("fn", fn.__module__, qualname, h.hexdigest())


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
            module-level function with no captured data (not a lambda or nested function)
            whose defaults, if any, are immutable values (numbers, strings, None, tuples of
            these). Its key is then its module, qualified name and a digest of its code
            object (bytecode, constants, names, nested code, file and line) and defaults, so
            a function redefined with a new body (a notebook cell run again) is a new mask.
            What the key cannot see: module globals and other functions the body reads. If
            those change, pass a key that names them.
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
        key = _code_key(fn)
        if key is None:
            raise TypeError(
                f"from_mask_mod({getattr(fn, '__name__', fn)!r}) needs key=...: only a "
                f"module-level function without captured data, whose defaults (if any) are "
                f"immutable values, names itself; a closure's identity is not a content key "
                f"(caches keyed on closures never hit, or return stale masks). Pass e.g. "
                f"key=('name', tuple_of_the_captured_values)."
            )
    try:
        hash(key)
    except TypeError as err:
        raise TypeError(f"key must be hashable (a tuple, str or int), got {key!r}") from err
    return FromMaskMod(fn, key, bool(batch_dependent), bool(head_dependent))
