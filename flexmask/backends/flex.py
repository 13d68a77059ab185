"""The flex backend: torch's own flex_attention kernel, compiled once per process unless
compilation is off. It takes every call but a CPU call that needs gradients (torch has no
flex backward there) or that runs uncompiled (torch's uncompiled CPU forward materialises
the whole score matrix and re-traces the mask for every new BlockMask)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

from flexmask.backends.request import Deferred, Request
from flexmask.runtime import default_cache

NAME = "flex"
ENV_COMPILE = "FLEXMASK_COMPILE"
OPTIONS = ("kernel_options",)
"""torch's flex_attention keywords beyond the shared ones, passed through as given."""

_compiled: Callable[..., Any] | None = None
_compiled_lock = threading.Lock()
_logger = logging.getLogger("flexmask")
_announced: set[tuple] = set()
"""Shapes whose first compiled call has been announced in this process."""


def can_take(request: Request) -> str | None:
    if request.on_cpu and request.needs_grad:
        return "torch's flex_attention has no backward on the CPU"
    if request.on_cpu and not request.compile:
        return "compile is off, and torch's uncompiled CPU kernel materialises every score"
    return None


def lower(request: Request) -> Request:
    """The BlockMask built: torch's kernel reads it (None: no mask) as it is; a bare Mask's
    in the block shape the requested kernel needs on this device (``block_size_for``)."""
    block = block_size_for(request.query.device, request.options.get("kernel_options"))
    deferred = request.block_mask
    if block is not None and isinstance(deferred, Deferred) and deferred.spec is not None:
        # The call's spec in that block shape: validated once, when the call was checked.
        built = default_cache().get_spec(deferred.spec._replace(block_size=block))[1]
        return request._replace(block_mask=built)
    return request.built()


FLASH_BLOCK_SIZES = {10: (256, 128)}
"""Compute capability (major) -> the (Q, KV) block shape FA4's kernel (torch's
``kernel_options={"BACKEND": "FLASH"}``) needs there, as attn-gym's ``get_flash_block_size``
gives it: SM100 and later 256 x 128; before, torch's default 128 x 128."""


def block_size_for(device: torch.device, kernel_options: Any) -> tuple[int, int] | None:
    """The block shape a flexmask-built BlockMask takes for this call's kernel, where it
    is not torch's default 128 x 128; None otherwise (and off CUDA)."""
    if not isinstance(kernel_options, dict) or kernel_options.get("BACKEND") != "FLASH":
        return None
    capability = _capability(device)
    if capability is None:
        return None
    sizes = [size for major, size in FLASH_BLOCK_SIZES.items() if capability[0] >= major]
    return sizes[-1] if sizes else None


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return cast(tuple[int, int], torch.cuda.get_device_capability(device))


def kernel_name(request: Request) -> str:
    if request.compile:
        return "torch's flex_attention, compiled (torch.compile, static shapes)"
    return "torch's flex_attention, uncompiled (eager: every score materialised)"


def attend(request: Request) -> Tensor | tuple[Tensor, Tensor]:
    if request.compile:
        _announce_compile(request.query, request.key)
    fn = (
        compiled_flex_attention()
        if request.compile
        else cast(Callable[..., Any], torch_flex_attention)
    )
    return fn(
        request.query,
        request.key,
        request.value,
        score_mod=request.score_mod,
        block_mask=request.block_mask,
        scale=request.scale,
        enable_gqa=request.enable_gqa,
        return_lse=request.return_lse,
        **request.options,
    )


def compiled_flex_attention() -> Callable[..., Any]:
    """torch's flex_attention compiled once for the process, with static shapes.

    Static because, measured with torch 2.13 on CPU, automatic dynamic shapes kick in on the
    second sequence length and the CPU kernel then failed to build; bucket sequence lengths
    (e.g. pack to a few fixed ``max_len``) so each length compiles once.
    """
    global _compiled
    with _compiled_lock:
        if _compiled is None:
            _compiled = torch.compile(torch_flex_attention, dynamic=False)
        return _compiled


def _announce_compile(query: Tensor, key: Tensor) -> None:
    """One log line, once per process and shape, before a call that may compile for minutes.

    A WARNING, so it shows without any logging set up: the wait would otherwise look like a
    hang. ``logging.getLogger("flexmask").setLevel(logging.ERROR)`` silences it.
    """
    shape = (query.device.type, tuple(query.shape), tuple(key.shape), query.dtype)
    with _compiled_lock:
        if shape in _announced:
            return
        _announced.add(shape)
    _logger.warning(
        "flexmask: compiling flex_attention for query %s, key %s (%s) on %s; the first call "
        "of each shape takes ~20-50 s on a CPU (%s=0 or flexmask.set_compile(False) turns "
        "compilation off)",
        tuple(query.shape),
        tuple(key.shape),
        str(query.dtype).removeprefix("torch."),
        query.device.type,
        ENV_COMPILE,
    )
