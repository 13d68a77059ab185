"""The runtime: what a call holds between the user and a backend — the spec of a build
(validated once), the cache of built BlockMasks (keys apart from the cache) and lazy
handles."""

from flexmask.builders import Spec, make_spec  # noqa: F401 (names of _INTERNAL)
from flexmask.runtime.cache import (  # noqa: F401 (names of _INTERNAL)
    CacheInfo,
    KeyedCache,
    MaskCache,
    cache_clear,
    cache_info,
    default_cache,
    on_cache_clear,
)
from flexmask.runtime.lazy import BuiltOnRead, LazyBlockMask, lazy  # noqa: F401 (names of _INTERNAL)

__all__ = [
    "CacheInfo",
    "LazyBlockMask",
    "MaskCache",
    "cache_clear",
    "cache_info",
    "default_cache",
    "lazy",
]

# What other flexmask packages use and users need not: not an API, it may change in any
# release (tests/test_structure.py lets siblings import these beside __all__; ruff reads only
# __all__, hence the noqa on their imports).
_INTERNAL = [
    "BuiltOnRead",
    "KeyedCache",
    "Spec",
    "make_spec",
    "on_cache_clear",
]
