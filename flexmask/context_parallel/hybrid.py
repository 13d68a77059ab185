"""Several masks per step, weighed by their layers: one permutation for a hybrid model.

A hybrid model (global and sliding-window layers, or global and chunked ones) runs several
masks over the same sharded sequence in one step, and every layer waits at its own
all-gather for its slowest rank. ``LayerWeightedBalancer`` takes each mask with its layer
count and deals query blocks so that every mask's per-rank cost is even, weighted by how
many layers run it; ``layer_imbalance`` measures any balancer the same way from every
rank's shard.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.builders import cpu_threads
from flexmask.context_parallel.balance import MaskAwareBalancer, _check_cost, _restore, deal
from flexmask.context_parallel.core import shard_costs

# Candidate swaps scored at once: (masks, ranks, blocks, blocks) float64 stays ~32 MiB.
_SWAP_CHUNK = 1 << 22
# Relative tolerance below which a swap's gain is rounding, not progress.
_TOLERANCE = 1e-12
# Swaps stop once the synchronised step is this close to its mean: far below timing noise.
_CLOSE_ENOUGH = 5e-4

_EXAMPLE = "e.g. [(causal() & document(lengths), 12), (causal() & sliding_window(1024), 36)]"


def _check_weight(weight: Any, name: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise TypeError(
            f"{name} must be a number (how many layers run the mask, or its cost weight), "
            f"got {weight!r}"
        )
    value = float(weight)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{name} must be a finite number > 0 (a mask no layer runs has no place in the "
            f"step: leave it out), got {weight!r}"
        )
    return value


def check_layers(layers: Any) -> tuple[tuple[Mask, ...], tuple[float, ...]]:
    """``layers`` as (masks, weights): pairs of a flexmask Mask and a weight > 0, the
    masks over one sequence (the same document lengths, the same batch rows)."""
    if isinstance(layers, (Mask, str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(
            f"layers must be a list of (mask, weight) pairs ({_EXAMPLE}), got {layers!r}"
        )
    if not layers:
        raise ValueError(f"layers must hold at least one (mask, weight) pair ({_EXAMPLE}), got []")
    masks, weights = [], []
    for i, pair in enumerate(layers):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(f"layers[{i}] must be a (mask, weight) pair ({_EXAMPLE}), got {pair!r}")
        mask, weight = pair
        if not isinstance(mask, Mask):
            raise TypeError(f"layers[{i}][0] must be a flexmask Mask, got {type(mask).__name__}")
        masks.append(mask)
        weights.append(_check_weight(weight, f"layers[{i}][1]"))
    # Masks that carry data (documents, a tree) must describe the same sequence and batch.
    lengths = {(i, m.natural_length) for i, m in enumerate(masks) if m.natural_length}
    if len({n for _, n in lengths}) > 1:
        raise ValueError(
            "layers: the masks describe sequences of different lengths "
            f"({', '.join(f'layers[{i}]: {n}' for i, n in sorted(lengths))}); every layer of "
            "a step runs over the same tokens: build each mask from the same documents"
        )
    rows = {(i, m.rows) for i, m in enumerate(masks) if m.rows is not None}
    if len({r for _, r in rows}) > 1:
        raise ValueError(
            "layers: the masks hold different batch rows "
            f"({', '.join(f'layers[{i}]: {r}' for i, r in sorted(rows))}); build each mask "
            "for the same batch"
        )
    return tuple(masks), tuple(weights)


def _others_max(loads: Tensor, high: int, partners: Tensor) -> Tensor:
    """(masks, len(partners)): each mask's largest load among the ranks other than ``high``
    and the partner."""
    masks, world = loads.shape
    grid = loads.unsqueeze(1).expand(masks, len(partners), world).clone()
    grid[:, :, high] = -math.inf
    grid[:, torch.arange(len(partners)), partners] = -math.inf
    return grid.max(-1).values if world > 2 else torch.zeros(masks, len(partners))


def _swap_scores(
    values: Tensor, weights: Tensor, high: int, partners: Tensor
) -> tuple[Tensor, Tensor]:
    """For every swap of block i of rank ``high`` with block j of each partner rank, the
    synchronised step ``sum_m w_m max_r cost_m(r)`` after it and the change of the weighted
    spread ``sum_m w_m / mean_m * sum_r cost_m(r)^2``: two (P, k, k) tensors."""
    masks = values.shape[0]
    loads = values.sum(-1)  # (masks, W)
    means = loads.mean(1).clamp(min=1e-300)
    outside = _others_max(loads, high, partners)[:, :, None, None]  # (masks, P, 1, 1)
    # d: what the swap takes off ``high`` and puts on the partner, per mask.
    d = values[:, high][:, None, :, None] - values[:, partners][:, :, None, :]
    new_high = loads[:, high].view(masks, 1, 1, 1) - d
    new_partner = loads[:, partners].view(masks, -1, 1, 1) + d
    peak = torch.maximum(torch.maximum(new_high, new_partner), outside)
    new_step = (weights.view(-1, 1, 1, 1) * peak).sum(0)
    gap = (loads[:, high, None] - loads[:, partners]).view(masks, -1, 1, 1)
    spread_change = ((weights / means).view(-1, 1, 1, 1) * 2 * d * (d - gap)).sum(0)
    return new_step, spread_change


def _best_swap(
    values: Tensor, weights: Tensor, high: int, step: float, spread: float
) -> tuple[int, int, int] | None:
    """The swap of a block of rank ``high`` for a block of another rank that most lowers
    the synchronised step, or where none does, the one that most lowers the weighted spread
    without raising the step (ties at a mask's maximum are then broken over several swaps:
    the spread falls with every swap, so this ends). None where no swap helps. Returns
    (partner rank, block position on ``high``, block position on the partner)."""
    masks, world, k = values.shape
    others = torch.tensor([r for r in range(world) if r != high], dtype=torch.int64)
    chunk = max(1, _SWAP_CHUNK // max(1, masks * k * k))
    step_tol, spread_tol = _TOLERANCE * max(step, 1.0), _TOLERANCE * max(spread, 1.0)
    lowest: tuple[float, int, int, int] | None = None  # (new step, partner, i, j)
    flattest: tuple[float, int, int, int] | None = None  # (spread change, partner, i, j)
    for start in range(0, len(others), chunk):
        partners = others[start : start + chunk]
        new_step, spread_change = _swap_scores(values, weights, high, partners)
        at = int(new_step.argmin())
        p, i, j = (int(x) for x in torch.unravel_index(torch.tensor(at), new_step.shape))
        value = float(new_step[p, i, j])
        if value < step - step_tol and (lowest is None or value < lowest[0]):
            lowest = (value, int(partners[p]), i, j)
        if lowest is not None:
            continue
        plateau = torch.where(new_step <= step + step_tol, spread_change, math.inf)
        at = int(plateau.argmin())
        p, i, j = (int(x) for x in torch.unravel_index(torch.tensor(at), plateau.shape))
        value = float(plateau[p, i, j])
        if value < -spread_tol and (flattest is None or value < flattest[0]):
            flattest = (value, int(partners[p]), i, j)
    chosen = lowest if lowest is not None else flattest
    return None if chosen is None else chosen[1:]


def refine(groups: Tensor, costs: Tensor, weights: Tensor, rounds: int) -> Tensor:
    """``groups`` (W, k) block ids improved by swaps between ranks: each round the rank that
    most exceeds the masks' means swaps one block with another rank (``_best_swap``) while
    that lowers the synchronised step or, at equal step, its spread. ``costs``: (masks, n)
    per block, ``weights``: (masks,). Every rank keeps its number of blocks."""
    groups = groups.clone()
    for _ in range(rounds):
        values = costs[:, groups]  # (masks, W, k)
        loads = values.sum(-1)
        means = loads.mean(1, keepdim=True)
        excess = (weights.view(-1, 1) * (loads - means).clamp(min=0)).sum(0)
        high = int(excess.argmax())
        step = float((weights * loads.max(1).values).sum())
        if step <= (1 + _CLOSE_ENOUGH) * float((weights * means[:, 0]).sum()):
            break
        spread = float(((weights.view(-1, 1) / means.clamp(min=1e-300)) * loads**2).sum())
        move = _best_swap(values, weights, high, step, spread)
        if move is None:
            break
        partner, i, j = move
        groups[high, i], groups[partner, j] = int(groups[partner, j]), int(groups[high, i])
    return groups.sort(dim=-1).values


def synced_step(groups: Tensor, costs: Tensor, weights: Tensor) -> float:
    """``sum_m w_m max_r cost_m(r)`` of ``groups`` (W, k) block ids; ``costs`` (masks, n)."""
    return float((weights * costs[:, groups].sum(-1).max(1).values).sum())


def best_of(costs: Tensor, weights: Tensor, starts: list[Tensor], rounds: int) -> Tensor:
    """The start (W, k) with the lowest synchronised step after ``refine``. Starts are refined
    from the best one down, and the search ends at one within ``_CLOSE_ENOUGH`` of the mean:
    the result is never worse than the best start, at a fraction of refining them all."""
    bound = (1 + _CLOSE_ENOUGH) * float((weights * costs.sum(1)).sum()) / starts[0].shape[0]
    ordered = sorted(starts, key=lambda groups: synced_step(groups, costs, weights))
    best, best_step = ordered[0], math.inf
    for start in ordered:
        groups = refine(start, costs, weights, rounds)
        step = synced_step(groups, costs, weights)
        if step < best_step:
            best, best_step = groups, step
        if best_step <= bound:
            break
    return best


class LayerWeightedBalancer(_LoadBalancer):
    """One permutation for a step that runs several masks, each weighed by its layers.

    A hybrid model's step runs every mask over the same sharded sequence (GPT-OSS, Olmo 3 and
    Gemma 3: global and sliding-window layers; Llama 4: global and chunked ones), and each
    layer waits at its all-gather for its slowest rank. So the step costs
    ``sum_m w_m * max_r cost_m(r)`` — the *synchronised step* — where ``cost_m(r)`` is what
    rank ``r``'s query blocks cost under mask ``m``: its full kv blocks plus ``partial_cost``
    times its partial ones, summed over heads (``MaskAwareBalancer``'s per-block cost). This
    balancer makes that small: it deals blocks by their weighted cost ``sum_m w_m cost_m``
    heaviest first (``MaskAwareBalancer``'s deal), then swaps blocks between ranks while a
    swap lowers the synchronised step (or, at equal step, the masks' weighted spread); it
    does the same from each mask's own ``MaskAwareBalancer`` deal and keeps the best, so it
    is never worse than a mask-aware balancer given one of the masks. The per-rank maximum
    of the weighted sum, ``max_r sum_m w_m cost_m(r)``, is never above the synchronised
    step, so its imbalance (``imbalance``) is at most ``synced_imbalance``. Every rank gets
    the same number of blocks, in ascending order, as from ``MaskAwareBalancer``.

    The permutation is one torch ``_LoadBalancer`` for every mask of the step: pass it to
    ``flexmask.shard(mask, ..., balancer=lb)`` for each mask in ``layers``.

    Args:
        layers: (mask, weight) pairs: each flexmask Mask with how many layers run it (or any
            cost weight > 0), e.g. ``[(global_mask, 12), (window_mask, 36)]``.
        B, H: as for ``create_block_mask``; per-row masks give per-row permutations.
        seq_length: real sequence length (padded up as ``MaskAwareBalancer`` pads it).
        world_size: number of context-parallel ranks.
        block_size: the BlockMask block size, an int or torch's ``(Q, KV)`` pair, as for
            ``MaskAwareBalancer`` (which pads and deals the same units).
        partial_cost: the cost of a partial block relative to a full one.
        device: where the masks are built and the indices live.
        max_swaps: swap rounds at most (default ``16 * world_size``).

    Attributes:
        mask_costs: (rows, masks, W) cost of each rank under each mask.

    Example:
        >>> import flexmask
        >>> from flexmask.context_parallel import LayerWeightedBalancer
        >>> g = flexmask.causal() & flexmask.document([512, 1536])
        >>> lb = LayerWeightedBalancer([(g, 1), (g & flexmask.chunked(256), 3)], 1, 1,
        ...                            2048, 2, block_size=128)
        >>> lb.imbalance, lb.synced_imbalance, lb.mask_imbalance
        (1.0, 1.0, (1.0, 1.0))
    """

    def __init__(
        self,
        layers: Sequence[tuple[Mask, float]],
        B: int | None,
        H: int | None,
        seq_length: int,
        world_size: int,
        block_size: int | tuple[int, int] = 128,
        partial_cost: float = 1.0,
        device: torch.device | str | None = None,
        max_swaps: int | None = None,
    ) -> None:
        self.masks, self.weights = check_layers(layers)
        # Each mask's own balancer validates the shared arguments and costs its blocks.
        single = [
            MaskAwareBalancer(m, B, H, seq_length, world_size, block_size, partial_cost, device)
            for m in self.masks
        ]
        first = single[0]
        self.B, self.H, self.seq_length = first.B, first.H, first.seq_length
        self.world_size, self.block_size = first.world_size, first.block_size
        self.partial_cost, self.device = first.partial_cost, first.device
        self.padded_length = first.padded_length
        world = self.world_size
        rounds = 16 * world if max_swaps is None else check_int(max_swaps, "max_swaps", minimum=0)
        unit_size: Any = getattr(first, "unit", first.block_size)  # tokens dealt as one
        unit = int(unit_size)
        rows = max(lb.block_costs.shape[0] for lb in single)
        costs = torch.stack([lb.block_costs.cpu().expand(rows, -1) for lb in single], 1)
        weights = torch.tensor(self.weights, dtype=torch.float64)
        # Small tensor ops: on a busy machine one thread beats waiting for a second one.
        # Starts: the deal by the weighted cost and each mask's own balancer's deal, so the
        # result is never worse than a balancer given one of the masks.
        starts = [deal((weights.view(1, -1, 1) * costs).sum(1), world)]  # (rows, W, k)
        for lb in single:
            blocks = lb._generate_indices().cpu()[:, ::unit] // unit
            starts.append(blocks.expand(rows, -1).reshape(rows, world, -1))
        with cpu_threads(self.device):
            groups = torch.stack(
                [best_of(costs[r], weights, [g[r] for g in starts], rounds) for r in range(rows)]
            )
        self.mask_costs: Tensor = torch.stack(
            [costs[r][:, groups[r]].sum(-1) for r in range(rows)]
        )  # (rows, masks, W)
        tokens = groups.reshape(rows, -1, 1) * unit + torch.arange(unit)
        self._indices = tokens.reshape(rows, -1).to(self.device)

    @property
    def rows(self) -> int:
        """Permutations given: one per batch row, or one shared by every row."""
        return self._indices.shape[0]

    @property
    def imbalance(self) -> float:
        """Max rank cost / mean of the weighted step ``sum_m w_m cost_m(r)``."""
        return _ratios(self.mask_costs.sum(0), self.weights).step

    @property
    def synced_imbalance(self) -> float:
        """``sum_m w_m max_r cost_m(r)`` over ``sum_m w_m mean_r cost_m(r)``: the step when
        each layer waits for its slowest rank; at least ``imbalance``."""
        return _ratios(self.mask_costs.sum(0), self.weights).synced

    @property
    def mask_imbalance(self) -> tuple[float, ...]:
        """Max rank cost / mean of each mask, in the order of ``layers``."""
        return _ratios(self.mask_costs.sum(0), self.weights).masks

    @property
    def key(self) -> tuple:
        return (
            "layer_weighted",
            tuple(m.key for m in self.masks),
            self.weights,
            self.B,
            self.H,
            self.seq_length,
            self.world_size,
            self.block_size,
            self.partial_cost,
        )

    def _generate_indices(self, restore: bool = False) -> Tensor:
        return _restore(self._indices, restore)


class LayerImbalance(NamedTuple):
    """A step's balance: ``step`` (max / mean rank cost of ``sum_m w_m cost_m(r)``),
    ``synced`` (``sum_m w_m max_r cost_m(r)`` over ``sum_m w_m mean_r cost_m(r)``: each
    layer waiting for its slowest rank), ``masks`` (each mask's max / mean) and
    ``rank_costs`` ((masks, W) cost of each rank under each mask, unweighted)."""

    step: float
    synced: float
    masks: tuple[float, ...]
    rank_costs: Tensor


def _ratios(rank_costs: Tensor, weights: Sequence[float]) -> LayerImbalance:
    """``LayerImbalance`` of (masks, W) per-rank costs."""
    costs = rank_costs.to(torch.float64)
    w = torch.tensor(weights, dtype=torch.float64).view(-1, 1)
    means = costs.mean(1)
    step = (w * costs).sum(0)
    mean = float(step.mean())
    return LayerImbalance(
        step=float(step.max()) / mean if mean else 1.0,
        synced=float((w[:, 0] * costs.max(1).values).sum()) / mean if mean else 1.0,
        masks=tuple(float(c.max() / m) if m else 1.0 for c, m in zip(costs, means, strict=True)),
        rank_costs=costs,
    )


def layer_imbalance(
    layers: Sequence[tuple[Mask, float]],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    world_size: int,
    balancer: str | _LoadBalancer | None,
    BLOCK_SIZE: int = 128,
    partial_cost: float = 1.0,
) -> LayerImbalance:
    """How evenly ``balancer`` spreads a step of several weighted masks, from every rank's
    shard of every mask (full blocks + ``partial_cost`` x partial blocks, summed over rows
    and heads), as ``LayerWeightedBalancer`` costs it.

    ``balancer`` is one permutation for every mask: ``None``, ``"head_tail"`` or any
    ``_LoadBalancer`` instance (a single-mask ``MaskAwareBalancer`` or ``PTRRBalancer``
    included); the names ``"mask_aware"`` and ``"ptrr"`` would make one per mask and are
    refused.

    Example:
        >>> import flexmask
        >>> from flexmask.context_parallel import layer_imbalance
        >>> g = flexmask.causal()
        >>> r = layer_imbalance([(g, 1), (g & flexmask.sliding_window(256), 3)], 1, 1,
        ...                     2048, 2, "head_tail")
        >>> [round(x, 3) for x in r.masks], round(r.step, 3)  # head-tail leaves the window
        ([1.0, 1.067], 1.033)
    """
    masks, weights = check_layers(layers)
    if isinstance(balancer, str) and balancer != "head_tail":
        raise ValueError(
            f"balancer={balancer!r} makes a permutation per mask, but a step shares one: pass "
            "None, 'head_tail', or a balancer instance (e.g. LayerWeightedBalancer(layers, ...) "
            "or MaskAwareBalancer(one_mask, ...))"
        )
    world_size = check_int(world_size, "world_size", minimum=1)
    partial_cost = _check_cost(partial_cost)
    costs = torch.stack(
        [
            shard_costs(mask, B, H, Q_LEN, world_size, balancer, BLOCK_SIZE, partial_cost)
            for mask in masks
        ]
    )
    return _ratios(costs, weights)
