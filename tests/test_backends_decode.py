"""The decode backend: a few queries against a KV cache, on the CPU, in one flash-kernel call.

Every result is compared, in float64, with ``oracle.attention`` over the dense mask written
plainly from the documented semantics (``oracle``: causal, document ids, |q - kv| < size,
ancestor sets), evaluated at each row's query positions ``cache_lens[b] ..`` — the window a
decode step means — for decode_mask's and DecodeMasks' steps, torch's own BlockMasks, Masks
and handles; and ``flexmask.attention(..., backend="auto")`` is checked to choose the
backend for a decode call and not otherwise.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.backends import decode
from tests import oracle

TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}


def _tensors(batch, q_heads, kv_heads, q_len, kv_len, dtype, seed=0, head_dim=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _check(q, k, v, allowed, got, scale=None):
    """``got`` (output, lse) against the float64 reference over ``allowed`` (bool,
    broadcastable to (B, Hq, Q, KV)): close where a row attends something, exactly 0 and
    -inf where it attends nothing."""
    out, lse = got
    allowed = torch.as_tensor(allowed).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    ref_out, ref_lse = oracle.attention(q.double(), k.double(), v.double(), allowed, scale)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    tol = TOLERANCE[q.dtype]
    has_key = allowed.any(-1)
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double()[has_key], ref_lse[has_key], atol=tol, rtol=tol)
    assert bool((out[~has_key] == 0).all())
    assert bool((lse[~has_key] == float("-inf")).all())


def _run(q, k, v, mask, **kwargs):
    return flexmask.attention(q, k, v, mask, backend="decode", return_lse=True, **kwargs)


def _window(rows, lens, q_len):
    """(B, 1, q_len, capacity): each row's full-sequence mask at its step's query positions."""
    return torch.from_numpy(
        np.stack([full[n : n + q_len] for full, n in zip(rows, lens, strict=True)])[:, None]
    )


def _cases(capacity, batch, q_len, rng):
    """(name, mask, cache_lens, one (capacity, capacity) numpy mask per row)."""
    lens = [rng.randrange(0, capacity - q_len + 1) for _ in range(batch)]
    docs = []
    for _ in range(batch):
        row, used = [], 0
        while used < capacity:
            row.append(min(rng.randint(1, 90), capacity - used))
            used += row[-1]
        docs.append(row)
    window = rng.randint(1, 150)
    causal = oracle.causal(capacity, capacity)
    parents = []
    for _ in range(batch):
        prompt = rng.randint(1, capacity // 2)
        row = [-1, *range(prompt - 1)]
        while len(row) < capacity:  # branches off the prompt or off an earlier branch
            row.append(rng.randrange(prompt - 1, len(row)) if rng.random() < 0.1 else len(row) - 1)
        parents.append(row)
    prefix, draft = (
        rng.randint(1, capacity - q_len),
        [-1] + [rng.randrange(-1, i) for i in range(q_len - 1)],
    )
    spec_len = prefix + len(draft)
    spec_parents = [*range(-1, prefix - 1)] + [prefix - 1 if p < 0 else p + prefix for p in draft]
    return [
        ("causal", flexmask.causal(), lens, [causal] * batch),
        (
            "causal & document",
            flexmask.causal() & flexmask.document(docs),
            lens,
            [causal & oracle.document(d, capacity, capacity) for d in docs],
        ),
        (
            "causal & sliding_window",
            flexmask.causal() & flexmask.sliding_window(window),
            lens,
            [causal & oracle.sliding_window(window, capacity, capacity)] * batch,
        ),
        (
            "tree",
            flexmask.tree(parents),
            lens,
            [oracle.tree(p, capacity, capacity) for p in parents],
        ),
        (
            "speculative_tree",
            flexmask.speculative_tree(prefix, draft),
            [prefix] * batch,  # the verify step: the draft's queries
            [oracle.tree(spec_parents, capacity, capacity)] * batch,
        ),
    ][: None if spec_len <= capacity else -1]


@pytest.mark.parametrize("q_len", [1, 7, 64])
@pytest.mark.parametrize(
    ("batch", "q_heads", "kv_heads", "dtype", "block"),
    [
        (1, 1, 1, torch.float32, 128),
        (3, 2, 2, torch.float64, 64),
        (2, 4, 2, torch.bfloat16, (16, 32)),
        (3, 6, 3, torch.float16, 128),
    ],
)
def test_decode_mask_steps_match_reference(q_len, batch, q_heads, kv_heads, dtype, block):
    """decode_mask's step for each mask kind, ragged cache lengths, a capacity that is not a
    multiple of the block size, GQA, every dtype the kernel takes."""
    rng = random.Random(q_len * 100 + batch)
    capacity = 333
    q, k, v = _tensors(batch, q_heads, kv_heads, q_len, capacity, dtype, seed=q_len)
    for name, mask, lens, rows in _cases(capacity, batch, q_len, rng):
        bm = flexmask.decode_mask(mask, lens, q_len, capacity, block_size=block)
        got = _run(q, k, v, bm, enable_gqa=q_heads != kv_heads)
        try:
            _check(q, k, v, _window(rows, lens, q_len), got)
        except AssertionError as err:
            raise AssertionError(f"{name}, cache_lens={lens}: {err}") from err


@pytest.mark.parametrize("name", ["causal", "causal & document", "causal & sliding_window", "tree"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_masks_walk_matches_reference(name, q_len):
    """DecodeMasks' steps, reused and appended in place as the walk crosses kv blocks (the
    backend keeps what it read from a BlockMask only while its tensors are unchanged)."""
    rng = random.Random(q_len)
    capacity, batch = 200, 3
    (case,) = [c for c in _cases(capacity, batch, q_len, rng) if c[0] == name]
    _, mask, _, rows = case
    lens = [rng.randrange(0, 40) for _ in range(batch)]
    if name == "tree":  # a walk down each row's last branch: the tree path's appends
        lens = [capacity - 70 - q_len] * batch
    steps = flexmask.DecodeMasks(mask, lens, capacity=capacity, q_len=q_len, block_size=16)
    q, k, v = _tensors(batch, 2, 2, q_len, capacity, torch.float64, seed=1)
    kinds = set()
    for index, step in enumerate(steps):
        if index == 60:
            break
        kinds.add(step.kind)
        _check(q, k, v, _window(rows, step.cache_lens, q_len), _run(q, k, v, step.block_mask))
    assert {"append", "reuse"} <= kinds or name == "tree"


def test_fresh_block_masks_and_inference_mode():
    """A new BlockMask every step (a freed one's id comes back) and inference tensors (no
    version counter: read every call) give each step its own mask."""
    capacity, batch = 180, 2
    q, k, v = _tensors(batch, 2, 2, 1, capacity, torch.float64)
    rows = [oracle.causal(capacity, capacity)] * batch
    for start in range(60, 140, 7):
        lens = [start, start // 2]
        bm = flexmask.decode_mask(flexmask.causal(), lens, 1, capacity, block_size=16)
        _check(q, k, v, _window(rows, lens, 1), _run(q, k, v, bm))
        del bm
    with torch.inference_mode():
        steps = flexmask.DecodeMasks(flexmask.causal(), [10, 40], capacity=capacity, block_size=16)
        for index, step in enumerate(steps):
            if index == 30:
                break
            assert step.block_mask.kv_num_blocks.is_inference()
            _check(q, k, v, _window(rows, step.cache_lens, 1), _run(q, k, v, step.block_mask))


def test_edited_block_mask_is_read_again():
    """A BlockMask edited in place attends what its blocks say now, not what was read."""
    capacity = 256
    bm = flexmask.decode_mask(flexmask.causal(), [200, 100], 1, capacity, block_size=64)
    q, k, v = _tensors(2, 2, 2, 1, capacity, torch.float64)
    _check(
        q, k, v, _window([oracle.causal(capacity, capacity)] * 2, [200, 100], 1), _run(q, k, v, bm)
    )
    bm.kv_num_blocks[0] = 0  # row 0 now lists no block: it attends nothing
    bm.kv_num_blocks[1] = 1  # row 1 its first block only (decode_mask's causal lists partial)
    allowed = torch.zeros(2, 1, 1, capacity, dtype=torch.bool)
    allowed[1, 0, 0, :64] = True
    _check(q, k, v, allowed, _run(q, k, v, bm))


@pytest.mark.parametrize("scale", [None, 0.7, 0.0, -0.5, -3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale(scale, dtype):
    """Any finite scale, 0 and negatives included (the kernel's own causal masking would
    scale a masked -inf; this backend masks by adding -inf after scaling)."""
    capacity = 300
    docs = [[120, 100, 80], [50, 250]]
    mask = flexmask.causal() & flexmask.document(docs)
    lens = [130, 20]
    bm = flexmask.decode_mask(mask, lens, 4, capacity, block_size=64)
    q, k, v = _tensors(2, 2, 2, 4, capacity, dtype)
    rows = [
        oracle.causal(capacity, capacity) & oracle.document(d, capacity, capacity) for d in docs
    ]
    _check(q, k, v, _window(rows, lens, 4), _run(q, k, v, bm, scale=scale), scale=scale)
    # No mask: every key, no additive mask at all.
    _check(
        q,
        k,
        v,
        torch.ones(1, 1, 4, capacity, dtype=torch.bool),
        _run(q, k, v, None, scale=scale),
        scale,
    )


def test_rows_that_attend_nothing():
    """Padding past a row's length, a tree position past the tree, a BlockMask that lists
    nothing: output 0, lse -inf, as flex_attention gives."""
    capacity = 200
    mask = flexmask.causal() & flexmask.padding([150, 40])
    lens = [140, 45]  # row 1's queries sit past its length: they attend nothing
    bm = flexmask.decode_mask(mask, lens, 12, capacity, block_size=32)
    q, k, v = _tensors(2, 2, 2, 12, capacity, torch.float32)
    rows = [
        oracle.causal(capacity, capacity) & oracle.padding(n, capacity, capacity) for n in (150, 40)
    ]
    allowed = _window(rows, lens, 12)
    assert not allowed[1].any() and allowed[0, 0, :10].any() and not allowed[0, 0, 10:].any()
    _check(q, k, v, allowed, _run(q, k, v, bm))
    nothing = BlockMask.from_kv_blocks(
        torch.zeros(1, 1, 1, dtype=torch.int32),
        torch.zeros(1, 1, 1, 2, dtype=torch.int32),
        BLOCK_SIZE=128,
        seq_lengths=(12, capacity),
    )
    _check(q, k, v, torch.zeros(1, 1, 12, capacity, dtype=torch.bool), _run(q, k, v, nothing))


def test_torch_block_masks():
    """torch's own BlockMasks: a lookup mask_mod that broadcasts, one that only runs under
    vmap (called on scalars as flex_attention calls it), a B = 1 BlockMask whose mask_mod
    reads the real batch index, and per-head blocks."""
    capacity, q_len, batch, heads = 260, 5, 3, 2
    q, k, v = _tensors(batch, heads, heads, q_len, capacity, torch.float64)
    rng = np.random.default_rng(0)
    dense = rng.random((batch, heads, q_len, capacity)) < 0.3
    dense[:, :, :, 128:256] = True  # some full blocks
    dense[1, 0, 2] = False
    _check(q, k, v, torch.from_numpy(dense), _run(q, k, v, oracle.torch_build(dense, block=128)))

    def scalar_only(b, h, q_idx, kv_idx):
        # torch.stack needs equal shapes: broadcasting index tensors fail, vmap's 0-d pass.
        pair = torch.stack([q_idx + 100 * b, kv_idx])
        return pair[1] <= pair[0] + h

    bm = torch_create_block_mask(
        scalar_only, batch, heads, q_len, capacity, device="cpu", BLOCK_SIZE=64
    )
    meaning = oracle.block_mask_meaning(bm, batch, heads, q_len, capacity)
    _check(q, k, v, meaning, _run(q, k, v, bm))
    shared = BlockMask.from_kv_blocks(  # B = 1, H = 1: every block partial, mask_mod decides
        torch.full((1, 1, 1), 3, dtype=torch.int32),
        torch.arange(3, dtype=torch.int32).view(1, 1, 1, 3),
        BLOCK_SIZE=128,
        mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 50 * b + 7 * h,
        seq_lengths=(q_len, capacity),
    )
    meaning = oracle.block_mask_meaning(shared, batch, heads, q_len, capacity)
    assert not torch.equal(meaning[0], meaning[2])
    _check(q, k, v, meaning, _run(q, k, v, shared))
    # Per query head, with grouped kv heads: query head h reads kv head h // 2.
    q, k, v = _tensors(batch, 4, 2, q_len, capacity, torch.float64, seed=3)
    per_head = torch_create_block_mask(
        lambda b, h, q_idx, kv_idx: kv_idx <= q_idx * 40 + 30 * h + 7 * b,
        batch,
        4,
        q_len,
        capacity,
        device="cpu",
        BLOCK_SIZE=64,
    )
    meaning = oracle.block_mask_meaning(per_head, batch, 4, q_len, capacity)
    _check(q, k, v, meaning, _run(q, k, v, per_head, enable_gqa=True))


def test_block_listed_partial_and_full_counts_as_full():
    capacity, q_len = 256, 2
    bm = BlockMask.from_kv_blocks(
        torch.tensor([[[2]]], dtype=torch.int32),
        torch.tensor([[[0, 1]]], dtype=torch.int32),
        torch.tensor([[[1]]], dtype=torch.int32),
        torch.tensor([[[1, 0]]], dtype=torch.int32),
        BLOCK_SIZE=128,
        mask_mod=lambda b, h, q_idx, kv_idx: kv_idx == 5,
        seq_lengths=(q_len, capacity),
    )
    q, k, v = _tensors(1, 1, 1, q_len, capacity, torch.float64)
    allowed = torch.zeros(1, 1, q_len, capacity, dtype=torch.bool)
    allowed[..., 5] = True
    allowed[..., 128:] = True
    _check(q, k, v, allowed, _run(q, k, v, bm))


def test_masks_handles_and_non_contiguous_inputs():
    """A Mask (through the cache) and a handle for the call's own lengths; q, k and v as
    views of (B, S, H, D) storage and a key with a last-dim stride of 2."""
    capacity, q_len, batch = 300, 3, 2
    base_q = torch.randn(batch, q_len, 4, 16, dtype=torch.float64)
    base_kv = torch.randn(batch, capacity, 2, 32, dtype=torch.float64)
    q = base_q.transpose(1, 2)
    k = base_kv[..., ::2].transpose(1, 2)
    v = base_kv[..., 16:].transpose(1, 2)
    assert k.stride(-1) == 2 and not q.is_contiguous()
    mask = flexmask.causal() & flexmask.sliding_window(100)
    allowed = torch.from_numpy(
        oracle.causal(q_len, capacity) & oracle.sliding_window(100, q_len, capacity)
    )
    _check(q, k, v, allowed, _run(q, k, v, mask, enable_gqa=True))
    handle = flexmask.lazy(mask, batch, 4, q_len, capacity, device="cpu")
    _check(q, k, v, allowed, _run(q, k, v, handle, enable_gqa=True))


def test_auto_chooses_decode_for_a_decode_call_only():
    capacity = 4096
    bm = flexmask.decode_mask(flexmask.causal(), [1000, 3000], 1, capacity)
    q, k, v = _tensors(2, 4, 4, 1, capacity, torch.float32)
    choice = flexmask.explain(q, k, v, bm)
    assert choice.backend == decode.NAME
    allowed = _window([oracle.causal(capacity, capacity)] * 2, [1000, 3000], 1)
    _check(q, k, v, allowed, flexmask.attention(q, k, v, bm, return_lse=True))
    out = flexmask.attention(q, k, v, bm)
    assert torch.equal(out, flexmask.attention(q, k, v, bm, backend="decode"))
    verify = flexmask.decode_mask(flexmask.causal(), [1000, 3000], decode.MAX_QUERY_ROWS, capacity)
    q_verify = torch.randn(2, 4, decode.MAX_QUERY_ROWS, 64)
    k, v = torch.randn(2, 4, capacity, 64), torch.randn(2, 4, capacity, 64)
    assert flexmask.explain(q_verify, k, v, verify).backend == decode.NAME
    # A prefill (long Q), and a call that needs gradients, go elsewhere.
    long_q = torch.randn(1, 4, 1024, 64)
    long_kv = torch.randn(1, 4, 1024, 64)
    choice = flexmask.explain(long_q, long_kv, long_kv, flexmask.causal())
    assert choice.backend != decode.NAME and decode.NAME in choice.refused
    chunk = flexmask.decode_mask(flexmask.causal(), [1000], decode.MAX_QUERY_ROWS + 1, capacity)
    q_chunk = torch.randn(1, 4, decode.MAX_QUERY_ROWS + 1, 64)
    assert flexmask.explain(q_chunk, k[:1], v[:1], chunk).backend != decode.NAME
    q_grad, k_grad, v_grad = (
        t.clone().requires_grad_() for t in _tensors(2, 4, 4, 1, capacity, torch.float32)
    )
    choice = flexmask.explain(q_grad, k_grad, v_grad, bm)
    assert choice.backend != decode.NAME and "gradients" in choice.refused[decode.NAME]


def test_refusals_name_the_reason():
    capacity = 256
    bm = flexmask.decode_mask(flexmask.causal(), [10], 1, capacity)
    q, k, v = _tensors(1, 2, 2, 1, capacity, torch.float32)
    with pytest.raises(ValueError, match="score_mod"):
        flexmask.attention(q, k, v, bm, backend="decode", score_mod=lambda s, b, h, qi, ki: s)
    with pytest.raises((TypeError, ValueError), match="dtype"):  # refused, or the call's check
        flexmask.attention(q.int(), k.int(), v.int(), bm, backend="decode")
    per_row = flexmask.decode_mask(flexmask.causal(), [10, 20, 30], 1, capacity)
    with pytest.raises(ValueError, match="batch and head dims"):
        flexmask.attention(q, k, v, per_row, backend="decode")
