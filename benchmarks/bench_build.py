"""BlockMask build: flexmask (from structure) against torch's create_block_mask, one run.

For each mask and size: flexmask's build time and peak extra memory, torch eager's and
torch compiled's (steady state, after the first-call compile), and the ratios. Torch runs are
skipped where they could not fit this machine (eager needs ~10 bytes x B x S^2 of temporary
memory) or would take minutes (compiled is O(B x S^2)); the table says so.

    python benchmarks/bench_build.py                      # the full table (~10 min, 2 cores)
    python benchmarks/bench_build.py --sizes 1024 4096 --batches 1 --quick
    python benchmarks/bench_build.py --masks tree tree-insertion composed --sizes 4096 32768 \
        --batches 1 --quick --eager-limit-gb 1 --compiled-limit 0 --no-fresh

The "floor" column is what writing the output alone costs: filling torch's four index
tensors of that shape, ``(B, H, nq, nkv)`` int32, in memory already resident, measured in the
same run; "vs floor" is the build over it (the target is within 2x); it runs on the builds' intra-op
thread count (``FLEXMASK_BUILD_THREADS``, default 1). Allocation is left out
of the floor: whether the allocator hands out fresh pages (a page fault per 4 KiB) or reuses
resident ones swings it by 100x at 131k within one run, and it is the same for any builder.
"fresh write" allocates and fills the eight tensors of the BlockMask on the pages the allocator
hands out (fresh small pages where it maps them: at 131k B=8 it is most of any build's cost), and
"vs fresh write" is the build over it. Where builds advise their outputs onto huge pages
(``blocks.memory``, on Linux unless FLEXMASK_HUGE_PAGES=0), "fresh write, huge pages" is the same
write into memory advised so, and "vs it" the build over that: the floor such a build is held to.
Outputs of 1M entries or more are also written again from the runs the build expanded them from
(``runs_write``: fresh tensors, the kv pair beside the q pair, as a build writes them): "runs
write" is that over the fresh write, and the build over it what the build's own passes
(classification, run finding, ranks) add to its write. "vs document-causal" is the build over the
document-causal closed form of the same shape (B, H, S), measured in the same run (always measured,
also when ``--masks`` leaves it out); each row's line also prints the load average when it
finished. Each row calls its build, the document-causal build and the fresh write in turn (at least
5 rounds), so a change of load on a shared machine falls on all three: both ratios are given of the
minimums and of the medians. "ops" counts the torch operator calls of one build (views included)
and "ops x small op" is that count times one call on a one-element tensor measured in the same run:
a lower bound on any build made of that many eager torch calls, whatever their size.

``--device cuda`` (or any ``--device``) measures another table instead (``run_device``): at
S = 32k, 131k, 524k and 1M (B = 1, H = 1), flexmask's build on that device against torch's compiled
``create_block_mask`` there (first call, then the best of 3), whether the two BlockMasks
agree block for block, and the host syncs of one flexmask build: the warnings of
``torch.cuda.set_sync_debug_mode("warn")`` (CUDA only) and, on any device, the ops that wait
for the device or copy between host and device (``.item()``, ``nonzero``, cross-device
copies), counted at dispatch::

    python benchmarks/bench_build.py --device cuda --json out/gpu/bench_build.json
    python benchmarks/bench_build.py --device cpu --sizes 1024 --quick   # the same path, CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _memory import peak_extra_bytes
from common import (
    best_time,
    documents,
    fmt_bytes,
    fmt_time,
    machine,
    markdown_table,
    mask_cases,
    ratio,
    save_json,
    settle_allocator,
)
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.utils._python_dispatch import TorchDispatchMode

import flexmask
from flexmask.blocks import (  # runs: its writers, recorded (runs_write)
    huge_pages_on,
    index_tensors,
    runs,
    side_by_side,
)
from flexmask.blocks.memory import ADVISED_FROM
from flexmask.builders import make_grid
from flexmask.builders.create import build_counted
from flexmask.builders.sides import in_closed_form
from flexmask.builders.threads import cpu_threads

FIRST_CALL = """
import time
t0 = time.perf_counter()
import flexmask
t1 = time.perf_counter()
from common import documents
mask = flexmask.causal() & flexmask.document(documents({S}, 0))
t2 = time.perf_counter()
flexmask.create_block_mask(mask, 1, 1, {S}, {S}, device="cpu")
t3 = time.perf_counter()
print(t1 - t0, t3 - t2)
"""


COLD_BUILDS = """
import time
import torch
torch.set_num_threads({threads})
import flexmask
from common import documents
mask = flexmask.causal() & flexmask.document([documents({S}, s) for s in range({B})])
times = []
for _ in range(10):
    t0 = time.perf_counter()
    flexmask.create_block_mask(mask, {B}, 1, {S}, {S}, device="cpu")
    times.append(time.perf_counter() - t0)
print(min(times), sorted(times)[len(times) // 2])
"""


def insertion_tree(S: int, seed: int, sequences: int = 16) -> list[int]:
    """A trie of ``sequences`` sequences with tokens numbered as inserted (AReaL's layout):
    each sequence shares a random prefix of a random earlier one, then appends its own
    tokens. Not a preorder: a branch inserted later lands after unrelated sequences."""
    gen = torch.Generator().manual_seed(seed)
    parents: list[int] = []
    paths: list[list[int]] = []
    per = max(1, S // sequences)
    while len(parents) < S:
        path: list[int] = []
        if paths:
            base = paths[int(torch.randint(0, len(paths), (1,), generator=gen))]
            path = base[: int(torch.randint(0, len(base) + 1, (1,), generator=gen))]
        for _ in range(min(per, S - len(parents))):
            parents.append(path[-1] if path else -1)
            path.append(len(parents) - 1)
        paths.append(path)
    return parents


def build_cases(S: int, B: int) -> dict[str, flexmask.Mask]:
    """The shared cases (``common.mask_cases``), the tile path's (a tree in insertion
    order, and unions of interval pieces) and the newer pieces' (``piece_cases``)."""
    docs = [documents(S, seed) for seed in range(B)]
    cases = mask_cases(S, B)
    cases["tree-insertion"] = flexmask.tree(
        [insertion_tree(S, s) for s in range(B)] if B > 1 else insertion_tree(S, 0)
    )
    cases["window|prefix"] = flexmask.sliding_window(max(1, S // 8)) | flexmask.prefix(min(S, 64))
    cases["doc-causal|prefix"] = (
        flexmask.causal() & flexmask.document(docs if B > 1 else docs[0])
    ) | flexmask.prefix(min(S, 64))
    cases.update(piece_cases(S, B))
    # Two heads, two masks: a document-causal head and a window head (HEADS says H).
    cases["per_head"] = flexmask.per_head(
        flexmask.causal() & flexmask.document(docs if B > 1 else docs[0]),
        flexmask.causal() & flexmask.sliding_window(max(1, S // 8)),
    )
    return cases


HEADS = {"per_head": 2}
"""Heads of a row (1 where not named): per_head's cycle."""


def write_floor(B: int, H: int, nq: int, nkv: int, repeat: int) -> float:
    """Best time to fill torch's four index tensors of a build's shape, already resident."""
    out = [
        torch.empty((B, H, n, m), dtype=torch.int32).fill_(0)
        for n, m in ((nq, nkv), (nkv, nq), (nq, nkv), (nkv, nq))
    ]

    def write() -> None:
        with cpu_threads(torch.device("cpu")):  # the builds' thread count
            for t in out:
                t.fill_(1)

    # Cheap, and on a shared machine single runs stall: the best of many.
    return best_time(write, repeat=max(repeat, 20))


def fresh_write_once(B: int, H: int, nq: int, nkv: int, huge: bool = False) -> None:
    """Allocates and fills torch's eight BlockMask tensors of a build's shape (four counts,
    four indices, int32) once: whatever pages the allocator hands out (at 131k B=8, 32 MiB
    each, fresh ones from the OS), or with ``huge`` as a build allocates them
    (``blocks.index_tensors``: large ones advised onto huge pages, where the build does)."""
    with cpu_threads(torch.device("cpu")):  # the builds' thread count
        shapes = [
            (B, H, nq),
            (B, H, nq, nkv),
            (B, H, nkv),
            (B, H, nkv, nq),
            (B, H, nq),
            (B, H, nq, nkv),
            (B, H, nkv),
            (B, H, nkv, nq),
        ]
        if huge:
            out = [t.fill_(1) for t in index_tensors(shapes, torch.device("cpu"))]
        else:
            out = [torch.empty(shape, dtype=torch.int32).fill_(1) for shape in shapes]
        del out


def runs_write(build: Callable[[], Any], entries: int) -> Callable[[], None] | None:
    """The write floor of a build made of runs: its four index tensors (``entries`` each)
    written again from the runs the build expanded them from (recorded on one build), into
    fresh tensors, the kv pair beside the q pair as a build writes them
    (``blocks.pair.side_by_side``); None where the build wrote them otherwise (row by row, a
    copy of a reduced row). What is over it is the build's own passes: classification, run
    finding, ranks."""
    recorded: list[tuple[Callable[..., None], Tensor, Tensor]] = []
    real = {name: getattr(runs, name) for name in ("_expand_runs_chunked", "_expand_runs_cumsum")}

    def recording(name: str) -> Callable[..., None]:
        def call(out: Tensor, starts: Tensor, lens: Tensor) -> None:
            if out.numel() == entries:
                recorded.append((real[name], starts.clone(), lens.clone()))
            real[name](out, starts, lens)

        return call

    try:
        for name in real:
            setattr(runs, name, recording(name))
        build()
    finally:
        for name, fn in real.items():
            setattr(runs, name, fn)
    if len(recorded) != 4:
        return None

    def write_pair(pair: list[tuple[Callable[..., None], Tensor, Tensor]]) -> None:
        for fn, starts, lens in pair:
            (out,) = index_tensors([(entries,)], torch.device("cpu"))  # as the build's
            fn(out, starts, lens)

    def write() -> None:
        with cpu_threads(torch.device("cpu")):  # the builds' thread count
            side_by_side(
                lambda: write_pair(recorded[:2]),
                lambda: write_pair(recorded[2:]),
                entries,
                torch.device("cpu"),
            )

    return write


def interleaved(fns: list[Callable[[], Any]], repeat: int) -> list[list[float]]:
    """Wall times of ``repeat`` rounds, each calling every one of ``fns`` in turn (after one
    warm-up round): on a shared machine a change of load falls on all of them, so their
    ratios (of minimums, of medians) compare like with like."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> int:
    """Torch operator calls ``fn`` makes (what reaches dispatch: views and copies included)."""
    with _CountOps() as counter:
        fn()
    return counter.calls


def small_op_time() -> float:
    """One eager torch call on a one-element tensor: the fixed cost every op of a build pays."""
    a, b = torch.ones(1), torch.ones(1)

    def calls() -> None:
        for _ in range(1000):
            torch.add(a, b)

    return best_time(calls, repeat=20) / 1000


def _fresh_process(code: str) -> list[float]:
    """The numbers a snippet prints, run in a fresh Python process."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=__file__.rsplit("/", 1)[0],
    )
    return [float(x) for x in out.stdout.split()]


def cold_builds(S: int, B: int) -> tuple[float, float]:
    """(best, median) of 10 document-causal builds in a fresh process that does nothing
    else: glibc has not settled (see common.settle_allocator)."""
    best, median = _fresh_process(COLD_BUILDS.format(S=S, B=B, threads=torch.get_num_threads()))
    return best, median


def first_call(S: int) -> tuple[float, float]:
    """(import time, first build time) in a fresh Python process."""
    imp, build = _fresh_process(FIRST_CALL.format(S=S))
    return imp, build


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of bench_build's rows (printed here, and on the benchmark page)."""
    return markdown_table(
        [
            "mask",
            "path",
            "B",
            "S",
            "flexmask",
            "flexmask peak",
            "torch eager",
            "eager peak",
            "torch compiled",
            "compiled first call",
            "vs eager",
            "vs compiled",
            "tiles evaluated",
            "H",
            "floor",
            "vs floor",
            "fresh write",
            "vs fresh write",
            "fresh write, huge pages",
            "vs it",
            "vs document-causal",
            "vs doc-causal (medians)",
            "vs fresh write (medians)",
            "ops",
            "ops × small op",
        ],
        [
            [
                r["mask"],
                r["path"],
                r["B"],
                f"{r['S']:,}",
                fmt_time(r["flexmask_s"]),
                fmt_bytes(r["flexmask_bytes"]),
                fmt_time(r["eager_s"]),
                fmt_bytes(r["eager_bytes"]),
                fmt_time(r["compiled_s"]),
                fmt_time(r["compiled_first_s"]),
                ratio(r["eager_s"], r["flexmask_s"]),
                ratio(r["compiled_s"], r["flexmask_s"]),
                f"{r['refined_tiles']:,}/{r['tiles']:,}" if r["path"] == "tiles" else "none",
                r["H"],
                fmt_time(r.get("floor_s")),
                ratio(r["flexmask_s"], r.get("floor_s")),
                fmt_time(r.get("fresh_s")),
                ratio(r["flexmask_s"], r.get("fresh_s")),
                fmt_time(r.get("fresh_huge_s")),
                ratio(r["flexmask_s"], r.get("fresh_huge_s")),
                ratio(r["flexmask_s"], r.get("document_s")),
                ratio(r.get("flexmask_median_s"), r.get("document_median_s")),
                ratio(r.get("flexmask_median_s"), r.get("fresh_median_s")),
                f"{r['ops']:,}" if "ops" in r else "—",
                fmt_time(r.get("ops_s")),
            ]
            for r in rows
        ],
    )


def image_ids(S: int, seed: int) -> list[int]:
    """Span ids of text with images: four 256-token images (Gemma 3's size), one early in
    each quarter of the sequence, shifted by the row's seed; -1 for text."""
    ids = [-1] * S
    size = min(256, max(1, S // 8))
    for k in range(4):
        start = k * (S // 4) + (64 * seed) % max(1, S // 4 - size)
        ids[start : start + size] = [k] * size
    return ids


def piece_cases(S: int, B: int) -> dict[str, flexmask.Mask]:
    """Rows for the newer pieces, both written in closed form: Llama 4's chunked local
    attention (8192-token chunks, a quarter of the sequence below 32k) and text with images
    (``causal() | spans(ids)``)."""
    ids = [image_ids(S, seed) for seed in range(B)]
    return {
        "chunked-causal": flexmask.causal() & flexmask.chunked(min(8192, max(1, S // 4))),
        "causal|spans": flexmask.causal() | flexmask.spans(ids if B > 1 else ids[0]),
    }


DEVICE_SIZES = [32768, 131072, 524288, 1048576]
DEVICE_MASKS = ["causal", "document-causal", "tree"]


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_time(fn: Callable[[], Any], device: str, repeat: int) -> float:
    """Best wall time of ``repeat`` calls, each waited for on the device (after one warm-up)."""

    def waited() -> None:
        fn()
        synchronize(device)

    return best_time(waited, repeat=repeat, warmup=1)


_SYNCING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::equal")


class _CountSyncs(TorchDispatchMode):
    """Ops that make the host wait for the device or move data between them: ``.item()``,
    ``nonzero``, ``equal``, and copies whose source and result sit on different devices."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        label = None
        if name in _SYNCING:
            label = name.removeprefix("aten::")
        elif name in ("aten::_to_copy", "aten::copy_", "aten::to", "aten::_copy_from"):
            sources = [a for a in args if isinstance(a, torch.Tensor)]
            results = out if isinstance(out, (list, tuple)) else [out]
            devices = {t.device.type for t in [*sources, *results] if isinstance(t, torch.Tensor)}
            if len(devices) > 1:
                label = "host<->device copy"
        if label:
            self.ops[label] = self.ops.get(label, 0) + 1
        return out


def count_syncs(fn: Callable[[], Any], device: str) -> dict[str, Any]:
    """One call's host syncs: torch's sync debug warnings (CUDA only, else None) and the
    syncing ops counted at dispatch."""
    import warnings

    debug = None
    with _CountSyncs() as counter:
        if torch.device(device).type == "cuda":
            synchronize(device)
            previous = torch.cuda.get_sync_debug_mode()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    fn()
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            debug = sum("synchroniz" in str(w.message) for w in caught)
        else:
            fn()
    return {"sync_debug_warnings": debug, "syncing_ops": counter.ops}


def _dense(num: torch.Tensor | None, idx: torch.Tensor | None, columns: int) -> torch.Tensor:
    """A BlockMask's (count, index) pair as a (B, H, rows, columns) bool grid."""
    if num is None or idx is None:
        return torch.zeros(0, dtype=torch.bool)
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    target = torch.where(listed, idx.long(), columns)
    grid = torch.zeros(*idx.shape[:-1], columns + 1, dtype=torch.bool, device=idx.device)
    grid.scatter_(-1, target, True)
    return grid[..., :columns]


def same_blocks(ours: Any, theirs: Any) -> bool:
    """Whether two BlockMasks list the same partial and the same full blocks."""
    columns = ours.kv_indices.shape[-1]
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        a = _dense(getattr(ours, num), getattr(ours, idx), columns)
        b = _dense(getattr(theirs, num), getattr(theirs, idx), columns)
        if a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
            return False
    return True


def compiled_row(
    compiled_builder: Any,
    mask: flexmask.Mask,
    ours: Any,
    B: int,
    H: int,
    S: int,
    device: str,
    row: dict[str, Any],
) -> dict[str, Any]:
    """torch's compiled build of the same mask on ``device``: first call, best of 3, and
    whether it lists the blocks ``ours`` lists. torch failing (out of memory at 1M, say) is
    recorded as ``compiled_error``: the yardstick's failure, not flexmask's."""
    out: dict[str, Any] = {}
    try:
        mod = mask.mask_mod_for(S, S, device)

        def theirs_build() -> Any:
            return compiled_builder(mod, B, H, S, S, device)

        start = time.perf_counter()
        theirs = theirs_build()
        synchronize(device)
        out["compiled_first_s"] = time.perf_counter() - start
        out["compiled_s"] = device_time(theirs_build, device, 3)
        out["vs_compiled"] = out["compiled_s"] / row["flexmask_s"]
        out["same_blocks"] = same_blocks(ours, theirs)
    except Exception as error:  # noqa: BLE001 - recorded, the row goes on
        out["compiled_error"] = f"{type(error).__name__}: {error}"[:500]
    return out


def run_device(args: argparse.Namespace) -> None:
    """flexmask's build on ``args.device`` against torch's compiled create_block_mask there,
    with the host syncs of one build; the JSON is written after every row."""
    device = args.device
    sizes = args.sizes or DEVICE_SIZES
    masks = args.masks or DEVICE_MASKS
    repeat = 3 if args.quick else 5
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "CPU"
    print(f"# BlockMask build on {device} ({name}): flexmask vs compiled create_block_mask\n")
    print(machine(), "\n", flush=True)
    torch._dynamo.config.recompile_limit = 256
    compiled_builder = torch.compile(torch_create_block_mask, dynamic=False)
    rows: list[dict[str, Any]] = []

    def save() -> None:
        save_json(
            args.json, {"machine": machine(), "device": device, "device_name": name, "rows": rows}
        )

    B = 1
    for S in sizes:
        # Only what is asked: the newer rows' Python-made trees and ids take seconds at 1M.
        cases = mask_cases(S, B) if set(masks) <= set(mask_cases(64, 1)) else build_cases(S, B)
        for mask_name in masks:
            mask = cases[mask_name]
            H = HEADS.get(mask_name, 1)
            row: dict[str, Any] = dict(mask=mask_name, S=S, B=B, H=H, device=device)
            try:

                def build(m: flexmask.Mask = mask, H: int = H, S: int = S) -> Any:
                    return flexmask.create_block_mask(m, B, H, S, S, device)

                start = time.perf_counter()
                ours = build()
                synchronize(device)
                row["flexmask_first_s"] = time.perf_counter() - start
                row["flexmask_s"] = device_time(build, device, repeat)
                row.update(count_syncs(build, device))
                if args.compiled_limit >= B * H * S * S:
                    row.update(compiled_row(compiled_builder, mask, ours, B, H, S, device, row))
                del ours
            except Exception as error:  # noqa: BLE001 - a row that fails is recorded, not fatal
                row["error"] = f"{type(error).__name__}: {error}"[:500]
            if torch.device(device).type == "cuda":
                row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            rows.append(row)
            print(
                f"  S={S:>8} {mask_name:16} flexmask {fmt_time(row.get('flexmask_s'))} "
                f"(first {fmt_time(row.get('flexmask_first_s'))}) compiled torch "
                f"{fmt_time(row.get('compiled_s'))} (first {fmt_time(row.get('compiled_first_s'))})"
                f" {ratio(row.get('compiled_s'), row.get('flexmask_s'))} same blocks "
                f"{row.get('same_blocks', '—')} syncs {row.get('sync_debug_warnings', '—')} "
                f"{row.get('syncing_ops', {})} {row.get('error', '')}"
                f"{' torch: ' + row['compiled_error'] if 'compiled_error' in row else ''}",
                flush=True,
            )
            save()
    print()
    print(
        markdown_table(
            [
                "mask",
                "S",
                "flexmask",
                "flexmask first",
                "torch compiled",
                "compiled first call",
                "vs compiled",
                "same blocks",
                "sync warnings",
                "syncing ops",
                "error",
            ],
            [
                [
                    r["mask"],
                    f"{r['S']:,}",
                    fmt_time(r.get("flexmask_s")),
                    fmt_time(r.get("flexmask_first_s")),
                    fmt_time(r.get("compiled_s")),
                    fmt_time(r.get("compiled_first_s")),
                    ratio(r.get("compiled_s"), r.get("flexmask_s")),
                    r.get("same_blocks", "—"),
                    "—" if r.get("sync_debug_warnings") is None else r["sync_debug_warnings"],
                    ", ".join(f"{k} {v}" for k, v in r.get("syncing_ops", {}).items()) or "none",
                    " ".join(
                        f"{who}: {r[key]}"
                        for who, key in (("flexmask", "error"), ("torch", "compiled_error"))
                        if key in r
                    ),
                ]
                for r in rows
            ],
        )
    )
    save()
    if any("error" in r or r.get("same_blocks") is False for r in rows):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--device",
        default=None,
        help="measure the build on this device against compiled torch there (run_device); "
        "default: the CPU table",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--masks", nargs="+", default=None)
    parser.add_argument(
        "--eager-limit-gb",
        type=float,
        default=12.0,
        help="skip torch eager where 10*B*S^2 bytes exceed this",
    )
    parser.add_argument(
        "--compiled-limit",
        type=float,
        default=None,
        help="skip compiled torch where B*S^2 exceeds this many elements",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument(
        "--no-fresh", action="store_true", help="skip the fresh-process first-call/cold lines"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.device is not None:
        if args.compiled_limit is None:
            args.compiled_limit = 1.2e12  # 1M x 1M: a GPU's compiled build evaluates it all
        run_device(args)
        return
    args.sizes = args.sizes or [1024, 4096, 16384, 32768, 65536]
    if args.compiled_limit is None:
        args.compiled_limit = 8.6e9
    repeat = 3 if args.quick else 10

    print(f"# BlockMask build: flexmask vs torch.create_block_mask\n\n{machine()}\n")
    # One graph per (mask, S, B): raise dynamo's default limit of 8, past which it would
    # silently fall back to eager and the "compiled" column would lie.
    torch._dynamo.config.recompile_limit = 256
    compiled_builder = torch.compile(torch_create_block_mask, dynamic=False)
    settle_allocator()
    small_op = small_op_time()
    print(f"one eager torch call on a one-element tensor: {fmt_time(small_op)}\n")
    results = []
    for B in args.batches:
        for S in args.sizes:
            # Every row's yardsticks, measured in this run at the row's shape: the
            # document-causal build (always measured, also under --masks) and the write.
            cases = build_cases(S, B)
            document_s: dict[int, float] = {}
            for name, mask in cases.items():
                if args.masks and name not in args.masks and name != "document-causal":
                    continue
                H = HEADS.get(name, 1)
                # What the build did: the closed form (no tiles) or tiles, some refined.
                grid = make_grid(mask, B, H, S, S, "cpu", 128)
                _, refined = build_counted(mask, grid)
                path = (
                    "closed form"
                    if in_closed_form(mask)
                    else "columns"
                    if mask.block_columns(grid) is not None
                    else "tiles"
                )

                def build(m: flexmask.Mask = mask, B: int = B, H: int = H, S: int = S) -> None:
                    flexmask.create_block_mask(m, B, H, S, S, "cpu")

                def document(
                    d: flexmask.Mask = cases["document-causal"], B: int = B, H: int = H, S: int = S
                ) -> None:
                    flexmask.create_block_mask(d, B, H, S, S, "cpu")

                def write(
                    B: int = B,
                    H: int = H,
                    nq: int = grid.num_q_blocks,
                    nkv: int = grid.num_kv_blocks,
                ) -> None:
                    fresh_write_once(B, H, nq, nkv)

                def write_huge(
                    B: int = B,
                    H: int = H,
                    nq: int = grid.num_q_blocks,
                    nkv: int = grid.num_kv_blocks,
                ) -> None:
                    fresh_write_once(B, H, nq, nkv, huge=True)

                # The build, the document-causal build and the fresh write in turn, so a
                # change of load falls on all three: ratios of minimums and of medians. Long
                # builds also against the write of their own runs (``runs_write``).
                entries = B * H * grid.num_q_blocks * grid.num_kv_blocks
                from_runs = runs_write(build, entries) if entries >= 1 << 20 else None
                # Where builds advise huge pages (``blocks.memory``), the same write into them.
                huge = huge_pages_on() and entries * 4 >= ADVISED_FROM
                extra = [f for f in (write_huge if huge else None, from_runs) if f is not None]
                times = interleaved([build, document, write, *extra], repeat=max(repeat, 5))
                ours, document_s[H], fresh = (min(t) for t in times[:3])
                ours_median, document_median, fresh_median = (
                    statistics.median(t) for t in times[:3]
                )
                fresh_huge = min(times[3]) if huge else None
                runs_s = min(times[-1]) if from_runs else None
                runs_median = statistics.median(times[-1]) if from_runs else None
                ours_mem, _ = peak_extra_bytes(build)
                floor = write_floor(B, H, grid.num_q_blocks, grid.num_kv_blocks, repeat)
                ops = count_ops(build)
                row = dict(
                    mask=name,
                    path=path,
                    S=S,
                    B=B,
                    H=H,
                    refined_tiles=refined,
                    tiles=grid.num_q_blocks * grid.num_kv_blocks * B * H,
                    flexmask_s=ours,
                    flexmask_bytes=ours_mem,
                    floor_s=floor,
                    fresh_s=fresh,
                    fresh_huge_s=fresh_huge,
                    ops=ops,
                    ops_s=ops * small_op,
                    eager_s=None,
                    eager_bytes=None,
                    compiled_s=None,
                    compiled_first_s=None,
                    compiled_bytes=None,
                    document_s=document_s[H],
                    flexmask_median_s=ours_median,
                    document_median_s=document_median,
                    fresh_median_s=fresh_median,
                    runs_write_s=runs_s,
                    runs_write_median_s=runs_median,
                )
                if args.eager_limit_gb * 2**30 >= 10 * B * H * S * S:
                    row["eager_s"] = best_time(
                        lambda m=mask, B=B, H=H, S=S: torch_create_block_mask(
                            m.mask_mod, B, H, S, S, "cpu"
                        ),
                        repeat=1 if S >= 16384 else 3,
                        warmup=0 if S >= 16384 else 1,
                    )
                    row["eager_bytes"], _ = peak_extra_bytes(
                        lambda m=mask, B=B, H=H, S=S: torch_create_block_mask(
                            m.mask_mod, B, H, S, S, "cpu"
                        )
                    )
                if args.compiled_limit >= B * H * S * S:
                    mod = mask.mask_mod_for(S, S, "cpu")
                    start = time.perf_counter()
                    compiled_builder(mod, B, H, S, S, "cpu")
                    row["compiled_first_s"] = time.perf_counter() - start
                    row["compiled_s"] = best_time(
                        lambda mod=mod, B=B, H=H, S=S: compiled_builder(mod, B, H, S, S, "cpu"),
                        repeat=3,
                        warmup=0,
                    )
                    row["compiled_bytes"], _ = peak_extra_bytes(
                        lambda mod=mod, B=B, H=H, S=S: compiled_builder(mod, B, H, S, S, "cpu")
                    )
                results.append(row)
                print(
                    f"  B={B} H={H} S={S:>6} {name:16} flexmask {fmt_time(ours):>9} "
                    f"vs doc-causal {ratio(ours, document_s[H])} "
                    f"(median {ratio(ours_median, document_median)}) "
                    f"vs fresh write {ratio(ours, fresh)} ({fmt_time(fresh)}; "
                    f"median {ratio(ours_median, fresh_median)}) "
                    + (
                        f"vs fresh write on huge pages {ratio(ours, fresh_huge)} "
                        f"({fmt_time(fresh_huge)}) "
                        if fresh_huge
                        else ""
                    )
                    + (
                        f"runs write {ratio(runs_s, fresh)} of the fresh write (median "
                        f"{ratio(runs_median, fresh_median)}), the build {ratio(ours, runs_s)} "
                        f"of it (median {ratio(ours_median, runs_median)}) "
                        if runs_s
                        else ""
                    )
                    + f"eager {fmt_time(row['eager_s']):>9} "
                    f"compiled {fmt_time(row['compiled_s']):>9}"
                    f" refined {refined}/{row['tiles']} floor {fmt_time(floor)}"
                    f" ({ratio(ours, floor)}) ops {ops} x small op {fmt_time(ops * small_op)}"
                    f" load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )

    print()
    print(table(results))
    if args.no_fresh:
        save_json(args.json, {"machine": machine(), "results": results})
        return
    imp, first = first_call(32768)
    print(
        f"\nFresh process, document-causal S=32768 B=1: import flexmask {fmt_time(imp)}, "
        f"first build {fmt_time(first)} (no compile step)."
    )
    cold = {B: cold_builds(32768, B) for B in (1, 8)}
    for B, (best, median) in cold.items():
        print(
            f"Fresh process doing only builds (allocator not settled), document-causal "
            f"S=32768 B={B}: best {fmt_time(best)}, median {fmt_time(median)} of 10."
        )
    save_json(
        args.json,
        {
            "machine": machine(),
            "results": results,
            "first_call": {"import_s": imp, "build_s": first, "S": 32768},
            "cold_builds": [
                {"S": 32768, "B": B, "best_s": best, "median_s": median}
                for B, (best, median) in cold.items()
            ],
        },
    )


if __name__ == "__main__":
    main()
