"""What naming a leak's first layer adds to ``leak_test``: the locator alone (its replayed
passes, timed inside the test) against the whole test, and the test with and without it,
alternately, the best of ``--repeat`` each. Quoted in docs/leaks.md ("Where it starts").

Cases: bench_check's SmallLM (2 layers, width 64, 512 tokens, 9 documents) with a kernel
causal across the documents, by default and backward only; a tiny transformers Qwen3-Next
(a Gated DeltaNet layer, then an attention layer) packed by flexmask, 15 and 200 tokens.

    OMP_NUM_THREADS=1 python benchmarks/bench_leak_origin.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import flexmask
import flexmask.testing.passes as passes
from flexmask.testing import leak_test

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_check import SmallLM, documents  # noqa: E402

SPENT = [0.0]
_LOCATE = passes.locate_origin


def _timed_locate(*args, **kwargs):
    started = time.perf_counter()
    try:
        return _LOCATE(*args, **kwargs)
    finally:
        SPENT[0] += time.perf_counter() - started


def small_lm():
    torch.manual_seed(0)
    model = SmallLM(vocab=512, dim=64, heads=4, layers=2, hidden=128)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 512, (n,), generator=gen) for n in documents(512, seed=1, mean=64)]
    batch = flexmask.pack(seqs, max_len=512, strategy="next_fit")
    across = flexmask.lazy(flexmask.causal(), 1, 1, 512, 512, BLOCK_SIZE=64)
    return model, (batch.tokens, batch.position_ids, across), batch.mask


def qwen3_next(lengths):
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    from flexmask.integrations.transformers import model_inputs

    config = Qwen3NextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, 64, (n,), generator=gen) for n in lengths]
    batch = flexmask.pack(seqs, max_len=sum(lengths), strategy="next_fit")
    packed = model_inputs(model, batch)
    # Not seq_idx / cu_seq_lens: transformers refuses them on the CPU.
    inputs = {k: packed[k] for k in ("input_ids", "position_ids", "attention_mask")}
    return model, inputs, batch.mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    passes.locate_origin = _timed_locate
    cases = [
        ("SmallLM, 512 tokens", small_lm(), "auto"),
        ("SmallLM, 512 tokens", small_lm(), "grad"),
        ("tiny Qwen3-Next, 15 tokens", qwen3_next([5, 4, 6]), "auto"),
        ("tiny Qwen3-Next, 200 tokens", qwen3_next([60, 40, 70, 30]), "auto"),
    ]
    print(
        "| model | method | passes | locator's passes | leak_test | without locating | "
        "locating alone | share | named |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (model, inputs, mask), method in cases:
        leak_test(model, inputs, mask, method=method)  # warm-up
        on, off, alone = [], [], []
        for _ in range(args.repeat):
            SPENT[0] = 0.0
            started = time.perf_counter()
            report = leak_test(model, inputs, mask, method=method)
            on.append(time.perf_counter() - started)
            alone.append(SPENT[0])
            started = time.perf_counter()
            leak_test(model, inputs, mask, method=method, locate=False)
            off.append(time.perf_counter() - started)
        origin = report.origin
        assert origin is not None, str(report)
        print(
            f"| {name} | {report.method} | {report.passes} | {origin.checks} | {min(on):.3f} s"
            f" | {min(off):.3f} s | {min(alone):.3f} s | {min(alone) / min(off):.1%} | "
            f"`{origin.path or type(model).__name__}` |"
        )


if __name__ == "__main__":
    main()
