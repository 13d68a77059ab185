"""Windows of a mask: ``create_block_mask(..., q_offset=, kv_offset=)`` builds the rows
``[q_offset, q_offset + Q_LEN)`` and columns ``[kv_offset, kv_offset + KV_LEN)`` — equal, as
whole tensors, to torch's build of the shifted mask_mod and to the dense oracle's window.

Windows far from position 0 (issue #29), anywhere up to 2**63 - 1, are built from the
window's own positions, never from lookups over every position before it, and equal a dense
reference written on the window alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask, flex_attention

import flexmask
from flexmask.builders import make_grid
from tests import oracle
from tests.strategies import (
    ending_intersections,
    expressions,
    interval_intersections,
    small_windows,
)

BLOCKS = st.sampled_from([16, 32, 64, 128, (16, 32), (64, 16)])


def _window(dense: np.ndarray, q_off: list[int], kv_off: list[int], q_len: int, kv_len: int):
    """(B, H, q_len, kv_len) rows/columns of the whole dense mask at each row's offsets."""
    out = np.zeros((*dense.shape[:2], q_len, kv_len), dtype=bool)
    for b in range(dense.shape[0]):
        out[b] = dense[b, :, q_off[b] : q_off[b] + q_len, kv_off[b] : kv_off[b] + kv_len]
    return out


def _offsets(draw, batch: int, span: int, name: str):
    """An int or a per-row list of offsets in [0, span]."""
    if draw(st.booleans()):
        return draw(st.integers(0, span), label=name)
    return draw(st.lists(st.integers(0, span), min_size=batch, max_size=batch), label=name)


def _per_row(offset, batch: int) -> list[int]:
    return list(offset) if isinstance(offset, list) else [offset] * batch


def _check(mask, dense_of, batch, heads, q_len, kv_len, q_off, kv_off, block):
    total_q = max(_per_row(q_off, batch)) + q_len
    total_kv = max(_per_row(kv_off, batch)) + kv_len
    span = max(total_q, total_kv)
    ours = flexmask.create_block_mask(
        mask, batch, heads, q_len, kv_len, "cpu", block, q_offset=q_off, kv_offset=kv_off
    )
    whole = dense_of(span, span)
    window = _window(whole, _per_row(q_off, batch), _per_row(kv_off, batch), q_len, kv_len)
    context = f"{mask!r} q_offset={q_off} kv_offset={kv_off}"
    oracle.assert_same_block_mask(ours, oracle.torch_build(window, block=block), context)
    # The BlockMask's mask_mod takes local indices: densely it is the window too.
    local = create_mask(ours.mask_mod, batch, heads, q_len, kv_len, "cpu")
    assert np.array_equal(local.numpy(), window), context
    return ours


@settings(max_examples=40)
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    q_len=st.integers(1, 200),
    kv_len=st.integers(1, 200),
    block=BLOCKS,
)
def test_closed_form_windows_equal_the_oracle(data, batch, q_len, kv_len, block):
    q_off = _offsets(data.draw, batch, 200, "q_offset")
    kv_off = _offsets(data.draw, batch, 200, "kv_offset")
    span = max(max(_per_row(q_off, batch)) + q_len, max(_per_row(kv_off, batch)) + kv_len)
    mask, dense = data.draw(interval_intersections(batch, span))
    assert mask.has_monotone_intervals()
    _check(
        mask,
        lambda q, kv: np.repeat(dense(q, kv)[:, None], 2, axis=1),
        batch,
        2,
        q_len,
        kv_len,
        q_off,
        kv_off,
        block,
    )


@settings(max_examples=25)
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    q_len=st.integers(1, 150),
    kv_len=st.integers(1, 150),
    block=BLOCKS,
)
def test_any_expression_windows_equal_the_oracle(data, batch, heads, q_len, kv_len, block):
    q_off = _offsets(data.draw, batch, 150, "q_offset")
    kv_off = _offsets(data.draw, batch, 150, "kv_offset")
    span = max(max(_per_row(q_off, batch)) + q_len, max(_per_row(kv_off, batch)) + kv_len)
    mask, dense = data.draw(expressions(batch, heads, span))
    _check(mask, dense, batch, heads, q_len, kv_len, q_off, kv_off, block)


def _dense4(dense, heads: int):
    return lambda q, kv: np.repeat(dense(q, kv)[:, None], heads, axis=1)


@settings(max_examples=120)
@given(data=st.data(), batch=st.integers(1, 2))
def test_small_unaligned_windows_equal_the_oracle(data, batch):
    # Tiny tiles and kv offsets off the block grid: a q block may hold every query that
    # attends the window while its first and last queries attend nothing in it (the first
    # ends before kv_offset, the last is past the documents or the padding).
    drawn = data.draw(small_windows(batch, ending_intersections))
    mask, dense, q_len, kv_len, q_off, kv_off, block = drawn
    assert mask.has_monotone_intervals()
    _check(mask, _dense4(dense, 1), batch, 1, q_len, kv_len, q_off, kv_off, block)


@settings(max_examples=60)
@given(data=st.data(), batch=st.integers(1, 2), heads=st.integers(1, 2))
def test_small_windows_of_any_expression_equal_the_oracle(data, batch, heads):
    def masks(batch, length):
        return expressions(batch, heads, length)

    mask, dense, q_len, kv_len, q_off, kv_off, block = data.draw(small_windows(batch, masks))
    _check(mask, dense, batch, heads, q_len, kv_len, q_off, kv_off, block)


def test_window_equals_torchs_build_of_the_shifted_mask_mod():
    mask = flexmask.causal() & flexmask.document([[300, 200, 12], [100, 400, 12]], truncate=True)
    q_off, kv_off = torch.tensor([64, 3]), torch.tensor([0, 7])
    ours = flexmask.create_block_mask(
        mask, 2, 2, 130, 505, "cpu", 64, q_offset=q_off, kv_offset=kv_off
    )
    whole = mask.mask_mod_for(512, 512)
    theirs = oracle.torch_build(whole, 2, 2, 130, 505, 64, q_offset=q_off, kv_offset=kv_off)
    oracle.assert_same_block_mask(ours, theirs)


def test_offsets_are_held_as_tensors_and_validated():
    mask = flexmask.causal() & flexmask.sliding_window(64)
    bm = flexmask.create_block_mask(mask, 1, 1, 128, 512, "cpu", q_offset=384)
    # One shared offset: one entry, read at b - b (an index, which inductor's interval
    # analysis reads; a bare 0-d operand refuses the mask there).
    assert isinstance(bm.mask_mod.q_offset, torch.Tensor) and bm.mask_mod.q_offset.shape == (1,)
    same = flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=[384, 384])
    apart = flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=[384, 256])
    # Per-row offsets stay per row when they agree: a compiled kernel guards on the shapes
    # of the tensors its mask_mod holds, so rows that agree one step and diverge the next
    # must not change them (that would recompile).
    for bm in (same, apart):
        assert bm.mask_mod.q_offset.shape == bm.mask_mod.kv_offset.shape == (2,)
    assert same.mask_mod.q_offset.tolist() == [384, 384]
    assert same.mask_mod.kv_offset.tolist() == [0, 0]
    oracle.assert_same_block_mask(
        same, flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=384)
    )
    zero = flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=[0, 0])
    assert zero.mask_mod.q_offset.tolist() == [0, 0]
    plain = flexmask.create_block_mask(mask, 1, 1, 128, 512, "cpu")
    assert plain.mask_mod is not None and not hasattr(plain.mask_mod, "q_offset")
    with pytest.raises(ValueError, match="q_offset must be >= 0"):
        flexmask.create_block_mask(mask, 1, 1, 128, 512, "cpu", q_offset=-1)
    with pytest.raises(ValueError, match="kv_offset holds 3 offsets but B=2"):
        flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", kv_offset=[0, 1, 2])
    with pytest.raises(TypeError, match="q_offset"):
        flexmask.create_block_mask(mask, 1, 1, 128, 512, "cpu", q_offset=1.5)
    with pytest.raises(TypeError, match="need a flexmask Mask"):
        flexmask.create_block_mask(mask.mask_mod, 1, 1, 128, 512, "cpu", q_offset=4)


def test_cache_keys_windows_apart():
    cache = flexmask.MaskCache()
    mask = flexmask.causal() & flexmask.document([[300, 212], [512]], truncate=True)
    a = cache.get(mask, 2, 1, 128, 512, "cpu", q_offset=128)
    b = cache.get(mask, 2, 1, 128, 512, "cpu", q_offset=256)
    c = cache.get(mask, 2, 1, 128, 512, "cpu", q_offset=[128, 128])
    assert a is not b and a is not c  # c's mask_mod holds per-row offsets
    oracle.assert_same_block_mask(a, c)
    assert c.mask_mod.q_offset.shape == (2,)
    d = cache.get(mask, 2, 1, 128, 512, "cpu", q_offset=[128, 256])
    expected = flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=[128, 256])
    oracle.assert_same_block_mask(d, expected)
    # A mask ignoring rows, windowed per row, is built per row.
    static = cache.get(flexmask.causal(), 2, 1, 128, 512, "cpu", q_offset=[0, 256])
    assert static.kv_num_blocks.shape[0] == 2
    grid = make_grid(flexmask.causal(), 2, 1, 128, 512, "cpu", 128, [0, 256], 0)
    assert grid.per_row_offsets and grid.length == 512
    # Equal per-row offsets on a mask ignoring rows: rows kept, so the (B,) offsets its
    # mask_mod holds match the batch flex_attention runs; attention equals the int window's.
    agree = cache.get(flexmask.causal(), 2, 1, 128, 512, "cpu", q_offset=[256, 256])
    assert agree.kv_num_blocks.shape[0] == 2 and agree.mask_mod.q_offset.shape == (2,)
    q = torch.randn(2, 1, 128, 16, dtype=torch.float64)
    kv = torch.randn(2, 1, 512, 16, dtype=torch.float64)
    window = flexmask.create_block_mask(flexmask.causal(), 2, 1, 128, 512, "cpu", q_offset=256)
    torch.testing.assert_close(
        flex_attention(q, kv, kv, block_mask=agree), flex_attention(q, kv, kv, block_mask=window)
    )


FAR = 2**40
EDGE = 2**63 - 384  # a window of up to 256 positions still ends below 2**63


# --- the reference: plain comparisons of whole-mask positions q_offset + i, kv_offset + j ---


def _causal(q, kv):
    return kv <= q


def _documents(seq_lens):
    """Attends iff q and kv lie in one document [start, start + n)."""
    bounds, start = [], 0
    for n in seq_lens:
        bounds.append((start, start + n))
        start += n

    def attends(q, kv):
        out = np.zeros(np.broadcast_shapes(q.shape, kv.shape), dtype=bool)
        for lo, hi in bounds:
            # Python ints: an end may be 2**63 - 1, where int64 arithmetic would wrap.
            out |= (q >= lo) & (q < hi) & (kv >= lo) & (kv < hi)
        return out

    return attends


def _padding(length):
    return lambda q, kv: (q < length) & (kv < length)


def _prefix(length):
    return lambda q, kv: np.broadcast_to(kv < length, np.broadcast_shapes(q.shape, kv.shape))


def _sliding(size):
    # q and kv are int64 >= 0: their difference cannot wrap.
    return lambda q, kv: np.abs(q - kv) < size


def _chunked(size):
    return lambda q, kv: q // size == kv // size


def _spans(ids):
    def attends(q, kv):
        out = np.zeros(np.broadcast_shapes(q.shape, kv.shape), dtype=bool)
        for span in set(ids) - {-1}:
            where = [i for i, x in enumerate(ids) if x == span]
            lo, hi = min(where), max(where) + 1
            out |= (q >= lo) & (q < hi) & (kv >= lo) & (kv < hi)
        return out

    return attends


def _tree(parents):
    def attends(q, kv):
        out = np.zeros(np.broadcast_shapes(q.shape, kv.shape), dtype=bool)
        for node in range(len(parents)):  # each kv node: the queries in its subtree
            below, frontier = {node}, [node]
            while frontier:
                frontier = [c for c, p in enumerate(parents) if p in frontier]
                below.update(frontier)
            out |= (kv == node) & np.isin(q, list(below))
        return out

    return attends


def _and(*refs):
    def attends(q, kv):
        out = refs[0](q, kv)
        for ref in refs[1:]:
            out = out & ref(q, kv)
        return out

    return attends


def _or(*refs):
    def attends(q, kv):
        out = refs[0](q, kv)
        for ref in refs[1:]:
            out = out | ref(q, kv)
        return out

    return attends


def _not(ref):
    return lambda q, kv: ~ref(q, kv)


def _rows(offset, batch):
    return list(offset) if isinstance(offset, list) else [offset] * batch


def _far_window(refs, batch, q_len, kv_len, q_offset, kv_offset):
    """(B, 1, Q, KV): row b's reference at positions q_offset[b] + i, kv_offset[b] + j."""
    out = np.zeros((batch, 1, q_len, kv_len), dtype=bool)
    for b, (q0, kv0) in enumerate(
        zip(_rows(q_offset, batch), _rows(kv_offset, batch), strict=True)
    ):
        q = np.array([q0 + i for i in range(q_len)], dtype=np.int64)[:, None]
        kv = np.array([kv0 + j for j in range(kv_len)], dtype=np.int64)[None, :]
        ref = refs[b] if isinstance(refs, list) else refs
        out[b, 0] = np.broadcast_to(ref(q, kv), (q_len, kv_len))
    return out


def _far_check(mask, refs, batch, q_len, kv_len, q_offset, kv_offset, block):
    ours = flexmask.create_block_mask(
        mask, batch, 1, q_len, kv_len, "cpu", block, q_offset=q_offset, kv_offset=kv_offset
    )
    window = _far_window(refs, batch, q_len, kv_len, q_offset, kv_offset)
    context = f"{mask!r} q_offset={q_offset} kv_offset={kv_offset}"
    oracle.assert_same_block_mask(ours, oracle.torch_build(window, block=block), context)
    local = create_mask(ours.mask_mod, batch, 1, q_len, kv_len, "cpu")
    assert np.array_equal(local.numpy(), window), context
    return ours


def test_issue_29_causal_and_document_at_2_to_the_40():
    mask = flexmask.causal() & flexmask.document([FAR + 256], truncate=True)
    bm = flexmask.create_block_mask(mask, 1, 1, 128, 128, device="cpu", q_offset=FAR, kv_offset=FAR)
    expected = flexmask.create_block_mask(flexmask.causal(), 1, 1, 128, 128, device="cpu")
    oracle.assert_same_block_mask(bm, expected)
    # The mask_mod holds the window's ids, not one per position from 0.
    held = [t for t in vars_of(bm.mask_mod) if isinstance(t, torch.Tensor)]
    assert held and max(t.numel() for t in held) <= 129


def vars_of(mod):
    """Every tensor a mask_mod holds, through its nested mask_mods."""
    out = []
    for cls in type(mod).__mro__:
        for name in cls.__dict__.get("__slots__", ()):
            value = getattr(mod, name, None)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, tuple):
                for item in value:
                    out.extend(vars_of(item))
            elif callable(value) and hasattr(value, "__slots__"):
                out.extend(vars_of(value))
    return out


CASES = [
    ("causal", lambda: flexmask.causal(), lambda: _causal),
    (
        "causal & document",
        lambda: (
            flexmask.causal()
            & flexmask.document([FAR + 100, 70, EDGE - FAR - 170, 300], truncate=True)
        ),
        lambda: _and(_causal, _documents([FAR + 100, 70, EDGE - FAR - 170, 300])),
    ),
    (
        "document ending at 2**63 - 1",
        lambda: flexmask.document([2**63 - 1 - 300, 100, 200], truncate=True),
        lambda: _documents([2**63 - 1 - 300, 100, 200]),
    ),
    (
        "causal & padding",
        lambda: flexmask.causal() & flexmask.padding(FAR + 90, truncate=True),
        lambda: _and(_causal, _padding(FAR + 90)),
    ),
    ("sliding_window", lambda: flexmask.sliding_window(37), lambda: _sliding(37)),
    ("chunked", lambda: flexmask.chunked(48), lambda: _chunked(48)),
    ("prefix", lambda: flexmask.prefix(FAR + 20), lambda: _prefix(FAR + 20)),
    (
        "causal | spans",
        lambda: flexmask.causal() | flexmask.spans([-1, 0, 0, 0, -1, 1, 1], truncate=True),
        lambda: _or(_causal, _spans([-1, 0, 0, 0, -1, 1, 1])),
    ),
    ("tree", lambda: flexmask.tree([-1, 0, 1, 0, 3]), lambda: _tree([-1, 0, 1, 0, 3])),
    (
        "~document | sliding_window (evaluated tiles)",
        lambda: ~flexmask.document([FAR + 60, 100], truncate=True) | flexmask.sliding_window(5),
        lambda: _or(_not(_documents([FAR + 60, 100])), _sliding(5)),
    ),
]


@pytest.mark.parametrize("name, make, reference", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(
    "q_offset, kv_offset",
    [(FAR, FAR), (FAR + 40, FAR - 3), (FAR, 0), (0, FAR), (EDGE, EDGE), (EDGE + 17, EDGE - 201)],
)
def test_far_windows_equal_the_window_reference(name, make, reference, q_offset, kv_offset):
    _far_check(make(), reference(), 1, 150, 130, q_offset, kv_offset, 64)


@pytest.mark.parametrize("block", [32, (64, 16)])
def test_far_windows_per_row(block):
    # Per-row data and per-row offsets, far apart: each row's window of its own mask.
    docs = [[FAR + 30, 90], [EDGE - 5, 40]]
    mask = flexmask.causal() & flexmask.document(docs, truncate=True)
    refs = [_and(_causal, _documents(d)) for d in docs]
    _far_check(mask, refs, 2, 100, 120, [FAR, EDGE], [FAR - 10, EDGE - 50], block)
    # Shared data, per-row offsets: the lookups are per row, the data is not.
    shared = flexmask.document([FAR + 30, 90], truncate=True) | flexmask.spans(
        [0, 0, -1, 1], truncate=True
    )
    ref = _or(_documents([FAR + 30, 90]), _spans([0, 0, -1, 1]))
    _far_check(shared, ref, 2, 70, 90, [FAR, 1], [FAR + 5, 0], block)
    trees = [[-1, 0, 1], [-1, 0, 0, 2, 2]]
    _far_check(flexmask.tree(trees), [_tree(p) for p in trees], 2, 40, 40, [0, FAR], [2, 1], block)


@pytest.mark.parametrize(
    "mask, reference",
    [
        (
            flexmask.causal() & flexmask.document([100, 130, 200], truncate=True),
            _and(_causal, _documents([100, 130, 200])),
        ),
        (
            flexmask.causal()
            | flexmask.spans([-1] * 90 + [0] * 60 + [-1] * 20 + [1] * 50, truncate=True),
            _or(_causal, _spans([-1] * 90 + [0] * 60 + [-1] * 20 + [1] * 50)),
        ),
        (
            flexmask.tree([-1] + list(range(0, 179))),
            _tree([-1] + list(range(0, 179))),
        ),
    ],
    ids=["document", "spans", "tree"],
)
def test_windows_past_their_extent_take_their_own_positions(mask, reference):
    # A window whose reach exceeds Q_LEN + KV_LEN holds lookups of its own positions; its
    # content is real here (the data reaches into it), unlike a window at 2**40.
    bm = _far_check(mask, reference, 1, 48, 40, 150, 120, 16)
    held = [t for t in vars_of(bm.mask_mod) if isinstance(t, torch.Tensor)]
    assert max(t.numel() for t in held) <= 49
