"""Lazy handles: nothing before use, one build for many layers, freed after release."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


@pytest.mark.parametrize(
    ("backend", "runs", "builds"), [("block_sparse", "block_sparse", 1), ("auto", "slices", 0)]
)
def test_one_build_serves_every_layer(cache, backend, runs, builds):
    """A backend that reads the BlockMask builds it once for every layer; the one that lowers
    the Mask itself (``auto`` here runs ``slices``) builds nothing."""
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.document([100, 156]), 2, 4, 256, 256, "cpu", cache=cache
    )
    q, k, v = (torch.randn(2, 4, 256, 16) for _ in range(3))
    assert flexmask.explain(q, k, v, handle, backend).backend == runs
    outs = [flexmask.attention(q, k, v, handle, backend, compile=False) for _ in range(6)]
    assert handle.builds == builds and cache.info().misses == builds
    assert cache.info().hits == 0
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
    assert handle.block_mask is not None and handle.built  # built again, by hand
    model(torch.randn(1, 1, 256, 8), handle)
    assert handle.built  # the hook was one-shot: nothing released it this time
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


# ----------------------------------------------------------- no device touched before first use
class DeviceLog(TorchDispatchMode):
    """Records the device of every tensor any aten op returns (factories included)."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.devices.append(t.device.type)
        return out


# Every kind of piece and per-row data: each _check runs at creation.
HANDLE_MASKS = [
    flexmask.causal() & flexmask.document([60, 40, 20]),
    flexmask.causal() & flexmask.document([[60, 40], [100]]),
    flexmask.tree([-1, 0, 1, 1, 0]),
    flexmask.padding([50, 90]) & flexmask.prefix(10) | flexmask.sliding_window(16),
    ~flexmask.full() | flexmask.empty(),
]


@pytest.mark.parametrize("device", ["meta", "cuda", "cuda:1", None])
@pytest.mark.parametrize("mask", HANDLE_MASKS, ids=range(len(HANDLE_MASKS)))
def test_creation_and_release_touch_no_device(mask, device, cache):
    # "cuda" on this CPU-only build cannot allocate: creating there must still succeed.
    with DeviceLog() as log:
        handle = flexmask.lazy(mask, None, 2, 128, 120, device, BLOCK_SIZE=(64, 32), cache=cache)
        repr(handle)
        handle.release()  # an unbuilt handle releases without building anything either
    assert not handle.built and cache.info().misses == 0
    assert set(log.devices) <= {"cpu"}, log.devices
    assert (mask.rows or 1) == handle.B and handle.BLOCK_SIZE == (64, 32)
    assert handle.device == (None if device is None else torch.device(device))
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


def test_int_validation_builds_what_torch_builds(cache):
    # B=None takes the row count from per-row data; the handle's shape must be the build's.
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.padding([70, 200, 9]), None, 1, 200, 200, cache=cache
    )
    assert (handle.B, handle.H, handle.Q_LEN, handle.KV_LEN) == (3, 1, 200, 200)
    rows = [oracle.causal(200, 200) & oracle.padding(n, 200, 200) for n in (70, 200, 9)]
    reference = oracle.torch_build(oracle.stack(rows), block=128)
    oracle.assert_same_block_mask(handle.block_mask, reference)
    handle.release()
    assert cache.info().entries == 0 and cache.info().discarded == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"cache": "x"}, TypeError, "cache must be a flexmask.MaskCache"),
        ({"cache": {}}, TypeError, "cache must be a flexmask.MaskCache"),
        ({"device": "bogus"}, ValueError, "device must be a torch device or its name"),
        ({"device": 1.5}, ValueError, "device must be a torch device or its name"),
        ({"B": -1}, ValueError, "B must be >= 0"),
        ({"H": "2"}, TypeError, "H must be an int"),
        ({"Q_LEN": -1}, ValueError, "Q_LEN must be >= 0"),
        ({"KV_LEN": 2.0}, TypeError, "KV_LEN must be an int"),
        ({"BLOCK_SIZE": (64,)}, ValueError, "BLOCK_SIZE must be an int or a"),
        ({"BLOCK_SIZE": 0}, ValueError, "BLOCK_SIZE must be >= 1"),
    ],
)
def test_every_handle_argument_is_checked_at_creation(kwargs, error, match):
    args = {"B": 1, "H": 1, "Q_LEN": 64, "KV_LEN": 64} | kwargs
    with pytest.raises(error, match=match):
        flexmask.lazy(flexmask.causal(), **args)


def test_a_tree_longer_than_the_sequence_fails_at_creation_on_any_device():
    # Documents and padding past the sequence are clipped to it; a tree's parents are not.
    with pytest.raises(ValueError, match="more than the sequence length"):
        flexmask.lazy(flexmask.tree([-1, *range(199)]), 1, 1, 128, 128, device="meta")
    with pytest.raises(ValueError, match="lives on cpu but the mask is built on meta"):
        flexmask.lazy(flexmask.padding(torch.tensor([3, 4])), None, 1, 8, 8, device="meta")


class _LoggedCollator:
    """Runs a collator inside a DeviceLog, in the worker, and returns what it saw."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, items):
        with DeviceLog() as log:
            batch = self.collator(items)
        return batch, sorted(set(log.devices)), torch.cuda.is_initialized()


def test_dataloader_worker_touches_no_device():
    from flexmask.packing import PackingCollator

    collator = PackingCollator(max_len=16, num_heads=2, device="cuda", block_size=8)
    assert collator.device == torch.device("cuda")
    data = [[1, 2, 3], [4, 5], [6] * 9, [7, 8, 9, 10]]
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, num_workers=1, collate_fn=_LoggedCollator(collator)
    )
    ((batch, devices, cuda_initialised),) = list(loader)
    assert devices == ["cpu"] and not cuda_initialised
    handle = batch.handle
    assert not handle.built and handle.device == torch.device("cuda")
    assert (handle.B, handle.H, handle.Q_LEN, handle.BLOCK_SIZE) == (2, 2, 16, (8, 8))
    # Built here, in the main process, on a device that can allocate: torch's blocks (H=1:
    # the mask is the same for every head, so the BlockMask broadcasts over heads).
    rows = [oracle.causal(16, 16) & oracle.document(lens, 16, 16) for lens in batch.seq_lens]
    built = flexmask.lazy(handle.mask, handle.B, 2, 16, 16, "cpu", 8).block_mask
    oracle.assert_same_block_mask(built, oracle.torch_build(oracle.stack(rows), block=8))


def test_collator_rejects_a_bad_device_at_construction():
    from flexmask.packing import PackingCollator

    with pytest.raises(ValueError, match="device must be a torch device or its name"):
        PackingCollator(max_len=8, device="gpu0")


def test_a_lazy_forward_and_backward_validates_the_mask_once(monkeypatch):
    """One spec, validated once: the handle validates its mask when made; building it
    through the cache, the block-sparse forward and backward and the release check nothing
    again, and a second handle of the same mask that hits the cache validates only itself."""
    from flexmask.algebra.mask import Mask

    calls = []
    validate = Mask.validate

    def counted(self, extent):
        calls.append(self)
        return validate(self, extent)

    monkeypatch.setattr(Mask, "validate", counted)
    cache = flexmask.MaskCache()
    mask = flexmask.causal() & flexmask.document([100, 156])
    q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
    handle = flexmask.lazy(mask, 1, 1, 256, 256, "cpu", cache=cache)
    assert calls == [mask]
    with handle:
        out = flexmask.attention(q, k, v, handle, "block_sparse")
        out.sum().backward()
        assert calls == [mask] and handle.builds == 1 and q.grad is not None
        again = flexmask.lazy(mask, 1, 1, 256, 256, "cpu", cache=cache)
        assert calls == [mask, mask]  # made: validated once
        calls.clear()
        assert again.block_mask is handle.block_mask and cache.info().hits == 1
        assert calls == []  # the cache hit: no validation
    assert calls == []  # nor the release


@pytest.fixture
def validations(monkeypatch):
    """The masks ``Mask.validate`` is called on, in order."""
    from flexmask.algebra.mask import Mask

    calls = []
    validate = Mask.validate

    def counted(self, extent):
        calls.append(self)
        return validate(self, extent)

    monkeypatch.setattr(Mask, "validate", counted)
    return calls


@pytest.mark.parametrize("balancer", ["head_tail", None])
def test_a_shard_and_a_lazy_shard_validate_the_mask_once(validations, balancer):
    """A shard is cut from one spec of the whole padded sequence: ``shard`` validates the
    mask once; a lazy shard once when made, and its build (through the cache) and release
    not again. The rows attended still equal the dense oracle's under the permutation."""
    import numpy as np

    mask = flexmask.causal() & flexmask.document([150, 100])
    args = dict(world_size=2, rank=1, balancer=balancer, BLOCK_SIZE=64)
    s = flexmask.shard(mask, 1, 1, 250, **args)  # padded to 252
    assert validations == [mask]
    dense = oracle.causal(250, 250) & oracle.document([150, 100], 250, 250)
    padded = np.zeros((s.padded_length,) * 2, dtype=bool)
    padded[:250, :250] = dense
    perm = s.indices[0].numpy()
    rows = padded[perm][:, perm][s.local]
    reference = oracle.torch_build(oracle.stack([rows]), block=s.block_mask.BLOCK_SIZE)
    oracle.assert_same_block_mask(s.block_mask, reference, own_storage=False)
    validations.clear()
    handle = flexmask.lazy_shard(
        mask, 1, 1, 250, cache=flexmask.context_parallel.ShardCache(), **args
    )
    assert validations == [mask] and not handle.built
    with handle:
        assert handle.kv_num_blocks.shape == (1, 1, 2) and handle.built  # a BlockMask field
        assert validations == [mask]
    assert validations == [mask] and not handle.built


def test_a_decode_step_and_a_generation_validate_the_mask_once(validations):
    """``decode_mask`` validates its mask once; a ``DecodeMasks`` once when made, and each
    step it builds after (its queries moved, the mask's reach unchanged) not again."""
    mask = flexmask.causal() & flexmask.document([40, 60])
    flexmask.decode_mask(mask, [30, 50], q_len=2, capacity=100, block_size=16)
    assert validations == [mask]
    validations.clear()
    steps = flexmask.DecodeMasks(mask, [30, 50], 100, q_len=2, block_size=16, append=False)
    assert validations == [mask]
    for step in steps:
        assert step.block_mask.seq_lengths == (2, 100)
        if step.index == 3:
            break
    steps.at([0, 97])
    assert steps.builds == 5 and validations == [mask]
