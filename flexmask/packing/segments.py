"""What each input of a training step says about the documents of a packed batch.

Every input that knows something of the segmentation is read into a :class:`Claim`: per token
``(B, S)``, whether a document starts there and whether the token belongs to a document at
all (not padding) — either may be unknown. ``position_ids`` know where documents start but
not where padding is; a 0/1 ``attention_mask`` knows padding and says one document per row;
``seq_lens``, ``cu_seqlens`` and a mask's ``document`` know both. All work is vectorised:
a few tensor ops per input whatever the number of documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flexmask.algebra import Mask, conjuncts
from flexmask.pieces import Document, Tree


class Claim(NamedTuple):
    """What one input says. ``start[b, p]``: a document starts at token p of row b;
    ``real[b, p]``: the token is in a document (not padding). None: the input does not say."""

    name: str
    start: Tensor | None
    real: Tensor | None


class Disagreement(NamedTuple):
    """Where inputs disagree: ``row``, ``token`` (``S`` for "past the row"), the ``inputs``
    that disagree, and a ``message`` saying what each says there."""

    row: int
    token: int
    inputs: tuple[str, ...]
    message: str


def previous(x: Tensor, fill: Any) -> Tensor:
    """``x[:, p - 1]`` at every p of a ``(B, S)`` tensor, ``fill`` at p = 0."""
    return torch.cat([x.new_full((x.shape[0], 1), fill), x[:, :-1]], 1)


def following(x: Tensor, fill: Any) -> Tensor:
    """``x[:, p + 1]`` at every p, ``fill`` at the last token."""
    return torch.cat([x[:, 1:], x.new_full((x.shape[0], 1), fill)], 1)


def as_rows(value: Tensor, name: str, shape: tuple[int, int]) -> Tensor:
    """A per-token tensor as ``(B, S)``: ``(S,)`` and ``(1, S)`` broadcast to every row."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2 or value.shape[1] != shape[1] or value.shape[0] not in (1, shape[0]):
        raise ValueError(
            f"{name} must have shape (B, S) = {shape} (or (1, S)), got {tuple(value.shape)}"
        )
    return value.expand(shape)


def integer(value: Tensor, name: str) -> Tensor:
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    return value.long()


def from_positions(position_ids: Tensor) -> Claim:
    """A document starts where positions do not go on by one (the first token of a row
    included); ``check`` separately asks that they restart at 0 there."""
    pos = position_ids.long()
    start = pos != previous(pos, -2) + 1
    start[:, 0] = True
    return Claim("position_ids", start, None)


def from_seq_idx(seq_idx: Tensor) -> Claim:
    """Mamba-style ``seq_idx``: one index per document, changing where a document starts."""
    idx = seq_idx.long()
    start = idx != previous(idx, -1)
    start[:, 0] = True
    return Claim("seq_idx", start, None)


def from_attention_mask(mask: Tensor) -> tuple[Claim, bool]:
    """A 2-D ``attention_mask``: 0 at padding; 0/1 values are one sequence per row (what
    transformers reads from them), larger values are segment ids (one per document).
    Returns the claim and whether the values were segment ids."""
    values = mask.long() if mask.dtype != torch.bool else mask.to(torch.int64)
    real = values != 0
    segments = bool((values > 1).any())
    if segments:
        start = real & ((values != previous(values, 0)) | ~previous(real, False))
    else:
        start = real & ~previous(real, False)
    return Claim("attention_mask", start, real), segments


def from_lengths(
    name: str, lengths: Sequence[Tensor], shape: tuple[int, int]
) -> tuple[Claim, list[Disagreement]]:
    """Documents back to back from token 0 in each row (``seq_lens``, a ``document``): one
    tensor of lengths per row, or one for every row."""
    batch, seq_len = shape
    issues: list[Disagreement] = []
    rows = list(lengths) if len(lengths) == batch else [lengths[0]] * batch
    if len(lengths) not in (1, batch):
        issues.append(
            Disagreement(0, 0, (name,), f"{name} has {len(lengths)} rows but the batch has {batch}")
        )
        rows = [rows[0]] * batch
    counts = torch.tensor([r.numel() for r in rows])
    flat = torch.cat([r.long().view(-1) for r in rows]) if rows else torch.zeros(0)
    row_of = torch.repeat_interleave(torch.arange(batch), counts)
    ends = _cumsum_per_row(flat, counts)
    starts = ends - flat
    totals = torch.zeros(batch, dtype=torch.int64).index_add_(0, row_of, flat)
    over = (totals > seq_len).nonzero()
    if over.numel():
        b = int(over[0])
        issues.append(
            Disagreement(
                b,
                seq_len,
                (name,),
                f"{name}[{b}] sums to {int(totals[b])}, past the row's {seq_len} tokens: it was "
                f"made for other lengths",
            )
        )
    start = torch.zeros(shape, dtype=torch.bool)
    keep = (flat > 0) & (starts < seq_len)
    start[row_of[keep], starts[keep]] = True
    real = torch.arange(seq_len).view(1, -1) < totals.view(-1, 1)
    return Claim(name, start, real), issues


def _cumsum_per_row(flat: Tensor, counts: Tensor) -> Tensor:
    total = flat.cumsum(0)
    first = torch.cumsum(counts, 0) - counts
    before = torch.where(first > 0, total[(first - 1).clamp(min=0)], 0) if flat.numel() else first
    return total - torch.repeat_interleave(before, counts)


def from_cu_seqlens(
    cu_seqlens: Tensor | None,
    cu_seqlens_padded: Tensor | None,
    shape: tuple[int, int],
    max_seqlen: int | None,
) -> tuple[Claim, list[Disagreement]]:
    """Cumulative lengths over the ``B * S`` tokens laid end to end (flash-attn's varlen,
    transformers' flash path, TransformerEngine's THD). With ``cu_seqlens_padded`` each
    sequence sits at its padded offset and ``cu_seqlens`` gives its real length: the
    tokens past it, up to the next padded offset, are padding."""
    batch, seq_len = shape
    total = batch * seq_len
    issues: list[Disagreement] = []
    name = "cu_seqlens" if cu_seqlens is not None else "cu_seqlens_padded"
    cu = _cumulative(cu_seqlens if cu_seqlens is not None else cu_seqlens_padded, name)
    lengths = cu.diff()
    if cu_seqlens is not None and cu_seqlens_padded is not None:
        padded = _cumulative(cu_seqlens_padded, "cu_seqlens_padded")
        if padded.numel() != cu.numel():
            raise ValueError(
                f"cu_seqlens and cu_seqlens_padded must have the same length (one entry per "
                f"sequence, plus one), got {cu.numel()} and {padded.numel()}"
            )
        slots = padded.diff()
        short = (slots < lengths).nonzero()
        if short.numel():
            i = int(short[0])
            issues.append(
                _flat_issue(
                    int(padded[i]),
                    seq_len,
                    ("cu_seqlens", "cu_seqlens_padded"),
                    f"sequence {i} has {int(lengths[i])} real tokens (cu_seqlens) but a padded "
                    f"slot of {int(slots[i])} (cu_seqlens_padded)",
                )
            )
        starts = padded[:-1]
        name = "cu_seqlens (with cu_seqlens_padded)"
    else:
        starts = cu[:-1]
    ends = starts + lengths
    if ends.numel() and int(ends.max()) > total:
        issues.append(
            Disagreement(
                batch - 1,
                seq_len,
                (name,),
                f"{name} reaches token {int(ends.max())} of the flattened batch, which has "
                f"{total} (B * S = {batch} * {seq_len})",
            )
        )
    if max_seqlen is not None and lengths.numel() and int(lengths.max()) > max_seqlen:
        i = int(torch.argmax(lengths))
        issues.append(
            _flat_issue(
                int(starts[i]),
                seq_len,
                ("max_seqlen", name),
                f"sequence {i} has {int(lengths[i])} tokens, more than max_seqlen={max_seqlen}: "
                f"the kernel would not read its last tokens",
            )
        )
    keep = (lengths > 0) & (starts < total)
    start = torch.zeros(total, dtype=torch.bool)
    start[starts[keep]] = True
    cover = torch.zeros(total + 1, dtype=torch.int64)
    cover.index_add_(0, starts[keep].clamp(max=total), torch.ones_like(starts[keep]))
    cover.index_add_(0, ends[keep].clamp(max=total), -torch.ones_like(ends[keep]))
    real = cover.cumsum(0)[:total] > 0
    return Claim(name, start.view(shape), real.view(shape)), issues


def _cumulative(value: Any, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        value = torch.as_tensor(value)
    value = integer(value, name).view(-1).cpu()
    if value.numel() < 1 or int(value[0]) != 0:
        raise ValueError(f"{name} must start at 0 (cumulative lengths), got {value[:4].tolist()}")
    down = (value.diff() < 0).nonzero()
    if down.numel():
        i = int(down[0])
        raise ValueError(
            f"{name} must not decrease, but goes from {int(value[i])} to {int(value[i + 1])} "
            f"at entry {i + 1}"
        )
    return value


def _flat_issue(flat: int, seq_len: int, inputs: tuple[str, ...], message: str) -> Disagreement:
    return Disagreement(flat // seq_len, flat % seq_len, inputs, message)


def mask_claims(
    mask: Mask, name: str, shape: tuple[int, int]
) -> tuple[list[Claim], list[Disagreement]]:
    """The documents a mask's ``document`` pieces say (an ``&`` of them with anything else
    keeps their boundaries), and the tokens a ``tree`` piece holds."""
    claims: list[Claim] = []
    issues: list[Disagreement] = []
    for part in conjuncts(mask):
        if isinstance(part, Document):
            claim, found = from_lengths(f"{name}'s documents", part.seq_lens, shape)
            claims.append(claim)
            issues += found
        elif isinstance(part, Tree):
            sizes = torch.tensor([p.numel() for p in part.parents])
            rows = sizes if sizes.numel() == shape[0] else sizes[:1].expand(shape[0])
            real = torch.arange(shape[1]).view(1, -1) < rows.view(-1, 1)
            claims.append(Claim(f"{name}'s tree", None, real))
    return claims, issues


def has_tree(mask: Mask) -> bool:
    """Whether the mask ANDs a ``tree`` piece in (its positions are then depths)."""
    return any(isinstance(part, Tree) for part in conjuncts(mask))


def tree_depths(mask: Mask, shape: tuple[int, int]) -> Tensor | None:
    """``(B, S)`` depth of every node of the mask's ``tree`` piece (-1 past the tree), or None
    when it has none: the positions a tree's tokens must have."""
    for part in conjuncts(mask):
        if isinstance(part, Tree):
            rows = list(part.parents)
            if len(rows) == 1 and shape[0] > 1:
                rows = rows * shape[0]
            depth = torch.full(shape, -1, dtype=torch.int64)
            for b, parents in enumerate(rows[: shape[0]]):
                n = min(parents.numel(), shape[1])
                depth[b, :n] = _depths(parents.long().cpu())[:n]
            return depth
    return None


def _depths(parents: Tensor) -> Tensor:
    """Distance to the root of every node, by pointer doubling (log of the depth steps)."""
    up = parents.clone()
    depth = (up >= 0).long()
    while bool((up >= 0).any()):
        has = up >= 0
        ancestor = up.clamp(min=0)
        depth = torch.where(has, depth + depth[ancestor], depth)
        up = torch.where(has, up[ancestor], up)
    return depth


def runs(start: Tensor, real: Tensor) -> list[Tensor]:
    """Per row, the lengths of its runs: each document, and each stretch of padding between
    them, from token 0 to the end (what ``document`` takes to draw these boundaries)."""
    batch, seq_len = start.shape
    edge = start | (real != previous(real, True))
    edge[:, 0] = True
    where = edge.nonzero()
    row, pos = where[:, 0], where[:, 1]
    nxt = torch.cat([pos[1:], pos.new_tensor([seq_len])])
    same_row = torch.cat([row[1:] == row[:-1], row.new_tensor([False], dtype=torch.bool)])
    lengths = torch.where(same_row, nxt, seq_len) - pos
    counts = torch.bincount(row, minlength=batch).tolist()
    return list(lengths.split(counts))
