"""The mask_mod objects a mask lowers to: picklable callables holding their tensors, and
``Lowered``, a node made concrete for one length on one device.

A piece's own mask_mod lives with the piece (``flexmask/pieces/<name>.py``); here are the
base they share and the mask_mods of the operators (``&``, ``|``, ``~``) and of a window
of a mask (``ShiftedMod``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class Lowered(NamedTuple):
    """A node made concrete for one padded length on one device."""

    mask_mod: MaskMod
    """What flex_attention and torch's create_block_mask call (scalar or vmapped indices)."""
    evaluate: MaskMod
    """The same predicate, callable with broadcasting index tensors of any shape."""


class MaskModFn:
    """Base of flexmask's mask_mods: a module-level callable object holding its tensors.

    Unlike a closure, it pickles (``pickle``, ``torch.save``, ``copy.deepcopy`` of a BlockMask
    work) and unpickles to a mask_mod that evaluates identically. Compiled ``flex_attention``
    traces ``__call__`` like a function: dynamo guards the class and the held tensors'
    dtypes and shapes, so a new object holding new same-shape tensors does not recompile.
    Equality stays identity: two mask_mods are the same mask only by their Mask's key.
    Subclasses define ``__call__(b, h, q_idx, kv_idx)``, index arithmetic only.
    """

    __slots__ = ()
    _name = "mask_mod"

    @property
    def __name__(self) -> str:  # what torch's BlockMask repr prints
        return self._name

    def _fields(self) -> list[str]:
        classes = reversed(type(self).__mro__)
        names = [n for cls in classes for n in cls.__dict__.get("__slots__", ())]
        return [f"{n}={_describe(getattr(self, n))}" for n in names]

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(self._fields())})"


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        shape = ", ".join(map(str, value.shape))
        return f"{str(value.dtype).removeprefix('torch.')}[{shape}]"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_describe, value)) + ")"
    return repr(value)


class _NaryMod(MaskModFn):
    __slots__ = ("mods",)

    def __init__(self, mods: tuple[MaskMod, ...]) -> None:
        self.mods = tuple(mods)

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(map(repr, self.mods))})"


class AndMod(_NaryMod):
    """``mods[0] & mods[1] & ...``: the mask_mod of an ``&`` node."""

    __slots__ = ()
    _name = "and_masks"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        result = self.mods[0](b, h, q_idx, kv_idx)
        for mod in self.mods[1:]:
            result = result & mod(b, h, q_idx, kv_idx)
        return result


class OrMod(_NaryMod):
    """``mods[0] | mods[1] | ...``: the mask_mod of an ``|`` node."""

    __slots__ = ()
    _name = "or_masks"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        result = self.mods[0](b, h, q_idx, kv_idx)
        for mod in self.mods[1:]:
            result = result | mod(b, h, q_idx, kv_idx)
        return result


def combined(make: Callable[[tuple[MaskMod, ...]], MaskMod], parts: list[Lowered]) -> Lowered:
    """A node's Lowered from its children's; one object when each child's evaluator is its
    mask_mod (every piece but from_mask_mod)."""
    mask_mod = make(tuple(part.mask_mod for part in parts))
    if all(part.evaluate is part.mask_mod for part in parts):
        return Lowered(mask_mod, mask_mod)
    return Lowered(mask_mod, make(tuple(part.evaluate for part in parts)))


class NotMod(MaskModFn):
    """``~mod``: the mask_mod of a ``~`` node."""

    __slots__ = ("mod",)
    _name = "not_mask"

    def __init__(self, mod: MaskMod) -> None:
        self.mod = mod

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~self.mod(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"{self._name}({self.mod!r})"


class ShiftedMod(MaskModFn):
    """``mod(b, h, q_idx + q_offset, kv_idx + kv_offset)``: the mask_mod of a window of a
    mask (``create_block_mask(..., q_offset=, kv_offset=)``). The offsets are int64 tensors —
    ``(B,)`` read at ``b`` when they differ by row, else one value — never Python ints, so
    new offsets of the same shape do not recompile a compiled kernel.

    One shared offset is held as a ``(1,)`` view of the tensor given (0-d or ``(1,)``) and
    read at ``b - b``: inductor's interval analysis and aux vectorisation read a captured
    tensor only through an index (``aten.index``), and a bare 0-d operand refuses the whole
    mask (``flexmask.algebra.interval_mods``); ``b`` itself would run past one entry when a
    BlockMask of one row serves a larger batch.
    """

    __slots__ = ("mod", "q_offset", "kv_offset", "per_row")
    _name = "shifted_mask"

    def __init__(self, mod: MaskMod, q_offset: Tensor, kv_offset: Tensor) -> None:
        self.mod = mod
        self.per_row = q_offset.dim() == 1
        self.q_offset = q_offset if self.per_row else q_offset.view(1)
        self.kv_offset = kv_offset if self.per_row else kv_offset.view(1)

    def __setstate__(self, state: tuple[None, dict[str, object]]) -> None:
        # Pickled by 0.1.0 with a 0-d shared offset: held as (1,) now.
        for name, value in state[1].items():
            if name in ("q_offset", "kv_offset") and isinstance(value, Tensor) and not value.dim():
                value = value.view(1)
            object.__setattr__(self, name, value)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        row = b if self.per_row else b - b
        return self.mod(b, h, q_idx + self.q_offset[row], kv_idx + self.kv_offset[row])
