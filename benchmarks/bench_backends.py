"""The backends of ``flexmask.backends.TABLE`` on this device, and what ``backend="auto"`` picks.

Times ``flexmask.attention(..., backend=name)`` for every backend that takes the call, and
``backend="auto"``, on the same inputs in one run (interleaved, the median of several
calls: on a shared machine single calls swing 2-4x, and a minimum rewards a lucky call), for a few
masks and lengths; forward+backward (training) and forward under no_grad. On the CPU that is
``slices`` (where the mask is a few big slices), ``block_sparse`` and ``sdpa`` (and torch's
uncompiled ``flex_attention`` forward, which
materialises every score, as ``flex (eager)``: ``auto`` never picks it, it is the reference
row). Prints one markdown table with each time's ratio to the best backend, whether ``auto``
is within 10% of the best, and the machine's load. Its result is ``flexmask.backends.AUTO``.

Run from the repository root::

    python benchmarks/bench_backends.py            # S = 1k, 2k, 4k
    python benchmarks/bench_backends.py --quick    # S = 512, 1k (seconds)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexmask  # noqa: E402
from flexmask import backends  # noqa: E402

try:
    from benchmarks.common import documents, machine, markdown_table, response_tree, save_json
except ImportError:  # run as a script from benchmarks/
    from common import documents, machine, markdown_table, response_tree, save_json  # type: ignore


def masks(S: int) -> dict[str, flexmask.Mask]:
    return {
        "causal": flexmask.causal(),
        "document-causal": flexmask.causal() & flexmask.document(documents(S, 0)),
        "tree": flexmask.tree(response_tree(S, 0)),
        "sliding-window": flexmask.causal() & flexmask.sliding_window(max(1, S // 8)),
    }


def timed(fn, repeat: int) -> float:
    start = time.perf_counter()
    fn()
    for _ in range(repeat - 1):
        fn()
    return (time.perf_counter() - start) / repeat


def run(S: int, name: str, mask: flexmask.Mask, train: bool, repeat: int, B: int, H: int) -> dict:
    gen = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(B, H, S, 64, generator=gen).requires_grad_(train) for _ in range(3))
    block_mask = flexmask.create_block_mask(mask, B, 1, S, S)
    names = [b for b in backends.TABLE if flexmask.explain(q, k, v, mask, b).backend]
    chosen = flexmask.explain(q, k, v, mask).backend

    def call(backend: str):
        def go():
            if train:
                out = flexmask.attention(q, k, v, mask, backend)
                out.sum().backward()
                q.grad = k.grad = v.grad = None
            else:
                with torch.no_grad():
                    flexmask.attention(q, k, v, mask, backend)

        return go

    calls = {b: call(b) for b in names}
    calls["auto"] = call("auto")
    if not train:
        calls["flex (eager)"] = lambda: torch_flex_attention(q, k, v, block_mask=block_mask)
    samples: dict[str, list[float]] = {label: [] for label in calls}
    for fn in calls.values():  # warm up: caches, first-call allocations
        fn()
    for _ in range(repeat):  # interleaved, so a busy machine slows each alike
        for label, fn in calls.items():
            samples[label].append(timed(fn, 1))
    best = {label: statistics.median(times) for label, times in samples.items()}
    fastest = min(t for label, t in best.items() if label in names)
    return {
        "S": S,
        "mask": name,
        "pass": "fwd+bwd" if train else "fwd",
        "auto picks": chosen,
        "times": best,
        "auto / best": best["auto"] / fastest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    lengths = (512, 1024) if args.quick else (1024, 2048, 4096)
    B, H = 2, 4
    print(f"machine: {machine()}")
    print(f"load before: {os.getloadavg()}")
    rows = []
    for S in lengths:
        for name, mask in masks(S).items():
            for train in (True, False):
                rows.append(run(S, name, mask, train, args.repeat, B, H))
                print(rows[-1], flush=True)
    print(f"load after: {os.getloadavg()}")
    labels = ["slices", "block_sparse", "sdpa", "flex (eager)", "auto"]
    table = []
    for row in rows:
        times = row["times"]
        fastest = min(t for label, t in times.items() if label in backends.TABLE)
        cells = [
            f"{times[label] * 1e3:.1f} ms ({times[label] / fastest:.2f}x)"
            if label in times
            else "-"
            for label in labels
        ]
        within = "yes" if row["auto / best"] <= 1.10 else "NO"
        table.append([row["S"], row["mask"], row["pass"], *cells, row["auto picks"], within])
    print(
        markdown_table(
            ["S", "mask", "pass", *labels, "auto picks", "auto within 10%"],
            table,
        )
    )
    print(
        f"B={B}, H={H}, D=64, float32; medians of {args.repeat} interleaved calls; ratios are"
        " to the fastest backend of the table"
    )
    save_json(args.json, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
