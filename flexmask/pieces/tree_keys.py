"""A tree's parents as the piece holds them: checked all rows at once, keyed by one digest.

An RL step re-makes ``tree(parents)`` from its data every step, and a cache hit then costs
what making the mask costs. So making one does only what the key and the checks need — a
copy, a few vectorized passes over every row at once and one digest of the values — and leaves
the order (preorder ranks, subtree ends, ``flexmask.pieces.tree_order``) to the first build.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_parents, digest, int_vector, is_nested


def parent_rows(parents: Any) -> tuple[list[Tensor], bool, str]:
    """``(rows, per_row, digest)``: each row's parents as int64 on the CPU (the piece's own
    copy), whether one was given per batch row, and the content digest of them all.

    Raises the errors ``check_parents`` raises, naming the first bad row (``parents[i]``) and
    value: an empty row, a parent that is not an earlier token or -1, non-integers.
    """
    per_row = is_nested(parents)
    if per_row and isinstance(parents, Tensor):
        # One copy of the whole table, checked and digested as one: its rows are its views.
        if parents.shape[0] == 0:
            raise ValueError("parents must hold at least one batch row, got a (0, n) tensor")
        flat = int_vector(parents.reshape(-1), "parents")
        rows = list(flat.view(parents.shape).unbind(0))
    else:
        given = list(parents) if per_row else [parents]
        if not given:
            raise ValueError("parents must hold at least one batch row, got an empty list")
        rows = [int_vector(p, _name(i, per_row)) for i, p in enumerate(given)]
        flat = rows[0] if len(rows) == 1 else torch.cat(rows)
    lengths = [row.numel() for row in rows]
    narrow = _narrowed(flat, lengths)
    if narrow is None:
        for i, row in enumerate(rows):  # the first bad row raises, named and explained
            check_parents(row, _name(i, per_row))
        raise RuntimeError("a tree's parents failed the vectorized check only")
    # The lengths fix the narrow type and where each row starts: equal digests are equal
    # rows, however they were given (lists, tensors, one table).
    return rows, per_row, digest(torch.tensor(lengths), narrow)


def _name(row: int, per_row: bool) -> str:
    return f"parents[{row}]" if per_row else "parents"


def _narrowed(flat: Tensor, lengths: list[int]) -> Tensor | None:
    """``flat`` (every row's parents, one row after another) in the smallest integer type
    that holds ``[-1, longest)``, so the digest reads 2 or 4 bytes a token, not 8; None
    where a row is empty or some parent is neither -1 nor an earlier token of its row.

    Three passes over the values whatever B is: their extremes (which also make the
    narrowing lossless), the narrowing, and the greatest of parent less position (a
    difference that fits the narrow type; torch's CPU compares into bools take several
    times as long).
    """
    if min(lengths) == 0:
        return None
    longest = max(lengths)
    low, high = (int(v) for v in flat.aminmax())
    if low < -1 or high >= longest:
        return None
    dtype = torch.int16 if longest <= torch.iinfo(torch.int16).max else torch.int32
    if longest > torch.iinfo(torch.int32).max:
        dtype = torch.int64
    narrow = flat.to(dtype)
    if len(set(lengths)) == 1:  # rows of one length: compared as a table
        ahead = narrow.view(len(lengths), longest) - torch.arange(longest, dtype=dtype)
    else:
        counts = torch.tensor(lengths)
        starts = (counts.cumsum(0) - counts).repeat_interleave(counts)
        ahead = narrow - (torch.arange(flat.numel()) - starts).to(dtype)
    return None if int(ahead.max()) >= 0 else narrow
