"""Before against after: the headline rows of three benchmarks on two versions of flexmask.

Times the main rows of ``bench_build.py`` (``flexmask.create_block_mask`` of document-causal,
sliding window, tree, a union and ``per_head`` at 8k and 32k, B = 1 and 8, a fresh mask each
repeat so nothing a mask keeps from an earlier build is reused), ``bench_cpu_backward.py``
(``flexmask.attention(q, k, v, mask)`` forward + backward at 2k and 4k, B = 1, H = 4, D = 64
for causal, documents, a window and a tree) and ``bench_decode.py`` (``flexmask.decode_mask``
of one step, a ``DecodeMasks`` step, and ``flexmask.flex_attention`` of 1 and 16 queries
against a 4k and a 32k cache) on two versions of the package, through public names both
versions have. Each version is a ``git worktree`` of its commit (``--after worktree``: this
checkout as it is, uncommitted edits included), removed at exit.

Each round runs one fresh process per version (``PYTHONPATH`` = that tree; the child checks
``flexmask.__file__`` lies in it), alternating the order (ABBA: before-after, after-before,
...), so a change of load falls on both. Per row: the median of each version over every
timed call, after / before, the range of the per-round ratios, and the split-half noise: the
larger of before-vs-before and after-vs-after (the rounds that ran a version first against
those that ran it second). A row is within noise when its per-round ratios straddle 1 or
|ratio - 1| is at most the split-half noise. The load average is printed at the start, after
each round and at the end.

    python benchmarks/bench_before_after.py                        # ce3ec1a against this tree
    python benchmarks/bench_before_after.py --after HEAD --rounds 4 --markdown
    python benchmarks/bench_before_after.py --quick                # 2 rounds, few rows
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEP = "\t"  # between a row name's benchmark, case and shape

CHILD = r'''
import json, os, random, statistics, sys, time
import torch

tree_root = os.path.realpath(sys.argv[1])
repeat, quick, threads = int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
torch.set_num_threads(threads)
import flexmask

where = os.path.realpath(flexmask.__file__)
if not where.startswith(tree_root + os.sep):
    raise SystemExit(f"flexmask imported from {where}, not from {tree_root}")


def documents(S, seed):
    rng = random.Random(seed)
    mean = max(1, S // 32)
    lens = []
    while sum(lens) < S:
        lens.append(rng.randrange(max(1, mean // 4), 2 * mean))
    lens[-1] -= sum(lens) - S
    return [n for n in lens if n > 0]


def response_tree(S, seed, responses=8):
    rng = random.Random(seed)
    prompt = S // 4 + rng.randrange(max(1, S // 16))
    parents = [-1] + list(range(prompt - 1))
    rest = S - prompt
    for r in range(responses):
        n = rest // responses + (rest % responses if r == responses - 1 else 0)
        parents += [prompt - 1] + [len(parents) + i for i in range(n - 1)]
    return parents


def one(rows, B):
    return rows if B > 1 else rows[0]


results = {}
backends = {}
SEP = "\t"


def timed(name, fn, setup=None, n=repeat):
    """``fn(setup())`` once to warm up, then ``n`` timed calls, each on a fresh ``setup()``
    (four times as many where the warm-up took under 5 ms: short calls are noisier)."""
    start = time.perf_counter()
    fn(setup() if setup else None)
    if time.perf_counter() - start < 5e-3:
        n *= 4
    times = []
    for _ in range(n):
        arg = setup() if setup else None
        flexmask.cache_clear()
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    results[name] = times


# bench_build: builds of fresh masks (made outside the timing).
sizes = (8192,) if quick else (8192, 32768)
for S in sizes:
    for B in (1, 8):
        docs = [documents(S, s) for s in range(B)]
        trees = [response_tree(S, s) for s in range(B)]
        window = S // 8
        makers = {
            "document-causal": (1, lambda: flexmask.causal() & flexmask.document(one(docs, B))),
            "sliding window": (1, lambda: flexmask.causal() & flexmask.sliding_window(window)),
            "tree": (1, lambda: flexmask.tree(one(trees, B))),
            "doc-causal | prefix": (
                1,
                lambda: (flexmask.causal() & flexmask.document(one(docs, B)))
                | flexmask.prefix(64),
            ),
            "per_head": (
                2,
                lambda: flexmask.per_head(
                    flexmask.causal() & flexmask.document(one(docs, B)),
                    flexmask.causal() & flexmask.sliding_window(window),
                ),
            ),
        }
        for label, (H, make) in makers.items():
            timed(
                f"build{SEP}{label}{SEP}S={S // 1024}k B={B}",
                lambda m, B=B, H=H, S=S: flexmask.create_block_mask(m, B, H, S, S, device="cpu"),
                make,
            )
        # tree(parents) checks its rows when made and keeps what a build derives from
        # them: the making, and making + building, as a user pays them.
        shape = f"S={S // 1024}k B={B}"
        timed(f"build{SEP}tree, made{SEP}{shape}", lambda _: flexmask.tree(one(trees, B)))
        timed(
            f"build{SEP}tree, made + built{SEP}{shape}",
            lambda _, B=B, S=S: flexmask.create_block_mask(
                flexmask.tree(one(trees, B)), B, 1, S, S, device="cpu"
            ),
        )

# bench_cpu_backward: forward + backward, the Mask handed to flexmask.attention.
lengths = (2048,) if quick else (2048, 4096)
for S in lengths:
    docs = documents(S, S)
    masks = {
        "causal": flexmask.causal(),
        "document-causal": flexmask.causal() & flexmask.document(docs),
        "window 1024": flexmask.causal() & flexmask.sliding_window(1024),
        "tree": flexmask.tree(response_tree(S, 0)),
    }
    gen = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(1, 4, S, 64, generator=gen).requires_grad_() for _ in range(3))
    grad_out = torch.randn(1, 4, S, 64, generator=gen)

    def step(_, mask=None):
        for t in (q, k, v):
            t.grad = None
        flexmask.attention(q, k, v, mask).backward(grad_out)

    for label, mask in masks.items():
        name = f"fwd+bwd{SEP}{label}{SEP}S={S // 1024}k B=1 H=4"
        backends[name] = flexmask.explain(q, k, v, mask).backend
        timed(name, lambda _, m=mask: step(_, m), n=max(2, repeat // 2))

# bench_decode: one step's BlockMask, a DecodeMasks step, and the attention of a step.
capacities = (4096,) if quick else (4096, 32768)
for cap in capacities:
    for B in (1, 16):
        rng = random.Random(cap + B)
        lens = [rng.randrange(cap // 4, cap // 2) for _ in range(B)]
        docs = [documents(cap, s) for s in range(B)]
        cases = {
            "causal": flexmask.causal(),
            "documents": flexmask.causal() & flexmask.document(docs),
            "window 1024": flexmask.causal() & flexmask.sliding_window(1024),
            "tree": flexmask.tree([response_tree(cap, s) for s in range(B)]),
        }
        for label, mask in cases.items():
            at = [n + 7 for n in lens]
            timed(
                f"decode_mask{SEP}{label}{SEP}cap={cap // 1024}k B={B}",
                lambda _, m=mask, at=at: flexmask.decode_mask(m, at, 1, cap),
            )
            walk = [[n + j for n in lens] for j in range(4 * repeat + 2)]
            decode = flexmask.DecodeMasks(mask, walk[0], cap)
            _ = decode.at(walk[0]).block_mask
            position = iter(walk[1:])
            timed(
                f"decode step{SEP}{label}{SEP}cap={cap // 1024}k B={B}",
                lambda _, d=decode, p=position: d.at(next(p)).block_mask,
            )
for cap in capacities:
    for q_len in (1, 16):
        rng = random.Random(cap + q_len)
        lens = [cap - q_len - rng.randrange(0, 128)]
        gen = torch.Generator().manual_seed(cap + q_len)
        q = torch.randn(1, 8, q_len, 64, generator=gen)
        k = torch.randn(1, 8, cap, 64, generator=gen)
        v = torch.randn(1, 8, cap, 64, generator=gen)
        cases = {
            "causal": flexmask.causal(),
            "documents": flexmask.causal() & flexmask.document(documents(cap, 1)),
        }
        for label, mask in cases.items():
            block_mask = flexmask.decode_mask(mask, lens, q_len, cap)

            def call(_, bm=block_mask):
                with torch.no_grad():
                    flexmask.flex_attention(q, k, v, block_mask=bm)

            name = f"decode attention{SEP}{label}{SEP}cap={cap // 1024}k q_len={q_len} B=1 H=8"
            with torch.no_grad():
                backends[name] = flexmask.explain(q, k, v, block_mask).backend
            timed(name, call)

payload = {"file": where, "torch": torch.__version__, "results": results, "backends": backends}
print(json.dumps(payload))
'''


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def checkout(rev: str, scratch: Path) -> tuple[Path, str]:
    """A tree holding ``rev`` (a detached worktree, removed at exit), and its label."""
    if rev == "worktree":
        dirty = " + uncommitted edits" if _git("status", "--porcelain", "--", "flexmask") else ""
        return ROOT, f"working tree ({_git('rev-parse', '--short', 'HEAD')}{dirty})"
    commit = _git("rev-parse", "--short", f"{rev}^{{commit}}")
    path = scratch / f"tree-{commit}"
    _git("worktree", "add", "--detach", str(path), commit)

    def remove() -> None:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True
        )
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)

    atexit.register(remove)
    return path, commit


def run_child(tree: Path, child: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process timing every row on ``tree``: its times and the backends it ran."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(
        [
            sys.executable,
            str(child),
            str(tree),
            str(args.repeat),
            str(int(args.quick)),
            str(args.threads),
        ],
        cwd=child.parent,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"child for {tree} failed:\n{out.stderr[-4000:]}")
    payload = json.loads(out.stdout.strip().splitlines()[-1])
    return payload


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def summarize(
    rounds: list[dict[str, dict[str, list[float]]]],
    first: list[str],
    backends: dict[str, dict[str, str]],
) -> list[dict[str, Any]]:
    """Per row: medians, ratio, per-round ratio range, split-half noise, verdict."""
    rows = []
    for name in rounds[0]["before"]:
        bench, case, shape = name.split(SEP)
        ran = [backends[v].get(name, "") for v in ("before", "after")]
        pooled = {v: [t for r in rounds for t in r[v][name]] for v in ("before", "after")}
        med = {v: statistics.median(ts) for v, ts in pooled.items()}
        ratio = med["after"] / med["before"]
        per_round = [
            statistics.median(r["after"][name]) / statistics.median(r["before"][name])
            for r in rounds
        ]
        noise = 0.0
        for version in ("before", "after"):
            ahead = [
                t
                for r, f in zip(rounds, first, strict=True)
                if f == version
                for t in r[version][name]
            ]
            behind = [
                t
                for r, f in zip(rounds, first, strict=True)
                if f != version
                for t in r[version][name]
            ]
            if ahead and behind:
                split = statistics.median(ahead) / statistics.median(behind)
                noise = max(noise, abs(split - 1))
        low, high = min(per_round), max(per_round)
        within = low <= 1 <= high or abs(ratio - 1) <= noise
        rows.append(
            dict(
                bench=bench,
                case=case,
                shape=shape,
                backend=ran[0] if ran[0] == ran[1] else " → ".join(ran),
                before=med["before"],
                after=med["after"],
                ratio=ratio,
                low=low,
                high=high,
                noise=noise,
                within=within,
            )
        )
    return rows


HEADER = [
    "benchmark",
    "case",
    "shape",
    "backend",
    "before",
    "after",
    "after / before",
    "per-round ratios",
    "split-half noise",
    "within noise",
]


def cells(r: dict) -> list[str]:
    return [
        r["bench"],
        r["case"],
        r["shape"],
        r["backend"] or "—",
        fmt(r["before"]),
        fmt(r["after"]),
        f"{r['ratio']:.2f}×",
        f"{r['low']:.2f}–{r['high']:.2f}",
        f"±{r['noise']:.2f}",
        "yes" if r["within"] else "**no, faster**" if r["ratio"] < 1 else "**no, slower**",
    ]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def plain(rows: list[dict]) -> str:
    table = [HEADER, *(cells(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="ce3ec1a", help="commit (default ce3ec1a)")
    parser.add_argument(
        "--after", default="worktree", help='commit, or "worktree" (this checkout as it is)'
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each runs both versions")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per row per process")
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads")
    parser.add_argument("--quick", action="store_true", help="2 rounds, the smaller rows only")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table too")
    parser.add_argument("--json", default=None, help="write every timing here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.repeat = min(args.rounds, 2), min(args.repeat, 3)

    scratch = Path(tempfile.mkdtemp(prefix="flexmask-before-after-"))
    atexit.register(shutil.rmtree, scratch, True)
    trees = {"before": checkout(args.before, scratch), "after": checkout(args.after, scratch)}
    child = scratch / "child.py"
    child.write_text(CHILD)
    print(
        f"before: {trees['before'][1]}; after: {trees['after'][1]}; {args.rounds} rounds "
        f"(ABBA), {args.repeat} timed calls per row per process, {args.threads} thread(s); "
        f"load average at start {load()}",
        flush=True,
    )
    started = time.perf_counter()
    rounds: list[dict[str, dict[str, list[float]]]] = []
    first: list[str] = []
    backends: dict[str, dict[str, str]] = {}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        ran = {v: run_child(trees[v][0], child, args) for v in order}
        rounds.append({v: ran[v]["results"] for v in order})
        backends = {v: ran[v]["backends"] for v in order}
        first.append(order[0])
        print(
            f"round {i + 1}/{args.rounds} ({order[0]} first) done at "
            f"{time.perf_counter() - started:.0f} s, load {load()}",
            flush=True,
        )
    rows = summarize(rounds, first, backends)
    print(f"\nload average at end {load()}, {time.perf_counter() - started:.0f} s in all\n")
    print(plain(rows))
    outside = [r for r in rows if not r["within"]]
    slower = sum(r["ratio"] > 1 for r in outside)
    print(
        f"\n{len(rows) - len(outside)} of {len(rows)} rows within noise; outside it "
        f"{len(outside) - slower} faster, {slower} slower"
    )
    if args.markdown:
        print()
        print(markdown(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                dict(
                    before=trees["before"][1],
                    after=trees["after"][1],
                    order=first,
                    backends=backends,
                    rounds=rounds,
                    rows=rows,
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
