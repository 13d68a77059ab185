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
import itertools
import math
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


def synchronize(device: str) -> None:
    """Waits for the device's queued kernels (a no-op on the CPU), so a wall time covers them."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeat: int, device: str = "cpu") -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    for _ in range(repeat - 1):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / repeat


def run(
    S: int,
    name: str,
    mask: flexmask.Mask,
    train: bool,
    repeat: int,
    B: int,
    H: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    gen = torch.Generator().manual_seed(S)
    q, k, v = (
        torch.randn(B, H, S, 64, generator=gen).to(device=device, dtype=dtype).requires_grad_(train)
        for _ in range(3)
    )
    block_mask = flexmask.create_block_mask(mask, B, 1, S, S, device=device)
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
    # torch's uncompiled forward materialises every score: a reference row, kept to sizes
    # whose scores fit easily (it is the CPU's reference; on a GPU, up to 8k).
    if not train and (torch.device(device).type == "cpu" or S <= 8192):
        calls["flex (eager)"] = lambda: torch_flex_attention(q, k, v, block_mask=block_mask)
    errors: dict[str, str] = {}
    for label, fn in list(calls.items()):  # warm up: caches, first-call allocations, compiles
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - a backend that fails is recorded, dropped
            errors[label] = f"{type(error).__name__}: {error}"[:500]
            del calls[label]
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    names = [b for b in names if b in calls]
    samples: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeat):  # interleaved, so a busy machine slows each alike
        for label, fn in calls.items():
            samples[label].append(timed(fn, 1, device))
    best = {label: statistics.median(times) for label, times in samples.items()}
    fastest = min((t for label, t in best.items() if label in names), default=float("nan"))
    return {
        "S": S,
        "mask": name,
        "pass": "fwd+bwd" if train else "fwd",
        "auto picks": chosen,
        "takers": names,
        "times": best,
        "auto / best": best.get("auto", float("nan")) / fastest,
        "errors": errors,
    }


def first_taker(order: tuple[str, ...], row: dict) -> str:
    """The backend ``order`` hands ``row``'s call to: its first that took the call."""
    return next(name for name in order if name in row["takers"])


def suggest_order(rows: list[dict], current: tuple[str, ...]) -> tuple[tuple[str, ...], dict]:
    """The order ``AUTO[device]`` should have from these rows' medians: of every order of the
        backends measured (those that took some call), the one whose first taker of each row is
        slowest against that row's fastest backend by the least (geometric mean over the rows,
        then the worst row; ties keep ``current``'s order), in the places the measured backends
    hold in ``current`` (the others stay where they are). Returns it with, for it and for
        ``current``, the geometric mean and the worst of those ratios."""
    measured = [n for n in backends.TABLE if any(n in row["takers"] for row in rows)]
    measured.sort(key=lambda n: current.index(n) if n in current else len(current))

    def cost(order: tuple[str, ...]) -> tuple[float, float]:
        ratios = []
        for row in (r for r in rows if r["takers"]):
            fastest = min(row["times"][n] for n in row["takers"])
            ratios.append(row["times"][first_taker(order, row)] / fastest)
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios)), max(ratios)

    if not measured:
        return current, {"suggested": (1.0, 1.0), "current": (1.0, 1.0)}
    best = min(itertools.permutations(measured), key=cost)  # first minimum: current's order
    # The measured backends take the measured ones' places in ``current``, in the best order;
    # the rest keep theirs (one that took no call is no evidence to move it).
    picks = iter(best)
    suggested = tuple(next(picks) if n in measured else n for n in current) + tuple(picks)
    current_measured = tuple(n for n in current if n in measured) + tuple(
        n for n in measured if n not in current
    )
    return suggested, {"suggested": cost(best), "current": cost(current_measured)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths")
    parser.add_argument(
        "--passes",
        nargs="+",
        choices=["fwd+bwd", "fwd"],
        default=["fwd+bwd", "fwd"],
        help="which passes (every fwd+bwd row runs before any fwd row)",
    )
    parser.add_argument("--heads", type=int, default=None, help="H (default 4; 16 on CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device).type
    on_cpu = device == "cpu"
    if args.lengths:
        lengths = tuple(args.lengths)
    elif on_cpu:
        lengths = (512, 1024) if args.quick else (1024, 2048, 4096)
    else:
        lengths = (1024, 4096) if args.quick else (4096, 16384)
    B, H = 2, args.heads or (4 if on_cpu else 16)
    dtype = torch.float32 if on_cpu else torch.bfloat16  # varlen takes only 16-bit
    print(f"machine: {machine()}")
    if not on_cpu:
        print(f"device: {torch.cuda.get_device_name(args.device)}")
    print(f"load before: {os.getloadavg()}")
    rows: list[dict] = []
    current = backends.AUTO.get(device, ())

    def save() -> None:  # after every row: a run cut short keeps what it measured
        suggested, costs = suggest_order(rows, current) if rows else ((), {})
        save_json(
            args.json,
            {
                "machine": machine(),
                "device": args.device,
                "dtype": str(dtype),
                "B": B,
                "H": H,
                "repeat": args.repeat,
                "rows": rows,
                "current_order": list(current),
                "suggested_order": list(suggested),
                "order_costs": costs,
            },
        )

    for train in [p == "fwd+bwd" for p in args.passes]:
        for S in lengths:
            for name, mask in masks(S).items():
                rows.append(run(S, name, mask, train, args.repeat, B, H, args.device, dtype))
                print(rows[-1], flush=True)
                save()
    print(f"load after: {os.getloadavg()}")
    labels = ["slices", "block_sparse", "sdpa", "flex (eager)", "auto"]
    if not on_cpu:
        labels = [n for n in backends.TABLE if any(n in r["times"] for r in rows)]
        labels += [n for n in ("flex (eager)", "auto") if n not in labels]
    table = []
    for row in rows:
        times = row["times"]
        fastest = min((t for label, t in times.items() if label in backends.TABLE), default=1.0)
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
        f"B={B}, H={H}, D=64, {str(dtype).removeprefix('torch.')}, {args.device}; medians of"
        f" {args.repeat} interleaved calls; ratios are to the fastest backend of the table"
    )
    suggested, costs = suggest_order(rows, current)
    print(
        f"\nAUTO[{device!r}] now:       {current}\n"
        f"AUTO[{device!r}] suggested: {suggested}\n"
        "(of every order of the backends measured, the one whose pick on each row is slowest "
        "against the row's fastest backend by the least: geometric mean "
        f"{costs['suggested'][0]:.2f}x, worst {costs['suggested'][1]:.2f}x; the order now: "
        f"{costs['current'][0]:.2f}x, worst {costs['current'][1]:.2f}x)"
    )
    for row in (r for r in rows if r["takers"]):
        now, then = first_taker(current, row), first_taker(suggested, row)
        if now != then:
            print(f"  S={row['S']} {row['mask']} {row['pass']}: {now} now, {then} suggested")
    failed = [(row["S"], row["mask"], row["pass"], row["errors"]) for row in rows if row["errors"]]
    for failure in failed:
        print(f"FAILED: S={failure[0]} {failure[1]} {failure[2]}: {failure[3]}")
    save()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
