"""The device seam: a build runs where its ``device`` says, pieces' data moves there once, and
the closed form reads no value back to the host.

Two independent proofs on a CPU-only machine: a TorchDispatchMode that fails on every op
that synchronises with a device (reading a scalar, data-dependent shapes), and whole builds
on the ``meta`` device, whose tensors hold no values at all, so any read of one fails.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.utils._python_dispatch import TorchDispatchMode

import flexmask
from flexmask.builders import make_grid, unions
from flexmask.builders.create import build
from flexmask.builders.sides import in_closed_form

# Ops that wait for a device's values: a scalar read, or an output whose shape depends on
# the data.
SYNCING = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
}
# Its output length is the sum of the repeats: a sync unless output_size gives it.
SIZED_BY_DATA = {"aten::repeat_interleave"}


class NoSync(TorchDispatchMode):
    """Records every syncing op (and boolean-mask indexing, which is a nonzero)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNCING:
            self.seen.append(name)
        elif name in SIZED_BY_DATA and (kwargs or {}).get("output_size") is None:
            self.seen.append(f"{name} without output_size")
        elif name in ("aten::index.Tensor", "aten::index", "aten::index_put_", "aten::index_put"):
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.seen.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


DOCS = [[300, 80, 12], [100, 250, 12]]
CLOSED_FORM = {
    "document": flexmask.document(DOCS),
    "causal & document": flexmask.causal() & flexmask.document(DOCS),
    "causal": flexmask.causal(),
    "window": flexmask.causal() & flexmask.sliding_window([100, 7]),
    "prefix-LM": flexmask.causal() | flexmask.prefix([30, 200]),
    "padding": flexmask.padding([390, 380]) & flexmask.causal(),
    "all of them": flexmask.causal()
    & flexmask.document(DOCS)
    & flexmask.sliding_window(100)
    & flexmask.padding([390, 380]),
    # Unions of two monotone masks (build.unions): two runs per row, still no sync.
    "doc-causal | prefix": flexmask.prefix([30, 64])
    | (flexmask.causal() & flexmask.document(DOCS)),
    "composed": (flexmask.causal() & flexmask.document(DOCS) & flexmask.sliding_window(50))
    | flexmask.prefix(64)
    | flexmask.prefix([20, 100]),
}
WINDOWS = [(0, 0), (64, 0), ([10, 100], [0, 3]), (128, 64)]


@pytest.mark.parametrize("name", sorted(CLOSED_FORM))
@pytest.mark.parametrize(("q_offset", "kv_offset"), WINDOWS)
def test_closed_form_build_never_syncs(name, q_offset, kv_offset, monkeypatch):
    mask = CLOSED_FORM[name]
    assert in_closed_form(mask)
    # The path an accelerator takes (on the CPU unions may read values: no device there).
    monkeypatch.setattr(unions, "must_not_sync", lambda grid: True)
    # Validation reads the user's host data; the build itself reads nothing back.
    grid = make_grid(mask, 2, 2, 300, 400, "cpu", 64, q_offset, kv_offset)
    spy = NoSync()
    with spy:
        block_mask = build(mask, grid)
    assert spy.seen == [], f"{name}: syncing ops {sorted(set(spy.seen))}"
    expected = flexmask.create_block_mask(
        mask, 2, 2, 300, 400, "cpu", 64, q_offset=q_offset, kv_offset=kv_offset
    )
    assert torch.equal(block_mask.kv_indices, expected.kv_indices)


def test_the_spy_sees_syncs():
    # The check can fail: the tile path refines by nonzero, and .item() is a scalar read.
    spy = NoSync()
    mask = flexmask.tree([-1, 0, 0, 1, 1, 2] * 50)  # an insertion-order tree: tiles refined
    grid = make_grid(mask, 1, 1, 300, 300, "cpu", 64)
    with spy:
        build(mask, grid)
        torch.ones(3).sum().item()
    assert "aten::_local_scalar_dense" in spy.seen


@pytest.mark.parametrize("name", sorted(CLOSED_FORM))
def test_closed_form_builds_on_a_device_with_no_values(name):
    # On "meta" every tensor is shapes only: a build that read any value would fail.
    mask = CLOSED_FORM[name]
    bm = flexmask.create_block_mask(mask, 2, 3, 300, 400, "meta", 64, q_offset=[10, 100])
    cpu = flexmask.create_block_mask(mask, 2, 3, 300, 400, "cpu", 64, q_offset=[10, 100])
    for field in ("kv_num_blocks", "kv_indices", "full_q_indices"):
        got, want = getattr(bm, field), getattr(cpu, field)
        assert got.device.type == "meta"
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    assert bm.mask_mod is not None


def test_pieces_move_their_data_once_and_do_not_pickle_the_copies():
    mask = flexmask.causal() & flexmask.document(DOCS)
    flexmask.create_block_mask(mask, 2, 1, 600, 600, "meta")
    is_document = type(flexmask.document([1]))
    document = next(c for c in mask.children if isinstance(c, is_document))
    placed = dict(document._placed)
    assert placed and all(d.type == "meta" for _, d in placed)
    flexmask.create_block_mask(mask, 2, 1, 600, 600, "meta")
    assert all(document._placed[k] is v for k, v in placed.items())  # not copied again
    clone = pickle.loads(pickle.dumps(mask))
    assert clone == mask
    assert next(c for c in clone.children if isinstance(c, is_document))._placed == {}


def test_unions_on_the_cpu_read_values_and_stay_exact():
    # The CPU path of a union reads its tile codes (a nonzero: no device to wait for there);
    # the same build equals torch's, so the seam above is the only difference.
    mask = CLOSED_FORM["composed"]
    grid = make_grid(mask, 2, 2, 300, 400, "cpu", 64, 0, 0)
    assert not unions.must_not_sync(grid)
    spy = NoSync()
    with spy:
        ours = build(mask, grid)
    assert "aten::nonzero" in spy.seen
    theirs = torch_create_block_mask(mask.mask_mod, 2, 2, 300, 400, "cpu", BLOCK_SIZE=64)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
