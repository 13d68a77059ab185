"""The block-sparse path's chunk size (``max_chunk_elements``): forward + backward time and
peak resident-set rise for each size, against the default, in one run.

A group of q blocks is capped at ``max_chunk_elements`` score elements. Large groups make
fewer, larger ops (less Python per element); small ones keep a group's temporaries in cache,
deal more evenly to the worker threads and lower the peak. Each case times every size
interleaved (size after size, ``--repeats`` rounds), median::

    python benchmarks/bench_chunk.py [--lengths 2048 8192] [--batches 1] [--heads 4]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from _memory import peak_rss_bytes
from common import documents, fmt_bytes, fmt_time, machine, markdown_table, response_tree, save_json

import flexmask
from flexmask.backends.block_sparse.api import DEFAULT_MAX_CHUNK_ELEMENTS, block_sparse_attention

SIZES = (1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22)


def masks(S: int, B: int) -> dict[str, flexmask.Mask]:
    def rows(make):
        return [make(seed) for seed in range(B)] if B > 1 else make(0)

    return {
        "doc-4": flexmask.causal() & flexmask.document(rows(lambda s: documents(S, s, S // 4))),
        "doc-20": flexmask.causal() & flexmask.document(rows(lambda s: documents(S, s, S // 20))),
        "window-1024": flexmask.causal() & flexmask.sliding_window(1024),
        "tree": flexmask.tree(rows(lambda s: response_tree(S, s))),
    }


def measure(mask, S, B, H, repeats) -> dict[int, tuple[float, int]]:
    block_mask = flexmask.create_block_mask(mask, B, 1, S, S, "cpu")
    q, k, v = (torch.randn(B, H, S, 64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(B, H, S, 64)

    def call(size: int) -> None:
        for t in (q, k, v):
            t.grad = None
        out = block_sparse_attention(
            q, k, v, block_mask, mask=mask, kernel="sparse", max_chunk_elements=size
        )
        out.backward(grad_out)

    for size in SIZES:  # warm-up, and the thread choice's first measurements
        for _ in range(3):
            call(size)
    times: dict[int, list[float]] = {size: [] for size in SIZES}
    for _ in range(repeats):
        for size in SIZES:
            gc.collect()
            begin = time.perf_counter()
            call(size)
            times[size].append(time.perf_counter() - begin)
    return {
        size: (statistics.median(times[size]), peak_rss_bytes(lambda s=size: call(s))[0])
        for size in SIZES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="*", default=[1])
    parser.add_argument("--heads", type=int, nargs="*", default=[4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(machine())
    rows, payload = [], []
    for S in args.lengths:
        for B in args.batches:
            for H in args.heads:
                for name, mask in masks(S, B).items():
                    result = measure(mask, S, B, H, args.repeats)
                    base_time, base_rss = result[DEFAULT_MAX_CHUNK_ELEMENTS]
                    cells = [
                        f"{fmt_time(t)} ({t / base_time:.2f}×), {fmt_bytes(r)}"
                        for t, r in (result[size] for size in SIZES)
                    ]
                    rows.append([name, f"{S:,}", f"{B}×{H}", *cells])
                    payload.append(
                        dict(mask=name, S=S, B=B, H=H, results={str(s): result[s] for s in SIZES})
                    )
                    print(" | ".join(rows[-1]), flush=True)
    header = ["mask", "S", "B×H", *(f"{size >> 10}Ki elements" for size in SIZES)]
    print(markdown_table(header, rows))
    save_json(args.json, dict(rows=payload))


if __name__ == "__main__":
    main()
