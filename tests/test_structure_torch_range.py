"""The torch this suite runs on is one pyproject.toml declares, and flexmask's default device
follows torch's rule on every build of it (CPU, CUDA with a GPU, CUDA without one).

scripts/check_torch_range.sh runs the suite's core files on another torch in a venv of its
own; this file is among them, so a torch outside the declared range fails here by name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

import flexmask
from flexmask._validate import default_device
from tests import oracle

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def declared_torch() -> Requirement:
    """pyproject's torch requirement, read as text (tomllib is not in Python 3.10)."""
    match = re.search(r'^\s*"(torch[<>=!~,.\s\d]*)"', PYPROJECT.read_text(), re.MULTILINE)
    assert match, f"no torch line in the dependencies of {PYPROJECT}"
    return Requirement(match.group(1))


def test_installed_torch_is_in_the_declared_range():
    requirement = declared_torch()
    installed = Version(Version(torch.__version__).base_version)  # 2.13.0+cpu -> 2.13.0
    assert requirement.specifier.contains(installed), (
        f"torch {torch.__version__} is outside pyproject's {requirement}: if the rest of this "
        "run passes, widen the range and list the version in docs/getting-started.md"
    )


def test_declared_range_has_a_lower_and_an_upper_bound():
    operators = {spec.operator for spec in declared_torch().specifier}
    assert ">=" in operators and "<" in operators, declared_torch()


@pytest.fixture
def gpu_less_cuda_build(monkeypatch):
    """torch as a CUDA build on a machine without a GPU: its current accelerator is ``cuda``
    (as 2.14.1's is there) but no accelerator is available."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: "cuda")


def test_a_cuda_build_without_a_gpu_builds_on_the_cpu(gpu_less_cuda_build):
    mask = flexmask.causal() & flexmask.document([70, 130])
    dense = mask.to_dense(1, 1, 200, 200)
    assert dense.device.type == "cpu"
    expected = oracle.causal(200, 200) & oracle.document([70, 130], 200, 200)
    assert dense[0, 0].numpy().tolist() == expected.tolist()
    built = flexmask.create_block_mask(mask, 1, 1, 200, 200, BLOCK_SIZE=64)
    assert built.kv_num_blocks.device.type == "cpu"
    oracle.assert_same_block_mask(built, oracle.torch_build(oracle.stack([expected]), block=64))


def test_an_available_accelerator_is_the_default(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: "cuda")
    assert default_device() == torch.device("cuda")


def test_without_an_accelerator_masks_live_on_the_cpu():
    """Not mocked: on this machine's torch, whatever its build, when no accelerator is usable."""
    if torch.accelerator.is_available():
        pytest.skip(f"{torch.accelerator.current_accelerator()} is available here")
    assert default_device() == torch.device("cpu")
    assert flexmask.causal().to_dense(1, 1, 3, 3).device == torch.device("cpu")
    assert flexmask.lazy(flexmask.causal(), 1, 1, 3, 3).block_mask.kv_indices.device.type == "cpu"
