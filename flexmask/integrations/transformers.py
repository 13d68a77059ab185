"""Hugging Face transformers: the mask every layer type of a model needs, for every backend.

A transformers decoder can mix layer types (``config.layer_types``): ``"full_attention"``,
``"sliding_attention"`` (a window of ``config.sliding_window`` tokens) and
``"chunked_attention"`` (Llama 4: chunks of ``config.attention_chunk_size``). When its
``attention_mask`` is already prepared, transformers uses it as is for every layer, so one mask
for all layers silently drops the window. :func:`attention_masks` builds one mask per layer
type from a packed batch, in the form the model's attention implementation reads:

* ``"flex_attention"`` and :func:`register`'s ``"flexmask"``: a ``BlockMask``, built from
  structure through flexmask's cache;
* ``"sdpa"``: a dense bool ``(B, 1, S, S)`` mask;
* ``"eager"``: a dense additive ``(B, 1, S, S)`` float mask (0 where attended, the dtype's
  minimum elsewhere), which eager attention adds to its scores;
* ``"flash_attention_2"`` / ``"flash_attention_3"``: no mask at all, but :func:`flash_kwargs`
  — ``cu_seq_lens_q/k`` and ``max_length_q/k`` from ``flexmask.formats.to_varlen`` of the
  batch's mask — which transformers' flash path hands to ``flash_attn_varlen_func``
  (:func:`model_inputs` gives them).

Windows and chunks count *positions* (``position_ids``), not packed offsets, so they stay
exact inside packed documents (positions restart in each) and inside prefix trees (a node's
position is its depth). transformers itself stays out of flexmask's dependencies: install the
``transformers`` extra.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from cachetools import LRUCache
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask import pieces
from flexmask._validate import check_device, check_int
from flexmask.algebra import Mask
from flexmask.attention import flex_attention
from flexmask.builders import create_block_mask
from flexmask.formats import to_varlen
from flexmask.integrations.transformers_layers import (
    RECURRENT_KINDS,
    _text_config,
    boundary_kwargs,
    causal_lm_labels,
    layer_kinds,
    mask_kinds,
)
from flexmask.packing import PackedBatch, TreeBatch, TreePack, check_batch, check_enabled
from flexmask.runtime import LazyBlockMask

__all__ = [
    "attention_masks",
    "flash_kwargs",
    "flexmask_attention",
    "layer_mask",
    "model_inputs",
    "register",
]

FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
"""transformers' implementations that read ``cu_seq_lens_*`` / ``max_length_*``."""

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
_DENSE_CACHE: LRUCache = LRUCache(maxsize=16)  # dense masks by (mask, shape, kind, dtype, device)


def _check_shape(shape: Any) -> tuple[int, int]:
    if shape is None:
        raise TypeError("with a flexmask Mask as batch, pass shape=(batch_size, seq_len)")
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__") or len(shape) != 2:
        raise ValueError(f"shape must be (batch_size, seq_len), two ints >= 1; got {shape!r}")
    return (
        check_int(shape[0], "shape[0] (batch_size)", minimum=1),
        check_int(shape[1], "shape[1] (seq_len)", minimum=1),
    )


def _check_positions(position_ids: Any, batch_size: int, seq_len: int) -> Tensor:
    if not isinstance(position_ids, Tensor):
        raise TypeError(
            f"position_ids must be a (batch_size, seq_len) integer tensor, got "
            f"{type(position_ids).__name__}"
        )
    dtype = position_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor, got dtype {dtype}")
    if tuple(position_ids.shape) != (batch_size, seq_len):
        raise ValueError(
            f"position_ids must have shape (batch_size, seq_len) = {(batch_size, seq_len)}, got "
            f"{tuple(position_ids.shape)}"
        )
    return position_ids


def _batch_parts(
    batch: Any, shape: Any, position_ids: Tensor | None
) -> tuple[Mask, Tensor | None, int, int]:
    """The base mask, the (B, S) positions (None: 0..S-1 in every row), B and S."""
    if position_ids is not None and not isinstance(batch, Mask):
        raise TypeError(
            f"position_ids is only for a flexmask Mask as batch: a {type(batch).__name__} "
            f"brings its own position_ids"
        )
    if isinstance(batch, PackedBatch):
        return batch.mask, batch.position_ids, batch.num_rows, batch.max_len
    if isinstance(batch, TreeBatch):
        return batch.mask, batch.position_ids, batch.num_rows, batch.max_tokens
    if isinstance(batch, TreePack):
        return batch.mask, batch.position_ids[None], 1, batch.length
    if isinstance(batch, Mask):
        batch_size, seq_len = _check_shape(shape)
        if position_ids is not None:
            position_ids = _check_positions(position_ids, batch_size, seq_len)
        return batch, position_ids, batch_size, seq_len
    raise TypeError(
        f"batch must be a PackedBatch (flexmask.pack), a TreePack (pack_one_tree), a TreeBatch "
        f"(pack_tree_batch) or a flexmask Mask with shape=(B, S); got {type(batch).__name__}"
    )


def _size(value: Any, what: str, layer_type: str) -> int:
    """A window or chunk size: an int (numpy integers and 0-d tensors too) >= 1."""
    if value is None:
        raise ValueError(f"{layer_type} needs {what} >= 1, got None")
    try:
        return check_int(value, what, minimum=1)
    except ValueError as err:
        raise ValueError(f"{layer_type} needs {what} >= 1: {err}") from None


def layer_mask(
    layer_type: str,
    base: Mask,
    positions: Tensor | None,
    *,
    sliding: int | None = None,
    chunk: int | None = None,
) -> Mask:
    """The mask of one layer type: ``base`` restricted to a window or a chunk of positions.

    Args:
        layer_type: ``"full_attention"``, ``"sliding_attention"`` or ``"chunked_attention"``.
        base: the batch's mask (``causal() & document(...)``, ``tree(...)``, ...).
        positions: ``(B, S)`` position of every token (restarting per document, depth in a
            tree, counted from the first real token under left padding), or ``None`` when
            positions are the offsets ``0..S-1`` themselves. The mask keeps its own copy.
        sliding: the window, for ``"sliding_attention"``: q attends kv only when
            ``position[q] - position[kv] < sliding`` — one-sided, as transformers'
            ``sliding_window_overlay``: keys after the query that ``base`` lets it see (a
            bidirectional image) stay visible. An int >= 1 (numpy integers too).
        chunk: the chunk size, for ``"chunked_attention"``: q attends kv only when
            ``position[q] // chunk == position[kv] // chunk``. An int >= 1.

    Example:
        >>> import flexmask
        >>> from flexmask.integrations.transformers import layer_mask
        >>> m = layer_mask("sliding_attention", flexmask.causal(), None, sliding=2)
        >>> m.to_dense(1, 1, 3, 3)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    if layer_type == "full_attention":
        return base
    # The caller's position_ids may change after the mask is made (a reused buffer, an
    # in-place op): the mask's piece keeps its own copy (PositionWindow), so none here.
    pos = None if positions is None else positions.detach()
    if layer_type == "sliding_attention":
        window = _size(sliding, "a window (config.sliding_window)", layer_type)
        if pos is None:
            # q - kv < window, one-sided as in transformers' sliding_window_overlay: keys
            # after the query (a bidirectional image, an encoder prefix) stay visible
            # whatever their distance; sliding_window(window) alone would cut them at it.
            return base & (pieces.sliding_window(window) | ~pieces.causal())
        # position[q] - position[kv] < window, one-sided likewise, from the positions'
        # structure (each tile's runs of positions): a mask_mod alone would be evaluated on
        # every tile the base leaves open. Windows are differences: positions below 0 (left
        # padding counted from the first real token) are shifted, which changes none.
        least = int(pos.min()) if pos.numel() else 0
        shifted = pos - least if least < 0 else pos
        return base & pieces.PositionWindow(window, shifted, keys_ahead=True)
    if layer_type == "chunked_attention":
        chunk_size = _size(chunk, "a chunk size (config.attention_chunk_size)", layer_type)
        if pos is None:
            return base & pieces.chunked(chunk_size)
        # Same chunk: chunk ids (position // chunk, floored as torch's // is) less than 1
        # apart, a window of 1 over them; ids step by 0 or 1 where positions step by 1, so
        # the window's tiles read their runs as for positions. Shifted to start at 0.
        ids = torch.div(pos, chunk_size, rounding_mode="floor")
        least = int(ids.min()) if ids.numel() else 0
        return base & pieces.PositionWindow(1, ids - least if least < 0 else ids)
    raise ValueError(
        f"layer_type must be one of {', '.join(map(repr, LAYER_TYPES))}; got {layer_type!r}"
    )


def _packed_layer_mask(
    layer_type: str, batch: PackedBatch, *, sliding: int | None, chunk: int | None
) -> Mask:
    """``layer_mask`` of a PackedBatch, in closed forms. Its positions count from the start of
    each document, which its mask (``causal() & document(seq_lens)``) never crosses: a
    window of positions is there a window of offsets, and a chunk of positions a piece of a
    document cut every ``chunk`` tokens from its start — a document of its own."""
    if layer_type == "sliding_attention":
        return layer_mask(layer_type, batch.mask, None, sliding=sliding)
    if layer_type == "chunked_attention":
        size = _size(chunk, "a chunk size (config.attention_chunk_size)", layer_type)
        pieces_of = [
            [min(size, n - start) for n in row for start in range(0, n, size)]
            for row in batch.seq_lens
        ]
        return pieces.causal() & pieces.document(pieces_of)
    return layer_mask(layer_type, batch.mask, batch.position_ids)


def attention_masks(
    config: Any,
    batch: Any,
    *,
    implementation: str | None = None,
    shape: tuple[int, int] | None = None,
    position_ids: Tensor | None = None,
    block_size: int = 128,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """What to pass as a transformers model's ``attention_mask`` for a packed batch.

    Args:
        config: the model's config (``model.config``); its ``layer_types``,
            ``sliding_window`` and ``attention_chunk_size`` are read, and its
            ``_attn_implementation`` unless ``implementation`` is given.
        batch: a :class:`~flexmask.packing.PackedBatch`, :class:`~flexmask.packing.TreePack`,
            :class:`~flexmask.packing.TreeBatch`, or a flexmask ``Mask`` together with ``shape``.
        implementation: ``"flex_attention"``, ``"flexmask"`` (see :func:`register`),
            ``"sdpa"`` or ``"eager"``.
        shape: ``(B, S)``, only with a ``Mask`` as ``batch``.
        position_ids: ``(B, S)`` integer positions, only with a ``Mask`` as ``batch`` (a
            packed batch brings its own): the ``position_ids`` given to the model. Windows
            and chunks count them; without them they count offsets ``0..S-1``. Pass them for
            a left-padded batch (``attention_mask.cumsum(-1) - 1``, as ``generate`` does), so
            that chunks start at each row's first real token, as transformers' own chunked
            mask starts them.
        block_size: the BlockMask's block size (flex paths).
        device: where the mask is built (default: flexmask's default device).
        dtype: the float dtype of eager's additive mask (the model's dtype).

    Returns:
        One mask when every layer is ``"full_attention"`` (models such as Llama take only
        that), else ``{layer_type: mask}`` for every layer type the model has, which
        transformers hands to each layer by its type. Dense masks let a query with nothing
        to attend (padding) attend to itself, so sdpa and eager stay finite there. A hybrid
        model's recurrent kinds (``"linear_attention"``, ``"conv"``) get None, the 2-D
        padding mask transformers gives an unpadded batch: their boundaries are keyword
        arguments (:func:`model_inputs` adds them; see ``transformers_layers``).

    Example:
        >>> from transformers import Qwen2Config
        >>> from flexmask.packing import pack
        >>> from flexmask.integrations.transformers import attention_masks
        >>> config = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=2,
        ...                      max_window_layers=1)
        >>> masks = attention_masks(config, pack([[1, 2, 3], [4, 5]], 5), implementation="sdpa")
        >>> sorted(masks), masks["sliding_attention"][0, 0].int().tolist()[2]
        (['full_attention', 'sliding_attention'], [0, 1, 1, 0, 0])
    """
    text = _text_config(config)
    kind = implementation or getattr(config, "_attn_implementation", None) or "sdpa"
    if kind in FLASH_IMPLEMENTATIONS:
        raise ValueError(
            f"implementation {kind!r} takes no attention_mask for a packed batch: pass "
            f"flash_kwargs(batch) to the model instead (model_inputs does)"
        )
    if kind not in ("flex_attention", "flexmask", "sdpa", "eager"):
        raise ValueError(
            f"implementation must be 'flex_attention', 'flexmask', 'sdpa' or 'eager', got {kind!r}"
        )
    base, positions, batch_size, seq_len = _batch_parts(batch, shape, position_ids)
    layer_types = mask_kinds(config)
    masks: dict[str, Any] = {}
    for layer_type in layer_types:
        if layer_type in RECURRENT_KINDS:
            masks[layer_type] = None
            continue
        sliding = getattr(text, "sliding_window", None)
        chunk = getattr(text, "attention_chunk_size", None)
        if isinstance(batch, PackedBatch):
            mask = _packed_layer_mask(layer_type, batch, sliding=sliding, chunk=chunk)
        else:
            mask = layer_mask(layer_type, base, positions, sliding=sliding, chunk=chunk)
        masks[layer_type] = _materialise(mask, kind, batch_size, seq_len, block_size, device, dtype)
    if layer_types == ("full_attention",):
        return masks["full_attention"]
    return masks


def _materialise(
    mask: Mask,
    kind: str,
    batch_size: int,
    seq_len: int,
    block_size: int,
    device: torch.device | str | None,
    dtype: torch.dtype,
) -> BlockMask | Tensor:
    if kind in ("flex_attention", "flexmask"):
        # flexmask's own cache keys BlockMasks on the mask's content.
        return create_block_mask(
            mask, batch_size, 1, seq_len, seq_len, device=device, BLOCK_SIZE=block_size
        )
    key = (mask, batch_size, seq_len, kind, dtype, str(device))
    cached = _DENSE_CACHE.get(key)
    if cached is not None:
        return cached
    dense = mask.to_dense(batch_size, 1, seq_len, seq_len)
    if device is not None:
        dense = dense.to(device)
    # A query that attends nothing (padding) would give NaN in sdpa and eager, and NaN values
    # poison every later layer through 0 * NaN: let it attend to itself instead.
    lonely = ~dense.any(-1, keepdim=True)
    dense = dense | (lonely & torch.eye(seq_len, dtype=torch.bool, device=dense.device))
    if kind == "eager":
        zero = torch.zeros((), dtype=dtype, device=dense.device)
        dense = torch.where(dense, zero, torch.finfo(dtype).min)
    _DENSE_CACHE[key] = dense
    return dense


def model_inputs(
    model: Any, batch: Any, *, check: bool | None = None, labels: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """Everything every layer of ``model`` reads from a packed batch, for ``model(**inputs)``.

    ``input_ids``, ``position_ids`` (restarting per document), the attention layers'
    ``attention_mask`` (:func:`attention_masks`) or on flash their ``cu_seq_lens_q/k`` and
    ``max_length_q/k``; and for recurrent or convolution layers (``layer_types`` with
    ``"linear_attention"``, ``"conv"``, ``"hybrid"``) the boundaries they read by
    transformers' names, ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx``
    (``transformers_layers.boundary_kwargs``; docs/hybrid.md). Where their kernels cannot
    take them (on the CPU transformers refuses them), ``flexmask.integrations.hybrid.
    keep_documents_apart(model)`` runs those layers per document from the same arguments.

    Args:
        model: a transformers model; its config picks the implementation and layer types.
        batch: a :class:`~flexmask.packing.PackedBatch`, :class:`~flexmask.packing.TreePack` or
            :class:`~flexmask.packing.TreeBatch` (a tree only for a model of attention layers
            alone: a recurrent layer has no way to read a tree).
        check: run :func:`flexmask.check_batch` on the result (the batch, each layer type's
            mask as that layer restricts the batch's, the boundaries) and raise ValueError at
            a disagreement; None: FLEXMASK_CHECK=1. ``transformers_check.check_inputs`` also
            asks transformers which masks it builds.
        labels: also give ``labels`` as transformers takes them (it shifts them): -100 at
            every document's first token (``transformers_layers.causal_lm_labels``).
        **kwargs: passed to :func:`attention_masks` (``device=`` also places the boundaries).

    Example:
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> from flexmask.packing import pack
        >>> from flexmask.integrations.transformers import model_inputs
        >>> config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=1, num_attention_heads=2)
        >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        >>> inputs = model_inputs(model, pack([[1, 2, 3], [4, 5]], max_len=5))
        >>> model(**inputs).logits.shape
        torch.Size([1, 5, 16])
    """
    kind = kwargs.get("implementation") or getattr(model.config, "_attn_implementation", None)
    recurrent = any(k in RECURRENT_KINDS for k in layer_kinds(model.config))
    if (kind in FLASH_IMPLEMENTATIONS or recurrent or labels) and not isinstance(
        batch, PackedBatch
    ):
        raise TypeError(
            f"model_inputs takes a PackedBatch for flash attention, labels or recurrent layers "
            f"(which cannot read a tree), got {type(batch).__name__}"
        )
    if isinstance(batch, TreePack):
        inputs = {"input_ids": batch.tokens[None], "position_ids": batch.position_ids[None]}
    elif isinstance(batch, (PackedBatch, TreeBatch)):
        inputs = {"input_ids": batch.tokens, "position_ids": batch.position_ids}
    else:
        raise TypeError(
            f"batch must be a PackedBatch, TreePack or TreeBatch, got {type(batch).__name__}"
        )
    if kind not in FLASH_IMPLEMENTATIONS:
        inputs["attention_mask"] = attention_masks(model.config, batch, **kwargs)
    elif set(kwargs) - {"implementation", "device"}:
        raise TypeError(f"for {kind}, model_inputs takes device= only, got {sorted(kwargs)}")
    if kind in FLASH_IMPLEMENTATIONS or recurrent:
        flash = flash_kwargs(batch, device=kwargs.get("device"))
        inputs.update(flash if not recurrent else boundary_kwargs(flash, batch.tokens.shape))
    if labels:
        inputs["labels"] = causal_lm_labels(batch.labels)
    return _checked(model, inputs, batch, check)


def _checked(model: Any, inputs: dict[str, Any], batch: Any, check: bool | None) -> dict[str, Any]:
    """With ``check``, :func:`flexmask.check_batch` on what ``model_inputs`` made: the batch,
    each layer type's mask against the batch's mask restricted as the layer is, and the
    boundaries the recurrent layers read."""
    if not check_enabled(check):
        return inputs
    kind = getattr(model.config, "_attn_implementation", None)
    masks = inputs.get("attention_mask")
    if kind in FLASH_IMPLEMENTATIONS or not isinstance(masks, dict):
        masks = dict.fromkeys(layer_kinds(model.config), masks)
    text = _text_config(model.config)
    for layer_type, built in masks.items():
        if layer_type in RECURRENT_KINDS:
            continue  # no mask: their boundaries are checked below
        expected = layer_mask(
            layer_type,
            batch.mask,
            inputs["position_ids"],
            sliding=getattr(text, "sliding_window", None),
            chunk=getattr(text, "attention_chunk_size", None),
        )
        kernel = {"attention_mask": built} if built is not None else {}
        if kind in FLASH_IMPLEMENTATIONS and "cu_seq_lens_q" in inputs:
            kernel = {"cu_seqlens": inputs["cu_seq_lens_q"], "causal_kernel": True}
        check_batch(batch=batch, mask=expected, raise_on_error=True, **kernel)
    if "seq_idx" in inputs or "labels" in inputs:
        check_batch(
            batch=batch,
            seq_idx=inputs.get("seq_idx"),
            cu_seq_lens_q=inputs.get("cu_seq_lens_q"),
            cu_seq_lens_k=inputs.get("cu_seq_lens_k"),
            labels=inputs.get("labels"),
            labels_shifted=False if "labels" in inputs else None,
            raise_on_error=True,
        )
    return inputs


def flash_kwargs(
    batch: Any,
    *,
    shape: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """``cu_seq_lens_q/k`` and ``max_length_q/k`` for transformers' flash-attention path.

    transformers' ``flash_attention_2`` (and ``_3``) flattens a ``(B, S)`` batch to ``B * S``
    tokens and, given these kwargs and no ``attention_mask``, runs
    ``flash_attn_varlen_func`` over them: each document one sequence, causal as the model
    is, with the layer's own sliding window. They come from ``flexmask.formats.to_varlen``
    of the batch's mask, which lowers exactly or refuses (a tree, a prefix, a union):
    every document is one sequence; a token in no document (padding) is a sequence of its
    own, so it attends to itself — finite, as the dense masks of :func:`attention_masks`
    make it, and masked out of the loss by its label. These are the values transformers'
    own ``prepare_fa_kwargs_from_position_ids`` derives from a packed batch's positions.

    Args:
        batch: a :class:`~flexmask.packing.PackedBatch`, or a flexmask ``Mask`` with ``shape``
            ``(B, S)`` (causal, documents, padding: what ``to_varlen`` takes).
        device: where the ``cu_seq_lens`` tensors live.

    Raises:
        ValueError: the mask is not causal, or brings a window of its own (transformers takes
            both from the model's config), or ``to_varlen`` refuses it (its reason).

    Example:
        >>> from flexmask.packing import pack
        >>> from flexmask.integrations.transformers import flash_kwargs
        >>> kwargs = flash_kwargs(pack([[1, 2, 3], [4, 5]], max_len=6))
        >>> kwargs["cu_seq_lens_q"].tolist(), kwargs["max_length_q"]  # tail: padding
        ([0, 3, 5, 6], 3)
    """
    if isinstance(batch, PackedBatch):
        mask, batch_size, seq_len = batch.mask, batch.num_rows, batch.max_len
    elif isinstance(batch, Mask):
        mask = batch
        batch_size, seq_len = _check_shape(shape)
    else:
        raise TypeError(
            f"batch must be a PackedBatch (flexmask.pack) or a flexmask Mask with shape=(B, S); "
            f"got {type(batch).__name__} (trees need a mask kernel: attention_masks)"
        )
    lowered = to_varlen(mask, batch_size, 1, seq_len, seq_len)
    if not lowered.causal or lowered.window_size != (-1, -1):
        raise ValueError(
            f"{mask!r} lowers to causal={lowered.causal}, window_size={lowered.window_size}, "
            f"but transformers' flash path takes causal and the window from the model's "
            f"config: give a causal mask without sliding_window (the config's sliding_window "
            f"applies per layer)"
        )
    cu_q, cu_k = lowered.cu_seqlens_q.tolist(), lowered.cu_seqlens_k.tolist()
    q_index, k_index = lowered.q_index.tolist(), lowered.k_index.tolist()
    starts: list[int] = []
    for i in range(lowered.num_sequences):
        first, last = q_index[cu_q[i]], q_index[cu_q[i + 1] - 1]
        rows = q_index[cu_q[i] : cu_q[i + 1]]
        if rows != k_index[cu_k[i] : cu_k[i + 1]] or rows != list(range(first, last + 1)):
            raise ValueError(
                f"{mask!r}: sequence {i} is not one run of tokens with its own keys, which "
                f"transformers' flattened layout needs"
            )
        starts.append(first)
    # Every token not in a document becomes a sequence of one: the flattened layout must
    # cover every token, or the kernel leaves its output unwritten.
    covered = set(q_index)
    starts += [t for t in range(batch_size * seq_len) if t not in covered]
    cu = torch.tensor(sorted(starts) + [batch_size * seq_len], dtype=torch.int32)
    cu = cu.to(check_device(device, None))
    longest = int(cu.diff().max()) if cu.numel() > 1 else 0
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def flexmask_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: BlockMask | LazyBlockMask | Mask | Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A transformers attention function running ``flexmask.flex_attention``.

    With a BlockMask (or a lazy handle, or a flexmask Mask) it runs flexmask's path, which
    trains on the CPU. With no mask (a reference run, or ``generate`` without padding) it is
    causal, with the layer's ``sliding_window`` when it has one, and aligned to the end of
    the keys when a KV cache makes them longer than the queries. A dense mask (what
    transformers builds for this implementation when none was passed) goes to sdpa.
    """
    if dropout:
        raise ValueError(f"flexmask_attention has no dropout; got dropout={dropout}")
    enable_gqa = query.shape[1] != key.shape[1]
    q_len, kv_len = query.shape[2], key.shape[2]
    score_mod = None
    if softcap:
        cap = float(softcap)

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return cap * torch.tanh(score / cap)

    if attention_mask is None and q_len == kv_len:
        attention_mask = pieces.causal()
        if sliding_window:
            attention_mask = attention_mask & pieces.sliding_window(sliding_window)
    if isinstance(attention_mask, (BlockMask, LazyBlockMask, Mask)):
        out = flex_attention(
            query,
            key,
            value,
            block_mask=attention_mask,
            score_mod=score_mod,
            scale=scaling,
            enable_gqa=enable_gqa,
        )
        if not isinstance(out, Tensor):  # return_lse is off: flex_attention gives the output
            raise RuntimeError(f"flex_attention returned {type(out).__name__}, not a tensor")
        return out.transpose(1, 2).contiguous(), None
    if softcap:
        raise ValueError("flexmask_attention applies softcap only with a BlockMask or no mask")
    if attention_mask is None:  # decoding with a cache: the queries are the last q_len keys
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        kv_pos = torch.arange(kv_len, device=query.device)[None, :]
        attention_mask = kv_pos <= q_pos
        if sliding_window:
            attention_mask &= q_pos - kv_pos < sliding_window
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask[..., :kv_len],
        scale=scaling,
        enable_gqa=enable_gqa,
    )
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "flexmask") -> str:
    """Registers :func:`flexmask_attention` with transformers under ``name``.

    The mask function registered with it is transformers' sdpa one, so a model loaded with
    ``attn_implementation=name`` still gets its padding, sliding and chunked masks built by
    transformers when no prepared mask is passed (e.g. in ``generate``).

    Example:
        >>> from flexmask.integrations.transformers import register
        >>> register()
        'flexmask'
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, flexmask_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
