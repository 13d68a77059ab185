"""SFT packing: labels and loss masks travel with the tokens; split_across_pack keeps every token.

References are plain walks over the input sequences, written without flexmask's tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmask.packing import pack
from tests import oracle
from tests.tiny import tiny_model

IGNORE, PAD = -7, 99  # PAD: above every token drawn (0..50), so padding shows
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def masked_batches(draw, max_count=8, longest=20):
    """Sequences with a loss mask each (True = trained on)."""
    sequences = draw(
        st.lists(
            st.lists(st.integers(0, 50), min_size=1, max_size=longest),
            min_size=1,
            max_size=max_count,
        )
    )
    masks = [draw(st.lists(st.booleans(), min_size=len(s), max_size=len(s))) for s in sequences]
    return sequences, masks


def reference_labels(batch, targets):
    """(B, max_len) labels by walking every chunk of every sequence: the next target in the
    chunk, IGNORE at the chunk's last token and at padding."""
    labels = [[IGNORE] * batch.max_len for _ in range(batch.num_rows)]
    for i, chunks in enumerate(batch.placement):
        offset = 0  # where the chunk starts inside sequence i
        for chunk in chunks:
            for t in range(chunk.length - 1):
                labels[chunk.row][chunk.start + t] = targets[i][offset + t + 1]
            offset += chunk.length
    return labels


def document_of(seq_lens, max_len):
    """Per row, the document number of every position (-1 at padding)."""
    rows = []
    for lens in seq_lens:
        row = [-1] * max_len
        start = 0
        for d, n in enumerate(lens):
            row[start : start + n] = [d] * n
            start += n
        rows.append(row)
    return rows


@FAST
@given(
    data=masked_batches(),
    max_len=st.integers(1, 24),
    split_across_pack=st.booleans(),
    strategy=st.sampled_from(["first_fit_decreasing", "best_fit_decreasing", "next_fit"]),
)
def test_loss_mask_labels_equal_a_by_hand_walk_and_never_cross_a_document(
    data, max_len, split_across_pack, strategy
):
    sequences, masks = data
    batch = pack(
        sequences,
        max_len,
        loss_mask=masks,
        ignore_index=IGNORE,
        pad_id=PAD,
        strategy=strategy,
        split_across_pack=split_across_pack,
    )
    targets = [
        [t if keep else IGNORE for t, keep in zip(seq, mask, strict=True)]
        for seq, mask in zip(sequences, masks, strict=True)
    ]
    assert batch.labels.tolist() == reference_labels(batch, targets)

    # Independently of the walk: a label is the token right after it, in the same document,
    # and that token is one the mask trains on.
    docs = document_of(batch.seq_lens, max_len)
    trained = {}
    for i, chunks in enumerate(batch.placement):
        offset = 0
        for c in chunks:
            for t in range(c.length):
                trained[(c.row, c.start + t)] = masks[i][offset + t]
            offset += c.length
    for b, row in enumerate(batch.labels.tolist()):
        for p, label in enumerate(row):
            if label == IGNORE:
                continue
            assert p + 1 < max_len and docs[b][p] == docs[b][p + 1] != -1
            assert label == int(batch.tokens[b, p + 1]) and trained[(b, p + 1)]
    # Every trained token that is not the first of its chunk is some position's target.
    num_targets = sum(
        sum(masks[i][offset + 1 : offset + c.length])
        for i, chunks in enumerate(batch.placement)
        for offset, c in zip(
            np.cumsum([0] + [c.length for c in chunks]).tolist(), chunks, strict=False
        )
    )
    assert int((batch.labels != IGNORE).sum()) == num_targets


@FAST
@given(data=masked_batches(), max_len=st.integers(1, 24))
def test_labels_argument_equals_the_loss_mask_it_encodes(data, max_len):
    sequences, masks = data
    labels = [
        [t if keep else -100 for t, keep in zip(seq, mask, strict=True)]
        for seq, mask in zip(sequences, masks, strict=True)
    ]
    by_labels = pack(sequences, max_len, labels=labels)
    by_mask = pack(sequences, max_len, loss_mask=[torch.tensor(m) for m in masks])
    assert torch.equal(by_labels.labels, by_mask.labels)
    assert torch.equal(by_labels.tokens, by_mask.tokens)
    # All-True masks are the default labels.
    everything = pack(sequences, max_len, loss_mask=[[True] * len(s) for s in sequences])
    assert torch.equal(everything.labels, pack(sequences, max_len).labels)


def test_labels_may_differ_from_the_tokens():
    # Labels are per-token targets of any value (a distillation target, a class id): they are
    # shifted by one inside the document and nothing else.
    batch = pack([[1, 2, 3], [4, 5]], 8, labels=[[10, 20, 30], [40, 50]], strategy="next_fit")
    assert batch.labels.tolist() == [[20, 30, -100, 50, -100, -100, -100, -100]]


@FAST
@given(
    sequences=st.lists(
        st.lists(st.integers(0, 50), min_size=1, max_size=30), min_size=1, max_size=10
    ),
    max_len=st.integers(1, 16),
)
def test_split_across_pack_round_trip_loses_no_token_and_fills_every_row(sequences, max_len):
    batch = pack(sequences, max_len, split_across_pack=True, pad_id=PAD, ignore_index=IGNORE)
    assert [t.tolist() for t in batch.unpack(batch.tokens)] == sequences
    # End to end in input order: the rows, read left to right, are the concatenation.
    flat = [t for seq in sequences for t in seq]
    assert batch.tokens.flatten().tolist()[: len(flat)] == flat
    assert all(sum(lens) == max_len for lens in batch.seq_lens[:-1])
    assert batch.num_rows == -(-len(flat) // max_len)
    # Continuations restart at position 0, and each chunk's document is causal alone.
    for b, lens in enumerate(batch.seq_lens):
        expected_positions = [p for n in lens for p in range(n)]
        row = batch.position_ids[b].tolist()
        assert row[: len(expected_positions)] == expected_positions
    dense = batch.mask.to_dense(batch.num_rows, 1, max_len, max_len)[:, 0].numpy()
    for b, lens in enumerate(batch.seq_lens):
        reference = oracle.causal(max_len, max_len) & oracle.document(lens, max_len, max_len)
        assert (dense[b] == reference).all()


def test_split_across_pack_example_positions_and_labels():
    batch = pack([[1, 2, 3], [4, 5, 6, 7, 8]], 4, split_across_pack=True)
    assert batch.tokens.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert batch.seq_lens == [[3, 1], [4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    # Token 4 is cut from 5: it predicts nothing, and 5 is predicted by nothing.
    assert batch.labels.tolist() == [[2, 3, -100, -100], [6, 7, 8, -100]]


def test_loss_mask_from_tensors_numpy_and_ints():
    seqs = [[1, 2, 3], [4, 5]]
    expected = pack(seqs, 5, loss_mask=[[False, True, True], [False, True]]).labels
    for masks in (
        [torch.tensor([0, 1, 1]), torch.tensor([0, 1])],
        [np.array([False, True, True]), np.array([False, True])],
        [[0, 1, 1], (0, 1)],
    ):
        assert torch.equal(pack(seqs, 5, loss_mask=masks).labels, expected)
    assert expected.tolist() == [[2, 3, -100, 5, -100]]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"labels": [[1, 2]], "loss_mask": [[1, 1]]}, ValueError, "labels or loss_mask"),
        ({"labels": [[1, 2], [3]]}, ValueError, r"labels has 2 entries but there are 1"),
        ({"labels": [[1]]}, ValueError, r"labels\[0\] has 1 entries but sequences\[0\] has 2"),
        ({"labels": [[1.5, 2]]}, TypeError, r"labels\[0\]\[0\]"),
        ({"loss_mask": [[1, 2]]}, ValueError, r"loss_mask\[0\] holds 2"),
        ({"loss_mask": [[0.0, 1.0]]}, TypeError, r"loss_mask\[0\] holds 0.0"),
        ({"loss_mask": [torch.ones(2)]}, TypeError, r"loss_mask\[0\] has dtype"),
        ({"loss_mask": [[True]]}, ValueError, r"loss_mask\[0\] has 1 entries"),
        ({"loss_mask": 3}, TypeError, "loss_mask must be an iterable"),
        ({"split_across_pack": 1}, TypeError, "split_across_pack must be a bool"),
        ({"split_across_pack": True, "policy": "reject"}, ValueError, "policy='reject'"),
    ],
)
def test_bad_labels_and_masks_name_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        pack([[1, 2]], 4, **kwargs)


def test_packed_prompt_masked_loss_equals_each_sequence_alone():
    # SFT with train_on_input=False: the packed, shifted labels give the loss a model gives
    # each sequence alone with its prompt masked out (summed over targets).
    gen = torch.Generator().manual_seed(0)
    lengths, prompts = [9, 5, 12, 3, 7], [4, 2, 6, 1, 7]
    sequences = [torch.randint(0, 16, (n,), generator=gen) for n in lengths]
    masks = [torch.arange(n) >= p for n, p in zip(lengths, prompts, strict=True)]
    model = tiny_model(vocab=16)
    batch = pack(sequences, 16, loss_mask=masks)
    logits = model(batch.tokens, batch.position_ids, batch.lazy(2, block_size=8))
    packed = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum")

    alone = 0.0
    for seq, mask in zip(sequences, masks, strict=True):
        out = model(seq[None], torch.arange(len(seq))[None], None)[0]
        target = torch.where(mask, seq, -100)[1:]
        alone = alone + F.cross_entropy(out[:-1], target, reduction="sum")
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-6)


def test_collator_and_dataset_carry_labels_from_mapping_items():
    from torch.utils.data import DataLoader

    from flexmask.packing import PackedDataset, PackingCollator

    items = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8, 9], "labels": [-100, 9]},
    ]
    expected = pack(
        [it["input_ids"] for it in items], 6, labels=[it["labels"] for it in items]
    ).labels
    collate = PackingCollator(6, key="input_ids", labels_key="labels")
    batch = next(iter(DataLoader(items, batch_size=3, collate_fn=collate)))
    assert torch.equal(batch.labels, expected)
    masks = [dict(it, mask=[lab != -100 for lab in it["labels"]]) for it in items]
    streamed = list(PackedDataset(masks, 6, buffer_size=3, key="input_ids", loss_mask_key="mask"))
    assert len(streamed) == 1 and torch.equal(streamed[0].labels, expected)
    with pytest.raises(ValueError, match="pass key= too"):
        PackingCollator(6, labels_key="labels")
    with pytest.raises(ValueError, match="not both"):
        PackingCollator(6, key="input_ids", labels_key="labels", loss_mask_key="mask")
