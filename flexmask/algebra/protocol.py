"""The piece protocol: what the builders (``flexmask.builders``) and the lowerings
(``flexmask.formats``) ask of every node of a mask expression, the values they ask with,
and the answers of a node that has no such structure (``Node``). Public within the package.

Every ``Mask`` (``flexmask.algebra.mask``) answers, besides its key and validation:

* ``lower_at(length, device, window=None)`` — its ``mask_mod``, lookups padded to
  ``length`` (or, given a ``Window``, over the window's positions only), and an evaluator
  the build may call with broadcasting index tensors to refine undecided blocks;
* ``intervals_at(q_idx, row, grid)`` and the shape flags ``has_intervals``,
  ``has_monotone_intervals``, ``attends_from_zero``, ``covers_diagonal``,
  ``attends_around_self``, ``attends_nowhere`` — each query's kv interval in a build, where
  it has one (the builders' closed forms and refinement);
* ``lines_at(pos, transpose=, fmt=)`` — the intervals each query (each key, transposed)
  attends, as a short list: what FlashMask's columns and Magi's slices are read from;
* ``varlen_part(length)`` — what the node is as a factor of an ``&`` a varlen kernel runs
  (a rule, a partition), or a refusal naming it;
* ``interval_form()`` — the node as comparisons of ``kv_idx`` with bounds read by the query
  (``interval_mods``), where its rows are unions of intervals: the mask_mod the GPU runs;
* ``head_cycle``, ``at_head(h)``, ``head_parts(heads)`` — the masks of the heads, where they
  differ (``per_head``);
* for leaves, ``classify_tiles(grid)`` — block codes from structure (``Leaf``).

A node with no interval structure refuses the lowerings with a ValueError that names it and
the format (``lines.cannot_lower``); the builders then evaluate its mask_mod.

The grid the build asks about is a ``TileGrid`` (``flexmask.blocks.grid.BlockGrid`` is
one): declared here, so this layer imports nothing from the blocks above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import Tensor

from flexmask.algebra.lines import LineIntervals, VarlenPart, cannot_lower

if TYPE_CHECKING:
    from flexmask.algebra.interval_mods import Formula


class Window(NamedTuple):
    """The positions a windowed build calls its mask_mod at: queries ``[q_start, q_start +
    q_len)`` and keys ``[kv_start, kv_start + kv_len)`` of the whole mask, the starts ints
    or, per batch row, ``(B,)`` int64 tensors.

    Given to ``lower_at`` for a window far from position 0 (``BlockGrid.lookup_window``):
    a piece whose lookups are indexed by position (document, spans, tree) then holds them
    for these positions only — one lookup per side, O(q_len + kv_len) — instead of for
    every position from 0, which for a window near 2**63 would not fit any memory. Its
    mask_mod still takes whole-mask positions (under the window's ``ShiftedMod``)."""

    q_start: int | Tensor
    q_len: int
    kv_start: int | Tensor
    kv_len: int


class Extent(NamedTuple):
    """What a mask validates itself against: the batch size, heads, the furthest position
    any index may take (lookups are padded to it) and the device."""

    batch: int
    heads: int | None
    """None where no head count is given (``mask_mod_for``, ``show``): any head index."""
    length: int
    device: torch.device
    length_name: str = "max(Q_LEN, KV_LEN)"
    """How errors name ``length``: with a window, ``max(q_offset + Q_LEN, kv_offset + KV_LEN)``."""


class Intervals(NamedTuple):
    """For given query positions, the one kv interval ``[lo, hi]`` each attends (empty when
    lo > hi).

    Pieces whose rows are single intervals (causal, document, sliding window, prefix,
    padding) expose them; an ``&`` of such pieces is their intersection. The builder asks for
    them only at the queries of undecided tiles, and refines those tiles in O(q_block) per
    tile instead of O(q_block * kv_block).
    """

    lo: Tensor
    """First kv attended by each queried position (broadcasts against the query tensor)."""
    hi: Tensor
    """Last kv attended by each queried position."""


class BlockColumns(NamedTuple):
    """Per kv block column ``(R, nkv)``: the q blocks whose tiles there attend somewhere,
    one run ``[first, last]`` (empty when first > last), and those that attend everywhere,
    one run ``[full_first, full_last]`` inside it (empty when full_first > full_last) — a
    piece's tiles as runs down the columns (``Leaf.block_columns``), before torch's edge
    tiles are made partial (the builder does that, as for classified tiles)."""

    first: Tensor
    last: Tensor
    full_first: Tensor
    full_last: Tensor


class TileGrid(Protocol):
    """The tiles of one build, as a piece reads them (``flexmask.blocks.grid.BlockGrid``).

    Token bounds are positions of the whole mask, clipped to the lengths; shapes broadcast
    over (rows, heads, q blocks, kv blocks): ``q_first``/``q_last`` ``(1 or B, 1, nq, 1)``,
    ``kv_first``/``kv_last`` ``(1 or B, 1, 1, nkv)``.
    """

    @property
    def batch(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def q_len(self) -> int: ...
    @property
    def kv_len(self) -> int: ...
    @property
    def q_block(self) -> int: ...
    @property
    def kv_block(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def q_first(self) -> Tensor: ...
    @property
    def q_last(self) -> Tensor: ...
    @property
    def kv_first(self) -> Tensor: ...
    @property
    def kv_last(self) -> Tensor: ...
    @property
    def q_offset(self) -> int | Tensor:
        """The grid's first query position: an int, or per batch row a ``(B, 1)`` tensor."""

    @property
    def kv_offset(self) -> int | Tensor:
        """The grid's first key position, likewise."""

    @property
    def q_end(self) -> int | Tensor:
        """One past the grid's last query position."""

    @property
    def kv_end(self) -> int | Tensor:
        """One past the grid's last key position."""

    @property
    def length(self) -> int:
        """Lookups are padded to this length: every position a kernel may reach is below it."""

    @property
    def num_q_blocks(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def lookup_window(self) -> Window | None:
        """The positions the build's lookups cover (``lower_at``'s ``window``), or None for
        every position below ``length``."""


class Node:
    """A node of a mask expression as the builders and the lowerings see it: the questions
    they ask, answered as a node with no interval structure answers them (``Mask``
    subclasses it; a piece overrides what its data lets it answer).
    """

    __slots__ = ()

    def has_intervals(self) -> bool:
        """True if ``intervals_at`` describes this mask (every row one kv interval)."""
        return False

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals | None:
        """Each query's attended kv as one interval, if the mask has that shape (else None).

        Args:
            q_idx: (k, n) int64 query positions, each below ``grid.q_len``.
            row: (k, 1) int64 batch row of each line of ``q_idx`` (0 when not per row).
        """
        return None

    def has_monotone_intervals(self) -> bool:
        """True if ``intervals_at`` are monotone in the sense of ``flexmask.builders.closed_form``:
        on a prefix of the positions ``lo`` never decreases and ``lo(q) <= q``, ``hi`` never
        decreases and is ``>= q`` or constant; past the prefix, empty. The builder then
        writes the BlockMask in closed form from the intervals of the block edges."""
        return False

    def attends_nowhere(self) -> bool:
        """True if no query attends any key (``empty()``): a union drops it."""
        return False

    def attends_from_zero(self) -> bool:
        """True if every query attends one non-empty kv interval starting at 0 (causal,
        prefix, full): a union of such intervals is again one, ``[0, max hi]``."""
        return False

    def covers_diagonal(self) -> bool:
        """True if, besides ``attends_from_zero``, every query ``q`` attends at least up to
        itself (``hi >= q``: causal, full): a union with ``attends_around_self`` intervals is
        then one interval too."""
        return False

    def attends_around_self(self) -> bool:
        """True if each query's interval is empty or holds the query itself, ``lo <= q <=
        hi``, and the intervals are disjoint runs: an interval holding a later query ``p``
        is ``p``'s own too (spans). Not monotone alone; see ``Or`` for the union with
        ``covers_diagonal`` masks."""
        return False

    # ----------------------------------------------------------------- lowerings (formats)
    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        """The positions each line attends, as intervals: for ``pos`` ``(R, N)`` absolute
        query positions, the keys each attends; with ``transpose``, for key positions, the
        queries attending each. What ``to_flashmask`` and ``to_magi`` are read from.

        Args:
            pos: ``(R, N)`` int64 positions, R = 1 or one line of positions per batch row.
            transpose: ask about keys (the queries attending them) instead of queries.
            fmt: the format asking, for a refusal's message.

        Raises:
            ValueError: the node cannot say (``cannot_lower``, naming it and ``fmt``).
        """
        raise cannot_lower(
            self,
            fmt,
            f"{type(self).__name__} does not say which keys each query attends (it defines no "
            f"lines_at). Use flexmask.create_block_mask (flex_attention)",
        )

    def line_breaks(self, *, transpose: bool) -> Tensor | None:
        """Where this node's lines (``lines_at``, normalized) may change shape, as ``(R, D)``
        int64 absolute line positions (any order, repeats and far positions allowed): between
        two neighbouring ones every line has the same slots, empty or not, and each end moves
        by 0 or 1 from one line to the next. The lowerings then ask ``lines_at`` about a few
        lines per stretch instead of every line (``flexmask.formats._stretches``).

        The default, None, says nothing: the lowerings read every line.
        """
        return None

    def block_columns(self, grid: TileGrid) -> BlockColumns | None:
        """This node's tiles on ``grid`` as runs down the columns, where every kv block
        column is one run of attending q blocks with one full run inside (a tree in
        preorder: a key is attended by its subtree, one run of positions). The build then
        writes both sides from them with no tile grid (``flexmask.builders.columns``).

        The default, None, says nothing: the build classifies tiles.
        """
        return None

    def varlen_part(self, length: int) -> VarlenPart:
        """What this node is as a factor of an ``&`` a varlen kernel runs: a rule (causal,
        a sliding window), a partition of positions ``0..length`` into sequences
        (documents, chunks, padding), nothing, or no constraint (``full()``).

        Raises:
            ValueError: the node is none of these (``cannot_lower``, naming it).
        """
        raise cannot_lower(
            self,
            "varlen",
            "varlen takes an & of causal(), sliding_window(), document(), chunked() and padding()",
        )

    def interval_form(self) -> Formula | None:
        """This node as comparisons of ``kv_idx`` with bounds read by the query alone
        (``flexmask.algebra.interval_mods``): the form in which inductor packs a mask into
        interval keep masks on the GPU. The default, None: the node has no such form and
        keeps its general mask_mod (trees, ``from_mask_mod``, ``per_head``)."""
        return None

    def interval_tables(self, length: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
        """For a node whose rows are one interval each, every position's start and
        exclusive end clamped into ``[0, length]``, ``(R, length + interval_mods.TAIL)``
        int32 (empty: start >= end; the tail empty), where the node writes them faster than
        its ``intervals_at`` at every position (what ``interval_mods`` reads otherwise).
        The default, None: read those."""
        return None

    # ----------------------------------------------------------------- heads
    @property
    def head_cycle(self) -> int:
        """Heads after which the heads' masks repeat (``at_head``): 1 when every head
        attends alike, as for every node but ``per_head`` and what holds one."""
        return 1
