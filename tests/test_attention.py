"""flexmask.flex_attention equals SDPA on the dense mask; compiled, it does not recompile."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flexmask
from tests import oracle


def masks(S: int):
    """name -> (mask, plain dense reference of shape (rows, S, S) from tests/oracle.py)."""
    lens = [max(1, S // 3), max(1, S // 4), max(1, S // 5)] if S >= 3 else [S]
    parents = [-1] + [i - 1 if i % 11 else 0 for i in range(1, S)]
    causal, doc = oracle.causal(S, S), oracle.document(lens, S, S)
    return {
        "causal": (flexmask.causal(), [causal]),
        "document": (flexmask.document(lens), [doc]),
        "document-causal": (flexmask.causal() & flexmask.document(lens), [causal & doc]),
        "padding": (
            flexmask.padding([S, max(1, S - 17)]),
            [oracle.padding(S, S, S), oracle.padding(max(1, S - 17), S, S)],
        ),
        "tree": (flexmask.tree(parents), [oracle.tree(parents, S, S)]),
        "sliding-window": (
            flexmask.causal() & flexmask.sliding_window(37),
            [causal & oracle.sliding_window(37, S, S)],
        ),
        "prefix-lm": (
            flexmask.causal() | flexmask.prefix(max(1, S // 4)),
            [causal | oracle.prefix(max(1, S // 4), S, S)],
        ),
        "composed": (
            (flexmask.causal() & flexmask.document(lens) & flexmask.sliding_window(50))
            | flexmask.prefix(min(3, S)),
            [(causal & doc & oracle.sliding_window(50, S, S)) | oracle.prefix(min(3, S), S, S)],
        ),
        "full": (flexmask.full(), [np.ones((S, S), bool)]),
    }


def dense_reference(rows, B: int, H: int) -> torch.Tensor:
    rows = rows * B if len(rows) == 1 else rows
    return torch.from_numpy(oracle.stack(rows, heads=H))


def sdpa_reference(q, k, v, dense):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    return torch.where(dense.any(-1, keepdim=True), out, 0.0)  # flex gives 0 for empty rows


@pytest.mark.parametrize("S", [1, 77, 300])
def test_forward_matches_sdpa_for_every_piece(S):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, S, 16) for _ in range(3))
    for name, (mask, rows) in masks(S).items():
        with torch.no_grad():
            out = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
        dense = dense_reference(rows, 2, 3)
        torch.testing.assert_close(
            out, sdpa_reference(q, k, v, dense), atol=1e-5, rtol=1e-5, msg=name
        )


def test_block_mask_and_handle_and_none_inputs():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 130, 8) for _ in range(3))
    mask = flexmask.causal() & flexmask.document([70, 60])
    bm = flexmask.create_block_mask(mask, 1, 2, 130, 130, "cpu")
    handle = flexmask.lazy(mask, 1, 2, 130, 130, "cpu")
    with torch.no_grad():
        a = flexmask.flex_attention(q, k, v, block_mask=bm, compile=False)
        b = flexmask.flex_attention(q, k, v, block_mask=handle, compile=False)
        c = flexmask.flex_attention(q, k, v, compile=False)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(c, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="block_mask must be"):
        flexmask.flex_attention(q, k, v, block_mask="causal")


def test_compile_switch(monkeypatch):
    monkeypatch.setenv("FLEXMASK_COMPILE", "0")
    flexmask.set_compile(None)  # fall back to the environment
    assert not flexmask.compile_enabled()
    monkeypatch.setenv("FLEXMASK_COMPILE", "maybe")
    with pytest.raises(ValueError, match="FLEXMASK_COMPILE"):
        flexmask.compile_enabled()
    flexmask.set_compile(True)
    assert flexmask.compile_enabled()
    flexmask.set_compile(None)


@pytest.mark.slow
def test_compiled_no_recompiles_when_batch_content_changes():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    S = 256
    rng = random.Random(0)
    q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
    for step in range(6):
        n_docs = rng.randint(1, 9)
        cuts = sorted(rng.sample(range(1, S - 10), n_docs - 1))
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, S - rng.randint(0, 10)], strict=True)]
        # documents, a new tree and new padding every step; same S
        parents = [-1] + [rng.randint(max(0, i - 3), i - 1) for i in range(1, S)]
        real = S - rng.randint(0, 40)
        for mask, row in (
            (
                flexmask.causal() & flexmask.document(lens),
                oracle.causal(S, S) & oracle.document(lens, S, S),
            ),
            (flexmask.tree(parents), oracle.tree(parents, S, S)),
            (
                flexmask.causal() & flexmask.padding([real]),
                oracle.causal(S, S) & oracle.padding(real, S, S),
            ),
        ):
            handle = flexmask.lazy(mask, 1, 2, S, S, "cpu")
            with torch.no_grad(), handle:
                out = flexmask.flex_attention(q, k, v, block_mask=handle, compile=True)
            dense = torch.from_numpy(oracle.stack([row], heads=2))
            torch.testing.assert_close(out, sdpa_reference(q, k, v, dense), atol=1e-5, rtol=1e-5)
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs_after_first
    assert sum(counters["recompiles"].values()) == 0 if "recompiles" in counters else True
