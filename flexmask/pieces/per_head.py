"""A different mask per attention head (or per group of heads)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_int
from flexmask.algebra import Composite, Extent, Lowered, Mask, MaskMod, MaskModFn, Window


class PerHead(Composite):
    """Head ``h`` attends as ``masks[(h // group_size) % len(masks)]``.

    ::

        per_head(causal(), full()):  head 0  ■ ⬚ ⬚   head 1  ■ ■ ■
                                             ■ ■ ⬚           ■ ■ ■
                                             ■ ■ ■           ■ ■ ■

    Equal masks are kept once (``distinct``): the build makes each distinct mask's tensors
    once (``Mask.head_parts``; in closed form where it has one) and copies them to the heads
    that use it — inside ``&``/``|``/``~``, each distinct mask's tile codes
    (``builders.classify.per_head_codes``); the mask_mod
    evaluates each distinct mask once.
    """

    __slots__ = ("masks", "group_size", "distinct", "head_table")

    def __init__(self, masks: tuple[Mask, ...], group_size: int) -> None:
        self.masks = masks
        self.group_size = group_size
        distinct: list[Mask] = []
        table = []
        for mask in masks:
            if mask not in distinct:
                distinct.append(mask)
            table.append(distinct.index(mask))
        self.distinct = tuple(distinct)
        self.head_table = torch.tensor(table, dtype=torch.int64)  # masks[i] is distinct[...]
        self._set_parts(self.distinct, ("per_head", tuple(m.key for m in masks), group_size))

    @property
    def head_dependent(self) -> bool:
        return True

    @property
    def cycle(self) -> int:
        """Heads after which the masks repeat: ``len(masks) * group_size``; H must be a
        multiple of it."""
        return len(self.masks) * self.group_size

    def check(self, extent: Extent) -> None:
        # Only where a head count is given: a mask_mod or a picture takes any head index.
        if extent.heads is not None and extent.heads % self.cycle:
            raise ValueError(
                f"H={extent.heads} must be a multiple of len(masks) * group_size = "
                f"{len(self.masks)} * {self.group_size} = {self.cycle} for per_head: head h "
                f"uses masks[(h // group_size) % len(masks)], and every mask needs its heads"
            )
        super().check(extent)

    def head_parts(self, heads: int) -> tuple[tuple[Mask, ...], list[Tensor]]:
        return self.distinct, self._heads_of(heads)

    @property
    def head_cycle(self) -> int:
        return math.lcm(self.cycle, *(m.head_cycle for m in self.masks))

    def at_head(self, head: int) -> Mask:
        return self.masks[(head // self.group_size) % len(self.masks)].at_head(head)

    def _heads_of(self, heads: int) -> list[Tensor]:
        """For each distinct mask, the heads (of H) that use it."""
        h = torch.arange(heads)
        which = self.head_table[(h // self.group_size) % len(self.masks)]
        return [(which == d).nonzero().view(-1) for d in range(len(self.distinct))]

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        parts = [m.lower_at(length, device, window) for m in self.distinct]
        table = self.head_table.to(device)
        mask_mod = PerHeadMod(tuple(p.mask_mod for p in parts), table, self.group_size)
        if all(p.evaluate is p.mask_mod for p in parts):
            return Lowered(mask_mod, mask_mod)
        evaluate = PerHeadMod(tuple(p.evaluate for p in parts), table, self.group_size)
        return Lowered(mask_mod, evaluate)

    def __repr__(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size != 1 else ""
        return f"per_head({', '.join(map(repr, self.masks))}{group})"


class PerHeadMod(MaskModFn):
    """per_head's mask_mod: every distinct mask's value, the one of head ``h`` kept.

    ``table[i]`` is the distinct mask of ``masks[i]``; head h uses
    ``table[(h // group_size) % len(table)]``. Index arithmetic and ``where`` only.
    """

    __slots__ = ("mods", "table", "group_size")
    _name = "per_head"

    def __init__(self, mods: tuple[MaskMod, ...], table: Tensor, group_size: int) -> None:
        self.mods = mods
        self.table = table
        self.group_size = group_size

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        which = self.table[(h // self.group_size) % self.table.shape[0]]
        result = self.mods[0](b, h, q_idx, kv_idx)
        for i, mod in enumerate(self.mods[1:], 1):
            result = torch.where(which == i, mod(b, h, q_idx, kv_idx), result)
        return result

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(map(repr, self.mods))}, table={self.table.tolist()})"


def per_head(*masks: Mask, group_size: Any = 1) -> Mask:
    """A different mask per head: head ``h`` attends as ``masks[(h // group_size) %
    len(masks)]``, for ``H`` a multiple of ``len(masks) * group_size``.

    With ``group_size`` the number of query heads per kv head (grouped-query attention),
    ``per_head(*one_mask_per_kv_head, group_size=H // H_kv)`` gives each kv head's group
    its mask. Heads that share a mask are built once; if every head shares one mask, it is
    that mask (broadcast over the heads).

    Args:
        *masks: one flexmask mask per head (or per head group), at least one.
        group_size: consecutive heads that share each entry of ``masks``, >= 1.

    Raises:
        TypeError: an entry that is not a flexmask mask, or a group_size that is not an int.
        ValueError: no masks, a group_size below 1, or (when built) an ``H`` that is not a
            multiple of ``len(masks) * group_size``.

    Example:
        >>> import flexmask
        >>> m = flexmask.per_head(flexmask.causal(), flexmask.sliding_window(1))
        >>> print(m.show(3, head=1))
        ■ ⬚ ⬚
        ⬚ ■ ⬚
        ⬚ ⬚ ■
        >>> bm = flexmask.create_block_mask(m, 1, 4, 256, 256, device="cpu")
        >>> bm.full_kv_num_blocks[0].tolist()  # heads 0, 2 causal; 1, 3 the window
        [[0, 1], [0, 0], [0, 1], [0, 0]]
    """
    if not masks:
        raise ValueError("per_head needs at least one mask: per_head(mask_0, mask_1, ...)")
    for i, mask in enumerate(masks):
        if not isinstance(mask, Mask):
            raise TypeError(
                f"masks[{i}] must be a flexmask Mask, got {type(mask).__name__}; wrap a plain "
                f"mask_mod first: flexmask.from_mask_mod(fn, key=...)"
            )
    checked = tuple(masks)
    group = check_int(group_size, "group_size", minimum=1)
    if all(m == checked[0] for m in checked[1:]):
        return checked[0]  # one mask for every head: no head dimension to write
    return PerHead(checked, group)
