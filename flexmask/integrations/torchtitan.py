"""torchtitan: the mapping its hybrid models' ``get_attention_masks`` returns, from a flexmask
batch.

torchtitan's Qwen3.5 (softmax attention and Gated DeltaNet layers) keeps packed documents
apart in every layer through one dict: each block reads its value by key,
``"quadratic_attention"`` (a ``BlockMask`` for FlexAttention, or the ``VarlenMetadata`` of
varlen attention) and ``"deltanet"`` (the ``VarlenMetadata`` whose ``cu_seq_q`` its Gated
DeltaNet hands to fla's convolution and delta rule, with ``cu_seq_q_host``, the same offsets
as Python ints, which fla sizes its launches from). :func:`attention_masks` returns that
dict with torchtitan's own ``VarlenMetadata`` (imported when called: torchtitan stays out of
flexmask's dependencies) and a BlockMask built by flexmask from the batch's structure.

The offsets run over the ``B * S`` tokens laid end to end, as torchtitan's Gated DeltaNet
folds its batch into one row: every document one sequence, and every padding token one of
its own — the partition torchtitan's ``create_varlen_metadata_for_document`` reads from
positions that restart at 0, which ``flexmask.pack`` writes (0 at padding too).
"""

from __future__ import annotations

from typing import Any

import torch

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.builders import create_block_mask
from flexmask.integrations.transformers import flash_kwargs
from flexmask.packing import PackedBatch

__all__ = ["attention_masks", "varlen_metadata"]

QUADRATIC = ("flex", "varlen", None)
"""What the quadratic attention layers run: FlexAttention, varlen attention, or none."""


def _varlen_type() -> Any:
    try:
        from torchtitan.models.common.attention import VarlenMetadata
    except ImportError as error:
        raise ImportError(
            "flexmask.integrations.torchtitan needs torchtitan (its VarlenMetadata): "
            "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser "
            f"triton, or torchtitan with its dependencies ({error})"
        ) from error
    return VarlenMetadata


def _shape(batch: Any, shape: Any) -> tuple[int, int]:
    if isinstance(batch, PackedBatch):
        return batch.num_rows, batch.max_len
    if not isinstance(batch, Mask):
        raise TypeError(
            f"batch must be a PackedBatch (flexmask.pack) or a flexmask Mask with shape=(B, S), "
            f"got {type(batch).__name__}"
        )
    if shape is None or len(shape) != 2:
        raise TypeError(f"with a Mask as batch, pass shape=(batch_size, seq_len); got {shape!r}")
    return (check_int(shape[0], "shape[0]", minimum=1), check_int(shape[1], "shape[1]", minimum=1))


def varlen_metadata(
    batch: PackedBatch | Mask,
    *,
    shape: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
    host_offsets: bool = True,
) -> Any:
    """torchtitan's ``VarlenMetadata`` of a packed batch: its documents as varlen sequences.

    Args:
        batch: a :class:`~flexmask.packing.PackedBatch`, or a causal flexmask ``Mask`` of
            documents with ``shape``.
        shape: ``(B, S)``, only with a ``Mask``.
        device: where ``cu_seq_q``/``cu_seq_k`` live (the model's device).
        host_offsets: also set ``cu_seq_q_host`` (the offsets as a tuple of ints), which
            torchtitan's Gated DeltaNet requires.

    Returns:
        ``VarlenMetadata(cu_seq_q, cu_seq_k, max_q, max_k, cu_seq_q_host)``: int32 offsets
        over the ``B * S`` tokens end to end, the longest sequence.

    Raises:
        ImportError: torchtitan is not installed (the message gives the install line).
        ValueError: the mask is not causal documents (``flash_kwargs``' reason).
    """
    metadata = _varlen_type()
    size = _shape(batch, shape)
    flash = flash_kwargs(batch, shape=None if isinstance(batch, PackedBatch) else size)
    cu = flash["cu_seq_lens_q"].to(device) if device is not None else flash["cu_seq_lens_q"]
    host = tuple(int(x) for x in flash["cu_seq_lens_q"].tolist()) if host_offsets else None
    longest = flash["max_length_q"]
    return metadata(cu_seq_q=cu, cu_seq_k=cu, max_q=longest, max_k=longest, cu_seq_q_host=host)


def attention_masks(
    batch: PackedBatch | Mask,
    *,
    quadratic: str | None = "flex",
    shape: tuple[int, int] | None = None,
    block_size: int = 128,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """What torchtitan's hybrid ``get_attention_masks`` returns, for a flexmask batch.

    Args:
        batch: a :class:`~flexmask.packing.PackedBatch`, or a causal flexmask ``Mask`` of
            documents with ``shape``.
        quadratic: what the softmax-attention layers run: ``"flex"`` (a BlockMask, ``B`` by
            1 head, as torchtitan builds it), ``"varlen"`` (the same ``VarlenMetadata`` as the
            Gated DeltaNet, as torchtitan gives both under varlen attention) or None (a model
            without such layers).
        shape: ``(B, S)``, only with a ``Mask``.
        block_size: the BlockMask's block size (torchtitan's ``FlexAttention.Config.block_size``).
        device: where the BlockMask and the offsets are built.

    Returns:
        ``{"quadratic_attention": BlockMask | VarlenMetadata | None, "deltanet":
        VarlenMetadata}``.

    Example:
        >>> from flexmask.packing import pack
        >>> from flexmask.integrations.torchtitan import attention_masks
        >>> masks = attention_masks(pack([[1, 2, 3], [4, 5]], max_len=6))
        >>> masks["deltanet"].cu_seq_q_host, type(masks["quadratic_attention"]).__name__
        ((0, 3, 5, 6), 'BlockMask')
    """
    if quadratic not in QUADRATIC:
        raise ValueError(f"quadratic must be 'flex', 'varlen' or None, got {quadratic!r}")
    deltanet = varlen_metadata(batch, shape=shape, device=device)
    batch_size, seq_len = _shape(batch, shape)
    if quadratic == "flex":
        mask = batch.mask if isinstance(batch, PackedBatch) else batch
        attention: Any = create_block_mask(
            mask, batch_size, 1, seq_len, seq_len, device=device, BLOCK_SIZE=block_size
        )
    else:
        attention = deltanet if quadratic == "varlen" else None
    return {"quadratic_attention": attention, "deltanet": deltanet}
