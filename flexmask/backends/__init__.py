"""Attention backends, in one table: name -> backend.

A backend is one module with three functions and one line in ``TABLE``:

* ``can_take(request) -> str | None`` — why it cannot run this call, or None if it can;
* ``lower(request) -> Request`` — the call made concrete for it (its BlockMask, its options
  checked);
* ``attend(request)`` — the output, or ``(output, lse)`` with ``return_lse``.

``flexmask.flex_attention`` hands each call (a ``Request``: q, k, v and the lowered mask) to
the first backend in table order that takes it (``choose``).
"""

from __future__ import annotations

from types import ModuleType

from flexmask.backends import block_sparse, flex, sdpa
from flexmask.backends.request import Request

TABLE: dict[str, ModuleType] = {
    flex.NAME: flex,
    block_sparse.NAME: block_sparse,
    sdpa.NAME: sdpa,
}
"""Every backend, in the order ``choose`` asks them."""


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


__all__ = ["TABLE", "Request", "choose"]
