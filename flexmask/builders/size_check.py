"""Refusing, before anything is allocated, a build that cannot fit its device: a Mask's
BlockMask and the build's own tensors (``check_size``), or the dense grid torch evaluates
for a plain mask_mod (``check_dense_size``); arithmetic on Python ints only."""

from __future__ import annotations

from typing import Any

import torch

from flexmask._validate import block_mask_bytes, check_device, check_fits
from flexmask.algebra import Mask
from flexmask.builders.sides import in_closed_form


def check_size(
    mask: Mask,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    device: torch.device | None,
    block_size: tuple[int, int],
    *,
    per_row: bool = False,
    reduced: bool = False,
) -> None:
    """Refuses, before anything is allocated, a build that cannot fit the device: its
    BlockMask (``reduced``: B and H cut to 1 where the mask ignores them, as the cache
    builds), the grid's tile bounds (per row where the window is, ``per_row``) and, in closed
    form, one block's queries at a time. The arguments are a spec's (``builders.spec``),
    checked already; arithmetic on Python ints only."""
    q_block, kv_block = block_size
    rows = batch if not reduced or per_row or mask.batch_dependent else 1
    built_heads = heads if not reduced or mask.head_dependent else 1
    nq, nkv = -(-q_len // q_block), -(-kv_len // kv_block)
    nbytes = block_mask_bytes(rows, built_heads, q_len, kv_len, q_block, kv_block)
    nbytes += 16 * (nq + nkv) * (batch if per_row else 1)  # the grid's first/last tokens
    if in_closed_form(mask) and nq and nkv:
        # int64 queries of a block and both ends of their intervals, live together
        nbytes += 24 * rows * q_block
    check_fits(
        nbytes,
        check_device(device, mask.device),
        f"a BlockMask with B={batch}, H={heads}, Q_LEN={q_len}, KV_LEN={kv_len}, "
        f"BLOCK_SIZE={(q_block, kv_block)} ({nq} x {nkv} blocks per row and head)",
        "use shorter lengths, fewer B/H, or a BLOCK_SIZE no longer than the sequence (a block's "
        "queries are evaluated together)",
    )


def check_dense_size(
    B: Any, H: Any, q_len: int, kv_len: int, q_block: int, kv_block: int, device: Any
) -> None:
    """Refuses a plain mask_mod's build by torch that cannot fit ``device``: torch evaluates
    the mask on the whole ``(B, H, q_len, kv_len)`` grid, padded to whole blocks, as bools.
    ``B`` and ``H`` as checked (None: 1)."""
    rows, cols = (B or 1) * (H or 1), 1
    padded = -(-q_len // q_block) * q_block * -(-kv_len // kv_block) * kv_block
    check_fits(
        rows * (q_len * kv_len + padded)
        + block_mask_bytes(rows, cols, q_len, kv_len, q_block, kv_block),
        device,
        f"create_block_mask of a plain mask_mod with B={B}, H={H}, Q_LEN={q_len}, "
        f"KV_LEN={kv_len}, BLOCK_SIZE={(q_block, kv_block)} (torch evaluates it on every "
        f"element, padded to whole blocks, as bools)",
        "use shorter lengths, fewer B/H or a BLOCK_SIZE no longer than the sequence; a flexmask "
        "expression (flexmask.from_mask_mod(fn, key=...) & ...) evaluates only the blocks its "
        "structure leaves undecided",
    )
