"""What the slices backend pays once per new mask: its lowering, against the BlockMask build.

On the CPU ``flexmask.flex_attention`` runs the ``slices`` backend wherever it takes the mask:
it lowers the Mask to MagiAttention slices (``flexmask.formats.to_magi``) and those to kernel
calls (``flexmask.backends.slices``), once per mask (kept for the calls of one step), and
builds no BlockMask when given a Mask. A training step on new data pays that lowering once
per micro-batch, so this benchmark times it beside the peer it replaces — flexmask's own
BlockMask build of the same mask at the same size — in one run, interleaved, medians of
``--repeat`` calls with every cache cleared, and prints the load.

Run from the repository root::

    python benchmarks/bench_lowering.py            # 8k and 131k
    python benchmarks/bench_lowering.py --quick    # 8k only
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

from bench_rl_pack import BUDGET, grpo_groups  # noqa: E402
from common import documents, fmt_time, machine, markdown_table, response_tree  # noqa: E402

import flexmask  # noqa: E402
from flexmask.backends import slices  # noqa: E402
from flexmask.packing import pack_trees  # noqa: E402


def rl_rows(groups: int) -> list[list[int]]:
    """The parents of every micro-batch of ``groups`` GRPO groups, packed by ``pack_trees``
    exactly as ``bench_rl_pack.py`` packs them."""
    sequences, prompts = grpo_groups(groups)
    batch = pack_trees(sequences, BUDGET, prompt_lens=prompts)
    return [batch.parents[row] for row in range(batch.num_rows)]


def cases(quick: bool) -> list[tuple[str, flexmask.Mask, int, int]]:
    """(name, mask, B, S)."""
    out = [
        ("RL tree, 1 group", flexmask.tree(rl_rows(1)[0]), 1, 8192),
        ("RL trees, 8 groups (5 rows)", flexmask.tree(rl_rows(8)), 5, 8192),
        (
            "causal & 20 documents",
            flexmask.causal() & flexmask.document(documents(8192, 0, 410)),
            1,
            8192,
        ),
        ("causal & window 1024", flexmask.causal() & flexmask.sliding_window(1024), 1, 8192),
        ("tree, 8 responses", flexmask.tree(response_tree(8192, 0)), 1, 8192),
        (
            "causal & per-row documents, B=8",
            flexmask.causal() & flexmask.document([documents(8192, r, 410) for r in range(8)]),
            8,
            8192,
        ),
    ]
    if not quick:
        S = 131072
        out += [
            (
                "causal & 20 documents",
                flexmask.causal() & flexmask.document(documents(S, 0, S // 20)),
                1,
                S,
            ),
            (
                "causal & 1000 documents",
                flexmask.causal() & flexmask.document(documents(S, 0, S // 1000)),
                1,
                S,
            ),
            ("tree, 8 responses", flexmask.tree(response_tree(S, 0)), 1, S),
        ]
    return out


def lower(mask: flexmask.Mask, B: int, S: int) -> str:
    slices._lowered.cache_clear()
    lowered = slices._lowered(mask, B, S, S)
    return lowered if isinstance(lowered, str) else f"{len(lowered)} calls"


def build(mask: flexmask.Mask, B: int, S: int) -> None:
    flexmask.cache_clear()
    flexmask.create_block_mask(mask, B, 1, S, S, device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8k only")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    print(f"machine: {machine()}; load before {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for name, mask, B, S in cases(args.quick):
        what = lower(mask, B, S)  # warm up both, and say what the lowering gives
        build(mask, B, S)
        low, built = [], []
        for _ in range(args.repeat):  # interleaved: load changes hit both alike
            start = time.perf_counter()
            lower(mask, B, S)
            low.append(time.perf_counter() - start)
            start = time.perf_counter()
            build(mask, B, S)
            built.append(time.perf_counter() - start)
        lo, bu = statistics.median(low), statistics.median(built)
        rows.append([name, B, f"{S:,}", what, fmt_time(lo), fmt_time(bu), f"{lo / bu:.2f}x"])
        print(rows[-1], flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}")
    header = ["mask", "B", "S", "slices lowering gives", "lowering", "BlockMask build", "ratio"]
    print(markdown_table(header, rows))
    print(f"medians of {args.repeat} interleaved calls, caches cleared before each")


if __name__ == "__main__":
    main()
