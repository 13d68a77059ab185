"""sliding_window(size, positions=...): a window measured in given positions (a tree's depths,
a packed batch's position ids). Every build equals torch's create_block_mask of a dense oracle
written here (``|pos[q] - pos[kv]| < size``), alone and in compounds (& causal, & tree, |, ~),
over B > 1, per-row sizes and positions, lengths that are not block multiples, block sizes
16..128 and pairs, and windows at offsets; in a packed tree it is each sequence's own window."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.formats import to_magi, to_varlen
from flexmask.packing import pack_tree_batch
from flexmask.pieces import PositionWindow
from tests import oracle

BLOCKS = [16, 32, 128, (16, 64), (64, 16)]


def dense_window(positions, sizes, q_len, kv_len, q_off=0, kv_off=0, keys_ahead=False):
    """(B, 1, Q, KV) ``|pos[q] - pos[kv]| < size`` (``pos[q] - pos[kv] < size`` with
    ``keys_ahead``) at whole-mask positions q_off + q, ..., written from the definition: one
    row of positions and one size per batch row."""
    out = []
    for pos, size in zip(positions, sizes, strict=True):
        pos = np.asarray(pos, dtype=np.int64)
        q = pos[q_off : q_off + q_len][:, None]
        kv = pos[kv_off : kv_off + kv_len][None, :]
        out.append((q - kv < size) if keys_ahead else (np.abs(q - kv) < size))
    return np.stack(out)[:, None]


def depths(parents):
    """Each node's depth (its distance from its root), by walking up."""
    out = []
    for node in range(len(parents)):
        d, up = 0, parents[node]
        while up != -1:
            d, up = d + 1, parents[up]
        out.append(d)
    return out


def build(mask, B, q_len, kv_len, block, **offsets):
    return flexmask.create_block_mask(mask, B, 1, q_len, kv_len, "cpu", block, **offsets)


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    q_len = draw(st.integers(1, 200))
    kv_len = draw(st.integers(1, 200))
    q_off = draw(st.integers(0, 40))
    kv_off = draw(st.integers(0, 40))
    n = max(q_off + q_len, kv_off + kv_len) + draw(st.integers(0, 5))
    kind = draw(st.sampled_from(["walk", "random", "tree depths", "document positions"]))
    rows = []
    for _ in range(B):
        if kind == "walk":  # steps of -1..1: tiles whose positions skip no integer
            steps = draw(st.lists(st.integers(-1, 1), min_size=n - 1, max_size=n - 1))
            row = np.cumsum([draw(st.integers(0, 50)), *steps])
            row = row - min(0, int(row.min()))
        elif kind == "random":  # tiles whose ranges overlap with no pair close enough
            spread = draw(st.sampled_from([3, 30, 300, 3000]))
            row = np.random.default_rng(draw(st.integers(0, 2**32))).integers(0, spread, n)
        elif kind == "tree depths":
            parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
            row = depths(parents)
        else:
            row, left = [], n
            while left:
                length = min(left, draw(st.integers(1, 60)))
                row += list(range(length))
                left -= length
        rows.append([int(v) for v in row])
    per_row_positions = B > 1 and draw(st.booleans())
    per_row_sizes = B > 1 and draw(st.booleans())
    size = st.one_of(st.integers(0, 4), st.integers(0, 90))
    sizes = [draw(size) for _ in range(B)] if per_row_sizes else [draw(size)] * B
    if not per_row_positions:
        rows = [rows[0]] * B
    positions = torch.tensor(rows) if per_row_positions else rows[0]
    size = sizes if per_row_sizes else sizes[0]
    block = draw(st.sampled_from(BLOCKS))
    keys_ahead = draw(st.booleans())
    return dict(
        keys_ahead=keys_ahead,
        B=B, q_len=q_len, kv_len=kv_len, q_off=q_off, kv_off=kv_off, rows=rows, sizes=sizes,
        positions=positions, size=size, block=block,
    )  # fmt: skip


def window_of(case):
    """The piece a case draws: sliding_window(size, positions=...), or its one-sided form."""
    if case["keys_ahead"]:
        return PositionWindow(case["size"], case["positions"], keys_ahead=True)
    return flexmask.sliding_window(case["size"], positions=case["positions"])


@settings(max_examples=60, deadline=None)
@given(cases())
def test_the_block_mask_is_torchs_of_the_dense_oracle(case):
    mask = window_of(case)
    offsets = dict(q_offset=case["q_off"], kv_offset=case["kv_off"])
    want = dense_window(
        case["rows"],
        case["sizes"],
        case["q_len"],
        case["kv_len"],
        case["q_off"],
        case["kv_off"],
        keys_ahead=case["keys_ahead"],
    )
    args = (case["B"], case["q_len"], case["kv_len"], case["block"])
    ours = build(mask, *args, **offsets)
    oracle.assert_same_block_mask(ours, oracle.torch_build(want, *args[:1], 1, *args[1:]))
    if case["q_off"] == case["kv_off"] == 0:
        got = mask.to_dense(case["B"], 1, case["q_len"], case["kv_len"]).numpy()
        np.testing.assert_array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(cases(), st.sampled_from(["& causal", "| causal", "~", "~(& causal)", "& document"]))
def test_compounds_equal_torchs_build_of_their_dense_oracle(case, how):
    B, q_len, kv_len, block = case["B"], case["q_len"], case["kv_len"], case["block"]
    window = window_of(case)
    dense = dense_window(case["rows"], case["sizes"], q_len, kv_len, keys_ahead=case["keys_ahead"])
    below = np.tril(np.ones((q_len, kv_len), dtype=bool))
    docs = [37, 50, 41, 200]
    if how == "& causal":
        mask, want = flexmask.causal() & window, dense & below
    elif how == "| causal":
        mask, want = flexmask.causal() | window, dense | below
    elif how == "~":
        mask, want = ~window, ~dense
    elif how == "~(& causal)":
        mask, want = ~(flexmask.causal() & window), ~(dense & below)
    else:
        mask = window & flexmask.document(docs, truncate=True)
        want = dense & oracle.document(docs, q_len, kv_len)
    ours = build(mask, B, q_len, kv_len, block)
    oracle.assert_same_block_mask(ours, oracle.torch_build(want, B, 1, q_len, kv_len, block), how)


@pytest.mark.parametrize("size", [1, 2, 5])
def test_tiles_whose_ranges_meet_but_no_pair_does_are_empty(size):
    """Random positions: most tiles' ranges overlap while no pair of theirs lies within a
    small window; such a tile is empty (torch lists no block), not partial."""
    positions = torch.randint(0, 300, (2, 200), generator=torch.Generator().manual_seed(size))
    mask = flexmask.sliding_window(size, positions=positions)
    want = dense_window(positions.tolist(), [size] * 2, 200, 200)
    for block in (16, (32, 16)):
        ours = build(mask, 2, 200, 200, block)
        oracle.assert_same_block_mask(ours, oracle.torch_build(want, 2, 1, 200, 200, block))


@pytest.mark.parametrize("keys_ahead", [False, True])
@pytest.mark.parametrize("size", [1, 20, 41, 120])
def test_tiles_of_several_runs_are_read_run_by_run(size, keys_ahead):
    """Tiles whose positions are two or three runs with gaps between (a branch ending inside
    a block): their ranges overlap while their runs may all be apart, so such a tile is
    empty for windows narrower than the runs' gaps and partial for wider ones."""
    q_tiles = [
        [*range(0, 8), *range(100, 108)],  # two runs around the key tile's
        [*range(300, 305), *range(20, 25), *range(150, 156)],  # three, one near it
        list(range(40, 56)),  # one run, inside
        [*range(0, 4), *range(90, 94), *range(200, 204), *range(400, 404)],  # four: evaluated
    ]
    kv_tiles = [list(range(50, 66)), [*range(60, 68), *range(160, 168)]]
    positions = [p for tile in q_tiles + kv_tiles for p in tile]
    S = len(positions)
    mask = PositionWindow(size, positions, keys_ahead=keys_ahead)
    want = dense_window([positions], [size], S, S, keys_ahead=keys_ahead)
    ours = build(mask, 1, S, S, 16)
    oracle.assert_same_block_mask(ours, oracle.torch_build(want, 1, 1, S, S, 16))


@pytest.mark.parametrize("block", BLOCKS)
def test_in_a_packed_tree_each_sequence_attends_its_own_window(block):
    """pack_tree_batch' position_ids are depths: tree & sliding_window(w, positions=them) gives
    every sequence's tokens what causal() & sliding_window(w) gives that sequence alone —
    the prompt tokens less than w back in its own sequence, however far its siblings pushed
    it in the packed row. Packed distance drops some of them."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 50, size=n).tolist() for n in (40, 70)]
    sequences = [p + rng.integers(1, 50, size=n).tolist() for p in prompts for n in (30, 55, 90)]
    batch = pack_tree_batch(sequences, max_tokens=400)
    S, w = batch.max_tokens, 48
    mask = batch.mask & flexmask.sliding_window(w, positions=batch.position_ids)
    B = batch.tokens.shape[0]
    dense = mask.to_dense(B, 1, S, S)[:, 0]
    packed = (batch.mask & flexmask.sliding_window(w)).to_dense(B, 1, S, S)[:, 0]
    lost = 0
    for i, row in enumerate(batch.row_of):
        path = _path(batch, row, sequences[i])
        n = len(path)
        own = torch.tensor(np.tril(np.ones((n, n), dtype=bool)) & (oracle.sliding_window(w, n, n)))
        got = dense[row][path][:, path]
        assert torch.equal(got, own), i
        lost += int((own & ~packed[row][path][:, path]).sum())
    assert lost > 0  # the packed-distance window drops prompt tokens of later responses
    ours = build(mask, B, S, S, block)
    want = np.stack(
        [
            oracle.tree(batch.parents[b].tolist(), S, S)
            & dense_window([batch.position_ids[b].tolist()], [w], S, S)[0, 0]
            for b in range(B)
        ]
    )[:, None]
    oracle.assert_same_block_mask(ours, oracle.torch_build(want, B, 1, S, S, block))


def _path(batch, row, sequence):
    """The packed positions of ``sequence`` in ``row``: the trie walked from a root down its
    tokens (a parent has one child per token), read off the row's parents and tokens."""
    parents = batch.parents[row].tolist()
    tokens = batch.tokens[row].tolist()
    path, at = [], -1
    for token in sequence:
        at = next(
            node for node in range(len(parents)) if parents[node] == at and tokens[node] == token
        )
        path.append(at)
    return path


def test_with_document_positions_it_is_the_packed_window():
    """Positions that restart at every document make it the packed window inside documents."""
    lens = [100, 37, 250, 125]
    positions = torch.cat([torch.arange(n) for n in lens])
    for block in (32, (64, 16)):
        ours = build(
            flexmask.causal()
            & flexmask.document(lens)
            & flexmask.sliding_window(40, positions=positions),
            1, 512, 512, block,
        )  # fmt: skip
        theirs = build(
            flexmask.causal() & flexmask.document(lens) & flexmask.sliding_window(40),
            1, 512, 512, block,
        )  # fmt: skip
        oracle.assert_same_block_mask(ours, theirs)


def test_equal_positions_make_equal_masks_however_given():
    as_list = flexmask.sliding_window(8, positions=[0, 1, 2, 1, 2])
    as_tensor = flexmask.sliding_window(
        8, positions=torch.tensor([0, 1, 2, 1, 2], dtype=torch.int32)
    )
    assert as_list == as_tensor and hash(as_list) == hash(as_tensor)
    assert as_list != flexmask.sliding_window(8, positions=[0, 1, 2, 1, 3])
    assert as_list != flexmask.sliding_window(7, positions=[0, 1, 2, 1, 2])
    assert as_list != flexmask.sliding_window(8)
    assert as_list != PositionWindow(8, [0, 1, 2, 1, 2], keys_ahead=True)
    rows = flexmask.sliding_window([8, 8], positions=[[0, 1, 2, 1, 2]] * 2)
    assert rows != as_list and rows == pickle.loads(pickle.dumps(rows))
    again = pickle.loads(pickle.dumps(as_list))
    assert again == as_list
    oracle.assert_same_block_mask(build(again, 1, 5, 5, 16), build(as_list, 1, 5, 5, 16))


def test_the_positions_are_the_masks_own_copy():
    positions = torch.tensor([0, 1, 2, 3, 4, 5])
    mask = flexmask.sliding_window(2, positions=positions)
    before = mask.to_dense(1, 1, 6, 6).clone()
    positions.zero_()
    assert torch.equal(mask.to_dense(1, 1, 6, 6), before)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: flexmask.sliding_window(2, positions=[0, -1]),
            ValueError,
            r"\[0, 2\*\*62\), got -1",
        ),
        (
            lambda: flexmask.sliding_window(2, positions=[0, 2**62]),
            ValueError,
            r"got 4611686018427387904",
        ),
        (lambda: flexmask.sliding_window(2, positions=[0.5, 1.0]), TypeError, "positions"),
        (lambda: flexmask.sliding_window(2, positions=[[0, 1], [0]]), ValueError, "same number"),
        (lambda: flexmask.sliding_window(2, positions=[]), ValueError, "at least one"),
        (lambda: flexmask.sliding_window(-1, positions=[0, 1]), ValueError, "size"),
        (
            lambda: flexmask.sliding_window([2, 3], positions=[[0, 1]] * 3),
            ValueError,
            "size is given for 2 batch rows and positions for 3",
        ),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_too_few_positions_or_rows_fail_at_the_build():
    mask = flexmask.sliding_window(4, positions=list(range(100)))
    with pytest.raises(ValueError, match=r"holds 100 positions per row, fewer than .*=128"):
        build(mask, 1, 128, 128, 16)
    with pytest.raises(ValueError, match=r"fewer than the sequence length"):
        build(mask, 1, 64, 64, 16, q_offset=40)
    rows = flexmask.sliding_window(4, positions=torch.zeros(2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="2 batch rows but B=3"):
        build(rows, 3, 64, 64, 16)


def test_lowerings_refuse_naming_it_and_attention_runs_it():
    mask = flexmask.causal() & flexmask.sliding_window(3, positions=[0, 1, 2, 1, 2, 3, 2, 3])
    for lower in (lambda: to_magi(mask, 1, None, 8, 8), lambda: to_varlen(mask, 1, None, 8, 8)):
        with pytest.raises(ValueError, match="sliding_window"):
            lower()
    q, k, v = (torch.randn(2, 2, 8, 16, dtype=torch.float64) for _ in range(3))
    out = flexmask.attention(q, k, v, mask)
    dense = torch.as_tensor(
        dense_window([[0, 1, 2, 1, 2, 3, 2, 3]], [3], 8, 8) & np.tril(np.ones((8, 8), bool))
    )
    want, _ = oracle.attention(q, k, v, dense)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_shards_equal_torchs(world):
    """tree & sliding_window(w, positions=depths) sharded under head-tail and mask-aware
    balancing: every rank's shard is torch's _create_cp_block_mask of the same mask."""
    rng = np.random.default_rng(world)
    sequences = [
        prompt + rng.integers(1, 50, size=n).tolist()
        for prompt in (rng.integers(1, 50, size=m).tolist() for m in (60, 90, 30))
        for n in (40, 100)
    ]
    S = 512
    batch = pack_tree_batch(sequences, max_tokens=S)
    B = batch.tokens.shape[0]
    mask = batch.mask & flexmask.sliding_window(64, positions=batch.position_ids)
    balancers = {
        "head_tail": flexmask.context_parallel.HeadTailBalancer(S, world),
        "mask_aware": flexmask.context_parallel.MaskAwareBalancer(
            mask, B, 1, S, world, block_size=128
        ),
    }
    for name, lb in balancers.items():
        for rank in range(world):
            ours = flexmask.shard(mask, B, 1, S, world_size=world, rank=rank, balancer=lb)
            theirs = oracle.torch_cp_shard(mask, B, 1, S, world, rank, lb)
            oracle.assert_same_block_mask(
                ours.block_mask, theirs, f"{name} rank {rank}", own_storage=False
            )
