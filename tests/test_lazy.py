"""Lazy handles: nothing before use, one build for many layers, freed after release."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch

import flexmask
from tests import oracle


@pytest.fixture()
def cache():
    return flexmask.MaskCache(maxsize=8)


def test_nothing_is_built_before_use(cache):
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.document([60, 68]), 1, 1, 128, 128, "cpu", cache=cache
    )
    assert not handle.built and handle.builds == 0
    assert cache.info().misses == 0 and cache.info().entries == 0


def test_one_build_serves_every_layer(cache):
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.document([100, 156]), 2, 4, 256, 256, "cpu", cache=cache
    )
    q, k, v = (torch.randn(2, 4, 256, 16) for _ in range(3))
    outs = [flexmask.flex_attention(q, k, v, block_mask=handle, compile=False) for _ in range(6)]
    assert handle.builds == 1 and cache.info().misses == 1 and cache.info().hits == 0
    row = oracle.document([100, 156], 256, 256) & oracle.causal(256, 256)
    dense = torch.from_numpy(oracle.stack([row, row], heads=4))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_released_block_mask_is_freed_and_batch_data_leaves_the_cache(cache):
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.document([100, 156]), 1, 1, 256, 256, "cpu", cache=cache
    )
    ref = weakref.ref(handle.block_mask)
    assert cache.info().entries == 1
    handle.release()
    gc.collect()
    assert ref() is None  # neither the handle nor the cache holds it
    assert cache.info().entries == 0
    assert cache.info().discarded == 1 and cache.info().evictions == 0
    assert handle.block_mask is not None  # used again: builds again
    assert handle.builds == 2


def test_static_masks_stay_cached_for_the_next_step(cache):
    mask = flexmask.causal() & flexmask.sliding_window(64)
    first = flexmask.lazy(mask, 1, 1, 256, 256, "cpu", cache=cache)
    bm = first.block_mask
    first.release()
    second = flexmask.lazy(mask, 1, 1, 256, 256, "cpu", cache=cache)
    assert second.block_mask is bm and cache.info().hits == 1
    assert cache.info().discarded == 0


def test_context_manager_and_forward_hook_release(cache):
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.padding([200]), 1, 1, 256, 256, "cpu", cache=cache
    )
    with handle:
        assert handle.block_mask is not None
        assert handle.built
    assert not handle.built

    class Attn(torch.nn.Module):
        def forward(self, x, block_mask):
            return flexmask.flex_attention(x, x, x, block_mask=block_mask, compile=False)

    model = Attn()
    hook = handle.release_after(model)
    model(torch.randn(1, 1, 256, 8), handle)
    assert not handle.built  # released at the end of the forward
    model(torch.randn(1, 1, 256, 8), handle)
    assert handle.built  # the hook was one-shot
    hook.remove()


def test_backward_still_works_after_release(cache):
    q = torch.randn(1, 2, 200, 8, requires_grad=True)
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.document([120, 80]), 1, 2, 200, 200, "cpu", cache=cache
    )
    out = flexmask.flex_attention(q, q, q, block_mask=handle)
    handle.release()
    gc.collect()
    out.square().sum().backward()
    q2 = q.detach().clone().requires_grad_()
    row = oracle.document([120, 80], 200, 200) & oracle.causal(200, 200)
    dense = torch.from_numpy(oracle.stack([row], heads=2))
    ref = torch.nn.functional.scaled_dot_product_attention(q2, q2, q2, attn_mask=dense)
    ref.square().sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-5, rtol=1e-4)


def test_handles_pickle_small_and_build_after_unpickling(cache):
    parents = [-1] + list(range(4095))
    handle = flexmask.lazy(flexmask.tree(parents), 1, 1, 4096, 4096, "cpu", cache=cache)
    assert handle.block_mask is not None  # even a built handle pickles without its tensors
    data = pickle.dumps(handle)
    assert len(data) < 4096 * 64  # O(N) data, never N x N
    clone = pickle.loads(data)
    assert not clone.built and clone.mask == handle.mask
    assert torch.equal(clone.block_mask.kv_indices, handle.block_mask.kv_indices)


def test_lazy_validates_at_creation():
    with pytest.raises(ValueError, match="given for 2 batch rows but B=3"):
        flexmask.lazy(flexmask.padding([3, 4]), 3, 1, 8, 8, "cpu")
    with pytest.raises(TypeError, match="flexmask Mask"):
        flexmask.lazy("causal", 1, 1, 8, 8)
