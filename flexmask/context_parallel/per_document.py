"""A per-document balancer's shard of its own mask, ``causal() & document(lengths)``, in
closed form from the documents' boundaries: no per-query intervals, no sort over the shard.

The permutation is a list of *segments*: its runs (consecutive original positions at
consecutive permuted ones) cut at document starts, each inside one document. A query in
document ``d`` attends the keys of ``d`` at or before it, so:

* kv side (lines: the rank's query blocks; columns: the permuted keys): a line attends, in
  each key segment of each document ``d`` it holds, the segment's prefix up to the line's
  last query of ``d``; it covers (every query attends every key) the prefix up to its first
  query, where the line is one document and a whole block;
* q side (lines: the permuted key blocks; columns: the rank's queries): a line is attended,
  in each local query segment of each document ``d`` it holds, by the segment's suffix from
  the line's first key of ``d``; covered by the suffix from its last key, likewise.

Each line's intervals, laid in permuted order (a sort over the (line, segment) pairs, a few
per line), become block runs: the listed blocks then the others, ascending, each index
tensor written in one pass (``segments.write_runs``). O(lines x segments per document)
besides the output; exact, torch's order (an incomplete block is never full).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.builders import ShardMaskMod, write_runs
from flexmask.pieces import causal, document


def own_mask(mask: Mask, lengths: list[int]) -> bool:
    """Whether ``mask`` is the balancer's own mask ``causal() & document(lengths)``."""
    return mask.key == (causal() & document(lengths)).key


class _Segments(NamedTuple):
    """Segments of a permutation row, sorted by permuted start (int64 tensors)."""

    perm_start: Tensor
    orig_start: Tensor
    length: Tensor
    doc: Tensor

    @classmethod
    def of(cls, runs: tuple[Tensor, Tensor, Tensor], doc_starts: Tensor) -> _Segments:
        """``runs`` (permuted starts, original starts, lengths) cut at ``doc_starts`` (each
        document's first position, ascending; zero-length documents repeat a start)."""
        local, orig, lengths = (t.to(torch.int64) for t in runs)
        first = torch.searchsorted(doc_starts, orig, right=True) - 1
        last = torch.searchsorted(doc_starts, orig + lengths - 1, right=True) - 1
        count = last - first + 1
        run = torch.repeat_interleave(torch.arange(count.numel()), count)
        doc = first.index_select(0, run) + (
            torch.arange(run.numel()) - (count.cumsum(0) - count).index_select(0, run)
        )
        ends = torch.cat([doc_starts[1:], doc_starts.new_tensor([torch.iinfo(torch.int64).max])])
        o0, r_len = orig.index_select(0, run), lengths.index_select(0, run)
        a = torch.maximum(o0, doc_starts.index_select(0, doc))
        z = torch.minimum(o0 + r_len, ends.index_select(0, doc))
        keep = torch.nonzero(z > a).flatten()
        p = local.index_select(0, run) + (a - o0)
        return cls(*(t.index_select(0, keep) for t in (p, a, z - a, doc)))

    def window(self, begin: int, end: int) -> _Segments:
        """The segments inside permuted positions ``[begin, end)``, re-based at ``begin``."""
        p0 = self.perm_start.clamp(min=begin)
        p1 = (self.perm_start + self.length).clamp(max=end)
        keep = torch.nonzero(p1 > p0).flatten()
        p0, p1 = p0.index_select(0, keep), p1.index_select(0, keep)
        orig = self.orig_start.index_select(0, keep) + (p0 - self.perm_start.index_select(0, keep))
        return _Segments(p0 - begin, orig, p1 - p0, self.doc.index_select(0, keep))

    def by_doc(self, num_docs: int) -> tuple[Tensor, Tensor]:
        """Segment ids grouped by document (each group in permuted order) and where each
        document's group begins ``(num_docs + 1,)``."""
        order = torch.sort(self.doc, stable=True).indices  # already in permuted order
        counts = torch.bincount(self.doc, minlength=num_docs)
        return order, torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def _line_docs(segs: _Segments, block: int, length: int) -> tuple[Tensor, ...]:
    """The segments cut at blocks of ``block`` positions: per (line, document) pair its
    line, document, first and last original position; per line whether it holds one
    document and is a whole block, and its first and last original position."""
    p0, n = segs.perm_start, segs.length
    first_block = p0.div(block, rounding_mode="floor")
    count = (p0 + n - 1).div(block, rounding_mode="floor") - first_block + 1
    seg = torch.repeat_interleave(torch.arange(count.numel()), count)
    line = first_block.index_select(0, seg) + (
        torch.arange(seg.numel()) - (count.cumsum(0) - count).index_select(0, seg)
    )
    s0 = p0.index_select(0, seg)
    a = torch.maximum(s0, line * block)
    z = torch.minimum(s0 + n.index_select(0, seg), (line + 1) * block)
    shift = segs.orig_start.index_select(0, seg) - s0
    lo, hi, doc = a + shift, z - 1 + shift, segs.doc.index_select(0, seg)
    # (line, document) pairs: pieces sorted by both, min / max reduced per pair.
    num_docs = int(doc.max()) + 1 if doc.numel() else 1
    key, order = torch.sort(line * num_docs + doc, stable=True)
    lo, hi = lo.index_select(0, order), hi.index_select(0, order)
    pair_key, pair = torch.unique_consecutive(key, return_inverse=True)
    pairs = pair_key.numel()
    pair_lo = torch.full((pairs,), torch.iinfo(torch.int64).max).scatter_reduce_(
        0, pair, lo, "amin"
    )
    pair_hi = torch.full((pairs,), -1, dtype=torch.int64).scatter_reduce_(0, pair, hi, "amax")
    pair_line = pair_key.div(num_docs, rounding_mode="floor")
    lines = -(-length // block)
    docs_in_line = torch.bincount(pair_line, minlength=lines)
    whole = (torch.arange(lines) + 1) * block <= length
    single = (docs_in_line == 1) & whole
    line_lo = torch.full((lines,), torch.iinfo(torch.int64).max).scatter_reduce_(
        0, pair_line, pair_lo, "amin"
    )
    line_hi = torch.full((lines,), -1, dtype=torch.int64).scatter_reduce_(
        0, pair_line, pair_hi, "amax"
    )
    return pair_line, pair_key % num_docs, pair_lo, pair_hi, single, line_lo, line_hi


def _candidates(
    pair_line: Tensor, pair_doc: Tensor, cols: _Segments, num_docs: int
) -> tuple[Tensor, Tensor]:
    """Every (pair, column segment of the pair's document), in permuted order per line:
    (pair index, column segment index)."""
    order, doc_first = cols.by_doc(num_docs)
    start = doc_first.index_select(0, pair_doc)
    count = doc_first.index_select(0, pair_doc + 1) - start
    pair = torch.repeat_interleave(torch.arange(count.numel()), count)
    seg = order.index_select(
        0,
        start.index_select(0, pair)
        + torch.arange(pair.numel())
        - (count.cumsum(0) - count).index_select(0, pair),
    )
    # A line's documents each list their segments in permuted order; one sort interleaves
    # a line's documents (a few (line, segment) pairs per line, not the shard's entries).
    # (Segments are numbered in permuted order.)
    key = pair_line.index_select(0, pair) * (cols.perm_start.numel() + 1) + seg
    order = torch.sort(key).indices
    return pair.index_select(0, order), seg.index_select(0, order)


def _merge(line: Tensor, p0: Tensor, p1: Tensor, touching: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Ascending intervals of each line (sorted by line), merged where they overlap (or
    touch: ``touching``): (line, start, end) of each merged one."""
    if line.numel() == 0:
        return line, p0, p1
    new = torch.ones_like(line, dtype=torch.bool)
    joined = p0[1:] <= p1[:-1] if touching else p0[1:] < p1[:-1]
    new[1:] = (line[1:] != line[:-1]) | ~joined
    starts = torch.nonzero(new).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([line.numel()])]) - 1
    return line.index_select(0, starts), p0.index_select(0, starts), p1.index_select(0, ends)


def _layout(
    out: Tensor, line: Tensor, start: Tensor, end: Tensor, lines: int, width: int
) -> Tensor:
    """Writes each line's listed block ranges ``[start, end)`` (sorted by line, ascending
    and disjoint within it) then the others, ascending, into ``out`` ``(lines, width)``;
    returns the listed counts ``(lines,)`` int32."""
    n = line.numel()
    count = torch.bincount(line, minlength=lines)
    before = count.cumsum(0) - count  # listed ranges of earlier lines
    rank = torch.arange(n) - before.index_select(0, line)
    runs_before = 2 * before + torch.arange(lines)  # 2 count + 1 runs per line
    starts = torch.empty(2 * n + lines, dtype=torch.int64)
    lens = torch.empty(2 * n + lines, dtype=torch.int64)
    listed_at = runs_before.index_select(0, line) + rank
    starts.index_copy_(0, listed_at, start)
    lens.index_copy_(0, listed_at, end - start)
    # Gaps u = 0..count of a line: [end of range u - 1 (or 0), start of range u (or width)).
    gap_before = before + torch.arange(lines)  # count + 1 gaps per line
    gap_start = torch.zeros(n + lines, dtype=torch.int64)
    gap_end = torch.full((n + lines,), width, dtype=torch.int64)
    at = gap_before.index_select(0, line) + rank
    gap_start.index_copy_(0, at + 1, end)
    gap_end.index_copy_(0, at, start)
    gap_line = torch.repeat_interleave(torch.arange(lines), count + 1)
    gap_at = (
        runs_before.index_select(0, gap_line)
        + count.index_select(0, gap_line)
        + torch.arange(n + lines)
        - gap_before.index_select(0, gap_line)
    )
    starts.index_copy_(0, gap_at, gap_start)
    lens.index_copy_(0, gap_at, gap_end - gap_start)
    write_runs(out.view(-1), starts, lens)
    num = torch.zeros(lines, dtype=torch.int64).index_add_(0, line, end - start)
    return num.to(torch.int32)


def _side(
    line: Tensor,
    some: tuple[Tensor, Tensor],
    cover: tuple[Tensor, Tensor],
    covered: Tensor,
    lines: int,
    length: int,
    block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One side's (partial_num, partial_idx, full_num, full_idx) from each line's attended
    and covered column intervals (half-open positions, ascending per line, sorted by line;
    ``covered`` marks the candidates whose line may be full)."""
    width = -(-length // block)
    nonempty = torch.nonzero(some[1] > some[0]).flatten()
    s_line = line.index_select(0, nonempty)
    b0 = some[0].index_select(0, nonempty).div(block, rounding_mode="floor")
    b1 = (some[1].index_select(0, nonempty) - 1).div(block, rounding_mode="floor") + 1
    g_line, g0, g1 = _merge(s_line, b0, b1, touching=True)
    keep = torch.nonzero(covered & (cover[1] > cover[0])).flatten()
    c_line, c0, c1 = _merge(
        line.index_select(0, keep),
        cover[0].index_select(0, keep),
        cover[1].index_select(0, keep),
        touching=True,
    )
    f0 = (c0 + block - 1).div(block, rounding_mode="floor")  # whole blocks inside
    f1 = c1.div(block, rounding_mode="floor")
    whole = torch.nonzero(f1 > f0).flatten()
    f_line, f0, f1 = (t.index_select(0, whole) for t in (c_line, f0, f1))
    # Partial: each attended range less the full ranges inside it, as points
    # [g0, f0, f1, f0, f1, ..., g1] read in pairs.
    key = g_line * (width + 1) + g0
    group = torch.searchsorted(key, f_line * (width + 1) + f0, right=True) - 1
    in_group = torch.bincount(group, minlength=g_line.numel())
    full_before = in_group.cumsum(0) - in_group
    points = torch.empty(2 * g_line.numel() + 2 * f_line.numel(), dtype=torch.int64)
    g_at = 2 * torch.arange(g_line.numel()) + 2 * full_before
    points.index_copy_(0, g_at, g0)
    points.index_copy_(0, g_at + 2 * in_group + 1, g1)
    f_at = 2 * group + 2 * torch.arange(f_line.numel()) + 1
    points.index_copy_(0, f_at, f0)
    points.index_copy_(0, f_at + 1, f1)
    pair_line = torch.repeat_interleave(g_line, in_group + 1)
    p_start, p_end = points[0::2], points[1::2]
    real = torch.nonzero(p_end > p_start).flatten()
    p_line, p_start, p_end = (t.index_select(0, real) for t in (pair_line, p_start, p_end))
    partial_idx = torch.empty((lines, width), dtype=torch.int32)
    full_idx = torch.empty((lines, width), dtype=torch.int32)
    partial_num = _layout(partial_idx, p_line, p_start, p_end, lines, width)
    full_num = _layout(full_idx, f_line, f0, f1, lines, width)
    return partial_num, partial_idx, full_num, full_idx


def build(
    mask: Mask,
    lengths: list[int],
    indices: Tensor,
    runs: tuple[Tensor, Tensor, Tensor],
    rank: int,
    world: int,
    block: tuple[int, int],
) -> BlockMask:
    """Rank ``rank``'s BlockMask of ``mask`` (``causal() & document(lengths)``, one row)
    under the permutation ``indices`` ``(1, S)`` whose runs are ``runs``, on the CPU, at
    ``block`` ``(q_block, kv_block)``: query lines and columns at the query block, key
    lines and columns at the key block."""
    q_block, kv_block = block
    total = indices.shape[-1]
    local = total // world
    sizes = torch.tensor(lengths, dtype=torch.int64)
    doc_starts = sizes.cumsum(0) - sizes
    num_docs = sizes.numel()
    keys = _Segments.of(runs, doc_starts)
    queries = keys.window(rank * local, (rank + 1) * local)
    nq, nkv = -(-local // q_block), -(-total // kv_block)

    # kv side: each query line's (line, document) pairs against the key segments.
    pair_line, pair_doc, _, q_last, single, q_first, _ = _line_docs(queries, q_block, local)
    pair, seg = _candidates(pair_line, pair_doc, keys, num_docs)
    line = pair_line.index_select(0, pair)
    p, o, n = (t.index_select(0, seg) for t in (keys.perm_start, keys.orig_start, keys.length))
    upto = torch.minimum(q_last.index_select(0, pair) - o + 1, n).clamp_(min=0)
    cover = torch.minimum(q_first.index_select(0, line) - o + 1, n).clamp_(min=0)
    covered = single.index_select(0, line)
    kv = _side(line, (p, p + upto), (p, p + cover), covered, nq, total, kv_block)

    # q side: each key line's pairs against the local query segments.
    pair_line, pair_doc, k_first, _, single, _, k_last = _line_docs(keys, kv_block, total)
    pair, seg = _candidates(pair_line, pair_doc, queries, num_docs)
    line = pair_line.index_select(0, pair)
    p, o, n = (
        t.index_select(0, seg) for t in (queries.perm_start, queries.orig_start, queries.length)
    )
    end = p + n
    some = p + (k_first.index_select(0, pair) - o).clamp_(min=0)
    cover = p + (k_last.index_select(0, line) - o).clamp_(min=0)
    q = _side(
        line,
        (torch.minimum(some, end), end),
        (torch.minimum(cover, end), end),
        single.index_select(0, line),
        nkv,
        local,
        q_block,
    )

    def lookup(index: Tensor, length: int) -> Tensor:
        # Rows past the end (padding of the last block) read the last index; the kernel
        # drops them.
        pad = length - index.shape[-1]
        return index if pad <= 0 else torch.cat([index, index[:, -1:].expand(-1, pad)], dim=-1)

    q_index = lookup(
        indices[:, rank * local : (rank + 1) * local], math.ceil(local / q_block) * q_block
    )
    kv_index = lookup(indices, math.ceil(total / kv_block) * kv_block)
    return BlockMask(
        (local, total),
        kv[0].view(1, 1, nq),
        kv[1].view(1, 1, nq, nkv),
        kv[2].view(1, 1, nq),
        kv[3].view(1, 1, nq, nkv),
        q[0].view(1, 1, nkv),
        q[1].view(1, 1, nkv, nq),
        q[2].view(1, 1, nkv),
        q[3].view(1, 1, nkv, nq),
        BLOCK_SIZE=block,
        mask_mod=ShardMaskMod(mask.mask_mod, q_index.contiguous(), kv_index.contiguous()),
    )
