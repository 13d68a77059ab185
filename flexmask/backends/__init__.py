"""Attention backends, in one table: name -> backend.

A backend is one module with four functions, its ``OPTIONS`` and one line in ``TABLE``:

* ``can_take(request) -> str | None`` — why it cannot run this call, or None if it can;
* ``lower(request) -> Request`` — the call made concrete for it (its BlockMask, its options
  checked);
* ``attend(request)`` — the output, or ``(output, lse)`` with ``return_lse``;
* ``kernel_name(request) -> str`` — what ``attend`` will call for this (lowered) request, hand-offs
  inside the backend included: what ``explain`` reports;
* ``OPTIONS`` — the keyword options it takes beyond torch's flex_attention arguments.

Every call is checked once before any backend sees it (``request.make_request``: the same
calls are valid whichever backend runs), and runs through ``finite.attend_checked`` on the
CPU.

``flexmask.flex_attention`` hands each call (a ``Request``: q, k, v and the lowered mask) to
the first backend in table order that takes it (``choose``); ``flexmask.attention`` with
``backend="auto"`` asks them in ``AUTO``'s order for the device instead, fastest first
(``rank``), and says why each other backend was refused (``Choice``).
"""

from __future__ import annotations

import difflib
from types import ModuleType
from typing import Any, NamedTuple

from flexmask.backends import block_sparse, flex, sdpa, slices, varlen
from flexmask.backends.request import Request

TABLE: dict[str, ModuleType] = {
    flex.NAME: flex,
    # Before block_sparse: on the CPU it takes documents, trees and prefix masks in slices
    # big enough for torch's fused kernel, and refuses the rest (and any block-sparse option).
    slices.NAME: slices,
    block_sparse.NAME: block_sparse,
    sdpa.NAME: sdpa,
    varlen.NAME: varlen,  # last: flex_attention's choice stays flex, slices or block_sparse
}
"""Every backend, in the order ``choose`` asks them."""

AUTO_BENCHMARK = "benchmarks/bench_backends.py"
AUTO: dict[str, tuple[str, ...]] = {
    # Measured by AUTO_BENCHMARK (2 cores at load 0.8-1.9, torch 2.13, B=2, H=4, D=64,
    # float32, S 1k-4k; causal, document-causal, tree, sliding window; fwd+bwd and no-grad
    # fwd; medians of 9 interleaved calls; docs/costs.md has the table): slices, where it
    # takes the mask, was the fastest backend or within 4% of it on every row but one (1k
    # causal no-grad, 1.12x SDPA's 10.7 ms, the same kernel call); documents 2.0-2.9x faster
    # than block_sparse at 2k-4k and 8-14x faster than SDPA with a dense mask, the RL tree
    # 1.5-2.5x and 1.8-3.2x, windows 1.03-2.2x and 2.1-4.9x. Where it refuses (1k
    # documents of ~20 tokens) block_sparse was fastest fwd+bwd (31.5 ms against SDPA's 71.5)
    # and, running the sdpa backend's own ops, 1.02x SDPA without gradients. torch's
    # uncompiled flex forward materialises every score: 14-109x slower, so last.
    "cpu": (slices.NAME, block_sparse.NAME, sdpa.NAME, flex.NAME),
    # Not measured here (no GPU was lent): torch's compiled kernel first, as flex_attention
    # has always run; varlen where flex cannot take the call. Measure before reordering.
    "cuda": (flex.NAME, varlen.NAME, sdpa.NAME),
}
"""Per device type, the backends ``rank`` asks, fastest first; a device type not listed is
asked in ``TABLE`` order."""


def options() -> tuple[str, ...]:
    """Every keyword option some backend of ``TABLE`` takes."""
    return tuple(dict.fromkeys(name for backend in TABLE.values() for name in backend.OPTIONS))


_ARGUMENTS = (
    "block_mask",
    "mask",
    "score_mod",
    "scale",
    "enable_gqa",
    "return_lse",
    "compile",
    "backend",
)


def check_options(given: dict[str, Any]) -> None:
    """A keyword no backend takes raises TypeError naming the closest right one (a typo must
    not reach a backend that would ignore or misread it)."""
    known = options()
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    name = unknown[0]
    if name in ("attn_mask", "mask_mod", "is_causal"):
        hint = "pass the mask as block_mask= (or mask=): a flexmask Mask, handle or BlockMask"
    else:
        close = difflib.get_close_matches(name, (*_ARGUMENTS, *known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "check the spelling"
    raise TypeError(
        f"unexpected keyword argument {name!r}: {hint} (the arguments are "
        f"{', '.join(_ARGUMENTS)}; backend options: {', '.join(known)})"
    )


def refusal(backend: ModuleType, request: Request) -> str | None:
    """Why ``backend`` cannot run the call (options it does not take, then its own
    ``can_take``), or None."""
    extra = sorted(name for name in request.options if name not in backend.OPTIONS)
    if extra:
        takes = ", ".join(backend.OPTIONS) if backend.OPTIONS else "none"
        return f"it takes no option {extra} (its options: {takes})"
    return backend.can_take(request)  # type: ignore[no-any-return]


class Choice(NamedTuple):
    """Which backend runs a call, the kernel it calls, and why each backend before it in
    the order did not."""

    backend: str
    """The backend that runs the call ("" where none takes it)."""
    order: tuple[str, ...]
    """The backends in the order they were asked."""
    refused: dict[str, str]
    """Backend name -> why it cannot run this call, for every backend asked and refused."""
    device: str
    kernel: str = ""
    """What the chosen backend calls for this call, any hand-off inside it included ("" where
    no backend takes it)."""

    def __repr__(self) -> str:
        lines = [
            f"Choice(backend={self.backend!r}, kernel={self.kernel!r}, device={self.device!r}, "
            f"order={self.order})"
        ]
        lines += [f"  {name}: refused: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def kernel_name(name: str, request: Request) -> str:
    """What backend ``name`` calls for ``request`` (one it takes)."""
    if request.empty:
        return "none: the output is empty or no key exists (B, H, Q_LEN or KV_LEN is 0)"
    backend = TABLE[name]
    return backend.kernel_name(backend.lower(request))  # type: ignore[no-any-return]


def rank(
    request: Request, order: tuple[str, ...] | None = None, *, with_kernel: bool = True
) -> Choice:
    """Every backend of ``order`` (default: ``AUTO`` for the device, else ``TABLE``'s order)
    asked in turn; the first that takes the call is chosen, the rest still asked, so the
    Choice says why each one that cannot run it was refused."""
    device = request.query.device.type
    if order is None:
        order = AUTO.get(device, tuple(TABLE))
    chosen, refused = "", {}
    for name in order:
        reason = refusal(TABLE[name], request)
        if reason is not None:
            refused[name] = reason
        elif not chosen:
            chosen = name
    return Choice(
        chosen,
        tuple(order),
        refused,
        device,
        kernel_name(chosen, request) if chosen and with_kernel else "",
    )


def choose(request: Request) -> ModuleType:
    """The first backend of ``TABLE`` that takes the call."""
    reasons = {}
    for name, backend in TABLE.items():
        reason = refusal(backend, request)
        if reason is None:
            return backend
        reasons[name] = reason
    refusals = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    raise ValueError(f"no attention backend takes this call ({refusals})")


__all__ = [
    "AUTO",
    "AUTO_BENCHMARK",
    "TABLE",
    "Choice",
    "Request",
    "check_options",
    "choose",
    "kernel_name",
    "options",
    "rank",
    "refusal",
]
