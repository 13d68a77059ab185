"""A mask is checked once per spec, counted by every check of it — ``Mask.validate`` and each
node's own ``check`` (pieces, ``&``, ``|``, ``~``) — through a lazy handle's forward and
backward on every CPU backend, and at every entry point that makes a spec."""

from __future__ import annotations

import pytest
import torch

import flexmask
from flexmask.algebra import Mask


def _mask_classes() -> list[type]:
    found, todo = [], [Mask]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.fixture
def checks(monkeypatch):
    """Every check run on a mask node, as ``(class name, method)``, in order."""
    calls: list[tuple[str, str]] = []
    for cls in _mask_classes():
        for method in ("check", "validate"):
            own = cls.__dict__.get(method)
            if own is None:
                continue

            def counted(self, extent, _own=own, _method=method):
                calls.append((type(self).__name__, _method))
                return _own(self, extent)

            monkeypatch.setattr(cls, method, counted)
    return calls


S = 512
MASKS = {
    "document": lambda: flexmask.causal() & flexmask.document([300, 212]),
    "window": lambda: flexmask.sliding_window(128) & flexmask.document([[400, 112], [112, 400]]),
    "tree": lambda: flexmask.tree([-1, *range(300), 0, *range(301, 511)]),
    "negation": lambda: ~(flexmask.prefix(32) | ~flexmask.causal()) | flexmask.padding(480),
}
# The CPU backends (flex's uncompiled CPU kernel is refused by default; decode serves a few
# queries without gradients).
WITH_GRAD = ("slices", "block_sparse", "sdpa")


def _call(backend: str, handle, rows: int) -> None:
    grad = backend in WITH_GRAD
    q_len = 4 if backend == "decode" else S
    q = torch.randn(rows, 2, q_len, 16, requires_grad=grad)
    k, v = (torch.randn(rows, 2, S, 16, requires_grad=grad) for _ in range(2))
    assert flexmask.explain(q, k, v, handle, backend=backend).backend == backend
    out = flexmask.attention(q, k, v, handle, backend)
    if grad:
        out.sum().backward()
        assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("backend", (*WITH_GRAD, "decode"))
def test_a_lazy_handle_is_checked_once_on_every_cpu_backend(checks, backend, name):
    mask = MASKS[name]()
    rows = mask.rows or 1
    q_len = 4 if backend == "decode" else S
    checks.clear()
    handle = flexmask.lazy(mask, rows, 1, q_len, S, "cpu", cache=flexmask.MaskCache())
    made = list(checks)
    assert made[0] == (type(mask).__name__, "validate") and made.count(made[0]) == 1
    assert len(made) > 1  # each node's own check ran, once, under that validation
    with handle:
        _call(backend, handle, rows)
        _call(backend, handle, rows)
    assert checks == made, f"{backend} checked the mask again: {checks[len(made) :]}"


@pytest.mark.parametrize("backend", WITH_GRAD)
def test_a_mask_given_to_attention_is_checked_once_per_call(checks, backend):
    mask = MASKS["document"]()
    q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
    checks.clear()
    flexmask.attention(q, k, v, mask, backend)
    assert checks.count(("And", "validate")) == 1, checks
    for node in ("And", "Causal", "Document"):
        assert checks.count((node, "check")) == 1, checks


ENTRIES = {
    "create": lambda m: flexmask.create_block_mask(m, 1, 1, S, S, "cpu"),
    "create_window": lambda m: flexmask.create_block_mask(m, 1, 1, 128, S, "cpu", q_offset=384),
    "cache": lambda m: flexmask.MaskCache().get(m, 1, 1, S, S, "cpu"),
    "varlen": lambda m: flexmask.to_varlen(m, 1, None, S, S),
    "magi": lambda m: flexmask.to_magi(m, 1, None, S, S),
    "flashmask": lambda m: flexmask.to_flashmask(m, 1, 1, S),
    "decode": lambda m: flexmask.decode_mask(m, [200], q_len=1, capacity=S, block_size=64),
    "shard": lambda m: flexmask.shard(m, 1, 1, S, world_size=2, rank=0, BLOCK_SIZE=64),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_every_entry_point_checks_the_mask_once(checks, entry):
    mask = MASKS["document"]()
    checks.clear()
    ENTRIES[entry](mask)
    assert checks.count(("And", "validate")) == 1, checks
    for node in ("And", "Causal", "Document"):
        assert checks.count((node, "check")) == 1, checks


def test_the_counter_sees_a_second_check(checks):
    mask = MASKS["document"]()
    checks.clear()
    flexmask.create_block_mask(mask, 1, 1, S, S, "cpu")
    once = len(checks)
    flexmask.create_block_mask(mask, 1, 1, S, S, "cpu")
    assert once == 4 and len(checks) == 2 * once
