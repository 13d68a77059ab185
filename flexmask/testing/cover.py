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
   reaches ("above" it) — they keep apart branches of a tree, siblings of a prefix, windows;
4. inside every component at once, single sources and everything below them: the cuts that
   keep an output from a later input.

3 and 4 are packed greedily, first fit, a source joining a pass only if it takes away no
pair the pass was chosen for, and every pass tests at least one pair no earlier pass did:
the plan ends when every forbidden pair is tested. One causal document of ``n`` tokens
needs ``n - 1`` passes of kind 4 (a pass tests ``(t, t + 1)`` only if its latest source is
``t``), run for all documents at once; a tree adds one pass per branch under a fork.
"""

from __future__ import annotations

import math

import numpy as np
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
    reach = relation[row][mine][:, seen].numpy()
    # Sources that reach the same targets are one class: they need the same passes.
    classes, members = np.unique(reach, axis=0, return_inverse=True)
    members = members.reshape(-1)
    reaches = [_bits(r) for r in classes]
    full = (1 << seen.numel()) - 1
    need = [full & ~r for r in reaches]
    # Kind 3: a class with everything that reaches at least what it reaches.
    contains = (classes.astype(np.float32) @ (~classes).astype(np.float32).T) == 0
    above = [_union(reaches, np.flatnonzero(contains[k]).tolist()) for k in range(len(reaches))]
    chosen = _greedy(reaches, need, _units(above))
    # Kind 4: single classes (and, free, all below them).
    chosen += _greedy(reaches, need, [(r, k) for k, r in enumerate(reaches)])
    result = []
    for reached in chosen:
        picked = [k for k, r in enumerate(reaches) if r & ~reached == 0]
        mask = torch.zeros_like(sources)
        hit = torch.from_numpy(np.isin(members, picked))
        mask[row, mine[hit]] = True
        result.append(mask)
    return result


def _units(above: list[int]) -> list[tuple[int, int]]:
    """``(targets reached, owner)`` per distinct kind-3 set, owned by its first class."""
    first: dict[int, int] = {}
    for k, reached in enumerate(above):
        first.setdefault(reached, k)
    return [(reached, k) for reached, k in first.items()]


def _greedy(reaches: list[int], need: list[int], units: list[tuple[int, int]]) -> list[int]:
    """Packs units (targets reached, owner class) into passes, first fit: returns each
    pass's reached targets and marks the pairs it tests as done in ``need``."""
    chosen: list[int] = []
    while True:
        gains = [(need[owner] & ~reached).bit_count() for reached, owner in units]
        order = sorted((i for i, g in enumerate(gains) if g), key=lambda i: (-gains[i], i))
        if not order:
            return chosen
        reached, owner = units[order[0]]
        wanted = need[owner] & ~reached  # the pairs this pass is for: none may be lost
        for i in order[1:]:
            more, other = units[i]
            gain = need[other] & ~(reached | more)
            if gain and not more & wanted & ~reached:
                reached |= more
                wanted = (wanted | gain) & ~reached
        for k, r in enumerate(reaches):
            if r & ~reached == 0:  # below the pass: tested against all it does not reach
                need[k] &= reached
        chosen.append(reached)


def _bits(row: np.ndarray) -> int:
    return int.from_bytes(np.packbits(row, bitorder="little").tobytes(), "little")


def _union(reaches: list[int], picked: list[int]) -> int:
    total = 0
    for k in picked:
        total |= reaches[k]
    return total
