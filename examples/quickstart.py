"""Quickstart: compose masks, look at them, build their BlockMasks beside torch's builder.

Run: python examples/quickstart.py [--seq-len 8192]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask


def timed(fn, repeat: int = 3):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    S = args.seq_len
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(S // 16, S // 4, (32,), generator=gen)
    seq_lens = seq_lens[: int((seq_lens.cumsum(0) <= S).sum())].tolist()
    parents = [-1] + [max(0, i - 1 - (i % 97 == 0) * (i % 50)) for i in range(1, S)]

    masks = {
        "causal": flexmask.causal(),
        "document-causal": flexmask.causal() & flexmask.document(seq_lens),
        "sliding window (causal, 512)": flexmask.causal() & flexmask.sliding_window(512),
        "prefix-LM (prefix 1000)": flexmask.causal() | flexmask.prefix(1000),
        "padding (causal, 2 rows)": flexmask.causal() & flexmask.padding([S, S - 1000]),
        "tree": flexmask.tree(parents),
    }
    print(f"flexmask {flexmask.__version__}, torch {torch.__version__}, S={S}\n")
    print("What `causal() & document([3, 2]) | prefix(1)` looks like (■ attends, ⬚ does not):")
    print((flexmask.causal() & flexmask.document([3, 2]) | flexmask.prefix(1)).show(5))
    print()
    header = f"{'mask':32} {'sparsity':>9} {'flexmask':>10} {'torch eager':>12} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for name, mask in masks.items():
        B = mask.rows or 1
        fm_time, fm_bm = timed(lambda m=mask, b=B: flexmask.create_block_mask(m, b, 1, S, S, "cpu"))
        t_time, t_bm = timed(
            lambda m=mask, b=B: torch_create_block_mask(m.mask_mod, b, 1, S, S, device="cpu"),
            repeat=1,
        )
        if not flexmask.same_blocks(fm_bm, t_bm):
            raise SystemExit(f"{name}: flexmask and torch disagree — please report this")
        print(
            f"{name:32} {fm_bm.sparsity():8.1f}% {fm_time * 1e3:8.2f}ms {t_time * 1e3:10.1f}ms "
            f"{t_time / fm_time:8.0f}x"
        )
    print(
        "\nEvery BlockMask above lists the same blocks (and the same full/partial split) as "
        "torch's create_block_mask."
    )
    print("Block picture of a document-causal mask over 16 x 16 blocks (torch's BlockMask repr):")
    small = flexmask.causal() & flexmask.document([700, 300, 1048])
    print(flexmask.create_block_mask(small, 1, 1, 2048, 2048, "cpu"))


if __name__ == "__main__":
    main()
