"""block_sparse_attention read from a flexmask Mask's structure: per-query kv intervals on
partial blocks, and plain causal handed to SDPA's ``is_causal``.

Oracles: torch's ``create_mask`` (vmap of the Mask's mask_mod, no interval code) as a dense
bool mask for SDPA, and the same call without ``mask=`` (the mask_mod path).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import flexmask
from flexmask.backends import block_sparse as block_sparse_backend
from flexmask.backends import flex as flex_backend
from flexmask.backends.block_sparse.api import block_sparse_attention
from flexmask.backends.block_sparse.grouped import interval_bounds
from flexmask.backends.dense import is_causal
from flexmask.backends.plan import make_plan

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def qkv(batch, heads, q_len, kv_len, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, 8, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(batch, heads, kv_len, 8, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(batch, heads, kv_len, 8, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v, torch.randn(batch, heads, q_len, 8, generator=gen, dtype=dtype)


def oracle(q, k, v, dense):
    """SDPA on the dense mask; rows with no key attend everywhere, then are zeroed (flex's 0)."""
    has_key = dense.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense | ~has_key)
    return out * has_key


def grads(out, grad_out, inputs):
    return torch.autograd.grad(out, inputs, grad_out)


def interval_masks(seq_len):
    third = seq_len // 3
    return {
        "causal": flexmask.causal(),
        "document-causal": flexmask.causal()
        & flexmask.document([third, third, seq_len - 2 * third]),
        "per-row documents": flexmask.causal()
        & flexmask.document([[third, seq_len - third], [seq_len - 5, 5]]),
        "window": flexmask.causal() & flexmask.sliding_window(17),
        "prefix-lm": flexmask.causal() | flexmask.prefix(third),
        "padding": flexmask.causal() & flexmask.padding([seq_len - 7, third]),
        "document": flexmask.document([5, seq_len - 5]),
    }


@pytest.mark.parametrize("name", list(interval_masks(150)))
@pytest.mark.parametrize("block_size", [(32, 32), (64, 16)])
def test_intervals_give_the_mask_mod_result(name, block_size):
    """Partial blocks from intervals: same output and gradients as the mask_mod path and as
    SDPA on torch's dense mask, fp64, lengths not multiples of the blocks, B=2, H=2."""
    seq_len = 150
    mask = interval_masks(seq_len)[name]
    assert mask.has_intervals()
    batch = mask.rows or 2
    block_mask = flexmask.create_block_mask(mask, batch, 2, seq_len, seq_len, BLOCK_SIZE=block_size)
    dense = create_mask(mask.mask_mod, batch, 1, seq_len, seq_len, device="cpu")
    q, k, v, grad_out = qkv(batch, 2, seq_len, seq_len)
    by_intervals = block_sparse_attention(q, k, v, block_mask, mask=mask, backend="sparse")
    # torch's build of the same mask_mod records no Mask: the mask_mod path.
    torch_block_mask = create_block_mask(
        mask.mask_mod, batch, 2, seq_len, seq_len, device="cpu", BLOCK_SIZE=block_size
    )
    by_mask_mod = block_sparse_attention(q, k, v, torch_block_mask, backend="sparse")
    expected = oracle(q, k, v, dense)
    torch.testing.assert_close(by_intervals, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(by_intervals, by_mask_mod, atol=1e-12, rtol=0)
    for got, want in zip(
        grads(by_intervals, grad_out, (q, k, v)), grads(expected, grad_out, (q, k, v)), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    window=st.integers(1, 60),
    q_block=st.sampled_from([8, 16, 32]),
    kv_block=st.sampled_from([8, 16, 32]),
    with_window=st.booleans(),
)
def test_bounds_equal_torch_create_mask(lengths, window, q_block, kv_block, with_window):
    """The intervals the kernel reads, as a dense mask, equal torch's create_mask everywhere."""
    seq_len = sum(lengths)
    mask = flexmask.causal() & flexmask.document(lengths)
    if with_window:
        mask = mask & flexmask.sliding_window(window)
    block_mask = flexmask.create_block_mask(
        mask, 1, 1, seq_len, seq_len, BLOCK_SIZE=(q_block, kv_block)
    )
    q, k, v, _ = qkv(1, 1, seq_len, seq_len)
    bounds = interval_bounds(mask, make_plan(q, k, v, block_mask, None, None, False, "auto"))
    lo, hi = (t.flatten(1)[:, :seq_len, None] for t in bounds)
    kv_idx = torch.arange(seq_len)
    dense = create_mask(mask.mask_mod, 1, 1, seq_len, seq_len, device="cpu")[0]
    assert torch.equal((kv_idx >= lo) & (kv_idx <= hi), dense)
    out = block_sparse_attention(q, k, v, block_mask, mask=mask, backend="sparse")
    torch.testing.assert_close(out, oracle(q, k, v, dense[None]), atol=1e-10, rtol=0)


def test_mask_without_intervals_falls_back_to_mask_mod():
    mask = flexmask.tree([-1, 0, 1, 0, 3, 3, 5] * 1 + [5] * 33)
    seq_len = 40
    assert not mask.has_intervals()
    block_mask = flexmask.create_block_mask(mask, 1, 1, seq_len, seq_len, BLOCK_SIZE=16)
    q, k, v, _ = qkv(1, 2, seq_len, seq_len)
    assert interval_bounds(mask, make_plan(q, k, v, block_mask, None, None, False, "auto")) is None
    dense = create_mask(mask.mask_mod, 1, 1, seq_len, seq_len, device="cpu")
    out = block_sparse_attention(q, k, v, block_mask, mask=mask, backend="sparse")
    torch.testing.assert_close(out, oracle(q, k, v, dense), atol=1e-10, rtol=0)


def test_mask_argument_must_be_a_flexmask_mask():
    block_mask = flexmask.create_block_mask(flexmask.causal(), 1, 1, 64, 64, BLOCK_SIZE=32)
    q, k, v, _ = qkv(1, 1, 64, 64)
    with pytest.raises(TypeError, match="mask must be the flexmask Mask"):
        block_sparse_attention(q, k, v, block_mask, mask=lambda b, h, q, kv: q >= kv)


# --- the mask argument is checked, not trusted -------------------------------------------


def _two_document_masks(seq_len):
    third = seq_len // 3
    built = flexmask.causal() & flexmask.document([third, seq_len - third])
    other = flexmask.causal() & flexmask.document([seq_len - third, third])
    return built, other


def test_a_mask_other_than_the_built_one_is_refused():
    """Without the check, partial blocks would come from the other mask's intervals: a
    silently wrong output."""
    seq_len = 120
    built, other = _two_document_masks(seq_len)
    block_mask = flexmask.create_block_mask(built, 1, 1, seq_len, seq_len, BLOCK_SIZE=32)
    q, k, v, _ = qkv(1, 2, seq_len, seq_len)
    with pytest.raises(ValueError, match="mask must be the Mask block_mask was built from"):
        block_sparse_attention(q, k, v, block_mask, mask=other, backend="sparse")
    # An equal mask (same key, another object) is the same mask.
    same = flexmask.causal() & flexmask.document([seq_len // 3, seq_len - seq_len // 3])
    out = block_sparse_attention(q, k, v, block_mask, mask=same, backend="sparse")
    dense = create_mask(built.mask_mod, 1, 1, seq_len, seq_len, device="cpu")
    torch.testing.assert_close(out, oracle(q, k, v, dense), atol=1e-10, rtol=0)


@pytest.mark.parametrize("derive", ["torch build", "to()", "slice", "mask_mod replaced", "window"])
def test_a_block_mask_with_no_record_ignores_the_mask_argument(derive):
    """A BlockMask flexmask did not build, or one torch derived from flexmask's, has nothing
    to check a mask against: the result follows its mask_mod even when a wrong mask is
    passed (trusting that mask would give its intervals, a different output)."""
    seq_len = 120
    built, other = _two_document_masks(seq_len)
    block_mask = flexmask.create_block_mask(built, 2, 1, seq_len, seq_len, BLOCK_SIZE=32)
    batch, q_offset = 2, 0
    if derive == "torch build":
        block_mask = create_block_mask(built.mask_mod, 2, 1, seq_len, seq_len, device="cpu")
    elif derive == "to()":
        block_mask = block_mask.to("cpu")
    elif derive == "slice":
        sliced, batch = block_mask[:1], 1
        sliced.mask_mod = block_mask.mask_mod  # torch resets it on a slice
        block_mask = sliced
    elif derive == "mask_mod replaced":
        block_mask.mask_mod = lambda b, h, q_idx, kv_idx: built.mask_mod(b, h, q_idx, kv_idx)
    else:  # the last 100 queries of the mask: their mask_mod is shifted
        q_offset = 20
        block_mask = flexmask.create_block_mask(
            built, 1, 1, seq_len - q_offset, seq_len, BLOCK_SIZE=32, q_offset=q_offset
        )
        batch = 1
    q, k, v, grad_out = qkv(batch, 2, seq_len - q_offset, seq_len)
    out = block_sparse_attention(q, k, v, block_mask, mask=other, backend="sparse")
    dense = create_mask(built.mask_mod, 1, 1, seq_len, seq_len, device="cpu")[:, :, q_offset:]
    expected = oracle(q, k, v, dense)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    for got, want in zip(
        grads(out, grad_out, (q, k, v)), grads(expected, grad_out, (q, k, v)), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_a_flexmask_block_mask_reads_its_own_intervals(monkeypatch):
    """No mask argument needed: the BlockMask's recorded Mask gives the intervals, so
    mask_mod is never called on the partial blocks."""
    from flexmask.backends.block_sparse import grouped as block_sparse

    def refuse(*args, **kwargs):
        raise AssertionError("mask_mod path taken")

    monkeypatch.setattr(block_sparse, "group_mask_fn", refuse)
    seq_len = 120
    built, _ = _two_document_masks(seq_len)
    block_mask = flexmask.create_block_mask(built, 1, 1, seq_len, seq_len, BLOCK_SIZE=32)
    q, k, v, _ = qkv(1, 2, seq_len, seq_len)
    out = block_sparse_attention(q, k, v, block_mask, backend="sparse")
    dense = create_mask(built.mask_mod, 1, 1, seq_len, seq_len, device="cpu")
    torch.testing.assert_close(out, oracle(q, k, v, dense), atol=1e-10, rtol=0)
    # The spy is live: a moved BlockMask records no Mask, and rows that are not intervals on
    # its partial blocks (every other key) leave mask_mod to decide.
    moved = block_mask.to("cpu")
    moved.mask_mod = lambda b, h, q_idx, kv_idx: (
        built.mask_mod(b, h, q_idx, kv_idx) & (kv_idx % 2 == 0)
    )
    with pytest.raises(AssertionError, match="mask_mod path"):
        block_sparse_attention(q, k, v, moved, backend="sparse")


def test_the_record_survives_pickling():
    import pickle

    seq_len = 96
    built, other = _two_document_masks(seq_len)
    block_mask = flexmask.create_block_mask(built, 1, 1, seq_len, seq_len, BLOCK_SIZE=32)
    clone = pickle.loads(pickle.dumps(block_mask))
    q, k, v, _ = qkv(1, 1, seq_len, seq_len)
    with pytest.raises(ValueError, match="mask must be the Mask"):
        block_sparse_attention(q, k, v, clone, mask=other)


# --- plain causal -------------------------------------------------------------------------


def torch_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def strictly_causal(b, h, q_idx, kv_idx):
    return q_idx > kv_idx  # causal's block lists, but not causal on the diagonal


def causal_by_stack(b, h, q_idx, kv_idx):
    return torch.stack([q_idx, kv_idx]).diff(dim=0).squeeze(0) <= 0  # needs vmap


def plan_of(block_mask, q_len, kv_len, heads=2):
    q, k, v, _ = qkv(1, heads, q_len, kv_len)
    return make_plan(q, k, v, block_mask, None, None, False, "auto")


@pytest.mark.parametrize(
    ("mask_mod", "q_len", "kv_len", "block_size", "heads", "expected"),
    [
        (torch_causal, 300, 300, 64, None, True),
        (torch_causal, 300, 300, (64, 32), 2, True),  # per-head lists, unequal blocks
        (causal_by_stack, 200, 200, 32, None, True),
        (strictly_causal, 300, 300, 64, None, False),
        (torch_causal, 300, 200, 64, None, False),  # SDPA's is_causal is top-left aligned
        (lambda b, h, q, kv: (q >= kv) & (q - kv < 100), 300, 300, 64, None, False),
        (lambda b, h, q, kv: (q >= kv) & (q < 290), 300, 300, 64, None, False),
    ],
)
def test_causal_is_recognised_from_the_block_mask_exactly(
    mask_mod, q_len, kv_len, block_size, heads, expected
):
    block_mask = create_block_mask(mask_mod, None, heads, q_len, kv_len, "cpu", block_size)
    assert is_causal(plan_of(block_mask, q_len, kv_len)) is expected


def test_causal_is_recognised_from_the_mask_key():
    block_mask = flexmask.create_block_mask(flexmask.causal(), 1, 1, 256, 256, BLOCK_SIZE=64)
    plan = plan_of(block_mask, 256, 256)
    assert is_causal(plan, flexmask.causal())
    assert is_causal(plan)  # and from the BlockMask alone
    # Another mask with causal's pairs on this grid is causal too (checked, not keyed); one
    # pair fewer is not.
    for window, expected in ((256, True), (255, False), (200, False)):
        mask = flexmask.causal() & flexmask.sliding_window(window)
        block_mask = flexmask.create_block_mask(mask, 1, 1, 256, 256, BLOCK_SIZE=64)
        assert is_causal(plan_of(block_mask, 256, 256), mask) is expected, window


@pytest.mark.parametrize("gqa", [False, True])
def test_causal_through_sdpa_matches_the_oracle(monkeypatch, gqa):
    """auto hands plain causal to SDPA(is_causal=True); result and gradients stay exact."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("is_causal", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    block_mask = create_block_mask(torch_causal, None, None, 700, 700, "cpu")
    q, k, v, grad_out = qkv(1, 4, 700, 700, dtype=torch.float32)
    k2, v2 = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
    kv = (k2, v2) if gqa else (k, v)
    out = block_sparse_attention(q, *kv, block_mask, enable_gqa=gqa)
    assert calls == [True]
    dense = create_mask(torch_causal, 1, 1, 700, 700, device="cpu")
    kv_dense = [t.repeat_interleave(2, dim=1) for t in kv] if gqa else kv
    expected = sdpa(q, *kv_dense, attn_mask=dense)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    for got, want in zip(
        grads(out, grad_out, (q, *kv)), grads(expected, grad_out, (q, *kv)), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_flex_attention_passes_the_mask_behind_a_handle_or_expression(monkeypatch):
    seen = []
    inner = block_sparse_backend.block_sparse_attention

    def spy(*args, mask=None, **kwargs):
        seen.append(mask)
        return inner(*args, mask=mask, **kwargs)

    monkeypatch.setattr(block_sparse_backend, "block_sparse_attention", spy)
    mask = flexmask.causal() & flexmask.document([100, 156])
    q, k, v, _ = qkv(1, 2, 256, 256)
    handle = flexmask.lazy(mask, 1, 1, 256, 256)
    block_mask = flexmask.create_block_mask(mask, 1, 1, 256, 256)
    # threads=: a block-sparse option, so the slices backend (asked first) leaves it the call.
    outs = [
        flexmask.flex_attention(q, k, v, block_mask=m, compile=False, threads=1)
        for m in (mask, handle, block_mask)
    ]
    assert seen == [mask, mask, None]
    dense = create_mask(mask.mask_mod, 1, 1, 256, 256, device="cpu")
    for out in outs:
        torch.testing.assert_close(out, oracle(q, k, v, dense), atol=1e-10, rtol=0)


def test_no_grad_cpu_call_compiles_only_when_asked(monkeypatch):
    """No 20-40 s compile for a CPU call that a CPU backend takes (every one: the order of
    flex_attention and attention("auto") puts them first, measured faster), whatever
    compile says; where flex runs (asked for by name), compile, set_compile and
    FLEXMASK_COMPILE decide whether it is compiled."""
    compiled_calls = []

    def fake_compiled():
        def run(q, k, v, **kwargs):
            compiled_calls.append(kwargs["block_mask"])
            return torch.zeros_like(q)

        return run

    monkeypatch.setattr(flex_backend, "compiled_flex_attention", fake_compiled)
    monkeypatch.delenv("FLEXMASK_COMPILE", raising=False)
    mask = flexmask.causal() & flexmask.document([60, 68])
    q, k, v, _ = qkv(1, 2, 128, 128)
    dense = create_mask(mask.mask_mod, 1, 1, 128, 128, device="cpu")
    try:
        with torch.no_grad():
            flexmask.set_compile(None)
            for compile in (None, True, False):
                out = flexmask.flex_attention(q, k, v, block_mask=mask, compile=compile)
                torch.testing.assert_close(out, oracle(q, k, v, dense), atol=1e-10, rtol=0)
            monkeypatch.setenv("FLEXMASK_COMPILE", "1")
            flexmask.flex_attention(q, k, v, block_mask=mask)
            assert compiled_calls == []
            flexmask.attention(q, k, v, mask, "flex")
            assert len(compiled_calls) == 1
            monkeypatch.delenv("FLEXMASK_COMPILE")
            flexmask.set_compile(True)
            flexmask.attention(q, k, v, mask, "flex")
            flexmask.set_compile(None)
            flexmask.attention(q, k, v, mask, "flex", compile=True)
            assert len(compiled_calls) == 3
            with pytest.raises(ValueError, match="compile is off"):
                flexmask.attention(q, k, v, mask, "flex")
    finally:
        flexmask.set_compile(None)


def test_dense_masks_go_to_sdpa_and_sparse_ones_stay():
    """Half the blocks listed is the line: ~36% stays sparse, ~59% goes to SDPA."""
    from flexmask.backends.dense import SDPA_MIN_DENSITY, choose_backend

    for mask, expected in (
        (flexmask.causal() & flexmask.sliding_window(700), "sparse"),
        (flexmask.causal() | flexmask.prefix(700), "sdpa"),
    ):
        block_mask = flexmask.create_block_mask(mask, 1, 1, 2048, 2048)
        listed = 1 - block_mask.sparsity() / 100
        assert (listed >= SDPA_MIN_DENSITY) == (expected == "sdpa"), listed
        assert choose_backend(plan_of(block_mask, 2048, 2048), mask) == expected


def test_a_small_forward_without_gradients_goes_to_sdpa():
    """Without gradients SDPA takes rows up to SDPA_MAX_PAIRS_NO_GRAD pairs; with them the
    same sparse mask stays on the sparse kernel, and past the bound both stay sparse."""
    from flexmask.backends.dense import SDPA_MAX_PAIRS_NO_GRAD, choose_backend

    mask = flexmask.causal() & flexmask.sliding_window(100)
    for n, no_grad in ((1024, "sdpa"), (2048, "sparse")):
        assert (n * n <= SDPA_MAX_PAIRS_NO_GRAD) == (no_grad == "sdpa")
        plan = plan_of(flexmask.create_block_mask(mask, 1, 1, n, n), n, n)
        assert choose_backend(plan, mask, needs_grad=False) == no_grad
        assert choose_backend(plan, mask, needs_grad=True) == "sparse"
    # Through the call: the same inputs, with and without gradients, agree with SDPA on the
    # dense mask either way (the path differs, the result does not).
    q, k, v = (torch.randn(1, 2, 1024, 16) for _ in range(3))
    dense = mask.to_dense(1, 1, 1024, 1024)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    with torch.no_grad():
        out = flexmask.flex_attention(q, k, v, mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
