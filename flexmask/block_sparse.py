"""Differentiable block-sparse attention in plain torch ops, for CPUs (where flex has no backward).

``torch.nn.attention.flex_attention.flex_attention`` runs its forward on CPU but raises in the
backward. :func:`block_sparse_attention` computes the same thing from the same
:class:`~torch.nn.attention.flex_attention.BlockMask`, touching only the blocks it lists, with
ordinary differentiable ops, so autograd gives gradients for query, key and value.

How it is laid out, and why:

* **Gather, don't materialize.** For each q block, the kv blocks the BlockMask lists (partial
  first, then full) are gathered into a padded ``(M, KV_BLOCK)`` strip, ``M`` being the largest
  count among the q blocks processed together; padding slots are masked. Scores therefore cost
  ``Q_LEN x M x KV_BLOCK``, never ``Q_LEN x KV_LEN``.
* **Chunks bound the temporaries.** q blocks are grouped greedily, in order, into chunks whose
  scores and gathered keys/values stay under ``max_chunk_elements``; neighbouring q blocks have
  similar counts for the usual masks (causal, documents, windows), so padding stays small.
* **Recompute by default.** Each chunk runs under non-reentrant activation checkpointing, so
  autograd keeps only the inputs and rebuilds one chunk at a time in the backward: memory is
  ``O(Q_LEN x D)`` plus one chunk, at the cost of a second forward. ``recompute=False`` keeps
  every chunk's activations instead (``O(Q_LEN x active kv tokens)``) and skips that forward.
* **mask_mod only where it matters.** It is evaluated on the partial blocks only; full blocks are
  taken as all-allowed, exactly as flex's kernels do, and padding past ``Q_LEN``/``KV_LEN`` is
  clamped before the call (so lookups sized to the length are safe) and masked after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

ModEval = Literal["auto", "broadcast", "vmap"]
"""How ``mask_mod``/``score_mod`` are evaluated: see :func:`block_sparse_attention`."""

_MOD_EVALS = ("auto", "broadcast", "vmap")

# 4 Mi elements: 16 MiB per fp32 score-sized temporary. Softmax and its backward keep a handful
# alive at once, so one chunk peaks near 100 MiB; smaller chunks add Python overhead per block.
DEFAULT_MAX_CHUNK_ELEMENTS = 1 << 22


def block_sparse_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: BlockMask,
    score_mod: Callable[..., Tensor] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    *,
    mod_eval: ModEval = "auto",
    recompute: bool = True,
    max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse attention with flex_attention's semantics, differentiable on any device.

    Same result as ``flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
    return_lse)`` evaluated by flex's kernels: for each q block only the kv blocks in
    ``block_mask.kv_indices[..., :kv_num_blocks]`` (``mask_mod`` applied) and
    ``block_mask.full_kv_indices[..., :full_kv_num_blocks]`` (no ``mask_mod``) are attended.
    A query row with no allowed key gets output 0 and lse ``-inf``, and zero gradients.

    Args:
        query: ``(B, Hq, Q_LEN, D)``, floating point.
        key: ``(B, Hkv, KV_LEN, D)``, same dtype and device as ``query``.
        value: ``(B, Hkv, KV_LEN, Dv)``, same dtype and device as ``query``.
        block_mask: built for ``(Q_LEN, KV_LEN)``, e.g. by ``create_block_mask``. Its batch and
            head dims may be 1 (broadcast) or ``B`` and ``Hq``; ``BLOCK_SIZE`` may be any
            ``(Q_BLOCK, KV_BLOCK)`` and the lengths need not be multiples of it.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to
            ``scale * q @ k^T`` before masking, as in flex. ``None`` leaves scores unchanged.
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv``; query head ``h`` reads kv head
            ``h // (Hq // Hkv)``.
        return_lse: also return the natural-log logsumexp of the masked scores,
            ``(B, Hq, Q_LEN)``, float32 (float64 for float64 inputs), as flex does on CPU.
        mod_eval: how the mods are called. ``"broadcast"`` calls them once with broadcasting
            index tensors (``b`` shaped ``(B, 1, ...)``, ``h`` ``(1, Hkv, 1, G, 1, ...)``, and so
            on): the fast path, right for mods made of elementwise ops and indexing, which is all
            flexmask produces. ``"vmap"`` nests ``torch.vmap`` over every index dim so each call
            sees 0-d tensors, like ``create_mask`` does; this is right for any mod flex accepts.
            ``"auto"`` (default) tries broadcasting once per call, on the first chunk, and
            switches to vmap if the mod raises or returns a result that does not broadcast to
            the scores' shape. A mod that *reduces* over its inputs returns a plausible shape
            under broadcasting yet a wrong value, which no check can see: pass ``"vmap"``.
        recompute: rebuild each chunk in the backward instead of keeping its activations
            (activation checkpointing). Keeps memory at ``O(Q_LEN x D)`` plus one chunk.
        max_chunk_elements: soft bound on the score and gathered key/value elements of one
            chunk of q blocks; a single q block is never split, so it may exceed it.

    Returns:
        The output ``(B, Hq, Q_LEN, Dv)`` in ``query.dtype``, and with ``return_lse`` the pair
        ``(output, lse)``.

    Raises:
        TypeError: an argument of the wrong type or dtype (named in the message).
        ValueError: shapes that do not fit together, or a ``block_mask`` built for other lengths.

    Example:
        >>> import torch
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> block_mask = create_block_mask(causal, None, None, 300, 300, device="cpu")
        >>> q, k, v = (torch.randn(1, 2, 300, 16, requires_grad=True) for _ in range(3))
        >>> out = block_sparse_attention(q, k, v, block_mask)
        >>> out.sum().backward()
        >>> out.shape, q.grad.shape
        (torch.Size([1, 2, 300, 16]), torch.Size([1, 2, 300, 16]))
    """
    plan = _plan(query, key, value, block_mask, score_mod, scale, enable_gqa, mod_eval)
    if isinstance(max_chunk_elements, bool) or not isinstance(max_chunk_elements, int):
        raise TypeError(
            f"max_chunk_elements must be an int, got {type(max_chunk_elements).__name__}"
        )
    if max_chunk_elements < 1:
        raise ValueError(f"max_chunk_elements must be >= 1, got {max_chunk_elements}")

    chunks = _chunks(plan, max_chunk_elements)
    mask_eval, score_eval = _resolve_mod_evals(plan, chunks, query, mod_eval)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))

    # Padded once to whole blocks, so a chunk takes its query rows by slicing and its keys and
    # values as whole blocks (index_select over (KV_BLOCK * D)-wide rows, whose index_add
    # backward is far cheaper than one per token).
    q_rows = _pad_to_blocks(query, plan.q_block)
    key_blocks = _pad_to_blocks(key, plan.kv_block).reshape(-1, plan.kv_block * plan.head_dim)
    value_blocks = _pad_to_blocks(value, plan.kv_block).reshape(-1, plan.kv_block * plan.value_dim)

    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for chunk in chunks:
        args = (q_rows, key_blocks, value_blocks, plan, chunk, mask_eval, score_eval, return_lse)
        if recompute and needs_grad:
            # Non-reentrant checkpointing: only the arguments are kept; the chunk's scores,
            # probabilities and gathered keys/values are rebuilt when its backward runs.
            result = checkpoint(
                _chunk_attention, *args, use_reentrant=False, preserve_rng_state=False
            )
        else:
            result = _chunk_attention(*args)
        outs.append(result[0])
        if return_lse:
            lses.append(result[1])
    out = torch.cat(outs, dim=2)
    if return_lse:
        return out, torch.cat(lses, dim=2)
    return out


@dataclass(frozen=True)
class _Plan:
    """Validated sizes and the block lists, laid out as (B | 1, Hkv | 1, q block, Gi, slot)."""

    batch: int
    q_heads: int
    kv_heads: int
    group: int  # G = Hq // Hkv
    mask_group: int  # Gi: G when the BlockMask has one row per query head, else 1
    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    head_dim: int
    value_dim: int
    scale: float
    working_dtype: torch.dtype
    partial_num: Tensor  # (Bm, Hm', NQ, Gi), int64
    partial_idx: Tensor  # (Bm, Hm', NQ, Gi, Lp), int64
    full_num: Tensor | None
    full_idx: Tensor | None
    partial_counts: list[int]  # per q block, the most partial blocks over batch and heads
    full_counts: list[int]
    mask_mod: Callable[..., Tensor]
    score_mod: Callable[..., Tensor] | None


class _Chunk(NamedTuple):
    start: int  # first q block
    stop: int  # one past the last q block
    partial_slots: int  # Mp: slots for partial kv blocks, padded to the chunk's max
    full_slots: int  # Mf


class _ChunkIndices(NamedTuple):
    """Index tensors of one chunk, broadcastable to (B, Hkv, C, G, Q_BLOCK, M, KV_BLOCK)."""

    b: Tensor
    h: Tensor
    q_idx: Tensor  # clamped to Q_LEN - 1
    kv_idx: Tensor  # clamped to KV_LEN - 1; (Bm, Hkv | 1, C, Gi, 1, M, KV_BLOCK)
    block_idx: Tensor  # kv block of each slot, 0 in unused ones; (Bm, Hkv | 1, C, Gi, M)
    kv_allowed: Tensor  # slot in use and token in range, same shape as kv_idx


def _plan(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: BlockMask,
    score_mod: Callable[..., Tensor] | None,
    scale: float | None,
    enable_gqa: bool,
    mod_eval: str,
) -> _Plan:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, seq_len, head_dim), got shape {tuple(tensor.shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating-point dtype, got {tensor.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(
                f"{name}.dtype must equal query.dtype ({query.dtype}), got {tensor.dtype}"
            )
        if tensor.device != query.device:
            raise ValueError(
                f"{name} must be on query's device ({query.device}), got {tensor.device}"
            )
    batch, q_heads, q_len, head_dim = query.shape
    if key.size(0) != batch or value.size(0) != batch:
        raise ValueError(
            f"key and value must have query's batch size {batch}, got key {key.size(0)} and "
            f"value {value.size(0)}"
        )
    if key.size(-1) != head_dim:
        raise ValueError(
            f"key's head_dim must equal query's ({head_dim}), got key.shape={tuple(key.shape)}"
        )
    if value.shape[1:3] != key.shape[1:3]:
        raise ValueError(
            f"value must have key's heads and length {tuple(key.shape[1:3])}, "
            f"got value.shape={tuple(value.shape)}"
        )
    kv_heads, kv_len = key.size(1), key.size(2)
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if not enable_gqa and q_heads != kv_heads:
        raise ValueError(
            f"query has {q_heads} heads but key/value have {kv_heads}; pass enable_gqa=True "
            "for grouped-query attention, or give them the same number of heads"
        )
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(
            f"with enable_gqa=True, query's heads ({q_heads}) must be a multiple of key/value's "
            f"heads ({kv_heads})"
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
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if mod_eval not in _MOD_EVALS:
        raise ValueError(f"mod_eval must be one of {_MOD_EVALS}, got {mod_eval!r}")

    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a torch.nn.attention.flex_attention.BlockMask (for example "
            f"from create_block_mask), got {type(block_mask).__name__}"
        )
    if tuple(block_mask.seq_lengths) != (q_len, kv_len):
        raise ValueError(
            f"block_mask was built for (Q_LEN, KV_LEN)={tuple(block_mask.seq_lengths)} but query "
            f"and key give ({q_len}, {kv_len}); build it for these lengths"
        )
    if block_mask.kv_num_blocks.device != query.device:
        raise ValueError(
            f"block_mask must be on query's device ({query.device}), got "
            f"{block_mask.kv_num_blocks.device}; use block_mask.to(device)"
        )
    q_block, kv_block = (int(s) for s in block_mask.BLOCK_SIZE)
    group = q_heads // kv_heads
    num_q_blocks = -(-q_len // q_block)
    num_kv_blocks = -(-kv_len // kv_block)

    def lists(num: Tensor, idx: Tensor, name: str) -> tuple[Tensor, Tensor, list[int]]:
        if num.dim() != 3 or idx.dim() != 4 or idx.shape[:3] != num.shape:
            raise ValueError(
                f"block_mask.{name} must be (B, H, q_blocks, max_blocks), got shape "
                f"{tuple(idx.shape)} with counts of shape {tuple(num.shape)}"
            )
        mask_batch, mask_heads, mask_rows, slots = idx.shape
        if mask_batch not in (1, batch) or mask_heads not in (1, q_heads):
            raise ValueError(
                f"block_mask's batch and head dims must be 1 or match query's ({batch}, "
                f"{q_heads}), got ({mask_batch}, {mask_heads})"
            )
        if mask_rows < num_q_blocks:
            raise ValueError(
                f"block_mask.{name} has {mask_rows} q blocks but Q_LEN={q_len} needs "
                f"{num_q_blocks} of size {q_block}"
            )
        num = num[:, :, :num_q_blocks].long()
        idx = idx[:, :, :num_q_blocks].long()
        if int(num.min()) < 0 or int(num.max()) > slots:
            raise ValueError(f"block_mask's counts for {name} must lie in [0, {slots}]")
        in_use = torch.arange(slots, device=idx.device) < num[..., None]
        # Slots past the count hold leftovers; pointing them at block 0 keeps gathers in range.
        idx = torch.where(in_use, idx, 0)
        if int(idx.min()) < 0 or int(idx.max()) >= num_kv_blocks:
            raise ValueError(
                f"block_mask.{name} points outside the {num_kv_blocks} kv blocks of KV_LEN={kv_len}"
            )
        counts = num.amax(dim=(0, 1)).tolist()
        # Heads split as (Hkv, Gi) so a per-query-head mask lines up with grouped kv heads.
        if mask_heads == q_heads:
            num = num.view(mask_batch, kv_heads, group, -1).transpose(2, 3)
            idx = idx.view(mask_batch, kv_heads, group, num_q_blocks, slots).transpose(2, 3)
        else:
            num = num.unsqueeze(-1)
            idx = idx.unsqueeze(-2)
        return num, idx, counts

    full_num: Tensor | None = None
    full_idx: Tensor | None = None
    full_counts = [0] * num_q_blocks
    partial_num, partial_idx, partial_counts = lists(
        block_mask.kv_num_blocks, block_mask.kv_indices, "kv_indices"
    )
    if block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None:
        full_num, full_idx, full_counts = lists(
            block_mask.full_kv_num_blocks, block_mask.full_kv_indices, "full_kv_indices"
        )
        if full_num.shape[:2] != partial_num.shape[:2]:
            raise ValueError(
                "block_mask's kv_indices and full_kv_indices must have the same batch and head "
                f"dims, got {tuple(block_mask.kv_indices.shape[:2])} and "
                f"{tuple(block_mask.full_kv_indices.shape[:2])}"
            )

    return _Plan(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        group=group,
        mask_group=partial_num.size(-1),
        q_len=q_len,
        kv_len=kv_len,
        q_block=q_block,
        kv_block=kv_block,
        head_dim=head_dim,
        value_dim=value.size(-1),
        scale=float(scale),
        working_dtype=torch.float64 if query.dtype == torch.float64 else torch.float32,
        partial_num=partial_num,
        partial_idx=partial_idx,
        full_num=full_num,
        full_idx=full_idx,
        partial_counts=partial_counts,
        full_counts=full_counts,
        mask_mod=block_mask.mask_mod,
        score_mod=score_mod,
    )


def _chunks(plan: _Plan, max_elements: int) -> list[_Chunk]:
    """Groups consecutive q blocks while one chunk's scores and gathered k/v fit the budget."""

    def cost(q_blocks: int, slots: int) -> int:
        kv_tokens = max(slots, 1) * plan.kv_block
        scores = plan.batch * plan.q_heads * q_blocks * plan.q_block * kv_tokens
        gathered = (
            plan.batch
            * plan.kv_heads
            * q_blocks
            * plan.mask_group
            * kv_tokens
            * (plan.head_dim + plan.value_dim)
        )
        return scores + gathered

    chunks: list[_Chunk] = []
    start = 0
    num_q_blocks = len(plan.partial_counts)
    while start < num_q_blocks:
        stop, partial, full = start + 1, plan.partial_counts[start], plan.full_counts[start]
        while stop < num_q_blocks:
            grown_partial = max(partial, plan.partial_counts[stop])
            grown_full = max(full, plan.full_counts[stop])
            if cost(stop + 1 - start, grown_partial + grown_full) > max_elements:
                break
            stop, partial, full = stop + 1, grown_partial, grown_full
        if partial + full == 0:
            partial = 1  # an all-padding slot keeps shapes non-empty; it is masked out
        chunks.append(_Chunk(start, stop, partial, full))
        start = stop
    return chunks


def _chunk_indices(plan: _Plan, chunk: _Chunk, device: torch.device) -> _ChunkIndices:
    start, stop, partial_slots, full_slots = chunk
    slot_range = torch.arange(max(partial_slots, full_slots), device=device)

    def slots(num: Tensor, idx: Tensor, count: int) -> tuple[Tensor, Tensor]:
        num = num[:, :, start:stop]
        idx = idx[:, :, start:stop, :, :count]
        if idx.size(-1) < count:  # fewer stored slots than the padded count: pad with block 0
            idx = torch.nn.functional.pad(idx, (0, count - idx.size(-1)))
        return idx, slot_range[:count] < num[..., None]

    block_idx, in_use = slots(plan.partial_num, plan.partial_idx, partial_slots)
    if full_slots:
        assert plan.full_num is not None and plan.full_idx is not None  # full_counts > 0
        full_block_idx, full_in_use = slots(plan.full_num, plan.full_idx, full_slots)
        block_idx = torch.cat([block_idx, full_block_idx], dim=-1)
        in_use = torch.cat([in_use, full_in_use], dim=-1)

    # (Bm, Hkv | 1, C, Gi, M) -> tokens (Bm, Hkv | 1, C, Gi, 1, M, KV_BLOCK)
    kv_tokens = (
        block_idx[..., None] * plan.kv_block + torch.arange(plan.kv_block, device=device)
    ).unsqueeze(-3)
    kv_allowed = in_use[..., None].unsqueeze(-3) & (kv_tokens < plan.kv_len)
    q_tokens = torch.arange(start * plan.q_block, stop * plan.q_block, device=device)

    return _ChunkIndices(
        b=torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1, 1),
        h=torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, 1, plan.group, 1, 1, 1),
        q_idx=q_tokens.clamp(max=plan.q_len - 1).view(1, 1, stop - start, 1, plan.q_block, 1, 1),
        kv_idx=kv_tokens.clamp(max=plan.kv_len - 1),
        kv_allowed=kv_allowed,
        block_idx=block_idx,
    )


def _pad_to_blocks(tensor: Tensor, block: int) -> Tensor:
    """Zero-pads dim 2 (the sequence) up to a multiple of ``block``."""
    missing = -tensor.size(2) % block
    return torch.nn.functional.pad(tensor, (0, 0, 0, missing)) if missing else tensor


def _chunk_attention(
    q_rows: Tensor,
    key_blocks: Tensor,
    value_blocks: Tensor,
    plan: _Plan,
    chunk: _Chunk,
    mask_eval: str,
    score_eval: str,
    return_lse: bool,
) -> tuple[Tensor, ...]:
    """Attention for the q blocks of one chunk: (out rows,) or (out rows, lse rows).

    ``q_rows`` is the query padded to whole q blocks; ``key_blocks``/``value_blocks`` are key
    and value padded to whole kv blocks and flattened to one row per (batch, kv head, kv block).
    """
    batch, kv_heads, group, mask_group = plan.batch, plan.kv_heads, plan.group, plan.mask_group
    q_block, kv_block = plan.q_block, plan.kv_block
    num_blocks = chunk.stop - chunk.start
    slots = chunk.partial_slots + chunk.full_slots
    idx = _chunk_indices(plan, chunk, q_rows.device)

    device = q_rows.device
    # Query rows past Q_LEN are padding: computed like the others and dropped at the end.
    queries = q_rows[:, :, chunk.start * q_block : chunk.stop * q_block]
    queries = queries.view(batch, kv_heads, group, num_blocks, q_block, plan.head_dim)
    queries = queries.permute(0, 1, 3, 2, 4, 5).reshape(
        batch, kv_heads, num_blocks, mask_group, -1, plan.head_dim
    )
    queries = queries.to(plan.working_dtype) * plan.scale

    num_kv_blocks = -(-plan.kv_len // kv_block)
    batch_heads = torch.arange(batch * kv_heads, device=device).view(batch, kv_heads, 1, 1, 1)
    flat_blocks = (batch_heads * num_kv_blocks + idx.block_idx).flatten()

    def gather(blocks: Tensor, dim: int) -> Tensor:
        rows = blocks.index_select(0, flat_blocks).to(plan.working_dtype)
        return rows.view(batch, kv_heads, num_blocks, mask_group, slots * kv_block, dim)

    keys = gather(key_blocks, plan.head_dim)
    values = gather(value_blocks, plan.value_dim)
    full_shape = (batch, kv_heads, num_blocks, group, q_block, slots, kv_block)
    scores = (queries @ keys.transpose(-1, -2)).view(full_shape)

    if plan.score_mod is not None:
        scores = _call_mod(
            plan.score_mod,
            (scores, idx.b, idx.h, idx.q_idx, idx.kv_idx),
            full_shape,
            score_eval,
            "score_mod",
        )
        if scores.shape != full_shape:
            scores = scores.expand(full_shape)
    # Slot use and the KV_LEN bound first (a small broadcast mask; chunks without padding skip
    # it), then mask_mod on the partial slots only, in place on that slice: no full-size mask
    # is ever built.
    if not bool(idx.kv_allowed.all()):
        scores = torch.where(idx.kv_allowed, scores, -math.inf)
    elif chunk.partial_slots and plan.score_mod is not None:
        # score_mod's result may be saved for its backward, or be an expanded view: the
        # in-place fill below must write into a tensor of our own.
        scores = scores.clone(memory_format=torch.contiguous_format)
    if chunk.partial_slots:
        partial_kv = idx.kv_idx[..., : chunk.partial_slots, :]
        partial_shape = (*full_shape[:-2], chunk.partial_slots, kv_block)
        by_mask_mod = _call_mod(
            plan.mask_mod,
            (idx.b, idx.h, idx.q_idx, partial_kv),
            partial_shape,
            mask_eval,
            "mask_mod",
        )
        scores[..., : chunk.partial_slots, :].masked_fill_(~by_mask_mod, -math.inf)
    scores = scores.view(*full_shape[:-2], -1)

    # Rows with nothing allowed (by mask or by a score_mod returning -inf) would make softmax
    # 0/0; zeroing their scores keeps every intermediate finite, so forward and gradient are
    # exactly 0 there instead of NaN. Checked first: most chunks have none, and the fix costs
    # two passes over the scores.
    empty_rows = scores.amax(dim=-1, keepdim=True) == -math.inf
    has_empty_rows = bool(empty_rows.any())
    if has_empty_rows:
        scores = scores.masked_fill(empty_rows, 0.0)
    probs = torch.softmax(scores, dim=-1)
    if has_empty_rows:
        probs = probs.masked_fill(empty_rows, 0.0)
    out = probs.view(batch, kv_heads, num_blocks, mask_group, -1, slots * kv_block) @ values
    out = out.view(batch, kv_heads, num_blocks, group, q_block, plan.value_dim)
    out = out.permute(0, 1, 3, 2, 4, 5).reshape(batch, plan.q_heads, -1, plan.value_dim)
    valid_rows = min(plan.q_len, chunk.stop * q_block) - chunk.start * q_block
    out = out[:, :, :valid_rows].to(q_rows.dtype)
    if not return_lse:
        return (out,)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    if has_empty_rows:
        lse = lse.masked_fill(empty_rows, -math.inf)
    lse = lse.view(batch, kv_heads, num_blocks, group, q_block).permute(0, 1, 3, 2, 4)
    return out, lse.reshape(batch, plan.q_heads, -1)[:, :, :valid_rows]


def _resolve_mod_evals(
    plan: _Plan, chunks: list[_Chunk], query: Tensor, mod_eval: str
) -> tuple[str, str]:
    """Turns ``"auto"`` into ``"broadcast"`` or ``"vmap"`` by probing the first chunk once.

    Probing here, outside autograd and checkpointing, keeps every chunk's forward the same
    sequence of ops on its first run and on its recompute.
    """
    if mod_eval != "auto":
        return mod_eval, mod_eval
    mask_eval = score_eval = "broadcast"
    with torch.no_grad():
        probe = next((c for c in chunks if max(plan.partial_counts[c.start : c.stop]) > 0), None)
        if probe is not None:
            idx = _chunk_indices(plan, probe, query.device)
            partial_kv = idx.kv_idx[..., : probe.partial_slots, :]
            shape = (
                plan.batch,
                plan.kv_heads,
                probe.stop - probe.start,
                plan.group,
                plan.q_block,
                probe.partial_slots,
                plan.kv_block,
            )
            if not _broadcasts(plan.mask_mod, (idx.b, idx.h, idx.q_idx, partial_kv), shape):
                mask_eval = "vmap"
        if plan.score_mod is not None:
            first = chunks[0]
            idx = _chunk_indices(plan, first, query.device)
            slots = first.partial_slots + first.full_slots
            shape = (
                plan.batch,
                plan.kv_heads,
                first.stop - first.start,
                plan.group,
                plan.q_block,
                slots,
                plan.kv_block,
            )
            score = torch.zeros(shape, dtype=plan.working_dtype, device=query.device)
            if not _broadcasts(plan.score_mod, (score, idx.b, idx.h, idx.q_idx, idx.kv_idx), shape):
                score_eval = "vmap"
    return mask_eval, score_eval


def _broadcasts(fn: Callable[..., Tensor], args: Sequence[Tensor], shape: tuple[int, ...]) -> bool:
    """True when ``fn`` accepts broadcasting index tensors and answers in ``shape``."""
    try:
        result = fn(*args)
    except Exception:  # any failure means "needs scalars": the vmap path will tell if it is real
        return False
    return isinstance(result, Tensor) and _fits(result, shape)


def _fits(result: Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(result.shape, shape) == torch.Size(shape)
    except RuntimeError:
        return False


def _call_mod(
    fn: Callable[..., Tensor],
    args: Sequence[Tensor],
    shape: tuple[int, ...],
    mod_eval: str,
    name: str,
) -> Tensor:
    if mod_eval == "vmap":
        result = _vmap_broadcast(fn, args, shape)
    else:
        result = fn(*args)
        if not isinstance(result, Tensor) or not _fits(result, shape):
            got = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
            raise ValueError(
                f"{name} called with broadcasting index tensors returned {got}, which does not "
                f"broadcast to the scores' shape {shape}; pass mod_eval='vmap' to call it on "
                "scalars as flex_attention does"
            )
    if name == "mask_mod" and result.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor, got dtype {result.dtype}")
    return result


def _vmap_broadcast(
    fn: Callable[..., Tensor], args: Sequence[Tensor], shape: tuple[int, ...]
) -> Tensor:
    """Calls ``fn`` elementwise on 0-d tensors over the broadcast of ``args`` (which is ``shape``).

    One ``torch.vmap`` level per dim of ``shape`` longer than 1, the way
    ``flex_attention._vmap_for_bhqkv`` nests them, with ``in_dims=None`` for the arguments that
    are broadcast along that dim, so index tensors are never expanded in memory.
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    ndim = len(shape)
    args = [a.reshape((1,) * (ndim - a.dim()) + tuple(a.shape)) for a in args]
    mapped_dims = [d for d in range(ndim) if shape[d] != 1]
    squeezed = [a.reshape([s for s in a.shape if s != 1]) for a in args]
    mapped = fn
    for d in reversed(mapped_dims):
        in_dims = tuple(0 if a.size(d) != 1 else None for a in args)
        mapped = torch.vmap(mapped, in_dims=in_dims)
    # Inside vmap, ``lookup[q_idx]`` must become aten.index to batch; this mode does that.
    with TransformGetItemToIndex():
        result = mapped(*squeezed)
    return result.reshape(shape)
