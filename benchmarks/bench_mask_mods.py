"""Compiled flex_attention forward with flexmask's BlockMask against hand-written mask_mods
of the same mask: the interval form (``lo[q] <= kv <= q``) and the equality form
(``doc[q] == doc[kv] & kv <= q``), one run, ratios printed, load average printed.

    python benchmarks/bench_mask_mods.py                      # CPU, 4k, ~1-2 min (compiles)
    python benchmarks/bench_mask_mods.py --sizes 4096 16384 32768
    python benchmarks/bench_mask_mods.py --device cuda --backends TRITON FLASH --check

On CUDA, ``--backends`` picks torch's kernels (``kernel_options={"BACKEND": ...}``; FLASH
needs FA4, SM100 for its interval path, with (256, 128) blocks there) and ``--check`` compares
every output with a dense SDPA reference of ``mask.to_dense`` (max abs difference printed).
Every form runs on the same BlockMask tensors: only the mask_mod differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import flexmask


def documents(S: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens, left = [], S
    while left > 0:
        n = min(left, int(torch.randint(S // 40, S // 8 + 1, (1,), generator=g)))
        lens.append(n)
        left -= n
    return lens


def hand_forms(lens: list[int], S: int, device: str):
    ends = torch.tensor(lens).cumsum(0)
    starts = ends - torch.tensor(lens)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    start_of = starts[doc.cpu()].to(torch.int32).to(device)

    def interval(b, h, q_idx, kv_idx):
        return (kv_idx >= start_of[q_idx]) & (q_idx >= kv_idx)

    def equality(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return interval, equality


def with_mod(bm: BlockMask, mod) -> BlockMask:
    return BlockMask.from_kv_blocks(
        bm.kv_num_blocks,
        bm.kv_indices,
        bm.full_kv_num_blocks,
        bm.full_kv_indices,
        BLOCK_SIZE=bm.BLOCK_SIZE,
        mask_mod=mod,
        seq_lengths=bm.seq_lengths,
    )


def timed(fn, repeat: int, device: str) -> float:
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backends", nargs="+", default=[None])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    block = 128
    print(f"load before: {os.getloadavg()}")
    print("| S | kernel | flexmask | interval (hand) | equality (hand) | flexmask / interval |")
    print("| --- | --- | --- | --- | --- | --- |")
    for S in args.sizes:
        lens = documents(S)
        mask = flexmask.causal() & flexmask.document(lens)
        ours = flexmask.create_block_mask(mask, 1, 1, S, S, device, block)
        interval, equality = hand_forms(lens, S, device)
        q, k, v = (
            torch.randn(1, args.heads, S, args.dim, device=device, dtype=dtype) for _ in range(3)
        )
        for backend in args.backends:
            options = {"BACKEND": backend} if backend else None
            compiled = torch.compile(flex_attention, dynamic=False)
            times, outs = {}, {}
            for name, bm in (
                ("flexmask", ours),
                ("interval", with_mod(ours, interval)),
                ("equality", with_mod(ours, equality)),
            ):

                def run(bm=bm, compiled=compiled, qkv=(q, k, v), options=options):
                    return compiled(*qkv, block_mask=bm, kernel_options=options)

                outs[name] = run()  # compiles
                times[name] = timed(run, args.repeat, device)
            cells = [f"{times[n] * 1e3:.2f} ms" for n in ("flexmask", "interval", "equality")]
            ratio = times["flexmask"] / times["interval"]
            print(f"| {S} | {backend or 'default'} | {' | '.join(cells)} | {ratio:.2f}x |")
            if args.check:
                dense = mask.to_dense(1, 1, S, S, device=device)
                want = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), attn_mask=dense
                )
                for name, out in outs.items():
                    diff = (out.float() - want).abs().max().item()
                    print(f"  check {backend or 'default'} {name}: max |diff| = {diff:.2e}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
