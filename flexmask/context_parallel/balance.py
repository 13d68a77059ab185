"""Load balancers: which query tokens each rank owns, as torch ``_LoadBalancer`` subclasses.

Every balancer here returns from ``_generate_indices`` the permutation ``indices`` (shape
``(1, S)`` or ``(B, S)``, int64) such that ``x[..., indices, ...]`` is the rearranged sequence
and rank ``r`` keeps positions ``[r * S / W, (r + 1) * S / W)`` of it — exactly what torch's
``_context_parallel_shard`` / ``context_parallel_unshard`` expect. ``S`` is the balancer's
``padded_length``: the sequence length rounded up to what the balancer divides (``2W`` for
head-tail, ``W * block_size`` for the mask-aware one); tokens past the real length are padding.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer

from flexmask._validate import check_int, digest
from flexmask.build.classify import classify_blocks
from flexmask.build.closed_form import row_runs
from flexmask.build.codes import EMPTY
from flexmask.build.create import create_block_mask
from flexmask.build.grid import make_grid
from flexmask.mask import Mask
from flexmask.pieces import padding


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


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
        self.device = torch.device("cpu" if device is None else device)
        self.padded_length = _round_up(seq_length, 2 * world_size)

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
    ``2W - 1 - r``), as torch does. torch (2.13) lists the pairs document by document, and
    rank ``r`` keeps the ``r``-th slice of that list: whole documents' pairs, not one pair
    of every document (see the imbalance figures in docs/context-parallel.md).

    Args:
        seq_length_per_doc: document lengths of each batch row (one row: the same for every
            row), each a multiple of ``2 * world_size`` as torch requires; rows sum alike.
        world_size: number of context-parallel ranks.
        device: where the indices live.

    Example:
        >>> from flexmask.context_parallel import PerDocumentBalancer
        >>> PerDocumentBalancer([[4, 8]], 2)._generate_indices()[0].tolist()
        [0, 3, 1, 2, 4, 5, 10, 11, 6, 7, 8, 9]
    """

    def __init__(
        self,
        seq_length_per_doc: Sequence[Sequence[int]],
        world_size: int,
        device: torch.device | str | None = None,
    ) -> None:
        self.world_size = check_int(world_size, "world_size", minimum=1)
        self.device = torch.device("cpu" if device is None else device)
        rows = [list(row) for row in seq_length_per_doc]
        if not rows or any(not row for row in rows):
            raise ValueError(
                "seq_length_per_doc must be a list of rows of document lengths, e.g. "
                f"[[128, 256]], got {seq_length_per_doc!r}"
            )
        for row in rows:
            for length in row:
                check_int(length, "seq_length_per_doc entries", minimum=0)
                if length % (2 * world_size):
                    raise ValueError(
                        f"seq_length_per_doc: document length {length} is not a multiple of "
                        f"2 * world_size = {2 * world_size} (torch's per-document balancer "
                        "needs that; pad documents or use the mask-aware balancer)"
                    )
        totals = {sum(row) for row in rows}
        if len(totals) != 1:
            raise ValueError(f"seq_length_per_doc: rows must sum alike, got sums {totals}")
        self.seq_length_per_doc = rows
        self.seq_length = self.padded_length = totals.pop()

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
        # (docs, ranks, 2): head chunk r and tail chunk 2W-1-r of every document.
        picks = torch.stack([rank, 2 * world - 1 - rank], dim=1)
        run_start = starts[:, None, None] + chunk[:, None, None] * picks
        run_len = chunk[:, None, None].expand_as(run_start).reshape(-1)
        run_start = run_start.reshape(-1)
        offsets = torch.arange(int(run_len.sum())) - torch.repeat_interleave(
            torch.cumsum(run_len, 0) - run_len, run_len
        )
        return (torch.repeat_interleave(run_start, run_len) + offsets).to(self.device)

    def _generate_indices(self, restore: bool = False) -> Tensor:
        rows = torch.stack([self._row(row) for row in self.seq_length_per_doc])
        return _restore(rows, restore)


def _block_costs(
    mask: Mask,
    B: int | None,
    H: int | None,
    length: int,
    block: int,
    partial_cost: float,
    device: torch.device,
) -> Tensor:
    """Work of every query block, (rows, n_blocks): full blocks + partial_cost * partial."""
    bm = create_block_mask(mask, B, H, length, length, device, block)
    if bm.full_kv_num_blocks is None:  # flexmask's build always writes the full side
        raise RuntimeError("create_block_mask returned a BlockMask without its full blocks")
    cost = bm.full_kv_num_blocks.to(torch.float64) + partial_cost * bm.kv_num_blocks
    cost = cost.sum(dim=1)  # heads share one permutation: their work adds up
    if not mask.batch_dependent:
        cost = cost[:1]
    return cost


class MaskAwareBalancer(_LoadBalancer):
    """flexmask's balancer: query blocks go to ranks by the exact cost the structure gives.

    Each query block of ``block_size`` tokens costs its full kv blocks plus ``partial_cost``
    times its partial ones (the kernel's work), summed over every mask given (a global and a
    sliding-window layer, say) and over heads. Blocks are dealt heaviest first to the least
    loaded rank that still has room (every rank gets ``S / (W * block_size)`` blocks), then
    kept in ascending order per rank. Works for any flexmask expression — trees included.

    Args:
        masks: one flexmask Mask or several (their costs add).
        B, H: as for ``create_block_mask``; per-row masks give per-row permutations.
        seq_length: real sequence length (padded up to a multiple of ``W * block_size``).
        world_size: number of context-parallel ranks.
        block_size: the BlockMask block size (and the unit dealt out).
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
        block_size: int = 128,
        partial_cost: float = 1.0,
        device: torch.device | str | None = None,
    ) -> None:
        self.masks = (masks,) if isinstance(masks, Mask) else tuple(masks)
        if not self.masks or not all(isinstance(m, Mask) for m in self.masks):
            raise TypeError(f"masks must be a flexmask Mask or a list of them, got {masks!r}")
        self.seq_length = check_int(seq_length, "seq_length", minimum=1)
        self.world_size = check_int(world_size, "world_size", minimum=1)
        self.block_size = check_int(block_size, "block_size", minimum=1)
        if not isinstance(partial_cost, (int, float)) or partial_cost < 0:
            raise ValueError(f"partial_cost must be a number >= 0, got {partial_cost!r}")
        self.partial_cost = float(partial_cost)
        self.device = torch.device("cpu" if device is None else device)
        self.B, self.H = B, H
        self.padded_length = _round_up(seq_length, world_size * block_size)
        padded = [self._padded(m) for m in self.masks]
        costs = [
            _block_costs(m, B, H, self.padded_length, block_size, self.partial_cost, self.device)
            for m in padded
        ]
        rows = max(c.shape[0] for c in costs)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.block_costs: Tensor = sum((c.expand(rows, -1) for c in costs), zero)
        assignment, rank_costs = zip(*(self._deal(row) for row in self.block_costs), strict=False)
        self.rank_costs = torch.stack(rank_costs)
        blocks = torch.stack(assignment)  # (rows, n_blocks): block ids, rank by rank
        tokens = blocks[:, :, None] * block_size + torch.arange(block_size)
        self._indices = tokens.reshape(rows, -1).to(self.device)

    def _padded(self, mask: Mask) -> Mask:
        if self.padded_length == self.seq_length:
            return mask
        return mask & padding(self.seq_length)

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

    def _deal(self, costs: Tensor) -> tuple[Tensor, Tensor]:
        world = self.world_size
        room = costs.numel() // world
        order = torch.argsort(costs, descending=True, stable=True).tolist()
        values = costs.tolist()
        heap = [(0.0, rank) for rank in range(world)]
        owned: list[list[int]] = [[] for _ in range(world)]
        loads = [0.0] * world
        for block in order:
            load, rank = heapq.heappop(heap)
            owned[rank].append(block)
            loads[rank] = load + values[block]
            if len(owned[rank]) < room:
                heapq.heappush(heap, (loads[rank], rank))
        flat = [block for rank in range(world) for block in sorted(owned[rank])]
        return torch.tensor(flat, dtype=torch.int64), torch.tensor(loads, dtype=torch.float64)

    def _generate_indices(self, restore: bool = False) -> Tensor:
        return _restore(self._indices, restore)


def nonempty_blocks(
    mask: Mask, B: int | None, H: int | None, length: int, block: int, device: torch.device
) -> Tensor:
    """Non-empty kv blocks of every query block, (rows, n_blocks) int64: the counts
    ``kv_num_blocks + full_kv_num_blocks`` of the mask's BlockMask (rows: B where the mask
    depends on the row, else 1), from structure and without writing the BlockMask. A mask
    with monotone intervals counts its closed-form runs (O(blocks)); any other has its
    blocks classified (only blocks the structure leaves undecided are evaluated)."""
    grid = make_grid(mask, B, H, length, length, device, block)
    if mask._has_monotone_intervals() and not mask.head_dependent:
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
        seq_length: real sequence length (padded up to ``world_size * block_size``; torch
            requires the block count to be a multiple of W and then pads nothing).
        world_size: number of context-parallel ranks.
        block_size: the block size of torch's BlockMask (and the unit dealt out).
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
        block_size: int = 128,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
        self.seq_length = check_int(seq_length, "seq_length", minimum=1)
        self.world_size = check_int(world_size, "world_size", minimum=1)
        self.block_size = check_int(block_size, "block_size", minimum=1)
        if H is not None and check_int(H, "H", minimum=1) > 1 and mask.head_dependent:
            raise ValueError(
                f"H = {H} with a mask that depends on the head: PTRR (torch's too) gives one "
                "permutation for every head, from a BlockMask with H == 1; pass H=None or a "
                "mask that is the same on every head"
            )
        self.mask, self.B, self.H = mask, B, H
        self.device = torch.device("cpu" if device is None else device)
        self.padded_length = _round_up(seq_length, world_size * block_size)
        padded = mask if self.padded_length == seq_length else mask & padding(seq_length)
        self.block_costs = nonempty_blocks(
            padded, B, 1, self.padded_length, block_size, torch.device("cpu")
        )
        groups = ptrr_schedule(self.block_costs, world_size)  # (rows, W, n / W)
        rows = groups.shape[0]
        tokens = groups.reshape(rows, -1, 1) * block_size + torch.arange(block_size)
        self._indices = tokens.reshape(rows, -1).to(self.device)

    @property
    def rank_costs(self) -> Tensor:
        """(rows, W) non-empty blocks per rank: PTRR's own measure of the work."""
        rows = self.block_costs.shape[0]
        blocks = self._indices[:, :: self.block_size].cpu() // self.block_size
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
