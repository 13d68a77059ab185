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

from flexmask.backends.request import Request

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
    """The BlockMask built: torch's kernel reads it (None: no mask) as it is."""
    return request.built()


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
