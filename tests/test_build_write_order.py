"""The writer's order is torch's: a stable descending argsort of each side's flags
(``oracle.torch_order``), set blocks ascending, then unset ones.

Each line written as runs of set and unset blocks (``ordered_lines``), on grids of few runs
and of many; and the writer from int8 tile codes (``ordered_from_codes``): both sides'
partial and full tensors from one pass of runs per side (the q side's found down the
columns, without a transpose), expanded in chunks and mended where a run begins inside a
chunk — against torch's order and, end to end, against torch's ``create_block_mask``.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.blocks import runs, write
from flexmask.blocks.write import ordered_from_codes, ordered_lines
from tests import oracle
from tests.test_build_trees import insertion_tree


def _expected(codes: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for side in (codes, codes.transpose(-2, -1)):
        for code in (1, 2):  # partial, then full
            out += oracle.torch_order(side == code)
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
    with (
        mock.patch.object(runs, "_CHUNK", chunk),
        mock.patch.object(runs, "_CHUNKED_FROM", 0),
    ):
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
    with (
        mock.patch.object(runs, "_CHUNK", chunk),
        mock.patch.object(runs, "_CHUNKED_FROM", 0),
    ):
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
    with (
        mock.patch.object(runs, "_CHUNK", chunk),
        mock.patch.object(runs, "_CHUNKED_FROM", 0),
    ):
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
    want_count, want_indices = oracle.torch_order(blocks)
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
            want_num, want_idx = oracle.torch_order(grid == code)
            assert torch.equal(num, want_num) and torch.equal(idx, want_idx)
