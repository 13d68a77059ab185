"""Lazy BlockMask handles: build on first forward use, share across layers, drop after.

A handle holds the mask expression and the shape — O(data), never an S×S tensor — so a
DataLoader worker can return one and the BlockMask is built in the training process, on the
training device, just before the forward that needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import lengths
from flexmask.algebra import Mask
from flexmask.builders import Spec, make_spec
from flexmask.runtime.cache import MaskCache, default_cache


class _Field(dict):
    """The getter of one BlockMask field on a handle: ``property(_Field(name).__getitem__)``
    reads ``name`` from the handle's BlockMask, built on this first read.

    Why a dict: its bound ``__getitem__`` is a C function, and torch.compile (dynamo) reads
    a property whose getter is a C function on the real object as it traces, rather than
    tracing into it. The build then runs once, at trace time, and the tensors enter the
    graph as inputs read from the handle; the next handle's guards read them the same way,
    which builds it: no recompile for new content of the same shape, and no graph break (a
    Python getter would be traced into the build, which dynamo cannot trace). The dict
    stays empty: every lookup misses, and ``__missing__`` answers.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __missing__(self, handle: BuiltOnRead) -> Any:
        return getattr(handle.block_mask, self.name)


def _refuse_set(name: str) -> Any:
    def refuse(handle: BuiltOnRead, value: Any) -> None:
        raise TypeError(
            f"{name} of a {type(handle).__name__} is read from its build, and cannot be set on the "
            f"handle; to edit a BlockMask, set it on a copy of handle.block_mask (the plain "
            f"BlockMask, shared through the cache with every handle of the same mask)"
        )

    return refuse


BUILT_FIELDS = tuple(name for name in BlockMask.__annotations__ if name != "BLOCK_SIZE")
"""torch's BlockMask fields a handle reads from its built BlockMask (``BLOCK_SIZE`` is part
of the recipe: the same tuple, known before the build)."""


class BuiltOnRead(BlockMask):
    """A torch BlockMask whose fields are read from ``self.block_mask``, which a subclass
    provides (built on first use, held until released): the one mechanism behind a flexmask
    handle that goes where a BlockMask goes.

    Each field of ``BUILT_FIELDS`` is a read-only property with a C-level getter
    (``_Field``): torch.compile reads it on the real handle, so the build runs when a
    compiled call first reads the handle — no graph break, no recompile for new content.
    ``BLOCK_SIZE`` stays the subclass's to give (a ``(q, kv)`` tuple, known before the
    build). Methods that make a new BlockMask make a plain one; ``str`` builds nothing.
    """

    __slots__ = ()

    for _name in BUILT_FIELDS:
        locals()[_name] = property(_Field(_name).__getitem__, _refuse_set(_name))
    del _name

    if TYPE_CHECKING:  # the one thing a subclass provides; the fields are read from it

        @property
        def block_mask(self) -> BlockMask: ...

    # torch's BlockMask methods that make a new BlockMask call ``cls(...)`` with its fields:
    # from a handle they make a plain BlockMask.
    @classmethod
    def from_kv_blocks(cls, *args: Any, **kwargs: Any) -> BlockMask:  # type: ignore[override]
        return BlockMask.from_kv_blocks(*args, **kwargs)

    @classmethod
    def _unflatten(cls, *args: Any, **kwargs: Any) -> BlockMask:  # type: ignore[override]
        return BlockMask._unflatten(*args, **kwargs)

    # torch's __str__ draws the blocks (a build); printing a handle, in a DataLoader
    # worker say, must build nothing: ``str(handle.block_mask)`` draws them.
    def __str__(self) -> str:
        return repr(self)


class LazyBlockMask(BuiltOnRead):
    """A BlockMask to be: built through the cache on first use, dropped on release.

    It *is* a torch ``BlockMask`` (a subclass), so it goes wherever one goes: torch's own
    ``flex_attention``, eager or under ``torch.compile`` (no recompile when the next batch's
    handle brings new content of the same shape), ``shape``, ``kv_num_blocks``,
    ``mask_mod``, ``sparsity()``, ``to_dense()``, ``to(device)``, indexing, ``_adjust``,
    torch's paged-attention and context-parallel helpers. The first read of a BlockMask
    field builds it (through the cache, once for every layer that reads it); ``release``
    drops it. Reading the recipe — ``mask``, ``B``, ``H``, ``Q_LEN``, ``KV_LEN``,
    ``device``, ``BLOCK_SIZE``, ``built``, ``repr`` — builds nothing. Methods that make a
    new BlockMask (``to``, ``_adjust``, indexing) return a plain, built ``BlockMask``.

    Example:
        >>> import flexmask, torch
        >>> handle = flexmask.lazy(flexmask.causal() & flexmask.document([100, 156]),
        ...                        1, 1, 256, 256, device="cpu")
        >>> handle.built
        False
        >>> q = k = v = torch.randn(1, 2, 256, 16)
        >>> with handle:                    # released when the block ends
        ...     out = flexmask.flex_attention(q, k, v, block_mask=handle, compile=False)
        ...     before = handle.built       # the CPU's slices backend lowered the mask itself
        ...     before, handle.shape, handle.built  # a BlockMask attribute: read from the build
        (False, (1, 1, 256, 256), True)
        >>> handle.built
        False
    """

    # The recipe, in the order it pickles.
    _RECIPE = ("mask", "B", "H", "Q_LEN", "KV_LEN", "device", "BLOCK_SIZE")
    __slots__ = (*_RECIPE, "spec", "cache", "_block_mask", "_key", "builds")

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
        # torch's BlockMask.__init__ is not called: it would set the fields this handle
        # reads from its build.
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a flexmask Mask, got {type(mask).__name__}")
        if cache is not None and not isinstance(cache, MaskCache):
            raise TypeError(
                f"cache must be a flexmask.MaskCache or None (the process-wide cache), "
                f"got {type(cache).__name__} {cache!r}"
            )
        # Validate now, once, so a bad batch fails in the worker that made it; Python ints
        # only, nothing touches the device before the first use builds.
        self._set_spec(make_spec(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE))
        self.cache = cache
        self._block_mask: BlockMask | None = None
        self._key: tuple | None = None
        self.builds = 0

    @property
    def built(self) -> bool:
        """True while the handle holds its BlockMask."""
        return self._block_mask is not None

    @property
    def block_mask(self) -> BlockMask:
        """The plain BlockMask: built (or fetched from the cache) on first use, then held."""
        if self._block_mask is None:
            self._key, self._block_mask = self._cache().get_spec(self.spec)
            self.builds += 1
        return self._block_mask

    def release(self) -> None:
        """Drops the BlockMask. Masks carrying per-batch data leave the cache too.

        A backward still pending keeps what it saved: autograd holds its own references.
        """
        built, self._block_mask = self._block_mask is not None, None
        # Only a handle that built has an entry to drop, under the key its build made:
        # releasing an unbuilt handle (in a worker, say) touches no device.
        if built and self._key is not None and self.mask.carries_batch_data and self.B and self.H:
            self._cache().discard(self._key)

    def release_after(self, module: torch.nn.Module) -> Any:
        """Releases this handle when ``module``'s next forward returns (a one-shot hook).

        Returns the hook's removable handle.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"module must be a torch.nn.Module (the handle is released when its forward "
                f"returns), got {type(module).__name__} {module!r}"
            )
        hooks: list[Any] = []

        def _release(*_: Any) -> None:
            self.release()
            hooks[0].remove()

        hooks.append(module.register_forward_hook(_release))
        return hooks[0]

    def _set_spec(self, spec: Spec) -> None:
        self.spec = spec
        self.mask = spec.mask
        self.B, self.H = spec.batch, spec.heads
        self.Q_LEN, self.KV_LEN = spec.q_len, spec.kv_len
        self.device = spec.device
        self.BLOCK_SIZE = spec.block_size

    def _cache(self) -> MaskCache:
        return self.cache if self.cache is not None else default_cache()

    def __enter__(self) -> LazyBlockMask:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __getstate__(self) -> dict[str, Any]:
        # Pickles the recipe, never the built tensors nor the cache (process-local).
        return {name: getattr(self, name) for name in self._RECIPE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A loaded recipe is a new call: validated, once, as when the handle was made.
        recipe = [state[name] for name in self._RECIPE]
        self._set_spec(make_spec(*recipe))
        self.cache = None
        self._block_mask = None
        self._key = None
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
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    *,
    cache: MaskCache | None = None,
) -> LazyBlockMask:
    """A handle that builds the BlockMask of ``mask`` on first use, through the cache.

    Args:
        mask: a flexmask expression.
        B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE: as for ``create_block_mask``. B=None takes
            the row count of per-row data; KV_LEN None is Q_LEN.
        cache: the MaskCache to build through (None: the process-wide cache).

    Example:
        >>> import flexmask
        >>> h = flexmask.lazy(flexmask.causal(), 1, 1, 512, 512, device="cpu")
        >>> h.block_mask is h.block_mask    # one build serves every layer
        True
        >>> h.builds
        1
    """
    Q_LEN, KV_LEN = lengths(Q_LEN, KV_LEN, "lazy")
    return LazyBlockMask(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, cache)
