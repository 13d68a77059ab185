"""GRPO batches three ways: padded rows, packed documents, prefix trees under a token budget.

64 groups x 8 completions (prompt 512 tokens, completions 64-1024), as a GRPO step samples
them. Each layout runs the same model over every sequence and takes the same loss (the
completions' log-probs); one run measures, per layout:

* tokens computed (rows x row length) and real tokens, and what trees save by computing each
  prompt once per tree;
* pack + mask time: ``pack_trees`` / ``pack`` / padding, plus building every BlockMask;
* forward + backward time over all micro-batches (gradient accumulation, ~8k tokens each).

The model is deliberately tiny (``TinyLM`` from examples/_model.py: dim 32, 2 heads, 1 layer,
vocabulary 128) so the whole step runs in a few minutes on 2 CPU cores: the times show
attention and per-token costs at this scale, not those of a real LLM, where the per-token
(MLP) share grows and the saved tokens count for more. Attention runs through flexmask's CPU
block-sparse path for documents and trees, and causal ``scaled_dot_product_attention`` for
padding.

Run from the repository root::

    python benchmarks/bench_rl_pack.py             # 64 groups (a few minutes)
    python benchmarks/bench_rl_pack.py --groups 8  # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from common import fmt_time, machine, markdown_table  # noqa: E402

import flexmask  # noqa: E402
from flexmask.packing import pack, pack_trees  # noqa: E402

VOCAB, BUDGET, PROMPT, COMPLETIONS = 128, 8192, 512, 8


def tiny_model():
    path = _HERE.parent / "examples" / "_model.py"
    spec = importlib.util.spec_from_file_location("flexmask_examples_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyLM(vocab=VOCAB, dim=32, num_heads=2, num_layers=1, seed=0)


def grpo_groups(num_groups: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sequences, prompt_lens = [], []
    for _ in range(num_groups):
        prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist()
        for _ in range(COMPLETIONS):
            n = int(torch.randint(64, 1025, (1,), generator=gen))
            sequences.append(prompt + torch.randint(0, VOCAB, (n,), generator=gen).tolist())
            prompt_lens.append(PROMPT)
    return sequences, prompt_lens


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run_trees(model, sequences, prompt_lens):
    def prepare():
        batch = pack_trees(sequences, BUDGET, prompt_lens=prompt_lens)
        handles = []
        for row in range(batch.num_rows):
            handle = row_handle(batch, row)
            handle.block_mask  # noqa: B018  (build it now, inside the timing)
            handles.append(handle)
        return batch, handles

    (batch, handles), prep = timed(prepare)

    def step():
        for row, handle in enumerate(handles):
            logits = model(batch.tokens[row : row + 1], batch.position_ids[row : row + 1], handle)
            out = batch.log_probs(logits, rows=slice(row, row + 1))  # this micro-batch's rows
            (-out.log_probs.sum()).backward()

    _, fwd_bwd = timed(step)
    return {
        "rows": batch.num_rows,
        "row length": BUDGET,
        "computed": batch.num_rows * BUDGET,
        "real": sum(batch.num_tokens),
        "prep": prep,
        "fwd_bwd": fwd_bwd,
    }


def row_handle(batch, row):
    # One tree per micro-batch: the row's own (1, max_tokens) mask.
    return flexmask.lazy(
        flexmask.tree(batch.parents[row]), 1, 2, BUDGET, BUDGET, device="cpu", BLOCK_SIZE=128
    )


def run_documents(model, sequences, prompt_lens):
    def prepare():
        masks = [torch.arange(len(s)) >= p for s, p in zip(sequences, prompt_lens, strict=True)]
        batch = pack(sequences, BUDGET, loss_mask=masks)
        handles = []
        for row in range(batch.num_rows):
            mask = flexmask.causal() & flexmask.document([batch.seq_lens[row]])
            handle = flexmask.lazy(mask, 1, 2, BUDGET, BUDGET, device="cpu", BLOCK_SIZE=128)
            handle.block_mask  # noqa: B018
            handles.append(handle)
        return batch, handles

    (batch, handles), prep = timed(prepare)

    def step():
        for row, handle in enumerate(handles):
            logits = model(batch.tokens[row : row + 1], batch.position_ids[row : row + 1], handle)
            loss = F.cross_entropy(logits[0], batch.labels[row], reduction="sum")
            loss.backward()

    _, fwd_bwd = timed(step)
    return {
        "rows": batch.num_rows,
        "row length": BUDGET,
        "computed": batch.num_rows * BUDGET,
        "real": batch.num_tokens,
        "prep": prep,
        "fwd_bwd": fwd_bwd,
    }


def run_padding(model, sequences, prompt_lens):
    longest = max(map(len, sequences))
    per_step = max(1, BUDGET // longest)  # rows per micro-batch: about as many tokens

    def prepare():
        tokens = torch.zeros(len(sequences), longest, dtype=torch.int64)
        labels = torch.full((len(sequences), longest), -100, dtype=torch.int64)
        for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
            tokens[i, : len(seq)] = torch.tensor(seq)
            labels[i, p - 1 : len(seq) - 1] = tokens[i, p : len(seq)]
        return tokens, labels

    (tokens, labels), prep = timed(prepare)
    positions = torch.arange(longest).expand(per_step, -1)

    def step():
        for start in range(0, len(sequences), per_step):
            rows = tokens[start : start + per_step]
            logits = model(rows, positions[: len(rows)], None)  # causal SDPA
            loss = F.cross_entropy(
                logits.flatten(0, 1), labels[start : start + per_step].flatten(), reduction="sum"
            )
            loss.backward()

    _, fwd_bwd = timed(step)
    return {
        "rows": len(sequences),
        "row length": longest,
        "computed": len(sequences) * longest,
        "real": sum(map(len, sequences)),
        "prep": prep,
        "fwd_bwd": fwd_bwd,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sequences, prompt_lens = grpo_groups(args.groups)
    unpacked = sum(map(len, sequences))
    model = tiny_model()
    # One untimed group through every layout first: one-time costs (first kernels, allocator
    # growth) are not charged to whichever layout happens to run first.
    warm_sequences, warm_prompts = grpo_groups(1, seed=1)
    for run in (run_trees, run_documents, run_padding):
        run(model, warm_sequences, warm_prompts)
    results = {}
    for name, run in (
        ("prefix trees (pack_trees)", run_trees),
        ("documents (pack)", run_documents),
        ("padding", run_padding),
    ):
        model.zero_grad()
        results[name] = run(model, sequences, prompt_lens)
    trees = results["prefix trees (pack_trees)"]
    rows = [
        [
            name,
            r["rows"],
            r["row length"],
            f"{r['computed']:,}",
            f"{r['real']:,}",
            f"{unpacked - r['real']:,}",
            fmt_time(r["prep"]),
            fmt_time(r["fwd_bwd"]),
            f"{r['fwd_bwd'] / trees['fwd_bwd']:.2f}x",
        ]
        for name, r in results.items()
    ]
    print(
        f"GRPO: {args.groups} groups x {COMPLETIONS} completions, prompt {PROMPT}, completions "
        f"64-1024 ({unpacked:,} tokens unpacked); tree budget {BUDGET}; TinyLM dim 32, 2 heads, "
        f"1 layer, vocab {VOCAB}; {machine()}, {torch.get_num_threads()} threads\n"
    )
    header = [
        "layout",
        "rows",
        "row length",
        "tokens computed",
        "real tokens",
        "tokens saved",
        "pack + masks",
        "fwd + bwd",
        "fwd + bwd vs trees",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
