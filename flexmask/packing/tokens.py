"""Token inputs and bins: validating sequences of token ids, and assigning pieces to rows."""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from flexmask._validate import check_fits

Device = torch.device | str | None
Policy = Literal["split", "reject"]
Strategy = Literal["first_fit_decreasing", "best_fit_decreasing", "next_fit"]

_POLICIES = ("split", "reject")
_STRATEGIES = ("first_fit_decreasing", "best_fit_decreasing", "next_fit")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def _token_list(
    seq: Any,
    index: int,
    name: str = "sequences",
    *,
    allow_empty: bool = False,
    allow_negative: bool = False,
) -> list[int]:
    """Validates ``name[index]`` and returns it as a list of Python ints.

    Token ids index the embedding and the logits, so they must be >= 0: a negative id would
    wrap to the end of the vocabulary in ``x[id]`` instead of failing. ``allow_negative`` is
    for label lists, where a negative value is the ignore index.
    """
    where = f"{name}[{index}]"
    if isinstance(seq, (str, bytes)):
        raise TypeError(
            f"{where} is a {type(seq).__name__}; pass token ids (tokenize the text first)"
        )
    if not isinstance(seq, torch.Tensor) and hasattr(seq, "__array__"):
        # numpy arrays: one dtype check instead of one per element.
        try:
            seq = torch.as_tensor(seq)
        except (TypeError, RuntimeError) as error:
            raise TypeError(f"{where} is an array torch cannot read as integers: {error}") from None
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            raise ValueError(
                f"{where} is a {seq.dim()}-d tensor of shape {tuple(seq.shape)}; each sequence "
                "must be 1-d (a 2-d tensor can be passed as sequences itself, one row each)"
            )
        if seq.dtype == torch.bool or seq.dtype.is_floating_point or seq.dtype.is_complex:
            raise TypeError(
                f"{where} has dtype {seq.dtype}; token tensors need an integer dtype such as "
                "torch.int64"
            )
        tokens = seq.tolist()
    elif isinstance(seq, Sequence):
        tokens = seq if isinstance(seq, list) else list(seq)  # read only, so no copy needed
        # Fast path, at C speed: nothing but plain ints (a bool's type is bool, not int).
        if not set(map(type, tokens)) <= {int}:
            tokens = [_token_value(t, f"{where}[{j}]") for j, t in enumerate(tokens)]
    elif isinstance(seq, Mapping):
        raise TypeError(
            f"{where} is a {type(seq).__name__} with keys {sorted(map(str, seq))}; pass the "
            "token list itself (e.g. item['input_ids']), or PackingCollator(key='input_ids')"
        )
    elif isinstance(seq, numbers.Integral) and not isinstance(seq, bool):
        raise TypeError(
            f"{where} is the int {seq!r}; sequences must be a list of sequences, e.g. "
            "[[1, 2, 3], [4, 5]], not one flat list of tokens"
        )
    else:
        raise TypeError(
            f"{where} is a {type(seq).__name__}; each sequence must be a list/tuple of ints or "
            "a 1-d integer tensor"
        )
    if not tokens:
        if allow_empty:
            return []
        raise ValueError(f"{where} is empty; every sequence needs at least one token")
    lo, hi = min(tokens), max(tokens)
    if lo < _INT64_MIN or hi > _INT64_MAX:
        bad = lo if lo < _INT64_MIN else hi
        raise ValueError(f"{where} holds the token {bad}, which does not fit in int64")
    if lo < 0 and not allow_negative:
        at = tokens.index(lo)
        raise ValueError(
            f"{where}[{at}] is the token id {lo}; token ids must be >= 0 (they index the "
            "vocabulary, where a negative id would silently wrap to the end)"
        )
    return tokens


def _token_value(token: Any, where: str) -> int:
    if isinstance(token, torch.Tensor):
        if token.dim() == 0 and not token.dtype.is_floating_point and token.dtype != torch.bool:
            return int(token)
    elif isinstance(token, numbers.Integral) and not isinstance(token, bool):
        return int(token)
    # numpy.bool_ is not numbers.Integral, so it lands here together with floats and strings.
    raise TypeError(
        f"{where} is {token!r} ({type(token).__name__}); tokens must be integers (int, a numpy "
        "integer or a 0-d integer tensor), not bools, floats or strings"
    )


def _token_lists(
    sequences: Any,
    name: str = "sequences",
    *,
    allow_empty: bool = False,
    allow_negative: bool = False,
) -> list[list[int]]:
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
        raise TypeError(
            f"{name} must be an iterable of token sequences, got {type(sequences).__name__}"
        )
    if isinstance(sequences, torch.Tensor) and sequences.dim() < 2:
        raise ValueError(
            f"{name} is a {sequences.dim()}-d tensor; pass a list of 1-d tensors or a 2-d "
            "tensor with one sequence per row (to pack one sequence, pass [tensor])"
        )
    token_lists = [
        _token_list(seq, i, name, allow_empty=allow_empty, allow_negative=allow_negative)
        for i, seq in enumerate(sequences)
    ]
    if not token_lists:
        raise ValueError(f"{name} is empty; pass at least one sequence to pack")
    return token_lists


def _labels(
    name: str, values: Any, token_lists: list[list[int]], ignore_index: int
) -> list[list[int]]:
    """Per-sequence label lists, one per sequence and each as long as its sequence.

    A label is a token id (>= 0) or ``ignore_index``; any other negative value would wrap as an
    index into the logits, or be read as "ignore" by a loss with another ignore index.
    """
    lists = _token_lists(values, name, allow_empty=True, allow_negative=True)
    _check_aligned(name, lists, token_lists)
    for i, labels in enumerate(lists):
        if labels and min(labels) < 0:
            found = [(t, v) for t, v in enumerate(labels) if v < 0 and v != ignore_index]
            if found:
                t, bad = found[0]
                raise ValueError(
                    f"{name}[{i}][{t}] is {bad}; a label is a token id (>= 0) or "
                    f"ignore_index={ignore_index}"
                )
    return lists


def _loss_masks(name: str, values: Any, token_lists: list[list[int]]) -> list[list[bool]]:
    """Per-sequence masks of bools (or 0/1), one per sequence and each as long as its sequence."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(
            f"{name} must be an iterable with one mask per sequence, got {type(values).__name__}"
        )
    masks = []
    for i, mask in enumerate(values):
        where = f"{name}[{i}]"
        if isinstance(mask, torch.Tensor) or hasattr(mask, "__array__"):
            mask = torch.as_tensor(mask)
            if mask.dim() != 1:
                raise ValueError(f"{where} must be 1-d, got shape {tuple(mask.shape)}")
            if mask.dtype.is_floating_point or mask.dtype.is_complex:
                raise TypeError(f"{where} has dtype {mask.dtype}; pass bools (or 0/1 ints)")
            mask = mask.tolist()
        elif not isinstance(mask, Sequence) or isinstance(mask, (str, bytes)):
            raise TypeError(
                f"{where} is a {type(mask).__name__}; each mask must be a list of bools or a "
                "1-d bool tensor"
            )
        if not set(map(type, mask)) <= {bool, int}:
            mask = [_mask_value(v, where) for v in mask]
        if not set(mask) <= {0, 1}:  # True == 1 and False == 0
            bad = next(v for v in mask if v not in (0, 1))
            raise ValueError(f"{where} holds {bad!r}; a loss mask holds only True/False (or 1/0)")
        masks.append([bool(v) for v in mask])
    _check_aligned(name, masks, token_lists)
    return masks


def _mask_value(value: Any, where: str) -> bool | int:
    """One loss-mask entry that is not a plain bool/int: a numpy bool/integer or a 0-d tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not (value.dtype.is_floating_point or value.dtype.is_complex):
            return value.item()  # type: ignore[return-value]
    elif isinstance(value, numbers.Integral):  # numpy integers
        return int(value)
    elif getattr(getattr(value, "dtype", None), "kind", None) == "b":  # numpy.bool_
        return bool(value)
    raise TypeError(f"{where} holds {value!r}; a loss mask holds only True/False (or 1/0)")


def _check_aligned(name: str, lists: Sequence[Sequence[Any]], token_lists: list[list[int]]) -> None:
    if len(lists) != len(token_lists):
        raise ValueError(
            f"{name} has {len(lists)} entries but there are {len(token_lists)} sequences; pass "
            "one per sequence"
        )
    for i, (values, tokens) in enumerate(zip(lists, token_lists, strict=True)):
        if len(values) != len(tokens):
            raise ValueError(
                f"{name}[{i}] has {len(values)} entries but sequences[{i}] has {len(tokens)} "
                "tokens; they must be aligned one to one"
            )


# --------------------------------------------------------------------------------------------
# Bin packing: each returns, for every piece, the row it goes to (rows numbered from 0).
# --------------------------------------------------------------------------------------------


def _first_fit(lengths: Sequence[int], capacity: int) -> list[int]:
    # A max segment tree over the remaining capacity of every row that could ever be needed
    # (one per piece) finds the lowest-numbered row with room in O(log n); untouched rows have
    # full capacity, so "open a new row" is just first fit landing on the next unused row.
    n = len(lengths)
    size = 1
    while size < n:
        size *= 2
    room = [0] * (2 * size)
    room[size : size + n] = [capacity] * n
    for node in range(size - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
    rows = []
    for length in lengths:
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        rows.append(node - size)
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return rows


def _best_fit(lengths: Sequence[int], capacity: int) -> list[int]:
    # Open rows sorted by (remaining room, row); the first entry with room >= length is the
    # tightest fit, ties going to the lowest row.
    open_rows: list[tuple[int, int]] = []
    rows = []
    num_rows = 0
    for length in lengths:
        at = bisect.bisect_left(open_rows, (length, -1))
        if at < len(open_rows):
            room, row = open_rows.pop(at)
        else:
            room, row = capacity, num_rows
            num_rows += 1
        rows.append(row)
        if room > length:
            bisect.insort(open_rows, (room - length, row))
    return rows


def _next_fit(lengths: Sequence[int], capacity: int) -> list[int]:
    rows = []
    row, room = 0, capacity
    for length in lengths:
        if length > room:
            row, room = row + 1, capacity
        rows.append(row)
        room -= length
    return rows


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    offsets = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    shift = torch.repeat_interleave(starts - offsets, lengths, output_size=total)
    return shift + torch.arange(total)


# --------------------------------------------------------------------------------------------
# Memory: a size whose padded tensors this process could never hold is refused up front.
# --------------------------------------------------------------------------------------------


def _check_memory(nbytes: int, what: str, culprit: str, advice: str) -> None:
    """Raises ValueError, before anything is allocated, when the padded tensors (written in
    full, so needing real memory) exceed what this process can hold on the CPU; nothing
    smaller is refused, however much of it is padding."""
    check_fits(nbytes, torch.device("cpu"), culprit, advice, purpose=what)
