"""Lengths past the sequence mean one thing for every piece: clipped to the sequence
(docs/algebra.md, "Lengths past the sequence"). Each piece with a length (padding, prefix,
chunked, sliding_window) or with data that may run past the sequence (document, spans), at
lengths past Q_LEN/KV_LEN — with and without q_offset/kv_offset, shared and per row — is
built and compared with two independent references: torch's create_block_mask of a plain
mask_mod written here from the documented rule, and the dense oracle (tests/oracle.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from tests import oracle

INT64_MAX = 2**63 - 1
Q_LEN, KV_LEN, BLOCK = 37, 45, 16  # neither a block multiple
# (q_offset, kv_offset): the sequence is positions [0, max(q_offset + Q_LEN, kv_offset + KV_LEN))
OFFSETS = [(0, 0), (13, 0), (0, 9), (21, 5), ([3, 30], [11, 0])]


def _reach(q_off, kv_off) -> int:
    """The sequence's length: the furthest position the window reaches."""
    q_far = max(q_off) if isinstance(q_off, list) else q_off
    kv_far = max(kv_off) if isinstance(kv_off, list) else kv_off
    return max(q_far + Q_LEN, kv_far + KV_LEN)


def _per_row(offset, batch: int) -> list[int]:
    return offset if isinstance(offset, list) else [offset] * batch


# ---------------------------------------------------------------- the rule, written plainly
# Each case: (name, make(S) -> (flexmask piece, rows), plain(b, q, kv) for absolute positions,
# dense(S) -> (B, S, S) numpy). "S" is the sequence length; the lengths given are past it.
def _row_values(values, batch):
    return values if isinstance(values, list) else [values] * batch


def _value_case(name, piece_fn, rule, dense_fn, values):
    """padding / prefix / chunked / sliding_window at the given values (an int or per row)."""

    def build(batch):
        vals = _row_values(values, batch)
        table = torch.tensor(vals, dtype=torch.int64)

        def plain(b, q, kv):
            return rule(table[b], q, kv)

        def dense(length):
            return np.stack([dense_fn(v, length) for v in vals])

        return piece_fn(values), plain, dense

    return pytest.param(name, build, id=f"{name}({values})")


def _padding_dense(n, length):
    q, kv = np.arange(length)[:, None], np.arange(length)[None, :]
    return (q < n) & (kv < n)


def _prefix_dense(n, length):
    kv = np.arange(length)[None, :]
    return np.broadcast_to(kv < n, (length, length))


def _window_dense(n, length):
    q, kv = np.arange(length)[:, None], np.arange(length)[None, :]
    return np.abs(q - kv) < n


def _chunked_dense(n, length):
    q, kv = np.arange(length)[:, None], np.arange(length)[None, :]
    return (q // n) == (kv // n)


PAST = [80, 10**12, INT64_MAX, [80, 10]]  # past every window's sequence (<= 60 tokens)

VALUE_CASES = [
    *(
        _value_case(
            "padding", flexmask.padding, lambda n, q, kv: (q < n) & (kv < n), _padding_dense, v
        )
        for v in PAST
    ),
    *(
        _value_case("prefix", flexmask.prefix, lambda n, q, kv: kv < n, _prefix_dense, v)
        for v in PAST
    ),
    *(
        _value_case(
            "sliding_window",
            flexmask.sliding_window,
            lambda n, q, kv: (q - kv).abs() < n,
            _window_dense,
            v,
        )
        for v in PAST
    ),
    *(
        _value_case(
            "chunked",
            flexmask.chunked,
            lambda n, q, kv: (q // n) == (kv // n),
            _chunked_dense,
            v,
        )
        for v in [80, 10**12, INT64_MAX, [80, 7]]
    ),
]


def _table_case(name, piece, tables):
    """document / spans: per-position ids written plainly; -1 is "in none"."""

    def build(batch):
        rows = tables if len(tables) > 1 else tables * batch

        def dense(length):
            out = []
            for row in rows:
                ids = np.full(length, -1)
                ids[: min(length, len(row))] = row[:length]
                out.append((ids[:, None] == ids[None, :]) & (ids[:, None] >= 0))
            return np.stack(out)

        def plain_for(length):
            table = torch.full((len(rows), length), -1, dtype=torch.int64)
            for i, row in enumerate(rows):
                table[i, : min(length, len(row))] = torch.tensor(row[:length])

            def plain(b, q, kv):
                q_id = table[b, q]
                return (q_id == table[b, kv]) & (q_id >= 0)

            return plain

        return piece, plain_for, dense

    return pytest.param(name, build, id=name)


def _doc_ids(seq_lens):
    return [d for d, n in enumerate(seq_lens) for _ in range(n)]


TABLE_CASES = [
    # The last document runs past every sequence: a truncated document.
    _table_case("document([30, 200])", flexmask.document([30, 200]), [_doc_ids([30, 200])]),
    # Bounds near int64's edge: past the search padding of 2**62.
    _table_case(
        "document([30, 2**63 - 31])",
        flexmask.document([30, INT64_MAX - 30]),
        [_doc_ids([30, 100])],
    ),
    _table_case(
        "document(per row, past)",
        flexmask.document([[5, 0, 100], [61, 4]]),
        [_doc_ids([5, 0, 100]), _doc_ids([61, 4])],
    ),
    # A span straddling the end, and ids for tokens that are not there.
    _table_case(
        "spans(straddling)",
        flexmask.spans([-1] * 20 + [0] * 30 + [-1, 1, 1] + [2] * 50),
        [[-1] * 20 + [0] * 30 + [-1, 1, 1] + [2] * 50],
    ),
]


def _check(mask, plain_abs, dense_abs, batch, q_off, kv_off, context):
    """Ours against torch's build of the plain rule and against the dense oracle, on the
    window [q_off, q_off + Q_LEN) x [kv_off, kv_off + KV_LEN) of row b."""
    q_rows = torch.tensor(_per_row(q_off, batch))
    kv_rows = torch.tensor(_per_row(kv_off, batch))

    def shifted(b, h, q_idx, kv_idx):
        return plain_abs(b, q_idx + q_rows[b], kv_idx + kv_rows[b])

    ours = flexmask.create_block_mask(
        mask, batch, 1, Q_LEN, KV_LEN, "cpu", BLOCK, q_offset=q_off, kv_offset=kv_off
    )
    theirs = torch_create_block_mask(shifted, batch, 1, Q_LEN, KV_LEN, "cpu", BLOCK_SIZE=BLOCK)
    oracle.assert_same_block_mask(ours, theirs, context)
    window = np.stack(
        [
            dense_abs[b, q : q + Q_LEN, kv : kv + KV_LEN]
            for b, (q, kv) in enumerate(zip(q_rows.tolist(), kv_rows.tolist(), strict=True))
        ]
    )[:, None]
    oracle.assert_same_block_mask(ours, oracle.torch_blocks(window, BLOCK), context)
    # The BlockMask's own mask_mod (local indices) says the same, element by element.
    b = torch.arange(batch).view(-1, 1, 1, 1)
    got = ours.mask_mod(
        b, torch.zeros(1, 1, 1, 1, dtype=torch.long), *_local_grid(Q_LEN, KV_LEN)
    ).expand(batch, 1, Q_LEN, KV_LEN)
    assert np.array_equal(got.numpy(), window), context


def _local_grid(q_len, kv_len):
    return torch.arange(q_len).view(1, 1, -1, 1), torch.arange(kv_len).view(1, 1, 1, -1)


@pytest.mark.parametrize(("q_off", "kv_off"), OFFSETS, ids=str)
@pytest.mark.parametrize(("name", "build"), VALUE_CASES)
def test_lengths_past_the_sequence_are_clipped(name, build, q_off, kv_off):
    batch = 2
    piece, plain, dense = build(batch)
    length = _reach(q_off, kv_off)
    dense_abs = dense(length)
    causal_abs = np.tril(np.ones((length, length), dtype=bool))[None]
    for mask, rule, table in (
        (piece, plain, dense_abs),
        (
            flexmask.causal() & piece,
            lambda b, q, kv: plain(b, q, kv) & (kv <= q),
            dense_abs & causal_abs,
        ),
        (
            flexmask.causal() | piece,
            lambda b, q, kv: plain(b, q, kv) | (kv <= q),
            dense_abs | causal_abs,
        ),
    ):
        _check(mask, rule, table, batch, q_off, kv_off, f"{mask!r} offsets {q_off}, {kv_off}")


@pytest.mark.parametrize(("q_off", "kv_off"), OFFSETS, ids=str)
@pytest.mark.parametrize(("name", "build"), TABLE_CASES)
def test_documents_and_spans_past_the_sequence_are_clipped(name, build, q_off, kv_off):
    batch = 2
    piece, plain_for, dense = build(batch)
    length = _reach(q_off, kv_off)
    plain, dense_abs = plain_for(length), dense(length)
    causal_abs = np.tril(np.ones((length, length), dtype=bool))[None]
    for mask, rule, table in (
        (piece, plain, dense_abs),
        (
            flexmask.causal() & piece,
            lambda b, q, kv: plain(b, q, kv) & (kv <= q),
            dense_abs & causal_abs,
        ),
        (
            flexmask.causal() | piece,
            lambda b, q, kv: plain(b, q, kv) | (kv <= q),
            dense_abs | causal_abs,
        ),
    ):
        _check(mask, rule, table, batch, q_off, kv_off, f"{mask!r} offsets {q_off}, {kv_off}")


@pytest.mark.parametrize(
    ("past", "clipped"),
    [
        (flexmask.padding(10**12), flexmask.padding(40)),
        (flexmask.padding([41, 7]), flexmask.padding([40, 7])),
        (flexmask.prefix(INT64_MAX), flexmask.prefix(40)),
        (flexmask.chunked(41), flexmask.chunked(40)),
        (flexmask.sliding_window(10**9), flexmask.sliding_window(40)),
        (flexmask.document([30, 11]), flexmask.document([30, 10])),
        (flexmask.document([[30, 11], [50]]), flexmask.document([[30, 10], [40]])),
        (flexmask.spans([0] * 38 + [1] * 5), flexmask.spans([0] * 38 + [1] * 2)),
    ],
    ids=repr,
)
def test_a_length_past_the_sequence_is_the_length_clipped_to_it(past, clipped):
    # Every entry point takes it (none raises) and agrees with the clipped value at S = 40.
    length = 40
    batch = past.rows or 1
    assert torch.equal(
        past.to_dense(batch, 1, length, length), clipped.to_dense(batch, 1, length, length)
    )
    ours = flexmask.create_block_mask(past, batch, 1, length, length, "cpu", BLOCK)
    same = flexmask.create_block_mask(clipped, batch, 1, length, length, "cpu", BLOCK)
    oracle.assert_same_block_mask(ours, same, repr(past))
    mod = past.mask_mod_for(length, length)
    theirs = torch_create_block_mask(mod, batch, 1, length, length, "cpu", BLOCK_SIZE=BLOCK)
    oracle.assert_same_block_mask(ours, theirs, repr(past))
    flexmask.decode_mask(past, [length - 1] * batch, 1, length, block_size=BLOCK)
