"""A mask as cuDNN's flex_attention takes it: per query, endpoints of visible key intervals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_device, check_int
from flexmask.algebra import Mask
from flexmask.formats._structure import Window, head_masks, lines, window


@dataclass(frozen=True, eq=False)
class CudnnMask:
    """The mask arguments of cuDNN's ``cudnn.flex_attention.create_mask_plan``.

    ``mask_func`` is int32 ``(H_mask, n_func, total_q)``, ``H_mask`` 1 (every head) or
    ``H_q`` (one per query head, where the heads differ), ``n_func`` odd. Query row ``t`` of
    head ``h`` sees the sample-local keys ``[0, F0) ∪ [F1, F2) ∪ …`` with
    ``F = mask_func[h, :, t]``; the endpoints never decrease and lie in ``[0, S_k]`` of the
    row's sample (an empty interval repeats the previous end).

    Fixed (BSHD) form, ``cu_seqlens_q`` None: ``total_q = B * Q_LEN``, row ``b * Q_LEN + q``
    is query ``q`` of batch row ``b`` (each batch row its own sample, so rows may differ).
    Varlen (THD) form: sample ``b`` is batch row ``b``'s queries ``q_index[cu_seqlens_q[b]:
    cu_seqlens_q[b + 1]]`` and keys ``k_index[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]`` (flat
    ``b * Q_LEN + q`` and ``b * KV_LEN + kv``), each the row's leading run: queries past the
    row's last one that attends anything, and keys past the last attended one, are left
    out (``unpack`` gives those queries zero output, as flex_attention does).
    """

    mask_func: Tensor
    cu_seqlens_q: Tensor | None
    cu_seqlens_k: Tensor | None
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    q_index: Tensor | None
    """int64 ``(total_q,)`` in the varlen form: each packed query's flat ``(B * Q_LEN)`` row."""
    k_index: Tensor | None
    """int64 ``(total_k,)`` in the varlen form: each packed key's flat ``(B * KV_LEN)`` row."""
    batch: int
    q_len: int
    kv_len: int

    @property
    def n_func(self) -> int:
        """The number of endpoints per query: ``2 * intervals - 1``."""
        return self.mask_func.shape[1]

    @property
    def varlen(self) -> bool:
        """Whether this is the THD form (``cu_seqlens_*`` given)."""
        return self.cu_seqlens_q is not None

    def kwargs(self) -> dict[str, Any]:
        """Keywords of ``cudnn.flex_attention.create_mask_plan`` besides ``q, k, v``:
        ``mask_func`` and, in the varlen form, ``cu_seqlens_q/k`` and ``max_seqlen_q/k``."""
        out: dict[str, Any] = {"mask_func": self.mask_func}
        if self.varlen:
            out.update(
                cu_seqlens_q=self.cu_seqlens_q,
                cu_seqlens_k=self.cu_seqlens_k,
                max_seqlen_q=self.max_seqlen_q,
                max_seqlen_k=self.max_seqlen_k,
            )
        return out

    def pack_q(self, x: Tensor) -> Tensor:
        """``(B, Q_LEN, ...)`` → the kernel's query layout (``(total_q, ...)`` in THD)."""
        return _pack(x, self.batch, self.q_len, self.q_index)

    def pack_kv(self, x: Tensor) -> Tensor:
        """``(B, KV_LEN, ...)`` → the kernel's key/value layout."""
        return _pack(x, self.batch, self.kv_len, self.k_index)

    def unpack(self, out: Tensor) -> Tensor:
        """The kernel's output → ``(B, Q_LEN, ...)``, zeros at queries left out."""
        if self.q_index is None:
            return out
        if out.shape[0] != self.q_index.numel():
            raise ValueError(
                f"out must have {self.q_index.numel()} packed queries in dim 0, got "
                f"{tuple(out.shape)}"
            )
        full = out.new_zeros((self.batch * self.q_len, *out.shape[1:]))
        full = full.index_copy(0, self.q_index.to(out.device), out)
        return full.view(self.batch, self.q_len, *out.shape[1:])

    def __repr__(self) -> str:
        form = f"varlen, total_q={self.mask_func.shape[2]}" if self.varlen else "fixed"
        return (
            f"CudnnMask(mask_func=int32{list(self.mask_func.shape)}, n_func={self.n_func}, "
            f"{form}, B={self.batch}, Q_LEN={self.q_len}, KV_LEN={self.kv_len})"
        )


def _pack(x: Tensor, batch: int, length: int, index: Tensor | None) -> Tensor:
    if x.dim() < 2 or x.shape[0] != batch or x.shape[1] != length:
        raise ValueError(
            f"x must have shape (B, S, ...) = ({batch}, {length}, ...), got {tuple(x.shape)}"
        )
    if index is None:
        return x
    return x.reshape(batch * length, *x.shape[2:])[index.to(x.device)]


def to_cudnn(
    mask: Mask,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int | None = None,
    *,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    varlen: bool = False,
    max_intervals: int | None = None,
    device: torch.device | str | None = None,
) -> CudnnMask:
    """Lower a mask to cuDNN flex_attention's interval endpoints (``mask_func``), exactly.

    Each query's attended keys are read from the mask's structure as a few sorted intervals
    (never the Q×KV grid) and written as cuDNN's endpoints: ``n_func`` is the smallest odd
    count that holds every row. Rows that differ (per-row documents, padding) are rows of
    ``mask_func``; heads that differ (``per_head``) give ``H_mask = H``, else ``H_mask = 1``.

    Args:
        mask: the mask.
        B: batch size (None: the mask's rows, else 1).
        H: number of query heads (None: 1).
        Q_LEN, KV_LEN: query and key lengths of the window (KV_LEN None: Q_LEN).
        q_offset, kv_offset: the window's first query and key position, an int or one per row.
        varlen: the THD form: each batch row a sample, trimmed to its queries up to the last
            that attends anything and its keys up to the last attended (see ``CudnnMask``).
        max_intervals: refuse rows that need more intervals than this in cuDNN's form,
            ``(n_func + 1) / 2`` (the first runs from key 0: a row whose first attended key
            is not 0 needs one more); None: any.
        device: where the tensors live (None: the mask's device, else CPU).

    Raises:
        ValueError: a row needing more than ``max_intervals`` intervals (naming the row,
            the head and its intervals), or a leaf whose intervals flexmask cannot read
            (``from_mask_mod``).

    Example:
        >>> import flexmask
        >>> from flexmask.formats import to_cudnn
        >>> c = to_cudnn(flexmask.causal() & flexmask.document([3, 2]), 1, 1, 5)
        >>> c.n_func, c.mask_func[0].T.tolist()   # [0, F0) ∪ [F1, F2) per query
        (3, [[1, 1, 1], [2, 2, 2], [3, 3, 3], [0, 3, 4], [0, 3, 5]])
        >>> to_cudnn(flexmask.causal(), 1, 1, 4).mask_func[0, 0].tolist()
        [1, 2, 3, 4]
    """
    if not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be a flexmask Mask (flexmask.causal(), document(...), ...), "
            f"got {type(mask).__name__}"
        )
    if not isinstance(varlen, bool):
        raise TypeError(f"varlen must be a bool, got {varlen!r}")
    if max_intervals is not None:
        max_intervals = check_int(max_intervals, "max_intervals", minimum=1)
    heads = 1 if H is None else H
    win = window(mask, B, heads, Q_LEN, KV_LEN, q_offset, kv_offset)
    dev = check_device(device, mask.device)
    lo, hi = head_lines(mask, win, heads, "cuDNN flex_attention")
    begins, ends, count = _intervals(lo, hi)
    _check_cap(mask, count, begins, ends, max_intervals)
    # F0 = end of the interval from 0, then (begin, end) of each further one: (Hm, R, Q, n_func),
    # R = 1 where no batch row differs (written out per row once, below).
    rest = torch.stack([begins[..., 1:], ends[..., 1:]], -1).flatten(-2)
    endpoints = torch.cat([ends[..., :1], rest], -1).to(torch.int32)
    endpoints = endpoints.permute(0, 3, 1, 2)  # (Hm, n_func, R, Q)
    if not varlen:
        shape = (*endpoints.shape[:2], win.batch, win.q_len)
        flat = endpoints.expand(shape).reshape(*shape[:2], win.batch * win.q_len)
        return CudnnMask(
            flat.contiguous().to(dev),
            *(None,) * 6,
            batch=win.batch,
            q_len=win.q_len,
            kv_len=win.kv_len,
        )
    return _varlen(endpoints, ends, win, dev)


def head_lines(mask: Mask, win: Window, heads: int, fmt: str) -> tuple[Tensor, Tensor]:
    """Per head (one for all when they attend alike), batch row (one for all when no row
    differs) and query, the attended keys as inclusive local intervals: ``lo``, ``hi``
    ``(1 or H, 1 or B, Q_LEN, K)`` int64 (sorted, disjoint, empty slots ``lo > hi`` last)."""
    distinct, which = head_masks(mask, heads)
    found = [lines(m, win, fmt=fmt) for m in distinct]
    slots = max(f.lo.shape[-1] for f in found)
    rows = max(f.lo.shape[0] for f in found)
    los, his = [], []
    for f in found:
        pad = slots - f.lo.shape[-1]
        lo = torch.nn.functional.pad(f.lo, (0, pad), value=1)
        hi = torch.nn.functional.pad(f.hi, (0, pad), value=0)
        los.append(lo.expand(rows, win.q_len, slots))
        his.append(hi.expand(rows, win.q_len, slots))
    if len(distinct) == 1:
        return los[0][None], his[0][None]
    pick = torch.tensor(which)
    return torch.stack(los)[pick], torch.stack(his)[pick]


def _intervals(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """cuDNN's half-open intervals of each row, the first from key 0 (empty where the row's
    first attended key is not 0), unused slots empty at the last end: ``begins``, ``ends``
    ``(..., W)``, W the most any row uses (at least 1), and each row's count of used slots
    (a prefix: ``lines`` puts the empty slots last)."""
    real = lo <= hi
    # Shifted rows (whose first key is not 0): an empty [0, 0) first, then every interval.
    shifted = ~(real[..., :1] & (lo[..., :1] == 0))
    count = real.sum(-1, keepdim=True) + shifted
    width = int(count.max())
    zero = torch.zeros_like(lo[..., :1])
    if bool(shifted.all()):
        begins, ends = torch.cat([zero, lo], -1), torch.cat([zero, hi + 1], -1)
    elif not bool(shifted.any()):
        begins, ends = lo, hi + 1
    else:
        begins = torch.where(shifted, torch.cat([zero, lo], -1), torch.cat([lo, zero], -1))
        ends = torch.where(shifted, torch.cat([zero, hi + 1], -1), torch.cat([hi + 1, zero], -1))
    begins, ends = begins[..., :width], ends[..., :width]
    if width > 1:
        # Unused slots repeat the last end: endpoints never decrease, and an empty interval
        # that starts where the previous one ends is valid in cuDNN's check.
        last = ends.gather(-1, count - 1)
        used = torch.arange(width) < count
        begins, ends = torch.where(used, begins, last), torch.where(used, ends, last)
    return begins, ends, count[..., 0]


def _check_cap(
    mask: Mask,
    count: Tensor,
    begins: Tensor,
    ends: Tensor,
    cap: int | None,
) -> None:
    if cap is None or not bool((count > cap).any()):
        return
    hm, b, q = (int(i) for i in (count > cap).nonzero()[0])
    n = int(count[hm, b, q])
    spans = [
        [int(a), int(z)] for a, z in zip(begins[hm, b, q, :n], ends[hm, b, q, :n], strict=True)
    ]
    raise ValueError(
        f"{mask!r} cannot be lowered to cuDNN flex_attention with max_intervals={cap}: "
        f"query {q} of batch row {b} (head {hm}) sees the key intervals "
        f"{spans} (half-open, the first from key 0), {n} intervals, n_func = {2 * n - 1}. "
        f"Raise max_intervals to {int(count.max())}, or use to_cudnn_bsa / create_block_mask"
    )


def _varlen(endpoints: Tensor, ends: Tensor, win: Window, dev: torch.device) -> CudnnMask:
    """The THD form from ``endpoints`` ``(Hm, n_func, R, Q)``: each batch row's leading
    queries up to its last attending one, and its keys up to the last one attended (nothing
    left out is attended)."""
    # A row attends something iff it has a non-empty interval: its greatest end is > 0.
    reach = ends.amax(-1).amax(0).expand(win.batch, -1)  # (B, Q): the last end, any head
    attends = reach > 0
    q_index = torch.arange(win.q_len).expand(win.batch, -1)
    q_lens = torch.where(attends, q_index + 1, 0).amax(-1)
    k_lens = reach.amax(-1)
    rows = torch.arange(win.batch)
    keep_q = q_index < q_lens.unsqueeze(-1)
    keep_k = torch.arange(win.kv_len).expand(win.batch, -1) < k_lens.unsqueeze(-1)
    flat_q = (rows.view(-1, 1) * win.q_len + q_index)[keep_q]
    flat_k = (rows.view(-1, 1) * win.kv_len + torch.arange(win.kv_len))[keep_k]
    shape = (*endpoints.shape[:2], win.batch, win.q_len)
    packed = endpoints.expand(shape).reshape(*shape[:2], -1)[..., flat_q]
    return CudnnMask(
        packed.contiguous().to(dev),
        _cumulative(q_lens, dev),
        _cumulative(k_lens, dev),
        int(q_lens.max()),
        int(k_lens.max()),
        flat_q.to(dev),
        flat_k.to(dev),
        batch=win.batch,
        q_len=win.q_len,
        kv_len=win.kv_len,
    )


def _cumulative(lengths: Tensor, device: torch.device) -> Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0).to(torch.int32)
    return cu.to(device)
