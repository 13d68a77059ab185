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

``flexmask.flex_attention`` and ``flexmask.attention(backend="auto")`` hand each call (a
``Request``: q, k, v and the mask) to the first backend of one order per device that takes
it (``order``: ``AUTO``'s measured order, fastest first, then the rest), and ``explain``
says why each other backend was refused (``Choice``). ``register_backend`` adds one.
"""

from __future__ import annotations

import difflib
from types import ModuleType
from typing import Any, NamedTuple

from flexmask.backends import block_sparse, decode, flex, sdpa, slices, varlen
from flexmask.backends.block_sparse import DEFAULT_MAX_CHUNK_ELEMENTS, block_sparse_attention
from flexmask.backends.finite import attend_checked
from flexmask.backends.flex import ENV_COMPILE, compiled_flex_attention
from flexmask.backends.request import Deferred, Request, check_fits, check_tensors, make_request
from flexmask.builders import BlockStats

TABLE: dict[str, ModuleType] = {
    module.NAME: module for module in (flex, decode, slices, block_sparse, sdpa, varlen)
}
"""Every backend by name (``register_backend`` adds one)."""

AUTO_BENCHMARK = "benchmarks/bench_backends.py"
AUTO: dict[str, tuple[str, ...]] = {
    # Fastest first, as AUTO_BENCHMARK measured them (docs/costs.md, "The thresholds in the
    # code"): slices where it takes the mask; block_sparse where slices refuses (many tiny
    # documents); sdpa's dense mask last but one; torch's uncompiled flex forward
    # materialises every score, so it is last.
    "cpu": (decode.NAME, slices.NAME, block_sparse.NAME, sdpa.NAME, flex.NAME),
    # Not measured here (no GPU was lent): torch's compiled kernel first, as flex_attention
    # has always run; varlen where flex cannot take the call. Measure before reordering.
    "cuda": (flex.NAME, varlen.NAME, sdpa.NAME),
}
"""Per device type, the backends asked first, fastest first (``order``)."""


def order(device: str) -> tuple[str, ...]:
    """The one order in which the backends are asked for a call on ``device``, by
    ``flex_attention`` and ``attention(backend="auto")`` alike: ``AUTO``'s for the device,
    then every other backend in ``TABLE``'s order."""
    first = tuple(name for name in AUTO.get(device, ()) if name in TABLE)
    return first + tuple(name for name in TABLE if name not in first)


_PROTOCOL = ("can_take", "lower", "attend", "kernel_name")


def register_backend(
    name: str, module: ModuleType, devices: tuple[str, ...] = (), *, before: str | None = None
) -> None:
    """Adds a backend: ``module`` has ``NAME == name``, ``OPTIONS`` (a tuple of the keyword
    options it takes) and the four calls (``can_take``, ``lower``, ``attend``,
    ``kernel_name``). It is asked for calls on each device type of ``devices`` — ahead of
    ``before`` in that device's order where given, else after the backends already there —
    and after those on any other device.

    Example:
        >>> import types, torch, flexmask
        >>> from flexmask import backends
        >>> ones = types.ModuleType("ones")
        >>> ones.NAME, ones.OPTIONS = "ones", ("ones",)
        >>> ones.can_take = lambda request: None if request.options.get("ones") else "not asked"
        >>> ones.lower = lambda request: request._replace(options={})
        >>> ones.attend = lambda request: torch.ones_like(request.query)
        >>> ones.kernel_name = lambda request: "torch.ones_like"
        >>> backends.register_backend("ones", ones, ("cpu",), before="slices")
        >>> q = torch.randn(1, 1, 4, 8)
        >>> flexmask.explain(q, q, q, flexmask.causal(), ones=True).kernel
        'torch.ones_like'
        >>> backends.unregister_backend("ones")
    """
    if not isinstance(name, str) or getattr(module, "NAME", None) != name:
        raise ValueError(f"name must be the module's NAME, got {name!r} for {module!r}")
    if name in TABLE:
        raise ValueError(f"a backend named {name!r} is registered already")
    missing = [call for call in _PROTOCOL if not callable(getattr(module, call, None))]
    options_ = getattr(module, "OPTIONS", None)
    if missing or not (isinstance(options_, tuple) and all(isinstance(o, str) for o in options_)):
        raise TypeError(
            f"backend {name!r} must define {', '.join(_PROTOCOL)} and OPTIONS (a tuple of "
            f"option names); it lacks {missing or ['OPTIONS']}"
        )
    for device in devices:
        current = list(AUTO.get(device, ()))
        at = current.index(before) if before in current else len(current)
        AUTO[device] = (*current[:at], name, *current[at:])
    TABLE[name] = module


def unregister_backend(name: str) -> None:
    """Removes a backend ``register_backend`` added (or a built-in one)."""
    TABLE.pop(name)
    for device, names in AUTO.items():
        AUTO[device] = tuple(n for n in names if n != name)


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
    blocks: BlockStats | None = None
    """``explain``'s reading of the call's BlockMask at its block shape: the mask's exact
    density and its shares of non-empty and partial blocks (None: no mask, every query
    attends every key; ``rank`` alone leaves it None)."""

    def __repr__(self) -> str:
        lines = [
            f"Choice(backend={self.backend!r}, kernel={self.kernel!r}, device={self.device!r}, "
            f"order={self.order})"
        ]
        if self.blocks is not None:
            lines.append(f"  mask: {self.blocks}")
        lines += [f"  {name}: refused: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def kernel_name(name: str, request: Request) -> str:
    """What backend ``name`` calls for ``request`` (one it takes)."""
    if request.empty:
        return "none: the output is empty or no key exists (B, H, Q_LEN or KV_LEN is 0)"
    backend = TABLE[name]
    return backend.kernel_name(backend.lower(request))  # type: ignore[no-any-return]


def rank(
    request: Request, names: tuple[str, ...] | None = None, *, with_kernel: bool = True
) -> Choice:
    """Every backend of ``names`` (default: ``order`` for the device) asked in turn; the
    first that takes the call is chosen, the rest still asked, so the Choice says why each
    one that cannot run it was refused. ``with_kernel``: also say what the chosen one calls
    (explain's question; it may build the BlockMask and plan the call); without it the
    backends after the chosen one are not asked (a call about to run)."""
    device = request.query.device.type
    if names is None:
        names = order(device)
    chosen, refused = "", {}
    for name in names:
        reason = refusal(TABLE[name], request)
        if reason is not None:
            refused[name] = reason
        elif not chosen:
            chosen = name
            if not with_kernel:  # a call to run: the backends after it need not answer
                break
    return Choice(
        chosen,
        tuple(names),
        refused,
        device,
        kernel_name(chosen, request) if chosen and with_kernel else "",
    )


def choose(request: Request) -> ModuleType:
    """The first backend of the device's ``order`` that takes the call; ValueError naming
    every refusal where none does."""
    choice = rank(request, with_kernel=False)
    if not choice.backend:
        refusals = "; ".join(f"{name}: {reason}" for name, reason in choice.refused.items())
        raise ValueError(f"no attention backend takes this call ({refusals})")
    return TABLE[choice.backend]


__all__ = [
    "AUTO",
    "AUTO_BENCHMARK",
    "Choice",
    "DEFAULT_MAX_CHUNK_ELEMENTS",
    "Deferred",
    "ENV_COMPILE",
    "Request",
    "TABLE",
    "attend_checked",
    "block_sparse_attention",
    "check_fits",
    "check_options",
    "check_tensors",
    "choose",
    "compiled_flex_attention",
    "kernel_name",
    "make_request",
    "options",
    "order",
    "rank",
    "refusal",
    "register_backend",
    "unregister_backend",
]
