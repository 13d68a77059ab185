"""Non-finite values on the CPU backends: a masked-out position never reaches an output.

Padding often holds garbage, NaN and inf included. Dense and fused kernels mask by adding
``-inf`` to a score (``nan + -inf`` is NaN) and multiply probabilities by values
(``0 * nan`` is NaN), so a NaN at a position a query does not attend can still reach its
output, and through the backward its gradients. flex_attention's rule is flexmask's: only
what a row attends reaches it, and there non-finite values propagate as in a softmax.

Every CPU backend runs under :func:`attend_checked`:

* without gradients, the backend runs on the tensors as given; an output with no
  non-finite entry cannot have been touched by one (nothing maps NaN or +inf back to a
  finite value but a mask), so only rows whose output is not finite are recomputed,
  exactly, by :func:`exact_rows`;
* with gradients, the backward could carry a masked NaN into other rows' gradients even
  where the forward did not, so q, k and v are checked first (one pass each); where they
  hold non-finite entries the backend runs on copies with those entries set to 0, and the
  rows that read one (a query holding one, or attending a key or value that holds one) are
  recomputed by :func:`exact_rows`.

Finite inputs cost one summing pass over the output, q, k and v (``_all_finite``).
Devices other than the CPU run torch's kernels as they are (a check would sync the host).
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.backends.mod_eval import broadcasts, call_mod
from flexmask.backends.request import Request
from flexmask.backends.threads import one_thread
from flexmask.blocks import FULL, PARTIAL, kv_codes

# Scores one step of exact_rows holds (B x Hq x rows x KV_LEN): 64 MiB in float32.
MAX_EXACT_ELEMENTS = 1 << 24


def attend_checked(backend: ModuleType, request: Request) -> Tensor | tuple[Tensor, Tensor]:
    """``backend.attend(request)`` (a lowered request), with no masked-out non-finite value
    reaching an output or a gradient (module docstring)."""
    if not request.on_cpu:
        return backend.attend(request)  # type: ignore[no-any-return]
    if request.needs_grad:
        q, k, v = request.query, request.key, request.value
        if _all_finite(q, k, v):
            return backend.attend(request)  # type: ignore[no-any-return]
        bad_q = ~torch.isfinite(q).all(-1)  # (B, Hq, Q)
        bad_kv = ~torch.isfinite(k).all(-1) | ~torch.isfinite(v).all(-1)  # (B, Hkv, KV)
        clean = request._replace(query=_zeroed(q), key=_zeroed(k), value=_zeroed(v))
        result = backend.attend(clean)
        cols = bad_kv.flatten(0, 1).any(0).nonzero().flatten()
        rows = bad_q.flatten(0, 1).any(0)
        if cols.numel():
            reads = attended(request, torch.arange(q.size(2)), cols).any(-1)
            rows = rows | reads.flatten(0, 1).any(0)
        picked = rows.nonzero().flatten()
    else:
        result = backend.attend(request)
        out = result[0] if isinstance(result, tuple) else result
        lse_bad = (
            torch.isnan(result[1]) | (result[1] == float("inf"))
            if isinstance(result, tuple)
            else None
        )
        finite_kv = _all_finite(request.key, request.value)
        lse_ok = lse_bad is None or not bool(lse_bad.any())
        if finite_kv and lse_ok and _all_finite(out, request.query):
            return result  # type: ignore[no-any-return]
        bad = ~torch.isfinite(out).all(-1) | ~torch.isfinite(request.query).all(-1)
        if lse_bad is not None:
            bad |= lse_bad
        # A fused kernel whose running max skips NaN gives 0 to a row whose every attended
        # score is NaN (a NaN key it alone attends): a row of zeros that attends something
        # is read again. With finite keys and values no such row exists, so rows of zeros
        # (padding, which attends nothing) cost nothing, not a BlockMask build; otherwise
        # rows that attend nothing are told apart by their block rows.
        zero = (out == 0).all(-1).flatten(0, 1).any(0) if not finite_kv else None
        if zero is not None and bool(zero.any()):
            rows = zero.nonzero().flatten()
            reads = _listed_rows(request, rows)
            if reads.numel():
                some = attended(request, reads, torch.arange(request.key.size(2))).any(-1)
                bad[..., reads] |= some.flatten(0, 1).any(0)
        if not bool(bad.any()):
            return result  # type: ignore[no-any-return]
        picked = bad.flatten(0, 1).any(0).nonzero().flatten()
    if not picked.numel():
        return result  # type: ignore[no-any-return]
    out_rows, lse_rows = exact_rows(request, picked)
    if isinstance(result, tuple):
        out, lse = result
        return (
            out.index_copy(2, picked, out_rows.to(out.dtype)),
            lse.index_copy(2, picked, lse_rows.to(lse.dtype)),
        )
    return result.index_copy(2, picked, out_rows.to(result.dtype))  # type: ignore[union-attr]


def _all_finite(*tensors: Tensor) -> bool:
    """Whether every entry is finite, from one sum each: a NaN or an infinity makes the sum
    NaN or infinite. Finite values whose sum overflows make the answer False, and the caller
    takes the exact path, which is only slower (half types sum in float32, where that takes
    sixty-five thousand times larger sums). A sum reads each tensor once and writes
    nothing: a fraction of ``isfinite``'s passes."""
    # On one thread: a sum is a short memory-bound pass, which torch's threads only slow (on
    # busy cores each waits for a descheduled thread, a hundredfold its own time).
    with one_thread():
        return all(
            bool(
                torch.isfinite(
                    t.detach().sum(dtype=torch.float32 if t.element_size() < 4 else None)
                )
            )
            for t in tensors
        )


def _listed_rows(request: Request, rows: Tensor) -> Tensor:
    """The rows among ``rows`` whose block row lists some block (the others attend nothing)."""
    block_mask = request.built().block_mask
    if block_mask is None:
        return rows
    assert isinstance(block_mask, BlockMask)
    q_block = int(block_mask.BLOCK_SIZE[0])
    listed = (kv_codes(block_mask) != 0).flatten(0, 1).any(0).any(-1).cpu()
    return rows[listed[rows // q_block]]


def _zeroed(x: Tensor) -> Tensor:
    """``x`` with its non-finite entries 0 (their gradient 0); ``x`` itself where it has none."""
    finite = torch.isfinite(x)
    return x if bool(finite.all()) else torch.where(finite, x, 0)


def attended(request: Request, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Whether query ``q_idx[i]`` attends key ``kv_idx[j]``: ``(B | 1, Hq | 1, n, m)`` bool,
    as the call's BlockMask says (full blocks, partial ones through ``mask_mod``, a block
    listed both ways as full; no BlockMask: every key)."""
    block_mask = request.built().block_mask
    if block_mask is None:
        return torch.ones(1, 1, q_idx.numel(), kv_idx.numel(), dtype=torch.bool)
    assert isinstance(block_mask, BlockMask)
    q_block, kv_block = (int(size) for size in block_mask.BLOCK_SIZE)
    device = block_mask.kv_num_blocks.device
    q_idx, kv_idx = q_idx.to(device), kv_idx.to(device)
    codes = kv_codes(block_mask)[:, :, q_idx // q_block][:, :, :, kv_idx // kv_block]
    seen = codes == FULL
    partial = codes == PARTIAL
    if bool(partial.any()):
        batch, heads = request.query.shape[:2]
        args = (
            torch.arange(batch, device=device).view(-1, 1, 1, 1),
            torch.arange(heads, device=device).view(1, -1, 1, 1),
            q_idx.view(1, 1, -1, 1),
            kv_idx.view(1, 1, 1, -1),
        )
        shape = (batch, heads, q_idx.numel(), kv_idx.numel())
        how = "broadcast" if broadcasts(block_mask.mask_mod, args, shape) else "vmap"
        seen = seen | (partial & call_mod(block_mask.mask_mod, args, shape, how, "mask_mod"))
    return seen


def exact_rows(request: Request, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The output ``(B, Hq, n, Dv)`` and log-sum-exp ``(B, Hq, n)`` of query rows ``rows``,
    computed so that only what a row attends reaches it: scores and values of masked-out
    positions are selected away (``where``), never multiplied by 0. Differentiable; in the
    working dtype (float32, float64 for float64)."""
    q, k, v = request.query, request.key, request.value
    batch, q_heads, _, head_dim = q.shape
    group = q_heads // k.size(1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k.to(acc).repeat_interleave(group, 1) if group > 1 else k.to(acc)
    values = v.to(acc).repeat_interleave(group, 1) if group > 1 else v.to(acc)
    finite_keys = torch.where(torch.isfinite(keys), keys, 0)
    finite_values = torch.where(torch.isfinite(values), values, 0)
    bad_key = _bad_positions(keys)
    bad_value = _bad_positions(values)
    scale = request.scale if request.scale is not None else 1.0 / math.sqrt(head_dim)
    kv_len = k.size(2)
    kv_idx = torch.arange(kv_len)
    heavy = int(bad_key.sum()) + int(bad_value.sum())
    step = max(1, MAX_EXACT_ELEMENTS // max(1, batch * q_heads * (kv_len + heavy * head_dim)))
    outs, lses = [], []
    for start in range(0, rows.numel(), step):
        picked = rows[start : start + step]
        seen = attended(request, picked, kv_idx).expand(batch, q_heads, -1, -1)
        # Only the keys these rows attend take part: a key no row of theirs reads gets no
        # gradient from them, even where their own output is NaN.
        cols = seen.flatten(0, 2).any(0).nonzero().flatten()
        if not cols.numel():  # none of these rows attends a key: 0, lse -inf
            link = q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum()
            outs.append(q.new_zeros(batch, q_heads, picked.numel(), v.size(-1), dtype=acc) + link)
            lses.append(torch.full((batch, q_heads, picked.numel()), float("-inf"), dtype=acc))
            continue
        seen = seen[..., cols]
        # Every operand selected to 0 where it must not count, so that no 0 * nan appears
        # forward or backward: a row that attends nothing reads no query; a key or value no
        # row of its batch row and head reads here is 0 (and gets no gradient); keys and
        # values holding NaN or inf are multiplied in only where the row attends them.
        raw_query = torch.where(seen.any(-1, keepdim=True), q[:, :, picked].to(acc), 0)
        finite_query = torch.isfinite(raw_query)
        query = torch.where(finite_query, raw_query, 0)
        read = seen.any(-2).unsqueeze(-1)  # (B, Hq, keys, 1)
        raw_keys = keys[:, :, cols]
        scores = query @ torch.where(read, finite_keys[:, :, cols], 0).transpose(-1, -2)
        bad = bad_key[cols].nonzero().flatten()
        if bad.numel():
            gated = torch.where(seen[..., bad, None], raw_keys[:, :, None, bad], 0)
            scores = scores.index_copy(3, bad, (query.unsqueeze(-2) * gated).sum(-1))
        bad = (~finite_query).any(-1).flatten(0, 1).any(0).nonzero().flatten()
        if bad.numel():  # queries holding NaN or inf: every product gated, pair by pair
            gated = torch.where(seen[:, :, bad, :, None], raw_keys[:, :, None], 0)
            products = raw_query[:, :, bad, None, :] * gated
            scores = scores.index_copy(2, bad, products.sum(-1))
        scores = scores * scale
        if request.score_mod is not None:
            args = (
                scores,
                torch.arange(batch).view(-1, 1, 1, 1),
                torch.arange(q_heads).view(1, -1, 1, 1),
                picked.view(1, 1, -1, 1),
                cols.view(1, 1, 1, -1),
            )
            how = "broadcast" if broadcasts(request.score_mod, args, scores.shape) else "vmap"
            scores = call_mod(request.score_mod, args, tuple(scores.shape), how, "score_mod")
        scores = torch.where(seen, scores, float("-inf"))
        top = scores.amax(-1, keepdim=True).detach()
        top = torch.where(top == float("-inf"), 0, top)  # a row that attends nothing: 0
        probs = torch.where(seen, (scores - top).exp(), 0)
        total = probs.sum(-1, keepdim=True)
        out = _Weighted.apply(probs, torch.where(read, finite_values[:, :, cols], 0), seen)
        bad = bad_value[cols].nonzero().flatten()
        if bad.numel():
            # What a non-finite value adds over its finite stand-in, selected away as a
            # whole where the row does not attend it: a stand-in outside the where would
            # send a NaN output gradient (a row whose own query holds one) to that value
            # through 0 * nan in the backward.
            value, stand_in = values[:, :, None, cols[bad]], finite_values[:, :, None, cols[bad]]
            gated = torch.where(seen[..., bad, None], value - stand_in, 0)
            out = out + (probs[..., bad, None] * gated).sum(-2)
        outs.append(out / torch.where(total == 0, 1, total))
        lses.append((total.log() + top).squeeze(-1).detach())
    return torch.cat(outs, 2), torch.cat(lses, 2)


class _Weighted(torch.autograd.Function):
    """``probs @ values`` whose backward sends a value only what the rows attending it send:
    a row whose output gradient holds NaN (its output does) sends nothing to the values it
    does not attend (``0 * nan`` in a plain matmul's backward would)."""

    @staticmethod
    def forward(ctx, probs, values, seen):  # type: ignore[override]
        ctx.save_for_backward(probs, values, seen)
        return probs @ values

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        probs, values, seen = ctx.saved_tensors
        finite = torch.isfinite(grad)
        clean = torch.where(finite, grad, 0)
        grad_values = probs.transpose(-1, -2) @ clean
        for row in (~finite).any(-1).flatten(0, 1).any(0).nonzero().flatten().tolist():
            sent = probs[:, :, row, :, None] * (grad - clean)[:, :, row, None, :]
            grad_values = grad_values + torch.where(seen[:, :, row, :, None], sent, 0)
        return grad @ values.transpose(-1, -2), grad_values, None


def _bad_positions(x: Tensor) -> Tensor:
    """Per sequence position of ``x`` (B, H, S, D): whether it holds NaN or inf in some batch
    row or head (a bool ``(S,)``)."""
    return (~torch.isfinite(x)).any(-1).flatten(0, 1).any(0)
