"""The steps of one generation (``DecodeMasks``): where each step's queries sit, and its mask."""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.inference.appending import rows_for
from flexmask.inference.arguments import (
    block_pair,
    cache_lengths,
    check_step_size,
    check_window,
    is_scalar,
    step_device,
)
from flexmask.inference.step import DecodeStep, span
from flexmask.inference.window import build_window, step_spec


class DecodeMasks:
    """The BlockMasks of one generation, one step per position of the growing cache.

    Two ways to walk the steps, each of which says where every step's queries sit:

    * ``for step in steps:`` — the constructor's ``cache_lens`` first, then every row moves
      ``q_len`` tokens per step; it stops before a window would pass ``capacity``
      (``break`` when generation ends). Iterating again resumes after the last step given.
    * ``step = steps.at(cache_lens)`` — the step whose queries start at the given per-row
      cache lengths, the very numbers the loop writes the KV cache at (ragged batches,
      finished rows that stay put, speculative decoding that accepts a different number of
      tokens per row).

    Each gives a ``DecodeStep``: ``step.block_mask`` for flex_attention, ``step.cache_lens``
    and ``step.positions`` for the cache writes and position ids, and a repr that shows them.

    With ``q_len`` below the q block size (decode, short verify chunks) a step keeps the
    BlockMask, writes the new lengths into its mask_mod's offset tensor in place (a *reuse*)
    and rewrites only the rows whose listed kv blocks changed (an *append*):

    * ``causal()``: blocks ``0 .. (cache_len + q_len - 1) // block``, from the lengths alone;
    * masks whose rows are kv intervals (``document``, ``sliding_window``, ``padding``,
      ``prefix`` unions and their ``&``): the blocks of each query's interval, read from the
      mask for the next 256 positions of every row at once, so a decode step compares ints;
    * ``tree(...)`` (or ``causal() & tree(...)``), ``q_len = 1``: a row that moves down its
      own branch adds the blocks of the tokens it passed (a token's ancestors are its
      parent's and itself); a row that leaves its branch or moves back builds the step.

    Other masks, or ``append=False``, build each step with ``decode_mask``. All give tensors
    equal to torch's build of the shifted mask_mod. Since the BlockMask may be rewritten in
    place, a step is valid until the next one is made: an earlier step's ``block_mask``
    raises rather than return a mask for other positions.

    ``advance(step)`` (moves, then returns the next BlockMask) is kept for loops that read
    ``block_mask`` before it. Called while the current step was never read (the
    constructor's, in ``steps = DecodeMasks(...); bm = steps.advance()``) it raises: that loop
    skipped the first step and fed every query the mask of the position after it.

    Args:
        mask, cache_lens, capacity, q_len, heads, block_size, device: as for ``decode_mask``;
            ``capacity`` is required (it fixes the shapes of every step).
        append: reuse and append where possible (default); False builds every step.

    Example:
        >>> import flexmask
        >>> steps = flexmask.DecodeMasks(flexmask.causal(), [126, 3], capacity=512)
        >>> for step in steps:
        ...     print(step, step.block_mask.kv_num_blocks.flatten().tolist())
        ...     if step.index == 2:
        ...         break
        DecodeStep(0: queries at [126, 3], q_len=1, capacity=512, build) [1, 1]
        DecodeStep(1: queries at [127, 4], q_len=1, capacity=512, reuse) [1, 1]
        DecodeStep(2: queries at [128, 5], q_len=1, capacity=512, append) [2, 1]
        >>> steps.at([300, 6])   # any lengths: each row's cache as the loop wrote it
        DecodeStep(3: queries at [300, 6], q_len=1, capacity=512, append)
        >>> steps.builds, steps.appends, steps.reuses
        (1, 2, 1)
    """

    def __init__(
        self,
        mask: Mask,
        cache_lens: Any,
        capacity: int,
        *,
        q_len: int = 1,
        heads: int = 1,
        block_size: int | tuple[int, int] = 128,
        device: torch.device | str | None = None,
        append: bool = True,
    ) -> None:
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
        self.mask = mask
        self._lens = cache_lengths(cache_lens, mask)
        self.q_len = check_int(q_len, "q_len", minimum=1)
        self.capacity = check_int(capacity, "capacity", minimum=1)
        self.heads = check_int(heads, "heads", minimum=1)
        blocks = block_pair(block_size)
        self.device = step_device(mask, device)
        check_window(self._lens, self.q_len, self.capacity)
        rows = len(self._lens)
        check_step_size(
            self._lens, self.q_len, self.capacity, self.heads, blocks, rows, self.device
        )
        self._spec = step_spec(
            mask, self._lens, self.q_len, self.capacity, self.heads, blocks, self.device
        )
        self._rows = rows_for(self._spec, self._lens, self.device, bool(append))
        self.appendable = self._rows is not None
        self.builds = 0
        """Steps built from structure (including the first)."""
        self.appends = 0
        """Steps that reused the BlockMask and appended a kv block to some row."""
        self.reuses = 0
        """Steps that reused the BlockMask, writing only the new cache lengths."""
        self._index = 0  # steps made before the current one
        self._generation = 0  # bumped by every move: what makes an earlier DecodeStep stale
        self._served = False  # the current step was given out (iteration, at, block_mask)
        self._kind = "build"
        self._block_mask = self._build_step()

    @property
    def block_mask(self) -> BlockMask:
        """The current step's BlockMask (prefer the ``DecodeStep`` that iteration or ``at``
        give: it says which positions it is for)."""
        self._served = True
        return self._block_mask

    @property
    def cache_lens(self) -> list[int]:
        """Each row's tokens in the cache before the current step's queries."""
        return list(self._lens)

    def __repr__(self) -> str:
        return (
            f"DecodeMasks({self.mask!r}, current step {self._index}: queries at "
            f"{span(self._lens, self.q_len)}{'' if self._served else ' (not yet given)'}, "
            f"q_len={self.q_len}, capacity={self.capacity}, builds={self.builds}, "
            f"appends={self.appends}, reuses={self.reuses})"
        )

    def __iter__(self) -> Iterator[DecodeStep]:
        """The steps from the current one on (each position once), every row moving
        ``q_len`` tokens per step, until a window would pass ``capacity``."""
        while True:
            if self._served:
                moved = [n + self.q_len for n in self._lens]
                if max(moved) + self.q_len > self.capacity:
                    return
                self._move(moved)
            yield self._step()

    def at(self, cache_lens: Any) -> DecodeStep:
        """The step whose row b queries start at ``cache_lens[b]`` (an int for every row, or
        one per row): forward, in place or back (a slot reused by a new request).

        Raises:
            ValueError: a negative length, another number of rows, or a window past
                ``capacity``. TypeError: non-integer lengths.
        """
        if is_scalar(cache_lens):
            lens = [check_int(cache_lens, "cache_lens", minimum=0)] * len(self._lens)
        else:
            lens = cache_lengths(cache_lens, self.mask)
        if len(lens) != len(self._lens):
            raise ValueError(
                f"cache_lens gives {len(lens)} rows but the generation has {len(self._lens)}: "
                f"pass one int, or one per row"
            )
        check_window(lens, self.q_len, self.capacity)
        if lens != self._lens:
            self._move(lens)
        return self._step()

    def advance(self, step: Any = 1) -> BlockMask:
        """Moves every row's cache forward by ``step`` tokens (an int, or one per row) and
        returns the next step's BlockMask. Prefer ``for step in steps`` or ``at``.

        Raises:
            RuntimeError: the current step's BlockMask was never read (``advance`` right
                after the constructor would skip its step, the first).
            ValueError: a negative step, or a row whose next window runs past ``capacity``.
        """
        if isinstance(step, numbers.Integral):
            steps = [check_int(step, "step", minimum=0)] * len(self._lens)
        else:
            steps = cache_lengths(step, self.mask, "step")
        if len(steps) != len(self._lens):
            raise ValueError(
                f"step gives {len(steps)} rows but the generation has {len(self._lens)}: pass "
                f"one int, or one per row"
            )
        if not self._served:
            raise RuntimeError(
                f"advance() would skip step {self._index}, whose queries sit at "
                f"{span(self._lens, self.q_len)} and whose BlockMask was never read: the "
                f"constructor already holds the first step, so a loop that calls advance() "
                f"before each step feeds every query the mask of a later position. Loop with "
                f"`for step in steps:` (step.block_mask, step.cache_lens), or call "
                f"`steps.at(cache_lens)` with the lengths the KV cache is written at"
            )
        new_lens = [length + s for length, s in zip(self._lens, steps, strict=True)]
        check_window(new_lens, self.q_len, self.capacity)
        self._move(new_lens)
        return self.block_mask

    # ----------------------------------------------------------------- moving the window
    def _step(self) -> DecodeStep:
        self._served = True
        return DecodeStep(self, self._generation, self._block_mask, self._index, self._kind)

    def _offsets(self) -> Tensor:
        return torch.tensor(self._lens, dtype=torch.int64, device=self.device)

    def _build_step(self) -> BlockMask:
        self.builds += 1
        return build_window(self._spec.at_queries(self._lens), self._offsets())

    def _move(self, new_lens: list[int]) -> None:
        """Makes the step at ``new_lens`` (checked) the current one: the kept BlockMask
        rewritten where its rows can follow (``appending``), else a build."""
        old_lens = self._lens
        self._lens = new_lens
        self._index += 1
        self._generation += 1
        self._served = False
        offsets = self._offsets()
        rows = self._rows
        kind = "build" if rows is None else rows.move(self._block_mask, old_lens, new_lens, offsets)
        self._kind = kind
        if kind == "build":
            self._block_mask = self._build_step()
            return
        self._block_mask.mask_mod.q_offset.copy_(offsets)  # type: ignore[attr-defined]
        if kind == "append":
            self.appends += 1
        else:
            self.reuses += 1
