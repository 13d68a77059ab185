"""One build's spec: a mask with its shape, block sizes, window and device, validated once.

Every entry point makes one from the user's call — ``create_block_mask``, ``MaskCache.get``,
``flexmask.lazy``, a Mask passed to ``flexmask.flex_attention``, the formats' lowerings,
decode steps, context-parallel shards — and passes it whole: the cache key (``Spec.key``), the
lazy handle, the grid and the build all come from it, and nothing downstream parses the
arguments or validates the mask again. Making one is arithmetic on Python ints: nothing is
allocated on any device (a handle made in a DataLoader worker must not initialise CUDA
there); the device is resolved where it builds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from flexmask._validate import check_device, check_int, check_window
from flexmask.algebra import Extent, Mask
from flexmask.blocks import BlockGrid, block_sizes, offsets, per_row
from flexmask.builders.size_check import check_size
from flexmask.builders.zero_sizes import no_rows_or_heads

_NO_DEVICE = torch.device("meta")
_WINDOW_NAME = "max(q_offset + Q_LEN, kv_offset + KV_LEN)"

Offset = int | tuple[int, ...]


class Spec(NamedTuple):
    """A validated build: hashable (the mask by its content key), equal when the builds are.

    Offsets are one int, or — where either side was given per batch row — a tuple of one
    per row on both sides (the grid lays out per-row tiles for both then)."""

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
    q_offset: Offset = 0
    kv_offset: Offset = 0
    row_offsets: bool = False
    """Offsets were given per batch row (equal ones are held as one int): the window's
    mask_mod reads them per row."""

    @property
    def empty(self) -> bool:
        """B=0 or H=0: built as one row (head), then emptied, as torch's."""
        return self.batch == 0 or self.heads == 0

    def one_row(self) -> Spec:
        """The spec of the one row (head) an empty spec is built from."""
        return self._replace(batch=self.batch or 1, heads=self.heads or 1)

    @property
    def per_row(self) -> bool:
        """The window differs by row: its tiles (or its mask_mod's offsets) are per row."""
        return self.row_offsets or isinstance(self.q_offset, tuple)

    def reduced(self) -> Spec:
        """The build a cache holds: B (H) cut to 1 where neither the mask nor the window
        depends on the row (head); flex_attention broadcasts the rest."""
        rows = self.batch if self.mask.batch_dependent or self.per_row else 1
        return self._replace(batch=rows, heads=self.heads if self.mask.head_dependent else 1)

    @property
    def key(self) -> tuple:
        """The cache key: the reduced shape, the resolved device, the mask's content key and
        the window. From ints alone: no grid, no tensor (what a cache hit costs)."""
        device = torch.device(check_device(self.device, self.mask.device))
        spec = self.reduced()
        return (
            spec.batch,
            spec.heads,
            spec.q_len,
            spec.kv_len,
            spec.block_size,
            (device.type, device.index),
            spec.mask.key,
            spec.q_offset,
            spec.kv_offset,
            self.per_row,
        )

    @property
    def reach(self) -> int:
        """The positions the mask was checked for: ``max(q_offset + Q_LEN, kv_offset +
        KV_LEN)`` over the rows."""
        return max(_largest(self.q_offset) + self.q_len, _largest(self.kv_offset) + self.kv_len)

    def at_queries(self, q_offset: Any) -> Spec:
        """The same build with its queries at ``q_offset`` (an int, or one per batch row):
        the next step of a decode. The offsets are checked, the mask is not checked again,
        so the window must stay within the ``reach`` it was checked for."""
        q_off = offsets(q_offset, "q_offset", self.batch or 1)
        q_side, kv_side = _sides(q_off, _listed(self.kv_offset), self.batch or 1)
        moved = self._replace(
            q_offset=q_side, kv_offset=kv_side, row_offsets=self.row_offsets or per_row(q_offset)
        )
        if moved.reach > self.reach:
            raise ValueError(
                f"q_offset={q_off!r} with Q_LEN={self.q_len} reaches position {moved.reach}, "
                f"past the {self.reach} the mask was checked for: make a new spec "
                f"(make_spec) for the longer window"
            )
        return moved

    def check_fits(self, device: torch.device | None, *, reduced: bool = True) -> None:
        """Refuses the build on ``device`` if its BlockMask cannot fit there (``reduced``: B
        and H cut as ``reduced`` cuts them, as the cache builds; else the whole ``(B, H)``)."""
        check_size(
            self.mask,
            self.batch or 1,
            self.heads or 1,
            self.q_len,
            self.kv_len,
            device,
            self.block_size,
            per_row=self.per_row,
            reduced=reduced,
        )

    def grid(self, *, sized: bool = True) -> BlockGrid:
        """The tiles of this build, on the resolved device; the mask is not checked again.
        The memory bound, checked at validation on the CPU, is checked here for a device
        only known now (``sized=False``: the caller bounds the memory itself — a
        context-parallel rank builds only its own rows)."""
        device = check_device(self.device, self.mask.device)
        if sized and (self.device or self.mask.device or _NO_DEVICE).type != "cpu":
            self.check_fits(device)
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
    any_heads: bool = False,
) -> Spec:
    """Validates a build's arguments and the mask against them, once, and returns its spec.

    ``sized=False`` skips the memory bound of the whole BlockMask: the caller builds only a
    part of the window (a context-parallel rank's rows) or bounds it itself.
    ``any_heads``: H=None validates the mask for any head count (a lowering to a format
    that lists its heads' masks apart) rather than for one head."""
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (e.g. flexmask.causal() & flexmask.document(lens)), "
            f"got {type(mask).__name__}"
        )
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
    for offset, name, length, length_name, block in (
        (q_off, "q_offset", q_len, "Q_LEN", block_size[0]),
        (kv_off, "kv_offset", kv_len, "KV_LEN", block_size[1]),
    ):
        check_window(_largest(offset), length, block, name, length_name)
    # With no device given and none in the mask's data no piece compares devices, so the
    # check needs none: the default device is resolved by the build, in the process that
    # builds (asking for it here could initialise CUDA in a worker).
    where = given or mask.device or _NO_DEVICE
    reach = max(_largest(q_off) + q_len, _largest(kv_off) + kv_len)
    windowed = isinstance(q_off, list) or isinstance(kv_off, list) or q_off != 0 or kv_off != 0
    name = _WINDOW_NAME if windowed else "max(Q_LEN, KV_LEN)"
    checked_heads = None if any_heads and H is None else built_heads
    mask.validate(Extent(rows, checked_heads, reach, where, name))
    q_side, kv_side = _sides(q_off, kv_off, rows)
    spec = Spec(
        mask,
        batch,
        heads,
        q_len,
        kv_len,
        block_size,
        given,
        q_side,
        kv_side,
        per_row(q_offset) or per_row(kv_offset),
    )
    if sized and where.type == "cpu":  # another device's memory is read where it builds
        spec.check_fits(where)
    return spec


def _sides(q_off: int | list[int], kv_off: int | list[int], rows: int) -> tuple[Offset, Offset]:
    """Both offsets as held: ints, or one per row on both sides where either is per row."""
    if not isinstance(q_off, list) and not isinstance(kv_off, list):
        return q_off, kv_off
    return tuple(_listed_rows(q_off, rows)), tuple(_listed_rows(kv_off, rows))


def _listed_rows(offset: int | list[int], rows: int) -> list[int]:
    return offset if isinstance(offset, list) else [offset] * rows


def _largest(offset: int | list[int] | tuple[int, ...]) -> int:
    return max(offset) if isinstance(offset, (list, tuple)) else offset


def _listed(offset: Offset) -> int | list[int]:
    return list(offset) if isinstance(offset, tuple) else offset


def make_grid(
    mask: Mask,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    device: Any,
    BLOCK_SIZE: Any,
    q_offset: Any = 0,
    kv_offset: Any = 0,
) -> BlockGrid:
    """The tiles of a build of ``mask`` (its spec's grid, the mask validated once): for a
    caller that classifies tiles itself (a balancer weighing blocks)."""
    if B is not None:
        check_int(B, "B", minimum=1)
    if H is not None:
        check_int(H, "H", minimum=1)
    spec = make_spec(
        mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, q_offset, kv_offset, sized=False
    )
    return spec.grid(sized=False)
