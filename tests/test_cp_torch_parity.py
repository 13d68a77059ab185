"""Context parallelism where torch has more to say: KV_LEN != Q_LEN, torch's PTRR balancer
from structure, and a module parallelized with torch's _ContextParallel on gloo."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor.experimental._attention import (
    _HeadTailLoadBalancer,
    _PTRRLoadBalancer,
)
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.context_parallel import PTRRBalancer
from tests import oracle
from tests.ranks import spawn_ranks
from tests.test_cp import (
    check_against_oracle,
    dense_case,
    document_dense,
    expanded,
    random_lengths,
    random_tree,
)


def torch_cp_block_mask(mask, B, H, Q, KV, world, rank, balancer=None):
    return oracle.torch_cp_shard(mask, B, H, Q, world, rank, balancer, kv_len=KV)


def other_keys_case(name, Q, KV, rng):
    """(mask over max(Q, KV) positions, dense (Q, KV) reference)."""
    n = max(Q, KV)
    if name == "causal":
        return flexmask.causal(), oracle.causal(Q, KV)
    if name == "sliding_window":
        return (
            flexmask.causal() & flexmask.sliding_window(150),
            oracle.causal(Q, KV) & oracle.sliding_window(150, Q, KV),
        )
    if name == "prefix_lm":
        return flexmask.causal() | flexmask.prefix(300), oracle.causal(Q, KV) | oracle.prefix(
            300, Q, KV
        )
    if name == "document":
        lengths = random_lengths(rng, n, 8, 5)
        return flexmask.causal() & flexmask.document(lengths), document_dense(lengths, n)[:Q, :KV]
    if name == "tree":
        parents = random_tree(rng, n)
        return flexmask.tree(parents), oracle.tree(parents, Q, KV)
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "document", "tree"])
def test_other_key_length_equals_torch_and_oracle(name):
    """KV_LEN != Q_LEN without a balancer: rows [r Q/W, (r+1) Q/W) against every key, in
    order: torch's blocks (B = H = 2) and the dense rows."""
    rng = random.Random(len(name))
    for Q, KV, world in [(512, 1024, 2), (1024, 640, 4), (1024, 384, 2)]:
        mask, dense = other_keys_case(name, Q, KV, rng)
        for rank in range(world):
            ours = flexmask.shard(mask, 2, 2, Q, KV, world_size=world, rank=rank, balancer=None)
            theirs = torch_cp_block_mask(mask, 2, 2, Q, KV, world, rank)
            oracle.assert_same_block_mask(
                expanded(ours.block_mask, 2, 2), theirs, f"{Q}x{KV} rank {rank}", own_storage=False
            )
            local = Q // world
            rows = dense[rank * local : (rank + 1) * local]
            reference = oracle.torch_build(oracle.stack([rows] * 2, 2), block=128)
            oracle.assert_same_block_mask(
                expanded(ours.block_mask, 2, 2), reference, own_storage=False
            )
            keys = torch.arange(KV).view(1, KV, 1)
            assert torch.equal(ours.shard_kv(keys, 1).flatten(), keys.flatten()[ours_kv(ours)])


def ours_kv(shard):
    size = shard.kv_length // shard.world_size
    return slice(shard.rank * size, (shard.rank + 1) * size)


def test_other_key_length_any_block_size():
    """Lengths torch's CP refuses (not a multiple of W * 128): against the dense rows."""
    rng = random.Random(3)
    for name in ["document", "tree", "sliding_window"]:
        for Q, KV, world, block in [(300, 500, 3, 32), (700, 200, 2, 48)]:
            mask, dense = other_keys_case(name, Q, KV, rng)
            for rank in range(world):
                ours = flexmask.shard(
                    mask, 1, 1, Q, KV, world_size=world, rank=rank, balancer=None, BLOCK_SIZE=block
                )
                local = Q // world
                reference = oracle.torch_build(
                    oracle.stack([dense[rank * local : (rank + 1) * local]]), block=block
                )
                oracle.assert_same_block_mask(
                    expanded(ours.block_mask, 1, 1), reference, own_storage=False
                )


def test_other_key_length_with_a_balancer_is_refused_as_torch_cannot_build_it():
    mask = flexmask.causal()
    for balancer in ["head_tail", "ptrr", "mask_aware", _HeadTailLoadBalancer(512, 2, "cpu")]:
        with pytest.raises(ValueError, match="balancer=None"):
            flexmask.shard(mask, 1, 1, 512, 1024, world_size=2, rank=0, balancer=balancer)
    # torch itself: keys past Q_LEN index the queries' permutation out of bounds.
    with pytest.raises(IndexError):
        torch_cp_block_mask(mask, 1, 1, 512, 1024, 2, 0, _HeadTailLoadBalancer(512, 2, "cpu"))
    with pytest.raises(ValueError, match="multiple of world_size"):
        flexmask.shard(mask, 1, 1, 501, 1024, world_size=2, rank=0, balancer=None)
    with pytest.raises(ValueError, match="KV_LEN"):
        flexmask.shard(mask, 1, 1, 512, 0, world_size=2, rank=0, balancer=None)
    shard = flexmask.shard(mask, 1, 1, 512, 1001, world_size=2, rank=0, balancer=None)
    with pytest.raises(ValueError, match="kv_length"):
        shard.shard_kv(torch.zeros(1, 1001), 1)


def torch_ptrr(mask, B, S, world, block):
    bm = torch_create_block_mask(mask.mask_mod, B, 1, S, S, device="cpu", BLOCK_SIZE=block)
    return _PTRRLoadBalancer(bm, world)


PTRR_CASES = ["document", "tree", "sliding_window", "prefix_lm"]


@pytest.mark.parametrize("name", PTRR_CASES)
def test_ptrr_indices_equal_torch(name):
    """The permutation (and its inverse) equals torch's _generate_indices on torch's own
    BlockMask, for block sizes and worlds torch takes, a partial last block included."""
    rng = random.Random(len(name) + 1)
    for S, world, block in [(1024, 2, 128), (2048, 4, 64), (1000, 4, 64), (4096, 8, 128)]:
        mask, _, _ = dense_case(name, S, rng)
        ours = PTRRBalancer(mask, 1, 1, S, world, block_size=block)
        theirs = torch_ptrr(mask, 1, S, world, block)
        for restore in (False, True):
            assert torch.equal(ours._generate_indices(restore), theirs._generate_indices(restore))


def test_ptrr_per_row_and_heads():
    """Per-row documents give one permutation per row, as torch's (B, 1, S, S) BlockMask;
    H > 1 on a head-independent mask is H = 1 (torch's own reshape breaks there: its
    indices come out H times too long); a head-dependent mask with H > 1 is refused."""
    rng = random.Random(9)
    S, world, block = 2048, 4, 64
    lengths = [random_lengths(rng, S, 64, 6), random_lengths(rng, S, 8, 3)]
    mask = flexmask.causal() & flexmask.document(lengths)
    ours = PTRRBalancer(mask, 2, 4, S, world, block_size=block)._generate_indices()
    assert torch.equal(ours, torch_ptrr(mask, 2, S, world, block)._generate_indices())
    bm = torch_create_block_mask(mask.mask_mod, 2, 2, S, S, device="cpu", BLOCK_SIZE=block)
    assert _PTRRLoadBalancer(bm, world)._generate_indices().shape[-1] == 2 * S
    heads = flexmask.per_head(flexmask.causal(), flexmask.causal() & flexmask.sliding_window(64))
    with pytest.raises(ValueError, match="depends on the head"):
        PTRRBalancer(heads, 1, 2, S, world)
    with pytest.raises(TypeError, match="mask"):
        PTRRBalancer(mask.mask_mod, 1, 1, S, world)


@pytest.mark.parametrize("name", PTRR_CASES)
def test_shard_with_ptrr_equals_torch(name):
    """flexmask.shard(balancer='ptrr') gives torch's PTRR permutation and, rank by rank, the
    blocks torch's _create_cp_block_mask builds with torch's PTRR balancer."""
    rng = random.Random(len(name) + 2)
    S, world = 1024, 2
    mask, dense, _ = dense_case(name, S, rng)
    theirs = torch_ptrr(mask, 1, S, world, 128)
    for rank in range(world):
        ours = flexmask.shard(mask, 1, 2, S, world_size=world, rank=rank, balancer="ptrr")
        assert torch.equal(ours.indices, theirs._generate_indices())
        reference = oracle.torch_cp_shard(mask, 1, 2, S, world, rank, theirs)
        oracle.assert_same_block_mask(
            expanded(ours.block_mask, 1, 2), reference, f"rank {rank}", own_storage=False
        )
        check_against_oracle(ours, dense, 1, 1)


def test_ptrr_rank_costs_are_balanced_on_documents():
    rng = random.Random(4)
    S, world = 1 << 15, 8
    mask = flexmask.causal() & flexmask.document(random_lengths(rng, S, 128, 12))
    lb = PTRRBalancer(mask, 1, 1, S, world)
    costs = lb.rank_costs[0].double()
    assert costs.sum() == lb.block_costs.sum()
    assert float(costs.max() / costs.mean()) < 1.05


# --- torch's _ContextParallel (parallelize_module) with a flexmask shard -----------------


class FlexAttention(torch.nn.Module):
    """What torchtitan's FlexAttentionWrapper is: a module whose forward is flex_attention,
    so _ContextParallel's forward pre-hook can all-gather its key and value."""

    def forward(self, query, key, value, block_mask):
        return flexmask.flex_attention(query, key, value, block_mask=block_mask, compile=False)


def _parallel_checks(rank, world, S):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module

    from flexmask.context_parallel import shard_buffers, unshard

    mesh = init_device_mesh("cpu", (world,))
    attention = parallelize_module(
        FlexAttention(), mesh, _ContextParallel(2, _ContextParallel.AttentionType.FLEX)
    )
    rng = random.Random(5)
    lengths = random_lengths(rng, S, 2 * world, 5)
    for mask, balancer in [
        (flexmask.causal() & flexmask.document(lengths), "ptrr"),
        (flexmask.tree(random_tree(rng, S)), "mask_aware"),
    ]:
        torch.manual_seed(0)  # every rank draws the same global tensors
        q, k, v = (torch.randn(1, 2, S, 16, requires_grad=True) for _ in range(3))
        ref = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
        ref.backward(torch.ones_like(ref))
        shard = flexmask.shard(mask, 1, 2, S, mesh=mesh, balancer=balancer, BLOCK_SIZE=64)
        local_q, local_k, local_v, bm = shard_buffers(
            shard, mesh, [q.detach(), k.detach(), v.detach(), mask], [2, 2, 2, 0]
        )
        for t in (local_q, local_k, local_v):
            t.requires_grad_(True)
        out = attention(local_q, local_k, local_v, block_mask=bm)  # torch's hook gathers k, v
        out.backward(torch.ones_like(out))
        gathered = unshard(
            shard, mesh, [out.detach(), local_q.grad, local_k.grad, local_v.grad], [2, 2, 2, 2]
        )
        for got, want in zip(gathered, (ref, q.grad, k.grad, v.grad), strict=True):
            torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # two spawned processes: ~30 s on 2 busy cores
def test_context_parallel_style_runs_a_flexmask_shard():
    spawn_ranks(_parallel_checks, 2, 512)


def test_dense_reference_helper_is_not_vacuous():
    """The KV_LEN reference rows are the plain dense mask (guards the helper itself)."""
    mask, dense = other_keys_case("causal", 4, 6, random.Random(0))
    assert dense.shape == (4, 6) and np.array_equal(dense, np.tril(np.ones((4, 6), dtype=bool)))
