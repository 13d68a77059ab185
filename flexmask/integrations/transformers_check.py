"""Checks a transformers model's inputs: :func:`check_inputs` compares them with each other
and with the masks transformers itself builds from them for every layer type.

The model's forward decides more than its inputs say: with a cache, transformers 5.x does not
read packed sequences off ``position_ids``; a 0/1 ``attention_mask`` makes each row one
sequence; flash implementations read ``cu_seq_lens_*`` or the positions. So the check asks
transformers' own mask functions what each layer type will attend, and compares that with
the batch's mask, pair by pair (:func:`flexmask.check_batch`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask import pieces
from flexmask.algebra import Mask
from flexmask.integrations.transformers import FLASH_IMPLEMENTATIONS, _text_config, layer_mask
from flexmask.integrations.transformers_layers import RECURRENT_KINDS, layer_kinds, unkept_layers
from flexmask.packing import BatchReport, Disagreement, check_batch
from flexmask.runtime import LazyBlockMask, lazy

__all__ = ["check_inputs"]


def check_inputs(
    model: Any,
    inputs: dict[str, Any],
    *,
    batch: Any = None,
    mask: Mask | None = None,
    labels_shifted: bool | None = None,
    raise_on_error: bool = False,
) -> BatchReport:
    """:func:`flexmask.check_batch` for a transformers model's inputs, and for the masks
    transformers will build from them.

    ``inputs`` is what goes to ``model(**inputs)``: a flexmask batch's :func:`model_inputs`,
    or transformers' own ``DataCollatorWithFlattening`` output (``input_ids``,
    ``position_ids``, ``labels``, and ``cu_seq_lens_q/k`` or ``seq_idx`` when asked for).
    Besides comparing them with each other, the check asks transformers which mask each
    layer type will use — ``create_causal_mask`` (and the sliding and chunked ones) with the
    model's implementation, its ``attention_mask`` and its cache, as the model's forward
    calls them — and compares that with the batch's mask, token pair by token pair. So it
    sees what the model does with the inputs, not only what they say: in transformers 5.x a
    model with a cache (``use_cache`` not False) builds a plain causal mask from packed
    ``position_ids``, attending across the documents. On ``flash_attention_2/3`` the
    sequences come from ``cu_seq_lens_q`` (or the ``position_ids``) and run causal.

    A hybrid model's recurrent and convolution layers read no mask: on a packed row the
    check names each layer kind and class that will carry one document into the next —
    its boundaries (``seq_idx``, ``cu_seq_lens_q``) missing from ``inputs``, dropped by
    transformers before its kernel, or refused where the kernels do not run — unless
    ``flexmask.integrations.hybrid.keep_documents_apart`` is installed on it.

    Args:
        model: a transformers model (or its config).
        inputs: the keyword arguments of ``model(**inputs)``.
        batch: the flexmask batch the inputs came from (its mask and documents).
        mask: the mask the batch means (default: ``batch.mask``, else causal attention inside
            the documents the inputs describe).
        labels_shifted: as in :func:`flexmask.check_batch`; by default False when ``labels``
            are in ``inputs`` (the model shifts them).
        raise_on_error: raise ValueError at the first disagreement.

    Example:
        >>> import torch
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> from flexmask.integrations.transformers_check import check_inputs
        >>> config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=1, num_attention_heads=2)
        >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        >>> packed = {"input_ids": torch.tensor([[1, 2, 3, 4, 5]]),
        ...           "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
        >>> report = check_inputs(model, packed)           # config.use_cache is True
        >>> report.first.inputs, report.first.token
        (("transformers' sdpa mask (full_attention layers)", 'causal documents of position_ids'), 3)
        >>> check_inputs(model, {**packed, "use_cache": False}).ok
        True
    """
    config = _text_config(getattr(model, "config", model))
    kind = getattr(getattr(model, "config", model), "_attn_implementation", None) or "sdpa"
    ids = inputs.get("input_ids")
    positions = inputs.get("position_ids")
    attention = inputs.get("attention_mask")
    if labels_shifted is None and inputs.get("labels") is not None and batch is None:
        labels_shifted = False
    two_d = attention if isinstance(attention, Tensor) and attention.dim() == 2 else None
    embeds = inputs.get("inputs_embeds")
    first = check_batch(
        batch=batch,
        mask=mask,
        input_ids=ids,
        position_ids=positions,
        labels=inputs.get("labels"),
        seq_idx=inputs.get("seq_idx"),
        labels_shifted=labels_shifted,
        attention_mask=two_d,
        shape=(int(embeds.shape[0]), int(embeds.shape[1]))
        if ids is None and isinstance(embeds, Tensor)
        else None,
    )
    base = first.mask
    base_name = (
        "mask"
        if mask is not None
        else "batch.mask"
        if batch is not None
        else f"causal documents of {first.reference or 'the batch'}"
    )
    shape = _report_shape(ids, inputs, attention)
    disagreements = list(first.disagreements)
    checked = list(first.checked)
    if base is not None and kind in FLASH_IMPLEMENTATIONS:
        cu = inputs.get("cu_seq_lens_q")
        if cu is None and positions is not None and two_d is None:
            from transformers.modeling_flash_attention_utils import (
                prepare_fa_kwargs_from_position_ids,
            )

            (cu, _), _ = prepare_fa_kwargs_from_position_ids(positions)
        if cu is not None:
            found = check_batch(
                mask=base,
                shape=shape,
                cu_seqlens=cu,
                causal_kernel=True,
                max_seqlen=inputs.get("max_length_q"),
            )
            disagreements += _renamed(
                found, "cu_seqlens", f"transformers' {kind} sequences", base_name
            )
            checked.append(f"{kind} sequences")
    elif base is not None:
        for layer_type, built in _transformers_masks(model, config, kind, inputs, shape).items():
            expected = layer_mask(
                layer_type,
                base,
                None if positions is None else positions.expand(shape),
                sliding=getattr(config, "sliding_window", None),
                chunk=getattr(config, "attention_chunk_size", None),
            )
            label = f"transformers' {kind} mask ({layer_type} layers)"
            if built is None:  # sdpa's is_causal path: plain causal attention
                built = lazy(pieces.causal(), shape[0], 1, shape[1], shape[1])
            found = check_batch(mask=expected, shape=shape, block_mask=built)
            disagreements += _renamed(found, "block_mask", label, base_name)
            checked.append(label)
    unkept = _unkept(model, inputs, base_name)  # recurrent layers: no mask, boundaries
    report = BatchReport(
        tuple(sorted(disagreements + unkept, key=lambda d: (d.row, d.token))),
        tuple(checked + [d.inputs[0] for d in unkept]),
        first.reference,
        first.documents,
        base,
    )
    if raise_on_error:
        report.raise_if_failed()
    return report


def _unkept(model: Any, inputs: dict[str, Any], base_name: str) -> list[Disagreement]:
    """A packed row through a recurrent layer that reads no boundaries: the second
    document's first token is where the first one's state leaks in."""
    start = _second_document(inputs)
    if start is None or not hasattr(model, "modules"):
        return []
    return [
        Disagreement(start[0], start[1], (label, base_name), message)
        for label, message in unkept_layers(model, inputs)
    ]


def _second_document(inputs: dict[str, Any]) -> tuple[int, int] | None:
    """(row, token) of the first document that does not start a row, from ``position_ids``
    (a restart at 0) or ``seq_idx`` (a change); None when every row holds one."""
    positions, seq_idx = inputs.get("position_ids"), inputs.get("seq_idx")
    if isinstance(positions, Tensor) and positions.dim() in (1, 2):
        starts = positions.reshape(-1, positions.shape[-1])[:, 1:] == 0
    elif isinstance(seq_idx, Tensor) and seq_idx.dim() in (1, 2):
        rows = seq_idx.reshape(-1, seq_idx.shape[-1])
        starts = rows[:, 1:] != rows[:, :-1]
    else:
        return None
    found = starts.nonzero()
    return None if not len(found) else (int(found[0, 0]), int(found[0, 1]) + 1)


def _report_shape(ids: Any, inputs: dict[str, Any], attention: Any) -> tuple[int, int]:
    for value in (ids, inputs.get("inputs_embeds"), inputs.get("position_ids"), attention):
        if isinstance(value, Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    raise TypeError("inputs need input_ids or inputs_embeds")


def _transformers_masks(
    model: Any, config: Any, kind: str, inputs: dict[str, Any], shape: tuple[int, int]
) -> dict[str, Any]:
    """What transformers hands each layer type for these inputs (None: no mask, causal)."""
    from transformers import masking_utils

    attention = inputs.get("attention_mask")
    layer_types = list(layer_kinds(config))
    if isinstance(attention, dict):  # prepared per layer type: used as given
        return {t: attention[t] for t in layer_types if t in attention and t not in RECURRENT_KINDS}
    if isinstance(attention, (BlockMask, LazyBlockMask)) or (
        isinstance(attention, Tensor) and attention.dim() == 4
    ):
        return dict.fromkeys(layer_types, attention)
    use_cache = inputs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(config, "use_cache", False)
    cache = inputs.get("cache", inputs.get("past_key_values"))
    if cache is None and use_cache:
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
    full = getattr(model, "config", model)
    embeds = torch.zeros(*shape, 1, dtype=getattr(full, "dtype", None) or torch.float32)
    makers = {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        "chunked_attention": masking_utils.create_chunked_causal_mask,
    }
    return {
        t: makers[t](full, embeds, attention, cache, inputs.get("position_ids"))
        for t in layer_types
        if t in makers
    }


def _renamed(report: BatchReport, name: str, label: str, mask_name: str) -> list[Any]:
    """The disagreements of a check of one kernel argument, under the names the user knows."""
    names = {name: label, "mask": mask_name}
    return [
        d._replace(
            inputs=tuple(names.get(i, i) for i in d.inputs),
            message=d.message.replace(name, label, 1).replace("; mask ", f"; {mask_name} "),
        )
        for d in report.disagreements
    ]
