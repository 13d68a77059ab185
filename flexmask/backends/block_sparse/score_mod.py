"""The ``score_mod`` kernel: chunks of consecutive q blocks that share their kv columns,
each under activation checkpointing, with ``score_mod`` and ``mask_mod`` evaluated per chunk."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from flexmask.backends.mod_eval import broadcasts, call_mod
from flexmask.backends.plan import Plan, pad_to_blocks
from flexmask.blocks import EMPTY, PARTIAL

# A chunk stops growing when fewer than this share of its (q block, column) pairs are listed:
# the union of columns is computed for every q block of the chunk, listed or not.
MIN_CHUNK_DENSITY = 0.5


def chunked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: Plan,
    mod_eval: str,
    recompute: bool,
    max_chunk_elements: int,
    needs_grad: bool,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """The autograd path, for a score_mod: chunks of consecutive q blocks, checkpointed."""
    chunks = plan_chunks(plan, max_chunk_elements)
    mask_eval, score_eval = resolve_mod_evals(plan, chunks, query, mod_eval)

    # Padded once to whole blocks. The query is split into the chunks' rows in one op, so the
    # backward assembles its gradient once instead of adding a full-size one per chunk.
    q_pieces = pad_to_blocks(query, plan.q_block).split(
        [(c.stop - c.start) * plan.q_block for c in chunks], dim=2
    )
    keys = pad_to_blocks(key, plan.kv_block)
    values = pad_to_blocks(value, plan.kv_block)

    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for chunk, q_piece in zip(chunks, q_pieces, strict=True):
        args = (q_piece, keys, values, plan, chunk, mask_eval, score_eval, return_lse)
        if recompute and needs_grad:
            # Non-reentrant checkpointing: only the arguments are kept; the chunk's scores and
            # probabilities are rebuilt when its backward runs.
            result = checkpoint(
                chunk_attention, *args, use_reentrant=False, preserve_rng_state=False
            )
        else:
            result = chunk_attention(*args)
        outs.append(result[0])
        if return_lse:
            lses.append(result[1])
    out = torch.cat(outs, dim=2)
    if return_lse:
        return out, torch.cat(lses, dim=2)
    return out


class Chunk(NamedTuple):
    start: int  # first q block
    stop: int  # one past the last q block
    columns: Tensor  # kv blocks attended by some q block of the chunk, ascending, on the CPU
    first_column: int | None  # set when ``columns`` is a contiguous run: slice, don't gather
    partial_columns: tuple[int, int] | None  # positions in ``columns`` spanning partial blocks


class ChunkIndices(NamedTuple):
    """Index tensors of one chunk, broadcastable to (B, Hkv, G, C, Q_BLOCK, U, KV_BLOCK)."""

    b: Tensor
    h: Tensor
    q_idx: Tensor  # clamped to Q_LEN - 1
    kv_idx: Tensor  # clamped to KV_LEN - 1
    # Listed block and token below KV_LEN: (B | 1, Hkv | 1, G | 1, C, 1, U, KV_BLOCK).
    allowed: Tensor
    kinds: Tensor  # (B | 1, Hkv | 1, G | 1, C, 1, U, 1)


def plan_chunks(plan: Plan, max_elements: int) -> list[Chunk]:
    """Groups consecutive q blocks while the chunk fits the budget and stays dense enough."""
    num_q_blocks = plan.listed.size(0)
    counts = plan.listed.sum(dim=-1).tolist()

    def cost(q_blocks: int, columns: int) -> int:
        return plan.batch * plan.q_heads * q_blocks * plan.q_block * columns * plan.kv_block

    chunks: list[Chunk] = []
    start = 0
    while start < num_q_blocks:
        stop, union, listed = start + 1, plan.listed[start], counts[start]
        while stop < num_q_blocks:
            grown = union | plan.listed[stop]
            width = int(grown.sum())
            q_blocks = stop + 1 - start
            if cost(q_blocks, width) > max_elements or (
                listed + counts[stop] < MIN_CHUNK_DENSITY * q_blocks * width
            ):
                break
            stop, union, listed = stop + 1, grown, listed + counts[stop]
        columns = union.nonzero().flatten()
        if columns.numel() == 0:
            columns = torch.zeros(1, dtype=torch.long)  # nothing listed: one absent column
        first, last = int(columns[0]), int(columns[-1])
        contiguous = last - first + 1 == columns.numel()
        partial = plan.partial[start:stop, columns].any(dim=0).nonzero().flatten().tolist()
        partial_span = (partial[0], partial[-1] + 1) if partial else None
        first_column = first if contiguous else None
        chunks.append(Chunk(start, stop, columns, first_column, partial_span))
        start = stop
    return chunks


def chunk_indices(plan: Plan, chunk: Chunk, device: torch.device) -> ChunkIndices:
    columns = chunk.columns.to(device)
    num_blocks, num_columns = chunk.stop - chunk.start, columns.numel()
    kinds = plan.kinds[..., chunk.start : chunk.stop, :].index_select(-1, columns)
    kinds = kinds.unsqueeze(-2).unsqueeze(-1)  # (B | 1, Hkv | 1, G | 1, C, 1, U, 1)
    kv_tokens = columns[:, None] * plan.kv_block + torch.arange(plan.kv_block, device=device)
    kv_tokens = kv_tokens.view(1, 1, 1, 1, 1, num_columns, plan.kv_block)
    q_tokens = torch.arange(chunk.start * plan.q_block, chunk.stop * plan.q_block, device=device)
    return ChunkIndices(
        b=torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1, 1),
        h=torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, plan.group, 1, 1, 1, 1),
        q_idx=q_tokens.clamp(max=plan.q_len - 1).view(1, 1, 1, num_blocks, plan.q_block, 1, 1),
        kv_idx=kv_tokens.clamp(max=plan.kv_len - 1),
        allowed=(kinds != EMPTY) & (kv_tokens < plan.kv_len),
        kinds=kinds,
    )


def chunk_attention(
    q_piece: Tensor,
    keys: Tensor,
    values: Tensor,
    plan: Plan,
    chunk: Chunk,
    mask_eval: str,
    score_eval: str,
    return_lse: bool,
) -> tuple[Tensor, ...]:
    """Attention for the q blocks of one chunk: (out rows,) or (out rows, lse rows).

    ``q_piece`` holds the chunk's query rows (padded to whole q blocks); ``keys``/``values`` are
    the whole key and value padded to whole kv blocks.
    """
    batch, kv_heads, group = plan.batch, plan.kv_heads, plan.group
    q_block, kv_block = plan.q_block, plan.kv_block
    num_blocks, num_columns = chunk.stop - chunk.start, chunk.columns.numel()
    idx = chunk_indices(plan, chunk, q_piece.device)

    # Query heads of one kv head side by side: one (G * C * Q_BLOCK, D) matrix per kv head, so
    # each (batch, kv head) is a single large matmul.
    queries = q_piece.reshape(batch, kv_heads, -1, plan.head_dim)
    queries = queries.to(plan.working_dtype) * plan.scale
    if chunk.first_column is not None:
        lo = chunk.first_column * kv_block
        keys = keys[:, :, lo : lo + num_columns * kv_block]
        values = values[:, :, lo : lo + num_columns * kv_block]
    else:

        def gather(tensor: Tensor) -> Tensor:
            blocks = tensor.reshape(batch, kv_heads, -1, kv_block * tensor.size(-1))
            picked = blocks.index_select(2, chunk.columns.to(blocks.device))
            return picked.view(batch, kv_heads, num_columns * kv_block, tensor.size(-1))

        keys, values = gather(keys), gather(values)
    keys, values = keys.to(plan.working_dtype), values.to(plan.working_dtype)

    full_shape = (batch, kv_heads, group, num_blocks, q_block, num_columns, kv_block)
    scores = (queries @ keys.transpose(-1, -2)).view(full_shape)
    if plan.score_mod is not None:
        scores = call_mod(
            plan.score_mod,
            (scores, idx.b, idx.h, idx.q_idx, idx.kv_idx),
            full_shape,
            score_eval,
            "score_mod",
        )
        if scores.shape != full_shape:
            scores = scores.expand(full_shape)

    # Absent blocks and tokens past KV_LEN first, from a block-level mask that broadcasts (and
    # is skipped when everything is allowed); then mask_mod, in place, on the span of columns
    # that are partial somewhere, applied only to the partial pairs.
    if not bool(idx.allowed.all()):
        scores = torch.where(idx.allowed, scores, -math.inf)
    elif chunk.partial_columns is not None and plan.score_mod is not None:
        # score_mod's result may be saved for its backward, or be an expanded view: the
        # in-place fill below must write into a tensor of our own.
        scores = scores.clone(memory_format=torch.contiguous_format)
    if chunk.partial_columns is not None:
        first, stop = chunk.partial_columns
        by_mask_mod = call_mod(
            plan.mask_mod,
            (idx.b, idx.h, idx.q_idx, idx.kv_idx[..., first:stop, :]),
            (*full_shape[:-2], stop - first, kv_block),
            mask_eval,
            "mask_mod",
        )
        refused = (idx.kinds[..., first:stop, :] == PARTIAL) & ~by_mask_mod
        scores[..., first:stop, :].masked_fill_(refused, -math.inf)
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
    out = probs.view(batch, kv_heads, -1, num_columns * kv_block) @ values
    out = out.view(batch, plan.q_heads, -1, plan.value_dim)
    valid_rows = min(plan.q_len, chunk.stop * q_block) - chunk.start * q_block
    out = out[:, :, :valid_rows].to(q_piece.dtype)
    if not return_lse:
        return (out,)
    lse = torch.logsumexp(scores, dim=-1)
    if has_empty_rows:
        lse = lse.masked_fill(empty_rows.squeeze(-1), -math.inf)
    return out, lse.view(batch, plan.q_heads, -1)[:, :, :valid_rows]


def resolve_mod_evals(
    plan: Plan, chunks: list[Chunk], query: Tensor, mod_eval: str
) -> tuple[str, str]:
    """Turns ``"auto"`` into ``"broadcast"`` or ``"vmap"`` by probing one chunk per mod.

    Probing here, outside autograd and checkpointing, keeps every chunk's forward the same
    sequence of ops on its first run and on its recompute.
    """
    if mod_eval != "auto":
        return mod_eval, mod_eval
    mask_eval = score_eval = "broadcast"
    with torch.no_grad():
        probe = next((c for c in chunks if c.partial_columns is not None), None)
        if probe is not None:
            idx = chunk_indices(plan, probe, query.device)
            first, stop = probe.partial_columns  # type: ignore[misc]
            shape = (
                plan.batch,
                plan.kv_heads,
                plan.group,
                probe.stop - probe.start,
                plan.q_block,
                stop - first,
                plan.kv_block,
            )
            args = (idx.b, idx.h, idx.q_idx, idx.kv_idx[..., first:stop, :])
            if not broadcasts(plan.mask_mod, args, shape):
                mask_eval = "vmap"
        if plan.score_mod is not None:
            probe = chunks[0]
            idx = chunk_indices(plan, probe, query.device)
            shape = (
                plan.batch,
                plan.kv_heads,
                plan.group,
                probe.stop - probe.start,
                plan.q_block,
                probe.columns.numel(),
                plan.kv_block,
            )
            score = torch.zeros(shape, dtype=plan.working_dtype, device=query.device)
            if not broadcasts(plan.score_mod, (score, idx.b, idx.h, idx.q_idx, idx.kv_idx), shape):
                score_eval = "vmap"
    return mask_eval, score_eval
