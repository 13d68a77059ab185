"""Windows far from position 0 (issue #29): ``create_block_mask(..., q_offset=, kv_offset=)``
anywhere up to 2**63 - 1 builds from the window's own positions, never from lookups over
every position before it, and equals a dense reference written on the window alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import flexmask
from tests import oracle

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


def _window(refs, batch, q_len, kv_len, q_offset, kv_offset):
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


def _check(mask, refs, batch, q_len, kv_len, q_offset, kv_offset, block):
    ours = flexmask.create_block_mask(
        mask, batch, 1, q_len, kv_len, "cpu", block, q_offset=q_offset, kv_offset=kv_offset
    )
    window = _window(refs, batch, q_len, kv_len, q_offset, kv_offset)
    context = f"{mask!r} q_offset={q_offset} kv_offset={kv_offset}"
    oracle.assert_same_block_mask(ours, oracle.torch_blocks(window, block), context)
    local = create_mask(ours.mask_mod, batch, 1, q_len, kv_len, "cpu")
    assert np.array_equal(local.numpy(), window), context
    return ours


def test_issue_29_causal_and_document_at_2_to_the_40():
    mask = flexmask.causal() & flexmask.document([FAR + 256])
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
        lambda: flexmask.causal() & flexmask.document([FAR + 100, 70, EDGE - FAR - 170, 300]),
        lambda: _and(_causal, _documents([FAR + 100, 70, EDGE - FAR - 170, 300])),
    ),
    (
        "document ending at 2**63 - 1",
        lambda: flexmask.document([2**63 - 1 - 300, 100, 200]),
        lambda: _documents([2**63 - 1 - 300, 100, 200]),
    ),
    (
        "causal & padding",
        lambda: flexmask.causal() & flexmask.padding(FAR + 90),
        lambda: _and(_causal, _padding(FAR + 90)),
    ),
    ("sliding_window", lambda: flexmask.sliding_window(37), lambda: _sliding(37)),
    ("chunked", lambda: flexmask.chunked(48), lambda: _chunked(48)),
    ("prefix", lambda: flexmask.prefix(FAR + 20), lambda: _prefix(FAR + 20)),
    (
        "causal | spans",
        lambda: flexmask.causal() | flexmask.spans([-1, 0, 0, 0, -1, 1, 1]),
        lambda: _or(_causal, _spans([-1, 0, 0, 0, -1, 1, 1])),
    ),
    ("tree", lambda: flexmask.tree([-1, 0, 1, 0, 3]), lambda: _tree([-1, 0, 1, 0, 3])),
    (
        "~document | sliding_window (evaluated tiles)",
        lambda: ~flexmask.document([FAR + 60, 100]) | flexmask.sliding_window(5),
        lambda: _or(_not(_documents([FAR + 60, 100])), _sliding(5)),
    ),
]


@pytest.mark.parametrize("name, make, reference", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(
    "q_offset, kv_offset",
    [(FAR, FAR), (FAR + 40, FAR - 3), (FAR, 0), (0, FAR), (EDGE, EDGE), (EDGE + 17, EDGE - 201)],
)
def test_far_windows_equal_the_window_reference(name, make, reference, q_offset, kv_offset):
    _check(make(), reference(), 1, 150, 130, q_offset, kv_offset, 64)


@pytest.mark.parametrize("block", [32, (64, 16)])
def test_far_windows_per_row(block):
    # Per-row data and per-row offsets, far apart: each row's window of its own mask.
    docs = [[FAR + 30, 90], [EDGE - 5, 40]]
    mask = flexmask.causal() & flexmask.document(docs)
    refs = [_and(_causal, _documents(d)) for d in docs]
    _check(mask, refs, 2, 100, 120, [FAR, EDGE], [FAR - 10, EDGE - 50], block)
    # Shared data, per-row offsets: the lookups are per row, the data is not.
    shared = flexmask.document([FAR + 30, 90]) | flexmask.spans([0, 0, -1, 1])
    ref = _or(_documents([FAR + 30, 90]), _spans([0, 0, -1, 1]))
    _check(shared, ref, 2, 70, 90, [FAR, 1], [FAR + 5, 0], block)
    trees = [[-1, 0, 1], [-1, 0, 0, 2, 2]]
    _check(flexmask.tree(trees), [_tree(p) for p in trees], 2, 40, 40, [0, FAR], [2, 1], block)


@pytest.mark.parametrize(
    "mask, reference",
    [
        (
            flexmask.causal() & flexmask.document([100, 130, 200]),
            _and(_causal, _documents([100, 130, 200])),
        ),
        (
            flexmask.causal() | flexmask.spans([-1] * 90 + [0] * 60 + [-1] * 20 + [1] * 50),
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
    bm = _check(mask, reference, 1, 48, 40, 150, 120, 16)
    held = [t for t in vars_of(bm.mask_mod) if isinstance(t, torch.Tensor)]
    assert max(t.numel() for t in held) <= 49
