"""``runs.expand_runs`` at its real sizes against concatenated ranges: totals either side of
``_CHUNKED_FROM`` (the cumsum and the chunked write, with the real chunk size), every
remainder of a partial last chunk, runs of 1 to 5000 entries that begin mid-chunk and jump
or carry on their predecessor's values, empty runs for the caller to drop, int32 and int64
starts and outputs, values near either end of the output's dtype."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given
from hypothesis import strategies as st

from flexmask.blocks import runs


def _lengths(
    gen: torch.Generator, total: int, long_share: float, empty: bool, short_end: bool
) -> torch.Tensor:
    """Run lengths summing to ``total``: 1 to 5000 (a ``long_share`` of them) or 1 to 40,
    with one in twenty empty (and one at either end) where ``empty``; where ``short_end``,
    the last 12 entries as runs of one (some begin inside a partial last chunk)."""
    draws = total // 20 + 2
    lens = torch.where(
        torch.rand(draws, generator=gen) < long_share,
        torch.randint(1, 5001, (draws,), generator=gen),
        torch.randint(1, 41, (draws,), generator=gen),
    )
    if empty:
        lens[torch.rand(draws, generator=gen) < 0.05] = 0
    ends = lens.cumsum(0)
    kept = int((ends < total).sum())
    lens = lens[: kept + 1].clone()
    lens[kept] = total - (int(ends[kept - 1]) if kept else 0)
    if short_end:
        ones = min(int(lens[-1]) - 1, 12)
        lens[-1] -= ones
        lens = torch.cat([lens, lens.new_ones(ones)])
    if empty:
        lens = torch.cat([lens.new_zeros(1), lens, lens.new_zeros(1)])
    return lens


def _starts(gen: torch.Generator, lens: torch.Tensor, carry: float, low: int, high: int):
    """A start per run in ``[low, high)``, less than where the last chain of carried runs
    would overflow; a ``carry`` share of runs start where their predecessor stopped (no
    jump), so runs side by side make chains."""
    n = lens.numel()
    span = int(lens.sum())
    own = torch.randint(low, high - span, (n,), generator=gen, dtype=torch.int64)
    carried = torch.rand(n, generator=gen) < carry
    carried[0] = False
    first = lens.cumsum(0) - lens
    head = torch.where(carried, 0, torch.arange(n)).cummax(0).values
    return own.index_select(0, head) + first - first.index_select(0, head)


@given(
    seed=st.integers(0, 2**31 - 1),
    over=st.integers(-40, 40),
    long_share=st.sampled_from([0.3, 0.7, 1.0]),
    carry=st.sampled_from([0.0, 0.3, 0.9]),
    empty=st.booleans(),
    short_end=st.booleans(),
    start_dtype=st.sampled_from([torch.int32, torch.int64]),
    out_dtype=st.sampled_from([torch.int32, torch.int64]),
    extreme=st.booleans(),
)
def test_expand_runs_match_concatenated_ranges(
    seed, over, long_share, carry, empty, short_end, start_dtype, out_dtype, extreme
):
    gen = torch.Generator().manual_seed(seed)
    total = runs._CHUNKED_FROM + over
    lens = _lengths(gen, total, long_share, empty, short_end)
    narrow = torch.int32 in (start_dtype, out_dtype)
    bound = 2**31 if narrow else 2**40
    low, high = (-bound, bound) if extreme else (0, 1 << 22)
    starts = _starts(gen, lens, carry, low, high)
    want = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist(), strict=True)]
    )
    out = torch.full((total,), -7, dtype=out_dtype)
    chunked = mock.patch.object(runs, "_expand_runs_chunked", wraps=runs._expand_runs_chunked)
    with chunked as write:
        runs.expand_runs(out, starts.to(start_dtype), lens.to(start_dtype), nonempty=not empty)
    assert torch.equal(out.to(torch.int64), want)
    assert write.called == (over >= 0 and lens.numel() * runs._CHUNK <= total)
