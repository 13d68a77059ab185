"""The backend table: every backend is one module (can_take, lower, attend) and one TABLE
line; flexmask.flex_attention runs the first one that takes the call."""

from __future__ import annotations

import types

import pytest
import torch

import flexmask
from flexmask import backends
from flexmask.backends import Request


def dense_attention(q, k, v, allowed):
    """Attention written plainly: softmax over the allowed keys; a row with none gives 0."""
    scores = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def request(q, k, v, mask=None, *, compile=False, **options):
    block_mask = (
        None if mask is None else flexmask.create_block_mask(mask, 1, 1, q.size(2), k.size(2))
    )
    return Request(q, k, v, block_mask, mask, None, None, False, False, compile, options)


def qkv(length=200, requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, 2, length, 16, dtype=torch.float64, generator=gen).requires_grad_(
            requires_grad
        )
        for _ in range(3)
    ]


def test_every_backend_is_one_module_with_the_three_calls():
    assert list(backends.TABLE) == ["flex", "block_sparse", "sdpa"]
    for name, module in backends.TABLE.items():
        assert name == module.NAME
        for call in ("can_take", "lower", "attend"):
            assert callable(getattr(module, call)), f"{name}.{call}"


def test_the_table_chooses_as_flex_attention_always_did():
    q, k, v = qkv()
    with torch.no_grad():
        assert backends.choose(request(q, k, v, compile=True)) is backends.flex
        assert backends.choose(request(q, k, v, compile=False)) is backends.block_sparse
    q, k, v = qkv(requires_grad=True)
    assert backends.choose(request(q, k, v, compile=True)) is backends.block_sparse
    assert "no backward" in backends.flex.can_take(request(q, k, v, compile=True))


@pytest.mark.parametrize("name", ["block_sparse", "sdpa"])
def test_cpu_backends_agree_with_the_dense_oracle(name):
    # A query with no key (padding cuts the last 20 keys, the window the first rows' own):
    # every backend gives it 0, as flex_attention does.
    mask = flexmask.causal() & flexmask.document([120, 80]) & flexmask.padding([180])
    q, k, v = qkv()
    backend = backends.TABLE[name]
    call = request(q, k, v, mask)
    assert backend.can_take(call) is None
    out = backend.attend(backend.lower(call))
    dense = mask.to_dense(1, 1, 200, 200)
    torch.testing.assert_close(out, dense_attention(q, k, v, dense), atol=1e-10, rtol=0)


def test_a_new_backend_is_one_module_and_one_table_line(monkeypatch):
    seen = []
    ones = types.ModuleType("ones")
    ones.NAME = "ones"
    ones.can_take = lambda call: None if call.options.get("ones") else "not asked for"
    ones.lower = lambda call: call._replace(options={})
    ones.attend = lambda call: seen.append(call.mask) or torch.ones_like(call.query)
    monkeypatch.setattr(backends, "TABLE", {"ones": ones, **backends.TABLE})
    q, k, v = qkv()
    mask = flexmask.causal()
    out = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False, ones=True)
    assert bool((out == 1).all()) and seen == [mask]
    # Not asked for: the next backend in the table takes the call, as before.
    out = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
    torch.testing.assert_close(
        out, dense_attention(q, k, v, mask.to_dense(1, 1, 200, 200)), atol=1e-10, rtol=0
    )


def test_no_backend_taking_the_call_names_every_reason(monkeypatch):
    monkeypatch.setattr(backends, "TABLE", {"flex": backends.flex})
    q, k, v = qkv(requires_grad=True)
    with pytest.raises(ValueError, match="flex: torch's flex_attention has no backward"):
        backends.choose(request(q, k, v))
