"""Aligned context-parallel shards written as runs per ascending key piece, each index
tensor in one pass (``segments.write_runs``): against plain references (runs as
concatenated ``arange``s), torch's ``_create_cp_block_mask`` and torch's BlockMask of the
dense oracle rows; and no temporary near the size of the shard's tensors."""

from __future__ import annotations

import random
import sys

import pytest
import torch

import flexmask
from flexmask.builders.segments import write_runs
from flexmask.context_parallel import HeadTailBalancer
from tests import oracle
from tests.test_cp import (
    check_against_oracle,
    dense_case,
    document_dense,
    expanded,
    random_lengths,
)

SHARD = sys.modules["flexmask.builders.cp_shard"]


def plain_runs(starts: list[int], lens: list[int]) -> torch.Tensor:
    """Runs laid end to end as the docstring says: run k is starts[k], starts[k] + 1, ..."""
    parts = [torch.arange(s, s + n, dtype=torch.int32) for s, n in zip(starts, lens, strict=True)]
    return torch.cat(parts)


def _random_runs(rng: random.Random) -> tuple[list[int], list[int]]:
    count = rng.randrange(1, 80)
    choices = [0, 0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 200, 1000, 5000]
    lens = [rng.choice(choices) for _ in range(count)]
    starts = [rng.randrange(0, 4000) for _ in range(count)]
    for k in range(1, count):
        if rng.random() < 0.4:  # the next run carries on counting: no boundary there
            starts[k] = starts[k - 1] + lens[k - 1]
    return starts, lens


def test_write_runs_equals_concatenated_aranges():
    """Random runs (empty ones, runs that carry on, lengths around every tile width, totals
    that are not a multiple of any): every entry written, equal to the plain reference."""
    rng = random.Random(23)
    checked = 0
    for _ in range(400):
        starts, lens = _random_runs(rng)
        if sum(lens) == 0:
            continue
        out = torch.full((sum(lens),), -5, dtype=torch.int32)
        write_runs(out, torch.tensor(starts), torch.tensor(lens))
        assert torch.equal(out, plain_runs(starts, lens)), (starts, lens)
        checked += 1
    assert checked > 300


def test_write_runs_of_long_lines_uses_wide_tiles():
    """Lines of 4096 entries, each three runs (a listed range, then the rest ascending), as
    a shard's q side lays them: the writer picks its widest tile and stays exact."""
    rng = random.Random(4)
    starts, lens = [], []
    for _ in range(300):
        lo = rng.randrange(0, 4096)
        hi = rng.randrange(lo, 4096)
        starts += [lo, 0, hi + 1]
        lens += [hi - lo + 1, lo, 4095 - hi]
    out = torch.empty(sum(lens), dtype=torch.int32)
    write_runs(out, torch.tensor(starts), torch.tensor(lens))
    assert torch.equal(out, plain_runs(starts, lens))


@pytest.fixture
def pieces_only(monkeypatch):
    """Aligned closed-form shards write their kv side from key pieces: never from segments,
    a compare per block, or the tile path; returns the list of pieces' calls."""
    calls = []
    real = SHARD._piece_line_runs

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("an aligned closed-form shard left the pieces path")

    monkeypatch.setattr(SHARD, "_piece_line_runs", counted)
    for name in ("side", "ordered_lines", "_tile_sides", "segment_sides"):
        monkeypatch.setattr(SHARD, name, refuse)
    return calls


@pytest.mark.parametrize("name", ["document", "sliding_window", "prefix_lm"])
def test_head_tail_shards_from_pieces_equal_torch(name, pieces_only):
    """torch's head-tail balancer at its block size (128: chunks of 4 blocks; B = 1,
    H = 2): every rank equals torch's _create_cp_block_mask, tensor by tensor."""
    rng = random.Random(len(name))
    S, world = 4096, 4
    mask, _, _ = dense_case(name, S, rng)
    for rank in range(world):
        lb = HeadTailBalancer(S, world)
        ours = flexmask.shard(mask, 1, 2, S, world_size=world, rank=rank, balancer=lb)
        reference = oracle.torch_cp_shard(mask, 1, 2, S, world, rank, lb)
        oracle.assert_same_block_mask(
            expanded(ours.block_mask, 1, 2), reference, f"rank {rank}", own_storage=False
        )
    assert len(pieces_only) == world


@pytest.mark.parametrize("balancer", ["head_tail", "mask_aware", "ptrr"])
@pytest.mark.parametrize("name", ["document", "sliding_window", "prefix_lm"])
def test_balancers_shards_from_pieces_against_oracle(name, balancer, pieces_only):
    """Head-tail, mask-aware and PTRR (single blocks dealt: many key runs, W ascending
    pieces), a length the latter two pad up: every rank equals torch's blocks of the dense
    rows under the permutation."""
    rng = random.Random(hash((name, balancer)) % 997)
    odd = 3072 if balancer == "head_tail" else 3000  # head-tail chunks stay whole blocks
    for S, world, block in [(4096, 4, 32), (odd, 2, 16), (2048, 8, 16)]:
        mask, dense, _ = dense_case(name, S, rng)
        for rank in range(world):
            shard = flexmask.shard(
                mask, 1, 1, S, world_size=world, rank=rank, balancer=balancer, BLOCK_SIZE=block
            )
            check_against_oracle(shard, dense, 1, 1)
    assert pieces_only


def test_per_row_permutations_write_only_their_row(pieces_only):
    """One permutation per batch row (B = 3, mask-aware): each row equals its dense rows,
    and each row's build writes one row of tensors (not B rows, then one kept)."""
    rng = random.Random(12)
    S, world, block, B = 2048, 2, 32, 3
    lengths = [random_lengths(rng, S, 32, rng.randrange(2, 7)) for _ in range(B)]
    mask = flexmask.causal() & flexmask.document(lengths)
    written = []
    real = SHARD.write_runs

    def counted(out, starts, lens):
        written.append(out.numel())
        return real(out, starts, lens)

    monkey = pytest.MonkeyPatch()
    monkey.setattr(SHARD, "write_runs", counted)
    try:
        for rank in range(world):
            shard = flexmask.shard(
                mask, B, 1, S, world_size=world, rank=rank, balancer="mask_aware", BLOCK_SIZE=block
            )
            rows = []
            for b in range(B):
                perm = shard.indices[b].numpy()
                rows.append(document_dense(lengths[b], S)[perm][:, perm][shard.local])
            reference = oracle.torch_build(oracle.stack(rows), block=block)
            oracle.assert_same_block_mask(shard.block_mask, reference, own_storage=False)
    finally:
        monkey.undo()
    nq, nkv = S // world // block, S // block
    assert written and all(n == nq * nkv for n in written)  # one row per tensor written


def test_shard_allocates_no_temporary_near_its_tensors():
    """A head-tail shard at S = 2^18, W = 2 (four 8 MiB index tensors): besides its eight
    outputs, no op allocates a quarter of one index tensor (the mask_mod's lookups, one
    int32 per position, are an eighth)."""
    S, world, block = 1 << 18, 2, 128
    lengths = random_lengths(random.Random(3), S, 256, 16)
    mask = flexmask.causal() & flexmask.document(lengths)
    lb = HeadTailBalancer(S, world)

    def one():
        return flexmask.shard(
            mask, 1, 1, S, world_size=world, rank=1, balancer=lb, BLOCK_SIZE=block
        )

    made = one()  # the permutation, then cached
    outputs = [getattr(made.block_mask, f).nbytes for f in oracle.BLOCK_FIELDS]
    with torch.profiler.profile(profile_memory=True) as prof:
        one()
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None]
    others = sorted((size for size in sizes if size > 0), reverse=True)
    for size in outputs:
        assert size in others, (size, others[:12])  # each output allocated once, by one op
        others.remove(size)
    index_bytes = max(outputs)
    assert index_bytes == (S // world // block) * (S // block) * 4
    assert max(others, default=0) < index_bytes / 4, others[:8]
