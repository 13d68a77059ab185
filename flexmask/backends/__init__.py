"""Attention backends, in one table: name -> backend.

A backend is one module with three functions and one line in ``TABLE``:

* ``can_take(request) -> str | None`` — why it cannot run this call, or None if it can;
* ``lower(request) -> Request`` — the call made concrete for it (its BlockMask, its options
  checked);
* ``attend(request)`` — the output, or ``(output, lse)`` with ``return_lse``.

``flexmask.flex_attention`` hands each call (a ``Request``: q, k, v and the lowered mask) to
the first backend in table order that takes it (``choose``); ``flexmask.attention`` with
``backend="auto"`` asks them in ``AUTO``'s order for the device instead, fastest first
(``rank``), and says why each other backend was refused (``Choice``).
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

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
    # Measured by AUTO_BENCHMARK (2 cores at load 1.1-2.4, torch 2.13, B=2, H=4, D=64,
    # float32, S 1k-4k; causal, document-causal, tree, sliding window; fwd+bwd and no-grad
    # fwd; medians of 9 interleaved calls): block_sparse (which itself runs SDPA on plain
    # causal, on masks half dense or more and on small rows, 1k x 1k without gradients) was
    # fastest or within 10% on 21 of 24 rows (sdpa 1.5-6.8x slower in fwd+bwd on documents
    # and windows at 1k-4k: 881.7 vs 130.5 ms at 4k document-causal). The other three were
    # the RL tree at 1k fwd+bwd (sdpa 1.22x faster), at 1k no-grad fwd (1.86x; now SDPA) and
    # at 2k no-grad fwd (1.18x; 0.64x the other way in a second run: noise). torch's
    # uncompiled flex forward materialises every score: 8-37x slower on every row, so last.
    # Where block_sparse runs SDPA it now runs the sdpa backend's own ops (decided before it
    # reads intervals): 1k doc-causal no-grad 24.4 ms against sdpa's 24.1 (27.8 before), and
    # 0.99-1.01x sdpa on 6 such rows (2 threads, load 0.7-1.2, medians of 15 interleaved).
    "cpu": (slices.NAME, block_sparse.NAME, sdpa.NAME, flex.NAME),
    # Not measured here (no GPU was lent): torch's compiled kernel first, as flex_attention
    # has always run; varlen where flex cannot take the call. Measure before reordering.
    "cuda": (flex.NAME, varlen.NAME, sdpa.NAME),
}
"""Per device type, the backends ``rank`` asks, fastest first; a device type not listed is
asked in ``TABLE`` order."""


class Choice(NamedTuple):
    """Which backend runs a call, and why each backend before it in the order did not."""

    backend: str
    """The backend that runs the call ("" where none takes it)."""
    order: tuple[str, ...]
    """The backends in the order they were asked."""
    refused: dict[str, str]
    """Backend name -> why it cannot run this call, for every backend asked and refused."""
    device: str

    def __repr__(self) -> str:
        lines = [f"Choice(backend={self.backend!r}, device={self.device!r}, order={self.order})"]
        lines += [f"  {name}: refused: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def rank(request: Request, order: tuple[str, ...] | None = None) -> Choice:
    """Every backend of ``order`` (default: ``AUTO`` for the device, else ``TABLE``'s order)
    asked in turn; the first that takes the call is chosen, the rest still asked, so the
    Choice says why each one that cannot run it was refused."""
    device = request.query.device.type
    if order is None:
        order = AUTO.get(device, tuple(TABLE))
    chosen, refused = "", {}
    for name in order:
        reason = TABLE[name].can_take(request)
        if reason is not None:
            refused[name] = reason
        elif not chosen:
            chosen = name
    return Choice(chosen, tuple(order), refused, device)


def choose(request: Request) -> ModuleType:
    """The first backend of ``TABLE`` that takes the call."""
    reasons = {}
    for name, backend in TABLE.items():
        reason = backend.can_take(request)
        if reason is None:
            return backend
        reasons[name] = reason
    refusals = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    raise ValueError(f"no attention backend takes this call ({refusals})")


__all__ = ["AUTO", "AUTO_BENCHMARK", "TABLE", "Choice", "Request", "choose", "rank"]
