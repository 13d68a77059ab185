"""``LazyShard``: a rank's shard as a torch ``BlockMask`` built on first read through a
``ShardCache``, pickled as its recipe; ``lazy_shard`` makes one."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor.experimental._attention import _LoadBalancer
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import lengths
from flexmask.algebra import Mask
from flexmask.context_parallel.build import build_rank_shard
from flexmask.context_parallel.plan import ShardPlan, plan_shard
from flexmask.context_parallel.rank_shard import CPShard
from flexmask.context_parallel.shard_cache import ShardCache, default_shard_cache
from flexmask.runtime import BuiltOnRead


class LazyShard(BuiltOnRead):
    """A shard to be: built through a ShardCache on first use, dropped on release.

    Like ``LazyBlockMask`` it *is* a torch ``BlockMask`` (both are ``BuiltOnRead``): the
    rank's local BlockMask goes wherever one goes (``flex_attention``, ``shape``,
    ``kv_num_blocks``...), and its first read of a BlockMask field builds the shard.
    ``shard`` is the whole ``CPShard`` (the permutation to shard q/k/v with, too).

    Holds only the recipe (mask, shape, group, balancer) and its spec, validated when made
    (the mask once, against the whole padded sequence); its key is computed once, then, and
    carries world size, rank and balancer. It pickles that recipe (a mesh as the world size
    and rank it gave, ``BLOCK_SIZE`` as torch's ``(q, kv)`` pair), never the built shard nor
    the cache, which are process-local: an unpickled handle is validated again, as a new
    call, and builds through ``default_shard_cache()``.

    Example:
        >>> import flexmask
        >>> h = flexmask.lazy_shard(flexmask.causal(), 1, 1, 512, world_size=2, rank=1,
        ...                         BLOCK_SIZE=64, cache=flexmask.context_parallel.ShardCache())
        >>> h.built, h.BLOCK_SIZE
        (False, (64, 64))
        >>> h.kv_num_blocks.shape, h.built     # a BlockMask field: read from the build
        (torch.Size([1, 1, 4]), True)
    """

    # The recipe, in the order it pickles.
    _RECIPE: tuple[str, ...] = (
        *("mask", "B", "H", "Q_LEN", "KV_LEN", "world_size", "rank", "balancer"),
        *("BLOCK_SIZE", "device", "key"),
    )
    __slots__ = (*_RECIPE, "spec", "cache", "_plan", "_shard")

    def __init__(
        self,
        mask: Mask,
        B: int | None = None,
        H: int | None = None,
        Q_LEN: int | None = None,
        KV_LEN: int | None = None,
        *,
        world_size: int | None = None,
        rank: int | None = None,
        mesh: Any = None,
        balancer: str | _LoadBalancer | None = "head_tail",
        BLOCK_SIZE: int | tuple[int, int] = 128,
        device: torch.device | str | None = None,
        cache: ShardCache | None = None,
    ) -> None:
        # torch's BlockMask.__init__ is not called: it would set the fields this handle
        # reads from its build.
        if cache is not None and not isinstance(cache, ShardCache):
            raise TypeError(
                f"cache must be a flexmask ShardCache or None (the process-wide one), got "
                f"{type(cache).__name__}"
            )
        Q_LEN = lengths(Q_LEN, KV_LEN, "LazyShard")[0]
        plan = plan_shard(
            mask, B, H, Q_LEN, KV_LEN, world_size, rank, mesh, balancer, BLOCK_SIZE, device
        )
        # The argument, not the resolved balancer: a name stays a name (made where built).
        self._set_plan(plan, balancer)
        self.cache = cache

    def _set_plan(self, plan: ShardPlan, balancer: Any) -> None:
        self._plan = plan
        self.spec = plan.spec
        self.mask, self.B, self.H, self.Q_LEN = plan.mask, plan.B, plan.H, plan.Q_LEN
        self.KV_LEN = plan.kv_length
        self.world_size, self.rank = plan.world, plan.rank
        self.balancer = balancer
        self.BLOCK_SIZE, self.device = plan.block, plan.device
        self.key = plan.key
        self._shard: CPShard | None = None

    @property
    def built(self) -> bool:
        """True while the handle holds its shard."""
        return self._shard is not None

    @property
    def shard(self) -> CPShard:
        """The ``CPShard``: built (or fetched from the cache) on first use, then held."""
        if self._shard is None:
            plan = self._plan
            self._shard = self._cache().get_or_build(plan.key, lambda: build_rank_shard(plan))
        return self._shard

    @property
    def block_mask(self) -> BlockMask:
        """The rank's plain BlockMask (``shard.block_mask``)."""
        return self.shard.block_mask

    def release(self) -> None:
        """Drops the shard, and its cache entry."""
        self._shard = None
        self._cache().discard(self.key)

    def _cache(self) -> ShardCache:
        return self.cache if self.cache is not None else default_shard_cache()

    def __enter__(self) -> LazyShard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in self._RECIPE)

    def __setstate__(self, state: tuple) -> None:
        # A loaded recipe is a new call: validated, once, as when the handle was made.
        recipe = dict(zip(self._RECIPE, state, strict=True))
        plan = plan_shard(
            recipe["mask"],
            recipe["B"],
            recipe["H"],
            recipe["Q_LEN"],
            recipe["KV_LEN"],
            recipe["world_size"],
            recipe["rank"],
            None,
            recipe["balancer"],
            recipe["BLOCK_SIZE"],
            recipe["device"],
        )
        if plan.key != recipe["key"]:
            raise ValueError(
                f"this LazyShard was pickled with key {recipe['key']!r}, but its recipe makes "
                f"{plan.key!r} here: unpickle it where the same flexmask makes the same shard"
            )
        self._set_plan(plan, recipe["balancer"])
        self.cache = None

    def __repr__(self) -> str:
        return (
            f"LazyShard({self.mask!r}, B={self.B}, H={self.H}, Q_LEN={self.Q_LEN}, "
            f"KV_LEN={self.KV_LEN}, world_size={self.world_size}, rank={self.rank}, "
            f"balancer={self.balancer!r}, BLOCK_SIZE={self.BLOCK_SIZE}, built={self.built})"
        )


def lazy_shard(
    mask: Mask,
    B: int | None = None,
    H: int | None = None,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    mesh: Any = None,
    balancer: str | _LoadBalancer | None = "head_tail",
    BLOCK_SIZE: int | tuple[int, int] = 128,
    device: torch.device | str | None = None,
    cache: ShardCache | None = None,
) -> LazyShard:
    """A rank-aware lazy handle: ``flexmask.shard`` on first use, through ``cache``.

    Takes ``shard``'s arguments, checked now (a misspelled keyword is a TypeError here, not
    at first use). ``cache``: the ShardCache to build through (None: the process-wide one,
    ``default_shard_cache()``). The handle pickles its recipe, not the shard.

    Example:
        >>> import flexmask
        >>> cache = flexmask.context_parallel.ShardCache()
        >>> h = flexmask.lazy_shard(flexmask.causal(), 1, 1, 512, cache=cache,
        ...                         world_size=2, rank=1)
        >>> h.key in cache, h.block_mask.shape, h.key in cache
        (False, (1, 1, 256, 512), True)
    """
    return LazyShard(
        mask,
        B,
        H,
        Q_LEN,
        KV_LEN,
        world_size=world_size,
        rank=rank,
        mesh=mesh,
        balancer=balancer,
        BLOCK_SIZE=BLOCK_SIZE,
        device=device,
        cache=cache,
    )
