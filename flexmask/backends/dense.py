"""SDPA over the dense mask a BlockMask means: the bool mask (full blocks True, unlisted
False, ``mask_mod`` on partial blocks — equal to ``Mask.to_dense`` of the Mask it was built
from), or ``is_causal`` where it is exactly causal, run by torch's
``scaled_dot_product_attention``. Rows that attend nothing give 0 and zero gradients, as
flex_attention does: the one empty-row rule, ``flexmask.algebra.dense``.

Shared below the backends: the ``sdpa`` backend runs it, and the block-sparse path hands it
the calls where it is faster (``choose_backend``)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from flexmask.algebra import Mask, open_empty_rows, zero_empty_rows
from flexmask.backends.mod_eval import broadcasts, call_mod
from flexmask.backends.plan import Plan
from flexmask.backends.request import positive_scale
from flexmask.blocks import EMPTY, FULL, PARTIAL
from flexmask.pieces import Causal

# choose_backend: SDPA with a dense mask wins on a CPU above this share of listed blocks, or
# below this many (query, key) pairs in all (benchmarks/bench_cpu_backward.py; docs/costs.md,
# "The thresholds in the code"). With several threads the sparse path's many separate ops
# each wait for the slowest thread, which on a shared machine costs more than the work saved,
# so it wins only at lower shares there than on one thread.
SDPA_MIN_DENSITY = 0.5


SDPA_MAX_PAIRS = 256 * 256

# A forward without gradients is SDPA's cheapest call (no backward to save), so it wins up to
# larger rows (benchmarks/bench_backends.py; docs/costs.md, "The thresholds in the code").
SDPA_MAX_PAIRS_NO_GRAD = 1024 * 1024


def choose_backend(
    plan: Plan, mask: Mask | None = None, *, needs_grad: bool = True, causal: bool | None = None
) -> Literal["sparse", "sdpa"]:
    """``"sdpa"`` where SDPA is faster on a CPU, else ``"sparse"``.

    SDPA's fused CPU kernel does every (query, key) pair but without the sparse path's extra
    passes over the scores, so it wins when the listed blocks cover most of the grid
    (``SDPA_MIN_DENSITY``: half of them) and on small problems (``SDPA_MAX_PAIRS`` pairs per
    row with gradients, ``SDPA_MAX_PAIRS_NO_GRAD`` without), where per-group overhead
    dominates; and on plain causal, where ``is_causal=True`` skips the upper triangle without
    any mask. On idle cores the sparse path beats SDPA up to near half the blocks listed; on
    loaded ones its many small ops wait on busy cores — see docs/cpu-training.md.

    ``causal``: :func:`is_causal` of the plan where the caller has it already (None: worked
    out here, where the size alone does not decide).
    """
    most = SDPA_MAX_PAIRS if needs_grad else SDPA_MAX_PAIRS_NO_GRAD
    if causal or plan.q_len * plan.kv_len <= most:
        return "sdpa"
    if causal is None and is_causal(plan, mask):
        return "sdpa"
    listed = (plan.kinds != EMPTY).flatten(0, 2).any(dim=0)
    return "sdpa" if float(listed.float().mean()) >= SDPA_MIN_DENSITY else "sparse"


def dense_mask(plan: Plan, mod_eval: str) -> Tensor:
    """The bool mask ``(B | 1, Hq | 1, Q_LEN, KV_LEN)`` the plan's BlockMask means: full blocks
    True, unlisted False, and ``mask_mod`` evaluated on the partial blocks only. A row that
    attends nothing is all False, as in ``Mask.to_dense`` (``flexmask.algebra.dense``)."""
    kinds = plan.kinds  # (Bm, Hkv | 1, G | 1, NQ, NKV)
    pairs = (kinds == PARTIAL).flatten(0, 2).any(dim=0).nonzero()
    rows, cols = pairs[:, 0], pairs[:, 1]
    full = (kinds == FULL)[..., :, None, :, None]
    if rows.numel():
        count, device = rows.numel(), kinds.device
        q_idx = rows[:, None] * plan.q_block + torch.arange(plan.q_block, device=device)
        kv_idx = cols[:, None] * plan.kv_block + torch.arange(plan.kv_block, device=device)
        args = (
            torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1),
            torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, plan.group, 1, 1, 1),
            q_idx.clamp(max=plan.q_len - 1).view(1, 1, 1, count, plan.q_block, 1),
            kv_idx.clamp(max=plan.kv_len - 1).view(1, 1, 1, count, 1, plan.kv_block),
        )
        shape = (plan.batch, plan.kv_heads, plan.group, count, plan.q_block, plan.kv_block)
        how = mod_eval
        if how == "auto":
            how = "broadcast" if broadcasts(plan.mask_mod, args, shape) else "vmap"
        by_mask_mod = call_mod(plan.mask_mod, args, shape, how, "mask_mod")
        picked = kinds[..., rows, cols][..., None, None]  # (Bm, Hk, Gm, count, 1, 1)
        values = (picked == FULL) | ((picked == PARTIAL) & by_mask_mod)
        dims = torch.broadcast_shapes(full.shape[:3], values.shape[:3])
        blocked = (full.size(3), plan.q_block, full.size(5), plan.kv_block)
        dense = full.expand(*dims, *blocked).clone()
        dense[..., rows, :, cols, :] = values.expand(*dims, *values.shape[3:]).movedim(3, 0)
    else:
        dense = full.expand(*full.shape[:4], plan.q_block, full.size(5), plan.kv_block)
    b, hk, g = dense.shape[:3]
    dense = dense.reshape(b, hk * g, dense.size(3) * plan.q_block, -1)
    return dense[:, :, : plan.q_len, : plan.kv_len]


def is_causal(plan: Plan, mask: Mask | None = None) -> bool:
    """True when the plan's BlockMask means exactly ``q_idx >= kv_idx`` with ``Q_LEN ==
    KV_LEN``, so SDPA's ``is_causal=True`` computes the same thing.

    Known when ``mask`` (the Mask the BlockMask was built from) is ``causal()``; otherwise
    checked from the BlockMask itself: its block lists must be causal's (every batch row and
    head) and ``mask_mod`` must equal ``q_idx >= kv_idx`` on its partial blocks — the
    diagonal, so the check costs ``Q_LEN x KV_BLOCK`` evaluations, and only when the lists
    are causal's (``causal() & sliding_window(w)`` with ``w >= Q_LEN`` is taken for causal).
    """
    if plan.q_len != plan.kv_len:
        return False
    if isinstance(mask, Causal):
        return True
    # Other masks can still be exactly causal on this grid (a sliding window at least as
    # long as the sequence, say): the check below is cheap when the block lists differ.
    q_first = torch.arange(0, plan.q_len, plan.q_block)
    kv_first = torch.arange(0, plan.kv_len, plan.kv_block)
    q_last = (q_first + plan.q_block - 1).clamp(max=plan.q_len - 1)
    kv_last = (kv_first + plan.kv_block - 1).clamp(max=plan.kv_len - 1)
    complete = (q_last - q_first + 1 == plan.q_block)[:, None] & (
        kv_last - kv_first + 1 == plan.kv_block
    )
    full = complete & (kv_last[None, :] <= q_first[:, None])
    nonempty = kv_first[None, :] <= q_last[:, None]
    expected = torch.where(full, FULL, torch.where(nonempty, PARTIAL, EMPTY))
    if not bool((plan.kinds.cpu() == expected.to(torch.int8)).all()):
        return False
    pairs = (plan.kinds == PARTIAL).flatten(0, 2).any(dim=0).nonzero()
    count, device = pairs.size(0), plan.kinds.device
    q_idx = pairs[:, :1] * plan.q_block + torch.arange(plan.q_block, device=device)
    kv_idx = pairs[:, 1:] * plan.kv_block + torch.arange(plan.kv_block, device=device)
    inside = (q_idx < plan.q_len)[:, :, None] & (kv_idx < plan.kv_len)[:, None, :]
    q_idx = q_idx.clamp(max=plan.q_len - 1).view(1, 1, 1, count, plan.q_block, 1)
    kv_idx = kv_idx.clamp(max=plan.kv_len - 1).view(1, 1, 1, count, 1, plan.kv_block)
    args = (
        torch.arange(plan.batch, device=device).view(-1, 1, 1, 1, 1, 1),
        torch.arange(plan.q_heads, device=device).view(1, plan.kv_heads, plan.group, 1, 1, 1),
        q_idx,
        kv_idx,
    )
    shape = (plan.batch, plan.kv_heads, plan.group, count, plan.q_block, plan.kv_block)
    try:
        with torch.no_grad():
            how = "broadcast" if broadcasts(plan.mask_mod, args, shape) else "vmap"
            by_mask_mod = call_mod(plan.mask_mod, args, shape, how, "mask_mod")
    except Exception:  # not provably causal: the general paths will raise if it is an error
        return False
    causal = (q_idx >= kv_idx).view(count, plan.q_block, plan.kv_block)
    return bool(((by_mask_mod == causal) | ~inside).all())


def sdpa_attention(
    query: Tensor, key: Tensor, value: Tensor, plan: Plan, mod_eval: str, causal: bool
) -> Tensor:
    """SDPA with the dense mask (or ``is_causal``); rows with no key get 0 and zero gradients,
    as in flex."""
    if causal:
        # is_causal runs torch's fused CPU flash kernel, which needs a positive scale.
        query, scale = positive_scale(query, plan.scale)
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=plan.group > 1
        )
    # The one empty-row rule (flexmask.algebra.dense): attend anywhere, then zeroed.
    mask, has_key = open_empty_rows(dense_mask(plan, mod_eval))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=plan.scale, enable_gqa=plan.group > 1
    )
    return zero_empty_rows(out, has_key)


KERNELS = {
    "sdpa_causal": "torch's scaled_dot_product_attention with is_causal=True",
    "sdpa_dense": "torch's scaled_dot_product_attention with the BlockMask's dense bool mask",
}
"""What ``sdpa_attention`` calls, by its route: the words ``explain`` reports."""
