"""Context parallelism: shards against torch's _create_cp_block_mask and the dense oracle,
balancers against torch's, and forward/backward on 2 and 4 gloo processes."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor.experimental._attention import (
    _HeadTailLoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
)

import flexmask
from flexmask.context_parallel import (
    HeadTailBalancer,
    MaskAwareBalancer,
    PerDocumentBalancer,
    ShardCache,
    default_shard_cache,
    imbalance,
    lazy_shard,
)
from tests import oracle
from tests.ranks import spawn_ranks


def expanded(block_mask, B, H):
    """A copy of ``block_mask`` with B and H broadcast out (torch keeps them)."""
    out = {}
    for field in oracle.BLOCK_FIELDS:
        t = getattr(block_mask, field)
        out[field] = t.expand(B, H, *t.shape[2:]).contiguous()
    return type(block_mask)(
        block_mask.seq_lengths,
        *(out[f] for f in oracle.BLOCK_FIELDS),
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
    )


def document_dense(lengths, S):
    ids = np.repeat(np.arange(len(lengths)), lengths)
    ids = np.concatenate([ids, np.full(S - len(ids), -1)])
    same = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    return same & np.tril(np.ones((S, S), dtype=bool))


def random_lengths(rng, total, multiple, count):
    cuts = sorted(rng.sample(range(1, total // multiple), count - 1))
    edges = [0, *cuts, total // multiple]
    return [(b - a) * multiple for a, b in zip(edges, edges[1:], strict=False)]


def random_tree(rng, n):
    return [-1] + [
        rng.randrange(max(0, i - 40), i) if rng.random() > 0.05 else -1 for i in range(1, n)
    ]


def dense_case(name, S, rng):
    """(mask, dense (S, S) numpy reference, document lengths or None)."""
    if name == "document":
        lengths = random_lengths(rng, S, 8, 5)
        return flexmask.causal() & flexmask.document(lengths), document_dense(lengths, S), lengths
    if name == "tree":
        parents = random_tree(rng, S)
        return flexmask.tree(parents), oracle.tree(parents, S, S), None
    if name == "sliding_window":
        return (
            flexmask.causal() & flexmask.sliding_window(100),
            oracle.causal(S, S) & oracle.sliding_window(100, S, S),
            None,
        )
    if name == "prefix_lm":
        return (
            flexmask.causal() | flexmask.prefix(200),
            oracle.causal(S, S) | oracle.prefix(200, S, S),
            None,
        )
    raise AssertionError(name)


CASES = ["document", "tree", "sliding_window", "prefix_lm"]


def check_against_oracle(shard, dense, B, H):
    """The shard equals torch's blocks of the plain dense rows under the permutation."""
    S = shard.padded_length
    padded = np.zeros((S, S), dtype=bool)
    padded[: dense.shape[0], : dense.shape[1]] = dense
    perm = shard.indices[0].numpy()
    rows = padded[perm][:, perm][shard.local]
    reference = oracle.torch_build(oracle.stack([rows] * B, H), block=shard.block_mask.BLOCK_SIZE)
    oracle.assert_same_block_mask(expanded(shard.block_mask, B, H), reference, own_storage=False)


def test_balancers_equal_torch():
    rng = random.Random(0)
    for S, W in [(8, 2), (2048, 4), (4096, 8)]:
        for restore in (False, True):
            ours = HeadTailBalancer(S, W)._generate_indices(restore)
            theirs = _HeadTailLoadBalancer(S, W, "cpu")._generate_indices(restore)
            assert torch.equal(ours, theirs.long())
    for W in (2, 4):
        docs = [random_lengths(rng, 4096, 2 * W, 7), random_lengths(rng, 4096, 2 * W, 3)]
        for restore in (False, True):
            ours = PerDocumentBalancer(docs, W)._generate_indices(restore)
            theirs = _PerDocumentHeadTailLoadBalancer(docs, W, "cpu")._generate_indices(restore)
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("world", [2, 4])
def test_shard_equals_torch_and_oracle(name, world):
    rng = random.Random(hash((name, world)) % 1000)
    S = 1024
    mask, dense, lengths = dense_case(name, S, rng)
    balancers = [lambda: HeadTailBalancer(S, world), lambda: None]
    if lengths is not None:
        balancers.append(lambda: PerDocumentBalancer([lengths], world))
    for make in balancers:
        for rank in range(world):
            lb = make()
            ours = flexmask.shard(mask, 1, 2, S, world_size=world, rank=rank, balancer=lb)
            reference = oracle.torch_cp_shard(mask, 1, 2, S, world, rank, lb)
            oracle.assert_same_block_mask(
                expanded(ours.block_mask, 1, 2),
                reference,
                f"{name} {lb} rank {rank}",
                own_storage=False,
            )
            if rank == world - 1:
                check_against_oracle(ours, dense, 1, 1)


@pytest.mark.parametrize("name", CASES)
def test_any_block_size_and_length_against_oracle(name, monkeypatch):
    """Lengths torch's CP refuses: not a multiple of W * BLOCK_SIZE, odd block sizes, padding.
    Closed-form masks take the runs or the segments path, never tiles."""
    if name != "tree":
        _no_tile_path(monkeypatch)
    rng = random.Random(7)
    for S, world, block, balancer in [
        (600, 2, 64, "head_tail"),
        (1000, 4, 48, "head_tail"),
        (777, 3, 32, "mask_aware"),
        (500, 2, 100, None),
    ]:
        mask, dense, _ = dense_case(name, S, rng)
        for rank in range(world):
            shard = flexmask.shard(
                mask, 1, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=block
            )
            assert shard.padded_length % world == 0 and shard.padded_length >= S
            check_against_oracle(shard, dense, 1, 1)


def _no_tile_path(monkeypatch):
    """Makes the tile path (a classification of the rank's tiles) fail: closed-form shards
    are written from runs (aligned) or segments (not)."""
    module = __import__("sys").modules["flexmask.builders.cp_shard"]

    def refuse(*args, **kwargs):
        raise AssertionError("an aligned closed-form shard took the tile path")

    monkeypatch.setattr(module, "_tile_sides", refuse)


@pytest.mark.parametrize("name", ["document", "sliding_window", "prefix_lm"])
def test_aligned_closed_form_shards_are_written_from_runs(name, monkeypatch):
    """Block-aligned runs of a closed-form mask: no offset build, equal to the oracle. The
    sizes cover keys cut into few segments (runs per segment) and many (one compare per
    element), a partial last block (S not a multiple of BLOCK_SIZE) and padding."""
    _no_tile_path(monkeypatch)
    rng = random.Random(11)
    for S, world, block, balancer in [
        (2048, 2, 32, "head_tail"),  # 4 key segments, 64 blocks: runs per segment
        (2048, 4, 32, "head_tail"),
        (1024, 4, 128, "head_tail"),  # 8 segments, 8 blocks: compare per element
        (2000, 1, 16, None),  # a partial last block (only one rank can hold one)
        (1500, 2, 32, "mask_aware"),  # padded to 1536
    ]:
        mask, dense, _ = dense_case(name, S, rng)
        for rank in range(world):
            shard = flexmask.shard(
                mask, 1, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=block
            )
            check_against_oracle(shard, dense, 1, 1)


def test_per_row_permutations_of_per_row_documents(monkeypatch):
    """One permutation per batch row on per-row documents: the mask-aware balancer's (whole
    blocks, ascending per rank: the runs path) and torch's per-document one (document by
    document, chunks of 8 tokens: the segments path). Every row equals its dense rows."""
    rng = random.Random(5)
    S, world, block = 2048, 2, 32
    lengths = [random_lengths(rng, S, 128, 4), random_lengths(rng, S, 8, 6)]
    mask = flexmask.causal() & flexmask.document(lengths)
    _no_tile_path(monkeypatch)
    for balancer in ["mask_aware", PerDocumentBalancer(lengths, world)]:
        for rank in range(world):
            shard = flexmask.shard(
                mask, 2, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=block
            )
            assert shard.indices.shape == (2, S)
            rows = []
            for b in range(2):
                perm = shard.indices[b].numpy()
                rows.append(document_dense(lengths[b], S)[perm][:, perm][shard.local])
            reference = oracle.torch_build(oracle.stack(rows), block=block)
            oracle.assert_same_block_mask(
                shard.block_mask, reference, f"{balancer} rank {rank}", own_storage=False
            )


def test_random_closed_form_shards_against_oracle(monkeypatch):
    """Random lengths, worlds, block sizes and balancers on closed-form masks — document &
    sliding window, causal & chunked, causal | spans — (runs and segments paths alike; the
    tile path refused): every rank equals the oracle."""
    _no_tile_path(monkeypatch)
    rng = random.Random(2024)
    for _ in range(18):
        world = rng.choice([1, 2, 3, 4])
        block = rng.choice([8, 16, 24, 32, 64])
        S = rng.randrange(64, 700)
        lengths = random_lengths(rng, S - S % 2 + 2, 2, rng.randrange(1, 6))
        n = sum(lengths)
        kind = rng.choice(["window", "chunked", "spans"])
        if kind == "window":
            window = rng.randrange(1, 200)
            mask = flexmask.causal() & flexmask.document(lengths) & flexmask.sliding_window(window)
            dense = document_dense(lengths, n) & oracle.sliding_window(window, n, n)
        elif kind == "chunked":
            size = rng.randrange(1, 150)
            mask = flexmask.causal() & flexmask.chunked(size)
            dense = oracle.causal(n, n) & oracle.chunked(size, n, n)
        else:  # text with images: causal, each contiguous span bidirectional
            ids, next_id = [], 0
            while len(ids) < n:
                run = rng.randrange(1, 80)
                ids += [next_id if rng.random() < 0.5 else -1] * run
                next_id += 1
            ids = ids[:n]
            mask = flexmask.causal() | flexmask.spans(ids)
            dense = oracle.causal(n, n) | oracle.spans(ids, n, n)
        balancer = rng.choice(["head_tail", "mask_aware", None])
        for rank in range(world):
            shard = flexmask.shard(
                mask,
                1,
                1,
                n,
                world_size=world,
                rank=rank,
                balancer=balancer,
                BLOCK_SIZE=block,
            )
            check_against_oracle(shard, dense, 1, 1)


def test_permutation_is_made_once_per_balancer():
    """Every rank's shard shares the balancer's indices (cached by its content key)."""
    mask = flexmask.causal()
    a = flexmask.shard(mask, 1, 1, 4096, world_size=4, rank=0, balancer=HeadTailBalancer(4096, 4))
    b = flexmask.shard(mask, 1, 1, 4096, world_size=4, rank=3, balancer=HeadTailBalancer(4096, 4))
    assert a.indices is b.indices
    assert torch.equal(a.indices, _HeadTailLoadBalancer(4096, 4, "cpu")._generate_indices())


def test_mask_aware_balancer_beats_head_tail_on_documents_and_trees():
    rng = random.Random(3)
    S, W = 2048, 4
    lengths = random_lengths(rng, S, 128, 5)
    docs = flexmask.causal() & flexmask.document(lengths)
    tree = flexmask.tree(random_tree(rng, S))
    window = flexmask.causal() & flexmask.sliding_window(256)
    for masks in ([docs], [tree], [docs, window]):
        aware = MaskAwareBalancer(masks, 1, 1, S, W)
        measured = imbalance(masks, 1, 1, S, W, aware)
        assert measured == pytest.approx(aware.imbalance)
        assert measured <= imbalance(masks, 1, 1, S, W, "head_tail") + 1e-9
        assert measured < 1.05
        # every token exactly once
        assert torch.equal(aware._generate_indices()[0].sort().values, torch.arange(S))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="rank"):
        flexmask.shard(flexmask.causal(), 1, 1, 256, world_size=2, rank=2)
    with pytest.raises(ValueError, match="KV_LEN"):
        flexmask.shard(flexmask.causal(), 1, 1, 256, 128, world_size=2, rank=0)
    with pytest.raises(ValueError, match="balancer"):
        flexmask.shard(flexmask.causal(), 1, 1, 256, world_size=2, rank=0, balancer="zigzag")
    with pytest.raises(ValueError, match="seq_length_per_doc"):
        PerDocumentBalancer([[10, 6]], 2)
    with pytest.raises(TypeError, match="mask"):
        flexmask.shard(lambda b, h, q, kv: q >= kv, 1, 1, 256, world_size=2, rank=0)


def test_cache_and_lazy_keys_are_rank_aware():
    cache = ShardCache(maxsize=8)

    def make(rank, world=2, balancer="head_tail", lengths=(300, 212)):
        mask = flexmask.causal() & flexmask.document(list(lengths))
        return lazy_shard(
            mask,
            1,
            1,
            512,
            cache=cache,
            world_size=world,
            rank=rank,
            balancer=balancer,
            BLOCK_SIZE=64,
        )

    keys = {
        make(0).key,
        make(1).key,
        make(0, 4).key,
        make(0, balancer=None).key,
        make(0, lengths=(212, 300)).key,
    }
    assert len(keys) == 5
    assert make(1).key == make(1).key  # fresh objects, same inputs: the same key everywhere
    a, b = make(1), make(1)
    assert a.block_mask is b.block_mask and cache.info().hits == 1
    a.release()
    assert a.key not in cache


@pytest.mark.parametrize(
    "balancer", ["head_tail", "mask_aware", None, PerDocumentBalancer([[256, 192, 64]], 2)]
)
def test_lazy_shard_pickles_its_recipe(balancer):
    """Before: pickle.dumps(lazy_shard(...)) raised "cannot pickle '_thread.lock' object" (the
    handle held its ShardCache). Now it pickles the recipe — a mesh as the world size and rank
    it gave — and the unpickled handle builds through the process-wide ShardCache a shard
    tensor-equal to the original's and to the dense rows under the permutation."""
    S, lengths = 512, [256, 192, 64]
    mask = flexmask.causal() & flexmask.document(lengths)
    handle = lazy_shard(
        mask,
        1,
        2,
        S,
        cache=ShardCache(),
        mesh=oracle.FakeMesh(2, 1),
        balancer=balancer,
        BLOCK_SIZE=64,
    )
    built = handle.shard  # built before pickling: the pickle still holds only the recipe
    copy = pickle.loads(pickle.dumps(handle))
    assert copy.cache is None and copy._shard is None
    assert (copy.key, copy.world_size, copy.rank) == (handle.key, 2, 1)
    assert copy.key not in default_shard_cache()
    got = copy.shard
    assert copy.key in default_shard_cache() and got is not built
    assert torch.equal(got.indices, built.indices)
    for field in oracle.BLOCK_FIELDS:
        assert torch.equal(getattr(got.block_mask, field), getattr(built.block_mask, field))
    check_against_oracle(got, document_dense(lengths, S), 1, 2)
    copy.release()
    assert copy.key not in default_shard_cache()


def _distributed_checks(rank, world, S):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    from flexmask.context_parallel import shard_buffers, unshard

    mesh = init_device_mesh("cpu", (world,))
    rng = random.Random(11)
    lengths = random_lengths(rng, S, 2 * world, 4)
    cases = [
        (flexmask.causal() & flexmask.document(lengths), PerDocumentBalancer([lengths], world)),
        (flexmask.tree(random_tree(rng, S)), "mask_aware"),
        (flexmask.causal() & flexmask.document(lengths), "head_tail"),
    ]
    for mask, balancer in cases:
        torch.manual_seed(0)  # every rank draws the same global tensors
        q, k, v = (torch.randn(1, 2, S, 16, requires_grad=True) for _ in range(3))
        ref = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
        ref.backward(torch.ones_like(ref))

        shard = flexmask.shard(mask, 1, 2, S, mesh=mesh, balancer=balancer, BLOCK_SIZE=64)
        local_q, local_k, local_v, bm = shard_buffers(
            shard, mesh, [q.detach(), k.detach(), v.detach(), mask], [2, 2, 2, 0]
        )
        assert bm is shard.block_mask
        assert torch.equal(local_q, shard.shard_tensor(q.detach(), 2))
        for t in (local_q, local_k, local_v):
            t.requires_grad_(True)
        out = flexmask.cp_flex_attention(local_q, local_k, local_v, shard, mesh, compile=False)
        out.backward(torch.ones_like(out))
        gathered = unshard(
            shard, mesh, [out.detach(), local_q.grad, local_k.grad, local_v.grad], [2, 2, 2, 2]
        )
        for got, want in zip(gathered, (ref, q.grad, k.grad, v.grad), strict=False):
            torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
        restored = context_parallel_unshard(mesh, [local_q.detach()], [2], shard.balancer)[0]
        assert torch.equal(restored.narrow(2, 0, S), q.detach())


@pytest.mark.slow  # 35-80 s on 2 busy cores: make test-slow and CI run it
def test_two_gloo_ranks_match_single_process():
    spawn_ranks(_distributed_checks, 2, 512)


@pytest.mark.slow
def test_four_gloo_ranks_match_single_process():
    spawn_ranks(_distributed_checks, 4, 1024)


def _rank_one_fails(rank, world):
    torch.distributed.barrier()
    if rank == 1:
        raise ValueError("rank one's check failed")


@pytest.mark.slow
def test_spawn_ranks_reports_what_a_rank_raised():
    """The runner the gloo tests stand on fails the test when a rank's check raises."""
    with pytest.raises(AssertionError, match="rank 1: ValueError"):
        spawn_ranks(_rank_one_fails, 2)


def test_a_lazy_shard_is_a_block_mask_built_on_first_read():
    """One lazy type for whole masks and shards: a LazyShard is a torch BlockMask (as a
    LazyBlockMask is); torch's own flex_attention takes it, reading a field builds it, and
    the output equals the dense reference on the rank's permuted rows. BLOCK_SIZE is
    torch's pair, known before the build."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    S, lengths = 512, [256, 192, 64]
    mask = flexmask.causal() & flexmask.document(lengths)
    handle = lazy_shard(mask, 1, 2, S, cache=ShardCache(), world_size=2, rank=1, BLOCK_SIZE=64)
    assert isinstance(handle, BlockMask) and handle.BLOCK_SIZE == (64, 64)
    assert not handle.built and "built=False" in str(handle)  # printing builds nothing
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
    plain = flexmask.shard(mask, 1, 2, S, world_size=2, rank=1, BLOCK_SIZE=64)
    assert not handle.built
    perm = plain.indices[0]
    local = perm[plain.local]
    out = flex_attention(q[:, :, local], k[:, :, perm], v[:, :, perm], block_mask=handle)
    assert handle.built and handle.seq_lengths == (S // 2, S)
    dense = torch.from_numpy(document_dense(lengths, S))[local][:, perm]
    expected, _ = oracle.attention(q[:, :, local], k[:, :, perm], v[:, :, perm], dense)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    handle.release()
    assert not handle.built and handle.key not in handle.cache
