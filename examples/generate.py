"""Greedy generation with a KV cache, every mask a window of the training mask.

Usage: python examples/generate.py [--quick] [--capacity 384] [--chunk 40] [--new 24]

A batch of rows with ragged prompts, each prompt several documents packed back to back
(``causal() & document(...)``, the last document the one being continued), runs as:

1. chunked prefill: chunks of ``--chunk`` queries (not a block multiple) against the growing
   cache, each step's BlockMask from ``flexmask.decode_mask(mask, starts, chunk, capacity)``;
2. decode: one query per row per step, each step ``flexmask.DecodeMasks.at(cache_lens)`` at
   the lengths the cache is written at, which reuses the step's BlockMask and appends a block
   only when a row's cache crosses a block boundary (for a causal mask) or builds from
   structure (here: documents);
3. a speculative draft tree appended to every row, verified in one forward
   (``flexmask.speculative_tree``).

Every logit is checked against full recomputation without a cache (each row's last document
alone through plain causal ``scaled_dot_product_attention``: documents do not see each other),
and every draft-tree node against verifying its branch alone (fp32, atol 1e-5). The example
prints the per-step mask cost.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch
from _model import TinyLM, rotate
from torch import Tensor

import flexmask

VOCAB = 64
ATOL = 1e-5
BLOCK_SIZE = 32  # small, so a few hundred tokens span several blocks


@dataclass
class KVCache:
    """Per-layer keys and values ``(B, H, capacity, D)``; row b's token t sits at index t."""

    keys: list[Tensor]
    values: list[Tensor]

    @classmethod
    def empty(cls, model: TinyLM, batch: int, capacity: int) -> KVCache:
        dim = model.embed.weight.shape[1]
        shape = (batch, model.num_heads, capacity, dim // model.num_heads)
        layers = len(model.blocks)
        return cls(
            [torch.zeros(shape) for _ in range(layers)], [torch.zeros(shape) for _ in range(layers)]
        )

    def write(self, layer: int, starts: Tensor, k: Tensor, v: Tensor) -> None:
        """Writes ``k``/``v`` ``(B, H, q, D)`` at row b's positions ``[starts[b], + q)``."""
        index = starts.view(-1, 1, 1, 1) + torch.arange(k.shape[2]).view(1, 1, -1, 1)
        index = index.expand_as(k)
        self.keys[layer].scatter_(2, index, k)
        self.values[layer].scatter_(2, index, v)


def cached_forward(
    model: TinyLM,
    tokens: Tensor,
    position_ids: Tensor,
    cache: KVCache,
    starts: Tensor,
    block_mask: object,
) -> Tensor:
    """``model``'s forward for new tokens ``(B, q)`` at cache positions ``[starts[b], + q)``:
    writes their keys and values into ``cache`` and attends the whole cache under
    ``block_mask`` (a step's BlockMask). Same weights and arithmetic as ``TinyLM.forward``."""
    x = model.embed(tokens)
    batch, length, dim = x.shape
    for layer, block in enumerate(model.blocks):
        q, k, v = (
            block.qkv(block.norm1(x))
            .view(batch, length, 3, block.num_heads, dim // block.num_heads)
            .permute(2, 0, 3, 1, 4)
        )
        q, k = rotate(q, position_ids), rotate(k, position_ids)
        cache.write(layer, starts, k, v)
        attn = flexmask.flex_attention(
            q, cache.keys[layer], cache.values[layer], block_mask=block_mask, compile=False
        )
        x = x + block.out(attn.transpose(1, 2).reshape(batch, length, dim))
        x = x + block.mlp(block.norm2(x))
    return model.norm(x) @ model.embed.weight.T


def reference_logits(model: TinyLM, document: list[int]) -> Tensor:
    """Full recomputation, no cache and no flexmask: one document, plain causal SDPA."""
    tokens = torch.tensor(document)[None]
    return model(tokens, torch.arange(len(document))[None])[0]


@dataclass
class Row:
    """One batch row: earlier documents and the document being continued."""

    earlier: list[list[int]]
    current: list[int]

    @property
    def prompt_len(self) -> int:
        return sum(map(len, self.earlier)) + len(self.current)

    def doc_lens(self, capacity: int) -> list[int]:
        """Document lengths over the whole cache: the current document runs to the end."""
        done = sum(map(len, self.earlier))
        return [len(d) for d in self.earlier] + [capacity - done]

    def tokens(self) -> list[int]:
        return [t for d in self.earlier for t in d] + self.current

    def position(self, t: int) -> int:
        """Position id of token t: its offset in its own document."""
        start = 0
        for d in self.earlier:
            if t < start + len(d):
                return t - start
            start += len(d)
        return t - start


def make_rows(batch: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        earlier = [
            [rng.randrange(VOCAB) for _ in range(rng.randint(5, 60))]
            for _ in range(rng.randint(0, 3))
        ]
        rows.append(Row(earlier, [rng.randrange(VOCAB) for _ in range(rng.randint(3, 70))]))
    return rows


def _step_inputs(rows: list[Row], starts: list[int], q_len: int) -> tuple[Tensor, Tensor]:
    """Tokens and position ids of positions ``[starts[b], + q_len)``; past a row's tokens,
    token 0 (its keys land past the row's cache and are overwritten before anyone sees them)."""
    tokens, positions = [], []
    for row, start in zip(rows, starts, strict=True):
        seq = row.tokens()
        span = range(start, start + q_len)
        tokens.append([seq[t] if t < len(seq) else 0 for t in span])
        positions.append([row.position(t) for t in span])
    return torch.tensor(tokens), torch.tensor(positions)


def check(name: str, got: Tensor, expected: Tensor, worst: dict[str, float]) -> None:
    err = float((got - expected).abs().max())
    worst[name] = max(worst.get(name, 0.0), err)
    if err > ATOL:
        raise AssertionError(f"{name}: cached logits differ from recomputation by {err:.2e}")


def prefill(model, rows, mask, cache, capacity, chunk, worst) -> tuple[list[int], list[float]]:
    """Chunked prefill; returns each row's first generated token and per-chunk mask times."""
    batch = len(rows)
    last_logits: list[Tensor | None] = [None] * batch
    times = []
    longest = max(row.prompt_len for row in rows)
    for start in range(0, longest, chunk):
        began = time.perf_counter()
        block_mask = flexmask.decode_mask(mask, start, chunk, capacity, block_size=BLOCK_SIZE)
        times.append(time.perf_counter() - began)
        tokens, positions = _step_inputs(rows, [start] * batch, chunk)
        logits = cached_forward(
            model, tokens, positions, cache, torch.full((batch,), start), block_mask
        )
        for b, row in enumerate(rows):
            local = row.prompt_len - 1 - start
            if 0 <= local < chunk:
                last_logits[b] = logits[b, local]
                # Every prompt position of the current document, against recomputation.
            done = sum(map(len, row.earlier))
            reference = reference_logits(model, row.current)
            for t in range(max(start, done), min(start + chunk, row.prompt_len)):
                check("prefill", logits[b, t - start], reference[t - done], worst)
    return [int(lg.argmax()) for lg in last_logits], times


def decode(model, rows, mask, cache, capacity, first, new_tokens, worst):
    """Greedy decode; returns per-step (seconds, kind) of the mask step after the first."""
    steps = flexmask.DecodeMasks(
        mask, [row.prompt_len for row in rows], capacity, block_size=BLOCK_SIZE
    )
    nxt, costs = first, []
    for index in range(new_tokens):
        # The step at the cache's own lengths: the positions the keys are written at.
        lens = [len(row.tokens()) for row in rows]
        began = time.perf_counter()
        step = steps.at(lens)
        elapsed = time.perf_counter() - began
        if index:
            costs.append((elapsed, step.kind))
        for row, token in zip(rows, nxt, strict=True):
            row.current.append(token)
        tokens = torch.tensor(nxt).view(-1, 1)
        positions = torch.tensor([[row.position(n)] for row, n in zip(rows, lens, strict=True)])
        logits = cached_forward(
            model, tokens, positions, cache, torch.tensor(lens), step.block_mask
        )
        for b, row in enumerate(rows):
            check("decode", logits[b, 0], reference_logits(model, row.current)[-1], worst)
        nxt = [int(lg.argmax()) for lg in logits[:, 0]]
    return costs


def verify_draft_tree(model, rows, capacity, worst, seed: int) -> int:
    """Appends one draft tree to every row's cache and verifies it in one forward; each node's
    logits must equal its branch verified alone. Returns the number of draft nodes checked."""
    rng = random.Random(seed)
    draft = [-1, 0, 0, 1, 3, -1, 5, 2]  # parents within the draft, -1: after the prefix
    depth = []
    for p in draft:
        depth.append(0 if p < 0 else depth[p] + 1)
    draft_tokens = [[rng.randrange(VOCAB) for _ in draft] for _ in rows]
    prefix_lens = [row.prompt_len for row in rows]
    docs = flexmask.document([row.doc_lens(capacity) for row in rows])
    mask = flexmask.speculative_tree(prefix_lens, draft) & docs
    block_mask = flexmask.decode_mask(
        mask, prefix_lens, len(draft), capacity, block_size=BLOCK_SIZE
    )
    tokens = torch.tensor(draft_tokens)
    positions = torch.tensor([[len(row.current) + d for d in depth] for row in rows])
    cache = KVCache.empty(model, len(rows), capacity)
    # The verified prefix: write it through the cache once (a prefill of one chunk).
    everything = max(prefix_lens)
    prefix_mask = flexmask.causal() & docs
    pre = flexmask.decode_mask(prefix_mask, 0, everything, capacity, block_size=BLOCK_SIZE)
    pre_tokens, pre_positions = _step_inputs(rows, [0] * len(rows), everything)
    cached_forward(
        model, pre_tokens, pre_positions, cache, torch.zeros(len(rows), dtype=torch.long), pre
    )
    logits = cached_forward(model, tokens, positions, cache, torch.tensor(prefix_lens), block_mask)
    for b, row in enumerate(rows):
        for node in range(len(draft)):
            branch, walk = [], node
            while walk >= 0:
                branch.append(draft_tokens[b][walk])
                walk = draft[walk]
            alone = reference_logits(model, row.current + branch[::-1])[-1]
            check("draft tree", logits[b, node], alone, worst)
    return len(rows) * len(draft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small run (tests use it)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=384)
    parser.add_argument(
        "--chunk", type=int, default=40, help="prefill chunk (not a block multiple)"
    )
    parser.add_argument("--new", type=int, default=24, help="tokens to generate per row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.new = 3, 12
    torch.manual_seed(args.seed)
    model = TinyLM(VOCAB, dim=64, num_heads=4, num_layers=2, seed=args.seed).eval()
    rows = make_rows(args.batch, args.seed)
    mask = flexmask.causal() & flexmask.document([row.doc_lens(args.capacity) for row in rows])
    worst: dict[str, float] = {}
    print(
        f"rows: prompt lengths {[row.prompt_len for row in rows]}, documents per row "
        f"{[len(row.earlier) + 1 for row in rows]}, capacity {args.capacity}, "
        f"block {BLOCK_SIZE}, chunk {args.chunk}"
    )
    with torch.no_grad():
        cache = KVCache.empty(model, len(rows), args.capacity)
        first, chunk_times = prefill(model, rows, mask, cache, args.capacity, args.chunk, worst)
        print(
            f"prefill: {len(chunk_times)} chunks, "
            f"mask {1e6 * sum(chunk_times) / len(chunk_times):.0f} us per chunk"
        )
        # The document mask decodes by building each step; causal alone reuses and appends.
        for name, step_mask in (("causal & document", mask), ("causal", flexmask.causal())):
            decode_rows = rows if step_mask is mask else [Row([], row.tokens()) for row in rows]
            if step_mask is not mask:
                cache = KVCache.empty(model, len(rows), args.capacity)
                first, _ = prefill(
                    model, decode_rows, step_mask, cache, args.capacity, args.chunk, worst
                )
            costs = decode(
                model, decode_rows, step_mask, cache, args.capacity, first, args.new, worst
            )
            by_kind: dict[str, list[float]] = {}
            for seconds, kind in costs:
                by_kind.setdefault(kind, []).append(seconds)
            summary = ", ".join(
                f"{kind} {len(v)} x {1e6 * sum(v) / len(v):.0f} us"
                for kind, v in sorted(by_kind.items())
            )
            print(f"decode ({name}): {args.new} steps; mask per step: {summary}")
        nodes = verify_draft_tree(model, rows, args.capacity, worst, args.seed)
        print(f"draft tree: {nodes} nodes verified in one forward")
    print(
        "max |cached - recomputed| logits: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    )
    print(f"all logits equal full recomputation (atol {ATOL})")


if __name__ == "__main__":
    main()
