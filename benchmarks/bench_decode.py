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

Then the attention call of a step (``--only attention`` runs just this section): at 4k and
32k caches, B = 1 and 16, H = 8, D = 64, float32, no grad, q_len 1 (decode) and 16 (a
speculative verify), the median of ``flexmask.attention(q, k, v, step.block_mask)`` (a
``DecodeMasks`` step: every layer of a model calls it with that one BlockMask) and of
``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)`` with the
equivalent ``(B, 1, q_len, capacity)`` bool mask (the mask_mod at the step's positions, made
before timing), interleaved, and their ratio; outputs checked equal. "new BlockMask" is the
flexmask call with a BlockMask object it has not seen (the same tensors: what it reads from
the blocks is read again, as for the first layer after the step's blocks changed). Caches
filled to near their capacity (the kernel reads all of it) and, for causal, to a quarter to
a half (flexmask's kernel reads the listed blocks' span only; SDPA the whole capacity).

``--only rows``: where the decode backend's limit on queries per call
(``flexmask.backends.decode.MAX_QUERY_ROWS``) comes from. A chunk of q_len queries at the
end of a 4k or 32k cache (B = 4, H = 8, D = 64, no grad), run by each CPU backend that takes
its BlockMask (the decode backend with its limit lifted), interleaved.

    python benchmarks/bench_decode.py            # 4k, 32k, 128k x B = 1, 16; attention 4k, 32k
    python benchmarks/bench_decode.py --quick    # 4k, 32k x B = 1, 16; attention q_len 1 only
    python benchmarks/bench_decode.py --only attention --quick
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
from torch.nn.attention.flex_attention import BlockMask
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


ATTENTION_HEADS, HEAD_DIM = 8, 64


def attention_cases(
    capacity: int, batch: int, q_len: int
) -> dict[str, tuple[flexmask.Mask, list[int]]]:
    """Each mask with the rows' cache lengths: near the capacity (the last q_len to q_len +
    one block before it), and causal again at a quarter to a half of it."""
    rng = random.Random(capacity + batch + q_len)
    full = [capacity - q_len - rng.randrange(0, BLOCK) for _ in range(batch)]
    docs = [_docs(capacity, n, rng) for n in full]
    trees = [response_tree(capacity, seed) for seed in range(batch)]
    return {
        "causal": (flexmask.causal(), full),
        "causal, cache 1/4-1/2": (
            flexmask.causal(),
            [rng.randrange(capacity // 4, capacity // 2) for _ in range(batch)],
        ),
        "documents": (flexmask.causal() & flexmask.document(docs), full),
        f"window {WINDOW}": (flexmask.causal() & flexmask.sliding_window(WINDOW), full),
        "tree": (flexmask.tree(trees), full),
    }


def _dense_step(mask: flexmask.Mask, lens: list[int], q_len: int, capacity: int) -> torch.Tensor:
    """(B, 1, q_len, capacity) bool: the mask_mod at each row's query positions."""
    base = mask.mask_mod_for(capacity, capacity, "cpu")
    batch = len(lens)
    q_idx = torch.tensor(lens).view(batch, 1, 1, 1) + torch.arange(q_len).view(1, 1, -1, 1)
    allowed = base(
        torch.arange(batch).view(-1, 1, 1, 1),
        torch.zeros(1, 1, 1, 1, dtype=torch.int64),
        q_idx,
        torch.arange(capacity).view(1, 1, 1, -1),
    )
    return allowed.expand(batch, 1, q_len, capacity).contiguous()


def _copy(block_mask: BlockMask) -> BlockMask:
    """The same tensors and mask_mod in a BlockMask object of its own."""
    return BlockMask(
        seq_lengths=block_mask.seq_lengths,
        **{name: getattr(block_mask, name) for name in BLOCK_FIELDS},
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
    )


def measure_attention(
    mask: flexmask.Mask, lens: list[int], q_len: int, capacity: int, repeats: int
) -> dict[str, Any]:
    batch = len(lens)
    gen = torch.Generator().manual_seed(capacity + batch)
    q = torch.randn(batch, ATTENTION_HEADS, q_len, HEAD_DIM, generator=gen)
    k = torch.randn(batch, ATTENTION_HEADS, capacity, HEAD_DIM, generator=gen)
    v = torch.randn(batch, ATTENTION_HEADS, capacity, HEAD_DIM, generator=gen)
    step = next(iter(flexmask.DecodeMasks(mask, lens, capacity, q_len=q_len)))
    block_mask = step.block_mask
    dense = _dense_step(mask, lens, q_len, capacity)
    fresh = [_copy(block_mask) for _ in range(repeats + 1)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backend = flexmask.explain(q, k, v, block_mask).backend
    with torch.no_grad():
        ours, theirs = flexmask.attention(q, k, v, block_mask), sdpa(q, k, v, attn_mask=dense)
        if not torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4):
            raise RuntimeError(f"{mask!r} at {lens}: flexmask's output differs from SDPA's")
        flexmask.attention(q, k, v, fresh[-1])
        times: dict[str, list[float]] = {"flexmask": [], "new BlockMask": [], "sdpa": []}
        for rep in range(repeats):
            calls = [
                ("flexmask", lambda: flexmask.attention(q, k, v, block_mask)),
                ("new BlockMask", lambda rep=rep: flexmask.attention(q, k, v, fresh[rep])),
                ("sdpa", lambda: sdpa(q, k, v, attn_mask=dense)),
            ]
            for name, call in calls if rep % 2 else calls[::-1]:  # interleaved, both orders
                times[name].append(_timed(call))
    return {"backend": backend, **{name: statistics.median(t) for name, t in times.items()}}


def attention_section(quick: bool) -> list[dict[str, Any]]:
    repeats = 5 if quick else 11
    q_lens = (1,) if quick else (1, 16)
    print(
        f"\nattention call of a step: H = {ATTENTION_HEADS}, D = {HEAD_DIM}, float32, no grad, "
        f"block {BLOCK}, medians of {repeats} interleaved calls",
        flush=True,
    )
    results, rows = [], []
    for capacity in (4096, 32768):
        for batch in (1, 16):
            for q_len in q_lens:
                for name, (mask, lens) in attention_cases(capacity, batch, q_len).items():
                    if quick and name in ("tree", f"window {WINDOW}"):
                        continue
                    r = measure_attention(mask, lens, q_len, capacity, repeats)
                    load = os.getloadavg()[0]
                    results.append(
                        {
                            "capacity": capacity,
                            "B": batch,
                            "q_len": q_len,
                            "mask": name,
                            "load": load,
                            **r,
                        }
                    )
                    rows.append(
                        [
                            f"{capacity // 1024}k",
                            batch,
                            q_len,
                            name,
                            r["backend"],
                            fmt_time(r["flexmask"]),
                            fmt_time(r["new BlockMask"]),
                            fmt_time(r["sdpa"]),
                            ratio(r["flexmask"], r["sdpa"]),
                            ratio(r["new BlockMask"], r["sdpa"]),
                            f"{load:.1f}",
                        ]
                    )
                    print(markdown_table(ATTENTION_HEADER, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(ATTENTION_HEADER, rows))
    return results


ATTENTION_HEADER = [
    "capacity",
    "B",
    "q_len",
    "mask",
    "backend",
    "flexmask",
    "new BlockMask",
    "SDPA, dense mask",
    "flexmask / SDPA",
    "new / SDPA",
    "load",
]


ROWS_BACKENDS = ("decode", "block_sparse", "sdpa")


def rows_section(quick: bool) -> list[dict[str, Any]]:
    from flexmask.backends import decode

    repeats = 3 if quick else 7
    q_lens = (16, 64, 128) if quick else (16, 32, 64, 128, 256, 512)
    print(
        f"\nqueries per call: B = 4, H = {ATTENTION_HEADS}, D = {HEAD_DIM}, float32, no grad, "
        f"block {BLOCK}, medians of {repeats} interleaved calls",
        flush=True,
    )
    limit, decode.MAX_QUERY_ROWS = decode.MAX_QUERY_ROWS, 1 << 30
    results, rows = [], []
    try:
        for capacity in (4096, 32768):
            for q_len in q_lens:
                for name, (mask, lens) in attention_cases(capacity, 4, q_len).items():
                    if name.startswith("causal,"):
                        continue
                    times = _time_backends(mask, lens, q_len, capacity, repeats)
                    load = os.getloadavg()[0]
                    results.append(
                        {"capacity": capacity, "q_len": q_len, "mask": name, "load": load, **times}
                    )
                    best = min(times, key=times.__getitem__)
                    rows.append(
                        [f"{capacity // 1024}k", q_len, name]
                        + [fmt_time(times.get(b)) for b in ROWS_BACKENDS]
                        + [ratio(times["decode"], times[best]), f"{load:.1f}"]
                    )
                    print(markdown_table(ROWS_HEADER, rows[-1:]).splitlines()[-1], flush=True)
    finally:
        decode.MAX_QUERY_ROWS = limit
    print()
    print(markdown_table(ROWS_HEADER, rows))
    return results


def _time_backends(
    mask: flexmask.Mask, lens: list[int], q_len: int, capacity: int, repeats: int
) -> dict[str, float]:
    batch = len(lens)
    gen = torch.Generator().manual_seed(capacity + q_len)
    q = torch.randn(batch, ATTENTION_HEADS, q_len, HEAD_DIM, generator=gen)
    k = torch.randn(batch, ATTENTION_HEADS, capacity, HEAD_DIM, generator=gen)
    v = torch.randn(batch, ATTENTION_HEADS, capacity, HEAD_DIM, generator=gen)
    block_mask = flexmask.decode_mask(mask, lens, q_len, capacity)
    times: dict[str, list[float]] = {name: [] for name in ROWS_BACKENDS}
    with torch.no_grad():
        for name in ROWS_BACKENDS:
            flexmask.attention(q, k, v, block_mask, name)
        for rep in range(repeats):
            for name in ROWS_BACKENDS if rep % 2 else ROWS_BACKENDS[::-1]:
                times[name].append(
                    _timed(lambda n=name: flexmask.attention(q, k, v, block_mask, n))
                )
    return {name: statistics.median(t) for name, t in times.items()}


ROWS_HEADER = ["capacity", "q_len", "mask", *ROWS_BACKENDS, "decode / fastest", "load"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=64, help="decode positions per walk")
    parser.add_argument(
        "--only", choices=("steps", "attention", "rows"), default=None, help="run one section"
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    payload: dict[str, Any] = {"machine": machine(), "cases": [], "attention": [], "rows": []}
    print(f"{payload['machine']}; load {os.getloadavg()[0]:.1f} at start", flush=True)
    if args.only in (None, "steps"):
        step_section(args.quick, args.steps, payload)
    if args.only in (None, "attention"):
        payload["attention"] = attention_section(args.quick)
    if args.only == "rows":
        payload["rows"] = rows_section(args.quick)
    save_json(args.json, payload)


def step_section(quick: bool, steps: int, payload: dict[str, Any]) -> None:
    inductor_config.cpp.vec_isa_ok = False  # see the module docstring
    torch._dynamo.config.recompile_limit = 256
    compiled = torch.compile(torch_create_block_mask, dynamic=False)
    capacities = [4096, 32768] if quick else [4096, 32768, 131072]
    rows = []
    print(f"\ndecode step, q_len = 1, block {BLOCK}, H = 1, {steps} positions per walk\n")
    for capacity in capacities:
        for batch in (1, 16):
            for name, (mask, lens) in cases(capacity, batch, steps).items():
                r = measure(mask, lens, capacity, steps, compiled)
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
