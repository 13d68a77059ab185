"""Two masks compared exactly, tile by tile: where does what a kernel attends differ from the
mask the batch means?

Each side is a table of tile codes (EMPTY / PARTIAL / FULL, as a BlockMask lists them) and an
element rule for its PARTIAL tiles (a mask_mod). Tiles both sides call EMPTY, or both FULL,
agree without a look inside; every other tile is evaluated element by element on both sides,
in chunks, and the first differing ``(row, q, kv)`` on a query row that matters is kept. So a
flexmask mask against its own BlockMask costs its partial tiles (the diagonal and the document
edges), never ``S × S``; a side with no codes (a foreign format read element by element) costs
``S × S`` and stops at the first query tile that differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.blocks import kv_codes, q_codes
from flexmask.builders import create_block_mask

EMPTY, PARTIAL, FULL = 0, 1, 2  # the codes flexmask.blocks.kv_codes reads
ElementRule = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``(b, h, q_idx, kv_idx) -> bool``, broadcasting, like a mask_mod."""

_PAIRS_PER_CHUNK = 1 << 21  # element pairs evaluated at once: a few MB of temporaries


class Side(NamedTuple):
    """One side of a comparison: tile codes ``(B or 1, H or 1, q_tiles, kv_tiles)`` (None:
    every tile is read element by element) and the rule inside PARTIAL tiles."""

    codes: Tensor | None
    rule: ElementRule
    block: tuple[int, int]
    heads: int


class Difference(NamedTuple):
    """The first query ``(row, q)`` (then the first ``kv``, then ``head``) where two sides
    differ, and what each side says there."""

    row: int
    q: int
    kv: int
    head: int
    expected: bool
    got: bool


def mask_side(mask: Mask, batch: int, seq_len: int, block: tuple[int, int], device) -> Side:
    """A flexmask mask: its tile codes from a build from structure (flexmask's cache), its
    own evaluator inside partial tiles."""
    built = create_block_mask(mask, batch, 1, seq_len, seq_len, device=device, BLOCK_SIZE=block)
    rule = mask.lower_at(seq_len, torch.device(device)).evaluate
    return Side(kv_codes(built), rule, block, 1)


def block_mask_side(block_mask: BlockMask) -> Side:
    """A BlockMask as a kernel reads it: listed FULL tiles attended whole, listed partial
    tiles through its mask_mod, unlisted tiles not at all."""
    codes = kv_codes(block_mask, checked=True)
    block = (int(block_mask.BLOCK_SIZE[0]), int(block_mask.BLOCK_SIZE[1]))
    return Side(codes, _broadcasting(block_mask.mask_mod), block, codes.shape[1])


def block_mask_q_side(block_mask: BlockMask) -> Side | None:
    """A BlockMask's q side as torch's backward reads it for dK and dV: the tiles its q lists
    name, partial ones through the same mask_mod; None where it has no q side."""
    codes = q_codes(block_mask, checked=True)
    if codes is None:
        return None
    block = (int(block_mask.BLOCK_SIZE[0]), int(block_mask.BLOCK_SIZE[1]))
    return Side(codes, _broadcasting(block_mask.mask_mod), block, codes.shape[1])


def rule_side(rule: ElementRule, block: tuple[int, int] = (128, 128)) -> Side:
    """A mask known only element by element (a foreign format's rule)."""
    return Side(None, rule, block, 1)


def _broadcasting(mask_mod: ElementRule) -> ElementRule:
    """A mask_mod called on broadcasting index tensors, or, where it only takes scalars (an
    ``if`` on a tensor), through torch.vmap over every element as torch's create_mask does."""

    def rule(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        shape = torch.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape)
        try:
            out = mask_mod(b, h, q, kv)
            return torch.as_tensor(out, dtype=torch.bool).expand(shape)
        except Exception:  # noqa: BLE001 - a scalar-only mask_mod: evaluated under vmap
            flat = [x.expand(shape).reshape(-1) for x in (b, h, q, kv)]
            return torch.vmap(mask_mod)(*flat).to(torch.bool).view(shape)

    return rule


def first_difference(
    expected: Side,
    got: Side,
    batch: int,
    seq_len: int,
    rows: Tensor,
    device: torch.device | str = "cpu",
) -> Difference | None:
    """The first ``(row, q, kv)`` where ``got`` attends otherwise than ``expected``, looking
    only at the query rows where ``rows`` (``(B, S)`` bool) is True; None if they agree there.

    Both sides must tile the same way (``block``); codes of B or H of 1 broadcast.
    """
    if expected.codes is not None and got.codes is not None and expected.block != got.block:
        raise ValueError(f"sides tile differently: {expected.block} and {got.block}")
    q_block, kv_block = got.block if got.codes is not None else expected.block
    num_q, num_kv = -(-seq_len // q_block), -(-seq_len // kv_block)
    heads = max(expected.heads, got.heads)
    shape = (batch, heads, num_q, num_kv)
    code_e = _codes(expected.codes, shape, device)
    code_g = _codes(got.codes, shape, device)
    # A query tile with no row that matters is skipped whole.
    tile_rows = _pad_to(rows, num_q * q_block).view(batch, 1, num_q, q_block).any(-1, True)
    need = ((code_e == PARTIAL) | (code_g == PARTIAL) | (code_e != code_g)) & tile_rows
    tiles = need.nonzero()
    if tiles.numel() == 0:
        return None
    # Row, q tile, kv tile, head: the first difference by (row, q, kv) is in the first q
    # tile (per row) that has one, so the walk may stop once that q tile is done.
    order = torch.argsort(((tiles[:, 0] * num_q + tiles[:, 2]) * num_kv + tiles[:, 3]) * heads)
    tiles = tiles[order]
    per_chunk = max(1, _PAIRS_PER_CHUNK // (q_block * kv_block))
    q_arange = torch.arange(q_block, device=device).view(1, -1, 1)
    kv_arange = torch.arange(kv_block, device=device).view(1, 1, -1)
    rows_padded = _pad_to(rows, num_q * q_block)
    best: tuple[int, int, int, int] | None = None
    for chunk in tiles.split(per_chunk):
        if best is not None:
            row, q_tile = best[0], best[1] // q_block
            first = chunk[0]
            if (int(first[0]), int(first[2])) > (row, q_tile):
                break
        b, h, i, j = (chunk[:, k].view(-1, 1, 1) for k in range(4))
        q = i * q_block + q_arange
        kv = j * kv_block + kv_arange
        q_in, kv_in = q.clamp(max=seq_len - 1), kv.clamp(max=seq_len - 1)
        differs = _values(expected, code_e[b, h, i, j], b, h, q_in, kv_in) != _values(
            got, code_g[b, h, i, j], b, h, q_in, kv_in
        )
        differs &= (q < seq_len) & rows_padded[b, q]  # (T, q_block, 1): cheap to broadcast
        if seq_len % kv_block:
            differs &= kv < seq_len
        if not bool(differs.any()):
            continue
        where = differs.nonzero()
        t, dq, dkv = where[:, 0], where[:, 1], where[:, 2]
        found = torch.stack(
            [
                b.view(-1)[t],
                q.view(-1, q_block)[t, dq],
                kv.view(-1, kv_block)[t, dkv],
                h.view(-1)[t],
            ],
            1,
        )
        keys = ((found[:, 0] * seq_len + found[:, 1]) * seq_len + found[:, 2]) * heads
        k = int(torch.argmin(keys + found[:, 3]))
        candidate = tuple(int(x) for x in found[k])
        if best is None or candidate < best:
            best = candidate  # type: ignore[assignment]
    if best is None:
        return None
    row, q_pos, kv_pos, head = best
    e = _point(expected, row, head, q_pos, kv_pos, device)
    return Difference(row, q_pos, kv_pos, head, e, not e)


def empty_rows(
    side: Side, batch: int, seq_len: int, rows: Tensor, device
) -> tuple[int, int] | None:
    """The first ``(row, q)`` with ``rows`` True where ``side`` attends no key at all."""
    # Most masks attend the diagonal: only rows that do not are read across.
    b = torch.arange(batch, device=device).view(-1, 1)
    q = torch.arange(seq_len, device=device).view(1, -1)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    diagonal = _point_values(side, b, zero, q, q, seq_len, device)
    suspects = (rows & ~diagonal).nonzero()
    if suspects.numel() == 0:
        return None
    per_chunk = max(1, _PAIRS_PER_CHUNK // seq_len)
    kv = torch.arange(seq_len, device=device).view(1, -1)
    for chunk in suspects.split(per_chunk):
        rb, rq = chunk[:, :1], chunk[:, 1:]
        found = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        for head in range(side.heads):
            h = torch.full_like(rb, head)
            found |= _point_values(side, rb, h, rq, kv, seq_len, device).any(-1)
        if not bool(found.all()):
            k = int((~found).nonzero()[0])
            return int(chunk[k, 0]), int(chunk[k, 1])
    return None


def _codes(codes: Tensor | None, shape: tuple[int, int, int, int], device) -> Tensor:
    if codes is None:
        return torch.full(shape, PARTIAL, dtype=torch.int8, device=device)
    return codes.to(device).expand(shape)


def _pad_to(rows: Tensor, length: int) -> Tensor:
    extra = length - rows.shape[1]
    return torch.nn.functional.pad(rows, (0, extra)) if extra > 0 else rows


def _values(side: Side, code: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """The side's values on a chunk of tiles (a view: not to be written to)."""
    shape = (q.shape[0], q.shape[1], kv.shape[2])
    partial = code == PARTIAL
    if not bool(partial.any()):
        return (code == FULL).expand(shape)
    inside = side.rule(b, h, q, kv).expand(shape)
    if bool(partial.all()):  # the common chunk: every tile read element by element
        return inside
    return torch.where(partial.expand(shape), inside, (code == FULL).expand(shape))


def _point_values(
    side: Side, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, seq_len: int, device
) -> Tensor:
    """The side's value at broadcast points (codes read at each point's tile)."""
    value = side.rule(b, h, q, kv)
    if side.codes is None:
        return value
    q_block, kv_block = side.block
    codes = side.codes.to(device)
    code = codes[
        b.clamp(max=codes.shape[0] - 1),
        h.clamp(max=codes.shape[1] - 1),
        q // q_block,
        kv // kv_block,
    ]
    return torch.where(code == PARTIAL, value, code == FULL)


def _point(side: Side, row: int, head: int, q: int, kv: int, device) -> bool:
    def t(x: int) -> Tensor:
        return torch.tensor(x, device=device)

    head = min(head, side.heads - 1)
    return bool(_point_values(side, t(row), t(head), t(q), t(kv), q + 1, device))
