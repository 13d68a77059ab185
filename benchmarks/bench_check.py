"""What the leak checks cost, against a training step.

* ``check_batch`` on what a training step feeds a model, at 8k and 32k tokens, against one
  forward + backward of a small transformer on the same batch (flexmask attention on the
  CPU): the packed batch with its lazy handle, plus ``cu_seqlens`` under a causal varlen
  kernel, plus its varlen and Magi lowerings, a transformers-style flattened batch, and a
  BlockMask built elsewhere (torch's ``create_block_mask``), read on its partial blocks.
* ``leak_test`` on a tiny model, by default and backward only: its passes, its time,
  against one training step of it.

Run: ``python benchmarks/bench_check.py`` (``--sizes 8192 32768``, ``--json out.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.nn.functional as F
from common import best_time, documents, fmt_time, machine, markdown_table, save_json
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

import flexmask
from flexmask.testing import leak_test


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, block_mask) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(batch, seq_len, 3, self.heads, dim // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        y = flexmask.flex_attention(q, k, v, block_mask=block_mask)
        x = x + self.out(y.transpose(1, 2).reshape(batch, seq_len, dim))
        gate, up = self.up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class SmallLM(nn.Module):
    """A small decoder: embeddings, ``layers`` blocks, an output head."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(1 << 16, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, positions, block_mask):
        x = self.embed(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, block_mask)
        return self.head(self.norm(x))


def step(model, batch, handle) -> None:
    logits = model(batch.tokens, batch.position_ids, handle)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    loss.backward()
    model.zero_grad(set_to_none=True)


def check_cases(batch, handle) -> dict[str, dict]:
    B, S = batch.tokens.shape
    lens = torch.tensor(batch.seq_lens[0])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    unshifted = batch.tokens.masked_fill(batch.position_ids == 0, -100)
    foreign = torch_block_mask(batch.mask.mask_mod, B, 1, S, S, device="cpu")
    return {
        "packed batch + its handle": {"batch": batch, "block_mask": handle},
        "+ cu_seqlens under a causal varlen kernel": {
            "batch": batch,
            "block_mask": handle,
            "cu_seqlens": cu,
            "causal_kernel": True,
        },
        "+ its varlen and Magi lowerings": {
            "batch": batch,
            "block_mask": handle,
            "varlen": flexmask.to_varlen(batch.mask, B, 1, S, S),
            "magi": flexmask.to_magi(batch.mask, B, 1, S, S),
        },
        "flattened (transformers): ids, positions, labels": {
            "input_ids": batch.tokens,
            "position_ids": batch.position_ids,
            "labels": unshifted,
        },
        "packed batch + a BlockMask from torch": {"batch": batch, "block_mask": foreign},
    }


def measure_check(S: int, model, repeat: int) -> dict:
    lens = documents(S, seed=0)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 8192, (n,), generator=gen) for n in lens]
    batch = flexmask.pack(seqs, max_len=S, strategy="next_fit")
    handle = batch.lazy(device="cpu")
    batch = dataclasses.replace(batch, handle=handle)
    step_time = best_time(lambda: step(model, batch, handle), repeat=2, warmup=1)
    rows = {}
    for name, kwargs in check_cases(batch, handle).items():
        report = flexmask.check_batch(**kwargs)
        assert report.ok, str(report)
        rows[name] = best_time(lambda kwargs=kwargs: flexmask.check_batch(**kwargs), repeat)
    return {"S": S, "documents": len(lens), "step": step_time, "checks": rows}


def measure_leak_test() -> dict:
    """leak_test's default (backward and forward passes over the planned pairs) and its
    backward half alone (``method="grad"``), each after one warm-up run."""
    torch.manual_seed(0)
    model = SmallLM(vocab=512, dim=64, heads=4, layers=2, hidden=128)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 512, (n,), generator=gen) for n in documents(512, seed=1, mean=64)]
    batch = flexmask.pack(seqs, max_len=512, strategy="next_fit")
    handle = batch.lazy(device="cpu", block_size=64)
    step_time = best_time(lambda: step(model, batch, handle), repeat=3)
    inputs = (batch.tokens, batch.position_ids, handle)
    runs = {}
    for method in ("auto", "grad"):
        report = leak_test(model, inputs, batch.mask, method=method)
        assert report.ok, str(report)
        started = time.perf_counter()
        report = leak_test(model, inputs, batch.mask, method=method)
        runs[method] = {
            "method": report.method,
            "passes": report.passes,
            "seconds": time.perf_counter() - started,
        }
    return {
        "tokens": 512,
        "documents": len(report.documents),
        "longest": max(length for _, _, length in report.documents),
        "runs": runs,
        "step": step_time,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("FLEXMASK_COMPILE", "0")
    load = os.getloadavg()
    print(f"# bench_check on {machine()}")
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    torch.manual_seed(0)
    model = SmallLM(vocab=8192, dim=256, heads=4, layers=2, hidden=1024)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"\nTraining step: SmallLM (2 layers, dim 256, 4 heads, MLP 1024, vocab 8192, "
        f"{params:.1f}M parameters), forward + backward, B = 1, flexmask attention "
        f"(causal() & document(seq_lens), documents of mean S/32)\n"
    )
    results = [measure_check(S, model, args.repeat) for S in args.sizes]
    names = list(results[0]["checks"])
    header = ["check_batch on", *(f"S = {r['S']} ({r['documents']} docs)" for r in results)]
    rows = [
        ["one training step", *(fmt_time(r["step"]) for r in results)],
        *(
            [
                name,
                *(
                    f"{fmt_time(r['checks'][name])} ({100 * r['checks'][name] / r['step']:.2f}%)"
                    for r in results
                ),
            ]
            for name in names
        ),
    ]
    print(markdown_table(header, rows))
    leak = measure_leak_test()
    print(
        f"\nleak_test on a tiny SmallLM (2 layers, dim 64, {leak['tokens']} tokens, "
        f"{leak['documents']} documents, the longest {leak['longest']}):\n"
    )
    print(
        markdown_table(
            ["method", "passes", "leak_test", "one training step", "ratio"],
            [
                [
                    f"{method} ({run['method']})",
                    run["passes"],
                    fmt_time(run["seconds"]),
                    fmt_time(leak["step"]),
                    f"{run['seconds'] / leak['step']:.1f}x",
                ]
                for method, run in leak["runs"].items()
            ],
        )
    )
    after = os.getloadavg()
    print(f"\nload average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    save_json(
        args.json,
        {"machine": machine(), "load": [load, after], "checks": results, "leak_test": leak},
    )


if __name__ == "__main__":
    main()
