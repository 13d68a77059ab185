"""The memory a build writes its BlockMask tensors into: on Linux, large CPU outputs are
advised onto transparent huge pages before their first write (``FLEXMASK_HUGE_PAGES=0``,
``false`` or ``off`` turns it off).

A long build is mostly its first write of fresh pages: at 131k, B = 8 the four index
tensors are 128 MiB, and the kernel faults them in 4 KiB at a time (32,768 faults, each
zeroing its page), about as long as every pass of the build together. Advised, the kernel
faults 2 MiB at a time, and the same write takes half as long (docs/costs.md, "Huge pages
for the outputs"). numpy advises its large arrays the same way by default (from 4 MiB).
The tensors are ordinary memory, a storage each, as torch's own: only the pages under them
differ, and only where the kernel allows it (THP ``madvise`` or ``always``; ``never``
leaves them as they were).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from flexmask._validate import env_bool

ENV_HUGE_PAGES = "FLEXMASK_HUGE_PAGES"

HUGE_PAGE = 2 << 20
"""x86-64's and aarch64's (4 KiB base pages) transparent huge page."""

ADVISED_FROM = 4 << 20
"""Outputs of at least this many bytes are advised (numpy's bar): smaller ones hold at most
one whole huge page, and the call would cost more than it saves."""

_MADV_HUGEPAGE = 14  # <linux/mman.h>, the same on every Linux architecture


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, or None off Linux or where libc cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call  # type: ignore[no-any-return]


def huge_pages_on() -> bool:
    """Whether builds advise their outputs onto huge pages: FLEXMASK_HUGE_PAGES (on by
    default; 0/false/no/off turns it off, as every FLEXMASK_* switch), read at every build,
    and a Linux libc to ask."""
    return env_bool(ENV_HUGE_PAGES, True) and _madvise() is not None


def advise_huge_pages(tensor: Tensor) -> bool:
    """Advises the whole huge pages inside ``tensor``'s memory (CPU, not yet written:
    advice does not move pages already faulted in) onto transparent huge pages; True when
    the kernel took the advice. Pages at either end that the tensor shares with other
    memory are left alone, so nothing beside it changes."""
    madvise = _madvise()
    nbytes = tensor.numel() * tensor.element_size()
    if madvise is None or tensor.device.type != "cpu" or nbytes < ADVISED_FROM:
        return False
    try:
        start = tensor.data_ptr()
    except RuntimeError:  # no memory to advise: a fake tensor (torch.export traces with them)
        return False
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    stop = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    # A kernel without THP answers EINVAL: the pages stay as they were, which is correct.
    return stop > first and madvise(first, stop - first, _MADV_HUGEPAGE) == 0


def index_tensors(
    shapes: Sequence[Sequence[int]], device: torch.device, dtype: torch.dtype = torch.int32
) -> list[Tensor]:
    """Uninitialised tensors of ``shapes`` for a build to write its BlockMask into, the
    large ones on the CPU advised onto huge pages (``huge_pages_on``)."""
    out = [torch.empty(tuple(shape), dtype=dtype, device=device) for shape in shapes]
    if torch.device(device).type == "cpu" and huge_pages_on():
        for tensor in out:
            advise_huge_pages(tensor)
    return out
