"""Packed training with document masks: no padding, and no token sees another document.

Usage: python examples/packed_training.py [--quick] [--steps 30] [--max-len 256]

Each step takes the next documents of a synthetic corpus, packs them with ``flexmask.pack``
into rows of ``--max-len`` tokens and trains on them under ``causal() & document(seq_lens)``
(``batch.lazy(...)``, released after the backward). Before training it checks that packing
changes nothing but the layout: every document's logits in the packed batch equal its logits
computed alone. It prints the loss and how much of each batch is real tokens, packed against
padded to the longest document.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _model import TinyLM
from _synthetic import VOCAB, make_corpus

import flexmask

IGNORE = -100
ATOL = 1e-5
# Short documents in rows of a few hundred tokens: on the CPU's block-sparse path, blocks of
# 32 skip more of the masked area than torch's default of 128 and measured faster.
BLOCK_SIZE = 32


def padded_slots(sequences: list[list[int]]) -> int:
    """Slots a batch padded to its longest sequence takes."""
    return len(sequences) * max(map(len, sequences))


def check_packing_is_exact(model: TinyLM, sequences: list[list[int]], max_len: int) -> float:
    """Max |packed - alone| over every document's logits; raises if above ``ATOL``."""
    batch = flexmask.pack(sequences, max_len)
    with torch.no_grad(), batch.lazy(model.num_heads, "cpu", block_size=BLOCK_SIZE) as handle:
        packed = batch.unpack(model(batch.tokens, batch.position_ids, handle))
        worst = 0.0
        for seq, got in zip(sequences, packed, strict=True):
            tokens = torch.tensor(seq)[None]
            alone = model(tokens, torch.arange(len(seq))[None])[0]  # plain causal attention
            worst = max(worst, (got - alone).abs().max().item())
    if worst > ATOL:
        raise SystemExit(f"packed and unpacked logits differ by {worst:.2e}")
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="10 steps")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 30)")
    parser.add_argument("--max-len", type=int, default=256, help="packed row length")
    parser.add_argument("--docs-per-step", type=int, default=16)
    args = parser.parse_args(argv)
    steps = args.steps or (10 if args.quick else 30)

    torch.manual_seed(0)
    docs = [doc.tokens for doc in make_corpus(steps * args.docs_per_step + 8, seed=1)]
    model = TinyLM(VOCAB, dim=64, num_heads=4, num_layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    worst = check_packing_is_exact(model, docs[-8:], args.max_len)
    print(f"packed logits == logits of each document alone (max |difference| {worst:.1e})\n")

    real = slots = pad_slots = 0
    losses = []
    print(f"{'step':>4} {'rows':>4} {'docs':>4} {'loss':>7} {'packed':>7} {'padded':>7}")
    for step in range(steps):
        sequences = docs[step * args.docs_per_step : (step + 1) * args.docs_per_step]
        batch = flexmask.pack(sequences, args.max_len)
        with batch.lazy(model.num_heads, "cpu", block_size=BLOCK_SIZE) as handle:
            logits = model(batch.tokens, batch.position_ids, handle)
            loss = F.cross_entropy(
                logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE
            )
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        losses.append(loss.item())
        real += batch.num_tokens
        slots += batch.num_rows * batch.max_len
        pad_slots += padded_slots(sequences)
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            padded = batch.num_tokens / padded_slots(sequences)
            print(
                f"{step:>4} {batch.num_rows:>4} {len(sequences):>4} {losses[-1]:>7.3f} "
                f"{100 * batch.efficiency:>6.1f}% {100 * padded:>6.1f}%"
            )

    print(f"\nloss {losses[0]:.3f} → {losses[-1]:.3f} over {steps} steps")
    print(
        f"real tokens per computed slot: packed {100 * real / slots:.1f}% "
        f"({slots:,} slots), padded to the longest document {100 * real / pad_slots:.1f}% "
        f"({pad_slots:,} slots): {pad_slots / slots:.1f}x fewer slots packed"
    )


if __name__ == "__main__":
    main()
