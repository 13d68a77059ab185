"""selected(indices, tile=...): the router-picked key tiles of NSA / DSA / MoBA.

Every build is compared, as whole tensors, with torch's own ``create_block_mask`` of the
plain dense oracle (``strategies.selected_dense``, loops over the definition: q attends kv
iff ``kv // kv_tile`` is among the picks of ``q // q_tile``), or of a mask_mod written here
from the same definition — over B and H > 1 with every index layout, tiles equal to, a
multiple of, a divisor of and unrelated to the block, lengths that are not block multiples,
windows at offsets (per row too), rows that attend nothing, negations and compositions with
causal, documents and sliding windows. The lowerings are read back through each format's
own documented meaning (``test_formats``' decoders) and compared with the same oracle."""

from __future__ import annotations

import io
import itertools
import pickle
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.formats import to_fa4, to_flashmask, to_magi, to_varlen
from tests import oracle
from tests.strategies import leaves, selected_dense, selected_picks
from tests.test_formats import flashmask_dense, magi_dense
from tests.test_formats_fa4 import fa4_dense

CLASSIFY = sys.modules["flexmask.builders.classify"]

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BLOCKS = st.sampled_from([1, 2, 3, 4, 8, 16, (2, 4), (4, 3), (8, 3), (16, 5)])


def dense(picks4, q_tile, kv_tile, B, H, q_len, kv_len, q_off=0, kv_off=0) -> np.ndarray:
    """(B, H, Q, KV) oracle of ``(R, Hd, n, k)`` picks (R, Hd 1 or B, H) at a window."""
    q_off = q_off if isinstance(q_off, list) else [q_off] * B
    kv_off = kv_off if isinstance(kv_off, list) else [kv_off] * B
    out = np.zeros((B, H, q_len, kv_len), dtype=bool)
    for b in range(B):
        n = max(q_off[b] + q_len, kv_off[b] + kv_len)
        for h in range(H):
            rows = picks4[b % picks4.shape[0], h % picks4.shape[1]].tolist()
            whole = selected_dense(rows, q_tile, kv_tile, n, n)
            out[b, h] = whole[q_off[b] : q_off[b] + q_len, kv_off[b] : kv_off[b] + kv_len]
    return out


def plain_window(size, n):
    q, kv = np.arange(n)[:, None], np.arange(n)[None, :]
    return np.abs(q - kv) < size


def build(mask, B, H, q_len, kv_len, block, q_off=0, kv_off=0):
    return flexmask.create_block_mask(
        mask, B, H, q_len, kv_len, "cpu", block, q_offset=q_off, kv_offset=kv_off
    )


@st.composite
def cases(draw):
    """A selected piece in one of the three layouts (size-1 dimensions included), its
    (R, Hd, n, k) picks, B, H, lengths, block and offsets."""
    B = draw(st.integers(1, 3), label="B")
    H = draw(st.integers(1, 3), label="H")
    length = draw(st.integers(1, 60), label="length")
    layout = draw(st.sampled_from(["shared", "rows", "rows_heads", "one_row", "one_head"]))
    rows = B if layout in ("rows", "rows_heads", "one_head") else 1
    heads = H if layout == "rows_heads" else 1
    picks, tile = draw(selected_picks(rows * heads, length))
    picks4 = picks.view(rows, heads, *picks.shape[1:])
    given_as = {
        "shared": picks4[0, 0],
        "rows": picks4[:, 0],
        "one_row": picks4[:, 0],  # [1, n, k]: shared, as torch broadcasts B=1
        "rows_heads": picks4,
        "one_head": picks4,  # [B, 1, n, k]
    }[layout]
    if draw(st.booleans()):  # any integer dtype
        given_as = given_as.to(draw(st.sampled_from([torch.int32, torch.int16])))
    mask = flexmask.selected(given_as, tile=tile, truncate=True)
    q_len = draw(st.integers(1, length + 8), label="q_len")
    kv_len = draw(st.integers(1, length + 8), label="kv_len")
    block = draw(BLOCKS, label="block")
    offsets = st.integers(0, 2 * length)
    if draw(st.booleans()):
        q_off, kv_off = 0, 0
    elif draw(st.booleans()):
        q_off, kv_off = draw(offsets), draw(offsets)
    else:
        q_off = draw(st.lists(offsets, min_size=B, max_size=B))
        kv_off = draw(st.lists(offsets, min_size=B, max_size=B))
    return mask, picks4, tile, B, H, q_len, kv_len, block, q_off, kv_off


@SETTINGS
@given(case=cases(), shape=st.integers(0, 6), data=st.data())
def test_builds_equal_torch_of_the_oracle(case, shape, data):
    mask, picks4, (qt, kt), B, H, q_len, kv_len, block, q_off, kv_off = case
    sel = dense(picks4, qt, kt, B, H, q_len, kv_len, q_off, kv_off)
    n = max(np.max(q_off) + q_len, np.max(kv_off) + kv_len)
    qo = np.asarray(q_off).reshape(-1, 1, 1, 1) + np.arange(q_len).reshape(1, 1, -1, 1)
    ko = np.asarray(kv_off).reshape(-1, 1, 1, 1) + np.arange(kv_len).reshape(1, 1, 1, -1)
    causal = np.broadcast_to(ko <= qo, sel.shape)
    size = data.draw(st.integers(1, 12), label="window")
    window = np.broadcast_to(np.abs(qo - ko) < size, sel.shape)
    docs = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=6), label="docs")
    doc_dense = oracle.document(docs, n, n)
    doc = np.stack(
        [
            doc_dense[np.asarray(q_off).reshape(-1)[b % np.size(q_off)] + np.arange(q_len)][
                :, np.asarray(kv_off).reshape(-1)[b % np.size(kv_off)] + np.arange(kv_len)
            ]
            for b in range(B)
        ]
    )[:, None]
    doc = np.broadcast_to(doc, sel.shape)
    win = flexmask.sliding_window(size)
    docm = flexmask.document(docs, truncate=True)
    mask, ref = [
        (mask, sel),
        (~mask, ~sel),
        (flexmask.causal() & mask, causal & sel),
        (win | mask, window | sel),
        (flexmask.causal() & (mask | win), causal & (sel | window)),  # NSA's two branches
        (~(flexmask.causal() & mask), ~(causal & sel)),
        (docm & ~mask & flexmask.causal(), doc & ~sel & causal),
    ][shape]
    ours = build(mask, B, H, q_len, kv_len, block, q_off, kv_off)
    reference = oracle.torch_build(np.ascontiguousarray(ref), block=block)
    oracle.assert_same_block_mask(ours, reference, repr(mask))
    if q_off == 0 and kv_off == 0:
        assert np.array_equal(mask.to_dense(B, H, q_len, kv_len).numpy(), ref), repr(mask)


# ------------------------------------------------------------- tiles against blocks, at size
def nsa_picks(B, H, n_q, n_kv, k, seed):
    """Causal top-k picks per row and head, as an NSA router makes them: the query's own
    tile always, k - 1 earlier ones (or -1 where there are fewer), shuffled."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((B, H, n_q, k), -1, dtype=torch.int64)
    for i in range(n_q):
        earlier = min(i, n_kv - 1)
        for b in range(B):
            for h in range(H):
                chosen = torch.randperm(earlier + 1, generator=gen)[:k].tolist()
                if i < n_kv and i not in chosen:
                    chosen[-1] = i
                out[b, h, i, : len(chosen)] = torch.tensor(chosen)
    return out


@pytest.mark.parametrize(
    ("tile", "block"),
    [
        (64, 64),  # NSA at torch's kernel tile
        (64, 128),  # two tiles per block
        (128, 64),  # two blocks per tile
        ((64, 32), (128, 128)),
        (48, 128),  # neither divides the other
        (100, (64, 128)),
        (1, 16),  # DSA: single keys
    ],
)
def test_tile_and_block_sizes_equal_torch_of_the_definition(tile, block):
    B, H, q_len, kv_len = 2, 3, 777, 700  # no length a multiple of any block or tile
    q_tile, kv_tile = tile if isinstance(tile, tuple) else (tile, tile)
    n_q, n_kv = -(-q_len // q_tile), -(-kv_len // kv_tile)
    picks = nsa_picks(B, H, n_q, n_kv, 3, seed=q_tile * 7 + kv_tile)
    table = torch.zeros(B, H, n_q + 1, n_kv + 1, dtype=torch.bool)
    for b, h, i, s in itertools.product(range(B), range(H), range(n_q), range(3)):
        if picks[b, h, i, s] >= 0:
            table[b, h, i, picks[b, h, i, s]] = True

    def definition(b, h, q_idx, kv_idx):  # written from the docstring, not from flexmask
        return table[b, h, q_idx // q_tile, kv_idx // kv_tile]

    def nsa(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (definition(b, h, q_idx, kv_idx) | (q_idx - kv_idx < 100))

    piece = flexmask.selected(picks, tile=tile)
    for mask, mod in (
        (piece, definition),
        (flexmask.causal() & (piece | flexmask.sliding_window(100)), nsa),
    ):
        ours = flexmask.create_block_mask(mask, B, H, q_len, kv_len, "cpu", block)
        reference = oracle.torch_build(mod, B, H, q_len, kv_len, block)
        oracle.assert_same_block_mask(ours, reference, repr(mask))
    # The piece's own mask_mod, as torch builds it, is the definition too.
    mine = oracle.torch_build(piece.mask_mod_for(q_len, kv_len), B, H, q_len, kv_len, block)
    oracle.assert_same_block_mask(mine, oracle.torch_build(definition, B, H, q_len, kv_len, block))


def test_builds_from_the_picks_without_evaluating_an_element(monkeypatch):
    """A bare piece decides every block from its picks; under causal() only the diagonal
    blocks both leave partial are evaluated."""
    evaluated = []
    original = CLASSIFY.refine_by_evaluation

    def counting(codes, tiles, evaluate, grid):
        evaluated.append(tiles.shape[0])
        return original(codes, tiles, evaluate, grid)

    monkeypatch.setattr(CLASSIFY, "refine_by_evaluation", counting)
    picks = nsa_picks(1, 2, 16, 16, 4, seed=1)
    piece = flexmask.selected(picks, tile=64)
    flexmask.create_block_mask(piece, 1, 2, 1024, 1024, "cpu", 128)
    flexmask.create_block_mask(~piece, 1, 2, 1024, 1024, "cpu", (64, 32))
    assert evaluated == []
    flexmask.create_block_mask(flexmask.causal() & piece, 1, 2, 1024, 1024, "cpu", 128)
    assert 0 < sum(evaluated) <= 2 * 8  # at most the 8 diagonal blocks of each head
    report = flexmask.explain_build(piece, 1, 2, 1024, 1024, "cpu", 128)
    assert report.path == "tiles" and report.route.refined == 0


# ------------------------------------------------------------------------ layouts and data
def test_layouts_broadcast_as_torch_does():
    picks = nsa_picks(2, 3, 5, 5, 2, seed=3)
    shared = flexmask.selected(picks[0, 0], tile=4)
    assert shared == flexmask.selected(picks[:1, 0], tile=4)  # [1, n, k]: every row
    assert shared == flexmask.selected(picks[:1, :1], tile=4)  # [1, 1, n, k]
    assert shared.rows is None and not shared.head_dependent
    rows = flexmask.selected(picks[:, 0], tile=4)
    assert rows.rows == 2 and rows.batch_dependent and not rows.head_dependent
    heads = flexmask.selected(picks, tile=4)
    assert heads.rows == 2 and heads.head_dependent and heads.head_cycle == 3
    want = dense(picks, 4, 4, 2, 3, 20, 20)
    assert np.array_equal(heads.to_dense(2, 3, 20, 20).numpy(), want)
    assert np.array_equal(heads.at_head(1).to_dense(2, 1, 20, 20).numpy(), want[:, 1:2])
    # One head's picks broadcast over H, one row's over B.
    assert np.array_equal(
        flexmask.selected(picks[:, :1], tile=4).to_dense(2, 3, 20, 20).numpy(),
        np.broadcast_to(want[:, :1], want.shape),
    )
    with pytest.raises(ValueError, match=r"picks for 3 heads but H=2.*repeat_interleave"):
        flexmask.create_block_mask(heads, 2, 2, 20, 20, "cpu", 4)
    with pytest.raises(ValueError, match="indices is given for 2 batch rows but B=3"):
        flexmask.create_block_mask(rows, 3, 1, 20, 20, "cpu", 4)
    # Lists, arrays and every integer dtype read alike.
    as_list = flexmask.selected(picks[0, 0].tolist(), tile=4)
    assert as_list == shared == flexmask.selected(picks[0, 0].numpy().astype(np.int8), tile=4)


def test_content_key_is_the_picks_not_their_spelling():
    a = flexmask.selected([[0, 1, -1], [2, 2, 0]], tile=8)
    same = [
        flexmask.selected([[1, 0, 0], [0, 2, -1]], tile=(8, 8)),  # order, repeats
        flexmask.selected([[0, 1], [0, 2], [-1, -1], [-1, -1]], tile=8),  # padding
        flexmask.selected(torch.tensor([[[1, -1, 0, -1], [2, 0, -1, -1]]]), tile=8),
    ]
    for other in same:
        assert other == a and hash(other) == hash(a)
    for other in (
        flexmask.selected([[0, 1], [2, 1]], tile=8),
        flexmask.selected([[0, 1], [0, 2]], tile=(8, 4)),
        flexmask.selected([[0, 1], [0, 2]], tile=16),
        flexmask.selected([[[0, 1], [0, 2]], [[0, 1], [0, 2]]], tile=8),  # per row
    ):
        assert other != a
    # Structural equality goes through the operators, and the cache hits on it.
    assert flexmask.causal() & a == same[0] & flexmask.causal()
    cache = flexmask.MaskCache()
    first = cache.get(a, 1, 1, 64, 64, device="cpu")
    assert cache.get(same[1], 1, 1, 64, 64, device="cpu") is first


def test_pickles_and_saves_with_safe_globals():
    mask = flexmask.causal() & flexmask.selected(nsa_picks(2, 2, 4, 4, 2, seed=5), tile=16)
    assert pickle.loads(pickle.dumps(mask)) == mask
    bm = flexmask.create_block_mask(mask, 2, 2, 64, 64, "cpu", 16)
    buffer = io.BytesIO()
    torch.save(bm, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(flexmask.safe_globals()):
        loaded = torch.load(buffer)
    assert flexmask.same_blocks(loaded, bm)
    q, kv = torch.arange(64).view(-1, 1), torch.arange(64).view(1, -1)
    b, h = torch.tensor(1), torch.tensor(1)
    assert torch.equal(loaded.mask_mod(b, h, q, kv), bm.mask_mod(b, h, q, kv))


def test_rows_that_attend_nothing_and_data_past_the_sequence():
    picks = [[-1, -1], [1, -1], [-1, -1]]
    mask = flexmask.selected(picks, tile=4)
    want = np.zeros((12, 12), dtype=bool)
    want[4:8, 4:8] = True
    assert np.array_equal(mask.to_dense(1, 1, 12, 12)[0, 0].numpy(), want)
    bm = flexmask.create_block_mask(mask, 1, 1, 12, 12, "cpu", 4)
    assert bm.kv_num_blocks.tolist() == [[[0, 0, 0]]]  # partial: none; full: one
    assert bm.full_kv_num_blocks.tolist() == [[[0, 1, 0]]]
    # A pick of key tile 3 (positions 12..15) is past a sequence of 12: it raises, naming
    # the tile and the tiles the sequence has, unless truncate drops it.
    far = [[3], [1]]
    with pytest.raises(ValueError, match=r"picks key tile 3 \(positions from 12\).*3 key tiles"):
        flexmask.create_block_mask(flexmask.selected(far, tile=4), 1, 1, 12, 12, "cpu", 4)
    with pytest.raises(ValueError, match=r"holds picks for query tile 3 \(positions from 12\)"):
        flexmask.selected([[0]] * 4, tile=4).to_dense(1, 1, 12, 12)
    cut = flexmask.selected(far, tile=4, truncate=True).to_dense(1, 1, 12, 12)
    assert np.array_equal(cut.numpy()[0, 0], selected_dense([[-1], [1]], 4, 4, 12, 12))
    # Picks for query tiles that pick nothing never reach past the sequence.
    assert flexmask.selected([[0], [-1], [-1], [-1]], tile=4).to_dense(1, 1, 5, 5).any()
    # A window reaches as far as its offsets: the same picks are inside it.
    bm = flexmask.create_block_mask(
        flexmask.selected(far, tile=4), 1, 1, 4, 4, "cpu", 4, q_offset=0, kv_offset=12
    )
    assert bm.full_kv_num_blocks.tolist() == [[[1]]]


@pytest.mark.parametrize(
    ("indices", "tile", "error", "match"),
    [
        ([[0.0, 1.0]], 4, TypeError, "indices must hold integer key tile numbers.*float"),
        (torch.ones(2, 2, dtype=torch.bool), 4, TypeError, "got dtype torch.bool"),
        ([0, 1, 2], 4, ValueError, r"shape \[n_q_tiles, k\].*got shape \(3,\)"),
        (torch.zeros(1, 1, 1, 1, 1, dtype=torch.int64), 4, ValueError, "got shape"),
        ([[0, 1], [2, -2]], 4, ValueError, r"indices\[1, 1\] = -2: .*-1 for no pick"),
        (torch.tensor([[[0], [-3]]]), 4, ValueError, r"indices\[0, 1, 0\] = -3"),
        ([[0, 1], [2]], 4, TypeError, "nested lists of ints"),
        (torch.zeros(0, 2, 3, dtype=torch.int64), 4, ValueError, "hold no batch row or head"),
        ([[0]], 0, ValueError, "tile must be >= 1"),
        ([[0]], (4, 0), ValueError, r"tile\[1\] must be >= 1"),
        ([[0]], (1, 2, 3), ValueError, r"a \(q_tile, kv_tile\) pair"),
        ([[0]], 2.0, TypeError, "tile must be an int"),
        ([[2**62]], 4, ValueError, "do not fit in int64"),
        (torch.zeros(2, 2, dtype=torch.int64, device="meta"), 4, ValueError, "meta tensor"),
    ],
)
def test_bad_input_names_the_argument(indices, tile, error, match):
    with pytest.raises(error, match=match):
        flexmask.selected(indices, tile=tile)


def test_empty_picks_attend_nothing():
    for indices in ([[]], torch.zeros(3, 0, dtype=torch.int64), [[-1, -1]]):
        mask = flexmask.selected(indices, tile=2)
        assert mask == flexmask.selected(torch.full((5, 2), -1), tile=2)
        assert not mask.to_dense(1, 1, 9, 9).any()
        bm = flexmask.create_block_mask(mask | flexmask.causal(), 1, 1, 9, 9, "cpu", 4)
        oracle.assert_same_block_mask(
            bm, oracle.torch_build(oracle.stack([oracle.causal(9, 9)]), block=4)
        )


# ----------------------------------------------------------------- the mask_mod it runs
def test_mask_mod_is_a_table_lookup_of_fixed_shape():
    """No interval form (k runs of data per query); a lookup sized by the length alone, so
    the next batch of picks at this length is the same program with the same shapes."""
    a = flexmask.selected(nsa_picks(2, 4, 8, 8, 2, seed=7), tile=64)
    b = flexmask.selected(nsa_picks(2, 4, 3, 2, 1, seed=8), tile=64)
    assert a.interval_form() is None and (flexmask.causal() & a).interval_form() is None
    mod_a, mod_b = a.mask_mod_for(500, 500), b.mask_mod_for(500, 500)
    assert type(mod_a).__name__ == "SelectedMod"
    assert mod_a.table.shape == mod_b.table.shape == (2, 4, 9, 9)
    assert mod_a.q_tile.dim() == 0  # a tensor: a new tile size is no new Python constant
    # torch's own build vmaps it (no .item(), no branch on a tensor).
    bm = flexmask.create_block_mask(a, 2, 4, 500, 500, "cpu", 128)
    oracle.assert_same_block_mask(bm, oracle.torch_build(mod_a, 2, 4, 500, 500, 128))


# ------------------------------------------------------------------------------ lowerings
@SETTINGS
@given(data=st.data(), batch=st.integers(1, 3), q_len=st.integers(1, 20), kv_len=st.integers(1, 20))
def test_formats_are_exact_or_refuse_naming_the_piece(data, batch, q_len, kv_len):
    heads = 2
    if data.draw(st.booleans()):
        kv_len = q_len
    q_off = data.draw(st.integers(0, 6)) if data.draw(st.booleans()) else 0
    kv_off = data.draw(st.integers(0, 6)) if data.draw(st.booleans()) else 0
    n = max(q_off + q_len, kv_off + kv_len)
    piece, piece_ref = data.draw(leaves(batch, n, ("selected",)))
    other, other_ref = data.draw(leaves(batch, n, ("causal", "window", "document", "prefix")))
    combine = data.draw(st.sampled_from(["alone", "and", "or", "not", "not_and"]))
    mask, ref = {
        "alone": (piece, piece_ref),
        "and": (other & piece, lambda q, kv: other_ref(q, kv) & piece_ref(q, kv)),
        "or": (other | piece, lambda q, kv: other_ref(q, kv) | piece_ref(q, kv)),
        "not": (~piece, lambda q, kv: ~piece_ref(q, kv)),
        "not_and": (~(other & piece), lambda q, kv: ~(other_ref(q, kv) & piece_ref(q, kv))),
    }[combine]
    want = ref(n, n)[:, q_off : q_off + q_len, kv_off : kv_off + kv_len]  # (B, Q, KV)
    window = {"q_offset": q_off, "kv_offset": kv_off}
    try:
        m = to_magi(mask, batch, None, q_len, kv_len, **window)
        assert np.array_equal(magi_dense(m, batch, q_len, kv_len), want), repr(mask)
    except ValueError as error:  # Magi takes any union of intervals: never refused
        raise AssertionError(f"{mask!r}: {error}") from error
    try:
        f = to_flashmask(mask, batch, heads, q_len, kv_len, **window)
        got = flashmask_dense(f.startend_row_indices, f.causal, q_len)
        assert np.array_equal(np.broadcast_to(got, (batch, heads, q_len, kv_len))[:, 0], want)
    except ValueError as error:  # only columns of more than two masked runs
        assert "intervals" in str(error) and "selected(" in str(error), error
    with pytest.raises(ValueError, match=r"selected\(.*cannot be lowered to varlen"):
        to_varlen(piece & flexmask.causal(), batch, None, q_len, kv_len)
    if q_off == kv_off == 0:
        fa4 = to_fa4(mask, batch, heads, q_len, kv_len, q_block=4, kv_block=3)
        assert np.array_equal(fa4_dense(fa4, batch, heads)[:, 0], want), repr(mask)


def test_per_head_picks_lower_per_head_or_refuse():
    picks = nsa_picks(1, 2, 4, 4, 2, seed=11)
    mask = flexmask.causal() & flexmask.selected(picks, tile=3)
    want = mask.to_dense(1, 2, 12, 12).numpy()
    f = to_flashmask(mask, 1, 2, 12, 12)  # per-head columns
    assert f.startend_row_indices.shape[1] == 2
    assert np.array_equal(flashmask_dense(f.startend_row_indices, f.causal, 12), want)
    fa4 = to_fa4(mask, 1, 2, 12, 12, q_block=4, kv_block=4)
    assert np.array_equal(fa4_dense(fa4, 1, 2), want)
    with pytest.raises(ValueError, match=r"selected\(<2 heads.*heads attend differently"):
        to_magi(mask, 1, 2, 12, 12)
    # Each head on its own lowers (at_head).
    for h in range(2):
        m = to_magi(mask.at_head(h), 1, 1, 12, 12)
        assert np.array_equal(magi_dense(m, 1, 12, 12)[0], want[0, h])


# ---------------------------------------------------------------- per_head, CP, lazy
def test_inside_per_head_and_grouped_heads():
    picks = nsa_picks(2, 1, 6, 6, 2, seed=13)[:, 0]
    piece = flexmask.selected(picks, tile=16)
    mask = flexmask.per_head(flexmask.causal() & piece, flexmask.sliding_window(20))
    sel = dense(picks[:, None], 16, 16, 2, 1, 90, 90)[:, 0]
    q, kv = np.arange(90)[:, None], np.arange(90)[None, :]
    want = np.stack([(kv <= q) & sel, np.broadcast_to(np.abs(q - kv) < 20, sel.shape)], 1)
    want = np.concatenate([want, want], 1)  # H = 4
    bm = flexmask.create_block_mask(mask, 2, 4, 90, 90, "cpu", (32, 16))
    oracle.assert_same_block_mask(bm, oracle.torch_build(want, block=(32, 16)))


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_shards_equal_torch_of_the_oracle(world):
    from flexmask.context_parallel import HeadTailBalancer
    from tests.test_cp import check_against_oracle

    S = 512
    picks = nsa_picks(1, 1, S // 64, S // 64, 3, seed=world)[0, 0]
    mask = flexmask.causal() & (flexmask.selected(picks, tile=64) | flexmask.sliding_window(40))
    q, kv = np.arange(S)[:, None], np.arange(S)[None, :]
    rows = selected_dense(picks.tolist(), 64, 64, S, S)
    whole = (kv <= q) & (rows | (np.abs(q - kv) < 40))
    for rank in range(world):
        for balancer in (HeadTailBalancer(S, world), None):
            shard = flexmask.shard(mask, 1, 2, S, world_size=world, rank=rank, balancer=balancer)
            check_against_oracle(shard, whole, 1, 2)


def test_lazy_handle_and_decode_window():
    picks = nsa_picks(1, 1, 8, 8, 2, seed=17)[0, 0]
    mask = flexmask.causal() & flexmask.selected(picks, tile=32)
    handle = flexmask.lazy(mask, 1, 1, 256, 256, device="cpu")
    assert flexmask.same_blocks(
        handle.block_mask, flexmask.create_block_mask(mask, 1, 1, 256, 256, "cpu")
    )
    # A decode step: one query at the end of the keys, a window at an offset.
    want = selected_dense(picks.tolist(), 32, 32, 256, 256) & oracle.causal(256, 256)
    for pos in (31, 32, 200, 255):
        bm = flexmask.create_block_mask(mask, 1, 1, 1, 256, "cpu", 16, q_offset=pos)
        ref = oracle.torch_build(oracle.stack([want[pos : pos + 1]]), block=16)
        oracle.assert_same_block_mask(bm, ref, f"decode at {pos}")


# --------------------------------------------------------------------- compiled, on CPU
@pytest.mark.slow
def test_compiled_flex_attention_equals_the_reference_attention():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    B, H, S, D = 1, 2, 256, 16
    picks = nsa_picks(B, H, S // 64, S // 64, 2, seed=19)
    mask = flexmask.causal() & (flexmask.selected(picks, tile=64) | flexmask.sliding_window(32))
    bm = flexmask.create_block_mask(mask, B, H, S, S, "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(3))
    out = torch.compile(flex_attention)(q, k, v, block_mask=bm)
    want, _ = oracle.attention(q, k, v, mask.to_dense(B, H, S, S))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tile", [1, 2, 4, (2, 4), 3])
@pytest.mark.parametrize(("q_len", "kv_len"), [(19, 21), (21, 19), (16, 13)])
def test_incomplete_edge_blocks_under_negation(tile, q_len, kv_len):
    """The last block runs past the lengths and spans fewer tiles than the others: picked
    over its in-range part it is full there, so ``~`` empties it (torch lists it nowhere)."""
    q_tile, kv_tile = tile if isinstance(tile, tuple) else (tile, tile)
    n_q, n_kv = -(-q_len // q_tile), -(-kv_len // kv_tile)
    every = torch.arange(n_kv).expand(n_q, n_kv)
    some = torch.where(torch.arange(n_kv) % 3 == 1, -1, every)
    for picks in (every, some):
        mask = flexmask.selected(picks, tile=tile, truncate=True)
        ref = dense(picks[None, None], q_tile, kv_tile, 1, 1, q_len, kv_len)
        for m, r in ((mask, ref), (~mask, ~ref)):
            ours = flexmask.create_block_mask(m, 1, 1, q_len, kv_len, "cpu", 8)
            oracle.assert_same_block_mask(ours, oracle.torch_build(r, block=8), repr(m))


@pytest.mark.parametrize("backend", ["auto", "block_sparse", "sdpa"])
def test_attention_equals_the_reference_attention(backend, monkeypatch):
    monkeypatch.setenv("FLEXMASK_COMPILE", "0")
    B, H, S, D = 2, 3, 100, 8
    gen = torch.Generator().manual_seed(23)
    for picks in (torch.randint(-1, 7, (7, 3), generator=gen), nsa_picks(B, H, 7, 7, 3, seed=2)):
        piece = flexmask.selected(picks, tile=16)
        mask = flexmask.causal() & (piece | flexmask.sliding_window(5))
        q, k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(3))
        picks4 = picks.view(1, 1, 7, 3) if picks.dim() == 2 else picks
        sel = dense(picks4, 16, 16, B, H, S, S)
        allowed = oracle.causal(S, S) & (sel | plain_window(5, S))
        want, _ = oracle.attention(q, k, v, torch.from_numpy(allowed))
        out = flexmask.attention(q, k, v, mask, backend=backend)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_long_lowerings_read_by_stretches_equal_the_oracle():
    """Past 2**15 lines a lowering reads a few lines per stretch between the pieces'
    ``line_breaks`` (every line of one tile attends alike): the same answer as every line."""
    S, tile = 33_000, 1000  # tiles and blocks cut the sequence unevenly
    picks = nsa_picks(1, 1, -(-S // tile), -(-S // tile), 3, seed=29)[0, 0]
    mask = flexmask.causal() & (flexmask.selected(picks, tile=tile) | flexmask.sliding_window(300))
    m = to_magi(mask, 1, 1, S, S)
    # Magi's slices, read back per query tile: each of its lines against the definition.
    q_ranges, k_ranges, kinds = m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist()
    for q in (0, 999, 1000, 1001, 17_500, S - 8, S - 7, S - 1):
        row = selected_dense([picks[q // tile].tolist()], tile, tile, 1, S)[0]
        want = (row | (np.abs(q - np.arange(S)) < 300)) & (np.arange(S) <= q)
        got = np.zeros(S, dtype=bool)
        for (qs, qe), (ks, ke), kind in zip(q_ranges, k_ranges, kinds, strict=True):
            if qs <= q < qe:
                cols = np.arange(ks, ke)
                keep = {0: True, 1: cols <= q + (ke - qe), 2: cols >= q + (ks - qs)}.get(
                    kind, (cols <= q + (ke - qe)) & (cols >= q + (ks - qs))
                )
                got[cols[np.broadcast_to(keep, cols.shape)]] = True
        assert np.array_equal(got, want), q
