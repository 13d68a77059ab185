"""A tree's parents as the piece holds them: checked all rows at once, keyed by one digest.

An RL step re-makes ``tree(parents)`` from its data every step, and a cache hit then costs
what making the mask costs. So making one does only what the key and the checks need — one
narrowed copy of every row, a few vectorized passes over it and one digest of its bytes —
and leaves the int64 parents and the order (preorder ranks, subtree ends,
``flexmask.pieces.tree_order``) to the first build.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flexmask._cores import at_most_threads, others_busy
from flexmask._validate import (
    check_parents,
    digest,
    int_tensor,
    int_vector,
    is_nested,
    plain_ints,
)
from flexmask.pieces._base import tracing

_BUSY = 0.5
"""Other processes keeping this much of a core busy send the key's passes to one thread: a
parallel pass then waits for a descheduled thread (milliseconds, against microseconds for the
pass), as a build's do (``builders.threads.BUSY``)."""


class ParentRows(NamedTuple):
    """A tree's parents as made: ``flat`` every row's parents one row after another in the
    smallest integer type that holds ``[-1, longest)`` (the piece's own copy: later edits
    of the user's tensor change nothing), each row's length, whether one was given per batch
    row, and the content digest of them all."""

    flat: Tensor
    lengths: tuple[int, ...]
    per_row: bool
    digest: str


def parent_rows(parents: Any) -> ParentRows:
    """The tree's parents checked, narrowed and digested (``ParentRows``).

    Raises the errors ``check_parents`` raises, naming the first bad row (``parents[i]``) and
    value: an empty row, a parent that is not an earlier token or -1, non-integers.
    """
    per_row = is_nested(parents)
    with _one_thread_if_busy():
        values, lengths = _values(parents, per_row)
        flat = _narrowed(values, lengths)
        if flat is None:
            for i, row in enumerate(values.split(lengths)):  # the first bad row raises
                check_parents(row, _name(i, per_row))
            raise RuntimeError("a tree's parents failed the vectorized check only")
        # The lengths fix the narrow type and where each row starts: equal digests are equal
        # rows, however they were given (lists, tensors, one table).
        key = digest(torch.tensor(lengths), flat)
    return ParentRows(flat, tuple(lengths), per_row, key)


def _values(parents: Any, per_row: bool) -> tuple[Tensor, list[int]]:
    """Every row's integer values, one row after another, checked for type and shape, and
    each row's length. A table given is read in place (``_narrowed`` makes the copy); rows
    given apart are joined (one copy, then passes over all rows at once: at 4k a token a
    quarter of the time of a pass per row)."""
    if per_row and isinstance(parents, Tensor):
        if parents.shape[0] == 0:
            raise ValueError("parents must hold at least one batch row, got a (0, n) tensor")
        rows, length = parents.shape
        return _row_values(parents.reshape(-1), "parents"), [length] * rows
    given = list(parents) if per_row else [parents]
    if not given:
        raise ValueError("parents must hold at least one batch row, got an empty list")
    plain = plain_ints(given)  # lists of ints: one scan, one conversion
    if plain is not None:
        return plain, [len(row) for row in given]
    values = [_row_values(p, _name(i, per_row)) for i, p in enumerate(given)]
    return values[0] if len(values) == 1 else torch.cat(values), [v.numel() for v in values]


def _row_values(value: Any, name: str) -> Tensor:
    """A row's values: a CPU integer tensor given, in place; anything else converted."""
    if isinstance(value, Tensor):
        values = int_tensor(value, name)
        if values.device.type == "cpu" and values.dtype != torch.uint64:
            return values
    return int_vector(value, name)


def _name(row: int, per_row: bool) -> str:
    return f"parents[{row}]" if per_row else "parents"


def narrow_type(longest: int) -> torch.dtype:
    """The smallest integer type holding parents ``[-1, longest - 1]``, positions
    ``[0, longest - 1]`` and their differences ``[-longest, longest - 1]``."""
    for dtype in (torch.int16, torch.int32):
        if longest - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def _narrowed(values: Tensor, lengths: list[int]) -> Tensor | None:
    """``values`` (every row's parents, one row after another) copied into ``narrow_type``
    (the digest then reads 2 or 4 bytes a token, not 8); None where a row is empty or some
    parent is neither -1 nor an earlier token of its row.

    Three passes over the values: their extremes (which make the narrowing lossless), the
    narrowing copy, and the greatest of parent less position in the narrow type (torch's
    CPU compares into bools take several times as long).
    """
    if min(lengths) == 0:
        return None
    longest = max(lengths)
    low, high = (int(v) for v in values.aminmax())
    if low < -1 or high >= longest:
        return None
    dtype = narrow_type(longest)
    flat = values.to(dtype, copy=True)  # the piece's own copy, whoever holds ``values``
    # A trace's own tensors are never kept (``pieces._base.tracing``).
    positions = torch.arange(longest, dtype=dtype) if tracing() else _positions(longest, dtype)
    if len(set(lengths)) == 1:  # rows of one length: compared as a table
        ahead = (flat.view(len(lengths), longest) - positions).max()
    else:
        rows = flat.split(lengths)
        ahead = torch.stack([(row - positions[: row.numel()]).max() for row in rows]).max()
    return None if ahead.item() >= 0 else flat


@functools.lru_cache(maxsize=4)
def _positions(length: int, dtype: torch.dtype) -> Tensor:
    """``arange(length)`` in ``dtype``, kept for the next tree of that length (read only)."""
    return torch.arange(length, dtype=dtype)


def _one_thread_if_busy() -> contextlib.AbstractContextManager[None]:
    """One intra-op thread while other processes keep a core busy, else torch's own."""
    busy = torch.get_num_threads() > 1 and others_busy(busy=_BUSY)
    return at_most_threads(1) if busy else contextlib.nullcontext()
