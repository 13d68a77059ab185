"""A mask as FlashAttention's varlen kernels take it: packed tokens and cumulative lengths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_device, torch_order
from flexmask.algebra import INF, Mask
from flexmask.formats._structure import (
    VarlenPlan,
    Window,
    lines,
    one_mask_for_all_heads,
    varlen_plan,
    window,
)


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

    def varlen_attn_kwargs(self, keys: str = "packed") -> dict[str, Any]:
        """Keywords of ``torch.nn.attention.varlen.varlen_attn`` (after query, key, value):
        torch has no ``causal`` flag, causal is ``window_size=(left, 0)``.

        Args:
            keys: ``"packed"``: key and value as :meth:`pack_kv` gives them (each sequence's
                keys gathered, back to back). ``"in_place"``: key and value as the
                ``(B * KV_LEN, H, D)`` view of the ``(B, KV_LEN, H, D)`` tensors, no gather
                (a KV cache whose slots hold more than each row uses): sequence ``i`` reads
                the ``seqused_k[i]`` keys from ``cu_seq_k[i]``, where they lie. torch's
                ``seqused_k`` is inference-only (no backward).

        Example:
            >>> import flexmask
            >>> from flexmask.formats import to_varlen
            >>> # A decode step: each row's one query over the first 5 and 3 of 8 cache slots.
            >>> v = to_varlen(flexmask.padding([5, 3]), 2, 1, 1, 8, q_offset=[4, 2])
            >>> kwargs = v.varlen_attn_kwargs(keys="in_place")
            >>> kwargs["cu_seq_k"].tolist(), kwargs["seqused_k"].tolist(), kwargs["max_k"]
            ([0, 8, 16], [5, 3], 5)
        """
        window_size = (self.window_size[0], 0) if self.causal else self.window_size
        if keys == "packed":
            cu_seq_k, extra = self.cu_seqlens_k, dict[str, Any]()
        elif keys == "in_place":
            cu_seq_k, extra = self._keys_in_place()
        else:
            raise ValueError(f"keys must be 'packed' or 'in_place', got {keys!r}")
        return {
            "cu_seq_q": self.cu_seqlens_q,
            "cu_seq_k": cu_seq_k,
            "max_q": self.max_seqlen_q,
            "max_k": self.max_seqlen_k,
            "window_size": window_size,
            **extra,
        }

    def _keys_in_place(self) -> tuple[Tensor, dict[str, Any]]:
        """``cu_seq_k`` and ``seqused_k`` reading each sequence's keys in the flat
        ``(B * KV_LEN)`` layout: its first key's index, a slot running to the next one's
        (the last to ``B * KV_LEN``), its key count used. Each sequence's keys are one run of
        a row (``k_index`` is made so) and the runs come in flat order, one per slot."""
        used = (self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1]).to(torch.int32)
        starts = self.k_index.to(self.cu_seqlens_k.device)[self.cu_seqlens_k[:-1].long()]
        end = torch.tensor([self.batch * self.kv_len], device=starts.device)
        cu_seq_k = torch.cat([starts, end]).to(torch.int32)
        if bool((cu_seq_k[:-1] + used > cu_seq_k[1:]).any()):
            raise ValueError(  # not reached by to_varlen's layouts; a hand-made VarlenMask
                "keys='in_place' needs each sequence's keys in one run of a row, in order; "
                "use keys='packed'"
            )
        return cu_seq_k, {"seqused_k": used}

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


@torch_order
def to_varlen(
    mask: Mask,
    B: int | None,
    H: int | None,
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
        H: number of heads (None: 1); the mask must be one for every head.
        Q_LEN, KV_LEN: query and key lengths of the window (KV_LEN None: Q_LEN). The order
            is torch's ``(mask, B, H, Q_LEN, KV_LEN)``; the pre-0.2 ``(mask, B, Q_LEN)``
            warns, and ``(mask, B, Q_LEN, KV_LEN)`` with Q_LEN != KV_LEN raises.
        q_offset, kv_offset: the window's first query and key position, an int or one per row.
        device: where the returned tensors live (None: the mask's device, else CPU).

    Raises:
        ValueError: a piece varlen cannot express (naming it: ``tree(...)``, ``prefix(...)``,
            a union, a complement, a per-row window that differs between rows, heads that
            differ), or a window whose alignment the kernel cannot reproduce.

    Example:
        >>> import flexmask, torch
        >>> from flexmask.formats import to_varlen
        >>> v = to_varlen(flexmask.causal() & flexmask.document([3, 2]), 1, 1, 6, 6)
        >>> v.cu_seqlens_q.tolist(), v.max_seqlen_q, v.causal   # token 5 is padding
        ([0, 3, 5], 3, True)
        >>> out = v.unpack(v.pack_q(torch.ones(1, 6, 2, 4)))   # (B, S, H, D) round trip
        >>> out[0, :, 0, 0].tolist()
        [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    """
    win = window(mask, B, H, Q_LEN, KV_LEN, q_offset, kv_offset)
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
    # Where every row's queries and keys are the same positions, each sequence's queries and
    # keys are the same run of one segment: the kernel's bottom-right alignment is its
    # top-left one, and its rule within the run is the mask's (an & of that rule and
    # partitions), so the lowering is exact by construction (no check) and its keys are
    # its queries.
    aligned = win.q_len == win.kv_len and bool((win.q_offset == win.kv_offset).all())
    row, qa, qb, ka, kb = _sequences(plan, win, left, aligned)
    q_lens, k_lens = qb - qa, kb - ka
    window_size = (-1, -1) if plan.window is None else (left, right)
    q_index = _spread(row * win.q_len + qa, q_lens)
    k_index = q_index.clone() if aligned else _spread(row * win.kv_len + ka, k_lens)
    lowered = VarlenMask(
        cu_seqlens_q=_cumulative(q_lens, dev),
        cu_seqlens_k=_cumulative(k_lens, dev),
        max_seqlen_q=int(q_lens.max()) if q_lens.numel() else 0,
        max_seqlen_k=int(k_lens.max()) if k_lens.numel() else 0,
        causal=plan.causal,
        window_size=window_size,
        q_index=q_index.to(dev),
        k_index=k_index.to(dev),
        batch=win.batch,
        q_len=win.q_len,
        kv_len=win.kv_len,
    )
    if not aligned:
        _check_exact(one_mask_for_all_heads(mask, "varlen"), win, lowered, plan.rule_piece)
    return lowered


def _sequences(
    plan: VarlenPlan, win: Window, left: int, aligned: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The kernel's sequences in order (by batch row, then first query): their row, local
    queries ``[qa, qb)`` and local keys ``[ka, kb)``. A segment is a sequence where the
    window holds both its queries and its keys; with ``causal``, keys after its last query
    (and before its first query's window) are left out, as no query attends them."""
    # Segments and offsets shared by every row: one row's sequences, repeated for each.
    shared = len(plan.segment_ids) == 1 and win.q_offset.shape[0] == win.kv_offset.shape[0] == 1
    rows = 1 if shared else win.batch
    ids = torch.stack(plan.segment_ids)
    ids = ids[torch.arange(rows).clamp(max=ids.shape[0] - 1)]
    q0 = win.q_offset.expand(rows, 1)
    k0 = win.kv_offset.expand(rows, 1)
    q_row, q_seg, qa, qb = _runs(ids.gather(1, q0 + torch.arange(win.q_len)))
    if aligned:  # each run's keys are its queries, none left out by the rule
        return _repeated((q_row, qa, qb, qa, qb), rows, win.batch)
    k_row, k_seg, ka, kb = _runs(ids.gather(1, k0 + torch.arange(win.kv_len)))
    # Match each query run with the key run of its (row, segment): at most one each.
    span = int(torch.cat([q_seg, k_seg, q_seg.new_zeros(1)]).max()) + 1
    k_key, order = (k_row * span + k_seg).sort()
    at = torch.searchsorted(k_key, q_row * span + q_seg).clamp(max=max(k_key.numel() - 1, 0))
    if k_key.numel():
        found = k_key[at] == q_row * span + q_seg
        k_first, k_end = ka[order][at], kb[order][at]
    else:
        found = torch.zeros_like(q_seg, dtype=torch.bool)
        k_first, k_end = torch.zeros_like(qa), torch.zeros_like(qa)
    q_off, k_off = q0.view(-1)[q_row], k0.view(-1)[q_row]
    k_first, k_end = k_first + k_off, k_end + k_off  # absolute, as the rule compares them
    if plan.causal:  # keys after the last query are attended by none of them
        k_end = torch.minimum(k_end, q_off + qb)
        if plan.window is not None:
            k_first = torch.maximum(k_first, q_off + qa - left)
    keep = found & (k_end > k_first)
    k_first, k_end = k_first - k_off, k_end - k_off
    return _repeated((q_row[keep], qa[keep], qb[keep], k_first[keep], k_end[keep]), rows, win.batch)


def _repeated(
    found: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], rows: int, batch: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The sequences of ``rows`` rows for ``batch`` rows: as they are, or one row's
    repeated for each batch row."""
    if rows == batch:
        return found
    row = torch.arange(batch).repeat_interleave(found[0].numel())
    qa, qb, ka, kb = (t.repeat(batch) for t in found[1:])
    return row, qa, qb, ka, kb


def _runs(ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The runs of equal ids ``>= 0`` of each row of ``(B, n)``, in order: their row, id,
    and local positions ``[start, end)``."""
    n = ids.shape[1]
    change = torch.ones_like(ids, dtype=torch.bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    flat = change.view(-1).nonzero().view(-1)
    ends = torch.cat([flat[1:], flat.new_full((1,), ids.numel())])
    seg = ids.view(-1)[flat]
    real = seg >= 0
    flat, ends, seg = flat[real], ends[real], seg[real]
    row = flat.div(n, rounding_mode="floor")
    return row, seg, flat - row * n, ends - row * n


def _spread(starts: Tensor, lengths: Tensor) -> Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])``, without the loop."""
    total = int(lengths.sum()) if lengths.numel() else 0
    before = lengths.cumsum(0) - lengths
    return torch.repeat_interleave(starts - before, lengths, output_size=total) + torch.arange(
        total
    )


def _cumulative(lengths: Tensor, device: torch.device) -> Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0).to(torch.int32)
    return cu.to(device)


def _kernel_intervals(lowered: VarlenMask) -> tuple[Tensor, Tensor]:
    """Per flat query, the flat kv interval the kernel attends (flash-attn's documented
    rule), empty for queries in no sequence."""
    total = lowered.batch * lowered.q_len
    lo = torch.full((total,), INF, dtype=torch.int64)
    hi = torch.full((total,), -INF, dtype=torch.int64)
    cu_q, cu_k = lowered.cu_seqlens_q.cpu().long(), lowered.cu_seqlens_k.cpu().long()
    q_index, k_index = lowered.q_index.cpu(), lowered.k_index.cpu()
    left, right = lowered.window_size
    sq, sk = cu_q.diff(), cu_k.diff()
    # Per packed query: its sequence, and its place in it.
    seq = torch.repeat_interleave(torch.arange(sq.numel()), sq, output_size=q_index.numel())
    shift = torch.arange(q_index.numel()) - cu_q[:-1][seq] + (sk - sq)[seq]
    first = shift - left if left >= 0 else torch.full_like(shift, -INF)
    last = shift if lowered.causal else (shift + right if right >= 0 else shift + INF)
    first, last = first.clamp(min=0), torch.minimum(last, (sk - 1)[seq])
    kv_first = k_index[cu_k[:-1].clamp(max=max(k_index.numel() - 1, 0))][seq]
    lo[q_index] = torch.where(first <= last, kv_first + first, INF)
    hi[q_index] = torch.where(first <= last, kv_first + last, -INF)
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
