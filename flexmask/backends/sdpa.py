"""The SDPA backend: torch's ``scaled_dot_product_attention`` over the dense mask a BlockMask
means, or ``is_causal`` where it is exactly causal (``flexmask.backends.dense``)."""

from __future__ import annotations

from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.backends.dense import KERNELS, is_causal, sdpa_attention
from flexmask.backends.plan import Plan, make_plan
from flexmask.backends.request import Request
from flexmask.pieces import Full
from flexmask.runtime import default_cache

NAME = "sdpa"
OPTIONS = ("mod_eval",)


def can_take(request: Request) -> str | None:
    if request.score_mod is not None:
        return "SDPA takes no score_mod"
    if request.return_lse:
        return "SDPA returns no log-sum-exp"
    return None


def lower(request: Request) -> Request:
    """The BlockMask built; no mask made the full one (from the cache)."""
    request = request.built()
    if request.block_mask is None:
        q_len, kv_len = request.query.shape[-2], request.key.shape[-2]
        full = default_cache().get(Full(), 1, 1, q_len, kv_len, request.query.device)
        request = request._replace(block_mask=full)
    return request


def kernel_name(request: Request) -> str:
    plan = _plan(request)
    return KERNELS["sdpa_causal" if is_causal(plan, request.mask) else "sdpa_dense"]


def _plan(request: Request) -> Plan:
    assert isinstance(request.block_mask, BlockMask)  # lower() built or made one
    return make_plan(
        request.query,
        request.key,
        request.value,
        request.block_mask,
        None,
        request.scale,
        request.enable_gqa,
        request.options.get("mod_eval", "auto"),
    )


def attend(request: Request) -> Tensor:
    """SDPA over the dense mask the BlockMask means (``is_causal`` where it is causal)."""
    plan = _plan(request)
    causal = is_causal(plan, request.mask)
    mod_eval = request.options.get("mod_eval", "auto")
    return sdpa_attention(request.query, request.key, request.value, plan, mod_eval, causal)
