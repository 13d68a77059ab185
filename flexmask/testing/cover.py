"""The leak test's plan: sets of sources (outputs read, or inputs moved) whose passes, taken
together, test every forbidden (source, target) pair — deterministically, for any mask.

A pass with source set ``O`` tests the pairs ``O x (targets none of O may reach)``: its
influence on such a target must be exactly 0. The plan covers every pair the relation
forbids, with four kinds of pass:

1. every source at once (sources that reach nothing — moved padding — alone);
2. per bit of the component number (components: tokens the mask links, rows apart), the
   components with that bit set, then clear: ``2 * ceil(log2 components)`` passes cover every
   pair across components, rows and padding included;
3. inside every component at once, for each source ``a`` the sources that reach all ``a``
   reaches ("above" it): a tree's branch with its prompt, read against its siblings;
4. inside every component at once, each source with the sources that reach no more than
   it ("below" it): the cuts that keep an output from a later input, a window's tokens, and
   (inputs moved) a whole branch from its first token.

3 and 4 are packed greedily: a pass starts from the unit that tests the most pairs not yet
tested and takes, first fit, every unit that gains a pair and takes away none the pass was
chosen for — so every pass tests at least one new pair, and the plan ends when every
forbidden pair is tested. One causal document of ``n`` tokens needs ``n - 1`` passes of kind
4 (a pass tests ``(t, t + 1)`` only if its latest source is ``t``), run for all documents at
once; a tree adds one pass per branch under a fork, its branches' cuts side by side.
"""

from __future__ import annotations

import heapq
import math

import torch
from torch import Tensor


def plan(relation: Tensor, sources: Tensor, targets: Tensor, component: Tensor) -> list[Tensor]:
    """Source sets whose passes test every forbidden pair.

    Args:
        relation: ``(B, S, S)`` bool, ``[b, s, t]``: source ``s`` may reach target ``t``.
        sources: ``(B, S)`` bool, the tokens a pass may pick as sources.
        targets: ``(B, S)`` bool, the tokens whose influence is read.
        component: ``(B, S)`` int64, the component of every token (-1: none).

    Returns:
        ``(B, S)`` bool source sets. For every source ``s`` and target ``t`` (any rows) with
        ``relation`` not letting ``s`` reach ``t``, some set holds ``s`` and no source that
        may reach ``t``.
    """
    batch, seq_len = sources.shape
    passes: list[Tensor] = []
    if bool(sources.any()):
        passes.append(sources & relation.any(-1))
    lonely = sources & ~relation.any(-1)  # moved padding: may reach no target at all
    if bool(lonely.any()):
        passes.append(lonely)
    count = int(component.max()) + 1 if component.numel() else 0
    owned = sources & (component >= 0)
    for bit in range(math.ceil(math.log2(count)) if count > 1 else 0):
        for value in (0, 1):
            passes.append(owned & (((component >> bit) & 1) == value))
    inside = [_inside(relation, sources, targets, component == number) for number in range(count)]
    for step in range(max((len(sets) for sets in inside), default=0)):
        chosen = torch.zeros(batch, seq_len, dtype=torch.bool)
        for sets in inside:
            if step < len(sets):
                chosen |= sets[step]
        passes.append(chosen)
    return [p for p in passes if bool(p.any())]


def _inside(relation: Tensor, sources: Tensor, targets: Tensor, where: Tensor) -> list[Tensor]:
    """Kinds 3 and 4 inside one component: its source sets, as ``(B, S)`` masks."""
    rows, tokens = where.nonzero(as_tuple=True)
    row = int(rows[0])  # a component lies in one row
    mine = tokens[sources[row, tokens]]
    seen = tokens[targets[row, tokens]]
    if mine.numel() == 0 or seen.numel() == 0:
        return []
    reach = relation[row][mine][:, seen]
    # Sources that reach the same targets are one class: they need the same passes. (torch,
    # not numpy: numpy is no dependency of flexmask.)
    classes, members = torch.unique(reach, dim=0, return_inverse=True)
    members = members.reshape(-1)
    reaches = [_bits(r) for r in classes]
    need = [((1 << seen.numel()) - 1) & ~r for r in reaches]
    # The units a pass is made of, each with its owner class: a class with every class
    # that reaches at least what it reaches (kind 3), and a class alone (kind 4).
    as_float = classes.to(torch.float32)
    within = (as_float @ (~classes).to(torch.float32).T) == 0  # [k, j]: k reaches <= j
    above = (within.to(torch.float32) @ as_float) > 0
    units: dict[int, int] = {}
    for k in range(len(reaches)):
        units.setdefault(_bits(above[k]), k)
    for k, reached in enumerate(reaches):
        units.setdefault(reached, k)
    unit_rows = torch.stack([_row(reached, seen.numel()) for reached in units])
    below = (as_float @ (~unit_rows).to(torch.float32).T) == 0  # [k, u]: k within u
    chosen = _greedy(
        reaches,
        need,
        [
            (reached, owner, below[:, u].nonzero().flatten().tolist())
            for u, (reached, owner) in enumerate(units.items())
        ],
    )
    result = []
    for reached in chosen:
        picked = [k for k, r in enumerate(reaches) if r & ~reached == 0]
        mask = torch.zeros_like(sources)
        hit = torch.isin(members, torch.tensor(picked, dtype=members.dtype))
        mask[row, mine[hit]] = True
        result.append(mask)
    return result


def _greedy(
    reaches: list[int], need: list[int], units: list[tuple[int, int, list[int]]]
) -> list[int]:
    """Packs units ``(targets reached, owner class, classes within)`` into passes and
    returns each pass's reached targets, marking the pairs it tests as done in ``need``.

    A pass starts from the unit that tests the most pairs not yet tested (lazily: a unit
    only ever loses pairs) — a tree's branch whole before its cuts, so siblings run side by
    side — and takes, first fit, every unit whose owner gains a pair and which reaches no
    target the pass's owners need: no pair it was chosen for is lost, and each pass tests at
    least one new pair."""

    def tests(u: int) -> int:
        reached, _, within = units[u]
        return sum((need[k] & ~reached).bit_count() for k in within)

    heap = [(-tests(u), u) for u in range(len(units))]
    heapq.heapify(heap)
    chosen: list[int] = []
    while heap:
        _, u = heapq.heappop(heap)
        fresh = tests(u)
        if not fresh:
            continue  # a unit never gains pairs again
        if heap and fresh < -heap[0][0]:
            heapq.heappush(heap, (-fresh, u))
            continue
        reached, owner, within = units[u]
        wanted = 0
        for k in within:
            wanted |= need[k]
        wanted &= ~reached
        for _, v in sorted(heap):
            more, other, _ = units[v]
            gain = need[other] & ~(reached | more)
            if gain and not more & wanted:
                reached |= more
                wanted = (wanted | gain) & ~reached
        for k, r in enumerate(reaches):
            if r & ~reached == 0:  # within the pass: tested against all it does not reach
                need[k] &= reached
        chosen.append(reached)
        heapq.heappush(heap, (-fresh, u))  # it may test more later: recounted when popped
    return chosen


def _bits(row: Tensor) -> int:
    """A bool row as an int, bit i for entry i."""
    return sum(1 << i for i in row.nonzero().flatten().tolist())


def _row(bits: int, width: int) -> Tensor:
    """``_bits``'s inverse."""
    return torch.tensor([(bits >> i) & 1 for i in range(width)], dtype=torch.bool)
