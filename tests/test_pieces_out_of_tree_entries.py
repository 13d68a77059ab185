"""The piece written outside flexmask (tests/test_pieces_out_of_tree.py) through the entry
points that file does not take it through: the cache, a lazy handle's forward and backward,
a decode step and a whole generation, a context-parallel shard and its exchange plan — each
compared with the piece's plain reference or torch's own build of its mask_mod."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.context_parallel import plan_exchange
from tests import oracle
from tests.test_pieces_out_of_tree import every_other_document, reference

LENS = [[150, 90, 130, 100, 42], [60, 200, 80, 172]]
B, S = 2, 512


def _dense() -> torch.Tensor:
    return torch.from_numpy(reference(LENS, S, S))[:, None]


@pytest.mark.parametrize("backend", ["slices", "block_sparse", "sdpa"])
def test_the_cache_and_a_lazy_handle_take_it(backend):
    mask = flexmask.causal() & every_other_document(LENS)
    want_blocks = torch_create_block_mask(
        mask.mask_mod_for(S, S), B, 1, S, S, device="cpu", BLOCK_SIZE=64
    )
    cache = flexmask.MaskCache()
    oracle.assert_same_block_mask(cache.get(mask, B, 1, S, S, "cpu", 64), want_blocks)
    q, k, v = (torch.randn(B, 2, S, 16, requires_grad=True) for _ in range(3))
    handle = flexmask.lazy(mask, B, 1, S, S, "cpu", 64, cache=cache)
    with handle:
        out = flexmask.attention(q, k, v, handle, backend)
        out.sum().backward()
    dense = _dense() & torch.ones(S, S, dtype=torch.bool).tril()
    want = oracle.attention(q, k, v, dense)[0]
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    # slices lowers the Mask itself: its handle reads no BlockMask, so the cache is not asked
    assert cache.info().hits == (0 if backend == "slices" else 1) and q.grad is not None


def test_a_decode_step_and_a_generation_take_it():
    mask = flexmask.causal() & every_other_document(LENS)
    lens = [300, 410]
    step = flexmask.decode_mask(mask, lens, q_len=3, capacity=S, block_size=32)

    def shifted(b, h, q, kv):
        return mask.mask_mod_for(S, S)(b, h, q + torch.tensor(lens)[b], kv)

    want = torch_create_block_mask(shifted, B, 1, 3, S, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(
        oracle.block_mask_meaning(step, B, 1, 3, S),
        oracle.block_mask_meaning(want, B, 1, 3, S),
    )
    steps = flexmask.DecodeMasks(mask, lens, S, q_len=1, block_size=32)
    dense = _dense()[:, 0] & torch.ones(S, S, dtype=torch.bool).tril()
    for n, decoded in enumerate(steps):
        rows = oracle.block_mask_meaning(decoded.block_mask, B, 1, 1, S)[:, 0, 0]
        assert torch.equal(rows, dense[torch.arange(B), torch.tensor(lens) + n])
        if n == 4:
            break


@pytest.mark.parametrize("balancer", ["head_tail", "mask_aware", None])
def test_a_shard_and_its_exchange_plan_take_it(balancer):
    mask = flexmask.causal() & every_other_document(LENS[0])
    dense = np.asarray(reference([LENS[0]], S, S)[0] & np.tril(np.ones((S, S), dtype=bool)))
    for rank in range(2):
        args = dict(world_size=2, rank=rank, balancer=balancer, BLOCK_SIZE=64)
        s = flexmask.shard(mask, 1, 1, S, **args)
        perm = s.indices[0].numpy()
        rows = dense[perm][:, perm][s.local]
        want = oracle.torch_build(oracle.stack([rows]), block=s.block_mask.BLOCK_SIZE)
        oracle.assert_same_block_mask(s.block_mask, want, own_storage=False)
        plan = plan_exchange(mask, 1, 1, S, **args)
        # over the keys it receives, the plan's BlockMask attends every pair the shard does
        q_len, kv_len = plan.block_mask.seq_lengths
        meaning = oracle.block_mask_meaning(plan.block_mask, 1, 1, q_len, kv_len)
        assert int(meaning.sum()) == int(rows.sum()) and kv_len <= S
