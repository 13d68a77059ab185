"""torch 2.13's create_block_mask keywords, BlockMask's pytree and torch.export.

Every keyword the installed torch's ``create_block_mask`` takes is taken by flexmask's, and
the result is compared, whole tensors (``dq_write_order`` included), with torch's own build:
of the mask's mask_mod, and of a lookup into the dense oracle (tests/oracle.py).
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.builders import torch_flags
from tests import oracle
from tests.strategies import expressions, interval_intersections

SIGNATURE = inspect.signature(torch_create_block_mask).parameters
HAS_213_FLAGS = {"separate_full_blocks", "compute_dq_write_order", "dq_kv_order"} <= set(SIGNATURE)
needs_213 = pytest.mark.skipif(not HAS_213_FLAGS, reason="torch < 2.13 has no such keywords")

BLOCKS = st.sampled_from([16, 32, 64, 128, (16, 32), (64, 16)])
FLAGS = st.fixed_dictionaries(
    {
        "separate_full_blocks": st.booleans(),
        "compute_dq_write_order": st.booleans(),
        "dq_kv_order": st.booleans(),
    }
)
TENSORS = (
    *oracle.BLOCK_FIELDS,
    "dq_write_order",
    "dq_write_order_full",
    "dq_kv_order",
)


def assert_same(ours: BlockMask, theirs: BlockMask, context: str = "") -> None:
    """Every tensor torch writes equal as a whole (None where torch's is None), contiguous,
    and the same lengths, block sizes and scheduler order flag."""
    assert ours.seq_lengths == theirs.seq_lengths, context
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE), context
    assert getattr(ours, "dq_kv_order_spt", None) == getattr(theirs, "dq_kv_order_spt", None)
    for name in TENSORS:
        a, b = getattr(ours, name, None), getattr(theirs, name, None)
        assert (a is None) == (b is None), f"{context} {name}: {a is None} vs {b is None}"
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{context} {name}"
        assert torch.equal(a, b), f"{context} {name} differs:\n{a}\n!=\n{b}"
        assert a.is_contiguous(), f"{context} {name}: not contiguous"


@needs_213
@settings(max_examples=30)
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    q_len=st.integers(1, 300),
    kv_len=st.integers(1, 300),
    block=BLOCKS,
    flags=FLAGS,
)
def test_flags_on_random_expressions_equal_torch(data, batch, heads, q_len, kv_len, block, flags):
    mask, dense = data.draw(expressions(batch, heads, max(q_len, kv_len)))
    ours = flexmask.create_block_mask(
        mask, batch, heads, q_len, kv_len, "cpu", BLOCK_SIZE=block, **flags
    )
    theirs = torch_create_block_mask(
        mask.mask_mod, batch, heads, q_len, kv_len, "cpu", BLOCK_SIZE=block, **flags
    )
    assert_same(ours, theirs, f"{mask!r} {flags}")
    reference = oracle.torch_build(dense(q_len, kv_len), None, None, q_len, kv_len, block, **flags)
    assert_same(ours, reference, f"{mask!r} {flags} (dense oracle)")


@needs_213
@settings(max_examples=30)
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    q_len=st.integers(1, 400),
    kv_len=st.integers(1, 400),
    block=BLOCKS,
    flags=FLAGS,
)
def test_flags_on_the_closed_form_equal_torch(data, batch, q_len, kv_len, block, flags):
    mask, dense = data.draw(interval_intersections(batch, max(q_len, kv_len)))
    ours = flexmask.create_block_mask(
        mask, batch, 2, q_len, kv_len, "cpu", BLOCK_SIZE=block, **flags
    )
    heads = np.repeat(dense(q_len, kv_len)[:, None], 2, axis=1)
    theirs = oracle.torch_build(heads, None, None, q_len, kv_len, block, **flags)
    assert_same(ours, theirs, f"{mask!r} {flags}")


@needs_213
@pytest.mark.parametrize("separate_full_blocks", [True, False])
@pytest.mark.parametrize("dq_kv_order", [True, False])
@pytest.mark.parametrize(
    ("batch", "heads", "q_len", "kv_len"),
    [(0, 2, 300, 300), (2, 0, 300, 300), (2, 3, 0, 300), (2, 3, 300, 0), (2, 3, 1, 1)],
)
def test_flags_at_edges_equal_torch(separate_full_blocks, dq_kv_order, batch, heads, q_len, kv_len):
    flags = {
        "separate_full_blocks": separate_full_blocks,
        "compute_dq_write_order": True,
        "dq_kv_order": dq_kv_order,
    }
    for mask in (flexmask.causal(), flexmask.causal() | flexmask.prefix(70)):
        ours = flexmask.create_block_mask(
            mask, batch, heads, q_len, kv_len, "cpu", BLOCK_SIZE=64, **flags
        )
        theirs = torch_create_block_mask(
            _causal_or_prefix if "prefix" in repr(mask) else _causal,
            batch,
            heads,
            q_len,
            kv_len,
            "cpu",
            BLOCK_SIZE=64,
            **flags,
        )
        assert_same(ours, theirs, f"{mask!r} B={batch} H={heads} {q_len}x{kv_len} {flags}")


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _causal_or_prefix(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < 70)


def test_every_torch_keyword_is_taken_at_its_default():
    # Whatever the installed torch's create_block_mask takes beyond the shape arguments,
    # ours takes by keyword, and at torch's default builds what torch builds.
    mask = flexmask.causal() & flexmask.document([100, 156])
    extra = {
        name: p.default
        for name, p in SIGNATURE.items()
        if name not in ("mask_mod", "B", "H", "Q_LEN", "KV_LEN", "device", "BLOCK_SIZE")
    }
    ours = flexmask.create_block_mask(mask, 2, 2, 256, 256, "cpu", BLOCK_SIZE=64, **extra)
    theirs = torch_create_block_mask(mask.mask_mod, 2, 2, 256, 256, "cpu", BLOCK_SIZE=64, **extra)
    assert_same(ours, theirs)


@pytest.mark.parametrize("mask", [flexmask.causal(), _causal], ids=["Mask", "mask_mod"])
def test_an_unknown_keyword_raises_torchs_type_error(mask):
    with pytest.raises(TypeError) as theirs:
        torch_create_block_mask(_causal, 1, 1, 64, 64, "cpu", no_such_flag=True)
    with pytest.raises(TypeError) as ours:
        flexmask.create_block_mask(mask, 1, 1, 64, 64, "cpu", no_such_flag=True)
    assert str(ours.value) == str(theirs.value)


@needs_213
@pytest.mark.parametrize("mask", [flexmask.causal(), _causal], ids=["Mask", "mask_mod"])
def test_a_non_bool_dq_kv_order_raises_torchs_value_error(mask):
    with pytest.raises(ValueError, match="dq_kv_order must be a bool"):
        torch_create_block_mask(_causal, 1, 1, 64, 64, "cpu", dq_kv_order=torch.arange(1))
    with pytest.raises(ValueError, match="dq_kv_order must be a bool"):
        flexmask.create_block_mask(mask, 1, 1, 64, 64, "cpu", dq_kv_order=torch.arange(1))


FLAG_VALUES = [True, False, 0, 1, "no", "", None]


def _build_warned(build, flags):
    """``build(**flags)``'s BlockMask (or the exception it raised) and whether it warned
    that ``_compile`` is deprecated."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = build(**flags)
        except (TypeError, ValueError) as err:
            out = err
    return out, any("_compile" in str(w.message) for w in caught)


@pytest.mark.parametrize("value", FLAG_VALUES, ids=repr)
@pytest.mark.parametrize(
    "flags",
    [{name: None} for name in torch_flags.TORCH_FLAGS]
    + ([{"compute_dq_write_order": True, "dq_kv_order": None}] if HAS_213_FLAGS else []),
    ids=lambda flags: "+".join(flags),
)
@pytest.mark.parametrize("form", ["Mask", "mask_mod"])
def test_every_flag_takes_what_torch_takes(form, flags, value, monkeypatch):
    # Issue #29: compute_dq_write_order=1 was taken but separate_full_blocks="no" refused,
    # while torch tests both with `if flag:`. Every keyword at every value: torch's build
    # (or its refusal) and the same deprecation warning. _compile=True makes torch compile
    # its own create_block_mask: torch.compile is the identity here, so torch builds as it
    # would compiled, without the compile.
    monkeypatch.setattr(torch, "compile", lambda fn, *args, **kwargs: fn)
    flags = {name: value if given is None else given for name, given in flags.items()}
    mask = flexmask.causal() & flexmask.document([[90, 100, 60], [250]])
    ours_mask = mask if form == "Mask" else mask.mask_mod

    def ours_build(**kw):
        return flexmask.create_block_mask(ours_mask, 2, 2, 250, 250, "cpu", 64, **kw)

    def theirs_build(**kw):
        return torch_create_block_mask(mask.mask_mod, 2, 2, 250, 250, "cpu", 64, **kw)

    theirs, theirs_warned = _build_warned(theirs_build, flags)
    ours, ours_warned = _build_warned(ours_build, flags)
    assert ours_warned == theirs_warned, flags
    if isinstance(theirs, Exception):
        assert type(ours) is type(theirs), f"{flags}: torch raised {theirs!r}, ours {ours!r}"
        assert all(name in str(ours) for name in flags if name != "compute_dq_write_order")
        return
    assert isinstance(ours, BlockMask), f"{flags}: torch built, ours raised {ours!r}"
    assert_same(ours, theirs, repr(flags))


@needs_213
@pytest.mark.parametrize("name", ["separate_full_blocks", "compute_dq_write_order", "_compile"])
def test_a_flag_with_no_truth_value_names_itself(name):
    # torch's `if flag:` fails on a tensor of several values; ours says which flag.
    with pytest.raises(TypeError, match=rf"{name}=tensor\(\[0, 1\]\) has no truth value"):
        flexmask.create_block_mask(flexmask.causal(), 1, 1, 64, 64, **{name: torch.arange(2)})


def test_a_torch_keyword_flexmask_does_not_build_is_refused_off_its_default(monkeypatch):
    # A later torch may add a keyword flexmask does not know: at its default it is torch's
    # usual build; any other value raises rather than being silently ignored.
    monkeypatch.setitem(torch_flags.TORCH_FLAGS, "future_flag", None)
    mask = flexmask.causal()
    ours = flexmask.create_block_mask(mask, 1, 1, 128, 128, "cpu", future_flag=None)
    assert_same(ours, torch_create_block_mask(_causal, 1, 1, 128, 128, "cpu"))
    with pytest.raises(TypeError, match=r"future_flag=3: flexmask does not build"):
        flexmask.create_block_mask(mask, 1, 1, 128, 128, "cpu", future_flag=3)


@pytest.mark.skipif("_compile" not in SIGNATURE, reason="this torch has no _compile keyword")
def test_compile_is_ignored_with_a_deprecation_warning():
    mask = flexmask.causal() & flexmask.sliding_window(100)
    with pytest.warns(DeprecationWarning, match="_compile"):
        ours = flexmask.create_block_mask(mask, 1, 1, 256, 256, "cpu", _compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flexmask.create_block_mask(mask, 1, 1, 256, 256, "cpu", _compile=False)
    assert_same(ours, torch_create_block_mask(mask.mask_mod, 1, 1, 256, 256, "cpu"))


# --- pytree ----------------------------------------------------------------------------


@pytest.fixture
def block_mask_pytree():
    """BlockMask as a pytree node, registered as torch's own export tests do (torch keeps it
    a leaf by default, pytorch#166434), and unregistered afterwards."""
    if BlockMask in pytree.SUPPORTED_NODES:
        yield
        return
    pytree.register_pytree_node(
        BlockMask,
        BlockMask._flatten,
        BlockMask._unflatten,
        flatten_with_keys_fn=BlockMask._flatten_with_keys,
        serialized_type_name="torch.nn.attention.flex_attention.BlockMask",
    )
    try:
        yield
    finally:
        pytree._deregister_pytree_node(BlockMask)


FLAG_CASES = [
    {},
    {"separate_full_blocks": False},
    {"compute_dq_write_order": True, "dq_kv_order": False},
    {"separate_full_blocks": False, "compute_dq_write_order": True},
]


@needs_213
@pytest.mark.parametrize("flags", FLAG_CASES, ids=str)
@pytest.mark.parametrize(
    "mask",
    [
        flexmask.causal() & flexmask.document([[100, 90, 110], [300]]),
        ~flexmask.causal() | flexmask.tree([-1, 0, 0, 1, 3] * 40),
    ],
    ids=["closed form", "tiles"],
)
def test_pytree_round_trip(block_mask_pytree, mask, flags):
    ours = flexmask.create_block_mask(mask, 2, 2, 300, 300, "cpu", BLOCK_SIZE=64, **flags)
    theirs = torch_create_block_mask(mask.mask_mod, 2, 2, 300, 300, "cpu", BLOCK_SIZE=64, **flags)
    leaves, spec = pytree.tree_flatten(ours)
    their_leaves, their_spec = pytree.tree_flatten(theirs)
    assert spec.num_leaves == their_spec.num_leaves == len(leaves) == len(their_leaves)
    for a, b in zip(leaves, their_leaves, strict=True):
        assert torch.equal(a, b)
    again = pytree.tree_unflatten(leaves, spec)
    assert type(again) is BlockMask and again.mask_mod is ours.mask_mod
    assert_same(again, theirs)
    # tree_map reaches the tensors inside: a copy whose tensors are new ones, equal to torch's.
    copied = pytree.tree_map(torch.clone, {"mask": ours})["mask"]
    assert copied.kv_indices.data_ptr() != ours.kv_indices.data_ptr()
    assert_same(copied, theirs)


# --- torch.export ----------------------------------------------------------------------


class _BuildFrom(torch.nn.Module):
    """Builds a BlockMask for the length of its input, from a mask made outside."""

    def __init__(self, mask, **flags) -> None:
        super().__init__()
        self.mask, self.flags = mask, flags

    def forward(self, x: torch.Tensor):
        n = x.shape[-2]
        bm = flexmask.create_block_mask(self.mask, 2, 1, n, n, "cpu", BLOCK_SIZE=64, **self.flags)
        return tuple(getattr(bm, name) for name in TENSORS if getattr(bm, name) is not None)


def _exported_equals_torch(mask, **flags):
    x = torch.zeros(2, 300, 8)
    program = torch.export.export(_BuildFrom(mask, **flags), (x,))
    got = program.module()(x)
    theirs = torch_create_block_mask(mask.mask_mod, 2, 1, 300, 300, "cpu", BLOCK_SIZE=64, **flags)
    expected = tuple(getattr(theirs, n) for n in TENSORS if getattr(theirs, n) is not None)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    return program


def _largest_intermediate(program) -> int:
    sizes = [
        node.meta["val"].numel()
        for node in program.graph.nodes
        if isinstance(node.meta.get("val"), torch.Tensor)
    ]
    return max(sizes)


def test_export_traces_the_closed_form_without_a_dense_grid():
    mask = flexmask.causal() & flexmask.document([[100, 90, 110], [300]])
    program = _exported_equals_torch(mask)
    # The graph is block-edge arithmetic: nothing as large as one row's Q x KV elements.
    assert _largest_intermediate(program) < 300 * 300


@needs_213
def test_export_with_torch_213_flags():
    mask = (flexmask.causal() & flexmask.sliding_window(100)) | flexmask.prefix(30)
    _exported_equals_torch(mask, separate_full_blocks=False, compute_dq_write_order=True)
    _exported_equals_torch(mask, compute_dq_write_order=True, dq_kv_order=False)


def test_export_of_a_tile_mask_goes_through_torchs_build():
    # Classifying tiles reads tensor values (which tiles are undecided), which export cannot
    # trace; under export such masks are built by torch's create_block_mask of the mask_mod.
    mask = ~flexmask.causal() | flexmask.tree([-1, 0, 0, 1, 3] * 60)
    program = _exported_equals_torch(mask)
    assert _largest_intermediate(program) >= 300 * 300  # torch's dense evaluation


def test_export_cannot_make_a_mask_from_traced_data():
    # The documented limit (docs/blocks.md): pieces check and key their data by value when
    # they are made, so data that is an input of the exported program cannot make one.
    class FromLengths(torch.nn.Module):
        def forward(self, lengths):
            mask = flexmask.causal() & flexmask.document(lengths)
            return flexmask.create_block_mask(mask, 1, 1, 256, 256, "cpu").kv_num_blocks

    with pytest.raises(TypeError, match="seq_lens is traced by torch.export"):
        torch.export.export(FromLengths(), (torch.tensor([100, 56, 100]),))
