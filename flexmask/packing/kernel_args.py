"""What a kernel is handed, against the mask the batch means: a BlockMask, a dense 4-D mask,
varlen (``cu_seqlens``), FlashMask and Magi arguments — each read as the kernel reads it
(its documented rule), compared exactly on every real query row
(:mod:`flexmask.packing.compare`), the first differing pair named.

Common forms cost little: a BlockMask flexmask built for this mask is recognised as such,
varlen and Magi arguments made of whole documents become ``document`` masks whose blocks are
classified from structure. Other forms are read element by element.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.builders import create_block_mask
from flexmask.formats import FlashMask, MagiMask, VarlenMask, to_flashmask, to_magi, to_varlen
from flexmask.packing import compare, segments
from flexmask.packing.segments import Claim, Issue
from flexmask.pieces import Document, causal, document, sliding_window, spans
from flexmask.runtime.lazy import LazyBlockMask

KERNEL_BLOCKS = {"flex": 128, "flexmask": 1}
"""The block sizes a kernel takes: multiples of this. torch's Triton kernel (``"flex"``)
tiles a BlockMask's blocks by its default configs' BLOCK_M/BLOCK_N, up to 128 on every GPU
and dtype; flexmask's CPU backends take any."""


def batch_shape(value: Any) -> tuple[int, int]:
    """``(B, S)`` of a BlockMask, handle or 4-D mask."""
    if isinstance(value, LazyBlockMask):
        return value.B, value.Q_LEN
    if isinstance(value, BlockMask):
        return int(value.shape[0]), int(value.seq_lengths[0])
    return int(value.shape[0]), int(value.shape[-2])


def check_mask(
    mask: Mask,
    name: str,
    start: Tensor,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Issue],
    claims: list[Claim],
    derived: bool = False,
) -> None:
    """The batch's own mask: it keeps the documents apart (checked against them when it has
    no ``document`` of its own, unless ``derived`` from them) and gives every real token
    something to attend."""
    batch, seq_len = shape
    device = mask.device or torch.device("cpu")
    own_documents = derived or any(c.name == f"{name}'s documents" for c in claims)
    several = bool((start.sum(1) > 1).any()) or not bool(real.all())
    side = compare.mask_side(mask, batch, seq_len, (128, 128), device)
    if not own_documents and several and any(c.start is not None for c in claims):
        kept = compare.mask_side(
            mask & document(segments.runs(start, real)), batch, seq_len, (128, 128), device
        )
        found = compare.first_difference(kept, side, batch, seq_len, real, device)
        if found is not None:
            issues.append(
                Issue(
                    found.row,
                    found.q,
                    (name, "the documents"),
                    f"{name} lets token {found.q} attend token {found.kv}, which is "
                    + ("padding" if not bool(real[found.row, found.kv]) else "another document"),
                )
            )
    empty = compare.empty_rows(side, batch, seq_len, real, device)
    if empty is not None:
        b, q = empty
        issues.append(
            Issue(
                b,
                q,
                (name,),
                f"{name} lets token {q}, a real token, attend nothing: its output is 0 and it "
                f"learns nothing",
            )
        )


def check(
    name: str,
    value: Any,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    given: dict[str, Any],
    issues: list[Issue],
) -> None:
    """One kernel argument against the mask."""
    if isinstance(value, (LazyBlockMask, BlockMask)):
        _block_mask(name, value, mask, mask_name, real, shape, given["kernel"], issues)
    elif isinstance(value, Tensor) and value.dim() == 4:
        _dense(name, value, mask, mask_name, real, shape, issues)
    elif isinstance(value, VarlenMask):
        _varlen(name, value, mask, mask_name, real, shape, issues)
    elif isinstance(value, FlashMask):
        _flashmask(name, value, mask, mask_name, real, shape, issues)
    elif isinstance(value, MagiMask):
        _magi(name, value, mask, mask_name, real, shape, issues)
    else:
        raise TypeError(f"{name} cannot be a {type(value).__name__}")


def check_cu_seqlens(
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    given: dict[str, Any],
    issues: list[Issue],
) -> None:
    """``cu_seqlens`` under a varlen kernel that is causal (or not) with a window: what it
    attends inside each sequence, against the mask."""
    batch, seq_len = shape
    claim, _ = segments.from_cu_seqlens(
        given["cu_seqlens"], given["cu_seqlens_padded"], shape, None
    )
    assert claim.start is not None and claim.real is not None
    kernel = _documents_mask(
        claim.start, claim.real, bool(given["causal_kernel"]), given["window_size"], real
    )
    if kernel is None:
        raise ValueError(
            f"window_size={given['window_size']} is not (left, 0) under a causal kernel nor "
            f"(w, w): flexmask reads only those"
        )
    _compare_masks("cu_seqlens", kernel, mask, mask_name, real, shape, issues)


# ---------------------------------------------------------------------- BlockMask and dense
def _block_mask(
    name: str,
    value: BlockMask | LazyBlockMask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    kernel: str | None,
    issues: list[Issue],
) -> None:
    batch, seq_len = shape
    if isinstance(value, LazyBlockMask):
        block = _pair(value.BLOCK_SIZE)
        lengths = (value.Q_LEN, value.KV_LEN)
        rows = value.B
    else:
        block = _pair(value.BLOCK_SIZE)
        lengths = (int(value.seq_lengths[0]), int(value.seq_lengths[1]))
        rows = int(value.shape[0])
    if lengths != (seq_len, seq_len):
        issues.append(
            Issue(
                0,
                min(lengths[0], lengths[1], seq_len),
                (name, "the batch"),
                f"{name} was built for Q_LEN={lengths[0]}, KV_LEN={lengths[1]}, but the batch "
                f"has {seq_len} tokens per row",
            )
        )
        return
    if rows not in (1, batch):
        issues.append(
            Issue(0, 0, (name, "the batch"), f"{name} has {rows} rows, the batch has {batch}")
        )
        return
    if kernel is not None:
        if kernel not in KERNEL_BLOCKS:
            raise ValueError(f"kernel must be one of {sorted(KERNEL_BLOCKS)}, got {kernel!r}")
        multiple = KERNEL_BLOCKS[kernel]
        if block[0] % multiple or block[1] % multiple:
            issues.append(
                Issue(
                    0,
                    0,
                    (name, f"kernel {kernel!r}"),
                    f"{name} has BLOCK_SIZE={block}; kernel {kernel!r} takes multiples of "
                    f"{multiple}",
                )
            )
    if isinstance(value, LazyBlockMask):
        # A handle builds its mask exactly: compare the masks, nothing to build or read.
        if value.mask != mask:
            _compare_masks(name, value.mask, mask, mask_name, real, shape, issues)
        return
    device = value.kv_num_blocks.device
    ours = create_block_mask(
        mask, rows, int(value.shape[1]), seq_len, seq_len, device=device, BLOCK_SIZE=block
    )
    if ours is value:  # flexmask's cache handed out this very BlockMask for this mask
        return
    got = compare.block_mask_side(value)
    expected = compare.mask_side(mask, batch, seq_len, block, device)
    _report(
        name,
        compare.first_difference(expected, got, batch, seq_len, real, device),
        mask_name,
        issues,
    )


def _dense(
    name: str,
    value: Tensor,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Issue],
) -> None:
    batch, seq_len = shape
    if value.shape[-2:] != (seq_len, seq_len) or value.shape[0] not in (1, batch):
        issues.append(
            Issue(
                0,
                0,
                (name, "the batch"),
                f"{name} has shape {tuple(value.shape)}, not (B, 1 or H, S, S) = ({batch}, 1, "
                f"{seq_len}, {seq_len})",
            )
        )
        return
    attends = value if value.dtype == torch.bool else value > torch.finfo(value.dtype).min / 2
    rows, heads = attends.shape[0], attends.shape[1]

    def rule(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return attends[b.clamp(max=rows - 1), h.clamp(max=heads - 1), q, kv]

    side = compare.Side(None, rule, (128, 128), heads)
    device = value.device
    expected = compare.mask_side(mask, batch, seq_len, (128, 128), device)
    _report(
        name,
        compare.first_difference(expected, side, batch, seq_len, real.to(device), device),
        mask_name,
        issues,
    )


# ---------------------------------------------------------------------- other kernels' formats
def _varlen(
    name: str,
    value: VarlenMask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Issue],
) -> None:
    batch, seq_len = shape
    if (value.batch, value.q_len, value.kv_len) != (batch, seq_len, seq_len):
        issues.append(
            Issue(
                0,
                0,
                (name, "the batch"),
                f"{name} is for B={value.batch}, Q_LEN="
                f"{value.q_len}, KV_LEN={value.kv_len}; the batch is {batch} x {seq_len}",
            )
        )
        return
    if _same_varlen(value, mask, shape):
        return
    q_index, k_index = value.q_index.cpu(), value.k_index.cpu()
    cu_q, cu_k = value.cu_seqlens_q.cpu().long(), value.cu_seqlens_k.cpu().long()
    square = torch.equal(cu_q, cu_k) and torch.equal(q_index, k_index)
    runs_ok = square and bool((q_index.diff() == 1).sum() == q_index.numel() - value.num_sequences)
    if runs_ok:
        starts = q_index[cu_q[:-1]]
        ends = q_index[(cu_q[1:] - 1).clamp(min=0)] + 1
        within_row = bool((starts // seq_len == (ends - 1) // seq_len).all())
        if within_row:
            start, covered = _ranges(starts, ends, shape)
            kernel = _documents_mask(start, covered, value.causal, value.window_size, real)
            if kernel is not None:
                _compare_masks(name, kernel, mask, mask_name, real, shape, issues)
                return
    side = compare.rule_side(_varlen_rule(value))
    expected = compare.mask_side(mask, batch, seq_len, (128, 128), "cpu")
    _report(
        name,
        compare.first_difference(expected, side, batch, seq_len, real, "cpu"),
        mask_name,
        issues,
    )


def _same_varlen(value: VarlenMask, mask: Mask, shape: tuple[int, int]) -> bool:
    try:
        ours = to_varlen(mask, shape[0], shape[1], shape[1])
    except ValueError:
        return False
    return (
        ours.causal == value.causal
        and tuple(ours.window_size) == tuple(value.window_size)
        and all(
            torch.equal(getattr(ours, f).cpu().long(), getattr(value, f).cpu().long())
            for f in ("cu_seqlens_q", "cu_seqlens_k", "q_index", "k_index")
        )
    )


def _varlen_rule(value: VarlenMask) -> compare.ElementRule:
    """flash-attn's documented rule, aligned to each sequence's bottom-right corner."""
    total_q, total_k = value.batch * value.q_len, value.batch * value.kv_len
    seq_q = _sequence_of(value.cu_seqlens_q, value.q_index, total_q)
    seq_k = _sequence_of(value.cu_seqlens_k, value.k_index, total_k)
    cu_q, cu_k = value.cu_seqlens_q.cpu().long(), value.cu_seqlens_k.cpu().long()
    local_q, local_k = (
        _local(seq_q, cu_q, value.q_index, total_q),
        _local(seq_k, cu_k, value.k_index, total_k),
    )
    sq, sk = cu_q.diff(), cu_k.diff()
    left, right = value.window_size
    q_len, kv_len = value.q_len, value.kv_len

    def rule(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        fq, fk = b * q_len + q, b * kv_len + kv
        i, j = seq_q[fq], seq_k[fk]
        same = (i == j) & (i >= 0)
        i = i.clamp(min=0)
        shift = local_q[fq] + sk[i] - sq[i]
        lk = local_k[fk]
        ok = same
        if value.causal:
            ok = ok & (lk <= shift)
        elif right >= 0:
            ok = ok & (lk <= shift + right)
        if left >= 0:
            ok = ok & (lk >= shift - left)
        return ok

    return rule


def _sequence_of(cu: Tensor, index: Tensor, total: int) -> Tensor:
    seq = torch.full((total,), -1, dtype=torch.int64)
    counts = cu.cpu().long().diff()
    seq[index.cpu()] = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return seq


def _local(seq: Tensor, cu: Tensor, index: Tensor, total: int) -> Tensor:
    local = torch.zeros(total, dtype=torch.int64)
    counts = cu.diff()
    local[index.cpu()] = torch.arange(index.numel()) - torch.repeat_interleave(cu[:-1], counts)
    return local


def _flashmask(
    name: str,
    value: FlashMask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Issue],
) -> None:
    batch, seq_len = shape
    bounds = value.startend_row_indices.cpu().long()
    if bounds.shape[0] not in (1, batch) or bounds.shape[2] != seq_len:
        issues.append(
            Issue(
                0,
                0,
                (name, "the batch"),
                f"{name} has startend_row_indices of shape "
                f"{tuple(bounds.shape)}, not (B, H, S, C) with B={batch}, S={seq_len}",
            )
        )
        return
    try:
        ours = to_flashmask(mask, batch, bounds.shape[1], seq_len, seq_len)
        if ours.causal == value.causal and torch.equal(
            ours.startend_row_indices.cpu().long(), bounds.expand_as(ours.startend_row_indices)
        ):
            return
    except ValueError:
        pass
    rows, heads, columns = bounds.shape[0], bounds.shape[1], bounds.shape[3]

    def rule(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        col = bounds[b.clamp(max=rows - 1), h.clamp(max=heads - 1), kv]
        if value.causal:
            masked = q < kv
            masked = masked | ((q >= col[..., 0]) & ((q < col[..., 1]) if columns == 2 else True))
        elif columns == 2:
            masked = (q >= col[..., 0]) | (q < col[..., 1])
        else:
            masked = ((q >= col[..., 0]) & (q < col[..., 1])) | (
                (q >= col[..., 2]) & (q < col[..., 3])
            )
        return ~masked

    side = compare.Side(None, rule, (128, 128), heads)
    expected = compare.mask_side(mask, batch, seq_len, (128, 128), "cpu")
    _report(
        name,
        compare.first_difference(expected, side, batch, seq_len, real, "cpu"),
        mask_name,
        issues,
    )


def _magi(
    name: str,
    value: MagiMask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Issue],
) -> None:
    batch, seq_len = shape
    q_ranges, k_ranges = value.q_ranges.cpu().long(), value.k_ranges.cpu().long()
    types = value.attn_type_map.cpu().long()
    try:
        ours = to_magi(mask, batch, seq_len, seq_len)
        if (
            torch.equal(ours.q_ranges.cpu().long(), q_ranges)
            and torch.equal(ours.k_ranges.cpu().long(), k_ranges)
            and torch.equal(ours.attn_type_map.cpu().long(), types)
        ):
            return
    except ValueError:
        pass
    square = torch.equal(q_ranges, k_ranges) and bool(((types == 0) | (types == 1)).all())
    starts, ends = q_ranges[:, 0], q_ranges[:, 1]
    order = torch.argsort(starts)
    starts, ends, kinds = starts[order], ends[order], types[order]
    disjoint = bool((starts[1:] >= ends[:-1]).all()) if starts.numel() > 1 else True
    within_row = bool((starts // seq_len == (ends - 1).clamp(min=0) // seq_len).all())
    if square and disjoint and within_row:
        start, covered = _ranges(starts, ends, shape)
        ids = torch.full((batch * seq_len,), -1, dtype=torch.int64)
        full = (kinds == 0).nonzero().view(-1)
        for k in full.tolist():  # one span per full (bidirectional) slice
            ids[int(starts[k]) : int(ends[k])] = k
        rule_mask = causal() | spans(ids.view(batch, seq_len)) if full.numel() else causal()
        kernel = rule_mask & document(segments.runs(start, covered))
        if bool((real & ~covered).any()):  # real tokens in no slice attend nothing
            kernel = kernel & spans(torch.where(covered, 0, -1))
        _compare_masks(name, kernel, mask, mask_name, real, shape, issues)
        return

    def rule(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        fq, fk = b * seq_len + q, b * seq_len + kv
        hit = torch.zeros(torch.broadcast_shapes(fq.shape, fk.shape), dtype=torch.bool)
        for (qa, qz), (ka, kz), t in zip(
            q_ranges.tolist(), k_ranges.tolist(), types.tolist(), strict=True
        ):
            inside = (fq >= qa) & (fq < qz) & (fk >= ka) & (fk < kz)
            if t in (1, 3):  # causal: bottom-right aligned
                inside = inside & (fk - kz <= fq - qz)
            if t in (2, 3):  # inverse causal: top-left aligned
                inside = inside & (fk - ka >= fq - qa)
            hit = hit | inside
        return hit

    side = compare.rule_side(rule)
    expected = compare.mask_side(mask, batch, seq_len, (128, 128), "cpu")
    _report(
        name,
        compare.first_difference(expected, side, batch, seq_len, real, "cpu"),
        mask_name,
        issues,
    )


# ---------------------------------------------------------------------- shared
def _ranges(starts: Tensor, ends: Tensor, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``(B, S)`` starts and covered tokens of ranges over the rows laid end to end."""
    total = shape[0] * shape[1]
    start = torch.zeros(total, dtype=torch.bool)
    keep = ends > starts
    start[starts[keep]] = True
    cover = torch.zeros(total + 1, dtype=torch.int64)
    cover.index_add_(0, starts[keep], torch.ones_like(starts[keep]))
    cover.index_add_(0, ends[keep], -torch.ones_like(ends[keep]))
    return start.view(shape), (cover.cumsum(0)[:total] > 0).view(shape)


def _documents_mask(
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


def _compare_masks(
    name: str,
    kernel: Mask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Issue],
) -> None:
    batch, seq_len = shape
    if _same_documents(kernel, mask, real):
        return
    got = compare.mask_side(kernel, batch, seq_len, (128, 128), "cpu")
    expected = compare.mask_side(mask, batch, seq_len, (128, 128), "cpu")
    _report(
        name,
        compare.first_difference(expected, got, batch, seq_len, real, "cpu"),
        mask_name,
        issues,
    )


def _same_documents(a: Mask, b: Mask, real: Tensor) -> bool:
    """True when both masks are one ``document`` ANDed with the same other pieces and every
    real token lies in a document of the same extent in both: then every real query row
    attends the same keys. O(B * S), no tile read."""
    parts_a, parts_b = segments.conjuncts(a), segments.conjuncts(b)
    docs_a = [p for p in parts_a if isinstance(p, Document)]
    docs_b = [p for p in parts_b if isinstance(p, Document)]
    if len(docs_a) != 1 or len(docs_b) != 1:
        return False
    rest_a = sorted(repr(p.key) for p in parts_a if not isinstance(p, Document))
    rest_b = sorted(repr(p.key) for p in parts_b if not isinstance(p, Document))
    if rest_a != rest_b:
        return False
    first_a, last_a = _extents(docs_a[0], real.shape)
    first_b, last_b = _extents(docs_b[0], real.shape)
    return bool((((first_a == first_b) & (last_a == last_b)) | ~real).all())


def _extents(doc: Document, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
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


def _report(
    name: str, found: compare.Difference | None, mask_name: str, issues: list[Issue]
) -> None:
    if found is None:
        return
    verb = "lets" if found.got else "does not let"
    should = "does not" if found.got else "does"
    head = f" (head {found.head})" if found.head else ""
    issues.append(
        Issue(
            found.row,
            found.q,
            (name, mask_name),
            f"{name} {verb} token {found.q} attend token {found.kv}{head}; {mask_name} {should}",
        )
    )


def _pair(block: Any) -> tuple[int, int]:
    if isinstance(block, (tuple, list)):
        return int(block[0]), int(block[1])
    return int(block), int(block)
