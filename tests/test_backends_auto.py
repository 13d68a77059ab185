"""flexmask.attention(backend="auto") and flexmask.explain: the fastest backend that can take
a call on this device, checked against a dense reference written plainly from the oracle's
masks (not flexmask's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import flexmask
from flexmask import backends
from tests import oracle

B, H, S = 2, 3, 203  # odd length: not a multiple of the block size


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
    ref = oracle.attention(q, k, v, dense(rows))[0]
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
    want = oracle.attention(q, k, v, dense(rows))[0]
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)


def test_explain_names_the_choice_and_every_refusal():
    mask = CASES["document-causal-padding"][0]
    q, k, v = qkv()
    choice = flexmask.explain(q, k, v, mask)
    assert choice.backend == backends.AUTO["cpu"][1] == "slices"
    assert set(choice.order) == set(backends.TABLE)
    assert choice.refused == {
        "decode": "it runs without gradients (a decode step); this call needs them",
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


def _spy_on_the_sparse_path(monkeypatch):
    """Records each time block_sparse_attention reads intervals or runs its sparse kernel."""
    from flexmask.backends.block_sparse import api

    taken = []
    for name in ("interval_bounds", "grouped_attention"):
        real = getattr(api, name)
        monkeypatch.setattr(
            api, name, lambda *a, name=name, real=real, **kw: taken.append(name) or real(*a, **kw)
        )
    return taken


DELEGATED = {
    # block_sparse's own rule runs SDPA on each: too small for the sparse kernel with
    # gradients (203 x 203), half the blocks or more listed (300 x 300, 7 of 9), or a
    # no-grad 1k x 1k call; tiny documents, which the slices backend refuses.
    "small, with gradients": (
        flexmask.causal() & flexmask.document([7] * 29),
        S,
        True,
        lambda: dense([oracle.causal(S, S) & oracle.document([7] * 29, S, S)]),
    ),
    "half dense or more": (  # torch's BlockMask: no Mask, so the slices backend refuses it
        create_block_mask(lambda b, h, q, kv: (q >= kv) | (kv < 200), None, None, 300, 300, "cpu"),
        300,
        True,
        lambda: dense([oracle.causal(300, 300) | oracle.prefix(200, 300, 300)]),
    ),
    "1k tiny documents, no grad": (
        flexmask.causal() & flexmask.document([16] * 64),
        1024,
        False,
        lambda: dense([oracle.causal(1024, 1024) & oracle.document([16] * 64, 1024, 1024)]),
    ),
}


@pytest.mark.parametrize("case", sorted(DELEGATED))
def test_calls_the_block_sparse_rule_hands_to_sdpa_run_the_sdpa_backends_ops(monkeypatch, case):
    """Where block_sparse's rule picks SDPA, the call runs the sdpa backend's ops and nothing
    more: no intervals read, no sparse kernel, output and gradients equal bit for bit to
    backend="sdpa" (and to the dense reference). Through auto and flex_attention too, which
    pick block_sparse on these calls."""
    mask, length, train, allowed = DELEGATED[case]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(B, H, length, 16, dtype=torch.float64, generator=gen).requires_grad_(train)
        for _ in range(3)
    )
    taken = _spy_on_the_sparse_path(monkeypatch)
    with torch.set_grad_enabled(train):
        by_sdpa = flexmask.attention(q, k, v, mask, "sdpa")
        runs = {
            "block_sparse": flexmask.attention(q, k, v, mask, "block_sparse"),
            "auto": flexmask.attention(q, k, v, mask),
            "flex_attention": flexmask.flex_attention(q, k, v, mask, compile=False),
        }
    assert taken == []
    torch.testing.assert_close(by_sdpa, oracle.attention(q, k, v, allowed())[0], atol=1e-10, rtol=0)
    grad = torch.randn_like(by_sdpa)
    want = torch.autograd.grad(by_sdpa, (q, k, v), grad) if train else ()
    for name, out in runs.items():
        assert torch.equal(out, by_sdpa), name
        if train:
            got = torch.autograd.grad(out, (q, k, v), grad)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
    assert flexmask.explain(q, k, v, mask).backend == "block_sparse"


def test_a_block_sparse_option_still_runs_the_block_sparse_backend(monkeypatch):
    """An option of the block-sparse path keeps the call there; backend="sparse" runs its
    sparse kernel even where its rule would pick SDPA."""
    mask, rows = CASES["document-causal-padding"]
    q, k, v = qkv()
    assert flexmask.explain(q, k, v, mask, threads=1).backend == "block_sparse"
    taken = _spy_on_the_sparse_path(monkeypatch)
    out = flexmask.flex_attention(q, k, v, mask, compile=False, backend="sparse")
    assert taken == ["interval_bounds", "grouped_attention"]
    torch.testing.assert_close(out, oracle.attention(q, k, v, dense(rows))[0], atol=1e-10, rtol=0)


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
        out, oracle.attention(q, k, v, dense(CASES["sliding-window"][1]))[0], atol=1e-10, rtol=0
    )
