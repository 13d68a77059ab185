"""``explain_build``: which builder wrote a BlockMask and why, read from the build itself.

The report comes from the route the dispatch (``sides``) records as it dispatches, on the one
build ``create_block_mask`` would run, so it cannot disagree with what a build does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask.algebra import Mask, MaskMod
from flexmask.blocks import listed_counts
from flexmask.builders.create import routed_build
from flexmask.builders.density import BlockStats, block_stats
from flexmask.builders.sides import Route


@dataclass(frozen=True)
class BuildReport:
    """What a build did: its path and why (``route``), and what it listed.

    ``route.path`` is one of ``"closed form"``, ``"unions"``, ``"per head"`` (its
    ``route.parts``: each distinct head mask's own route), ``"tree columns"``, ``"tiles"``
    (``route.tiles`` classified from structure, ``route.refined`` of them refined), ``"rows"``
    (per-row offsets off the closed form: ``route.parts``, one per row), ``"no tiles"`` (a
    zero length) or ``"torch"`` (torch's own ``create_block_mask``).
    """

    route: Route
    """The path the build took, why, and its counts."""
    batch: int
    """B and H of the BlockMask written (torch's layout: a mask that does not depend on the
    row is built once and copied to every row)."""
    heads: int
    q_blocks: int
    kv_blocks: int
    block_size: tuple[int, int]
    partial: int
    """Blocks the kv side lists partial (the kernel evaluates the mask_mod there), over every
    row and head."""
    full: int
    """Blocks the kv side lists full (no mask_mod call)."""
    stats: BlockStats
    """The mask's exact density and its shares of non-empty and partial blocks at this block
    shape (:func:`~flexmask.builders.block_stats`): what kernels choose on."""

    @property
    def path(self) -> str:
        return self.route.path

    @property
    def why(self) -> str:
        return self.route.why

    def __str__(self) -> str:
        tiles = self.batch * self.heads * self.q_blocks * self.kv_blocks
        lines = [
            *_route_lines(self.route, ""),
            f"listed: {self.partial} partial and {self.full} full of {tiles} blocks "
            f"(B={self.batch}, H={self.heads}, {self.q_blocks} x {self.kv_blocks} blocks of "
            f"{self.block_size[0]} x {self.block_size[1]})",
            str(self.stats),
        ]
        return "\n".join(lines)


def _route_lines(route: Route, indent: str) -> list[str]:
    head = f"{indent}{route.path}"
    if route.path == "tiles":
        head += f": {route.tiles} tiles classified, {route.refined} refined"
    lines = [head, f"{indent}  why: {route.why}"]
    label = "row" if route.path == "rows" else "head mask"
    for number, part in enumerate(route.parts):
        lines.append(f"{indent}  {label} {number}:")
        lines.extend(_route_lines(part, indent + "    "))
    return lines


def explain_build(
    mask: Mask | MaskMod,
    B: int | None = None,
    H: int | None = None,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    *,
    q_offset: int | Sequence[int] | Tensor = 0,
    kv_offset: int | Sequence[int] | Tensor = 0,
    **flags: Any,
) -> BuildReport:
    """Which builder :func:`flexmask.create_block_mask` runs for these arguments, why, and
    what it lists.

    Takes exactly what ``create_block_mask`` takes, in torch's order, and runs that build
    once (the counts — tiles refined, blocks listed — are the build's own; a closed form
    costs what its build costs, a plain mask_mod torch's dense build). The path is the one
    the build recorded as it dispatched, not a second reading of the mask.

    Returns:
        A :class:`BuildReport` (``print`` it): ``report.path`` — ``"closed form"`` (an ``&``
        of interval pieces), ``"unions"`` (an ``|`` of two such), ``"per head"``, ``"tree
        columns"`` (a tree in preorder), ``"tiles"`` (tile classification, with the tiles
        classified and refined), ``"rows"`` (per-row offsets off the closed form), ``"no
        tiles"`` or ``"torch"`` (a plain mask_mod) — and ``report.why``.

    Example:
        >>> import flexmask
        >>> report = flexmask.explain_build(
        ...     flexmask.causal() & flexmask.document([300, 200]), 1, 1, 512, device="cpu")
        >>> report.path, report.partial, report.full
        ('closed form', 7, 1)
        >>> report = flexmask.explain_build(
        ...     flexmask.causal() & ~flexmask.sliding_window(64), 1, 1, 512, device="cpu")
        >>> report.path, report.route.tiles, report.route.refined
        ('tiles', 16, 4)
    """
    built, route = routed_build(
        mask,
        B,
        H,
        Q_LEN,
        KV_LEN,
        device,
        BLOCK_SIZE,
        q_offset,
        kv_offset,
        flags,
        caller="explain_build",
    )
    batch, heads = built.kv_num_blocks.shape[:2]
    partial, full = listed_counts(built)
    q_block, kv_block = (int(size) for size in built.BLOCK_SIZE)
    q_len, kv_len = built.seq_lengths
    return BuildReport(
        route,
        batch,
        heads,
        -(-q_len // q_block),
        -(-kv_len // kv_block),
        (q_block, kv_block),
        partial,
        full,
        block_stats(built),
    )
