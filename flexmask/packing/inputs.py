"""Reading :func:`~flexmask.check_batch`'s inputs before any comparison: the batch's
``(B, S)``, ``seq_lens`` as lengths, ``position_ids`` as ``(B, S)`` integers. What cannot be
read is refused here, naming the input, what it is and what would be right: a guess (a
length cut to an integer, one row's shape taken for the batch's) would be checked silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int, int_vector
from flexmask.packing import kernel_args, segments
from flexmask.runtime import LazyBlockMask


def length_rows(seq_lens: Any) -> list[Tensor]:
    """One int64 tensor of document lengths per row, each checked: whole numbers >= 0 (a
    float length would be cut to an integer and a negative one would move every later
    document, so both are refused, naming the entry)."""
    rows: list[Any]
    if isinstance(seq_lens, Tensor) or hasattr(seq_lens, "__array__"):  # or a numpy array
        if seq_lens.ndim <= 1:
            rows, names = [seq_lens.reshape(-1)], ["seq_lens"]
        else:
            rows, names = list(seq_lens), [f"seq_lens[{b}]" for b in range(len(seq_lens))]
    elif isinstance(seq_lens, Sequence) and not isinstance(seq_lens, (str, bytes)):
        items = list(seq_lens)
        nested = [isinstance(r, (Sequence, Tensor)) and not isinstance(r, str) for r in items]
        if items and all(nested):
            rows, names = items, [f"seq_lens[{b}]" for b in range(len(items))]
        elif any(nested):
            raise TypeError(
                f"seq_lens must be one list of document lengths for every row or one list per "
                f"row, not a mix of numbers and lists: got {seq_lens!r}"
            )
        else:
            rows, names = [items], ["seq_lens"]
    else:
        raise TypeError(
            f"seq_lens must be a list of document lengths (one per row, or one for every "
            f"row) or a tensor of them, got {type(seq_lens).__name__}"
        )
    out = []
    for row, name in zip(rows, names, strict=True):
        lengths = int_vector(row, name)
        negative = (lengths < 0).nonzero()
        if negative.numel():
            i = int(negative[0, 0])
            raise ValueError(f"{name}[{i}] must be a document length >= 0, got {int(lengths[i])}")
        out.append(lengths)
    return out


_TRANSFORMERS_NAMES = {
    # flexmask's (flash-attn's) name -> transformers' names for it, as
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns them.
    "cu_seqlens": ("cu_seq_lens_q", "cu_seq_lens_k"),
    "max_seqlen": ("max_length_q", "max_length_k"),
}


def transformers_names(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with transformers' names (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``)
    folded into flexmask's (``cu_seqlens``, ``max_seqlen``). A packed batch attends within
    itself, so the q and k values are one set of boundaries: values given under several of
    these names must be equal, else ValueError naming two that differ (one of them would be
    checked and the other silently not)."""
    given = dict(given)
    for name, aliases in _TRANSFORMERS_NAMES.items():
        named = [(n, given.pop(n, None)) for n in (name, *aliases)]
        named = [(n, value) for n, value in named if value is not None]
        for other, value in named[1:]:
            if not _same(named[0][1], value):
                raise ValueError(
                    f"{named[0][0]} and {other} must be the same (check_batch reads one set of "
                    f"document boundaries for queries and keys), got {named[0][1]!r} and "
                    f"{value!r}; pass one of them"
                )
        given[name] = named[0][1] if named else None
    return given


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) or isinstance(b, (int, float)):
        return bool(a == b)
    a, b = torch.as_tensor(a).reshape(-1), torch.as_tensor(b).reshape(-1)
    return a.shape == b.shape and bool((a.long() == b.long()).all())


def positions(value: Tensor, shape: tuple[int, int]) -> Tensor:
    if isinstance(value, Tensor) and value.dim() == 3:  # multimodal RoPE: (3, B, S)
        value = value[0]
    return segments.integer(segments.as_rows(value, "position_ids", shape), "position_ids")


PER_TOKEN = (
    "input_ids",
    "labels",
    "position_ids",
    "attention_mask",
    "padding_mask",
    "loss_mask",
    "seq_idx",
)
"""The ``(B, S)`` inputs, whose shapes say the batch's."""


def shape_of(given: dict[str, Any]) -> tuple[int, int]:
    """The batch's ``(B, S)``: ``shape=`` where given, else the per-token tensors'. A ``(1,
    S)`` (or ``(S,)``) tensor is one row for every row, so it never sets B: with ``shape=(2,
    S)`` it is read for both rows, as transformers broadcasts ``(1, S)`` position_ids. Any
    other disagreement — two B above 1, two S, a tensor against ``shape`` — is a ValueError
    naming both, not a guess."""
    said: list[tuple[str, int | None, int]] = []  # (input, B or None where it broadcasts, S)
    if given["shape"] is not None:
        value = given["shape"]
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise TypeError(f"shape must be (B, S), got {value!r}")
        batch = check_int(value[0], "shape[0] (B)", minimum=1)
        said.append(("shape", batch, check_int(value[1], "shape[1] (S)", minimum=1)))
    for name in PER_TOKEN:
        value = given.get(name)
        if name == "position_ids" and isinstance(value, Tensor) and value.dim() == 3:
            value = value[0]  # multimodal RoPE: (3, B, S)
        if isinstance(value, Tensor) and value.dim() in (1, 2):
            rows = int(value.shape[0]) if value.dim() == 2 else 1
            said.append((name, rows if rows != 1 else None, int(value.shape[-1])))
    if said:
        first_s = said[0]
        for other in said[1:]:
            if other[2] != first_s[2]:
                raise ValueError(_shape_clash(first_s, other, "tokens per row"))
        with_rows = [(entry, entry[1]) for entry in said if entry[1] is not None]
        for other, rows in with_rows[1:]:
            if rows != with_rows[0][1]:
                raise ValueError(_shape_clash(with_rows[0][0], other, "rows"))
        return (with_rows[0][1] if with_rows else 1), first_s[2]
    for name in ("block_mask", "attention_mask"):
        value = given.get(name)
        if isinstance(value, (BlockMask, LazyBlockMask)) or (
            isinstance(value, Tensor) and value.dim() == 4
        ):
            return kernel_args.batch_shape(value)
    raise TypeError(
        "check_batch needs the batch's shape: give input_ids (or another (B, S) tensor), a "
        "block_mask, or shape=(B, S)"
    )


def _shape_clash(a: tuple[str, int | None, int], b: tuple[str, int | None, int], what: str) -> str:
    def says(entry: tuple[str, int | None, int]) -> str:
        name, rows, seq_len = entry
        if name == "shape":
            return f"shape=({rows}, {seq_len})"
        return f"{name} has shape ({rows if rows is not None else 1}, {seq_len})"

    return (
        f"the inputs disagree on the batch's {what}: {says(a)}, {says(b)}. Every per-token "
        f"input is (B, S) for the same B and S (or (1, S), read for every row)"
    )
