"""Global tokens (rows and columns that attend everything) composed of pieces.

No piece says "query ``i`` attends every key": every piece relates the two positions. A
global token ``g`` is still exact from two two-document splits, ``D_g`` (cut before ``g``)
and ``D_{g+1}`` (cut after it): the pair (q, kv) sits on one side of one cut and across the
other exactly when one of q, kv is ``g`` and the other is not, so ``D_g xor D_{g+1}`` is row
``g`` and column ``g`` less their crossing, which ``spans`` (``g`` alone in its span) adds.
Each piece lowers to every format, so the composition does too (``to_cudnn`` included).
"""

from __future__ import annotations

from typing import Any

from flexmask.algebra import Mask
from flexmask.pieces import document, empty, full, spans


def global_tokens(is_global: Any) -> Mask:
    """Every pair with a global query or a global key: ``is_global[q] or is_global[kv]``.

    Args:
        is_global: one bool per token (a list or a 1-D bool tensor); its length is the
            sequence length the mask is made for.

    Raises:
        TypeError: ``is_global`` is not a sequence of bools.
        ValueError: ``is_global`` is empty.

    Example:
        >>> from flexmask.gallery._global import global_tokens
        >>> print(global_tokens([False, True, False]).show(3))
        ⬚ ■ ⬚
        ■ ■ ■
        ⬚ ■ ⬚
    """
    flags = _flags(is_global)
    length = len(flags)
    chosen = [token for token, flag in enumerate(flags) if flag]
    if not chosen:
        return empty()
    ids = [-1] * length
    for number, token in enumerate(chosen):
        ids[token] = number
    mask: Mask = spans(ids)
    for token in chosen:
        before, after = _cut(token, length), _cut(token + 1, length)
        mask = mask | ((before | after) & ~(before & after))
    return mask


def _cut(at: int, length: int) -> Mask:
    """Same side of a cut before token ``at``: one document when the cut is at an end."""
    if at <= 0 or at >= length:
        return full()
    return document([at, length - at])


def _flags(is_global: Any) -> list[bool]:
    if hasattr(is_global, "tolist"):
        is_global = is_global.tolist()
    if isinstance(is_global, (str, bytes)) or not hasattr(is_global, "__len__"):
        raise TypeError(
            f"is_global must be one bool per token (a list or 1-D bool tensor), got "
            f"{type(is_global).__name__}"
        )
    flags = list(is_global)
    if not all(isinstance(flag, bool) for flag in flags):
        raise TypeError("is_global must hold bools (True where the token is global)")
    if not flags:
        raise ValueError("is_global must hold one bool per token, got none")
    return flags
