"""Input checks shared by the pieces. Every error names the argument and says what is right."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import numbers
import os
import warnings
from array import array as py_array
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def check_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    """Returns ``value`` as an int, or raises TypeError/ValueError naming ``name``.

    Accepts Python and numpy integers, and 0-d integer tensors and arrays. Values must fit in
    int64: every size ends up in an int64 tensor, where a larger one would wrap silently.
    """
    if not isinstance(value, Tensor) and _is_array(value) and getattr(value, "ndim", None) == 0:
        value = value[()]  # a 0-d numpy array: its scalar (a numpy integer, or not an integer)
    if isinstance(value, Tensor):
        _has_values(value, name)
        if (
            value.dim() != 0
            or value.dtype.is_floating_point
            or value.dtype.is_complex
            or (value.dtype == torch.bool)
        ):
            raise TypeError(
                f"{name} must be an int or a 0-d integer tensor, got a tensor of shape "
                f"{tuple(value.shape)} and dtype {value.dtype}"
            )
        value = value.item()
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(
            f"{name} must fit in a signed 64-bit integer [-2**63, 2**63 - 1], got {value}"
        )
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _has_values(value: Tensor, name: str) -> None:
    """A meta tensor has a shape but no values to read: say so, naming ``name``."""
    if value.is_meta:
        raise ValueError(
            f"{name} is a meta tensor (shape {tuple(value.shape)}), which holds no values to "
            f"read: pass its values as ints or as a tensor on a real device (e.g. 'cpu')"
        )
    if torch.compiler.is_exporting():
        # A traced input has no values yet, and a piece checks and keys its data by value
        # when it is made (torch's error here would be a data-dependent guard).
        raise TypeError(
            f"{name} is traced by torch.export, and a flexmask piece reads its "
            f"data's values when it is made: make the mask outside the traced function and "
            f"pass it (or its BlockMask, or a lazy handle) in"
        )


def _is_array(value: Any) -> bool:
    """A numpy array or another array-like that is not a tensor or a Python sequence."""
    return hasattr(value, "__array__") and not isinstance(value, (Tensor, list, tuple))


def int_tensor(value: Tensor, name: str) -> Tensor:
    """``value`` checked as a 1-D integer tensor and returned detached, not copied: the
    caller copies what it keeps (``int_vector``: to int64; a tree: narrowed)."""
    _has_values(value, name)
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got a tensor of shape {tuple(value.shape)}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
    return value.detach()


def int_vector(value: Any, name: str) -> Tensor:
    """A 1-D int64 CPU tensor from a list/tuple of ints or a 1-D integer tensor/array."""
    if isinstance(value, Tensor):
        value = int_tensor(value, name)
        if value.dtype == torch.uint64:  # .to(int64) would wrap values >= 2**63: check them
            return int_vector(value.tolist(), name)
        return value.to("cpu", torch.int64, copy=True)  # the mask owns its data
    if _is_array(value):
        import numpy as np  # only reached with an array in hand: numpy is installed

        array = np.asarray(value)
        if array.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got an array of shape {array.shape}")
        if array.dtype.kind in "uO":  # uint64 would wrap; object arrays hold Python ints
            return int_vector(array.tolist(), name)
        if array.dtype.kind != "i":
            raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
        return torch.from_numpy(array.astype(np.int64, copy=True))
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor, got {value!r}")
    plain = plain_ints([value])
    if plain is not None:
        return plain
    items = [check_int(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return torch.tensor(items, dtype=torch.int64)


def plain_ints(rows: Sequence[Any]) -> Tensor | None:
    """Every row's values, one row after another, as one int64 CPU tensor, where each row is
    a list or tuple of plain ints (not bools) within int64; None otherwise (``int_vector``
    then checks each value and names a bad one).

    One scan of the values' types and one conversion through an array: a quarter of
    ``torch.tensor``'s time on a list, with no per-row tensors to concatenate
    (docs/costs.md). ``array('q')`` alone would take bools and any ``__index__`` as ints.
    """
    if not all(type(row) in (list, tuple) for row in rows):
        return None
    if set(map(type, itertools.chain.from_iterable(rows))) != {int}:
        return None  # empty, or some value is not a plain int
    values = py_array("q")
    try:
        for row in rows:
            values.fromlist(row if type(row) is list else list(row))
    except OverflowError:
        return None  # a value outside int64
    return torch.frombuffer(values, dtype=torch.int64)


def check_parents(
    value: Any,
    name: str,
    *,
    token: str = "token",
    rule: str = "each token's parent must be an earlier token",
    root: str = "a root",
    empty: str = "an empty array",
) -> Tensor:
    """A tree's parent list as int64: ``parents[i]`` is an earlier index (``< i``) or -1. The
    one parents check (``tree``, ``speculative_tree``): the wording names what the caller
    calls a token, its parent rule and its roots."""
    parents = int_vector(value, name)
    if parents.numel() == 0:
        raise ValueError(f"{name} must hold at least one {token}, got {empty}")
    index = torch.arange(parents.numel())
    bad = ((parents >= index) | (parents < -1)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"{name}[{i}]={int(parents[i])} is not a valid parent: {rule} (0 <= parent < {i}) "
            f"or -1 for {root}"
        )
    return parents


def is_nested(value: Any) -> bool:
    """True for a per-row value: a 2-D tensor or array, or a list whose items are lists,
    1-D tensors or 1-D arrays."""
    if isinstance(value, Tensor) or _is_array(value):
        return getattr(value, "ndim", None) == 2
    if isinstance(value, (list, tuple)) and value:
        return all(
            isinstance(v, (list, tuple))
            or ((isinstance(v, Tensor) or _is_array(v)) and getattr(v, "ndim", None) == 1)
            for v in value
        )
    return False


def checked_sum(values: Tensor, name: str) -> int:
    """The sum of int64 values as a Python int, or a ValueError naming ``name`` if it does
    not fit in int64 (where the cumulative sums a piece keeps would wrap)."""
    total = sum(values.tolist())  # Python ints: exact, whatever the values
    if not INT64_MIN <= total <= INT64_MAX:
        raise ValueError(
            f"sum({name})={total} does not fit in a signed 64-bit integer: lengths that large "
            f"are a mistake (a sequence is far shorter)"
        )
    return total


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
    scalar = isinstance(value, numbers.Integral) or (
        (isinstance(value, Tensor) or _is_array(value)) and getattr(value, "ndim", None) == 0
    )
    if scalar:
        return torch.tensor([check_int(value, name, minimum=minimum)]), False
    values = int_vector(value, name)
    if values.numel() == 0:
        raise ValueError(f"{name} must hold one value per batch row, got an empty list")
    for i, v in enumerate(values.tolist()):
        if v < minimum:
            raise ValueError(f"{name}[{i}] must be >= {minimum}, got {v}")
    return values, True


def digest(*tensors: Tensor) -> str:
    """A strong content digest: dtype, shape and bytes of each tensor, never its identity.

    SHA-256, cut to 128 bits: current x86 and Arm CPUs hash it in hardware (SHA extensions),
    about twice blake2b's speed there, and a re-made mask that hits the cache pays the
    digest of all its data (docs/costs.md).
    """
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        nbytes = t.numel() * t.element_size()
        if nbytes:
            # The bytes in place, read as a ctypes buffer: no numpy (not a dependency), no
            # copy (bytes(storage) takes ~50 s per 8 MB).
            h.update((ctypes.c_char * nbytes).from_address(t.data_ptr()))
    return h.digest()[:16].hex()


def default_device() -> torch.device:
    """torch's default for create_block_mask: the current accelerator, else the CPU.

    An accelerator this process cannot use counts as none. A CUDA build of torch on a machine
    without a GPU (PyPI's plain ``torch`` on Linux) names ``cuda`` as its current accelerator,
    and torch's own build there fails on the driver; flexmask builds on the CPU instead.
    """
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    current = torch.accelerator.current_accelerator()
    return torch.device(current) if current is not None else torch.device("cpu")


def check_device(device: Any, fallback: torch.device | None = None) -> torch.device:
    """``device`` as a torch.device; None gives ``fallback`` (the device of a mask's data),
    else torch's default. No tensor is made: naming a device touches nothing on it."""
    if device is None:
        return fallback or default_device()
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device or its name, got {device!r}") from err


def env_int(
    name: str, default: int | None, *, minimum: int = 0, byte_suffixes: bool = False
) -> int | None:
    """An integer environment variable (unset or empty: ``default``), or a ValueError naming
    the variable and what would be right. With ``byte_suffixes``, ``512M``/``2G``/``64K``."""
    raw = os.environ.get(name, "")
    text = raw.strip().lower()
    if not text:
        return default
    scale = 1
    for suffix, factor in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
        if byte_suffixes and text.endswith(suffix):
            text, scale = text[:-1], factor
    try:
        value = int(text) * scale
    except ValueError:
        example = f"{name}=32" + (", 512M or 2G" if byte_suffixes else "")
        raise ValueError(
            f"environment variable {name}={raw!r} is not a whole number (expected e.g. "
            f"{example}, or unset it)"
        ) from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be >= {minimum}")
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_bool(name: str, default: bool) -> bool:
    """A boolean environment variable: ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any
    case; unset or empty: ``default``), or a ValueError naming the variable and those
    values. The FLEXMASK_* switches read through this, so each takes the same spellings."""
    raw = os.environ.get(name, "")
    text = raw.strip().lower()
    if not text:
        return default
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r} must be 1/0, true/false, yes/no or on/off "
        f"(or unset it)"
    )


@functools.lru_cache(maxsize=1)
def host_memory() -> int | None:
    """Bytes this process can hold on the CPU: the machine's RAM, or its cgroup's limit when
    lower. None where neither can be read (no ``os.sysconf``, no cgroup files)."""
    limits = []
    with contextlib.suppress(AttributeError, ValueError, OSError):  # not POSIX: unknown
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    # cgroup v2, then v1: a container's limit, "max" (v2) or a huge number (v1) when unlimited.
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    positive = [limit for limit in limits if limit > 0]
    return min(positive) if positive else None


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory ``device`` has in all (the CPU: what this process can hold); None
    where unknown (meta: no memory at all).

    Read only for a build on that device: asking about a CUDA device initialises CUDA.
    """
    if device.type == "cpu":
        return host_memory()
    if device.type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device() if device.index is None else device.index
        return int(torch.cuda.get_device_properties(index).total_memory)
    return None


def bytes_text(nbytes: int) -> str:
    """``24.0 TiB (26388279066624 bytes)``: a size as people read it, and exactly."""
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


def check_fits(
    nbytes: int, device: torch.device, what: str, fix: str, *, purpose: str = ""
) -> None:
    """Refuses, before anything is allocated, ``nbytes`` that exceed all of ``device``'s
    memory (on the CPU: the RAM or cgroup limit of this process): a ValueError saying
    ``what`` would need them and ``fix``. Tensors written in full need real memory, so more
    can only fail, be OOM-killed or swap; sizes that fit pass (whether they fit beside what
    is already allocated is the allocator's to say)."""
    total = device_memory(device)
    if total is not None and nbytes > total:
        where = (
            "of memory this process can have (RAM, or its cgroup limit)"
            if device.type == "cpu"
            else "of memory in all"
        )
        raise ValueError(
            f"{what} would need {bytes_text(nbytes)} on {device}"
            f"{f' for {purpose}' if purpose else ''}, more than the "
            f"{bytes_text(total)} {where}: {fix}"
        )


def block_mask_bytes(
    rows: int, heads: int, q_len: int, kv_len: int, q_block: int, kv_block: int
) -> int:
    """Bytes of a BlockMask's eight int32 tensors: per (row, head), the counts of both sides
    and the ``(nq, nkv)`` / ``(nkv, nq)`` index tensors, partial and full."""
    nq, nkv = -(-q_len // q_block), -(-kv_len // kv_block)
    return 8 * rows * heads * (nq + nkv + 2 * nq * nkv)


def check_window(offset: int, length: int, block: int, offset_name: str, length_name: str) -> None:
    """Positions ``[offset, offset + length)``, padded to whole blocks, are int64 tensor
    values: refuse an end past 2**63 - 1 (where they would wrap) naming both arguments."""
    end = offset + -(-length // block) * block
    if end > INT64_MAX + 1:
        raise ValueError(
            f"{offset_name}={offset} plus {length_name}={length} (rounded up to the block size "
            f"{block}) ends at {end}, past 2**63: positions are int64, so {offset_name} + "
            f"{length_name} must stay below 2**63 - {block}"
        )


# --- One shape signature: (mask, B, H, Q_LEN, KV_LEN) in torch's order -----------------------
# torch's create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN) is the order users know, so every
# flexmask entry that takes a shape takes it so, KV_LEN defaulting to Q_LEN. Two lowerings took
# (mask, B, Q_LEN, KV_LEN) before 0.2: their old calls keep working for a release with a
# DeprecationWarning where they have one reading, and raise where the two orders would give
# different results (to_magi(mask, 1, 1, 1024) was one query against 1,024 keys).

F = TypeVar("F", bound=Callable[..., Any])

OLD_DEFAULT_LENGTH = 128
"""What ``create_block_mask``, ``lazy`` and ``MaskCache.get`` built without ``Q_LEN`` before
0.2 (torch requires it)."""


def lengths(q_len: Any, kv_len: Any, entry: str, stacklevel: int = 3) -> tuple[Any, Any]:
    """``(Q_LEN, KV_LEN)`` of a call: ``KV_LEN`` None is ``Q_LEN``; ``Q_LEN`` None is the old
    128 (x 128 where ``KV_LEN`` is None too) with a DeprecationWarning. The values are
    checked where the spec is made."""
    if q_len is None:
        warnings.warn(
            f"{entry} without Q_LEN is deprecated (torch's create_block_mask requires it): "
            f"this release builds the old default Q_LEN={OLD_DEFAULT_LENGTH}, the next raises; "
            f"pass Q_LEN (KV_LEN defaults to it)",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return OLD_DEFAULT_LENGTH, OLD_DEFAULT_LENGTH if kv_len is None else kv_len
    return q_len, q_len if kv_len is None else kv_len


def torch_order(entry: F) -> F:
    """Wraps a lowering whose signature is now ``(mask, B, H, Q_LEN, KV_LEN=None, *, ...)``
    and was ``(mask, B, Q_LEN, KV_LEN=None, *, ...)`` before 0.2, reading its positional
    shape as the caller meant it:

    - ``(mask, B, S)`` (no ``Q_LEN``, which the new order requires): the old reading, with a
      DeprecationWarning;
    - ``(mask, B, Q, KV)`` with no other shape keyword: the old ``(B, Q_LEN=Q, KV_LEN=KV)``
      and the new ``(B, H=Q, Q_LEN=KV, KV_LEN=KV)``; where ``Q == KV`` both give the same
      lowering (these lowerings take one mask for every head), read the old way with a
      DeprecationWarning; otherwise a TypeError naming both readings;
    - anything else: the new order.
    """
    name = entry.__name__

    @functools.wraps(entry)
    def read(mask: Any, *shape: Any, **kwargs: Any) -> Any:
        named = {"B", "H", "Q_LEN", "KV_LEN"} & set(kwargs)
        if len(shape) == 2 and not named & {"H", "Q_LEN"}:
            batch, q_len = shape
            _warn_old(name, f"B={batch!r}, Q_LEN={q_len!r}", f"{batch!r}, 1, {q_len!r}")
            return entry(mask, batch, None, q_len, **kwargs)
        if len(shape) == 3 and not named:
            batch, second, third = shape
            if second != third:
                raise TypeError(
                    f"{name}(mask, {batch!r}, {second!r}, {third!r}) reads two ways: before "
                    f"0.2 as (B={batch!r}, Q_LEN={second!r}, KV_LEN={third!r}), now in "
                    f"torch's order as (B={batch!r}, H={second!r}, Q_LEN={third!r}, "
                    f"KV_LEN={third!r}). Pass all four, {name}(mask, B, H, Q_LEN, KV_LEN): "
                    f"{name}(mask, {batch!r}, 1, {second!r}, {third!r}) for the old reading"
                )
            _warn_old(
                name,
                f"B={batch!r}, Q_LEN=KV_LEN={second!r}",
                f"{batch!r}, 1, {second!r}, {third!r}",
            )
            return entry(mask, batch, None, second, third, **kwargs)
        return entry(mask, *shape, **kwargs)

    return read  # type: ignore[return-value]


def _warn_old(name: str, reading: str, new_args: str) -> None:
    warnings.warn(
        f"{name}(mask, B, Q_LEN[, KV_LEN]) is deprecated: {name} takes torch's order "
        f"(mask, B, H, Q_LEN, KV_LEN) like every flexmask entry. Read as {reading}; write "
        f"{name}(mask, {new_args})",
        DeprecationWarning,
        stacklevel=3,
    )


def dense_lengths(B: Any, H: Any, q_len: Any, kv_len: Any) -> tuple[Any, Any]:
    """``Mask.to_dense``'s ``(Q_LEN, KV_LEN)``: ``KV_LEN`` None is ``Q_LEN``; ``Q_LEN`` is
    required where ``B`` or ``H`` is given (``to_dense(512, 512)`` was 512 rows and heads of
    one query, never what was meant); ``to_dense()`` warns and gives the old 1 x 1."""
    if q_len is None:
        if B is not None or H is not None:
            raise TypeError(
                f"to_dense takes (B, H, Q_LEN, KV_LEN) in torch's order, got B={B!r}, "
                f"H={H!r} and no Q_LEN: for a {B!r} x {H!r} mask of one row and head call "
                f"to_dense(1, 1, {B!r}, {H!r}); for {B!r} rows and {H!r} heads pass Q_LEN"
            )
        warnings.warn(
            "to_dense() without Q_LEN is deprecated: this release gives the old 1 x 1, the "
            "next raises; pass to_dense(B, H, Q_LEN, KV_LEN)",
            DeprecationWarning,
            stacklevel=3,
        )
        q_len = 1
    return q_len, q_len if kv_len is None else kv_len


def check_flag(value: Any, name: str) -> bool:
    """A keyword that is a bool: ``True``/``False`` (numpy's too), nothing read by truth
    value (``truncate="no"`` would cut)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
