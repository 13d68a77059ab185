"""Runs every benchmark and writes its block of docs/benchmarks.md from its JSON (``make bench``).

Each benchmark runs as its own process (``python benchmarks/<name>.py ... --json
out/bench/<name>.json``): torch's compile caches, allocator and thread pools start fresh for
each. Their printed output is echoed and kept in ``out/bench/<name>.md``; each benchmark's block
of the page (between its ``<!-- make bench: name -->`` comments) is formatted here from the
JSON, so every number in a block comes from this run; the sections around the blocks, pasted
by hand from other runs, are kept. The page also gets a log-log plot of build time against S
(docs/img/).

    python benchmarks/run_all.py                     # everything (~20-25 min on 2 cores)
    python benchmarks/run_all.py --quick             # small sizes, to check it works (~3 min)
    python benchmarks/run_all.py --only lazy forward # some benchmarks (page lists only those)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import bench_build
import bench_cpu_backward
import bench_forward
import bench_lazy
import torch
from common import ROOT, fmt_bytes, fmt_time

import flexmask

OUT = ROOT / "out" / "bench"
DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "img" / "build_time_vs_seq_len.png"


# ----------------------------------------------------------------------------- per benchmark
def build_section(data: dict[str, Any]) -> list[str]:
    rows = data["results"]
    table = bench_build.table(rows)
    first = data["first_call"]
    lines = [
        "Build time of the BlockMask (best of several calls; torch compiled after its first-call "
        'compile) and the peak extra memory of one build. "—": skipped, too large for this '
        "machine (eager needs ~10 bytes × B × S² of temporaries) or too slow (compiled). "
        '"path": *closed form* — an `&` of interval pieces, written from the intervals at block '
        "edges with no tile grid ([how](blocks.md#6-the-closed-form-for-intervals)); *columns* — "
        "a tree in preorder, written from its kv block columns, no tile grid either; *tiles* — "
        'every tile classified from structure, "tiles evaluated" of them refined by evaluating '
        "the mask.",
        "",
        table,
        "",
        f"Fresh process, document-causal S={first['S']:,} B=1: `import flexmask` "
        f"{fmt_time(first['import_s'])}, first build {fmt_time(first['build_s'])} "
        "(no compile step).",
    ]
    cold = data.get("cold_builds", [])
    if cold:
        lines += [
            "",
            "The table's builds run after `settle_allocator()` (benchmarks/common.py) has freed "
            "one 32 MB block, as any training step does: until then glibc hands each freed "
            "BlockMask back to the OS and the next build faults its output pages back in. A "
            "fresh process doing nothing but builds, document-causal: "
            + "; ".join(
                f"S={c['S']:,} B={c['B']}: best {fmt_time(c['best_s'])}, "
                f"median {fmt_time(c['median_s'])} of 10"
                for c in cold
            )
            + ".",
        ]
    if plot_build(rows):
        lines += ["", f"![Build time against sequence length](img/{PLOT.name})"]
    return lines


def plot_build(rows: list[dict[str, Any]]) -> bool:
    """Log-log build time against S, document-causal B=1. False if nothing to plot."""
    points = sorted(
        (r for r in rows if r["mask"] == "document-causal" and r["B"] == 1), key=lambda r: r["S"]
    )
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for key, label, style in (
        ("flexmask_s", "flexmask.create_block_mask", "o-"),
        ("eager_s", "torch create_block_mask (eager)", "s--"),
        ("compiled_s", "torch create_block_mask (compiled)", "^--"),
    ):
        xs = [r["S"] for r in points if r[key] is not None]
        ys = [r[key] for r in points if r[key] is not None]
        if xs:
            ax.plot(xs, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([r["S"] for r in points], [f"{r['S']:,}" for r in points])
    ax.minorticks_off()
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("build time (s)")
    ax.set_title("BlockMask build, document-causal, B=1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT)
    plt.close(fig)
    return True


def lazy_section(data: dict[str, Any]) -> list[str]:
    mem = data["memory"]
    lazy = mem["lazy"]
    n, S = mem["micro_batches"], mem["S"]
    memory_table = bench_lazy.memory_table(mem)
    cost_table = bench_lazy.cost_table(data["costs"])
    verdict = "PASS" if mem["passed"] else "FAIL"
    return [
        f"Gradient accumulation over {n} micro-batches at S = {S:,} (B=1, each with its own "
        "random documents, `causal() & document(lens)`); the forward is a cheap op reading the "
        'BlockMask. "Handles + cache" is each built handle\'s BlockMask plus '
        "`cache_info().bytes` (the built handle's BlockMask is the cached object, so it counts "
        'twice); "BlockMasks alive" counts distinct objects. The allocator peak covers the '
        "whole loop, builds' temporaries included.",
        "",
        memory_table,
        "",
        f"Target — lazy peak ≤ one micro-batch's BlockMask ({fmt_bytes(mem['one_block_mask'])}) "
        f"+ the cache's bound ({fmt_bytes(mem['cache_bound'])}: {mem['cache_bound_text']}): "
        f"{fmt_bytes(lazy['accounted_peak'])} ≤ {fmt_bytes(mem['target_bytes'])} → "
        f"**{verdict}**. The cache held at most {fmt_bytes(lazy['cache_peak'])}: a released "
        "handle whose mask carries per-batch data evicts it.",
        "",
        "Cost of a cache hit (`MaskCache.get` on an equal mask made from different Python "
        "objects), of a handle's first use on a miss, and of a build (document-causal, B=1; "
        f"best of {data['repeats']['hit']} hits / {data['repeats']['build']} builds). A hit "
        "is not free: every `get` validates its arguments against the mask and assembles the "
        'key; the key\'s content part is computed when the mask is made, so "make mask + hit" '
        "is what a step pays when it rebuilds an equal mask from its data.",
        "",
        cost_table,
    ]


def cpu_backward_section(data: dict[str, Any]) -> list[str]:
    table = bench_cpu_backward.table(data["rows"])
    return [
        f"Forward + backward on the CPU (D={data['head_dim']}, fp32; masks: causal, "
        "document-causal with N random documents, causal sliding window, an RL group tree): "
        "`flexmask.block_sparse.block_sparse_attention` with its defaults (the implementation "
        "column names the backend it chose) against `scaled_dot_product_attention` with a "
        "dense bool mask (built inside the timed call: it is the price of using SDPA with a "
        "mask), interleaved in one run. Median time; peak of tensors alive at once.",
        "",
        table,
    ]


def forward_section(data: dict[str, Any]) -> list[str]:
    table = bench_forward.table(data["results"])
    return [
        "`torch.compile(flex_attention, dynamic=False)` forward on the CPU (B=1, "
        f"H={data['heads']}, D={data['head_dim']}, fp32, no grad): flexmask's mask_mod "
        "(`mask.mask_mod_for(S, S)` in a BlockMask from `flexmask.create_block_mask`) against "
        "attn-gym's hand-written one (BlockMask from torch's `create_block_mask`) — same kernel, "
        f"same inputs; best of {data['repeat']} calls per side, the two interleaved. The "
        f"sliding window is attn-gym's `generate_sliding_window({data['window']})` against "
        f"`causal() & sliding_window({data['window'] + 1})`.",
        "",
        table,
        "",
        f"Target — flexmask within {data['target']:.0%} of the hand-written mask_mod: "
        f"**{'PASS' if data['passed'] else 'FAIL'}**; outputs agree within 1e-5: "
        f"{'yes' if data['agree'] else '**no**'}.",
        "",
        "† Much shorter when torch's on-disk compile cache already holds the graph (a second "
        "run on the same machine).",
    ]


# --------------------------------------------------------------------------------- the runner
@dataclass
class Benchmark:
    name: str
    title: str
    section: Callable[[dict[str, Any]], list[str]]
    quick_args: list[str] = field(default_factory=lambda: ["--quick"])
    full_args: list[str] = field(default_factory=list)

    @property
    def script(self) -> Path:
        return ROOT / "benchmarks" / f"{self.name}.py"


BENCHMARKS = [
    # bench_build's --quick only cuts repeats: the sizes are cut here.
    Benchmark(
        "bench_build",
        "BlockMask build: flexmask vs torch.create_block_mask",
        build_section,
        quick_args=["--quick", "--sizes", "1024", "4096", "--batches", "1"],
    ),
    Benchmark("bench_lazy", "Lazy handles and the mask cache", lazy_section),
    Benchmark(
        "bench_cpu_backward", "CPU forward + backward: block-sparse vs SDPA", cpu_backward_section
    ),
    Benchmark(
        "bench_forward",
        "Compiled flex_attention forward: flexmask vs attn-gym mask_mods",
        forward_section,
    ),
]


def machine_lines() -> list[str]:
    cpu = platform.processor() or platform.machine()
    memory = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
            memory = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    return [
        f"- CPU: {cpu}, {os.cpu_count()} logical cores (torch uses {torch.get_num_threads()} "
        "threads)",
        f"- RAM: {memory}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, "
        f"flexmask {flexmask.__version__}, {platform.system()} {platform.release()}",
    ]


def run(bench: Benchmark, quick: bool) -> dict[str, Any]:
    """Runs one benchmark, echoing its output; returns its JSON, command and timing."""
    OUT.mkdir(parents=True, exist_ok=True)
    json_path = OUT / f"{bench.name}.json"
    json_path.unlink(missing_ok=True)  # never report a previous run's numbers
    args = [
        *(bench.quick_args if quick else bench.full_args),
        "--json",
        str(json_path.relative_to(ROOT)),
    ]
    command = ["python", str(bench.script.relative_to(ROOT)), *args]
    print(f"\n$ {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    printed: list[str] = []
    with open(OUT / f"{bench.name}.stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, *command[1:]],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # echo their progress as it comes
        )
        assert process.stdout is not None
        for line in process.stdout:
            print(line, end="", flush=True)
            printed.append(line)
        code = process.wait()
    seconds = time.perf_counter() - start
    (OUT / f"{bench.name}.md").write_text("".join(printed))
    data = json.loads(json_path.read_text()) if code == 0 and json_path.exists() else None
    if data is None:
        tail = (OUT / f"{bench.name}.stderr.txt").read_text().splitlines()[-15:]
        print(f"!! {bench.name} failed (exit {code}):\n" + "\n".join(tail), file=sys.stderr)
    return dict(command=shlex.join(command), seconds=seconds, code=code, data=data)


def marker(name: str) -> tuple[str, str]:
    """The comments around the block ``make bench`` owns in docs/benchmarks.md: everything
    else on the page (sections pasted by hand from other runs, notes inside a section) is
    kept as it is."""
    return (
        f"<!-- make bench: {name} (regenerated; edit outside) -->",
        f"<!-- /make bench: {name} -->",
    )


def merge(page: str, blocks: list[tuple[str, str, list[str]]]) -> str:
    """``page`` with each ``(name, title, lines)`` block written between its markers, or,
    where the page has none, appended as a new section ``## title``."""
    for name, title, lines in blocks:
        start, end = marker(name)
        body = "\n".join([start, "", *lines, "", end])
        at, stop = page.find(start), page.find(end)
        if at >= 0 and stop > at:
            page = page[:at] + body + page[stop + len(end) :]
        else:
            page = page.rstrip("\n") + f"\n\n## {title}\n\n{body}\n"
    return page


HEADER = [
    "# Benchmarks",
    "",
    "Every benchmark measures flexmask and its alternative in the same run on the same "
    "machine, so the ratios describe the machine it names. The blocks between "
    "`<!-- make bench -->` comments are regenerated by `make bench` (`benchmarks/run_all.py`), "
    "each from its benchmark's JSON; the rest was written by hand from the runs it cites.",
]


def write_doc(
    runs: dict[str, dict[str, Any]],
    command: str,
    quick: bool,
    started: datetime,
    load: tuple[float, float],
) -> None:
    """Writes this run's blocks into docs/benchmarks.md, keeping everything around them."""
    lines: list[str] = []
    if quick:
        lines += [
            '!!! warning "Quick run"',
            "    These numbers come from `--quick`: small sizes and few repeats, to check that the "
            "benchmarks run. They are not the report; run `make bench` for it.",
            "",
        ]
    lines += [
        *machine_lines(),
        f"- Date: {started:%Y-%m-%d %H:%M} UTC; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end",
        "",
        "```bash",
        command,
        "```",
        "",
        "which ran:",
        "",
        "```bash",
        *(r["command"] for r in runs.values()),
        "```",
        "",
        "Raw JSON and printed output: `out/bench/<name>.json` and `out/bench/<name>.md`.",
    ]
    skipped = [b.name for b in BENCHMARKS if b.name not in runs]
    if skipped:
        lines += [
            "",
            f"This run left out (`--only`): {', '.join(f'`{n}`' for n in skipped)}; their "
            "blocks below are from an earlier run.",
        ]
    blocks = [("machine", "Machine and command", lines)]
    for bench in BENCHMARKS:
        if bench.name not in runs:
            continue
        result = runs[bench.name]
        body = [f"`benchmarks/{bench.name}.py`, {result['seconds']:.0f} s.", ""]
        if result["data"] is None:
            body.append(
                f"**Failed** (exit code {result['code']}); see `out/bench/{bench.name}.stderr.txt`."
            )
        else:
            body += bench.section(result["data"])
        blocks.append((bench.name, bench.title, body))
    page = DOC.read_text(encoding="utf-8") if DOC.exists() else "\n".join(HEADER) + "\n"
    DOC.write_text(merge(page, blocks), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats (passes --quick to each benchmark)",
    )
    names = [b.name for b in BENCHMARKS]
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        default=None,
        help=f"run only these ({', '.join(names)}; the bench_ prefix is optional)",
    )
    args = parser.parse_args()

    selected = BENCHMARKS
    if args.only:
        wanted = {n.removesuffix(".py").removeprefix("bench_") for n in args.only}
        unknown = wanted - {n.removeprefix("bench_") for n in names}
        if unknown:
            parser.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {names}")
        selected = [b for b in BENCHMARKS if b.name.removeprefix("bench_") in wanted]

    command = shlex.join(["python", "benchmarks/run_all.py", *sys.argv[1:]])
    started = datetime.now(timezone.utc)
    load_start = os.getloadavg()[0]
    runs = {bench.name: run(bench, args.quick) for bench in selected}
    write_doc(runs, command, args.quick, started, (load_start, os.getloadavg()[0]))
    total = sum(r["seconds"] for r in runs.values())
    print(f"\nWrote {DOC.relative_to(ROOT)} ({total:.0f} s of benchmarks).")
    failed = [name for name, r in runs.items() if r["data"] is None]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
