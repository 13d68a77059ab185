"""``flexmask.gallery.attn_gym``'s doc_mask, jetspec_tree_causal, vision_cross_attention,
spatial_head, vsa and sta_2d/sta_3d against attention-gym's own generators (installed);
tests/test_gallery.py holds the module's other families to the same references.

The reference for every family is attn-gym's mask_mod, from its ``generate_*`` with the
same arguments: evaluated densely by torch's ``create_mask`` (vmap over B, H, Q, KV), and
built by torch's own ``create_block_mask`` (``tests.oracle.torch_build``), whose eight
tensors the gallery mask's BlockMask must equal whole. Sizes are drawn off the block size,
blocks small, B and H above 1, at the lengths each generator defines (attn-gym's lookups
index past them).
"""

from __future__ import annotations

import math

import pytest
import torch
from attn_gym.masks import (
    build_tree_ancestor_matrix,
    causal_mask,
    generate_doc_mask_mod,
    generate_jetspec_tree_causal_mask_mod,
    generate_sliding_window,
    generate_sta_mask_mod_2d,
    generate_sta_mask_mod_3d,
    generate_vision_cross_attention_mask_mod,
    generate_vsa_mask_mod,
)
from attn_gym.masks.document_mask import length_to_offsets
from attn_gym.masks.svg import generate_spatial_head_mask_mod
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask, noop_mask

import flexmask
from flexmask.algebra import leaves
from flexmask.gallery import attn_gym
from flexmask.pieces import FromMaskMod
from tests.oracle import assert_same_block_mask, torch_build

blocks = st.sampled_from([1, 2, 3, 4, 8, 16, (2, 4), (8, 2)])
heads = st.integers(1, 2)


def same_as_attn_gym(mask, mod, q_len, kv_len, B=1, H=1, block=4):
    """``mask`` attends where attn-gym's ``mod`` does, and builds torch's BlockMask of it."""
    assert not any(isinstance(leaf, FromMaskMod) for leaf in leaves(mask)), mask
    want = create_mask(mod, B, H, q_len, kv_len, device="cpu")
    got = mask.to_dense(B, H, q_len, kv_len)
    assert torch.equal(got, want), f"{mask!r}\n{got.int()}\n!=\n{want.int()}"
    ours = flexmask.create_block_mask(mask, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
    assert_same_block_mask(ours, torch_build(mod, B, H, q_len, kv_len, block=block), repr(mask))


document_lengths = st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(lambda x: sum(x))


@settings(max_examples=20)  # four masks a case
@given(document_lengths, blocks, heads, st.integers(0, 4), st.booleans())
def test_doc_mask(lengths, block, H, window, tensor):
    offsets = length_to_offsets(lengths, "cpu")
    given_offsets = offsets if tensor else offsets.tolist()
    S = sum(lengths)
    # generate_doc_mask_mod runs its mask_mod in each document's own positions.
    local = flexmask.causal() & flexmask.sliding_window(window + 1)
    same_as_attn_gym(
        attn_gym.doc_mask(local, given_offsets),
        generate_doc_mask_mod(generate_sliding_window(window), offsets),
        S,
        S,
        1,
        H,
        block,
    )
    same_as_attn_gym(
        attn_gym.doc_mask(causal_mask, offsets),
        generate_doc_mask_mod(causal_mask, offsets),
        S,
        S,
        2,
        1,
        block,
    )
    same_as_attn_gym(
        attn_gym.doc_mask(noop_mask, offsets), generate_doc_mask_mod(noop_mask, offsets), S, S
    )
    # A negated compound is still a mask of q_idx - kv_idx: the same inside every document.
    step = window % 3 + 1
    far = ~(flexmask.causal() & flexmask.sliding_window(window + 1)) | flexmask.pieces.dilated(step)

    def far_mod(b, h, q_idx, kv_idx):
        return ~((q_idx >= kv_idx) & (q_idx - kv_idx <= window)) | ((q_idx - kv_idx) % step == 0)

    same_as_attn_gym(
        attn_gym.doc_mask(far, offsets), generate_doc_mask_mod(far_mod, offsets), S, S, 1, 1, block
    )


@st.composite
def trees(draw):
    nodes = draw(st.integers(1, 12))
    return [-1] + [draw(st.integers(0, node - 1)) for node in range(1, nodes)]


@given(trees(), st.integers(0, 20), blocks, heads, st.booleans(), st.randoms())
def test_jetspec_tree_causal(parents, prefix_length, block, H, any_matrix, rng):
    ancestors = build_tree_ancestor_matrix(parents, "cpu")
    if any_matrix:  # the picks hold any boolean matrix, not only a tree's ancestors
        ancestors = (
            torch.rand(ancestors.shape, generator=torch.Generator().manual_seed(rng.randint(0, 99)))
            < 0.3
        )
    nodes = len(parents)
    same_as_attn_gym(
        attn_gym.jetspec_tree_causal(prefix_length, ancestors),
        generate_jetspec_tree_causal_mask_mod(prefix_length, ancestors),
        nodes,
        prefix_length + nodes,
        2,
        H,
        block,
    )


@st.composite
def image_intervals(draw):
    images = draw(st.integers(1, 4))
    scale = draw(st.sampled_from([1, 2, 3]))  # shared factors: query tiles above 1
    pairs = [
        sorted(draw(st.lists(st.integers(0, 8), min_size=2, max_size=2))) for _ in range(images)
    ]
    return torch.tensor(pairs) * scale


@settings(max_examples=25)
@given(image_intervals(), st.integers(1, 4), blocks, heads)
def test_vision_cross_attention(intervals, per_image, block, H):
    q_len = max(int(intervals.max()), 1)
    kv_len = intervals.shape[0] * per_image
    same_as_attn_gym(
        attn_gym.vision_cross_attention(intervals, per_image),
        generate_vision_cross_attention_mask_mod(intervals, per_image),
        q_len,
        kv_len,
        2,
        H,
        block,
    )


@given(
    st.integers(0, 5),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 3),
    st.booleans(),
    st.integers(1, 5),
    blocks,
)
def test_spatial_head(prompt, frames, per_frame, width, sink, round_width, block):
    S = prompt + frames * per_frame
    same_as_attn_gym(
        attn_gym.spatial_head(prompt, frames, per_frame, width, sink, round_width),
        generate_spatial_head_mask_mod(prompt, frames, per_frame, width, sink, round_width),
        S,
        S,
        1,
        2,
        block,
    )


@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 3),
    st.booleans(),
    st.randoms(),
    blocks,
)
def test_vsa(tile, q_tiles, kv_tiles, top_k, padded, rng, block):
    """Per (row, head, query tile) top-k key tiles, with and without padded key tiles."""
    top_k = min(top_k, kv_tiles)
    B, H = 2, 2
    topk = torch.tensor([rng.sample(range(kv_tiles), top_k) for _ in range(B * H * q_tiles)]).view(
        B, H, q_tiles, top_k
    )
    sizes = torch.tensor([rng.randint(0, tile) for _ in range(kv_tiles)]) if padded else None
    same_as_attn_gym(
        attn_gym.vsa(topk, tile, sizes),
        generate_vsa_mask_mod(topk, tile, sizes),
        q_tiles * tile,
        kv_tiles * tile,
        B,
        H,
        block,
    )


@st.composite
def sta_shapes(draw, axes):
    """Canvas and kernel as multiples of the tile (kernels of 0 tiles and wider than the
    canvas included), text tokens after the canvas."""
    tile = [draw(st.integers(1, 2)) for _ in range(axes)]
    canvas = tuple(t * draw(st.integers(1, 3)) for t in tile)
    kernel = tuple(t * draw(st.integers(0, 4)) for t in tile)
    return canvas, kernel, tuple(tile), draw(st.integers(0, 3))


@given(sta_shapes(2), sta_shapes(3), blocks, st.integers(0, 2))
def test_sta(shape_2d, shape_3d, block, extra):
    for make, generate, (canvas, kernel, tile, text) in (
        (attn_gym.sta_2d, generate_sta_mask_mod_2d, shape_2d),
        (attn_gym.sta_3d, generate_sta_mask_mod_3d, shape_3d),
    ):
        S = math.prod(canvas) + text
        # Queries past the text still attend the canvas and the text (attn-gym's rule).
        mask, reference = make(canvas, kernel, tile, text), generate(canvas, kernel, tile, text)
        same_as_attn_gym(mask, reference, S + extra, S, 1, 2, block)


def test_the_gallery_names_its_sources_generators():
    """Each function is the generator's name less ``generate_`` and ``_mask_mod``/``_mask``."""
    import attn_gym.masks as masks

    for name in attn_gym.__dict__:
        func = getattr(attn_gym, name)
        if name.startswith("_") or not callable(func) or func.__module__ != attn_gym.__name__:
            continue
        sources = {f"{name}_mask"} | {f"generate_{name}{end}" for end in ("", "_mask", "_mod")}
        sources.add(f"generate_{name}_mask_mod")
        stem, _, axes = name.rpartition("_")  # sta_2d: generate_sta_mask_mod_2d
        sources.add(f"generate_{stem}_mask_mod_{axes}")
        assert sources & set(dir(masks)), name


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="reads absolute positions"):
        attn_gym.doc_mask(flexmask.causal() | flexmask.prefix(2), [0, 3])
    with pytest.raises(ValueError, match="reads absolute positions"):
        attn_gym.doc_mask(flexmask.sliding_window(2, positions=[0, 1, 2]), [0, 3])
    with pytest.raises(TypeError, match="mask_mod must be a flexmask Mask"):
        attn_gym.doc_mask(lambda b, h, q, kv: q >= kv, [0, 3])
    with pytest.raises(ValueError, match="offsets must be cumulative"):
        attn_gym.doc_mask(flexmask.causal(), [1, 3])
    with pytest.raises(TypeError, match="prefix_length must be an int"):
        attn_gym.jetspec_tree_causal(2.0, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="ancestor_matrix must be a non-empty square"):
        attn_gym.jetspec_tree_causal(2, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="image_token_length must be >= 1"):
        attn_gym.vision_cross_attention(torch.tensor([[0, 2]]), 0)
    with pytest.raises(ValueError, match=r"intervals must be integer \(num_images, 2\)"):
        attn_gym.vision_cross_attention(torch.tensor([1.0, 2.0]), 2)
    with pytest.raises(ValueError, match="intervals must be positions >= 0"):
        attn_gym.vision_cross_attention(torch.tensor([[-1, 2]]), 2)
    with pytest.raises(ValueError, match="round_width must be >= 1"):
        attn_gym.spatial_head(round_width=0)
    with pytest.raises(ValueError, match="width must be >= 0"):
        attn_gym.spatial_head(width=-1)
    with pytest.raises(ValueError, match=r"topk_indices must have shape \(B, H, Q_TILES, TOP_K\)"):
        attn_gym.vsa(torch.zeros(2, 1, dtype=torch.long), 4)
    with pytest.raises(
        ValueError, match=r"variable_block_sizes must be 1-D real-token counts in \[0, 4\]"
    ):
        attn_gym.vsa(torch.zeros(1, 1, 2, 1, dtype=torch.long), 4, torch.tensor([5]))
    with pytest.raises(ValueError, match=r"canvas_hw must be multiples of tile_hw"):
        attn_gym.sta_2d((3, 4), (2, 2), (2, 2))
    with pytest.raises(ValueError, match=r"kernel_twh must be 3 sizes"):
        attn_gym.sta_3d((2, 2, 2), (2, 2), (1, 1, 1))
    with pytest.raises(ValueError, match=r"tile_hw must be 2 sizes \(tiles >= 1\)"):
        attn_gym.sta_2d((2, 2), (2, 2), (0, 1))
