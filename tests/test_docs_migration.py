"""Every row of every migration table in docs/ runs: "what you write today" against the one
flexmask call the row gives.

The "before" side of a row is built from its own format's documented rules, written plainly
below — never from flexmask's code:

* varlen: flash-attn's ``flash_attn_varlen_func`` docstring (sequence ``i`` is
  ``cu_seqlens[i]:cu_seqlens[i + 1]`` of the unpadded tokens; ``causal`` and ``window_size``
  aligned to its bottom-right corner) and torch's ``varlen_attn`` (``window_size=(-1, 0)`` is
  causal);
* FlashMask: PaddlePaddle's ``flashmask_attention`` — per key column ``c`` the row bounds
  ``LTS/LTE/UTS/UTE``; row ``r`` is masked where ``LTS[c] <= r < LTE[c]`` (lower triangle) or
  ``UTS[c] <= r < UTE[c]`` (upper); ``causal=True`` masks ``r < c`` instead of the upper bounds,
  a missing LTE is "to the end", a missing UTS is 0;
* Magi: ``flex_flash_attn_func``'s mask types on ``q_ranges``/``k_ranges``/``attn_type_map``
  (full; causal aligned bottom-right; inverse causal top-left; bi-causal both), and
  ``infer_attn_mask_from_cu_seqlens`` (one slice per sequence);
* hand-written mask_mods and attn-gym's generators: torch's ``create_mask``.

The "after" side is exactly the call in the table: the mask's ``to_dense``, and for the
lowerings the returned fields against the hand-written ones. ``ROWS`` holds every row's text;
``test_every_migration_row_has_a_case`` reads the tables in docs/ and fails on a row without a
case (or a case whose row is gone), so a new row, or a changed call, needs its test here.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask, or_masks

import flexmask
from flexmask import causal, document, padding, prefix, sliding_window, spans, tree
from flexmask.formats import to_flashmask, to_magi, to_varlen
from tests.oracle import assert_same_block_mask

DOCS = Path(__file__).resolve().parent.parent / "docs"


# ----------------------------------------------------------------- the formats' own rules
def varlen_dense(cu_q, cu_k, q_index, k_index, causal_flag, window_size, batch, q_len, kv_len):
    """(B, Q, KV) attended, from flash-attn's varlen arguments: query ``i`` of a sequence with
    ``sq`` queries and ``sk`` keys sees key ``j`` when ``j <= i + sk - sq`` (causal) and
    ``i + sk - sq - left <= j <= i + sk - sq + right`` (-1: unbounded); ``q_index``/``k_index``
    place the packed tokens in the flat ``(B * Q_LEN)`` / ``(B * KV_LEN)`` layout."""
    out = np.zeros((batch * q_len, batch * kv_len), dtype=bool)
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    q_index, k_index = np.asarray(q_index), np.asarray(k_index)
    left, right = window_size
    for s in range(len(cu_q) - 1):
        sq, sk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        i = np.arange(sq)[:, None] + sk - sq  # each query's diagonal key
        j = np.arange(sk)[None, :]
        ok = np.ones((sq, sk), dtype=bool)
        if causal_flag:
            ok &= j <= i
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        rows = q_index[cu_q[s] : cu_q[s + 1]]
        cols = k_index[cu_k[s] : cu_k[s + 1]]
        out[np.ix_(rows, cols)] |= ok
    per_row = [
        out[b * q_len : (b + 1) * q_len, b * kv_len : (b + 1) * kv_len] for b in range(batch)
    ]
    assert sum(int(r.sum()) for r in per_row) == int(out.sum()), "a sequence spans two rows"
    return np.stack(per_row)


def flashmask_dense(startend_row_indices, causal_flag: bool, q_len: int) -> np.ndarray:
    """(B, H, Q, KV) attended, from paddle's ``startend_row_indices`` (B, H, KV, C)."""
    s = np.asarray(startend_row_indices, dtype=np.int64)
    columns = s.shape[-1]
    r = np.arange(q_len)[:, None]  # rows (queries), against columns (keys) on the last axis
    c = np.arange(s.shape[2])[None, :]
    big = np.iinfo(np.int64).max

    def bound(k: int) -> np.ndarray:  # (B, H, 1, KV)
        return s[..., k][:, :, None, :]

    lts = bound(0)
    if causal_flag:
        lte = bound(1) if columns == 2 else big
        upper = r < c
    else:
        lte = bound(1) if columns == 4 else big
        uts = bound(2) if columns == 4 else 0
        ute = bound(3) if columns == 4 else bound(1)
        upper = (uts <= r) & (r < ute)
    masked = ((lts <= r) & (r < lte)) | upper
    return ~masked


def magi_dense(q_ranges, k_ranges, attn_type_map, batch, q_len, kv_len) -> np.ndarray:
    """(B, Q, KV) attended, from Magi's slices over the flattened (B * S) tokens: type 0 full,
    1 causal (bottom-right: key ``k <= q + ke - qe``), 2 inverse causal (top-left:
    ``k >= q + ks - qs``), 3 both. Asserts no (query, key) pair is covered twice."""
    count = np.zeros((batch * q_len, batch * kv_len), dtype=int)
    for (qs, qe), (ks, ke), kind in zip(q_ranges, k_ranges, attn_type_map, strict=True):
        q = np.arange(qs, qe)[:, None]
        k = np.arange(ks, ke)[None, :]
        ok = np.ones((qe - qs, ke - ks), dtype=bool)
        if kind in (1, 3):
            ok &= k <= q + (ke - qe)
        if kind in (2, 3):
            ok &= k >= q + (ks - qs)
        count[qs:qe, ks:ke] += ok
    assert count.max(initial=0) <= 1, "a (query, key) pair is covered by two slices"
    per_row = [
        count[b * q_len : (b + 1) * q_len, b * kv_len : (b + 1) * kv_len] == 1 for b in range(batch)
    ]
    assert sum(int(r.sum()) for r in per_row) == int(count.sum()), "a slice spans two rows"
    return np.stack(per_row)


def torch_dense(mask_mod, batch: int, heads: int, length: int) -> np.ndarray:
    """(B, H, S, S): torch's own evaluation of a mask_mod."""
    return create_mask(mask_mod, batch, heads, length, length, device="cpu").numpy()


def ours(mask, batch: int, heads: int, length: int) -> np.ndarray:
    return mask.to_dense(batch, heads, length, length, device="cpu").numpy()


def same(a: np.ndarray, b: np.ndarray, context: str = "") -> None:
    a, b = np.broadcast_arrays(a, b)
    if not np.array_equal(a, b):
        where = np.argwhere(a != b)[:5].tolist()
        raise AssertionError(f"{context}: dense masks differ at (b, [h,] q, kv) {where}")


# ----------------------------------------------------------------- hand-written inputs
def flat_docs(rows: list[list[int]]) -> list[int]:
    """Every document of every row in order: the packed (unpadded) layout's sequences."""
    return [n for row in rows for n in row]


def cu_seqlens_of(seq_lens: list[int]) -> torch.Tensor:
    """The row's text, ``F.pad(torch.cumsum(seq_lens, 0), (1, 0))``, as int32 (flash-attn and
    Magi take int32)."""
    return F.pad(torch.cumsum(torch.tensor(seq_lens), 0), (1, 0)).to(torch.int32)


def attention_mask_of(rows: list[list[int]], length: int) -> torch.Tensor:
    """(B, S) 1 for real tokens (each row's documents, left-aligned), 0 for padding."""
    lens = torch.tensor([sum(r) for r in rows])
    return (torch.arange(length)[None, :] < lens[:, None]).int()


def flexmask_docs(rows: list[list[int]]) -> list[list[int]]:
    """document()'s per-row lengths: a row with no documents is written [0]."""
    return [r or [0] for r in rows]


def paddle_document_columns(seq_lens: list[int], length: int) -> torch.Tensor:
    """Bidirectional documents, ``causal=False``, ``[LTS, UTE]`` (S, 2) as paddle's document
    example writes them: a key masks the rows from its document's end and the rows before its
    document's start; a padding key every row ([total, total])."""
    lts, ute, start = [], [], 0
    for n in seq_lens:
        lts += [start + n] * n
        ute += [start] * n
        start += n
    lts += [start] * (length - start)
    ute += [start] * (length - start)
    return torch.tensor([lts, ute], dtype=torch.int32).T.clamp(max=length)


def paddle_prefix_lm_columns(docs: list[tuple[int, int]], length: int) -> torch.Tensor:
    """Prefix-LM documents ``(prefix_len, seq_len)``, ``causal=False``, ``[LTS, UTE]`` (S, 2)
    as paddle's prefix-LM document example writes them: LTS the document's end; UTE the
    document's start for a prefix key (the whole document sees it), the key itself after the
    prefix (causal); a padding key masks every row ([total, total])."""
    lts, ute, start = [], [], 0
    for p, n in docs:
        lts += [start + n] * n
        ute += [start] * p + list(range(start + p, start + n))
        start += n
    lts += [start] * (length - start)
    ute += [start] * (length - start)
    return torch.tensor([lts, ute], dtype=torch.int32).T.clamp(max=length)


def prefix_ids_of(docs: list[tuple[int, int]]) -> list[int]:
    """docs/formats.md's ``prefix_ids``: document ``d``'s prefix has id ``d``, the rest -1."""
    return [d if t < p else -1 for d, (p, n) in enumerate(docs) for t in range(n)]


# ----------------------------------------------------------------- rows of docs/formats.md
FORMATS = "formats.md"

VARLEN_CASES = [
    {"rows": [[1]], "S": 1},
    {"rows": [[3, 4]], "S": 8},  # the page's example: token 7 is padding
    {"rows": [[100, 57, 43], [300]], "S": 300},
    {"rows": [[128, 128], [5, 1, 90], []], "S": 257},  # a row of padding only: attends nothing
]


def _varlen_mask(rows: list[list[int]]):
    """The row's ``causal() & document(seq_lens) & padding(lens)``: per-row documents, each
    row padded after them."""
    return causal() & document(flexmask_docs(rows)) & padding([sum(r) for r in rows])


def _varlen_lowering(case):
    rows, S = case["rows"], case["S"]
    B = len(rows)
    v = to_varlen(_varlen_mask(rows), B, 1, S, S)
    return v, B, S


def check_flash_varlen(case):
    """cu_seqlens and max_seqlen by hand, causal=True, unpad/pad by attention_mask.nonzero()."""
    v, B, S = _varlen_lowering(case)
    flat = flat_docs(case["rows"])
    cu_seqlens = cu_seqlens_of(flat)
    max_seqlen = max(flat, default=0)
    indices = attention_mask_of(case["rows"], S).flatten().nonzero()[:, 0]
    hand = {
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_k": cu_seqlens,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_k": max_seqlen,
        "causal": True,
        "window_size": (-1, -1),  # flash_attn_varlen_func's default
    }
    theirs = v.flash_attn_kwargs()
    assert theirs.keys() == hand.keys()
    for name, want in hand.items():
        got = theirs[name]
        if isinstance(want, torch.Tensor):
            assert got.dtype == torch.int32 and torch.equal(got, want), (name, got, want)
        else:
            assert got == want, (name, got, want)
    # The unpad / pad: hand-written gather by the nonzero indices, scatter back with zeros.
    x = torch.randn(B, S, 2, 3)
    assert torch.equal(v.pack_q(x), x.flatten(0, 1)[indices])
    assert torch.equal(v.pack_kv(x), x.flatten(0, 1)[indices])
    packed_out = torch.randn(indices.numel(), 2, 3)
    padded = torch.zeros(B * S, 2, 3).index_put((indices,), packed_out).view(B, S, 2, 3)
    assert torch.equal(v.unpack(packed_out), padded)
    # What the kernel masks with the hand-written arguments is the mask.
    mask = _varlen_mask(case["rows"])
    before = varlen_dense(cu_seqlens, cu_seqlens, indices, indices, True, (-1, -1), B, S, S)
    same(before, ours(mask, B, 1, S)[:, 0], "flash varlen")


def check_megatron(case):
    """Megatron's THD PackedSeqParams: cu_seqlens_q/kv and max_seqlen_q/kv from seq_lens."""
    v, B, S = _varlen_lowering(case)
    flat = flat_docs(case["rows"])
    params = {
        "cu_seqlens_q": cu_seqlens_of(flat),
        "cu_seqlens_kv": cu_seqlens_of(flat),
        "max_seqlen_q": max(flat, default=0),
        "max_seqlen_kv": max(flat, default=0),
    }
    assert torch.equal(v.cu_seqlens_q, params["cu_seqlens_q"])
    assert torch.equal(v.cu_seqlens_k, params["cu_seqlens_kv"])
    assert v.cu_seqlens_q.dtype == v.cu_seqlens_k.dtype == torch.int32
    assert (v.max_seqlen_q, v.max_seqlen_k) == (params["max_seqlen_q"], params["max_seqlen_kv"])
    indices = attention_mask_of(case["rows"], S).flatten().nonzero()[:, 0]
    before = varlen_dense(
        params["cu_seqlens_q"], params["cu_seqlens_kv"], indices, indices, True, (-1, -1), B, S, S
    )
    mask = _varlen_mask(case["rows"])
    same(before, ours(mask, B, 1, S)[:, 0], "megatron thd")


def check_torch_varlen_attn(case):
    """torch's varlen_attn(q, k, v, cu_seq, cu_seq, max_len, max_len, window_size=(-1, 0)):
    the same bound arguments, q/k/v packed by hand."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    v, B, S = _varlen_lowering(case)
    flat = flat_docs(case["rows"])
    cu_seq, max_len = cu_seqlens_of(flat), max(flat, default=0)
    indices = attention_mask_of(case["rows"], S).flatten().nonzero()[:, 0]
    q, k, val = (torch.randn(B, S, 2, 4) for _ in range(3))
    q_p, k_p, val_p = (x.flatten(0, 1)[indices] for x in (q, k, val))
    signature = inspect.signature(varlen.varlen_attn)
    hand = signature.bind(q_p, k_p, val_p, cu_seq, cu_seq, max_len, max_len, window_size=(-1, 0))
    call = signature.bind(v.pack_q(q), v.pack_kv(k), v.pack_kv(val), **v.varlen_attn_kwargs())
    hand.apply_defaults()
    call.apply_defaults()
    assert hand.arguments.keys() == call.arguments.keys()
    for name, want in hand.arguments.items():
        got = call.arguments[name]
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), name
        else:
            assert got == want, (name, got, want)
    # torch documents window_size=(-1, 0) as causal: no causal flag of its own.
    before = varlen_dense(cu_seq, cu_seq, indices, indices, False, (-1, 0), B, S, S)
    mask = _varlen_mask(case["rows"])
    same(before, ours(mask, B, 1, S)[:, 0], "torch varlen_attn")


PADDLE_CAUSAL_CASES = [  # the row's repeat_interleave covers every token: sum(seq_lens) == S
    {"rows": [[1]], "S": 1, "H": 1},
    {"rows": [[4, 3, 3]], "S": 10, "H": 1},  # paddle's own document example
    {"rows": [[100, 157, 43], [300]], "S": 300, "H": 2},
    {"rows": [[128, 1, 128], [1, 255, 1]], "S": 257, "H": 3},
]


def check_paddle_causal_documents(case):
    rows, S, H = case["rows"], case["S"], case["H"]
    B = len(rows)
    hand = []
    for seq_lens in rows:
        cu_seqlens = cu_seqlens_of(seq_lens)
        startend = torch.repeat_interleave(cu_seqlens[1:], torch.tensor(seq_lens))
        hand.append(startend.view(1, S, 1))
    startend_row_indices = torch.stack(hand).to(torch.int32)  # (B, 1, S, 1): heads broadcast
    f = to_flashmask(causal() & document(rows), B, H, S, S)
    assert f.causal is True
    assert f.startend_row_indices.dtype == torch.int32
    assert torch.equal(f.startend_row_indices, startend_row_indices)
    same(
        flashmask_dense(startend_row_indices, True, S),
        ours(causal() & document(rows), B, H, S),
        "paddle causal documents",
    )


PADDLE_DOCUMENT_CASES = [  # "docs": (prefix_len, seq_len) per document, per row
    {"docs": [[(1, 1)]], "S": 1, "H": 1},
    {"docs": [[(2, 4), (3, 4)]], "S": 8, "H": 1},  # the page's example
    {"docs": [[(3, 5), (2, 4), (0, 3)]], "S": 12, "H": 1},  # a document with no prefix
    {"docs": [[(100, 130), (60, 60), (7, 200)], [(0, 1), (299, 299)]], "S": 390, "H": 2},
    {"docs": [[(3, 5), (4, 4), (1, 4)], [(1, 1)]], "S": 16, "H": 1},  # padding after the docs
    {"docs": [[(100, 130), (60, 60), (7, 200)], [(128, 256)]], "S": 400, "H": 2},  # padding
]


def _check_paddle_columns(f, hand: torch.Tensor, rows: list[list[int]], S: int, context: str):
    """The lowering's [LTS, UTE] are the hand-written ones on every key of a document; a
    padding key is masked in every row both ways (paddle's example writes [total, total]).
    Where no query sees a later key (1-token documents only) to_flashmask takes FlashMask's
    smaller causal form instead: then the two must mask the same elements."""
    want = flashmask_dense(hand, False, S)
    got = flashmask_dense(f.startend_row_indices, f.causal, S)
    same(got, want, context)
    assert f.startend_row_indices.dtype == torch.int32
    if f.causal:
        assert not np.triu(want, 1).any(), context
        return
    assert f.columns == 2 and f.startend_row_indices.shape == hand.shape
    for b, seq_lens in enumerate(rows):
        real = sum(seq_lens)
        cols, hand_cols = f.startend_row_indices[b, 0], hand[b, 0]
        assert torch.equal(cols[:real], hand_cols[:real]), (context, b, cols.T, hand_cols.T)


def check_paddle_bidirectional_documents(case):
    rows = [[n for _, n in row] for row in case["docs"]]
    S, H, B = case["S"], case["H"], len(rows)
    hand = torch.stack([paddle_document_columns(r, S)[None] for r in rows])  # (B, 1, S, 2)
    mask = document(rows)
    f = to_flashmask(mask, B, H, S, S)
    _check_paddle_columns(f, hand, rows, S, "paddle bidirectional documents")
    same(flashmask_dense(hand, False, S), ours(mask, B, H, S), "paddle bidirectional documents")


def check_paddle_prefix_lm_documents(case):
    docs, S, H = case["docs"], case["S"], case["H"]
    B = len(docs)
    rows = [[n for _, n in row] for row in docs]
    hand = torch.stack([paddle_prefix_lm_columns(row, S)[None] for row in docs])
    prefix_ids = [prefix_ids_of(row) for row in docs]
    mask = (causal() | spans(prefix_ids)) & document(rows)
    f = to_flashmask(mask, B, H, S, S)
    _check_paddle_columns(f, hand, rows, S, "paddle prefix-LM documents")
    same(flashmask_dense(hand, False, S), ours(mask, B, H, S), "paddle prefix-LM documents")


MAGI_CASES = [  # infer_attn_mask_from_cu_seqlens covers every token: sum(seq_lens) == S
    {"rows": [[1]], "S": 1},
    {"rows": [[3, 4, 1]], "S": 8},
    {"rows": [[100, 157, 43], [300]], "S": 300},
    {"rows": [[128, 2, 127], [2, 255]], "S": 257},
]


def check_magi_cu_seqlens(case):
    """infer_attn_mask_from_cu_seqlens(cu, cu, causal=True): one causal slice per sequence of
    the flattened (B * S) tokens, totals cu[-1]."""
    rows, S = case["rows"], case["S"]
    B = len(rows)
    cu = cu_seqlens_of(flat_docs(rows))
    ranges = torch.stack([cu[:-1], cu[1:]], 1)
    hand_types = [1] * len(ranges)  # AttnMaskType.CAUSAL
    mask = causal() & document(rows)
    m = to_magi(mask, B, 1, S, S)
    assert (m.total_q, m.total_k) == (int(cu[-1]), int(cu[-1]))
    same(
        magi_dense(ranges.tolist(), ranges.tolist(), hand_types, B, S, S),
        ours(mask, B, 1, S)[:, 0],
        "magi cu_seqlens",
    )
    kwargs = m.flex_flash_attn_kwargs()
    same(
        magi_dense(
            kwargs["q_ranges"].tolist(),
            kwargs["k_ranges"].tolist(),
            kwargs["attn_type_map"].tolist(),
            B,
            S,
            S,
        ),
        ours(mask, B, 1, S)[:, 0],
        "to_magi",
    )
    if min(flat_docs(rows)) > 1:  # two 1-token documents may join into one bi-causal slice
        assert torch.equal(kwargs["q_ranges"], ranges) and torch.equal(kwargs["k_ranges"], ranges)
        assert kwargs["attn_type_map"].tolist() == hand_types
        assert kwargs["max_seqlen_q"] == kwargs["max_seqlen_k"] == max(flat_docs(rows))


RL_CASES = [  # per row, groups of (prompt_len, [response lengths]); then padding to S
    {"groups": [[(3, [1, 2, 2])]], "S": 8},
    {"groups": [[(100, [50, 70, 30])], [(40, [1]), (7, [60, 60])]], "S": 300},
    {"groups": [[(128, [64, 64])], [(1, [1, 1, 1])]], "S": 257},
]


def _rl_row(groups):
    """Hand-written Magi slices of one row (positions in the row) and the sequences that
    pack_one_tree turns into the same tree: each group is its prompt, then its responses packed
    one after another; slices: the prompt causal onto itself, each response full onto its
    prompt and causal onto itself."""
    slices, sequences, start, token = [], [], 0, 1
    for prompt_len, responses in groups:
        prompt = list(range(token, token + prompt_len))
        token += prompt_len
        slices.append(((start, start + prompt_len), (start, start + prompt_len), 1))
        at = start + prompt_len
        for n in responses:
            response = list(range(token, token + n))  # distinct tokens: no shared prefix
            token += n
            sequences.append(prompt + response)
            slices.append(((at, at + n), (start, start + prompt_len), 0))
            slices.append(((at, at + n), (at, at + n), 1))
            at += n
        start = at
    return slices, sequences, start


def check_magi_rl(case):
    S, rows = case["S"], case["groups"]
    B = len(rows)
    q_ranges, k_ranges, types, parents = [], [], [], []
    for b, groups in enumerate(rows):
        slices, sequences, used = _rl_row(groups)
        assert used <= S
        for (qs, qe), (ks, ke), kind in slices:
            q_ranges.append((b * S + qs, b * S + qe))
            k_ranges.append((b * S + ks, b * S + ke))
            types.append(kind)
        packed = flexmask.pack_one_tree(sequences)
        assert packed.num_tokens == used
        parents.append(packed.parents.tolist())
    before = magi_dense(q_ranges, k_ranges, types, B, S, S)
    mask = tree(parents)
    m = to_magi(mask, B, 1, S, S)
    after = magi_dense(m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), B, S, S)
    same(before, after, "magi RL slices")
    same(before, ours(mask, B, 1, S)[:, 0], "tree")


# ----------------------------------------------------------------- rows of docs/migrating.md
MIGRATING = "migrating.md"
LENGTHS = (1, 7, 128, 300)


def _torch_row(make_before, make_after, batch: int = 2, heads: int = 1):
    """A check comparing torch's create_mask of a mask_mod with the flexmask expression,
    densely for B=2 (and H), and block by block through ``flexmask.create_block_mask`` against
    torch's ``create_block_mask`` for B = H = 1 (the page's claim: the same BlockMask)."""

    def check(case):
        S = case["S"]
        before, after = make_before(S, batch), make_after(S, batch)
        same(torch_dense(before, batch, heads, S), ours(after, batch, heads, S), "dense")
        if case.get("blocks"):
            one_before, one_after = make_before(S, 1), make_after(S, 1)
            reference = create_block_mask(one_before, 1, 1, S, S, device="cpu")
            built = flexmask.create_block_mask(one_after, 1, 1, S, S, device="cpu")
            assert_same_block_mask(built, reference, f"S={S}", own_storage=False)

    return check


def _seq_lens(S: int, batch: int) -> list[list[int]]:
    """Per row documents covering the row exactly (the hand-written doc_id needs every
    token in a document), lengths not multiples of 128."""
    shapes = [[S // 3, S - S // 3], [1] * min(S, 3) + [S - min(S, 3)], [S]]
    return [[n for n in shapes[b % 3] if n > 0] for b in range(batch)]


def _doc_id(S: int, batch: int) -> torch.Tensor:
    rows = _seq_lens(S, batch)
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    )


def _pad_lens(S: int, batch: int) -> list[int]:
    return [[S // 2 + 1, 0, S][b % 3] for b in range(batch)]  # 0: a row of padding only


def _hand_causal(b, h, q, kv):
    return q >= kv


def _every_third_back(b, h, q, kv):
    """A mask flexmask has no piece for: causal keys at a distance divisible by 3."""
    return (q >= kv) & ((q - kv) % 3 == 0)


def _mm_doc(S, B):
    doc_id = _doc_id(S, B)
    return lambda b, h, q, kv: doc_id[b, q] == doc_id[b, kv]


def _mm_padding(S, B):
    lens = torch.tensor(_pad_lens(S, B))
    return lambda b, h, q, kv: (q < lens[b]) & (kv < lens[b])


def _mm_window(w):
    return lambda b, h, q, kv: (q - kv).abs() < w


def _mm_prefix(n):
    return lambda b, h, q, kv: kv < n


def _combined_before(S, B):
    f = and_masks(_hand_causal, _mm_doc(S, B))
    g = or_masks(_mm_prefix(S // 4), _hand_causal)
    return and_masks(or_masks(f, g), _mm_padding(S, B))


def _combined_after(S, B):
    f = causal() & document(_seq_lens(S, B))
    g = prefix(S // 4) | causal()
    return (f | g) & padding(_pad_lens(S, B))


TORCH_CASES = [{"S": S, "blocks": S >= 128} for S in LENGTHS]


# ----------------------------------------------------------------- attn-gym's generators
def _gym():
    return pytest.importorskip("attn_gym.masks")


def _gym_doc_before(S, B):
    from attn_gym.masks.document_mask import generate_doc_mask_mod, length_to_offsets

    lengths = _seq_lens(S, 1)[0]  # attn-gym's document mask is one layout for every row
    return generate_doc_mask_mod(_gym().causal_mask, length_to_offsets(lengths, "cpu"))


def _gym_doc_after(S, B):
    return causal() & document(_seq_lens(S, 1)[0])


GYM_CASES = [{"S": S, "blocks": S >= 128} for S in LENGTHS]


# ----------------------------------------------------------------- the rows
@dataclass(frozen=True)
class Row:
    """One table row as docs/ writes it (``before`` | ``after``, ``\\|`` unescaped) and the
    check that runs it, once per case."""

    page: str
    before: str
    after: str
    check: Callable[[dict], None]
    cases: list[dict] = field(default_factory=list)
    table: str = ""  # which of the page's tables, in test ids


def _w(S, B):  # window sizes: 1, a small one, one past the sequence
    return {1: 1, 7: 3, 128: 5, 300: 130}[S]


def _n(S, B):  # prefix lengths: 0 (prefix alone attends nothing), inside, past the sequence
    return {1: 0, 7: 3, 128: 130, 300: 200}[S]


ROWS = [
    Row(
        FORMATS,
        "`cu_seqlens = F.pad(torch.cumsum(seq_lens, 0), (1, 0))`, `max_seqlen = max(seq_lens)`, "
        "`causal=True`, an unpad/pad by `attention_mask.nonzero()`",
        "`v = to_varlen(causal() & document(seq_lens) & padding(lens), B, 1, S, S)`; "
        "`v.flash_attn_kwargs()`, `v.pack_q(q)`, `v.unpack(out)`",
        check_flash_varlen,
        VARLEN_CASES,
    ),
    Row(
        FORMATS,
        "Megatron `PackedSeqParams(cu_seqlens_q=..., max_seqlen_q=...)`",
        "`v.cu_seqlens_q`, `v.cu_seqlens_k`, `v.max_seqlen_q`, `v.max_seqlen_k`",
        check_megatron,
        VARLEN_CASES,
    ),
    Row(
        FORMATS,
        "torch `varlen_attn(q, k, v, cu_seq, cu_seq, max_len, max_len, window_size=(-1, 0))`",
        "`varlen_attn(v.pack_q(q), v.pack_kv(k), v.pack_kv(val), **v.varlen_attn_kwargs())`",
        check_torch_varlen_attn,
        VARLEN_CASES,
    ),
    Row(
        FORMATS,
        "paddle: `startend_row_indices = repeat_interleave(cu_seqlens[1:], seq_lens)` and "
        "`causal=True`",
        "`f = to_flashmask(causal() & document(seq_lens), B, H, S, S)`; "
        "`f.startend_row_indices`, `f.causal`",
        check_paddle_causal_documents,
        PADDLE_CAUSAL_CASES,
    ),
    Row(
        FORMATS,
        "paddle: LTS/UTE concatenated by hand for bidirectional documents (`causal=False`)",
        "`to_flashmask(document(seq_lens), B, H, S, S)`",
        check_paddle_bidirectional_documents,
        PADDLE_DOCUMENT_CASES,
    ),
    Row(
        FORMATS,
        "paddle: LTS/UTE concatenated by hand for prefix-LM documents (each document's first "
        "tokens bidirectional, the rest causal)",
        "`to_flashmask((causal() | spans(prefix_ids)) & document(seq_lens), B, H, S, S)`",
        check_paddle_prefix_lm_documents,
        PADDLE_DOCUMENT_CASES,
    ),
    Row(
        FORMATS,
        "Magi: `infer_attn_mask_from_cu_seqlens(cu_seqlens, cu_seqlens, causal=True)`",
        "`m = to_magi(causal() & document(seq_lens), B, 1, S, S)`; `m.flex_flash_attn_kwargs()`",
        check_magi_cu_seqlens,
        MAGI_CASES,
    ),
    Row(
        FORMATS,
        "Magi: q/k ranges for an RL prompt and its responses, by hand",
        "`to_magi(tree(parents), B, 1, S, S)` (parents from `flexmask.pack_one_tree`)",
        check_magi_rl,
        RL_CASES,
    ),
    Row(
        MIGRATING,
        "`lambda b, h, q, kv: q >= kv`",
        "`flexmask.causal()`",
        _torch_row(lambda S, B: lambda b, h, q, kv: q >= kv, lambda S, B: flexmask.causal()),
        TORCH_CASES,
        "torch",
    ),
    Row(
        MIGRATING,
        "`doc_id[b, q] == doc_id[b, kv]`",
        "`flexmask.document(seq_lens)` (the lengths, not the ids)",
        _torch_row(_mm_doc, lambda S, B: flexmask.document(_seq_lens(S, B))),
        TORCH_CASES,
        "torch",
    ),
    Row(
        MIGRATING,
        "`(q < lens[b]) & (kv < lens[b])`",
        "`flexmask.padding(lens)`",
        _torch_row(_mm_padding, lambda S, B: flexmask.padding(_pad_lens(S, B))),
        TORCH_CASES,
        "torch",
    ),
    Row(
        MIGRATING,
        "`(q - kv).abs() < w`",
        "`flexmask.sliding_window(w)`",
        _torch_row(
            lambda S, B: _mm_window(_w(S, B)), lambda S, B: flexmask.sliding_window(_w(S, B))
        ),
        TORCH_CASES,
        "torch",
    ),
    Row(
        MIGRATING,
        "`kv < n`",
        "`flexmask.prefix(n)`",
        _torch_row(lambda S, B: _mm_prefix(_n(S, B)), lambda S, B: flexmask.prefix(_n(S, B))),
        TORCH_CASES,
        "torch",
    ),
    Row(
        MIGRATING,
        "`and_masks(f, g)`, `or_masks(f, g)`",
        "`f & g`, `f | g`",
        _torch_row(_combined_before, _combined_after),
        TORCH_CASES,
        "torch",
    ),
    Row(
        MIGRATING,
        "anything else",
        "`flexmask.from_mask_mod(fn, key=...)` ([interop](interop.md))",
        _torch_row(
            lambda S, B: _every_third_back,
            lambda S, B: flexmask.from_mask_mod(_every_third_back, key="every-third-back"),
        ),
        TORCH_CASES,
        "torch",
    ),
    Row(
        MIGRATING,
        "`causal_mask`",
        "`causal()`",
        _torch_row(lambda S, B: _gym().causal_mask, lambda S, B: causal()),
        GYM_CASES,
        "attn-gym",
    ),
    Row(
        MIGRATING,
        "`generate_doc_mask_mod(causal_mask, length_to_offsets(lengths, device))`",
        "`causal() & document(lengths)`",
        _torch_row(_gym_doc_before, _gym_doc_after),
        GYM_CASES,
        "attn-gym",
    ),
    Row(
        MIGRATING,
        "`generate_sliding_window(w)` (causal, `q - kv <= w`)",
        "`causal() & sliding_window(w + 1)`",
        _torch_row(
            lambda S, B: _gym().generate_sliding_window(_w(S, B)),
            lambda S, B: causal() & sliding_window(_w(S, B) + 1),
        ),
        GYM_CASES,
        "attn-gym",
    ),
    Row(
        MIGRATING,
        "`generate_prefix_lm_mask(n)` (`kv < n` or causal)",
        "`causal() | prefix(n)`",
        _torch_row(
            lambda S, B: _gym().generate_prefix_lm_mask(_n(S, B)),
            lambda S, B: causal() | prefix(_n(S, B)),
        ),
        GYM_CASES,
        "attn-gym",
    ),
    Row(
        MIGRATING,
        "any other `mask_mod`",
        "`from_mask_mod(mask_mod, key=...)`",
        _torch_row(
            lambda S, B: _gym().generate_dilated_sliding_window(5, 2),
            lambda S, B: flexmask.from_mask_mod(
                _gym().generate_dilated_sliding_window(5, 2), key=("dilated_sliding_window", 5, 2)
            ),
        ),
        GYM_CASES,
        "attn-gym",
    ),
]


def _row_id(row: Row) -> str:
    """The page and the start of the flexmask call, as a test id."""
    call = re.sub(r"[^\w.]+", "-", row.after.replace("flexmask.", "")).strip("-")
    return ":".join(filter(None, (row.page[:-3], row.table, call[:44])))


def _case_id(case: dict) -> str:
    parts = []
    for name, value in case.items():
        if name in ("rows", "docs", "groups"):
            parts.append(f"B{len(value)}")
        elif name != "blocks":
            parts.append(f"{name}{value}")
    return "-".join(parts)


@pytest.mark.parametrize(
    "row, case",
    [
        pytest.param(row, case, id=f"{_row_id(row)}:{_case_id(case)}")
        for row in ROWS
        for case in row.cases
    ],
)
def test_migration_row(row: Row, case: dict):
    row.check(case)


# ----------------------------------------------------------------- every row has a case
def _cells(line: str) -> list[str]:
    """A Markdown table line's cells: split on ``|`` outside code spans and not escaped
    (``\\|``, unescaped in the cell's text)."""
    cells, current, in_code, i = [], "", False, 0
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    while i < len(body):
        ch = body[i]
        if ch == "\\" and body[i + 1 : i + 2] == "|":
            current += "|"
            i += 2
            continue
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += ch
        i += 1
    cells.append(current.strip())
    return cells


def migration_tables(path: Path) -> list[tuple[list[str], list[tuple[str, ...]]]]:
    """The page's two-column tables whose second header names flexmask: (header, rows)."""
    tables, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        if (
            lines[i].startswith("|")
            and i + 1 < len(lines)
            and re.match(r"^\|[\s:|-]+$", lines[i + 1])
        ):
            header = _cells(lines[i])
            j, rows = i + 2, []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(tuple(_cells(lines[j])))
                j += 1
            if len(header) == 2 and "flexmask" in header[1].lower():
                tables.append((header, rows))
            i = j
        else:
            i += 1
    return tables


def test_every_migration_row_has_a_case():
    """Every row of every migration table in docs/ has a case above, and every case's row is
    still in docs/ as written: a new or reworded row fails here until it is tested."""
    documented, headers = set(), set()
    for path in sorted(DOCS.rglob("*.md")):
        for header, rows in migration_tables(path):
            page = path.relative_to(DOCS).as_posix()
            headers.add((page, tuple(header)))
            for row in rows:
                assert len(row) == 2, (page, row)
                documented.add((page, *row))
    # The tables this file was written for are found (the detection has not gone blind).
    assert {
        (FORMATS, ("what you write today", "the one flexmask call")),
        (MIGRATING, ("torch / hand-written mask_mod", "flexmask")),
        (MIGRATING, ("attn-gym", "flexmask")),
    } <= headers
    tested = {(row.page, row.before, row.after) for row in ROWS}
    assert all(row.cases for row in ROWS)
    untested = sorted(documented - tested)
    stale = sorted(tested - documented)
    assert not untested, f"migration rows in docs/ without a case in {__name__}: {untested}"
    assert not stale, f"cases whose row is no longer in docs/ (reworded?): {stale}"


def test_cells_split_like_the_rendered_table():
    assert _cells("| `a \\| b` | `f | g`, x |") == ["`a | b`", "`f | g`, x"]
    assert _cells("| a | b |") == ["a", "b"]


# ----------------------------------------------------------------- the old prefix-LM row
def test_old_prefix_lm_row_gave_only_the_first_document_its_prefix():
    """docs/formats.md used to give ``document(lens) & (causal() | prefix(n))`` for paddle's
    prefix-LM documents (issue #29): ``prefix(n)`` is ``kv < n`` in absolute positions, so the
    second document is causal where paddle's hand-written columns give it a prefix."""
    docs, S = [(2, 4), (3, 4)], 8
    hand = paddle_prefix_lm_columns(docs, S)[None, None]
    old = document([4, 4]) & (causal() | prefix(2))
    want = flashmask_dense(hand, False, S)[0, 0]
    got = ours(old, 1, 1, S)[0, 0]
    assert np.array_equal(got[:4], want[:4])  # the first document is right
    assert not np.array_equal(got[4:], want[4:])  # the second lost its prefix
    assert not got[4, 5] and want[4, 5]  # its first token no longer sees the prefix's second
