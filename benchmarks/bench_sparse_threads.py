"""How the block-sparse path's groups share the cores: the four ways, timed in one process.

* ``workers``: groups dealt to ``torch.get_num_threads()`` Python threads of one intra-op
  thread each (``threads=N``);
* ``one thread``: every group in the calling thread on one intra-op thread (``threads=1``);
* ``torch's threads``: every group in the calling thread, torch's intra-op threads in each op
  (no public knob: the kernel's ``run_groups`` is swapped here);
* ``measured choice``: ``threads=None``, the default (``threads.ThreadChoice``),
  after 12 calls in which it times both ways and settles.

Forward + backward, best and median of ``--repeats`` calls per way. ``--busy N`` runs N
spinning processes alongside (as DataLoader workers or other jobs would)::

    python benchmarks/bench_sparse_threads.py [--busy 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import busy_processes, documents, fmt_time, machine, markdown_table, save_json

import flexmask
from flexmask.backends.block_sparse import kernel
from flexmask.backends.block_sparse.api import block_sparse_attention

WAYS = ("workers", "one thread", "torch's threads", "measured choice")


def cases() -> dict[str, tuple[flexmask.Mask, int, int, int, int, int]]:
    """name: (mask, S, B, H, D, BLOCK_SIZE)."""

    def doc(S: int, B: int, mean: int) -> flexmask.Mask:
        lengths = [documents(S, seed, mean) for seed in range(B)]
        return flexmask.causal() & flexmask.document(lengths if B > 1 else lengths[0])

    return {
        "the demo's calls (512, B=2, D=32, BLOCK 32)": (doc(512, 2, 96), 512, 2, 4, 32, 32),
        "doc-20, 2k": (doc(2048, 1, 2048 // 20), 2048, 1, 4, 64, 128),
        "doc-20, 8k": (doc(8192, 1, 8192 // 20), 8192, 1, 4, 64, 128),
        "window 1024, 2k": (
            flexmask.causal() & flexmask.sliding_window(1024),
            2048,
            1,
            4,
            64,
            128,
        ),
    }


def time_ways(mask, S, B, H, D, block, repeats) -> dict[str, list[float]]:
    block_mask = flexmask.create_block_mask(mask, B, 1, S, S, "cpu", BLOCK_SIZE=block)
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    run_groups = kernel.run_groups
    threads = torch.get_num_threads()

    def call(way: str) -> None:
        for t in (q, k, v):
            t.grad = None
        option = {"workers": threads, "one thread": 1}.get(way)
        out = block_sparse_attention(
            q, k, v, block_mask, mask=mask, backend="sparse", threads=option
        )
        out.sum().backward()

    def in_this_thread(one, groups, *_):
        threads.in_this_thread(one, len(groups))

    times: dict[str, list[float]] = {}
    for way in WAYS:
        threads.CHOICE = threads.ThreadChoice()  # every case starts the choice afresh
        kernel.run_groups = in_this_thread if way == "torch's threads" else run_groups
        try:
            for _ in range(12 if way == "measured choice" else 1):  # warm-up
                call(way)
            times[way] = []
            for _ in range(repeats):
                begin = time.perf_counter()
                call(way)
                times[way].append(time.perf_counter() - begin)
        finally:
            kernel.run_groups = run_groups
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--busy", type=int, default=0, help="spinning processes alongside")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per way")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    print(machine(), f"torch threads {torch.get_num_threads()}, busy processes {args.busy}")
    rows, payload = [], []
    with busy_processes(args.busy):
        for name, (mask, S, B, H, D, block) in cases().items():
            times = time_ways(mask, S, B, H, D, block, args.repeats)
            rows.append(
                [name]
                + [
                    f"{fmt_time(min(times[w]))} / {fmt_time(statistics.median(times[w]))}"
                    for w in WAYS
                ]
            )
            payload.append(dict(case=name, busy=args.busy, times=times))
            print(rows[-1], flush=True)
    print(markdown_table(["case (best / median)", *WAYS], rows))
    save_json(args.json, dict(rows=payload))


if __name__ == "__main__":
    main()
