"""Context-parallel shards written from segments (``flexmask.builders.segments``),
the mask-aware balancer's costs and deal, and ``import flexmask`` without torch.distributed:
against torch's ``_create_cp_block_mask``, torch's BlockMask of the dense oracle rows, and
plain references."""

from __future__ import annotations

import heapq
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import flexmask
from flexmask.builders.segments import segment_sides
from flexmask.context_parallel import MaskAwareBalancer, PerDocumentBalancer
from flexmask.context_parallel.balance import _block_costs, deal, ptrr_schedule
from tests import oracle
from tests.test_cp import (
    check_against_oracle,
    document_dense,
    expanded,
    random_lengths,
    random_tree,
)

SHARD = sys.modules["flexmask.builders.cp_shard"]


SEGMENTS = sys.modules["flexmask.builders.segments"]
BUILD = sys.modules["flexmask.context_parallel.build"]


@pytest.fixture
def segments_only(monkeypatch):
    """Closed-form shards take the segments path (runs per ascending key piece and the
    per-document balancer's closed form for its own mask turned off), never a dense compare
    or the tile path; returns the list of written sides."""
    calls = []
    monkeypatch.setattr(BUILD, "_own_documents", lambda *args: None)
    real = SEGMENTS.side
    monkeypatch.setattr(SHARD, "PIECES_PER_BLOCK", 0.0)
    monkeypatch.setattr(SHARD, "DENSE_PAIRS_PER_BLOCK", 1e9)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("a closed-form shard left the segments path")

    monkeypatch.setattr(SEGMENTS, "side", counted)
    monkeypatch.setattr(SHARD, "side", counted)
    monkeypatch.setattr(SHARD, "ordered_lines", refuse)
    monkeypatch.setattr(SHARD, "_tile_sides", refuse)
    return calls


@pytest.mark.parametrize("world", [2, 4])
def test_per_document_shards_equal_torch(world, segments_only):
    """torch's per-document balancer cuts documents into chunks of 2W that blocks do not
    align with: every rank equals torch's _create_cp_block_mask (H = 2) and the oracle."""
    rng = random.Random(world)
    S = 2048
    lengths = random_lengths(rng, S, 8 * world, 6)
    mask = flexmask.causal() & flexmask.document(lengths)
    for rank in range(world):
        lb = PerDocumentBalancer([lengths], world)
        ours = flexmask.shard(mask, 1, 2, S, world_size=world, rank=rank, balancer=lb)
        reference = oracle.torch_cp_shard(mask, 1, 2, S, world, rank, lb)
        oracle.assert_same_block_mask(
            expanded(ours.block_mask, 1, 2), reference, f"rank {rank}", own_storage=False
        )
        check_against_oracle(ours, document_dense(lengths, S), 1, 1)
    assert len(segments_only) == 2 * world  # both sides of every rank


def _random_case(rng, n):
    """(mask, dense (n, n), document lengths or None) of a random closed-form mask."""
    kind = rng.choice(["documents", "window", "chunked", "spans", "prefix_lm"])
    lengths = random_lengths(rng, n, 2, rng.randrange(1, 7))
    if kind == "documents":
        return flexmask.causal() & flexmask.document(lengths), document_dense(lengths, n), lengths
    if kind == "window":
        window = rng.randrange(1, 200)
        mask = flexmask.causal() & flexmask.document(lengths) & flexmask.sliding_window(window)
        return mask, document_dense(lengths, n) & oracle.sliding_window(window, n, n), lengths
    if kind == "chunked":
        size = rng.randrange(1, 150)
        dense = oracle.causal(n, n) & oracle.chunked(size, n, n)
        return flexmask.causal() & flexmask.chunked(size), dense, None
    if kind == "prefix_lm":
        size = rng.randrange(0, n)
        dense = oracle.causal(n, n) | oracle.prefix(size, n, n)
        return flexmask.causal() | flexmask.prefix(size), dense, None
    ids, next_id = [], 0
    while len(ids) < n:
        ids += [next_id if rng.random() < 0.5 else -1] * rng.randrange(1, 80)
        next_id += 1
    ids = ids[:n]
    return (
        flexmask.causal() | flexmask.spans(ids),
        oracle.causal(n, n) | oracle.spans(ids, n, n),
        None,
    )


def test_random_shards_from_segments_against_oracle(segments_only):
    """Random closed-form masks, lengths (padding included), block sizes and balancers —
    per-document (chunks cut inside blocks), mask-aware and PTRR (single blocks dealt: keys
    in many segments), head-tail at block sizes that cut its chunks: every rank equals
    torch's blocks of the dense rows under the permutation."""
    rng = random.Random(31)
    for _ in range(24):
        world = rng.choice([1, 2, 3, 4])
        block = rng.choice([8, 16, 24, 32, 64])
        n = rng.randrange(2, 360) * 2 * world
        mask, dense, lengths = _random_case(rng, n)
        choices = ["mask_aware", "ptrr", "head_tail", None]
        if lengths is not None and all(length % (2 * world) == 0 for length in lengths):
            choices.append(PerDocumentBalancer([lengths], world))
        balancer = rng.choice(choices)
        S = n - rng.randrange(0, 2 * world) if balancer in ("mask_aware", "ptrr") else n
        for rank in range(world):
            shard = flexmask.shard(
                mask, 1, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=block
            )
            check_against_oracle(shard, dense[:S, :S], 1, 1)
    assert len(segments_only) > 24


def test_per_row_permutations_from_segments(segments_only):
    """One permutation and one mask per batch row (B = 2): each row equals its dense rows."""
    rng = random.Random(8)
    S, world, block = 1536, 2, 32
    lengths = [random_lengths(rng, S, 8, 5), random_lengths(rng, S, 4, 3)]
    mask = flexmask.causal() & flexmask.document(lengths)
    for balancer in ["mask_aware", PerDocumentBalancer(lengths, world)]:
        for rank in range(world):
            shard = flexmask.shard(
                mask, 2, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=block
            )
            rows = []
            for b in range(2):
                perm = shard.indices[b].numpy()
                rows.append(document_dense(lengths[b], S)[perm][:, perm][shard.local])
            reference = oracle.torch_build(oracle.stack(rows), block=block)
            oracle.assert_same_block_mask(shard.block_mask, reference, own_storage=False)
    assert segments_only


def test_segment_sides_of_a_permuted_causal_mask():
    """Keys in 16 runs of 16 (reversed), local queries the first 128: both sides equal
    torch's blocks of the dense rows."""
    perm = torch.arange(256).view(16, 16).flip(0).reshape(-1)
    local = perm[:128]
    lo = torch.zeros(1, 128, dtype=torch.int64)
    hi = local.view(1, -1).clone()  # causal: query q attends [0, q]
    kv, q = segment_sides(lo, hi, local, SHARD.runs(local), perm, SHARD.runs(perm), 16)
    dense = np.tril(np.ones((256, 256), dtype=bool))[perm.numpy()][:, perm.numpy()][:128]
    reference = oracle.torch_build(oracle.stack([dense]), block=16)
    got = {
        "kv_num_blocks": kv.partial_num,
        "kv_indices": kv.partial_idx,
        "full_kv_num_blocks": kv.full_num,
        "full_kv_indices": kv.full_idx,
        "q_num_blocks": q.partial_num,
        "q_indices": q.partial_idx,
        "full_q_num_blocks": q.full_num,
        "full_q_indices": q.full_idx,
    }
    for name, tensor in got.items():
        assert torch.equal(tensor, getattr(reference, name)), name


def test_many_touched_runs_fall_back_to_a_compare_per_block(monkeypatch):
    """Past DENSE_PAIRS_PER_BLOCK the kv side of an aligned shard compares every block
    (segments never written there), still equal to the oracle."""
    monkeypatch.setattr(SHARD, "PIECES_PER_BLOCK", 0.0)
    monkeypatch.setattr(SHARD, "DENSE_PAIRS_PER_BLOCK", 0.0)

    def refuse(*args, **kwargs):
        raise AssertionError("segments written past DENSE_PAIRS_PER_BLOCK")

    monkeypatch.setattr(SHARD, "side", refuse)
    dense_passes = []
    real = SHARD.ordered_lines

    def counted(*args, **kwargs):
        dense_passes.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(SHARD, "ordered_lines", counted)
    S, world, block = 2048, 2, 32
    mask = flexmask.causal() & flexmask.sliding_window(300)
    dense = oracle.causal(S, S) & oracle.sliding_window(300, S, S)
    for rank in range(world):
        shard = flexmask.shard(
            mask, 1, 1, S, world_size=world, rank=rank, balancer="ptrr", BLOCK_SIZE=block
        )
        check_against_oracle(shard, dense, 1, 1)
    assert len(dense_passes) == 2 * world  # partial and full of every rank


def _costs_from_blocks(block_mask, partial_cost):
    full = block_mask.full_kv_num_blocks.to(torch.float64)
    return (full + partial_cost * block_mask.kv_num_blocks).sum(1)


@pytest.mark.parametrize("partial_cost", [1.0, 0.25])
def test_block_costs_equal_the_dense_blocks(partial_cost):
    """The mask-aware costs from structure equal those counted on torch's BlockMask of the
    dense mask: documents, a tree, a window, prefix-LM, per-row documents, H = 3."""
    rng = random.Random(4)
    S, block = 640, 32
    lengths = [random_lengths(rng, S, 8, 4), random_lengths(rng, S, 8, 6)]
    parents = random_tree(rng, S)
    causal, window = oracle.causal(S, S), oracle.sliding_window(70, S, S)
    cases = [
        (flexmask.causal() & flexmask.document(lengths[0]), [document_dense(lengths[0], S)]),
        (flexmask.tree(parents), [oracle.tree(parents, S, S)]),
        (flexmask.causal() & flexmask.sliding_window(70), [causal & window]),
        (flexmask.causal() | flexmask.prefix(100), [causal | oracle.prefix(100, S, S)]),
        (flexmask.causal() & flexmask.document(lengths), [document_dense(x, S) for x in lengths]),
    ]  # fmt: skip
    for mask, dense in cases:
        B = len(dense)
        got = _block_costs(mask, B, 3, S, block, partial_cost, torch.device("cpu"))
        reference = oracle.torch_build(oracle.stack(dense, 3), block=block)
        assert torch.equal(got, _costs_from_blocks(reference, partial_cost)), mask


def _greedy(costs, world):
    """The balancer's former deal: heaviest first to the least-loaded rank with room."""
    room = costs.numel() // world
    heap, loads, owned = [(0.0, r) for r in range(world)], [0.0] * world, [0] * world
    for block in torch.argsort(costs, descending=True, stable=True).tolist():
        load, rank = heapq.heappop(heap)
        loads[rank], owned[rank] = load + float(costs[block]), owned[rank] + 1
        if owned[rank] < room:
            heapq.heappush(heap, (loads[rank], rank))
    return max(loads)


def test_deal_partitions_and_balances():
    """Every rank gets n / W distinct blocks, ascending; the most loaded rank carries no more
    than after PTRR's alternating rounds alone, nor (on these masks' costs) than the greedy
    deal did; rows are dealt independently."""
    rng = random.Random(3)
    S, block, world = 16384, 128, 4
    lengths = random_lengths(rng, S, 512, 12)
    docs = flexmask.causal() & flexmask.document(lengths)
    window = flexmask.causal() & flexmask.sliding_window(512)
    cpu = torch.device("cpu")
    rows = [
        _block_costs(docs, 1, 1, S, block, 1.0, cpu),
        _block_costs(docs, 1, 1, S, block, 1.0, cpu) + _block_costs(window, 1, 1, S, block, 1, cpu),
        _block_costs(flexmask.tree(random_tree(rng, S)), 1, 1, S, block, 1.0, cpu),
        torch.tensor([float(rng.randrange(100)) for _ in range(S // block)]).view(1, -1),
    ]
    costs = torch.cat(rows)
    groups = deal(costs, world)
    n = costs.shape[1]
    assert groups.shape == (4, world, n // world)
    for r in range(4):
        assert sorted(groups[r].reshape(-1).tolist()) == list(range(n))
        assert bool((groups[r].diff(dim=-1) > 0).all())
        top = float(costs[r][groups[r]].sum(-1).max())
        snake = float(costs[r][ptrr_schedule(costs[r : r + 1], world)[0]].sum(-1).max())
        assert top <= snake
        if r < 3:
            assert top <= _greedy(costs[r], world) + 1e-9
        assert torch.equal(deal(costs[r : r + 1], world)[0], groups[r])


def test_mask_aware_balancer_two_masks_and_ranks():
    """Two masks' costs add; rank costs are the sums of the dealt blocks' costs."""
    S, world = 4096, 4
    masks = [flexmask.causal(), flexmask.causal() & flexmask.sliding_window(256)]
    lb = MaskAwareBalancer(masks, 1, 2, S, world, block_size=64)
    cpu = torch.device("cpu")
    total = sum(_block_costs(m, 1, 2, S, 64, 1.0, cpu) for m in masks)
    assert torch.equal(lb.block_costs, total)
    blocks = lb._generate_indices()[0, ::64].view(world, -1) // 64
    assert torch.equal(lb.rank_costs[0], total[0][blocks].sum(-1))
    assert lb.imbalance < 1.01


def test_import_without_torch_distributed():
    """A torch without distributed (simulated): ``import flexmask`` works and builds masks;
    the context-parallel names are not exported and name what is missing when asked for."""
    code = """
import sys, torch, torch.distributed
torch.distributed.is_available = lambda: False
for name in ("torch.distributed.tensor", "torch.distributed.distributed_c10d",
             "torch.distributed.tensor.experimental._attention"):
    sys.modules[name] = None
import flexmask
from flexmask import *  # noqa: F403
assert "flexmask.context_parallel" not in sys.modules
assert "shard" not in flexmask.__all__ and "PTRRBalancer" not in flexmask.__all__
bm = flexmask.create_block_mask(flexmask.causal(), 1, 1, 256, 256, "cpu", 128)
assert bm.kv_num_blocks.view(-1).tolist() == [1, 1], bm
try:
    flexmask.shard
except ImportError as error:
    assert "torch.distributed" in str(error), error
else:
    raise AssertionError("flexmask.shard without torch.distributed")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    loaded = "import sys, flexmask; print('flexmask.context_parallel' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
    assert flexmask.shard.__name__ == "shard" and "shard" in flexmask.__all__
