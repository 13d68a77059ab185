"""``CPShard``: one rank's BlockMask and the permutation that shards, pads and restores the
rank's tensors (no collective)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor.experimental._attention import _LoadBalancer
from torch.nn.attention.flex_attention import BlockMask

from flexmask._validate import check_int


@dataclass(frozen=True, eq=False)
class CPShard:
    """One rank's share of a context-parallel attention.

    Attributes:
        block_mask: the local BlockMask, ``(B, H, padded_length / W, padded_length)``; B and H
            are 1 where the mask ignores them.
        indices: (1 or B, padded_length) int64: ``x[..., indices, ...]`` is the permuted
            sequence; this rank keeps the slice ``local`` of it.
        balancer: the ``_LoadBalancer`` that gave ``indices`` (pass it to torch's
            ``_context_parallel_shard`` / ``context_parallel_unshard``), or None.
        seq_length: real sequence length; padded_length: what it is padded to (zeros
            appended by ``shard_tensor``; those tokens neither attend nor are attended).
        kv_length: the key/value length where it differs from the query length (then
            ``balancer`` is None: keys stay in their order, see ``shard_kv``), else None.
    """

    block_mask: BlockMask
    indices: Tensor
    balancer: _LoadBalancer | None
    rank: int
    world_size: int
    seq_length: int
    padded_length: int
    key: tuple = field(repr=False)
    kv_length: int | None = None

    @property
    def local(self) -> slice:
        size = self.padded_length // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def _dim(self, tensor: Any, seq_dim: Any, method: str) -> int:
        """``seq_dim`` as a dim of ``tensor`` (negative ones counted from the end), or a
        TypeError/ValueError naming the argument of ``method``."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{method}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        dim = check_int(seq_dim, "seq_dim")
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(
                f"{method}: seq_dim={dim} is not a dim of a tensor of shape "
                f"{tuple(tensor.shape)}: pass one in [{-tensor.dim()}, {tensor.dim()})"
            )
        return dim % tensor.dim()

    def _rows_match(self, tensor: Tensor, seq_dim: int, method: str) -> None:
        rows = self.indices.shape[0]
        if rows > 1 and (seq_dim == 0 or tensor.shape[0] != rows):
            raise ValueError(
                f"{method}: this shard has one permutation per batch row ({rows} rows), so the "
                f"tensor must be batch first with {rows} rows and its sequence on another dim; "
                f"got shape {tuple(tensor.shape)} with seq_dim={seq_dim}"
            )

    def pad(self, tensor: Tensor, seq_dim: int) -> Tensor:
        """``tensor`` zero-padded along ``seq_dim`` to ``padded_length``."""
        seq_dim = self._dim(tensor, seq_dim, "pad")
        extra = self.padded_length - tensor.shape[seq_dim]
        if extra < 0:
            raise ValueError(
                f"tensor has {tensor.shape[seq_dim]} positions on dim {seq_dim}, more than "
                f"the sharded sequence ({self.padded_length})"
            )
        if extra == 0:
            return tensor
        shape = list(tensor.shape)
        shape[seq_dim] = extra
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=seq_dim)

    def shard_tensor(self, tensor: Tensor, seq_dim: int) -> Tensor:
        """This rank's slice of ``tensor`` (batch first), padded and permuted: no collective."""
        seq_dim = self._dim(tensor, seq_dim, "shard_tensor")
        self._rows_match(tensor, seq_dim, "shard_tensor")
        tensor = self.pad(tensor, seq_dim)
        index = self.indices[:, self.local].to(tensor.device)
        if seq_dim == 0:
            return tensor.index_select(0, index[0])
        shape = [1] * tensor.dim()
        shape[0], shape[seq_dim] = index.shape[0], index.shape[1]
        target = list(tensor.shape)
        target[seq_dim] = index.shape[1]
        return torch.gather(tensor, seq_dim, index.view(shape).expand(target))

    def shard_kv(self, tensor: Tensor, seq_dim: int) -> Tensor:
        """This rank's slice of a key/value tensor: ``shard_tensor`` where keys and queries
        share the sequence, else (``kv_length`` set) the contiguous ``kv_length / W``
        positions torch's ``_context_parallel_shard`` keeps without a balancer."""
        if self.kv_length is None:
            return self.shard_tensor(tensor, seq_dim)
        seq_dim = self._dim(tensor, seq_dim, "shard_kv")
        if tensor.shape[seq_dim] != self.kv_length or self.kv_length % self.world_size:
            raise ValueError(
                f"tensor has {tensor.shape[seq_dim]} positions on dim {seq_dim}; keys of "
                f"this shard need kv_length = {self.kv_length}, a multiple of world_size = "
                f"{self.world_size} (the all-gather joins equal slices)"
            )
        size = self.kv_length // self.world_size
        return tensor.narrow(seq_dim, self.rank * size, size)

    def restore(self, gathered: Tensor, seq_dim: int) -> Tensor:
        """A gathered (permuted, padded) tensor back in the original order, unpadded."""
        seq_dim = self._dim(gathered, seq_dim, "restore")
        self._rows_match(gathered, seq_dim, "restore")
        if gathered.shape[seq_dim] != self.padded_length:
            raise ValueError(
                f"restore: gathered has {gathered.shape[seq_dim]} positions on dim {seq_dim}, "
                f"but every rank's slices gathered make padded_length = {self.padded_length}"
            )
        index = torch.argsort(self.indices, dim=-1).to(gathered.device)
        if seq_dim == 0:
            return gathered.index_select(0, index[0]).narrow(0, 0, self.seq_length)
        shape = [1] * gathered.dim()
        shape[0], shape[seq_dim] = index.shape[0], index.shape[1]
        out = torch.gather(gathered, seq_dim, index.view(shape).expand(gathered.shape))
        return out.narrow(seq_dim, 0, self.seq_length)
