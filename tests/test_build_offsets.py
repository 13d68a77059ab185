"""Windows of a mask: ``create_block_mask(..., q_offset=, kv_offset=)`` builds the rows
``[q_offset, q_offset + Q_LEN)`` and columns ``[kv_offset, kv_offset + KV_LEN)`` — equal, as
whole tensors, to torch's build of the shifted mask_mod and to the dense oracle's window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask, flex_attention

import flexmask
from flexmask.builders import make_grid
from tests import oracle
from tests.strategies import (
    ending_intersections,
    expressions,
    interval_intersections,
    small_windows,
)

BLOCKS = st.sampled_from([16, 32, 64, 128, (16, 32), (64, 16)])


def _window(dense: np.ndarray, q_off: list[int], kv_off: list[int], q_len: int, kv_len: int):
    """(B, H, q_len, kv_len) rows/columns of the whole dense mask at each row's offsets."""
    out = np.zeros((*dense.shape[:2], q_len, kv_len), dtype=bool)
    for b in range(dense.shape[0]):
        out[b] = dense[b, :, q_off[b] : q_off[b] + q_len, kv_off[b] : kv_off[b] + kv_len]
    return out


def _offsets(draw, batch: int, span: int, name: str):
    """An int or a per-row list of offsets in [0, span]."""
    if draw(st.booleans()):
        return draw(st.integers(0, span), label=name)
    return draw(st.lists(st.integers(0, span), min_size=batch, max_size=batch), label=name)


def _per_row(offset, batch: int) -> list[int]:
    return list(offset) if isinstance(offset, list) else [offset] * batch


def _check(mask, dense_of, batch, heads, q_len, kv_len, q_off, kv_off, block):
    total_q = max(_per_row(q_off, batch)) + q_len
    total_kv = max(_per_row(kv_off, batch)) + kv_len
    span = max(total_q, total_kv)
    ours = flexmask.create_block_mask(
        mask, batch, heads, q_len, kv_len, "cpu", block, q_offset=q_off, kv_offset=kv_off
    )
    whole = dense_of(span, span)
    window = _window(whole, _per_row(q_off, batch), _per_row(kv_off, batch), q_len, kv_len)
    context = f"{mask!r} q_offset={q_off} kv_offset={kv_off}"
    oracle.assert_same_block_mask(ours, oracle.torch_blocks(window, block), context)
    # The BlockMask's mask_mod takes local indices: densely it is the window too.
    local = create_mask(ours.mask_mod, batch, heads, q_len, kv_len, "cpu")
    assert np.array_equal(local.numpy(), window), context
    return ours


@settings(max_examples=40)
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    q_len=st.integers(1, 200),
    kv_len=st.integers(1, 200),
    block=BLOCKS,
)
def test_closed_form_windows_equal_the_oracle(data, batch, q_len, kv_len, block):
    q_off = _offsets(data.draw, batch, 200, "q_offset")
    kv_off = _offsets(data.draw, batch, 200, "kv_offset")
    span = max(max(_per_row(q_off, batch)) + q_len, max(_per_row(kv_off, batch)) + kv_len)
    mask, dense = data.draw(interval_intersections(batch, span))
    assert mask.has_monotone_intervals()
    _check(
        mask,
        lambda q, kv: np.repeat(dense(q, kv)[:, None], 2, axis=1),
        batch,
        2,
        q_len,
        kv_len,
        q_off,
        kv_off,
        block,
    )


@settings(max_examples=25)
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    q_len=st.integers(1, 150),
    kv_len=st.integers(1, 150),
    block=BLOCKS,
)
def test_any_expression_windows_equal_the_oracle(data, batch, heads, q_len, kv_len, block):
    q_off = _offsets(data.draw, batch, 150, "q_offset")
    kv_off = _offsets(data.draw, batch, 150, "kv_offset")
    span = max(max(_per_row(q_off, batch)) + q_len, max(_per_row(kv_off, batch)) + kv_len)
    mask, dense = data.draw(expressions(batch, heads, span))
    _check(mask, dense, batch, heads, q_len, kv_len, q_off, kv_off, block)


def _dense4(dense, heads: int):
    return lambda q, kv: np.repeat(dense(q, kv)[:, None], heads, axis=1)


@settings(max_examples=120)
@given(data=st.data(), batch=st.integers(1, 2))
def test_small_unaligned_windows_equal_the_oracle(data, batch):
    # Tiny tiles and kv offsets off the block grid: a q block may hold every query that
    # attends the window while its first and last queries attend nothing in it (the first
    # ends before kv_offset, the last is past the documents or the padding).
    drawn = data.draw(small_windows(batch, ending_intersections))
    mask, dense, q_len, kv_len, q_off, kv_off, block = drawn
    assert mask.has_monotone_intervals()
    _check(mask, _dense4(dense, 1), batch, 1, q_len, kv_len, q_off, kv_off, block)


@settings(max_examples=60)
@given(data=st.data(), batch=st.integers(1, 2), heads=st.integers(1, 2))
def test_small_windows_of_any_expression_equal_the_oracle(data, batch, heads):
    def masks(batch, length):
        return expressions(batch, heads, length)

    mask, dense, q_len, kv_len, q_off, kv_off, block = data.draw(small_windows(batch, masks))
    _check(mask, dense, batch, heads, q_len, kv_len, q_off, kv_off, block)


def test_window_equals_torchs_build_of_the_shifted_mask_mod():
    mask = flexmask.causal() & flexmask.document([[300, 200, 12], [100, 400, 12]])
    q_off, kv_off = torch.tensor([64, 3]), torch.tensor([0, 7])
    ours = flexmask.create_block_mask(
        mask, 2, 2, 130, 505, "cpu", 64, q_offset=q_off, kv_offset=kv_off
    )
    whole = mask.mask_mod_for(512, 512)

    def shifted(b, h, q_idx, kv_idx):
        return whole(b, h, q_idx + q_off[b], kv_idx + kv_off[b])

    theirs = torch_create_block_mask(shifted, 2, 2, 130, 505, "cpu", BLOCK_SIZE=64)
    oracle.assert_same_block_mask(ours, theirs)


def test_offsets_are_held_as_tensors_and_validated():
    mask = flexmask.causal() & flexmask.sliding_window(64)
    bm = flexmask.create_block_mask(mask, 1, 1, 128, 512, "cpu", q_offset=384)
    assert isinstance(bm.mask_mod.q_offset, torch.Tensor) and bm.mask_mod.q_offset.dim() == 0
    same = flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=[384, 384])
    apart = flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=[384, 256])
    # Per-row offsets stay per row when they agree: a compiled kernel guards on the shapes
    # of the tensors its mask_mod holds, so rows that agree one step and diverge the next
    # must not change them (that would recompile).
    for bm in (same, apart):
        assert bm.mask_mod.q_offset.shape == bm.mask_mod.kv_offset.shape == (2,)
    assert same.mask_mod.q_offset.tolist() == [384, 384]
    assert same.mask_mod.kv_offset.tolist() == [0, 0]
    oracle.assert_same_block_mask(
        same, flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=384)
    )
    zero = flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=[0, 0])
    assert zero.mask_mod.q_offset.tolist() == [0, 0]
    plain = flexmask.create_block_mask(mask, 1, 1, 128, 512, "cpu")
    assert plain.mask_mod is not None and not hasattr(plain.mask_mod, "q_offset")
    with pytest.raises(ValueError, match="q_offset must be >= 0"):
        flexmask.create_block_mask(mask, 1, 1, 128, 512, "cpu", q_offset=-1)
    with pytest.raises(ValueError, match="kv_offset holds 3 offsets but B=2"):
        flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", kv_offset=[0, 1, 2])
    with pytest.raises(TypeError, match="q_offset"):
        flexmask.create_block_mask(mask, 1, 1, 128, 512, "cpu", q_offset=1.5)
    with pytest.raises(TypeError, match="need a flexmask Mask"):
        flexmask.create_block_mask(mask.mask_mod, 1, 1, 128, 512, "cpu", q_offset=4)


def test_cache_keys_windows_apart():
    cache = flexmask.MaskCache()
    mask = flexmask.causal() & flexmask.document([[300, 212], [512]])
    a = cache.get(mask, 2, 1, 128, 512, "cpu", q_offset=128)
    b = cache.get(mask, 2, 1, 128, 512, "cpu", q_offset=256)
    c = cache.get(mask, 2, 1, 128, 512, "cpu", q_offset=[128, 128])
    assert a is not b and a is not c  # c's mask_mod holds per-row offsets
    oracle.assert_same_block_mask(a, c)
    assert c.mask_mod.q_offset.shape == (2,)
    d = cache.get(mask, 2, 1, 128, 512, "cpu", q_offset=[128, 256])
    expected = flexmask.create_block_mask(mask, 2, 1, 128, 512, "cpu", q_offset=[128, 256])
    oracle.assert_same_block_mask(d, expected)
    # A mask ignoring rows, windowed per row, is built per row.
    static = cache.get(flexmask.causal(), 2, 1, 128, 512, "cpu", q_offset=[0, 256])
    assert static.kv_num_blocks.shape[0] == 2
    grid = make_grid(flexmask.causal(), 2, 1, 128, 512, "cpu", 128, [0, 256], 0)
    assert grid.per_row_offsets and grid.length == 512
    # Equal per-row offsets on a mask ignoring rows: rows kept, so the (B,) offsets its
    # mask_mod holds match the batch flex_attention runs; attention equals the int window's.
    agree = cache.get(flexmask.causal(), 2, 1, 128, 512, "cpu", q_offset=[256, 256])
    assert agree.kv_num_blocks.shape[0] == 2 and agree.mask_mod.q_offset.shape == (2,)
    q = torch.randn(2, 1, 128, 16, dtype=torch.float64)
    kv = torch.randn(2, 1, 512, 16, dtype=torch.float64)
    window = flexmask.create_block_mask(flexmask.causal(), 2, 1, 128, 512, "cpu", q_offset=256)
    torch.testing.assert_close(
        flex_attention(q, kv, kv, block_mask=agree), flex_attention(q, kv, kv, block_mask=window)
    )
