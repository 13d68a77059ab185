"""Build time with one intra-op thread (flexmask's default) vs torch's default thread count,
on a quiet machine and with one or two busy processes (as DataLoader workers would be), for
a closed-form build (document-causal, B=1 and B=8) and a tile build (a tree).

    python benchmarks/bench_threads.py [--seq-len 32768]
"""

from __future__ import annotations

import argparse
import os

import torch
from common import (
    best_time,
    busy_processes,
    documents,
    fmt_time,
    machine,
    markdown_table,
    response_tree,
)

import flexmask


def cases(S: int) -> dict[str, tuple[flexmask.Mask, int]]:
    return {
        "document-causal, B=1 (closed form)": (
            flexmask.causal() & flexmask.document(documents(S, 0)),
            1,
        ),
        "document-causal, B=8 (closed form)": (
            flexmask.causal() & flexmask.document([documents(S, s) for s in range(8)]),
            8,
        ),
        "tree, B=1 (tiles)": (flexmask.tree(response_tree(S, 0)), 1),
    }


def measure(mask: flexmask.Mask, B: int, S: int, threads: str) -> float:
    os.environ["FLEXMASK_BUILD_THREADS"] = threads
    return best_time(lambda: flexmask.create_block_mask(mask, B, 1, S, S, "cpu"), repeat=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=32768)
    args = parser.parse_args()
    S = args.seq_len
    default = str(torch.get_num_threads())
    rows = []
    for name, (mask, B) in cases(S).items():
        for busy in (0, 1, 2):
            with busy_processes(busy):
                one, many = measure(mask, B, S, "1"), measure(mask, B, S, default)
            label = f"{busy} busy process{'es' if busy != 1 else ''}" if busy else "quiet"
            rows.append([name, label, fmt_time(one), fmt_time(many), f"{many / one:.1f}×"])
    print(f"# Build threads, S={S}\n\n{machine()}\n")
    header = ["mask", "machine", "1 thread (default)", f"{default} threads", "slowdown"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
