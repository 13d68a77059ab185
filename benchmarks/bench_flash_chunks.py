"""torch's fused CPU flash kernel: what a causal call saves against a full one, by length.

The slices backend runs this kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward) once per slice of a mask. Its cost floor for a mask follows from how the
kernel skips work under ``is_causal``: it computes keys in whole chunks, so a causal call
saves nothing until it has more keys than a chunk. Each row times the causal call and the
full call of the same shape, interleaved, forward and forward + backward, and prints their
ratio (1/2 would be a kernel that skips exactly the upper triangle).

Run from the repository root::

    python benchmarks/bench_flash_chunks.py                  # S = 256 ... 2048, one thread
    python benchmarks/bench_flash_chunks.py --lengths 512 1024 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from common import markdown_table  # noqa: E402


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turn ``repeats`` times (after one warmup)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _forward_backward(forward, backward, q, k, v, causal):  # type: ignore[no-untyped-def]
    out, lse = forward(q, k, v, 0.0, causal)
    return backward(torch.ones_like(out), q, k, v, out, lse, 0.0, causal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[256, 512, 768, 1024, 2048])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), H={args.heads}, "
        f"D={args.head_dim}, fp32, load average {os.getloadavg()[0]:.1f}"
    )
    rows = []
    for length in args.lengths:
        q, k, v = (torch.randn(1, args.heads, length, args.head_dim) for _ in range(3))
        fns = {}
        for causal in (False, True):
            name = "causal" if causal else "full"
            fns[name] = functools.partial(forward, q, k, v, 0.0, causal)
            fns[f"{name} fb"] = functools.partial(
                _forward_backward, forward, backward, q, k, v, causal
            )
        t = timed(fns, args.repeats)
        rows.append(
            [
                length,
                f"{t['full'] * 1e3:.2f} ms",
                f"{t['causal'] * 1e3:.2f} ms",
                f"{t['causal'] / t['full']:.2f}×",
                f"{t['causal fb'] / t['full fb']:.2f}×",
                f"{os.getloadavg()[0]:.1f}",
            ]
        )
    print(
        markdown_table(
            ["S", "full, fwd", "causal, fwd", "causal / full", "causal / full, fwd+bwd", "load"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
