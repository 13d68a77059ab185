"""torch's build flags: the keywords the installed torch's ``create_block_mask`` takes
beyond the shape arguments, read as that torch reads them, into the ``Flags`` the writer
(``blocks.write``) writes under."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

from flexmask.blocks import Flags

_SHAPE_ARGS = ("mask_mod", "B", "H", "Q_LEN", "KV_LEN", "device", "BLOCK_SIZE")
TORCH_FLAGS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(torch_create_block_mask).parameters.items()
    if name not in _SHAPE_ARGS
    and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
}
"""The keywords the installed torch's ``create_block_mask`` takes beyond the shape arguments,
with their defaults — read from its signature, so each torch keeps its own set (2.13:
``_compile``, ``separate_full_blocks``, ``compute_dq_write_order``, ``dq_kv_order``)."""


def build_flags(flags: dict[str, Any]) -> Flags:
    """The build flags of a ``create_block_mask(..., **flags)`` call, read as the installed
    torch reads them: a keyword it does not take raises its ``TypeError``; a non-bool
    ``dq_kv_order`` its ``ValueError``; ``_compile``, ``separate_full_blocks`` and
    ``compute_dq_write_order`` by their truth value, as torch's ``if flag:`` does (``"no"``
    is true, ``None`` and ``""`` false), a value with none a ``TypeError`` naming it."""
    for name, value in flags.items():
        if name not in TORCH_FLAGS:
            raise TypeError(f"create_block_mask() got an unexpected keyword argument '{name}'")
        if name in Flags._fields or name == "_compile" or _is_default(value, TORCH_FLAGS[name]):
            continue
        raise TypeError(
            f"{name}={value!r}: flexmask does not build torch {torch.__version__}'s {name} yet; "
            f"leave it at its default {TORCH_FLAGS[name]!r}, or build with torch: "
            f"torch.nn.attention.flex_attention.create_block_mask(mask.mask_mod, ...)"
        )
    if _flag(flags, "_compile", False):
        warnings.warn(
            "create_block_mask(_compile=True) is deprecated in torch and ignored by flexmask, "
            "which builds from structure without compiling: drop _compile",
            DeprecationWarning,
            stacklevel=3,
        )
    dq_kv_order = flags.get("dq_kv_order", True)
    if not isinstance(dq_kv_order, bool):  # torch's own check and message, with the remedy
        raise ValueError(
            f"dq_kv_order must be a bool when using create_block_mask, got {dq_kv_order!r}: "
            f"True ranks kv blocks descending, False ascending (a tensor order goes to "
            f"BlockMask.from_kv_blocks with a precomputed dq_write_order)"
        )
    return Flags(
        separate_full_blocks=_flag(flags, "separate_full_blocks", True),
        compute_dq_write_order=_flag(flags, "compute_dq_write_order", False),
        dq_kv_order=dq_kv_order,
    )


def _flag(flags: dict[str, Any], name: str, default: bool) -> bool:
    """The flag's truth value: torch tests these flags with ``if flag:``, so any value it
    builds with (``1``, ``"no"``, ``None``) builds the same here."""
    value = flags.get(name, default)
    try:
        return bool(value)
    except Exception as err:  # a tensor of many values, a Mask: no truth value
        raise TypeError(
            f"{name}={value!r} has no truth value, which torch's create_block_mask tests "
            f"(`if {name}:`): pass True or False"
        ) from err


def _is_default(value: Any, default: Any) -> bool:
    try:
        return value is default or (type(value) is type(default) and bool(value == default))
    except Exception:  # noqa: BLE001 - a value that does not compare is not the default
        return False


def torch_keywords(flags: Flags) -> dict[str, Any]:
    """``flags`` as keywords of the installed torch's ``create_block_mask`` (those it takes)."""
    return {name: value for name, value in flags._asdict().items() if name in TORCH_FLAGS}
