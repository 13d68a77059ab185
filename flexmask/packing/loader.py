"""DataLoader integration: a collate function and an iterable dataset that pack as they go."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from flexmask._validate import check_device, check_int
from flexmask.packing.documents import PackedBatch, pack
from flexmask.packing.tokens import (
    _POLICIES,
    _STRATEGIES,
    Device,
    Policy,
    Strategy,
    _check_choice,
    _check_memory,
)


class PackingCollator:
    """``collate_fn`` that packs a list of sequences and attaches a lazy, unbuilt BlockMask.

    Workers only pack (cheap Python and small tensors) and ship the handle's recipe; the
    BlockMask is built in the process that first reads ``batch.handle.block_mask``, on its
    device, so no mask crosses process boundaries and no worker touches the accelerator.

    Args:
        max_len: row length, see :func:`pack`. A ``max_len`` whose one row would not fit in
            memory (24 bytes a token, more than the RAM or cgroup limit) is refused here,
            not later inside a worker.
        num_heads: ``H`` of the BlockMask.
        device: where the BlockMask will be built (``None``: flexmask's default).
        block_size: the BlockMask's ``BLOCK_SIZE``.
        key: when dataset items are mappings (e.g. ``{"input_ids": [...]}``), the key holding
            the tokens; ``None`` means items are token sequences themselves.
        policy, pad_id, ignore_index, strategy, split_across_pack: passed to :func:`pack`.
        labels_key, loss_mask_key: with ``key``, the item keys holding per-token ``labels``
            or a ``loss_mask`` (see :func:`pack`; at most one), e.g. for SFT items
            ``{"input_ids": [...], "labels": [...]}``.
        check: run :func:`~flexmask.check_batch` on every batch (in the worker) and raise
            ValueError at a disagreement; None: the environment variable FLEXMASK_CHECK=1.

    Example:
        >>> from flexmask.packing import PackingCollator
        >>> from torch.utils.data import DataLoader
        >>> data = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
        >>> loader = DataLoader(data, batch_size=4, collate_fn=PackingCollator(max_len=5))
        >>> batch = next(iter(loader))
        >>> batch.seq_lens, batch.handle.built
        ([[4, 1], [3, 2]], False)
    """

    def __init__(
        self,
        max_len: int,
        num_heads: int = 1,
        *,
        device: Device = None,
        block_size: int = 128,
        key: str | None = None,
        policy: Policy = "split",
        pad_id: int = 0,
        ignore_index: int = -100,
        strategy: Strategy = "first_fit_decreasing",
        labels_key: str | None = None,
        loss_mask_key: str | None = None,
        split_across_pack: bool = False,
        check: bool | None = None,
    ) -> None:
        # Validated here so a bad setting fails at construction, not later inside a worker.
        self.max_len = check_int(max_len, "max_len", minimum=1)
        # One row is the least a batch needs; pack checks the whole batch once rows are known.
        _check_memory(
            24 * self.max_len,
            f"one row of tokens, labels and position_ids (3 int64 tensors of {self.max_len})",
            f"max_len={self.max_len}",
            "a max_len near the longest sequence wastes little on padding",
        )
        self.num_heads = check_int(num_heads, "num_heads", minimum=1)
        self.block_size = check_int(block_size, "block_size", minimum=1)
        # A name or torch.device, checked; nothing touches the device until a handle builds.
        self.device = None if device is None else check_device(device)
        self.key = key
        self.policy = _check_choice("policy", policy, _POLICIES)
        self.pad_id = check_int(pad_id, "pad_id", minimum=0)
        self.ignore_index = check_int(ignore_index, "ignore_index")
        self.strategy = _check_choice("strategy", strategy, _STRATEGIES)
        if (labels_key or loss_mask_key) and key is None:
            raise ValueError(
                "labels_key/loss_mask_key read mapping items: pass key= too (e.g. "
                "key='input_ids', labels_key='labels')"
            )
        if labels_key and loss_mask_key:
            raise ValueError("pass labels_key or loss_mask_key, not both")
        if not isinstance(split_across_pack, bool):
            raise TypeError(f"split_across_pack must be a bool, got {split_across_pack!r}")
        self.labels_key = labels_key
        self.loss_mask_key = loss_mask_key
        self.split_across_pack = split_across_pack
        self.check = check

    def __call__(self, items: Sequence[Any]) -> PackedBatch:
        targets: dict[str, Any] = {}
        if self.labels_key is not None:
            targets["labels"] = [_select(item, self.labels_key, j) for j, item in enumerate(items)]
        if self.loss_mask_key is not None:
            targets["loss_mask"] = [
                _select(item, self.loss_mask_key, j) for j, item in enumerate(items)
            ]
        if self.key is not None:
            items = [_select(item, self.key, j) for j, item in enumerate(items)]
        batch = pack(
            items,
            self.max_len,
            policy=self.policy,  # type: ignore[arg-type]
            pad_id=self.pad_id,
            ignore_index=self.ignore_index,
            strategy=self.strategy,  # type: ignore[arg-type]
            split_across_pack=self.split_across_pack,
            check=self.check,
            **targets,
        )
        handle = batch.lazy(self.num_heads, self.device, self.block_size)
        return dataclasses.replace(batch, handle=handle)

    def __repr__(self) -> str:
        return (
            f"PackingCollator(max_len={self.max_len}, num_heads={self.num_heads}, "
            f"device={self.device!r}, block_size={self.block_size}, key={self.key!r}, "
            f"policy={self.policy!r}, strategy={self.strategy!r})"
        )


def _select(item: Any, key: str, index: int) -> Any:
    if not isinstance(item, Mapping):
        raise TypeError(
            f"item {index} is a {type(item).__name__}, but key={key!r} was given; with key, "
            "items must be mappings such as {'input_ids': [...]} (or pass key=None)"
        )
    if key not in item:
        raise KeyError(f"item {index} has no {key!r}; its keys are {sorted(map(str, item))}")
    return item[key]


class PackedDataset(torch.utils.data.IterableDataset):
    """Streams :class:`PackedBatch` es, each packing the next ``buffer_size`` sequences.

    Use with ``DataLoader(dataset, batch_size=None)``; every batch carries an unbuilt lazy
    handle, as with :class:`PackingCollator`. With several workers, worker ``w`` of ``n`` takes
    sequences ``w, w + n, w + 2n, ...``, so ``sequences`` must iterate the same way in every
    worker (a list, a file, a seeded generator). The last, partial buffer is packed too.

    Args:
        sequences: an iterable of token sequences (or of mappings, with ``key``).
        max_len: row length, see :func:`pack`.
        buffer_size: sequences packed together; more gives tighter packing and bigger batches.
        num_heads: as in :class:`PackingCollator`; so are ``device``, ``block_size``,
            ``key``, ``policy``, ``pad_id``, ``ignore_index``, ``strategy``, ``labels_key``,
            ``loss_mask_key``, ``split_across_pack`` and ``check``.

    Example:
        >>> from flexmask.packing import PackedDataset
        >>> data = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11]]
        >>> batches = list(PackedDataset(data, max_len=5, buffer_size=4))
        >>> [b.seq_lens for b in batches]
        [[[4, 1], [3, 2]], [[1]]]
    """

    def __init__(
        self,
        sequences: Iterable[Any],
        max_len: int,
        *,
        buffer_size: int = 64,
        num_heads: int = 1,
        device: Device = None,
        block_size: int = 128,
        key: str | None = None,
        policy: Policy = "split",
        pad_id: int = 0,
        ignore_index: int = -100,
        strategy: Strategy = "first_fit_decreasing",
        labels_key: str | None = None,
        loss_mask_key: str | None = None,
        split_across_pack: bool = False,
        check: bool | None = None,
    ) -> None:
        super().__init__()
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
            raise TypeError(
                f"sequences must be an iterable of token sequences, got {type(sequences).__name__}"
            )
        self.sequences = sequences
        self.buffer_size = check_int(buffer_size, "buffer_size", minimum=1)
        self.collate = PackingCollator(
            max_len,
            num_heads,
            device=device,
            block_size=block_size,
            key=key,
            policy=policy,
            pad_id=pad_id,
            ignore_index=ignore_index,
            strategy=strategy,
            labels_key=labels_key,
            loss_mask_key=loss_mask_key,
            split_across_pack=split_across_pack,
            check=check,
        )

    def __iter__(self) -> Iterator[PackedBatch]:
        items: Iterator[Any] = iter(self.sequences)
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            items = itertools.islice(items, worker.id, None, worker.num_workers)
        while buffer := list(itertools.islice(items, self.buffer_size)):
            yield self.collate(buffer)
