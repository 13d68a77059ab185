"""The backend table: every backend is one module (can_take, lower, attend, kernel_name,
OPTIONS) and one registration; flex_attention and attention("auto") run the first one of the
device's one order that takes the call."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import flexmask
from flexmask import backends
from flexmask.backends import Request
from tests import oracle


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


def test_every_backend_is_one_module_with_the_four_calls_and_its_options():
    assert set(backends.TABLE) >= {"flex", "slices", "block_sparse", "sdpa", "varlen"}
    for name, module in backends.TABLE.items():
        assert name == module.NAME
        for call in ("can_take", "lower", "attend", "kernel_name"):
            assert callable(getattr(module, call)), f"{name}.{call}"
        assert all(isinstance(option, str) for option in module.OPTIONS), name


def test_flex_attention_and_auto_ask_in_one_order_per_device():
    """On the CPU, whatever compile says: the slices backend for masks in big slices, the
    block-sparse path for the rest and for any call with its options; torch's kernel only
    where no CPU backend takes the call (never here: block_sparse takes every CPU call)."""
    assert backends.order("cpu")[: len(backends.AUTO["cpu"])] == backends.AUTO["cpu"]
    assert set(backends.order("cpu")) == set(backends.TABLE)
    assert backends.order("cuda")[0] == "flex"
    tiny = flexmask.causal() & flexmask.document([4] * 50)  # 50 calls of 4 queries
    for grad in (False, True):
        q, k, v = qkv(requires_grad=grad)
        for compile in (False, True):
            assert backends.choose(request(q, k, v, compile=compile)) is backends.slices
            assert backends.choose(request(q, k, v, tiny, compile=compile)) is backends.block_sparse
            threads = request(q, k, v, compile=compile)._replace(options={"threads": 1})
            assert backends.choose(threads) is backends.block_sparse
            explained = flexmask.explain(q, k, v, tiny, compile=compile)
            assert (
                explained.backend == backends.choose(request(q, k, v, tiny, compile=compile)).NAME
            )
    q, k, v = qkv(requires_grad=True)
    assert "no backward" in backends.flex.can_take(request(q, k, v, compile=True))


def test_register_backend_checks_the_protocol():
    bad = types.ModuleType("bad")
    bad.NAME = "bad"
    with pytest.raises(TypeError, match="lacks"):
        backends.register_backend("bad", bad, ("cpu",))
    with pytest.raises(ValueError, match="module's NAME"):
        backends.register_backend("other", bad)
    with pytest.raises(ValueError, match="registered already"):
        backends.register_backend("slices", backends.slices)
    assert "bad" not in backends.TABLE


@pytest.mark.parametrize("name", ["slices", "block_sparse", "sdpa"])
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
    torch.testing.assert_close(out, oracle.attention(q, k, v, dense)[0], atol=1e-10, rtol=0)


def test_a_new_backend_is_one_module_and_one_table_line(monkeypatch):
    seen = []
    ones = types.ModuleType("ones")
    ones.NAME = "ones"
    ones.can_take = lambda call: None if call.options.get("ones") else "not asked for"
    ones.lower = lambda call: call._replace(options={})
    ones.attend = lambda call: seen.append(call.mask) or torch.ones_like(call.query)
    ones.kernel_name = lambda call: "torch.ones_like"
    ones.OPTIONS = ("ones",)
    monkeypatch.setattr(backends, "TABLE", dict(backends.TABLE))
    monkeypatch.setattr(backends, "AUTO", dict(backends.AUTO))
    backends.register_backend("ones", ones, ("cpu",), before="slices")
    q, k, v = qkv()
    mask = flexmask.causal()
    out = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False, ones=True)
    assert bool((out == 1).all()) and seen == [mask]
    choice = flexmask.explain(q, k, v, mask, ones=True)
    assert (choice.backend, choice.kernel) == ("ones", "torch.ones_like")
    # Not asked for: the next backend in the table takes the call, as before.
    out = flexmask.flex_attention(q, k, v, block_mask=mask, compile=False)
    torch.testing.assert_close(
        out, oracle.attention(q, k, v, mask.to_dense(1, 1, 200, 200))[0], atol=1e-10, rtol=0
    )


def test_no_backend_taking_the_call_names_every_reason(monkeypatch):
    monkeypatch.setattr(backends, "TABLE", {"flex": backends.flex})
    q, k, v = qkv(requires_grad=True)
    with pytest.raises(ValueError, match="flex: torch's flex_attention has no backward"):
        backends.choose(request(q, k, v))


# --- varlen: lowered and gathered on the CPU, the kernel replaced by a reference written from
# flash-attn's documented semantics; the real kernels run under `gpu`.


def flash_attn_varlen_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    **unused,
):
    """flash_attn_varlen_func as its docstring says: per sequence, softmax attention; with
    causal (or a window) aligned to the bottom-right corner — query i of sq sees key j when
    i + sk - sq - left <= j <= i + sk - sq + right (right = 0 with causal); a query that
    sees no key gives 0. k/v heads are shared by groups of q heads (MQA/GQA)."""
    assert dropout_p == 0.0 and not unused
    assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0]
    left, right = window_size
    right = 0 if causal else right
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(cu_seqlens_q.numel() - 1):
        qa, qb = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ka, kb = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        sq, sk = qb - qa, kb - ka
        assert sq <= max_seqlen_q and sk <= max_seqlen_k
        diag = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None, :]
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= diag - left
        if right >= 0:
            allowed &= j <= diag + right
        qs = q[qa:qb].transpose(0, 1)  # (H, sq, D)
        ks = k[ka:kb].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[ka:kb].transpose(0, 1).repeat_interleave(group, 0)
        scores = (qs @ ks.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        out[qa:qb] = (torch.softmax(scores, -1).nan_to_num(0.0) @ vs).transpose(0, 1)
    return out


def torch_varlen_attn_reference(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
):
    """torch.nn.attention.varlen.varlen_attn as documented: no causal flag, (-1, 0) is causal,
    (W, 0) a causal window; the same bottom-right alignment as flash-attn."""
    assert enable_gqa or query.shape[1] == key.shape[1]
    return flash_attn_varlen_reference(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        softmax_scale=scale,
        window_size=window_size,
    )


VARLEN_CASES = [
    # per-row documents, padding at the end of each row, a query attending nothing
    (
        lambda: (
            flexmask.causal()
            & flexmask.document([[90, 60, 51], [30, 171]])
            & flexmask.padding([190, 201])
        ),
        lambda: np.stack(
            [
                oracle.causal(201, 201)
                & oracle.document([90, 60, 51], 201, 201)
                & oracle.padding(190, 201, 201),
                oracle.causal(201, 201)
                & oracle.document([30, 171], 201, 201)
                & oracle.padding(201, 201, 201),
            ]
        )[:, None],
    ),
    (  # a sliding window inside documents
        lambda: flexmask.causal() & flexmask.sliding_window(17) & flexmask.document([120, 81]),
        lambda: (
            oracle.causal(201, 201)
            & oracle.sliding_window(17, 201, 201)
            & oracle.document([120, 81], 201, 201)
        )[None, None],
    ),
    (  # bidirectional documents (no causal)
        lambda: flexmask.document([33, 100, 68]),
        lambda: oracle.document([33, 100, 68], 201, 201)[None, None],
    ),
]


@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
@pytest.mark.parametrize("kernel", ["flash_attn", "torch"])
def test_varlen_gathers_lowers_and_scatters_exactly(case, kernel, monkeypatch):
    from flexmask.backends import varlen

    if kernel == "flash_attn":
        monkeypatch.setattr(varlen, "flash_attn_varlen_func", lambda: flash_attn_varlen_reference)
    else:
        monkeypatch.setattr(varlen, "flash_attn_varlen_func", lambda: None)
        monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: torch_varlen_attn_reference)
    make_mask, make_dense = VARLEN_CASES[case]
    mask = make_mask()
    gen = torch.Generator().manual_seed(case)
    q = torch.randn(2, 4, 201, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 201, 16, dtype=torch.float64, generator=gen, requires_grad=True)
        for _ in range(2)
    )  # GQA: 2 kv heads for 4 q heads
    call = Request(q, k, v, None, mask, None, None, True, False, False, {})
    out = varlen.attend(varlen.lower(call))
    allowed = torch.from_numpy(np.ascontiguousarray(make_dense()))
    ref = oracle.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), allowed)[0]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def test_varlen_refuses_off_cuda_and_passes_to_varlens_reason_on():
    from flexmask.backends import varlen

    q, k, v = qkv()
    assert varlen.can_take(request(q, k, v, flexmask.causal())) == (
        "varlen_attn and flash-attn run on CUDA only, and this call is on cpu"
    )
    tree = flexmask.tree([-1, 0, 0, 1] + list(range(3, 199)))
    with pytest.raises(ValueError, match=r"backend 'varlen' cannot run this call: .*tree"):
        varlen.lower(request(q, k, v, tree))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_varlen_kernel_matches_flex_on_cuda(case):
    from flexmask.backends import varlen

    mask = VARLEN_CASES[case][0]()
    gen = torch.Generator(device="cuda").manual_seed(case)
    q, k, v = (
        torch.randn(
            2, 4, 201, 64, device="cuda", dtype=torch.bfloat16, generator=gen
        ).requires_grad_(True)
        for _ in range(3)
    )
    assert flexmask.explain(q, k, v, mask, "varlen").backend == varlen.NAME
    out = flexmask.attention(q, k, v, mask, "varlen")
    ref = flexmask.attention(q, k, v, mask, "flex")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
