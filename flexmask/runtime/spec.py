"""One build's spec: a mask with its shape, block sizes, window and device, validated once.

A ``Spec`` is made where the user calls (``MaskCache.get``, ``flexmask.lazy``, a Mask passed to
``flexmask.flex_attention``) and carried from there: the cache key, the lazy handle and the
build all come from it, and nothing downstream validates the mask again. Making one is
arithmetic on Python ints: nothing is allocated on any device (a handle made in a DataLoader
worker must not initialise CUDA there); the device is resolved where it builds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from flexmask._validate import check_device, check_int
from flexmask.algebra import Extent, Mask
from flexmask.blocks import BlockGrid, block_sizes, offsets, per_row
from flexmask.builders import check_size, no_rows_or_heads

_NO_DEVICE = torch.device("meta")
_WINDOW_NAME = "max(q_offset + Q_LEN, kv_offset + KV_LEN)"


class Spec(NamedTuple):
    """A validated build: hashable (the mask by its content key), equal when the builds are."""

    mask: Mask
    batch: int
    """B: the rows of per-row data where B was None, else 1 where it was None; 0 allowed."""
    heads: int
    """H, 1 where it was None; 0 allowed."""
    q_len: int
    kv_len: int
    block_size: tuple[int, int]
    device: torch.device | None
    """As given; None: the mask's data's device, else torch's default, resolved at the build."""
    q_offset: int | tuple[int, ...] = 0
    kv_offset: int | tuple[int, ...] = 0
    row_offsets: bool = False
    """Offsets were given per batch row (equal ones are held as one int)."""

    @property
    def empty(self) -> bool:
        """B=0 or H=0: built as one row (head), then emptied, as torch's."""
        return self.batch == 0 or self.heads == 0

    def one_row(self) -> Spec:
        """The spec of the one row (head) an empty spec is built from."""
        return self._replace(batch=self.batch or 1, heads=self.heads or 1)

    @property
    def reach(self) -> int:
        """The positions the mask was checked for: ``max(q_offset + Q_LEN, kv_offset +
        KV_LEN)`` over the rows."""
        return max(
            _largest(_listed(self.q_offset)) + self.q_len,
            _largest(_listed(self.kv_offset)) + self.kv_len,
        )

    def at_queries(self, q_offset: Any) -> Spec:
        """The same build with its queries at ``q_offset`` (an int, or one per batch row):
        the next step of a decode. The offsets are checked, the mask is not checked again,
        so the window must stay within the ``reach`` it was checked for."""
        q_off = offsets(q_offset, "q_offset", self.batch or 1)
        moved = self._replace(
            q_offset=_tupled(q_off), row_offsets=self.row_offsets or per_row(q_offset)
        )
        if moved.reach > self.reach:
            raise ValueError(
                f"q_offset={q_off!r} with Q_LEN={self.q_len} reaches position {moved.reach}, "
                f"past the {self.reach} the mask was checked for: make a new spec "
                f"(make_spec) for the longer window"
            )
        return moved

    def grid(self, *, sized: bool = True) -> BlockGrid:
        """The tiles of this build, on the resolved device; the mask is not checked again.
        The memory bound, checked at validation on the CPU, is checked here for a device
        only known now (``sized=False``: the caller builds only a part of this window, a
        context-parallel rank's rows, and bounds its own memory)."""
        device = check_device(self.device, self.mask.device)
        if sized and (self.device or self.mask.device or _NO_DEVICE).type != "cpu":
            check_size(
                self.mask,
                self.batch,
                self.heads,
                self.q_len,
                self.kv_len,
                device,
                self.block_size,
                _listed(self.q_offset),
                _listed(self.kv_offset),
                reduced=True,
            )
        return BlockGrid.make(
            self.batch,
            self.heads,
            self.q_len,
            self.kv_len,
            *self.block_size,
            device,
            q_offset=_listed(self.q_offset),
            kv_offset=_listed(self.kv_offset),
            row_offsets=self.row_offsets,
        )


def make_spec(
    mask: Mask,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    device: Any = None,
    BLOCK_SIZE: Any = 128,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    *,
    sized: bool = True,
) -> Spec:
    """Validates a build's arguments and the mask against them, once, and returns its spec.

    ``sized=False`` skips the memory bound of the whole BlockMask: the caller builds only a
    part of the window (a context-parallel rank's rows) and bounds its own memory."""
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
    batch = 1 if B is None else check_int(B, "B", minimum=0)
    heads = 1 if H is None else check_int(H, "H", minimum=0)
    q_len = check_int(Q_LEN, "Q_LEN", minimum=0)
    kv_len = check_int(KV_LEN, "KV_LEN", minimum=0)
    block_size = block_sizes(BLOCK_SIZE)
    if mask.rows is not None and B is None:
        batch = mask.rows
    given = None if device is None else check_device(device)
    empty = no_rows_or_heads(mask, B, H)  # per-row data for B=0 is refused, as torch's
    rows, built_heads = (batch or 1, heads or 1) if empty is not None else (batch, heads)
    q_off = offsets(q_offset, "q_offset", rows)
    kv_off = offsets(kv_offset, "kv_offset", rows)
    row_offsets = per_row(q_offset) or per_row(kv_offset)
    # With no device given and none in the mask's data no piece compares devices, so the
    # check needs none: the default device is resolved by the build, in the process that
    # builds (asking for it here could initialise CUDA in a worker).
    where = given or mask.device or _NO_DEVICE
    reach = max(_largest(q_off) + q_len, _largest(kv_off) + kv_len)
    windowed = isinstance(q_off, list) or isinstance(kv_off, list) or q_off != 0 or kv_off != 0
    name = _WINDOW_NAME if windowed else "max(Q_LEN, KV_LEN)"
    mask.validate(Extent(rows, built_heads, reach, where, name))
    if sized and where.type == "cpu":  # another device's memory is read where it builds
        check_size(
            mask, rows, built_heads, q_len, kv_len, where, block_size, q_off, kv_off, reduced=True
        )
    return Spec(
        mask,
        batch,
        heads,
        q_len,
        kv_len,
        block_size,
        given,
        _tupled(q_off),
        _tupled(kv_off),
        row_offsets,
    )


def _largest(offset: int | list[int]) -> int:
    return max(offset) if isinstance(offset, list) else offset


def _tupled(offset: int | list[int]) -> int | tuple[int, ...]:
    return tuple(offset) if isinstance(offset, list) else offset


def _listed(offset: int | tuple[int, ...]) -> int | list[int]:
    return list(offset) if isinstance(offset, tuple) else offset
