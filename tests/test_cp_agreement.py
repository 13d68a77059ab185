"""Context-parallel ranks agree on everything that decides the result before any key or value
moves, on both paths (the needed-only exchange and the all-gather): where one rank's
tensors, mask, balancer, block size or path differ from the others', every rank raises a
ValueError naming the first field that differs, and the group still serves the next call.

Each case below ran without a word before the agreement (issue 39): another (H, D) on one
rank (off by 0.7-1.65), plans of different masks or of one mask with another document split
whose split sizes happen to agree, a value dtype other than the key's (one rank aborted in
gloo, the other returned an output off by 9e32), and under the all-gather any other mask.
"""

from __future__ import annotations

import pytest
import torch

import flexmask
from flexmask.context_parallel import plan_exchange
from tests import oracle
from tests.ranks import run_ranks

S, BLOCK, HEADS, DIM = 16, 4, 2, 8
DOCS = [4, 12]


def _docs(lengths: list[int]) -> flexmask.Mask:
    return flexmask.causal() & flexmask.document(lengths)


# The pair: at S = 16, W = 2, BLOCK_SIZE = 4 and no balancer their split sizes agree.
OTHER_MASK = (flexmask.causal() & flexmask.prefix(4)) | _docs([8, 8])
# One document split changed: split sizes agree too (rank 1's queries read keys 4-7 of
# rank 0 under both), so only the mask's data tells them apart.
OTHER_SPLIT = _docs([4, 8, 4])

# (name, what the odd rank passes instead, the field every rank's error names)
CASES: list[tuple[str, dict, str]] = [
    ("heads and head dim", dict(heads=4, dim=4), r"query\.H"),
    ("value dtype", dict(value_dtype=torch.float64), r"value\.dtype"),
    ("another mask", dict(mask=OTHER_MASK), r"\bmask\b"),
    ("another document split", dict(mask=OTHER_SPLIT), r"\bmask\b"),
    ("another balancer", dict(balancer="head_tail"), r"\bbalancer\b"),
    ("another block size", dict(block=8), r"BLOCK_SIZE"),
    ("another path", dict(other_path=True), r"\bexchange\b"),
]


def _call(rank: int, world: int, path: str, *, odd: dict | None = None, extra: int = 0):
    """One cp_flex_attention call of rank ``rank`` on ``path`` (the default arguments, or
    ``odd``'s where this rank is the odd one)."""
    args = dict(mask=_docs(DOCS), balancer=None, block=BLOCK, heads=HEADS, dim=DIM)
    args |= dict(value_dtype=torch.float32, other_path=False) | (odd or {})
    if args["other_path"]:
        path = "all_gather" if path == "needed" else "needed"
    common = dict(world_size=world, rank=rank, balancer=args["balancer"], BLOCK_SIZE=args["block"])
    if path == "needed":
        shard = plan_exchange(args["mask"], 1, None, S, **common)
    else:
        shard = flexmask.shard(args["mask"], 1, None, S, **common)
    q = torch.randn(1, args["heads"], S // world, args["dim"])
    k = torch.randn(1, args["heads"], S // world + extra, args["dim"])
    v = torch.randn(1, args["heads"], S // world + extra, args["dim"], dtype=args["value_dtype"])
    return flexmask.cp_flex_attention(q, k, v, shard, exchange=path, compile=False)


def _good_call(rank: int, world: int, path: str, odd_rank: int) -> None:
    """The agreed call, against the float64 reference attention of the whole sequence:
    output and q/k/v gradients (k and v summed back from every rank that read them). The
    odd rank passes another kind of shard of the same sharding — a lazy shard to exchange
    with, a plain BlockMask to all-gather with (which carries no mask to fingerprint: it is
    compared on what it has) — and that agrees."""
    torch.manual_seed(0)  # every rank draws the same global tensors
    q, k, v = (torch.randn(1, HEADS, S, DIM, dtype=torch.float64) for _ in range(3))
    grad_out = torch.randn(1, HEADS, S, DIM, dtype=torch.float64)
    dense = torch.from_numpy(oracle.causal(S, S) & oracle.document(DOCS, S, S))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref, _ = oracle.attention(*full, dense)
    ref_grads = torch.autograd.grad(ref, full, grad_out)
    mine = slice(rank * S // world, (rank + 1) * S // world)  # balancer=None: contiguous
    local = [t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
    common = dict(world_size=world, rank=rank, balancer=None, BLOCK_SIZE=BLOCK)
    if rank == odd_rank:
        lazy = flexmask.lazy_shard(_docs(DOCS), 1, None, S, **common)
        shard = lazy if path == "needed" else lazy.block_mask
    elif path == "needed":
        shard = plan_exchange(_docs(DOCS), 1, None, S, **common)
    else:
        shard = flexmask.shard(_docs(DOCS), 1, None, S, **common)
    out = flexmask.cp_flex_attention(*local, shard, exchange=path, compile=False)
    grads = torch.autograd.grad(out, local, grad_out[:, :, mine])
    torch.testing.assert_close(out, ref[:, :, mine])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want[:, :, mine])


def _disagreements(rank: int, world: int, odd_rank: int) -> None:
    """Every case on both paths, each caught on every rank, then a good call on each path
    on the same group. ``odd_rank`` is the rank that differs."""
    for path in ("needed", "all_gather"):
        for name, odd, field in CASES:
            with pytest.raises(ValueError) as raised:
                _call(rank, world, path, odd=odd if rank == odd_rank else None)
            assert raised.match(field), (path, name, str(raised.value))
            # Every rank reads the same table: the message names the odd rank's value.
            assert f"rank {odd_rank}" in str(raised.value), (path, name, str(raised.value))
        # A rank that refused its own inputs raises its own error, the others one naming it.
        with pytest.raises(ValueError) as raised:
            _call(rank, world, path, extra=8 if rank == odd_rank else 0)
        if rank == odd_rank:
            raised.match("key and value must hold")
        else:
            raised.match(rf"rank\(s\) \[{odd_rank}\] of the group refused")
        _good_call(rank, world, path, odd_rank)


def test_two_ranks_that_disagree_raise_on_every_rank_on_both_paths():
    """Rank 1 differs, one case at a time; run_ranks fails the test on a signal (gloo's
    abort on unequal sizes) or a hang (ranks killed after 120 s)."""
    reports = run_ranks(_disagreements, 2, 1, group_timeout_s=20, deadline_s=120)
    assert reports == [None, None], "\n".join(r for r in reports if r)


@pytest.mark.slow  # four spawned ranks
def test_four_ranks_that_disagree_raise_on_every_rank_on_both_paths():
    """Rank 2 differs: the table, not a neighbour, carries it to every rank."""
    reports = run_ranks(_disagreements, 4, 2, group_timeout_s=30, deadline_s=180)
    assert reports == [None] * 4, "\n".join(r for r in reports if r)


def test_the_repro_pairs_plan_split_sizes_that_agree():
    """The mask cases test the fingerprint, not the split sizes: rank 0's plan of the
    documents and rank 1's plan of the other mask (or split) send and receive alike, which
    is why the split sizes alone let them run."""
    for other in (OTHER_MASK, OTHER_SPLIT):
        common = dict(world_size=2, balancer=None, BLOCK_SIZE=BLOCK)
        mine = plan_exchange(_docs(DOCS), 1, None, S, rank=0, **common)
        theirs = plan_exchange(other, 1, None, S, rank=1, **common)
        assert mine.send_counts[1] == theirs.recv_counts[0]
        assert theirs.send_counts[0] == mine.recv_counts[1]
        dense_other = other.to_dense(1, 1, S, S)[0, 0]
        dense_docs = _docs(DOCS).to_dense(1, 1, S, S)[0, 0]
        assert not torch.equal(dense_other[S // 2 :], dense_docs[S // 2 :])  # rank 1's rows


def test_fingerprints_are_the_same_in_every_process_and_see_data():
    """The mask's fingerprint is made from its content key with a canonical encoding,
    never Python's ``hash`` of a string (which differs per process): the spawned ranks above
    (each with its own hash seed) agree on it in every good call. A changed document split
    gives another fingerprint."""
    from flexmask.context_parallel.agreement import fingerprint

    here = [
        fingerprint(m.key) for m in (_docs([4, 12]), _docs([4, 8, 4]), flexmask.sliding_window(3))
    ]
    assert len(set(here)) == 3 and all(-(2**63) < f < 2**63 for f in here)
    assert fingerprint(_docs([4, 12]).key) == fingerprint(_docs([4, 12]).key)
    # sets are read in a canonical order, tensors by their bytes, objects without their own
    # repr by their type (their default repr holds an address that differs per process)
    assert fingerprint(frozenset({"a", "b"})) == fingerprint(frozenset({"b", "a"}))
    assert fingerprint(torch.arange(4)) == fingerprint(torch.arange(4))
    assert fingerprint(torch.arange(4)) != fingerprint(torch.arange(4).flip(0))
    assert fingerprint((object(),)) == fingerprint((object(),))
    assert fingerprint(1) != fingerprint(True) != fingerprint(1.0)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_status_has_one_size_whatever_the_data(world):
    """gloo aborts an all-gather of unequal sizes: the status depends on the world size
    alone — any tensors, mask, shard kind or path give ``status_size(world)`` entries, and
    a plain BlockMask's unknowable mask and permutation are marked unknown, not guessed."""
    from flexmask.context_parallel.agreement import FIELDS, UNKNOWN, status, status_size

    names = [field.name for field in FIELDS]
    seen = set()
    for mask, heads, dim, dtype in [
        (_docs(DOCS), 2, 8, torch.float32),
        (OTHER_MASK, 4, 4, torch.float64),
        (flexmask.sliding_window(3) & flexmask.document([5, 3, 8]), 1, 16, torch.bfloat16),
    ]:
        common = dict(world_size=world, rank=world - 1, balancer=None, BLOCK_SIZE=BLOCK)
        plan = plan_exchange(mask, 1, None, S, **common)
        q, k, v = (torch.zeros(1, heads, S // world, dim, dtype=dtype) for _ in range(3))
        for shard, path in ((plan.shard, None), (plan, plan), (plan.shard.block_mask, None)):
            own = shard.shard if shard is plan else shard
            entries = status(q, k, v, own, path, world)
            assert len(entries) == status_size(world) == len(FIELDS) + 2 * world
            plain = own is plan.shard.block_mask
            assert (entries[names.index("mask")] == UNKNOWN) == plain
            assert (entries[names.index("balancer")] == UNKNOWN) == plain
            assert entries[names.index("key.H")] == heads
            seen.add(entries[names.index("mask")])
    assert len(seen) == 4  # three masks and the unknown one
