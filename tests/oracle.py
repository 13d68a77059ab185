"""Independent references, written plainly: Python loops over the definitions.

Nothing here imports flexmask. Dense masks are numpy bool arrays (B, H, Q, KV); the block
oracle is torch's own create_block_mask applied to a lookup into such an array.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

BLOCK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def attention(q, k, v, allowed, scale=None):
    """Attention written plainly: softmax over the allowed keys of ``allowed`` (bool,
    broadcastable to (B, Hq, Q, KV)); grouped heads read kv head ``h // (Hq // Hkv)``. A
    row with no allowed key gives output 0 and lse -inf. Returns (output, lse)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v, lse


def _grid(q_len: int, kv_len: int):
    q = np.arange(q_len)[:, None]
    kv = np.arange(kv_len)[None, :]
    return q, kv


def causal(q_len, kv_len):
    q, kv = _grid(q_len, kv_len)
    return kv <= q


def sliding_window(size, q_len, kv_len):
    q, kv = _grid(q_len, kv_len)
    return np.abs(q - kv) < size


def prefix(length, q_len, kv_len):
    q, kv = _grid(q_len, kv_len)
    return np.broadcast_to(kv < length, (q_len, kv_len))


def padding(length, q_len, kv_len):
    q, kv = _grid(q_len, kv_len)
    return (q < length) & (kv < length)


def document(seq_lens, q_len, kv_len):
    doc_of = {}
    pos = 0
    for d, n in enumerate(seq_lens):
        for _ in range(n):
            doc_of[pos] = d
            pos += 1
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        for kv in range(kv_len):
            out[q, kv] = q in doc_of and kv in doc_of and doc_of[q] == doc_of[kv]
    return out


def chunked(size, q_len, kv_len):
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        for kv in range(kv_len):
            out[q, kv] = q // size == kv // size
    return out


def spans(ids, q_len, kv_len):
    """Same non-negative id: attends both ways (ids are per token; past them, no span)."""
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(min(q_len, len(ids))):
        for kv in range(min(kv_len, len(ids))):
            out[q, kv] = ids[q] >= 0 and ids[q] == ids[kv]
    return out


def tree(parents, q_len, kv_len):
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(min(q_len, len(parents))):
        node = q
        while node != -1:  # walk up: q itself, its parent, ...
            if node < kv_len:
                out[q, node] = True
            node = parents[node]
    return out


def stack(rows: list[np.ndarray], heads: int = 1) -> np.ndarray:
    """(B, H, Q, KV) from one (Q, KV) array per row."""
    arr = np.stack([np.asarray(r, dtype=bool) for r in rows])[:, None]
    return np.repeat(arr, heads, axis=1)


def block_mask_meaning(block_mask, batch, heads, q_len, kv_len, element=None) -> torch.Tensor:
    """What a BlockMask attends, read from its lists block by block (torch's documented
    meaning), as (B, H, Q_LEN, KV_LEN) bool: a listed full block everything, a listed
    partial block the element mask there, an unlisted block nothing. ``element``: that mask,
    broadcastable to (B, H, Q_LEN, KV_LEN); by default its mask_mod through torch's
    ``create_mask``."""
    from torch.nn.attention.flex_attention import create_mask

    if element is None:
        element = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    element = torch.as_tensor(element).expand(batch, heads, q_len, kv_len)
    q_block, kv_block = block_mask.BLOCK_SIZE
    dense = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.bool)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, False)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True))
    for num, indices, full in lists:
        for b in range(batch):
            for h in range(heads):
                mb, mh = b % num.size(0), h % num.size(1)
                for i in range(-(-q_len // q_block)):
                    rows = slice(i * q_block, (i + 1) * q_block)
                    for j in indices[mb, mh, i, : int(num[mb, mh, i])].tolist():
                        cols = slice(j * kv_block, (j + 1) * kv_block)
                        dense[b, h, rows, cols] = True if full else element[b, h, rows, cols]
    return dense


def torch_blocks(dense: np.ndarray, block_size) -> object:
    """torch's create_block_mask on a plain lookup into the dense mask."""
    table = torch.from_numpy(np.ascontiguousarray(dense))
    B, H, Q, KV = table.shape

    def lookup(b, h, q_idx, kv_idx):
        return table[b, h, q_idx, kv_idx]

    return torch_create_block_mask(lookup, B, H, Q, KV, device="cpu", BLOCK_SIZE=block_size)


def assert_same_block_mask(ours, reference, context="", *, own_storage=True) -> None:
    """Drop-in equality: same lengths and block sizes, and every one of the eight tensors
    ``torch.equal`` to the reference's as a whole (the unlisted tail included, which
    ``BlockMask._adjust`` reads) — and, with ``own_storage``, contiguous with a storage of
    its own, as torch's builder writes them (torch's ``_adjust`` returns slices)."""
    assert ours.seq_lengths == reference.seq_lengths, context
    assert tuple(ours.BLOCK_SIZE) == tuple(reference.BLOCK_SIZE), context
    storages = set()
    for field in BLOCK_FIELDS:
        a, b = getattr(ours, field), getattr(reference, field)
        assert a.shape == b.shape, f"{context} {field}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{context} {field}: dtype {a.dtype} != {b.dtype}"
        assert torch.equal(a, b), f"{context} {field} differs:\n{a}\n!=\n{b}"
        if not own_storage:
            continue
        assert a.is_contiguous(), f"{context} {field}: not contiguous (stride {a.stride()})"
        if a.numel():
            storages.add(a.untyped_storage().data_ptr())
    nonempty = sum(getattr(ours, f).numel() > 0 for f in BLOCK_FIELDS)
    assert not own_storage or len(storages) == nonempty, f"{context}: tensors share storage"
