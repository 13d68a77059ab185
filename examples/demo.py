"""The flexmask demo: train a small transformer on packed documents, on the CPU, with lazy masks.

Usage: python examples/demo.py [--steps N] [--quick] [--threads N] [--workers N] [--out DIR]

What happens, end to end:

1. A synthetic language is generated (``_synthetic.py``: arithmetic runs, copy tasks, repeated
   motifs; 9 to 160 tokens per document). Nothing is downloaded.
2. A ``DataLoader`` with ``flexmask.PackingCollator`` packs each batch of documents into rows of
   ``--max-len`` tokens. Workers only pack; every batch carries an unbuilt lazy handle for
   ``causal() & document(seq_lens)``.
3. Each step passes that handle straight to ``flexmask.flex_attention`` in every layer. The
   first layer builds the BlockMask (timed: that is the mask cost of the step), the others
   reuse it, and the handle is released when forward and backward are done, which also drops
   the per-batch mask from the cache. On the CPU the differentiable block-sparse path runs,
   touching only the blocks the mask lists.
4. A closing report gives what was measured in this run (throughput, mask build time, cache
   statistics, mask memory against dense masks, packing efficiency, loss), draws one packed
   batch's mask to ``out/demo_mask.png`` and writes everything to ``out/demo_report.json``.

The run is a fixed amount of work (120 steps; ``--quick``: 40), so its losses are the same
on any machine and under any load: only its times change (see the README for the measured
ones). ``--time-limit`` stops training early, if you want that, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from _model import TinyLM
from _synthetic import TASKS, VOCAB, describe, make_corpus
from torch.utils.data import DataLoader, Sampler

import flexmask
from flexmask.packing import PackedBatch
from flexmask.runtime.cache import block_mask_nbytes

IGNORE = -100
# Share of rows * max_len a batch may fill: first-fit then always fits the documents (all
# shorter than 161 tokens) in `rows` rows, at a few percent of padding.
BUDGET_FILL = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 120)")
    parser.add_argument("--quick", action="store_true", help="a short run (40 steps) for tests")
    parser.add_argument("--max-len", type=int, default=512, help="packed row length")
    parser.add_argument("--rows", type=int, default=2, help="packed rows per batch")
    parser.add_argument("--block-size", type=int, default=32, help="BlockMask BLOCK_SIZE")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: at this model's size the ops are too small to share; on 2"
        " cores at load 5, 30 steps trained in 5.2 s on 1 thread and 38 s on 2, with the same"
        " losses; 0: torch's default)",
    )
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (0: none)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evaluations")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="stop training after this many seconds, whatever --steps says (default: no limit,"
        " so the result does not depend on the machine's load)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out"), help="where PNG + JSON go")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 40 if args.quick else 120
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // (4 if args.quick else 8))
    for name in ("steps", "max_len", "rows", "block_size", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads < 0:
        parser.error(f"--threads must be >= 0, got {args.threads}")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    return args


# ----------------------------------------------------------------------------------- data


class TokenBudgetBatches(Sampler[list[int]]):
    """Batches of shuffled documents holding at most ``budget`` tokens; ``num_batches`` of them.

    A token budget rather than a fixed count keeps every packed batch at the same number of
    rows: the budget is a little under ``rows * max_len``, so first-fit packing always fits.
    """

    def __init__(self, lengths: list[int], budget: int, num_batches: int, seed: int) -> None:
        if max(lengths) > budget:
            raise ValueError(f"a document of {max(lengths)} tokens exceeds the budget {budget}")
        self.lengths, self.budget, self.num_batches, self.seed = lengths, budget, num_batches, seed

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed)
        made, batch, used = 0, [], 0
        while True:  # epoch after epoch, each a new permutation
            for index in torch.randperm(len(self.lengths), generator=generator).tolist():
                if used + self.lengths[index] > self.budget:
                    yield batch
                    made += 1
                    if made == self.num_batches:
                        return
                    batch, used = [], 0
                batch.append(index)
                used += self.lengths[index]

    def __len__(self) -> int:
        return self.num_batches


def make_loader(sequences: list[list[int]], args: argparse.Namespace, workers: int) -> DataLoader:
    """Exactly ``args.steps`` packed batches of ``args.rows`` rows each (workers only pack)."""
    budget = int(args.rows * args.max_len * BUDGET_FILL)
    sampler = TokenBudgetBatches([len(s) for s in sequences], budget, args.steps, args.seed)
    collate = flexmask.PackingCollator(
        max_len=args.max_len, num_heads=args.heads, device="cpu", block_size=args.block_size
    )
    return DataLoader(
        sequences,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )


def start_loader(sequences: list[list[int]], args: argparse.Namespace):
    """The loader's iterator and the worker count used: falls back to 0 if workers fail."""
    wanted = min(args.workers, os.cpu_count() or 1)
    if wanted < args.workers:
        print(f"note: {os.cpu_count()} CPU(s) visible, so {wanted} DataLoader worker(s)")
    if wanted > 0:
        try:
            iterator = iter(make_loader(sequences, args, wanted))
            first = next(iterator)
            return _prepend(first, iterator), wanted
        except (OSError, RuntimeError) as error:
            print(f"note: DataLoader workers unavailable ({error}); packing in the main process")
    return iter(make_loader(sequences, args, 0)), 0


def _prepend(first: PackedBatch, iterator: Iterator[PackedBatch]) -> Iterator[PackedBatch]:
    yield first
    yield from iterator


def padding_slots(seq_lens: list[list[int]]) -> int:
    """Slots a pad-to-longest batch of the same documents would take (the usual baseline)."""
    lengths = [n for row in seq_lens for n in row]
    return len(lengths) * max(lengths)


# ----------------------------------------------------------------------------------- model


def batch_loss(model: TinyLM, batch, handle) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token loss of a packed batch, and the per-token losses ``(B, max_len)``."""
    logits = model(batch.tokens, batch.position_ids, handle)
    per_token = F.cross_entropy(
        logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE, reduction="none"
    ).view(batch.labels.shape)
    counted = (batch.labels != IGNORE).sum()
    return per_token.sum() / counted, per_token


@torch.no_grad()
def evaluate(model: TinyLM, val_batches, val_tasks, args) -> tuple[float, dict[str, float]]:
    """Loss on the fixed validation batches, overall and per task.

    Validation batches recur at every evaluation, so a fresh handle each time finds their
    BlockMasks in the cache: the handles are not released, on purpose (contrast with the
    training handles, whose per-batch masks never recur and are dropped on release).
    """
    model.eval()
    total = defaultdict(float)
    count = defaultdict(int)
    for batch, tasks in zip(val_batches, val_tasks, strict=True):
        handle = batch.lazy(args.heads, "cpu", args.block_size)
        _, per_token = batch_loss(model, batch, handle)
        valid = batch.labels != IGNORE
        for task, loss, ok in zip(tasks, batch.unpack(per_token), batch.unpack(valid), strict=True):
            total[task] += float(loss[ok].sum())
            count[task] += int(ok.sum())
    model.train()
    overall = sum(total.values()) / sum(count.values())
    return overall, {task: total[task] / count[task] for task in TASKS if count[task]}


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up (20 steps, fewer in short runs), then cosine decay to a tenth."""
    warmup = min(20, max(1, args.steps // 10))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------- progress


class Progress:
    """tqdm when installed, else a line every tenth of the run."""

    def __init__(self, total: int) -> None:
        self.total = total
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
            print("note: tqdm is not installed; printing progress lines instead")
        else:
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, step: int, **fields: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif step == 1 or step % max(1, self.total // 10) == 0 or step == self.total:
            shown = "  ".join(f"{k} {v}" for k, v in fields.items())
            print(f"step {step:>4}/{self.total}  {shown}", flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    run_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    corpus = make_corpus(1500 if args.quick else 4000, seed=args.seed)
    num_val = 60 if args.quick else 120
    val_docs, train_docs = corpus[:num_val], corpus[num_val:]
    train_sequences = [doc.tokens for doc in train_docs]
    print(
        f"flexmask {flexmask.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print(f"corpus: {len(corpus)} synthetic documents, e.g.")
    for doc in corpus[:3]:
        print(f"  {describe(doc)}")

    # Validation: fixed packed batches, made once, in the main process.
    collate = flexmask.PackingCollator(
        args.max_len, args.heads, device="cpu", block_size=args.block_size
    )
    val_batches, val_tasks = [], []
    for start in range(0, len(val_docs), 40):
        docs = val_docs[start : start + 40]
        val_batches.append(collate([d.tokens for d in docs]))
        val_tasks.append([d.task for d in docs])

    model = TinyLM(VOCAB, args.dim, args.heads, args.layers, seed=args.seed)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01
    )
    print(
        f"model: {args.layers} layers, d_model {args.dim}, {args.heads} heads, "
        f"{params / 1e6:.2f}M parameters; rows of {args.max_len} tokens, "
        f"{args.rows} rows per batch, BLOCK_SIZE {args.block_size}"
    )

    flexmask.cache_clear()
    loader, workers = start_loader(train_sequences, args)
    print(f"DataLoader: PackingCollator, {workers} worker(s)")

    val_lookups = [0, 0]  # cache hits and misses of evaluation, told apart from training's

    def run_eval() -> tuple[float, dict[str, float]]:
        before = flexmask.cache_info()
        result = evaluate(model, val_batches, val_tasks, args)
        after = flexmask.cache_info()
        val_lookups[0] += after.hits - before.hits
        val_lookups[1] += after.misses - before.misses
        return result

    last_eval = run_eval()
    val_start, val_start_tasks = last_eval
    history = [(0, val_start)]
    train_losses, build_ms, step_s, builds_per_step, sparsity = [], [], [], [], []
    mask_bytes_peak = dense_bytes_peak = 0
    real_tokens = slots = pad_slots = 0
    train_time = 0.0
    stopped_early = None
    progress = Progress(args.steps)

    step = 0
    first_batch = None
    waited = time.perf_counter()
    for batch in loader:
        step_start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        if first_batch is None:
            first_batch = batch
        handle = batch.handle
        with handle:  # released at the end of forward + backward
            # The first access builds the BlockMask through the cache: the step's mask cost.
            build_start = time.perf_counter()
            block_mask = handle.block_mask
            build_ms.append((time.perf_counter() - build_start) * 1e3)
            mask_bytes_peak = max(mask_bytes_peak, block_mask_nbytes(block_mask))
            sparsity.append(block_mask.sparsity())
            dense_bytes_peak = max(dense_bytes_peak, batch.num_rows * args.max_len**2)
            del block_mask  # the handle holds it; every layer gets the handle itself

            loss, _ = batch_loss(model, batch, handle)
            loss.backward()
        builds_per_step.append(handle.builds)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        now = time.perf_counter()
        step_s.append(now - step_start)
        train_time += now - waited  # includes any wait for the DataLoader
        step += 1
        train_losses.append(loss.item())
        real_tokens += batch.num_tokens
        slots += batch.num_rows * batch.max_len
        pad_slots += padding_slots(batch.seq_lens)
        progress.update(
            step,
            loss=f"{train_losses[-1]:.3f}",
            tok_s=f"{real_tokens / train_time:,.0f}",
            mask_ms=f"{build_ms[-1]:.2f}",
        )
        if step % args.eval_every == 0 or step == args.steps:
            last_eval = run_eval()
            history.append((step, last_eval[0]))
            progress.write(f"step {step:>4}: validation loss {last_eval[0]:.3f}")
        if args.time_limit is not None and train_time > args.time_limit and step < args.steps:
            stopped_early = f"time limit of {args.time_limit:.0f} s reached after {step} steps"
            progress.write(f"note: {stopped_early}")
            break
        waited = time.perf_counter()
    progress.close()

    if history[-1][0] != step:
        last_eval = run_eval()
        history.append((step, last_eval[0]))
    val_end, val_end_tasks = last_eval
    info = flexmask.cache_info()

    # Draw the first training batch (its handle was released: plot builds the mask aside),
    # on its row holding the most documents.
    shown = first_batch
    row = max(range(shown.num_rows), key=lambda r: len(shown.seq_lens[r]))
    png = flexmask.plot(
        shown.handle,
        args.out / "demo_mask.png",
        batch=row,
        title=f"first training batch, row {row}: causal & document, "
        f"{len(shown.seq_lens[row])} documents",
    )
    window = max(1, min(10, len(train_losses) // 4))
    report = {
        "steps": step,
        "stopped_early": stopped_early,
        "wall_time_s": round(time.perf_counter() - run_start, 2),
        "train_time_s": round(train_time, 2),
        "tokens_per_second": round(real_tokens / train_time, 1),
        "real_tokens": real_tokens,
        "mask_build_ms_per_step": round(statistics.fmean(build_ms), 4),
        "mask_build_ms_median": round(statistics.median(build_ms), 4),
        "mask_build_ms_max": round(max(build_ms), 4),
        "mask_build_share_of_step": round(sum(build_ms) / 1e3 / sum(step_s), 5),
        "handle_builds_per_step": max(builds_per_step),
        "block_sparsity": round(statistics.fmean(sparsity) / 100, 4),
        "layers_served_per_build": args.layers,
        "cache": {
            "hits": info.hits,
            "misses": info.misses,
            "hit_rate": round(info.hit_rate, 4),
            "evictions": info.evictions,
            "entries": info.entries,
            "bytes": info.bytes,
            "train_hits": info.hits - val_lookups[0],
            "train_misses": info.misses - val_lookups[1],
            "eval_hits": val_lookups[0],
            "eval_misses": val_lookups[1],
        },
        "peak_mask_bytes": mask_bytes_peak,
        "dense_mask_bytes": dense_bytes_peak,
        "dense_over_blockmask": round(dense_bytes_peak / mask_bytes_peak, 1),
        "packing_efficiency": round(real_tokens / slots, 4),
        "padding_efficiency": round(real_tokens / pad_slots, 4),
        "loss": {
            "train_start": round(statistics.fmean(train_losses[:window]), 4),
            "train_end": round(statistics.fmean(train_losses[-window:]), 4),
            "val_start": round(val_start, 4),
            "val_end": round(val_end, 4),
            "val_start_by_task": {k: round(v, 4) for k, v in val_start_tasks.items()},
            "val_end_by_task": {k: round(v, 4) for k, v in val_end_tasks.items()},
            "val_history": [[s, round(v, 4)] for s, v in history],
        },
        "png": str(png),
        "config": {
            "dim": args.dim,
            "layers": args.layers,
            "heads": args.heads,
            "parameters": params,
            "max_len": args.max_len,
            "rows": args.rows,
            "block_size": args.block_size,
            "threads": torch.get_num_threads(),
            "workers": workers,
            "torch": torch.__version__,
            "flexmask": flexmask.__version__,
        },
    }
    report_path = args.out / "demo_report.json"
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, report_path)
    return report


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_report(r: dict, report_path: Path) -> None:
    c, loss, cfg = r["cache"], r["loss"], r["config"]
    by_task = ", ".join(
        f"{task} {loss['val_start_by_task'][task]:.2f} → {loss['val_end_by_task'][task]:.2f}"
        for task in loss["val_end_by_task"]
    )
    lines = [
        "",
        "flexmask demo — closing report (all numbers measured in this run)",
        f"  run                 {r['steps']} steps in {r['wall_time_s']:.1f} s "
        f"({r['train_time_s']:.1f} s training), {cfg['threads']} torch thread(s), "
        f"{cfg['workers']} DataLoader worker(s)",
        f"  tokens/second       {r['tokens_per_second']:,.0f} "
        f"({r['real_tokens']:,} real tokens, padding not counted)",
        f"  mask build          {r['mask_build_ms_per_step']:.2f} ms/step "
        f"(median {r['mask_build_ms_median']:.2f}, max {r['mask_build_ms_max']:.2f}): "
        f"{100 * r['mask_build_share_of_step']:.1f}% of step time",
        f"                      {r['handle_builds_per_step']} build per step shared by "
        f"{r['layers_served_per_build']} layers",
        f"  block sparsity      {100 * r['block_sparsity']:.1f}% of attention tiles skipped "
        "(mean over training batches)",
        f"  cache               hit rate {100 * c['hit_rate']:.1f}% ({c['hits']} hits, "
        f"{c['misses']} misses, {c['evictions']} evictions, {c['entries']} entries left)",
        f"                      training {c['train_hits']} hits / {c['train_misses']} misses "
        "(new documents every batch; dropped on release),",
        f"                      evaluation {c['eval_hits']} hits / {c['eval_misses']} misses "
        "(the same batches each time)",
        f"  peak mask memory    {_bytes(r['peak_mask_bytes'])} of BlockMask vs "
        f"{_bytes(r['dense_mask_bytes'])} as dense (n, 1, S, S) bool "
        f"({r['dense_over_blockmask']:,.0f}x less)",
        f"  packing efficiency  {100 * r['packing_efficiency']:.1f}% real tokens "
        f"(padded to the longest document: {100 * r['padding_efficiency']:.1f}%)",
        f"  loss                train {loss['train_start']:.3f} → {loss['train_end']:.3f}; "
        f"validation {loss['val_start']:.3f} → {loss['val_end']:.3f}",
        f"                      by task: {by_task}",
        f"  mask picture        {r['png']}",
        f"  report              {report_path}",
    ]
    if r["stopped_early"]:
        lines.insert(3, f"  note                {r['stopped_early']}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
