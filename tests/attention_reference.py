"""The reference attention, in float64, written plainly from the documented semantics; and
the rule a backend's result is held to against it.

Nothing here imports flexmask: the only mask it knows is the dense bool tensor
``(B, Hq, Q_LEN, KV_LEN)`` (from ``Mask.to_dense`` or torch's ``create_mask``).

Semantics (``flexmask.attention``'s docstring, torch's flex_attention):

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

import torch
from torch import Tensor

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


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dense: Tensor,
    scale: float | None = None,
    enable_gqa: object = False,
) -> tuple[Tensor, Tensor]:
    """(output, lse) in float64, differentiable w.r.t. ``query``, ``key`` and ``value``.

    ``dense``: bool, broadcastable to ``(B, Hq, Q_LEN, KV_LEN)``. Inputs of any float dtype
    and layout; they are read as float64 values. Where every input is finite the scores are
    one matmul; otherwise every (query, key) product is formed separately and the masked-out
    ones replaced before they meet anything, so no NaN can leak through a masked pair — in
    the forward or in autograd's backward (a plain matmul's backward multiplies a masked
    pair's zero gradient into its key: ``0 * nan``).
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
    return out, lse.squeeze(-1).detach()


def reference_outcome(
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
        out, lse = reference_attention(*leaves, dense, scale, enable_gqa)
        grads = None
        if grad_out is not None:
            grads = torch.autograd.grad(out, leaves, grad_out.to(torch.float64))
    return Outcome(out.detach(), lse, grads)


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
    """What in ``got`` breaks the module docstring's rule against the reference ``want``
    (made by ``reference_outcome`` from the same inputs); empty when it holds."""
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
