"""Drop-in downstream: flexmask's BlockMasks behave exactly like torch's after the build.

The tensors are ``torch.equal`` to torch's as wholes (the unlisted tail included), contiguous
and one storage each, so ``_adjust``, in-place edits, ``to_dense`` and ``PagedAttention``
behave as with torch's own build. The eager flex_attention ignores block tensors, so the
attention checks here go through torch's *compiled* CPU kernel (marked slow).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from tests import oracle
from tests.strategies import expressions, interval_intersections

BLOCKS = st.sampled_from([16, 32, 64, 128, (16, 32), (64, 16)])


@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    q_len=st.integers(1, 300),
    kv_len=st.integers(1, 300),
    block=BLOCKS,
)
def test_random_expressions_equal_torch_as_whole_tensors(data, batch, heads, q_len, kv_len, block):
    mask, dense = data.draw(expressions(batch, heads, max(q_len, kv_len)))
    ours = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    oracle.assert_same_block_mask(
        ours, oracle.torch_build(mask.mask_mod, batch, heads, q_len, kv_len, block)
    )
    # And against torch's builder on a plain lookup into the independent dense reference.
    reference = oracle.torch_build(dense(q_len, kv_len), block=block)
    oracle.assert_same_block_mask(ours, reference, repr(mask))


@given(
    data=st.data(),
    batch=st.integers(1, 3),
    q_len=st.integers(1, 400),
    kv_len=st.integers(1, 400),
    block=BLOCKS,
)
def test_closed_form_equals_torch_as_whole_tensors(data, batch, q_len, kv_len, block):
    mask, dense = data.draw(interval_intersections(batch, max(q_len, kv_len)))
    ours = flexmask.create_block_mask(mask, batch, 2, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    reference = oracle.torch_build(np.repeat(dense(q_len, kv_len)[:, None], 2, axis=1), block=block)
    oracle.assert_same_block_mask(ours, reference, repr(mask))


def _adjusted_or_error(block_mask: BlockMask, q_len: int, kv_len: int):
    try:
        return block_mask._adjust(q_len, kv_len), None
    except Exception as err:  # noqa: BLE001 - compared with what torch raises
        return None, type(err)


@settings(max_examples=25)
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    q_len=st.integers(1, 400),
    kv_len=st.integers(1, 400),
    new_q=st.integers(1, 600),
    new_kv=st.integers(1, 600),
    block=BLOCKS,
)
def test_adjust_equals_torchs_adjust(data, batch, heads, q_len, kv_len, new_q, new_kv, block):
    mask, _ = data.draw(expressions(batch, heads, max(q_len, kv_len)))
    ours = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    theirs = oracle.torch_build(mask.mask_mod, batch, heads, q_len, kv_len, block)
    expected, expected_error = _adjusted_or_error(theirs, new_q, new_kv)
    got, got_error = _adjusted_or_error(ours, new_q, new_kv)
    assert got_error is expected_error
    if expected is not None:
        context = f"{mask!r} -> ({new_q}, {new_kv})"
        oracle.assert_same_block_mask(got, expected, context, own_storage=False)


def test_adjust_keeps_the_diagonal_block():
    # The report of the bug: an identity-like crop of causal lost the diagonal block.
    ours = flexmask.create_block_mask(flexmask.causal(), 1, 1, 1024, 1024, device="cpu")
    assert ours._adjust(256, 256).kv_num_blocks.tolist() == [[[1, 1]]]
    assert ours._adjust(256, 256).full_kv_num_blocks.tolist() == [[[0, 1]]]


@pytest.mark.parametrize(("q_len", "kv_len"), [(0, 300), (300, 0), (0, 0)])
def test_zero_lengths_equal_torch(q_len, kv_len):
    # torch's builder fails on some mask_mods at length 0 (vmap over an empty grid), so the
    # references are mask_mods it can build there.
    ours = flexmask.create_block_mask(flexmask.causal(), 2, 3, q_len, kv_len, "cpu", BLOCK_SIZE=64)
    theirs = torch_create_block_mask(_causal, 2, 3, q_len, kv_len, "cpu", BLOCK_SIZE=64)
    oracle.assert_same_block_mask(ours, theirs)
    window = flexmask.causal() & flexmask.sliding_window(50)  # closed form, nothing listed
    ours = flexmask.create_block_mask(window, 2, 3, q_len, kv_len, "cpu", BLOCK_SIZE=64)
    oracle.assert_same_block_mask(ours, theirs)
    tiles = ~flexmask.causal()  # the tile path
    ours = flexmask.create_block_mask(tiles, 2, 3, q_len, kv_len, "cpu", BLOCK_SIZE=64)
    theirs = torch_create_block_mask(_above, 2, 3, q_len, kv_len, "cpu", BLOCK_SIZE=64)
    oracle.assert_same_block_mask(ours, theirs)


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _above(b, h, q_idx, kv_idx):
    return kv_idx > q_idx


def test_in_place_edit_changes_one_row_and_head():
    mask = flexmask.causal() & flexmask.document([300, 212])  # the same for every row and head
    ours = flexmask.create_block_mask(mask, 2, 2, 512, 512, device="cpu")
    theirs = oracle.torch_build(mask.mask_mod, 2, 2, 512, 512, 128)
    for bm in (ours, theirs):
        bm.kv_num_blocks[0, 0, 0] = 0
        bm.kv_indices[1, 1, 2, 0] = 3
    oracle.assert_same_block_mask(ours, theirs)
    assert int((ours.kv_num_blocks == 0).sum()) == 1


def test_block_mask_methods_agree_with_torch():
    mask = (flexmask.causal() & flexmask.document([[100, 200, 90], [390]])) | flexmask.prefix(40)
    ours = flexmask.create_block_mask(mask, 2, 2, 390, 390, "cpu", BLOCK_SIZE=64)
    theirs = oracle.torch_build(mask.mask_mod, 2, 2, 390, 390, 64)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.sparsity() == theirs.sparsity()
    for index in (1, (slice(None), 1), (1, 0, slice(2, None))):
        oracle.assert_same_block_mask(ours[index], theirs[index], str(index), own_storage=False)
    again = BlockMask.from_kv_blocks(
        ours.kv_num_blocks,
        ours.kv_indices,
        ours.full_kv_num_blocks,
        ours.full_kv_indices,
        BLOCK_SIZE=ours.BLOCK_SIZE,
        mask_mod=ours.mask_mod,
        seq_lengths=ours.seq_lengths,
    )
    oracle.assert_same_block_mask(again, theirs)


@pytest.mark.slow
def test_adjusted_masks_attend_like_sdpa_through_the_compiled_kernel():
    from flexmask.attention import compiled_flex_attention

    torch.manual_seed(0)
    flex = compiled_flex_attention()
    B, H, S, D = 2, 2, 512, 16
    cases = [
        (flexmask.causal() & flexmask.document([[200, 250, 62], [512]]), 256, 384),
        (flexmask.causal() & flexmask.sliding_window(100), 256, 256),
        (flexmask.causal() | flexmask.prefix(300), 128, 512),
    ]
    for mask, new_q, new_kv in cases:
        bm = flexmask.create_block_mask(mask, B, H, S, S, device="cpu")._adjust(new_q, new_kv)
        q = torch.randn(B, H, new_q, D)
        k, v = torch.randn(B, H, new_kv, D), torch.randn(B, H, new_kv, D)
        dense = mask.to_dense(B, H, S, S)[:, :, :new_q, :new_kv]
        out = flex(q, k, v, block_mask=bm)
        want = oracle.attention(q, k, v, dense)[0]
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_paged_attention_with_shuffled_pages_equals_the_contiguous_cache():
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    from flexmask.attention import compiled_flex_attention

    torch.manual_seed(0)
    flex = compiled_flex_attention()
    B, H, S, D, page = 2, 3, 256, 16, 64
    mask = flexmask.causal() & flexmask.document([[100, 156], [30, 200, 26]])
    logical = flexmask.create_block_mask(mask, B, H, S, S, "cpu", BLOCK_SIZE=(64, page))
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    expected = oracle.attention(q, k, v, mask.to_dense(B, H, S, S))[0]
    out = flex(q, k, v, block_mask=logical)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)

    n_pages = 2 * S // page + 3
    paged = PagedAttention(n_pages, page, B, device="cpu")
    paged.empty_pages = torch.randperm(n_pages, generator=torch.Generator().manual_seed(1))
    paged.empty_pages = paged.empty_pages.tolist()  # a shuffled page table
    for b in range(B):
        paged.reserve(torch.tensor(b), torch.tensor(S))
    assert not torch.equal(paged.page_table[:, : S // page], torch.arange(S // page).expand(B, -1))
    k_cache = torch.zeros(1, H, n_pages * page, D)
    v_cache = torch.zeros(1, H, n_pages * page, D)
    positions = torch.arange(S).expand(B, S)
    paged.assign(torch.arange(B), positions, k, v, k_cache, v_cache)
    physical = paged.convert_logical_block_mask(logical)
    out = flex(q, k_cache, v_cache, block_mask=physical)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
