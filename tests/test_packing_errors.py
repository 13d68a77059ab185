"""Bad packing inputs fail with an error that names the argument; valid ones are not refused.

Token ids index the vocabulary, so a negative one used to wrap silently (``x[-5]`` is
``x[V - 5]``); sizes whose padded tensors could never be allocated used to reach torch's
allocator. References are written by hand from the documented layouts: log_softmax gathered
at the positions the preorder layout documents, rows of tokens and padding spelled out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import flexmask._validate
from flexmask.packing import PackedDataset, PackingCollator, pack, pack_one_tree, pack_tree_batch

HUGE = 2**40
IGNORE = -100


# ------------------------------------------------------------------------------------------
# Negative token ids: refused everywhere an id indexes
# ------------------------------------------------------------------------------------------


def test_log_probs_of_the_issue_batch_match_a_hand_gather_and_a_negative_id_is_refused():
    # The issue's batch, with -5 (which gathered log p(token 5) at V = 10) refused ...
    with pytest.raises(ValueError, match=r"sequences\[0\]\[1\] is the token id -5.*>= 0"):
        pack_tree_batch([[7, -5, 2], [7, 3]], 4)
    # ... and the same batch with a real id: preorder [7, 5, 2, 3]; sequence 0's 5 and 2 are
    # predicted at positions 0 and 1, sequence 1's 3 at position 0 (the shared 7).
    batch = pack_tree_batch([[7, 5, 2], [7, 3]], 4)
    assert batch.tokens.tolist() == [[7, 5, 2, 3]]
    logits = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(logits[0].double(), dim=-1)
    expected = torch.tensor([[logp[0, 5], logp[1, 2]], [logp[0, 3], 0.0]])
    out = batch.log_probs(logits)
    torch.testing.assert_close(out.log_probs.double(), expected, atol=1e-6, rtol=0)
    assert out.mask.tolist() == [[True, True], [True, False]]


def test_the_last_id_of_the_vocabulary_is_gathered_and_one_past_it_is_refused():
    vocab = 6
    batch = pack_tree_batch([[0, vocab - 1]], 2)
    logits = torch.randn(1, 2, vocab, generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits[0].double(), dim=-1)[0, vocab - 1]
    got = batch.log_probs(logits).log_probs[0, 0]
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="V=5 entries but the targets go up to token 5"):
        batch.log_probs(logits[..., :5])


@pytest.mark.parametrize(
    "sequence",
    [[1, -5, 2], (1, -5, 2), torch.tensor([1, -5, 2]), np.array([1, -5, 2]), [1, np.int64(-5), 2]],
    ids=["list", "tuple", "tensor", "array", "numpy-int"],
)
@pytest.mark.parametrize(
    "call",
    [
        lambda seqs: pack(seqs, 4),
        lambda seqs: pack(seqs, 4, split_across_pack=True),
        lambda seqs: pack_one_tree(seqs),
        lambda seqs: pack_tree_batch(seqs, 4),
        lambda seqs: PackingCollator(4)(seqs),
        lambda seqs: next(iter(PackedDataset(seqs, 4))),
    ],
    ids=["pack", "pack-across", "pack_one_tree", "pack_tree_batch", "collator", "dataset"],
)
def test_a_negative_token_id_is_refused_by_every_packer(call, sequence):
    with pytest.raises(ValueError, match=r"sequences\[1\]\[1\] is the token id -5"):
        call([[3], sequence])


def test_a_negative_token_equal_to_ignore_index_no_longer_vanishes_from_the_labels():
    # Before, pack([[1, -100, 3]]) wrote -100 as the label of token 1: silently untrained.
    with pytest.raises(ValueError, match=r"sequences\[0\]\[1\] is the token id -100"):
        pack([[1, -100, 3]], 4)


@pytest.mark.parametrize(
    "call",
    [
        lambda: pack([[1]], 4, pad_id=-1),
        lambda: pack_one_tree([[1]], pad_to=4, pad_id=-1),
        lambda: pack_tree_batch([[1]], 4, pad_id=-1),
        lambda: PackingCollator(4, pad_id=-1),
        lambda: PackedDataset([[1]], 4, pad_id=-1),
        lambda: pack([[1]], 4, pad_id=np.int64(-1)),
    ],
    ids=["pack", "pack_one_tree", "pack_tree_batch", "collator", "dataset", "numpy"],
)
def test_a_negative_pad_id_is_refused(call):
    with pytest.raises(ValueError, match="pad_id must be >= 0, got -1"):
        call()


def test_a_negative_label_other_than_ignore_index_is_refused():
    with pytest.raises(ValueError, match=r"labels\[0\]\[1\] is -5; .* ignore_index=-100"):
        pack([[1, 2]], 4, labels=[[IGNORE, -5]])
    with pytest.raises(ValueError, match=r"labels\[1\]\[0\] is -100; .* ignore_index=-1"):
        pack([[1], [2]], 4, labels=[[-1], [-100]], ignore_index=-1)
    # The ignore index itself, whatever its value, is a label.
    batch = pack([[1, 2, 3]], 4, labels=[[-1, 2, -1]], ignore_index=-1)
    assert batch.labels.tolist() == [[2, -1, -1, -1]]


def test_log_probs_checks_every_token_and_pad_id_against_the_vocabulary():
    # A prompt token (never a target) past V: the model could not have embedded it.
    batch = pack_tree_batch([[1, 7, 3]], 4, prompt_lens=[2])
    with pytest.raises(ValueError, match="V=5 entries but the sequences hold token 7"):
        batch.log_probs(torch.zeros(1, 4, 5))
    batch = pack_tree_batch([[1, 2, 3]], 4, pad_id=9)
    with pytest.raises(ValueError, match=r"pad_id=9 is not a token of .* \(V=5\)"):
        batch.log_probs(torch.zeros(1, 4, 5))
    assert batch.log_probs(torch.zeros(1, 4, 10)).mask.all()


# ------------------------------------------------------------------------------------------
# Sizes too large to allocate: refused before allocating, with the bytes they need
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: pack([[1, 2]], HUGE), r"max_len=1099511627776 would need 24\.0 TiB"),
        (
            lambda: pack([[1, 2]], np.int64(HUGE), split_across_pack=True),
            r"max_len=1099511627776 would need 24\.0 TiB",
        ),
        (lambda: pack_one_tree([[1]], pad_to=HUGE), r"pad_to=1099511627776 would need 16\.0 TiB"),
        (lambda: pack_tree_batch([[1]], HUGE), r"max_tokens=1099511627776 would need 16\.0 TiB"),
        (
            lambda: pack_tree_batch([[1]], 8, num_rows=HUGE),
            r"num_rows=1099511627776 with max_tokens=8 would need 144\.0 TiB",
        ),
        (lambda: PackingCollator(HUGE), r"max_len=1099511627776 would need 24\.0 TiB"),
        (lambda: PackedDataset([[1]], HUGE), r"max_len=1099511627776 would need 24\.0 TiB"),
    ],
    ids=[
        "pack",
        "pack-across",
        "pack_one_tree",
        "pack_tree_batch",
        "num_rows",
        "collator",
        "dataset",
    ],
)
def test_a_size_that_cannot_be_allocated_names_the_argument_and_the_bytes(call, pattern):
    with pytest.raises(ValueError, match=pattern + ".* of memory this process can have"):
        call()


def test_the_rule_refuses_just_above_the_memory_limit_and_accepts_at_it(monkeypatch):
    # 1 MiB of memory: pack needs 24 bytes per slot, pack_one_tree 16 per position, pack_tree_batch
    # 16 per slot + 16 per row.
    monkeypatch.setattr(flexmask._validate, "device_memory", lambda device: 2**20)
    fits, over = 2**20 // 24, 2**20 // 24 + 1
    assert pack([[1]], fits).tokens.shape == (1, fits)
    with pytest.raises(ValueError, match=rf"max_len={over} would need 1\.0 MiB .* for tokens"):
        pack([[1]], over)
    with pytest.raises(ValueError, match=rf"max_len={over} would need"):
        PackingCollator(over)
    # Two rows of half the length need as much as one full one.
    with pytest.raises(ValueError, match=rf"max_len={over // 2 + 1} .* 2 x {over // 2 + 1}"):
        pack([[1] * (over // 2), [2] * (over // 2)], over // 2 + 1)
    assert pack_one_tree([[1]], pad_to=2**16).length == 2**16
    with pytest.raises(ValueError, match=rf"pad_to={2**16 + 1} would need 1\.0 MiB"):
        pack_one_tree([[1]], pad_to=2**16 + 1)
    assert pack_tree_batch([[1]], 2**16 - 1).tokens.shape == (1, 2**16 - 1)
    with pytest.raises(ValueError, match=f"max_tokens={2**16} would need"):
        pack_tree_batch([[1]], 2**16)
    with pytest.raises(ValueError, match="num_rows=2 with max_tokens=40000 would need"):
        pack_tree_batch([[1]], 40000, num_rows=2)


def test_the_memory_limit_is_at_most_the_machine_ram():
    limit = flexmask._validate.host_memory()
    try:
        with open("/proc/meminfo") as file:
            total = next(
                int(line.split()[1]) * 1024 for line in file if line.startswith("MemTotal")
            )
    except OSError:
        pytest.skip("no /proc/meminfo to read the machine's RAM from")
    assert limit is not None and 0 < limit <= total


def test_a_large_row_that_fits_is_packed_like_a_plain_reference():
    # 2**20 tokens a row: 24 MiB, legitimate, so accepted; checked slot by slot.
    length = 2**20
    batch = pack([[5, 6, 7]], length, pad_id=9)
    tokens = [5, 6, 7] + [9] * (length - 3)
    labels = [6, 7] + [IGNORE] * (length - 2)
    positions = [0, 1, 2] + [0] * (length - 3)
    assert batch.tokens.tolist() == [tokens]
    assert batch.labels.tolist() == [labels]
    assert batch.position_ids.tolist() == [positions]
    tree = pack_one_tree([[5, 6], [5, 7]], pad_to=length, pad_id=9)
    assert tree.tokens.tolist() == [5, 6, 7] + [9] * (length - 3)
    assert tree.position_ids.tolist() == [0, 1, 1] + [0] * (length - 3)


# ------------------------------------------------------------------------------------------
# Valid inputs that used to be refused; numpy integers wherever Python ints are taken
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_lens",
    [[2, 1], (2, 1), torch.tensor([2, 1]), np.array([2, 1]), np.array([2, 1], dtype=np.int32)],
    ids=["list", "tuple", "tensor", "array", "int32-array"],
)
def test_prompt_lens_as_an_array_is_a_prompt_length_per_sequence(prompt_lens):
    # Preorder [1, 2, 3, 4]: sequence 0 trains 3 (predicted at 1), sequence 1 trains 4 (at 0).
    batch = pack_tree_batch([[1, 2, 3], [1, 4]], 4, prompt_lens=prompt_lens)
    assert batch.tokens.tolist() == [[1, 2, 3, 4]]
    logits = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(2))
    logp = torch.log_softmax(logits[0].double(), dim=-1)
    expected = torch.tensor([[logp[1, 3]], [logp[0, 4]]])
    out = batch.log_probs(logits)
    torch.testing.assert_close(out.log_probs.double(), expected, atol=1e-6, rtol=0)
    assert out.mask.all()


@pytest.mark.parametrize(
    "mask",
    [
        [False, False, True],
        [np.False_, np.False_, np.True_],
        [np.int64(0), np.int8(0), np.int32(1)],
        [torch.tensor(False), torch.tensor(0), torch.tensor(1)],
        np.array([False, False, True]),
    ],
    ids=["bools", "numpy-bools", "numpy-ints", "0-d-tensors", "array"],
)
def test_loss_mask_entries_may_be_numpy_scalars_or_0d_tensors(mask):
    # Only token 2 (the 3) is trained on: the label at position 1 predicts it.
    batch = pack([[1, 2, 3]], 4, loss_mask=[mask])
    assert batch.labels.tolist() == [[IGNORE, 3, IGNORE, IGNORE]]


@pytest.mark.parametrize("bad", [np.float64(1.0), 0.5, "1", torch.tensor(1.0)])
def test_loss_mask_entries_that_are_not_bools_are_still_refused(bad):
    with pytest.raises(TypeError, match=r"loss_mask\[0\] holds"):
        pack([[1, 2]], 4, loss_mask=[[True, bad]])


@pytest.mark.parametrize("index", [1, np.int64(1), np.int8(1), torch.tensor(1)])
def test_sequence_index_takes_numpy_integers_and_0d_tensors(index):
    batch = pack([[7, 8], [9]], 2)  # one row each, in input order (equal rows: none shared)
    rows, positions = batch.sequence_index(index)
    assert batch.tokens[rows, positions].tolist() == [9]
    tree = pack_one_tree([[1, 2], [1, 3]])  # preorder [1, 2, 3]: sequence 1 is positions 0, 2
    assert tree.sequence_index(index).tolist() == [0, 2]
    trees = pack_tree_batch([[1, 2], [1, 3]], 3)
    assert trees.sequence_index(index)[1].tolist() == [0, 2]


@pytest.mark.parametrize("index", [-1, np.int64(-1), torch.tensor(-1), 2])
def test_sequence_index_does_not_wrap_a_negative_index(index):
    with pytest.raises(IndexError, match=r"i must be in \[0, 2\)"):
        pack([[7, 8], [9]], 2).sequence_index(index)
    with pytest.raises(IndexError, match=r"i must be in \[0, 2\)"):
        pack_one_tree([[1, 2], [1, 3]]).sequence_index(index)
    with pytest.raises(IndexError, match=r"i must be in \[0, 2\)"):
        pack_tree_batch([[1, 2], [1, 3]], 3).sequence_index(index)


def test_numpy_integers_are_taken_wherever_python_ints_are():
    batch = pack(
        [np.array([1, 2, 3]), [np.int64(4)]],
        np.int32(4),
        pad_id=np.uint8(9),
        ignore_index=np.int16(-7),
    )
    assert batch.tokens.tolist() == [[1, 2, 3, 4]]
    assert batch.labels.tolist() == [[2, 3, -7, -7]]
    assert batch.max_len == 4 and type(batch.max_len) is int

    tree = pack_one_tree([[1, 2], [1, 3]], pad_to=np.int64(5), pad_id=np.int32(9))
    assert tree.tokens.tolist() == [1, 2, 3, 9, 9]

    trees = pack_tree_batch(
        np.array([[1, 2, 3], [1, 2, 4]]),
        np.int64(4),
        prompt_lens=[np.int64(2), np.int32(2)],
        num_rows=np.int8(2),
        pad_id=np.uint8(9),
    )
    assert trees.tokens.tolist() == [[1, 2, 3, 4], [9, 9, 9, 9]]
    logits = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(3))
    out = trees.log_probs(logits, temperature=np.float32(0.5), rows=slice(np.int64(0), 1))
    logp = torch.log_softmax(logits[0].double() / 0.5, dim=-1)
    expected = torch.tensor([[logp[1, 3]], [logp[1, 4]]])
    torch.testing.assert_close(out.log_probs.double(), expected, atol=1e-6, rtol=0)

    collate = PackingCollator(np.int64(4), np.int64(2), block_size=np.int64(4), pad_id=np.int8(9))
    loaded = next(iter(DataLoader([[1, 2], [3]], batch_size=2, collate_fn=collate)))
    assert loaded.tokens.tolist() == [[1, 2, 3, 9]]
    assert (collate.max_len, collate.num_heads, collate.block_size, collate.pad_id) == (4, 2, 4, 9)
    assert loaded.handle.block_mask.BLOCK_SIZE == (4, 4)
    batches = list(PackedDataset([[1], [2], [3]], np.int64(2), buffer_size=np.int64(2)))
    assert [b.tokens.tolist() for b in batches] == [[[1, 2]], [[3, 0]]]
