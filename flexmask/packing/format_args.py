"""Other kernels' formats as their kernels read them — varlen (``cu_seqlens``, flash-attn's
bottom-right rule), FlashMask's column bounds, Magi's slices — against the batch's mask:
equal to flexmask's own lowering, or made of whole documents (then a ``document`` mask
classified from structure), or else read element by element."""

from __future__ import annotations

import torch
from torch import Tensor

from flexmask.algebra import Mask
from flexmask.formats import FlashMask, MagiMask, VarlenMask, to_flashmask, to_magi, to_varlen
from flexmask.packing import compare, segments
from flexmask.packing.kernel_masks import compare_masks, documents_mask, ranges, report
from flexmask.packing.segments import Disagreement
from flexmask.pieces import causal, document, spans


def check_varlen(
    name: str,
    value: VarlenMask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Disagreement],
) -> None:
    batch, seq_len = shape
    if (value.batch, value.q_len, value.kv_len) != (batch, seq_len, seq_len):
        issues.append(
            Disagreement(
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
            start, covered = ranges(starts, ends, shape)
            kernel = documents_mask(start, covered, value.causal, value.window_size, real)
            if kernel is not None:
                compare_masks(name, kernel, mask, mask_name, real, shape, issues)
                return
    side = compare.rule_side(_varlen_rule(value))
    expected = compare.mask_side(mask, batch, seq_len, (128, 128), "cpu")
    report(
        name,
        compare.first_difference(expected, side, batch, seq_len, real, "cpu"),
        mask_name,
        issues,
    )


def _same_varlen(value: VarlenMask, mask: Mask, shape: tuple[int, int]) -> bool:
    try:
        ours = to_varlen(mask, shape[0], 1, shape[1], shape[1])
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


def check_flashmask(
    name: str,
    value: FlashMask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Disagreement],
) -> None:
    batch, seq_len = shape
    bounds = value.startend_row_indices.cpu().long()
    if bounds.shape[0] not in (1, batch) or bounds.shape[2] != seq_len:
        issues.append(
            Disagreement(
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
    report(
        name,
        compare.first_difference(expected, side, batch, seq_len, real, "cpu"),
        mask_name,
        issues,
    )


def check_magi(
    name: str,
    value: MagiMask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Disagreement],
) -> None:
    batch, seq_len = shape
    q_ranges, k_ranges = value.q_ranges.cpu().long(), value.k_ranges.cpu().long()
    types = value.attn_type_map.cpu().long()
    try:
        ours = to_magi(mask, batch, 1, seq_len, seq_len)
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
        start, covered = ranges(starts, ends, shape)
        ids = torch.full((batch * seq_len,), -1, dtype=torch.int64)
        full = (kinds == 0).nonzero().view(-1)
        for k in full.tolist():  # one span per full (bidirectional) slice
            ids[int(starts[k]) : int(ends[k])] = k
        rule_mask = causal() | spans(ids.view(batch, seq_len)) if full.numel() else causal()
        kernel = rule_mask & document(segments.runs(start, covered))
        if bool((real & ~covered).any()):  # real tokens in no slice attend nothing
            kernel = kernel & spans(torch.where(covered, 0, -1))
        compare_masks(name, kernel, mask, mask_name, real, shape, issues)
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
    report(
        name,
        compare.first_difference(expected, side, batch, seq_len, real, "cpu"),
        mask_name,
        issues,
    )
