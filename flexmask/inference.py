"""Inference masks: the training mask evaluated on the window of a decode or prefill step.

A step feeds row b's queries at positions ``[cache_lens[b], cache_lens[b] + q_len)`` against a
KV cache of fixed ``capacity``. Its BlockMask is the window of the training expression: rows
``[cache_lens[b], cache_lens[b] + q_len)``, columns ``[0, capacity)``. Documents, a tree or
padding describe the whole (growing) sequence; causal is aligned so the new queries see the
whole cache and nothing past themselves.

Fixed shapes, values in tensors: the BlockMask's tensors are ``(B, H, ceil(q_len / block),
ceil(capacity / block))`` at every step, and its mask_mod (a ``ShiftedMod``) holds the cache
lengths as a ``(B,)`` tensor and the mask's lookups padded to ``capacity``. So compiled
``flex_attention`` traces the first step and never recompiles as the cache grows.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import (
    INT64_MAX,
    block_mask_bytes,
    check_fits,
    check_int,
    check_parents,
    int_vector,
)
from flexmask.algebra.mask import And, Mask, MaskMod, ShiftedMod
from flexmask.blocks.read import BLOCK_FIELDS
from flexmask.builders.create import build
from flexmask.pieces import causal, tree
from flexmask.pieces.tree import Tree
from flexmask.runtime.spec import Spec, make_spec


def _block_pair(block_size: Any) -> tuple[int, int]:
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a (q, kv) pair, got {block_size!r}")
        return (
            check_int(block_size[0], "block_size[0]", minimum=1),
            check_int(block_size[1], "block_size[1]", minimum=1),
        )
    size = check_int(block_size, "block_size", minimum=1)
    return size, size


def _is_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Integral) or (isinstance(value, Tensor) and value.dim() == 0)


def _lens(cache_lens: Any, mask: Mask, name: str = "cache_lens") -> list[int]:
    """Per-row cache lengths as Python ints: one int for every row (``mask.rows`` rows, else
    one), or one per row."""
    if _is_scalar(cache_lens):
        value = check_int(cache_lens, name, minimum=0)
        return [value] * (mask.rows or 1)
    # The decode loop's own lengths, every step: plain ints need no tensor round trip.
    if (
        type(cache_lens) is list
        and cache_lens
        and all(type(v) is int for v in cache_lens)
        and min(cache_lens) >= 0
        and max(cache_lens) <= INT64_MAX
        and (mask.rows is None or mask.rows == len(cache_lens))
    ):
        return list(cache_lens)
    if not isinstance(cache_lens, (Sequence, Tensor)) and not hasattr(cache_lens, "__array__"):
        raise TypeError(
            f"{name} must be an int or one int per batch row (list or 1-D integer tensor), "
            f"got {type(cache_lens).__name__}"
        )
    values = int_vector(cache_lens, name).tolist()
    if not values:
        raise ValueError(f"{name} must hold one value per batch row, got an empty list")
    for i, v in enumerate(values):
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
    if mask.rows is not None and mask.rows != len(values):
        raise ValueError(
            f"{name} gives {len(values)} rows but the mask's data is given for "
            f"{mask.rows} rows: pass one value per row of the mask"
        )
    return values


def _check_window(lens: list[int], q_len: int, capacity: int) -> None:
    for i, length in enumerate(lens):
        if length + q_len > capacity:
            raise ValueError(
                f"cache_lens[{i}]={length} plus q_len={q_len} is past capacity={capacity}: "
                f"the step's queries must fit in the cache (raise capacity to the next bucket)"
            )


def _check_step_size(
    lens: list[int],
    q_len: int,
    capacity: int,
    heads: int,
    blocks: tuple[int, int],
    rows: int,
    device: torch.device,
) -> None:
    """Refuses, before anything is allocated, a step whose BlockMask cannot fit the device
    or whose cache positions (padded to whole kv blocks) overflow int64."""
    q_block, kv_block = blocks
    if -(-capacity // kv_block) * kv_block > INT64_MAX + 1:
        raise ValueError(
            f"capacity={capacity} rounded up to the kv block size {kv_block} is past 2**63: "
            f"cache positions are int64 (with capacity None it is max(cache_lens) + q_len)"
        )
    nq, nkv = -(-q_len // q_block), -(-capacity // kv_block)
    check_fits(
        block_mask_bytes(rows, heads, q_len, capacity, q_block, kv_block) + 16 * (nq + nkv) * rows,
        device,
        f"the step's BlockMask for capacity={capacity} (with capacity None: max(cache_lens)="
        f"{max(lens)} + q_len={q_len}), heads={heads}, block_size={blocks}",
        "the cache holds max(cache_lens) + q_len tokens at most: pass the cache lengths in "
        "tokens and a capacity the KV cache really has",
    )


def _device(mask: Mask, device: Any) -> torch.device:
    if device is None:
        return mask.device or torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device or its name, got {device!r}") from err


def _with_mask_mod(block_mask: BlockMask, mask_mod: MaskMod) -> BlockMask:
    """The same tensors with another mask_mod (one mask_mod class for every step)."""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    return BlockMask(
        seq_lengths=(q_len, kv_len),
        **{name: getattr(block_mask, name) for name in BLOCK_FIELDS},
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=mask_mod,
    )


def decode_mask(
    mask: Mask,
    cache_lens: Any,
    q_len: int = 1,
    capacity: int | None = None,
    *,
    heads: int = 1,
    block_size: int | tuple[int, int] = 128,
    device: torch.device | str | None = None,
) -> BlockMask:
    """The BlockMask of one decode or chunked-prefill step, from the training mask.

    Row b's queries sit at positions ``[cache_lens[b], cache_lens[b] + q_len)`` of its
    sequence; keys are the whole cache ``[0, capacity)``. The result equals torch's
    ``create_block_mask`` of ``lambda b, h, q, kv: mask.mask_mod(b, h, q + cache_lens[b], kv)``
    with ``Q_LEN=q_len, KV_LEN=capacity`` (whole tensors), built from structure in
    O(blocks of the new rows). Its mask_mod takes local query indices and holds the cache
    lengths as a ``(B,)`` tensor, so compiled flex_attention does not recompile as they grow.

    ::

        causal(), cache_lens=[3, 1], q_len=2, capacity=6
        row 0:  ■ ■ ■ ■ ⬚ ⬚      row 1:  ■ ■ ⬚ ⬚ ⬚ ⬚
                ■ ■ ■ ■ ■ ⬚              ■ ■ ■ ⬚ ⬚ ⬚

    Args:
        mask: the training expression; its data (documents, tree, padding) describes the
            whole sequence up to ``capacity``.
        cache_lens: tokens already in the cache — one int for every row (the BlockMask then
            has B = 1 and broadcasts, unless the mask's data is per row), or one per row.
        q_len: new queries per row in this step (1 for decode, the chunk for prefill).
        capacity: the fixed KV cache length (bucket it: one compile per capacity).
            None: the smallest that fits, ``max(cache_lens) + q_len``.
        heads: H of the BlockMask.
        block_size: tile size, an int or a (q, kv) pair; for paged KV the kv size must be the
            page size.
        device: where to build (None: the mask's device, else the CPU).

    Returns:
        A torch BlockMask of shape ``(B, heads, ...)`` with ``seq_lengths == (q_len, capacity)``.

    Raises:
        ValueError: a negative cache length, ``q_len < 1``, or a row whose window runs past
            ``capacity``. TypeError: non-integer arguments.

    Example:
        >>> import flexmask
        >>> bm = flexmask.decode_mask(flexmask.causal(), [300, 40], q_len=1, capacity=512)
        >>> bm.kv_num_blocks.tolist(), bm.seq_lengths
        ([[[3]], [[1]]], (1, 512))
    """
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
    lens = _lens(cache_lens, mask)
    q_len = check_int(q_len, "q_len", minimum=1)
    if capacity is None:
        capacity = max(lens) + q_len
    capacity = check_int(capacity, "capacity", minimum=1)
    heads = check_int(heads, "heads", minimum=1)
    _check_window(lens, q_len, capacity)
    dev = _device(mask, device)
    blocks = _block_pair(block_size)
    per_row = not _is_scalar(cache_lens) or mask.rows is not None
    _check_step_size(lens, q_len, capacity, heads, blocks, len(lens) if per_row else 1, dev)
    offsets = torch.tensor(lens, dtype=torch.int64, device=dev)
    if _is_scalar(cache_lens) and mask.rows is None:
        offsets = offsets[0]  # one length for every row: a (1, H, ...) BlockMask, broadcast
    return _build(
        _step_spec(mask, lens[: offsets.numel()], q_len, capacity, heads, blocks, dev), offsets
    )


def _step_spec(
    mask: Mask,
    lens: list[int],
    q_len: int,
    capacity: int,
    heads: int,
    blocks: tuple[int, int],
    device: torch.device,
) -> Spec:
    """The spec of a step (its queries at ``lens``, one per row it builds), the mask
    validated here, once: every window fits the capacity, so every later step of the same
    generation reaches the same positions and moves the spec (``Spec.at_queries``) without
    checking the mask again."""
    return make_spec(mask, len(lens), heads, q_len, capacity, device, blocks, q_offset=lens)


def _build(spec: Spec, offsets: Tensor) -> BlockMask:
    """The window's BlockMask with a ShiftedMod over ``offsets`` (held, not copied, equal to
    the spec's query offsets): B is their count when per row (1-D), else 1."""
    built = build(spec.mask, spec.grid())
    # The build's own lowered mask (lookups padded to the capacity), not a second lowering:
    # its ShiftedMod may hold the offsets as one value where every row's is equal, while
    # the step's mask_mod holds these very offsets, (B,) or 0-d as given, which DecodeMasks
    # updates in place (one shape every step: no recompiles).
    inner = built.mask_mod
    if isinstance(inner, ShiftedMod):
        inner = inner.mod
    return _with_mask_mod(built, ShiftedMod(inner, offsets, torch.zeros_like(offsets)))


def _span(lens: Sequence[int], q_len: int) -> str:
    """Each row's query positions, as ``[126, 3]`` (one query) or ``[126-129, 3-6]``."""
    if q_len == 1:
        return "[" + ", ".join(map(str, lens)) + "]"
    return "[" + ", ".join(f"{n}-{n + q_len - 1}" for n in lens) + "]"


class DecodeStep:
    """One step of a generation: its BlockMask and the positions its queries sit at.

    Row b's queries are positions ``cache_lens[b] .. cache_lens[b] + q_len - 1``: write their
    keys and values at those cache indices, and pass ``block_mask`` to flex_attention. A step
    is valid until its ``DecodeMasks`` makes the next one (the append path rewrites the one
    BlockMask in place); reading ``block_mask`` of an earlier step raises instead of
    returning the later step's mask.

    Example:
        >>> import flexmask
        >>> step = next(iter(flexmask.DecodeMasks(flexmask.causal(), [126, 3], capacity=512)))
        >>> step
        DecodeStep(0: queries at [126, 3], q_len=1, capacity=512, build)
        >>> step.cache_lens, step.positions
        ([126, 3], [range(126, 127), range(3, 4)])
    """

    __slots__ = (
        "_owner",
        "_generation",
        "_block_mask",
        "index",
        "_lens",
        "q_len",
        "capacity",
        "kind",
    )

    def __init__(
        self, owner: DecodeMasks, generation: int, block_mask: BlockMask, index: int, kind: str
    ) -> None:
        self._owner = owner
        self._generation = generation
        self._block_mask = block_mask
        self.index = index
        """Steps made before this one by its ``DecodeMasks`` (0: the constructor's)."""
        self._lens = tuple(owner._lens)
        self.q_len = owner.q_len
        self.capacity = owner.capacity
        self.kind = kind
        """How its BlockMask was made: "build" (from structure), "append" or "reuse"."""

    @property
    def cache_lens(self) -> list[int]:
        """Each row's tokens in the cache before this step's queries (their first position)."""
        return list(self._lens)

    @property
    def positions(self) -> list[range]:
        """Each row's query positions (equally, the cache indices their keys go to)."""
        return [range(n, n + self.q_len) for n in self._lens]

    @property
    def block_mask(self) -> BlockMask:
        """The step's BlockMask, shape ``(B, H, q_len, capacity)``.

        Raises:
            RuntimeError: the ``DecodeMasks`` has made a later step since.
        """
        owner = self._owner
        if owner._generation != self._generation:
            raise RuntimeError(
                f"{self!r} is stale: its DecodeMasks has moved on to queries at "
                f"{_span(owner._lens, owner.q_len)}, and a step's BlockMask is valid only until "
                f"the next step is made (the append path rewrites it in place). Use the step "
                f"the loop gives now (`for step in steps:` or `step = steps.at(cache_lens)`)"
            )
        return self._block_mask

    def __repr__(self) -> str:
        return (
            f"DecodeStep({self.index}: queries at {_span(self._lens, self.q_len)}, "
            f"q_len={self.q_len}, capacity={self.capacity}, {self.kind})"
        )


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
        self._lens = _lens(cache_lens, mask)
        self.q_len = check_int(q_len, "q_len", minimum=1)
        self.capacity = check_int(capacity, "capacity", minimum=1)
        self.heads = check_int(heads, "heads", minimum=1)
        self._blocks = _block_pair(block_size)
        self.device = _device(mask, device)
        _check_window(self._lens, self.q_len, self.capacity)
        _check_step_size(
            self._lens,
            self.q_len,
            self.capacity,
            self.heads,
            self._blocks,
            len(self._lens),
            self.device,
        )
        self._spec = _step_spec(
            mask, self._lens, self.q_len, self.capacity, self.heads, self._blocks, self.device
        )
        # With a single, incomplete q block no block is full (torch pads the q block with
        # masked rows), so a step's BlockMask is each row's set of listed kv blocks. Causal:
        # blocks 0 .. last, from the lengths alone. Masks whose rows are kv intervals
        # (documents, windows, padding, prefix unions): each query's interval, read from the
        # mask's structure. A tree: a token's ancestors are its parent's plus itself, so a step
        # that moves a row down its own branch adds the blocks of the tokens it passed.
        self._path = "build"
        if bool(append) and self.q_len < self._blocks[0]:
            if mask == causal():
                self._path = "causal"
            elif mask.has_intervals() and not mask.head_dependent:
                self._path = "intervals"
            elif self.q_len == 1 and _tree_of(mask) is not None:
                self._path = "tree"
        self.appendable = self._path != "build"
        self._listed: Tensor | None = None  # (B, nkv) bool: each row's listed kv blocks
        if self._path == "intervals":  # what every step's intervals are read with
            self._fixed = (
                self._spec.grid(),
                torch.arange(len(self._lens), device=self.device).view(-1, 1),
                torch.arange(self.q_len, device=self.device),
                self._columns(),
            )
            self._ahead: tuple[list[int], list[list[tuple[int, int]]]] = ([], [])
            if self.q_len == 1:
                self._ranges = self._ranges_at(self._lens)
        # The tree's parents as ints (a step walks a few of them), read once here.
        tree_piece = _tree_of(mask) if self._path == "tree" else None
        self._parents = [p.tolist() for p in tree_piece.parents] if tree_piece is not None else []
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
            f"{_span(self._lens, self.q_len)}{'' if self._served else ' (not yet given)'}, "
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
        if _is_scalar(cache_lens):
            lens = [check_int(cache_lens, "cache_lens", minimum=0)] * len(self._lens)
        else:
            lens = _lens(cache_lens, self.mask)
        if len(lens) != len(self._lens):
            raise ValueError(
                f"cache_lens gives {len(lens)} rows but the generation has {len(self._lens)}: "
                f"pass one int, or one per row"
            )
        _check_window(lens, self.q_len, self.capacity)
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
        steps = _lens(step, self.mask, "step") if not isinstance(step, numbers.Integral) else None
        if steps is None:
            steps = [check_int(step, "step", minimum=0)] * len(self._lens)
        if len(steps) != len(self._lens):
            raise ValueError(
                f"step gives {len(steps)} rows but the generation has {len(self._lens)}: pass "
                f"one int, or one per row"
            )
        if not self._served:
            raise RuntimeError(
                f"advance() would skip step {self._index}, whose queries sit at "
                f"{_span(self._lens, self.q_len)} and whose BlockMask was never read: the "
                f"constructor already holds the first step, so a loop that calls advance() "
                f"before each step feeds every query the mask of a later position. Loop with "
                f"`for step in steps:` (step.block_mask, step.cache_lens), or call "
                f"`steps.at(cache_lens)` with the lengths the KV cache is written at"
            )
        new_lens = [length + s for length, s in zip(self._lens, steps, strict=True)]
        _check_window(new_lens, self.q_len, self.capacity)
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
        return _build(self._spec.at_queries(self._lens), self._offsets())

    def _last_blocks(self, lens: list[int]) -> list[int]:
        return [(length + self.q_len - 1) // self._blocks[1] for length in lens]

    def _move(self, new_lens: list[int]) -> None:
        """Makes the step at ``new_lens`` (checked) the current one."""
        old_lens = self._lens
        crossed = self._last_blocks(new_lens) != self._last_blocks(old_lens)
        self._lens = new_lens
        self._index += 1
        self._generation += 1
        self._served = False
        if self._path == "build":
            self._kind = "build"
            self._block_mask = self._build_step()
            return
        if self._path == "causal":
            bm = self._block_mask
            offsets = self._offsets()
            bm.mask_mod.q_offset.copy_(offsets)  # type: ignore[attr-defined]
            if not crossed:
                self._kind = "reuse"
                self.reuses += 1
                return
            # Each row's block row is kv blocks 0 .. last in order (kv_indices is that order
            # whatever the lengths), so the counts alone say where it ends: any move, any row.
            self._kind = "append"
            self.appends += 1
            last = (offsets + (self.q_len - 1)).div_(self._blocks[1], rounding_mode="floor")
            count = (last + 1).to(torch.int32).view(-1, 1, 1)
            bm.kv_num_blocks.copy_(count.expand_as(bm.kv_num_blocks))
            q_num_blocks = bm.q_num_blocks
            assert q_num_blocks is not None  # every BlockMask built here has its q side
            columns = torch.arange(q_num_blocks.shape[-1], device=self.device)
            q_num_blocks.copy_((columns < count).to(torch.int32).expand_as(q_num_blocks))
            return
        offsets = self._offsets()
        if self._path == "intervals" and self.q_len == 1:
            self._block_mask.mask_mod.q_offset.copy_(offsets)  # type: ignore[attr-defined]
            self._move_ranges(new_lens)
            return
        listed = (
            self._interval_listed(offsets)
            if self._path == "intervals"
            else self._tree_listed(old_lens, new_lens)
        )
        if listed is None:  # a tree row that left its branch: its ancestors are new
            self._kind = "build"
            self._block_mask = self._build_step()
            self._listed = None
            return
        self._block_mask.mask_mod.q_offset.copy_(offsets)  # type: ignore[attr-defined]
        self._write_rows(listed)

    # ------------------------------------------------ listed blocks from the mask's structure
    def _current_listed(self) -> Tensor:
        """(B, nkv) bool: the kv blocks each row of the current BlockMask lists."""
        if self._listed is None:
            q_num_blocks = self._block_mask.q_num_blocks
            assert q_num_blocks is not None  # every BlockMask built here has its q side
            self._listed = q_num_blocks[:, 0] > 0
        return self._listed

    def _interval_listed(self, offsets: Tensor) -> Tensor:
        """(B, nkv) bool: kv blocks holding some of each row's query intervals."""
        grid, rows, window, columns = self._fixed
        kv_block = self._blocks[1]
        queries = offsets.view(-1, 1) + window
        found = self.mask.intervals_at(queries, rows, grid)
        assert found is not None  # has_intervals() was checked when the path was chosen
        # A piece's interval may broadcast (one for every row): each row gets its own here.
        lo = found.lo.expand_as(queries).clamp(min=0)
        hi = found.hi.expand_as(queries).clamp(max=self.capacity - 1)
        first = lo.div(kv_block, rounding_mode="floor").unsqueeze(-1)
        # An empty interval lists nothing, even where lo and hi share a block.
        last = torch.where(lo <= hi, hi.div(kv_block, rounding_mode="floor"), -1).unsqueeze(-1)
        return ((columns >= first) & (columns <= last)).any(1)

    def _move_ranges(self, new_lens: list[int]) -> None:
        """A decode step (q_len 1) of an interval mask: each row lists the blocks of one kv
        interval, ``first .. last``. Those of the next ``_AHEAD`` positions of every row are
        read from the mask in one call and kept as ints, so a step compares ints and writes
        only the rows whose blocks changed."""
        ranges = self._ranges_at(new_lens)
        changed = [
            row
            for row, (new, now) in enumerate(zip(ranges, self._ranges, strict=True))
            if new != now
        ]
        self._ranges = ranges
        if not changed:
            self._kind = "reuse"
            self.reuses += 1
            return
        index = torch.tensor(changed, device=self.device)
        bounds = torch.tensor([ranges[row] for row in changed], device=self.device)
        columns = self._fixed[3]
        listed = (columns >= bounds[:, :1]) & (columns <= bounds[:, 1:])
        self._write(index, listed)

    def _ranges_at(self, lens: list[int]) -> list[tuple[int, int]]:
        """Each row's (first, last) listed kv block for a query at ``lens[row]``; (0, -1)
        where it attends nothing."""
        base, table = self._ahead
        if not table or not all(
            0 <= n - b < len(t) for n, b, t in zip(lens, base, table, strict=True)
        ):
            base, table = lens, self._read_ranges(lens)
            self._ahead = base, table
        return [t[n - b] for n, b, t in zip(lens, base, table, strict=True)]

    def _read_ranges(self, lens: list[int]) -> list[list[tuple[int, int]]]:
        """The (first, last) blocks of positions ``lens[row] .. + _AHEAD - 1`` (up to the
        capacity) of every row, from the mask's intervals in one call."""
        grid, rows, _, _ = self._fixed
        kv_block = self._blocks[1]
        ahead = min(_AHEAD, self.capacity - min(lens))
        start = torch.tensor(lens, device=self.device).view(-1, 1)
        queries = (start + torch.arange(ahead, device=self.device)).clamp(max=self.capacity - 1)
        found = self.mask.intervals_at(queries, rows, grid)
        assert found is not None  # has_intervals() was checked when the path was chosen
        lo = found.lo.expand_as(queries).clamp(min=0)
        hi = found.hi.expand_as(queries).clamp(max=self.capacity - 1)
        some = lo <= hi
        first = torch.where(some, lo.div(kv_block, rounding_mode="floor"), 0)
        last = torch.where(some, hi.div(kv_block, rounding_mode="floor"), -1)
        pairs = torch.stack([first, last], -1).tolist()
        return [[(a, z) for a, z in row] for row in pairs]

    def _tree_listed(self, old_lens: list[int], new_lens: list[int]) -> Tensor | None:
        """(B, nkv) bool for a tree decode step (q_len 1): a row that moved down its own
        branch (every token passed has the previous as its parent, back to the old query)
        adds the blocks of the tokens passed; None where a row left its branch."""
        parents = self._parents
        kv_block = self._blocks[1]
        added: list[tuple[int, int]] = []
        for row, (old, new) in enumerate(zip(old_lens, new_lens, strict=True)):
            if new == old:
                continue
            row_parents = parents[row] if len(parents) > 1 else parents[0]
            if new < old or new >= len(row_parents) or old >= len(row_parents):
                return None
            node = new
            while node > old:
                added.append((row, node // kv_block))
                node = row_parents[node]
            if node != old:
                return None
        listed = self._current_listed()
        if not added:
            return listed
        listed = listed.clone()
        rows, columns = zip(*added, strict=True)
        listed[torch.tensor(rows), torch.tensor(columns)] = True
        return listed

    def _columns(self) -> Tensor:
        nkv = -(-self.capacity // self._blocks[1])
        return torch.arange(nkv, device=self.device)

    def _write_rows(self, listed: Tensor) -> None:
        """Makes ``listed`` (B, nkv) the current step's blocks, rewriting only the rows that
        changed."""
        changed = (listed != self._current_listed()).any(1).nonzero().view(-1)
        self._listed = listed
        if changed.numel() == 0:
            self._kind = "reuse"
            self.reuses += 1
            return
        self._write(changed, listed.index_select(0, changed))

    def _write(self, changed: Tensor, rows: Tensor) -> None:
        """Rewrites, in place, rows ``changed`` to list the blocks ``rows`` (k, nkv) as torch
        lays them out: counts, then the listed blocks in order followed by the others in
        order (torch's stable descending argsort), and the q side (one q block: index 0,
        count 0 or 1)."""
        self._kind = "append"
        self.appends += 1
        bm = self._block_mask
        heads = bm.kv_num_blocks.shape[1]
        k, nkv = rows.shape
        as_int = rows.to(torch.int32)
        counts = as_int.sum(1, dtype=torch.int32).view(k, 1, 1).expand(k, heads, 1)
        order = torch.argsort(as_int, dim=1, descending=True, stable=True).to(torch.int32)
        bm.kv_num_blocks.index_copy_(0, changed, counts)
        bm.kv_indices.index_copy_(0, changed, order.view(k, 1, 1, nkv).expand(k, heads, 1, nkv))
        q_num_blocks = bm.q_num_blocks
        assert q_num_blocks is not None  # every BlockMask built here has its q side
        q_num_blocks.index_copy_(0, changed, as_int.view(k, 1, nkv).expand(k, heads, nkv))


_AHEAD = 256
"""Decode positions per row whose interval blocks are read from the mask in one call."""


def _tree_of(mask: Mask) -> Tree | None:
    """The tree of ``tree(...)`` or ``causal() & tree(...)`` (a tree's ancestors precede
    their descendants, so causal changes nothing), else None."""
    if isinstance(mask, Tree):
        return mask
    if isinstance(mask, And) and len(mask.children) == 2:
        trees = [p for p in mask.children if isinstance(p, Tree)]
        if len(trees) == 1 and any(p == causal() for p in mask.children):
            return trees[0]
    return None


def speculative_tree(prefix_lens: Any, draft_parents: Any) -> Mask:
    """A prefix followed by a draft tree, as one ``flexmask.tree`` over positions
    ``[0, prefix_len + len(draft))``: prefix tokens attend causally, a draft token attends
    the whole prefix, its draft ancestors and itself. Positions past the draft attend nothing.

    ::

        prefix_lens=2, draft_parents=[-1, 0, -1]   (draft: a → b, and c)
                          ■ ⬚ ⬚ ⬚ ⬚
                          ■ ■ ⬚ ⬚ ⬚
                          ■ ■ ■ ⬚ ⬚      a
                          ■ ■ ■ ■ ⬚      b (child of a)
                          ■ ■ ⬚ ⬚ ■      c

    Verify the draft in one forward with ``decode_mask(mask, prefix_lens, q_len=len(draft),
    capacity=...)``; combine with ``document`` (``& flexmask.document(...)``) when the prefix
    packs several documents.

    Args:
        prefix_lens: tokens before the draft (>= 1) — one int for every row, or one per row.
        draft_parents: each draft token's parent within the draft (``parents[i] < i``), or -1
            for a child of the last prefix token — one list for every row, or one per row.

    Returns:
        A ``flexmask.tree`` mask (per row when either argument is).

    Example:
        >>> import flexmask
        >>> print(flexmask.speculative_tree(2, [-1, 0, -1]).show(5))
        ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚
        ■ ■ ■ ■ ⬚
        ■ ■ ⬚ ⬚ ■
    """
    per_row_drafts = isinstance(draft_parents, (list, tuple, Tensor)) and any(
        isinstance(d, (list, tuple)) or (isinstance(d, Tensor) and d.dim() == 1)
        for d in draft_parents
    )
    drafts = list(draft_parents) if per_row_drafts else None
    if isinstance(prefix_lens, numbers.Integral) or (
        isinstance(prefix_lens, Tensor) and prefix_lens.dim() == 0
    ):
        prefixes = None
        shared_prefix = check_int(prefix_lens, "prefix_lens", minimum=1)
    else:
        prefixes = int_vector(prefix_lens, "prefix_lens").tolist()
        for i, p in enumerate(prefixes):
            if p < 1:
                raise ValueError(f"prefix_lens[{i}] must be >= 1, got {p}")
    rows = len(drafts) if drafts is not None else (len(prefixes) if prefixes else 1)
    if drafts is not None and prefixes is not None and len(drafts) != len(prefixes):
        raise ValueError(
            f"prefix_lens gives {len(prefixes)} rows but draft_parents {len(drafts)}: pass one "
            f"of each per row, or one shared"
        )
    longest = max(prefixes) if prefixes is not None else shared_prefix
    check_fits(
        # per row: the prefix's parents and the joined list, int64, before the tree's own
        16 * rows * longest,
        torch.device("cpu"),
        f"speculative_tree with prefix_lens up to {longest}",
        "prefix_lens counts the tokens before the draft (the cache length), not bytes",
    )
    parents = []
    for row in range(rows):
        prefix = prefixes[row] if prefixes is not None else shared_prefix
        name = f"draft_parents[{row}]" if drafts is not None else "draft_parents"
        draft = check_parents(
            drafts[row] if drafts is not None else draft_parents,
            name,
            token="draft token",
            rule="a draft token's parent is an earlier draft token",
            root="the prefix's last",
            empty="an empty list",
        )
        chain = torch.arange(-1, prefix - 1)  # the prefix: each token's parent is the previous
        parents.append(torch.cat([chain, torch.where(draft < 0, prefix - 1, draft + prefix)]))
    per_row = drafts is not None or prefixes is not None
    return tree(parents if per_row else parents[0])
