"""A backend written outside flexmask, registered with ``register_backend``, runs through every
entry point: ``flexmask.flex_attention`` with a Mask, flexmask's BlockMask, torch's own
BlockMask, a lazy handle and a decode step; ``flexmask.attention`` (by name and "auto");
``explain``; transformers' attention function; ``cp_flex_attention`` on gloo ranks (the
all-gather and the needed-only exchange) — and gives the dense oracle's output everywhere.

The backend is a plain reference written here from torch's documented BlockMask semantics: a
position is attended where its block is listed and either the block is listed as full or the
mask_mod holds there (torch's ``create_mask`` evaluates the mask_mod)."""

from __future__ import annotations

import types

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import create_mask

import flexmask
from flexmask import backends
from flexmask.context_parallel import plan_exchange
from tests import oracle
from tests.ranks import spawn_ranks


def _listed(block_mask, full: bool) -> torch.Tensor:
    """(B, H, n_q, n_kv) bools: the blocks ``block_mask`` lists as partial (or full)."""
    counts = block_mask.full_kv_num_blocks if full else block_mask.kv_num_blocks
    indices = block_mask.full_kv_indices if full else block_mask.kv_indices
    shape = (*indices.shape[:3], indices.shape[-1])
    listed = torch.zeros(shape, dtype=torch.bool)
    if counts is None:
        return listed
    for b, h, row in torch.cartesian_prod(*(torch.arange(n) for n in shape[:3])).tolist():
        listed[b, h, row, indices[b, h, row, : counts[b, h, row]]] = True
    return listed


def attended(block_mask, batch: int, heads: int) -> torch.Tensor:
    """(B, H, Q_LEN, KV_LEN) bools of what ``block_mask`` attends, by torch's semantics."""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE

    def spread(blocks: torch.Tensor) -> torch.Tensor:
        dense = blocks.repeat_interleave(q_block, 2).repeat_interleave(kv_block, 3)
        return dense[:, :, :q_len, :kv_len].expand(batch, heads, -1, -1)

    mod = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    return spread(_listed(block_mask, True)) | spread(_listed(block_mask, False)) & mod


SEEN: list[str] = []


def _module() -> types.ModuleType:
    ref = types.ModuleType("reference_backend")
    ref.NAME = "reference"
    ref.OPTIONS = ()

    def can_take(request):
        return "no score_mod here" if request.score_mod is not None else None

    def lower(request):
        return request.built()

    def attend(request):
        q, k, v = request.query_key_value
        SEEN.append(type(request.block_mask).__name__)
        if request.block_mask is None:
            dense = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
        else:
            dense = attended(request.block_mask, q.shape[0], q.shape[1])
        out, lse = oracle.attention(q, k, v, dense, request.scale, request.enable_gqa)
        out, lse = out.to(q.dtype), lse.to(torch.float32)
        return (out, lse) if request.return_lse else out

    ref.can_take, ref.lower, ref.attend = can_take, lower, attend
    ref.kernel_name = lambda request: "tests.oracle.attention"
    return ref


def register() -> None:
    """The backend asked first on the CPU (a fresh TABLE and AUTO are the caller's)."""
    backends.register_backend("reference", _module(), ("cpu",), before=backends.order("cpu")[0])


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(backends, "TABLE", dict(backends.TABLE))
    monkeypatch.setattr(backends, "AUTO", dict(backends.AUTO))
    register()
    SEEN.clear()
    yield SEEN


B, H, S, D = 2, 2, 192, 16
MASK = flexmask.causal() & flexmask.document([[100, 92], [64, 128]])


def doc_causal(b, h, q, kv):
    """The same mask as a plain mask_mod, written here (torch builds it)."""
    ends = torch.tensor([[100, 192], [64, 192]])
    return (kv <= q) & ((q >= ends[b, 0]) == (kv >= ends[b, 0]))


def expected(q, k, v):
    return oracle.attention(q, k, v, MASK.to_dense(B, H, S, S))[0].to(q.dtype)


ENTRIES = {
    "mask": lambda q, k, v: flexmask.flex_attention(q, k, v, block_mask=MASK),
    "flexmask_block_mask": lambda q, k, v: flexmask.flex_attention(
        q, k, v, block_mask=flexmask.create_block_mask(MASK, B, 1, S, S, "cpu", 64)
    ),
    "torch_block_mask": lambda q, k, v: flexmask.flex_attention(
        q, k, v, block_mask=torch_create_block_mask(doc_causal, B, 1, S, S, "cpu", 64)
    ),
    "lazy": lambda q, k, v: flexmask.flex_attention(
        q, k, v, block_mask=flexmask.lazy(MASK, B, 1, S, S, "cpu", 64)
    ),
    "attention_auto": lambda q, k, v: flexmask.attention(q, k, v, MASK),
    "attention_named": lambda q, k, v: flexmask.attention(q, k, v, MASK, backend="reference"),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_a_registered_backend_takes_every_entry_point(registered, entry):
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out = ENTRIES[entry](q, k, v)
    assert registered, f"{entry} did not reach the registered backend"
    torch.testing.assert_close(out, expected(q, k, v), atol=1e-6, rtol=1e-6)


def test_explain_names_it_and_a_decode_step_reaches_it(registered):
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    choice = flexmask.explain(q, k, v, MASK)
    assert (choice.backend, choice.kernel) == ("reference", "tests.oracle.attention")
    step = flexmask.decode_mask(MASK, [150, 170], q_len=2, capacity=S, block_size=32)
    q2 = torch.randn(B, H, 2, D)
    out = flexmask.flex_attention(q2, k, v, block_mask=step)
    rows = torch.tensor([[150, 151], [170, 171]])
    dense = MASK.to_dense(B, H, S, S)[torch.arange(B)[:, None], :, rows].transpose(1, 2)
    torch.testing.assert_close(out, oracle.attention(q2, k, v, dense)[0].float())
    assert registered == ["BlockMask"]


def test_transformers_attention_function_reaches_it(registered):
    pytest.importorskip("transformers")
    from flexmask.integrations.transformers import flexmask_attention

    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    out, _ = flexmask_attention(None, q, k, v, MASK)
    assert registered
    torch.testing.assert_close(out, expected(q, k, v).transpose(1, 2))


def _cp_ranks(rank: int, world: int) -> None:
    register()  # each rank is a fresh process: its own registry
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D) for _ in range(3))
    mask = flexmask.causal() & flexmask.document([100, 92])
    want = oracle.attention(q, k, v, mask.to_dense(1, H, S, S))[0].float()
    shard = flexmask.shard(mask, 1, 1, S, world_size=world, rank=rank, BLOCK_SIZE=32)
    plan = plan_exchange(mask, 1, 1, S, world_size=world, rank=rank, BLOCK_SIZE=32)
    local = [shard.shard_tensor(t, 2) for t in (q, k, v)]
    for via, exchange in ((shard, "all_gather"), (plan, "needed")):
        SEEN.clear()
        out = flexmask.cp_flex_attention(*local, via, exchange=exchange)
        assert SEEN, f"cp_flex_attention ({exchange}) did not reach the registered backend"
        torch.testing.assert_close(out, shard.shard_tensor(want, 2), atol=1e-5, rtol=1e-5)


def test_context_parallel_attention_reaches_it():
    spawn_ranks(_cp_ranks, 2)
