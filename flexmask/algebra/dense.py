"""The dense form of a mask and its one rule for a query that attends nothing.

Every dense lowering in flexmask — ``Mask.to_dense`` (from the expression) and the SDPA
backend's ``dense_mask`` (from a BlockMask: full blocks True, unlisted False, ``mask_mod``
on partial blocks) — is exactly what the mask means: ``True`` where query ``q`` attends key
``kv``, and a query that attends no key is a row of ``False``, nothing added.

Attention over such a row follows flex_attention: the query's output is 0 and it passes no
gradient to queries, keys or values (its log-sum-exp is -inf). A dense kernel cannot take an
all-False row (softmax over no key is NaN), so ``open_empty_rows`` lets those rows attend
every key — finite values and gradients — and ``zero_empty_rows`` then multiplies their
output by 0, which zeroes their gradients too.

::

    padding(2), 3 x 3        dense mask       what a dense kernel gets    output
                             ■ ■ ⬚            ■ ■ ⬚                       row 0
                             ■ ■ ⬚            ■ ■ ⬚                       row 1
                             ⬚ ⬚ ⬚            ■ ■ ■   (then × 0)          0
"""

from __future__ import annotations

from torch import Tensor


def open_empty_rows(dense: Tensor) -> tuple[Tensor, Tensor | None]:
    """``dense`` (bool, ``(..., Q_LEN, KV_LEN)``) with every row that attends nothing opened
    to every key, and the ``(..., Q_LEN, 1)`` bool of rows that attend something — None when
    every row does (``dense`` is then returned as is, nothing allocated).

    Example:
        >>> import flexmask
        >>> dense = flexmask.padding(2).to_dense(1, 1, 3, 3)
        >>> opened, has_key = open_empty_rows(dense)
        >>> opened[0, 0].int().tolist(), has_key[0, 0, :, 0].tolist()
        ([[1, 1, 0], [1, 1, 0], [1, 1, 1]], [True, True, False])
    """
    has_key = dense.any(dim=-1, keepdim=True)
    if bool(has_key.all()):
        return dense, None
    return dense | ~has_key, has_key


def zero_empty_rows(out: Tensor, has_key: Tensor | None) -> Tensor:
    """The output of attention over ``open_empty_rows``' mask with the rows that attend
    nothing set to 0 (multiplied, so their gradients are 0 too)."""
    return out if has_key is None else out * has_key
