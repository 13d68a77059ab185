"""``to_magi`` cut without a Python pass per query gives exactly the slices of the greedy walk
it replaced (kept below, as it was, as the reference: same slices, same order, same types),
on random interval tracks and on the masks it was profiled on; and the interval lists' short
cuts (one or two intervals, lists already in order) merge exactly as a plain merge does.
The slices' meaning is checked against a dense oracle in tests/test_formats.py."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexmask
from flexmask.formats import magi, to_magi
from flexmask.formats._structure import _normalize, lines, one_mask_for_all_heads, window
from flexmask.formats.magi import _slices
from flexmask.packing import pack_tree_batch
from tests.strategies import expressions, random_parents

BIG = 1 << 62  # lines' empty slot: (BIG, -BIG)
tree_module = importlib.import_module("flexmask.pieces.tree")  # not the function tree


# ----------------------------------------------------------------- the old lowering, as it was
_TYPE = {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}


def old_runs(first: list[int], last: list[int]):
    n = len(first)
    q = 0
    while q < n:
        if first[q] > last[q]:
            q += 1
            continue
        start, shape = q, None
        while q + 1 < n and first[q + 1] <= last[q + 1]:
            step = (first[q + 1] - first[q], last[q + 1] - last[q])
            if step not in _TYPE or (shape is not None and step != shape):
                break
            shape = step
            q += 1
        yield start, q, shape
        q += 1


def old_slices(lo, hi):
    q_all, k_all, t_all = [], [], []
    for track in range(lo.shape[1]):
        first, last = lo[:, track].tolist(), hi[:, track].tolist()
        for start, end, shape in old_runs(first, last):
            if shape is None:
                shape = (0, 0)
            q_all.append((start, end + 1))
            stop = last[end] if shape[1] else last[start]
            k_all.append((first[start], stop + 1))
            t_all.append(_TYPE[shape])
    if not q_all:
        empty = torch.zeros(0, 2, dtype=torch.int64)
        return empty, empty, torch.zeros(0, dtype=torch.int64)
    order = sorted(range(len(q_all)), key=lambda i: (q_all[i][0], k_all[i][0]))
    return (
        torch.tensor([q_all[i] for i in order], dtype=torch.int64),
        torch.tensor([k_all[i] for i in order], dtype=torch.int64),
        torch.tensor([t_all[i] for i in order], dtype=torch.int64),
    )


def old_to_magi(mask, B, Q_LEN, KV_LEN=None, *, q_offset=0, kv_offset=0):
    win = window(mask, B, None, Q_LEN, KV_LEN, q_offset, kv_offset)
    lo, hi = lines(one_mask_for_all_heads(mask, "MagiAttention"), win)
    per_row = [old_slices(lo[r], hi[r]) for r in range(lo.shape[0])]
    q_out, k_out, types = [], [], []
    for b in range(win.batch):
        q, k, t = per_row[min(b, len(per_row) - 1)]
        q_out.append(q + b * win.q_len)
        k_out.append(k + b * win.kv_len)
        types.append(t)
    q_ranges = torch.cat(q_out).to(torch.int32)
    k_ranges = torch.cat(k_out).to(torch.int32)
    return {
        "q_ranges": q_ranges,
        "k_ranges": k_ranges,
        "attn_type_map": torch.cat(types).to(torch.int32),
        "max_seqlen_q": int((q_ranges[:, 1] - q_ranges[:, 0]).max()) if len(q_ranges) else 0,
        "max_seqlen_k": int((k_ranges[:, 1] - k_ranges[:, 0]).max()) if len(k_ranges) else 0,
        "total_q": win.batch * win.q_len,
        "total_k": win.batch * win.kv_len,
    }


def assert_same_as_old(mask, B, q_len, kv_len=None, **offsets):
    got = to_magi(mask, B, None, q_len, kv_len, **offsets)
    want = old_to_magi(mask, B, q_len, kv_len, **offsets)
    for name, value in want.items():
        mine = getattr(got, name)
        if isinstance(value, torch.Tensor):
            assert mine.dtype == value.dtype and mine.shape == value.shape, name
            assert torch.equal(mine, value), (name, mine.tolist(), value.tolist())
        else:
            assert mine == value, (name, mine, value)


# ----------------------------------------------------------------- random interval tracks
@st.composite
def interval_tracks(draw):
    """(R, N, K) lines as ``lines`` lays them out: per query sorted disjoint intervals, empty
    slots (BIG, -BIG) last. Each track walks with steps of 0, 1 and others, with gaps."""
    rows = draw(st.integers(1, 3))
    n = draw(st.integers(1, 40))
    tracks = draw(st.integers(1, 3))
    steps = st.sampled_from([0, 0, 1, 1, 2, -1, 7])
    lo = torch.full((rows, n, tracks), BIG, dtype=torch.int64)
    hi = torch.full((rows, n, tracks), -BIG, dtype=torch.int64)
    for r in range(rows):
        per_query: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for t in range(tracks):
            if draw(st.integers(0, 5)) == 0:
                continue  # a track (or a whole row) with nothing in it
            first = draw(st.integers(0, 30))
            last = first + draw(st.integers(0, 30))
            for q in range(n):
                first = min(max(first + draw(steps), 0), 999)
                last = min(max(last + draw(steps), first), 999)
                if draw(st.integers(0, 6)) != 0:  # else this query attends nothing here
                    per_query[q].append((t * 1000 + first, t * 1000 + last))
        for q, intervals in enumerate(per_query):
            for slot, (a, b) in enumerate(intervals):
                lo[r, q, slot], hi[r, q, slot] = a, b
    return lo, hi


WAYS = pytest.mark.parametrize("way", ["lists", "tensors"])


@contextlib.contextmanager
def cut(way: str):
    """Both ways the slices and a tree's run tables are built: from Python lists (few
    segments or runs) and with tensor ops (many)."""
    with pytest.MonkeyPatch.context() as patch:
        if way == "tensors":
            patch.setattr(magi, "_FEW_SEGMENTS", -1)
            patch.setattr(tree_module, "_FEW_RUNS", 0)
        yield


@WAYS
@given(tracks=interval_tracks())
def test_slices_equal_the_old_greedy_walk_on_random_tracks(way, tracks):
    with cut(way):
        lo, hi = tracks
        row, q, k, t = _slices(lo, hi)
        for r in range(lo.shape[0]):
            want_q, want_k, want_t = old_slices(lo[r], hi[r])
            mine = row == r
            assert torch.equal(q[mine], want_q), (q[mine].tolist(), want_q.tolist())
            assert torch.equal(k[mine], want_k)
            assert torch.equal(t[mine], want_t)
        assert torch.equal(row, row.sort().values)  # rows in order


@WAYS
def test_slices_of_a_chain_of_one_step_segments_alternate(way):
    with cut(way):
        # Steps alternate causal / full / causal ...: the greedy walk takes two queries a run.
        first = [0] * 9
        last = [0, 1, 1, 2, 2, 3, 3, 4, 4]
        lo = torch.tensor(first).view(1, -1, 1)
        hi = torch.tensor(last).view(1, -1, 1)
        _, q, _, t = _slices(lo, hi)
        want_q, _, want_t = old_slices(lo[0], hi[0])
        assert q.tolist() == want_q.tolist() == [[0, 2], [2, 4], [4, 6], [6, 8], [8, 9]]
        assert t.tolist() == want_t.tolist() == [1, 1, 1, 1, 0]


# ----------------------------------------------------------------- masks
def rl_tree(groups: int, seed: int = 0):
    """GRPO groups as benchmarks/bench_rl_pack.py samples them (prompt 512, 8 completions of
    64-1024 tokens, vocabulary 128), packed into 8192-token trees."""
    gen = torch.Generator().manual_seed(seed)
    sequences, prompt_lens = [], []
    for _ in range(groups):
        prompt = torch.randint(0, 128, (512,), generator=gen).tolist()
        for _ in range(8):
            n = int(torch.randint(64, 1025, (1,), generator=gen))
            sequences.append(prompt + torch.randint(0, 128, (n,), generator=gen).tolist())
            prompt_lens.append(512)
    batch = pack_tree_batch(sequences, 8192, prompt_lens=prompt_lens)
    return flexmask.tree(batch.parents), batch.num_rows


def documents(count: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(length - 1, generator=gen)[: count - 1].sort().values + 1).tolist()
    bounds = [0, *cuts, length]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


@WAYS
@pytest.mark.parametrize("groups", [1, 8])
def test_rl_trees_lower_as_before(way, groups):
    with cut(way):
        mask, rows = rl_tree(groups)
        assert_same_as_old(mask, rows, 8192)


@pytest.mark.parametrize("count", [20, 1000])
def test_causal_documents_lower_as_before(count):
    assert_same_as_old(
        flexmask.causal() & flexmask.document(documents(count, 8192, 0), truncate=True), 1, 8192
    )


def test_windows_per_row_documents_and_offsets_lower_as_before():
    assert_same_as_old(flexmask.causal() & flexmask.sliding_window(1024), 1, 8192)
    per_row = flexmask.document([documents(20, 8192, seed) for seed in range(8)], truncate=True)
    assert_same_as_old(flexmask.causal() & per_row, 8, 8192)
    # One mask row for three batch rows; offsets that cut documents.
    assert_same_as_old(
        flexmask.causal() & flexmask.document(documents(7, 300, 1), truncate=True), 3, 200, 250
    )
    assert_same_as_old(
        flexmask.sliding_window(5) | flexmask.prefix(9), 2, 40, 50, q_offset=[3, 0], kv_offset=7
    )


@WAYS
@given(data=st.data(), batch=st.integers(1, 3), length=st.integers(1, 40))
def test_random_trees_lower_as_before(way, data, batch, length):
    with cut(way):
        rows = [data.draw(random_parents(data.draw(st.integers(1, length)))) for _ in range(batch)]
        tree = flexmask.tree(rows if data.draw(st.booleans()) else rows[0])
        q_off = data.draw(st.integers(0, 3))
        kv_len = data.draw(st.integers(1, length + 3))
        assert_same_as_old(tree, batch, length, kv_len, q_offset=q_off)
        assert_same_as_old(tree & flexmask.causal() | flexmask.prefix(2), batch, length, kv_len)


@WAYS
@given(data=st.data(), batch=st.integers(1, 3), q_len=st.integers(1, 17))
def test_random_masks_lower_as_before(way, data, batch, q_len):
    with cut(way):
        kv_len = data.draw(st.integers(1, 17))
        q_off = data.draw(st.integers(0, 5))
        kv_off = data.draw(st.integers(0, 5))
        n = max(q_off + q_len, kv_off + kv_len)
        mask, _ = data.draw(expressions(batch, 1, n, max_leaves=4))
        try:
            old_to_magi(mask, batch, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
        except ValueError as error:
            with pytest.raises(ValueError, match="cannot be lowered"):
                to_magi(mask, batch, None, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)
            assert "cannot be lowered" in str(error)
            return
        assert_same_as_old(mask, batch, q_len, kv_len, q_offset=q_off, kv_offset=kv_off)


# ----------------------------------------------------------------- interval lists
def plain_merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Non-empty intervals sorted, overlapping or touching ones joined."""
    out: list[list[int]] = []
    for a, b in sorted(i for i in intervals if i[0] <= i[1]):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


@st.composite
def interval_lists(draw):
    lines_, width = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    # Real ends lie within +-INF (2**61, an unbounded end); empty slots come as (BIG, -BIG).
    value = st.integers(-3, 20) | st.sampled_from([-(1 << 61), 1 << 61])
    ordered = draw(st.booleans())  # already sorted and apart: the no-sort short cut
    lo, hi = [], []
    for _ in range(lines_):
        row_lo, row_hi = [], []
        start = draw(st.integers(-3, 5))
        for _ in range(width):
            if ordered:
                a = start + draw(st.integers(0, 3))
                b = a + draw(st.integers(-1, 3))
                start = max(a, b) + 2
            elif draw(st.integers(0, 4)) == 0:
                a, b = BIG, -BIG
            else:
                a, b = draw(value), draw(value)
            row_lo.append(a)
            row_hi.append(b)
        lo.append(row_lo)
        hi.append(row_hi)
    return torch.tensor(lo), torch.tensor(hi)


@given(lists=interval_lists())
def test_interval_lists_normalize_to_their_plain_merge(lists):
    lo, hi = lists
    got_lo, got_hi = _normalize(lo, hi)
    merged = [
        plain_merge(list(zip(a, b, strict=True)))
        for a, b in zip(lo.tolist(), hi.tolist(), strict=True)
    ]
    slots = max(1, *(len(m) for m in merged))
    want_lo = [[a for a, _ in m] + [BIG] * (slots - len(m)) for m in merged]
    want_hi = [[b for _, b in m] + [-BIG] * (slots - len(m)) for m in merged]
    assert got_lo.tolist() == want_lo
    assert got_hi.tolist() == want_hi


def plain_ancestor_runs(parents: list[int], q: int, kv_len: int) -> list[tuple[int, int]]:
    """Keys a tree query attends (itself and its ancestors, below kv_len) as sorted runs."""
    keys = set()
    while q >= 0:
        keys.add(q)
        q = parents[q]
    return plain_merge([(k, k) for k in keys if k < kv_len])


@WAYS
@given(data=st.data(), length=st.integers(1, 40))
def test_tree_lines_are_the_ancestors_as_runs(way, data, length):
    parents = data.draw(random_parents(data.draw(st.integers(1, length))))
    q_len, kv_len = length, data.draw(st.integers(1, length + 2))
    mask = flexmask.tree(parents)
    with cut(way):
        got = lines(mask, window(mask, 1, None, q_len, kv_len))
    for q in range(q_len):
        want = plain_ancestor_runs(parents, q, kv_len) if q < len(parents) else []
        pairs = zip(got.lo[0, q].tolist(), got.hi[0, q].tolist(), strict=True)
        have = [(a, b) for a, b in pairs if a <= b]
        assert have == want, (q, parents)
        assert all(a == BIG for a in got.lo[0, q].tolist()[len(want) :])
