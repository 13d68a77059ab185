"""The runtime: what a call holds between the user and a backend — the spec of a build
(validated once), the cache of built BlockMasks (keys apart from the cache) and lazy
handles."""

from flexmask.builders import Spec, make_spec
from flexmask.runtime.cache import (
    CacheInfo,
    KeyedCache,
    MaskCache,
    cache_clear,
    cache_info,
    default_cache,
    on_cache_clear,
)
from flexmask.runtime.lazy import BuiltOnRead, LazyBlockMask, lazy

__all__ = [
    "BuiltOnRead",
    "CacheInfo",
    "KeyedCache",
    "LazyBlockMask",
    "MaskCache",
    "Spec",
    "cache_clear",
    "cache_info",
    "default_cache",
    "lazy",
    "make_spec",
    "on_cache_clear",
]
