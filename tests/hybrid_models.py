"""Tiny instances of every hybrid architecture transformers ships (hidden 16-32, 2-4 layers,
each layer kind present), for the hybrid fallback's tests and benchmark."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)

_GDN = dict(
    linear_num_value_heads=2,
    linear_num_key_heads=1,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
_MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
_MAMBA2 = dict(
    mamba_n_heads=2, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8
)

# name -> (config class, settings): each architecture's layer kinds all present.
HYBRIDS: dict[str, tuple[str, dict]] = {
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            shared_expert_intermediate_size=16,
            **_GDN,
            **_MOE,
        ),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **_GDN),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            shared_expert_intermediate_size=16,
            **_GDN,
            **_MOE,
        ),
    ),
    "olmo_hybrid": (
        "OlmoHybridConfig",
        dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **_GDN),
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_key_value_heads=2,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            linear_head_dim=8,
            linear_num_heads=2,
            num_experts=2,
            num_experts_per_token=1,
            moe_intermediate_size=16,
            mlp_layer_types=["dense", "dense"],
        ),
    ),
    "falcon_h1": (
        "FalconH1Config",
        dict(
            num_hidden_layers=2,
            mamba_d_ssm=32,
            mamba_d_head=16,
            mamba_n_heads=2,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=8,
        ),
    ),
    "bamba": ("BambaConfig", dict(num_hidden_layers=2, attn_layer_indices=[1], **_MAMBA2)),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["mamba", "attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            shared_intermediate_size=16,
            **_MAMBA2,
        ),
    ),
    "nemotron_h": (
        "NemotronHConfig",
        dict(num_hidden_layers=3, layers_block_type=["mamba", "attention", "mlp"], **_MAMBA2),
    ),
    "jamba": (
        "JambaConfig",
        dict(
            num_hidden_layers=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        ),
    ),
    "zamba": (
        "ZambaConfig",
        dict(
            num_hidden_layers=2,
            layers_block_type=["mamba", "hybrid"],
            mamba_d_state=8,
            attention_head_dim=16,
            mamba_dt_rank=4,
            n_mamba_heads=1,
        ),
    ),
    "zamba2": (
        "Zamba2Config",
        dict(
            num_hidden_layers=2,
            layers_block_type=["mamba", "hybrid"],
            mamba_d_state=8,
            mamba_headdim=32,
            n_mamba_heads=2,
            attention_head_dim=16,
            chunk_size=8,
        ),
    ),
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=2, layer_types=["conv", "full_attention"])),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["conv", "full_attention"],
            num_dense_layers=1,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
        ),
    ),
    "minimax": (
        "MiniMaxConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_local_experts=2,
            num_experts_per_tok=1,
            block_size=4,
        ),
    ),
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        dict(
            num_hidden_layers=2,
            block_types=["recurrent", "attention"],
            lru_width=32,
            attention_window_size=16,
            conv1d_width=4,
            logits_soft_cap=30.0,
        ),
    ),
    "lfm3": (
        "Lfm3Config",
        dict(
            num_hidden_layers=3,
            layer_types=["conv", "sliding_attention", "full_attention"],
            sliding_window=32,
        ),
    ),
    "lara_mini": (
        "LaraMiniConfig",
        dict(
            num_hidden_layers=3,
            layer_types=["linear_attention", "sliding_attention", "full_attention"],
            sliding_window=32,
            **_GDN,
            **_MOE,
        ),
    ),
    "bailing_hybrid": (
        "BailingHybridConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "dense"],
            num_key_value_heads=2,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=1,
            num_local_experts=2,
            moe_intermediate_size=16,
            first_k_dense_replace=2,
            num_mtp_layers=0,
        ),
    ),
    "inkling": (
        "InklingTextConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["hybrid_sliding", "hybrid"],
            sliding_window=32,
            mlp_layer_types=["dense", "dense"],
        ),
    ),
    # transformers 5.25 builds Inkling2 with eager attention only.
    "inkling2": (
        "Inkling2TextConfig",
        dict(num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"], sliding_window=32),
    ),
}
EAGER_ONLY = {"inkling2"}


def packed_inputs(model, batch):
    """flexmask's arguments for a packed batch (``model_inputs``: ids, positions, each layer
    type's mask, and ``cu_seq_lens_q/k`` / ``seq_idx`` for a hybrid model)."""
    from flexmask.integrations.transformers import model_inputs

    return model_inputs(model, batch)


def tiny_model(name: str, implementation: str | None = None, seed: int = 0):
    """The tiny float32 model of ``name`` (a key of HYBRIDS) in eval mode, seeded;
    ``implementation`` by default sdpa, eager where transformers builds only that."""
    if implementation is None:
        implementation = "eager" if name in EAGER_ONLY else "sdpa"
    import transformers
    from transformers import AutoModelForCausalLM

    config_name, settings = HYBRIDS[name]
    config = getattr(transformers, config_name)(**{**COMMON, **settings})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    return model.float().eval()
