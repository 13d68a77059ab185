"""One shape signature: every entry that takes a shape reads ``(mask, B, H, Q_LEN, KV_LEN)`` in
torch's order, ``KV_LEN`` defaulting to ``Q_LEN``; the pre-0.2 forms warn where they have one
reading and raise where the two orders would give different results."""

from __future__ import annotations

import warnings

import pytest
import torch

import flexmask
from flexmask.formats import to_fa4, to_flashmask, to_magi, to_varlen

MASK = flexmask.causal() & flexmask.document([5, 3])


def magi_pairs(m, rows, q_len, kv_len):
    """The (row, q, kv) pairs a Magi lowering attends, from its documented slice types."""
    pairs = set()
    for (qs, qe), (ks, ke), kind in zip(
        m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), strict=True
    ):
        for q in range(qs, qe):
            for k in range(ks, ke):
                i, j = q - qs, k - ks
                causal = j - (ke - ks) <= i - (qe - qs)  # bottom-right aligned
                inverse = j >= i  # top-left aligned
                keep = {0: True, 1: causal, 2: inverse, 3: causal and inverse}[kind]
                if keep:
                    pairs.add((q // q_len, q % q_len, k - (q // q_len) * kv_len))
    return pairs


def dense_pairs(mask, rows, q_len, kv_len):
    dense = mask.to_dense(rows, 1, q_len, kv_len)[:, 0]
    return {tuple(i) for i in dense.nonzero().tolist()}


@pytest.mark.parametrize("lower", [to_magi, to_varlen, to_flashmask, to_fa4])
def test_every_lowering_reads_torchs_order(lower):
    """(mask, B, H, Q_LEN, KV_LEN), KV_LEN defaulting to Q_LEN, by position or keyword."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = lower(MASK, 2, 1, 8, 8)
        by_keyword = lower(MASK, 2, 1, Q_LEN=8)
    assert repr(full) == repr(by_keyword)


def test_magi_in_the_new_order_is_the_dense_reference():
    m = to_magi(MASK, 2, 1, 8, 8)
    assert magi_pairs(m, 2, 8, 8) == dense_pairs(MASK, 2, 8, 8)
    short = to_magi(MASK, 1, 1, 3, 8)  # three queries against eight keys
    assert magi_pairs(short, 1, 3, 8) == dense_pairs(MASK, 1, 3, 8)


@pytest.mark.parametrize("lower", [to_magi, to_varlen])
def test_the_old_two_argument_form_warns_and_keeps_its_meaning(lower):
    with pytest.warns(DeprecationWarning, match=rf"{lower.__name__}\(mask, 2, 1, 8\)"):
        old = lower(MASK, 2, 8)
    assert repr(old) == repr(lower(MASK, 2, None, 8, 8))


@pytest.mark.parametrize("lower", [to_magi, to_varlen])
def test_an_old_call_that_reads_two_ways_is_an_error_naming_both(lower):
    """``to_magi(mask, 1, 1, 8)``: (B=1, Q_LEN=1, KV_LEN=8) before, (B=1, H=1, Q_LEN=8) now."""
    with pytest.raises(TypeError) as err:
        lower(MASK, 1, 1, 8)
    message = str(err.value)
    assert "B=1, Q_LEN=1, KV_LEN=8" in message and "B=1, H=1, Q_LEN=8, KV_LEN=8" in message
    assert f"{lower.__name__}(mask, 1, 1, 1, 8)" in message


def test_an_old_call_whose_readings_agree_warns_and_lowers_alike():
    with pytest.warns(DeprecationWarning, match="Q_LEN=KV_LEN=8"):
        old = to_magi(MASK, 2, 8, 8)
    assert magi_pairs(old, 2, 8, 8) == dense_pairs(MASK, 2, 8, 8)


@pytest.mark.parametrize("entry", ["lazy", "create_block_mask", "cache"])
def test_kv_len_defaults_to_q_len(entry):
    make = {
        "lazy": lambda *a: flexmask.lazy(*a).block_mask,
        "create_block_mask": flexmask.create_block_mask,
        "cache": lambda *a: flexmask.MaskCache(4).get(*a),
    }[entry]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bm = make(MASK, 1, 1, 512)
    assert bm.seq_lengths == (512, 512)
    want = torch.nn.attention.flex_attention.create_block_mask(
        MASK.mask_mod, 1, 1, 512, 512, device="cpu"
    )
    assert torch.equal(bm.to_dense(), want.to_dense())


@pytest.mark.parametrize("entry", ["lazy", "create_block_mask"])
def test_no_q_len_warns_and_builds_the_old_default(entry):
    make = {
        "lazy": lambda m: flexmask.lazy(m).block_mask,
        "create_block_mask": flexmask.create_block_mask,
    }
    with pytest.warns(DeprecationWarning, match="without Q_LEN"):
        bm = make[entry](flexmask.causal())
    assert bm.seq_lengths == (128, 128)


def test_to_dense_reads_torchs_order():
    with pytest.raises(TypeError, match=r"to_dense\(1, 1, 512, 512\)"):
        flexmask.causal().to_dense(512, 512)
    assert flexmask.causal().to_dense(1, 1, 6).shape == (1, 1, 6, 6)
    assert torch.equal(flexmask.causal().to_dense(1, 1, 6)[0, 0], torch.ones(6, 6).tril().bool())
    with pytest.warns(DeprecationWarning, match="to_dense"):
        assert flexmask.causal().to_dense().shape == (1, 1, 1, 1)
