"""One call contract for every backend: the same calls are valid with the same messages
whichever backend runs them, every backend that takes a valid call gives the reference's
answer (layouts, scales, non-finite values, empty sizes), one keyword set across the three
entry points, and ``explain`` names the kernel that runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask import backends
from flexmask.backends import slices
from flexmask.backends.block_sparse import api as block_sparse_api
from tests import oracle
from tests.strategies import build_case, case_specs

S = 200
CPU_BACKENDS = [name for name in backends.TABLE if name not in ("flex", "varlen")]
MASKS = {
    "causal": flexmask.causal(),
    "document-causal": flexmask.causal() & flexmask.document([70, 50, 80]),
    "padding-causal": flexmask.causal() & flexmask.padding(150),
    "window": flexmask.causal() & flexmask.sliding_window(40),
    "none": None,
}


def qkv(b=2, h=2, q_len=S, kv_len=S, d=16, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, q_len, d), (b, h, kv_len, d), (b, h, kv_len, d)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes]


def dense_of(mask, b, h, q_len, kv_len):
    if mask is None:
        return torch.ones(1, 1, q_len, kv_len, dtype=torch.bool)
    return mask.to_dense(b, h, q_len, kv_len)


def taking(q, k, v, mask, **kwargs):
    """The CPU backends that take this call (explain's answer, named one by one)."""
    return [
        name
        for name in CPU_BACKENDS
        if flexmask.explain(q, k, v, mask, backend=name, **kwargs).backend
    ]


def run_all(q, k, v, mask, **kwargs):
    """Each taking backend's output, and auto's and flex_attention's."""
    names = taking(q, k, v, mask, **kwargs)
    assert "block_sparse" in names  # it takes every CPU call
    outs = {name: flexmask.attention(q, k, v, mask, name, **kwargs) for name in names}
    outs["auto"] = flexmask.attention(q, k, v, mask, **kwargs)
    outs["flex_attention"] = flexmask.flex_attention(q, k, v, mask, compile=False, **kwargs)
    return outs


# --- one answer: bugs 1-3 of issue #29, each through every backend that takes the call -----


def last_dim_strided(x):
    """``x``'s values in a tensor whose last dimension has stride 2 (a slice of a wider one)."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x.detach()
    view = wide[..., ::2]
    assert view.stride(-1) == 2
    return view.requires_grad_(x.requires_grad) if x.requires_grad else view


@pytest.mark.parametrize("which", ["query", "key", "value", "all"])
@pytest.mark.parametrize("mask", ["causal", "document-causal", "window", "none"])
def test_last_dim_strided_inputs_give_the_contiguous_answer(which, mask):
    q, k, v = qkv()
    given = [
        last_dim_strided(t) if which in (name, "all") else t
        for name, t in zip(("query", "key", "value"), (q, k, v), strict=True)
    ]
    want, _ = oracle.attention(q, k, v, dense_of(MASKS[mask], 2, 2, S, S))
    for name, out in run_all(*given, MASKS[mask]).items():
        torch.testing.assert_close(
            out.double(), want, atol=2e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("scale", [0.0, -0.0, -0.7, -3.0, 1e-4, 30.0])
@pytest.mark.parametrize("mask", ["causal", "document-causal", "window", "none"])
def test_any_finite_scale_gives_the_reference(scale, mask):
    q, k, v = qkv(grad=True)
    dense = dense_of(MASKS[mask], 2, 2, S, S)
    want, _ = oracle.attention(q, k, v, dense, scale)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * grad_out).sum(), (q, k, v))
    atol = 2e-5 * (1 + abs(scale) * 4)  # float32 scores of size |scale| x |q| x |k|
    for name in taking(q, k, v, MASKS[mask], scale=scale):
        out = flexmask.attention(q, k, v, MASKS[mask], name, scale=scale)
        assert torch.isfinite(out).all(), name
        torch.testing.assert_close(
            out.double(), want, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )
        grads = torch.autograd.grad((out * grad_out.float()).sum(), (q, k, v))
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(
                got.double(),
                expected.double(),
                atol=20 * atol,
                rtol=0,
                msg=lambda m, name=name: f"{name}: {m}",
            )


NONFINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("value", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["key", "value", "query", "all"])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_garbage_in_padding_reaches_no_output_and_no_gradient(value, where, grad):
    """padding(150): keys 150.. are attended by no query and queries 150.. attend nothing;
    garbage there changes nothing, forward or backward, on any backend."""
    mask = MASKS["padding-causal"]
    q, k, v = qkv(grad=True)
    dense = dense_of(mask, 2, 2, S, S)
    want, _ = oracle.attention(q, k, v, dense)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * grad_out).sum(), (q, k, v))
    dirty = [t.detach().clone() for t in (q, k, v)]
    for name, t in zip(("query", "key", "value"), dirty, strict=True):
        if where in (name, "all"):
            t[:, :, 150:] = value
    for t in dirty:
        t.requires_grad_(grad)
    for name in taking(*dirty, mask):
        out = flexmask.attention(*dirty, mask, name)
        torch.testing.assert_close(
            out.double(), want, atol=2e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )
        if grad:
            grads = torch.autograd.grad((out * grad_out.float()).sum(), dirty)
            for got, expected in zip(grads, want_grads, strict=True):
                torch.testing.assert_close(
                    got.double(),
                    expected.double(),
                    atol=1e-4,
                    rtol=0,
                    msg=lambda m, name=name: f"{name}: {m}",
                )


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_a_nan_value_reaches_only_the_rows_that_attend_it(grad):
    """A NaN in value 100 (document 2 of causal documents 70, 50, 80): rows 100..119 read it
    (their output is NaN), rows 70..99 of the same document do not (theirs is exact)."""
    mask = MASKS["document-causal"]
    q, k, v = qkv()
    dense = dense_of(mask, 2, 2, S, S)
    want, _ = oracle.attention(q, k, v, dense)
    v = v.clone()
    v[:, :, 100] = float("nan")
    for t in (q, k, v):
        t.requires_grad_(grad)
    for name in taking(q, k, v, mask):
        out = flexmask.attention(q, k, v, mask, name)
        nan_rows = out.isnan().any(-1).any(0).any(0).nonzero().flatten().tolist()
        assert nan_rows == list(range(100, 120)), name
        clean = torch.ones(S, dtype=torch.bool)
        clean[100:120] = False
        torch.testing.assert_close(
            out[:, :, clean].double(), want[:, :, clean], atol=2e-5, rtol=0, msg=name
        )


# --- one validity: the same calls accepted and refused, with the same messages --------------


def _outcome(call):
    try:
        return ("ok", call())
    except (TypeError, ValueError) as err:
        return (type(err).__name__, str(err))


BAD_CALLS = {
    "scale str": ((), {"scale": "x"}),
    "scale nan": ((), {"scale": float("nan")}),
    "scale inf": ((), {"scale": float("inf")}),
    "scale bool": ((), {"scale": True}),
    "score_mod not callable": ((), {"score_mod": 3}),
    "typo keyword": ((), {"treads": 2}),
    "attn_mask keyword": ((), {"attn_mask": torch.ones(S, S, dtype=torch.bool)}),
    "both mask keywords": ((), {"block_mask": flexmask.causal()}),
    "key dtype": (("key", torch.float64), {}),
    "key 3-D": (("key", "3d"), {}),
    "value heads": (("value", "heads"), {}),
    "query int": (("query", torch.int64), {}),
    "gqa without flag": (("query", "gqa"), {}),
    "gqa not a multiple": (("query", "gqa3"), {"enable_gqa": True}),
    "key no heads": (("key", "noheads"), {}),
}


def _bad_call(case):
    (change, kwargs) = BAD_CALLS[case]
    q, k, v = qkv(b=1)
    tensors = {"query": q, "key": k, "value": v}
    if change:
        name, how = change
        t = tensors[name]
        if isinstance(how, torch.dtype):
            tensors[name] = t.to(how)
        elif how == "3d":
            tensors[name] = t[0]
        elif how == "heads":
            tensors[name] = t[:, :1]
        elif how == "gqa":
            tensors[name] = torch.cat([t, t], 1)
        elif how == "gqa3":
            tensors[name] = torch.cat([t, t, t], 1)[:, :3]
            tensors["key"], tensors["value"] = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
        elif how == "noheads":
            tensors["key"], tensors["value"] = k[:, :0], v[:, :0]
    mask = flexmask.causal()
    if "block_mask" in kwargs:
        mask = flexmask.causal()
    return tensors["query"], tensors["key"], tensors["value"], mask, kwargs


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_every_backend_refuses_a_bad_call_with_the_same_message(case):
    q, k, v, mask, kwargs = _bad_call(case)
    outcomes = {
        name: _outcome(lambda name=name: flexmask.attention(q, k, v, mask, name, **kwargs))
        for name in backends.TABLE
    }
    outcomes["auto"] = _outcome(lambda: flexmask.attention(q, k, v, mask, **kwargs))
    outcomes["explain"] = _outcome(lambda: flexmask.explain(q, k, v, mask, **kwargs))
    outcomes["flex_attention"] = _outcome(
        lambda: flexmask.flex_attention(q, k, v, mask=mask, **kwargs)
    )
    first = outcomes["auto"]
    assert first[0] in ("TypeError", "ValueError"), first
    assert all(got == first for got in outcomes.values()), outcomes


def test_the_refusals_name_the_argument_and_what_is_right():
    q, k, v = qkv(b=1)
    mask = flexmask.causal()
    with pytest.raises(TypeError, match=r"scale must be a float or None .* got 'x' \(str\)"):
        flexmask.attention(q, k, v, mask, scale="x")
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        flexmask.attention(q, k, v, mask, scale=float("nan"))
    with pytest.raises(TypeError, match="'treads': did you mean 'threads'"):
        flexmask.attention(q, k, v, mask, treads=2)
    with pytest.raises(TypeError, match=r"'attn_mask': pass the mask as block_mask="):
        flexmask.flex_attention(q, k, v, attn_mask=mask)
    with pytest.raises(TypeError, match="both block_mask= and mask="):
        flexmask.attention(q, k, v, mask, block_mask=mask)


_TWO_ROWS = flexmask.causal() & flexmask.document([[100, 156], [256]])
OTHER_DIMS = {
    # The issue's repro: a handle of 2 rows under 3 query rows ran on slices (row 2 got
    # row 1's documents); the other way round was a bare KeyError.
    "handle of 2 rows, query of 3": (lambda: flexmask.lazy(_TWO_ROWS, 2, 2, 256, 256), 3, 2),
    "handle of 3 rows, query of 2": (
        lambda: flexmask.lazy(flexmask.causal() & flexmask.padding([256, 200, 100]), 3, 2, 256),
        2,
        2,
    ),
    "handle of 3 heads, query of 2": (
        lambda: flexmask.lazy(
            flexmask.per_head(flexmask.causal(), flexmask.full(), flexmask.causal()), 1, 3, 256
        ),
        1,
        2,
    ),
    "BlockMask of 2 rows, query of 3": (
        lambda: flexmask.create_block_mask(_TWO_ROWS, 2, 2, 256, 256, "cpu"),
        3,
        2,
    ),
    "BlockMask of 3 heads, query of 2": (
        lambda: flexmask.create_block_mask(flexmask.causal(), 1, 3, 256, 256, "cpu"),
        1,
        2,
    ),
    "torch's BlockMask of 2 rows, query of 3": (
        lambda: torch.nn.attention.flex_attention.create_block_mask(
            lambda b, h, q, kv: q >= kv, 2, 1, 256, 256, "cpu"
        ),
        3,
        2,
    ),
    "Mask of 2 rows, query of 3": (lambda: _TWO_ROWS, 3, 2),
    "per-row handle of B=1, query of 3": (
        lambda: flexmask.lazy(flexmask.causal() & flexmask.document([[100, 156]]), 1, 1, 256, 256),
        3,
        2,
    ),
}


@pytest.mark.parametrize("case", sorted(OTHER_DIMS))
def test_every_backend_refuses_a_mask_of_another_batch_or_heads(case):
    """A mask made for other B or H than the query's (each must be 1 or the query's, as
    torch's flex_attention checks; per-row data exactly the query's rows): refused by every
    backend, explain and flex_attention with one ValueError, not run with another row's
    mask nor failed with a bare KeyError."""
    make, batch, heads = OTHER_DIMS[case]
    q, k, v = qkv(b=batch, h=heads, q_len=256, kv_len=256)
    mask = make()
    outcomes = {
        name: _outcome(lambda name=name: flexmask.attention(q, k, v, mask, name))
        for name in backends.TABLE
    }
    outcomes["auto"] = _outcome(lambda: flexmask.attention(q, k, v, mask))
    outcomes["explain"] = _outcome(lambda: flexmask.explain(q, k, v, mask))
    outcomes["flex_attention"] = _outcome(lambda: flexmask.flex_attention(q, k, v, mask))
    first = outcomes["auto"]
    assert first[0] == "ValueError" and f"B={batch}" in first[1], first
    assert all(got == first for got in outcomes.values()), outcomes


@pytest.mark.parametrize("given", ["handle", "BlockMask", "handle of other B and H"])
def test_a_mask_of_one_row_and_head_serves_every_row_and_head(given):
    """B = 1 and H = 1 broadcast, as torch's: every taking backend gives the reference of
    the mask repeated over the query's rows and heads. A handle of a mask that ignores the
    row and head builds B = H = 1 whatever its recipe says, and serves any query."""
    mask = MASKS["document-causal"]
    make = flexmask.create_block_mask if given == "BlockMask" else flexmask.lazy
    dims = (5, 7) if given == "handle of other B and H" else (1, 1)
    passed = make(mask, *dims, S, S, "cpu")
    q, k, v = qkv(b=3, h=2)
    want, _ = oracle.attention(q, k, v, dense_of(mask, 1, 1, S, S).expand(3, 2, S, S))
    names = taking(q, k, v, passed)
    assert {"block_sparse", "slices"} <= set(names), names
    for name in names:
        torch.testing.assert_close(
            flexmask.attention(q, k, v, passed, name).double(), want, atol=2e-5, rtol=0, msg=name
        )


GOOD_CALLS = {
    "enable_gqa=1": ({}, {"enable_gqa": 1}),
    "enable_gqa='yes' with GQA": ({"gqa": 2}, {"enable_gqa": "yes"}),
    "scale numpy": ({}, {"scale": np.float32(0.25)}),
    "scale int": ({}, {"scale": 2}),
    "scale 0-d tensor": ({}, {"scale": torch.tensor(0.5)}),
    "return_lse=1": ({}, {"return_lse": 1}),
}


@pytest.mark.parametrize("case", sorted(GOOD_CALLS))
def test_every_backend_takes_torchs_valid_calls_with_the_same_result(case):
    shape, kwargs = GOOD_CALLS[case]
    q, k, v = qkv()
    if "gqa" in shape:
        q = torch.cat([q, q], 1)
    mask = MASKS["document-causal"]
    group = q.size(1) // k.size(1)
    scale = kwargs.get("scale")
    scale = float(scale) if scale is not None else None
    want, want_lse = oracle.attention(q, k, v, dense_of(mask, 2, q.size(1), S, S), scale, group > 1)
    for name in taking(q, k, v, mask, **kwargs):
        out = flexmask.attention(q, k, v, mask, name, **kwargs)
        if kwargs.get("return_lse"):
            out, lse = out
            torch.testing.assert_close(
                lse.double(), want_lse, atol=2e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
            )
        torch.testing.assert_close(
            out.double(), want, atol=2e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize(
    "sizes", [(0, 2, S, S), (2, 0, S, S), (2, 2, 0, S), (2, 2, S, 0), (0, 0, 0, 0)]
)
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_empty_sizes_give_what_torch_gives(sizes, mask):
    """B, H or Q_LEN of 0: an empty output (torch's flex_attention gives one for B and Q_LEN;
    it divides by H). KV_LEN of 0: no query has a key, so 0 and lse -inf. Gradients are 0."""
    b, h, q_len, kv_len = sizes
    q, k, v = qkv(b, h, q_len, kv_len, grad=True)
    for name in [*CPU_BACKENDS, "auto"]:
        if (
            name != "auto"
            and not flexmask.explain(q, k, v, MASKS[mask], backend=name, return_lse=True).backend
        ):
            continue
        out, lse = flexmask.attention(q, k, v, MASKS[mask], name, return_lse=True)
        assert out.shape == (b, h, q_len, 16) and lse.shape == (b, h, q_len), name
        assert bool((out == 0).all()) and bool((lse == float("-inf")).all()), name
        out.sum().backward()
        assert all(t.grad is not None and bool((t.grad == 0).all()) for t in (q, k, v)), name
        for t in (q, k, v):
            t.grad = None
    if q_len and b and h == 2:
        assert "none: the output is empty" in flexmask.explain(q, k, v, MASKS[mask]).kernel


# --- one keyword set ------------------------------------------------------------------------


def test_block_mask_and_mask_name_the_same_argument_everywhere():
    q, k, v = qkv()
    mask = MASKS["document-causal"]
    built = flexmask.create_block_mask(mask, 1, 1, S, S, "cpu")
    want = flexmask.attention(q, k, v, mask)
    with torch.no_grad():
        for given in (mask, built, flexmask.lazy(mask, 1, 1, S, S, "cpu")):
            for out in (
                flexmask.attention(q, k, v, block_mask=given),
                flexmask.attention(q, k, v, mask=given),
                flexmask.flex_attention(q, k, v, block_mask=given, compile=False),
                flexmask.flex_attention(q, k, v, mask=given, compile=False),
            ):
                torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
            assert (
                flexmask.explain(q, k, v, block_mask=given).backend
                == flexmask.explain(q, k, v, mask=given).backend
            )


# --- explain is the truth: the kernel it names is the one that runs ---------------------------


class Spy:
    """Records which kernels a call reaches, by wrapping each at the name its caller reads."""

    def __init__(self, monkeypatch):
        self.ran: list[str] = []
        flash = slices._flash_ops()
        assert flash is not None
        forward, backward = flash

        def flash_forward(*args, **kwargs):
            self.ran.append("flash")
            return forward(*args, **kwargs)

        monkeypatch.setattr(slices, "_flash_ops", lambda: (flash_forward, backward))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy_sdpa(*args, **kwargs):
            self.ran.append("sdpa_causal" if kwargs.get("is_causal") else "sdpa_dense")
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
        for name, label in (("grouped_attention", "grouped"), ("chunked_attention", "score_mod")):
            original = getattr(block_sparse_api, name)

            def spy(*args, _original=original, _label=label, **kwargs):
                self.ran.append(_label)
                return _original(*args, **kwargs)

            monkeypatch.setattr(block_sparse_api, name, spy)
        if "decode" in backends.TABLE:
            monkeypatch.setattr(backends.TABLE["decode"], "_flash_op", lambda: flash_forward)


KERNEL_WORDS = {
    "flash kernel": "flash",
    "is_causal=True": "sdpa_causal",
    "dense bool mask": "sdpa_dense",
    "grouped block-sparse": "grouped",
    "score_mod kernel": "score_mod",
}


def expected_kernel(words: str) -> str:
    found = [label for phrase, label in KERNEL_WORDS.items() if phrase in words]
    assert len(found) == 1, words
    return found[0]


EXPLAIN_CASES = [
    (mask_name, backend, grad, extra)
    for mask_name in MASKS
    for backend in ["auto", *CPU_BACKENDS]
    for grad in (False, True)
    for extra in ("", "lse", "score_mod")
]


@pytest.mark.parametrize("mask_name, backend, grad, extra", EXPLAIN_CASES)
def test_explain_names_the_kernel_that_runs(monkeypatch, mask_name, backend, grad, extra):
    q, k, v = qkv(grad=grad)
    mask = MASKS[mask_name]
    kwargs = {}
    if extra == "lse":
        kwargs["return_lse"] = True
    elif extra == "score_mod":
        kwargs["score_mod"] = lambda score, b, h, q_idx, kv_idx: score * 0.5
    choice = flexmask.explain(q, k, v, mask, backend=backend, **kwargs)
    if not choice.backend:
        return
    spy = Spy(monkeypatch)
    flexmask.attention(q, k, v, mask, backend, **kwargs)
    assert spy.ran, choice
    assert set(spy.ran) == {expected_kernel(choice.kernel)}, (choice, spy.ran)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case_specs(other_dims=st.just(False)))
def test_explain_names_the_kernel_that_runs_on_every_fuzz_case(monkeypatch, spec):
    """For the differential fuzz's cases (tests/test_attention_fuzz.py): every backend that
    takes the call runs the kernel ``explain`` names for it, and nothing else."""
    case = build_case(spec)
    for name in ["auto", *CPU_BACKENDS]:
        choice = case.explain(name)
        if not choice.backend:
            continue
        with monkeypatch.context() as patched:
            spy = Spy(patched)
            case.call(name)
        if choice.kernel.startswith("none"):
            assert not spy.ran, (name, choice, spy.ran)
        else:
            assert set(spy.ran) == {expected_kernel(choice.kernel)}, (name, choice, spy.ran)


# --- one validation: a call's mask is checked once, whichever backend runs -------------------


def count_checks(monkeypatch, mask):
    """The number of times ``mask`` itself is checked (``check``, which ``validate`` calls and
    any lowering that validates calls): the top-level node, whatever reaches it."""
    calls = []
    original = type(mask).check

    def counted(self, extent):
        if self is mask:
            calls.append(extent)
        return original(self, extent)

    monkeypatch.setattr(type(mask), "check", counted)
    return calls


@pytest.mark.parametrize("backend", ["slices", "block_sparse", "sdpa", "decode", "auto"])
@pytest.mark.parametrize("given", ["handle", "mask"])
def test_a_call_checks_its_mask_once_on_every_backend(monkeypatch, backend, given):
    """A handle is validated when made and never again by a forward and backward through any
    CPU backend; a Mask given to the call is validated once by the call (the slices backend's
    lowering used to check it a second time)."""
    mask = flexmask.causal() & flexmask.document([70, 50, 80])
    q_len = 4 if backend == "decode" else S
    grad = backend != "decode"
    q, k, v = qkv(q_len=q_len, grad=grad)
    flexmask.cache_clear()  # no lowering kept from another test hides a check
    calls = count_checks(monkeypatch, mask)
    passed = flexmask.lazy(mask, 2, 2, q_len, S, "cpu") if given == "handle" else mask
    assert len(calls) == (1 if given == "handle" else 0)
    calls.clear()
    if backend != "auto":
        assert flexmask.explain(q, k, v, passed, backend=backend).backend == backend
    for _ in range(2):
        out = flexmask.attention(q, k, v, passed, backend)
        if grad:
            out.sum().backward()
    # A handle: none; a Mask: one per call (explain's included), none by any backend.
    calls_made = 2 + (backend != "auto")
    assert len(calls) == (0 if given == "handle" else calls_made), calls
