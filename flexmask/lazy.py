"""Lazy BlockMask handles: build on first forward use, share across layers, drop after.

A handle holds the mask expression and the shape — O(data), never an S×S tensor — so a
DataLoader worker can return one and the BlockMask is built in the training process, on the
training device, just before the forward that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int
from flexmask.blocks import BlockGrid
from flexmask.builder import block_sizes, default_device
from flexmask.cache import MaskCache, _key, default_cache
from flexmask.mask import Mask


@dataclass(frozen=True)
class _Shape:
    """A build's shape as Python ints: the part of a BlockGrid that ``Mask._check`` and the
    cache key read. ``make_grid`` also lays out tile tensors on the device; a handle must not
    touch the device before its first use (in a DataLoader worker that would initialise CUDA),
    so it validates against this instead.
    """

    batch: int
    heads: int
    q_len: int
    kv_len: int
    q_block: int
    kv_block: int
    device: torch.device

    @property
    def length(self) -> int:
        return max(self.q_len, self.kv_len)

    def as_grid(self) -> BlockGrid:
        # Only for readers of the int fields above (Mask._check, the cache key).
        return cast(BlockGrid, self)


def check_device(device: Any, name: str = "device") -> torch.device | None:
    """``device`` as a torch.device (None stays None), without touching the device."""
    if device is None:
        return None
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise TypeError(
            f"{name} must be a torch.device, a device name such as 'cpu' or 'cuda:0', or None, "
            f"got {type(device).__name__} {device!r}"
        )
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"{name} must be a torch.device or its name (e.g. 'cpu', 'cuda:0'), got {device!r}"
        ) from err


def _shape(
    mask: Mask,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    device: torch.device,
    BLOCK_SIZE: Any,
) -> _Shape:
    """``make_grid``'s checks as arithmetic on Python ints: no tensor on any device."""
    batch = 1 if B is None else check_int(B, "B", minimum=1)
    heads = 1 if H is None else check_int(H, "H", minimum=1)
    q_len = check_int(Q_LEN, "Q_LEN", minimum=1)
    kv_len = check_int(KV_LEN, "KV_LEN", minimum=1)
    q_block, kv_block = block_sizes(BLOCK_SIZE)
    if mask.rows is not None and B is None:
        batch = mask.rows
    shape = _Shape(batch, heads, q_len, kv_len, q_block, kv_block, device)
    mask._check(shape.as_grid())
    return shape


class LazyBlockMask:
    """A BlockMask to be: built through the cache on first use, dropped on release.

    Example:
        >>> import flexmask, torch
        >>> handle = flexmask.lazy(flexmask.causal() & flexmask.document([100, 156]),
        ...                        1, 1, 256, 256, device="cpu")
        >>> handle.built
        False
        >>> q = k = v = torch.randn(1, 2, 256, 16)
        >>> with handle:                    # released when the block ends
        ...     out = flexmask.flex_attention(q, k, v, block_mask=handle, compile=False)
        ...     handle.built
        True
        >>> handle.built
        False
    """

    __slots__ = (
        "mask",
        "B",
        "H",
        "Q_LEN",
        "KV_LEN",
        "device",
        "BLOCK_SIZE",
        "cache",
        "_block_mask",
        "builds",
        "__weakref__",
    )

    def __init__(
        self,
        mask: Mask,
        B: int | None,
        H: int | None,
        Q_LEN: int,
        KV_LEN: int,
        device: torch.device | str | None = None,
        BLOCK_SIZE: int | tuple[int, int] = 128,
        cache: MaskCache | None = None,
    ) -> None:
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
        if cache is not None and not isinstance(cache, MaskCache):
            raise TypeError(
                f"cache must be a flexmask.MaskCache or None (the process-wide cache), "
                f"got {type(cache).__name__} {cache!r}"
            )
        device = check_device(device)
        # Validate now, so a bad batch fails in the worker that made it: Python ints only,
        # nothing allocated on the device (the build allocates, on first use).
        # With no device given and none in the mask's data, no piece compares devices, so the
        # check needs none: the default device is resolved at the build, in the process that
        # builds (asking for it here could initialise CUDA in a worker).
        where = device or mask.device or torch.device("meta")
        shape = _shape(mask, B, H, Q_LEN, KV_LEN, where, BLOCK_SIZE)
        self.mask = mask
        self.B, self.H = shape.batch, shape.heads
        self.Q_LEN, self.KV_LEN = shape.q_len, shape.kv_len
        self.device = device
        self.BLOCK_SIZE = (shape.q_block, shape.kv_block)
        self.cache = cache
        self._block_mask: BlockMask | None = None
        self.builds = 0

    @property
    def built(self) -> bool:
        """True while the handle holds its BlockMask."""
        return self._block_mask is not None

    @property
    def block_mask(self) -> BlockMask:
        """The BlockMask: built (or fetched from the cache) on first use, then held."""
        if self._block_mask is None:
            self._block_mask = self._cache().get(
                self.mask, self.B, self.H, self.Q_LEN, self.KV_LEN, self.device, self.BLOCK_SIZE
            )
            self.builds += 1
        return self._block_mask

    def release(self) -> None:
        """Drops the BlockMask. Masks carrying per-batch data leave the cache too.

        A backward still pending keeps what it saved: autograd holds its own references.
        """
        self._block_mask = None
        if self.mask.carries_batch_data:
            # The device the build used: make_grid's rule for device=None.
            device = self.device or self.mask.device or default_device()
            shape = _shape(
                self.mask, self.B, self.H, self.Q_LEN, self.KV_LEN, device, self.BLOCK_SIZE
            )
            self._cache().discard(_key(self.mask, shape.as_grid()))

    def release_after(self, module: torch.nn.Module) -> Any:
        """Releases this handle when ``module``'s next forward returns (a one-shot hook).

        Returns the hook's removable handle.
        """
        hooks: list[Any] = []

        def _release(*_: Any) -> None:
            self.release()
            hooks[0].remove()

        hooks.append(module.register_forward_hook(_release))
        return hooks[0]

    def _cache(self) -> MaskCache:
        return self.cache if self.cache is not None else default_cache()

    def __enter__(self) -> LazyBlockMask:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __getstate__(self) -> dict[str, Any]:
        # Pickles the recipe, never the built tensors nor the cache (process-local).
        state = {name: getattr(self, name) for name in self.__slots__[:7]}
        state["cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._block_mask = None
        self.builds = 0

    def __repr__(self) -> str:
        return (
            f"LazyBlockMask({self.mask!r}, B={self.B}, H={self.H}, Q_LEN={self.Q_LEN}, "
            f"KV_LEN={self.KV_LEN}, device={self.device!r}, BLOCK_SIZE={self.BLOCK_SIZE}, "
            f"built={self.built})"
        )


def lazy(
    mask: Mask,
    B: int | None = None,
    H: int | None = None,
    Q_LEN: int = 128,
    KV_LEN: int = 128,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    *,
    cache: MaskCache | None = None,
) -> LazyBlockMask:
    """A handle that builds the BlockMask of ``mask`` on first use, through the cache.

    Args:
        mask: a flexmask expression.
        B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE: as for ``create_block_mask``. B=None takes
            the row count of per-row data.
        cache: the MaskCache to build through (None: the process-wide cache).

    Example:
        >>> import flexmask
        >>> h = flexmask.lazy(flexmask.causal(), 1, 1, 512, 512, device="cpu")
        >>> h.block_mask is h.block_mask    # one build serves every layer
        True
        >>> h.builds
        1
    """
    return LazyBlockMask(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, cache)
