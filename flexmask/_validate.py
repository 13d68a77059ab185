"""Input checks shared by the pieces. Every error names the argument and says what is right."""

from __future__ import annotations

import ctypes
import hashlib
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def check_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    """Returns ``value`` as an int, or raises TypeError/ValueError naming ``name``."""
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be an int or a 0-d integer tensor, got a tensor of shape "
                f"{tuple(value.shape)} and dtype {value.dtype}"
            )
        value = int(value.item())
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def int_vector(value: Any, name: str) -> Tensor:
    """A 1-D int64 CPU tensor from a list/tuple of ints or a 1-D integer tensor/array."""
    if isinstance(value, Tensor):
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got a tensor of shape {tuple(value.shape)}")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        return value.detach().to("cpu", torch.int64, copy=True)  # the mask owns its data
    if hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        return int_vector(torch.as_tensor(value), name)
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor, got {value!r}")
    items = [check_int(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return torch.tensor(items, dtype=torch.int64)


def is_nested(value: Any) -> bool:
    """True for a per-row value: a 2-D tensor or a list whose items are lists/tensors."""
    if isinstance(value, Tensor):
        return value.dim() == 2
    if isinstance(value, (list, tuple)) and value:
        return all(
            isinstance(v, (list, tuple)) or (isinstance(v, Tensor) and v.dim() == 1) for v in value
        )
    return False


def source_device(value: Any) -> torch.device | None:
    """The device a user's tensor lives on (None for Python data), to catch mismatches."""
    if isinstance(value, Tensor):
        return value.device
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, Tensor):
                return item.device
    return None


def scalar_or_rows(value: Any, name: str, *, minimum: int) -> tuple[Tensor, bool]:
    """One int for all rows, or one int per row. Returns (int64 values, per_row)."""
    if isinstance(value, Tensor) and value.dim() == 0 or isinstance(value, numbers.Integral):
        return torch.tensor([check_int(value, name, minimum=minimum)]), False
    values = int_vector(value, name)
    if values.numel() == 0:
        raise ValueError(f"{name} must hold one value per batch row, got an empty list")
    for i, v in enumerate(values.tolist()):
        if v < minimum:
            raise ValueError(f"{name}[{i}] must be >= {minimum}, got {v}")
    return values, True


def digest(*tensors: Tensor) -> str:
    """A strong content digest: dtype, shape and bytes of each tensor, never its identity."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        nbytes = t.numel() * t.element_size()
        if nbytes:
            # The bytes in place, read as a ctypes buffer: no numpy (not a dependency), no
            # copy (bytes(storage) takes ~50 s per 8 MB).
            h.update((ctypes.c_char * nbytes).from_address(t.data_ptr()))
    return h.hexdigest()
