"""Shared by the benchmarks: timing, the machine line, the masks measured, markdown tables."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable as `python benchmarks/x.py` without installing
    sys.path.insert(0, str(ROOT))

import flexmask  # noqa: E402


def settle_allocator() -> None:
    """Puts glibc's malloc in the state any training process reaches after its first step.

    Until the process frees one block of a few MB that malloc had mapped on its own, glibc
    keeps its mmap/trim thresholds at their start values: each BlockMask freed between two
    builds is handed back to the OS, and the next build faults every page of its outputs
    back in (~2.3 µs a page on the benchmark VM: ~5 ms for the 8 MB of index tensors at
    B=8, S=32k). Freeing one 32 MB block (activations, gradients) raises the thresholds for
    the rest of the process. bench_build measures builds after this, and reports a fresh
    process without it separately (``cold_builds``).
    """
    block = torch.empty(32 << 20, dtype=torch.uint8)
    block.fill_(0)
    del block


def _spin(stop) -> None:  # a busy process: pure Python, no torch threads
    count = 0
    while not stop.is_set():
        count += 1


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` spinning processes for the duration, as DataLoader workers or other jobs
    would take cores."""
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(count)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()


def best_time(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1) -> float:
    """Best wall time of ``repeat`` calls after ``warmup`` calls, in seconds."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, "
        f"flexmask {flexmask.__version__}"
    )


def documents(S: int, seed: int, mean: int | None = None) -> list[int]:
    """Random document lengths filling exactly S tokens (mean S/32 unless given)."""
    gen = torch.Generator().manual_seed(seed)
    mean = mean or max(1, S // 32)
    lens: list[int] = []
    while sum(lens) < S:
        lens.append(int(torch.randint(max(1, mean // 4), 2 * mean, (1,), generator=gen)))
    lens[-1] -= sum(lens) - S
    return [n for n in lens if n > 0]


def response_tree(S: int, seed: int, responses: int = 8) -> list[int]:
    """A shared prompt then ``responses`` branches, laid out in preorder (as pack_one_tree does)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = S // 4 + int(torch.randint(0, max(1, S // 16), (1,), generator=gen))
    parents = [-1] + list(range(prompt - 1))
    rest = S - prompt
    for r in range(responses):
        n = rest // responses + (rest % responses if r == responses - 1 else 0)
        parents += [prompt - 1] + [len(parents) + i for i in range(n - 1)]
    return parents


def mask_cases(S: int, B: int) -> dict[str, flexmask.Mask]:
    """The masks every build benchmark measures. Rows differ when B > 1."""
    rows = range(B)
    docs = [documents(S, seed) for seed in rows]
    case = {
        "causal": flexmask.causal(),
        "document-causal": flexmask.causal() & flexmask.document(docs if B > 1 else docs[0]),
        "tree": flexmask.tree(
            [response_tree(S, s) for s in rows] if B > 1 else response_tree(S, 0)
        ),
        "padding-causal": flexmask.causal()
        & flexmask.padding([S - (S // 7) * (s % 3) for s in rows]),
        "composed": (
            flexmask.causal()
            & flexmask.document(docs if B > 1 else docs[0])
            & flexmask.sliding_window(max(1, S // 8))
        )
        | flexmask.prefix(min(S, 64)),
    }
    return case


def ratio(a: float | None, b: float | None, digits: int | None = None) -> str:
    """a / b as "12×"; two decimals below 10 unless ``digits`` is given; "—" if unknown."""
    if a is None or not b:
        return "—"
    value = a / b
    return f"{value:,.{(0 if value >= 10 else 2) if digits is None else digits}f}×"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    # A `|` inside a cell (a union's name) would split it: escape it.
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def save_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))
