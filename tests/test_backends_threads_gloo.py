"""The block-sparse kernel's two ways of using the cores (torch's intra-op threads, or
single-threaded workers) inside gloo ranks, with collectives in flight on gloo's own threads.

A per-call choice between the two ways was once backed out after a gloo rank aborted
("terminate called without an active exception") about one run in five. These ranks take
both ways on purpose, call after call, with an asynchronous all-reduce running on gloo's
threads while the kernel's workers and OpenMP threads work, and check every output and
gradient against SDPA on the dense mask written from the documented semantics. A rank that
dies of a signal fails the test (``run_ranks``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ranks import run_ranks


def _dense_document_causal(lengths: list[int]) -> torch.Tensor:
    """q attends kv when both are in the same document and kv is not after q."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(doc.numel())
    return (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])


def _both_ways(rank: int, world: int, calls: int) -> None:
    import flexmask
    from flexmask.backends import threads
    from flexmask.backends.block_sparse.api import block_sparse_attention

    torch.set_num_threads(2)  # the ways differ only with more than one thread
    taken: list[str] = []
    # A choice that probes at every other call: both ways, alternating, in every rank.
    choice = threads.ThreadChoice(first=1, most=2)
    pick = choice.pick
    choice.pick = lambda kind: taken.append(pick(kind)) or taken[-1]  # type: ignore[method-assign]
    threads.CHOICE = choice
    lengths = [300, 40, 500, 184]
    S = sum(lengths)
    mask = flexmask.causal() & flexmask.document(lengths)
    block_mask = flexmask.create_block_mask(mask, 1, 1, S, S, "cpu", BLOCK_SIZE=64)
    dense = _dense_document_causal(lengths)
    for call in range(calls):
        gen = torch.Generator().manual_seed(call)
        q, k, v = (torch.randn(1, 4, S, 32, generator=gen, requires_grad=True) for _ in range(3))
        pending = torch.full((1 << 16,), float(rank + 1))
        work = torch.distributed.all_reduce(pending, async_op=True)  # on gloo's threads
        out = block_sparse_attention(q, k, v, block_mask, mask=mask, backend="sparse")
        out.sum().backward()
        work.wait()
        assert torch.all(pending == world * (world + 1) / 2)
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        expected = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=dense)
        expected.sum().backward()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        grads = torch.cat([q.grad.flatten(), k.grad.flatten()])
        total = grads.clone()
        torch.distributed.all_reduce(total)  # every rank drew the same tensors
        torch.testing.assert_close(total, world * grads)
    assert torch.get_num_threads() == 2
    assert {"torch", "workers"} <= set(taken), taken


@pytest.mark.slow  # two spawned ranks: 10-30 s on 2 busy cores
def test_both_thread_ways_in_gloo_ranks_with_collectives_in_flight():
    reports = run_ranks(_both_ways, 2, 8, group_timeout_s=60, deadline_s=240)
    assert reports == [None, None], "\n".join(r for r in reports if r)
