"""Cache keys of re-made per-row masks: equal data hits (however it is given), near-equal data
misses, and every BlockMask the cache returns equals torch's create_block_mask of a mask_mod
written here from the documented semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from tests import oracle

S = 96


def _torch_docs(rows, q_offset=0, block=16):
    """torch's build of causal & documents (ids from the lengths), B = len(rows)."""
    ids = torch.full((len(rows), S + 64), -1)
    for b, lens in enumerate(rows):
        pos = 0
        for d, n in enumerate(lens):
            ids[b, pos : pos + n] = d
            pos += n
    offsets = torch.tensor(q_offset if isinstance(q_offset, list) else [q_offset] * len(rows))

    def mod(b, h, q_idx, kv_idx):
        q = q_idx + offsets[b]
        return (q >= kv_idx) & (ids[b, q] == ids[b, kv_idx]) & (ids[b, q] >= 0)

    return torch_create_block_mask(mod, len(rows), 1, S - 32, S, device="cpu", BLOCK_SIZE=block)


ROWS = [[30, 40, 26], [50, 46], [96], [10, 20, 30, 36]]


@pytest.mark.parametrize(
    "given",
    [
        lambda: [list(r) for r in ROWS],
        lambda: [tuple(r) for r in ROWS],
        lambda: [torch.tensor(r) for r in ROWS],
        lambda: [np.array(r) for r in ROWS],
        lambda: [[np.int64(v) for v in r] for r in ROWS],
    ],
    ids=["lists", "tuples", "tensors", "arrays", "numpy ints"],
)
def test_a_re_made_equal_mask_hits_however_its_lengths_are_given(given):
    cache = flexmask.MaskCache()
    first = cache.get(
        flexmask.causal() & flexmask.document([list(r) for r in ROWS]),
        None,
        1,
        S - 32,
        S,
        "cpu",
        16,
        q_offset=8,
    )
    again = cache.get(
        flexmask.causal() & flexmask.document(given()), None, 1, S - 32, S, "cpu", 16, q_offset=8
    )
    assert again is first
    assert (cache.info().hits, cache.info().misses) == (1, 1)
    oracle.assert_same_block_mask(first, _torch_docs(ROWS, 8))


@pytest.mark.parametrize(
    ("other", "q_offset"),
    [
        ([ROWS[1], ROWS[0], ROWS[2], ROWS[3]], 8),  # the same rows in another order
        ([[30, 40, 26], [50, 46], [96], [10, 20, 36, 30]], 8),  # one row's documents reordered
        ([[30, 40], [26, 50, 46], [96], [10, 20, 30, 36]], 8),  # a document moved across rows
        ([[30, 40, 26], [50, 46], [95, 1], [10, 20, 30, 36]], 8),  # one split differs
        (ROWS[:3], 8),  # fewer rows
        (ROWS, 9),  # another window
        (ROWS, [8, 8, 8, 9]),  # one row's window
        (ROWS, [8, 8, 8, 8]),  # equal per-row offsets: a mask_mod holding (B,) of them
    ],
)
def test_near_equal_masks_miss_and_build_their_own(other, q_offset):
    cache = flexmask.MaskCache()
    base = cache.get(
        flexmask.causal() & flexmask.document(ROWS), None, 1, S - 32, S, "cpu", 16, q_offset=8
    )
    got = cache.get(
        flexmask.causal() & flexmask.document(other),
        None,
        1,
        S - 32,
        S,
        "cpu",
        16,
        q_offset=q_offset,
    )
    assert got is not base
    assert cache.info().misses == 2
    oracle.assert_same_block_mask(got, _torch_docs(other, q_offset))


def test_shared_and_per_row_lengths_key_apart():
    shared = flexmask.document([30, 66])
    per_row = flexmask.document([[30, 66]])
    assert shared != per_row
    assert shared == flexmask.document(torch.tensor([30, 66]))
    assert per_row == flexmask.document(torch.tensor([[30, 66]]))


@pytest.mark.parametrize(
    ("seq_lens", "error", "match"),
    [
        ([[3, -1], [4]], ValueError, r"seq_lens\[0\]\[1\] must be a document length >= 0"),
        ([[3, 1], []], ValueError, r"seq_lens\[1\] must list at least one document length"),
        ([[3, True], [4]], TypeError, r"seq_lens\[0\]\[1\]"),
        ([[3, 1.5], [4]], TypeError, r"seq_lens\[0\]\[1\]"),
        ([[2**62, 2**62], [4]], ValueError, r"sum\(seq_lens\[0\]\)"),
    ],
)
def test_bad_lengths_are_named(seq_lens, error, match):
    with pytest.raises(error, match=match):
        flexmask.document(seq_lens)


def test_a_hit_builds_nothing(monkeypatch):
    # The key is the lengths' content, computed when the mask is made: a hit on a re-made
    # equal mask makes no grid and runs no build, and returns the very object cached.
    # (Its cost against a build is measured in benchmarks/bench_lazy.py, not here.)
    from flexmask.runtime import cache as cache_module
    from flexmask.runtime.spec import Spec

    rows = [[64] * 32 for _ in range(8)]
    cache = flexmask.MaskCache()
    first = cache.get(flexmask.causal() & flexmask.document(rows), None, 1, 2048, 2048, "cpu")
    calls = []

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(cache_module, "build", counted("build", cache_module.build))
    monkeypatch.setattr(Spec, "grid", counted("grid", Spec.grid))
    again = cache.get(
        flexmask.causal() & flexmask.document([list(r) for r in rows]), None, 1, 2048, 2048, "cpu"
    )
    assert again is first
    assert calls == []
    other = cache.get(
        flexmask.causal() & flexmask.document([[32] * 64] * 8), None, 1, 2048, 2048, "cpu"
    )
    assert other is not first
    assert "build" in calls  # the counters see a miss: the check above can fail
