"""flexmask.create_block_mask lists the blocks torch's create_block_mask lists: the same
counts, blocks per row in the same order, and full/partial split — on random masks and on
the corners the builder once got silently wrong (issue #22: an edge block whose queries
attend nothing, a negated compound's edge tiles), each compared as whole tensors with
torch's own ``create_block_mask`` (uncompiled) on the mask's mask_mod, shifted to the window
as ``create_block_mask``'s docstring defines the offsets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.builders import make_grid
from flexmask.builders.classify import classify_blocks
from tests import oracle
from tests.strategies import SMALL_BLOCKS, expressions, negated_compounds

LENGTHS = [(1, 1), (5, 5), (127, 127), (128, 128), (129, 129), (300, 300), (300, 170), (90, 257)]
BLOCKS = [128, (64, 32), 16]


def pieces(q_len: int, kv_len: int):
    """One instance of every piece (and a few compositions) that fits these lengths."""
    n = max(q_len, kv_len)
    lens = [max(1, n // 3), max(1, n // 4)]
    lens = lens if sum(lens) <= n else [n]
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]  # a binary heap: not a preorder
    chain_pre = [-1] + [i - 1 if i % 7 else 0 for i in range(1, n)]  # a preorder layout
    return {
        "causal": (flexmask.causal(), [oracle.causal(q_len, kv_len)]),
        "full": (flexmask.full(), [np.ones((q_len, kv_len), bool)]),
        "empty": (flexmask.empty(), [np.zeros((q_len, kv_len), bool)]),
        "window": (flexmask.sliding_window(7), [oracle.sliding_window(7, q_len, kv_len)]),
        "prefix": (flexmask.prefix(max(1, n // 2)), [oracle.prefix(max(1, n // 2), q_len, kv_len)]),
        "padding": (
            flexmask.padding([n, max(1, n - 40)]),
            [oracle.padding(n, q_len, kv_len), oracle.padding(max(1, n - 40), q_len, kv_len)],
        ),
        "document": (flexmask.document(lens), [oracle.document(lens, q_len, kv_len)]),
        "document-causal": (
            flexmask.causal() & flexmask.document(lens),
            [oracle.document(lens, q_len, kv_len) & oracle.causal(q_len, kv_len)],
        ),
        "tree-heap": (flexmask.tree(parents), [oracle.tree(parents, q_len, kv_len)]),
        "tree-preorder": (flexmask.tree(chain_pre), [oracle.tree(chain_pre, q_len, kv_len)]),
        "prefix-lm": (
            flexmask.causal() | flexmask.prefix(max(1, n // 3)),
            [oracle.causal(q_len, kv_len) | oracle.prefix(max(1, n // 3), q_len, kv_len)],
        ),
        "not-window": (~flexmask.sliding_window(3), [~oracle.sliding_window(3, q_len, kv_len)]),
    }


@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
@pytest.mark.parametrize("block", BLOCKS)
def test_every_piece_matches_dense_oracle_and_torch(q_len, kv_len, block):
    for name, (mask, rows) in pieces(q_len, kv_len).items():
        B, H = max(len(rows), 2) if len(rows) > 1 else 2, 3
        rows = rows * B if len(rows) == 1 else rows
        dense = oracle.stack(rows, heads=H)
        context = f"{name} Q={q_len} KV={kv_len} block={block}"
        assert np.array_equal(mask.to_dense(B, H, q_len, kv_len, "cpu").numpy(), dense), context
        ours = flexmask.create_block_mask(mask, B, H, q_len, kv_len, "cpu", BLOCK_SIZE=block)
        oracle.assert_same_block_mask(ours, oracle.torch_build(dense, block=block), context)
        # and torch run on our own mask_mod agrees too
        theirs = torch_create_block_mask(mask.mask_mod, B, H, q_len, kv_len, "cpu", block)
        oracle.assert_same_block_mask(ours, theirs, context + " (torch on mask.mask_mod)")


@given(
    data=st.data(),
    batch=st.integers(1, 3),
    heads=st.integers(1, 2),
    q_len=st.integers(1, 200),
    kv_len=st.integers(1, 200),
    block=st.sampled_from([16, 32, (16, 8), 128]),
)
def test_random_expressions_match_oracle(data, batch, heads, q_len, kv_len, block):
    mask, reference = data.draw(expressions(batch, heads, min(q_len, kv_len)))
    dense = reference(q_len, kv_len)
    assert np.array_equal(mask.to_dense(batch, heads, q_len, kv_len, "cpu").numpy(), dense), mask
    ours = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    oracle.assert_same_block_mask(ours, oracle.torch_build(dense, block=block), repr(mask))


@settings(max_examples=100)
@given(
    data=st.data(),
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    block=SMALL_BLOCKS,
)
def test_random_expressions_on_tiny_tiles_match_oracle(data, batch, heads, q_len, kv_len, block):
    # Tiny tiles: most lengths leave an incomplete last tile row or column, which torch
    # lists only where an in-range element attends (a `~` over a compound included).
    length = max(q_len, kv_len)
    either = st.one_of(negated_compounds(batch, heads, length), expressions(batch, heads, length))
    mask, reference = data.draw(either)
    dense = reference(q_len, kv_len)
    ours = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    oracle.assert_same_block_mask(ours, oracle.torch_build(dense, block=block), repr(mask))


@given(
    seq_lens=st.lists(st.integers(1, 90), min_size=1, max_size=12),
    extra=st.integers(0, 70),
    block=st.sampled_from([16, 32, 64, 128]),
)
def test_document_causal_matches_attn_gym(seq_lens, extra, block):
    from attn_gym.masks import causal_mask, generate_doc_mask_mod
    from attn_gym.masks.document_mask import length_to_offsets

    total = sum(seq_lens)
    mask = flexmask.causal() & flexmask.document(seq_lens)
    offsets = length_to_offsets(seq_lens, "cpu")
    reference = generate_doc_mask_mod(causal_mask, offsets)
    ours = flexmask.create_block_mask(mask, 1, 1, total, total, "cpu", BLOCK_SIZE=block)
    theirs = torch_create_block_mask(reference, 1, 1, total, total, "cpu", BLOCK_SIZE=block)
    oracle.assert_same_block_mask(ours, theirs)
    # Past the documents flexmask masks everything; attn-gym's lookup cannot go there.
    longer = flexmask.create_block_mask(mask, 1, 1, total + extra, total + extra, "cpu", block)
    dense = oracle.stack(
        [
            oracle.document(seq_lens, total + extra, total + extra)
            & oracle.causal(total + extra, total + extra)
        ]
    )
    oracle.assert_same_block_mask(longer, oracle.torch_build(dense, block=block))


@pytest.mark.parametrize("S", [1, 100, 300])
@pytest.mark.parametrize("n", [1, 50, 128])
def test_prefix_lm_sliding_window_causal_match_attn_gym(S, n):
    from attn_gym.masks import causal_mask, generate_prefix_lm_mask, generate_sliding_window

    n = min(n, S)
    cases = [
        (flexmask.causal() | flexmask.prefix(n), generate_prefix_lm_mask(n)),
        # attn-gym's window counts the look-back distance inclusively: q - kv <= w.
        (flexmask.causal() & flexmask.sliding_window(n + 1), generate_sliding_window(n)),
        (flexmask.causal(), causal_mask),
    ]
    for ours_mask, theirs_mod in cases:
        ours = flexmask.create_block_mask(ours_mask, 2, 2, S, S, "cpu", BLOCK_SIZE=64)
        theirs = torch_create_block_mask(theirs_mod, 2, 2, S, S, "cpu", BLOCK_SIZE=64)
        oracle.assert_same_block_mask(ours, theirs, repr(ours_mask))


def test_attn_gym_mask_mod_as_leaf():
    from attn_gym.masks import generate_doc_mask_mod, generate_sliding_window
    from attn_gym.masks.document_mask import length_to_offsets

    lens = [40, 100, 60]
    window = flexmask.from_mask_mod(
        generate_sliding_window(16),
        key=("attn_gym.sliding_window", 16),
        batch_dependent=False,
        head_dependent=False,
    )
    doc = flexmask.from_mask_mod(
        generate_doc_mask_mod(lambda b, h, q, kv: q >= kv, length_to_offsets(lens, "cpu")),
        key=("attn_gym.doc_causal", tuple(lens)),
        batch_dependent=False,
        head_dependent=False,
    )
    mask = window & doc
    ours = flexmask.create_block_mask(mask, 1, 1, 200, 200, "cpu", BLOCK_SIZE=16)
    theirs = torch_create_block_mask(mask.mask_mod, 1, 1, 200, 200, "cpu", BLOCK_SIZE=16)
    oracle.assert_same_block_mask(ours, theirs)
    expected = flexmask.causal() & flexmask.sliding_window(17) & flexmask.document(lens)
    assert torch.equal(mask.to_dense(1, 1, 200, 200), expected.to_dense(1, 1, 200, 200))


def test_rows_and_heads_are_whole_tensors_of_their_own():
    # Drop-in: torch's tensors are (B, H, ...) contiguous; an in-place edit of one row and
    # head changes that one entry only, also where the mask ignores rows and heads.
    for mask in (
        flexmask.causal() & flexmask.document([300, 212]),
        flexmask.causal() & flexmask.padding([512, 300]),
        flexmask.tree([-1, 0, 1, 0, 3]) | flexmask.prefix(100),
    ):
        bm = flexmask.create_block_mask(mask, 2, 4, 512, 512, "cpu")
        for name in oracle.BLOCK_FIELDS:
            tensor = getattr(bm, name)
            assert tensor.shape[:2] == (2, 4) and tensor.is_contiguous(), name
            before = tensor.clone()
            tensor[1, 2, 0] = 7 if tensor.dim() == 3 else tensor[1, 2, 0].flip(0)
            changed = (tensor != before).reshape(2, 4, -1).any(-1)
            assert changed.sum() <= 1 and not changed[0].any(), name


def test_refinement_touches_only_undecided_tiles():
    S, block = 4096, 128
    lens = [1000, 1500, 1596]  # two boundaries inside diagonal tiles
    mask = flexmask.causal() & flexmask.document(lens)
    grid = make_grid(mask, 1, 1, S, S, "cpu", block)
    # An `&` of interval pieces is settled by its closed-form runs: nothing to refine.
    assert classify_blocks(mask, grid).refined == 0
    # structure alone decides a plain causal mask or a document mask
    assert classify_blocks(flexmask.causal(), grid).refined == 0
    assert classify_blocks(flexmask.tree(list(range(-1, S - 1))), grid).refined == 0
    # a custom leaf under causal: only the lower triangle is evaluated
    custom = flexmask.from_mask_mod(
        lambda b, h, q, kv: (q - kv) % 2 == 0,
        key="even",
        batch_dependent=False,
        head_dependent=False,
    )
    n = S // block
    assert classify_blocks(flexmask.causal() & custom, grid).refined == n * (n + 1) // 2


def test_plain_mask_mod_is_passed_to_torch():
    def causal_mod(b, h, q, kv):
        return q >= kv

    ours = flexmask.create_block_mask(causal_mod, 1, 1, 256, 256, "cpu")
    oracle.assert_same_block_mask(ours, torch_create_block_mask(causal_mod, 1, 1, 256, 256, "cpu"))


def test_block_mask_runs_in_flex_attention_eager():
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    mask = flexmask.causal() & flexmask.document([100, 57, 43]) | flexmask.prefix(3)
    q, k, v = (torch.randn(2, 2, 200, 16) for _ in range(3))
    bm = flexmask.create_block_mask(mask, 2, 2, 200, 200, "cpu", BLOCK_SIZE=64)
    out = flex_attention(q, k, v, block_mask=bm)
    row = (oracle.causal(200, 200) & oracle.document([100, 57, 43], 200, 200)) | oracle.prefix(
        3, 200, 200
    )
    dense = torch.from_numpy(oracle.stack([row, row], heads=2))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _whole(mask, q_end, kv_end):
    """The mask's mask_mod over every position up to the window's end."""
    span = max(q_end, kv_end)
    return mask.mask_mod_for(span, span)


# A kv offset past 0 and a q block holding every query that attends the window, whose first
# query's keys end before the window and whose last query attends nothing (past the
# padding or the documents): torch lists the block, the closed form listed none.
UNALIGNED_KV_OFFSET = [
    (flexmask.causal() & flexmask.padding(7), 11, 1, 0, 5, 4),
    (flexmask.causal() & flexmask.document([3, 3]), 7, 8, 0, 5, 4),
    (flexmask.document([7, 2]), 10, 11, 2, 8, 4),
    (flexmask.sliding_window(5) & flexmask.document([6, 3, 1]), 12, 6, 0, 9, 4),
    # the same corner on the union path (an operand's runs)
    (flexmask.prefix(1) | (flexmask.causal() & flexmask.padding(7)), 11, 3, 0, 5, 4),
]


@pytest.mark.parametrize(
    "mask, q_len, kv_len, q_offset, kv_offset, block",
    UNALIGNED_KV_OFFSET,
    ids=[f"{c[0]!r}-{c[1]}x{c[2]}-at-{c[3]},{c[4]}-{c[5]}" for c in UNALIGNED_KV_OFFSET],
)
def test_a_block_whose_edge_queries_attend_nothing_is_listed(
    mask, q_len, kv_len, q_offset, kv_offset, block
):
    ours = flexmask.create_block_mask(
        mask, 1, 1, q_len, kv_len, "cpu", block, q_offset=q_offset, kv_offset=kv_offset
    )
    oracle.assert_same_block_mask(
        ours,
        oracle.torch_build(
            _whole(mask, q_len + q_offset, kv_len + kv_offset),
            1,
            1,
            q_len,
            kv_len,
            block,
            q_offset=q_offset,
            kv_offset=kv_offset,
        ),
        repr(mask),
    )


# A `~` over an `&` or `|` whose codes came from closed-form runs: the incomplete edge tile
# was already demoted to partial, so `~` kept it partial where torch lists nothing.
NEGATED_COMPOUNDS = [
    (~(flexmask.causal() & flexmask.causal()), 1, 1, 8),
    (~(flexmask.causal() & flexmask.full()), 247, 247, 2),
    (~(flexmask.causal() | flexmask.prefix(3)), 13, 9, 4),
    (~((flexmask.causal() & flexmask.document([5, 6])) | flexmask.prefix(2)), 11, 11, (4, 3)),
]


@pytest.mark.parametrize(
    "mask, q_len, kv_len, block",
    NEGATED_COMPOUNDS,
    ids=[f"{c[0]!r}-{c[1]}x{c[2]}-{c[3]}" for c in NEGATED_COMPOUNDS],
)
def test_a_negated_compound_lists_no_edge_block_torch_would_not(mask, q_len, kv_len, block):
    ours = flexmask.create_block_mask(mask, 1, 1, q_len, kv_len, "cpu", block)
    theirs = torch_create_block_mask(mask.mask_mod, 1, 1, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    oracle.assert_same_block_mask(ours, theirs, repr(mask))
    assert ours.to_string() == theirs.to_string()  # same_blocks, as torch prints them


def test_the_last_row_of_a_negated_compound_lists_nothing():
    # ~(causal() & full()) at 247 with 2-blocks: the last, one-query block attends only
    # keys past itself, which lie in complete tiles; it listed 124 blocks.
    mask = ~(flexmask.causal() & flexmask.full())
    bm = flexmask.create_block_mask(mask, 1, 1, 247, 247, "cpu", 2)
    assert bm.kv_num_blocks[0, 0, -1].item() == 0
    assert bm.full_kv_num_blocks[0, 0, -1].item() == 0
