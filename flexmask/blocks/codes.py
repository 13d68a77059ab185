"""Block codes and their algebra: the first stage of a build.

A BlockMask splits the (q, kv) plane into ``q_block x kv_block`` tiles. Every piece of a mask
classifies each tile as EMPTY (no element attends), FULL (every in-range element attends) or
PARTIAL (some do), from its own structure. Combining codes with ``&``, ``|`` and ``~`` is exact
except where two PARTIAL tiles meet: the result is then UNDECIDED and the build refines those
tiles alone (``flexmask.builders.classify``).
"""

from __future__ import annotations

import torch
from torch import Tensor

EMPTY = 0
PARTIAL = 1
FULL = 2
UNDECIDED = 3

CODE_DTYPE = torch.int8


def codes_from(nonempty: Tensor, full: Tensor) -> Tensor:
    """Turns exact (nonempty, full) booleans into block codes.

    ``full`` must imply ``nonempty``; both broadcast against each other.
    """
    # EMPTY=0, PARTIAL=1, FULL=2 is the sum of the two flags (full implies nonempty).
    return nonempty.view(CODE_DTYPE) + full.view(CODE_DTYPE)


def constant_codes(code: int, device: torch.device) -> Tensor:
    """A (1, 1, 1, 1) code tensor that broadcasts over any block grid."""
    return torch.full((1, 1, 1, 1), code, dtype=CODE_DTYPE, device=device)


def _table(rule) -> list[int]:
    return [rule(a, b) for a in range(4) for b in range(4)]


def _and_rule(a: int, b: int) -> int:
    if EMPTY in (a, b):
        return EMPTY  # EMPTY wins
    if a == FULL:
        return b  # FULL is neutral
    return a if b == FULL else UNDECIDED  # two partial tiles may or may not overlap


def _or_rule(a: int, b: int) -> int:
    if FULL in (a, b):
        return FULL
    if a == EMPTY:
        return b
    return a if b == EMPTY else UNDECIDED


_AND = torch.tensor(_table(_and_rule), dtype=CODE_DTYPE)
_OR = torch.tensor(_table(_or_rule), dtype=CODE_DTYPE)
_NOT = torch.tensor([FULL, PARTIAL, EMPTY, UNDECIDED], dtype=CODE_DTYPE)


def _lookup(table: Tensor, index: Tensor) -> Tensor:
    # One gather over the grid instead of a chain of where/eq passes.
    flat = index.reshape(-1).to(torch.int32)
    return table.to(index.device).index_select(0, flat).view(index.shape)


def and_codes(a: Tensor, b: Tensor) -> Tensor:
    """Block codes of ``a & b``: EMPTY wins, FULL is neutral, PARTIAL & PARTIAL is undecided."""
    return _lookup(_AND, a * 4 + b)


def or_codes(a: Tensor, b: Tensor) -> Tensor:
    """Block codes of ``a | b``: FULL wins, EMPTY is neutral, PARTIAL | PARTIAL is undecided."""
    return _lookup(_OR, a * 4 + b)


def not_codes(a: Tensor) -> Tensor:
    """Block codes of ``~a``: EMPTY and FULL swap, PARTIAL and UNDECIDED stay."""
    return _lookup(_NOT, a)
