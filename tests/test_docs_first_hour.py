"""What a new user meets first: no numpy needed, a word before a long compile, a default
picture, readable reprs, a complete package."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

import flexmask
import flexmask.backends.flex as flex_backend
from tests import oracle

ROOT = Path(__file__).resolve().parent.parent


def test_library_runs_without_numpy():
    # numpy is not a dependency: with its import blocked, every data path that digests
    # tensors (document, tree, packing, the collator) must still work.
    script = """
import sys
sys.modules["numpy"] = None  # `import numpy` now raises ImportError, as where it is missing
import torch, flexmask
from flexmask.packing import PackingCollator
seqs = [[1, 2, 3], [1, 2, 4], [5]]
masks = [flexmask.document([2, 3]), flexmask.tree([-1, 0, 1]), flexmask.document([[2], [1, 1]]),
         flexmask.pack(seqs, 4).mask, flexmask.pack_one_tree(seqs).mask]
assert len({m.key for m in masks}) == len(masks)
assert PackingCollator(max_len=4)(seqs).handle.mask == masks[3]
assert flexmask.document([2, 3]) == flexmask.document(torch.tensor([2, 3]))
print(flexmask.create_block_mask(masks[0], 1, 1, 5, 5, device="cpu").kv_num_blocks.tolist())
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[[[1]]]"


@pytest.fixture()
def fake_compiled(monkeypatch):
    """The compiled kernel replaced by a recorder: the log line comes before the compile."""
    calls = []

    def kernel(query, key, value, **kwargs):
        calls.append(tuple(query.shape))
        return torch.zeros_like(query)

    monkeypatch.setattr(flex_backend, "compiled_flex_attention", lambda: kernel)
    monkeypatch.setattr(flex_backend, "_announced", set())
    return calls


def test_first_compiled_call_of_each_shape_logs_one_line(fake_compiled, caplog):
    a = torch.randn(1, 2, 64, 8)
    b = torch.randn(1, 2, 128, 8)
    with caplog.at_level(logging.WARNING, logger="flexmask"), torch.no_grad():
        for q in (a, a, b, a, b):
            flexmask.attention(q, q, q, flexmask.causal(), "flex", compile=True)
        # The CPU order's slices backend takes it, compile or not: not compiled here.
        flexmask.flex_attention(a, a, a, block_mask=flexmask.causal(), compile=True)
    assert fake_compiled == [tuple(q.shape) for q in (a, a, b, a, b)]
    lines = [r.getMessage() for r in caplog.records if r.name == "flexmask"]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert "(1, 2, 64, 8)" in lines[0] and "(1, 2, 128, 8)" in lines[1]
    for line in lines:
        assert "compiling flex_attention" in line and "20-50 s" in line
        assert "FLEXMASK_COMPILE=0" in line and "flexmask.set_compile(False)" in line


def picture(dense: np.ndarray) -> str:
    return "\n".join(" ".join("■" if x else "⬚" for x in row) for row in dense)


@pytest.mark.parametrize(
    "mask, reference, n",
    [
        (flexmask.causal(), oracle.causal, 8),  # no length of its own: 8
        (flexmask.document([3, 2]), lambda q, kv: oracle.document([3, 2], q, kv), 8),
        (flexmask.tree([-1, 0, 1, 0, 3, 3, 5, 0, 7, 8, 8]), None, 11),  # its own length
        (
            flexmask.causal() & flexmask.document([300, 200, 12]),  # a crop of 512
            lambda q, kv: oracle.causal(q, kv) & oracle.document([300, 200, 12], q, kv),
            32,
        ),
    ],
)
def test_show_draws_a_default_window(mask, reference, n):
    if reference is None:
        parents = [-1, 0, 1, 0, 3, 3, 5, 0, 7, 8, 8]
        dense = oracle.tree(parents, n, n)
    else:
        dense = reference(n, n)
    assert mask.show() == picture(dense)
    assert mask.show() == mask.show(n, n)


def test_show_checks_its_window():
    with pytest.raises(TypeError, match="q_len must be an int"):
        flexmask.causal().show("8")
    with pytest.raises(ValueError, match="kv_len must be >= 1"):
        flexmask.causal().show(4, 0)


def test_reprs_say_what_they_hold():
    cache = flexmask.MaskCache(maxsize=4, maxbytes=1 << 20)
    assert repr(cache) == (
        "MaskCache(maxsize=4, maxbytes=1048576, entries=0, bytes=0, hits=0, misses=0)"
    )
    mask = flexmask.causal() & flexmask.document([40, 24])
    cache.get(mask, 1, 1, 64, 64, "cpu")
    cache.get(mask, 1, 1, 64, 64, "cpu")
    info = cache.info()
    assert f"entries=1, bytes={info.bytes}, hits=1, misses=1" in repr(cache) and info.bytes > 0
    handle = flexmask.lazy(mask, 1, 2, 64, 64, "cuda", cache=cache)
    assert repr(handle) == (
        "LazyBlockMask((causal() & document([40, 24])), B=1, H=2, Q_LEN=64, KV_LEN=64, "
        "device=device(type='cuda'), BLOCK_SIZE=(128, 128), built=False)"
    )
    for simple in (flexmask.causal(), flexmask.document([3, 2]), flexmask.sliding_window(4)):
        assert eval(repr(simple), vars(flexmask)) == simple  # noqa: S307 - our own repr


def test_package_metadata_license_and_typing():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "BSD-3-Clause"  # an SPDX expression, not a table
    assert "LICENSE" in meta["project"]["license-files"]
    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text()
    assert "the flexmask authors" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "flexmask" / "py.typed").is_file()
    assert meta["tool"]["setuptools"]["package-data"]["flexmask"] == ["py.typed"]
    # numpy only where the tests' oracle needs it, never for the library itself
    assert not any(d.startswith("numpy") for d in meta["project"]["dependencies"])
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "graft tests" in manifest  # conftest.py, oracle.py, strategies.py ride along


def test_make_test_loads_only_the_declared_pytest_plugins():
    # .venv sees the system's packages: a plugin installed there (pytest-benchmark, say) must
    # not load into `make test`. Third-party plugins registered by the Makefile's command are
    # exactly the two the project declares (pytest-xdist, hypothesis).
    command = subprocess.run(
        ["make", "-s", "print-pytest"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.strip()
    result = subprocess.run(
        f"{command} --trace-config --co -q -p no:cacheprovider tests/test_algebra.py",
        shell=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    registered = re.findall(r"PLUGIN registered: <module '([\w.]+)' from '([^']+)'", result.stdout)
    third_party = {
        name for name, path in registered if "-packages" in path and not name.startswith("_pytest")
    }
    assert third_party == {"xdist.plugin", "_hypothesis_pytestplugin"}, third_party
