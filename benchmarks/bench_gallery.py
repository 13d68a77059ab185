"""The cuDNN flex-attention suite's masks: flexmask's build and every lowering against torch's
compiled ``create_block_mask`` of the same mask, in one run, with each format's memory.

NVIDIA's cuDNN-frontend benchmarks its flex-attention endpoints on eight masks (causal,
document causal, local, sink + local, trees in DFS and BFS order, Longformer, packed HSTU);
``flexmask.gallery`` builds each from pieces. Per mask, size and batch this times, medians of
``--repeat`` rounds, interleaved, every flexmask cache cleared before each call:

* **torch**: ``torch.compile(create_block_mask)`` of the mask's ``mask_mod`` (warmed up at
  that shape first: its compile is not counted), at the dims the mask needs (B = 1 where no
  row differs, as flexmask builds it; B where rows hold different documents);
* **build**: ``flexmask.create_block_mask`` of the mask (128 x 128 blocks);
* each **lowering** (``flexmask.formats``), or "refuses" where its format cannot express the
  mask (the reason is in the lowering's ValueError).

Memory is the bytes of each result's tensors (the BlockMask's eight for build and torch).
The load before and after is printed; ratios are to torch's median in the same run.

Run from the repository root::

    OMP_NUM_THREADS=2 python benchmarks/bench_gallery.py               # 32k and 128k, B 1 and 8
    OMP_NUM_THREADS=2 python benchmarks/bench_gallery.py --quick       # 32k, B = 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

import torch  # noqa: E402
from common import fmt_bytes, fmt_time, machine, markdown_table  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask  # noqa: E402

import flexmask  # noqa: E402
from flexmask import formats  # noqa: E402
from flexmask.blocks import block_mask_nbytes  # noqa: E402
from flexmask.builders import block_stats  # noqa: E402


def suite(S: int, B: int, only: list[str] | None = None) -> dict[str, flexmask.Mask]:
    """The cuDNN suite's eight masks at S tokens (``flexmask.gallery.cudnn``, the suite's
    parameters). With B > 1, document_causal's rows hold different documents (seeds 42, 43,
    ...); the other masks are one for every row, as the suite's (it runs B = 1)."""
    from flexmask.gallery import cudnn

    masks = {name: cudnn.make_mask(name, S) for name in (only or cudnn.MASK_NAMES)}
    if B > 1 and "document_causal" in masks:
        rows = [cudnn.document_lengths(S, seed=42 + r) for r in range(B)]
        masks["document_causal"] = flexmask.causal() & flexmask.document(rows)
    return masks


LOWERINGS: dict[str, Callable[[flexmask.Mask, int, int], Any]] = {
    "to_varlen": lambda m, B, S: formats.to_varlen(m, B, 1, S, S),
    "to_flashmask": lambda m, B, S: formats.to_flashmask(m, B, 1, S),
    "to_magi": lambda m, B, S: formats.to_magi(m, B, 1, S, S),
    "to_fa4": lambda m, B, S: formats.to_fa4(m, B, 1, S, S),
    "to_fa4_varlen": lambda m, B, S: formats.to_fa4_varlen(m, B, 1, S, S),
    "to_cudnn": lambda m, B, S: formats.to_cudnn(m, B, 1, S, S),
    "to_cudnn_bsa": lambda m, B, S: formats.to_cudnn_bsa(m, B, 1, S, S),
    "to_cudnn_topk": lambda m, B, S: formats.to_cudnn_topk(m, B, 1, S, S, index_granularity=128),
    "to_flashinfer": lambda m, B, S: formats.to_flashinfer(m, B, 1, S, S),
}

_compiled = torch.compile(torch_create_block_mask)


def torch_build(mask: flexmask.Mask, B: int, S: int) -> BlockMask:
    rows = B if mask.batch_dependent else 1
    return _compiled(mask.mask_mod, rows, 1, S, S, device="cpu")


def flexmask_build(mask: flexmask.Mask, B: int, S: int) -> BlockMask:
    return flexmask.create_block_mask(mask, B, 1, S, S, device="cpu")


def nbytes(value: Any) -> int:
    """Bytes of the tensors a result holds (a BlockMask's eight; a dataclass's fields, tuples
    of tensors included)."""
    if isinstance(value, BlockMask):
        return block_mask_nbytes(value)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(nbytes(v) for v in value)
    if is_dataclass(value):
        return sum(nbytes(getattr(value, f.name)) for f in fields(value))
    return 0


def attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ValueError as err:
        return err


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    flexmask.cache_clear()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure(mask: flexmask.Mask, B: int, S: int, repeat: int) -> tuple[list[str], list[str]]:
    """(time cells, memory cells) of one mask at one size."""
    calls: dict[str, Callable[[], Any]] = {
        "torch": lambda: torch_build(mask, B, S),
        "build": lambda: flexmask_build(mask, B, S),
        **{name: (lambda f=f: attempt(lambda: f(mask, B, S))) for name, f in LOWERINGS.items()},
    }
    # A fresh compile per mask and size (each mask_mod is new to dynamo: past its recompile
    # limit it would fall back to eager), warmed up here and not counted.
    torch._dynamo.reset()
    results = {name: fn() for name, fn in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeat):  # interleaved: load changes hit all alike
        for name, fn in calls.items():
            if not isinstance(results[name], ValueError):
                times[name].append(timed(fn)[0])
    peer = statistics.median(times["torch"])
    stats = block_stats(results["build"], mask.mask_mod)
    time_cells = [f"{stats.density:.3f}", f"{stats.partial_share:.1%}", fmt_time(peer)]
    memory_cells = []
    for name in calls:
        if isinstance(results[name], ValueError):
            time_cells.append("refuses")
            memory_cells.append("-")
            continue
        if name != "torch":
            t = statistics.median(times[name])
            time_cells.append(f"{fmt_time(t)} ({t / peer:.2f}x)")
        memory_cells.append(fmt_bytes(nbytes(results[name])))
    return time_cells, memory_cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32k, B = 1 only")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--masks", nargs="+", help="only these mask names")
    args = parser.parse_args()
    sizes, batches = ([32768], [1]) if args.quick else (args.sizes, args.batches)
    print(f"machine: {machine()}; load before {os.getloadavg()[0]:.1f}", flush=True)
    time_rows, memory_rows = [], []
    for S in sizes:
        for B in batches:
            for name, mask in suite(S, B, args.masks).items():
                if args.masks and name not in args.masks:
                    continue
                cells, memory = measure(mask, B, S, args.repeat)
                time_rows.append([name, f"{S:,}", B, *cells])
                memory_rows.append([name, f"{S:,}", B, *memory])
                print(time_rows[-1], memory_rows[-1], flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}")
    print(
        markdown_table(
            ["mask", "S", "B", "density", "partial blocks", "torch compiled", "build", *LOWERINGS],
            time_rows,
        )
    )
    print(
        f"medians of {args.repeat} interleaved rounds, flexmask caches cleared before each "
        "call; ratios to torch's compiled create_block_mask of the same mask in the same run; "
        "density and partial blocks at 128 x 128"
    )
    print(markdown_table(["mask", "S", "B", "torch", "build", *LOWERINGS], memory_rows))


if __name__ == "__main__":
    main()
