"""Both sides of a piece whose kv block columns are runs (``Leaf.block_columns``: a tree in
preorder), with no tile grid.

Each column holds one run of attending q blocks with one full run inside, so the q side is
written as the closed form writes its lines (``closed_form.write_lines``: five runs per
partial line, three per full one). The kv side's rows are not runs of one kind (a row of a
tree lists its ancestors' blocks), but they are the columns' runs read across: the runs of
codes down the columns become runs along the rows by one sort of their starts
(``blocks.q_side_from_line_runs`` on the transposed grid). A tree at 131k, B = 8 so skips
classifying 8M tiles and two passes over them to find its runs (docs/costs.md, "A tree's
columns").
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.algebra import BlockColumns
from flexmask.blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    BlockGrid,
    Ordered,
    index_tensors,
    q_side_from_line_runs,
    side_by_side,
)
from flexmask.builders.closed_form import Runs, write_lines


def _demoted(columns: BlockColumns, grid: BlockGrid) -> Runs:
    """The columns' runs as ``closed_form.Runs`` lines: torch's incomplete edge tiles never
    full (the last q block leaves every full run, the last kv block's column has none), and
    an empty line as ``first = last + 1`` (its unlisted blocks, before and after, touch)."""
    first, last, full_first, full_last = columns
    nq = grid.num_q_blocks
    if grid.q_len % grid.q_block:
        full_last = full_last.clamp(max=nq - 2)
    if grid.kv_len % grid.kv_block:
        full_last = full_last.clone()
        full_last[:, -1] = full_first[:, -1] - 1
    first = torch.minimum(first, last + 1)
    return Runs(first, last, full_first, full_last)


def _code_runs(lines: Runs, nq: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each column's runs of codes (EMPTY, PARTIAL, FULL, PARTIAL, EMPTY; empty ones
    dropped) as (line, col, length, value), in line order, every line starting at 0."""
    first, last, full_first, full_last = lines
    has_full = full_first <= full_last
    stop = last + 1
    full_a = torch.where(has_full, full_first, stop)
    full_z = torch.where(has_full, full_last + 1, stop)
    cuts = torch.stack([torch.zeros_like(first), first, full_a, full_z, stop], -1).view(-1, 5)
    length = torch.diff(cuts, append=torch.full_like(cuts[:, :1], nq)).view(-1)
    value = torch.tensor([EMPTY, PARTIAL, FULL, PARTIAL, EMPTY], dtype=torch.int64)
    kept = length.nonzero().squeeze(1)
    line = kept.div(5, rounding_mode="floor")
    return (
        line,
        cuts.view(-1).index_select(0, kept),
        length.index_select(0, kept),
        value.to(first.device).repeat(cuts.shape[0]).index_select(0, kept),
    )


def ordered_sides(columns: BlockColumns, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """torch's (kv side, q side) from a piece's column runs ``(R, nkv)``."""
    lines = _demoted(columns, grid)
    rows, nkv = lines.first.shape
    nq = grid.num_q_blocks
    q_p, q_f = index_tensors([(rows, nkv, nq)] * 2, grid.device)
    code_runs = _code_runs(lines, nq)
    transposed = torch.Size((rows, 1, nkv, nq))
    # Each side on its own thread where the grid is long.
    kv, (q_pn, q_fn) = side_by_side(
        lambda: q_side_from_line_runs(*code_runs, transposed, few=False),
        lambda: write_lines(q_p, q_f, lines, nq),
        rows * nq * nkv,
        grid.device,
    )
    assert kv is not None  # few=False: never refused
    return kv, Ordered(q_pn, q_p.unsqueeze(1), q_fn, q_f.unsqueeze(1))
