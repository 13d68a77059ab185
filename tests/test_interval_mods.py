"""Interval mask_mods (docs/compile.md): torch's own FLASH analyses take every mask whose rows
are unions of at most 8 intervals, their aux loads vectorise, and they mean the mask.

The graphs are traced as torch's flex_attention traces them (tests/mask_graphs.py) and, in
the compiled tests, caught inside inductor's lowering; the verdicts are torch's
``select_packed_mask_intervals`` and ``select_mask_mod_vec_size``; the meaning is checked
against the plain dense references of tests/strategies.py and tests/oracle.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

import flexmask
from flexmask.algebra.interval_mods import MAX_INTERVALS, IntervalMod, count
from tests import oracle
from tests.mask_graphs import compiled_graphs, verdict_of
from tests.strategies import expressions

B, S = 2, 128
DOCS = [[30, 40, 58], [64, 64]]
IDS = [[0] * 20 + [-1] * 108, [-1] * 10 + [1] * 30 + [-1] * 88]

# The issue's eight masks (0 of 8 took the interval path before), and every interval piece.
ISSUE_MASKS = {
    "causal & document": flexmask.causal() & flexmask.document(DOCS),
    "causal & window": flexmask.causal() & flexmask.sliding_window(64),
    "causal & document & window": flexmask.causal()
    & flexmask.document(DOCS)
    & flexmask.sliding_window(64),
    "causal | prefix": flexmask.causal() | flexmask.prefix(40),
    "causal & padding": flexmask.causal() & flexmask.padding([100, 128]),
    "causal & chunked": flexmask.causal() & flexmask.chunked(128),
    "prefix-LM documents": (flexmask.causal() | flexmask.spans(IDS)) & flexmask.document(DOCS),
    "document & padding": flexmask.document(DOCS) & flexmask.padding([100, 128]),
}
PIECES = {
    "causal": flexmask.causal(),
    "full": flexmask.full(),
    "empty": flexmask.empty(),
    "document": flexmask.document(DOCS[0]),
    "document per row": flexmask.document(DOCS),
    "padding": flexmask.padding(70),
    "prefix per row": flexmask.prefix([0, 300]),
    "chunked per row": flexmask.chunked([1, 7]),
    "sliding_window": flexmask.sliding_window(0),
    "sliding_window per row": flexmask.sliding_window([5, 1000]),
    "spans": flexmask.spans(IDS[1]),
    "~document": ~flexmask.document(DOCS),
    "~(causal & window)": ~(flexmask.causal() & flexmask.sliding_window(9)),
}
GENERAL = {
    "tree": flexmask.causal() & flexmask.tree([-1, 0, 0, 1, 3]),
    "from_mask_mod": flexmask.from_mask_mod(lambda b, h, q, kv: (q + kv) % 2 == 0, key="odd"),
    "per_head": flexmask.per_head(flexmask.causal(), flexmask.prefix(4)),
    # ~(d1 & d2 & d3 & d4 & d5) counts 2 + 2 + ... = 10 intervals: past torch's 8.
    "too many intervals": ~(
        flexmask.document([5, 123])
        & flexmask.document([9, 119])
        & flexmask.chunked(10)
        & flexmask.sliding_window(50)
        & flexmask.padding(100)
    ),
}
WINDOWS = [(0, 0), (5, 3), ([5, 20], [0, 7])]


def _dense(mod, rows: int, q_len: int, kv_len: int) -> torch.Tensor:
    b = torch.arange(rows).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    q = torch.arange(q_len).view(1, 1, -1, 1)
    kv = torch.arange(kv_len).view(1, 1, 1, -1)
    return mod(b, h, q, kv).expand(rows, 1, q_len, kv_len)


@pytest.mark.parametrize("q_offset, kv_offset", WINDOWS)
@pytest.mark.parametrize("name", sorted({**ISSUE_MASKS, **PIECES}))
def test_every_interval_mask_takes_torchs_interval_path(name, q_offset, kv_offset):
    mask = {**ISSUE_MASKS, **PIECES}[name]
    q_len = 100 if q_offset else S
    bm = flexmask.create_block_mask(
        mask, B, 1, q_len, S, "cpu", 32, q_offset=q_offset, kv_offset=kv_offset
    )
    verdict = verdict_of(bm.mask_mod)
    assert verdict.intervals is not None and 1 <= verdict.intervals <= MAX_INTERVALS, verdict.code
    assert verdict.vec_size == 32, verdict.code  # every aux load lane-uniform, vectorised
    assert not verdict.trivial  # never a no-op on a BlockMask with structure (#188322)
    # ... and it means the mask, on the window: torch's own build of the window agrees.
    reference = mask.to_dense(B, 1, 1000, 1000)
    q_off = torch.as_tensor(q_offset).expand(B)
    kv_off = torch.as_tensor(kv_offset).expand(B)
    expected = torch.stack(
        [reference[r, :, q_off[r] : q_off[r] + q_len, kv_off[r] : kv_off[r] + S] for r in range(B)]
    )
    assert torch.equal(_dense(bm.mask_mod, B, q_len, S), expected)


@pytest.mark.parametrize("name", sorted(GENERAL))
def test_trees_and_custom_masks_keep_the_general_form(name):
    mask = GENERAL[name]
    bm = flexmask.create_block_mask(mask, B, 2, S, S, "cpu", 32)
    assert not isinstance(bm.mask_mod, IntervalMod)
    assert verdict_of(bm.mask_mod).intervals is None
    form = mask.interval_form()
    assert form is None or count(form) > MAX_INTERVALS


def test_no_python_scalar_is_captured():
    # Every value the mask_mod reads is a tensor it holds (a captured int would recompile
    # on change and refuse FLASH under dynamic=True): new sizes, same code and shapes.
    def parts(size: int, length: int):
        mask = (flexmask.causal() & flexmask.sliding_window(size)) | flexmask.prefix(length)
        mod = flexmask.create_block_mask(mask, 1, 1, S, S, "cpu", q_offset=size).mask_mod
        return mod, verdict_of(mod).code

    (one, code_one), (other, code_other) = parts(7, 3), parts(50, 90)
    assert code_one == code_other

    def held(mod):
        names = [n for cls in type(mod).__mro__ for n in getattr(cls, "__slots__", ())]
        return {n: getattr(mod, n) for n in names}

    for a, b in ((one, other), (one.mod, other.mod)):
        for (name, x), y in zip(held(a).items(), held(b).values(), strict=True):
            assert not isinstance(x, (int, float)) or name == "per_row" or x == y, name


_LEAF_KINDS = ("causal", "full", "empty", "window", "prefix", "padding", "document", "chunked")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), length=st.integers(1, 40), heads=st.sampled_from([1, 2]))
def test_compositions_take_the_interval_path_exactly(data, length, heads):
    mask, dense = data.draw(expressions(B, heads, length, max_leaves=4))
    q_offset = data.draw(st.sampled_from([0, 3, [1, 6]]))
    q_len = max(1, length - 6) if q_offset else length
    bm = flexmask.create_block_mask(mask, B, heads, q_len, length, "cpu", 16, q_offset=q_offset)
    mod = bm.mask_mod
    inner = getattr(mod, "mod", mod)
    form = mask.interval_form()
    # A window farther from 0 than its own size holds its lookups for its positions alone
    # (BlockGrid.lookup_window): the general form, whose bounds could pass int32.
    far = max(np.atleast_1d(q_offset)) > length
    expressible = form is not None and count(form) <= MAX_INTERVALS and not far
    assert isinstance(inner, IntervalMod) == expressible
    if expressible:
        verdict = verdict_of(mod)
        assert verdict.intervals is not None and verdict.vec_size == 32, verdict.code
        # What torch's build of the whole mask means, read at the window.
        reference = torch.from_numpy(np.ascontiguousarray(dense(length + 8, length)))
        off = torch.as_tensor(q_offset).expand(B)
        expected = torch.stack([reference[r, :1, off[r] : off[r] + q_len] for r in range(B)])
        assert torch.equal(_dense(mod, B, q_len, length), expected)


def test_compiled_forward_takes_the_interval_path_and_matches_the_reference():
    # The graph inductor itself lowers (torch.compile of flex_attention on the CPU).
    mask = flexmask.causal() & flexmask.document(DOCS)
    bm = flexmask.create_block_mask(mask, B, 1, S, S, "cpu")
    q, k, v = (torch.randn(B, 2, S, 16) for _ in range(3))  # float32: the CPU kernel's
    torch._dynamo.reset()
    with compiled_graphs() as seen:
        out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=bm)
    assert len(seen) == 1
    assert seen[0].intervals == 1 and seen[0].vec_size == 32, seen[0].code
    want = oracle.attention(q.double(), k.double(), v.double(), mask.to_dense(B, 2, S, S))[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ISSUE_MASKS))
def test_compiled_issue_masks_take_the_interval_path(name):
    mask = ISSUE_MASKS[name]
    bm = flexmask.create_block_mask(mask, B, 1, S, S, "cpu")
    q, k, v = (torch.randn(B, 2, S, 16) for _ in range(3))
    torch._dynamo.reset()
    with compiled_graphs() as seen:
        out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=bm)
    assert seen and seen[0].intervals is not None and seen[0].vec_size == 32, seen[0].code
    want = oracle.attention(q.double(), k.double(), v.double(), mask.to_dense(B, 2, S, S))[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


def _steps(kind: str, step: int, length: int) -> flexmask.Mask:
    rng = np.random.default_rng(step)
    if kind == "documents":
        cuts = sorted(rng.choice(np.arange(1, length), size=4, replace=False).tolist())
        lens = np.diff([0, *cuts, length]).tolist()
        return flexmask.causal() & flexmask.document(lens)
    if kind == "windows":
        return flexmask.causal() & flexmask.sliding_window(int(rng.integers(1, length)))
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, length)]
    return flexmask.causal() & flexmask.tree(parents)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["documents", "windows", "trees"])
def test_twenty_steps_of_new_data_compile_once(kind):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_attention, dynamic=False)
    q = torch.randn(1, 1, S, 16)
    for step in range(20):
        bm = flexmask.create_block_mask(_steps(kind, step, S), 1, 1, S, S, "cpu")
        compiled(q, q, q, block_mask=bm)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
@pytest.mark.xfail(
    raises=torch._inductor.exc.InductorError,
    strict=True,
    reason="torch 2.13's CPU flex kernel fails to build (CppCompileError) under dynamic "
    "shapes (DESIGN-NOTES); the interval analysis itself takes [q] and [b, q] tables there",
)
def test_changing_lengths_compile_at_most_twice_under_dynamic_shapes():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_attention, dynamic=True)
    for step, length in enumerate([128, 256, 384, 512, 640] * 4):
        q = torch.randn(1, 1, length, 16)
        bm = flexmask.create_block_mask(_steps("documents", step, length), 1, 1, length, length)
        compiled(q, q, q, block_mask=bm)
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize(
    "mask",
    [
        flexmask.causal() & flexmask.document(DOCS),
        flexmask.causal() & flexmask.document([0, 30, 0, 50]),  # empty documents, padding after
        flexmask.causal() & flexmask.document([[0, 128], [7, 0, 9]]),
        (flexmask.causal() & flexmask.document(DOCS)) | flexmask.prefix([3, 0]),
    ],
    ids=repr,
)
def test_causal_documents_read_their_starts_alone(mask):
    """Under causal() a document's end is implied (its rows hold their query; past the
    documents they start at the length): ``start[q] <= kv <= q``, one table per document
    piece, as a hand-written mask_mod reads it, and the mask still (dense oracle)."""
    mod = mask.mask_mod_for(S, S)
    assert not re.search(r"kv < t\d", repr(mod)), repr(mod)  # no end read from a table
    rows = mask.rows or 1
    assert torch.equal(_dense(mod, rows, S, S), mask.to_dense(rows, 1, S, S))
    # The starts past the documents are what keeps padding rows empty without the end.
    docs = flexmask.document([30, 50])
    (start,) = (flexmask.causal() & docs).mask_mod_for(S, S).tables
    assert (start[80:] == S).all() and (start[:80] <= torch.arange(80)).all()


def test_an_end_without_its_start_or_causal_is_kept():
    """Only beside causal() and the document's own start is the end implied: a document
    alone, under a window, or negated keeps both bounds."""
    for mask in (
        flexmask.document(DOCS),
        flexmask.sliding_window(9) & flexmask.document(DOCS),
        flexmask.causal() & ~flexmask.document(DOCS),
    ):
        mod = mask.mask_mod_for(S, S)
        assert re.search(r"kv (<|>=) t1", repr(mod)), repr(mod)
        rows = mask.rows or 1
        assert torch.equal(_dense(mod, rows, S, S), mask.to_dense(rows, 1, S, S)), repr(mask)
