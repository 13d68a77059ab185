"""A tiny causal transformer whose attention takes a block mask, for packing equivalence tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import flexmask


def rotate(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``(B, H, L, D)`` at ``position_ids`` ``(B, L)``.

    Position enters only through ``position_ids``, so a token gets the same rotation whether it
    sits at its own position in an unpacked row or anywhere in a packed one.
    """
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=x.dtype) / half))
    angles = position_ids[:, None, :, None].to(x.dtype) * inv_freq  # (B, 1, L, half)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, block_mask: Any) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(batch, length, 3, self.num_heads, dim // self.num_heads)
            .permute(2, 0, 3, 1, 4)
        )
        q, k = rotate(q, position_ids), rotate(k, position_ids)
        if block_mask is None:
            # The reference path: plain causal attention, with no flexmask involved.
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # compile=False: tests stay on eager kernels (torch's forward, or flexmask's
            # block-sparse path when gradients are needed on the CPU).
            attn = flexmask.flex_attention(q, k, v, block_mask=block_mask, compile=False)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(nn.Module):
    """Embedding, ``num_layers`` pre-norm blocks (RoPE attention + MLP), LM head.

    ``forward(tokens, position_ids, block_mask)`` returns logits ``(B, L, vocab)``. With
    ``block_mask=None`` attention is ``scaled_dot_product_attention(is_causal=True)``; otherwise
    it is ``flexmask.flex_attention`` with the given mask, handle or BlockMask.
    """

    def __init__(
        self, vocab: int = 16, dim: int = 32, num_heads: int = 2, num_layers: int = 2, seed: int = 0
    ) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        torch.random.set_rng_state(generator_state)
        self.num_heads = num_heads

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor, block_mask: Any = None
    ) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, position_ids, block_mask)
        return self.head(self.norm(x))


def next_token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log p(tokens[t + 1] | ...)`` for ``t < len - 1``, from logits ``(len, V)`` along a path."""
    return logits[:-1].log_softmax(-1).gather(-1, tokens[1:, None])[:, 0]
