"""Masks are values: structural equality and hashing, operator laws, pictures."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexmask
from tests.strategies import expressions


def test_equal_content_means_equal_and_same_hash():
    a = flexmask.causal() & flexmask.document([3, 4, 5])
    b = flexmask.document(torch.tensor([3, 4, 5])) & flexmask.causal()
    assert a == b and hash(a) == hash(b)
    assert a != flexmask.causal() & flexmask.document([3, 4, 6])
    assert flexmask.tree([-1, 0, 1]) == flexmask.tree(torch.tensor([-1, 0, 1], dtype=torch.int32))
    assert flexmask.tree([-1, 0, 1]) != flexmask.tree([-1, 0, 0])
    assert flexmask.padding([3, 4]) != flexmask.padding([4, 3])
    assert flexmask.padding(4) != flexmask.padding([4])  # shared vs one row
    assert flexmask.sliding_window(3) != flexmask.prefix(3)
    assert len({flexmask.causal(), flexmask.causal(), flexmask.full()}) == 2


def test_key_never_uses_identity():
    lens = torch.tensor([5, 6])
    a = flexmask.document(lens)
    lens[0] = 7  # the mask copied its data: mutating the input changes nothing
    assert a == flexmask.document([5, 6])
    assert a.to_dense(1, 1, 11, 11).equal(flexmask.document([5, 6]).to_dense(1, 1, 11, 11))


def test_bool_raises_with_the_fix():
    with pytest.raises(TypeError, match=r"a & b"):
        _ = flexmask.causal() and flexmask.full()
    with pytest.raises(TypeError, match="truth value"):
        if flexmask.causal():
            pass


def test_operators_only_combine_masks():
    with pytest.raises(TypeError, match="from_mask_mod"):
        _ = flexmask.causal() & (lambda b, h, q, kv: q >= kv)
    with pytest.raises(TypeError):
        _ = flexmask.causal() | 1


def test_double_negation_and_flattening():
    c = flexmask.causal()
    assert ~~c == c
    m = c & flexmask.full() & flexmask.sliding_window(2)
    assert isinstance(m, flexmask.algebra.And) and len(m.children) == 3


@given(data=st.data(), q_len=st.integers(1, 40), kv_len=st.integers(1, 40))
def test_laws_hold_on_dense(data, q_len, kv_len):
    length = min(q_len, kv_len)
    a, _ = data.draw(expressions(2, 1, length, max_leaves=2))
    b, _ = data.draw(expressions(2, 1, length, max_leaves=2))

    def dense(m):
        return m.to_dense(2, 1, q_len, kv_len, "cpu")

    assert dense(~(a & b)).equal(dense(~a | ~b))  # De Morgan
    assert dense(~(a | b)).equal(dense(~a & ~b))
    assert dense(a & flexmask.full()).equal(dense(a))
    assert dense(a | flexmask.empty()).equal(dense(a))
    assert dense(a & flexmask.empty()).equal(dense(flexmask.empty()))
    assert dense(a & b).equal(dense(b & a))
    assert a & b == b & a


def test_show_pictures():
    assert flexmask.causal().show(2) == "■ ⬚\n■ ■"
    picture = (flexmask.causal() | flexmask.prefix(2)).show(3)
    assert picture.splitlines() == ["■ ■ ⬚", "■ ■ ⬚", "■ ■ ■"]
    assert flexmask.padding([2, 1]).show(2, batch=1) == "■ ⬚\n⬚ ⬚"


def test_masks_pickle_and_keep_their_value():
    m = flexmask.causal() & flexmask.tree([-1, 0, 0, 2]) | flexmask.prefix([1, 2])
    m2 = pickle.loads(pickle.dumps(m))
    assert m2 == m
    assert m2.to_dense(2, 1, 4, 4).equal(m.to_dense(2, 1, 4, 4))


def test_mask_mod_works_beyond_the_data_and_under_vmap():
    from torch.nn.attention.flex_attention import create_mask

    m = flexmask.causal() & flexmask.document([2, 3])
    dense = create_mask(m.mask_mod, 1, 1, 8, 8, device="cpu")  # longer than sum(seq_lens)
    assert dense.equal(m.to_dense(1, 1, 8, 8))
    assert not dense[0, 0, 5:].any() and not dense[0, 0, :, 5:].any()


def test_tree_preorder_detection():
    assert flexmask.tree([-1, 0, 1, 0, 3]).preorder == [True]
    heap = flexmask.tree([-1, 0, 0, 1, 1, 2])  # BFS numbering
    assert heap.preorder == [False]
    ref = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert heap.to_dense(1, 1, 6, 6)[0, 0].int().tolist() == ref


def test_show_crops_a_window_of_long_data_without_evaluating_it_all():
    from tests import oracle

    parents = [-1] + [i - 1 if i % 5 else 0 for i in range(1, 40_000)]  # 40k tokens
    picture = flexmask.tree(parents).show(6, 4)
    expected = oracle.tree(parents[:6], 6, 4)
    assert picture.splitlines() == [
        " ".join("■" if x else "⬚" for x in row) for row in expected.tolist()
    ]
    with pytest.raises(ValueError, match=r"batch must be in \[0, 2\)"):
        flexmask.padding([2, 1]).show(2, batch=2)
