"""Independent references, written plainly, and the one build of torch's BlockMask.

Nothing here imports flexmask:

* dense masks, Python loops over each piece's definition: numpy bool arrays (B, H, Q, KV);
* ``torch_build``: torch's own ``create_block_mask`` of a mask_mod or of a lookup into a
  dense array (shifted to a window), and ``torch_order``, the order it writes each side in;
  ``assert_same_block_mask`` compares a BlockMask with it as whole tensors;
* ``attention``: the one reference attention, in float64, over a dense bool mask
  ``(B, Hq, Q_LEN, KV_LEN)`` (from ``Mask.to_dense``, torch's ``create_mask`` or the dense
  masks here), and ``differences``: the rule a backend's result is held to against it.

The reference attention's semantics (``flexmask.attention``'s docstring, torch's
flex_attention):

* scores ``s = scale * q @ k^T``, ``scale`` by default ``1 / sqrt(D)``; query head ``h`` reads
  kv head ``h // (Hq // Hkv)``;
* query ``i`` attends key ``j`` iff the dense mask says so; ``out_i`` is the softmax of its
  attended scores, computed with the row's maximum subtracted, times the attended values;
  a row that attends nothing gives 0 (and zero gradients), its lse ``-inf``; the lse is the
  natural logsumexp of the attended scores;
* a masked-out pair never influences anything: every masked-out product is excluded with
  ``torch.where`` (never multiplied by 0), forward and backward, so a NaN or inf in a key,
  value or query that a row does not attend reaches neither that row's output nor any
  gradient through it;
* at attended positions non-finite values go through IEEE arithmetic: a NaN in an attended
  key (or in the row's query) makes the row NaN, a NaN in an attended value the output dims
  it is in, a +inf score (``+inf - +inf`` once the max is subtracted) the row NaN, and a
  -inf score an exp of 0 (as if masked).

The comparison rule (``differences``), chosen so that legitimate IEEE differences between
kernels (``inf * 0`` against ``inf``, a float32 probability that underflows) pass:

* an output or lse entry that is finite in the reference must be finite in the result and
  within the dtype's tolerance (scaled by the row's score size and value size);
* an entry that is non-finite in the reference must be non-finite in the result (NaN, +inf and
  -inf are not told apart);
* a row that attends something but all of whose attended scores are -inf (say a key with a
  -inf entry met by a positive query entry, and no other key) is NaN by the IEEE rule above
  (``-inf - -inf``); a kernel that guards its running max treats it as attending nothing
  instead. Both are accepted there: the whole row non-finite, or output 0 and lse -inf;
* a row that attends nothing has lse exactly -inf and output exactly 0;
* gradients are compared entry by entry (finite and within tolerance) on the rows and keys
  not connected to a non-finite input: a query row is connected when it attends a key whose
  key or value holds a non-finite entry, or its own query holds one and it attends
  anything; a key is connected when a connected row attends it. With finite inputs that is
  every entry; the connected ones are not checked (their gradients are NaN or inf by the
  reference's own arithmetic, ``-inf * 0`` and the like).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

BLOCK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _grid(q_len: int, kv_len: int):
    q = np.arange(q_len)[:, None]
    kv = np.arange(kv_len)[None, :]
    return q, kv


def causal(q_len, kv_len):
    q, kv = _grid(q_len, kv_len)
    return kv <= q


def sliding_window(size, q_len, kv_len):
    q, kv = _grid(q_len, kv_len)
    return np.abs(q - kv) < size


def prefix(length, q_len, kv_len):
    q, kv = _grid(q_len, kv_len)
    return np.broadcast_to(kv < length, (q_len, kv_len))


def padding(length, q_len, kv_len):
    q, kv = _grid(q_len, kv_len)
    return (q < length) & (kv < length)


def document(seq_lens, q_len, kv_len):
    doc_of = {}
    pos = 0
    for d, n in enumerate(seq_lens):
        for _ in range(n):
            doc_of[pos] = d
            pos += 1
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        for kv in range(kv_len):
            out[q, kv] = q in doc_of and kv in doc_of and doc_of[q] == doc_of[kv]
    return out


def chunked(size, q_len, kv_len):
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        for kv in range(kv_len):
            out[q, kv] = q // size == kv // size
    return out


def spans(ids, q_len, kv_len):
    """Same non-negative id: attends both ways (ids are per token; past them, no span)."""
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(min(q_len, len(ids))):
        for kv in range(min(kv_len, len(ids))):
            out[q, kv] = ids[q] >= 0 and ids[q] == ids[kv]
    return out


def tree(parents, q_len, kv_len):
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(min(q_len, len(parents))):
        node = q
        while node != -1:  # walk up: q itself, its parent, ...
            if node < kv_len:
                out[q, node] = True
            node = parents[node]
    return out


def stack(rows: list[np.ndarray], heads: int = 1) -> np.ndarray:
    """(B, H, Q, KV) from one (Q, KV) array per row."""
    arr = np.stack([np.asarray(r, dtype=bool) for r in rows])[:, None]
    return np.repeat(arr, heads, axis=1)


def block_mask_meaning(block_mask, batch, heads, q_len, kv_len, element=None) -> torch.Tensor:
    """What a BlockMask attends, read from its lists block by block (torch's documented
    meaning), as (B, H, Q_LEN, KV_LEN) bool: a listed full block everything, a listed
    partial block the element mask there, an unlisted block nothing. ``element``: that mask,
    broadcastable to (B, H, Q_LEN, KV_LEN); by default its mask_mod through torch's
    ``create_mask``."""
    from torch.nn.attention.flex_attention import create_mask

    if element is None:
        element = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    element = torch.as_tensor(element).expand(batch, heads, q_len, kv_len)
    q_block, kv_block = block_mask.BLOCK_SIZE
    dense = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.bool)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, False)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True))
    for num, indices, full in lists:
        for b in range(batch):
            for h in range(heads):
                mb, mh = b % num.size(0), h % num.size(1)
                for i in range(-(-q_len // q_block)):
                    rows = slice(i * q_block, (i + 1) * q_block)
                    for j in indices[mb, mh, i, : int(num[mb, mh, i])].tolist():
                        cols = slice(j * kv_block, (j + 1) * kv_block)
                        dense[b, h, rows, cols] = True if full else element[b, h, rows, cols]
    return dense


def torch_build(
    source,
    B: int | None = None,
    H: int | None = None,
    q_len: int | None = None,
    kv_len: int | None = None,
    block=128,
    *,
    q_offset=0,
    kv_offset=0,
    **flags,
):
    """The one build of torch's own BlockMask every test compares with: torch's
    ``create_block_mask`` (uncompiled, on the CPU) of ``source`` at
    ``mod(b, h, q_idx + q_offset, kv_idx + kv_offset)`` — the window ``create_block_mask``'s
    docstring defines for the offsets, written here without flexmask's ShiftedMod.

    ``source``: a mask_mod ``(b, h, q_idx, kv_idx) -> bool`` (a flexmask Mask's
    ``mask_mod``, or one written plainly in a test), or a dense bool array
    ``(B, H, Q, KV)`` (numpy or torch), read by lookup; B, H, Q_LEN and KV_LEN default to
    its shape. ``q_offset``/``kv_offset``: an int or one per row. ``flags``: torch's other
    keywords (``BLOCK_SIZE`` is ``block``)."""
    if callable(source):
        mod = source
    else:
        table = torch.as_tensor(np.ascontiguousarray(source))
        B, H = table.shape[0] if B is None else B, table.shape[1] if H is None else H
        q_len = table.shape[2] - _largest(q_offset) if q_len is None else q_len
        kv_len = table.shape[3] - _largest(kv_offset) if kv_len is None else kv_len

        def mod(b, h, q_idx, kv_idx):
            return table[b, h, q_idx, kv_idx]

    if isinstance(q_offset, int) and isinstance(kv_offset, int):
        if q_offset == kv_offset == 0:
            return torch_create_block_mask(
                mod, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=block, **flags
            )
        qo, ko = q_offset, kv_offset

        def shifted(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx + qo, kv_idx + ko)

    else:
        qo, ko = (torch.as_tensor(o).expand(B) for o in (q_offset, kv_offset))

        def shifted(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx + qo[b], kv_idx + ko[b])

    return torch_create_block_mask(
        shifted, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=block, **flags
    )


def _largest(offset) -> int:
    return int(np.max(np.asarray(offset)))


def torch_order(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One side of a BlockMask as torch's ``create_block_mask`` writes it from a grid of
    flags (..., lines, blocks): the counts, and the indices as a stable descending argsort
    (set blocks ascending, then unset ones)."""
    order = torch.argsort(blocks.to(torch.uint8), dim=-1, descending=True, stable=True)
    return blocks.sum(-1, dtype=torch.int32), order.to(torch.int32)


def assert_same_block_mask(ours, reference, context="", *, own_storage=True) -> None:
    """Drop-in equality: same lengths and block sizes, and every one of the eight tensors
    ``torch.equal`` to the reference's as a whole (the unlisted tail included, which
    ``BlockMask._adjust`` reads) — and, with ``own_storage``, contiguous with a storage of
    its own, as torch's builder writes them (torch's ``_adjust`` returns slices)."""
    assert ours.seq_lengths == reference.seq_lengths, context
    assert tuple(ours.BLOCK_SIZE) == tuple(reference.BLOCK_SIZE), context
    storages = set()
    for field in BLOCK_FIELDS:
        a, b = getattr(ours, field), getattr(reference, field)
        assert a.shape == b.shape, f"{context} {field}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{context} {field}: dtype {a.dtype} != {b.dtype}"
        assert torch.equal(a, b), f"{context} {field} differs:\n{a}\n!=\n{b}"
        if not own_storage:
            continue
        assert a.is_contiguous(), f"{context} {field}: not contiguous (stride {a.stride()})"
        if a.numel():
            storages.add(a.untyped_storage().data_ptr())
    nonempty = sum(getattr(ours, f).numel() > 0 for f in BLOCK_FIELDS)
    assert not own_storage or len(storages) == nonempty, f"{context}: tensors share storage"


# --- the reference attention --------------------------------------------------------------

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}
"""Per dtype: an output entry may differ from the reference by this times ``(1 + s) x
(1 + v)``, ``s`` the row's score size (``score_size``: what a kernel's rounding of scores
scales with) and ``v`` the largest ``|value|`` it attends; an lse entry by this times
``(1 + s)``; a gradient entry by this times ``(1 + largest s) x (1 + largest |reference
gradient|)`` of its tensor. Measured against the backends on 300 random finite cases
(scales to 30, every backend): the worst errors were 0.07 of these (float32), 0.28
(bfloat16: mostly the result's own rounding to bfloat16) and below 1e-4 (float64)."""


class Outcome(NamedTuple):
    """One attention call's results: the output, the lse (None without ``return_lse``) and
    the gradients of ``(out * grad_out).sum()`` w.r.t. query, key and value (None without
    gradients)."""

    out: Tensor
    lse: Tensor | None
    grads: tuple[Tensor, Tensor, Tensor] | None


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dense: Tensor,
    scale: float | None = None,
    enable_gqa: object = True,
    *,
    score_mod=None,
) -> tuple[Tensor, Tensor]:
    """The one reference attention: (output, lse) in float64, both differentiable w.r.t.
    ``query``, ``key`` and ``value``.

    ``dense``: bool, broadcastable to ``(B, Hq, Q_LEN, KV_LEN)``. Inputs of any float dtype
    and layout; they are read as float64 values. Where every input is finite the scores are
    one matmul; otherwise every (query, key) product is formed separately and the masked-out
    ones replaced before they meet anything, so no NaN can leak through a masked pair — in
    the forward or in autograd's backward (a plain matmul's backward multiplies a masked
    pair's zero gradient into its key: ``0 * nan``). Query head ``h`` reads kv head
    ``h // (Hq // Hkv)`` (``enable_gqa``; False refuses unequal heads, as flex does).
    ``score_mod``: flex's ``score_mod(score, b, h, q_idx, kv_idx)`` on the scaled scores,
    before the mask.
    """
    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads != kv_heads:
        if not enable_gqa or q_heads % kv_heads:
            raise ValueError(f"{q_heads} query heads and {kv_heads} kv heads need enable_gqa")
        group = q_heads // kv_heads  # query head h reads kv head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    allowed = torch.as_tensor(dense, dtype=torch.bool).expand(batch, q_heads, q_len, kv_len)
    has_key = allowed.any(-1, keepdim=True)
    finite = all(bool(t.isfinite().all()) for t in (q, k, v))

    if finite:
        raw = scale * (q @ k.transpose(-1, -2))
    else:
        pair = allowed.unsqueeze(-1)  # (B, H, Q, KV, 1)
        q_pairs = torch.where(pair, q.unsqueeze(-2), 0.0)
        k_pairs = torch.where(pair, k.unsqueeze(-3), 0.0)
        raw = scale * (q_pairs * k_pairs).sum(-1)
    if score_mod is not None:  # flex's score_mod(score, b, h, q_idx, kv_idx), on every pair
        b, h, i, j = (
            torch.arange(n).view(*([1] * d), n, *([1] * (3 - d))) for d, n in enumerate(raw.shape)
        )
        raw = score_mod(raw, b, h, i, j)
    scores = torch.where(allowed, raw, -math.inf)
    # The row max is a constant for the gradient (softmax does not depend on it); NaN and
    # +inf propagate through it as IEEE says (amax propagates NaN).
    row_max = scores.detach().amax(-1, keepdim=True)
    shift = torch.where(has_key, row_max, 0.0)
    exps = torch.where(allowed, torch.exp(scores - shift), 0.0)
    total = exps.sum(-1, keepdim=True)
    probs = torch.where(allowed, exps / torch.where(has_key, total, 1.0), 0.0)
    if finite:
        out = probs @ v
    else:
        v_pairs = torch.where(allowed.unsqueeze(-1), v.unsqueeze(-3), 0.0)  # (B, H, Q, KV, Dv)
        out = torch.where(allowed.unsqueeze(-1), probs.unsqueeze(-1) * v_pairs, 0.0).sum(-2)
    lse = torch.where(has_key, torch.log(torch.where(has_key, total, 1.0)) + shift, -math.inf)
    return out, lse.squeeze(-1)


def attention_outcome(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dense: Tensor,
    scale: float | None = None,
    enable_gqa: object = False,
    grad_out: Tensor | None = None,
) -> Outcome:
    """The reference's output, lse and (with ``grad_out``) autograd gradients, all float64."""
    leaves = [
        t.detach().to(torch.float64).requires_grad_(grad_out is not None)
        for t in (query, key, value)
    ]
    with torch.set_grad_enabled(grad_out is not None):
        out, lse = attention(*leaves, dense, scale, enable_gqa)
        grads = None
        if grad_out is not None:
            grads = torch.autograd.grad(out, leaves, grad_out.to(torch.float64))
    return Outcome(out.detach(), lse.detach(), grads)


def score_size(query: Tensor, key: Tensor, dense: Tensor, scale: float | None) -> Tensor:
    """Per row ``(B, Hq, Q, 1)``: the largest ``|scale| * sum_d |q_d k_d|`` over its
    attended keys (finite entries only), the size an error of a kernel's scores scales with."""
    q, k = (t.detach().to(torch.float64).nan_to_num(0.0, 0.0, 0.0).abs() for t in (query, key))
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    sizes = abs(scale) * (q @ k.transpose(-1, -2))
    allowed = torch.as_tensor(dense, dtype=torch.bool).expand(sizes.shape)
    return torch.where(allowed, sizes, 0.0).amax(-1, keepdim=True)


def connected(query: Tensor, key: Tensor, value: Tensor, dense: Tensor) -> tuple[Tensor, Tensor]:
    """``(rows, keys)``: query rows ``(B, Hq, Q)`` and keys ``(B, Hkv, KV)`` whose results a
    non-finite input may reach (the module docstring's rule)."""
    batch, q_heads, q_len = query.shape[:3]
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    allowed = torch.as_tensor(dense, dtype=torch.bool).expand(batch, q_heads, q_len, kv_len)
    bad_kv = ~(key.detach().isfinite().all(-1) & value.detach().isfinite().all(-1))
    bad_kv = bad_kv.repeat_interleave(group, dim=1)  # (B, Hq, KV)
    bad_q = ~query.detach().isfinite().all(-1)
    rows = (allowed & bad_kv.unsqueeze(-2)).any(-1) | (bad_q & allowed.any(-1))
    keys = (allowed & rows.unsqueeze(-1)).any(-2)  # (B, Hq, KV)
    keys = keys.view(batch, kv_heads, group, kv_len).any(2)
    return rows, keys


def _where_not_close(got: Tensor, want: Tensor, atol: Tensor) -> Tensor:
    """Bool: entries where a finite ``want`` is not matched by a finite ``got`` within atol."""
    got = got.detach().to(torch.float64)
    ok = got.isfinite() & ((got - want).abs() <= atol)
    return want.isfinite() & ~ok


def _describe(name: str, bad: Tensor, got: Tensor, want: Tensor) -> str:
    where = bad.nonzero()
    first = tuple(where[0].tolist())
    return (
        f"{name}: {int(bad.sum())} of {bad.numel()} entries differ, first at {first}: "
        f"got {float(got[first])!r}, want {float(want[first])!r}"
    )


def differences(
    got: Outcome,
    want: Outcome,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dense: Tensor,
    scale: float | None,
) -> list[str]:
    """What in ``got`` breaks the comparison rule (the module docstring) against the
    reference ``want`` (made by ``attention_outcome`` from the same inputs); empty when it
    holds."""
    problems: list[str] = []
    dtype = query.dtype
    tol = TOLERANCE[dtype]
    batch, q_heads, q_len = query.shape[:3]
    kv_len = key.shape[2]
    allowed = torch.as_tensor(dense, dtype=torch.bool).expand(batch, q_heads, q_len, kv_len)
    has_key = allowed.any(-1)
    if got.out.shape != want.out.shape or got.out.dtype != dtype:
        return [
            f"out: shape {tuple(got.out.shape)} {got.out.dtype}, want "
            f"{tuple(want.out.shape)} {dtype}"
        ]
    sizes = score_size(query, key, dense, scale)  # (B, Hq, Q, 1)
    v = value.detach().to(torch.float64).nan_to_num(0.0, 0.0, 0.0).abs().amax(-1)  # (B, Hkv, KV)
    v = v.repeat_interleave(q_heads // v.shape[1], dim=1).unsqueeze(-2)  # (B, Hq, 1, KV)
    value_size = torch.where(allowed, v, 0.0).amax(-1, keepdim=True)  # (B, Hq, Q, 1)
    atol = tol * (1.0 + sizes) * (1.0 + value_size)

    # Rows that attend something, every attended score -inf: NaN by IEEE, or empty.
    all_minus_inf = has_key & ~want.out.isfinite().all(-1) & want.lse.isnan()
    if bool(all_minus_inf.any()):
        raw = _raw_scores(query, key, dense, scale)
        all_minus_inf &= torch.where(allowed, raw == -math.inf, True).all(-1)
    out = got.out.detach().to(torch.float64)
    either = all_minus_inf.unsqueeze(-1)
    row_non_finite = ~out.isfinite().all(-1, keepdim=True)
    row_empty = (out == 0).all(-1, keepdim=True)
    bad = either & ~(row_non_finite | row_empty)
    if bool(bad.any()):
        problems.append(
            _describe("out (a row of -inf scores: NaN or 0)", bad.expand_as(out), out, want.out)
        )
    checked = ~either
    bad = checked & (
        _where_not_close(out, want.out, atol) | (~want.out.isfinite() & out.isfinite())
    )
    if bool(bad.any()):
        problems.append(_describe("out", bad, out, want.out))
    empty_rows = ~has_key.unsqueeze(-1) & (out != 0)
    if bool(empty_rows.any()):
        problems.append(_describe("out (a row that attends nothing: 0)", empty_rows, out, want.out))

    if got.lse is not None:
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if got.lse.shape != want.lse.shape or got.lse.dtype != lse_dtype:
            problems.append(
                f"lse: shape {tuple(got.lse.shape)} {got.lse.dtype}, want "
                f"{tuple(want.lse.shape)} {lse_dtype}"
            )
        else:
            lse = got.lse.detach().to(torch.float64)
            lse_tol = tol * (1.0 + sizes.squeeze(-1))
            either = all_minus_inf
            bad = either & ~(lse.isnan() | (lse == -math.inf) | (lse == math.inf))
            bad |= ~either & (
                _where_not_close(lse, want.lse, lse_tol) | (~want.lse.isfinite() & lse.isfinite())
            )
            bad |= ~has_key & (lse != -math.inf)
            if bool(bad.any()):
                problems.append(_describe("lse", bad, lse, want.lse))

    if want.grads is not None:
        if got.grads is None:
            return [*problems, "no gradients"]
        rows, keys = connected(query, key, value, dense)
        for name, g, w, clean in zip(
            ("grad query", "grad key", "grad value"),
            got.grads,
            want.grads,
            (~rows, ~keys, ~keys),
            strict=True,
        ):
            if g is None or g.shape != w.shape or g.dtype != dtype:
                problems.append(f"{name}: {None if g is None else (tuple(g.shape), g.dtype)}")
                continue
            g = g.detach().to(torch.float64)
            finite_w = torch.where(w.isfinite(), w, 0.0)
            size = finite_w.abs().amax() if w.numel() else torch.tensor(0.0)
            grad_tol = tol * (1.0 + sizes.amax()) * (1.0 + size)
            clean = clean.unsqueeze(-1).expand_as(w)
            bad = clean & (~g.isfinite() | ~w.isfinite() | ((g - finite_w).abs() > grad_tol))
            if bool(bad.any()):
                problems.append(_describe(name, bad, g, w))
    return problems


def _raw_scores(query: Tensor, key: Tensor, dense: Tensor, scale: float | None) -> Tensor:
    """``scale * q . k`` per pair in float64 (IEEE, each pair on its own), masked pairs 0."""
    q, k = (t.detach().to(torch.float64) for t in (query, key))
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    allowed = torch.as_tensor(dense, dtype=torch.bool).expand(*q.shape[:3], k.shape[2])
    pair = allowed.unsqueeze(-1)
    products = torch.where(pair, q.unsqueeze(-2), 0.0) * torch.where(pair, k.unsqueeze(-3), 0.0)
    return scale * products.sum(-1)


# ---------------------------------------------------------------------------- context parallel
class FakeMesh:
    """The three things torch's ``_create_cp_block_mask`` reads from a DeviceMesh: ranks in
    one process."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank, self.device_type = world, rank, "cpu"

    def size(self) -> int:
        return self.world

    def get_local_rank(self) -> int:
        return self.rank


def torch_cp_shard(mask, B, H, S, world, rank, balancer, kv_len=None):
    """torch's own ``_create_cp_block_mask`` of ``mask.mask_mod`` on rank ``rank`` of
    ``world``, eager (its compile swapped for the eager build: the same blocks); without a
    balancer, load balancing off. ``kv_len``: the key length where it is not S."""
    import torch.distributed.tensor.experimental._context_parallel._attention as torch_cp

    saved = torch_cp._compiled_create_block_mask, torch_cp._cp_options.enable_load_balance
    torch_cp._compiled_create_block_mask = torch_create_block_mask
    torch_cp._cp_options.enable_load_balance = balancer is not None
    try:
        return torch_cp._create_cp_block_mask(
            mask.mask_mod, B, H, S, S if kv_len is None else kv_len, FakeMesh(world, rank), balancer
        )
    finally:
        torch_cp._compiled_create_block_mask, torch_cp._cp_options.enable_load_balance = saved
