"""The slices backend (torch's CPU flash kernel once per MagiAttention slice) against attention
written plainly from the oracle's dense masks: outputs, gradients and log-sum-exps, on random
expressions with B and H > 1, odd and unequal lengths, grouped heads; and every refusal named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

import flexmask
from flexmask import backends
from flexmask.backends import slices
from flexmask.formats.magi import MagiMask
from tests import oracle
from tests.strategies import expressions
from tests.test_build_pickle import ROUND_TRIPS
from tests.test_formats import magi_dense


def qkv(batch, q_heads, kv_heads, q_len, kv_len, dtype=torch.float64, seed=0, dim=8):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, q_heads, q_len, dim), (batch, kv_heads, kv_len, dim)]
    shapes.append(shapes[1])
    return [torch.randn(s, dtype=dtype, generator=gen).requires_grad_(True) for s in shapes]


@pytest.fixture
def every_lowering(monkeypatch):
    """The cost rule off: every mask the kernel can mask is taken, however small its slices;
    banded slices cut every 5 queries, so short lengths cross call edges too."""
    monkeypatch.setattr(slices, "MIN_ROWS_PER_CALL", 1)
    monkeypatch.setattr(slices, "BAND_ROWS", 5)
    slices._lowered.cache_clear()
    yield
    slices._lowered.cache_clear()


def check(mask, dense, batch, q_heads, kv_heads, q_len, kv_len, scale=None):
    q, k, v = qkv(batch, q_heads, kv_heads, q_len, kv_len)
    try:
        out = flexmask.attention(
            q, k, v, mask, "slices", enable_gqa=q_heads != kv_heads, scale=scale
        )
    except ValueError as err:
        return str(err)
    allowed = torch.from_numpy(np.asarray(dense)).expand(batch, q_heads, q_len, kv_len)
    ref, _ = oracle.attention(q, k, v, allowed, scale)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0, msg=f"grad of {name}")
    return None


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1)]),
    q_len=st.integers(1, 70),
    kv_len=st.integers(1, 70),
)
def test_equals_dense_attention_or_refuses(every_lowering, data, batch, heads, q_len, kv_len):
    q_heads, kv_heads = heads
    length = max(q_len, kv_len)
    mask, dense = data.draw(expressions(batch, q_heads, length, max_leaves=3))
    want = dense(length, length)[:, :, :q_len, :kv_len]
    refused = check(mask, want, batch, q_heads, kv_heads, q_len, kv_len)
    if refused is not None:
        # Refused only for a reason it names: heads that differ, or a mask_mod leaf (no
        # structure to lower).
        assert any(why in refused for why in ("heads", "from_mask_mod", "mask_mod")), refused


S = 301  # odd: no slice boundary sits on a block edge

STRUCTURED = {
    "rl-tree": (
        flexmask.tree(
            [-1, *range(99), *([40] + list(range(100, 170))), *([99] + list(range(171, 300)))]
        ),
        oracle.tree(
            [-1, *range(99), *([40] + list(range(100, 170))), *([99] + list(range(171, 300)))], S, S
        ),
    ),
    "documents-padding-per-row": (
        flexmask.causal()
        & flexmask.document([[90, 113, 98], [50, 60, 70]])
        & flexmask.padding([290, 170]),
        np.stack(
            [
                oracle.causal(S, S)
                & oracle.document([90, 113, 98], S, S)
                & oracle.padding(290, S, S),
                oracle.causal(S, S)
                & oracle.document([50, 60, 70], S, S)
                & oracle.padding(170, S, S),
            ]
        )[:, None],
    ),
    # Row 1 attends nothing: no call touches its queries or keys (output and gradients 0).
    "a-row-attending-nothing": (
        flexmask.causal() & flexmask.document([[100, 201], [S]]) & flexmask.padding([S, 0]),
        np.stack([oracle.causal(S, S) & oracle.document([100, 201], S, S), np.zeros((S, S), bool)])[
            :, None
        ],
    ),
    "prefix-lm": (
        flexmask.causal() | flexmask.prefix(77),
        oracle.causal(S, S) | oracle.prefix(77, S, S),
    ),
    "sliding-window": (
        flexmask.causal() & flexmask.sliding_window(37),
        oracle.causal(S, S) & oracle.sliding_window(37, S, S),
    ),
    "window-in-documents": (
        flexmask.causal() & flexmask.document([150, 151]) & flexmask.sliding_window(130),
        oracle.causal(S, S) & oracle.document([150, 151], S, S) & oracle.sliding_window(130, S, S),
    ),
    "anti-causal": (~flexmask.causal(), ~oracle.causal(S, S)),
    # One kernel call for every query (the unmerged fast path), and no mask at all.
    "causal": (flexmask.causal(), oracle.causal(S, S)),
    "full": (flexmask.full(), np.ones((S, S), dtype=bool)),
    "bidirectional-documents": (
        flexmask.document([100, 1, 200]),
        oracle.document([100, 1, 200], S, S),
    ),
}


@pytest.mark.parametrize("case", sorted(STRUCTURED))
@pytest.mark.parametrize("lens", [(S, S), (S, 120), (120, S)])
def test_structured_masks_are_taken_and_exact(case, lens):
    """Documents, an RL tree and a prefix-LM are never refused at the default cost rule, at
    equal and unequal lengths (causal slices then bottom-right aligned in Magi's form)."""
    mask, dense = STRUCTURED[case]
    q_len, kv_len = lens
    want = np.asarray(dense)[..., :q_len, :kv_len]
    assert check(mask, want, 2, 4, 2, q_len, kv_len, scale=0.3) is None


def test_lse_without_gradients_and_empty_rows():
    """return_lse gives flex's lse: natural log, -inf (and output 0) where a row attends
    nothing; with gradients it is refused (the lse is not differentiated here)."""
    mask = flexmask.causal() & flexmask.document([40, 50]) & flexmask.padding(70)
    q, k, v = qkv(2, 2, 2, 96, 96)
    allowed = torch.from_numpy(
        oracle.causal(96, 96) & oracle.document([40, 50], 96, 96) & oracle.padding(70, 96, 96)
    )
    with torch.no_grad():
        out, lse = flexmask.attention(q, k, v, mask, "slices", return_lse=True)
        ref, ref_lse = oracle.attention(q, k, v, allowed)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)
    assert torch.isneginf(lse[..., 70:]).all() and (out[..., 70:, :] == 0).all()
    choice = flexmask.explain(q, k, v, mask, "slices", return_lse=True)
    assert choice.backend == "" and "without gradients" in choice.refused["slices"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_close_to_float64(dtype):
    mask = flexmask.tree([-1, *range(63), *([20] + list(range(64, 127)))])
    allowed = torch.from_numpy(
        oracle.tree([-1, *range(63), *([20] + list(range(64, 127)))], 128, 128)
    )
    q, k, v = qkv(1, 2, 2, 128, 128, dim=16)
    ref, _ = oracle.attention(q, k, v, allowed)
    low = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    out = flexmask.attention(*low, mask, "slices")
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    out.sum().backward()
    assert all(x.grad is not None and x.grad.dtype == dtype for x in low)


def test_refusals_name_their_reason():
    q, k, v = qkv(1, 2, 2, 256, 256)
    cases = {
        "fewer than": dict(mask=flexmask.causal() & flexmask.document([4] * 64)),
        "takes no option ['threads']": dict(mask=flexmask.causal(), threads=1),
        "score_mod": dict(mask=flexmask.causal(), score_mod=lambda s, b, h, qi, ki: s),
        "BlockMask without one": dict(
            mask=create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 256, 256, "cpu")
        ),
    }
    for why, kwargs in cases.items():
        mask = kwargs.pop("mask")
        choice = flexmask.explain(q, k, v, mask, "slices", **kwargs)
        assert choice.backend == "" and why in choice.refused["slices"], (why, choice)
        with pytest.raises(ValueError, match="slices"):
            flexmask.attention(q, k, v, mask, "slices", **kwargs)


def test_flexmask_built_block_mask_and_handle_are_lowered():
    """A BlockMask flexmask built knows its Mask; a handle carries it: both lower."""
    mask = flexmask.causal() & flexmask.document([100, 156])
    q, k, v = qkv(1, 2, 2, 256, 256)
    built = flexmask.create_block_mask(mask, 1, 1, 256, 256, device="cpu")
    handle = flexmask.lazy(mask, 1, 2, 256, 256, device="cpu")
    for given_mask in (built, handle, mask):
        assert flexmask.explain(q, k, v, given_mask).backend == "slices"


def test_flex_attention_on_cpu_runs_slices_for_a_tree(monkeypatch):
    """flexmask.flex_attention asks the table in order: on the CPU with gradients the slices
    backend takes an RL tree; a call with a block-sparse option goes to block_sparse."""
    mask, dense = STRUCTURED["rl-tree"]
    q, k, v = qkv(1, 2, 2, S, S)
    calls = []
    real = slices.attend
    monkeypatch.setattr(slices, "attend", lambda request: calls.append(1) or real(request))
    out = flexmask.flex_attention(q, k, v, block_mask=mask)
    ref, _ = oracle.attention(q, k, v, torch.from_numpy(dense))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert calls == [1]
    flexmask.flex_attention(q, k, v, block_mask=mask, threads=1)
    assert calls == [1]
    assert backends.TABLE["slices"] is slices


@settings(max_examples=200, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), q_len=st.integers(1, 12), kv_len=st.integers(1, 12))
def test_kernel_calls_mask_what_magis_slices_mean(data, batch, q_len, kv_len):
    """Random Magi slices of all four types (any key count: more, equal or fewer keys than
    queries) become calls of torch's kernel whose top-left causal geometry and band masks
    cover exactly the pairs Magi's documented geometry does (``magi_dense`` in
    test_formats), with banded slices cut into calls of 3 queries."""
    q_rows, k_rows, types = [], [], []
    for b in range(batch):
        for _ in range(data.draw(st.integers(0, 2))):
            qs = data.draw(st.integers(0, q_len - 1))
            qe = data.draw(st.integers(qs + 1, q_len))
            ks = data.draw(st.integers(0, kv_len - 1))
            ke = data.draw(st.integers(ks + 1, kv_len))
            q_rows.append((b * q_len + qs, b * q_len + qe))
            k_rows.append((b * kv_len + ks, b * kv_len + ke))
            types.append(data.draw(st.sampled_from([0, 1, 2, 3])))
    if not types:
        return
    i32 = torch.int32
    magi = MagiMask(
        torch.tensor(q_rows, dtype=i32).view(-1, 2),
        torch.tensor(k_rows, dtype=i32).view(-1, 2),
        torch.tensor(types, dtype=i32),
        q_len,
        kv_len,
        batch * q_len,
        batch * kv_len,
    )
    # Pairs covered twice are not a slice list to_magi makes; count them on both sides.
    want = np.zeros((batch, q_len, kv_len), dtype=int)
    for one in range(len(types)):
        single = MagiMask(
            magi.q_ranges[one : one + 1],
            magi.k_ranges[one : one + 1],
            magi.attn_type_map[one : one + 1],
            q_len,
            kv_len,
            batch * q_len,
            batch * kv_len,
        )
        want += magi_dense(single, batch, q_len, kv_len)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slices, "BAND_ROWS", 3)
        calls = slices.kernel_calls(magi, q_len, kv_len, per_row=True)
    got = np.zeros_like(want)
    for row, qs, qe, ks, ke, causal, band in calls:
        a = np.arange(qe - qs)[:, None]
        b = np.arange(ke - ks)[None, :]
        block = np.ones((qe - qs, ke - ks), dtype=bool)
        if causal:  # torch's kernel: top-left aligned
            block &= b <= a
        if band is not None:  # the band mask: from the query's own column, band keys wide
            block &= (b >= a) & ((band == 0) | (b <= a + band - 1))
        # Every query of a call sees a key: a row of -inf alone would be NaN in the kernel.
        assert block.any(axis=1).all(), (row, qs, qe, ks, ke, causal, band)
        got[row, qs:qe, ks:ke] += block
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("busy", [True, False])
def test_one_intra_op_thread_while_other_processes_keep_a_core_busy(monkeypatch, busy):
    """Under contention every kernel call (forward and backward) runs on one intra-op thread
    and torch's count comes back after; on free cores torch's threads run them."""
    threads_seen = []
    forward_op, backward_op = slices._flash_ops()

    def spy(op):
        def call(*args, **kwargs):
            threads_seen.append(torch.get_num_threads())
            return op(*args, **kwargs)

        return call

    monkeypatch.setattr(slices, "others_busy", lambda: busy)
    monkeypatch.setattr(slices, "_flash_ops", lambda: (spy(forward_op), spy(backward_op)))
    before = torch.get_num_threads()
    q, k, v = qkv(1, 2, 2, 64, 64)
    flexmask.attention(
        q, k, v, flexmask.causal() & flexmask.document([30, 34]), "slices"
    ).sum().backward()
    assert len(threads_seen) == 4  # two documents, forward and backward
    assert set(threads_seen) == ({1} if busy else {before})
    assert torch.get_num_threads() == before


def test_a_mask_runs_without_building_its_block_mask():
    """A Mask passed to flexmask.attention builds no BlockMask where the slices backend runs
    (it lowers the Mask itself); the block-sparse path, which reads one, builds it."""
    mask = flexmask.causal() & flexmask.document([150, 151])
    q, k, v = qkv(1, 2, 2, S, S)
    flexmask.cache_clear()
    out = flexmask.attention(q, k, v, mask)
    assert flexmask.explain(q, k, v, mask).backend == "slices"
    assert flexmask.cache_info().misses == 0 and flexmask.cache_info().entries == 0
    same = flexmask.attention(q, k, v, mask, "block_sparse")
    assert flexmask.cache_info().misses == 1
    torch.testing.assert_close(out, same, atol=1e-10, rtol=0)


def test_transposed_views_one_input_with_grad_and_inference_mode():
    """(B, S, H, D) tensors transposed to (B, H, S, D) views, as models pass them; a gradient
    for the query alone; and a call under inference_mode."""
    parents = [-1, *range(63), *([20] + list(range(64, 127)))]
    mask, allowed = flexmask.tree(parents), torch.from_numpy(oracle.tree(parents, 128, 128))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, 128, 4, 16, dtype=torch.float64, generator=gen).transpose(1, 2)
        for _ in range(3)
    )
    q.requires_grad_(True)
    out = flexmask.attention(q, k, v, mask, "slices")
    ref, _ = oracle.attention(q, k, v, allowed)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    grad = torch.randn_like(out)
    (got,), (want,) = torch.autograd.grad(out, q, grad), torch.autograd.grad(ref, q, grad)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    with torch.inference_mode():
        again = flexmask.attention(q.detach(), k, v, mask, "slices")
    torch.testing.assert_close(again, ref.detach(), atol=1e-10, rtol=0)


def test_a_torch_without_the_flash_ops_refuses_and_block_sparse_runs(monkeypatch):
    """This torch has the private ops with the arguments the backend passes; a torch
    without them (or with other ones) gets a refusal, and flex_attention the block-sparse
    path, never a failing call."""
    assert slices._flash_ops() is not None
    monkeypatch.setattr(slices, "_flash_ops", lambda: None)
    mask, dense = STRUCTURED["rl-tree"]
    q, k, v = qkv(1, 2, 2, S, S)
    choice = flexmask.explain(q, k, v, mask)
    assert (
        choice.backend == "block_sparse" and "flash_attention_for_cpu" in choice.refused["slices"]
    )
    out = flexmask.flex_attention(q, k, v, block_mask=mask)
    ref, _ = oracle.attention(q, k, v, torch.from_numpy(dense))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


EDITS = {
    "a full block dropped": lambda bm: bm.full_kv_num_blocks[0, 0, 3].zero_(),
    "a partial block dropped": lambda bm: bm.kv_num_blocks[0, 0, 1].sub_(1),
    "indices set to another tensor": lambda bm: setattr(
        bm, "kv_indices", bm.kv_indices.flip(-1).contiguous()
    ),
}


@pytest.mark.parametrize("made", ["create_block_mask", "handle"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_block_mask_edited_in_place_attends_its_blocks_not_its_mask(made, edit):
    """torch code may edit a BlockMask's tensors (drop blocks, swap indices); what is then
    attended is what its blocks say, as torch's kernel reads them. The slices backend lowers
    the Mask a BlockMask was built from, so it must not take an edited one: the block-sparse
    path, which reads the blocks, does — for a BlockMask and for a built handle alike."""
    mask = flexmask.causal() & flexmask.document([100, 156])
    element = oracle.causal(256, 256) & oracle.document([100, 156], 256, 256)
    if made == "handle":
        given = flexmask.lazy(
            mask, 1, 1, 256, 256, "cpu", BLOCK_SIZE=64, cache=flexmask.MaskCache()
        )
        built = given.block_mask
    else:
        given = built = flexmask.create_block_mask(mask, 1, 1, 256, 256, BLOCK_SIZE=64)
    q, k, v = qkv(1, 2, 2, 256, 256)
    assert flexmask.explain(q, k, v, given).backend == "slices"  # unedited: its Mask
    EDITS[edit](built)
    choice = flexmask.explain(q, k, v, given)
    assert choice.backend == "block_sparse" and "edited in place" in choice.refused["slices"]
    allowed = oracle.block_mask_meaning(built, 1, 2, 256, 256, torch.from_numpy(element))
    assert (allowed != torch.from_numpy(element)).any()  # the edit changed what is attended
    ref, _ = oracle.attention(q, k, v, allowed)
    out = flexmask.flex_attention(q, k, v, block_mask=given)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for backend in ("block_sparse", "sdpa"):  # each reads the blocks, with or without the Mask
        out = flexmask.attention(q, k, v, given, backend)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=0, msg=backend)


@pytest.mark.parametrize("round_trip", sorted(ROUND_TRIPS))
def test_a_copied_block_mask_is_lowered_until_edited(round_trip):
    """A pickled, saved or deep-copied BlockMask flexmask built still lowers to slices (its
    record names the copy's own tensors); an edit of the copy, or of the original before
    copying, sends it to the path that reads its blocks."""
    mask = flexmask.causal() & flexmask.document([100, 156])
    element = oracle.causal(256, 256) & oracle.document([100, 156], 256, 256)
    q, k, v = qkv(1, 2, 2, 256, 256)
    copy = ROUND_TRIPS[round_trip]
    built = flexmask.create_block_mask(mask, 1, 1, 256, 256, BLOCK_SIZE=64)
    restored = copy(built)
    assert flexmask.explain(q, k, v, restored).backend == "slices"
    EDITS["a full block dropped"](restored)
    assert flexmask.explain(q, k, v, restored).backend == "block_sparse"
    out = flexmask.flex_attention(q, k, v, block_mask=restored)
    allowed = oracle.block_mask_meaning(restored, 1, 2, 256, 256, torch.from_numpy(element))
    torch.testing.assert_close(out, oracle.attention(q, k, v, allowed)[0], atol=1e-10, rtol=0)
    EDITS["a partial block dropped"](built)  # edited before copying: no copy is intact
    assert flexmask.explain(q, k, v, copy(built)).backend == "block_sparse"


@settings(max_examples=200, deadline=None)
@given(
    spans=st.lists(
        st.tuples(st.sampled_from([None, 0, 1]), st.integers(0, 40), st.integers(1, 20)),
        max_size=12,
    )
)
def test_first_touch_and_gaps_against_a_coverage_array(spans):
    """Which calls write (no earlier call of their row overlaps them) and what is left to
    zero, checked against a plain per-position record of what earlier spans covered."""
    spans = [(row, start, start + size) for row, start, size in spans]
    length = 60
    first = slices._first_touch(spans)
    covered: dict = {}
    for (row, start, end), is_first in zip(spans, first, strict=True):
        seen = covered.setdefault(row, np.zeros(length, bool))
        assert is_first == (not seen[start:end].any())
        seen[start:end] = True
    rows = sorted({row for row, _, _ in spans} | {0}, key=lambda r: -1 if r is None else r)
    written = [s for s, f in zip(spans, first, strict=True) if f]
    gaps = slices._gaps(rows, length, written)
    for row in rows:
        want = np.ones(length, bool)
        for r, start, end in written:
            if r == row:
                want[start:end] = False
        got = np.zeros(length, bool)
        for r, start, end in gaps:
            if r == row:
                assert start < end and not got[start:end].any()
                got[start:end] = True
        assert (got == want).all()
