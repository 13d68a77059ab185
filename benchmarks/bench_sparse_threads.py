"""How the block-sparse path's groups share the cores: the ways, timed in one process.

* ``workers``: groups dealt to ``torch.get_num_threads()`` Python threads of one intra-op
  thread each (``threads=N``);
* ``one thread``: every group in the calling thread on one intra-op thread (``threads=1``);
* ``torch's threads``: every group in the calling thread, torch's intra-op threads in each op
  (no public knob: the choice is swapped here for one that always picks it);
* ``choice``: ``threads=None``, the default (``threads.ThreadChoice`` with its
  ``CoreLoad``), after 12 calls in which it may time both ways and settle.

Forward + backward, best and median of ``--repeats`` calls per way, the ways taking turns
call by call (a burst of load hits every way alike). Printed beside them: the choice's
median over torch's threads' and over the workers', and the load average and the cores
other processes kept busy (``CoreLoad``) while the case ran. ``--busy N`` runs N spinning
processes alongside (as DataLoader workers or other jobs would)::

    python benchmarks/bench_sparse_threads.py [--busy 1]

``--demo`` times the demo's training instead (``examples/demo.py``, as ``make demo`` runs
it, with torch's default thread count): one run per way, the ways taking turns, each in a
fresh process whose thread choice is swapped for one way (``choice``: left alone)::

    python benchmarks/bench_sparse_threads.py --demo [--busy 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import busy_processes, documents, fmt_time, machine, markdown_table, save_json

import flexmask
from flexmask.backends import threads
from flexmask.backends.block_sparse.api import block_sparse_attention

WAYS = ("workers", "one thread", "torch's threads", "choice")
ROOT = Path(__file__).resolve().parent.parent


class Always(threads.ThreadChoice):
    """A thread choice that always picks ``way`` (``"torch"`` or ``"workers"``)."""

    def __init__(self, way: str) -> None:
        super().__init__()
        self.always = way

    def pick(self, kind: tuple[str, int]) -> str:
        return self.always


def cases() -> dict[str, tuple[flexmask.Mask, int, int, int, int, int]]:
    """name: (mask, S, B, H, D, BLOCK_SIZE)."""

    def doc(S: int, B: int, mean: int) -> flexmask.Mask:
        lengths = [documents(S, seed, mean) for seed in range(B)]
        return flexmask.causal() & flexmask.document(lengths if B > 1 else lengths[0])

    return {
        "the demo's calls (512, B=2, D=32, BLOCK 32)": (doc(512, 2, 96), 512, 2, 4, 32, 32),
        "doc-20, 2k": (doc(2048, 1, 2048 // 20), 2048, 1, 4, 64, 128),
        "doc-4, 8k": (doc(8192, 1, 8192 // 4), 8192, 1, 4, 64, 128),
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
    count = torch.get_num_threads()
    choices = {
        "workers": threads.ThreadChoice(),  # unused: threads=count
        "one thread": threads.ThreadChoice(),  # unused: threads=1
        "torch's threads": Always("torch"),
        "choice": threads.ThreadChoice(load=threads.CoreLoad()),
    }
    default = threads.CHOICE

    def call(way: str) -> None:
        threads.CHOICE = choices[way]
        for t in (q, k, v):
            t.grad = None
        option = {"workers": count, "one thread": 1}.get(way)
        out = block_sparse_attention(
            q, k, v, block_mask, mask=mask, kernel="sparse", threads=option
        )
        out.sum().backward()

    times: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for way in WAYS:  # warm-up; the choice settles
            for _ in range(12 if way == "choice" else 1):
                call(way)
        for _ in range(repeats):
            for way in WAYS:
                begin = time.perf_counter()
                call(way)
                times[way].append(time.perf_counter() - begin)
    finally:
        threads.CHOICE = default
    return times


def load_line(load: threads.CoreLoad) -> str:
    others = load.others()
    cores = "?" if others is None else f"{others:.1f}"
    return f"load {os.getloadavg()[0]:.1f}, others' cores {cores}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def kernel_main(args: argparse.Namespace) -> None:
    rows, payload = [], []
    load = threads.CoreLoad(period=0.0)
    with busy_processes(args.busy):
        for name, (mask, S, B, H, D, block) in cases().items():
            load.others()
            times = time_ways(mask, S, B, H, D, block, args.repeats)
            during = load_line(load)
            median = {w: statistics.median(times[w]) for w in WAYS}
            rows.append(
                [name]
                + [f"{fmt_time(min(times[w]))} / {fmt_time(median[w])}" for w in WAYS]
                + [
                    ratio(median["choice"], median["torch's threads"]),
                    ratio(median["choice"], median["workers"]),
                    during,
                ]
            )
            payload.append(dict(case=name, busy=args.busy, times=times, load=during))
            print(rows[-1], flush=True)
    header = ["case (best / median)", *WAYS, "choice / torch's", "choice / workers", "machine"]
    print(markdown_table(header, rows))
    save_json(args.json, dict(rows=payload))


DEMO_RUN = """
import json, runpy, sys
sys.path.insert(0, {examples!r})
sys.path.insert(0, {benchmarks!r})
from flexmask.backends import threads
import bench_sparse_threads
if {way!r} != "choice":
    threads.CHOICE = bench_sparse_threads.Always({way!r})
sys.argv = ["demo.py", "--threads", "0", "--out", {out!r}] + {extra!r}
runpy.run_path({demo!r}, run_name="__main__")
"""


def demo_once(way: str, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        code = DEMO_RUN.format(
            examples=str(ROOT / "examples"),
            benchmarks=str(ROOT / "benchmarks"),
            way=way,
            out=out,
            extra=extra,
            demo=str(ROOT / "examples" / "demo.py"),
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        if run.returncode:
            raise SystemExit(f"the demo failed ({way}):\n{run.stderr[-4000:]}")
        report = json.loads((Path(out) / "demo_report.json").read_text())
    return report["train_time_s"]


def demo_main(args: argparse.Namespace) -> None:
    ways = {"torch's threads": "torch", "workers": "workers", "choice": "choice"}
    extra = [] if args.steps is None else ["--steps", str(args.steps)]
    times: dict[str, list[float]] = {name: [] for name in ways}
    loads: list[str] = []
    with busy_processes(args.busy):
        for _ in range(args.rounds):
            for name, way in ways.items():
                times[name].append(demo_once(way, extra))
                # The load average only: the demo runs in a child, which CoreLoad counts as
                # another process.
                loads.append(f"{name}: load {os.getloadavg()[0]:.1f}")
                print(f"{name}: {times[name][-1]:.1f} s ({loads[-1]})", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(
        markdown_table(
            ["demo training (s, median)", *ways, "choice / torch's", "choice / workers"],
            [
                [f"{args.busy} busy process(es)"]
                + [f"{median[n]:.1f}" for n in ways]
                + [
                    ratio(median["choice"], median["torch's threads"]),
                    ratio(median["choice"], median["workers"]),
                ]
            ],
        )
    )
    save_json(args.json, dict(demo=times, busy=args.busy, loads=loads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--busy", type=int, default=0, help="spinning processes alongside")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per way")
    parser.add_argument("--demo", action="store_true", help="time the demo's training")
    parser.add_argument("--rounds", type=int, default=1, help="--demo: runs per way")
    parser.add_argument("--steps", type=int, default=None, help="--demo: training steps")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    print(
        machine(),
        f"torch threads {torch.get_num_threads()}, busy processes {args.busy}, "
        f"load {os.getloadavg()[0]:.1f}",
    )
    if args.demo:
        demo_main(args)
    else:
        kernel_main(args)


if __name__ == "__main__":
    main()
