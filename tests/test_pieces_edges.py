"""Edge values that are well defined are accepted and exact; sizes never overflow silently.

Zero-sized pieces (``prefix(0)``, ``padding(0)``, ``sliding_window(0)``, empty documents), sizes
past the sequence (a prefix or window up to ``2**63 - 1``), numpy integers and numpy per-row
data: each, alone and composed, equals the plain dense reference of ``tests/oracle.py`` both as
``mask.to_dense`` and as a BlockMask (the closed form, the classified tiles and the evaluated
tiles), compared with torch's ``create_block_mask``. Values that signal a bug (negative sizes,
padding or documents longer than the sequence, anything past int64) raise an error naming the
argument.

Lengths past the sequence mean one thing for every piece: clipped to the sequence
(docs/algebra.md, "Lengths past the sequence"). Each piece with a length (padding, prefix,
chunked, sliding_window) or with data that may run past the sequence (document, spans), at
lengths past Q_LEN/KV_LEN — with and without q_offset/kv_offset, shared and per row — is
built and compared with two independent references: torch's create_block_mask of a plain
mask_mod written here from the documented rule, and the dense oracle (tests/oracle.py).
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.blocks.codes import UNDECIDED
from flexmask.blocks.write import assemble, ordered_from_codes
from flexmask.builders import closed_form, make_grid
from flexmask.builders.classify import classify, classify_blocks, refine_by_evaluation
from tests import oracle

INT64_MAX = 2**63 - 1
B, H = 2, 2


def _rows(fn):
    """A reference (batch, q_len, kv_len) -> (batch, Q, KV) from a per-row one."""
    return lambda batch, q, kv: np.stack([fn(r, q, kv) for r in range(batch)])


def _shared(fn):
    return _rows(lambda r, q, kv: fn(q, kv))


def _per_row(fn, values):
    return _rows(lambda r, q, kv: fn(values[r], q, kv))


def _document(seq_lens):
    return _shared(lambda q, kv: oracle.document(seq_lens, q, kv))


def _documents(rows):
    return _per_row(lambda lens, q, kv: oracle.document(lens, q, kv), rows)


# Edge values alone: (id, mask, reference). Data fits in 20 tokens, so every length below holds it.
EDGES = [
    ("prefix(0)", flexmask.prefix(0), _shared(lambda q, kv: oracle.prefix(0, q, kv))),
    ("prefix([0,5])", flexmask.prefix([0, 5]), _per_row(oracle.prefix, [0, 5])),
    ("prefix(past)", flexmask.prefix(1000), _shared(lambda q, kv: oracle.prefix(1000, q, kv))),
    (
        "prefix(int64 max)",
        flexmask.prefix(INT64_MAX),
        _shared(lambda q, kv: oracle.prefix(INT64_MAX, q, kv)),
    ),
    (
        "prefix(np [max, 0])",
        flexmask.prefix(np.array([INT64_MAX, 0])),
        _per_row(oracle.prefix, [INT64_MAX, 0]),
    ),
    ("padding(0)", flexmask.padding(0), _shared(lambda q, kv: oracle.padding(0, q, kv))),
    (
        "padding(np [0,13])",
        flexmask.padding(np.array([0, 13])),
        _per_row(oracle.padding, [0, 13]),
    ),
    (
        "window(0)",
        flexmask.sliding_window(0),
        _shared(lambda q, kv: oracle.sliding_window(0, q, kv)),
    ),
    (
        "window([0,3])",
        flexmask.sliding_window([0, 3]),
        _per_row(oracle.sliding_window, [0, 3]),
    ),
    (
        "window(maxsize)",
        flexmask.sliding_window(sys.maxsize),
        _shared(lambda q, kv: oracle.sliding_window(sys.maxsize, q, kv)),
    ),
    (
        "window([max,0])",
        flexmask.sliding_window([INT64_MAX, 0]),
        _per_row(oracle.sliding_window, [INT64_MAX, 0]),
    ),
    (
        "window(np.int64 5)",
        flexmask.sliding_window(np.int64(5)),
        _shared(lambda q, kv: oracle.sliding_window(5, q, kv)),
    ),
    ("document([0])", flexmask.document([0]), _document([0])),
    (
        "document([0,3,0,0,4,0])",
        flexmask.document([0, 3, 0, 0, 4, 0]),
        _document([0, 3, 0, 0, 4, 0]),
    ),
    (
        "document(np 2-D)",
        flexmask.document(np.array([[2, 0, 17], [0, 0, 5]])),
        _documents([[2, 0, 17], [0, 0, 5]]),
    ),
    (
        "document([np, np])",
        flexmask.document([np.array([3, 0]), np.array([1, 0, 1, 1], dtype=np.int32)]),
        _documents([[3, 0], [1, 0, 1, 1]]),
    ),
    (
        "document([[0],[4,0,2]])",
        flexmask.document([[0], [4, 0, 2]]),
        _documents([[0], [4, 0, 2]]),
    ),
]

# What each edge is composed with: (id, combine, combine the references).
_CAUSAL = _shared(oracle.causal)
_DOC = _document([5, 0, 7])
_PAD = _per_row(oracle.padding, [9, 20])
_WINDOW = _shared(lambda q, kv: oracle.sliding_window(3, q, kv))
COMPOSITIONS = [
    ("alone", lambda m: m, lambda ref: ref),
    ("& causal", lambda m: m & flexmask.causal(), lambda ref: _and(ref, _CAUSAL)),
    ("| causal", lambda m: flexmask.causal() | m, lambda ref: _or(ref, _CAUSAL)),
    (
        "& document",
        lambda m: m & flexmask.document([5, 0, 7]),
        lambda ref: _and(ref, _DOC),
    ),
    (
        "& padding & causal",
        lambda m: m & flexmask.padding([9, 20]) & flexmask.causal(),
        lambda ref: _and(_and(ref, _PAD), _CAUSAL),
    ),
    (
        "& window(3)",
        lambda m: m & flexmask.sliding_window(3),
        lambda ref: _and(ref, _WINDOW),
    ),
    (
        "| document & causal",  # no intervals: tiles from each piece's classification
        lambda m: (m | flexmask.document([5, 0, 7])) & flexmask.causal(),
        lambda ref: _and(_or(ref, _DOC), _CAUSAL),
    ),
    ("~ & causal", lambda m: ~m & flexmask.causal(), lambda ref: _and(_not(ref), _CAUSAL)),
]


def _and(a, b):
    return lambda batch, q, kv: a(batch, q, kv) & b(batch, q, kv)


def _or(a, b):
    return lambda batch, q, kv: a(batch, q, kv) | b(batch, q, kv)


def _not(a):
    return lambda batch, q, kv: ~a(batch, q, kv)


# (Q_LEN, KV_LEN, BLOCK_SIZE): lengths that are not block multiples, Q != KV both ways.
SHAPES = [(37, 37, 16), (20, 45, 32), (45, 23, (16, 32)), (33, 33, 128)]


def _paths(mask, q_len, kv_len, block):
    """The BlockMask of every build path: the public entry (closed form where the intervals
    are monotone), the closed form itself, the classified tiles (intervals refine them), and
    the tiles refined by evaluating the mask_mod."""
    grid = make_grid(mask, B, H, q_len, kv_len, "cpu", block)
    mask_mod = mask.lower_at(grid.length, grid.device).mask_mod
    out = {"create_block_mask": flexmask.create_block_mask(mask, B, H, q_len, kv_len, "cpu", block)}
    if mask.has_monotone_intervals():
        out["closed form"] = assemble(*closed_form.ordered_sides(mask, grid), grid, mask_mod)
    out["tiles"] = assemble(*ordered_from_codes(classify_blocks(mask, grid).codes), grid, mask_mod)
    rows = B if mask.batch_dependent else 1
    codes = classify(mask, grid).codes.expand(rows, 1, grid.num_q_blocks, grid.num_kv_blocks)
    codes = codes.contiguous()
    undecided = (codes == UNDECIDED).nonzero()
    refine_by_evaluation(codes, undecided, mask.lower_at(grid.length, grid.device).evaluate, grid)
    out["evaluated"] = assemble(*ordered_from_codes(grid.demote_incomplete(codes)), grid, mask_mod)
    return out


def _assert_exact(mask, reference, q_len, kv_len, block, context=""):
    """to_dense, every build path and torch's build from the mask's own mask_mod all equal
    the plain dense reference."""
    context = f"{mask!r} Q={q_len} KV={kv_len} block={block} {context}"
    expected = np.repeat(reference(B, q_len, kv_len)[:, None], H, 1)
    dense = mask.to_dense(B, H, q_len, kv_len, "cpu").numpy()
    assert np.array_equal(dense, expected), f"{context}: to_dense differs from the oracle"
    want = oracle.torch_build(expected, block=block)
    theirs = torch_create_block_mask(
        mask.mask_mod, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=block
    )
    oracle.assert_same_block_mask(theirs, want, f"{context} torch on mask.mask_mod")
    for path, ours in _paths(mask, q_len, kv_len, block).items():
        oracle.assert_same_block_mask(ours, want, f"{context} [{path}]")
        assert flexmask.same_blocks(ours, theirs), f"{context} [{path}] vs torch's build"


@pytest.mark.parametrize(
    "c, combine, combine_ref",
    [pytest.param(i, *c[1:], id=c[0]) for i, c in enumerate(COMPOSITIONS)],
)
@pytest.mark.parametrize(
    "e, edge, edge_ref", [pytest.param(i, *e[1:], id=e[0]) for i, e in enumerate(EDGES)]
)
def test_edge_values_equal_the_oracle(e, edge, edge_ref, c, combine, combine_ref):
    mask, reference = combine(edge), combine_ref(edge_ref)
    # One shape per case, cycling through all of them over the cases (each edge meets every
    # shape across its compositions).
    q_len, kv_len, block = SHAPES[(e + c) % len(SHAPES)]
    _assert_exact(mask, reference, q_len, kv_len, block, f"({EDGES[e][0]} {COMPOSITIONS[c][0]})")


@pytest.mark.parametrize(
    "mask, same_as",
    [
        (flexmask.causal() | flexmask.prefix(0), flexmask.causal()),
        (flexmask.prefix(0), flexmask.empty()),
        (flexmask.sliding_window(0), flexmask.empty()),
        (flexmask.padding(0), flexmask.empty()),
        (flexmask.prefix(10**18), flexmask.full()),
        (flexmask.sliding_window(INT64_MAX), flexmask.full()),
        (flexmask.causal() & flexmask.sliding_window(sys.maxsize), flexmask.causal()),
        (flexmask.document([0, 6, 0, 250, 0]), flexmask.document([6, 250])),
        (
            flexmask.causal() & flexmask.document([0, 0, 200]),
            flexmask.causal() & flexmask.padding(200),
        ),
    ],
    ids=repr,
)
def test_edges_equal_their_plain_equivalent(mask, same_as):
    # The cases at S = 256 and 512 (where the huge window listed wrong blocks).
    for length in (256, 512):
        a = mask.to_dense(1, 1, length, length, "cpu")
        assert torch.equal(a, same_as.to_dense(1, 1, length, length, "cpu"))
        ours = flexmask.create_block_mask(mask, 1, 1, length, length, "cpu", 16)
        plain = flexmask.create_block_mask(same_as, 1, 1, length, length, "cpu", 16)
        assert flexmask.same_blocks(ours, plain)
        theirs = torch_create_block_mask(mask.mask_mod, 1, 1, length, length, "cpu", 16)
        assert flexmask.same_blocks(ours, theirs)


def test_intervals_of_edge_values_keep_the_closed_form_properties():
    # Every query's interval starts at or before it (lo(q) <= q), or is the explicit empty
    # [1, 0] (never [q + 1, q - 1]); nothing is near int64 overflow, whatever the size.
    length = 40
    grid = make_grid(flexmask.causal(), 1, 1, length, length, "cpu", 16)
    q_idx = torch.arange(length).view(1, -1)
    row = torch.zeros(1, 1, dtype=torch.int64)
    for piece in (
        flexmask.sliding_window(0),
        flexmask.sliding_window(1),
        flexmask.sliding_window(INT64_MAX),
        flexmask.prefix(0),
        flexmask.prefix(INT64_MAX),
        flexmask.padding(0),
        flexmask.padding(length),
        flexmask.document([0, 7, 0]),
    ):
        lo, hi = (t.expand(1, length) for t in piece.intervals_at(q_idx, row, grid))
        assert bool((lo <= q_idx.clamp(min=1)).all()), f"{piece}: lo > q at {lo}"
        assert bool(((lo <= hi) | ((lo == 1) & (hi == 0)) | (hi == lo - 1)).all()), piece
        assert bool((lo.abs() <= 2 * length).all() and (hi.abs() <= 2 * length).all()), piece


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: flexmask.sliding_window(2**63), ValueError, "size must fit in a signed 64-bit"),
        (lambda: flexmask.sliding_window(-1), ValueError, "size must be >= 0"),
        (lambda: flexmask.prefix([3, -2]), ValueError, r"length\[1\] must be >= 0"),
        (lambda: flexmask.prefix(np.uint64(2**64 - 1)), ValueError, "length must fit"),
        (lambda: flexmask.padding(np.array([2**64 - 1], np.uint64)), ValueError, r"lengths\[0\]"),
        (lambda: flexmask.padding(-(2**63) - 1), ValueError, "lengths must fit"),
        (lambda: flexmask.padding(np.array(2.5)), TypeError, "lengths must be an int"),
        (lambda: flexmask.document([4, -1]), ValueError, r"seq_lens\[1\] must be a document"),
        (
            lambda: flexmask.document([2**62, 2**62, 2**62]),
            ValueError,
            r"sum\(seq_lens\)=13835058055282163712 does not fit",
        ),
        (
            lambda: flexmask.document([[1], [INT64_MAX, 1]]),
            ValueError,
            r"sum\(seq_lens\[1\]\)",
        ),
        (lambda: flexmask.document([2**64]), ValueError, r"seq_lens\[0\] must fit"),
        (lambda: flexmask.document(np.array([[1.0, 2.0]])), TypeError, r"seq_lens\[0\]"),
        (lambda: flexmask.document(np.zeros((2, 2, 2), int)), ValueError, "1-D"),
    ],
)
def test_values_that_signal_a_bug_raise(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_numpy_integers_everywhere_an_int_is_taken():
    n = np.int64
    mask = flexmask.causal() & flexmask.sliding_window(np.int32(9)) & flexmask.padding(n(30))
    cropped = flexmask.causal() & flexmask.sliding_window(np.int32(9)) & flexmask.padding(n(3))
    bm = flexmask.create_block_mask(mask, n(2), n(3), n(40), np.int32(33), "cpu", n(16))
    ref = flexmask.create_block_mask(mask, 2, 3, 40, 33, "cpu", 16)
    assert flexmask.same_blocks(bm, ref) and bm.shape == (2, 3, 40, 33)
    pair = flexmask.create_block_mask(mask, 1, 1, 40, 40, "cpu", (np.int16(16), n(32)))
    assert tuple(pair.BLOCK_SIZE) == (16, 32)
    assert torch.equal(mask.to_dense(n(1), n(1), n(40), n(33)), mask.to_dense(1, 1, 40, 33))
    assert cropped.show(n(4)) == cropped.show(4)
    assert flexmask.sliding_window(np.array(9)) == flexmask.sliding_window(9)
    assert flexmask.document(np.array([3, 4], np.uint8)) == flexmask.document([3, 4])
    assert flexmask.prefix(torch.tensor([2, 3], dtype=torch.uint64)) == flexmask.prefix([2, 3])


# Sizes up to 2**63 - 1 (and a little past, which must be refused).
SIZES = st.one_of(
    st.integers(0, 50),
    st.integers(0, INT64_MAX),
    st.sampled_from([INT64_MAX, INT64_MAX - 1, sys.maxsize, 2**62, 2**32, 2**31 - 1]),
    st.integers(INT64_MAX + 1, 2**65),
    st.integers(-5, -1),
)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_size_gives_the_right_mask_or_a_clear_error(data):
    kind = data.draw(st.sampled_from(["window", "prefix", "padding", "document"]), label="kind")
    q_len = data.draw(st.integers(1, 70), label="q_len")
    kv_len = data.draw(st.integers(1, 70), label="kv_len")
    block = data.draw(st.sampled_from([16, 32, 128, (16, 32)]), label="block")
    length = max(q_len, kv_len)
    per_row = data.draw(st.booleans(), label="per_row")
    if kind == "document":
        rows = [data.draw(st.lists(SIZES, min_size=1, max_size=4)) for _ in range(B)]
        arg = rows if per_row else rows[0]
        rows = rows if per_row else [rows[0]] * B
    else:
        rows = [data.draw(SIZES) for _ in range(B)] if per_row else [data.draw(SIZES)] * B
        arg = rows if per_row else rows[0]
    values = [v for r in rows for v in (r if kind == "document" else [r])]
    make = {
        "window": flexmask.sliding_window,
        "prefix": flexmask.prefix,
        "padding": flexmask.padding,
        "document": flexmask.document,
    }[kind]
    name = {"window": "size", "prefix": "length", "padding": "lengths", "document": "seq_lens"}
    too_big = any(v > INT64_MAX for v in values)
    negative = any(v < 0 for v in values)
    overflows = kind == "document" and any(sum(r) > INT64_MAX for r in rows)
    past = (kind == "padding" and max(values) > length) or (
        kind == "document" and max(sum(r) for r in rows) > length
    )
    if too_big or negative or overflows:
        with pytest.raises(ValueError, match=name[kind]):
            make(arg)
        return
    piece = make(arg)
    mask = data.draw(
        st.sampled_from([piece, piece & flexmask.causal(), flexmask.causal() | piece]),
        label="mask",
    )
    if past:
        with pytest.raises(ValueError, match=name[kind]):
            flexmask.create_block_mask(mask, B, H, q_len, kv_len, "cpu", block)
        return
    ref_of = {
        "window": oracle.sliding_window,
        "prefix": oracle.prefix,
        "padding": oracle.padding,
        "document": oracle.document,
    }[kind]
    reference = _per_row(ref_of, rows)
    if mask is not piece:
        causal = _shared(oracle.causal)
        reference = (
            _and(reference, causal) if mask == piece & flexmask.causal() else _or(reference, causal)
        )
    _assert_exact(mask, reference, q_len, kv_len, block)


def test_numpy_integers_in_attention_and_plot_options(tmp_path):
    from flexmask.backends.block_sparse.api import block_sparse_attention

    q = torch.randn(1, 2, 40, 8)
    bm = flexmask.create_block_mask(flexmask.causal(), 1, 1, 40, 40, "cpu", 16)
    chunked = block_sparse_attention(q, q, q, bm, max_chunk_elements=np.int64(100))
    torch.testing.assert_close(chunked, block_sparse_attention(q, q, q, bm))
    pytest.importorskip("matplotlib")
    path = flexmask.plot(
        flexmask.causal(), tmp_path / "x.png", Q_LEN=8, max_elements=np.int64(64), head=np.int8(0)
    )
    assert path.endswith("x.png")


Q_LEN, KV_LEN, BLOCK = 37, 45, 16  # neither a block multiple
# (q_offset, kv_offset): the sequence is positions [0, max(q_offset + Q_LEN, kv_offset + KV_LEN))
OFFSETS = [(0, 0), (13, 0), (0, 9), (21, 5), ([3, 30], [11, 0])]


def _reach(q_off, kv_off) -> int:
    """The sequence's length: the furthest position the window reaches."""
    q_far = max(q_off) if isinstance(q_off, list) else q_off
    kv_far = max(kv_off) if isinstance(kv_off, list) else kv_off
    return max(q_far + Q_LEN, kv_far + KV_LEN)


def _offset_rows(offset, batch: int) -> list[int]:
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


def _truncated_padding(lengths):
    """padding cut at the sequence end by request: a length past it is no padding."""
    return flexmask.padding(lengths, truncate=True)


VALUE_CASES = [
    *(
        _value_case(
            "padding", _truncated_padding, lambda n, q, kv: (q < n) & (kv < n), _padding_dense, v
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
    _table_case(
        "document([30, 200])", flexmask.document([30, 200], truncate=True), [_doc_ids([30, 200])]
    ),
    # Bounds near int64's edge: past the search padding of 2**62.
    _table_case(
        "document([30, 2**63 - 31])",
        flexmask.document([30, INT64_MAX - 30], truncate=True),
        [_doc_ids([30, 100])],
    ),
    _table_case(
        "document(per row, past)",
        flexmask.document([[5, 0, 100], [61, 4]], truncate=True),
        [_doc_ids([5, 0, 100]), _doc_ids([61, 4])],
    ),
    # A span straddling the end, and ids for tokens that are not there.
    _table_case(
        "spans(straddling)",
        flexmask.spans([-1] * 20 + [0] * 30 + [-1, 1, 1] + [2] * 50, truncate=True),
        [[-1] * 20 + [0] * 30 + [-1, 1, 1] + [2] * 50],
    ),
]


def _check(mask, plain_abs, dense_abs, batch, q_off, kv_off, context):
    """Ours against torch's build of the plain rule and against the dense oracle, on the
    window [q_off, q_off + Q_LEN) x [kv_off, kv_off + KV_LEN) of row b."""
    q_rows = torch.tensor(_offset_rows(q_off, batch))
    kv_rows = torch.tensor(_offset_rows(kv_off, batch))

    ours = flexmask.create_block_mask(
        mask, batch, 1, Q_LEN, KV_LEN, "cpu", BLOCK, q_offset=q_off, kv_offset=kv_off
    )
    theirs = oracle.torch_build(
        lambda b, h, q_idx, kv_idx: plain_abs(b, q_idx, kv_idx),
        batch,
        1,
        Q_LEN,
        KV_LEN,
        BLOCK,
        q_offset=q_rows,
        kv_offset=kv_rows,
    )
    oracle.assert_same_block_mask(ours, theirs, context)
    window = np.stack(
        [
            dense_abs[b, q : q + Q_LEN, kv : kv + KV_LEN]
            for b, (q, kv) in enumerate(zip(q_rows.tolist(), kv_rows.tolist(), strict=True))
        ]
    )[:, None]
    oracle.assert_same_block_mask(ours, oracle.torch_build(window, block=BLOCK), context)
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
        (flexmask.padding(10**12, truncate=True), flexmask.padding(40)),
        (flexmask.padding([41, 7], truncate=True), flexmask.padding([40, 7])),
        (flexmask.prefix(INT64_MAX), flexmask.prefix(40)),
        (flexmask.chunked(41), flexmask.chunked(40)),
        (flexmask.sliding_window(10**9), flexmask.sliding_window(40)),
        (flexmask.document([30, 11], truncate=True), flexmask.document([30, 10])),
        (
            flexmask.document([[30, 11], [50]], truncate=True),
            flexmask.document([[30, 10], [40]]),
        ),
        (flexmask.spans([0] * 38 + [1] * 5, truncate=True), flexmask.spans([0] * 38 + [1] * 2)),
    ],
    ids=repr,
)
def test_a_length_past_the_sequence_is_the_length_clipped_to_it(past, clipped):
    # Every entry point takes it (none raises; documents, spans and padding by request) and
    # agrees with the clipped value at S = 40.
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


@pytest.mark.parametrize(
    ("past", "what"),
    [
        (flexmask.document([30, 11]), "document's seq_lens reach position 41"),
        (flexmask.document([[30, 10], [50]]), "document's seq_lens reach position 50"),
        (flexmask.padding([41, 7]), "padding's lengths reach position 41"),
        (flexmask.spans([0] * 38 + [1] * 5), "spans's ids reach position 43"),
        (flexmask.tree([-1] + [0] * 41), "parents has 42 tokens"),
    ],
    ids=repr,
)
def test_data_past_the_sequence_raises_at_every_entry_unless_truncated(past, what):
    """Documents, spans, padding and trees made for longer rows than the call's (lengths
    counted before truncating, (B, S, H, D) tensors read as (B, H, S, D)) are refused where
    the mask meets its lengths, naming the piece, its reach and the length."""
    length, batch = 40, past.rows or 1
    q = torch.zeros(batch, 1, length, 8)
    entries = {
        "create_block_mask": lambda: flexmask.create_block_mask(past, batch, 1, length, length),
        "lazy": lambda: flexmask.lazy(past, batch, 1, length, length),
        "to_dense": lambda: past.to_dense(batch, 1, length, length),
        "to_magi": lambda: flexmask.to_magi(past, batch, 1, length, length),
        "flex_attention": lambda: flexmask.flex_attention(q, q, q, block_mask=past),
        "decode_mask": lambda: flexmask.decode_mask(past, [length - 1] * batch, 1, length),
    }
    for entry, call in entries.items():
        with pytest.raises(ValueError, match=re.escape(what)) as err:
            call()
        assert "40" in str(err.value), (entry, str(err.value))
        if "tree" not in repr(past):
            assert "truncate=True" in str(err.value), (entry, str(err.value))


def test_a_mask_for_b_s_h_d_tensors_is_refused():
    """The issue's misread: a Mask of 300 tokens' documents with (B, S, H, D) tensors, which
    flex_attention reads as S = H = 2, no longer runs on the first two positions."""
    mask = flexmask.causal() & flexmask.document([100, 200])
    q = torch.randn(1, 300, 2, 16)
    with pytest.raises(ValueError, match=r"reach position 300 .* = 2: .*\(B, H, S, D\)"):
        flexmask.flex_attention(q, q, q, block_mask=mask)


def test_truncate_is_a_bool():
    with pytest.raises(TypeError, match="truncate must be True or False"):
        flexmask.document([3, 4], truncate="no")
