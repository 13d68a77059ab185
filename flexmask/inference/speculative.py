"""Speculative decoding's mask: a prefix and a draft tree verified in one forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_fits, check_int, check_parents, int_vector
from flexmask.algebra import Mask
from flexmask.inference.arguments import is_scalar
from flexmask.pieces import tree


def speculative_tree(prefix_lens: Any, draft_parents: Any) -> Mask:
    """A prefix followed by a draft tree, as one ``flexmask.tree`` over positions
    ``[0, prefix_len + len(draft))``: prefix tokens attend causally, a draft token attends
    the whole prefix, its draft ancestors and itself. Positions past the draft attend nothing.

    ::

        prefix_lens=2, draft_parents=[-1, 0, -1]   (draft: a → b, and c)
                          ■ ⬚ ⬚ ⬚ ⬚
                          ■ ■ ⬚ ⬚ ⬚
                          ■ ■ ■ ⬚ ⬚      a
                          ■ ■ ■ ■ ⬚      b (child of a)
                          ■ ■ ⬚ ⬚ ■      c

    Verify the draft in one forward with ``decode_mask(mask, prefix_lens, q_len=len(draft),
    capacity=...)``; combine with ``document`` (``& flexmask.document(...)``) when the prefix
    packs several documents.

    Args:
        prefix_lens: tokens before the draft (>= 1) — one int for every row, or one per row.
        draft_parents: each draft token's parent within the draft (``parents[i] < i``), or -1
            for a child of the last prefix token — one list for every row, or one per row.

    Returns:
        A ``flexmask.tree`` mask (per row when either argument is).

    Example:
        >>> import flexmask
        >>> print(flexmask.speculative_tree(2, [-1, 0, -1]).show(5))
        ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚
        ■ ■ ■ ■ ⬚
        ■ ■ ⬚ ⬚ ■
    """
    per_row_drafts = isinstance(draft_parents, (list, tuple, Tensor)) and any(
        isinstance(d, (list, tuple)) or (isinstance(d, Tensor) and d.dim() == 1)
        for d in draft_parents
    )
    drafts = list(draft_parents) if per_row_drafts else None
    if is_scalar(prefix_lens):
        prefixes = None
        shared_prefix = check_int(prefix_lens, "prefix_lens", minimum=1)
    else:
        prefixes = int_vector(prefix_lens, "prefix_lens").tolist()
        for i, p in enumerate(prefixes):
            if p < 1:
                raise ValueError(f"prefix_lens[{i}] must be >= 1, got {p}")
    rows = len(drafts) if drafts is not None else (len(prefixes) if prefixes else 1)
    if drafts is not None and prefixes is not None and len(drafts) != len(prefixes):
        raise ValueError(
            f"prefix_lens gives {len(prefixes)} rows but draft_parents {len(drafts)}: pass one "
            f"of each per row, or one shared"
        )
    longest = max(prefixes) if prefixes is not None else shared_prefix
    check_fits(
        # per row: the prefix's parents and the joined list, int64, before the tree's own
        16 * rows * longest,
        torch.device("cpu"),
        f"speculative_tree with prefix_lens up to {longest}",
        "prefix_lens counts the tokens before the draft (the cache length), not bytes",
    )
    parents = []
    for row in range(rows):
        prefix = prefixes[row] if prefixes is not None else shared_prefix
        name = f"draft_parents[{row}]" if drafts is not None else "draft_parents"
        draft = check_parents(
            drafts[row] if drafts is not None else draft_parents,
            name,
            token="draft token",
            rule="a draft token's parent is an earlier draft token",
            root="the prefix's last",
            empty="an empty list",
        )
        chain = torch.arange(-1, prefix - 1)  # the prefix: each token's parent is the previous
        parents.append(torch.cat([chain, torch.where(draft < 0, prefix - 1, draft + prefix)]))
    per_row = drafts is not None or prefixes is not None
    return tree(parents if per_row else parents[0])
