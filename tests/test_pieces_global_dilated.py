"""global_tokens(is_global) (Longformer's global attention) and dilated(dilation).

Every build is compared, as whole tensors, with torch's own ``create_block_mask`` of a
plain dense oracle written here from the definitions (q attends kv iff ``is_global[b, q]
or is_global[b, kv]``, positions past the data not global; iff ``(q - kv) % d == 0``) —
over B and H > 1, shared and per-row data, rectangular and tiny blocks, lengths that are
not block multiples, windows at offsets (per row too), rows that attend nothing, negations
and the compositions the gallery uses (Longformer, packed HSTU, attn-gym's dilated sliding
window). The lowerings are read back through each format's own documented meaning
(``test_formats``' decoders) and compared with the same oracle, or refuse naming the piece."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch
from attn_gym.masks.dilated_sliding_window import generate_dilated_sliding_window
from attn_gym.masks.global_sliding_window import generate_global_sliding_window
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.formats import to_fa4, to_flashmask, to_magi, to_varlen
from flexmask.pieces import dilated, global_tokens
from tests import oracle
from tests.test_formats import flashmask_dense, magi_dense
from tests.test_formats_fa4 import fa4_dense

CLASSIFY = sys.modules["flexmask.builders.classify"]

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BLOCKS = st.sampled_from([1, 2, 3, 4, 8, 16, (2, 4), (4, 3), (8, 3), (16, 5)])


# ------------------------------------------------------------------------------ the oracles
def global_plain(flags: list[bool], n: int) -> np.ndarray:
    """(n, n): q attends kv iff either is global; positions past ``flags`` are not."""
    g = [bool(flags[i]) if i < len(flags) else False for i in range(n)]
    out = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for kv in range(n):
            out[q, kv] = g[q] or g[kv]
    return out


def dilated_plain(d: int, n: int) -> np.ndarray:
    out = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for kv in range(n):
            out[q, kv] = (q - kv) % d == 0
    return out


def windowed(whole_of_row, B, H, q_len, kv_len, q_off, kv_off) -> np.ndarray:
    """(B, H, Q, KV): row b's whole (n, n) mask cut at its window."""
    q_off = q_off if isinstance(q_off, list) else [q_off] * B
    kv_off = kv_off if isinstance(kv_off, list) else [kv_off] * B
    out = np.zeros((B, H, q_len, kv_len), dtype=bool)
    for b in range(B):
        n = max(q_off[b] + q_len, kv_off[b] + kv_len)
        whole = whole_of_row(b, n)
        out[b, :] = whole[q_off[b] : q_off[b] + q_len, kv_off[b] : kv_off[b] + kv_len]
    return out


def build(mask, B, H, q_len, kv_len, block, q_off=0, kv_off=0):
    return flexmask.create_block_mask(
        mask, B, H, q_len, kv_len, "cpu", block, q_offset=q_off, kv_offset=kv_off
    )


@st.composite
def flag_rows(draw, rows: int, length: int) -> list[list[bool]]:
    """``rows`` lists of flags, sparse, dense, none or all global, of any length up to
    ``length + 4`` (past the sequence: truncated)."""
    out = []
    for _ in range(rows):
        n = draw(st.integers(0, length + 4))
        kind = draw(st.sampled_from(["none", "all", "sparse", "dense", "mixed"]))
        if kind in ("none", "all"):
            out.append([kind == "all"] * n)
        else:
            p = {"sparse": 0.1, "dense": 0.8, "mixed": 0.5}[kind]
            out.append([draw(st.floats(0, 1)) < p for _ in range(n)])
    return out


@st.composite
def windows(draw, B: int, length: int):
    q_len = draw(st.integers(1, length + 8), label="q_len")
    kv_len = draw(st.integers(1, length + 8), label="kv_len")
    offsets = st.integers(0, 2 * length)
    pick = draw(st.integers(0, 2))
    if pick == 0:
        return q_len, kv_len, 0, 0
    if pick == 1:
        return q_len, kv_len, draw(offsets), draw(offsets)
    q_off = draw(st.lists(offsets, min_size=B, max_size=B))
    kv_off = draw(st.lists(offsets, min_size=B, max_size=B))
    return q_len, kv_len, q_off, kv_off


# --------------------------------------------------------------------------- global_tokens
@SETTINGS
@given(data=st.data(), B=st.integers(1, 3), H=st.integers(1, 2), length=st.integers(1, 40))
def test_global_builds_equal_torch_of_the_oracle(data, B, H, length):
    per_row = data.draw(st.booleans(), label="per_row")
    rows = data.draw(flag_rows(B if per_row else 1, length), label="flags")
    given_as = rows if per_row else rows[0]
    as_tensor = data.draw(st.booleans())
    # Tensors, bool or 0/1 ints, where the rows are as long.
    if as_tensor and (not per_row or len({len(r) for r in rows}) == 1):
        dtype = data.draw(st.sampled_from([torch.bool, torch.int32, torch.int64]))
        given_as = torch.tensor(given_as, dtype=torch.bool).to(dtype)
    piece = global_tokens(given_as, truncate=True)
    q_len, kv_len, q_off, kv_off = data.draw(windows(B, length))
    block = data.draw(BLOCKS, label="block")

    def flags(b):
        return rows[b if per_row else 0]

    g = windowed(lambda b, n: global_plain(flags(b), n), B, H, q_len, kv_len, q_off, kv_off)
    qo = np.asarray(q_off).reshape(-1, 1, 1, 1) + np.arange(q_len).reshape(1, 1, -1, 1)
    ko = np.asarray(kv_off).reshape(-1, 1, 1, 1) + np.arange(kv_len).reshape(1, 1, 1, -1)
    causal = np.broadcast_to(ko <= qo, g.shape)
    size = data.draw(st.integers(1, 12), label="window")
    window = np.broadcast_to(np.abs(qo - ko) < size, g.shape)
    diagonal = np.broadcast_to(qo == ko, g.shape)
    docs = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=6), label="docs")
    doc = windowed(lambda b, n: oracle.document(docs, n, n), B, H, q_len, kv_len, q_off, kv_off)
    win, docm = flexmask.sliding_window(size), flexmask.document(docs, truncate=True)
    shape = data.draw(st.integers(0, 5), label="shape")
    mask, ref = [
        (piece, g),
        (~piece, ~g),
        (win | piece, window | g),  # Longformer
        # packed HSTU: documents, causal, context tokens global, others attend themselves
        (
            docm & flexmask.causal() & (piece | flexmask.sliding_window(1)),
            doc & causal & (g | diagonal),
        ),
        (~(flexmask.causal() & piece), ~(causal & g)),
        (flexmask.causal() & ~piece, causal & ~g),  # global rows attend nothing
    ][shape]
    ours = build(mask, B, H, q_len, kv_len, block, q_off, kv_off)
    reference = oracle.torch_build(np.ascontiguousarray(ref), block=block)
    oracle.assert_same_block_mask(ours, reference, repr(mask))
    if q_off == 0 and kv_off == 0:
        assert np.array_equal(mask.to_dense(B, H, q_len, kv_len).numpy(), ref), repr(mask)


def test_global_is_attn_gyms_longformer():
    """``sliding_window(w + 1) | global_tokens(g)`` is attn-gym's
    ``generate_global_sliding_window(w, g)``, as torch builds it, at lengths and blocks
    that do not divide."""
    S, w = 301, 7
    gen = torch.Generator().manual_seed(0)
    is_global = torch.rand(S, generator=gen) < 0.05
    is_global[0] = True  # a CLS token
    gym = generate_global_sliding_window(w, is_global)
    mask = flexmask.sliding_window(w + 1) | global_tokens(is_global)
    for block in (128, 64, (32, 48)):
        ours = flexmask.create_block_mask(mask, 2, 3, S, S, "cpu", block)
        oracle.assert_same_block_mask(ours, oracle.torch_build(gym, 2, 3, S, S, block))


def test_global_builds_without_evaluating_an_element(monkeypatch):
    evaluated = []
    original = CLASSIFY.refine_by_evaluation

    def counting(codes, tiles, evaluate, grid):
        evaluated.append(tiles.shape[0])
        return original(codes, tiles, evaluate, grid)

    monkeypatch.setattr(CLASSIFY, "refine_by_evaluation", counting)
    flags = (torch.arange(1000) % 97 == 3).tolist()
    piece = global_tokens(flags)
    flexmask.create_block_mask(piece, 1, 1, 1000, 1000, "cpu", 128)
    flexmask.create_block_mask(~piece, 1, 1, 1000, 900, "cpu", (64, 32))
    assert evaluated == []


def test_global_mask_mod_is_the_definition_and_one_shape_per_length():
    a = global_tokens([[1, 0, 0, 1], [0, 0, 0, 0]])
    b = global_tokens([[0, 1], [1, 0]])
    mod_a, mod_b = a.mask_mod_for(50, 50), b.mask_mod_for(50, 50)
    assert mod_a.is_global.shape == mod_b.is_global.shape == (2, 51)
    rows = [[1, 0, 0, 1], [0, 0, 0, 0]]
    want = np.stack([global_plain(r, 50) for r in rows])[:, None]

    def definition(b_, h, q, kv):
        return torch.as_tensor(want)[b_, h, q, kv]

    mine = oracle.torch_build(mod_a, 2, 1, 50, 50, 16)
    oracle.assert_same_block_mask(mine, oracle.torch_build(definition, 2, 1, 50, 50, 16))


def test_global_key_validation_and_errors():
    a = global_tokens([True, False, True])
    for same in (
        global_tokens([1, 0, 1]),
        global_tokens(torch.tensor([1, 0, 1], dtype=torch.uint8)),
        global_tokens(np.array([True, False, True])),
        pickle.loads(pickle.dumps(a)),
    ):
        assert same == a and hash(same) == hash(a)
    assert a != global_tokens([1, 0, 0]) and a != global_tokens([[1, 0, 1], [1, 0, 1]])
    assert global_tokens([[1, 0], [0, 1]]).rows == 2
    with pytest.raises(ValueError, match=r"is_global\[1\] must be True/False.*got 2"):
        global_tokens([1, 2])
    with pytest.raises(ValueError, match=r"is_global\[1\]\[0\] must be True/False.*got -1"):
        global_tokens([[1], [-1]])
    with pytest.raises(TypeError, match="is_global"):
        global_tokens([0.5, 1.0])
    with pytest.raises(TypeError, match="is_global"):
        global_tokens(torch.tensor([0.0, 1.0]))
    # A global token past the sequence raises unless truncate; False past it is ignored.
    past = r"is_global marks position 5 global, past the sequence max\(Q_LEN, KV_LEN\) = 4"
    with pytest.raises(ValueError, match=past + r".*global_tokens\(\.\.\., truncate=True\)"):
        flexmask.create_block_mask(global_tokens([0] * 5 + [1]), 1, 1, 4, 4, "cpu", 2)
    flexmask.create_block_mask(global_tokens([1] + [0] * 9), 1, 1, 4, 4, "cpu", 2)
    cut = global_tokens([0] * 5 + [1], truncate=True)
    assert not cut.to_dense(1, 1, 4, 4).any()
    with pytest.raises(ValueError, match="is_global is given for 2 batch rows but B=3"):
        flexmask.create_block_mask(global_tokens([[1], [0]]), 3, 1, 4, 4, "cpu", 2)


@SETTINGS
@given(data=st.data(), batch=st.integers(1, 3), q_len=st.integers(1, 20), kv_len=st.integers(1, 20))
def test_global_formats_are_exact_or_refuse_naming_the_piece(data, batch, q_len, kv_len):
    heads = 2
    if data.draw(st.booleans()):
        kv_len = q_len
    q_off = data.draw(st.integers(0, 6)) if data.draw(st.booleans()) else 0
    kv_off = data.draw(st.integers(0, 6)) if data.draw(st.booleans()) else 0
    n = max(q_off + q_len, kv_off + kv_len)
    per_row = data.draw(st.booleans())
    rows = data.draw(flag_rows(batch if per_row else 1, n))
    piece = global_tokens(rows if per_row else rows[0], truncate=True)
    g = np.stack([global_plain(rows[b if per_row else 0], n) for b in range(batch)])
    size = data.draw(st.integers(1, 6))
    causal = np.tril(np.ones((n, n), dtype=bool))
    window = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]) < size
    mask, whole = data.draw(
        st.sampled_from(
            [
                (piece, g),
                (flexmask.sliding_window(size) | piece, window | g),
                (flexmask.causal() & piece, causal & g),
                (~piece, ~g),
                (~(flexmask.causal() & piece), ~(causal & g)),
            ]
        )
    )
    want = whole[:, q_off : q_off + q_len, kv_off : kv_off + kv_len]
    window_at = {"q_offset": q_off, "kv_offset": kv_off}
    m = to_magi(mask, batch, None, q_len, kv_len, **window_at)  # any union of intervals
    assert np.array_equal(magi_dense(m, batch, q_len, kv_len), want), repr(mask)
    try:
        f = to_flashmask(mask, batch, heads, q_len, kv_len, **window_at)
        got = flashmask_dense(f.startend_row_indices, f.causal, q_len)
        assert np.array_equal(np.broadcast_to(got, (batch, heads, q_len, kv_len))[:, 0], want)
    except ValueError as error:  # only columns of more than two masked runs
        assert "intervals" in str(error) and "global_tokens(" in str(error), error
    with pytest.raises(ValueError, match=r"global_tokens\(.*cannot be lowered to varlen"):
        to_varlen(piece & flexmask.causal(), batch, None, q_len, kv_len)
    if q_off == kv_off == 0:
        fa4 = to_fa4(mask, batch, heads, q_len, kv_len, q_block=4, kv_block=3)
        assert np.array_equal(fa4_dense(fa4, batch, heads)[:, 0], want), repr(mask)


# --------------------------------------------------------------------------------- dilated
@SETTINGS
@given(data=st.data(), B=st.integers(1, 3), H=st.integers(1, 2), length=st.integers(1, 40))
def test_dilated_builds_equal_torch_of_the_oracle(data, B, H, length):
    per_row = data.draw(st.booleans(), label="per_row")
    # 1 (full), small steps, and steps past the sequence (only the diagonal).
    step = st.one_of(st.integers(1, 5), st.integers(1, length + 50))
    steps = data.draw(st.lists(step, min_size=B if per_row else 1, max_size=B if per_row else 1))
    piece = dilated(steps if per_row else steps[0])
    q_len, kv_len, q_off, kv_off = data.draw(windows(B, length))
    block = data.draw(BLOCKS, label="block")

    def step_of(b):
        return steps[b if per_row else 0]

    d = windowed(lambda b, n: dilated_plain(step_of(b), n), B, H, q_len, kv_len, q_off, kv_off)
    qo = np.asarray(q_off).reshape(-1, 1, 1, 1) + np.arange(q_len).reshape(1, 1, -1, 1)
    ko = np.asarray(kv_off).reshape(-1, 1, 1, 1) + np.arange(kv_len).reshape(1, 1, 1, -1)
    causal = np.broadcast_to(ko <= qo, d.shape)
    size = data.draw(st.integers(1, 12), label="window")
    window = np.broadcast_to(np.abs(qo - ko) < size, d.shape)
    flags = data.draw(flag_rows(1, length), label="flags")[0]
    g = windowed(lambda b, n: global_plain(flags, n), B, H, q_len, kv_len, q_off, kv_off)
    win, gl = flexmask.sliding_window(size), global_tokens(flags, truncate=True)
    shape = data.draw(st.integers(0, 5), label="shape")
    mask, ref = [
        (piece, d),
        (~piece, ~d),
        (win & piece, window & d),  # attn-gym's dilated sliding window
        (~(flexmask.causal() & piece), ~(causal & d)),
        (flexmask.causal() & piece & gl, causal & d & g),  # rows that attend nothing
        ((win & piece) | gl, (window & d) | g),
    ][shape]
    ours = build(mask, B, H, q_len, kv_len, block, q_off, kv_off)
    reference = oracle.torch_build(np.ascontiguousarray(ref), block=block)
    oracle.assert_same_block_mask(ours, reference, repr(mask))
    if q_off == 0 and kv_off == 0:
        assert np.array_equal(mask.to_dense(B, H, q_len, kv_len).numpy(), ref), repr(mask)


def test_dilated_is_attn_gyms_dilated_sliding_window():
    S = 333
    for w, step in ((8, 2), (64, 3), (100, 7), (5, 1)):
        gym = generate_dilated_sliding_window(w, step)
        mask = flexmask.sliding_window(w + 1) & dilated(step)
        for block in (128, (32, 48)):
            ours = flexmask.create_block_mask(mask, 1, 2, S, S, "cpu", block)
            oracle.assert_same_block_mask(ours, oracle.torch_build(gym, 1, 2, S, S, block))


def test_dilated_far_windows_and_huge_steps_do_not_overflow():
    """Positions near 2**63 and a dilation near it: the classifier's arithmetic stays in
    int64 (a wrapped difference would mark blocks wrongly)."""
    big = 2**62
    for step, q_off, kv_off in ((3, big, 0), (2**63 - 1, 0, big), (5, big + 7, big), (1, 0, big)):
        q_len, kv_len = 37, 29

        def definition(b, h, q_idx, kv_idx, step=step):  # written plainly, Python ints
            return torch.remainder(q_idx - kv_idx, step) == 0

        ours = build(dilated(step), 1, 1, q_len, kv_len, (8, 4), q_off, kv_off)
        want = oracle.torch_build(
            definition, 1, 1, q_len, kv_len, (8, 4), q_offset=q_off, kv_offset=kv_off
        )
        oracle.assert_same_block_mask(ours, want, f"dilated({step}) at {q_off}, {kv_off}")


def test_dilated_builds_without_evaluating_an_element(monkeypatch):
    evaluated = []
    original = CLASSIFY.refine_by_evaluation

    def counting(codes, tiles, evaluate, grid):
        evaluated.append(tiles.shape[0])
        return original(codes, tiles, evaluate, grid)

    monkeypatch.setattr(CLASSIFY, "refine_by_evaluation", counting)
    for step in (1, 2, 300, 5000):
        flexmask.create_block_mask(dilated(step), 1, 1, 1000, 1000, "cpu", 128)
        flexmask.create_block_mask(~dilated([step, 3]), 2, 1, 1000, 900, "cpu", (1, 1))
    assert evaluated == []


def test_dilated_key_and_errors():
    assert dilated(2) == dilated(torch.tensor(2)) == pickle.loads(pickle.dumps(dilated(2)))
    assert hash(dilated(2)) == hash(dilated(np.int64(2)))
    assert dilated(2) != dilated(3) and dilated([2, 2]).rows == 2
    mod = dilated([2, 3]).mask_mod_for(10, 10)
    assert mod.dilation.shape == (2,)  # a tensor: a new step is no new Python constant
    with pytest.raises(ValueError, match=r"dilation must be >= 1, got 0"):
        dilated(0)
    with pytest.raises(ValueError, match=r"dilation\[1\] must be >= 1, got -2"):
        dilated([2, -2])
    with pytest.raises(TypeError, match="dilation"):
        dilated(1.5)
    with pytest.raises(ValueError, match="dilation is given for 2 batch rows but B=3"):
        flexmask.create_block_mask(dilated([1, 2]), 3, 1, 4, 4, "cpu", 2)


@SETTINGS
@given(data=st.data(), batch=st.integers(1, 2), q_len=st.integers(1, 16), kv_len=st.integers(1, 16))
def test_dilated_formats_refuse_naming_the_piece_or_are_exact(data, batch, q_len, kv_len):
    step = data.draw(st.integers(1, 4))
    piece = dilated(step)
    n = max(q_len, kv_len)
    size = data.draw(st.integers(1, 6))
    window = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]) < size
    d = dilated_plain(step, n)
    mask, whole = data.draw(
        st.sampled_from(
            [
                (piece, d),
                (flexmask.sliding_window(size) & piece, window & d),
                (~(flexmask.causal() & piece), ~(np.tril(np.ones((n, n), bool)) & d)),
            ]
        )
    )
    want = np.broadcast_to(whole[:q_len, :kv_len], (batch, q_len, kv_len))
    lowerings = {
        "magi": lambda: magi_dense(to_magi(mask, batch, None, q_len, kv_len), batch, q_len, kv_len),
        "flashmask": lambda: flashmask_dense(
            (f := to_flashmask(mask, batch, 1, q_len, kv_len)).startend_row_indices, f.causal, q_len
        )[:, 0],
        "varlen": None,
    }
    for fmt, lower in lowerings.items():
        if step == 1 and lower is None:  # dilation 1 constrains nothing: causal's varlen
            ours = to_varlen(piece & flexmask.causal(), batch, None, q_len, q_len)
            plain = to_varlen(flexmask.causal(), batch, None, q_len, q_len)
            assert ours.cu_seqlens_q.tolist() == plain.cu_seqlens_q.tolist()
            continue
        if step == 1:
            assert np.array_equal(np.broadcast_to(lower(), want.shape), want), (fmt, repr(mask))
            continue
        with pytest.raises(ValueError, match=rf"dilated\({step}\).*cannot be lowered to"):
            if lower is None:
                to_varlen(piece & flexmask.causal(), batch, None, q_len, kv_len)
            else:
                lower()
    fa4 = to_fa4(mask, batch, 1, q_len, kv_len, q_block=4, kv_block=3)  # blocks: any mask
    assert np.array_equal(fa4_dense(fa4, batch, 1)[:, 0], want), repr(mask)


# ------------------------------------------------------- windows far from 0, decode and CP
def test_far_windows_hold_the_data_not_the_position():
    """A window near 2**62 (``lookup_window``): the global tokens' lookup holds the data's
    positions, not 2**62 of them; every position there is past the data, not global."""
    big = 2**62
    flags = [1, 0, 0, 1, 1, 0, 1]
    mask = global_tokens(flags) | flexmask.sliding_window(3)

    def definition(b, h, q_idx, kv_idx):
        g = torch.tensor(flags + [0], dtype=torch.bool)
        q_g = g[q_idx.clamp(max=len(flags))]
        kv_g = g[kv_idx.clamp(max=len(flags))]
        return q_g | kv_g | ((q_idx - kv_idx).abs() < 3)

    for q_off, kv_off in ((big, big - 5), (big, 0), (3, big)):
        ours = build(mask, 1, 1, 20, 17, (4, 8), q_off, kv_off)
        want = oracle.torch_build(
            definition, 1, 1, 20, 17, (4, 8), q_offset=q_off, kv_offset=kv_off
        )
        oracle.assert_same_block_mask(ours, want, f"at {q_off}, {kv_off}")


def test_decode_steps_equal_torch_of_the_definition():
    """``decode_mask`` of Longformer's and the dilated window's training masks: each row's
    new queries at ``cache_lens[b]``, as torch builds the definition there."""
    cache_lens, q_len, capacity = [5, 19, 0], 3, 40
    rows = [[1, 0, 0, 0, 1, 0] + [0] * 30, [0] * 20 + [1], [0, 0, 1]]
    dense_rows = torch.as_tensor(np.stack([global_plain(r, capacity + q_len) for r in rows]))
    dil = torch.as_tensor(dilated_plain(3, capacity + q_len))
    offsets = torch.tensor(cache_lens)
    cases = [
        (
            flexmask.sliding_window(4) | global_tokens(rows),
            lambda b, q, kv: dense_rows[b, q, kv] | ((q - kv).abs() < 4),
        ),
        (
            flexmask.causal() & flexmask.sliding_window(9) & dilated([3, 3, 3]),
            lambda b, q, kv: (kv <= q) & ((q - kv).abs() < 9) & dil[q, kv],
        ),
    ]
    for mask, meaning in cases:
        ours = flexmask.decode_mask(mask, cache_lens, q_len, capacity, block_size=(2, 8))

        def definition(b, h, q_idx, kv_idx, meaning=meaning):
            return meaning(b, q_idx + offsets[b], kv_idx)

        want = oracle.torch_build(definition, 3, 1, q_len, capacity, (2, 8))
        oracle.assert_same_block_mask(ours, want, repr(mask), own_storage=False)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_shards_equal_torch_of_the_oracle(world):
    """Head-tail context-parallel shards of Longformer's mask and a dilated window: every
    rank equals torch's blocks of the dense rows under the permutation."""
    from tests.test_cp import check_against_oracle

    S = 512
    gen = torch.Generator().manual_seed(world)
    flags = (torch.rand(S, generator=gen) < 0.03).tolist()
    n = np.arange(S)
    cases = [
        (
            flexmask.sliding_window(33) | global_tokens(flags),
            global_plain(flags, S) | (np.abs(n[:, None] - n[None, :]) < 33),
        ),
        (
            flexmask.causal() & flexmask.sliding_window(65) & dilated(4),
            (n[None, :] <= n[:, None])
            & (np.abs(n[:, None] - n[None, :]) < 65)
            & dilated_plain(4, S),
        ),
    ]
    for mask, dense in cases:
        for rank in range(world):
            shard = flexmask.shard(
                mask, 1, 1, S, world_size=world, rank=rank, balancer="head_tail", BLOCK_SIZE=32
            )
            check_against_oracle(shard, dense, 1, 1)


@pytest.mark.slow
def test_compiled_flex_attention_equals_dense_attention():
    """torch.compile'd flex_attention over each piece's BlockMask and mask_mod (inductor
    traces the lookups and the remainder) equals SDPA with the oracle's dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    S, n = 300, np.arange(300)
    flags = (torch.arange(S) % 50 == 0).tolist()
    window = np.abs(n[:, None] - n[None, :]) < 33
    cases = [
        (flexmask.sliding_window(33) | global_tokens(flags), window | global_plain(flags, S)),
        (flexmask.sliding_window(33) & dilated(3), window & dilated_plain(3, S)),
    ]
    compiled = torch.compile(flex_attention)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, S, 16, generator=gen) for _ in range(3))
    for mask, dense in cases:
        bm = flexmask.create_block_mask(mask, 1, 2, S, S, "cpu")
        out = compiled(q, k, v, block_mask=bm)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.as_tensor(dense)
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=repr(mask))
