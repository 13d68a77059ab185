"""Differential fuzz of the CPU attention backends against the float64 reference.

Every backend of ``flexmask.backends.TABLE`` that takes a call on the CPU (``flex`` only
compiled, too slow here; ``varlen`` refuses the CPU itself), ``backend="auto"`` and
``flexmask.flex_attention(..., compile=False)`` must give the reference's output, lse and
gradients (``tests/oracle.py`` says what "give" means where inputs hold NaN or
inf) for every call it takes; block_sparse takes every one. Cases come from
``tests.strategies.case_specs``: masks of every piece and compounds, given as a Mask, a
handle or a BlockMask; q/k/v in every layout; scales, dtypes, grouped heads, non-finite
values at attended and unattended positions, forward and backward.

The CI tests each narrow one axis and keep the others benign, so that a bug in one axis
fails its own test; ``test_every_axis_at_once`` draws them all. The ``slow`` test draws many
more. Shrinking is left out of the CI tests (a failure prints its unshrunk case, which the
derandomized run reproduces); the slow test shrinks.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask import backends
from tests.oracle import differences
from tests.strategies import (
    CONTIGUOUS,
    LAYOUTS,
    MASK_KINDS,
    NON_FINITE,
    PLACES,
    SPECIAL_SCALES,
    AttentionCase,
    CaseSpec,
    Placement,
    build_case,
    case_specs,
)

NOT_FUZZED = ("flex",)
"""Backends of the table not run here: torch's kernel runs only compiled on the CPU
(20-40 s per shape)."""

CI = settings(
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
)
# 150 cases: ~60 s of CI on 2 busy cores (500 took 204 s); more with --hypothesis-seed runs.
SLOW = settings(deadline=None, derandomize=True, database=None, max_examples=150)

BENIGN_SCALES = st.sampled_from((None, 0.5, 2.0))
STRIDED_MORE = st.tuples(*[st.sampled_from((*LAYOUTS, "last_dim_strided"))] * 3)
"""Every layout; a last dim of stride != 1 (which reaches a kernel as it is) twice as often."""
PARTIAL_MORE = st.builds(
    Placement,
    st.sampled_from("qkvv"),
    st.sampled_from(NON_FINITE),
    st.sampled_from((*PLACES, "partial")),
    st.integers(0, 1 << 20),
    st.integers(0, 64),
)
"""A non-finite value; in a value (which reaches an output only through its weight: a
kernel that multiplies a zero weight into it spreads it) and at a position some rows attend
and others not, twice as often."""
BOOLS = st.booleans()
"""enable_gqa as a bool (True wherever the heads differ)."""
FINITE = st.just(())
NO = st.just(False)
"""A mask made for the call's batch and heads (or broadcast over them)."""


def backend_names() -> list[str]:
    """Every name a call is run under: the table's backends, "auto", "flex_attention"."""
    return [name for name in backends.TABLE if name not in NOT_FUZZED] + [
        "auto",
        "flex_attention",
    ]


def _unchanged(before: tuple[torch.Tensor, ...], after: tuple[torch.Tensor, ...]) -> bool:
    """Every entry equal, NaN where it was NaN."""
    return all(
        bool(((a == b) | (a.isnan() & b.isnan())).all()) for a, b in zip(before, after, strict=True)
    )


def check_case(spec: CaseSpec, threads: int | None = 1) -> None:
    """Every backend that takes the call agrees with the reference; block_sparse takes it.

    ``threads``: torch's intra-op threads for the calls (None: as they are). The CI cases
    are small, and their threads would only wait for each other (4-10x the time of one
    thread on a loaded 2-core machine)."""
    if threads is None:
        return _check_case(spec)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_case(spec)
    finally:
        torch.set_num_threads(before)


def _check_case(spec: CaseSpec) -> None:
    case = build_case(spec)
    if not spec.mask_fits:
        return _check_refused(case)
    want = case.reference()
    inputs = tuple(t.detach().contiguous().clone() for t in case.tensors)
    assert case.explain("block_sparse").backend == "block_sparse", (
        f"block_sparse refused {case!r}: {case.explain('block_sparse').refused}"
    )
    failures = []
    for name in backend_names():
        ran = name
        if name != "flex_attention":  # it runs the table's first taker: block_sparse at last
            choice = case.explain(name)
            if not choice.backend:
                continue  # refused: says why, runs nothing
            ran = name if choice.backend == name else f"{name} ({choice.backend})"
        try:
            got = case.call(name)
        except Exception as error:  # a call a backend took must run
            failures.append(f"{ran}: raised {type(error).__name__}: {error}")
            continue
        problems = differences(got, want, *case.tensors, case.dense, spec.scale)
        failures += [f"{ran}: {problem}" for problem in problems]
        if not _unchanged(inputs, tuple(t.detach() for t in case.tensors)):
            failures.append(f"{ran}: changed its inputs")
    assert not failures, "\n".join([repr(case), *failures])


def _check_refused(case: AttentionCase) -> None:
    """A mask made for another batch or other heads: every backend, ``explain`` and
    ``flex_attention`` refuse the call with one ValueError, before any kernel runs."""
    outcomes = {}
    for name in [*backends.TABLE, "auto", "flex_attention", "explain"]:
        try:
            if name == "explain":
                case.explain()
            else:
                case.call(name)
            outcomes[name] = ("ran", "")
        except ValueError as error:
            outcomes[name] = ("ValueError", str(error))
    first = outcomes["auto"]
    assert first[0] == "ValueError", (case, outcomes)
    assert re.search(r"batch|B=|rows", first[1]), first
    assert all(got == first for got in outcomes.values()), (case, outcomes)


# ------------------------------------------------------------------ the CI tests, one per axis

_DOC = flexmask.causal() & flexmask.document([70, 60])
_PADDED_DOC = flexmask.causal() & flexmask.document([30, 40]) & flexmask.padding(60)


@settings(CI, max_examples=120)
@example(CaseSpec(_DOC, 130, 130, layouts=("last_dim_strided", "contiguous", "contiguous")))
@example(CaseSpec(_DOC, 130, 130, layouts=("contiguous", "wide_slice", "last_dim_strided")))
@given(
    case_specs(
        layouts=STRIDED_MORE,
        scales=BENIGN_SCALES,
        placements=FINITE,
        dtypes=st.just(torch.float64),
        gqa_flags=BOOLS,
        other_dims=NO,
    )
)
def test_layouts(spec):
    """q, k and v in every layout: transposed, expanded, last-dim strided, sliced from a
    wider projection, sequence-strided."""
    check_case(spec)


@settings(CI, max_examples=150)
@example(CaseSpec(flexmask.causal(), 40, 40, scale=0.0))
@example(CaseSpec(flexmask.causal(), 40, 40, scale=-1.0, requires_grad=True))
@example(CaseSpec(_DOC, 130, 130, scale=-0.125))
@given(
    case_specs(
        scales=st.sampled_from(SPECIAL_SCALES),
        layouts=st.just(CONTIGUOUS),
        gqa_flags=BOOLS,
        other_dims=NO,
        placements=FINITE,
        # Plain causal and no lse half the time: the backends' SDPA is_causal path.
        mask_kinds=st.sampled_from((*MASK_KINDS, *["causal"] * len(MASK_KINDS))),
        return_lse=st.sampled_from((False, False, True)),
    )
)
def test_scales(spec):
    """scale None, 0, negative, tiny, large."""
    check_case(spec)


@settings(CI, max_examples=150)
@example(CaseSpec(_PADDED_DOC, 70, 70, placements=(Placement("k", math.nan, "unattended"),)))
@example(CaseSpec(_DOC, 130, 130, placements=(Placement("v", math.nan, "partial", 75),)))
@example(
    CaseSpec(
        _DOC,
        130,
        130,
        placements=(Placement("v", math.inf, "partial", 75),),
        requires_grad=True,
    )
)
@given(
    case_specs(
        scales=BENIGN_SCALES,
        layouts=st.just(CONTIGUOUS),
        gqa_flags=BOOLS,
        other_dims=NO,
        placements=st.lists(PARTIAL_MORE, min_size=1, max_size=2).map(tuple),
    )
)
def test_non_finite_values(spec):
    """NaN, +inf and -inf in q, k or v: at positions no query attends (nothing else may
    change), attended by some rows only (only those rows' results may change), attended."""
    check_case(spec)


@settings(CI, max_examples=60)
@given(
    case_specs(
        scales=BENIGN_SCALES,
        layouts=st.just(CONTIGUOUS),
        gqa_flags=BOOLS,
        other_dims=NO,
        placements=FINITE,
        requires_grad=st.just(True),
    )
)
def test_gradients(spec):
    """Gradients of q, k and v against the reference's autograd gradients."""
    check_case(spec)


_TWO_ROWS = flexmask.causal() & flexmask.document([[100, 156], [256]])


@settings(CI, max_examples=60)
@example(CaseSpec(_TWO_ROWS, 256, 256, batch=3, kv_heads=2, form="lazy", mask_batch=2))
@example(CaseSpec(_TWO_ROWS, 256, 256, batch=3, kv_heads=2, form="block_mask", mask_batch=2))
@example(CaseSpec(flexmask.causal(), 64, 64, batch=2, form="lazy", mask_batch=3))
@example(CaseSpec(flexmask.causal(), 64, 64, kv_heads=2, form="block_mask", mask_heads=3))
@example(CaseSpec(_TWO_ROWS, 256, 256, batch=1, form="lazy", mask_batch=2))
@given(
    case_specs(
        scales=BENIGN_SCALES,
        layouts=st.just(CONTIGUOUS),
        placements=FINITE,
        other_dims=st.just(True),
    )
)
def test_mask_dims(spec):
    """Masks made for a batch and heads of their own: per-row data of 1-3 rows, handles and
    BlockMasks of B and H 1, the query's or another. Where each is 1 or the query's the call
    gives the reference (broadcast); otherwise every backend refuses it alike (the slices
    backend once ran a mask of 2 rows under 3 query rows, row 2 with row 1's documents)."""
    check_case(spec)


@settings(CI, max_examples=120)
@given(case_specs())
def test_every_axis_at_once(spec):
    """Every axis drawn together (enable_gqa as any truthy value too)."""
    check_case(spec)


@pytest.mark.slow
@SLOW
@given(case_specs())
def test_every_axis_at_once_many(spec):
    """Many more cases, on torch's threads as they are (the block-sparse path's workers)."""
    check_case(spec, threads=None)
