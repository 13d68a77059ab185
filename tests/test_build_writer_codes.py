"""The writer from int8 tile codes (``ordered_from_codes``): both sides' partial and full
tensors from one pass of runs per side (the q side's found down the columns, without a
transpose), expanded in chunks and mended where a run begins inside a chunk. Against
torch's own order (a stable descending argsort of each side's flags, as its
``create_block_mask`` writes) and, end to end, against torch's ``create_block_mask``."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.blocks import runs, write
from tests import oracle
from tests.test_build_tree_classifier import insertion_tree


def _torch_order(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's counts and indices of one side: a stable descending argsort of the flags."""
    order = torch.argsort(blocks.to(torch.uint8), dim=-1, descending=True, stable=True)
    return blocks.sum(-1, dtype=torch.int32), order.to(torch.int32)


def _expected(codes: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for side in (codes, codes.transpose(-2, -1)):
        for code in (1, 2):  # partial, then full
            out += _torch_order(side == code)
    return out


def _banded(shape, gen: torch.Generator, bands: int) -> torch.Tensor:
    """Codes as block grids mostly are: a few rectangles of each code, so few runs."""
    codes = torch.zeros(shape, dtype=torch.int8)
    nq, nkv = shape[-2:]
    for _ in range(bands):
        r0 = int(torch.randint(0, nq, (1,), generator=gen))
        c0 = int(torch.randint(0, nkv, (1,), generator=gen))
        r1 = r0 + int(torch.randint(1, nq + 1, (1,), generator=gen))
        c1 = c0 + int(torch.randint(1, nkv + 1, (1,), generator=gen))
        row = int(torch.randint(0, shape[0], (1,), generator=gen))
        codes[row, :, r0:r1, c0:c1] = int(torch.randint(0, 3, (1,), generator=gen))
    return codes


@settings(max_examples=150, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 45), st.integers(1, 45)),
    bands=st.integers(0, 6),
    seed=st.integers(0, 2**31 - 1),
    chunk=st.sampled_from([1, 2, 3, 5, 16]),
)
def test_codes_written_as_runs_match_torch_order(shape, bands, seed, chunk):
    gen = torch.Generator().manual_seed(seed)
    codes = _banded(shape, gen, bands)
    # Small chunks: most runs begin inside one, and a tail is left over.
    with mock.patch.object(runs, "_CHUNK", chunk), mock.patch.object(runs, "_CHUNKED_FROM", 0):
        kv, q = write.ordered_from_codes(codes)
    got = [*kv, *q]
    names = ("kv_p_num", "kv_p", "kv_f_num", "kv_f", "q_p_num", "q_p", "q_f_num", "q_f")
    for name, a, b in zip(names, got, _expected(codes), strict=True):
        assert a.dtype == torch.int32 and a.is_contiguous(), name
        assert torch.equal(a, b), f"{name} {tuple(codes.shape)} chunk={chunk}"


@settings(max_examples=150, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 45), st.integers(1, 45)),
    bands=st.integers(0, 6),
    seed=st.integers(0, 2**31 - 1),
    split=st.integers(0, 6),
)
def test_q_side_from_the_rows_runs_matches_torch_order(shape, bands, seed, split):
    """The q side from runs along the rows (``write.q_side_from_line_runs``, no codes
    read), some runs split in two at random (equal neighbours apart, as a union's segments
    come): torch's order of each column's flags, or None where its runs are many."""
    gen = torch.Generator().manual_seed(seed)
    codes = _banded(shape, gen, bands)
    nkv = shape[-1]
    line, col, length, value = [], [], [], []
    for index, row in enumerate(codes.reshape(-1, nkv).tolist()):
        cuts = {0} | {j for j in range(1, nkv) if row[j] != row[j - 1]}
        cuts |= {int(torch.randint(1, nkv, (1,), generator=gen)) for _ in range(split) if nkv > 1}
        points = sorted(cuts) + [nkv]
        for a, b in zip(points, points[1:], strict=False):
            line.append(index)
            col.append(a)
            length.append(b - a)
            value.append(row[a])
    got = write.q_side_from_line_runs(*map(torch.tensor, (line, col, length, value)), codes.shape)
    if got is None:  # many runs: the caller ranks the codes instead
        return
    names = ("q_p_num", "q_p", "q_f_num", "q_f")
    for name, a, b in zip(names, got, _expected(codes)[4:], strict=True):
        assert a.dtype == torch.int32 and a.is_contiguous(), name
        assert torch.equal(a, b), f"{name} {tuple(codes.shape)}"


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 30), st.integers(1, 30)),
    seed=st.integers(0, 2**31 - 1),
)
def test_codes_with_many_short_runs_match_torch_order(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 3, shape, generator=gen).to(torch.int8)
    got = [*write.ordered_from_codes(codes)[0], *write.ordered_from_codes(codes)[1]]
    for a, b in zip(got, _expected(codes), strict=True):
        assert torch.equal(a, b)


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    seed=st.integers(0, 2**31 - 1),
    chunk=st.sampled_from([1, 2, 3, 7, 16]),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_expand_runs_in_chunks_match_concatenated_ranges(lens, seed, chunk, dtype):
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 1000, (len(lens),), generator=gen)
    want = [s + e for s, n in zip(starts.tolist(), lens, strict=True) for e in range(n)]
    out = torch.full((len(want),), -7, dtype=dtype)
    with mock.patch.object(runs, "_CHUNK", chunk), mock.patch.object(runs, "_CHUNKED_FROM", 0):
        runs.expand_runs(out, starts, torch.tensor(lens))
    assert out.tolist() == want


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    carry=st.lists(st.booleans(), min_size=30, max_size=30),
    seed=st.integers(0, 2**31 - 1),
    chunk=st.sampled_from([2, 3, 7, 16]),
)
def test_expand_runs_that_carry_on_their_predecessor_match_concatenated_ranges(
    lens, carry, seed, chunk
):
    """Runs that start where the one before stopped (no jump: unlisted runs side by side)
    are left to the chunks' broadcast; the others begun inside a chunk rewrite it."""
    gen = torch.Generator().manual_seed(seed)
    starts = []
    for i in range(len(lens)):
        if i and carry[i]:
            starts.append(starts[-1] + lens[i - 1])
        else:
            starts.append(int(torch.randint(0, 1000, (1,), generator=gen)))
    want = [s + e for s, n in zip(starts, lens, strict=True) for e in range(n)]
    out = torch.full((len(want),), -7, dtype=torch.int32)
    with mock.patch.object(runs, "_CHUNK", chunk), mock.patch.object(runs, "_CHUNKED_FROM", 0):
        runs.expand_runs(out, torch.tensor(starts), torch.tensor(lens), nonempty=True)
    assert out.tolist() == want


@pytest.fixture
def from_runs(monkeypatch):
    """How many tensors the run path wrote (small grids of many runs are ranked instead)."""
    count = [0]
    listed = write._listed_from_runs

    def counted(*args):
        count[0] += 1
        return listed(*args)

    monkeypatch.setattr(write, "_listed_from_runs", counted)
    return count


@pytest.mark.parametrize("block", [16, (32, 16), (16, 48)])
def test_insertion_trees_rows_differ_heads_match_torch(block, from_runs):
    length, batch = 1533, 3
    trees = [insertion_tree(length - 11 * b, seed=20 + b, sequences=7) for b in range(batch)]
    mask = flexmask.tree(trees)
    for q_len, kv_len in ((length, length), (1001, length), (length, 1203)):
        ours = flexmask.create_block_mask(mask, batch, 2, q_len, kv_len, "cpu", block)
        theirs = torch_create_block_mask(mask.mask_mod, batch, 2, q_len, kv_len, "cpu", block)
        oracle.assert_same_block_mask(ours, theirs, f"trees q={q_len} kv={kv_len} {block}")
    assert from_runs[0] > 0  # the case this test is for


def test_per_head_of_a_tree_and_a_window_matches_torch(from_runs):
    n = 1111
    trees = [insertion_tree(n, seed=5, sequences=5), insertion_tree(n - 40, seed=6, sequences=9)]
    mask = flexmask.per_head(flexmask.tree(trees), flexmask.causal() & flexmask.sliding_window(300))
    ours = flexmask.create_block_mask(mask, 2, 4, n, n, "cpu", 16)
    theirs = torch_create_block_mask(mask.mask_mod, 2, 4, n, n, "cpu", 16)
    oracle.assert_same_block_mask(ours, theirs, "per_head(tree, window)")
    assert from_runs[0] > 0


def test_large_closed_forms_expanded_in_chunks_match_torch(monkeypatch):
    """Outputs past ``_CHUNKED_FROM`` entries: the closed form's and the union's runs go
    through the chunked expand too (a 257 x 257 grid, lengths off the block; the threshold
    lowered so a test-sized build crosses it)."""
    n, block = 4100, 16
    monkeypatch.setattr(runs, "_CHUNKED_FROM", 1 << 16)  # the size, not the build's default
    docs = [[1000, 2000, 1100], [n]]
    doc_causal = flexmask.causal() & flexmask.document(docs)
    composed = (doc_causal & flexmask.sliding_window(700)) | flexmask.prefix(64)
    chunked = [0]
    real = runs._expand_runs_chunked

    def counted(*args):
        chunked[0] += 1
        return real(*args)

    monkeypatch.setattr(runs, "_expand_runs_chunked", counted)
    for mask in (doc_causal, composed):
        ours = flexmask.create_block_mask(mask, 2, 1, n, n, "cpu", block)
        theirs = torch_create_block_mask(mask.mask_mod, 2, 1, n, n, "cpu", block)
        oracle.assert_same_block_mask(ours, theirs, repr(mask))
    assert chunked[0] > 0
