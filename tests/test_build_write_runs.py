"""The tile path writes each line as runs of set and unset blocks: equal to torch's stable
argsort order (set blocks ascending, then unset ones) on grids of few runs and of many."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexmask.blocks.write import ordered_from_codes, ordered_lines


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


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("shape", [(2, 1, 700, 901), (1, 2, 1024, 1024)])
def test_large_grids_of_codes_written_as_torch_orders_them(shape, sparse):
    """Grids of over 16k words of tiles find their run starts by groups of words first
    (``_nonzero_words``): clustered starts (bands near a diagonal, most groups empty) and
    scattered ones (most groups hold one), a word count that is and is not a multiple of
    the group — both sides equal torch's stable argsort of the partial and full tiles."""
    gen = torch.Generator().manual_seed(sum(shape) + sparse)
    rows, cols = shape[-2:]
    if sparse:
        q = torch.arange(rows).view(-1, 1)
        lo = q * cols // rows - torch.randint(0, 40, (*shape[:-2], rows, 1), generator=gen)
        column = torch.arange(cols)
        inside = (column >= lo) & (column <= q * cols // rows)
        full = inside & (torch.rand(shape, generator=gen) < 0.3)
        codes = (inside.to(torch.int8) + full.to(torch.int8)).to(torch.int8)
    else:
        codes = torch.randint(0, 3, shape, generator=gen, dtype=torch.int8)
        codes[..., : rows // 2, :] = codes[..., : rows // 2, :1]  # some lines one run
    kv, q = ordered_from_codes(codes)
    flipped = codes.transpose(-2, -1)
    for side, grid in ((kv, codes), (q, flipped)):
        for (num, idx), code in (
            ((side.partial_num, side.partial_idx), 1),
            ((side.full_num, side.full_idx), 2),
        ):
            want_num, want_idx = _torch_order(grid == code)
            assert torch.equal(num, want_num) and torch.equal(idx, want_idx)
