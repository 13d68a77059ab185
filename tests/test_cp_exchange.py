"""Context parallel that moves only what each rank reads (``plan_exchange``, the exchange in
``cp_flex_attention``): every rank receives exactly the keys its queries attend (against a
dense oracle), attention on them is exact (outputs and gradients, in one process and on 2
and 4 gloo ranks), ``"auto"`` falls back to the all-gather on a dense causal mask, and a
rank with bad input raises before any collective."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import flexmask
from flexmask.context_parallel import (
    KVExchange,
    PerDocumentBalancer,
    exchange_from_block_masks,
    plan_exchange,
)
from tests import oracle
from tests.ranks import run_ranks, spawn_ranks

LENGTHS = [232, 40, 504, 128, 120]  # mixed, each a multiple of 2W for W = 2, 4 (S = 1024)


def _lengths(S: int) -> list[int]:
    lengths = [n * S // 1024 for n in LENGTHS]
    lengths[-1] += S - sum(lengths)
    return lengths


def _tree_parents(rng: random.Random, n: int) -> list[int]:
    """A prefix tree: a few roots, each token's parent among the 40 before it."""
    return [-1] + [
        rng.randrange(max(0, i - 40), i) if rng.random() > 0.03 else -1 for i in range(1, n)
    ]


def _case(name: str, S: int) -> tuple[flexmask.Mask, np.ndarray]:
    """(mask, its dense (S, S) reference)."""
    if name == "documents":
        lengths = _lengths(S)
        return (
            flexmask.causal() & flexmask.document(lengths),
            oracle.causal(S, S) & oracle.document(lengths, S, S),
        )
    if name == "window":
        return (
            flexmask.causal() & flexmask.sliding_window(48),
            oracle.causal(S, S) & oracle.sliding_window(48, S, S),
        )
    if name == "tree":
        parents = _tree_parents(random.Random(3), S)
        return flexmask.tree(parents), oracle.tree(parents, S, S)
    if name == "causal":
        return flexmask.causal(), oracle.causal(S, S)
    raise AssertionError(name)


def _balancer(name: str, S: int, world: int):
    if name == "per_document":
        return PerDocumentBalancer([_lengths(S)], world)
    return name


def _plans(mask, S, world, balancer, block=32, H=2):
    shards = [
        flexmask.shard(mask, 1, H, S, world_size=world, rank=r, balancer=balancer, BLOCK_SIZE=block)
        for r in range(world)
    ]
    masks = [s.block_mask for s in shards]
    return shards, [exchange_from_block_masks(masks, r, shards[r]) for r in range(world)]


def _received_positions(plans: list[KVExchange], rank: int) -> torch.Tensor:
    """The permuted key positions ``rank`` receives, from what every owner sends it."""
    parts = []
    for owner, plan in enumerate(plans):
        start = sum(plan.send_counts[:rank])
        sent = plan.send_index[start : start + plan.send_counts[rank]]
        parts.append(sent + owner * plan.slice_length)
    return torch.cat(parts)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("balancer", [None, "head_tail", "per_document", "mask_aware"])
@pytest.mark.parametrize("name", ["documents", "window", "tree", "causal"])
def test_each_rank_receives_exactly_the_keys_it_attends(name, balancer, world):
    """A full tile is attended whole, and a partial one's attended keys are found: so the
    keys a rank receives are exactly those its queries attend (padding never), and what
    each owner sends it is what it expects from that owner."""
    S = 1000 if balancer in (None, "head_tail") else 1024  # padded where the balancer needs
    mask, dense = _case(name, S)
    shards, plans = _plans(mask, S, world, _balancer(balancer, S, world))
    padded = shards[0].padded_length
    perm = shards[0].indices[0].numpy()
    whole = np.zeros((padded, padded), dtype=bool)
    whole[:S, :S] = dense
    for rank, plan in enumerate(plans):
        rows = perm[shards[rank].local]
        attended = np.flatnonzero(whole[rows][:, perm].any(0))
        got = _received_positions(plans, rank)
        assert got.tolist() == attended.tolist(), (name, balancer, world, rank)
        own = (attended >= rank * plan.slice_length) & (attended < (rank + 1) * plan.slice_length)
        assert plan.received[rank] == int((~own).sum())
        assert plan.recv_counts == tuple(p.send_counts[rank] for p in plans)
        assert all(p.received == plan.received for p in plans)  # every rank's plan agrees
        assert plan.gathered == (world - 1) * padded // world


def test_other_key_length_and_a_rank_that_attends_nothing():
    """Keys longer than the queries (no balancer: contiguous rows and key slices) are planned
    the same way; a rank whose queries are all padding receives nothing, and its attention
    over no keys gives zeros."""
    world, q_len, kv_len = 4, 512, 1024
    mask = flexmask.causal() & flexmask.sliding_window(64)
    dense = oracle.causal(q_len, kv_len) & oracle.sliding_window(64, q_len, kv_len)
    shards = [
        flexmask.shard(
            mask, 1, 1, q_len, kv_len, world_size=world, rank=r, balancer=None, BLOCK_SIZE=32
        )
        for r in range(world)
    ]
    plans = [exchange_from_block_masks([s.block_mask for s in shards], r) for r in range(world)]
    for rank in range(world):
        rows = slice(rank * q_len // world, (rank + 1) * q_len // world)
        attended = np.flatnonzero(dense[rows].any(0)).tolist()
        assert _received_positions(plans, rank).tolist() == attended
    padded = flexmask.causal() & flexmask.padding(100)
    shards = [
        flexmask.shard(padded, 1, 1, 1024, world_size=world, rank=r, balancer=None, BLOCK_SIZE=64)
        for r in range(world)
    ]
    plan = exchange_from_block_masks([s.block_mask for s in shards], 2)
    assert plan.received == (0, 0, 0, 0) and plan.block_mask.seq_lengths == (256, 0)
    q = torch.randn(1, 1, 256, 8)
    none = torch.zeros(1, 1, 0, 8)
    out = flexmask.flex_attention(q, none, none, block_mask=plan.block_mask, compile=False)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("balancer", ["head_tail", "per_document"])
@pytest.mark.parametrize("name", ["documents", "window", "tree", "causal"])
def test_attention_on_the_received_keys_is_exact(name, balancer):
    """Each rank's attention over its received buffer (zeros where a partial block's key is
    not attended) with the remapped BlockMask, restored, equals the plain dense attention:
    outputs and q/k/v gradients, in float64 (the exchange simulated by indexing)."""
    S, world, H = 1024, 4, 2
    mask, dense = _case(name, S)
    shards, plans = _plans(mask, S, world, _balancer(balancer, S, world), H=H)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, H, S, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    perm = shards[0].indices[0]
    k_perm, v_perm = k[:, :, perm], v[:, :, perm]
    outs = []
    for rank, plan in enumerate(plans):
        keys = int(plan.block_mask.seq_lengths[1])
        slots = torch.arange(keys) if plan.recv_slots is None else plan.recv_slots
        got = _received_positions(plans, rank)
        k_in = k_perm.new_zeros(1, H, keys, 8).index_copy(2, slots, k_perm[:, :, got])
        v_in = v_perm.new_zeros(1, H, keys, 8).index_copy(2, slots, v_perm[:, :, got])
        local_q = shards[rank].shard_tensor(q, 2)
        outs.append(
            flexmask.flex_attention(local_q, k_in, v_in, block_mask=plan.block_mask, compile=False)
        )
    out = shards[0].restore(torch.cat(outs, 2), 2)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
    want, _ = oracle.attention(q2, k2, v2, torch.from_numpy(dense))
    want_grads = torch.autograd.grad(want, (q2, k2, v2), grad_out)
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_auto_exchanges_packed_documents_and_all_gathers_dense_causal():
    """The choice is the same on every rank (from every rank's needs): documents sharded
    contiguously move little; a dense causal mask's last rank reads every key, so the
    all-gather stays."""
    S, world = 4096, 4
    lengths = [256] * 16
    docs = flexmask.causal() & flexmask.document(lengths)
    plans = [
        plan_exchange(docs, 1, 1, S, world_size=world, rank=r, balancer=None, BLOCK_SIZE=64)
        for r in range(world)
    ]
    assert all(p.needed for p in plans) and plans[0].received == (0, 0, 0, 0)
    causal = [
        plan_exchange(flexmask.causal(), 1, 1, S, world_size=world, rank=r, BLOCK_SIZE=64)
        for r in range(world)
    ]
    assert not any(p.needed for p in causal)
    assert max(causal[0].received) == causal[0].gathered  # rank 0's tail reads everything
    again = plan_exchange(docs, 1, 1, S, world_size=world, rank=1, balancer=None, BLOCK_SIZE=64)
    assert again is plans[1]  # kept by shard key: a step's layers share one


@pytest.fixture
def one_rank_group():
    """A one-process gloo group (an in-memory store, no spawn), destroyed after the test."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_the_exchange_on_one_rank_and_its_errors(one_rank_group):
    """On a one-rank group the exchange runs its collective both ways (gradients equal the
    all-gather's); a bad ``exchange``, a shard that cannot be planned from and a plan made
    for another group are refused by name before any collective."""
    S, lengths = 256, [100, 60, 96]
    mask = flexmask.causal() & flexmask.document(lengths)
    plan = plan_exchange(mask, 1, 2, S, world_size=1, rank=0, BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, 2, S, 8, requires_grad=True) for _ in range(3))
    results = []
    for exchange in ("needed", "all_gather"):
        out = flexmask.cp_flex_attention(q, k, v, plan, exchange=exchange, compile=False)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    handle = flexmask.lazy_shard(mask, 1, 2, S, world_size=1, rank=0, BLOCK_SIZE=32)
    out = flexmask.cp_flex_attention(q, k, v, handle, exchange="needed", compile=False)
    results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for got, want, lazy in zip(*results, strict=True):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(lazy, want)
    with pytest.raises(ValueError, match="exchange must be 'auto'"):
        flexmask.cp_flex_attention(q, k, v, plan, exchange="halo")
    with pytest.raises(ValueError, match="plan_exchange"):
        flexmask.cp_flex_attention(q, k, v, plan.shard, exchange="needed")
    other = plan_exchange(mask, 1, 2, 2 * S, world_size=2, rank=1, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="shard was made for world_size=2"):
        flexmask.cp_flex_attention(q, k, v, other, exchange="needed")
    with pytest.raises(TypeError, match="shard must be"):
        flexmask.cp_flex_attention(q, k, v, "shard", exchange="needed")


def test_exchange_kv_of_any_pair_on_one_rank(one_rank_group):
    """The exchange alone: keys never attended (past the padding) are not moved and read as
    zeros; keys and values of two dtypes move one message each; a loss that reads only the
    keys gives the values zero gradients."""
    from flexmask.context_parallel.exchange import exchange_kv

    mask = flexmask.causal() & flexmask.padding(200)
    plan = plan_exchange(mask, 1, 1, 256, world_size=1, rank=0, BLOCK_SIZE=64)
    assert plan.recv_slots is not None and plan.send_index.tolist() == list(range(200))
    key = torch.randn(1, 2, 256, 4, requires_grad=True)
    value = torch.randn(1, 2, 256, 3, dtype=torch.float64, requires_grad=True)
    group = torch.distributed.group.WORLD
    moved_key, moved_value = exchange_kv(key, value, plan, 2, group)
    assert moved_key.shape == (1, 2, 256, 4) and moved_value.dtype == torch.float64
    torch.testing.assert_close(moved_key[:, :, :200], key[:, :, :200])
    assert not moved_key[:, :, 200:].any() and not moved_value[:, :, 200:].any()
    moved_key, moved_value = exchange_kv(key, value.float(), plan, 2, group)
    (moved_key * 2).sum().backward()
    assert torch.equal(key.grad[:, :, :200], torch.full_like(key[:, :, :200], 2.0))
    assert not key.grad[:, :, 200:].any() and not value.grad.any()


def _exchange_checks(rank: int, world: int, S: int, names: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from flexmask.context_parallel import shard_buffers, unshard

    mesh = init_device_mesh("cpu", (world,))
    for name in names:
        for balancer in ("head_tail", "per_document"):
            mask, _ = _case(name, S)
            torch.manual_seed(0)  # every rank draws the same global tensors
            q, k, v = (torch.randn(1, 2, S, 16, requires_grad=True) for _ in range(3))
            ref = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
            grad_out = torch.randn_like(ref)
            ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
            plan = plan_exchange(
                mask, 1, 2, S, mesh=mesh, balancer=_balancer(balancer, S, world), BLOCK_SIZE=32
            )
            shard = plan.shard
            assert name != "causal" or not plan.needed  # the fallback case
            for exchange in ("auto", "needed"):
                local = shard_buffers(shard, mesh, [q.detach(), k.detach(), v.detach()], [2] * 3)
                for t in local:
                    t.requires_grad_(True)
                out = flexmask.cp_flex_attention(
                    *local, plan, mesh, exchange=exchange, compile=False
                )
                out.backward(shard.shard_tensor(grad_out, 2))
                got = unshard(shard, mesh, [out.detach(), *(t.grad for t in local)], [2] * 4)
                for g, w in zip(got, (ref, *ref_grads), strict=True):
                    torch.testing.assert_close(g, w.detach(), atol=1e-5, rtol=1e-5)


def test_two_gloo_ranks_exchange_exactly():
    spawn_ranks(_exchange_checks, 2, 512, ["documents", "tree", "causal"])


@pytest.mark.slow  # four spawned ranks: 7 s on 2 quiet cores, 40 s on busy ones
def test_four_gloo_ranks_exchange_exactly():
    spawn_ranks(_exchange_checks, 4, 1024, ["documents", "window", "tree", "causal"])


def _refusals(rank: int, world: int) -> None:
    """Three calls on 2 ranks, each caught and checked on every rank: rank 1's keys are 8
    positions too long; the ranks planned from different masks (named by the agreement's
    mask fingerprint, before the split sizes are compared); then a good call (the group
    still works, and equals the all-gather)."""
    docs = flexmask.causal() & flexmask.document([64, 64])

    def plan(mask):
        return plan_exchange(
            mask, 1, 1, 128, world_size=world, rank=rank, balancer=None, BLOCK_SIZE=16
        )

    def call(plan, extra=0, exchange="needed"):
        q = torch.randn(1, 1, 128 // world, 8)
        k, v = (torch.randn(1, 1, 128 // world + extra, 8) for _ in range(2))
        return flexmask.cp_flex_attention(q, k, v, plan, exchange=exchange, compile=False)

    with pytest.raises(ValueError) as refused:
        call(plan(docs), extra=8 if rank == 1 else 0)
    expected = "key and value must hold" if rank == 1 else r"rank\(s\) \[1\] of the group refused"
    refused.match(expected)
    with pytest.raises(ValueError, match="the ranks disagree on mask"):
        call(plan(docs if rank == 0 else flexmask.causal()))
    torch.manual_seed(rank)
    needed = call(plan(docs))
    torch.manual_seed(rank)
    gathered = call(plan(docs), exchange="all_gather")
    torch.testing.assert_close(needed, gathered)


def test_refused_inputs_and_disagreeing_plans_raise_on_every_rank():
    """Before the all-to-all the ranks share their checks' outcome and split sizes: a rank
    that refuses its keys raises its own ValueError and every other rank one naming it,
    even though the refusing rank catches its error and carries on (nobody waits in a
    collective for it); plans of different masks raise on every rank instead of aborting in
    gloo; and the group still serves the next call (tests/test_cp_agreement.py: every other
    disagreement, on both paths). run_ranks fails the test on a signal
    or a hang (ranks killed after 120 s)."""
    reports = run_ranks(_refusals, 2, group_timeout_s=20, deadline_s=120)
    assert reports == [None, None], "\n".join(r for r in reports if r)
