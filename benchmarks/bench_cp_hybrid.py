"""Context parallel for hybrid models: how evenly one permutation spreads a step of several
masks (global + sliding-window or chunked layers), each weighed by its layer count.

Run: python benchmarks/bench_cp_hybrid.py [--sizes 32768,131072] [--worlds 4,8] [--quick]
     [--json PATH] [--trees]

For each layout, length and world size, every balancer gives one permutation for the whole
step: head-tail, torch's per-document order, PTRR and the mask-aware balancer each given ONE
of the masks (the global or the local one), and ``LayerWeightedBalancer`` given both with
their weights. Each mask's cost per rank is read from that rank's shard (full kv blocks +
partial ones, ``flexmask.context_parallel.layer_imbalance``): deterministic, no timing. The
columns are imbalances, max rank cost / mean:

* ``step``: of the weighted sum ``sum_m w_m cost_m(r)`` (one number per rank for the step);
* ``synced``: ``sum_m w_m max_r cost_m(r) / sum_m w_m mean_r cost_m(r)``, the step when each
  layer waits at its all-gather for its slowest rank (at least ``step``);
* per mask: each mask alone.

``mask-aware (sum)`` is ``MaskAwareBalancer`` given both masks, each repeated by its weight:
it deals by the weighted sum of the costs, without the layer-weighted balancer's swaps.

``--trees`` measures GRPO groups packed by ``flexmask.pack_tree_batch`` instead (rows of S tokens,
several groups each): the imbalance of one tree mask under contiguous slices, head-tail,
PTRR and the mask-aware balancer (whose costs count each response's ancestor blocks).

Documents: a log-normal mix (median ~1.8k tokens, a few past 16k), multiples of 2W (torch's
per-document balancer needs that), B = 1, H = 1, BLOCK_SIZE = 128.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import common  # noqa: F401  (puts the repository on sys.path)

import flexmask
from flexmask.context_parallel import (
    HeadTailBalancer,
    LayerWeightedBalancer,
    MaskAwareBalancer,
    PerDocumentBalancer,
    PTRRBalancer,
    imbalance,
    layer_imbalance,
)

BLOCK = 128
# (name, local mask, weights global : local): GPT-OSS alternates global and 128-token
# window layers; Gemma 3 and Olmo 3 run several window layers per global one; Llama 4 three
# chunked (8192) layers per global one.
LAYOUTS = (
    ("window 1024", lambda: flexmask.sliding_window(1024), (1, 3)),
    ("window 1024", lambda: flexmask.sliding_window(1024), (1, 1)),
    ("window 128", lambda: flexmask.sliding_window(128), (1, 1)),
    ("chunked 8192", lambda: flexmask.chunked(8192), (1, 3)),
    ("chunked 8192", lambda: flexmask.chunked(8192), (1, 1)),
)


def mixed_documents(seq: int, seed: int, unit: int) -> list[int]:
    """Log-normal document lengths, multiples of ``unit``, summing to ``seq`` (as in
    tests/test_cp_hybrid.py)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < seq:
        length = max(unit, round(rng.lognormvariate(7.5, 1.2) / unit) * unit)
        lengths.append(min(length, seq - sum(lengths)))
    return lengths


def measure(name: str, local: Any, weights: tuple[int, int], seq: int, world: int) -> dict:
    lengths = mixed_documents(seq, 0, 2 * world)
    whole = flexmask.causal() & flexmask.document(lengths)
    masks = {"global": whole, "local": whole & local()}
    layers = [(whole, weights[0]), (masks["local"], weights[1])]
    singles: dict[str, Any] = {
        "head-tail": "head_tail",
        "per-document": PerDocumentBalancer([lengths], world),
    }
    for kind, label in ((PTRRBalancer, "PTRR"), (MaskAwareBalancer, "mask-aware")):
        for which, mask in masks.items():
            singles[f"{label} ({which})"] = kind(mask, 1, 1, seq, world, block_size=BLOCK)
    # MaskAwareBalancer already adds several masks' costs: each mask repeated by its layer
    # count deals by the weighted sum (no swaps) — the step even, each mask not.
    summed = [whole] * weights[0] + [masks["local"]] * weights[1]
    singles["mask-aware (sum)"] = MaskAwareBalancer(summed, 1, 1, seq, world, block_size=BLOCK)
    start = time.perf_counter()
    weighted = LayerWeightedBalancer(layers, 1, 1, seq, world, block_size=BLOCK)
    made_ms = (time.perf_counter() - start) * 1e3
    results = {}
    for label, lb in [*singles.items(), ("layer-weighted", weighted)]:
        r = layer_imbalance(layers, 1, 1, seq, world, lb, BLOCK_SIZE=BLOCK)
        results[label] = {"step": r.step, "synced": r.synced, "masks": list(r.masks)}
    one_mask = [k for k in results if k not in ("layer-weighted", "mask-aware (sum)")]
    best = min(one_mask, key=lambda k: results[k]["step"])
    return {
        "layout": name,
        "weights": list(weights),
        "seq": seq,
        "world": world,
        "documents": len(lengths),
        "longest": max(lengths),
        "balancers": results,
        "best_single": best,
        "weighted_ms": made_ms,
    }


def print_tables(rows: list[dict]) -> None:
    names = [k for k in rows[0]["balancers"] if k != "layer-weighted"]
    print("\nStep imbalance (max / mean rank cost of the weighted step):\n")
    print("| layout | w | S | W | " + " | ".join(names) + " | layer-weighted | synced | ms |")
    print("|---|---|---:|---:|" + "---:|" * (len(names) + 3))
    for row in rows:
        b = row["balancers"]
        cells = [
            f"**{b[n]['step']:.3f}**" if n == row["best_single"] else f"{b[n]['step']:.3f}"
            for n in names
        ]
        w = b["layer-weighted"]
        print(
            f"| {row['layout']} | {row['weights'][0]}:{row['weights'][1]} | {row['seq'] // 1024}k "
            f"| {row['world']} | " + " | ".join(cells) + f" | {w['step']:.4f} | "
            f"{w['synced']:.4f} | {row['weighted_ms']:.0f} |"
        )
    print("\nPer mask (global / local) and synced: the best single-mask balancer, the")
    print("mask-aware one given both masks (costs summed by weight), and ours:\n")
    print(
        "| layout | w | S | W | best single | masks | synced | mask-aware (sum): masks | synced "
        "| layer-weighted: masks | synced |"
    )
    print("|---|---|---:|---:|---|---|---:|---|---:|---|---:|")
    for row in rows:
        b, best = row["balancers"], row["best_single"]
        cells = [
            f"{b[k]['masks'][0]:.3f} / {b[k]['masks'][1]:.3f} | {b[k]['synced']:.4f}"
            for k in (best, "mask-aware (sum)", "layer-weighted")
        ]
        print(
            f"| {row['layout']} | {row['weights'][0]}:{row['weights'][1]} | {row['seq'] // 1024}k "
            f"| {row['world']} | {best} | " + " | ".join(cells) + " |"
        )


def grpo_trees(seq: int, seed: int = 0) -> Any:
    """GRPO groups (prompts of 64-4096 tokens, 4-8 responses of 64-2048 each, as in
    bench_cp_exchange.py) packed into prefix trees of ``seq`` tokens, about 8 rows."""
    rng = random.Random(seed)
    sequences, prompt_lens = [], []
    while sum(map(len, sequences)) < 8 * seq:
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(64, 4096))]
        for _ in range(rng.randrange(4, 9)):
            response = [rng.randrange(1, 1000) for _ in range(rng.randrange(64, 2048))]
            sequences.append(prompt + response)
            prompt_lens.append(len(prompt))
    return flexmask.pack_tree_batch(sequences, seq, prompt_lens=prompt_lens)


def trees(sizes: list[int], worlds: list[int]) -> list[dict]:
    rows = []
    print("\nTrees (GRPO groups, pack_tree_batch): imbalance of one tree mask, every row summed:\n")
    print("| S | rows | sequences | W | contiguous | head-tail | PTRR | mask-aware | ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seq in sizes:
        batch = grpo_trees(seq)
        mask, B = batch.mask, batch.num_rows
        for world in worlds:
            start = time.perf_counter()
            aware = MaskAwareBalancer(mask, B, 1, seq, world, block_size=BLOCK)
            made_ms = (time.perf_counter() - start) * 1e3
            balancers = {
                "contiguous": None,
                "head-tail": HeadTailBalancer(seq, world),
                "PTRR": PTRRBalancer(mask, B, 1, seq, world, block_size=BLOCK),
                "mask-aware": aware,
            }
            found = {k: imbalance(mask, B, 1, seq, world, lb) for k, lb in balancers.items()}
            rows.append({"seq": seq, "rows": B, "world": world, "imbalance": found})
            print(
                f"| {seq // 1024}k | {B} | {batch.num_sequences} | {world} | "
                + " | ".join(f"{v:.3f}" for v in found.values())
                + f" | {made_ms:.0f} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="32768,131072")
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--quick", action="store_true", help="S = 8192, W = 4 only")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--trees", action="store_true", help="GRPO trees instead")
    args = parser.parse_args()
    sizes = [8192] if args.quick else [int(s) for s in args.sizes.split(",") if s]
    worlds = [4] if args.quick else [int(w) for w in args.worlds.split(",") if w]
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.trees:
        rows = trees(sizes, worlds)
        end = os.getloadavg()
        print(f"\nload average at end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"load": [load, end], "trees": rows}, f, indent=1)
        return
    rows = []
    for name, local, weights in LAYOUTS:
        for seq in sizes:
            for world in worlds:
                rows.append(measure(name, local, weights, seq, world))
    print_tables(rows)
    end = os.getloadavg()
    print(f"\nload average at end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": [load, end], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
