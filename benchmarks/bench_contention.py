"""CPU attention under contention: ``flexmask.attention`` (what ``flex_attention`` runs on the
CPU) against SDPA on the same masks, with one and with two busy processes beside it (as
DataLoader workers or other jobs take cores), both in one run.

SDPA gets its best form of each mask: ``is_causal=True`` for plain causal (no mask at all),
else a dense bool mask built before the timing (its cost not counted). Each row times the two
interleaved (flexmask, SDPA, flexmask, ...) and reports medians, their ratio and the load.

    python benchmarks/bench_contention.py            # S = 2k, 4k; no grad and fwd+bwd
    python benchmarks/bench_contention.py --quick    # S = 1k
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import busy_processes, documents, markdown_table, response_tree  # noqa: E402

import flexmask  # noqa: E402


def masks(S: int) -> dict[str, flexmask.Mask]:
    return {
        "causal": flexmask.causal(),
        "document-causal": flexmask.causal() & flexmask.document(documents(S, 0)),
        "sliding window S/8": flexmask.causal() & flexmask.sliding_window(S // 8),
        "tree": flexmask.tree(response_tree(S, 0)),
    }


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def row(name: str, mask: flexmask.Mask, S: int, grad: bool, repeat: int) -> tuple[float, ...]:
    q, k, v = (torch.randn(1, 4, S, 64, requires_grad=grad) for _ in range(3))
    dense = None if name == "causal" else mask.to_dense(1, 1, S, S)

    def ours() -> None:
        out = flexmask.attention(q, k, v, mask)
        if grad:
            out.sum().backward()

    def sdpa() -> None:
        if dense is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        if grad:
            out.sum().backward()

    context = torch.enable_grad() if grad else torch.no_grad()
    with context:
        ours(), sdpa()  # warm: the lowering is cached after the first call, as in training
        pairs = [(timed(ours), timed(sdpa)) for _ in range(repeat)]
    a = statistics.median(p[0] for p in pairs)
    b = statistics.median(p[1] for p in pairs)
    return a, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--busy", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    lengths = [1024] if args.quick else [2048, 4096]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {torch.get_num_threads()} threads")
    print(f"load at start: {os.getloadavg()}")
    rows = []
    worst = 0.0
    for busy in args.busy:
        with busy_processes(busy):
            for S in lengths:
                for name, mask in masks(S).items():
                    for grad in (False, True):
                        ours, sdpa = row(name, mask, S, grad, args.repeat)
                        worst = max(worst, ours / sdpa)
                        rows.append(
                            [
                                busy,
                                S,
                                name,
                                "fwd+bwd" if grad else "no grad",
                                f"{ours * 1e3:.1f} ms",
                                f"{sdpa * 1e3:.1f} ms",
                                f"{ours / sdpa:.2f}x",
                            ]
                        )
                        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print(f"load at end: {os.getloadavg()}")
    header = ["busy", "S", "mask", "pass", "flexmask", "SDPA", "flexmask / SDPA"]
    print(markdown_table(header, rows))
    print(f"worst ratio: {worst:.2f}x")


if __name__ == "__main__":
    main()
