"""``flexmask.gallery.cudnn`` against NVIDIA's own suite.

The reference is the suite's mask definition (``benchmark/flex_attention/
benchmark_flex_attention.py`` in NVIDIA/cudnn-frontend), written out plainly below: per
query, interval endpoints ``[0, F0) ∪ [F1, F2) ∪ …``, with the suite's lengths drawn by its
own rules (rewritten here, not imported from flexmask). Each gallery mask must attend exactly
those pairs — densely at small sizes, where its BlockMask must also equal torch's own build
of the reference as whole tensors — and, at the suite's 128K (slow) and at 32K, its
``to_cudnn`` endpoints must give every query the same keys as the suite's.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import flexmask
from flexmask.formats import to_cudnn
from flexmask.gallery import cudnn
from tests.oracle import assert_same_block_mask, torch_build

LENGTHS_128K = [
    11858,
    8270,
    12765,
    11038,
    4578,
    14018,
    11721,
    11988,
    4942,
    8393,
    7541,
    13495,
    10465,
]


# ------------------------------------------------------------ the suite, written plainly
def jittered(total, count, seed, jitter=0.2):
    rng = random.Random(seed)
    weights = [rng.uniform(1 - jitter, 1 + jitter) for _ in range(count)]
    scaled = [w * total / sum(weights) for w in weights]
    out = [max(1, math.floor(x)) for x in scaled]
    order = sorted(range(count), key=lambda i: scaled[i] - math.floor(scaled[i]), reverse=True)
    for i in range(total - sum(out)):
        out[order[i % count]] += 1
    return out


def partition(total, lo, hi, seed, prefer_multiple=False):
    if total < lo:
        return [total]
    most = total // lo
    count = min(max(round(total / ((lo + hi) / 2)), math.ceil(total / hi)), most)
    if prefer_multiple and count == 1 and most >= 2:
        count = 2
    rng = random.Random(seed)
    out = [rng.randint(lo, hi) for _ in range(count)]
    diff = total - sum(out)
    while diff:
        order = list(range(count))
        rng.shuffle(order)
        for i in order:
            d = min(diff, hi - out[i]) if diff > 0 else -min(-diff, out[i] - lo)
            out[i] += d
            diff -= d
            if diff == 0:
                break
    return out


def suite_intervals(name: str, S: int, window=512, sink=4, depth=7, radius=256, globals_=8):
    """Per query, the suite's sorted intervals of attended keys (its _make_* functions)."""
    rows: list[list[tuple[int, int]]] = [[] for _ in range(S)]
    if name == "causal":
        return [[(0, q + 1)] for q in range(S)]
    if name == "document_causal":
        lens = LENGTHS_128K if S == 128 * 1024 else partition(S, 4096, 16384, 42, True)
        start = 0
        for n in lens:
            for q in range(start, start + n):
                rows[q] = [(start, q + 1)]
            start += n
        return rows
    if name == "local":
        return [[(max(0, q - window), q + 1)] for q in range(S)]
    if name == "sink_local":
        return [[(0, min(q + 1, sink)), (max(q - window, sink), q + 1)] for q in range(S)]
    if name in ("tree_dfs", "tree_bfs"):
        nodes = 2**depth - 1
        lens = jittered(S, nodes, 42)
        if name == "tree_bfs":
            order = list(range(nodes))
        else:
            order = []

            def visit(n):
                if n < nodes:
                    order.append(n)
                    visit(2 * n + 1)
                    visit(2 * n + 2)

            visit(0)
        starts, at = {}, 0
        for n in order:
            starts[n], at = at, at + lens[n]
        for n in order:
            up, anc = n, []
            while up:
                up = (up - 1) // 2
                anc.append((starts[up], starts[up] + lens[up]))
            for q in range(starts[n], starts[n] + lens[n]):
                rows[q] = [*anc, (starts[n], q + 1)]
        return rows
    if name == "longformer":
        glob = sorted({min(int((i + 0.5) * S / globals_), S - 1) for i in range(globals_)})
        for q in range(S):
            if q in glob:
                rows[q] = [(0, S)]
            else:
                rows[q] = [(max(0, q - radius), min(S, q + radius + 1))] + [
                    (g, g + 1) for g in glob
                ]
        return rows
    if name == "hstu":
        contexts = partition(S // 2, 4096, 8192, 42)
        targets = contexts.copy()
        targets[-1] += S % 2
        at = 0
        for c, t in zip(contexts, targets, strict=True):
            for q in range(at, at + c):
                rows[q] = [(at, q + 1)]
            for q in range(at + c, at + c + t):
                rows[q] = [(at, at + c), (q, q + 1)]
            at += c + t
        return rows
    raise AssertionError(name)


def dense(rows, S) -> np.ndarray:
    out = np.zeros((S, S), dtype=bool)
    for q, intervals in enumerate(rows):
        for a, b in intervals:
            out[q, a:b] = True
    return out


def endpoint_counts_and_probe(endpoints: torch.Tensor, q: torch.Tensor, kv: torch.Tensor):
    """cuDNN's rule for ``[n_func, S]`` endpoints: per query the number of visible keys
    (intervals as given, the suite's merged ones or to_cudnn's), and visibility of (q, kv)."""
    e = endpoints.long()
    count = e[0].clone()
    seen = kv < e[0, q]
    for i in range(1, e.shape[0], 2):
        count += (e[i + 1] - e[i]).clamp(min=0)
        seen |= (e[i, q] <= kv) & (kv < e[i + 1, q])
    return count, seen


def merged(rows):
    out = []
    for intervals in rows:
        m: list[list[int]] = []
        for a, b in sorted(intervals):
            if a == b:
                continue
            if m and a <= m[-1][1]:
                m[-1][1] = max(m[-1][1], b)
            else:
                m.append([a, b])
        out.append(m)
    return out


# ------------------------------------------------------------ small sizes, densely
SMALL = {
    "causal": {},
    "document_causal": {},
    "local": {"window_left": 5},
    "sink_local": {"sink_tokens": 3, "window_left": 6},
    "tree_dfs": {"depth": 3},
    "tree_bfs": {"depth": 4},
    "longformer": {"local_radius": 4, "global_count": 3},
    "hstu": {},
}
SUITE_KW = {
    "local": {"window": 5},
    "sink_local": {"sink": 3, "window": 6},
    "tree_dfs": {"depth": 3},
    "tree_bfs": {"depth": 4},
    "longformer": {"radius": 4, "globals_": 3},
}


@pytest.mark.parametrize("name", cudnn.MASK_NAMES)
@pytest.mark.parametrize(("S", "block"), [(77, 16), (130, (32, 8)), (203, (8, 32))])
def test_each_mask_attends_the_suite_pairs_and_builds_as_torch(name, S, block):
    """Small sizes with the suite's parameters scaled down (one document for
    document_causal and hstu here: their drawn lengths are checked at 32K below)."""
    mask = getattr(cudnn, name)(S, **SMALL[name])
    want = dense(suite_intervals(name, S, **SUITE_KW.get(name, {})), S)
    np.testing.assert_array_equal(mask.to_dense(1, 1, S, S)[0, 0].numpy(), want, name)
    reference = torch_build(want[None, None], 1, 1, S, S, block=block)
    ours = flexmask.create_block_mask(mask, 1, 1, S, S, device="cpu", BLOCK_SIZE=block)
    assert_same_block_mask(ours, reference, name)
    if not SMALL[name]:
        assert mask == cudnn.make_mask(name, S)


def _same_keys_as_the_suite(name: str, S: int) -> None:
    mask = cudnn.make_mask(name, S)
    lowered = to_cudnn(mask, 1, 1, S).mask_func[0]
    rows = merged(suite_intervals(name, S))
    width = max(len(r) for r in rows)
    suite = torch.zeros(2 * width + 1, S, dtype=torch.int64)
    for q, intervals in enumerate(rows):  # the suite's encoding: [0, F0) ∪ [F1, F2) ∪ …
        if intervals[0][0] == 0:
            flat = [intervals[0][1]] + [v for pair in intervals[1:] for v in pair]
        else:
            flat = [0] + [v for pair in intervals for v in pair]
        flat += [flat[-1]] * (suite.shape[0] - len(flat))
        suite[:, q] = torch.tensor(flat)
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, S, (400_000,), generator=gen)
    kv = torch.randint(0, S, (400_000,), generator=gen)
    # Probes at every interval edge (and one key either side) of sampled rows, too.
    rows_at = torch.randint(0, S, (2000,), generator=gen)
    edges = suite[:, rows_at]
    q = torch.cat([q, *(rows_at for _ in range(3 * suite.shape[0]))])
    kv = torch.cat([kv, *(edges[i] + d for i in range(suite.shape[0]) for d in (-1, 0, 1))])
    keep = (kv >= 0) & (kv < S)
    q, kv = q[keep], kv[keep]
    want_count, want_seen = endpoint_counts_and_probe(suite, q, kv)
    got_count, got_seen = endpoint_counts_and_probe(lowered, q, kv)
    assert torch.equal(got_count, want_count), name
    assert torch.equal(got_seen, want_seen), name


@pytest.mark.parametrize("name", cudnn.MASK_NAMES)
def test_to_cudnn_gives_every_query_the_suites_keys_at_32k(name):
    _same_keys_as_the_suite(name, 32 * 1024)


@pytest.mark.slow
@pytest.mark.parametrize("name", cudnn.MASK_NAMES)
def test_to_cudnn_gives_every_query_the_suites_keys_at_128k(name):
    _same_keys_as_the_suite(name, 128 * 1024)


def test_the_suites_lengths_and_refusals():
    assert cudnn.document_lengths(128 * 1024) == LENGTHS_128K
    assert cudnn.document_lengths(32768) == partition(32768, 4096, 16384, 42, True)
    contexts, targets = cudnn.hstu_lengths(128 * 1024 + 1)
    assert sum(contexts) + sum(targets) == 128 * 1024 + 1 and all(
        4096 <= c <= 8192 for c in contexts
    )
    parents = cudnn.tree_parents(1000, "bfs")
    assert len(parents) == 1000 and all(-1 <= p < i for i, p in enumerate(parents))
    with pytest.raises(ValueError, match="name must be one of"):
        cudnn.make_mask("sliding")
    with pytest.raises(ValueError, match="at least the tree's 127 nodes"):
        cudnn.tree_dfs(100)


@pytest.mark.parametrize("name", ["document_causal", "tree_dfs", "tree_bfs", "longformer", "hstu"])
def test_masks_with_drawn_data_refuse_a_bad_seqlen(name):
    with pytest.raises(ValueError, match="seqlen must be >= 1"):
        cudnn.make_mask(name, 0)
    with pytest.raises(TypeError, match="seqlen must be an int"):
        cudnn.make_mask(name, 1024.0)
    with pytest.raises(ValueError, match="global_count must be an int >= 1"):
        cudnn.longformer(64, global_count=0)
