"""The per-document balancer's shard of its own mask, ``causal() & document(lengths)``,
written in closed form from the documents (``flexmask.context_parallel.per_document``):
every tensor equal to torch's, over odd lengths, documents shorter than a block, one
document, many documents and W in {2, 4, 8}."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor.experimental._attention import _PerDocumentHeadTailLoadBalancer
from torch.nn.attention.flex_attention import create_mask

import flexmask
from flexmask.context_parallel import PerDocumentBalancer, per_document
from tests import oracle
from tests.test_cp import document_dense


@pytest.fixture
def closed_form_only(monkeypatch):
    """Counts the closed-form builds and refuses the general segments path, so a case can
    only pass through the path under test."""
    calls = []
    build = per_document.build

    def counted(*args, **kwargs):
        calls.append(args)
        return build(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the per-document shard of its own mask took the segments path")

    monkeypatch.setattr(per_document, "build", counted)
    monkeypatch.setattr("flexmask.builders.cp_shard.segment_sides", refuse)
    return calls


def check_shard(lengths, world, block, calls):
    """Every rank's shard against torch's create_block_mask of the dense rows under the
    permutation (plain numpy: same document, key at or before the query), and its mask_mod
    against those rows element by element."""
    S = sum(lengths)
    mask = flexmask.causal() & flexmask.document(lengths)
    balancer = PerDocumentBalancer([lengths], world)
    dense = document_dense(lengths, S)
    before = len(calls)
    for rank in range(world):
        shard = flexmask.shard(
            mask, 1, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=block
        )
        perm = shard.indices[0].numpy()
        rows = dense[perm][:, perm][shard.local]
        reference = oracle.torch_build(rows[None, None], block=block)
        context = f"lengths {lengths} W={world} BLOCK_SIZE={block} rank {rank}"
        oracle.assert_same_block_mask(shard.block_mask, reference, context)
        local = S // world
        evaluated = create_mask(shard.block_mask.mask_mod, 1, 1, local, S, device="cpu")
        assert np.array_equal(evaluated[0, 0].numpy(), rows), context
    assert len(calls) == before + world, "the closed-form path was not taken"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_equals_torch_blocks_of_dense_rows(world, closed_form_only):
    """Odd lengths (neither documents nor the total a multiple of the block), documents
    shorter than a block (chunks of 1 or 2 tokens), one document, empty documents."""
    unit = 2 * world
    cases = [
        [unit * 37],  # one document, its total not a multiple of any block here
        [unit, unit * 3, unit * 50, unit, unit * 2],  # documents shorter than a block
        [unit * 13, 0, unit * 29, unit * 7, 0],  # empty documents, odd lengths
        [unit * k for k in (1, 1, 1, 1, 2, 1, 3, 1, 1, 1)],  # every document under a block
    ]
    for lengths in cases:
        for block in (16, 48, 128):
            check_shard(lengths, world, block, closed_form_only)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_many_random_documents(world, closed_form_only):
    rng = random.Random(world)
    for _ in range(4):
        count = rng.randrange(20, 60)
        lengths = [2 * world * rng.choice([0, 1, 2, 3, 7, 8, 20]) for _ in range(count)]
        lengths[rng.randrange(count)] += 2 * world
        check_shard(lengths, world, rng.choice([16, 32, 64]), closed_form_only)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_equals_torch_per_document_cp_block_mask(world, closed_form_only):
    """torch's own _create_cp_block_mask with its per-document balancer (lengths it takes:
    the total a multiple of W x 128), whole tensors."""
    rng = random.Random(100 + world)
    S = 2048 if world < 8 else 4096
    for count in (1, 3, 17):
        cuts = sorted(rng.sample(range(1, S // (2 * world)), count - 1))
        edges = [0, *cuts, S // (2 * world)]
        lengths = [(b - a) * 2 * world for a, b in zip(edges, edges[1:], strict=False)]
        mask = flexmask.causal() & flexmask.document(lengths)
        for rank in range(world):
            ours = flexmask.shard(
                mask,
                1,
                1,
                S,
                world_size=world,
                rank=rank,
                balancer=PerDocumentBalancer([lengths], world),
            )
            theirs = oracle.torch_cp_shard(
                mask,
                1,
                1,
                S,
                world,
                rank,
                _PerDocumentHeadTailLoadBalancer([lengths], world, "cpu"),
            )
            oracle.assert_same_block_mask(
                ours.block_mask, theirs, f"{lengths} rank {rank}", own_storage=False
            )
    assert closed_form_only


@pytest.mark.parametrize("world", [2, 4, 8])
def test_rank_major_order_of_torch_2_14(world, closed_form_only, monkeypatch):
    """torch 2.14 lists each document's pairs rank by rank (rank r keeps pair r of every
    document): the same closed form, against the dense rows under that permutation."""
    balance = __import__("sys").modules["flexmask.context_parallel.balance"]
    build = __import__("sys").modules["flexmask.context_parallel.build"]
    monkeypatch.setattr(balance, "_RANK_MAJOR", True)
    monkeypatch.setattr(build, "_PERMUTATIONS", type(build._PERMUTATIONS)(maxsize=8))
    # The example in PerDocumentBalancer's docstring, written out by hand.
    two = PerDocumentBalancer([[4, 8]], 2)._generate_indices()[0].tolist()
    assert two == [0, 3, 4, 5, 10, 11, 1, 2, 6, 7, 8, 9]
    unit = 2 * world
    for lengths in ([unit * 37], [unit, unit * 3, unit * 50, 0, unit * 2], [unit * 9] * 7):
        for block in (16, 48):
            check_shard(lengths, world, block, closed_form_only)


def test_other_masks_keep_the_general_path():
    """The closed form is for the balancer's own mask: a different mask, or documents other
    than the balancer's, is written by the general path (and stays exact)."""
    lengths = [64, 192, 128]
    balancer = PerDocumentBalancer([lengths], 2)
    assert per_document.own_mask(flexmask.document(lengths) & flexmask.causal(), lengths)
    for mask, dense in (
        (
            flexmask.causal() & flexmask.document([128, 256]),
            document_dense([128, 256], 384),
        ),
        (
            flexmask.causal() & flexmask.document(lengths) & flexmask.sliding_window(40),
            document_dense(lengths, 384) & oracle.sliding_window(40, 384, 384),
        ),
    ):
        assert not per_document.own_mask(mask, lengths)
        for rank in range(2):
            shard = flexmask.shard(
                mask, 1, 1, 384, world_size=2, rank=rank, balancer=balancer, BLOCK_SIZE=32
            )
            perm = shard.indices[0].numpy()
            reference = oracle.torch_build(dense[perm][:, perm][shard.local][None, None], block=32)
            oracle.assert_same_block_mask(shard.block_mask, reference, own_storage=False)
    assert torch.equal(balancer._generate_indices()[0].sort().values, torch.arange(384))


def _bench_cp(monkeypatch):
    """benchmarks/bench_cp.py as a module (it imports its neighbour ``common``)."""
    import importlib.util
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location("_flexmask_bench_cp", folder / "bench_cp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seq", [8, 1024, 4096, 6000, 6152])
def test_bench_imbalance_at_short_and_odd_lengths(seq, monkeypatch, capsys):
    """``bench_cp.py --imbalance-seq N`` crashed inside ``documents()`` below ~6144 tokens
    (12 documents of 512-token units do not fit) and, at a length that is not a multiple of
    512, built a per-document balancer for fewer tokens than the masks. Now the documents
    always sum to N, in multiples of 2W, and every row prints."""
    bench = _bench_cp(monkeypatch)
    lengths = bench.documents(seq, 12, 512, seed=2)
    assert sum(lengths) == seq and all(n % 8 == 0 for n in lengths) and 1 <= len(lengths) <= 12
    bench.imbalances(seq, 4)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| documents",
        "| tree",
        "| documents + sliding window",
    ]
    for row in rows[1:]:
        assert all(float(value) >= 1.0 for value in row.strip(" |").split(" | ")[1:]), row
