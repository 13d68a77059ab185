"""The flex backend builds a bare Mask's BlockMask in the block shape torch's requested
kernel needs on the device: FA4 (``kernel_options={"BACKEND": "FLASH"}``) takes 256 x 128
blocks on SM100 and later (attn-gym's ``get_flash_block_size``). The device's compute
capability is stood in for here (no GPU); the built tensors are torch's own build's."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.attention import _request
from flexmask.backends import flex
from tests import oracle

S = 600
MASK = flexmask.causal() & flexmask.document([250, 350])


def lowered(monkeypatch, capability, given, options):
    monkeypatch.setattr(flex, "_capability", lambda device: capability)
    q = k = v = torch.randn(1, 2, S, 16)
    request = _request(q, k, v, given, None, None, False, False, True, options)
    return flex.lower(request).block_mask


@pytest.mark.parametrize("capability", [(10, 0), (12, 1)])
def test_flash_on_sm100_gets_256_by_128_blocks(monkeypatch, capability):
    built = lowered(monkeypatch, capability, MASK, {"kernel_options": {"BACKEND": "FLASH"}})
    assert tuple(built.BLOCK_SIZE) == (256, 128)
    want = torch_create_block_mask(MASK.mask_mod_for(S, S), 1, 1, S, S, "cpu", (256, 128))
    oracle.assert_same_block_mask(built, want, "FLASH blocks")


@pytest.mark.parametrize(
    ("capability", "given", "options"),
    [
        ((9, 0), MASK, {"kernel_options": {"BACKEND": "FLASH"}}),  # Hopper: torch's 128
        ((10, 0), MASK, {"kernel_options": {"BACKEND": "TRITON"}}),
        ((10, 0), MASK, {}),
        (None, MASK, {"kernel_options": {"BACKEND": "FLASH"}}),  # not CUDA
        # A handle's recipe is the caller's: its block shape stays.
        ((10, 0), flexmask.lazy(MASK, 1, 2, S, S, "cpu"), {"kernel_options": {"BACKEND": "FLASH"}}),
    ],
    ids=["sm90", "triton", "no options", "cpu", "handle"],
)
def test_otherwise_the_block_shape_is_the_callers_or_torchs(
    monkeypatch, capability, given, options
):
    built = lowered(monkeypatch, capability, given, options)
    assert tuple(built.BLOCK_SIZE) == (128, 128)


def test_block_size_for_reads_only_flash_on_cuda():
    cpu = torch.device("cpu")
    assert flex.block_size_for(cpu, {"BACKEND": "FLASH"}) is None
    assert flex.block_size_for(cpu, None) is None


def test_the_flash_shape_reuses_the_calls_checked_spec(monkeypatch):
    """The rebuild in another block shape is the call's spec, checked once by the call."""
    mask = flexmask.causal() & flexmask.document([250, 350])
    checks = []
    original = type(mask).check
    monkeypatch.setattr(
        type(mask), "check", lambda self, extent: (checks.append(self), original(self, extent))[1]
    )
    built = lowered(monkeypatch, (10, 0), mask, {"kernel_options": {"BACKEND": "FLASH"}})
    assert tuple(built.BLOCK_SIZE) == (256, 128)
    assert sum(node is mask for node in checks) == 1
