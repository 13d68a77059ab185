"""The closed-form path (flexmask.builders.closed_form): its preconditions hold for every
intersection of interval pieces, and what it writes equals torch's create_block_mask on a
plain dense reference, and the general path's (classify every tile, rank the grid)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask

import flexmask
from flexmask.blocks.write import assemble, ordered_from_codes
from flexmask.builders import closed_form, make_grid
from flexmask.builders.classify import classify_blocks
from tests import oracle
from tests.strategies import interval_intersections

BLOCK_FIELDS = oracle.BLOCK_FIELDS


def _general(mask, B, H, q_len, kv_len, block):
    """The same mask through the general path: classified tiles, ranked."""
    grid = make_grid(mask, B, H, q_len, kv_len, "cpu", block)
    kv, q = ordered_from_codes(classify_blocks(mask, grid).codes)
    return assemble(kv, q, grid, mask.lower_at(grid.length, grid.device).mask_mod)


def _case(data):
    """A random intersection of interval pieces, its plain dense reference and lengths that
    hold its data (documents, padding and prefixes must fit in max(Q_LEN, KV_LEN))."""
    batch = data.draw(st.integers(1, 3), label="batch")
    length = data.draw(st.integers(1, 300), label="length")
    mask, dense = data.draw(interval_intersections(batch, length))
    q_len = data.draw(st.integers(1, 300), label="q_len")
    kv_len = data.draw(st.integers(1, 300), label="kv_len")
    if max(q_len, kv_len) < length:
        kv_len = length
    return batch, mask, dense, q_len, kv_len


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_intervals_are_the_dense_rows_and_monotone(data):
    # The closed form rests on three properties of every query's interval (build.closed_form).
    # Check them on every query of random intersections, and that each interval is exactly
    # that query's row of the plain reference.
    batch, mask, dense, q_len, kv_len = _case(data)
    assert mask.has_monotone_intervals()
    reference = dense(q_len, kv_len)
    grid = make_grid(mask, batch, 1, q_len, kv_len, "cpu", 16)
    for r in range(batch):
        q_idx = torch.arange(q_len).view(1, -1)
        lo, hi = mask.intervals_at(q_idx, torch.tensor([[r]]), grid)
        lo = lo.clamp(min=0).expand(1, q_len)[0].tolist()
        hi = hi.clamp(max=kv_len - 1).expand(1, q_len)[0].tolist()
        attending = [lo[q] <= hi[q] for q in range(q_len)]
        for q in range(q_len):
            expected = np.zeros(kv_len, bool)
            if attending[q]:
                expected[lo[q] : hi[q] + 1] = True
            assert np.array_equal(reference[r, q], expected), f"row {r} query {q}"
        prefix = attending.index(False) if False in attending else q_len
        assert not any(attending[prefix:]), "attending queries must be a prefix"
        for q in range(prefix - 1):
            assert lo[q] <= lo[q + 1] and hi[q] <= hi[q + 1], f"not monotone at {q}"
            assert lo[q + 1] <= hi[q] + 1, f"intervals {q} and {q + 1} do not touch"


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_closed_form_equals_torch_and_the_general_path(data):
    batch, mask, dense, q_len, kv_len = _case(data)
    block = data.draw(st.sampled_from([128, 16, (32, 64), (64, 16), 7]), label="block")
    heads = data.draw(st.integers(1, 3), label="heads")
    ours = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", block)
    reference = oracle.torch_build(np.repeat(dense(q_len, kv_len)[:, None], heads, 1), block=block)
    oracle.assert_same_block_mask(ours, reference, repr(mask))
    oracle.assert_same_block_mask(_general(mask, batch, heads, q_len, kv_len, block), reference)


def _rows(*per_row):
    """Row references from functions of (q_len, kv_len), one per batch row."""
    return lambda q_len, kv_len: [f(q_len, kv_len) for f in per_row]


_causal = oracle.causal


def _doc(lens):
    return lambda q, kv: oracle.document(lens, q, kv)


def _and(*fs):
    def both(q, kv):
        out = np.ones((q, kv), bool)
        for f in fs:
            out = out & f(q, kv)
        return out

    return both


EDGE_CASES = [
    (flexmask.causal(), _rows(_causal), 1, 1, 128),
    (flexmask.causal(), _rows(_causal), 1000, 1000, 128),
    (
        flexmask.causal() & flexmask.document([[5, 300, 1], [1000]]),
        _rows(_and(_causal, _doc([5, 300, 1])), _and(_causal, _doc([1000]))),
        1000,
        1000,
        128,
    ),
    # the attending prefix ends inside a q block, in a row of its own
    (
        flexmask.causal() & flexmask.padding([200, 129, 1]),
        _rows(*(_and(_causal, lambda q, kv, n=n: oracle.padding(n, q, kv)) for n in (200, 129, 1))),
        300,
        300,
        128,
    ),
    (
        flexmask.document([100, 37]) & flexmask.prefix(120),
        _rows(_and(_doc([100, 37]), lambda q, kv: oracle.prefix(120, q, kv))),
        300,
        300,
        16,
    ),
    (
        flexmask.sliding_window(33) & flexmask.document([250, 250]),
        _rows(_and(_doc([250, 250]), lambda q, kv: oracle.sliding_window(33, q, kv))),
        500,
        513,
        64,
    ),
    (
        flexmask.causal() & flexmask.sliding_window([1, 500]),
        _rows(
            *(_and(_causal, lambda q, kv, w=w: oracle.sliding_window(w, q, kv)) for w in (1, 500))
        ),
        600,
        400,
        (32, 128),
    ),
    (
        flexmask.full() & flexmask.empty(),
        _rows(lambda q, kv: np.zeros((q, kv), bool)),
        129,
        129,
        128,
    ),
    (flexmask.full(), _rows(lambda q, kv: np.ones((q, kv), bool)), 129, 257, (128, 64)),
]


# ids from the mask and shape, not repr of each value: a lambda's repr holds its address,
# which differs between pytest-xdist workers and fails their collection.
@pytest.mark.parametrize(
    "mask, rows, q_len, kv_len, block",
    EDGE_CASES,
    ids=[f"{m!r}-{q}x{kv}-{b}" for m, _, q, kv, b in EDGE_CASES],
)
def test_edge_cases_equal_torch(mask, rows, q_len, kv_len, block):
    dense = oracle.stack(rows(q_len, kv_len), heads=2)
    ours = flexmask.create_block_mask(mask, dense.shape[0], 2, q_len, kv_len, "cpu", block)
    oracle.assert_same_block_mask(ours, oracle.torch_build(dense, block=block), repr(mask))


def test_only_intersections_of_interval_pieces_take_the_closed_form():
    monotone = [
        flexmask.causal(),
        flexmask.causal() & flexmask.document([3, 4]) & flexmask.sliding_window(2),
        flexmask.prefix(3) & flexmask.padding(5) & flexmask.full() & flexmask.empty(),
        flexmask.causal() | flexmask.prefix(3),  # prefix-LM: [0, max(q, 2)]
        (flexmask.causal() | flexmask.prefix([3, 9])) & flexmask.document([[5, 7], [12]]),
    ]
    general = [
        flexmask.causal() | flexmask.sliding_window(3),  # not from key 0
        flexmask.padding(5) | flexmask.prefix(3),  # padding attends nowhere past 5
        (flexmask.causal() & flexmask.document([3, 4])) | flexmask.prefix(2),
        ~flexmask.causal(),
        flexmask.causal() & ~flexmask.sliding_window(2),
        flexmask.tree([-1, 0, 0]),
        flexmask.causal() & flexmask.from_mask_mod(lambda b, h, q, kv: q >= kv, key="c"),
    ]
    assert all(m.has_monotone_intervals() for m in monotone)
    assert not any(m.has_monotone_intervals() for m in general)


def test_closed_form_asks_only_for_block_edges(monkeypatch):
    # The cost claim: intervals at 2 queries per q block, plus two blocks per row where the
    # attending queries begin and end; never every query, never a tile grid.
    S, block, rows = 4096, 128, 3
    mask = flexmask.causal() & flexmask.padding([S, 1000, 77])
    asked = []
    original = type(mask).intervals_at

    def spy(self, q_idx, row, grid):
        asked.append(q_idx.numel())
        return original(self, q_idx, row, grid)

    monkeypatch.setattr(type(mask), "intervals_at", spy)
    monkeypatch.setattr(
        "flexmask.builders.sides.classify_blocks",
        lambda *a: pytest.fail("the closed form must not classify tiles"),
    )
    flexmask.create_block_mask(mask, rows, 1, S, S, "cpu", block)
    nq = S // block
    assert sum(asked) <= rows * (2 * nq + 2 * block)


def test_runs_never_decrease():
    # Column runs are found by binary search over the row runs: they must be sorted.
    mask = flexmask.causal() & flexmask.document([[700, 300, 24], [1, 1023]])
    grid = make_grid(mask, 2, 1, 1024, 1024, "cpu", 64)
    runs = closed_form.row_runs(mask, grid)
    for t in runs:
        assert bool((t[:, 1:] >= t[:, :-1]).all())


def test_same_blocks_compares_listed_blocks_only():
    mask = flexmask.causal() & flexmask.document([300, 200])
    ours = flexmask.create_block_mask(mask, 1, 1, 512, 512, "cpu")
    dense = oracle.causal(512, 512) & oracle.document([300, 200], 512, 512)
    theirs = oracle.torch_build(oracle.stack([dense]), block=128)
    assert flexmask.same_blocks(ours, theirs)
    tail = ours.kv_indices.clone()
    tail[0, 0, 0, 1:] = tail[0, 0, 0, 1:].flip(-1)  # past the count of row 0 (one block)
    other_tail = BlockMask.from_kv_blocks(
        ours.kv_num_blocks, tail, ours.full_kv_num_blocks, ours.full_kv_indices
    )
    assert not torch.equal(other_tail.kv_indices, theirs.kv_indices)  # the tails differ...
    assert flexmask.same_blocks(other_tail, theirs)  # ...the listed blocks do not
    other = flexmask.create_block_mask(flexmask.causal(), 1, 1, 512, 512, "cpu")
    assert not flexmask.same_blocks(ours, other)  # other counts
    moved = ours.kv_indices.clone()
    row = int(ours.kv_num_blocks[0, 0].argmax())
    moved[0, 0, row, 0] = (moved[0, 0, row, 0] + 1) % moved.shape[-1]  # a listed entry
    changed = BlockMask.from_kv_blocks(
        ours.kv_num_blocks, moved, ours.full_kv_num_blocks, ours.full_kv_indices
    )
    assert not flexmask.same_blocks(ours, changed)  # same counts, another block listed
    bigger = flexmask.create_block_mask(mask, 1, 1, 512, 640, "cpu")
    assert not flexmask.same_blocks(ours, bigger)
    with pytest.raises(TypeError, match="b must be a torch BlockMask"):
        flexmask.same_blocks(ours, mask)


@pytest.mark.parametrize("B", [1, 3])
def test_both_paths_give_tensors_of_one_layout(B):
    # torch.compile guards on dtypes and strides: the closed form and the general path must
    # hand flex_attention the same layout, or one mask kind would compile twice.
    mask = flexmask.causal() & flexmask.document(
        [[100, 200], [300], [5, 5, 5]][:B] if B > 1 else [100, 200]
    )
    closed = flexmask.create_block_mask(mask, B, 2, 300, 300, "cpu", 64)
    general = _general(mask, B, 2, 300, 300, 64)
    for name in BLOCK_FIELDS:
        a, b = getattr(closed, name), getattr(general, name)
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
    # ... and no two of the tensors share memory (inputs that alias compile apart too).
    storages = {getattr(closed, name).untyped_storage().data_ptr() for name in BLOCK_FIELDS}
    assert len(storages) == len(BLOCK_FIELDS)
