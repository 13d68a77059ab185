"""Context parallelism refuses bad input by name, before anything is built or gathered: each
error's type and the argument it names (issue #22), and the collective that used to abort."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flexmask
from flexmask.context_parallel import (
    HeadTailBalancer,
    MaskAwareBalancer,
    PerDocumentBalancer,
    ShardCache,
    imbalance,
    lazy_shard,
)
from tests.ranks import run_ranks


def _wrong_key_length(rank, world):
    """Rank 1 passes keys 8 positions too long; rank 0 passes the right ones."""
    shard = flexmask.shard(flexmask.causal(), 1, 1, 64, world_size=world, rank=rank, BLOCK_SIZE=16)
    local = 64 // world + (8 if rank == 1 else 0)
    q = torch.randn(1, 1, 64 // world, 8)
    k, v = torch.randn(1, 1, local, 8), torch.randn(1, 1, local, 8)
    flexmask.cp_flex_attention(q, k, v, shard, compile=False)


@pytest.mark.slow
def test_keys_of_the_wrong_length_raise_before_the_all_gather():
    """Before: the all-gather of unequal slices aborted a rank (SIGABRT, "Received data size
    doesn't match expected size") and reset its peer; then rank 0 waited in the all-gather
    until rank 1 left the group. Now the bad rank raises a ValueError naming key before any
    key moves, and says so in the agreement's all-gather: its peer raises a ValueError
    naming rank 1 at once. No rank dies of a signal (run_ranks fails the test on one) and
    nothing hangs (it kills ranks after 90 s)."""
    reports = run_ranks(_wrong_key_length, 2, group_timeout_s=10, deadline_s=90)
    bad = reports[1]
    assert bad is not None and "ValueError" in bad and "key" in bad, reports
    assert "flex_cp_allgather" not in bad, bad  # raised before the keys were gathered
    assert reports[0] is not None and "ValueError" in reports[0], reports[0]
    assert "rank(s) [1] of the group refused" in reports[0], reports[0]
    assert "flex_cp_allgather" not in reports[0], reports[0]


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


def test_cp_flex_attention_checks_this_ranks_inputs_before_gathering(one_rank_group):
    mask = flexmask.causal()
    shard = flexmask.shard(mask, 1, 1, 64, world_size=1, rank=0, BLOCK_SIZE=16)
    q = k = v = torch.randn(1, 1, 64, 8)
    out = flexmask.cp_flex_attention(q, k, v, shard, compile=False)
    ref = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
    torch.testing.assert_close(out, ref)  # the checks pass good input through
    short = torch.randn(1, 1, 56, 8)
    with pytest.raises(ValueError, match=r"key and value .* 64 per rank; got key of shape"):
        flexmask.cp_flex_attention(q, short, short, shard, compile=False)
    with pytest.raises(ValueError, match=r"value must match key .* \(1, 1, 56, 8\)"):
        flexmask.cp_flex_attention(q, k, short, shard, compile=False)
    with pytest.raises(ValueError, match=r"query must hold this rank's 64 queries"):
        flexmask.cp_flex_attention(short, k, v, shard, compile=False)
    with pytest.raises(ValueError, match=r"seq_dim=5 must be the keys' sequence dim"):
        flexmask.cp_flex_attention(q, k, v, shard, seq_dim=5, compile=False)
    with pytest.raises(ValueError, match=r"seq_dim=1 must be the keys' sequence dim"):
        flexmask.cp_flex_attention(q, k, v, shard, seq_dim=1, compile=False)
    two = flexmask.shard(mask, 1, 1, 64, world_size=2, rank=0, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match=r"shard was made for world_size=2, but group has 1"):
        flexmask.cp_flex_attention(q[:, :, :32], k, v, two, compile=False)
    with pytest.raises(TypeError, match=r"group must be None .* got int 3"):
        flexmask.cp_flex_attention(q, k, v, shard, 3, compile=False)
    with pytest.raises(TypeError, match=r"shard must be this rank's CPShard"):
        flexmask.cp_flex_attention(q, k, v, mask, compile=False)
    with pytest.raises(TypeError, match=r"key must be a torch.Tensor, got list"):
        flexmask.cp_flex_attention(q, [1.0], v, shard, compile=False)


def test_seq_dim_out_of_range_needs_no_process_group():
    """seq_dim=5 was an IndexError inside the collective op; now a ValueError first."""
    shard = flexmask.shard(flexmask.causal(), 1, 1, 64, world_size=2, rank=0, BLOCK_SIZE=16)
    q = k = v = torch.randn(1, 1, 32, 8)
    with pytest.raises(ValueError, match="seq_dim=5"):
        flexmask.cp_flex_attention(q, k, v, shard, seq_dim=5, compile=False)


def test_per_document_balancer_wants_rows_of_lengths():
    """Before: "'int' object is not iterable"."""
    with pytest.raises(TypeError, match=r"seq_length_per_doc\[0\] must be a row .* got 128"):
        PerDocumentBalancer([128, 128], 2)
    with pytest.raises(TypeError, match=r"seq_length_per_doc must be a list of rows"):
        PerDocumentBalancer(128, 2)
    with pytest.raises(ValueError, match=r"seq_length_per_doc\[0\] is empty"):
        PerDocumentBalancer([[]], 2)
    with pytest.raises(ValueError, match=r"seq_length_per_doc\[0\]\[1\]: document length 6"):
        PerDocumentBalancer([[8, 6]], 2)
    with pytest.raises(TypeError, match=r"seq_length_per_doc\[0\]\[0\] must be an int"):
        PerDocumentBalancer([[8.0]], 2)
    with pytest.raises(ValueError, match=r"sum\(seq_length_per_doc\[0\]\)"):
        PerDocumentBalancer([[2**62, 2**62]], 2)
    # numpy rows and numpy lengths are rows of ints: the same permutation as the lists'
    want = PerDocumentBalancer([[4, 8]], 2)._generate_indices()
    got = PerDocumentBalancer(np.array([[4, 8]]), np.int64(2))._generate_indices()
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "balancer, message",
    [
        (HeadTailBalancer(256, 2), r"HeadTailBalancer was built for .* seq_length=256 .* Q_LEN"),
        (PerDocumentBalancer([[128, 128]], 2), r"seq_length=256 tokens, but Q_LEN is 512"),
        (
            MaskAwareBalancer(flexmask.causal(), 1, 1, 256, 2, 64),
            r"MaskAwareBalancer was built for .* seq_length=256 .* Q_LEN is 512",
        ),
        (HeadTailBalancer(512, 4), r"built for world_size=4, but this group has world_size=2"),
        (
            PerDocumentBalancer([[256, 256], [128, 384], [512]], 2),
            r"gives 3 permutations \(one per batch row\), but B is 1",
        ),
    ],
)
def test_a_balancer_made_for_another_sequence_is_refused(balancer, message):
    """Before: a balancer for 256 tokens with Q_LEN=512 failed with "lengths must be at most
    the sequence length max(Q_LEN, KV_LEN)=256, got 512" (naming neither); one for another
    world size or batch was taken silently."""
    with pytest.raises(ValueError, match=message):
        flexmask.shard(flexmask.causal(), 1, 1, 512, world_size=2, rank=0, balancer=balancer)


def test_a_balancer_that_is_not_a_permutation_is_refused():
    from torch.distributed.tensor.experimental._attention import _LoadBalancer

    class Repeats(_LoadBalancer):
        def _generate_indices(self, restore=False):
            return torch.tensor([[0, 0, 2, 3, 4, 5, 6, 7]])

    with pytest.raises(ValueError, match=r"Repeats's indices row 0 is not a permutation"):
        flexmask.shard(flexmask.causal(), 1, 1, 8, world_size=2, rank=0, balancer=Repeats())
    with pytest.raises(ValueError, match=r"balancer must be 'head_tail'.* got tensor"):
        flexmask.shard(flexmask.causal(), 1, 1, 8, world_size=2, rank=0, balancer=torch.ones(2))


def test_lazy_shard_refuses_unknown_keywords_at_the_call():
    """Before: ``balncer=`` was kept in **kwargs and failed only at first use."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'balncer'"):
        lazy_shard(flexmask.causal(), 1, 1, 512, cache=ShardCache(), world_size=2, rank=0,
                   balncer=None)  # fmt: skip
    with pytest.raises(TypeError, match=r"cache must be a flexmask ShardCache .* got dict"):
        lazy_shard(flexmask.causal(), 1, 1, 512, cache={}, world_size=2, rank=0)
    with pytest.raises(ValueError, match="rank must be an int in"):
        lazy_shard(flexmask.causal(), 1, 1, 512, world_size=2, rank=2)


def test_imbalance_names_its_arguments():
    """Before: world_size=0 gave torch's "max(): Expected reduction dim"."""
    mask = flexmask.causal()
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        imbalance(mask, 1, 1, 512, 0, None)
    with pytest.raises(TypeError, match="masks must be a flexmask Mask or a non-empty list"):
        imbalance([], 1, 1, 512, 2, None)
    with pytest.raises(ValueError, match="partial_cost must be a finite number >= 0, got nan"):
        imbalance(mask, 1, 1, 512, 2, None, partial_cost=float("nan"))
    with pytest.raises(TypeError, match="partial_cost must be a number"):
        MaskAwareBalancer(mask, 1, 1, 512, 2, partial_cost="1")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(Q_LEN=2**63 - 100), ValueError, r"Q_LEN=9223372036854775708 .* more than a tensor"),
        (dict(Q_LEN=2**64), ValueError, r"Q_LEN must fit in a signed 64-bit integer"),
        (dict(KV_LEN=2**63 - 100, balancer=None), ValueError, r"KV_LEN=9223372036854775708"),
        (dict(world_size=2**62), ValueError, r"world_size=4611686018427387904,.* more than a"),
        (dict(BLOCK_SIZE=2**62), ValueError, r"BLOCK_SIZE=4611686018427387904:.* more than a"),
        (dict(BLOCK_SIZE=(64, 32, 16)), ValueError, r"BLOCK_SIZE must be an int or a \(Q, KV\)"),
        (dict(q_offset=2**63 - 100), TypeError, r"unexpected keyword argument 'q_offset'"),
        (dict(world_size=2.0), TypeError, r"world_size must be an int, got 2.0"),
        (dict(world_size=None), ValueError, r"pass world_size and rank \(or mesh"),
        (dict(rank=-1), ValueError, r"rank must be >= 0, got -1"),
        (dict(B=0), ValueError, r"B must be >= 1, got 0"),
        (dict(device="nowhere"), ValueError, r"device must be a torch device .* 'nowhere'"),
        (dict(world_size=None, rank=None, mesh=3), TypeError, r"mesh must be a 1-D torch Device"),
        (dict(cache={}), TypeError, r"cache must be a flexmask ShardCache"),
    ],
)
def test_shard_names_the_argument(kwargs, error, message):
    """Before: overflowing sizes reached torch as "IntArrayRef contains an int that cannot be
    represented as a SymInt", "Storage size calculation overflowed" or an allocation of
    exabytes; a device name as torch's list of device types; mesh=3 and cache={} as
    AttributeErrors."""
    args = dict(mask=flexmask.causal(), B=1, H=1, Q_LEN=256, world_size=2, rank=0) | kwargs
    with pytest.raises(error, match=message):
        flexmask.shard(**args)


@pytest.mark.parametrize("balancer", ["head_tail", "mask_aware", None])
def test_numpy_integers_give_the_python_int_shard(balancer):
    """Before: world_size=np.int64(2) was refused ("must be an int >= 1"), unlike everywhere
    else in flexmask."""
    mask = flexmask.causal() & flexmask.document([100, 156, 64])
    common = dict(balancer=balancer)
    want = flexmask.shard(mask, 1, 2, 320, world_size=2, rank=1, BLOCK_SIZE=32, **common)
    got = flexmask.shard(
        mask,
        np.int64(1),
        np.int32(2),
        np.int64(320),
        world_size=np.int64(2),
        rank=np.uint8(1),
        BLOCK_SIZE=np.int16(32),
        **common,
    )
    assert got.key == want.key and type(got.seq_length) is int
    assert torch.equal(got.indices, want.indices)
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(got.block_mask, field), getattr(want.block_mask, field))
    assert got.block_mask.seq_lengths == want.block_mask.seq_lengths == (160, 320)


def test_shard_tensor_methods_name_the_argument():
    """Before: seq_dim=5 was an IndexError, a list an AttributeError, a short gathered tensor
    torch's expand error."""
    shard = flexmask.shard(flexmask.causal(), 1, 1, 256, world_size=2, rank=0, BLOCK_SIZE=64)
    x = torch.zeros(1, 1, 256, 4)
    for method in (shard.shard_tensor, shard.shard_kv, shard.pad, shard.restore):
        with pytest.raises(ValueError, match=r"seq_dim=5 is not a dim of a tensor of shape"):
            method(x, 5)
        with pytest.raises(TypeError, match=r"tensor must be a torch.Tensor, got list"):
            method([1, 2], 0)
        with pytest.raises(TypeError, match=r"seq_dim must be an int, got 2.0"):
            method(x, 2.0)
    with pytest.raises(ValueError, match=r"restore: gathered has 100 positions on dim 2"):
        shard.restore(torch.zeros(1, 1, 100, 4), 2)
    per_row = flexmask.shard(
        flexmask.causal(), 2, 1, 64, world_size=2, rank=0,
        balancer=PerDocumentBalancer([[32, 32], [16, 48]], 2), BLOCK_SIZE=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"one permutation per batch row \(2 rows\)"):
        per_row.shard_tensor(torch.zeros(3, 1, 64, 4), 2)
    # negative dims are dims: the same slice as the positive one
    assert torch.equal(shard.shard_tensor(x + torch.arange(256.0).view(-1, 1), -2),
                       shard.shard_tensor(x + torch.arange(256.0).view(-1, 1), 2))  # fmt: skip


def test_shard_buffers_and_unshard_check_their_lists():
    from flexmask.context_parallel import shard_buffers, unshard

    shard = flexmask.shard(flexmask.causal(), 1, 1, 256, world_size=2, rank=0, BLOCK_SIZE=64)
    x = torch.zeros(1, 1, 256, 4)
    with pytest.raises(TypeError, match=r"seq_dims must be a list .* got 2"):
        shard_buffers(shard, None, [x], 2)
    with pytest.raises(ValueError, match=r"seq_dims must give one dim per buffer \(2\), got 1"):
        unshard(shard, None, [x, x], [2])
    with pytest.raises(ValueError, match=r"unshard: seq_dim=7 is not a dim"):
        unshard(shard, None, [x], [7])
    with pytest.raises(TypeError, match=r"shard must be a CPShard"):
        unshard(shard.block_mask, None, [x], [2])
