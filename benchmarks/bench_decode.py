"""Per-step mask cost during decode: build, append, reuse — beside torch's create_block_mask.

One decode step (q_len = 1 per row, ragged cache lengths, block 128) at capacities 4k, 32k and
128k, B = 1 and 16, H = 1:

* build: ``flexmask.decode_mask`` of ``causal() & document(lens)`` (the prompt's documents,
  the last one running to the capacity), and of ``causal()``;
* append: ``DecodeMasks(causal()).at(cache_lens)`` on a step where every row's cache crosses a kv
  block boundary (block counts rewritten);
* reuse: the same on a step inside a block (only the cache-length tensor is written) — the
  decode counterpart of a cache hit: no block tensor is touched;
* torch: ``torch.nn.attention.flex_attention.create_block_mask`` of the shifted mask_mod
  ``mask.mask_mod(b, h, q + cache_lens[b], kv)`` per step, as generation loops do today.

    python benchmarks/bench_decode.py            # 4k, 32k, 128k x B = 1, 16
    python benchmarks/bench_decode.py --quick    # 4k, 32k x B = 1, 16
"""

from __future__ import annotations

import argparse
import random
from functools import partial

import torch
from common import best_time, fmt_time, machine, markdown_table, ratio, save_json
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask

BLOCK = 128


def _docs(capacity: int, prompt: int, rng: random.Random) -> list[int]:
    """Documents filling the prompt, then the continued one running to the capacity."""
    lens, used = [], 0
    while used < prompt - 1:
        n = min(rng.randint(64, max(64, capacity // 16)), prompt - 1 - used)
        lens.append(n)
        used += n
    return [*lens, capacity - used]


def measure(capacity: int, batch: int, repeat: int) -> dict[str, float]:
    rng = random.Random(capacity + batch)
    lens = [rng.randrange(capacity // 4, capacity // 2) for _ in range(batch)]
    docs = flexmask.causal() & flexmask.document([_docs(capacity, n, rng) for n in lens])
    causal = flexmask.causal()
    result = {
        "build_docs": best_time(lambda: flexmask.decode_mask(docs, lens, 1, capacity), repeat),
        "build_causal": best_time(lambda: flexmask.decode_mask(causal, lens, 1, capacity), repeat),
    }
    # Rows one token before a block boundary: the next advance appends a block to every row.
    edge = [n - n % BLOCK + BLOCK - 2 for n in lens]
    appends, reuses = [], []
    for _ in range(repeat):
        steps = flexmask.DecodeMasks(causal, edge, capacity)
        ahead = [[n + k for n in edge] for k in (1, 2, 3)]
        steps.at(ahead[0])  # inside the block: reuse
        appends.append(best_time(partial(steps.at, ahead[1]), repeat=1, warmup=0))
        reuses.append(best_time(partial(steps.at, ahead[2]), repeat=1, warmup=0))
        assert (steps.appends, steps.reuses) == (1, 2)
    result["append"], result["reuse"] = min(appends), min(reuses)
    base = docs.mask_mod_for(capacity, capacity, "cpu")
    offsets = torch.tensor(lens)

    def shifted(b, h, q_idx, kv_idx):
        return base(b, h, q_idx + offsets[b], kv_idx)

    result["torch"] = best_time(
        lambda: torch_create_block_mask(shifted, batch, 1, 1, capacity, device="cpu"),
        repeat=max(2, repeat // 2),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    capacities = [4096, 32768] if args.quick else [4096, 32768, 131072]
    rows, payload = [], {"machine": machine(), "cases": []}
    for capacity in capacities:
        for batch in (1, 16):
            r = measure(capacity, batch, args.repeat)
            payload["cases"].append({"capacity": capacity, "B": batch, **r})
            rows.append(
                [
                    f"{capacity // 1024}k",
                    batch,
                    fmt_time(r["build_docs"]),
                    fmt_time(r["build_causal"]),
                    fmt_time(r["append"]),
                    fmt_time(r["reuse"]),
                    fmt_time(r["torch"]),
                    ratio(r["torch"], r["build_docs"]),
                    ratio(r["build_causal"], r["append"]),
                ]
            )
    header = [
        "capacity",
        "B",
        "build causal&document",
        "build causal",
        "append",
        "reuse",
        "torch create_block_mask",
        "torch / build",
        "build / append",
    ]
    print(f"decode step, q_len = 1, block {BLOCK}, H = 1; builds: create_block_mask(q_offset=...)")
    print(f"{payload['machine']}\n")
    print(markdown_table(header, rows))
    save_json(args.json, payload)


if __name__ == "__main__":
    main()
