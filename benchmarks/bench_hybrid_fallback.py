"""What keep_documents_apart costs: a hybrid model's training step, packed with the exact
per-document fallback, against the same documents padded (one per row) and packed without it
(wrong — its recurrent layers carry one document into the next — but the speed peer), in one
run; and building the arguments (``model_inputs``, with and without ``check=True``) and the
fallback's reading of the boundaries, as a share of a training step at 8k-32k tokens.

The model: a Qwen3.5-style hybrid (transformers' ``Qwen3_5TextConfig``): width 256, 4 layers
(3 Gated DeltaNet, 1 full attention), MLP 512, vocabulary 8192, float32 on the CPU,
transformers' torch paths (no fla / causal_conv1d). Step: forward + backward of the summed
logits' squares over the real tokens.

Run: ``python benchmarks/bench_hybrid_fallback.py`` (``--sizes 1024 4096``, ``--overhead 8192
32768``, ``--json out.json``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from common import best_time, documents, fmt_time, machine, markdown_table, save_json

import flexmask
from flexmask.integrations.hybrid import BOUNDARY_ARGUMENTS, keep_documents_apart
from flexmask.integrations.transformers import model_inputs, register


def hybrid_model(implementation: str):
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=1 << 16,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation
    )
    return model.float().train()


def step(model, inputs, real) -> None:
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    logits[real].pow(2).sum().backward()


def batch_of(size: int, seed: int = 0):
    lengths = documents(size, seed, mean=max(16, size // 32))
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 8192, (n,), generator=gen).tolist() for n in lengths]
    return lengths, docs, flexmask.pack(docs, max_len=size)


def compare(size: int, repeat: int) -> list:
    model = hybrid_model("sdpa")
    lengths, docs, batch = batch_of(size)
    real = batch.position_ids >= 0  # pack fills the row: every token is a document's
    packed = model_inputs(model, batch)
    wrong = {k: v for k, v in packed.items() if k not in BOUNDARY_ARGUMENTS}
    wrong["use_cache"] = False
    width = max(lengths)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    pad = torch.zeros(len(docs), width, dtype=torch.long)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)] = torch.tensor(doc)
        pad[row, : len(doc)] = 1
    padded = {"input_ids": ids, "attention_mask": pad, "use_cache": False}
    times = {}
    times["padded"] = best_time(lambda: step(model, padded, pad.bool()), repeat)
    times["packed, no fallback"] = best_time(lambda: step(model, wrong, real), repeat)
    with keep_documents_apart(model):
        times["packed, fallback"] = best_time(lambda: step(model, packed, real), repeat)
    base = times["packed, no fallback"]
    return [
        [
            f"S = {size} ({len(lengths)} documents, longest {width})",
            *(f"{fmt_time(times[k])} ({times[k] / base:.2f}x)" for k in times),
        ]
    ]


def overhead(size: int) -> list:
    register()
    model = hybrid_model("flexmask")  # flexmask attention: trains on the CPU at 32k
    lengths, _, batch = batch_of(size, seed=1)
    real = batch.position_ids >= 0
    handle = keep_documents_apart(model)
    inputs = model_inputs(model, batch)
    start = time.perf_counter()
    step(model, inputs, real)  # one step: long at 32k, and the share needs no more
    step_time = time.perf_counter() - start
    build = best_time(lambda: model_inputs(model, batch), 5)
    checked = best_time(lambda: model_inputs(model, batch, check=True), 3)

    def read() -> None:  # what the fallback adds per step besides running the layers
        handle._enter(model, (), inputs)
        for _ in handle.layers:
            handle._stack()[-1].starts(batch.num_rows, batch.max_len)
        handle._exit(model, (), inputs, None)

    reading = best_time(read, 5)
    handle.remove()
    share = lambda t: f"{fmt_time(t)} ({100 * t / step_time:.2f}%)"  # noqa: E731
    return [
        f"S = {size} ({len(lengths)} documents)",
        fmt_time(step_time),
        share(build),
        share(checked),
        share(reading),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--overhead", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(machine())
    print(f"load before: {os.getloadavg()}; torch threads {torch.get_num_threads()}")
    rows = [r for size in args.sizes for r in compare(size, args.repeat)]
    print(
        markdown_table(
            [
                "step (forward + backward)",
                "padded, one document a row",
                "packed, no fallback",
                "packed, keep_documents_apart",
            ],
            rows,
        )
    )
    costs = [overhead(size) for size in args.overhead]
    print(
        markdown_table(
            [
                "batch",
                "training step",
                "model_inputs",
                "model_inputs(check=True)",
                "fallback's boundary reading",
            ],
            costs,
        )
    )
    print(f"load after: {os.getloadavg()}")
    save_json(args.json, {"compare": rows, "overhead": costs})


if __name__ == "__main__":
    main()
