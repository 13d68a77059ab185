"""A small causal transformer whose attention runs through ``flexmask.flex_attention``.

Shared by the examples. Usage::

    model = TinyLM(vocab=80, dim=128, num_heads=4, num_layers=3)
    logits = model(tokens, position_ids, block_mask=handle)   # (B, L, vocab)

Positions enter only through rotary embeddings of ``position_ids``, so a document packed at
offset 300 of a row is computed exactly as if it sat alone at offset 0: packing changes
nothing but the mask. ``block_mask=None`` runs plain causal
``scaled_dot_product_attention`` with no flexmask involved (the unpacked reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import flexmask


def rotate(x: Tensor, position_ids: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` ``(B, H, L, D)`` at ``position_ids`` ``(B, L)``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=x.dtype, device=x.device) / half))
    angles = position_ids[:, None, :, None].to(x.dtype) * inv_freq  # (B, 1, L, half)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    """Pre-norm block: RoPE attention through flexmask, then an MLP."""

    def __init__(self, dim: int, num_heads: int, backend: str = "auto") -> None:
        super().__init__()
        self.backend = backend
        if dim % num_heads or (dim // num_heads) % 2:
            raise ValueError(
                f"dim={dim} must split into num_heads={num_heads} heads of an even size"
            )
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, position_ids: Tensor, block_mask: Any) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(batch, length, 3, self.num_heads, dim // self.num_heads)
            .permute(2, 0, 3, 1, 4)
        )
        q, k = rotate(q, position_ids), rotate(k, position_ids)
        if block_mask is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # The handle goes in as is: the first layer to read its BlockMask builds it, the
            # others reuse it (on the CPU the slices backend lowers the mask itself and builds
            # none). compile=False keeps CPU inference off torch.compile's first-call cost.
            if self.backend == "auto":
                attn = flexmask.flex_attention(q, k, v, block_mask=block_mask, compile=False)
            else:
                attn = flexmask.attention(q, k, v, block_mask, self.backend, compile=False)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token embedding, ``num_layers`` blocks, tied LM head.

    Args:
        vocab: vocabulary size.
        dim: model width.
        num_heads: attention heads (``dim // num_heads`` must be even for RoPE).
        num_layers: transformer blocks.
        seed: parameters are initialised from this seed, leaving the global RNG untouched.
        backend: ``"auto"`` runs ``flexmask.flex_attention``; a backend's name runs
            ``flexmask.attention`` with it.
    """

    def __init__(
        self,
        vocab: int,
        dim: int = 128,
        num_heads: int = 4,
        num_layers: int = 3,
        seed: int = 0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, dim)
            nn.init.normal_(self.embed.weight, std=0.02)
            self.blocks = nn.ModuleList(Block(dim, num_heads, backend) for _ in range(num_layers))
            self.norm = nn.LayerNorm(dim)
        self.num_heads = num_heads

    def forward(self, tokens: Tensor, position_ids: Tensor, block_mask: Any = None) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, position_ids, block_mask)
        return self.norm(x) @ self.embed.weight.T


def next_token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log p(tokens[t + 1] | tokens[:t + 1])`` for every ``t``, from ``(len, V)`` logits."""
    return logits[:-1].log_softmax(-1).gather(-1, tokens[1:, None])[:, 0]
