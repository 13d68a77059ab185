"""``flexmask.gallery.attn_gym`` against attention-gym.

The reference is attention-gym's own mask_mod (``attn_gym.masks``, installed), called on
every (q, kv) pair.
Each gallery mask must attend exactly those pairs, and its BlockMask at B, H > 1 must equal
torch's own ``create_block_mask`` of the reference as whole tensors, at sizes that are not
multiples of the block and with small and unequal blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.gallery import attn_gym
from tests.oracle import assert_same_block_mask, torch_build

masks = pytest.importorskip("attn_gym.masks")

BLOCKS = st.sampled_from([4, 8, (8, 4), (4, 16), 16])


def reference_dense(mod, S):
    q = torch.arange(S).view(-1, 1)
    kv = torch.arange(S).view(1, -1)
    zero = torch.zeros((), dtype=torch.int64)
    return mod(zero, zero, q, kv).expand(S, S).to(torch.bool)


def check(mask, mod, S, block, B=2, H=3, context=""):
    want = reference_dense(mod, S)
    assert torch.equal(mask.to_dense(1, 1, S, S)[0, 0], want), context
    reference = torch_build(mod, B, H, S, S, block=block)
    ours = flexmask.create_block_mask(mask, B, H, S, S, device="cpu", BLOCK_SIZE=block)
    assert_same_block_mask(ours, reference, context)
    # A negation of the compound is exact too (rows that attend nothing, full rows).
    assert torch.equal((~mask).to_dense(1, 1, S, S)[0, 0], ~want), context


def offsets_from(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@settings(max_examples=12, deadline=None)
@given(S=st.integers(1, 70), w=st.integers(0, 20), block=BLOCKS)
def test_sliding_window_and_prefix_lm(S, w, block):
    check(attn_gym.sliding_window(w), masks.generate_sliding_window(w), S, block, context="sw")
    check(attn_gym.prefix_lm(w), masks.generate_prefix_lm_mask(w), S, block, context="plm")
    check(attn_gym.causal(), masks.causal_mask, S, block, context="causal")


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(0, 15), min_size=1, max_size=6), block=BLOCKS)
def test_packed_causal_doc(lengths, block):
    offsets = offsets_from(lengths)
    S = offsets[-1]
    if S == 0:
        return
    mod = masks.generate_packed_causal_doc_mask_mod(torch.tensor(offsets))
    check(attn_gym.packed_causal_doc(offsets), mod, S, block)


@st.composite
def shared_layouts(draw):
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=6))
    ids = []
    for doc in range(len(lengths)):
        prefixes = [d for d in range(doc) if ids[d] == d]
        ids.append(draw(st.sampled_from([doc, *prefixes])))
    return lengths, ids


@settings(max_examples=15, deadline=None)
@given(layout=shared_layouts(), block=BLOCKS)
def test_shared_prefix(layout, block):
    lengths, ids = layout
    offsets = offsets_from(lengths)
    mod = masks.generate_shared_prefix_mask_mod(torch.tensor(offsets), torch.tensor(ids))
    check(attn_gym.shared_prefix(offsets, ids), mod, offsets[-1], block, context=str(layout))


@settings(max_examples=15, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=70),
    w=st.integers(0, 9),
    block=BLOCKS,
)
def test_global_sliding_window(flags, w, block):
    is_global = torch.tensor(flags)
    mod = masks.generate_global_sliding_window(w, is_global)
    check(attn_gym.global_sliding_window(w, flags), mod, len(flags), block)


@settings(max_examples=12, deadline=None)
@given(S=st.integers(1, 70), w=st.integers(0, 20), d=st.integers(1, 6), block=BLOCKS)
def test_dilated_sliding_window(S, w, d, block):
    mod = masks.generate_dilated_sliding_window(w, d)
    check(attn_gym.dilated_sliding_window(w, d), mod, S, block)


@settings(max_examples=12, deadline=None)
@given(N=st.integers(1, 35), size=st.integers(1, 12), block=BLOCKS)
def test_block_diffusion(N, size, block):
    mod = masks.generate_block_diffusion_mask(N, size)
    check(attn_gym.block_diffusion(N, size), mod, 2 * N, block)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="window_size"):
        attn_gym.sliding_window(-1)
    with pytest.raises(TypeError, match="prefix_length"):
        attn_gym.prefix_lm(1.5)
    with pytest.raises(ValueError, match="offsets"):
        attn_gym.packed_causal_doc([1, 3])
    with pytest.raises(ValueError, match="prefix_document_id"):
        attn_gym.shared_prefix([0, 2, 4], [1, 1])  # the prefix after its continuation
    with pytest.raises(ValueError, match="prefix_document_id"):
        attn_gym.shared_prefix([0, 2, 4, 5], [0, 0, 1])  # a continuation's continuation
    with pytest.raises(ValueError, match="prefix_document_id"):
        attn_gym.shared_prefix([0, 2, 4], [0])
    with pytest.raises(ValueError, match="dilation"):
        attn_gym.dilated_sliding_window(3, 0)
    with pytest.raises(ValueError, match="block_size"):
        attn_gym.block_diffusion(8, 0)


def test_the_suite_size_builds_fast():
    """attention-gym's Longformer at cuDNN's 128K: built from structure, few partial blocks."""
    S = 128 * 1024
    flags = [False] * S
    for i in range(8):
        flags[(2 * i + 1) * S // 16] = True
    mask = attn_gym.global_sliding_window(256, flags)
    built = flexmask.create_block_mask(mask, 1, 1, S, S, device="cpu")
    n = S // 128
    global_blocks = {t // 128 for t in range(S) if flags[t]}
    want_total, want_full = [], []
    for r in range(n):
        if r in global_blocks:  # a global query row sees every key block
            want_total.append(n)
            want_full.append(len({r - 1, r, r + 1} & set(range(n))))
            continue
        band = set(range(max(0, (128 * r - 256) // 128), min(n - 1, (128 * r + 383) // 128) + 1))
        want_total.append(len(band | global_blocks))
        # Blocks r-1..r+1 lie within 255 of every query: full; global columns are single keys.
        want_full.append(len({r - 1, r, r + 1} & set(range(n))))
    total = built.kv_num_blocks + built.full_kv_num_blocks
    assert total[0, 0].tolist() == want_total
    assert built.full_kv_num_blocks[0, 0].tolist() == want_full
