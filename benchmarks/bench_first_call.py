"""Fixed costs a user meets first: importing flexmask, the README's five lines, the first
compiled CPU ``flex_attention`` call with empty compile caches, and re-making an equal
per-row tree mask to hit the cache against building it.

Each of the first three runs in a fresh Python process (so nothing is imported or compiled
yet); the last is timed in this one, the re-made hit and the build interleaved. Prints the
load before and after. README's "five lines" and "first compiled call" figures come from it.

Run from the repository root::

    python benchmarks/bench_first_call.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FIVE_LINES = """
import time
start = time.perf_counter()
import torch, flexmask
imported = time.perf_counter()
mask = flexmask.causal() & flexmask.document([300, 200, 12])
handle = flexmask.lazy(mask, B=1, H=4, Q_LEN=512, KV_LEN=512, device="cpu")
q, k, v = (torch.randn(1, 4, 512, 64) for _ in range(3))
out = flexmask.flex_attention(q, k, v, block_mask=handle)
handle.release()
print(imported - start, time.perf_counter() - imported)
"""

FIRST_COMPILED = """
import time, torch, flexmask
mask = flexmask.causal() & flexmask.document([300, 200, 12])
q, k, v = (torch.randn(1, 4, 512, 64) for _ in range(3))
with torch.no_grad():
    start = time.perf_counter()
    flexmask.attention(q, k, v, mask, "flex", compile=True)
    first = time.perf_counter() - start
    start = time.perf_counter()
    flexmask.attention(q, k, v, mask, "flex", compile=True)
print(first, time.perf_counter() - start)
"""


def fresh(code: str, env: dict[str, str] | None = None) -> list[float]:
    """The floats a fresh interpreter prints for ``code``, run from the repository root."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    )
    return [float(x) for x in done.stdout.split()[-2:]]


def remade_tree(S: int, B: int, repeat: int) -> tuple[float, float]:
    """Median seconds of (re-make an equal per-row tree mask + cache hit) and of a build."""
    sys.path.insert(0, str(ROOT))
    import flexmask
    from benchmarks.common import response_tree

    rows = [[int(p) for p in response_tree(S, seed)] for seed in range(B)]
    cache = flexmask.MaskCache()
    cache.get(flexmask.causal() & flexmask.tree(rows), None, 1, S, S, "cpu")
    hits, builds = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        cache.get(flexmask.causal() & flexmask.tree([list(r) for r in rows]), None, 1, S, S)
        hits.append(time.perf_counter() - start)
        start = time.perf_counter()
        flexmask.create_block_mask(flexmask.causal() & flexmask.tree(rows), None, 1, S, S)
        builds.append(time.perf_counter() - start)
    return statistics.median(hits), statistics.median(builds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per row")
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}")
    five = [fresh(FIVE_LINES) for _ in range(args.runs)]
    print(
        f"import flexmask: {statistics.median(r[0] for r in five):.2f} s; the README's five "
        f"lines after it: {statistics.median(r[1] for r in five):.3f} s "
        f"(median of {args.runs} fresh processes)"
    )
    with tempfile.TemporaryDirectory() as cold:
        compiled = fresh(
            FIRST_COMPILED,
            {
                "TORCHINDUCTOR_CACHE_DIR": cold,
                "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
                "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
            },
        )
    print(f"first compiled CPU flex_attention call, empty compile caches: {compiled[0]:.1f} s")
    print(f"  the second call of that shape: {compiled[1] * 1e3:.1f} ms")
    hit, build = remade_tree(4096, 8, 7)
    print(
        f"per-row tree, B=8, S=4096: re-made + cache hit {hit * 1e3:.2f} ms, build "
        f"{build * 1e3:.2f} ms ({hit / build:.2f}x)"
    )
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
