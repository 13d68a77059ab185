"""One step's BlockMask: the training mask's window, built from structure (``decode_mask``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int
from flexmask.algebra import Mask, MaskMod, ShiftedMod
from flexmask.blocks import BLOCK_FIELDS
from flexmask.builders import build
from flexmask.inference.arguments import (
    block_pair,
    cache_lengths,
    check_step_size,
    check_window,
    is_scalar,
    step_device,
)
from flexmask.runtime import Spec, make_spec


def decode_mask(
    mask: Mask,
    cache_lens: Any,
    q_len: int = 1,
    capacity: int | None = None,
    *,
    heads: int = 1,
    block_size: int | tuple[int, int] = 128,
    device: torch.device | str | None = None,
) -> BlockMask:
    """The BlockMask of one decode or chunked-prefill step, from the training mask.

    Row b's queries sit at positions ``[cache_lens[b], cache_lens[b] + q_len)`` of its
    sequence; keys are the whole cache ``[0, capacity)``. The result equals torch's
    ``create_block_mask`` of ``lambda b, h, q, kv: mask.mask_mod(b, h, q + cache_lens[b], kv)``
    with ``Q_LEN=q_len, KV_LEN=capacity`` (whole tensors), built from structure in
    O(blocks of the new rows). Its mask_mod takes local query indices and holds the cache
    lengths as a ``(B,)`` tensor, so compiled flex_attention does not recompile as they grow.

    ::

        causal(), cache_lens=[3, 1], q_len=2, capacity=6
        row 0:  ■ ■ ■ ■ ⬚ ⬚      row 1:  ■ ■ ⬚ ⬚ ⬚ ⬚
                ■ ■ ■ ■ ■ ⬚              ■ ■ ■ ⬚ ⬚ ⬚

    Args:
        mask: the training expression; its data (documents, tree, padding) describes the
            whole sequence up to ``capacity``.
        cache_lens: tokens already in the cache — one int for every row (the BlockMask then
            has B = 1 and broadcasts, unless the mask's data is per row), or one per row.
        q_len: new queries per row in this step (1 for decode, the chunk for prefill).
        capacity: the fixed KV cache length (bucket it: one compile per capacity).
            None: the smallest that fits, ``max(cache_lens) + q_len``.
        heads: H of the BlockMask.
        block_size: tile size, an int or a (q, kv) pair; for paged KV the kv size must be the
            page size.
        device: where to build (None: the mask's device, else the CPU).

    Returns:
        A torch BlockMask of shape ``(B, heads, ...)`` with ``seq_lengths == (q_len, capacity)``.

    Raises:
        ValueError: a negative cache length, ``q_len < 1``, or a row whose window runs past
            ``capacity``. TypeError: non-integer arguments.

    Example:
        >>> import flexmask
        >>> bm = flexmask.decode_mask(flexmask.causal(), [300, 40], q_len=1, capacity=512)
        >>> bm.kv_num_blocks.tolist(), bm.seq_lengths
        ([[[3]], [[1]]], (1, 512))
    """
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
    lens = cache_lengths(cache_lens, mask)
    q_len = check_int(q_len, "q_len", minimum=1)
    if capacity is None:
        capacity = max(lens) + q_len
    capacity = check_int(capacity, "capacity", minimum=1)
    heads = check_int(heads, "heads", minimum=1)
    check_window(lens, q_len, capacity)
    dev = step_device(mask, device)
    blocks = block_pair(block_size)
    per_row = not is_scalar(cache_lens) or mask.rows is not None
    check_step_size(lens, q_len, capacity, heads, blocks, len(lens) if per_row else 1, dev)
    offsets = torch.tensor(lens, dtype=torch.int64, device=dev)
    if is_scalar(cache_lens) and mask.rows is None:
        offsets = offsets[0]  # one length for every row: a (1, H, ...) BlockMask, broadcast
    return build_window(
        step_spec(mask, lens[: offsets.numel()], q_len, capacity, heads, blocks, dev), offsets
    )


def step_spec(
    mask: Mask,
    lens: list[int],
    q_len: int,
    capacity: int,
    heads: int,
    blocks: tuple[int, int],
    device: torch.device,
) -> Spec:
    """The spec of a step (its queries at ``lens``, one per row it builds), the mask
    validated here, once: every window fits the capacity, so every later step of the same
    generation reaches the same positions and moves the spec (``Spec.at_queries``) without
    checking the mask again."""
    return make_spec(mask, len(lens), heads, q_len, capacity, device, blocks, q_offset=lens)


def build_window(spec: Spec, offsets: Tensor) -> BlockMask:
    """The window's BlockMask with a ShiftedMod over ``offsets`` (held, not copied, equal to
    the spec's query offsets): B is their count when per row (1-D), else 1."""
    built = build(spec.mask, spec.grid())
    # The build's own lowered mask (lookups padded to the capacity), not a second lowering:
    # its ShiftedMod may hold the offsets as one value where every row's is equal, while
    # the step's mask_mod holds these very offsets, (B,) or 0-d as given, which DecodeMasks
    # updates in place (one shape every step: no recompiles).
    inner = built.mask_mod
    if isinstance(inner, ShiftedMod):
        inner = inner.mod
    return _with_mask_mod(built, ShiftedMod(inner, offsets, torch.zeros_like(offsets)))


def _with_mask_mod(block_mask: BlockMask, mask_mod: MaskMod) -> BlockMask:
    """The same tensors with another mask_mod (one mask_mod class for every step)."""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    return BlockMask(
        seq_lengths=(q_len, kv_len),
        **{name: getattr(block_mask, name) for name in BLOCK_FIELDS},
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=mask_mod,
    )
