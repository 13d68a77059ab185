"""Context parallelism for hybrid models: one permutation for several masks weighed by their
layers (LayerWeightedBalancer), against torch's _create_cp_block_mask and single-mask
balancers."""

from __future__ import annotations

import math
import random

import pytest
import torch

import flexmask
from flexmask.context_parallel import (
    LayerWeightedBalancer,
    MaskAwareBalancer,
    PerDocumentBalancer,
    PTRRBalancer,
    layer_imbalance,
)
from tests import oracle


def mixed_documents(S: int, seed: int, unit: int) -> list[int]:
    """Document lengths of a log-normal mix (mostly a few thousand tokens, a few long ones),
    multiples of ``unit`` (torch's per-document balancer needs 2W), summing to ``S``."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < S:
        length = max(unit, round(rng.lognormvariate(7.5, 1.2) / unit) * unit)
        lengths.append(min(length, S - sum(lengths)))
    return lengths


def hybrid(lengths, local):
    """(global, local) masks of a hybrid model over packed documents."""
    whole = flexmask.causal() & flexmask.document(lengths)
    return whole, whole & local


# --- validation ---------------------------------------------------------------------------

G = flexmask.causal()


@pytest.mark.parametrize(
    ("layers", "error", "named"),
    [
        (G, TypeError, "layers must be a list"),
        ([], ValueError, "layers must hold at least one"),
        ([G], TypeError, r"layers\[0\] must be a \(mask, weight\) pair"),
        ([(G, 1, 2)], TypeError, r"layers\[0\] must be a \(mask, weight\) pair"),
        ([("causal", 1)], TypeError, r"layers\[0\]\[0\] must be a flexmask Mask"),
        ([(G, 1), (G, 0)], ValueError, r"layers\[1\]\[1\] must be a finite number > 0"),
        ([(G, -2)], ValueError, r"layers\[0\]\[1\] must be a finite number > 0 .*got -2"),
        ([(G, math.nan)], ValueError, r"layers\[0\]\[1\]"),
        ([(G, math.inf)], ValueError, r"layers\[0\]\[1\]"),
        ([(G, True)], TypeError, r"layers\[0\]\[1\] must be a number"),
        ([(G, "12")], TypeError, r"layers\[0\]\[1\] must be a number"),
        (
            [(flexmask.document([256]), 1), (flexmask.document([128, 256]), 3)],
            ValueError,
            r"different lengths \(layers\[0\]: 256, layers\[1\]: 384\)",
        ),
        (
            [(flexmask.document([[64, 64], [128]]), 1), (flexmask.document([[128]] * 3), 1)],
            ValueError,
            r"different batch rows",
        ),
    ],
)
def test_bad_layers_are_refused_by_name(layers, error, named):
    with pytest.raises(error, match=named):
        LayerWeightedBalancer(layers, 1, 1, 512, 2, block_size=64)


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"seq_length": 0}, ValueError, "seq_length"),
        ({"world_size": 0}, ValueError, "world_size"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"partial_cost": -1.0}, ValueError, "partial_cost"),
        ({"max_swaps": -1}, ValueError, "max_swaps"),
        ({"B": 0}, ValueError, "B"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, named):
    args = {"B": 1, "H": 1, "seq_length": 512, "world_size": 2, "block_size": 64}
    args.update(kwargs)
    with pytest.raises(error, match=named):
        LayerWeightedBalancer([(G, 1)], **args)


def test_layer_imbalance_refuses_a_balancer_made_per_mask():
    for name in ("mask_aware", "ptrr"):
        with pytest.raises(ValueError, match=f"balancer='{name}' makes a permutation per mask"):
            layer_imbalance([(G, 1)], 1, 1, 512, 2, name)
    with pytest.raises(ValueError, match="partial_cost"):
        layer_imbalance([(G, 1)], 1, 1, 512, 2, "head_tail", partial_cost=-1)


# --- the permutation --------------------------------------------------------------------


@pytest.mark.parametrize(("S", "world", "block"), [(1000, 4, 64), (512, 2, 128), (777, 3, 16)])
def test_indices_are_a_permutation_of_whole_blocks_padded_at_the_end(S, world, block):
    lengths = mixed_documents(S, 3, 1)
    whole, window = hybrid(lengths, flexmask.sliding_window(100))
    lb = LayerWeightedBalancer([(whole, 1), (window, 3)], 1, 1, S, world, block_size=block)
    padded = -(-S // (world * block)) * world * block
    assert lb.padded_length == padded and lb.seq_length == S and lb.rows == 1
    indices = lb._generate_indices()
    assert indices.shape == (1, padded) and indices.dtype == torch.int64
    assert torch.equal(indices[0].sort().values, torch.arange(padded))
    # Whole blocks, each rank's ascending (the rows of a rank's shard stay in order).
    starts = indices[0, ::block]
    assert torch.equal(indices[0].view(-1, block), starts[:, None] + torch.arange(block))
    assert bool((starts % block == 0).all())
    for part in starts.view(world, -1):
        assert bool((part[1:] > part[:-1]).all())
    restore = lb._generate_indices(restore=True)
    assert torch.equal(indices[0][restore[0]], torch.arange(padded))
    # A shard of it pads the sequence and drops the padding again.
    part = flexmask.shard(whole, 1, 1, S, world_size=world, rank=0, balancer=lb, BLOCK_SIZE=block)
    x = torch.arange(S, dtype=torch.float64).view(1, 1, S, 1)
    assert part.padded_length == padded
    assert part.shard_tensor(x, 2).shape[2] == padded // world


def test_per_row_masks_give_per_row_permutations():
    lengths = [[256, 768], [512, 256, 256]]
    whole = flexmask.causal() & flexmask.document(lengths)
    lb = LayerWeightedBalancer(
        [(whole, 1), (whole & flexmask.chunked(256), 3)], 2, 1, 1024, 2, block_size=128
    )
    assert lb.rows == 2 and lb.mask_costs.shape == (2, 2, 2)
    single = [
        MaskAwareBalancer(flexmask.causal() & flexmask.document([row]), 1, 1, 1024, 2, 128)
        for row in lengths
    ]
    for row, indices in enumerate(lb._generate_indices()):
        assert torch.equal(indices.sort().values, torch.arange(1024))
        assert single[row].block_costs.shape == (1, 8)


def test_one_mask_is_never_worse_than_the_mask_aware_deal():
    """The swaps only lower the synchronised step: with one mask, that is the max rank cost
    of MaskAwareBalancer's deal (the same deal) or lower."""
    for seed in range(4):
        lengths = mixed_documents(8192, seed, 1)
        mask = flexmask.causal() & flexmask.document(lengths) & flexmask.chunked(1024)
        ours = LayerWeightedBalancer([(mask, 2)], 1, 1, 8192, 4, block_size=128)
        theirs = MaskAwareBalancer(mask, 1, 1, 8192, 4, block_size=128)
        assert ours.synced_imbalance == pytest.approx(ours.imbalance)
        assert ours.imbalance <= theirs.imbalance + 1e-9


@pytest.mark.parametrize("local", ["window", "chunked"])
def test_never_worse_than_a_mask_aware_balancer_given_one_mask(local):
    """Each mask's own MaskAwareBalancer deal is one of the starts: the synchronised step
    (and so the step) is at most what any of them gives the whole step."""
    S, world = 8192, 4
    for seed, weights in [(0, (1, 3)), (1, (1, 1)), (2, (5, 1))]:
        lengths = mixed_documents(S, seed, 1)
        piece = flexmask.sliding_window(300) if local == "window" else flexmask.chunked(1024)
        layers = list(zip(hybrid(lengths, piece), weights, strict=True))
        ours = LayerWeightedBalancer(layers, 1, 1, S, world, block_size=128)
        for mask, _ in layers:
            single = MaskAwareBalancer(mask, 1, 1, S, world, block_size=128)
            theirs = layer_imbalance(layers, 1, 1, S, world, single)
            assert ours.synced_imbalance <= theirs.synced + 1e-9, (seed, weights)
            assert ours.imbalance <= ours.synced_imbalance + 1e-12


# --- shards against torch's build -------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_mask_shard_equals_torch_cp_block_mask(world):
    """One permutation, every mask of the step: each rank's shard of each mask equals the
    blocks torch's _create_cp_block_mask builds for that mask with the same balancer."""
    S = 512 * world
    lengths = mixed_documents(S, world, 1)
    whole = flexmask.causal() & flexmask.document(lengths)
    layers = [
        (whole, 1),
        (whole & flexmask.sliding_window(200), 3),
        (whole & flexmask.chunked(384), 2),
    ]
    lb = LayerWeightedBalancer(layers, 1, 1, S, world, block_size=128)
    for m, (mask, _) in enumerate(layers):
        for rank in range(world):
            ours = flexmask.shard(mask, 1, 1, S, world_size=world, rank=rank, balancer=lb)
            theirs = oracle.torch_cp_shard(mask, 1, 1, S, world, rank, lb)
            oracle.assert_same_block_mask(
                ours.block_mask, theirs, f"mask {m} rank {rank}", own_storage=False
            )


# --- balance on a fixed hybrid layout ---------------------------------------------------


def test_weighted_step_is_balanced_where_every_single_mask_balancer_is_not():
    """Llama 4's layout (global and chunked 8192 layers, 1:3) over mixed documents at 32k
    on 8 ranks, the row of docs/context-parallel.md's table: the layer-weighted balancer's
    step within 5%; head-tail, per-document, PTRR and mask-aware balancers, each given one
    of the two masks, all above 5%. Costs from every rank's shard (deterministic)."""
    S, world = 32768, 8
    lengths = mixed_documents(S, 0, 2 * world)
    whole, chunked = hybrid(lengths, flexmask.chunked(8192))
    layers = [(whole, 1), (chunked, 3)]
    weighted = LayerWeightedBalancer(layers, 1, 1, S, world, block_size=128)
    ours = layer_imbalance(layers, 1, 1, S, world, weighted)
    assert ours.step <= ours.synced <= 1.05
    assert ours.step == pytest.approx(weighted.imbalance)
    assert ours.synced == pytest.approx(weighted.synced_imbalance)
    singles = {
        "head_tail": "head_tail",
        "per_document": PerDocumentBalancer([lengths], world),
        **{
            f"{kind.__name__}({name})": kind(mask, 1, 1, S, world, block_size=128)
            for kind in (PTRRBalancer, MaskAwareBalancer)
            for name, mask in (("global", whole), ("chunked", chunked))
        },
    }
    steps = {name: layer_imbalance(layers, 1, 1, S, world, lb).step for name, lb in singles.items()}
    assert min(steps.values()) > 1.05, steps


# --- trees: GRPO groups packed by pack_tree_batch, many per row ------------------------------


def grpo_batch(seed: int, groups: int, max_tokens: int):
    """GRPO groups (a prompt, 2-4 responses each) packed into prefix trees, several per row."""
    rng = random.Random(seed)
    sequences, prompt_lens = [], []
    for _ in range(groups):
        prompt = [rng.randrange(1, 100) for _ in range(rng.randrange(16, 200))]
        for _ in range(rng.randrange(2, 5)):
            response = [rng.randrange(1, 100) for _ in range(rng.randrange(8, 120))]
            sequences.append(prompt + response)
            prompt_lens.append(len(prompt))
    return flexmask.pack_tree_batch(sequences, max_tokens, prompt_lens=prompt_lens)


@pytest.mark.parametrize("world", [2, 4])
def test_grpo_trees_shard_equals_torch_under_every_balancer(world):
    """A tree mask per row (each row several GRPO groups: prompts shared by their responses),
    one permutation per row from the mask-aware, PTRR and layer-weighted balancers (their
    costs count the blocks of each response's ancestors), one shared by head-tail: every
    rank's shard equals torch's _create_cp_block_mask of the same mask and balancer."""
    S = 1024
    batch = grpo_batch(world, 12, S)
    mask, B = batch.mask, batch.num_rows
    assert B >= 2 and batch.num_sequences / B >= 4  # several groups in every row
    local = mask & flexmask.sliding_window(256)
    balancers = {
        "head_tail": flexmask.context_parallel.HeadTailBalancer(S, world),
        "mask_aware": MaskAwareBalancer(mask, B, 1, S, world, block_size=128),
        "ptrr": PTRRBalancer(mask, B, 1, S, world, block_size=128),
        "layer_weighted": LayerWeightedBalancer(
            [(mask, 1), (local, 3)], B, 1, S, world, block_size=128
        ),
    }
    for name, lb in balancers.items():
        assert lb.rows == (1 if name == "head_tail" else B)
        for rank in range(world):
            ours = flexmask.shard(mask, B, 1, S, world_size=world, rank=rank, balancer=lb)
            theirs = oracle.torch_cp_shard(mask, B, 1, S, world, rank, lb)
            oracle.assert_same_block_mask(
                ours.block_mask, theirs, f"{name} rank {rank}", own_storage=False
            )
