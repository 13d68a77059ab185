"""The plan: query, key, value and a BlockMask checked together, and the BlockMask's
block lists read into one map of block kinds (EMPTY / PARTIAL / FULL per batch, head, q block
and kv block) that every kernel of this backend and the SDPA lowering read."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.backends.request import check_fits, check_scale, check_tensors, dims_problem
from flexmask.blocks import EMPTY, PARTIAL, kv_codes
from flexmask.builders import built_from

MOD_EVALS = ("auto", "broadcast", "vmap")


@dataclass(frozen=True)
class Plan:
    """Validated sizes and the block-kind map, laid out as (B | 1, Hkv | 1, G | 1, NQ, NKV)."""

    batch: int
    q_heads: int
    kv_heads: int
    group: int  # G = Hq // Hkv
    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    head_dim: int
    value_dim: int
    scale: float
    working_dtype: torch.dtype
    kinds: Tensor  # int8 EMPTY / PARTIAL / FULL per (batch, head, q block, kv block)
    listed: Tensor  # (NQ, NKV) bool on the CPU: listed for some batch and head
    partial: Tensor  # (NQ, NKV) bool on the CPU: partial for some batch and head
    mask_mod: Callable[..., Tensor]
    score_mod: Callable[..., Tensor] | None


def make_plan(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: BlockMask,
    score_mod: Callable[..., Tensor] | None,
    scale: float | None,
    enable_gqa: bool,
    mod_eval: str,
) -> Plan:
    enable_gqa = bool(enable_gqa)  # any truthy value, as torch takes it
    check_tensors(query, key, value, enable_gqa)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.size(1), key.size(2)
    if q_heads == 0:
        raise ValueError(
            f"query and key/value must have at least one head (H >= 1, as torch's flex_attention "
            f"needs), got query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if q_len == 0 or kv_len == 0:
        raise ValueError(
            f"query and key must hold at least one token, got Q_LEN={q_len}, KV_LEN={kv_len}"
        )
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            f"score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx) or None, "
            f"got {type(score_mod).__name__}"
        )
    scale = check_scale(scale)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if mod_eval not in MOD_EVALS:
        raise ValueError(f"mod_eval must be one of {MOD_EVALS}, got {mod_eval!r}")

    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a torch.nn.attention.flex_attention.BlockMask (for example "
            f"from create_block_mask), got {type(block_mask).__name__}"
        )
    check_fits(block_mask.seq_lengths, block_mask.kv_num_blocks.device, query, key)
    q_block, kv_block = (int(s) for s in block_mask.BLOCK_SIZE)
    group = q_heads // kv_heads
    num_q_blocks = -(-q_len // q_block)
    num_kv_blocks = -(-kv_len // kv_block)

    # The one BlockMask reader: its lists checked (shapes, counts, listed indices), then
    # read into codes, a block listed both partial and full counting once, as full.
    kinds = kv_codes(block_mask, checked=True)
    mask_batch, mask_heads = kinds.shape[:2]
    built = built_from(block_mask)
    problem = dims_problem(
        (mask_batch, mask_heads), query, built is not None and built.batch_dependent
    )
    if problem is not None:
        raise ValueError(problem)
    listed = (kinds != EMPTY).flatten(0, 1).any(dim=0).cpu()
    partial = (kinds == PARTIAL).flatten(0, 1).any(dim=0).cpu()
    # Heads split as (Hkv, G) so a per-query-head map lines up with grouped kv heads.
    if mask_heads == q_heads:
        kinds = kinds.view(mask_batch, kv_heads, group, num_q_blocks, num_kv_blocks)
    else:
        kinds = kinds.view(mask_batch, 1, 1, num_q_blocks, num_kv_blocks)

    return Plan(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        group=group,
        q_len=q_len,
        kv_len=kv_len,
        q_block=q_block,
        kv_block=kv_block,
        head_dim=head_dim,
        value_dim=value.size(-1),
        scale=float(scale),
        working_dtype=torch.float64 if query.dtype == torch.float64 else torch.float32,
        kinds=kinds,
        listed=listed,
        partial=partial,
        mask_mod=block_mask.mask_mod,
        score_mod=score_mod,
    )


def pad_to_blocks(tensor: Tensor, block: int) -> Tensor:
    """Zero-pads dim 2 (the sequence) up to a multiple of ``block``."""
    missing = -tensor.size(2) % block
    return torch.nn.functional.pad(tensor, (0, 0, 0, missing)) if missing else tensor
