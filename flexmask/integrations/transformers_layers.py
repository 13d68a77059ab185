"""What each layer kind of a transformers model reads from a packed batch.

transformers 5.x lists every decoder layer's kind in ``config.layer_types`` (older names,
``"mamba"`` and ``"attention"``, are remapped as transformers remaps them):

* attention kinds — ``"full_attention"``, ``"sliding_attention"``, ``"chunked_attention"`` —
  read the ``attention_mask`` (a BlockMask, a 4-D mask) or, on the flash implementations,
  ``cu_seq_lens_q/k`` and ``max_length_q/k``;
* recurrent kinds — ``"linear_attention"`` (Gated DeltaNet, Kimi Delta Attention, Mamba-1 and
  Mamba-2, MiniMax's lightning attention) and ``"conv"`` (LFM2's short convolutions) — get a
  2-D padding mask (or None) as their ``attention_mask``, and the document boundaries only
  through the forward's keyword arguments, by transformers' names: ``seq_idx`` (``(B, S)``
  int32, the index of each token's sequence: causal_conv1d's and mamba_ssm's argument) and
  ``cu_seq_lens_q`` (``(N + 1,)`` int32 offsets over the ``B * S`` tokens laid end to end,
  which the Gated DeltaNet layers hand to fla's delta rule as ``cu_seqlens``);
* ``"hybrid"`` and ``"hybrid_sliding"`` layers (Falcon-H1, Zamba, Zamba2) hold both: an
  attention and a recurrent mixer side by side; ``"moe"`` and ``"mlp"`` layers mix nothing.

Without the boundaries, a recurrent layer runs a packed row as one sequence: each document's
state flows into the next. :func:`boundary_kwargs` makes them from the varlen partition that
``flash_kwargs`` lowers the batch's mask to (every document one sequence, every padding
token one of its own), so attention, recurrent and convolution layers see one partition.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ATTENTION_KINDS",
    "BOUNDARY_NAMES",
    "RECURRENT_KINDS",
    "boundary_kwargs",
    "causal_lm_labels",
    "layer_kinds",
    "mask_kinds",
    "unkept_layers",
]

ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
"""Layer kinds that read an attention mask."""

RECURRENT_KINDS = ("linear_attention", "conv")
"""Layer kinds that read the document boundaries from the forward's keyword arguments."""

BOUNDARY_NAMES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""The keyword arguments that carry a packed batch's boundaries, by transformers' names."""

# A layer of two mixers side by side reads both kinds' arguments.
_PARTS = {
    "hybrid": ("full_attention", "linear_attention"),
    "hybrid_sliding": ("sliding_attention", "linear_attention"),
}
# transformers' _LEGACY_LAYER_TYPE_REMAP (configuration_utils): Jamba's layers_block_type
# still says "mamba" / "attention".
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
# Layers that mix no tokens (Nemotron-H's MoE and MLP blocks): nothing to hand them.
_NO_MIXER = ("moe", "mlp", "dense", "sparse")


def _text_config(config: Any) -> Any:
    # Multimodal configs keep the decoder's settings in a text config.
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def layer_kinds(config: Any) -> tuple[str, ...]:
    """The kinds of mixer a model's layers hold, each once, in the order of its layers.

    ``"hybrid"`` layers count as their two mixers; layers that mix no tokens are left out;
    a config without ``layer_types`` is all ``"full_attention"``.

    Args:
        config: a transformers config (or a model's ``config``).

    Example:
        >>> from transformers import FalconH1Config, Qwen3NextConfig
        >>> from flexmask.integrations.transformers_layers import layer_kinds
        >>> layer_kinds(Qwen3NextConfig(num_hidden_layers=4))
        ('linear_attention', 'full_attention')
        >>> layer_kinds(FalconH1Config(num_hidden_layers=2))
        ('full_attention', 'linear_attention')
    """
    text = _text_config(config)
    listed = getattr(text, "layer_types", None) or ["full_attention"]
    kinds: dict[str, None] = {}
    for raw in listed:
        kind = _LEGACY.get(raw, raw)
        for part in _PARTS.get(kind, (kind,)):
            if part not in _NO_MIXER:
                kinds[part] = None
    return tuple(kinds)


def mask_kinds(config: Any) -> tuple[str, ...]:
    """The keys a model reads from a prepared ``attention_mask`` dict.

    Every layer kind, and, where any layer is recurrent, both ``"full_attention"`` and
    ``"linear_attention"``: Falcon-H1 and Zamba read those two by name whatever their
    ``layer_types`` say, and a model that finds a key missing raises KeyError.

    Example:
        >>> from transformers import Lfm2Config
        >>> from flexmask.integrations.transformers_layers import mask_kinds
        >>> mask_kinds(Lfm2Config(num_hidden_layers=2, layer_types=["conv", "full_attention"]))
        ('conv', 'full_attention', 'linear_attention')
    """
    kinds = layer_kinds(config)
    if any(k in RECURRENT_KINDS for k in kinds):
        kinds += tuple(k for k in ("full_attention", "linear_attention") if k not in kinds)
    return kinds


def boundary_kwargs(flash: dict[str, Any], shape: tuple[int, int]) -> dict[str, Any]:
    """The packing arguments of every layer kind, from ``flash_kwargs``' partition.

    Args:
        flash: ``cu_seq_lens_q/k`` and ``max_length_q/k`` over the ``B * S`` tokens end to
            end (what ``flexmask.integrations.transformers.flash_kwargs`` returns).
        shape: ``(B, S)`` of the batch.

    Returns:
        ``flash`` and ``seq_idx``: ``(B, S)`` int32, token ``t``'s sequence in that partition
        (counted across rows, so no two rows share one), on ``cu_seq_lens_q``'s device — as
        ``DataCollatorWithFlattening(return_seq_idx=True)`` numbers them.

    Example:
        >>> import torch
        >>> from flexmask.integrations.transformers_layers import boundary_kwargs
        >>> cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
        >>> flash = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 3,
        ...          "max_length_k": 3}
        >>> boundary_kwargs(flash, (1, 6))["seq_idx"].tolist()
        [[0, 0, 0, 1, 1, 2]]
    """
    cu = flash["cu_seq_lens_q"]
    batch, seq_len = shape
    if int(cu[-1]) != batch * seq_len:
        raise ValueError(
            f"cu_seq_lens_q must end at B * S = {batch * seq_len} (the batch's tokens end to "
            f"end), got {int(cu[-1])}"
        )
    tokens = torch.arange(batch * seq_len, device=cu.device, dtype=cu.dtype)
    seq_idx = torch.searchsorted(cu[1:], tokens, right=True).to(torch.int32)
    return {**flash, "seq_idx": seq_idx.view(batch, seq_len)}


def causal_lm_labels(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """A packed batch's shifted labels in transformers' convention: not yet shifted.

    ``flexmask.pack`` writes ``labels[b, p]`` as the target of the logit at ``p`` (the
    next token, ``ignore_index`` at each document's last token). transformers' causal-LM
    loss shifts its ``labels`` itself (the logit at ``p`` against ``labels[b, p + 1]``, per
    row), so it is given them one token later: ``ignore_index`` at every document's first
    token — what ``DataCollatorWithFlattening`` writes there — and no target ever crosses
    a document boundary.

    Args:
        labels: ``(B, S)`` shifted labels (``PackedBatch.labels``).
        ignore_index: the value the loss skips.

    Example:
        >>> from flexmask.packing import pack
        >>> from flexmask.integrations.transformers_layers import causal_lm_labels
        >>> batch = pack([[1, 2, 3], [4, 5]], max_len=6)
        >>> causal_lm_labels(batch.labels).tolist()
        [[-100, 2, 3, -100, 5, -100]]
    """
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise TypeError(f"labels must be a (B, S) tensor, got {labels!r:.80}")
    first = labels.new_full((labels.shape[0], 1), ignore_index)
    return torch.cat([first, labels[:, :-1]], 1)


# Mixers whose boundaries transformers 5.25 drops before any kernel reads them, though the
# class is in hybrid_mixers.MIXERS with the arguments its kernels would read: Kimi Delta
# Attention hands ``cu_seq_lens_q`` to fla's chunk_kda, which reads ``cu_seqlens`` and
# filters the other name out; Jamba's decoder layer calls its mixer without keyword
# arguments; Inkling's convolutions are called without them. tests/test_integrations_hybrid_
# args.py records what each architecture's kernels receive and holds this table to it.
_DROPPED = {
    "KimiLinearDeltaAttention": "fla's chunk_kda reads cu_seqlens, transformers hands it "
    "cu_seq_lens_q",
    "BailingHybridDeltaAttention": "fla's chunk_kda reads cu_seqlens, transformers hands it "
    "cu_seq_lens_q",
    # glm5_next's linear attention calls the same chunk_kimi_delta_attention (read from its
    # modeling file; no tiny config of it in the tests).
    "Glm5NextTextLinearAttention": "fla's chunk_kda reads cu_seqlens, transformers hands it "
    "cu_seq_lens_q",
    "JambaMambaMixer": "its decoder layer passes it no keyword arguments",
    "InklingShortConvolution": "its decoder layer passes it no keyword arguments",
}


def _fallback_on(module: Any) -> bool:
    # flexmask.integrations.hybrid.keep_documents_apart replaces the mixer's forward on the
    # instance with a function it defines: its qualified name says who installed it.
    forward = vars(module).get("forward")
    function = getattr(forward, "__func__", forward)
    return getattr(function, "__qualname__", "").startswith("keep_documents_apart.")


def unkept_layers(model: Any, inputs: dict[str, Any]) -> list[tuple[str, str]]:
    """The recurrent and convolution layers that will run packed documents as one sequence.

    For every mixer class of ``model`` in ``hybrid_mixers.MIXERS`` without
    ``keep_documents_apart`` installed: its kernels read no boundaries in transformers 5.25
    (Mamba-1's scan, lightning attention, Kimi Delta Attention, ...), or ``inputs`` lack one
    they read (``seq_idx``; ``cu_seq_lens_q`` too for the delta rule), or the delta rule is
    given several rows (fla's varlen kernels take one), or the kernel packages are absent or
    off CUDA, where transformers refuses the boundaries.

    Returns:
        ``(label, message)`` per layer kind and class: the label names the kind and class,
        the message what is missing and the one call that fixes it.
    """
    from flexmask.integrations.hybrid_mixers import MIXERS

    found: dict[str, tuple[str, str]] = {}
    ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    device = ids.device if isinstance(ids, Tensor) else torch.device("cpu")
    fix = "or flexmask.integrations.hybrid.keep_documents_apart(model)"
    for module in model.modules() if hasattr(model, "modules") else ():
        name = type(module).__name__
        row = MIXERS.get(name)
        if row is None or name in found or _fallback_on(module):
            continue
        kind = getattr(module, "layer_type", None) or "linear_attention"
        label = f"{kind} layers ({name})"
        missing = [n for n in row.native if inputs.get(n) is None]
        if name in _DROPPED or not row.native:
            why = _DROPPED.get(name, f"no kernel transformers calls for its {row.family} does")
            found[name] = (label, f"{label} never get document boundaries ({why}): {fix[3:]}")
        elif missing:
            found[name] = (
                label,
                f"{label} get no document boundaries: pass {'/'.join(row.native)} (model_inputs "
                f"does) {fix}",
            )
        elif "cu_seq_lens_q" in row.native and isinstance(ids, Tensor) and ids.shape[0] > 1:
            found[name] = (
                label,
                f"{label} are given cu_seq_lens_q over {ids.shape[0]} rows, but fla's varlen "
                f"delta rule takes one row (B = 1) and refuses more: pack into one row, {fix}",
            )
        elif device.type != "cuda" or any(
            importlib.util.find_spec(p) is None for p in row.packages
        ):
            found[name] = (
                label,
                f"{label} are given {'/'.join(row.native)}, but their kernels "
                f"({', '.join(row.packages)}) do not run here ({device.type}), and transformers' "
                f"torch path refuses them: {fix[3:]}",
            )
    return list(found.values())
