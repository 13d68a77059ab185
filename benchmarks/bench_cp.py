"""Context-parallel shards: per-rank build time against torch, and balancer imbalance.

Run: python benchmarks/bench_cp.py [--sizes 32768,65536,131072] [--worlds 2,4,8] [--paths-seq N]
     [--torch-max-elements 2e9] [--million | --million-only] [--million-repeat 9]
     [--million-ranks 0,3,7]

At S = 1M, W = 8 (``--million``) each balancer's shard is timed against a fresh write of the
same eight tensors (allocated by torch, written once: the floor), the two interleaved in
one run, with the 1-minute load beside each row: medians show the machine as it is, the
minimums are the best proxy for a quiet one. Each row also gives the bytes of the outputs
and what the shard's ops allocate in all (its temporaries beside the outputs).

Ranks are simulated in one process: each builds only its own shard (flexmask.shard, and
torch's _create_cp_block_mask compiled — its first call, with compilation, reported apart).
torch evaluates (S / W) x S elements per rank; sizes past --torch-max-elements are skipped
for torch (it needs ~10 bytes per element). The mask is a document-causal pack of 16
random documents, head-tail balanced (torch's default).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time

import torch
import torch.distributed.tensor.experimental._context_parallel._attention as torch_cp
from common import best_time, settle_allocator  # noqa: F401  (sys.path set by common)
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

import flexmask
from flexmask.blocks.read import BLOCK_FIELDS, block_mask_nbytes
from flexmask.context_parallel import (
    HeadTailBalancer,
    MaskAwareBalancer,
    PerDocumentBalancer,
    imbalance,
)


class SimMesh:
    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank, self.device_type = world, rank, "cpu"

    def size(self) -> int:
        return self.world

    def get_local_rank(self) -> int:
        return self.rank


def documents(seq: int, count: int, unit: int, seed: int = 0) -> list[int]:
    """Up to ``count`` random document lengths, multiples of ``unit``, that sum to ``seq``:
    fewer where ``seq`` holds fewer units, and the last one takes ``seq % unit`` too."""
    rng = random.Random(seed)
    units = seq // unit
    count = max(1, min(count, units))
    cuts = sorted(rng.sample(range(1, units), count - 1))
    lengths = [(b - a) * unit for a, b in zip([0, *cuts], [*cuts, units], strict=False)]
    lengths[-1] += seq - units * unit
    return lengths


def build_times(sizes, worlds, torch_max, repeat):
    print(
        "| S | W | flexmask ms/rank (max over ranks) | flexmask whole mask ms | "
        "torch compiled ms/rank | torch first call s |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for seq in sizes:
        mask = flexmask.causal() & flexmask.document(documents(seq, 16, 256))
        whole = best_time(
            lambda mask=mask, seq=seq: flexmask.create_block_mask(mask, 1, 1, seq, seq, "cpu"),
            repeat=repeat,
        )
        for world in worlds:
            ours = max(
                best_time(
                    lambda r=r, mask=mask, seq=seq, world=world: flexmask.shard(
                        mask,
                        1,
                        1,
                        seq,
                        world_size=world,
                        rank=r,
                        balancer=HeadTailBalancer(seq, world),
                    ),
                    repeat=repeat,
                )
                for r in range(world)
            )
            theirs = first = "skipped"
            if seq * seq / world <= torch_max:
                torch_cp._compiled_create_block_mask = None  # first call compiles
                start = time.perf_counter()
                torch_cp._create_cp_block_mask(
                    mask.mask_mod,
                    1,
                    1,
                    seq,
                    seq,
                    SimMesh(world, 0),
                    _HeadTailLoadBalancer(seq, world, "cpu"),
                )
                first = f"{time.perf_counter() - start:.1f}"
                times = []
                for r in range(world):  # best of 2 after a warm-up (that rank's recompile)
                    lb = _HeadTailLoadBalancer(seq, world, "cpu")
                    times.append(
                        best_time(
                            lambda r=r, lb=lb, mask=mask, seq=seq, world=world: (
                                torch_cp._create_cp_block_mask(
                                    mask.mask_mod, 1, 1, seq, seq, SimMesh(world, r), lb
                                )
                            ),
                            repeat=2,
                        )
                    )
                theirs = f"{1e3 * statistics.median(times):.0f}"
            print(
                f"| {seq} | {world} | {1e3 * ours:.2f} | {1e3 * whole:.2f} | {theirs} | {first} |",
                flush=True,
            )


def fresh_write(shapes):
    """The floor of a shard: its eight tensors allocated by torch and written once (int32),
    as the shard's own outputs are."""
    return [torch.empty(shape, dtype=torch.int32).fill_(1) for shape in shapes]


def allocations(fn, outputs):
    """MiB allocated by the top-level ops of ``fn`` (net per op: every tensor a build makes,
    its outputs included), and the largest allocation that is not one of ``outputs`` (the
    byte sizes of the results' tensors)."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None]
    sizes = sorted((size for size in sizes if size > 0), reverse=True)
    others = list(sizes)
    for size in outputs:
        if size in others:
            others.remove(size)
    return sum(sizes) / 2**20, max(others, default=0) / 2**20


def million(repeat, ranks):
    """S = 1M, W = 8: each balancer's shards against the fresh write of the same tensors,
    interleaved in one run (shard, write, shard, write...), ``repeat`` rounds over ``ranks``.
    Medians show the machine as it is; minimums are the best proxy for a quiet one."""
    seq, world = 1 << 20, 8
    lengths = documents(seq, 64, 256)
    mask = flexmask.causal() & flexmask.document(lengths)
    balancers = (
        ("head-tail", lambda: HeadTailBalancer(seq, world)),
        ("per-document", lambda: PerDocumentBalancer([lengths], world)),
        ("mask-aware", lambda: "mask_aware"),
        ("ptrr", lambda: "ptrr"),
    )
    print(
        f"\nS = 1M, W = 8, document-causal (64 documents), BLOCK_SIZE = 128, ranks {ranks}, "
        f"{repeat} rounds, shard and fresh write interleaved; load = 1-min load average "
        f"before / after the row ({os.cpu_count()} cores). Bytes: the fresh write touches "
        f"each output byte once; the shard writes each output tensor once too (one "
        f"index_select of template rows) and beside it the bytes its temporaries take "
        f"(allocated less output MiB; the largest other op in parentheses)\n"
    )
    print(
        "| balancer | output MiB | allocated MiB (largest other op) | shard ms median | fresh "
        "write ms median | ratio median | shard ms min | fresh write ms min | ratio min | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, make in balancers:
        lb = make()

        def one(rank, lb=lb):
            return flexmask.shard(mask, 1, 1, seq, world_size=world, rank=rank, balancer=lb)

        local = one(ranks[0]).block_mask  # also makes the balancer and its permutation
        shapes = [getattr(local, field).shape for field in BLOCK_FIELDS]
        written = block_mask_nbytes(local)
        del local
        outputs = [4 * math.prod(shape) for shape in shapes]
        allocated, largest_other = allocations(lambda: one(ranks[0]), outputs)
        load_before = os.getloadavg()[0]
        shard_t, write_t = [], []
        for _ in range(repeat):
            for rank in ranks:
                start = time.perf_counter()
                out = one(rank)
                shard_t.append(time.perf_counter() - start)
                del out
                start = time.perf_counter()
                out = fresh_write(shapes)
                write_t.append(time.perf_counter() - start)
                del out
        load_after = os.getloadavg()[0]
        s_med, w_med = statistics.median(shard_t), statistics.median(write_t)
        s_min, w_min = min(shard_t), min(write_t)
        print(
            f"| {name} | {written / 2**20:.0f} | {allocated:.0f} ({largest_other:.1f}) | "
            f"{1e3 * s_med:.1f} | {1e3 * w_med:.1f} | {s_med / w_med:.2f} | "
            f"{1e3 * s_min:.1f} | {1e3 * w_min:.1f} | {s_min / w_min:.2f} | "
            f"{load_before:.1f} / {load_after:.1f} |",
            flush=True,
        )


def paths(seq, world, repeat):
    """Per-rank shard time (max over ranks) by path: block-aligned closed form (runs), the
    per-document balancer's own mask (from its documents), unaligned closed form (segments)
    and trees (one classification of the rank's tiles)."""
    lengths = documents(seq, 16, 256)
    docs = flexmask.causal() & flexmask.document(lengths)
    per_document = PerDocumentBalancer([lengths], world)
    rng = random.Random(1)
    parents = [-1] + [
        rng.randrange(max(0, i - 512), i) if rng.random() > 0.002 else -1 for i in range(1, seq)
    ]
    tree = flexmask.tree(parents)
    print(f"\nShard build by path, S = {seq}, W = {world}, BLOCK_SIZE = 128\n")
    print("| mask | balancer | path | flexmask ms/rank | whole-mask build ms |")
    print("|---|---|---|---:|---:|")
    for name, mask, balancer, path in (
        ("documents", docs, "mask_aware", "runs"),
        ("documents", docs, per_document, "per-document"),
        ("documents & window 1024", docs & flexmask.sliding_window(1024), per_document, "segments"),
        ("tree", tree, "head_tail", "tiles"),
    ):
        flexmask.shard(mask, 1, 1, seq, world_size=world, rank=0, balancer=balancer)  # balancer
        ours = max(
            best_time(
                lambda r=r, mask=mask, balancer=balancer: flexmask.shard(
                    mask, 1, 1, seq, world_size=world, rank=r, balancer=balancer
                ),
                repeat=repeat,
            )
            for r in range(world)
        )
        whole = best_time(
            lambda mask=mask: flexmask.create_block_mask(mask, 1, 1, seq, seq, "cpu"),
            repeat=1,
        )
        label = balancer if isinstance(balancer, str) else type(balancer).__name__
        print(f"| {name} | {label} | {path} | {1e3 * ours:.1f} | {1e3 * whole:.1f} |", flush=True)


def imbalances(seq, world):
    rng = random.Random(1)
    lengths = documents(seq, 12, 2 * world * 64, seed=2)
    docs = flexmask.causal() & flexmask.document(lengths)
    parents = [-1] + [
        rng.randrange(max(0, i - 512), i) if rng.random() > 0.002 else -1 for i in range(1, seq)
    ]
    tree = flexmask.tree(parents)
    window = flexmask.causal() & flexmask.sliding_window(512)
    print(
        f"\nImbalance (max rank cost / mean; cost = full + partial blocks), S = {seq}, "
        f"W = {world}, BLOCK_SIZE = 128\n"
    )
    print("| masks | head-tail | per-document | mask-aware |")
    print("|---|---:|---:|---:|")
    for name, masks in (
        ("documents", [docs]),
        ("tree", [tree]),
        ("documents + sliding window", [docs, window]),
    ):
        head_tail = imbalance(masks, 1, 1, seq, world, "head_tail")
        per_doc = imbalance(masks, 1, 1, seq, world, PerDocumentBalancer([lengths], world))
        aware = MaskAwareBalancer(masks, 1, 1, seq, world)
        print(f"| {name} | {head_tail:.3f} | {per_doc:.3f} | {aware.imbalance:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="32768,65536,131072")
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--torch-max-elements", type=float, default=2e9)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--million", action="store_true", help="also S = 1M, W = 8")
    parser.add_argument("--million-only", action="store_true", help="only S = 1M, W = 8")
    parser.add_argument("--million-repeat", type=int, default=9, help="rounds at S = 1M")
    parser.add_argument("--million-ranks", default="0,3,7", help="ranks timed at S = 1M")
    parser.add_argument("--imbalance-seq", type=int, default=32768)
    parser.add_argument("--paths-seq", type=int, default=32768, help="0: skip")
    args = parser.parse_args()
    settle_allocator()
    # torch's rewritten mask_mod captures the rank as a Python int: one graph per rank.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sizes = [int(s) for s in args.sizes.split(",") if s]
    worlds = [int(w) for w in args.worlds.split(",") if w]
    million_ranks = [int(r) for r in args.million_ranks.split(",") if r]
    if args.million_only:
        million(args.million_repeat, million_ranks)
        return
    build_times(sizes, worlds, args.torch_max_elements, args.repeat)
    if args.million:
        million(args.million_repeat, million_ranks)
    if args.paths_seq:
        paths(args.paths_seq, 8, args.repeat)
    if args.imbalance_seq % 8:  # the per-document balancer's documents are multiples of 2W
        parser.error(
            f"--imbalance-seq must be a multiple of 8 (2 x the 4 ranks, as the per-document "
            f"balancer needs), got {args.imbalance_seq}"
        )
    imbalances(args.imbalance_seq, 4)


if __name__ == "__main__":
    main()
