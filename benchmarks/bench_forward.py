"""Compiled flex_attention forward on CPU: flexmask's mask_mods against hand-written attn-gym ones.

Same kernel (``torch.compile(flex_attention, dynamic=False)``), same inputs; only the mask_mod
and the BlockMask's origin differ: flexmask's ``mask.mask_mod_for(S, S)`` in a BlockMask built by
``flexmask.create_block_mask``, against attn-gym's mask_mod in a BlockMask from torch's
``create_block_mask``. Each (mask, S) compiles once per side before timing (the first-call
compile time is reported); then best-of-N, the two sides interleaved so load on the machine
hits both alike. Outputs must agree (atol 1e-5). Target: flexmask within 5% of attn-gym.

    python benchmarks/bench_forward.py           # document-causal 2k/4k, causal, sliding (~3-6 min)
    python benchmarks/bench_forward.py --quick   # S = 512, fewer repeats (~1-2 min: compiles)
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from attn_gym.masks import causal_mask, generate_doc_mask_mod, generate_sliding_window
from attn_gym.masks.document_mask import length_to_offsets
from common import documents, fmt_time, machine, markdown_table, save_json
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention

import flexmask

HEADS, HEAD_DIM = 4, 64
TARGET = 0.05  # flexmask at most 5% slower than the hand-written mask_mod


def cases(S: int, window: int) -> dict[str, tuple[flexmask.Mask, Callable]]:
    """name -> (flexmask expression, the equivalent hand-written attn-gym mask_mod)."""
    lens = documents(S, 0)
    return {
        "document-causal": (
            flexmask.causal() & flexmask.document(lens),
            generate_doc_mask_mod(causal_mask, length_to_offsets(lens, "cpu")),
        ),
        "causal": (flexmask.causal(), causal_mask),
        # attn-gym's window w: q - kv <= w and causal; flexmask's: |q - kv| < w + 1.
        f"sliding window {window}": (
            flexmask.causal() & flexmask.sliding_window(window + 1),
            generate_sliding_window(window),
        ),
    }


def run(
    name: str, S: int, mask: flexmask.Mask, reference: Callable, compiled: Callable, repeat: int
) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(1, HEADS, S, HEAD_DIM, generator=generator) for _ in range(3))
    # flexmask's BlockMask carries ``mask.mask_mod_for(S, S)``: lookups sized by the length.
    ours_bm = flexmask.create_block_mask(mask, 1, 1, S, S, "cpu")
    theirs_bm = torch_create_block_mask(reference, 1, 1, S, S, device="cpu")
    if any(
        not torch.equal(getattr(ours_bm, t), getattr(theirs_bm, t))
        for t in ("kv_num_blocks", "full_kv_num_blocks")
    ):
        raise RuntimeError(f"{name} S={S}: the two BlockMasks differ; the masks are not equal")

    def ours() -> torch.Tensor:
        return compiled(q, k, v, block_mask=ours_bm)

    def theirs() -> torch.Tensor:
        return compiled(q, k, v, block_mask=theirs_bm)

    with torch.no_grad():
        compile_s = {}
        for side, fn in (("flexmask", ours), ("attn_gym", theirs)):
            start = time.perf_counter()
            fn()
            compile_s[side] = time.perf_counter() - start
        max_diff = (ours() - theirs()).abs().max().item()
        for _ in range(2):  # warm-up
            ours(), theirs()
        best = {"flexmask": float("inf"), "attn_gym": float("inf")}
        for i in range(repeat):
            order = (("flexmask", ours), ("attn_gym", theirs))
            for side, fn in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                fn()
                best[side] = min(best[side], time.perf_counter() - start)
    relative = best["flexmask"] / best["attn_gym"] - 1
    row = dict(
        mask=name,
        S=S,
        flexmask_s=best["flexmask"],
        attn_gym_s=best["attn_gym"],
        relative=relative,
        max_abs_diff=max_diff,
        agree=max_diff <= 1e-5,
        within_target=relative <= TARGET,
        compile_flexmask_s=compile_s["flexmask"],
        compile_attn_gym_s=compile_s["attn_gym"],
        sparsity=ours_bm.sparsity(),
    )
    print(
        f"  {name:>20} S={S:>5}: flexmask {fmt_time(row['flexmask_s']):>9} attn-gym "
        f"{fmt_time(row['attn_gym_s']):>9} ({relative:+.1%}), max |diff| {max_diff:.1e}, "
        f"compile {compile_s['flexmask']:.1f} s / {compile_s['attn_gym']:.1f} s",
        flush=True,
    )
    return row


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of the results (printed here, and on the benchmark page)."""
    return markdown_table(
        [
            "mask",
            "S",
            "blocks skipped",
            "flexmask",
            "attn-gym",
            "flexmask vs attn-gym",
            "max abs diff",
            "first call (compile†) flexmask / attn-gym",
            "within 5%",
        ],
        [
            [
                r["mask"],
                f"{r['S']:,}",
                f"{r['sparsity']:.0f}%",
                fmt_time(r["flexmask_s"]),
                fmt_time(r["attn_gym_s"]),
                f"{r['relative']:+.1%}",
                f"{r['max_abs_diff']:.1e}",
                f"{fmt_time(r['compile_flexmask_s'])} / {fmt_time(r['compile_attn_gym_s'])}",
                "PASS" if r["within_target"] else "FAIL",
            ]
            for r in results
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 512 only, fewer repeats")
    parser.add_argument("--window", type=int, default=256, help="sliding window size w")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per side")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    # (mask, S) configurations: document-causal at every size, the others at the smallest.
    # Each costs two compiles (one per mask_mod), so keep the list short.
    sizes = [512] if args.quick else [2048, 4096]
    repeat = args.repeat or (5 if args.quick else 40)
    window = min(args.window, sizes[0] // 4)

    # One compiled function serves every configuration: each (mask_mod, S) is a guarded graph
    # of it, so allow more graphs than dynamo's default before it falls back to eager.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 256
    compiled = torch.compile(flex_attention, dynamic=False)

    print(f"# Compiled flex_attention forward: flexmask vs attn-gym mask_mods\n\n{machine()}\n")
    print(
        f"B=1, H={HEADS}, D={HEAD_DIM}, fp32, no grad, best of {repeat} interleaved calls, "
        f"load average {os.getloadavg()[0]:.1f}\n",
        flush=True,
    )
    start = time.perf_counter()
    results = []
    for i, S in enumerate(sizes):
        for name, (mask, reference) in cases(S, window).items():
            if i > 0 and name != "document-causal":  # the others at the smallest S only
                continue
            results.append(run(name, S, mask, reference, compiled, repeat))
    total = time.perf_counter() - start

    print()
    print(table(results))
    agree = all(r["agree"] for r in results)
    passed = all(r["within_target"] for r in results)
    print(
        f"\nTarget: flexmask's forward within 5% of the hand-written mask_mod's: "
        f"{'PASS' if passed else 'FAIL'}. Outputs agree within 1e-5: "
        f"{'yes' if agree else 'NO'}. Compiles and timing took {total:.0f} s; load average "
        f"{os.getloadavg()[0]:.1f} at the end."
    )
    save_json(
        args.json,
        {
            "machine": machine(),
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "repeat": repeat,
            "window": window,
            "target": TARGET,
            "results": results,
            "passed": passed,
            "agree": agree,
            "seconds": total,
        },
    )
    if not agree:
        raise SystemExit("flexmask and attn-gym outputs differ by more than 1e-5")


if __name__ == "__main__":
    main()
