"""The BlockMask cache: keys by content, LRU order, both bounds, env variables, threads.

Keys of re-made per-row masks: equal data hits (however it is given), near-equal data
misses, and every BlockMask the cache returns equals torch's create_block_mask of a mask_mod
written here from the documented semantics.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexmask
from flexmask.runtime.cache import block_mask_nbytes
from tests import oracle
from tests.strategies import expressions


def doc(lens):
    return flexmask.causal() & flexmask.document(lens, truncate=True)


def test_equal_masks_from_different_objects_hit_and_return_the_identical_object():
    cache = flexmask.MaskCache(maxsize=4)
    a = cache.get(doc([100, 156]), 1, 1, 256, 256, "cpu")
    b = cache.get(
        flexmask.document(torch.tensor([100, 156]), truncate=True) & flexmask.causal(),
        1,
        1,
        256,
        256,
        "cpu",
    )
    assert a is b
    info = cache.info()
    assert (info.hits, info.misses, info.entries) == (1, 1, 1)


def test_one_length_apart_misses():
    cache = flexmask.MaskCache(maxsize=4)
    a = cache.get(doc([100, 156]), 1, 1, 256, 256, "cpu")
    b = cache.get(doc([101, 155]), 1, 1, 256, 256, "cpu")
    assert a is not b and cache.info().misses == 2
    from torch.nn.attention.flex_attention import create_mask

    # each entry carries its own mask_mod: elementwise the two differ
    assert not torch.equal(
        create_mask(a.mask_mod, 1, 1, 256, 256, "cpu"),
        create_mask(b.mask_mod, 1, 1, 256, 256, "cpu"),
    )


def test_shape_signature_is_part_of_the_key_and_b_h_are_reduced_when_unused():
    cache = flexmask.MaskCache(maxsize=8)
    m = flexmask.causal()
    base = cache.get(m, 1, 1, 256, 256, "cpu")
    assert cache.get(m, 8, 16, 256, 256, "cpu") is base  # B, H unused: same entry
    assert base.kv_num_blocks.shape[:2] == (1, 1)  # flex_attention broadcasts it
    assert cache.get(m, 1, 1, 256, 384, "cpu") is not base
    assert cache.get(m, 1, 1, 256, 256, "cpu", BLOCK_SIZE=64) is not base
    per_row = flexmask.causal() & flexmask.padding([200, 256], truncate=True)
    bm = cache.get(per_row, 2, 4, 256, 256, "cpu")
    assert bm.kv_num_blocks.shape[:2] == (2, 1)


def test_cached_block_mask_equals_torch():
    cache = flexmask.MaskCache(maxsize=2)
    m = doc([30, 50, 20])
    bm = cache.get(m, 1, 1, 100, 100, "cpu", BLOCK_SIZE=16)
    dense = oracle.causal(100, 100) & oracle.document([30, 50, 20], 100, 100)
    oracle.assert_same_block_mask(bm, oracle.torch_build(oracle.stack([dense]), block=16))


def test_lru_order_and_entry_bound():
    cache = flexmask.MaskCache(maxsize=2)
    a, b, c = doc([10, 20]), doc([15, 15]), doc([5, 25])
    bm_a = cache.get(a, 1, 1, 30, 30, "cpu")
    cache.get(b, 1, 1, 30, 30, "cpu")
    assert cache.get(a, 1, 1, 30, 30, "cpu") is bm_a  # a is now most recent
    cache.get(c, 1, 1, 30, 30, "cpu")  # evicts b, the least recently used
    assert flexmask.MaskCache.key(b, 1, 1, 30, 30, "cpu") not in cache
    assert flexmask.MaskCache.key(a, 1, 1, 30, 30, "cpu") in cache
    info = cache.info()
    assert info.entries == 2 and info.evictions == 1


def test_byte_bound():
    one = block_mask_nbytes(flexmask.create_block_mask(doc([500, 524]), 1, 1, 1024, 1024, "cpu"))
    cache = flexmask.MaskCache(maxsize=100, maxbytes=int(2.5 * one))
    for i in range(6):
        cache.get(doc([500 + i, 524 - i]), 1, 1, 1024, 1024, "cpu")
        assert cache.info().bytes <= int(2.5 * one)
    info = cache.info()
    assert info.entries == 2 and info.evictions == 4
    tiny = flexmask.MaskCache(maxsize=4, maxbytes=10)  # too small for any entry
    assert tiny.get(doc([10, 20]), 1, 1, 30, 30, "cpu") is not None
    assert tiny.info().entries == 0


def test_size_zero_disables_caching():
    cache = flexmask.MaskCache(maxsize=0)
    m = doc([10, 20])
    assert cache.get(m, 1, 1, 30, 30, "cpu") is not cache.get(m, 1, 1, 30, 30, "cpu")
    assert cache.info().entries == 0 and cache.info().misses == 2


def test_bad_cache_arguments():
    with pytest.raises(ValueError, match="maxsize must be an int >= 0"):
        flexmask.MaskCache(maxsize=-1)
    with pytest.raises(ValueError, match="maxbytes"):
        flexmask.MaskCache(maxbytes=-5)
    with pytest.raises(TypeError, match="flexmask Mask"):
        flexmask.MaskCache().get(lambda b, h, q, kv: q >= kv, 1, 1, 8, 8, "cpu")


@given(data=st.data(), length=st.integers(8, 64))
def test_different_content_never_shares_an_entry(data, length):
    cache = flexmask.MaskCache(maxsize=16)
    a, ref_a = data.draw(expressions(2, 1, length, max_leaves=3))
    b, ref_b = data.draw(expressions(2, 1, length, max_leaves=3))
    # the plain-Python references, not the masks' own evaluation
    dense_a = torch.from_numpy(ref_a(length, length))
    dense_b = torch.from_numpy(ref_b(length, length))
    bm_a = cache.get(a, 2, 1, length, length, "cpu", BLOCK_SIZE=8)
    bm_b = cache.get(b, 2, 1, length, length, "cpu", BLOCK_SIZE=8)
    if not torch.equal(dense_a, dense_b):
        assert bm_a is not bm_b
    # whatever the cache returns is the right mask for what was asked
    for m, bm, dense in ((a, bm_a, dense_a), (b, bm_b, dense_b)):
        ref = oracle.torch_build(dense.numpy(), block=8)
        assert torch.equal(bm.to_dense().expand_as(ref.to_dense()), ref.to_dense()), m


def test_threads_share_one_object_per_key_and_respect_bounds():
    cache = flexmask.MaskCache(maxsize=6)
    masks = [doc([64 + 8 * i, 448 - 8 * i]) for i in range(10)]
    results: list[list] = [[] for _ in range(8)]
    errors = []

    def worker(slot: int) -> None:
        try:
            for rep in range(3):
                for i in range(10):
                    m = masks[(i + slot + rep) % 10]
                    results[slot].append((m, cache.get(m, 1, 1, 512, 512, "cpu")))
                    assert len(cache) <= 6
        except Exception as err:  # noqa: BLE001 - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for slot in results:
        for m, bm in slot:
            expected = flexmask.create_block_mask(m, 1, 1, 512, 512, "cpu")
            assert torch.equal(bm.kv_num_blocks, expected.kv_num_blocks)
            assert torch.equal(bm.full_kv_indices, expected.full_kv_indices)
    info = cache.info()
    assert info.entries <= 6 and info.hits + info.misses == 8 * 30


def test_same_key_concurrent_misses_return_one_object():
    cache = flexmask.MaskCache(maxsize=4)
    m = doc([1000, 1048])
    barrier = threading.Barrier(6)
    out = []

    def worker():
        barrier.wait()
        out.append(cache.get(m, 1, 1, 2048, 2048, "cpu"))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cached = cache.get(m, 1, 1, 2048, 2048, "cpu")
    # every thread that found or inserted the entry got the cached object
    assert sum(o is cached for o in out) >= 1
    assert all(torch.equal(o.kv_indices, cached.kv_indices) for o in out)


def _run_env(env: dict, code: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120
    )


def test_environment_variables_size_the_default_cache():
    code = (
        "import flexmask\n"
        "for i in range(5):\n"
        "    flexmask.lazy(flexmask.causal() & flexmask.document([10 + i, 20]), 1, 1, 64, 64,"
        " 'cpu').block_mask\n"
        "i = flexmask.cache_info()\n"
        "print(i.maxsize, i.maxbytes, i.entries, i.evictions)\n"
    )
    out = _run_env({"FLEXMASK_CACHE_SIZE": "3", "FLEXMASK_CACHE_BYTES": "1M"}, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", str(1 << 20), "3", "2"]
    off = _run_env({"FLEXMASK_CACHE_SIZE": "0"}, code)
    assert off.stdout.split() == ["0", "None", "0", "0"], off.stderr


@pytest.mark.parametrize(
    "name, value",
    [
        ("FLEXMASK_CACHE_SIZE", "lots"),
        ("FLEXMASK_CACHE_SIZE", "-2"),
        ("FLEXMASK_CACHE_BYTES", "12X"),
    ],
)
def test_malformed_environment_variable_is_named(name, value):
    out = _run_env({name: value}, "import flexmask; flexmask.cache_info()")
    assert out.returncode != 0
    assert f"environment variable {name}=" in out.stderr


def test_discard_is_counted_apart_from_evictions_and_clear_resets_it():
    cache = flexmask.MaskCache(maxsize=1)
    a, b = flexmask.causal(), flexmask.causal() & flexmask.prefix(10)
    cache.get(a, 1, 1, 64, 64, "cpu")
    cache.get(b, 1, 1, 64, 64, "cpu")  # pushes `a` out: an eviction
    assert cache.discard(cache.key(b, 1, 1, 64, 64, "cpu"))
    assert not cache.discard(cache.key(b, 1, 1, 64, 64, "cpu"))  # nothing left to drop
    info = cache.info()
    assert (info.evictions, info.discarded, info.entries) == (1, 1, 0)
    cache.clear()
    assert cache.info().discarded == 0 and cache.info().evictions == 0


S = 96


def _torch_docs(rows, q_offset=0, block=16):
    """torch's build of causal & documents (ids from the lengths), B = len(rows)."""
    ids = torch.full((len(rows), S + 64), -1)
    for b, lens in enumerate(rows):
        pos = 0
        for d, n in enumerate(lens):
            ids[b, pos : pos + n] = d
            pos += n

    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] >= 0)

    return oracle.torch_build(mod, len(rows), 1, S - 32, S, block, q_offset=q_offset)


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
        flexmask.causal() & flexmask.document([list(r) for r in ROWS], truncate=True),
        None,
        1,
        S - 32,
        S,
        "cpu",
        16,
        q_offset=8,
    )
    again = cache.get(
        flexmask.causal() & flexmask.document(given(), truncate=True),
        None,
        1,
        S - 32,
        S,
        "cpu",
        16,
        q_offset=8,
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
        flexmask.causal() & flexmask.document(ROWS, truncate=True),
        None,
        1,
        S - 32,
        S,
        "cpu",
        16,
        q_offset=8,
    )
    got = cache.get(
        flexmask.causal() & flexmask.document(other, truncate=True),
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
    shared = flexmask.document([30, 66], truncate=True)
    per_row = flexmask.document([[30, 66]], truncate=True)
    assert shared != per_row
    assert shared == flexmask.document(torch.tensor([30, 66]), truncate=True)
    assert per_row == flexmask.document(torch.tensor([[30, 66]]), truncate=True)


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
        flexmask.document(seq_lens, truncate=True)


def test_a_hit_builds_nothing(monkeypatch):
    # The key is the lengths' content, computed when the mask is made: a hit on a re-made
    # equal mask makes no grid and runs no build, and returns the very object cached.
    # (Its cost against a build is measured in benchmarks/bench_lazy.py, not here.)
    from flexmask.builders.spec import Spec
    from flexmask.runtime import cache as cache_module

    rows = [[64] * 32 for _ in range(8)]
    cache = flexmask.MaskCache()
    first = cache.get(
        flexmask.causal() & flexmask.document(rows, truncate=True), None, 1, 2048, 2048, "cpu"
    )
    calls = []

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(cache_module, "build", counted("build", cache_module.build))
    monkeypatch.setattr(Spec, "grid", counted("grid", Spec.grid))
    again = cache.get(
        flexmask.causal() & flexmask.document([list(r) for r in rows], truncate=True),
        None,
        1,
        2048,
        2048,
        "cpu",
    )
    assert again is first
    assert calls == []
    other = cache.get(
        flexmask.causal() & flexmask.document([[32] * 64] * 8, truncate=True),
        None,
        1,
        2048,
        2048,
        "cpu",
    )
    assert other is not first
    assert "build" in calls  # the counters see a miss: the check above can fail
