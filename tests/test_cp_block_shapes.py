"""Context parallelism at any block shape: a rectangular ``BLOCK_SIZE`` (FA4's (256, 128)
among them) through ``shard``, ``lazy_shard``, every balancer, ``imbalance`` and
``plan_exchange``. Each rank's shard equals torch's ``create_block_mask`` of the permuted
dense mask at that shape (all eight tensors, and ``same_blocks``); attention over the
shards, on 2 gloo ranks at (256, 128), equals single-process attention."""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.blocks import same_blocks
from flexmask.context_parallel import (
    MaskAwareBalancer,
    PerDocumentBalancer,
    PTRRBalancer,
    exchange_from_block_masks,
    imbalance,
    lazy_shard,
    per_document,
    plan_exchange,
)
from tests import oracle
from tests.ranks import spawn_ranks

SHAPES = [(256, 128), (128, 64), (64, 128), (64, 64)]
BALANCERS = ["head_tail", "mask_aware", "ptrr", None, "per_document"]


def _lengths(total: int, world: int) -> list[int]:
    """Documents of mixed lengths, each a multiple of 2W (torch's per-document balancer)."""
    parts = [0.23, 0.04, 0.49, 0.125]
    lengths = [int(p * total) // (2 * world) * 2 * world for p in parts]
    return [*lengths, total - sum(lengths)]


def _case(name: str, S: int, world: int) -> tuple[flexmask.Mask, np.ndarray, list[int]]:
    """(mask, its dense (S, S) reference, document lengths for the per-document balancer)."""
    lengths = _lengths(S, world)
    if name == "documents":
        dense = oracle.causal(S, S) & oracle.document(lengths, S, S)
        return flexmask.causal() & flexmask.document(lengths), dense, lengths
    if name == "window":
        dense = oracle.causal(S, S) & oracle.sliding_window(100, S, S)
        return flexmask.causal() & flexmask.sliding_window(100), dense, lengths
    if name == "tree":  # no closed form: the tile path
        rng = random.Random(5)
        parents = [-1] + [
            rng.randrange(max(0, i - 40), i) if rng.random() > 0.05 else -1 for i in range(1, S)
        ]
        return flexmask.tree(parents), oracle.tree(parents, S, S), lengths
    raise AssertionError(name)


def _balancer(name, lengths, world):
    return PerDocumentBalancer([lengths], world) if name == "per_document" else name


def _torch_reference(shard, dense: np.ndarray, H: int = 1):
    """torch's create_block_mask at the shard's block shape over the rank's rows of the
    permuted dense mask (padding attends nothing and is attended by nothing)."""
    S = shard.padded_length
    padded = np.zeros((S, S), dtype=bool)
    padded[: dense.shape[0], : dense.shape[1]] = dense
    perm = shard.indices[0].numpy()
    rows = padded[perm][:, perm][shard.local]
    return oracle.torch_build(oracle.stack([rows], H), block=tuple(shard.block_mask.BLOCK_SIZE))


def _expanded(block_mask, H: int):
    fields = [
        getattr(block_mask, f).expand(1, H, *getattr(block_mask, f).shape[2:])
        for f in oracle.BLOCK_FIELDS
    ]
    return type(block_mask)(
        block_mask.seq_lengths,
        *(t.contiguous() for t in fields),
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
    )


def _check(shard, dense, context: str, H: int = 1) -> None:
    reference = _torch_reference(shard, dense, H)
    ours = _expanded(shard.block_mask, H)
    oracle.assert_same_block_mask(ours, reference, context, own_storage=False)
    assert same_blocks(ours, reference), context


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["documents", "window", "tree"])
def test_every_balancer_at_every_shape_equals_torch(name, shape):
    """2 ranks at a length no block divides (the balancers pad it), and 3 ranks."""
    for S, world in [(1000, 2), (600, 3)]:
        mask, dense, lengths = _case(name, S, world)
        for balancer in BALANCERS:
            if balancer == "per_document" and name != "documents":
                continue
            for rank in range(world):
                shard = flexmask.shard(
                    mask,
                    1,
                    1,
                    S,
                    world_size=world,
                    rank=rank,
                    balancer=_balancer(balancer, lengths, world),
                    BLOCK_SIZE=shape,
                )
                assert tuple(shard.block_mask.BLOCK_SIZE) == shape
                _check(shard, dense, f"{name} {shape} {balancer} W={world} rank {rank}")


@pytest.mark.parametrize("shape", [(256, 128), (64, 128)])
def test_balancers_deal_whole_blocks_on_both_sides(shape):
    """Mask-aware and PTRR deal units of lcm(Q, KV) tokens and pad to W * lcm; the
    rank's query and key blocks are then whole original blocks."""
    S, world, unit = 1000, 2, math.lcm(*shape)
    mask = flexmask.causal() & flexmask.document(_lengths(S, world))
    for lb in (
        MaskAwareBalancer(mask, 1, 1, S, world, block_size=shape),
        PTRRBalancer(mask, 1, 1, S, world, block_size=shape),
    ):
        assert lb.padded_length == -(-S // (world * unit)) * world * unit
        units = lb._generate_indices().view(-1, unit)
        assert torch.equal(units - units[:, :1], torch.arange(unit).expand_as(units))
        assert bool((units[:, 0] % unit == 0).all())
    # A square pair is the int: the same permutation, the same key.
    square = MaskAwareBalancer(mask, 1, 1, S, world, block_size=(64, 64))
    assert square.key == MaskAwareBalancer(mask, 1, 1, S, world, block_size=64).key


@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    shape=st.sampled_from([(256, 128), (128, 64), (64, 128), (32, 16), (16, 48)]),
    world=st.sampled_from([2, 3]),
    balancer=st.sampled_from(["head_tail", "mask_aware", "ptrr", None]),
)
def test_random_documents_and_windows_equal_torch(data, shape, world, balancer):
    S = data.draw(st.integers(200, 900), label="S")
    cuts = sorted(data.draw(st.sets(st.integers(1, S - 1), max_size=5), label="cuts"))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, S], strict=True)]
    window = data.draw(st.integers(1, 300), label="window")
    mask = flexmask.causal() & flexmask.document(lengths) & flexmask.sliding_window(window)
    dense = (
        oracle.causal(S, S) & oracle.document(lengths, S, S) & oracle.sliding_window(window, S, S)
    )
    rank = data.draw(st.integers(0, world - 1), label="rank")
    shard = flexmask.shard(
        mask, 1, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=shape
    )
    _check(shard, dense, f"{lengths} window {window}")


def test_heads_lazy_shards_and_imbalance_at_a_rectangular_shape():
    S, world, shape = 1024, 2, (256, 128)
    mask, dense, _ = _case("documents", S, world)
    per_head = flexmask.per_head(flexmask.causal(), mask)
    for rank in range(world):
        shard = flexmask.shard(
            mask, 1, 2, S, world_size=world, rank=rank, balancer="mask_aware", BLOCK_SIZE=shape
        )
        _check(shard, dense, f"H=2 rank {rank}", H=2)
        handle = lazy_shard(
            mask, 1, 2, S, world_size=world, rank=rank, balancer="mask_aware", BLOCK_SIZE=shape
        )
        assert tuple(handle.BLOCK_SIZE) == shape and not handle.built
        assert same_blocks(handle.shard.block_mask, shard.block_mask)
        again = pickle.loads(pickle.dumps(handle))  # the recipe, the (Q, KV) pair in it
        assert tuple(again.BLOCK_SIZE) == shape and again.key == handle.key
        assert same_blocks(again.shard.block_mask, shard.block_mask)
        heads = flexmask.shard(
            per_head, 1, 2, S, world_size=world, rank=rank, balancer="head_tail", BLOCK_SIZE=shape
        )
        for h, dense_h in enumerate((oracle.causal(S, S), dense)):
            one = _torch_reference(heads, dense_h)
            for field in oracle.BLOCK_FIELDS:
                got = getattr(heads.block_mask, field)[:, h : h + 1]
                assert torch.equal(got, getattr(one, field)), (rank, h, field)
    ratio = imbalance(mask, 1, 1, S, world, "mask_aware", BLOCK_SIZE=shape)
    assert 1.0 <= ratio <= imbalance(mask, 1, 1, S, world, None, BLOCK_SIZE=shape)


@pytest.mark.parametrize("shape", [(256, 128), (64, 128), (48, 80)])
def test_per_document_closed_form_at_a_rectangular_shape(shape, monkeypatch):
    """The per-document balancer's own mask is written in closed form from the documents
    (``per_document.build``) at any block shape: never the general segments path."""
    calls = []
    build = per_document.build

    def counted(*args, **kwargs):
        calls.append(args)
        return build(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the per-document shard of its own mask took the segments path")

    monkeypatch.setattr(per_document, "build", counted)
    monkeypatch.setattr("flexmask.builders.cp_shard.segment_sides", refuse)
    for S, world in [(1000, 2), (1024, 4)]:
        mask, dense, lengths = _case("documents", S, world)
        for rank in range(world):
            shard = flexmask.shard(
                mask,
                1,
                1,
                S,
                world_size=world,
                rank=rank,
                balancer=PerDocumentBalancer([lengths], world),
                BLOCK_SIZE=shape,
            )
            _check(shard, dense, f"{shape} W={world} rank {rank}")
    assert len(calls) == 2 + 4


@pytest.mark.parametrize("shape", [(256, 128), (64, 128)])
def test_per_row_documents_at_a_rectangular_shape(shape):
    """Rows with their own documents: mask-aware and PTRR give each row its permutation."""
    rows, S, world = [[300, 200, 100, 400], [128, 600, 272]], 1000, 2
    mask = flexmask.causal() & flexmask.document(rows)
    dense = [oracle.causal(S, S) & oracle.document(r, S, S) for r in rows]
    for balancer in ("head_tail", "mask_aware", "ptrr"):
        for rank in range(world):
            shard = flexmask.shard(
                mask, 2, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=shape
            )
            P = shard.padded_length
            permuted = []
            for b, one in enumerate(dense):
                padded = np.zeros((P, P), dtype=bool)
                padded[:S, :S] = one
                perm = shard.indices[b % shard.indices.shape[0]].numpy()
                permuted.append(padded[perm][:, perm][shard.local])
            reference = oracle.torch_build(oracle.stack(permuted, 1), block=shape)
            for field in oracle.BLOCK_FIELDS:
                got = getattr(shard.block_mask, field)
                got = got.expand(2, 1, *got.shape[2:])
                assert torch.equal(got, getattr(reference, field)), (balancer, rank, field)


def test_other_key_length_at_a_rectangular_shape():
    """KV_LEN != Q_LEN (no balancer): contiguous query rows against every key."""
    Q, KV, world, shape = 512, 768, 2, (128, 64)
    mask = flexmask.causal() & flexmask.sliding_window(90)
    dense = oracle.causal(Q, KV) & oracle.sliding_window(90, Q, KV)
    for rank in range(world):
        shard = flexmask.shard(
            mask, 1, 1, Q, KV, world_size=world, rank=rank, balancer=None, BLOCK_SIZE=shape
        )
        rows = dense[rank * Q // world : (rank + 1) * Q // world]
        reference = oracle.torch_build(oracle.stack([rows]), block=shape)
        oracle.assert_same_block_mask(shard.block_mask, reference, own_storage=False)


@pytest.mark.parametrize("shape", [(256, 128), (64, 128)])
@pytest.mark.parametrize("balancer", ["head_tail", "mask_aware", "per_document"])
def test_attention_on_the_received_keys_is_exact(balancer, shape):
    """plan_exchange at a rectangular shape: each rank's attention over only the keys it
    receives (the exchange simulated by indexing), restored, equals dense attention."""
    S, world, H = 1024, 2, 2
    mask, dense, lengths = _case("documents", S, world)
    lb = _balancer(balancer, lengths, world)
    shards = [
        flexmask.shard(mask, 1, H, S, world_size=world, rank=r, balancer=lb, BLOCK_SIZE=shape)
        for r in range(world)
    ]
    plans = [exchange_from_block_masks([s.block_mask for s in shards], r) for r in range(world)]
    again = plan_exchange(mask, 1, H, S, world_size=world, rank=1, balancer=lb, BLOCK_SIZE=shape)
    assert same_blocks(again.block_mask, plans[1].block_mask)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, H, S, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    perm = shards[0].indices[0]
    outs = []
    for rank, plan in enumerate(plans):
        parts = []
        for owner, other in enumerate(plans):
            start = sum(other.send_counts[:rank])
            sent = other.send_index[start : start + other.send_counts[rank]]
            parts.append(sent + owner * other.slice_length)
        got = perm[torch.cat(parts)]
        keys = int(plan.block_mask.seq_lengths[1])
        slots = torch.arange(keys) if plan.recv_slots is None else plan.recv_slots
        k_in = k.new_zeros(1, H, keys, 8).index_copy(2, slots, k[:, :, got])
        v_in = v.new_zeros(1, H, keys, 8).index_copy(2, slots, v[:, :, got])
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


def _gloo_checks(rank: int, world: int, S: int, shape: tuple[int, int]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from flexmask.context_parallel import shard_buffers, unshard

    mesh = init_device_mesh("cpu", (world,))
    for name in ("documents", "tree"):
        mask, _, lengths = _case(name, S, world)
        for balancer in ("head_tail", "mask_aware"):
            torch.manual_seed(0)  # every rank draws the same global tensors
            q, k, v = (torch.randn(1, 2, S, 16, requires_grad=True) for _ in range(3))
            ref = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
            grad_out = torch.randn_like(ref)
            ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
            plan = plan_exchange(mask, 1, 2, S, mesh=mesh, balancer=balancer, BLOCK_SIZE=shape)
            shard = plan.shard
            assert tuple(shard.block_mask.BLOCK_SIZE) == shape
            for target in (plan, shard):  # the exchange, and the all-gather
                local = shard_buffers(shard, mesh, [q.detach(), k.detach(), v.detach()], [2] * 3)
                for t in local:
                    t.requires_grad_(True)
                out = flexmask.cp_flex_attention(*local, target, mesh, compile=False)
                out.backward(shard.shard_tensor(grad_out, 2))
                got = unshard(shard, mesh, [out.detach(), *(t.grad for t in local)], [2] * 4)
                for g, w in zip(got, (ref, *ref_grads), strict=True):
                    torch.testing.assert_close(g, w.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_two_gloo_ranks_at_fa4_blocks_are_exact():
    """FA4's Blackwell shape, (256, 128), on 2 gloo ranks: outputs and q/k/v gradients
    through the exchange and through the all-gather equal single-process attention."""
    spawn_ranks(_gloo_checks, 2, 1024, (256, 128))
