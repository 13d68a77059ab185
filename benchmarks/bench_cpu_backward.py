"""CPU forward+backward: flexmask's CPU attention against dense SDPA with a bool mask.

flex_attention has no backward on CPU, so the dense alternative is
``scaled_dot_product_attention(q, k, v, attn_mask=(1, 1, S, S) bool)``. Both are timed on the
same inputs in one run, interleaved (flexmask, SDPA, flexmask, ...) so a busy machine slows
both alike; memory is the peak of tensors alive at once during the call, measured from the
allocator (``_memory.peak_extra_bytes``: the calling thread's tensors, so the sparse path runs
on one thread for it), and the rise of the process's resident set (``_memory.peak_rss_bytes``:
every thread, both sides on their default threads), with SDPA's dense mask built inside the
call so it is counted (building it is the price of using SDPA with a mask). flexmask runs what
``flexmask.flex_attention`` runs for the Mask on the CPU (the row says which backend: ``slices``,
torch's fused flash kernel once per slice of the mask, where it takes the mask; else the
block-sparse path with its defaults, which hands masks to SDPA where that is faster); where
that is ``slices``, the block-sparse path's own time is a row too.

Run from the repository root::

    python benchmarks/bench_cpu_backward.py           # representative subset (minutes)
    python benchmarks/bench_cpu_backward.py --quick   # S = 1024, 2048, two masks (seconds)
    python benchmarks/bench_cpu_backward.py --full    # issue #15's grid: S = 1k-16k,
                                                      # B in {1, 4}, H in {4, 8}, six masks
    python benchmarks/bench_cpu_backward.py --quick --busy 1   # with one core taken
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # _memory.py, and flexmask when not installed

from _memory import peak_extra_bytes, peak_rss_bytes  # noqa: E402
from common import busy_processes, fmt_bytes, fmt_time, markdown_table, ratio  # noqa: E402

import flexmask  # noqa: E402
from flexmask.backends.block_sparse.api import block_sparse_attention  # noqa: E402
from flexmask.backends.dense import choose_backend, is_causal  # noqa: E402
from flexmask.backends.plan import make_plan  # noqa: E402


def document_causal(seq_len: int, num_docs: int, seed: int) -> tuple[Callable[..., Tensor], Tensor]:
    """attn-gym's document mask over causal: random cut points, ``num_docs`` non-empty docs."""
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq_len - 1, generator=generator)[: num_docs - 1] + 1
    lengths = torch.diff(
        torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([seq_len])])
    )
    document_id = torch.repeat_interleave(torch.arange(num_docs), lengths)

    def document_causal_mask(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    return document_causal_mask, document_id


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(window: int) -> Callable[..., Tensor]:
    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return sliding_window_mask


def rl_group(seq_len: int, completions: int = 8) -> Callable[..., Tensor]:
    """A tree of depth 1, as in RL (GRPO) training: one prompt (a quarter of the sequence)
    shared by ``completions`` answers; each answer sees the prompt and itself, causally."""
    prompt = seq_len // 4
    branch = torch.zeros(seq_len, dtype=torch.long)
    branch[prompt:] = 1 + torch.arange(seq_len - prompt) * completions // (seq_len - prompt)

    def rl_group_mask(b, h, q_idx, kv_idx):
        same = (branch[kv_idx] == 0) | (branch[kv_idx] == branch[q_idx])
        return same & (q_idx >= kv_idx)

    return rl_group_mask


def make_mask(name: str, seq_len: int) -> tuple[Callable[..., Tensor], flexmask.Mask]:
    """A named mask as an attn-gym style mask_mod (for SDPA's dense mask) and as the flexmask
    expression a user writes (for flexmask): causal, doc-N (document-causal, N documents),
    window-W (causal sliding window) or tree (an RL group). The run checks they agree."""
    if name == "causal":
        return causal_mask, flexmask.causal()
    if name.startswith("doc-"):
        mask_mod, document_id = document_causal(seq_len, int(name[4:]), seed=seq_len)
        lengths = torch.bincount(document_id).tolist()
        return mask_mod, flexmask.causal() & flexmask.document(lengths)
    if name.startswith("window-"):
        window = int(name[7:])
        return sliding_window(window), flexmask.causal() & flexmask.sliding_window(window)
    if name == "tree":
        prompt = seq_len // 4
        branch = torch.zeros(seq_len, dtype=torch.long)
        branch[prompt:] = 1 + torch.arange(seq_len - prompt) * 8 // (seq_len - prompt)
        parents = list(range(-1, prompt - 1))  # the prompt is a chain; each answer hangs off it
        for position in range(prompt, seq_len):
            same = position > prompt and branch[position] == branch[position - 1]
            parents.append(position - 1 if same else prompt - 1)
        return rl_group(seq_len), flexmask.tree(parents)
    raise ValueError(f"mask must be causal, doc-N, window-W or tree, got {name!r}")


def dense_mask(mask_mod: Callable, seq_len: int) -> Tensor:
    """The (1, 1, S, S) bool mask SDPA needs, by broadcasting (our mask_mods allow it)."""
    idx = torch.arange(seq_len)
    zero = torch.zeros((), dtype=torch.long)
    return mask_mod(zero, zero, idx[:, None], idx[None, :])[None, None]


def run_case(
    name: str, seq_len: int, batch: int, heads: int, head_dim: int, repeats: int
) -> list[dict]:
    mask_mod, mask = make_mask(name, seq_len)
    generator = torch.Generator().manual_seed(seq_len)
    q, k, v = (
        torch.randn(batch, heads, seq_len, head_dim, generator=generator).requires_grad_()
        for _ in range(3)
    )
    grad_out = torch.randn(batch, heads, seq_len, head_dim, generator=generator)

    start = time.perf_counter()
    block_mask: BlockMask = flexmask.create_block_mask(mask, 1, 1, seq_len, seq_len)
    build_s = time.perf_counter() - start
    plan = make_plan(q, k, v, block_mask, None, None, False, "auto")
    backend = choose_backend(plan, mask)
    chosen = flexmask.explain(q, k, v, mask).backend  # what flexmask.flex_attention runs

    def clear() -> None:
        for t in (q, k, v):
            t.grad = None

    def block_sparse_path(threads: int | None = None) -> None:
        clear()
        block_sparse_attention(q, k, v, block_mask, mask=mask, threads=threads).backward(grad_out)

    def flexmask_path(threads: int | None = None) -> None:
        # What flexmask.flex_attention runs for this mask on the CPU (the Mask passed along).
        if chosen != "slices":
            block_sparse_path(threads)
            return
        clear()
        flexmask.flex_attention(q, k, v, block_mask=mask).backward(grad_out)

    def sdpa() -> None:
        clear()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mask_mod, seq_len))
        out.backward(grad_out)

    # Same gradients, or the timings compare different things. Also the warm-up of both paths,
    # and of flexmask's thread choice (threads=None), which times each way once to begin with.
    flexmask_path()
    flexmask_path()
    grads = [t.grad.clone() for t in (q, k, v)]
    sdpa()
    max_err = max((g - t.grad).abs().max().item() for g, t in zip(grads, (q, k, v), strict=True))

    def sparse_path(threads: int | None = None) -> None:
        clear()
        block_sparse_attention(
            q, k, v, block_mask, mask=mask, kernel="sparse", threads=threads
        ).backward(grad_out)

    label = "slices" if chosen == "slices" else backend
    impls = [(f"flexmask ({label})", flexmask_path), ("sdpa + dense bool mask", sdpa)]
    if chosen == "slices":
        impls.append((f"flexmask block_sparse ({backend})", block_sparse_path))
    elif backend != "sparse" and not is_causal(plan, mask):
        # Where auto hands the mask to SDPA, the sparse kernel's time too: the rows that set
        # SDPA_MIN_DENSITY.
        impls.append(("flexmask (sparse, forced)", sparse_path))
    times: dict[str, list[float]] = {impl: [] for impl, _ in impls}
    for _ in range(repeats):  # interleaved: load changes hit both sides alike
        for impl, fn in impls:
            gc.collect()
            begin = time.perf_counter()
            fn()
            times[impl].append(time.perf_counter() - begin)
    # The share of the block grid the BlockMask lists: a kernel whose cost followed its
    # listed blocks would take about this share of SDPA's dense time.
    listed = 1 - block_mask.sparsity() / 100
    rows = []
    for impl, fn in impls:
        gc.collect()
        # The profiler sees the allocations of the calling thread only: the sparse kernel's
        # memory is measured on one thread (each further thread adds one group's temporaries).
        peak, _ = peak_extra_bytes(fn if impl.startswith("sdpa") else lambda fn=fn: fn(1))
        # The resident set's rise counts every thread, both sides on their default threads;
        # the last run's gradients are dropped first (each call makes its own).
        clear()
        rss, _ = peak_rss_bytes(fn)
        rows.append(
            dict(
                mask=name,
                S=seq_len,
                B=batch,
                H=heads,
                impl=impl,
                seconds=statistics.median(times[impl]),
                peak=peak,
                rss=rss,
                max_err=max_err,
                load=_load(),
                listed=listed,
            )
        )
    to_sdpa = rows[0]["seconds"] / rows[1]["seconds"]
    print(
        f"  {name:>12} S={seq_len} B={batch} H={heads}: blocks listed {100 * listed:.1f}%, "
        f"flexmask.create_block_mask {build_s:.3f}s, flexmask/SDPA {to_sdpa:.2f}x, "
        f"/(listed x SDPA) {to_sdpa / listed:.2f}x, max |grad diff| {max_err:.1e}, "
        f"load {_load()}",
        flush=True,
    )
    return rows


def _load() -> str:
    """The 1-minute load average: timings from a busy machine are not comparable."""
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def table(rows: list[dict]) -> str:
    """The markdown table of the rows, each against SDPA on the same mask and S (printed
    here, and on the benchmark page)."""

    def sdpa(row: dict) -> dict:
        return next(
            r
            for r in rows
            if (r["mask"], r["S"], r.get("B", 1), r.get("H"))
            == (row["mask"], row["S"], row.get("B", 1), row.get("H"))
            and r["impl"].startswith("sdpa")
        )

    return markdown_table(
        [
            "mask",
            "S",
            "B×H",
            "implementation",
            "fwd+bwd",
            "peak extra memory",
            "time vs SDPA",
            "blocks listed",
            "vs listed × SDPA",
            "memory vs SDPA",
            "peak RSS rise",
            "RSS vs SDPA",
            "max grad diff vs SDPA",
        ],
        [
            [
                r["mask"],
                f"{r['S']:,}",
                f"{r.get('B', 1)}×{r.get('H', '?')}",
                r["impl"],
                fmt_time(r["seconds"]),
                fmt_bytes(r["peak"]),
                ratio(r["seconds"], sdpa(r)["seconds"], 2),
                f"{100 * r['listed']:.1f}%" if "listed" in r else "—",
                "—"
                if r["impl"].startswith("sdpa") or "listed" not in r
                else ratio(r["seconds"], r["listed"] * sdpa(r)["seconds"], 2),
                ratio(r["peak"], sdpa(r)["peak"], 3),
                fmt_bytes(r["rss"]) if "rss" in r else "—",
                ratio(r["rss"], sdpa(r)["rss"], 3) if "rss" in r else "—",
                "—" if r["impl"].startswith("sdpa") else f"{r['max_err']:.1e}",
            ]
            for r in rows
        ],
    )


SUBSET = dict(
    lengths=(2048, 8192),
    batches=(1,),
    heads=(4,),
    masks=("causal", "doc-4", "doc-20", "doc-100", "window-1024", "tree"),
)
QUICK = dict(lengths=(1024, 2048), batches=(1,), heads=(4,), masks=("causal", "doc-20"))
FULL = dict(
    lengths=(1024, 2048, 4096, 8192, 16384),
    batches=(1, 4),
    heads=(4, 8),
    masks=("causal", "doc-4", "doc-20", "doc-100", "window-1024", "tree"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 1024, 2048, two masks")
    parser.add_argument("--full", action="store_true", help="issue #15's whole grid (hours)")
    parser.add_argument("--lengths", type=int, nargs="*", help="override the sequence lengths")
    parser.add_argument("--masks", nargs="*", help="causal, doc-N, window-W, tree")
    parser.add_argument("--batches", type=int, nargs="*", help="override the batch sizes")
    parser.add_argument("--heads", type=int, nargs="*", help="override the head counts")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 on a shared machine keeps the many small ops "
        "of the sparse path from waiting on a descheduled second thread",
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="spinning processes to run alongside (as DataLoader workers or other jobs would): "
        "the sparse path's threads must not stall when a core is taken",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = dict(FULL if args.full else QUICK if args.quick else SUBSET)
    if args.lengths:
        grid["lengths"] = tuple(args.lengths)
    if args.masks:
        grid["masks"] = tuple(args.masks)
    if args.batches:
        grid["batches"] = tuple(args.batches)
    if args.heads:
        grid["heads"] = tuple(args.heads)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, D={args.head_dim} fp32, "
        f"forward+backward, load average {_load()}",
        flush=True,
    )
    started = time.perf_counter()
    rows: list[dict] = []
    with busy_processes(args.busy):
        for seq_len in grid["lengths"]:
            for batch in grid["batches"]:
                for heads in grid["heads"]:
                    repeats = args.repeats or (3 if seq_len * batch * heads <= 4096 * 4 else 1)
                    for name in grid["masks"]:
                        rows += run_case(name, seq_len, batch, heads, args.head_dim, repeats)

    print(f"\nload average at the end {_load()}, {time.perf_counter() - started:.0f} s in all")
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        settings = dict(head_dim=args.head_dim, grid={k: list(v) for k, v in grid.items()})
        Path(args.json).write_text(json.dumps({**settings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
