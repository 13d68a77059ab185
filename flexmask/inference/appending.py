"""How a generation keeps one BlockMask: each step rewrites only the rows whose blocks moved.

With a single, incomplete q block no block is full (torch pads the q block with masked rows),
so a step's BlockMask is each row's set of listed kv blocks. Three masks say which blocks a
step lists without a build:

* ``causal()``: blocks ``0 .. last``, from the lengths alone (``CausalRows``);
* masks whose rows are kv intervals (documents, windows, padding, prefix unions and their
  ``&``): each query's interval, read from the mask's structure (``IntervalRows``);
* ``tree(...)`` (or ``causal() & tree(...)``), one query: a token's ancestors are its
  parent's plus itself, so a step that moves a row down its own branch adds the blocks of
  the tokens it passed (``TreeRows``).

Each answers ``move(block_mask, old_lens, new_lens, offsets)`` with how it made the step:
"reuse" (no row's blocks changed), "append" (changed rows rewritten in place) or "build" (the
step needs a build: nothing written).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask, conjuncts
from flexmask.pieces import Tree, causal
from flexmask.runtime import Spec

AHEAD = 256
"""Decode positions per row whose interval blocks are read from the mask in one call."""


class Rows(Protocol):
    """A way to move a kept BlockMask to the next step's rows."""

    def move(
        self, block_mask: BlockMask, old_lens: list[int], new_lens: list[int], offsets: Tensor
    ) -> str:
        """Rewrites ``block_mask`` for queries at ``new_lens`` (``offsets`` as a tensor),
        returning "reuse", "append", or "build" (where it wrote nothing)."""
        ...


def rows_for(spec: Spec, lens: list[int], device: torch.device, append: bool) -> Rows | None:
    """The way a generation keeps the BlockMask of ``spec`` (its first step, queries at
    ``lens``) from step to step; None where every step is built (``append`` False, a step
    that fills its q block, other masks)."""
    mask, q_len = spec.mask, spec.q_len
    q_block, kv_block = spec.block_size
    if not append or q_len >= q_block:
        return None
    if mask == causal():
        return CausalRows(q_len, kv_block)
    if mask.has_intervals() and not mask.head_dependent:
        return IntervalRows(spec, lens, device)
    found = tree_of(mask)
    if q_len == 1 and found is not None:
        return TreeRows(found, kv_block)
    return None


def tree_of(mask: Mask) -> Tree | None:
    """The tree of ``tree(...)`` or ``causal() & tree(...)`` (a tree's ancestors precede
    their descendants, so causal changes nothing), else None."""
    if isinstance(mask, Tree):
        return mask
    factors = conjuncts(mask)
    if len(factors) == 2:
        trees = [p for p in factors if isinstance(p, Tree)]
        if len(trees) == 1 and any(p == causal() for p in factors):
            return trees[0]
    return None


class CausalRows:
    """``causal()``: each row lists kv blocks ``0 .. (cache_len + q_len - 1) // block``."""

    def __init__(self, q_len: int, kv_block: int) -> None:
        self.q_len = q_len
        self.kv_block = kv_block

    def _last_blocks(self, lens: list[int]) -> list[int]:
        return [(length + self.q_len - 1) // self.kv_block for length in lens]

    def move(
        self, block_mask: BlockMask, old_lens: list[int], new_lens: list[int], offsets: Tensor
    ) -> str:
        if self._last_blocks(new_lens) == self._last_blocks(old_lens):
            return "reuse"
        # Each row's block row is kv blocks 0 .. last in order (kv_indices is that order
        # whatever the lengths), so the counts alone say where it ends: any move, any row.
        last = (offsets + (self.q_len - 1)).div_(self.kv_block, rounding_mode="floor")
        count = (last + 1).to(torch.int32).view(-1, 1, 1)
        block_mask.kv_num_blocks.copy_(count.expand_as(block_mask.kv_num_blocks))
        q_num_blocks = block_mask.q_num_blocks
        assert q_num_blocks is not None  # every BlockMask built here has its q side
        columns = torch.arange(q_num_blocks.shape[-1], device=offsets.device)
        q_num_blocks.copy_((columns < count).to(torch.int32).expand_as(q_num_blocks))
        return "append"


class ListedRows:
    """Rows kept as a (B, nkv) bool of listed kv blocks, rewritten where they change."""

    def __init__(self) -> None:
        self._listed: Tensor | None = None  # the current BlockMask's, read when first needed

    def _current(self, block_mask: BlockMask) -> Tensor:
        """(B, nkv) bool: the kv blocks each row of the current BlockMask lists."""
        if self._listed is None:
            q_num_blocks = block_mask.q_num_blocks
            assert q_num_blocks is not None  # every BlockMask built here has its q side
            self._listed = q_num_blocks[:, 0] > 0
        return self._listed

    def _rewrite(self, block_mask: BlockMask, listed: Tensor) -> str:
        """Makes ``listed`` (B, nkv) the step's blocks, rewriting only the rows that changed."""
        changed = (listed != self._current(block_mask)).any(1).nonzero().view(-1)
        self._listed = listed
        if changed.numel() == 0:
            return "reuse"
        write_rows(block_mask, changed, listed.index_select(0, changed))
        return "append"


def write_rows(block_mask: BlockMask, changed: Tensor, rows: Tensor) -> None:
    """Rewrites, in place, rows ``changed`` to list the blocks ``rows`` (k, nkv) as torch
    lays them out: counts, then the listed blocks in order followed by the others in
    order (torch's stable descending argsort), and the q side (one q block: index 0,
    count 0 or 1)."""
    heads = block_mask.kv_num_blocks.shape[1]
    k, nkv = rows.shape
    as_int = rows.to(torch.int32)
    counts = as_int.sum(1, dtype=torch.int32).view(k, 1, 1).expand(k, heads, 1)
    order = torch.argsort(as_int, dim=1, descending=True, stable=True).to(torch.int32)
    block_mask.kv_num_blocks.index_copy_(0, changed, counts)
    block_mask.kv_indices.index_copy_(0, changed, order.view(k, 1, 1, nkv).expand(k, heads, 1, nkv))
    q_num_blocks = block_mask.q_num_blocks
    assert q_num_blocks is not None  # every BlockMask built here has its q side
    q_num_blocks.index_copy_(0, changed, as_int.view(k, 1, nkv).expand(k, heads, nkv))


class IntervalRows(ListedRows):
    """Masks whose rows are kv intervals: a row lists the blocks of its queries' intervals.

    A decode step (one query) lists the blocks of one interval, ``first .. last``. Those of
    the next ``AHEAD`` positions of every row are read from the mask in one call and kept as
    ints, so a step compares ints and writes only the rows whose blocks changed. A longer
    step reads its queries' intervals from the mask."""

    def __init__(self, spec: Spec, lens: list[int], device: torch.device) -> None:
        super().__init__()
        self.mask, self.q_len, self.capacity = spec.mask, spec.q_len, spec.kv_len
        self.kv_block = spec.block_size[1]
        self.device = device
        # What every step's intervals are read with.
        self.grid = spec.grid()
        self.rows = torch.arange(len(lens), device=device).view(-1, 1)
        self.window = torch.arange(self.q_len, device=device)
        self.columns = torch.arange(-(-self.capacity // self.kv_block), device=device)
        self._ahead: tuple[list[int], list[list[tuple[int, int]]]] = ([], [])
        self._ranges = self._ranges_at(lens) if self.q_len == 1 else []

    def move(
        self, block_mask: BlockMask, old_lens: list[int], new_lens: list[int], offsets: Tensor
    ) -> str:
        if self.q_len > 1:
            return self._rewrite(block_mask, self._listed_at(offsets))
        ranges = self._ranges_at(new_lens)
        changed = [
            row
            for row, (new, now) in enumerate(zip(ranges, self._ranges, strict=True))
            if new != now
        ]
        self._ranges = ranges
        if not changed:
            return "reuse"
        index = torch.tensor(changed, device=self.device)
        bounds = torch.tensor([ranges[row] for row in changed], device=self.device)
        listed = (self.columns >= bounds[:, :1]) & (self.columns <= bounds[:, 1:])
        write_rows(block_mask, index, listed)
        return "append"

    def _intervals(self, queries: Tensor) -> tuple[Tensor, Tensor]:
        """Each query's kv interval ``lo .. hi``, one per row and query, within the cache."""
        found = self.mask.intervals_at(queries, self.rows, self.grid)
        assert found is not None  # has_intervals() was checked when the path was chosen
        # A piece's interval may broadcast (one for every row): each row gets its own here.
        lo = found.lo.expand_as(queries).clamp(min=0)
        hi = found.hi.expand_as(queries).clamp(max=self.capacity - 1)
        return lo, hi

    def _listed_at(self, offsets: Tensor) -> Tensor:
        """(B, nkv) bool: kv blocks holding some of each row's query intervals."""
        lo, hi = self._intervals(offsets.view(-1, 1) + self.window)
        first = lo.div(self.kv_block, rounding_mode="floor").unsqueeze(-1)
        # An empty interval lists nothing, even where lo and hi share a block.
        last = torch.where(lo <= hi, hi.div(self.kv_block, rounding_mode="floor"), -1)
        last = last.unsqueeze(-1)
        return ((self.columns >= first) & (self.columns <= last)).any(1)

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
        """The (first, last) blocks of positions ``lens[row] .. + AHEAD - 1`` (up to the
        capacity) of every row, from the mask's intervals in one call."""
        ahead = min(AHEAD, self.capacity - min(lens))
        start = torch.tensor(lens, device=self.device).view(-1, 1)
        queries = (start + torch.arange(ahead, device=self.device)).clamp(max=self.capacity - 1)
        lo, hi = self._intervals(queries)
        some = lo <= hi
        first = torch.where(some, lo.div(self.kv_block, rounding_mode="floor"), 0)
        last = torch.where(some, hi.div(self.kv_block, rounding_mode="floor"), -1)
        pairs = torch.stack([first, last], -1).tolist()
        return [[(a, z) for a, z in row] for row in pairs]


class TreeRows(ListedRows):
    """``tree(...)`` decode (one query): a row that moved down its own branch (every token
    passed has the previous as its parent, back to the old query) adds the blocks of the
    tokens passed; a row that left its branch or moved back needs a build."""

    def __init__(self, tree: Tree, kv_block: int) -> None:
        super().__init__()
        # The tree's parents as ints (a step walks a few of them), read once here.
        self.parents = [p.tolist() for p in tree.parents]
        self.kv_block = kv_block

    def move(
        self, block_mask: BlockMask, old_lens: list[int], new_lens: list[int], offsets: Tensor
    ) -> str:
        added = self._passed(old_lens, new_lens)
        if added is None:  # a row that left its branch: its ancestors are new
            self._listed = None  # the build's BlockMask is read again when needed
            return "build"
        listed = self._current(block_mask)
        if added:
            listed = listed.clone()
            rows, columns = zip(*added, strict=True)
            listed[torch.tensor(rows), torch.tensor(columns)] = True
        return self._rewrite(block_mask, listed)

    def _passed(self, old_lens: list[int], new_lens: list[int]) -> list[tuple[int, int]] | None:
        """The (row, kv block) of every token a row passed down its branch; None where a
        row left it."""
        added: list[tuple[int, int]] = []
        for row, (old, new) in enumerate(zip(old_lens, new_lens, strict=True)):
            if new == old:
                continue
            row_parents = self.parents[row] if len(self.parents) > 1 else self.parents[0]
            if new < old or new >= len(row_parents) or old >= len(row_parents):
                return None
            node = new
            while node > old:
                added.append((row, node // self.kv_block))
                node = row_parents[node]
            if node != old:
                return None
        return added
