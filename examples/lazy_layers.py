"""Lazy handles through a layer stack: one build per micro-batch; static masks stay cached.

Usage: python examples/lazy_layers.py [--quick] [--layers 4] [--steps 3] [--micro-batches 2]

A transformer-style stack runs several training steps of several micro-batches each. Every
micro-batch gets one ``flexmask.lazy`` handle, passed as is to ``flexmask.flex_attention`` in
every layer. The example checks and prints:

* each handle builds once (``handle.builds == 1``) however many layers use it — where the
  backend reads the BlockMask, as torch's kernel does on an accelerator; on the CPU the
  block-sparse path stands in for it here (``--backend``), since the default there, the
  ``slices`` backend, lowers the mask itself and builds nothing (``--backend auto`` shows it);
* a static mask (causal sliding window, same shape each step) misses once, then hits the cache
  on every later micro-batch, and stays cached when its handle is released;
* a per-batch document mask (packed sequences) is built for its micro-batch and leaves the
  cache when its handle is released, so the cache does not fill with masks that never recur.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
from _model import TinyLM

import flexmask

VOCAB = 64


def count_layer_calls(model: TinyLM) -> list[int]:
    """A one-element counter of block forwards (each block calls flex_attention once)."""
    calls = [0]

    def bump(*_: object) -> None:
        calls[0] += 1

    for block in model.blocks:
        block.register_forward_hook(bump)
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter sequences")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--backend",
        default="block_sparse",
        help="the attention backend (auto: flexmask.flex_attention's choice, slices on the CPU)",
    )
    args = parser.parse_args(argv)
    seq_len = 256 if args.quick else 512
    rows = 2

    rng = random.Random(0)
    torch.manual_seed(0)
    model = TinyLM(
        VOCAB, dim=64, num_heads=args.heads, num_layers=args.layers, backend=args.backend
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layer_calls = count_layer_calls(model)
    static_mask = flexmask.causal() & flexmask.sliding_window(128)
    flexmask.cache_clear()

    print(
        f"{args.layers} layers, {args.steps} steps x {args.micro_batches} micro-batches, "
        f"sequences of {seq_len} tokens\n"
    )
    header = (
        f"{'step':>4} {'micro':>5}  {'mask':<26} {'layers':>6} {'builds':>6} "
        f"{'cache':<5} {'released':<9} {'cached':>6}"
    )
    print(header)
    print("-" * len(header))
    for step in range(args.steps):
        for micro in range(args.micro_batches):
            # Micro-batch A: fixed-length rows under a static sliding-window mask.
            tokens = torch.randint(0, VOCAB, (rows, seq_len))
            positions = torch.arange(seq_len).expand(rows, -1)
            labels = torch.roll(tokens, -1, dims=1)
            labels[:, -1] = -100
            handle = flexmask.lazy(static_mask, rows, args.heads, seq_len, seq_len, "cpu")
            run_micro_batch(
                model,
                layer_calls,
                (step, micro, "causal & window(128)"),
                handle,
                tokens,
                positions,
                labels,
            )

            # Micro-batch B: packed documents, a mask that exists for this micro-batch only.
            docs = [
                torch.randint(0, VOCAB, (rng.randint(8, seq_len // 2),)).tolist()
                for _ in range(rows * 4)
            ]
            batch = flexmask.pack(docs, seq_len)
            run_micro_batch(
                model,
                layer_calls,
                (step, micro, f"causal & document ({batch.num_rows} rows)"),
                batch.lazy(args.heads, "cpu"),
                batch.tokens,
                batch.position_ids,
                batch.labels,
                release_after_forward=True,
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    info = flexmask.cache_info()
    print(
        f"\ncache: {info.hits} hits, {info.misses} misses, hit rate {100 * info.hit_rate:.0f}%, "
        f"{info.evictions} evictions, {info.discarded} discarded on release, "
        f"{info.entries} entries ({info.bytes} bytes) held"
    )
    static_lookups = args.steps * args.micro_batches
    # The static mask: one miss, then a hit for every other micro-batch. Document masks: one
    # miss each, removed on release, so only the static mask remains cached.
    expected = (static_lookups - 1, 1 + static_lookups, 1, static_lookups)
    if args.backend == "auto":  # slices may build nothing: no count to expect
        print("every handle built at most once for all layers.")
        return
    if (info.hits, info.misses, info.entries, info.discarded) != expected:
        raise SystemExit(f"expected (hits, misses, entries, discarded) = {expected}, got {info}")
    print("every handle built once for all layers; the static mask was reused from the cache;")
    print("every document mask left the cache on release.")


def run_micro_batch(
    model, layer_calls, label, handle, tokens, positions, labels, release_after_forward=False
) -> None:
    """Forward + backward of one micro-batch under ``handle``, released after; prints a row.

    Two ways to release: the context manager (after the backward), or ``release_after(model)``,
    a one-shot hook that fires when the forward returns; the backward still has what autograd
    saved, so it needs no BlockMask.
    """
    before = flexmask.cache_info()
    calls_before = layer_calls[0]
    if release_after_forward:
        handle.release_after(model)
        logits = model(tokens, positions, handle)
        released = "after fwd" if not handle.built else "never"
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    else:
        with handle:  # every layer below gets this handle; released after the backward
            logits = model(tokens, positions, handle)
            F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        released = "after bwd"
    after = flexmask.cache_info()
    if handle.builds > 1 or (handle.builds == 0 and model.blocks[0].backend != "auto"):
        raise SystemExit(f"handle built {handle.builds} times for one micro-batch")
    step, micro, name = label
    outcome = "hit" if after.hits > before.hits else "miss" if after.misses > before.misses else "-"
    print(
        f"{step:>4} {micro:>5}  {name:<26} {layer_calls[0] - calls_before:>6} "
        f"{handle.builds:>6} {outcome:<5} {released:<9} {after.entries:>6}"
    )


if __name__ == "__main__":
    main()
