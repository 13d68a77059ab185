"""Unions written with the q side from tile codes (``unions.union_sides``): the kv side from
the block rows' runs (edge queries and the special blocks' only), the int8 codes of those
runs (``unions._codes``: a jump per segment and a running sum) read down the columns by
``write.q_side_from_codes``. Against torch's own ``create_block_mask`` as whole tensors."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.blocks import write
from flexmask.builders import unions
from tests import oracle


def _docs(total: int, seed: int, longest: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(1, longest, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    return lengths


def _cases(n: int, rows: int, longest: int) -> list[flexmask.Mask]:
    docs = [_docs(n, seed, longest) for seed in range(rows)]
    doc_causal = flexmask.causal() & flexmask.document(docs)
    return [
        (doc_causal & flexmask.sliding_window(n // 8)) | flexmask.prefix(64),
        doc_causal | flexmask.prefix([64, 7, 300][:rows]),
        flexmask.sliding_window(n // 5) | flexmask.prefix(33),
        flexmask.document(docs) | (flexmask.causal() & flexmask.sliding_window(40)),
    ]


@pytest.mark.parametrize(("q_len", "kv_len", "block"), [(4100, 4100, 16), (4100, 3001, (16, 32))])
def test_long_unions_read_the_codes_by_runs_and_match_torch(monkeypatch, q_len, kv_len, block):
    """Grids of 257 x 257 tiles or so whose columns are few runs: the q side is listed from
    the runs down the codes' columns (``q_runs`` answers), three rows that differ, two heads."""
    found = []
    real = write.q_runs

    def spy(grid):
        runs = real(grid)
        found.append(runs is not None)
        return runs

    monkeypatch.setattr(write, "q_runs", spy)
    for mask in _cases(max(q_len, kv_len), 3, 1500):
        assert unions.union_operands(mask) is not None, repr(mask)
        ours = flexmask.create_block_mask(mask, 3, 2, q_len, kv_len, "cpu", block)
        theirs = torch_create_block_mask(mask.mask_mod, 3, 2, q_len, kv_len, "cpu", block)
        oracle.assert_same_block_mask(ours, theirs, f"{mask!r} q={q_len} kv={kv_len}")
    assert found and all(found)


@pytest.mark.parametrize(
    ("q_len", "kv_len", "block"), [(4100, 4100, 16), (4100, 3001, (16, 32)), (2999, 4100, 32)]
)
def test_unions_list_the_q_side_from_the_rows_runs_and_match_torch(
    monkeypatch, q_len, kv_len, block
):
    """Grids past ``_FROM_RUNS_FROM`` (lowered here) take the q side from the block rows'
    segments as runs (``write.q_side_from_line_runs``: no grid of codes), three rows that
    differ, two heads, lengths off the block."""
    answered = []
    real = unions.q_side_from_line_runs

    def spy(*args):
        q = real(*args)
        answered.append(q is not None)
        return q

    monkeypatch.setattr(unions, "_FROM_RUNS_FROM", 0)
    monkeypatch.setattr(unions, "q_side_from_line_runs", spy)
    for mask in _cases(max(q_len, kv_len), 3, 1500):
        ours = flexmask.create_block_mask(mask, 3, 2, q_len, kv_len, "cpu", block)
        theirs = torch_create_block_mask(mask.mask_mod, 3, 2, q_len, kv_len, "cpu", block)
        oracle.assert_same_block_mask(ours, theirs, f"{mask!r} q={q_len} kv={kv_len}")
    assert answered and all(answered)


def test_short_unions_with_many_runs_from_the_rows_runs_fall_back_and_match_torch(monkeypatch):
    """Short documents: the q side's runs are many, ``q_side_from_line_runs`` gives up and
    the codes are ranked column by column."""
    monkeypatch.setattr(unions, "_FROM_RUNS_FROM", 0)
    for mask in _cases(700, 2, 40):
        for q_len, kv_len, block in ((700, 700, 16), (333, 700, 8), (700, 129, (8, 16))):
            ours = flexmask.create_block_mask(mask, 2, 1, q_len, kv_len, "cpu", block)
            theirs = torch_create_block_mask(mask.mask_mod, 2, 1, q_len, kv_len, "cpu", block)
            oracle.assert_same_block_mask(ours, theirs, f"{mask!r} q={q_len} kv={kv_len}")


def test_short_unions_with_many_runs_match_torch():
    """Short documents on a small grid: columns of many short runs, ranked column by column
    (``q_runs`` gives up); queries past the data and a per-row window."""
    for mask in _cases(700, 2, 40):
        for q_len, kv_len, block in ((700, 700, 16), (333, 700, 8), (700, 129, (8, 16))):
            ours = flexmask.create_block_mask(mask, 2, 1, q_len, kv_len, "cpu", block)
            theirs = torch_create_block_mask(mask.mask_mod, 2, 1, q_len, kv_len, "cpu", block)
            oracle.assert_same_block_mask(ours, theirs, f"{mask!r} q={q_len} kv={kv_len}")


def test_codes_of_segments_with_empty_ones_at_line_ends():
    """``_codes`` against the codes written segment by segment in Python: empty segments
    inside a line, at its end, and at the very end of the last line."""
    starts = torch.tensor([[0, 5, 2, 9], [3, 3, 4, 4], [0, 8, 0, 8], [8, 8, 8, 8]])
    stops = torch.tensor([[4, 8, 3, 8], [8, 8, 6, 6], [8, 8, 8, 8], [8, 8, 8, 8]])
    segments = unions._segments(starts, stops, 8)
    got = unions._codes(segments, 4 * 8).view(4, 8)
    expected = torch.zeros(4, 8, dtype=torch.int8)
    for line in range(4):
        for tile in range(8):
            s, e = starts[line], stops[line]
            listed = any(s[k] <= tile < e[k] for k in (0, 1))
            full = any(s[k] <= tile < e[k] for k in (2, 3))
            expected[line, tile] = 2 if full else int(listed)
    assert torch.equal(got, expected)
