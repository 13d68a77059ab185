"""selected(indices, tile=...): the router-picked key tiles of NSA / DSA / MoBA.

Every build is compared, as whole tensors, with torch's own ``create_block_mask`` of the
plain dense oracle (``strategies.selected_dense``, loops over the definition: q attends kv
iff ``kv // kv_tile`` is among the picks of ``q // q_tile``), or of a mask_mod written here
from the same definition — over B and H > 1 with every index layout, tiles equal to, a
multiple of, a divisor of and unrelated to the block, lengths that are not block multiples,
windows at offsets (per row too), rows that attend nothing, negations and compositions with
causal, documents and sliding windows. The lowerings are read back through each format's
own documented meaning (``test_formats``' decoders) and compared with the same oracle."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from tests import oracle
from tests.strategies import selected_dense, selected_picks

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BLOCKS = st.sampled_from([1, 2, 3, 4, 8, 16, (2, 4), (4, 3), (8, 3), (16, 5)])


def dense(picks4, q_tile, kv_tile, B, H, q_len, kv_len, q_off=0, kv_off=0) -> np.ndarray:
    """(B, H, Q, KV) oracle of ``(R, Hd, n, k)`` picks (R, Hd 1 or B, H) at a window."""
    q_off = q_off if isinstance(q_off, list) else [q_off] * B
    kv_off = kv_off if isinstance(kv_off, list) else [kv_off] * B
    out = np.zeros((B, H, q_len, kv_len), dtype=bool)
    for b in range(B):
        n = max(q_off[b] + q_len, kv_off[b] + kv_len)
        for h in range(H):
            rows = picks4[b % picks4.shape[0], h % picks4.shape[1]].tolist()
            whole = selected_dense(rows, q_tile, kv_tile, n, n)
            out[b, h] = whole[q_off[b] : q_off[b] + q_len, kv_off[b] : kv_off[b] + kv_len]
    return out


def plain_window(size, n):
    q, kv = np.arange(n)[:, None], np.arange(n)[None, :]
    return np.abs(q - kv) < size


def build(mask, B, H, q_len, kv_len, block, q_off=0, kv_off=0):
    return flexmask.create_block_mask(
        mask, B, H, q_len, kv_len, "cpu", block, q_offset=q_off, kv_offset=kv_off
    )


@st.composite
def cases(draw):
    """A selected piece in one of the three layouts (size-1 dimensions included), its
    (R, Hd, n, k) picks, B, H, lengths, block and offsets."""
    B = draw(st.integers(1, 3), label="B")
    H = draw(st.integers(1, 3), label="H")
    length = draw(st.integers(1, 60), label="length")
    layout = draw(st.sampled_from(["shared", "rows", "rows_heads", "one_row", "one_head"]))
    rows = B if layout in ("rows", "rows_heads", "one_head") else 1
    heads = H if layout == "rows_heads" else 1
    picks, tile = draw(selected_picks(rows * heads, length))
    picks4 = picks.view(rows, heads, *picks.shape[1:])
    given_as = {
        "shared": picks4[0, 0],
        "rows": picks4[:, 0],
        "one_row": picks4[:, 0],  # [1, n, k]: shared, as torch broadcasts B=1
        "rows_heads": picks4,
        "one_head": picks4,  # [B, 1, n, k]
    }[layout]
    if draw(st.booleans()):  # any integer dtype
        given_as = given_as.to(draw(st.sampled_from([torch.int32, torch.int16])))
    mask = flexmask.selected(given_as, tile=tile, truncate=True)
    q_len = draw(st.integers(1, length + 8), label="q_len")
    kv_len = draw(st.integers(1, length + 8), label="kv_len")
    block = draw(BLOCKS, label="block")
    offsets = st.integers(0, 2 * length)
    if draw(st.booleans()):
        q_off, kv_off = 0, 0
    elif draw(st.booleans()):
        q_off, kv_off = draw(offsets), draw(offsets)
    else:
        q_off = draw(st.lists(offsets, min_size=B, max_size=B))
        kv_off = draw(st.lists(offsets, min_size=B, max_size=B))
    return mask, picks4, tile, B, H, q_len, kv_len, block, q_off, kv_off


@SETTINGS
@given(case=cases(), shape=st.integers(0, 6), data=st.data())
def test_builds_equal_torch_of_the_oracle(case, shape, data):
    mask, picks4, (qt, kt), B, H, q_len, kv_len, block, q_off, kv_off = case
    sel = dense(picks4, qt, kt, B, H, q_len, kv_len, q_off, kv_off)
    n = max(np.max(q_off) + q_len, np.max(kv_off) + kv_len)
    qo = np.asarray(q_off).reshape(-1, 1, 1, 1) + np.arange(q_len).reshape(1, 1, -1, 1)
    ko = np.asarray(kv_off).reshape(-1, 1, 1, 1) + np.arange(kv_len).reshape(1, 1, 1, -1)
    causal = np.broadcast_to(ko <= qo, sel.shape)
    size = data.draw(st.integers(1, 12), label="window")
    window = np.broadcast_to(np.abs(qo - ko) < size, sel.shape)
    docs = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=6), label="docs")
    doc_dense = oracle.document(docs, n, n)
    doc = np.stack(
        [
            doc_dense[np.asarray(q_off).reshape(-1)[b % np.size(q_off)] + np.arange(q_len)][
                :, np.asarray(kv_off).reshape(-1)[b % np.size(kv_off)] + np.arange(kv_len)
            ]
            for b in range(B)
        ]
    )[:, None]
    doc = np.broadcast_to(doc, sel.shape)
    win = flexmask.sliding_window(size)
    docm = flexmask.document(docs, truncate=True)
    mask, ref = [
        (mask, sel),
        (~mask, ~sel),
        (flexmask.causal() & mask, causal & sel),
        (win | mask, window | sel),
        (flexmask.causal() & (mask | win), causal & (sel | window)),  # NSA's two branches
        (~(flexmask.causal() & mask), ~(causal & sel)),
        (docm & ~mask & flexmask.causal(), doc & ~sel & causal),
    ][shape]
    ours = build(mask, B, H, q_len, kv_len, block, q_off, kv_off)
    reference = oracle.torch_build(np.ascontiguousarray(ref), block=block)
    oracle.assert_same_block_mask(ours, reference, repr(mask))
    if q_off == 0 and kv_off == 0:
        assert np.array_equal(mask.to_dense(B, H, q_len, kv_len).numpy(), ref), repr(mask)
