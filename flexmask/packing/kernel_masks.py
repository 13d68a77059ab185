"""Kernel masks read off sequence ranges, compared with the batch's mask: the helpers the
kernel-argument checks share (:mod:`flexmask.packing.kernel_args`,
:mod:`flexmask.packing.format_args`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask.algebra import Mask, conjuncts
from flexmask.packing import compare, segments
from flexmask.packing.segments import Disagreement
from flexmask.pieces import Document, causal, document, sliding_window, spans


def ranges(starts: Tensor, ends: Tensor, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``(B, S)`` starts and covered tokens of ranges over the rows laid end to end."""
    total = shape[0] * shape[1]
    start = torch.zeros(total, dtype=torch.bool)
    keep = ends > starts
    start[starts[keep]] = True
    cover = torch.zeros(total + 1, dtype=torch.int64)
    cover.index_add_(0, starts[keep], torch.ones_like(starts[keep]))
    cover.index_add_(0, ends[keep], -torch.ones_like(ends[keep]))
    return start.view(shape), (cover.cumsum(0)[:total] > 0).view(shape)


def documents_mask(
    start: Tensor, covered: Tensor, is_causal: bool, window_size: Any, real: Tensor
) -> Mask | None:
    """The mask a varlen kernel attends over these sequences (``covered``: the tokens in
    one): causal or not, with its window (None where flexmask's pieces do not say it).
    Stretches outside every sequence become documents of their own, which no real query
    reads — unless a real token is outside every sequence: then those attend nothing."""
    left, right = (int(w) for w in window_size)
    base: Mask = document(segments.runs(start, covered))
    if bool((real & ~covered).any()):
        base = base & spans(torch.where(covered, 0, -1))
    if is_causal:
        base = causal() & base
        return base if left < 0 else base & sliding_window(left + 1)
    if left < 0 and right < 0:
        return base
    if left == right:
        return base & sliding_window(left + 1)
    return None


def compare_masks(
    name: str,
    kernel: Mask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Disagreement],
) -> None:
    batch, seq_len = shape
    if same_documents(kernel, mask, real):
        return
    got = compare.mask_side(kernel, batch, seq_len, (128, 128), "cpu")
    expected = compare.mask_side(mask, batch, seq_len, (128, 128), "cpu")
    report(
        name,
        compare.first_difference(expected, got, batch, seq_len, real, "cpu"),
        mask_name,
        issues,
    )


def same_documents(a: Mask, b: Mask, real: Tensor) -> bool:
    """True when both masks are one ``document`` ANDed with the same other pieces and every
    real token lies in a document of the same extent in both: then every real query row
    attends the same keys. O(B * S), no tile read."""
    parts_a, parts_b = conjuncts(a), conjuncts(b)
    docs_a = [p for p in parts_a if isinstance(p, Document)]
    docs_b = [p for p in parts_b if isinstance(p, Document)]
    if len(docs_a) != 1 or len(docs_b) != 1:
        return False
    rest_a = sorted(repr(p.key) for p in parts_a if not isinstance(p, Document))
    rest_b = sorted(repr(p.key) for p in parts_b if not isinstance(p, Document))
    if rest_a != rest_b:
        return False
    first_a, last_a = extents(docs_a[0], real.shape)
    first_b, last_b = extents(docs_b[0], real.shape)
    return bool((((first_a == first_b) & (last_a == last_b)) | ~real).all())


def extents(doc: Document, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Per token, the first and last token of its document (-1 outside every document)."""
    batch, seq_len = shape
    rows = list(doc.seq_lens)
    first = torch.full((batch, seq_len), -1, dtype=torch.int64)
    last = torch.full((batch, seq_len), -1, dtype=torch.int64)
    positions = torch.arange(seq_len)
    for b in range(batch):
        lens = rows[min(b, len(rows) - 1)].long().cpu()
        ends = lens.cumsum(0)
        inside = positions < (int(ends[-1]) if ends.numel() else 0)
        which = torch.searchsorted(ends, positions[inside], right=True)
        first[b, inside] = (ends - lens)[which]
        last[b, inside] = ends[which] - 1
    return first, last


def report(
    name: str, found: compare.Difference | None, mask_name: str, issues: list[Disagreement]
) -> None:
    if found is None:
        return
    verb = "lets" if found.got else "does not let"
    should = "does not" if found.got else "does"
    head = f" (head {found.head})" if found.head else ""
    issues.append(
        Disagreement(
            found.row,
            found.q,
            (name, mask_name),
            f"{name} {verb} token {found.q} attend token {found.kv}{head}; {mask_name} {should}",
        )
    )
