"""The tile path writes each line as runs of set and unset blocks: equal to torch's stable
argsort order (set blocks ascending, then unset ones) on grids of few runs and of many."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from flexmask.blocks.write import ordered_lines


def _torch_order(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch's create_block_mask writes: counts and a stable descending argsort."""
    order = torch.argsort(blocks.to(torch.uint8), dim=-1, descending=True, stable=True)
    return blocks.sum(-1, dtype=torch.int32), order.to(torch.int32)


@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 40), st.integers(1, 40)),
    runs=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    density=st.floats(0.0, 1.0),
)
def test_lines_written_as_runs_match_torch_order(shape, runs, seed, density):
    gen = torch.Generator().manual_seed(seed)
    if runs:  # one band per line, as block grids mostly are: the run-length path
        lo = torch.randint(0, shape[-1], (*shape[:-1], 1), generator=gen)
        hi = lo + torch.randint(-1, 12, lo.shape, generator=gen)
        column = torch.arange(shape[-1])
        blocks = (column >= lo) & (column <= hi)
    else:  # random: many short runs, the column-ranking path
        blocks = torch.rand(shape, generator=gen) < density
    count, indices = ordered_lines(blocks)
    want_count, want_indices = _torch_order(blocks)
    assert torch.equal(count, want_count) and count.dtype == torch.int32
    assert torch.equal(indices, want_indices) and indices.dtype == torch.int32
