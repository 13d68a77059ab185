"""A window by depth over packed trees: the build of ``tree & sliding_window(w, positions=depths)``
against the build of the tree alone and of ``tree & sliding_window(w)`` (packed distance),
in one run; and a transformers sliding layer over packed documents.

Trees from ``pack_tree_batch`` of GRPO-like groups (a prompt of 200-2000 tokens, 8 responses of
100-1500 each), ``w = 1024``, B rows of S tokens. Each row times the three builds
interleaved (every cache cleared), medians and minimums of ``--repeat`` rounds, one thread
unless ``FLEXMASK_BUILD_THREADS`` says otherwise, load printed.

The second table: the sliding and chunked layers ``flexmask.integrations.transformers``
builds for a packed batch of documents (``pack``, positions restarting in every document),
as ``attention_masks`` builds them for a PackedBatch (a window of offsets; documents cut
every chunk from their starts: closed forms) and as ``layer_mask`` builds them from the
position_ids (the one-sided window of positions; a window of 1 over chunk ids), against
each written as a plain
mask_mod over the positions (``from_mask_mod``, every tile the documents leave open
evaluated: what the integration built before) and the documents' mask alone; window and
chunk 1024.

    python benchmarks/bench_position_window.py                   # 8k, 32k B=1; 131k B=8
    python benchmarks/bench_position_window.py --quick           # 8k B=1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import machine, markdown_table  # noqa: E402

import flexmask  # noqa: E402
from flexmask.integrations.transformers import _packed_layer_mask, layer_mask  # noqa: E402
from flexmask.packing import pack, pack_tree_batch  # noqa: E402

WINDOW = 1024


def grpo_trees(S: int, B: int, seed: int = 0) -> flexmask.packing.TreeBatch:
    """At least B rows of S tokens of GRPO groups packed as trees (the first B kept)."""
    rng = np.random.default_rng(seed)
    sequences: list[list[int]] = []
    while True:
        prompt = rng.integers(1, 50, size=int(rng.integers(200, 2000))).tolist()
        for _ in range(8):
            sequences.append(
                prompt + rng.integers(1, 50, size=int(rng.integers(100, 1500))).tolist()
            )
        if sum(len(s) for s in sequences) > 1.3 * S * B:
            batch = pack_tree_batch(sequences, max_tokens=S)
            if batch.tokens.shape[0] >= B:
                return batch


def packed_documents(S: int, B: int, seed: int = 0) -> flexmask.packing.PackedBatch:
    """About B rows of S tokens of documents of 50-4000 tokens, packed by ``pack``."""
    rng = np.random.default_rng(seed)
    docs = [list(range(int(n))) for n in rng.integers(50, 4000, size=B * S // 2100)]
    return pack(docs, S)


def timed(mask: flexmask.Mask, B: int, S: int) -> float:
    flexmask.cache_clear()
    start = time.perf_counter()
    flexmask.create_block_mask(mask, B, 1, S, S, "cpu")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    shapes = [(8192, 1)] if args.quick else [(8192, 1), (32768, 1), (32768, 8), (131072, 8)]
    print(f"# Window by depth over packed trees\n\n{machine()}\n")
    rows = []
    for S, B in shapes:
        batch = grpo_trees(S, B)
        parents = batch.parents[:B]
        depths = batch.position_ids[:B]
        tree = flexmask.tree(parents)
        masks = {
            "tree": tree,
            "& window by depth": tree & flexmask.sliding_window(WINDOW, positions=depths),
            "& window (packed)": tree & flexmask.sliding_window(WINDOW),
        }
        load = os.getloadavg()[0]
        times: dict[str, list[float]] = {name: [] for name in masks}
        for _ in range(args.repeat):
            for name, mask in masks.items():
                times[name].append(timed(mask, B, S))
        base = statistics.median(times["tree"])
        cells = []
        for name in masks:
            median = statistics.median(times[name])
            cells.append(
                f"{median * 1e3:.1f} ms ({median / base:.1f}x; min {min(times[name]) * 1e3:.1f})"
            )
        rows.append([f"{S:,}", B, *cells, f"{load:.1f}"])
        print(rows[-1], flush=True)
    print()
    print(markdown_table(["S", "B", *masks, "load"], rows))
    print(f"\nmedians of {args.repeat} interleaved rounds, caches cleared; w = {WINDOW}")
    print("\n# transformers' sliding and chunked layers over packed documents\n")
    rows = []
    for S, B in [(8192, 1)] if args.quick else [(8192, 1), (32768, 1), (32768, 4)]:
        batch = packed_documents(S, B)
        B = batch.num_rows
        pos = batch.position_ids.clone()
        size = torch.tensor(WINDOW)

        def within(b, h, q_idx, kv_idx, pos=pos, size=size):  # type: ignore[no-untyped-def]
            return pos[b, q_idx] - pos[b, kv_idx] < size

        def same_chunk(b, h, q_idx, kv_idx, pos=pos, size=size):  # type: ignore[no-untyped-def]
            return pos[b, q_idx] // size == pos[b, kv_idx] // size

        plain = flexmask.from_mask_mod(within, key=("bench window", S, B))
        chunks = flexmask.from_mask_mod(same_chunk, key=("bench chunks", S, B))
        packed = {
            kind: _packed_layer_mask(kind, batch, sliding=WINDOW, chunk=WINDOW)
            for kind in ("sliding_attention", "chunked_attention")
        }
        masks = {
            "documents": batch.mask,
            "window (PackedBatch)": packed["sliding_attention"],
            "window (positions)": layer_mask(
                "sliding_attention", batch.mask, batch.position_ids, sliding=WINDOW
            ),
            "window mask_mod (before)": batch.mask & plain,
            "chunks (PackedBatch)": packed["chunked_attention"],
            "chunks (positions)": layer_mask(
                "chunked_attention", batch.mask, batch.position_ids, chunk=WINDOW
            ),
            "chunks mask_mod (before)": batch.mask & chunks,
        }
        load = os.getloadavg()[0]
        times = {name: [] for name in masks}
        for _ in range(args.repeat):
            for name, mask in masks.items():
                times[name].append(timed(mask, B, S))
        base = statistics.median(times["documents"])
        medians = {name: statistics.median(times[name]) for name in masks}
        cells = [f"{medians[n] * 1e3:.1f} ms ({medians[n] / base:.1f}x)" for n in masks]
        rows.append([f"{S:,}", B, *cells, f"{load:.1f}"])
        print(rows[-1], flush=True)
    print()
    print(markdown_table(["S", "B", *masks, "load"], rows))


if __name__ == "__main__":
    main()
