"""One shape signature for every entry: ``(mask, B, H, Q_LEN, KV_LEN)`` in torch's order.

torch's ``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)`` is the order users know, so every
flexmask entry that takes a shape takes it so, with ``KV_LEN`` defaulting to ``Q_LEN`` (a
square window is the common case; before 0.2 some entries defaulted it to 128). Two lowerings
took ``(mask, B, Q_LEN, KV_LEN)`` before 0.2: their old calls keep working for a release with
a DeprecationWarning where they have one reading, and raise where the two orders would give
different results (``to_magi(mask, 1, 1, 1024)`` was one query against 1,024 keys and is now
1,024 queries and keys).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

OLD_DEFAULT_LENGTH = 128
"""What ``create_block_mask``, ``lazy`` and ``MaskCache.get`` built without ``Q_LEN`` before
0.2 (torch requires it)."""


def lengths(q_len: Any, kv_len: Any, entry: str, stacklevel: int = 3) -> tuple[Any, Any]:
    """``(Q_LEN, KV_LEN)`` of a call: ``KV_LEN`` None is ``Q_LEN``; ``Q_LEN`` None is the old
    128 (x 128 where ``KV_LEN`` is None too) with a DeprecationWarning. The values are
    checked where the spec is made."""
    if q_len is None:
        warnings.warn(
            f"{entry} without Q_LEN is deprecated (torch's create_block_mask requires it): "
            f"this release builds the old default Q_LEN={OLD_DEFAULT_LENGTH}, the next raises; "
            f"pass Q_LEN (KV_LEN defaults to it)",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return OLD_DEFAULT_LENGTH, OLD_DEFAULT_LENGTH if kv_len is None else kv_len
    return q_len, q_len if kv_len is None else kv_len


def torch_order(entry: F) -> F:
    """Wraps a lowering whose signature is now ``(mask, B, H, Q_LEN, KV_LEN=None, *, ...)``
    and was ``(mask, B, Q_LEN, KV_LEN=None, *, ...)`` before 0.2, reading its positional
    shape as the caller meant it:

    - ``(mask, B, S)`` (no ``Q_LEN``, which the new order requires): the old reading, with a
      DeprecationWarning;
    - ``(mask, B, Q, KV)`` with no other shape keyword: the old ``(B, Q_LEN=Q, KV_LEN=KV)``
      and the new ``(B, H=Q, Q_LEN=KV, KV_LEN=KV)``; where ``Q == KV`` both give the same
      lowering (these lowerings take one mask for every head), read the old way with a
      DeprecationWarning; otherwise a TypeError naming both readings;
    - anything else: the new order.
    """
    name = entry.__name__

    @functools.wraps(entry)
    def read(mask: Any, *shape: Any, **kwargs: Any) -> Any:
        named = {"B", "H", "Q_LEN", "KV_LEN"} & set(kwargs)
        if len(shape) == 2 and not named & {"H", "Q_LEN"}:
            batch, q_len = shape
            _warn_old(name, f"B={batch!r}, Q_LEN={q_len!r}", f"{batch!r}, 1, {q_len!r}")
            return entry(mask, batch, None, q_len, **kwargs)
        if len(shape) == 3 and not named:
            batch, second, third = shape
            if second != third:
                raise TypeError(
                    f"{name}(mask, {batch!r}, {second!r}, {third!r}) reads two ways: before "
                    f"0.2 as (B={batch!r}, Q_LEN={second!r}, KV_LEN={third!r}), now in "
                    f"torch's order as (B={batch!r}, H={second!r}, Q_LEN={third!r}, "
                    f"KV_LEN={third!r}). Pass all four, {name}(mask, B, H, Q_LEN, KV_LEN): "
                    f"{name}(mask, {batch!r}, 1, {second!r}, {third!r}) for the old reading"
                )
            _warn_old(
                name,
                f"B={batch!r}, Q_LEN=KV_LEN={second!r}",
                f"{batch!r}, 1, {second!r}, {third!r}",
            )
            return entry(mask, batch, None, second, third, **kwargs)
        return entry(mask, *shape, **kwargs)

    return read  # type: ignore[return-value]


def _warn_old(name: str, reading: str, new_args: str) -> None:
    warnings.warn(
        f"{name}(mask, B, Q_LEN[, KV_LEN]) is deprecated: {name} takes torch's order "
        f"(mask, B, H, Q_LEN, KV_LEN) like every flexmask entry. Read as {reading}; write "
        f"{name}(mask, {new_args})",
        DeprecationWarning,
        stacklevel=3,
    )
