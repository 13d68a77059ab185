"""flexmask.attention(backend="auto") and flexmask.explain: the fastest backend that can take
a call on this device, checked against a dense reference written plainly from the oracle's
masks (not flexmask's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import flexmask
from flexmask import backends
from tests import oracle

B, H, S = 2, 3, 203  # odd length: not a multiple of the block size


def dense_attention(q, k, v, allowed):
    """Attention written plainly: softmax over the allowed keys; a row with none gives 0."""
    scores = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


def qkv(requires_grad=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, S, 16, dtype=torch.float64, generator=gen).requires_grad_(requires_grad)
        for _ in range(3)
    ]


# Each case: a flexmask Mask and its dense (B, 1, S, S) oracle, rows differing.
CASES = {
    "document-causal-padding": (
        flexmask.causal()
        & flexmask.document([[90, 113], [50, 60, 70]])
        & flexmask.padding([190, 180]),
        [
            oracle.causal(S, S) & oracle.document([90, 113], S, S) & oracle.padding(190, S, S),
            oracle.causal(S, S) & oracle.document([50, 60, 70], S, S) & oracle.padding(180, S, S),
        ],
    ),
    "sliding-window": (
        flexmask.causal() & flexmask.sliding_window(37),
        [oracle.causal(S, S) & oracle.sliding_window(37, S, S)] * B,
    ),
    "tree-or-prefix": (
        flexmask.tree([-1, *range(100), *([10] + list(range(101, 202)))]) | flexmask.prefix(5),
        [
            oracle.tree([-1, *range(100), *([10] + list(range(101, 202)))], S, S)
            | oracle.prefix(5, S, S)
        ]
        * B,
    ),
}


def dense(rows):
    return torch.from_numpy(np.stack(rows))[:, None]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["auto", "slices", "block_sparse", "sdpa"])
def test_auto_and_each_cpu_backend_match_a_dense_reference(case, backend):
    mask, rows = CASES[case]
    q, k, v = qkv()
    out = flexmask.attention(q, k, v, mask, backend)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = dense_attention(q, k, v, dense(rows))
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


@pytest.mark.slow
def test_auto_runs_compiled_flex_when_asked_on_a_no_grad_cpu_call():
    mask, rows = CASES["document-causal-padding"]
    q, k, v = (t.float() for t in qkv(requires_grad=False))
    choice = flexmask.explain(q, k, v, mask, compile=True)
    assert choice.backend == "slices"  # measured faster on the CPU: AUTO's order
    out = flexmask.attention(q, k, v, mask, "flex", compile=True)
    torch.testing.assert_close(out, dense_attention(q, k, v, dense(rows)), atol=2e-5, rtol=0)


def test_explain_names_the_choice_and_every_refusal():
    mask = CASES["document-causal-padding"][0]
    q, k, v = qkv()
    choice = flexmask.explain(q, k, v, mask)
    assert choice.backend == backends.AUTO["cpu"][0] == "slices"
    assert set(choice.order) == set(backends.TABLE)
    assert choice.refused == {
        "flex": "torch's flex_attention has no backward on the CPU",
        "varlen": "varlen_attn and flash-attn run on CUDA only, and this call is on cpu",
    }
    text = repr(choice)
    assert "backend='slices'" in text and "varlen: refused: varlen_attn" in text
    # A call that only some take: return_lse is refused by SDPA, with its reason.
    with torch.no_grad():
        refused = flexmask.explain(q, k, v, mask, return_lse=True).refused
    assert refused["sdpa"] == "SDPA returns no log-sum-exp"
    # With gradients the slices backend refuses return_lse, and block_sparse takes it.
    choice = flexmask.explain(q, k, v, mask, return_lse=True)
    assert choice.backend == "block_sparse"
    assert "without gradients" in choice.refused["slices"]


def test_a_named_backend_that_cannot_run_the_call_raises_its_reason():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"backend='varlen' cannot run this call .*CUDA only"):
        flexmask.attention(q, k, v, flexmask.causal(), "varlen")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        flexmask.attention(q, k, v, flexmask.causal(), "flash")
    assert flexmask.explain(q, k, v, flexmask.causal(), "varlen").backend == ""


def test_auto_runs_the_backend_explain_names(monkeypatch):
    seen = []
    for name, module in backends.TABLE.items():
        monkeypatch.setattr(
            module,
            "attend",
            lambda request, name=name, attend=module.attend: seen.append(name) or attend(request),
        )
    q, k, v = qkv()
    mask = CASES["sliding-window"][0]
    flexmask.attention(q, k, v, mask)
    assert seen == [flexmask.explain(q, k, v, mask).backend]


def test_the_auto_table_names_its_benchmark_and_only_known_backends():
    assert (Path(__file__).parent.parent / backends.AUTO_BENCHMARK).is_file()
    for device, order in backends.AUTO.items():
        assert set(order) <= set(backends.TABLE), device
        assert len(set(order)) == len(order), device


def test_flex_attention_keeps_its_table_order():
    # flexmask.flex_attention still asks TABLE in order (flex, then block_sparse): the CPU
    # call with gradients runs block_sparse, as before auto existed.
    q, k, v = qkv()
    mask = CASES["sliding-window"][0]
    out = flexmask.flex_attention(q, k, v, block_mask=mask)
    torch.testing.assert_close(
        out, dense_attention(q, k, v, dense(CASES["sliding-window"][1])), atol=1e-10, rtol=0
    )
