"""A lazy handle goes wherever a torch BlockMask goes: torch's own flex_attention (eager and
compiled, without recompiling for new content), BlockMask's attributes and methods, torch's
paged-attention and context-parallel helpers. References: torch's create_block_mask on the
dense oracle (tests/oracle.py), SDPA on the dense oracle, and torch's functions given the
handle's built BlockMask."""

from __future__ import annotations

import gc
import pickle
import random
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import flexmask
from flexmask.block_sparse import block_sparse_attention
from tests import oracle


@pytest.fixture()
def cache():
    return flexmask.MaskCache(maxsize=8)


def sdpa(q, k, v, dense: np.ndarray) -> torch.Tensor:
    """SDPA on the dense oracle; rows that attend nothing are 0, as flex_attention gives."""
    allowed = torch.from_numpy(dense)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return torch.where(allowed.any(-1, keepdim=True), out, 0.0)


# (mask, B, H, S, dense oracle (B, H, S, S)); lengths not multiples of the block size.
def cases():
    S = 200
    parents = [-1] + [i - 1 if i % 13 else 0 for i in range(1, S)]
    return {
        "document-per-row": (
            flexmask.causal() & flexmask.document([[70, 90, 40], [150, 50]]),
            2,
            2,
            S,
            oracle.stack(
                [
                    oracle.causal(S, S) & oracle.document([70, 90, 40], S, S),
                    oracle.causal(S, S) & oracle.document([150, 50], S, S),
                ],
                heads=2,
            ),
        ),
        "tree": (flexmask.tree(parents), 1, 3, S, oracle.stack([oracle.tree(parents, S, S)], 3)),
        "padding-window": (
            flexmask.causal() & flexmask.sliding_window(48) & flexmask.padding([170, 200]),
            2,
            1,
            S,
            oracle.stack(
                [
                    oracle.causal(S, S) & oracle.sliding_window(48, S, S) & oracle.padding(n, S, S)
                    for n in (170, 200)
                ]
            ),
        ),
    }


CASES = cases()


def test_a_handle_is_a_block_mask_and_reading_its_recipe_builds_nothing(cache):
    handle = flexmask.lazy(flexmask.causal(), 1, 2, 200, 200, "cpu", BLOCK_SIZE=64, cache=cache)
    assert isinstance(handle, BlockMask)
    recipe = (handle.mask, handle.B, handle.H, handle.Q_LEN, handle.KV_LEN, handle.device)
    assert recipe == (flexmask.causal(), 1, 2, 200, 200, torch.device("cpu"))
    assert handle.BLOCK_SIZE == (64, 64)
    assert "LazyBlockMask(causal()" in repr(handle) and str(handle) == repr(handle)
    assert not handle.built and handle.builds == 0 and cache.info().misses == 0


@pytest.mark.parametrize("name", list(CASES))
def test_torch_flex_attention_eager_takes_a_handle(name, cache):
    mask, B, H, S, dense = CASES[name]
    q, k, v = (torch.randn(B, H, S, 16) for _ in range(3))
    handle = flexmask.lazy(mask, B, H, S, S, "cpu", BLOCK_SIZE=64, cache=cache)
    with handle:
        out = torch_flex_attention(q, k, v, block_mask=handle)
        again = torch_flex_attention(q, k, v, block_mask=handle)  # a second layer
        assert handle.builds == 1 and cache.info().misses == 1
        built = torch_flex_attention(q, k, v, block_mask=handle.block_mask)
    assert not handle.built
    torch.testing.assert_close(out, built, atol=0, rtol=0)
    torch.testing.assert_close(again, built, atol=0, rtol=0)
    torch.testing.assert_close(out, sdpa(q, k, v, dense), atol=1e-5, rtol=1e-5)


def test_block_mask_attributes_and_methods_equal_torchs(cache):
    # Per-row documents, one head: torch's create_block_mask keeps the same B and H.
    S, lens = 200, [[70, 90, 40], [150, 50]]
    mask = flexmask.causal() & flexmask.document(lens)
    dense = oracle.stack([oracle.causal(S, S) & oracle.document(row, S, S) for row in lens])
    reference = oracle.torch_build(dense, block=64)
    handle = flexmask.lazy(mask, 2, 1, S, S, "cpu", BLOCK_SIZE=64, cache=cache)
    assert handle.shape == reference.shape == (2, 1, S, S)
    assert handle.built and handle.builds == 1
    oracle.assert_same_block_mask(handle, reference)  # the eight tensors, lengths, BLOCK_SIZE
    assert handle.seq_lengths == (S, S) and tuple(reference.BLOCK_SIZE) == handle.BLOCK_SIZE
    assert handle.numel() == reference.numel()
    assert handle.sparsity() == pytest.approx(reference.sparsity())
    assert torch.equal(handle.to_dense(), reference.to_dense())
    assert handle.to_string() == reference.to_string()
    b, h, q_idx, kv_idx = (torch.tensor(i) for i in (1, 0, 160, 155))
    assert bool(handle.mask_mod(b, h, q_idx, kv_idx)) == bool(dense[1, 0, 160, 155])
    assert handle.dq_kv_order is None and handle.dq_write_order is None
    ours, theirs = handle.as_tuple(), reference.as_tuple()
    assert len(ours) == len(theirs) and ours[:2] == theirs[:2]
    # Methods that make a new BlockMask make a plain one, equal to torch's.
    for made, expected in (
        (handle[1], reference[1]),
        (handle[:, 0:1], reference[:, 0:1]),
        (handle.to("cpu"), reference.to("cpu")),
        (handle._adjust(130, 150), reference._adjust(130, 150)),
    ):
        assert type(made) is BlockMask
        assert made.shape == expected.shape
        assert torch.equal(made.to_dense(), expected.to_dense())
    assert handle.builds == 1  # every read above served by one build


def test_release_frees_what_torch_read_and_the_next_read_builds_again(cache):
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.document([100, 100]), 1, 1, 200, 200, "cpu", cache=cache
    )
    indices = weakref.ref(handle.kv_indices)
    handle.release()
    gc.collect()
    assert indices() is None and not handle.built and cache.info().entries == 0
    assert handle.shape == (1, 1, 200, 200) and handle.builds == 2


def test_a_built_handle_still_pickles_its_recipe(cache):
    handle = flexmask.lazy(flexmask.tree([-1, 0, 1, 1, 0] * 40), 1, 1, 200, 200, "cpu")
    _ = handle.kv_indices, handle.mask_mod
    clone = pickle.loads(pickle.dumps(handle))
    assert isinstance(clone, BlockMask) and not clone.built and clone.mask == handle.mask
    assert torch.equal(clone.to_dense(), handle.to_dense())


def test_fields_cannot_be_set_on_a_handle(cache):
    handle = flexmask.lazy(flexmask.causal(), 1, 1, 128, 128, "cpu", cache=cache)
    with pytest.raises(TypeError, match="handle.block_mask"):
        handle.kv_num_blocks = torch.zeros(1, 1, 1, dtype=torch.int32)
    assert not handle.built


def test_torch_paged_attention_converts_a_handle(cache):
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    torch.manual_seed(0)
    B, H, S, D, page = 2, 2, 256, 16, 64
    mask = flexmask.causal() & flexmask.document([[100, 156], [30, 200, 26]])
    handle = flexmask.lazy(mask, B, H, S, S, "cpu", BLOCK_SIZE=(64, page), cache=cache)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    n_pages = 2 * S // page + 3
    paged = PagedAttention(n_pages, page, B, device="cpu")
    paged.empty_pages = torch.randperm(n_pages, generator=torch.Generator().manual_seed(1))
    paged.empty_pages = paged.empty_pages.tolist()  # a shuffled page table
    for b in range(B):
        paged.reserve(torch.tensor(b), torch.tensor(S))
    k_cache, v_cache = torch.zeros(1, H, n_pages * page, D), torch.zeros(1, H, n_pages * page, D)
    paged.assign(torch.arange(B), torch.arange(S).expand(B, S), k, v, k_cache, v_cache)
    physical = paged.convert_logical_block_mask(handle)
    out = torch_flex_attention(q, k_cache, v_cache, block_mask=physical)
    rows = [
        oracle.causal(S, S) & oracle.document(lens, S, S) for lens in ([100, 156], [30, 200, 26])
    ]
    torch.testing.assert_close(out, sdpa(q, k, v, oracle.stack(rows, H)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("balanced", [False, True])
def test_torch_context_parallel_buffers_take_a_handle(balanced, cache):
    import torch.distributed.tensor.experimental._context_parallel._attention as torch_cp
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    S, world = 512, 2
    mask = flexmask.causal() & flexmask.document([200, 180, 132])
    balancer = _HeadTailLoadBalancer(S, world, torch.device("cpu")) if balanced else None
    saved = torch_cp._compiled_create_block_mask, torch_cp._cp_options.enable_load_balance
    torch_cp._compiled_create_block_mask = torch_create_block_mask  # eager: same blocks
    torch_cp._cp_options.enable_load_balance = balanced
    try:
        for rank in range(world):
            handle = flexmask.lazy(mask, 1, 1, S, S, "cpu", cache=cache)
            (ours,) = torch_cp._context_parallel_buffers(
                oracle.FakeMesh(world, rank), [handle], [2], balancer
            )
            expected = oracle.torch_cp_shard(mask, 1, 1, S, world, rank, balancer)
            oracle.assert_same_block_mask(ours, expected, f"rank {rank}", own_storage=False)
    finally:
        torch_cp._compiled_create_block_mask, torch_cp._cp_options.enable_load_balance = saved


def _document_lengths(rng: random.Random, S: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, S - 8), rng.randint(1, 6)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, S - rng.randint(0, 8)], strict=True)]


@pytest.mark.slow
def test_compiled_torch_flex_attention_takes_handles_without_recompiling():
    """torch.compile(flex_attention, fullgraph=True) as a model's attention module holds it
    (torchtitan's FlexAttentionWrapper): two layers, a new handle every step with new
    documents at the same shape, released after the forward. One compile, no graph break,
    no recompile; each step equal to eager flex_attention with the built BlockMask and to
    SDPA on the dense oracle."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(torch_flex_attention, backend=backend, fullgraph=True, dynamic=False)

    class Attention(torch.nn.Module):
        def forward(self, x, block_mask):
            return compiled(x, x, x, block_mask=block_mask)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Attention() for _ in range(2))

        def forward(self, x, block_mask):
            return [layer(x, block_mask) for layer in self.layers]

    model, cache = Model(), flexmask.MaskCache(maxsize=4)
    rng = random.Random(0)
    S, H = 256, 2
    x = torch.randn(1, H, S, 16)
    with torch.no_grad():
        for step in range(6):
            lens = _document_lengths(rng, S)
            mask = flexmask.causal() & flexmask.document(lens)
            handle = flexmask.lazy(mask, 1, H, S, S, "cpu", cache=cache)
            handle.release_after(model)
            outs = model(x, handle)
            assert not handle.built and handle.builds == 1  # one build for both layers
            built = flexmask.create_block_mask(mask, 1, H, S, S, "cpu")
            expected = torch_flex_attention(x, x, x, block_mask=built)
            dense = oracle.stack([oracle.causal(S, S) & oracle.document(lens, S, S)], H)
            for out in outs:
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out, sdpa(x, x, x, dense), atol=1e-5, rtol=1e-5)
            if step == 0:
                frames = backend.frame_count
    assert frames == 1 and backend.frame_count == 1, "a new handle recompiled"
    assert not counters["recompiles"] and not counters["graph_break"]


@pytest.mark.parametrize("name", list(CASES))
def test_block_sparse_attention_reads_a_handles_intervals(name, cache, monkeypatch):
    """A handle passed straight to block_sparse_attention takes the structured path (partial
    blocks read from the Mask's intervals, not evaluated through the mask_mod), as the built
    BlockMask does, and equals SDPA on the dense oracle."""
    from flexmask.backends.block_sparse import api

    mask, B, H, S, dense = CASES[name]
    q, k, v = (torch.randn(B, H, S, 16) for _ in range(3))
    seen = []
    real = api.interval_bounds
    monkeypatch.setattr(api, "interval_bounds", lambda m, plan: seen.append(m) or real(m, plan))
    handle = flexmask.lazy(mask, B, H, S, S, "cpu", BLOCK_SIZE=64, cache=cache)
    # The sparse kernel: at these sizes the auto rule hands the call to SDPA before any
    # interval is read.
    out = block_sparse_attention(q, k, v, handle, backend="sparse")
    assert seen == [mask]
    torch.testing.assert_close(out, sdpa(q, k, v, dense), atol=1e-5, rtol=1e-5)
