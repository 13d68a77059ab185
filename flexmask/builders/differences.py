"""``diff``: where two BlockMasks — or a BlockMask and the Mask it should mean — part, the
first block named with both classifications and the path that built each.

What "differ" means. One side of a BlockMask (the kv side, which flex_attention's forward
reads; the q side, which its backward reads for dK and dV) attends the pair ``(q, kv)`` of
row ``b`` and head ``h`` iff it lists the pair's block full, or partial and its mask_mod is
true there; pairs past ``Q_LEN`` or ``KV_LEN`` are no pairs. Two BlockMasks, side by side:

* attend **other pairs** in a block where one side attends a pair the other does not;
* list a block **otherwise, with the same pairs** where its classifications differ but its
  pairs agree — a partial block whose mask_mod is true on every pair, listed full by the
  other; one false on every pair, left empty by the other: the same attention at another
  cost.

A mask_mod is evaluated only where it decides (cost ∝ partial blocks): on the blocks one
side lists partial and the other does not, and — unless both mask_mods are one function or
were both built from one Mask — on the blocks both list partial. The codes read are each
side's whole ``(B, H, num_q_blocks, num_kv_blocks)``, through ``blocks.read``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask, MaskMod, vmap_broadcast
from flexmask.blocks import EMPTY, FULL, PARTIAL, kv_codes, q_codes
from flexmask.builders.create import routed_build
from flexmask.builders.provenance import built_from, built_route
from flexmask.builders.sides import Route

CLASSES = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}
"""A block code's name in a report."""

EVALUATE_CHUNK_ELEMENTS = 1 << 20
"""Pairs evaluated at a time (each chunk holds a few bool tensors of this size)."""


@dataclass(frozen=True)
class BlockDifference:
    """The first block where two BlockMasks part (``flexmask.diff``); ``print`` it.

    Blocks are ordered kv side first (the forward), then the q side, each by (batch row,
    head, q block, kv block); the first block attending other pairs is named if there is
    one, else the first listed otherwise with the same pairs.
    """

    side: str
    """``"kv"`` (what the forward reads) or ``"q"`` (what the backward reads for dK, dV)."""
    batch: int
    head: int
    q_block: int
    kv_block: int
    a: str
    """The block's classification in ``a``: ``"empty"``, ``"partial"`` or ``"full"``."""
    b: str
    same_pairs: bool
    """True: the block attends the same pairs in both, listed otherwise (and so does every
    block: no block attends other pairs)."""
    pair: tuple[int, int] | None
    """The block's first ``(q_idx, kv_idx)`` attended by one side only (row-major); None
    where the pairs agree."""
    attended_by: str | None
    """Which one attends ``pair``: ``"a"`` or ``"b"``."""
    a_built_by: str
    """The path that built ``a``, where flexmask built it (``explain_build``'s words)."""
    b_built_by: str
    other_pairs: int
    """Blocks, both sides counted, that attend other pairs."""
    other_listing: int
    """Blocks, both sides counted, listed otherwise with the same pairs."""

    def __str__(self) -> str:
        where = (
            f"{self.side} side, batch row {self.batch}, head {self.head}, q block "
            f"{self.q_block}, kv block {self.kv_block}: a lists it {self.a}, b {self.b}"
        )
        if self.same_pairs:
            lines = [
                f"same pairs, other listing: {self.other_listing} block(s) listed otherwise",
                f"first: {where}",
            ]
        else:
            q, kv = self.pair or (0, 0)
            lines = [
                f"other pairs: {self.other_pairs} block(s) attend other pairs, "
                f"{self.other_listing} more listed otherwise with the same pairs",
                f"first: {where}; (q {q}, kv {kv}) is attended by {self.attended_by} only",
            ]
        lines += [f"a: {self.a_built_by}", f"b: {self.b_built_by}"]
        return "\n".join(lines)


class _Found(NamedTuple):
    """One side's comparison: its first block of other pairs and of other listing (each
    ``(b, h, q block, kv block, code in a, code in b, pair, attended_by)``), and counts."""

    first_other: tuple | None
    first_listing: tuple | None
    other: int
    listing: int


def diff(
    a: BlockMask | Mask,
    b: BlockMask | Mask,
    *,
    q_offset: int | Sequence[int] | Tensor = 0,
    kv_offset: int | Sequence[int] | Tensor = 0,
) -> BlockDifference | None:
    """The first block where ``a`` and ``b`` part, or None where they list the same blocks
    and attend the same pairs (both sides; ``a is b`` at once).

    Args:
        a, b: two torch BlockMasks of the same lengths and block sizes (their B and H equal,
            or one 1, which flex_attention broadcasts); or one BlockMask and a flexmask Mask,
            the reference: it is built (``create_block_mask``) for the BlockMask's B, H,
            lengths, block sizes and device.
        q_offset, kv_offset: the window of the Mask the BlockMask holds, as
            ``create_block_mask`` takes them (a Mask reference only).

    Returns:
        None, or a :class:`BlockDifference`: its ``same_pairs`` says whether the BlockMasks
        attend the same pairs listed otherwise (a partial block against a full one whose
        mask_mod is true throughout) or other pairs (``pair``: the first one attended by one
        only). The q sides are compared where both have one (``from_kv_blocks(...,
        compute_q_blocks=False)`` has none).

    Example:
        >>> import flexmask, torch
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> mask = flexmask.causal() & flexmask.document([300, 200])
        >>> theirs = create_block_mask(mask.mask_mod, 1, 1, 500, 500, device="cpu")
        >>> print(flexmask.diff(theirs, mask))
        None
    """
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, (BlockMask, Mask)):
            raise TypeError(
                f"{name} must be a torch BlockMask or a flexmask Mask (the reference, built "
                f"for the other's shape), got {type(value).__name__}"
            )
    if isinstance(a, Mask) and isinstance(b, Mask):
        raise TypeError(
            "a and b are both flexmask Masks: diff compares BlockMasks; build one "
            "(flexmask.create_block_mask(a, B, H, Q_LEN, KV_LEN)) and pass it with the other "
            "Mask, or compare the Masks' structure with a == b"
        )
    windowed = not (_zero(q_offset) and _zero(kv_offset))
    if windowed and isinstance(a, BlockMask) and isinstance(b, BlockMask):
        raise TypeError(
            "q_offset/kv_offset place a Mask reference on the BlockMask's window; a and b "
            "are both BlockMasks"
        )
    if a is b:
        return None
    a_mask, a_by = _resolved(a, b, q_offset, kv_offset)
    b_mask, b_by = _resolved(b, a, q_offset, kv_offset)
    _check_alike(a_mask, b_mask)
    same_mod = _same_meaning(a_mask, b_mask)
    found = []
    sides = (("kv", kv_codes), ("q", q_codes))
    for side, read in sides:
        codes_a, codes_b = read(a_mask), read(b_mask)
        if codes_a is None or codes_b is None:
            continue
        codes_a, codes_b = _broadcast(codes_a, codes_b)
        found.append((side, _compare(codes_a, codes_b, a_mask, b_mask, same_mod)))
    other = sum(f.other for _, f in found)
    listing = sum(f.listing for _, f in found)
    for attr in ("first_other", "first_listing"):
        for side, side_found in found:
            first = getattr(side_found, attr)
            if first is not None:
                batch, head, q_block, kv_block, code_a, code_b, pair, by = first
                return BlockDifference(
                    side,
                    batch,
                    head,
                    q_block,
                    kv_block,
                    CLASSES[code_a],
                    CLASSES[code_b],
                    attr == "first_listing",
                    pair,
                    by,
                    a_by,
                    b_by,
                    other,
                    listing,
                )
    return None


def _zero(offset: Any) -> bool:
    return isinstance(offset, int) and not isinstance(offset, bool) and offset == 0


def _resolved(
    value: BlockMask | Mask, other: BlockMask | Mask, q_offset: Any, kv_offset: Any
) -> tuple[BlockMask, str]:
    """``value`` as a BlockMask — a Mask built for ``other``'s shape — and the words for
    what built it."""
    if isinstance(value, BlockMask):
        return value, _built_by(value)
    assert isinstance(other, BlockMask)  # diff refused two Masks
    q_len, kv_len = other.seq_lengths
    batch, heads = other.kv_num_blocks.shape[:2]
    built = routed_build(
        value,
        batch,
        heads,
        q_len,
        kv_len,
        other.kv_num_blocks.device,
        tuple(int(size) for size in other.BLOCK_SIZE),
        q_offset,
        kv_offset,
        {},
        caller="diff",
    )
    return built.block_mask, f"the Mask, built by flexmask: {_path(built.route)}"


def _built_by(block_mask: BlockMask) -> str:
    routed = built_route(block_mask)
    if routed is None:
        return "no flexmask build on record (torch's build, from_kv_blocks, a window or a copy)"
    route, intact = routed
    return f"built by flexmask: {_path(route)}" + ("" if intact else ", then edited")


def _path(route: Route) -> str:
    if not route.parts:
        return route.path
    return f"{route.path} ({', '.join(_path(part) for part in route.parts)})"


def _check_alike(a: BlockMask, b: BlockMask) -> None:
    if tuple(a.seq_lengths) != tuple(b.seq_lengths):
        raise ValueError(
            f"a and b must have the same (Q_LEN, KV_LEN) to compare pairs, got "
            f"{tuple(a.seq_lengths)} and {tuple(b.seq_lengths)}"
        )
    if tuple(a.BLOCK_SIZE) != tuple(b.BLOCK_SIZE):
        raise ValueError(
            f"a and b must have the same BLOCK_SIZE to compare block by block, got "
            f"{tuple(a.BLOCK_SIZE)} and {tuple(b.BLOCK_SIZE)}: build both with one block size"
        )
    if a.kv_num_blocks.device != b.kv_num_blocks.device:
        raise ValueError(
            f"a and b must be on one device, got {a.kv_num_blocks.device} and "
            f"{b.kv_num_blocks.device}: move one with BlockMask.to(device)"
        )


def _same_meaning(a: BlockMask, b: BlockMask) -> bool:
    """True when the mask_mods are known equal without evaluating them: one function, or
    both the recorded mask_mods of builds of equal Masks (a mask_mod is the Mask's at any
    shape; ``built_from`` is None for windows)."""
    if a.mask_mod is b.mask_mod:
        return True
    mask_a, mask_b = built_from(a), built_from(b)
    return mask_a is not None and mask_b is not None and mask_a == mask_b


def _broadcast(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Both codes on one ``(B, H, ...)``: a B (H) of 1 broadcasts, as in flex_attention."""
    shape = []
    for dim, name in ((0, "B"), (1, "H")):
        size_a, size_b = a.shape[dim], b.shape[dim]
        if size_a != size_b and 1 not in (size_a, size_b):
            raise ValueError(
                f"a has {name}={size_a} and b {name}={size_b}: BlockMasks compare where their "
                f"{name} are equal or one is 1 (broadcast, as flex_attention broadcasts it)"
            )
        shape.append(max(size_a, size_b))
    full = (*shape, *a.shape[2:])
    return a.expand(full), b.expand(full)


def _compare(
    codes_a: Tensor, codes_b: Tensor, a: BlockMask, b: BlockMask, same_mod: bool
) -> _Found:
    """One side of both BlockMasks compared block by block, laid out ``(B, H, nq, nkv)``."""
    differ = codes_a != codes_b
    either_partial = (codes_a == PARTIAL) | (codes_b == PARTIAL)
    # Empty against full: other pairs, no evaluation needed (every block holds a pair).
    outright = differ & ~either_partial
    decides = differ & either_partial
    if not same_mod:
        decides |= (codes_a == PARTIAL) & (codes_b == PARTIAL)
    firsts: list[tuple] = []  # the first outright, the first evaluated: the lower is first
    other = int(outright.sum())
    if other:
        tile = tuple(int(i) for i in outright.nonzero()[0])
        firsts.append(_outright(tile, codes_a, codes_b, a))
    first_evaluated = None
    listing = int(differ.sum()) - other
    first_listing = None
    tiles = decides.nonzero()
    q_block, kv_block = (int(size) for size in a.BLOCK_SIZE)
    per_chunk = max(1, EVALUATE_CHUNK_ELEMENTS // (q_block * kv_block))
    for chunk in torch.split(tiles, per_chunk):
        index = tuple(chunk.unbind(1))
        chunk_a, chunk_b = codes_a[index], codes_b[index]
        pairs_a = _pairs(chunk, chunk_a, a.mask_mod, a)
        pairs_b = _pairs(chunk, chunk_b, b.mask_mod, a)
        apart = pairs_a != pairs_b
        others = apart.flatten(1).any(1)
        other += int(others.sum())
        listed_apart = chunk_a != chunk_b
        listing -= int((others & listed_apart).sum())
        if first_evaluated is None and bool(others.any()):  # tiles come in order
            k = int(others.nonzero()[0])
            element = int(apart[k].flatten().nonzero()[0])
            q, kv = divmod(element, kv_block)
            tile = tuple(int(i) for i in chunk[k])
            pair = (tile[2] * q_block + q, tile[3] * kv_block + kv)
            by = "a" if bool(pairs_a[k, q, kv]) else "b"
            first_evaluated = (*tile, int(chunk_a[k]), int(chunk_b[k]), pair, by)
            firsts.append(first_evaluated)
        if first_listing is None and bool((listed_apart & ~others).any()):
            k = int((listed_apart & ~others).nonzero()[0])
            tile = tuple(int(i) for i in chunk[k])
            first_listing = (*tile, int(chunk_a[k]), int(chunk_b[k]), None, None)
    first_other = min(firsts, key=lambda found: found[:4]) if firsts else None
    return _Found(first_other, first_listing, other, listing)


def _outright(tile: tuple, codes_a: Tensor, codes_b: Tensor, a: BlockMask) -> tuple:
    """An empty block against a full one: its first pair, attended by the full one."""
    code_a, code_b = int(codes_a[tile]), int(codes_b[tile])
    q_block, kv_block = (int(size) for size in a.BLOCK_SIZE)
    pair = (tile[2] * q_block, tile[3] * kv_block)
    return (*tile, code_a, code_b, pair, "a" if code_a == FULL else "b")


def _pairs(tiles: Tensor, codes: Tensor, mask_mod: MaskMod, geometry: BlockMask) -> Tensor:
    """``(k, q_block, kv_block)``: the pairs of k tiles one side attends — every in-range
    pair of a full tile, none of an empty one, the mask_mod's where partial (evaluated on
    those tiles only, as flex_attention calls it: by ``vmap``)."""
    q_len, kv_len = geometry.seq_lengths
    q_block, kv_block = (int(size) for size in geometry.BLOCK_SIZE)
    device = tiles.device
    q_idx = tiles[:, 2].view(-1, 1, 1) * q_block + torch.arange(q_block, device=device).view(
        1, -1, 1
    )
    kv_idx = tiles[:, 3].view(-1, 1, 1) * kv_block + torch.arange(kv_block, device=device).view(
        1, 1, -1
    )
    in_range = (q_idx < q_len) & (kv_idx < kv_len)
    out = in_range & (codes == FULL).view(-1, 1, 1)
    partial = (codes == PARTIAL).nonzero().squeeze(1)
    if partial.numel():
        shape = (partial.numel(), q_block, kv_block)
        # Past an end the indices are clamped (lookups are sized to the sequence) and the
        # pairs there dropped by in_range.
        attends = vmap_broadcast(
            mask_mod,
            (
                tiles[partial, 0].view(-1, 1, 1),
                tiles[partial, 1].view(-1, 1, 1),
                q_idx[partial].clamp(max=max(q_len - 1, 0)),
                kv_idx[partial].clamp(max=max(kv_len - 1, 0)),
            ),
            shape,
        )
        out[partial] = attends.to(torch.bool) & in_range[partial]
    return out
