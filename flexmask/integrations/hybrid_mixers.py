"""The sequence-mixing layers of transformers' hybrid models, and how to run each per document.

One row per mixer *class* (matched by name, so that flexmask never imports transformers'
model files): which of the mixer's arguments are per-token and are cut with the document,
which arguments a per-document call sets, which argument carries state across calls (a
cache, which a packed row cannot continue), and the kernel packages and arguments through
which the layer takes the boundaries itself on CUDA. Read from transformers 5.25's modeling
files; a model family that reuses a class (``qwen3_5_moe`` and ``qwen3_5``'s Gated DeltaNet
layer have different names, but the same row) gets one more name, not one more row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["MIXERS", "MixerCall", "looks_recurrent"]


@dataclasses.dataclass(frozen=True)
class MixerCall:
    """How to run one mixer class on one document.

    The per-document call is ``forward(hidden[:, start:end], **sliced, **fixed)``: the first
    argument (the hidden states, ``(B, S, D)``) and every argument named in ``sliced`` cut to
    the document's tokens (a tensor on its dim 1, or each tensor of a tuple), ``fixed`` set,
    and nothing else — no cache, no attention mask, no packing arguments.

    Attributes:
        family: what the layer is (for messages and docs).
        sliced: per-token arguments besides the hidden states.
        fixed: arguments every per-document call sets.
        state: arguments that carry state from one call to the next (a cache): given
            (not None, not False) on a packed row, the fallback refuses.
        packages: the kernel packages the layer needs to take the boundaries itself.
        native: the call's arguments through which it takes them (all must be given); empty:
            this layer never keeps packed documents apart by itself.
        one_row: its kernel takes the boundaries for one row only (fla's varlen delta
            rule): with several rows, per document.
    """

    family: str
    sliced: tuple[str, ...] = ()
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    state: tuple[str, ...] = ("cache",)
    packages: tuple[str, ...] = ()
    native: tuple[str, ...] = ()
    one_row: bool = False


# Mamba-2 (SSD) and short convolutions hand ``seq_idx`` to mamba_ssm's chunk scan and to
# causal_conv1d_fn; the Gated DeltaNet family hands ``cu_seq_lens_q`` to fla's chunked delta
# rule (as ``cu_seqlens``, one row) and ``seq_idx`` to its convolution. Kimi Delta Attention
# is handed ``cu_seq_lens_q`` where fla's chunk_kda reads ``cu_seqlens`` (glm5_next's and
# bailing_hybrid's linear attention make the same call); Mamba-1's selective scan, the
# lightning attention and the RG-LRU take no boundaries in any kernel transformers calls.
_MAMBA2 = MixerCall("Mamba-2", packages=("mamba_ssm", "causal_conv1d"), native=("seq_idx",))
_MAMBA1 = MixerCall("Mamba-1")
_DELTA = MixerCall(
    "gated delta rule",
    packages=("fla", "causal_conv1d"),
    native=("cu_seq_lens_q", "seq_idx"),
    one_row=True,
)
_KDA = MixerCall("Kimi delta attention")
_CONV = MixerCall("short convolution", packages=("causal_conv1d",), native=("seq_idx",))

MIXERS: dict[str, MixerCall] = {
    # Gated DeltaNet: qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid, lara_mini, qwen4_exp.
    "Qwen3NextGatedDeltaNet": _DELTA,
    "Qwen3_5GatedDeltaNet": _DELTA,
    "Qwen3_5MoeGatedDeltaNet": _DELTA,
    "OlmoHybridGatedDeltaNet": _DELTA,
    "LaraMiniGatedDeltaNet": _DELTA,
    "Qwen4ExpTextGatedDeltaNet": _DELTA,
    # Kimi Delta Attention: kimi_linear, glm5_next, bailing_hybrid.
    "KimiLinearDeltaAttention": _KDA,
    "Glm5NextTextLinearAttention": _KDA,
    "BailingHybridDeltaAttention": _KDA,
    # Mamba-2: falcon_h1, bamba, granitemoehybrid, nemotron_h, zamba2.
    "FalconH1Mixer": _MAMBA2,
    "BambaMixer": _MAMBA2,
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
    # Mamba-1: jamba, zamba.
    "JambaMambaMixer": _MAMBA1,
    "ZambaMambaMixer": _MAMBA1,
    # Short gated convolutions: lfm2, lfm2_moe, lfm3; inkling's around attention and MLP.
    "Lfm2ShortConv": _CONV,
    "Lfm2MoeShortConv": _CONV,
    "Lfm3ShortConv": _CONV,
    "InklingShortConvolution": _CONV,
    # inkling2's convolutions read a per-token dynamic input and a cache offset (0 alone).
    "Inkling2ShortConvolution": dataclasses.replace(_CONV, sliced=("dynamic_input",)),
    "Inkling2DynamicShortConvolution": dataclasses.replace(_CONV, sliced=("dynamic_input",)),
    "Inkling2LoopShortConvolution": dataclasses.replace(_CONV, sliced=("dynamic_input",)),
    "Inkling2LoopDynamicShortConvolution": dataclasses.replace(_CONV, sliced=("dynamic_input",)),
    # MiniMax's lightning attention takes the rotary tables (cut with the document).
    "MiniMaxLightningAttention": MixerCall(
        "lightning attention", sliced=("position_embeddings",), fixed={"attention_mask": None}
    ),
    # recurrent_gemma: Griffin's block (a convolution, then the RG-LRU, which resets at
    # position 0 but the convolution does not); its cache lives in the module (use_cache).
    "RecurrentGemmaRecurrentBlock": MixerCall(
        "RG-LRU",
        sliced=("position_ids",),
        fixed={"attention_mask": None, "use_cache": False},
        state=("use_cache",),
    ),
}
"""Mixer class name -> how to run it per document."""

# The parameters a state-space or recurrent layer holds (a decay A_log, a time step dt_bias),
# a depthwise Conv1d over tokens, or a state kept on the module between calls: run over a
# packed row, such a layer carries one document into the next.
_STATE_PARAMETERS = ("A_log", "dt_bias")
_STATE_ATTRIBUTES = ("conv1d_state", "recurrent_states", "conv_state", "ssm_state")


def looks_recurrent(module: Any) -> str | None:
    """Why a module not in :data:`MIXERS` looks like a mixer with recurrent or convolution
    state, or None. Read from its own parameters and children (not its name: a class called
    ``...LinearAttention`` may be softmax attention, Kimi's MLA is)."""
    if type(module).__name__ in MIXERS:
        return None
    direct = dict(module.named_parameters(recurse=False))
    held = [p for p in _STATE_PARAMETERS if p in direct]
    if held:
        return f"it holds {', '.join(held)} (a state space's decay or time step)"
    kept = [a for a in _STATE_ATTRIBUTES if a in vars(module)]
    if kept:
        return f"it keeps {', '.join(kept)} between calls"
    for child_name, child in module.named_children():
        groups = getattr(child, "groups", None)
        channels = getattr(child, "in_channels", None)
        if type(child).__name__ == "Conv1d" and groups is not None and groups == channels != 1:
            return f"its {child_name} is a depthwise Conv1d (a causal convolution over tokens)"
    return None
