"""Tree builds that reuse the piece's kept rank/end lookups (one length at a time, with the
device copies) and take each q block's least rank from one pass: against torch's own
``create_block_mask`` as whole tensors, across lengths in turn and after a pickle."""

from __future__ import annotations

import pickle

from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from tests import oracle
from tests.test_build_tree_classifier import insertion_tree


def test_a_tree_rebuilt_at_other_lengths_matches_torch_each_time():
    """The lookups depend on the length (padded past the tree): 700 -> 1000 -> 700 -> 1000
    must not reuse the other length's pair. Insertion order (rank space), rows that differ,
    lengths off the block, the last q block partly past the tree."""
    trees = [insertion_tree(650, seed=1, sequences=7), insertion_tree(611, seed=2, sequences=4)]
    mask = flexmask.tree(trees)
    for length in (700, 1000, 700, 1000):
        for q_len, kv_len in ((length, length), (length - 37, length)):
            ours = flexmask.create_block_mask(mask, 2, 2, q_len, kv_len, "cpu", 16)
            theirs = torch_create_block_mask(mask.mask_mod, 2, 2, q_len, kv_len, "cpu", 16)
            oracle.assert_same_block_mask(ours, theirs, f"q={q_len} kv={kv_len}")


def test_a_pickled_tree_leaves_its_lookups_behind_and_still_matches_torch():
    parents = insertion_tree(500, seed=3, sequences=6)
    mask = flexmask.tree(parents)
    flexmask.create_block_mask(mask, 1, 1, 512, 512, "cpu", 32)
    blob = pickle.dumps(mask)
    assert len(blob) < len(pickle.dumps(flexmask.tree(parents))) + 64  # no lookups in it
    again = pickle.loads(blob)
    ours = flexmask.create_block_mask(again, 1, 1, 512, 512, "cpu", 32)
    theirs = torch_create_block_mask(again.mask_mod, 1, 1, 512, 512, "cpu", 32)
    oracle.assert_same_block_mask(ours, theirs, "after pickle")


def test_blocks_wholly_past_a_short_tree_list_nothing():
    """A tree shorter than the sequence by several blocks: those q blocks' least rank is a
    position past the tree (no padding to hide it), and torch lists nothing for them."""
    parents = [-1, 0, 1, 1, 0, 4, 2, 6] * 1 + list(range(7, 7 + 90))
    mask = flexmask.tree([parents, insertion_tree(300, seed=4, sequences=3)])
    for q_len in (256, 300):
        ours = flexmask.create_block_mask(mask, 2, 1, q_len, 300, "cpu", 16)
        theirs = torch_create_block_mask(mask.mask_mod, 2, 1, q_len, 300, "cpu", 16)
        oracle.assert_same_block_mask(ours, theirs, f"short tree q={q_len}")
        assert (
            int(ours.kv_num_blocks[0, 0, 10:].sum() + ours.full_kv_num_blocks[0, 0, 10:].sum()) == 0
        )
