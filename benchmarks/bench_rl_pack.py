"""GRPO batches four ways: one sequence at a time, padded rows, packed documents, prefix trees.

Groups of 8 completions (prompt 512 tokens, completions 64-1024), as a GRPO step samples
them, at 1, 8 and 64 groups. Each layout runs the same model over every sequence and takes
the same loss (the completions' log-probs); one run measures, per layout:

* tokens computed (rows x row length) and real tokens, and what trees save by computing each
  prompt once per tree;
* pack + mask time: ``pack_tree_batch`` / ``pack`` / padding, plus building every BlockMask;
* forward + backward time over all micro-batches (gradient accumulation, ~8k tokens each),
  the median of ``--repeats`` rounds in which the layouts take turns;
* where the tree step's time goes: its attention calls alone (forward + backward, the way
  the block-sparse kernel's threads took), ``log_probs``, and the rest of the model.

The model is deliberately tiny (``TinyLM`` from examples/_model.py: dim 32, 2 heads, 1 layer,
vocabulary 128) so the whole step runs in a few minutes on 2 CPU cores: the times show
attention and per-token costs at this scale, not those of a real LLM, where the per-token
(MLP) share grows and the saved tokens count for more. Attention runs through
``flexmask.flex_attention`` for documents and trees (on the CPU its ``slices`` backend: torch's
fused flash kernel once per MagiAttention slice, the prompt once per group), and causal
``scaled_dot_product_attention`` for padding and one sequence at a time. Every tree and
document step lowers its masks afresh (the slices backend's cache is cleared first), as a
training step on new data does.

Run from the repository root::

    python benchmarks/bench_rl_pack.py                 # 1, 8 and 64 groups (a few minutes)
    python benchmarks/bench_rl_pack.py --groups 1 8    # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from common import fmt_time, machine, markdown_table  # noqa: E402

import flexmask  # noqa: E402
from flexmask.backends import slices, threads  # noqa: E402
from flexmask.packing import pack, pack_tree_batch  # noqa: E402

VOCAB, BUDGET, PROMPT, COMPLETIONS = 128, 8192, 512, 8
HEADS = 2
BLOCK_SIZE = 128


def tiny_model():
    path = _HERE.parent / "examples" / "_model.py"
    spec = importlib.util.spec_from_file_location("flexmask_examples_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyLM(vocab=VOCAB, dim=32, num_heads=HEADS, num_layers=1, seed=0)


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


def cpu_timed(fn) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (all its threads) of ``fn()``: on a loaded
    machine the CPU seconds of a one-thread run are what the work costs, the wall seconds
    what the other processes left of the cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


class Layout:
    """One way to lay a GRPO batch out: ``prepare()`` packs and builds the masks (timed),
    ``step()`` runs forward + backward over every micro-batch (timed)."""

    name = ""

    def __init__(self, model, sequences, prompt_lens, block_size: int) -> None:
        self.model, self.sequences, self.prompt_lens = model, sequences, prompt_lens
        self.block_size = block_size
        _, self.prep = timed(self.prepare)

    def prepare(self) -> None:
        raise NotImplementedError  # every layout below defines it

    def step(self) -> None:
        raise NotImplementedError  # every layout below defines it


class Trees(Layout):
    name = "prefix trees (pack_tree_batch)"

    def prepare(self) -> None:
        self.batch = pack_tree_batch(self.sequences, BUDGET, prompt_lens=self.prompt_lens)
        self.handles = []
        for row in range(self.batch.num_rows):
            # One tree per micro-batch: the row's own (1, max_tokens) mask.
            handle = flexmask.lazy(
                flexmask.tree(self.batch.parents[row]),
                1,
                HEADS,
                BUDGET,
                BUDGET,
                device="cpu",
                BLOCK_SIZE=self.block_size,
            )
            handle.block_mask  # noqa: B018  (build it now, inside the timing)
            self.handles.append(handle)
        self.rows, self.width = self.batch.num_rows, BUDGET
        self.real = sum(self.batch.num_tokens)
        self.log_probs_s = 0.0

    def step(self) -> None:
        batch, self.log_probs_s = self.batch, 0.0
        slices._lowered.cache_clear()  # new data each step: its masks lowered afresh
        for row, handle in enumerate(self.handles):
            logits = self.model(
                batch.tokens[row : row + 1], batch.position_ids[row : row + 1], handle
            )
            start = time.perf_counter()
            out = batch.log_probs(logits, rows=slice(row, row + 1))  # this micro-batch's rows
            self.log_probs_s += time.perf_counter() - start
            (-out.log_probs.sum()).backward()

    def attention_alone(self) -> float:
        """Forward + backward of the step's attention calls alone, on random q, k, v of the
        model's shapes (head dim 16)."""
        q, k, v = (torch.randn(1, HEADS, BUDGET, 16, requires_grad=True) for _ in range(3))

        def run():
            slices._lowered.cache_clear()
            for handle in self.handles:
                flexmask.flex_attention(q, k, v, block_mask=handle, compile=False).sum().backward()

        return timed(run)[1]


class Documents(Layout):
    name = "documents (pack)"

    def prepare(self) -> None:
        masks = [
            torch.arange(len(s)) >= p for s, p in zip(self.sequences, self.prompt_lens, strict=True)
        ]
        self.batch = pack(self.sequences, BUDGET, loss_mask=masks)
        self.handles = []
        for row in range(self.batch.num_rows):
            mask = flexmask.causal() & flexmask.document([self.batch.seq_lens[row]])
            handle = flexmask.lazy(
                mask, 1, HEADS, BUDGET, BUDGET, device="cpu", BLOCK_SIZE=self.block_size
            )
            handle.block_mask  # noqa: B018
            self.handles.append(handle)
        self.rows, self.width, self.real = self.batch.num_rows, BUDGET, self.batch.num_tokens

    def step(self) -> None:
        batch = self.batch
        slices._lowered.cache_clear()  # new data each step: its masks lowered afresh
        for row, handle in enumerate(self.handles):
            logits = self.model(
                batch.tokens[row : row + 1], batch.position_ids[row : row + 1], handle
            )
            F.cross_entropy(logits[0], batch.labels[row], reduction="sum").backward()


class Padding(Layout):
    name = "padding"

    def prepare(self) -> None:
        longest = max(map(len, self.sequences))
        self.per_step = max(1, BUDGET // longest)  # rows per micro-batch: about as many tokens
        self.tokens = torch.zeros(len(self.sequences), longest, dtype=torch.int64)
        self.labels = torch.full((len(self.sequences), longest), -100, dtype=torch.int64)
        for i, (seq, p) in enumerate(zip(self.sequences, self.prompt_lens, strict=True)):
            self.tokens[i, : len(seq)] = torch.tensor(seq)
            self.labels[i, p - 1 : len(seq) - 1] = self.tokens[i, p : len(seq)]
        self.positions = torch.arange(longest).expand(self.per_step, -1)
        self.rows, self.width = len(self.sequences), longest
        self.real = sum(map(len, self.sequences))

    def step(self) -> None:
        for start in range(0, len(self.sequences), self.per_step):
            rows = self.tokens[start : start + self.per_step]
            logits = self.model(rows, self.positions[: len(rows)], None)  # causal SDPA
            labels = self.labels[start : start + self.per_step].flatten()
            F.cross_entropy(logits.flatten(0, 1), labels, reduction="sum").backward()


class OneByOne(Layout):
    name = "one sequence at a time"

    def prepare(self) -> None:
        self.tensors = [torch.tensor(s)[None] for s in self.sequences]
        self.rows, self.width = len(self.sequences), max(map(len, self.sequences))
        self.real = sum(map(len, self.sequences))

    def step(self) -> None:
        for tokens, p in zip(self.tensors, self.prompt_lens, strict=True):
            length = tokens.shape[1]
            logits = self.model(tokens, torch.arange(length)[None], None)  # causal SDPA
            log_probs = logits[0, p - 1 : length - 1].log_softmax(-1)
            (-log_probs.gather(1, tokens[0, p:, None]).sum()).backward()


LAYOUTS = (Trees, Documents, Padding, OneByOne)


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_size(model, num_groups: int, repeats: int, block_size: int) -> None:
    sequences, prompt_lens = grpo_groups(num_groups)
    unpacked = sum(map(len, sequences))
    layouts = [cls(model, sequences, prompt_lens, block_size) for cls in LAYOUTS]
    times: dict[str, list[float]] = {layout.name: [] for layout in layouts}
    cpu_times: dict[str, list[float]] = {layout.name: [] for layout in layouts}
    loads = [load()]
    for _ in range(repeats):  # the layouts take turns: a burst of load hits one round of all
        for layout in layouts:
            model.zero_grad()
            wall, cpu = cpu_timed(layout.step)
            times[layout.name].append(wall)
            cpu_times[layout.name].append(cpu)
        loads.append(load())
    median = {name: statistics.median(t) for name, t in times.items()}
    cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    trees, alone = layouts[0], median["one sequence at a time"]
    cpu_alone = cpu["one sequence at a time"]
    rows = [
        [
            layout.name,
            layout.rows,
            layout.width,
            f"{layout.rows * layout.width:,}",
            f"{layout.real:,}",
            f"{unpacked - layout.real:,}",
            fmt_time(layout.prep),
            fmt_time(median[layout.name]),
            f"{median[layout.name] / alone:.2f}x",
            fmt_time(cpu[layout.name]),
            f"{cpu[layout.name] / cpu_alone:.2f}x",
        ]
        for layout in layouts
    ]
    print(
        f"\n## {num_groups} group(s) x {COMPLETIONS} completions ({unpacked:,} tokens unpacked), "
        f"BLOCK_SIZE {block_size}, median of {repeats}, load {' -> '.join(loads)}\n"
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
        "vs one at a time",
        "fwd + bwd CPU",
        "CPU vs one at a time",
    ]
    print(markdown_table(header, rows))
    attention = trees.attention_alone()
    probe = torch.randn(1, HEADS, BUDGET, 16, requires_grad=True)
    backend = flexmask.explain(probe, probe, probe, trees.handles[0]).backend
    ways = sorted({f"{k[0]}: {w}" for k in threads.CHOICE.kinds if (w := threads.CHOICE.way(k))})
    print(
        f"\ntree step {fmt_time(median[trees.name])}: its attention alone (fwd + bwd) "
        f"{fmt_time(attention)}, log_probs {fmt_time(trees.log_probs_s)}, masks built in "
        f"{fmt_time(trees.prep)} (with pack_tree_batch); attention backend: {backend}; "
        f"block-sparse threads: {', '.join(ways) or 'not used'}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=3, help="rounds (1 at 64 groups)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = tiny_model()
    print(
        f"GRPO: prompt {PROMPT}, {COMPLETIONS} completions of 64-1024 tokens per group; tree "
        f"budget {BUDGET}; TinyLM dim 32, {HEADS} heads, 1 layer, vocab {VOCAB}; {machine()}, "
        f"{torch.get_num_threads()} threads"
    )
    # One untimed group through every layout first: one-time costs (first kernels, allocator
    # growth) are not charged to whichever layout happens to run first.
    warm_sequences, warm_prompts = grpo_groups(1, seed=1)
    for cls in LAYOUTS:
        cls(model, warm_sequences, warm_prompts, args.block_size).step()
    for num_groups in args.groups:
        run_size(model, num_groups, 1 if num_groups >= 64 else args.repeats, args.block_size)


if __name__ == "__main__":
    main()
