"""CPU forward+backward: block_sparse_attention against dense SDPA with a bool mask.

flex_attention has no backward on CPU, so the dense alternative is
``scaled_dot_product_attention(q, k, v, attn_mask=(1, 1, S, S) bool)``. Both are timed on the
same inputs in one run; memory is the peak of tensors alive at once during the call, measured
from the allocator (``_memory.peak_extra_bytes``), with SDPA's dense mask built inside the call
so it is counted (building it is the price of using SDPA with a mask).

Run from the repository root::

    python benchmarks/bench_cpu_backward.py           # S = 4096 and 16384 (a few minutes)
    python benchmarks/bench_cpu_backward.py --quick   # S = 1024 and 2048 (seconds)
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
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # _memory.py, and flexmask when not installed

from _memory import peak_extra_bytes  # noqa: E402
from common import fmt_bytes, fmt_time, markdown_table, ratio  # noqa: E402

from flexmask.block_sparse import block_sparse_attention  # noqa: E402


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


def dense_mask(mask_mod: Callable, seq_len: int) -> Tensor:
    """The (1, 1, S, S) bool mask SDPA needs, by broadcasting (our mask_mods allow it)."""
    idx = torch.arange(seq_len)
    zero = torch.zeros((), dtype=torch.long)
    return mask_mod(zero, zero, idx[:, None], idx[None, :])[None, None]


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``fn()`` (the gradient check before it serves as warm-up)."""
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(
    name: str, mask_mod: Callable, seq_len: int, heads: int, head_dim: int, repeats: int
) -> list[dict]:
    generator = torch.Generator().manual_seed(seq_len)
    q, k, v = (
        torch.randn(1, heads, seq_len, head_dim, generator=generator).requires_grad_()
        for _ in range(3)
    )
    grad_out = torch.randn(1, heads, seq_len, head_dim, generator=generator)

    start = time.perf_counter()
    block_mask: BlockMask = create_block_mask(mask_mod, 1, 1, seq_len, seq_len, device="cpu")
    build_s = time.perf_counter() - start

    def clear() -> None:
        for t in (q, k, v):
            t.grad = None

    def block_sparse(recompute: bool) -> Callable[[], None]:
        def fn() -> None:
            clear()
            out = block_sparse_attention(q, k, v, block_mask, recompute=recompute)
            out.backward(grad_out)

        return fn

    def sdpa() -> None:
        clear()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mask_mod, seq_len))
        out.backward(grad_out)

    # Same gradients, or the timings compare different things. Also the warm-up of both paths.
    block_sparse(True)()
    grads = [t.grad.clone() for t in (q, k, v)]
    sdpa()
    max_err = max((g - t.grad).abs().max().item() for g, t in zip(grads, (q, k, v), strict=True))

    rows = []
    for impl, fn in (
        ("block_sparse (recompute)", block_sparse(True)),
        ("block_sparse (keep activations)", block_sparse(False)),
        ("sdpa + dense bool mask", sdpa),
    ):
        seconds = timed(fn, repeats)
        gc.collect()
        peak, _ = peak_extra_bytes(fn)
        rows.append(
            dict(mask=name, S=seq_len, impl=impl, seconds=seconds, peak=peak, max_err=max_err)
        )
    density = 100 - block_mask.sparsity()
    print(
        f"  {name:>15} S={seq_len}: blocks computed {density:.1f}%, create_block_mask "
        f"{build_s:.2f}s, max |grad diff| vs SDPA {max_err:.1e}",
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
            if r["mask"] == row["mask"] and r["S"] == row["S"] and r["impl"].startswith("sdpa")
        )

    return markdown_table(
        [
            "mask",
            "S",
            "implementation",
            "fwd+bwd",
            "peak extra memory",
            "time vs SDPA",
            "memory vs SDPA",
            "max grad diff vs SDPA",
        ],
        [
            [
                r["mask"],
                f"{r['S']:,}",
                r["impl"],
                fmt_time(r["seconds"]),
                fmt_bytes(r["peak"]),
                ratio(r["seconds"], sdpa(r)["seconds"], 2),
                ratio(r["peak"], sdpa(r)["peak"], 3),
                "—" if r["impl"].startswith("sdpa") else f"{r['max_err']:.1e}",
            ]
            for r in rows
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 1024, 2048 (seconds)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--docs", type=int, default=8, help="documents in the document mask")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    lengths = (1024, 2048) if args.quick else (4096, 16384)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, B=1 H={args.heads} "
        f"D={args.head_dim} fp32, forward+backward, load average {_load()}",
        flush=True,
    )
    rows: list[dict] = []
    for seq_len in lengths:
        repeats = args.repeats or (3 if seq_len <= 4096 else 1)
        doc_mask, _ = document_causal(seq_len, args.docs, seed=seq_len)
        rows += run_case("document-causal", doc_mask, seq_len, args.heads, args.head_dim, repeats)
        rows += run_case("causal", causal_mask, seq_len, args.heads, args.head_dim, repeats)

    print(f"\nload average at the end {_load()}")
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        settings = dict(heads=args.heads, head_dim=args.head_dim, docs=args.docs)
        Path(args.json).write_text(json.dumps({**settings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
