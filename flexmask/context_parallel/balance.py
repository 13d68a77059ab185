"""Load balancers: which query tokens each rank owns, as torch ``_LoadBalancer`` subclasses.

Every balancer here returns from ``_generate_indices`` the permutation ``indices`` (shape
``(1, S)`` or ``(B, S)``, int64) such that ``x[..., indices, ...]`` is the rearranged sequence
and rank ``r`` keeps positions ``[r * S / W, (r + 1) * S / W)`` of it — exactly what torch's
``_context_parallel_shard`` / ``context_parallel_unshard`` expect. ``S`` is the balancer's
``padded_length``: the sequence length rounded up to what the balancer divides (``2W`` for
head-tail, ``W * lcm(block_size)`` for the mask-aware and PTRR ones: a ``(Q, KV)`` pair deals
units of the lcm of the two, whole blocks on both sides); tokens past the real length are
padding.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer

from flexmask._validate import check_device, check_int, checked_sum, digest
from flexmask.algebra import Mask
from flexmask.blocks import EMPTY, FULL, PARTIAL, block_sizes, expand_runs
from flexmask.builders import classify_blocks, cpu_threads, make_grid, row_runs
from flexmask.pieces import padding

# torch >= 2.14's per-document head-tail balancer lays its chunks out rank by rank.
_RANK_MAJOR = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _device(device: Any) -> torch.device:
    """Where a balancer's indices live: None is the CPU (torch's balancers take a device)."""
    return torch.device("cpu") if device is None else check_device(device)


def _is_row(value: Any, ndim: int) -> bool:
    """A list/tuple, or a tensor or array of ``ndim`` dims (never a string or a scalar)."""
    if isinstance(value, (str, bytes)):
        return False
    if hasattr(value, "ndim"):  # a tensor or an array (a numpy scalar has ndim 0)
        return value.ndim == ndim
    return isinstance(value, Sequence)


def _check_cost(partial_cost: Any) -> float:
    """``partial_cost`` as a float, finite and >= 0 (a NaN would deal blocks at random)."""
    if isinstance(partial_cost, bool) or not isinstance(partial_cost, numbers.Real):
        raise TypeError(
            f"partial_cost must be a number (a partial block's cost relative to a full one), "
            f"got {partial_cost!r}"
        )
    cost = float(partial_cost)
    if not math.isfinite(cost) or cost < 0:
        raise ValueError(f"partial_cost must be a finite number >= 0, got {partial_cost!r}")
    return cost


def _block_size(block_size: Any) -> tuple[int | tuple[int, int], tuple[int, int], int]:
    """A balancer's ``block_size`` (an int, or a (Q, KV) pair as torch's ``BLOCK_SIZE``)
    as given (a square pair as its int), as a pair, and the tokens dealt as one: the lcm
    of the two, so every dealt unit is whole query blocks and whole key blocks (keys are
    permuted with the queries' permutation)."""
    if isinstance(block_size, (tuple, list)):
        pair = block_sizes(block_size)
    else:
        size = check_int(block_size, "block_size", minimum=1)
        pair = (size, size)
    given: int | tuple[int, int] = pair[0] if pair[0] == pair[1] else pair
    return given, pair, math.lcm(*pair)


def _per_unit(costs: Tensor, q_block: int, unit: int) -> Tensor:
    """Query-block costs ``(rows, n)`` summed over each dealt unit of ``unit`` tokens."""
    return costs.view(costs.shape[0], -1, unit // q_block).sum(-1)


def _restore(indices: Tensor, restore: bool) -> Tensor:
    return torch.argsort(indices, dim=-1) if restore else indices


class HeadTailBalancer(_LoadBalancer):
    """torch's head-tail balancer (the same permutation), padding the sequence to ``2W``.

    The sequence is cut into ``2W`` chunks; rank ``r`` owns chunk ``r`` and chunk
    ``2W - 1 - r``. Right for one causal mask over the whole sequence.

    Args:
        seq_length: real sequence length (padded up to a multiple of ``2 * world_size``).
        world_size: number of context-parallel ranks.
        device: where the indices live.

    Example:
        >>> from flexmask.context_parallel import HeadTailBalancer
        >>> HeadTailBalancer(8, 2)._generate_indices().tolist()
        [[0, 1, 6, 7, 2, 3, 4, 5]]
    """

    def __init__(
        self, seq_length: int, world_size: int, device: torch.device | str | None = None
    ) -> None:
        self.seq_length = check_int(seq_length, "seq_length", minimum=1)
        self.world_size = check_int(world_size, "world_size", minimum=1)
        self.device = _device(device)
        self.padded_length = _round_up(self.seq_length, 2 * self.world_size)

    rows = 1  # one permutation for every batch row

    @property
    def key(self) -> tuple:
        return ("head_tail", self.padded_length, self.world_size)

    def _generate_indices(self, restore: bool = False) -> Tensor:
        world = self.world_size
        chunks = torch.arange(self.padded_length, device=self.device).view(2 * world, -1)
        head = torch.arange(world, device=self.device)
        paired = torch.stack([chunks[head], chunks[2 * world - 1 - head]], dim=1)
        return _restore(paired.reshape(1, -1), restore)


class PerDocumentBalancer(_LoadBalancer):
    """torch's per-document head-tail balancer (the same permutation).

    Each document is cut into ``2W`` chunks and paired head-tail (chunk ``r`` with chunk
    ``2W - 1 - r``), as torch does, in the installed torch's order. torch 2.13 lists the
    pairs document by document, and rank ``r`` keeps the ``r``-th slice of that list: whole
    documents' pairs, not one pair of every document (see the imbalance figures in
    docs/context-parallel.md); torch 2.14 lists them rank by rank, so rank ``r`` keeps pair
    ``r`` of every document (``[[4, 8]]`` on 2 ranks: ``[0, 3, 1, 2, 4, 5, 10, 11, 6, 7, 8,
    9]`` on 2.13, ``[0, 3, 4, 5, 10, 11, 1, 2, 6, 7, 8, 9]`` on 2.14).

    Args:
        seq_length_per_doc: document lengths of each batch row (one row: the same for every
            row), each a multiple of ``2 * world_size`` as torch requires; rows sum alike.
        world_size: number of context-parallel ranks.
        device: where the indices live.

    Example:
        >>> from flexmask.context_parallel import PerDocumentBalancer
        >>> PerDocumentBalancer([[8]], 2)._generate_indices()[0].tolist()  # one document
        [0, 1, 6, 7, 2, 3, 4, 5]
    """

    def __init__(
        self,
        seq_length_per_doc: Sequence[Sequence[int]],
        world_size: int,
        device: torch.device | str | None = None,
    ) -> None:
        self.world_size = check_int(world_size, "world_size", minimum=1)
        self.device = _device(device)
        example = "e.g. [[128, 256]] for one row of two documents"
        if not _is_row(seq_length_per_doc, 2):
            raise TypeError(
                f"seq_length_per_doc must be a list of rows of document lengths ({example}), "
                f"got {seq_length_per_doc!r}"
            )
        if len(seq_length_per_doc) == 0:
            raise ValueError(f"seq_length_per_doc must hold at least one row ({example}), got []")
        rows: list[list[int]] = []
        for i, row in enumerate(seq_length_per_doc):
            if not _is_row(row, 1):
                raise TypeError(
                    f"seq_length_per_doc[{i}] must be a row (a list) of document lengths "
                    f"({example}; a flat list of lengths is one row: wrap it in brackets), "
                    f"got {row!r}"
                )
            if len(row) == 0:
                raise ValueError(
                    f"seq_length_per_doc[{i}] is empty: each row lists its documents ({example})"
                )
            lengths = []
            for j, length in enumerate(row):
                length = check_int(length, f"seq_length_per_doc[{i}][{j}]", minimum=0)
                if length % (2 * self.world_size):
                    raise ValueError(
                        f"seq_length_per_doc[{i}][{j}]: document length {length} is not a "
                        f"multiple of 2 * world_size = {2 * self.world_size} (torch's "
                        "per-document balancer needs that; pad documents or use the "
                        "mask-aware balancer)"
                    )
                lengths.append(length)
            checked_sum(torch.tensor(lengths), f"seq_length_per_doc[{i}]")
            rows.append(lengths)
        totals = {sum(row) for row in rows}
        if len(totals) != 1:
            raise ValueError(f"seq_length_per_doc: rows must sum alike, got sums {totals}")
        self.seq_length_per_doc = rows
        self.seq_length = self.padded_length = totals.pop()
        if self.seq_length == 0:
            raise ValueError(f"seq_length_per_doc: the documents hold no tokens, got {rows}")

    @property
    def rows(self) -> int:
        """Permutations given: one per batch row, or one shared by every row."""
        return len(self.seq_length_per_doc)

    @property
    def key(self) -> tuple:
        return (
            "per_document",
            self.world_size,
            tuple(tuple(row) for row in self.seq_length_per_doc),
        )

    def _row(self, lengths: list[int]) -> Tensor:
        world = self.world_size
        sizes = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.cumsum(sizes, 0) - sizes
        chunk = sizes // (2 * world)
        rank = torch.arange(world)
        # Head chunk r and tail chunk 2W-1-r of every document. torch 2.13 lays them out
        # document by document, (docs, ranks, 2); torch 2.14 rank by rank, (ranks, docs, 2),
        # so each rank's contiguous shard holds a head and a tail of every document: the
        # installed torch's order, so the permutation equals its balancer's.
        picks = torch.stack([rank, 2 * world - 1 - rank], dim=1)
        if _RANK_MAJOR:
            run_start = starts[None, :, None] + chunk[None, :, None] * picks[:, None, :]
            run_len = chunk[None, :, None].expand_as(run_start).reshape(-1)
        else:
            run_start = starts[:, None, None] + chunk[:, None, None] * picks
            run_len = chunk[:, None, None].expand_as(run_start).reshape(-1)
        # The chunks' tokens laid end to end: one pass over the permutation.
        out = torch.empty(int(sizes.sum()), dtype=torch.int64)
        expand_runs(out, run_start.reshape(-1), run_len)
        return out.to(self.device)

    def _generate_indices(self, restore: bool = False) -> Tensor:
        with cpu_threads(self.device):
            rows = torch.stack([self._row(row) for row in self.seq_length_per_doc])
            return _restore(rows, restore)


def _block_costs(
    mask: Mask,
    B: int | None,
    H: int | None,
    length: int,
    block: tuple[int, int],
    partial_cost: float,
    device: torch.device,
) -> Tensor:
    """Work of every query block, (rows, n_blocks) float64: its full kv blocks plus
    ``partial_cost`` times its partial ones, summed over the H heads — the counts of the
    mask's BlockMask, from structure and without writing it. A mask with monotone intervals
    counts its closed-form runs (O(blocks)); any other has its blocks classified (only those
    the structure leaves undecided are evaluated)."""
    grid = make_grid(mask, B, H, length, length, device, block)
    _, heads = grid.reduced(mask)
    if mask.has_monotone_intervals() and not mask.head_dependent:
        runs = row_runs(mask, grid)
        some = (runs.last - runs.first + 1).clamp_(min=0)
        full = (runs.full_last - runs.full_first + 1).clamp_(min=0)
        full, partial = full.to(torch.float64), (some - full).to(torch.float64)
    else:
        codes = classify_blocks(mask, grid).codes  # (rows, heads, nq, nkv)
        full = (codes == FULL).sum(-1, dtype=torch.float64).sum(1)
        partial = (codes == PARTIAL).sum(-1, dtype=torch.float64).sum(1)
    # Heads the mask ignores were built once: their work is the same on each.
    return (full + partial_cost * partial) * (grid.heads // heads)


def deal(costs: Tensor, world_size: int, max_swaps: int | None = None) -> Tensor:
    """Blocks dealt to ranks by cost, every rank the same number: ``(rows, W, n / W)`` block
    ids, ascending per rank.

    Blocks sorted by cost, heaviest first, are dealt in rounds that alternate direction
    (``ptrr_schedule``); then, while the most loaded rank of a row can swap one of its blocks
    for one of the least loaded rank's that narrows their gap, the best such swap is made
    (their difference closest to half the gap: each swap lowers the sum of squared loads,
    so this ends). Every step is vectorised over blocks and rows; the swaps are at most
    ``max_swaps`` rounds (default ``4 W``), not a loop over blocks.
    """
    rows, n = costs.shape
    groups = ptrr_schedule(costs, world_size).contiguous()  # (rows, W, k)
    k = n // world_size
    if k == 0 or world_size == 1:
        return groups
    values = costs.gather(1, groups.view(rows, -1)).view(rows, world_size, k)
    row = torch.arange(rows)
    for _ in range(4 * world_size if max_swaps is None else max_swaps):
        loads = values.sum(-1)
        high, low = loads.argmax(1), loads.argmin(1)
        gap = loads[row, high] - loads[row, low]  # (rows,)
        ours, theirs = values[row, high], values[row, low]  # (rows, k)
        sorted_theirs, order = torch.sort(theirs, dim=1)
        target = ours - gap.view(-1, 1) / 2
        at = torch.searchsorted(sorted_theirs, target.contiguous())
        best_score = torch.full((rows,), float("inf"), dtype=costs.dtype)
        best_i = torch.zeros(rows, dtype=torch.int64)
        best_j = torch.zeros(rows, dtype=torch.int64)
        for candidate in (at - 1, at):
            j = candidate.clamp(0, k - 1)
            delta = ours - sorted_theirs.gather(1, j)
            # The pair's new gap |gap - 2 delta|: a swap helps iff 0 < delta < gap.
            score = torch.where(
                (delta > 0) & (delta < gap.view(-1, 1)),
                (gap.view(-1, 1) - 2 * delta).abs(),
                float("inf"),
            )
            score_i, i = score.min(1)
            better = score_i < best_score
            best_score = torch.where(better, score_i, best_score)
            best_i = torch.where(better, i, best_i)
            best_j = torch.where(better, order.gather(1, j).gather(1, i.view(-1, 1))[:, 0], best_j)
        swap = torch.isfinite(best_score)
        if not bool(swap.any()):
            break
        r = row[swap]
        hi_at, lo_at = (high[swap], best_i[swap]), (low[swap], best_j[swap])
        a, b = groups[r, hi_at[0], hi_at[1]], groups[r, lo_at[0], lo_at[1]]
        va, vb = values[r, hi_at[0], hi_at[1]], values[r, lo_at[0], lo_at[1]]
        groups[r, hi_at[0], hi_at[1]], groups[r, lo_at[0], lo_at[1]] = b, a
        values[r, hi_at[0], hi_at[1]], values[r, lo_at[0], lo_at[1]] = vb, va
    return groups.sort(dim=-1).values


class MaskAwareBalancer(_LoadBalancer):
    """flexmask's balancer: query blocks go to ranks by the exact cost the structure gives.

    Each query block of ``block_size`` tokens costs its full kv blocks plus ``partial_cost``
    times its partial ones (the kernel's work), summed over every mask given (a global and a
    sliding-window layer, say) and over heads. Blocks are dealt heaviest first in rounds of
    alternating direction, then the most and least loaded ranks swap blocks while that
    narrows their gap (``deal``: vectorised, no loop over blocks); every rank gets
    ``S / (W * block_size)`` blocks (units of ``lcm(Q, KV)`` tokens for a ``(Q, KV)`` pair,
    each costing the query blocks it holds), kept in ascending order. The costs come from
    structure (closed-form runs, or classified blocks), not from a whole BlockMask. Works
    for any flexmask expression — trees included.

    Args:
        masks: one flexmask Mask or several (their costs add).
        B, H: as for ``create_block_mask``; per-row masks give per-row permutations.
        seq_length: real sequence length (padded up to a multiple of ``W * block_size``, or
            of ``W * lcm(Q, KV)`` for a pair).
        world_size: number of context-parallel ranks.
        block_size: the BlockMask block size, an int or torch's ``(Q, KV)`` pair; the unit
            dealt out is ``lcm(Q, KV)`` tokens (whole blocks on both sides), costing the
            ``(Q, KV)`` blocks it holds.
        partial_cost: the cost of a partial block relative to a full one.
        device: where the masks are built and the indices live.

    Attributes:
        rank_costs: (rows, W) cost per rank. imbalance: max rank cost / mean rank cost.

    Example:
        >>> import flexmask
        >>> from flexmask.context_parallel import MaskAwareBalancer
        >>> lb = MaskAwareBalancer(flexmask.causal(), 1, 1, 1024, 2, block_size=128)
        >>> lb.imbalance
        1.0
    """

    def __init__(
        self,
        masks: Mask | Sequence[Mask],
        B: int | None,
        H: int | None,
        seq_length: int,
        world_size: int,
        block_size: int | tuple[int, int] = 128,
        partial_cost: float = 1.0,
        device: torch.device | str | None = None,
    ) -> None:
        self.masks = (masks,) if isinstance(masks, Mask) else tuple(masks)
        if not self.masks or not all(isinstance(m, Mask) for m in self.masks):
            raise TypeError(f"masks must be a flexmask Mask or a list of them, got {masks!r}")
        self.seq_length = check_int(seq_length, "seq_length", minimum=1)
        self.world_size = check_int(world_size, "world_size", minimum=1)
        self.block_size, pair, unit = _block_size(block_size)
        self.unit = unit
        self.partial_cost = partial_cost = _check_cost(partial_cost)
        self.device = _device(device)
        self.B = B = None if B is None else check_int(B, "B", minimum=1)
        self.H = H = None if H is None else check_int(H, "H", minimum=1)
        world_size = self.world_size
        self.padded_length = _round_up(self.seq_length, world_size * unit)
        # Small tensor ops: on a busy machine one thread beats waiting for a second one.
        with cpu_threads(self.device):
            padded = [self._padded(m) for m in self.masks]
            costs = [
                _per_unit(
                    _block_costs(m, B, H, self.padded_length, pair, partial_cost, self.device),
                    pair[0],
                    unit,
                )
                for m in padded
            ]
            rows = max(c.shape[0] for c in costs)
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            self.block_costs: Tensor = sum((c.expand(rows, -1) for c in costs), zero)
            groups = deal(self.block_costs.cpu(), world_size)  # (rows, W, n / W)
            self.rank_costs = self.block_costs.cpu().gather(1, groups.view(rows, -1))
            self.rank_costs = self.rank_costs.view(rows, world_size, -1).sum(-1)
            tokens = groups.reshape(rows, -1, 1) * unit + torch.arange(unit)
            self._indices = tokens.reshape(rows, -1).to(self.device)

    def _padded(self, mask: Mask) -> Mask:
        if self.padded_length == self.seq_length:
            return mask
        return mask & padding(self.seq_length)

    @property
    def rows(self) -> int:
        """Permutations given: one per batch row, or one shared by every row."""
        return self._indices.shape[0]

    @property
    def imbalance(self) -> float:
        total = self.rank_costs.sum(dim=0)
        mean = float(total.mean())
        return float(total.max()) / mean if mean else 1.0

    @property
    def key(self) -> tuple:
        return (
            "mask_aware",
            tuple(m.key for m in self.masks),
            self.B,
            self.H,
            self.seq_length,
            self.world_size,
            self.block_size,
            self.partial_cost,
        )

    def _generate_indices(self, restore: bool = False) -> Tensor:
        return _restore(self._indices, restore)


def nonempty_blocks(
    mask: Mask,
    B: int | None,
    H: int | None,
    length: int,
    block: int | tuple[int, int],
    device: torch.device,
) -> Tensor:
    """Non-empty kv blocks of every query block, (rows, n_blocks) int64: the counts
    ``kv_num_blocks + full_kv_num_blocks`` of the mask's BlockMask (rows: B where the mask
    depends on the row, else 1), from structure and without writing the BlockMask. A mask
    with monotone intervals counts its closed-form runs (O(blocks)); any other has its
    blocks classified (only blocks the structure leaves undecided are evaluated)."""
    grid = make_grid(mask, B, H, length, length, device, block)
    if mask.has_monotone_intervals() and not mask.head_dependent:
        runs = row_runs(mask, grid)
        return (runs.last - runs.first + 1).clamp_(min=0).to(torch.int64)
    codes = classify_blocks(mask, grid).codes  # (rows, heads, nq, nkv)
    return (codes[:, 0] != EMPTY).sum(-1, dtype=torch.int64)


def ptrr_schedule(process_time: Tensor, world_size: int) -> Tensor:
    """torch's PTRR (processing-time round robin) of each row of ``process_time``
    ``(rows, n)``: tasks sorted by time, descending and stable, dealt to ranks in rounds
    that alternate direction (0..W-1, then W-1..0), each rank's tasks sorted. Returns
    ``(rows, W, n / W)`` task ids; the same as ``_PTRRLoadBalancer.ptrr_scheduling`` row
    by row."""
    rows, n = process_time.shape
    order = torch.sort(process_time, dim=1, descending=True, stable=True).indices
    rounds = order.view(rows, n // world_size, world_size)
    backward = torch.arange(n // world_size, device=order.device) % 2 == 1
    rounds = torch.where(backward.view(1, -1, 1), rounds.flip(-1), rounds)
    return rounds.transpose(1, 2).sort(dim=-1).values


class PTRRBalancer(_LoadBalancer):
    """torch's PTRR balancer (``_PTRRLoadBalancer``, the same permutation), its per-block
    process times counted from the mask's structure instead of a BlockMask.

    torch deals query blocks by processing time — each block's non-empty kv blocks
    (``kv_num_blocks + full_kv_num_blocks`` of a ``(B, 1, S, S)`` BlockMask) — in
    alternating round robin. flexmask counts those blocks from structure: closed-form masks
    from their runs, O(blocks); others from their classified blocks. torch requires one
    mask for every head (its BlockMask's H == 1); so does this: a mask that depends on the
    head is refused, and a mask that does not is the same for any H.

    Args:
        mask: a flexmask Mask over the whole sequence.
        B, H: as for ``create_block_mask``; a mask that depends on the row gives one
            permutation per row, as torch's from a ``(B, 1, S, S)`` BlockMask.
        seq_length: real sequence length (padded up to ``world_size * block_size``, or
            ``world_size * lcm(Q, KV)`` for a pair; torch requires the block count to be a
            multiple of W and then pads nothing).
        world_size: number of context-parallel ranks.
        block_size: the block size of torch's BlockMask, an int or a ``(Q, KV)`` pair (torch's
            own refuses a pair; here the unit dealt out is ``lcm(Q, KV)`` tokens, its
            process time the non-empty ``(Q, KV)`` blocks it holds).
        device: where the indices live.

    Example:
        >>> import flexmask
        >>> from flexmask.context_parallel import PTRRBalancer
        >>> mask = flexmask.causal() & flexmask.document([4, 8, 4])
        >>> PTRRBalancer(mask, 1, 1, 16, 2, block_size=1)._generate_indices()[0].tolist()
        [2, 3, 5, 6, 8, 11, 12, 13, 0, 1, 4, 7, 9, 10, 14, 15]
    """

    def __init__(
        self,
        mask: Mask,
        B: int | None,
        H: int | None,
        seq_length: int,
        world_size: int,
        block_size: int | tuple[int, int] = 128,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
        self.seq_length = check_int(seq_length, "seq_length", minimum=1)
        self.world_size = check_int(world_size, "world_size", minimum=1)
        self.block_size, pair, unit = _block_size(block_size)
        self.unit = unit
        if H is not None and check_int(H, "H", minimum=1) > 1 and mask.head_dependent:
            raise ValueError(
                f"H = {H} with a mask that depends on the head: PTRR (torch's too) gives one "
                "permutation for every head, from a BlockMask with H == 1; pass H=None or a "
                "mask that is the same on every head"
            )
        self.mask = mask
        self.B = B = None if B is None else check_int(B, "B", minimum=1)
        self.H = None if H is None else check_int(H, "H", minimum=1)
        self.device = _device(device)
        seq_length, world_size = self.seq_length, self.world_size
        self.padded_length = _round_up(seq_length, world_size * unit)
        padded = mask if self.padded_length == seq_length else mask & padding(seq_length)
        with cpu_threads(self.device):
            self.block_costs = _per_unit(
                nonempty_blocks(padded, B, 1, self.padded_length, pair, torch.device("cpu")),
                pair[0],
                unit,
            )
            groups = ptrr_schedule(self.block_costs, world_size)  # (rows, W, n / W)
            rows = groups.shape[0]
            tokens = groups.reshape(rows, -1, 1) * unit + torch.arange(unit)
            self._indices = tokens.reshape(rows, -1).to(self.device)

    @property
    def rows(self) -> int:
        """Permutations given: one per batch row, or one shared by every row."""
        return self._indices.shape[0]

    @property
    def rank_costs(self) -> Tensor:
        """(rows, W) non-empty blocks per rank: PTRR's own measure of the work."""
        rows = self.block_costs.shape[0]
        blocks = self._indices[:, :: self.unit].cpu() // self.unit
        per_rank = self.block_costs.gather(1, blocks).view(rows, self.world_size, -1)
        return per_rank.sum(-1)

    @property
    def key(self) -> tuple:
        return (
            "ptrr",
            self.mask.key,
            self.B if self.mask.batch_dependent else None,
            self.seq_length,
            self.world_size,
            self.block_size,
        )

    def _generate_indices(self, restore: bool = False) -> Tensor:
        return _restore(self._indices, restore)


def balancer_key(balancer: _LoadBalancer | None) -> tuple:
    """A content key of a balancer: its own ``key``, else a digest of its indices."""
    if balancer is None:
        return ("none",)
    key = getattr(balancer, "key", None)
    if isinstance(key, tuple):
        return key
    indices = balancer_indices(balancer)
    return (type(balancer).__qualname__, tuple(indices.shape), digest(indices.to(torch.int64)))


def balancer_indices(balancer: _LoadBalancer) -> Tensor:
    """The balancer's permutation; a ValueError where it gives none (torch's base class
    allows ``_generate_indices`` to return None, which cannot shard anything)."""
    indices = balancer._generate_indices()
    if indices is None:
        raise ValueError(
            f"balancer {balancer!r} gives no permutation (_generate_indices() is None)"
        )
    return indices
