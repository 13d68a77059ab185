"""Inference masks against independent oracles: torch's create_block_mask of the shifted
mask_mod, the dense reference (tests/oracle.py) on the window, and a model run without cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexmask
from tests import oracle
from tests.strategies import expressions, interval_intersections

BLOCKS = st.sampled_from([16, 32, 64, (16, 32), (32, 16)])


def _window(dense_full: np.ndarray, lens, q_len: int) -> np.ndarray:
    """Rows [lens[b], lens[b] + q_len) of row b of a (B, H, S, S) dense mask."""
    return np.stack([dense_full[b, :, n : n + q_len] for b, n in enumerate(lens)])


def _draw_window(data, batch, capacity):
    q_len = data.draw(st.integers(1, capacity))
    lens = [data.draw(st.integers(0, capacity - q_len)) for _ in range(batch)]
    return q_len, lens


@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.integers(1, 2),
    capacity=st.integers(1, 300),
    block=BLOCKS,
)
def test_decode_mask_equals_torch_and_the_dense_window(data, batch, heads, capacity, block):
    mask, dense = data.draw(expressions(batch, heads, capacity))
    q_len, lens = _draw_window(data, batch, capacity)
    ours = flexmask.decode_mask(mask, lens, q_len, capacity, heads=heads, block_size=block)
    context = f"{mask!r} lens={lens} q_len={q_len}"
    theirs = oracle.torch_build(
        mask.mask_mod_for(capacity, capacity),
        len(lens),
        heads,
        q_len,
        capacity,
        block,
        q_offset=lens,
    )
    oracle.assert_same_block_mask(ours, theirs, context)
    reference = oracle.torch_build(_window(dense(capacity, capacity), lens, q_len), block=block)
    oracle.assert_same_block_mask(ours, reference, context)
    # The mask_mod takes local query indices.
    local = torch.arange(q_len).view(1, 1, -1, 1)
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    got = ours.mask_mod(b, h, local, torch.arange(capacity).view(1, 1, 1, -1))
    expected = _window(dense(capacity, capacity), lens, q_len)
    assert np.array_equal(got.expand(expected.shape).numpy(), expected), context


@settings(max_examples=12)
@given(data=st.data(), batch=st.integers(1, 3), capacity=st.integers(16, 400), block=BLOCKS)
def test_chunked_prefill_windows_of_closed_form_masks(data, batch, capacity, block):
    mask, dense = data.draw(interval_intersections(batch, capacity))
    chunk = data.draw(st.integers(max(1, capacity // 5), capacity))  # not a block multiple
    full = np.repeat(dense(capacity, capacity)[:, None], 1, axis=1)
    for start in range(0, capacity - chunk + 1, chunk):
        ours = flexmask.decode_mask(mask, [start] * batch, chunk, capacity, block_size=block)
        reference = oracle.torch_build(_window(full, [start] * batch, chunk), block=block)
        oracle.assert_same_block_mask(ours, reference, f"{mask!r} start={start} chunk={chunk}")


@settings(max_examples=8)
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    capacity=st.integers(8, 300),
    block=st.sampled_from([16, 32, (32, 16)]),
    q_len=st.integers(1, 12),
)
def test_decode_steps_append_or_build_equal_fresh_builds(data, batch, capacity, block, q_len):
    lens = [data.draw(st.integers(0, max(0, capacity - q_len - 12))) for _ in range(batch)]
    q_len = min(q_len, capacity - max(lens))
    with_docs = flexmask.causal() & flexmask.document([[n + 1, capacity - n - 1] for n in lens])
    for mask in (flexmask.causal(), with_docs):
        steps = flexmask.DecodeMasks(mask, lens, capacity, q_len=q_len, block_size=block)
        current = list(lens)
        for _ in range(min(12, capacity - max(lens) - q_len)):
            step = [data.draw(st.integers(0, 1)) for _ in range(batch)]
            current = [n + s for n, s in zip(current, step, strict=True)]
            got = steps.at(current)
            assert steps.cache_lens == got.cache_lens == current
            expected = oracle.torch_build(
                mask.mask_mod_for(capacity, capacity),
                len(current),
                1,
                q_len,
                capacity,
                block,
                q_offset=current,
            )
            oracle.assert_same_block_mask(got.block_mask, expected, f"{mask!r} lens={current}")
        q_block = block if isinstance(block, int) else block[0]
        if q_len < q_block:  # one incomplete q block: causal and documents append or reuse
            assert steps.builds == 1  # every later step reused the BlockMask
        else:
            assert steps.appends == steps.reuses == 0


def test_append_happens_only_at_block_boundaries():
    steps = flexmask.DecodeMasks(flexmask.causal(), [60, 10], capacity=256, block_size=64)
    before = steps.block_mask
    for _ in range(10):
        assert steps.advance() is before
    # Only row 0's step from 63 to 64 enters a new kv block.
    assert (steps.builds, steps.appends, steps.reuses) == (1, 1, 9)
    assert steps.block_mask.kv_num_blocks.flatten().tolist() == [2, 1]
    forced = flexmask.DecodeMasks(
        flexmask.causal(), [69, 19], capacity=256, block_size=64, append=False
    )
    assert forced.at([70, 20]).block_mask is not before and forced.builds == 2
    oracle.assert_same_block_mask(steps.block_mask, forced.block_mask)


def test_advance_before_the_first_step_raises():
    # The old misuse: the constructor holds step 0 and advance() moves first, so a loop that
    # calls advance() before each step fed the query at 126 the mask of position 127.
    steps = flexmask.DecodeMasks(flexmask.causal(), [126, 3], capacity=512)
    with pytest.raises(RuntimeError, match=r"skip step 0, whose queries sit at \[126, 3\]"):
        steps.advance()
    assert steps.cache_lens == [126, 3]  # nothing moved
    # Read first, then advance: the old correct loop still works.
    first = steps.block_mask
    oracle.assert_same_block_mask(
        first,
        oracle.torch_build(
            flexmask.causal().mask_mod_for(512, 512),
            len([126, 3]),
            1,
            1,
            512,
            128,
            q_offset=[126, 3],
        ),
    )
    got = steps.advance()
    expected = oracle.torch_build(
        flexmask.causal().mask_mod_for(512, 512), len([127, 4]), 1, 1, 512, 128, q_offset=[127, 4]
    )
    oracle.assert_same_block_mask(got, expected)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("with_docs", [False, True])
def test_iteration_gives_every_position_once_from_the_first(q_len, with_docs):
    capacity, lens, block = 70, [40, 29], 16
    mask = flexmask.causal()
    if with_docs:
        mask = mask & flexmask.document([[35, 35], [10, 60]])
    steps = flexmask.DecodeMasks(mask, lens, capacity, q_len=q_len, block_size=block)
    seen = []
    for step in steps:
        seen.append(step.cache_lens)
        assert step.index == len(seen) - 1
        assert step.positions == [range(n, n + q_len) for n in step.cache_lens]
        expected = oracle.torch_build(
            mask.mask_mod_for(capacity, capacity),
            len(step.cache_lens),
            1,
            q_len,
            capacity,
            block,
            q_offset=step.cache_lens,
        )
        oracle.assert_same_block_mask(step.block_mask, expected, repr(step))
        if len(seen) == 3:
            break
    for step in steps:  # resumes after the last step given: no position twice
        seen.append(step.cache_lens)
        oracle.assert_same_block_mask(
            step.block_mask,
            oracle.torch_build(
                mask.mask_mod_for(capacity, capacity),
                len(step.cache_lens),
                1,
                q_len,
                capacity,
                block,
                q_offset=step.cache_lens,
            ),
        )
    # Every row moved q_len per step, from the constructor's lengths until the cache is full.
    count = (capacity - max(lens) - q_len) // q_len + 1
    assert seen == [[n + k * q_len for n in lens] for k in range(count)]
    assert list(steps) == []


def test_a_stale_step_raises_and_steps_show_their_positions():
    steps = flexmask.DecodeMasks(flexmask.causal(), [126, 3], capacity=512, block_size=64)
    first = steps.at([126, 3])
    assert repr(first) == "DecodeStep(0: queries at [126, 3], q_len=1, capacity=512, build)"
    second = steps.at([128, 9])
    assert repr(second) == "DecodeStep(1: queries at [128, 9], q_len=1, capacity=512, append)"
    assert "queries at [128, 9]" in repr(steps)
    # The append path rewrote the one BlockMask: the first step's would now be position 128's.
    with pytest.raises(RuntimeError, match=r"stale: .* moved on to queries at \[128, 9\]"):
        _ = first.block_mask
    assert second.block_mask is steps.block_mask
    chunk = flexmask.DecodeMasks(flexmask.causal(), 0, capacity=64, q_len=40, block_size=16)
    assert "queries at [0-39]" in repr(next(iter(chunk)))


@settings(max_examples=10)
@given(data=st.data(), batch=st.integers(1, 3), block=st.sampled_from([16, 32, (16, 8)]))
def test_at_any_lengths_equals_a_fresh_build(data, batch, block):
    # Forward, in place, far ahead or back (a slot reused by a new request), per row.
    capacity = 150
    mask = flexmask.causal()
    first = [data.draw(st.integers(0, capacity - 1)) for _ in range(batch)]
    steps = flexmask.DecodeMasks(mask, first, capacity, block_size=block)
    for _ in range(6):
        lens = [data.draw(st.integers(0, capacity - 1)) for _ in range(batch)]
        step = steps.at(lens)
        oracle.assert_same_block_mask(
            step.block_mask,
            oracle.torch_build(
                mask.mask_mod_for(capacity, capacity),
                len(lens),
                1,
                1,
                capacity,
                block,
                q_offset=lens,
            ),
            repr(step),
        )
    assert steps.builds == 1


def test_speculative_tree_is_prefix_plus_draft_ancestors():
    prefix, draft = 5, [-1, 0, 1, -1, 3, 0]
    mask = flexmask.speculative_tree(prefix, draft)
    parents = list(range(-1, prefix - 1)) + [prefix - 1 if p < 0 else p + prefix for p in draft]
    n, capacity = prefix + len(draft), 16
    expected = oracle.tree(parents, capacity, capacity)
    assert np.array_equal(mask.to_dense(1, 1, capacity, capacity)[0, 0].numpy(), expected)
    # Verified in one step: the draft's rows of that mask, from the cache of the prefix.
    bm = flexmask.decode_mask(mask, prefix, len(draft), capacity, block_size=4)
    window = expected[None, None, prefix:n]
    oracle.assert_same_block_mask(bm, oracle.torch_build(window, block=4))
    per_row = flexmask.speculative_tree([3, 4], [[-1, 0], [-1, -1, 1]])
    assert per_row.rows == 2
    dense = per_row.to_dense(2, 1, 8, 8)[:, 0].numpy()
    assert np.array_equal(dense[0], oracle.tree([-1, 0, 1, 2, 3], 8, 8))
    assert np.array_equal(dense[1], oracle.tree([-1, 0, 1, 2, 3, 3, 5], 8, 8))


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: flexmask.decode_mask(flexmask.causal(), [10, 5], 4, 12), ValueError, "capacity"),
        (lambda: flexmask.decode_mask(flexmask.causal(), [-1], 1, 12), ValueError, "cache_lens"),
        (lambda: flexmask.decode_mask(flexmask.causal(), [1], 0, 12), ValueError, "q_len"),
        (lambda: flexmask.decode_mask(flexmask.causal(), 1.5, 1, 12), TypeError, "cache_lens"),
        (lambda: flexmask.decode_mask(flexmask.causal().mask_mod, 1), TypeError, "mask"),
        (
            lambda: flexmask.decode_mask(flexmask.document([[2, 3], [5]]), [1, 2, 3], 1, 8),
            ValueError,
            "rows",
        ),
        (lambda: flexmask.DecodeMasks(flexmask.causal(), [3], 4).at(4), ValueError, "q_len"),
        (lambda: flexmask.DecodeMasks(flexmask.causal(), [3, 1], 9).at([1]), ValueError, "rows"),
        (lambda: flexmask.DecodeMasks(flexmask.causal(), [3], 9).at(-1), ValueError, "cache_lens"),
        (lambda: flexmask.DecodeMasks(flexmask.causal(), [3], 9).advance(-1), ValueError, "step"),
        (lambda: flexmask.speculative_tree(0, [-1]), ValueError, "prefix_lens"),
        (lambda: flexmask.speculative_tree(2, [-1, 1]), ValueError, "draft_parents[1]"),
        (lambda: flexmask.speculative_tree([2, 3], [[-1], [-1], [-1]]), ValueError, "rows"),
    ],
)
def test_bad_input_names_the_argument(call, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        call()


@pytest.mark.slow
def test_compiled_decode_does_not_recompile_over_20_steps():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    B, H, D, capacity = 2, 2, 16, 512
    k, v = torch.randn(B, H, capacity, D), torch.randn(B, H, capacity, D)
    flex = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    docs = flexmask.causal() & flexmask.document([[100, 412], [30, 482]])
    for mask in (flexmask.causal(), docs):
        steps = flexmask.DecodeMasks(mask, [120, 40], capacity)
        graphs_after_first = None
        for step in range(20):
            bm = steps.block_mask if step == 0 else steps.advance([1, 2])
            q = torch.randn(B, H, 1, D)
            out = flex(q, k, v, block_mask=bm)
            dense = mask.to_dense(B, H, capacity, capacity)
            window = torch.stack([dense[b, :, n : n + 1] for b, n in enumerate(steps.cache_lens)])
            want = oracle.attention(q, k, v, window)[0]
            torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
            if step == 0:
                graphs_after_first = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs_after_first, repr(mask)
        assert steps.cache_lens == [139, 78]
    assert sum(counters["recompiles"].values()) <= 1  # the second mask kind only


@pytest.mark.slow
def test_paged_decode_with_a_shuffled_page_table_equals_the_contiguous_cache():
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    torch.manual_seed(0)
    flex = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    B, H, D, capacity, page, q_len = 2, 2, 16, 256, 32, 3
    mask = flexmask.causal() & flexmask.document([[50, 206], [120, 136]])
    lens = [170, 61]
    logical = flexmask.decode_mask(mask, lens, q_len, capacity, heads=H, block_size=(32, page))
    q = torch.randn(B, H, q_len, D)
    k, v = torch.randn(B, H, capacity, D), torch.randn(B, H, capacity, D)
    expected = flex(q, k, v, block_mask=logical)
    dense = mask.to_dense(B, H, capacity, capacity)
    window = torch.stack([dense[b, :, n : n + q_len] for b, n in enumerate(lens)])
    want = oracle.attention(q, k, v, window)[0]
    torch.testing.assert_close(expected.double(), want, atol=1e-5, rtol=0)

    n_pages = 2 * capacity // page + 3
    paged = PagedAttention(n_pages, page, B, device="cpu")
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(3))
    paged.empty_pages = order.tolist()  # a shuffled page table
    for b in range(B):
        paged.reserve(torch.tensor(b), torch.tensor(capacity))
    k_cache, v_cache = torch.zeros(1, H, n_pages * page, D), torch.zeros(1, H, n_pages * page, D)
    paged.assign(torch.arange(B), torch.arange(capacity).expand(B, -1), k, v, k_cache, v_cache)
    physical = paged.convert_logical_block_mask(logical)
    out = flex(q, k_cache, v_cache, block_mask=physical)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_generate_example_matches_full_recomputation():
    from tests.test_docs_examples import run_example

    out = run_example("generate.py", "--quick")
    assert "all logits equal full recomputation (atol 1e-05)" in out
    assert "draft tree: 24 nodes verified in one forward" in out
    assert "append" in out and "reuse" in out  # the causal decode reused its BlockMask
