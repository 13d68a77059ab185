"""A tiny language model for the leak tests, its kernels, and the reference they are checked
against: each document run alone through the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import flexmask


class TinyLM(nn.Module):
    """Embeddings + position embeddings, layers of (attention, optional token mixer, MLP).

    ``attend(q, k, v)`` is the kernel under test; ``mixer`` a recurrent layer run over the
    row as it is (``"scan"``: ignores boundaries), reset where positions restart (``"reset"``)
    or absent.
    """

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2, mixer: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(256, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.decay = nn.Parameter(torch.full((dim,), 0.5))
        self.mixer = mixer

    def forward(self, ids, positions, attend):
        x = self.embed(ids) + self.pos(positions)
        batch, seq_len, dim = x.shape
        for qkv, out, mlp in zip(self.qkv, self.out, self.mlp, strict=True):
            q, k, v = qkv(x).view(batch, seq_len, 3, 2, dim // 2).permute(2, 0, 3, 1, 4)
            x = x + out(attend(q, k, v).transpose(1, 2).reshape(batch, seq_len, dim))
            if self.mixer is not None:
                x = x + self._scan(x, positions)
            x = x + torch.tanh(mlp(x))
        return x

    def _scan(self, x, positions):
        # h_t = decay * h_{t-1} + x_t, reset to x_t where a document starts ("reset").
        keep = torch.sigmoid(self.decay)
        states, h = [], torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            if self.mixer == "reset":
                h = torch.where((positions[:, t] == 0).unsqueeze(-1), torch.zeros_like(h), h)
            h = keep * h + x[:, t]
            states.append(h)
        return torch.stack(states, 1)


def flex_kernel(block_mask):
    def attend(q, k, v):
        return flexmask.flex_attention(q, k, v, block_mask=block_mask)

    return attend


def dense_kernel(mask, batch, seq_len):
    dense = mask.to_dense(batch, 1, seq_len, seq_len)
    # A query that attends nothing (padding) attends itself: finite, never read.
    dense = dense | (~dense.any(-1, keepdim=True) & torch.eye(seq_len, dtype=torch.bool))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    return attend


def run(model, ids, positions, attend):
    return model(ids, positions, attend)


def alone_differs(model, batch, packed_out, doc_mask=None, atol=1e-5):
    """Each document alone through the model (positions from 0, its own mask: causal, or
    ``doc_mask(length)``): the numbers of the documents whose packed outputs differ."""
    differing = set()
    number = 0
    for row, lengths in enumerate(batch.seq_lens):
        start = 0
        for n in lengths:
            ids = batch.tokens[row : row + 1, start : start + n]
            mask = flexmask.causal() if doc_mask is None else doc_mask(n)
            ref = run(model, ids, torch.arange(n).unsqueeze(0), dense_kernel(mask, 1, n))
            if not torch.allclose(packed_out[row, start : start + n], ref[0], atol=atol):
                differing.add(number)
            start += n
            number += 1
    return differing


def packed_batch(lengths, max_len, vocab=32):
    gen = torch.Generator().manual_seed(sum(lengths) * 7 + len(lengths))
    return flexmask.pack(
        [torch.randint(1, vocab, (n,), generator=gen) for n in lengths],
        max_len=max_len,
        strategy="next_fit",
    )
