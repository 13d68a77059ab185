"""A mask as FlashAttention's varlen kernels take it: packed tokens and cumulative lengths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_device
from flexmask.algebra import INF, Mask
from flexmask.formats._structure import Window, lines, one_mask_for_all_heads, varlen_plan, window


@dataclass(frozen=True, eq=False)
class VarlenMask:
    """The arguments of ``flash_attn_varlen_func`` / ``torch.nn.attention.varlen.varlen_attn``
    for one mask, and the map between ``(B, S)`` rows and the packed token layout.

    Sequence ``i`` of the kernel is the queries ``q_index[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``
    and the keys ``k_index[cu_seqlens_k[i]:cu_seqlens_k[i+1]]`` (flat indices ``b * Q_LEN + q``
    and ``b * KV_LEN + kv``). Tokens in no sequence (padding, queries that attend nothing) are
    left out of the packed layout; ``unpack`` gives them zero output, as flex_attention does.
    """

    cu_seqlens_q: Tensor
    """int32 ``(N + 1,)``: where each sequence's queries start in the packed layout."""
    cu_seqlens_k: Tensor
    """int32 ``(N + 1,)``: where each sequence's keys start."""
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    """flash-attn's ``causal``: aligned to each sequence's bottom-right corner."""
    window_size: tuple[int, int]
    """flash-attn's ``(left, right)``, -1 for unbounded; ``(left, 0)`` with ``causal``."""
    q_index: Tensor
    """int64 ``(total_q,)``: the flat ``(B * Q_LEN)`` row of each packed query."""
    k_index: Tensor
    """int64 ``(total_k,)``: the flat ``(B * KV_LEN)`` row of each packed key."""
    batch: int
    q_len: int
    kv_len: int

    @property
    def num_sequences(self) -> int:
        """N, the number of sequences the kernel runs."""
        return self.cu_seqlens_q.numel() - 1

    def pack_q(self, x: Tensor) -> Tensor:
        """``(B, Q_LEN, ...)`` → ``(total_q, ...)``, the kernel's query layout."""
        return _flat(x, self.batch, self.q_len, "x")[self.q_index.to(x.device)]

    def pack_kv(self, x: Tensor) -> Tensor:
        """``(B, KV_LEN, ...)`` → ``(total_k, ...)``, the kernel's key/value layout."""
        return _flat(x, self.batch, self.kv_len, "x")[self.k_index.to(x.device)]

    def unpack(self, out: Tensor) -> Tensor:
        """``(total_q, ...)`` → ``(B, Q_LEN, ...)``, zeros at the queries left out."""
        if out.shape[0] != self.q_index.numel():
            raise ValueError(
                f"out must have {self.q_index.numel()} packed queries in dim 0, got "
                f"{tuple(out.shape)}"
            )
        full = out.new_zeros((self.batch * self.q_len, *out.shape[1:]))
        full = full.index_copy(0, self.q_index.to(out.device), out)
        return full.view(self.batch, self.q_len, *out.shape[1:])

    def flash_attn_kwargs(self) -> dict[str, Any]:
        """Keywords of ``flash_attn.flash_attn_varlen_func`` (after q, k, v)."""
        return {
            "cu_seqlens_q": self.cu_seqlens_q,
            "cu_seqlens_k": self.cu_seqlens_k,
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
            "causal": self.causal,
            "window_size": self.window_size,
        }

    def varlen_attn_kwargs(self) -> dict[str, Any]:
        """Keywords of ``torch.nn.attention.varlen.varlen_attn`` (after query, key, value):
        torch has no ``causal`` flag, causal is ``window_size=(left, 0)``."""
        window_size = (self.window_size[0], 0) if self.causal else self.window_size
        return {
            "cu_seq_q": self.cu_seqlens_q,
            "cu_seq_k": self.cu_seqlens_k,
            "max_q": self.max_seqlen_q,
            "max_k": self.max_seqlen_k,
            "window_size": window_size,
        }

    def __repr__(self) -> str:
        return (
            f"VarlenMask(sequences={self.num_sequences}, total_q={self.q_index.numel()}, "
            f"total_k={self.k_index.numel()}, max_seqlen_q={self.max_seqlen_q}, "
            f"max_seqlen_k={self.max_seqlen_k}, causal={self.causal}, "
            f"window_size={self.window_size})"
        )


def _flat(x: Tensor, batch: int, length: int, name: str) -> Tensor:
    if x.dim() < 2 or x.shape[0] != batch or x.shape[1] != length:
        raise ValueError(
            f"{name} must have shape (B, S, ...) = ({batch}, {length}, ...), got {tuple(x.shape)}"
        )
    return x.reshape(batch * length, *x.shape[2:])


def to_varlen(
    mask: Mask,
    B: int | None,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    device: torch.device | str | None = None,
) -> VarlenMask:
    """Lower a mask to FlashAttention's varlen format, exactly, or refuse.

    Takes an ``&`` of ``causal()``, ``sliding_window(w)``, ``document(...)`` (shared or one per
    row), ``chunked(n)``, ``padding(...)`` and ``full()``: each document (chunk, unpadded row)
    in the window becomes one sequence, bidirectional without ``causal()``. The kernel's rule
    is one for every sequence (one causal flag, one window) and is **aligned to each
    sequence's bottom-right corner**, as flash-attn >= 2.1 and torch's ``varlen_attn`` align
    it: query ``i`` of a sequence with ``sq`` queries and ``sk`` keys sees keys up to
    ``i + sk - sq``. A window whose queries end where their keys end (training; decode and
    chunked prefill, ``q_offset + Q_LEN == kv_offset + KV_LEN``) lowers exactly; keys after a
    document's last query are left out (no query attends them). The result is checked
    against the mask's own intervals and refused where the alignment would differ.

    Args:
        mask: the mask.
        B: batch size (None: the mask's rows, else 1).
        Q_LEN, KV_LEN: query and key lengths of the window (KV_LEN None: Q_LEN).
        q_offset, kv_offset: the window's first query and key position, an int or one per row.
        device: where the returned tensors live (None: the mask's device, else CPU).

    Raises:
        ValueError: a piece varlen cannot express (naming it: ``tree(...)``, ``prefix(...)``,
            a union, a complement, a per-row window that differs between rows, heads that
            differ), or a window whose alignment the kernel cannot reproduce.

    Example:
        >>> import flexmask, torch
        >>> from flexmask.formats import to_varlen
        >>> v = to_varlen(flexmask.causal() & flexmask.document([3, 2]), 1, 6)
        >>> v.cu_seqlens_q.tolist(), v.max_seqlen_q, v.causal   # token 5 is padding
        ([0, 3, 5], 3, True)
        >>> out = v.unpack(v.pack_q(torch.ones(1, 6, 2, 4)))   # (B, S, H, D) round trip
        >>> out[0, :, 0, 0].tolist()
        [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    """
    win = window(mask, B, None, Q_LEN, KV_LEN, q_offset, kv_offset)
    return varlen_of(mask, win, device)


def varlen_of(mask: Mask, win: Window, device: torch.device | str | None = None) -> VarlenMask:
    """``to_varlen`` of a window already checked against the mask (``window``, or
    ``validated_window`` for a call whose mask was validated once for its sizes)."""
    dev = check_device(device, mask.device)
    length = max(int(win.q_offset.max()) + win.q_len, int(win.kv_offset.max()) + win.kv_len)
    plan = varlen_plan(mask, length)
    if plan.window is not None and plan.window >= length:
        plan = plan._replace(window=None)  # |q - kv| < length everywhere: no window at all
    left = -1 if plan.window is None else plan.window - 1
    right = 0 if plan.causal else (-1 if plan.window is None else plan.window - 1)
    q_lens, k_lens, q_parts, k_parts = [], [], [], []
    for b in range(win.batch):
        ids = plan.segment_ids[min(b, len(plan.segment_ids) - 1)]
        q0 = int(win.q_offset[min(b, win.q_offset.shape[0] - 1)])
        k0 = int(win.kv_offset[min(b, win.kv_offset.shape[0] - 1)])
        q_runs = _runs(ids[q0 : q0 + win.q_len])
        k_runs = _runs(ids[k0 : k0 + win.kv_len])
        for seg, (qa, qb) in q_runs.items():
            if seg not in k_runs:
                continue
            ka, kb = (k + k0 for k in k_runs[seg])
            if plan.causal:  # keys after the last query are attended by none of them
                kb = min(kb, q0 + qb)
                if plan.window is not None:
                    ka = max(ka, q0 + qa - left)
            if kb <= ka:
                continue
            q_lens.append(qb - qa)
            k_lens.append(kb - ka)
            q_parts.append(b * win.q_len + torch.arange(qa, qb))
            k_parts.append(b * win.kv_len + torch.arange(ka - k0, kb - k0))
    window_size = (-1, -1) if plan.window is None else (left, right)
    lowered = VarlenMask(
        cu_seqlens_q=_cumulative(q_lens, dev),
        cu_seqlens_k=_cumulative(k_lens, dev),
        max_seqlen_q=max(q_lens, default=0),
        max_seqlen_k=max(k_lens, default=0),
        causal=plan.causal,
        window_size=window_size,
        q_index=_cat(q_parts, dev),
        k_index=_cat(k_parts, dev),
        batch=win.batch,
        q_len=win.q_len,
        kv_len=win.kv_len,
    )
    _check_exact(one_mask_for_all_heads(mask, "varlen"), win, lowered, plan.rule_piece)
    return lowered


def _runs(ids: Tensor) -> dict[int, tuple[int, int]]:
    """Segment id -> its run ``[start, end)`` of local positions (ids >= 0 only)."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0)
    return {
        int(v): (int(e - c), int(e))
        for v, c, e in zip(values.tolist(), counts.tolist(), ends.tolist(), strict=True)
        if v >= 0
    }


def _cumulative(lengths: list[int], device: torch.device) -> Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu.to(device)


def _cat(parts: list[Tensor], device: torch.device) -> Tensor:
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat(parts).to(device)


def _kernel_intervals(lowered: VarlenMask) -> tuple[Tensor, Tensor]:
    """Per flat query, the flat kv interval the kernel attends (flash-attn's documented
    rule), empty for queries in no sequence."""
    total = lowered.batch * lowered.q_len
    lo = torch.full((total,), INF, dtype=torch.int64)
    hi = torch.full((total,), -INF, dtype=torch.int64)
    cu_q, cu_k = lowered.cu_seqlens_q.cpu().long(), lowered.cu_seqlens_k.cpu().long()
    q_index, k_index = lowered.q_index.cpu(), lowered.k_index.cpu()
    left, right = lowered.window_size
    for i in range(lowered.num_sequences):
        sq, sk = int(cu_q[i + 1] - cu_q[i]), int(cu_k[i + 1] - cu_k[i])
        shift = torch.arange(sq) + sk - sq
        first = shift - left if left >= 0 else torch.full_like(shift, -INF)
        last = shift if lowered.causal else (shift + right if right >= 0 else shift + INF)
        first, last = first.clamp(min=0), last.clamp(max=sk - 1)
        kv_first = int(k_index[cu_k[i]])
        rows = q_index[cu_q[i] : cu_q[i + 1]]
        lo[rows] = torch.where(first <= last, kv_first + first, INF)
        hi[rows] = torch.where(first <= last, kv_first + last, -INF)
    return lo, hi


def _check_exact(mask: Mask, win: Any, lowered: VarlenMask, rule_piece: Mask | None) -> None:
    """Raise unless the kernel's documented rule attends what the mask attends."""
    want = lines(mask, win, fmt="varlen")
    lo, hi = (t.expand(win.batch, *t.shape[1:]) for t in want)
    offsets = (torch.arange(win.batch) * win.kv_len).view(-1, 1)
    first_lo = torch.where(lo[..., 0] <= hi[..., 0], lo[..., 0] + offsets, INF).reshape(-1)
    first_hi = torch.where(lo[..., 0] <= hi[..., 0], hi[..., 0] + offsets, -INF).reshape(-1)
    more = (lo[..., 1:] <= hi[..., 1:]).any(-1).reshape(-1) if lo.shape[-1] > 1 else None
    got_lo, got_hi = _kernel_intervals(lowered)
    bad = (got_lo != first_lo) | (got_hi != first_hi)
    if more is not None:
        bad |= more
    if not bool(bad.any()):
        return
    flat = int(bad.nonzero()[0, 0])
    b, q = divmod(flat, win.q_len)
    q_pos = q + int(win.q_offset[min(b, win.q_offset.shape[0] - 1)])

    def show(a: int, z: int) -> str:
        return "nothing" if a > z else f"keys [{a - b * win.kv_len}, {z - b * win.kv_len}]"

    piece = rule_piece if rule_piece is not None else mask
    raise ValueError(
        f"{piece!r} cannot be lowered to varlen for this window: in row {b}, query {q} "
        f"(position {q_pos}) attends {show(int(first_lo[flat]), int(first_hi[flat]))} but a "
        f"varlen kernel, which aligns its causal/window rule to each sequence's bottom-right "
        f"corner, would attend {show(int(got_lo[flat]), int(got_hi[flat]))}. Give each query "
        f"window the keys up to its last query (q_offset + Q_LEN == kv_offset + KV_LEN, as "
        f"decode and chunked prefill do), or use to_magi / create_block_mask"
    )
