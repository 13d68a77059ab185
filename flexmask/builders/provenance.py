"""The record a build leaves on its BlockMask: the Mask it was built from, read back by
``built_from`` while the BlockMask still means that Mask (its mask_mod, and for a reader of
its blocks its index tensors, unchanged)."""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask, MaskMod
from flexmask.blocks import BLOCK_FIELDS
from flexmask.builders.sides import Route

# A BlockMask flexmask built remembers its Mask with the mask_mod it was built with. torch
# makes a new BlockMask for ``.to()``, slicing and ``_adjust``, which so forget it.
_BUILT_FROM = "_flexmask_built_from"


def built_from(block_mask: BlockMask, blocks: bool = False) -> Mask | None:
    """The Mask ``block_mask`` was built from by ``create.build``, while its mask_mod is still
    the one it was built with; None for torch's BlockMasks, windows (``q_offset``/
    ``kv_offset``), and BlockMasks torch derived from flexmask's.

    With ``blocks``, also only while its index tensors are the ones built (no field set to
    another tensor, no in-place edit: each tensor's version counter unchanged), for a reader
    that takes the Mask for the blocks too: an edited BlockMask attends what its blocks say.
    """
    tag = getattr(block_mask, _BUILT_FROM, None)
    if not isinstance(tag, _Built) or tag.mask_mod is not block_mask.mask_mod:
        return None
    if blocks and not tag.intact(block_mask):
        return None
    return tag.mask


def built_route(block_mask: BlockMask) -> tuple[Route, bool] | None:
    """The path the build of ``block_mask`` took and whether its index tensors are still the
    ones built (False: edited since); None where :func:`built_from` is None, or for a
    BlockMask saved before builds recorded their path."""
    tag = getattr(block_mask, _BUILT_FROM, None)
    if built_from(block_mask) is None or not isinstance(tag, _Built) or tag.route is None:
        return None
    return Route.from_plain(tag.route), tag.intact(block_mask)


class _Built:
    """What a build records on its BlockMask: the Mask, the mask_mod, each index tensor
    (weakly: the record keeps none alive) with its version counter, which every in-place op
    bumps, and the build's route. It pickles (and deep-copies) with the tensors themselves,
    so that the copy's record names the copy's tensors (the pickle's memo makes them the same
    objects) at their versions on load — or, for an edited BlockMask, with none: no copy of
    it is intact. The route is kept as plain tuples (``Route.plain``): a pickle of it loads
    under ``torch.load(weights_only=True)`` with no other class allowed; records pickled
    before it load with none."""

    __slots__ = ("mask", "mask_mod", "tensors", "route")

    def __init__(
        self,
        mask: Mask,
        mask_mod: MaskMod,
        fields: tuple[Tensor | None, ...] | None,
        route: tuple | None = None,
    ):
        self.mask, self.mask_mod, self.route = mask, mask_mod, route
        self.tensors = (
            None
            if fields is None
            else tuple(None if t is None else (weakref.ref(t), t._version) for t in fields)
        )

    @staticmethod
    def of(block_mask: BlockMask, mask: Mask, mask_mod: MaskMod, route: Route) -> _Built:
        fields = tuple(getattr(block_mask, n, None) for n in BLOCK_FIELDS)
        return _Built(mask, mask_mod, fields, route.plain())

    def intact(self, block_mask: BlockMask) -> bool:
        if self.tensors is None:
            return False
        for name, kept in zip(BLOCK_FIELDS, self.tensors, strict=True):
            tensor = getattr(block_mask, name, None)
            if kept is None:
                if tensor is not None:
                    return False
            elif kept[0]() is not tensor or tensor is None or kept[1] != tensor._version:
                return False
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        tensors = (
            ()
            if self.tensors is None
            else tuple(None if kept is None else kept[0]() for kept in self.tensors)
        )
        if self.tensors is None or any(
            kept is not None and (tensor is None or tensor._version != kept[1])
            for kept, tensor in zip(self.tensors, tensors, strict=True)
        ):
            return (_Built, (self.mask, self.mask_mod, None, self.route))
        return (_Built, (self.mask, self.mask_mod, tensors, self.route))


BUILT_RECORD = _Built
"""The class of the record a build leaves on its BlockMask (``flexmask.safe_globals`` lists
it for ``torch.load(weights_only=True)``)."""


def record(block_mask: BlockMask, mask: Mask, mask_mod: MaskMod, route: Route) -> None:
    """Records on ``block_mask``, just built from ``mask`` with ``mask_mod`` along ``route``,
    what it means and how it was made."""
    setattr(block_mask, _BUILT_FROM, _Built.of(block_mask, mask, mask_mod, route))


def carry_record(source: BlockMask, out: BlockMask) -> None:
    """Records on ``out``, a copy of ``source`` with other tensors (``zero_sizes.emptied``),
    what ``source``'s record says: its tensors are intact where ``source``'s were."""
    tag = getattr(source, _BUILT_FROM, None)
    if isinstance(tag, _Built):
        tensors = tuple(getattr(out, name, None) for name in BLOCK_FIELDS)
        intact = tensors if tag.intact(source) else None
        setattr(out, _BUILT_FROM, _Built(tag.mask, tag.mask_mod, intact, tag.route))
