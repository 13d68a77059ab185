"""A keyed LRU cache of BlockMasks, bounded by entries and by bytes (cachetools).

The key is the build's shape signature — (B, H, Q_LEN, KV_LEN, BLOCK_SIZE, device), with B and
H reduced to 1 where the mask does not depend on them — plus the mask's content key. Never a
tensor's identity, ``data_ptr`` or a closure: equal masks from different Python objects hit,
masks that differ in one document length miss.

The lock guards the cache dictionary only, never a build: two threads missing the same key
both build, the first to insert wins and both return that one object.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import cachetools
import torch
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import env_int, lengths
from flexmask.algebra import Mask
from flexmask.blocks import block_mask_nbytes
from flexmask.builders import Spec, build, emptied, make_spec

ENV_SIZE = "FLEXMASK_CACHE_SIZE"
ENV_BYTES = "FLEXMASK_CACHE_BYTES"
DEFAULT_SIZE = 32


class CacheInfo(NamedTuple):
    """Statistics of a MaskCache."""

    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    maxsize: int
    maxbytes: int | None
    discarded: int = 0
    """Entries dropped by ``discard`` — a released lazy handle's per-batch mask, say — not by
    the bounds (those are ``evictions``)."""

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class _LRU(cachetools.LRUCache):
    """cachetools' LRU bounded by bytes (its size) and by a count of entries.

    Every eviction goes through ``popitem``, which counts it.
    """

    def __init__(
        self, maxentries: int, maxbytes: int | None, getsizeof: Callable[[Any], int]
    ) -> None:
        super().__init__(maxsize=math.inf if maxbytes is None else maxbytes, getsizeof=getsizeof)
        self.maxentries = maxentries
        self.evictions = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        while len(self) > self.maxentries:
            self.popitem()

    def popitem(self) -> tuple[Any, Any]:
        item = super().popitem()
        self.evictions += 1
        return item


class KeyedCache:
    """The keyed LRU under MaskCache and the context-parallel ShardCache: entries bounded by
    count and by bytes (``getsizeof``), hits, misses, evictions and discards counted, and a
    lock that guards the dictionary only, never a build: two threads missing the same key
    both build, the first to insert wins and both return that one object."""

    def __init__(self, maxsize: int, maxbytes: int | None, getsizeof: Callable[[Any], int]):
        self.maxsize = _bound(maxsize, "maxsize", "an int >= 0 (0 disables caching)")
        self.maxbytes = (
            None if maxbytes is None else _bound(maxbytes, "maxbytes", "None or an int >= 0")
        )
        self._lock = threading.Lock()
        self._data = _LRU(self.maxsize, self.maxbytes, getsizeof)
        self._hits = 0
        self._misses = 0
        self._discarded = 0

    def get_or_build(self, key: Any, build: Callable[[], Any]) -> Any:
        """The entry under ``key``: cached, or ``build()`` outside the lock and cached."""
        with self._lock:
            found = self._data.get(key)
            if found is not None:
                self._hits += 1
                return found
            self._misses += 1
        # Outside the lock: builds run concurrently.
        built = build()
        if self.maxsize == 0:
            return built
        with self._lock:
            existing = self._data.get(key)
            if existing is not None:  # another thread built it meanwhile: share one object
                return existing
            # Larger than maxbytes on its own: cachetools refuses it; serve it uncached.
            with contextlib.suppress(ValueError):
                self._data[key] = built
        return built

    def discard(self, key: Any) -> bool:
        """Drops one entry by key; True if it was cached."""
        with self._lock:
            dropped = self._data.pop(key, None) is not None
            self._discarded += dropped
            return dropped

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def info(self) -> CacheInfo:
        """Hits, misses, evictions (by the bounds), entries and bytes held, and entries
        discarded (by ``discard``)."""
        with self._lock:
            return CacheInfo(
                hits=self._hits,
                misses=self._misses,
                evictions=self._data.evictions,
                entries=len(self._data),
                bytes=int(self._data.currsize),
                maxsize=self.maxsize,
                maxbytes=self.maxbytes,
                discarded=self._discarded,
            )

    def clear(self) -> None:
        """Drops every entry and resets the statistics."""
        with self._lock:
            self._data.clear()
            self._data.evictions = 0
            self._hits = self._misses = self._discarded = 0


class MaskCache(KeyedCache):
    """An LRU cache of BlockMasks keyed by shape signature and mask content.

    Args:
        maxsize: most entries held; 0 disables caching (every call builds).
        maxbytes: most bytes of BlockMask tensors held (None: no byte bound). A BlockMask
            larger than this on its own is returned but not cached.

    Example:
        >>> import flexmask
        >>> cache = flexmask.MaskCache(maxsize=8)
        >>> a = cache.get(flexmask.causal() & flexmask.document([100, 156]), 1, 1, 256, 256, "cpu")
        >>> b = cache.get(flexmask.document([100, 156]) & flexmask.causal(), 1, 1, 256, 256, "cpu")
        >>> a is b, cache.info().hits, cache.info().misses
        (True, 1, 1)
    """

    def __init__(self, maxsize: int = DEFAULT_SIZE, maxbytes: int | None = None) -> None:
        super().__init__(maxsize, maxbytes, block_mask_nbytes)

    @staticmethod
    def key(
        mask: Mask,
        B: int | None,
        H: int | None,
        Q_LEN: int,
        KV_LEN: int | None = None,
        device: torch.device | str | None = None,
        BLOCK_SIZE: int | tuple[int, int] = 128,
        *,
        q_offset: Any = 0,
        kv_offset: Any = 0,
    ) -> tuple:
        """The cache key of a build, after validating its arguments against the mask."""
        Q_LEN, KV_LEN = lengths(Q_LEN, KV_LEN, "MaskCache.key")
        spec = make_spec(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, q_offset, kv_offset)
        return spec.one_row().key

    def get(
        self,
        mask: Mask,
        B: int | None = None,
        H: int | None = None,
        Q_LEN: int | None = None,
        KV_LEN: int | None = None,
        device: torch.device | str | None = None,
        BLOCK_SIZE: int | tuple[int, int] = 128,
        *,
        q_offset: Any = 0,
        kv_offset: Any = 0,
    ) -> BlockMask:
        """The BlockMask of ``mask`` for this shape (and window: ``q_offset``/``kv_offset`` as
        for ``create_block_mask``): cached, or built and cached.

        The result has batch (head) dimension 1 when the mask does not depend on the row
        (head): real tensors of that shape, not expanded views, which flex_attention
        broadcasts. A hit returns the very object cached. ``Q_LEN`` and ``KV_LEN`` as for
        ``create_block_mask`` (KV_LEN None: Q_LEN).
        """
        Q_LEN, KV_LEN = lengths(Q_LEN, KV_LEN, "MaskCache.get")
        spec = make_spec(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, q_offset, kv_offset)
        return self.get_spec(spec)[1]

    def get_spec(self, spec: Spec) -> tuple[tuple, BlockMask]:
        """The key and BlockMask of a spec: cached, or built and cached. The spec was
        validated when it was made (``make_spec``); nothing here checks the mask again."""
        if spec.empty:  # B=0 or H=0: the one-row (head) entry, emptied as torch's
            key, one = self.get_spec(spec.one_row())
            return key, emptied(one, spec.batch, spec.heads)
        # The key from the spec's ints and the mask's content key (made with the mask): a
        # hit allocates nothing; the grid is made only to build.
        key = spec.key
        return key, self.get_or_build(key, lambda: build(spec.mask, spec.reduced().grid()))

    def __repr__(self) -> str:
        info = self.info()
        return (
            f"MaskCache(maxsize={info.maxsize}, maxbytes={info.maxbytes}, "
            f"entries={info.entries}, bytes={info.bytes}, hits={info.hits}, "
            f"misses={info.misses})"
        )


def _bound(value: object, name: str, expected: str) -> int:
    """``value`` (a Python or numpy integer) as an int >= 0, or a ValueError naming ``name``.

    ``value`` is typed ``object``, not ``int``: typeshed's ``int`` is no ``numbers.Integral``,
    and narrowing an ``int`` parameter by that isinstance leaves mypy unable to type the
    attributes assigned after it.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


_default: MaskCache | None = None
_default_lock = threading.Lock()


def default_cache() -> MaskCache:
    """The process-wide cache, sized from FLEXMASK_CACHE_SIZE / FLEXMASK_CACHE_BYTES.

    Read once, on first use. FLEXMASK_CACHE_SIZE=0 disables caching.
    """
    global _default
    with _default_lock:
        if _default is None:
            size = env_int(ENV_SIZE, DEFAULT_SIZE)
            assert size is not None
            _default = MaskCache(
                maxsize=size, maxbytes=env_int(ENV_BYTES, None, byte_suffixes=True)
            )
        return _default


def cache_info() -> CacheInfo:
    """Statistics of the process-wide cache.

    Example:
        >>> import flexmask
        >>> flexmask.cache_clear()
        >>> _ = flexmask.lazy(flexmask.causal(), 1, 1, 256, 256, "cpu").block_mask
        >>> info = flexmask.cache_info()
        >>> info.misses, info.entries
        (1, 1)
    """
    return default_cache().info()


_CLEARS: list[Callable[[], object]] = []


def on_cache_clear(clear: Callable[[], object]) -> None:
    """Registers ``clear`` to run with every :func:`cache_clear`: a layer above that keeps its
    own cache of lowered masks (a backend's) empties it with the BlockMask cache."""
    _CLEARS.append(clear)


def cache_clear() -> None:
    """Empties the process-wide cache and resets its statistics, and every cache of lowered
    masks a backend keeps (``on_cache_clear``)."""
    default_cache().clear()
    for clear in _CLEARS:
        clear()
