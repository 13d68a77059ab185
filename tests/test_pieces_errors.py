"""Bad input raises a clear error naming the argument — never a silently wrong mask."""

from __future__ import annotations

import pytest
import torch

import flexmask


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: flexmask.document([3, -2, 2]), ValueError, r"seq_lens\[1\] must be a document"),
        (lambda: flexmask.document([3, -1]), ValueError, r"seq_lens\[1\]"),
        (lambda: flexmask.document([]), ValueError, "at least one document"),
        (lambda: flexmask.document([[2], []]), ValueError, r"seq_lens\[1\].*at least one"),
        (lambda: flexmask.document([1.5, 2]), TypeError, r"seq_lens\[0\] must be an int"),
        (lambda: flexmask.document(torch.tensor([1.0, 2.0])), TypeError, "integers"),
        (lambda: flexmask.document([True, 2]), TypeError, r"seq_lens\[0\]"),
        (lambda: flexmask.document(torch.ones(2, 2, 2, dtype=torch.long)), ValueError, "1-D"),
        (lambda: flexmask.document("abc"), TypeError, "seq_lens"),
        (lambda: flexmask.padding(-1), ValueError, "lengths must be >= 0"),
        (lambda: flexmask.padding([3, -1]), ValueError, r"lengths\[1\] must be >= 0"),
        (lambda: flexmask.padding(2.0), TypeError, "lengths"),
        (lambda: flexmask.prefix(-2), ValueError, "length must be >= 0"),
        (lambda: flexmask.sliding_window(-1), ValueError, "size must be >= 0"),
        (lambda: flexmask.sliding_window(2**63), ValueError, "size must fit in a signed 64-bit"),
        (lambda: flexmask.tree([]), ValueError, "at least one token"),
        (lambda: flexmask.tree([-1, 1]), ValueError, r"parents\[1\]=1 is not a valid parent"),
        (lambda: flexmask.tree([-1, 0, 5]), ValueError, r"parents\[2\]=5"),
        (lambda: flexmask.tree([-1, -3]), ValueError, r"parents\[1\]=-3"),
        (lambda: flexmask.tree([0]), ValueError, r"parents\[0\]=0"),
        (lambda: flexmask.tree([[-1, 0], [-1, 1]]), ValueError, r"parents\[1\]\[1\]=1"),
        (lambda: flexmask.tree(torch.tensor([-1.0, 0.0])), TypeError, "integers"),
        (
            lambda: flexmask.padding([3, 4]) & flexmask.document([[2], [2], [2]]),
            ValueError,
            "2 and 3 batch rows",
        ),
        (lambda: flexmask.from_mask_mod(lambda b, h, q, kv: q >= kv), TypeError, "needs key"),
        (
            lambda: flexmask.from_mask_mod(lambda b, h, q, kv: q >= kv, key=[1]),
            TypeError,
            "hashable",
        ),
        (lambda: flexmask.from_mask_mod("causal", key="k"), TypeError, "callable"),
    ],
)
def test_bad_pieces(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(Q_LEN=-1), ValueError, "Q_LEN must be >= 0"),
        (dict(KV_LEN=-5), ValueError, "KV_LEN must be >= 0"),
        (dict(Q_LEN=2**63), ValueError, "Q_LEN must fit in a signed 64-bit"),
        (dict(Q_LEN=10.0), TypeError, "Q_LEN must be an int"),
        (dict(B=-1), ValueError, "B must be >= 0"),
        (dict(H="2"), TypeError, "H must be an int"),
        (dict(BLOCK_SIZE=0), ValueError, "BLOCK_SIZE must be >= 1"),
        (dict(BLOCK_SIZE=(64, -1)), ValueError, r"BLOCK_SIZE\[1\] must be >= 1"),
        (dict(BLOCK_SIZE=(1, 2, 3)), ValueError, "pair"),
        (dict(device="nonsense"), ValueError, "device must be"),
    ],
)
def test_bad_build_arguments(kwargs, error, match):
    args = dict(B=1, H=1, Q_LEN=16, KV_LEN=16, device="cpu")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        flexmask.create_block_mask(flexmask.causal(), **args)


def test_per_row_count_must_match_batch():
    mask = flexmask.causal() & flexmask.padding([5, 6, 7])
    with pytest.raises(ValueError, match="given for 3 batch rows but B=2"):
        flexmask.create_block_mask(mask, 2, 1, 8, 8, "cpu")
    # B=None takes the row count
    assert flexmask.create_block_mask(mask, None, 1, 8, 8, "cpu").kv_num_blocks.shape[0] == 3


def test_a_tree_longer_than_the_sequence_is_refused():
    # Lengths past the sequence are clipped (tests/test_pieces_edges.py); a tree's parents
    # are not a length, and a tree cut short would lose the nodes past the cut's ancestry.
    with pytest.raises(ValueError, match="parents has 12 tokens"):
        flexmask.create_block_mask(flexmask.tree([-1] * 12), 1, 1, 10, 10, "cpu")


def test_non_mask_argument():
    with pytest.raises(TypeError, match="flexmask Mask or a mask_mod"):
        flexmask.create_block_mask("causal", 1, 1, 8, 8, "cpu")


def test_mismatched_devices():
    mask = flexmask.causal() & flexmask.document(torch.tensor([3, 4]))  # a CPU tensor
    with pytest.raises(ValueError, match="seq_lens lives on cpu but the mask is built on meta"):
        flexmask.create_block_mask(mask, 1, 1, 8, 8, device="meta")
    # Python data has no device: it goes wherever the mask is built
    flexmask.create_block_mask(flexmask.document([3, 4]), 1, 1, 8, 8, device="cpu")


def test_custom_mask_mod_must_return_bool():
    bad = flexmask.from_mask_mod(lambda b, h, q, kv: q - kv, key="int-valued")
    with pytest.raises(TypeError, match="must return a bool tensor"):
        flexmask.create_block_mask(bad, 1, 1, 16, 16, "cpu")
