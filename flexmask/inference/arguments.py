"""A step's arguments checked: cache lengths, block sizes, device, window and size."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import INT64_MAX, block_mask_bytes, check_fits, check_int, int_vector
from flexmask.algebra import Mask


def block_pair(block_size: Any) -> tuple[int, int]:
    """``block_size`` as a (q, kv) pair: an int for both, or a pair."""
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a (q, kv) pair, got {block_size!r}")
        return (
            check_int(block_size[0], "block_size[0]", minimum=1),
            check_int(block_size[1], "block_size[1]", minimum=1),
        )
    size = check_int(block_size, "block_size", minimum=1)
    return size, size


def is_scalar(value: Any) -> bool:
    """One length for every row: a Python int or a 0-d tensor."""
    return isinstance(value, numbers.Integral) or (isinstance(value, Tensor) and value.dim() == 0)


def cache_lengths(cache_lens: Any, mask: Mask, name: str = "cache_lens") -> list[int]:
    """Per-row cache lengths as Python ints: one int for every row (``mask.rows`` rows, else
    one), or one per row."""
    if is_scalar(cache_lens):
        value = check_int(cache_lens, name, minimum=0)
        return [value] * (mask.rows or 1)
    # The decode loop's own lengths, every step: plain ints need no tensor round trip.
    if (
        type(cache_lens) is list
        and cache_lens
        and all(type(v) is int for v in cache_lens)
        and min(cache_lens) >= 0
        and max(cache_lens) <= INT64_MAX
        and (mask.rows is None or mask.rows == len(cache_lens))
    ):
        return list(cache_lens)
    if not isinstance(cache_lens, (Sequence, Tensor)) and not hasattr(cache_lens, "__array__"):
        raise TypeError(
            f"{name} must be an int or one int per batch row (list or 1-D integer tensor), "
            f"got {type(cache_lens).__name__}"
        )
    values = int_vector(cache_lens, name).tolist()
    if not values:
        raise ValueError(f"{name} must hold one value per batch row, got an empty list")
    for i, v in enumerate(values):
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
    if mask.rows is not None and mask.rows != len(values):
        raise ValueError(
            f"{name} gives {len(values)} rows but the mask's data is given for "
            f"{mask.rows} rows: pass one value per row of the mask"
        )
    return values


def check_window(lens: list[int], q_len: int, capacity: int) -> None:
    """Every row's queries ``[lens[b], lens[b] + q_len)`` fit in the cache."""
    for i, length in enumerate(lens):
        if length + q_len > capacity:
            raise ValueError(
                f"cache_lens[{i}]={length} plus q_len={q_len} is past capacity={capacity}: "
                f"the step's queries must fit in the cache (raise capacity to the next bucket)"
            )


def check_step_size(
    lens: list[int],
    q_len: int,
    capacity: int,
    heads: int,
    blocks: tuple[int, int],
    rows: int,
    device: torch.device,
) -> None:
    """Refuses, before anything is allocated, a step whose BlockMask cannot fit the device
    or whose cache positions (padded to whole kv blocks) overflow int64."""
    q_block, kv_block = blocks
    if -(-capacity // kv_block) * kv_block > INT64_MAX + 1:
        raise ValueError(
            f"capacity={capacity} rounded up to the kv block size {kv_block} is past 2**63: "
            f"cache positions are int64 (with capacity None it is max(cache_lens) + q_len)"
        )
    nq, nkv = -(-q_len // q_block), -(-capacity // kv_block)
    check_fits(
        block_mask_bytes(rows, heads, q_len, capacity, q_block, kv_block) + 16 * (nq + nkv) * rows,
        device,
        f"the step's BlockMask for capacity={capacity} (with capacity None: max(cache_lens)="
        f"{max(lens)} + q_len={q_len}), heads={heads}, block_size={blocks}",
        "the cache holds max(cache_lens) + q_len tokens at most: pass the cache lengths in "
        "tokens and a capacity the KV cache really has",
    )


def step_device(mask: Mask, device: Any) -> torch.device:
    """Where a step is built: ``device``, else the mask's, else the CPU."""
    if device is None:
        return mask.device or torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device or its name, got {device!r}") from err
