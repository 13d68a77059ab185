"""Per-step mask cost during decode, every mask beside torch's compiled create_block_mask.

One decode walk (q_len = 1 per row, ragged cache lengths, block 128, H = 1) at capacities 4k,
32k and 128k, B = 1 and 16, for four masks: ``causal()``, ``causal() & document(lens)`` (the
prompt's documents, the last one running to the capacity), ``causal() & sliding_window(1024)``
and ``tree(parents)`` (a prompt then 8 branches in preorder, the rows decoding down their last
branch). For each:

* step: ``DecodeMasks.at(cache_lens)`` over ``--steps`` consecutive positions (every row one
  token further each step): the steps a generation loop takes, reuses and appends as they come
  (the table gives how many appended). Median and 90th percentile (the slowest step, in the
  JSON, is a scheduler preemption of a few ms on a loaded machine, for causal's path too).
* build: ``flexmask.decode_mask`` of the same step (the BlockMask from structure, what a step
  cost before the append paths).
* torch compiled: ``torch.compile(create_block_mask)`` of the shifted mask_mod
  ``mask.mask_mod(b, h, q + cache_lens[b], kv)`` (cache lengths in a tensor written in place,
  so it compiles once), warm, median over the same steps. Inductor's vectorised CPU code for
  this kernel fails to compile here (a C++ type error at Q_LEN = 1), so it is compiled with
  ``cpp.vec_isa_ok = False`` (scalar loops).

Every step's tensors are checked equal to torch's (all of them) at the first and last step.

    python benchmarks/bench_decode.py            # 4k, 32k, 128k x B = 1, 16
    python benchmarks/bench_decode.py --quick    # 4k, 32k x B = 1, 16
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config as inductor_config
from common import fmt_time, machine, markdown_table, ratio, response_tree, save_json
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.blocks.read import BLOCK_FIELDS

BLOCK = 128
WINDOW = 1024


def _docs(capacity: int, prompt: int, rng: random.Random) -> list[int]:
    """Documents filling the prompt, then the continued one running to the capacity."""
    lens, used = [], 0
    while used < prompt - 1:
        n = min(rng.randint(64, max(64, capacity // 16)), prompt - 1 - used)
        lens.append(n)
        used += n
    return [*lens, capacity - used]


def cases(capacity: int, batch: int, steps: int) -> dict[str, tuple[flexmask.Mask, list[int]]]:
    """Each mask with the rows' first cache lengths."""
    rng = random.Random(capacity + batch)
    lens = [rng.randrange(capacity // 4, capacity // 2) for _ in range(batch)]
    docs = [_docs(capacity, n, rng) for n in lens]
    trees = [response_tree(capacity, seed) for seed in range(batch)]
    # In the last branch, a few blocks from the end: each step a chain child of the last.
    tree_lens = [capacity - steps - 1 - rng.randrange(0, BLOCK) for _ in range(batch)]
    return {
        "causal": (flexmask.causal(), lens),
        "documents": (flexmask.causal() & flexmask.document(docs), lens),
        f"window {WINDOW}": (flexmask.causal() & flexmask.sliding_window(WINDOW), lens),
        "tree": (flexmask.tree(trees), tree_lens),
    }


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _same(ours: Any, theirs: Any, what: str) -> None:
    for name in BLOCK_FIELDS:
        if not torch.equal(getattr(ours, name), getattr(theirs, name)):
            raise RuntimeError(f"{what}: {name} differs from torch's create_block_mask")


def measure(
    mask: flexmask.Mask, lens: list[int], capacity: int, steps: int, compiled: Callable
) -> dict[str, Any]:
    walk = [[n + k for n in lens] for k in range(steps)]
    base = mask.mask_mod_for(capacity, capacity, "cpu")
    offsets = torch.tensor(lens)

    def shifted(b, h, q_idx, kv_idx):
        return base(b, h, q_idx + offsets[b], kv_idx)

    def torch_step(at: list[int]) -> Any:
        offsets.copy_(torch.tensor(at))
        return compiled(shifted, len(lens), 1, 1, capacity, "cpu")

    start = time.perf_counter()
    torch_step(walk[0])  # compiles
    compile_s = time.perf_counter() - start
    torch_step(walk[0])
    torch_times = [_timed(lambda at=at: torch_step(at)) for at in walk]

    decode = flexmask.DecodeMasks(mask, walk[0], capacity)
    _ = decode.at(walk[0]).block_mask
    step_times = [0.0] * steps
    for k, at in enumerate(walk[1:], 1):
        start = time.perf_counter()
        _ = decode.at(at).block_mask
        step_times[k] = time.perf_counter() - start
        if k in (1, steps - 1):
            _same(decode.at(at).block_mask, torch_step(at), f"{mask!r} step {k}")
    step_times = step_times[1:]
    build_times = [
        _timed(lambda at=at: flexmask.decode_mask(mask, at, 1, capacity))
        for at in walk[:: max(1, steps // 8)]
    ]
    return dict(
        step=statistics.median(step_times),
        step_p90=sorted(step_times)[int(0.9 * len(step_times))],
        step_max=max(step_times),
        appends=decode.appends,
        builds=decode.builds,
        steps=steps - 1,
        build=statistics.median(build_times),
        torch_compiled=statistics.median(torch_times),
        torch_compile_s=compile_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=64, help="decode positions per walk")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    inductor_config.cpp.vec_isa_ok = False  # see the module docstring
    torch._dynamo.config.recompile_limit = 256
    compiled = torch.compile(torch_create_block_mask, dynamic=False)
    capacities = [4096, 32768] if args.quick else [4096, 32768, 131072]
    rows, payload = [], {"machine": machine(), "cases": []}
    print(f"decode step, q_len = 1, block {BLOCK}, H = 1, {args.steps} positions per walk")
    print(f"{payload['machine']}; load {os.getloadavg()[0]:.1f} at start\n", flush=True)
    for capacity in capacities:
        for batch in (1, 16):
            for name, (mask, lens) in cases(capacity, batch, args.steps).items():
                r = measure(mask, lens, capacity, args.steps, compiled)
                load = os.getloadavg()[0]
                payload["cases"].append(
                    {"capacity": capacity, "B": batch, "mask": name, "load": load, **r}
                )
                rows.append(
                    [
                        f"{capacity // 1024}k",
                        batch,
                        name,
                        fmt_time(r["step"]),
                        fmt_time(r["step_p90"]),
                        f"{r['appends']}/{r['steps']}",
                        fmt_time(r["build"]),
                        fmt_time(r["torch_compiled"]),
                        ratio(r["torch_compiled"], r["step"]),
                        f"{load:.1f}",
                    ]
                )
                print(markdown_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADER, rows))
    save_json(args.json, payload)


HEADER = [
    "capacity",
    "B",
    "mask",
    "step (median)",
    "step (p90)",
    "appended",
    "build (decode_mask)",
    "torch compiled",
    "compiled / step",
    "load",
]


if __name__ == "__main__":
    main()
