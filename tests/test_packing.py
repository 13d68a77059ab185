"""Tests for flexmask.packing against plain-Python oracles and an unpacked model."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.utils.data import DataLoader

import flexmask
from flexmask.packing import Chunk, PackedDataset, PackingCollator, pack, pack_one_tree
from tests import oracle

# flexmask.lazy and flexmask.flex_attention are written alongside this module; until they land
# the tests that need them skip (and say why) rather than fail.
needs_lazy = pytest.mark.skipif(
    not hasattr(flexmask, "lazy"), reason="flexmask.lazy is not importable yet (core API pending)"
)
needs_flex_attention = pytest.mark.skipif(
    not (hasattr(flexmask, "lazy") and hasattr(flexmask, "flex_attention")),
    reason="flexmask.flex_attention / flexmask.lazy are not importable yet (core API pending)",
)

PAD, IGNORE = 99, -7  # unlike every token the strategies draw (0..50): padding shows
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

token_lists = st.lists(st.integers(0, 50), min_size=1, max_size=30)
batches = st.lists(token_lists, min_size=1, max_size=10)


# ------------------------------------------------------------------------------------------
# Plain-Python oracles
# ------------------------------------------------------------------------------------------


def reference_rows(seq_lens, rows_tokens, max_len):
    """labels / position_ids for each row, by walking its documents one token at a time."""
    labels, positions = [], []
    for lens, row in zip(seq_lens, rows_tokens, strict=True):
        row_labels, row_positions = [IGNORE] * max_len, [0] * max_len
        start = 0
        for n in lens:
            for t in range(n):
                row_positions[start + t] = t
                if t + 1 < n:
                    row_labels[start + t] = row[start + t + 1]
            start += n
        labels.append(row_labels)
        positions.append(row_positions)
    return labels, positions


def reference_document_mask(seq_lens, max_len):
    """(B, max_len, max_len): q attends kv iff same document and kv <= q."""
    dense = torch.zeros(len(seq_lens), max_len, max_len, dtype=torch.bool)
    for b, lens in enumerate(seq_lens):
        doc = [None] * max_len
        start = 0
        for d, n in enumerate(lens):
            for t in range(start, start + n):
                doc[t] = d
            start += n
        for q in range(max_len):
            for kv in range(q + 1):
                dense[b, q, kv] = doc[q] is not None and doc[q] == doc[kv]
    return dense


def reference_ancestors(parents, length):
    """(length, length): kv is q or an ancestor of q; rows/cols past the tree are False."""
    dense = torch.zeros(length, length, dtype=torch.bool)
    for q in range(len(parents)):
        node = q
        while node != -1:
            dense[q, node] = True
            node = parents[node]
    return dense


def reference_fit(lengths, capacity, best):
    """First/best fit of ``lengths`` (already in placement order), by scanning every row."""
    room, rows = [], []
    for n in lengths:
        fits = [r for r in range(len(room)) if room[r] >= n]
        if not fits:
            room.append(capacity)
            fits = [len(room) - 1]
        row = min(fits, key=lambda r: (room[r], r)) if best else fits[0]
        room[row] -= n
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------
# pack: round trip, layout, labels, positions, mask
# ------------------------------------------------------------------------------------------


@FAST
@given(
    sequences=batches,
    max_len=st.integers(1, 32),
    policy=st.sampled_from(["split", "reject"]),
    strategy=st.sampled_from(["first_fit_decreasing", "best_fit_decreasing", "next_fit"]),
)
def test_every_token_lands_in_exactly_one_position_and_unpacks(
    sequences, max_len, policy, strategy
):
    if policy == "reject" and max(map(len, sequences)) > max_len:
        with pytest.raises(ValueError, match=r"sequences\[\d+\] has \d+ tokens"):
            pack(sequences, max_len, policy=policy, strategy=strategy)
        return
    batch = pack(sequences, max_len, policy=policy, pad_id=PAD, strategy=strategy)

    assert batch.tokens.shape == batch.labels.shape == batch.position_ids.shape
    assert batch.tokens.shape == (batch.num_rows, max_len)
    assert batch.tokens.dtype == batch.labels.dtype == batch.position_ids.dtype == torch.int64
    assert all(sum(lens) <= max_len for lens in batch.seq_lens)

    owner = {}
    for i, seq in enumerate(sequences):
        chunks = batch.placement[i]
        # Split chunks are max_len long except the last, and reassemble the sequence.
        assert [c.length for c in chunks] == [
            min(max_len, len(seq) - s) for s in range(0, len(seq), max_len)
        ]
        reassembled = []
        for c in chunks:
            reassembled += batch.tokens[c.row, c.start : c.start + c.length].tolist()
            for p in range(c.start, c.start + c.length):
                assert (c.row, p) not in owner, "two tokens packed into one position"
                owner[(c.row, p)] = i
        assert reassembled == seq
    assert len(owner) == sum(map(len, sequences)) == batch.num_tokens

    # Each row's documents are exactly its chunks, back to back from position 0.
    for row, lens in enumerate(batch.seq_lens):
        chunks = sorted(c for cs in batch.placement for c in cs if c.row == row)
        assert [c.length for c in chunks] == lens
        assert [c.start for c in chunks] == [sum(lens[:d]) for d in range(len(lens))]
    # Every other position is padding.
    for row, p in itertools.product(range(batch.num_rows), range(max_len)):
        if (row, p) not in owner:
            assert batch.tokens[row, p] == PAD and batch.position_ids[row, p] == 0

    assert [t.tolist() for t in batch.unpack(batch.tokens)] == sequences
    assert all(
        batch.tokens[batch.sequence_index(i)].tolist() == seq for i, seq in enumerate(sequences)
    )
    assert batch.efficiency == pytest.approx(len(owner) / (batch.num_rows * max_len))


@FAST
@given(sequences=batches, max_len=st.integers(1, 32))
def test_labels_and_position_ids_match_a_per_document_walk(sequences, max_len):
    batch = pack(sequences, max_len, pad_id=PAD, ignore_index=IGNORE)
    labels, positions = reference_rows(batch.seq_lens, batch.tokens.tolist(), max_len)
    assert batch.labels.tolist() == labels
    assert batch.position_ids.tolist() == positions


@settings(max_examples=20, deadline=None)
@given(
    sequences=st.lists(
        st.lists(st.integers(0, 9), min_size=1, max_size=12), max_size=6, min_size=1
    ),
    max_len=st.integers(1, 20),
)
def test_mask_to_dense_is_block_diagonal_causal_with_padding_masked(sequences, max_len):
    batch = pack(sequences, max_len)
    dense = batch.mask.to_dense(batch.num_rows, 2, max_len, max_len)
    expected = reference_document_mask(batch.seq_lens, max_len)
    assert dense.shape == (batch.num_rows, 2, max_len, max_len)
    assert torch.equal(dense, expected[:, None].expand_as(dense))


@FAST
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    max_len=st.integers(1, 40),
    strategy=st.sampled_from(["first_fit_decreasing", "best_fit_decreasing", "next_fit"]),
)
def test_strategies_match_a_row_scanning_reference(lengths, max_len, strategy):
    batch = pack([[1] * n for n in lengths], max_len, strategy=strategy)
    pieces = [min(max_len, n - s) for n in lengths for s in range(0, n, max_len)]
    if strategy == "next_fit":
        rows, row, room = [], 0, max_len
        for n in pieces:
            if n > room:
                row, room = row + 1, max_len
            rows.append(row)
            room -= n
        order = pieces
    else:
        order = sorted(pieces, reverse=True)
        rows = reference_fit(order, max_len, best=strategy == "best_fit_decreasing")
    expected = [[] for _ in range(max(rows) + 1)]
    for n, row in zip(order, rows, strict=True):
        expected[row].append(n)
    assert batch.seq_lens == expected


def test_first_fit_decreasing_is_tight_on_a_known_case():
    # 6+4, 5+5, 3+3+2+2 fill three rows of 10 exactly.
    batch = pack([[1] * n for n in [3, 5, 2, 6, 4, 5, 3, 2]], max_len=10)
    assert batch.seq_lens == [[6, 4], [5, 5], [3, 3, 2, 2]]
    assert batch.efficiency == 1.0


def test_split_chunks_are_separate_documents():
    batch = pack([list(range(1, 8))], max_len=3, pad_id=PAD, ignore_index=IGNORE)
    assert batch.placement[0] == [Chunk(0, 0, 3), Chunk(1, 0, 3), Chunk(2, 0, 1)]
    assert batch.tokens.tolist() == [[1, 2, 3], [4, 5, 6], [7, PAD, PAD]]
    # No target across a cut: 3 -> 4 and 6 -> 7 are not predicted.
    assert batch.labels.tolist() == [[2, 3, IGNORE], [5, 6, IGNORE], [IGNORE] * 3]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 1, 2], [0, 0, 0]]


def test_single_tokens_and_max_len_one():
    batch = pack([[5], [6, 7]], max_len=1, ignore_index=IGNORE)
    assert batch.tokens.tolist() == [[5], [6], [7]]  # equal lengths keep input order
    assert batch.labels.tolist() == [[IGNORE]] * 3
    assert [t.tolist() for t in batch.unpack(batch.tokens)] == [[5], [6, 7]]


def test_accepts_tensors_numpy_and_numpy_integers():
    batch = pack(
        [torch.tensor([1, 2], dtype=torch.int32), np.array([3, 4, 5]), [np.int64(6), 7]],
        max_len=8,
    )
    assert [t.tolist() for t in batch.unpack(batch.tokens)] == [[1, 2], [3, 4, 5], [6, 7]]
    two_d = pack(torch.tensor([[1, 2], [3, 4]]), max_len=4)
    assert two_d.tokens.tolist() == [[1, 2, 3, 4]]


def test_unpack_keeps_trailing_dimensions_and_gradients():
    batch = pack([[1, 2, 3], [4, 5]], max_len=4)
    x = torch.randn(batch.num_rows, 4, 3, requires_grad=True)
    parts = batch.unpack(x)
    assert [p.shape for p in parts] == [(3, 3), (2, 3)]
    torch.cat(parts).sum().backward()
    used = torch.zeros(batch.num_rows, 4, dtype=torch.bool)
    used[batch.tokens != 0] = True
    assert torch.equal(x.grad[..., 0] == 1, used)


@pytest.mark.parametrize(
    ("sequences", "kwargs", "error", "pattern"),
    [
        ([[1, 2], []], {}, ValueError, r"sequences\[1\] is empty"),
        ([], {}, ValueError, r"sequences is empty"),
        ([[1, 2.0]], {}, TypeError, r"sequences\[0\]\[1\] is 2\.0 \(float\)"),
        ([[1], [True, 2]], {}, TypeError, r"sequences\[1\]\[0\] is True \(bool\)"),
        ([[1], [np.bool_(True)]], {}, TypeError, r"sequences\[1\]\[0\]"),
        ([["a", "b"]], {}, TypeError, r"sequences\[0\]\[0\] is 'a' \(str\)"),
        (["hello"], {}, TypeError, r"sequences\[0\] is a str.*tokenize"),
        ([1, 2, 3], {}, TypeError, r"sequences\[0\] is the int 1.*list of sequences"),
        ([torch.tensor([1.0, 2.0])], {}, TypeError, r"sequences\[0\] has dtype torch\.float32"),
        ([torch.tensor([True])], {}, TypeError, r"sequences\[0\] has dtype torch\.bool"),
        ([[1], torch.ones(2, 2, dtype=torch.long)], {}, ValueError, r"sequences\[1\] is a 2-d"),
        (torch.tensor([1, 2]), {}, ValueError, r"sequences is a 1-d tensor"),
        ([{"input_ids": [1]}], {}, TypeError, r"sequences\[0\] is a dict .*PackingCollator\(key="),
        ([np.array([1.5])], {}, TypeError, r"sequences\[0\] has dtype torch\.float64"),
        ([np.array(["a"])], {}, TypeError, r"sequences\[0\] is an array torch cannot read"),
        ([[1, 2**63]], {}, ValueError, r"sequences\[0\] holds the token .* int64"),
        ([[1]], {"max_len": 0}, ValueError, r"max_len must be >= 1, got 0"),
        ([[1]], {"max_len": 2.5}, TypeError, r"max_len must be an int, got 2\.5"),
        ([[1]], {"max_len": True}, TypeError, r"max_len must be an int"),
        ([[1]], {"max_len": "4"}, TypeError, r"max_len must be an int"),
        ([[1]], {"pad_id": 0.5}, TypeError, r"pad_id must be an int"),
        ([[1]], {"policy": "truncate"}, ValueError, r"policy must be one of 'split', 'reject'"),
        ([[1]], {"strategy": "ffd"}, ValueError, r"strategy must be one of"),
        (
            [[1], [1, 2, 3, 4, 5]],
            {"max_len": 4, "policy": "reject"},
            ValueError,
            r"sequences\[1\] has 5 tokens, more than max_len=4",
        ),
    ],
)
def test_bad_input_names_the_argument_and_index(sequences, kwargs, error, pattern):
    kwargs = {"max_len": 4, **kwargs}
    with pytest.raises(error, match=pattern):
        pack(sequences, **kwargs)


def test_unpack_and_sequence_index_reject_bad_arguments():
    batch = pack([[1, 2, 3]], max_len=4)
    with pytest.raises(ValueError, match=r"per_token must have shape \(B, max_len, \.\.\.\)"):
        batch.unpack(torch.zeros(4))
    with pytest.raises(TypeError, match="per_token must be a tensor"):
        batch.unpack([[1, 2, 3, 4]])
    with pytest.raises(IndexError, match=r"i must be in \[0, 1\), got 1"):
        batch.sequence_index(1)


# ------------------------------------------------------------------------------------------
# pack_one_tree
# ------------------------------------------------------------------------------------------


@st.composite
def shared_prefix_batches(draw, vocab=4, max_len=12):
    """Sequences branching off a few stems, plus a prefix of another and a duplicate."""
    stems = draw(
        st.lists(st.lists(st.integers(0, vocab - 1), max_size=max_len), min_size=1, max_size=3)
    )
    sequences = []
    for _ in range(draw(st.integers(1, 5))):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(st.integers(0, vocab - 1), max_size=max_len))
        if cut + len(tail) == 0:
            tail = [0]
        sequences.append(stem[:cut] + tail)
    victim = draw(st.sampled_from(sequences))
    sequences.append(victim[: draw(st.integers(1, len(victim)))])  # a prefix of another
    sequences.append(list(draw(st.sampled_from(sequences))))  # a duplicate
    return draw(st.permutations(sequences))


@FAST
@given(sequences=shared_prefix_batches(), extra=st.integers(0, 5))
def test_pack_tree_paths_depths_parents_and_savings(sequences, extra):
    tp = pack_one_tree(sequences)
    n = tp.num_tokens
    parents = tp.parents.tolist()
    assert tp.tokens.shape == tp.position_ids.shape == tp.parents.shape == (n,)
    assert all(-1 <= p < i for i, p in enumerate(parents))

    for i, seq in enumerate(sequences):
        index = tp.sequence_index(i)
        assert index.dtype == torch.int64
        assert tp.tokens[index].tolist() == seq
        assert tp.position_ids[index].tolist() == list(range(len(seq)))
        assert [parents[p] for p in index.tolist()] == [-1, *index[:-1].tolist()]
    assert [t.tolist() for t in tp.unpack(tp.tokens)] == sequences

    # One node per distinct prefix, and every node is on some sequence's path.
    prefixes = {tuple(seq[: t + 1]) for seq in sequences for t in range(len(seq))}
    assert n == len(prefixes)
    assert set(torch.cat([tp.sequence_index(i) for i in range(len(sequences))]).tolist()) == set(
        range(n)
    )
    assert tp.unpacked_tokens == sum(map(len, sequences))
    assert tp.saved_tokens == tp.unpacked_tokens - len(prefixes)

    # Preorder: every subtree is the contiguous run starting at its root...
    ancestors = reference_ancestors(parents, n)
    for v in range(n):
        descendants = set(ancestors[:, v].nonzero()[:, 0].tolist())
        assert descendants == set(range(v, v + len(descendants)))
    # ...and siblings come in order of first appearance in the input.
    first_seen = {}
    for i in range(len(sequences)):
        for p in tp.sequence_index(i).tolist():
            first_seen.setdefault(p, i)
    for a, b in itertools.combinations(range(n), 2):
        if parents[a] == parents[b]:
            assert first_seen[a] <= first_seen[b]

    padded = pack_one_tree(sequences, pad_to=n + extra, pad_id=PAD)
    length = n + extra
    assert padded.tokens.tolist() == tp.tokens.tolist() + [PAD] * extra
    assert padded.position_ids.tolist() == tp.position_ids.tolist() + [0] * extra
    assert padded.parents.tolist() == parents
    dense = padded.mask.to_dense(1, 1, length, length)[0, 0]
    assert torch.equal(dense, reference_ancestors(parents, length))


def test_pack_tree_example_prefix_and_duplicate():
    tp = pack_one_tree([[1, 2, 3], [1, 4], [1, 2], [1, 2, 3], [5]])
    assert tp.tokens.tolist() == [1, 2, 3, 4, 5]
    assert tp.parents.tolist() == [-1, 0, 1, 0, -1]
    assert tp.position_ids.tolist() == [0, 1, 2, 1, 0]
    assert [tp.sequence_index(i).tolist() for i in range(5)] == [
        [0, 1, 2],
        [0, 3],
        [0, 1],
        [0, 1, 2],
        [4],
    ]
    assert (tp.num_tokens, tp.unpacked_tokens, tp.saved_tokens) == (5, 11, 6)


def test_pack_tree_children_follow_first_appearance_not_creation_order():
    # Creation order would be 1 2 3 5 4; preorder puts 4 (under 2) before 5 (under 1).
    tp = pack_one_tree([[1, 2, 3], [1, 5], [1, 2, 4]])
    assert tp.tokens.tolist() == [1, 2, 3, 4, 5]
    assert tp.parents.tolist() == [-1, 0, 1, 1, 0]


def test_pack_tree_handles_deep_sequences_without_recursion():
    tp = pack_one_tree([list(range(5000)), list(range(2500)) + [7]])
    assert tp.num_tokens == 5001
    assert tp.tokens[tp.sequence_index(1)].tolist() == list(range(2500)) + [7]


@pytest.mark.parametrize(
    ("sequences", "kwargs", "error", "pattern"),
    [
        ([[1, 2, 3], [1, 4]], {"pad_to": 3}, ValueError, r"pad_to=3 is smaller .* 4 tokens"),
        ([[1]], {"pad_to": 0}, ValueError, r"pad_to must be >= 1"),
        ([[1]], {"pad_to": 2.0}, TypeError, r"pad_to must be an int"),
        ([[1], []], {}, ValueError, r"sequences\[1\] is empty"),
        ([[1, 0.5]], {}, TypeError, r"sequences\[0\]\[1\] is 0\.5"),
    ],
)
def test_pack_tree_bad_input(sequences, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        pack_one_tree(sequences, **kwargs)


def test_pack_tree_unpack_and_sequence_index_reject_bad_arguments():
    tp = pack_one_tree([[1, 2]], pad_to=4)
    with pytest.raises(ValueError, match=r"per_token must have shape \(L, \.\.\.\) with L = 4"):
        tp.unpack(torch.zeros(1, 4))
    with pytest.raises(IndexError, match=r"i must be in \[0, 1\), got -1"):
        tp.sequence_index(-1)


# ------------------------------------------------------------------------------------------
# The core promise: packing changes nothing a causal model computes
# ------------------------------------------------------------------------------------------

_MODEL = None


def _examples_model():
    """examples/_model.py: the examples' tiny causal LM, shared rather than copied."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "_model.py"
    spec = importlib.util.spec_from_file_location("flexmask_examples_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = _examples_model().TinyLM(vocab=8, dim=32, num_heads=2, num_layers=2, seed=0)
    return _MODEL


def log_probs_and_grads(model, per_sequence_logits, sequences):
    next_token_log_probs = _examples_model().next_token_log_probs
    log_probs = [
        next_token_log_probs(logits, torch.tensor(seq))
        for logits, seq in zip(per_sequence_logits, sequences, strict=True)
    ]
    # Distinct weights, so a log-prob credited to the wrong sequence changes the gradient.
    loss = sum((i + 1) * lp.sum() for i, lp in enumerate(log_probs))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return [lp.detach() for lp in log_probs], grads


@pytest.mark.slow  # minutes: a tiny model's forward and backward, three ways, per example
@needs_flex_attention
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sequences=shared_prefix_batches(vocab=8, max_len=10),
    block_size=st.sampled_from([8, 16, 128]),
    pad=st.integers(0, 9),
)
def test_packed_and_tree_packed_match_one_sequence_at_a_time(sequences, block_size, pad):
    model = tiny_model()
    heads = model.num_heads

    alone = [model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0] for seq in sequences]
    expected_lp, expected_grads = log_probs_and_grads(model, alone, sequences)

    # Rows as long as the longest sequence, so nothing is split and several rows are used.
    batch = pack(sequences, max(map(len, sequences)) + pad % 3)
    logits = model(batch.tokens, batch.position_ids, batch.lazy(heads, block_size=block_size))
    packed_lp, packed_grads = log_probs_and_grads(model, batch.unpack(logits), sequences)

    tp = pack_one_tree(sequences, pad_to=pack_one_tree(sequences).num_tokens + pad)
    tree_logits = model(tp.tokens[None], tp.position_ids[None], tp.lazy(heads, None, block_size))
    tree_lp, tree_grads = log_probs_and_grads(model, tp.unpack(tree_logits[0]), sequences)

    for got in (packed_lp, tree_lp):
        for a, b in zip(got, expected_lp, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for got in (packed_grads, tree_grads):
        for a, b in zip(got, expected_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # fp32 sums of 10+ terms

    # The packed labels are exactly the targets of those log-probs, position by position.
    by_label = logits.detach().log_softmax(-1).gather(-1, batch.labels.clamp(min=0)[..., None])
    assert int((batch.labels != -100).sum()) == sum(len(seq) - 1 for seq in sequences)
    for i, expected in enumerate(expected_lp):
        rows, positions = batch.sequence_index(i)
        torch.testing.assert_close(
            by_label[rows[:-1], positions[:-1], 0], expected, atol=1e-5, rtol=0
        )


@needs_flex_attention
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_inference_through_torchs_kernel_matches_one_sequence_at_a_time():
    # Without gradients flexmask hands the BlockMask to torch's own flex_attention kernel (one
    # fixed case: torch's eager kernel traces each new mask, which takes seconds).
    model = tiny_model()
    sequences = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4], [1, 2, 3, 4], [5] * 10, [1, 2, 6, 6, 6]]
    with torch.no_grad():
        alone = [model(torch.tensor([s]), torch.arange(len(s))[None])[0] for s in sequences]
        batch = pack(sequences, max_len=12)
        packed = batch.unpack(model(batch.tokens, batch.position_ids, batch.lazy(2, None, 8)))
        tp = pack_one_tree(sequences, pad_to=20)
        tree = tp.unpack(model(tp.tokens[None], tp.position_ids[None], tp.lazy(2, None, 8))[0])
    for got in (packed, tree):
        for a, b in zip(got, alone, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------
# DataLoader integration
# ------------------------------------------------------------------------------------------


class ReportingCollator(PackingCollator):
    """Also reports, from inside the worker, what packing there built."""

    def __call__(self, items):
        builds_before = flexmask.cache_info().misses
        batch = super().__call__(items)
        worker = torch.utils.data.get_worker_info()
        return batch, {
            "worker": None if worker is None else worker.id,
            "builds": flexmask.cache_info().misses - builds_before,
            "built": batch.handle.built,
        }


def random_sequences(count, seed, longest=20):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, 50, (n,), generator=generator).tolist() for n in lengths]


@needs_lazy
def test_collator_in_workers_ships_small_unbuilt_handles_built_correctly_in_main():
    data = random_sequences(40, seed=1)
    max_len, heads, block_size = 24, 2, 8
    collate = ReportingCollator(max_len, heads, block_size=block_size, pad_id=PAD)
    loader = DataLoader(data, batch_size=10, num_workers=2, collate_fn=collate)
    seen, workers = [], set()
    for batch, report in loader:
        assert report["builds"] == 0 and not report["built"], "a worker built a BlockMask"
        workers.add(report["worker"])
        assert not batch.handle.built
        tensor_bytes = sum(
            t.numel() * t.element_size() for t in (batch.tokens, batch.labels, batch.position_ids)
        )
        assert len(pickle.dumps(batch.handle)) < 4096
        assert len(pickle.dumps(batch)) < tensor_bytes + 8192
        seen += batch.unpack(batch.tokens)

        block_mask = batch.handle.block_mask  # built here, in the main process
        assert batch.handle.built
        # A head-independent mask may be built once and broadcast over heads (H = 1).
        assert tuple(block_mask.shape) in {
            (batch.num_rows, h, max_len, max_len) for h in (1, heads)
        }
        reference = reference_document_mask(batch.seq_lens, max_len)
        effective = oracle.block_mask_meaning(block_mask, *block_mask.shape)
        assert torch.equal(effective, reference[:, None].expand_as(effective))
        torch_bm = torch_create_block_mask(
            lambda b, h, q, kv, ref=reference: ref[b, q, kv],
            batch.num_rows,
            heads,
            max_len,
            max_len,
            device="cpu",
            BLOCK_SIZE=block_size,
        )
        blocks = block_mask.to_dense()
        assert torch.equal(blocks.expand_as(torch_bm.to_dense()), torch_bm.to_dense())
    assert [s.tolist() for s in seen] == data
    assert workers == {0, 1}


@needs_lazy
def test_collator_takes_mappings_and_validates_at_construction():
    collate = PackingCollator(8, key="input_ids")
    batch = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    assert batch.seq_lens == [[3, 1]]
    with pytest.raises(TypeError, match="item 0 is a list, but key='input_ids'"):
        collate([[1, 2]])
    with pytest.raises(KeyError, match="item 0 has no 'input_ids'"):
        collate([{"ids": [1]}])
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        PackingCollator(0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        PackingCollator(8, strategy="magic")
    with pytest.raises(TypeError, match="num_heads must be an int"):
        PackingCollator(8, num_heads=1.5)


@needs_lazy
@pytest.mark.parametrize("num_workers", [0, 2])
def test_packed_dataset_covers_every_sequence_once(num_workers):
    data = random_sequences(30, seed=2, longest=12)
    dataset = PackedDataset(data, max_len=16, buffer_size=7)
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
    seen = []
    for batch in loader:
        assert not batch.handle.built
        assert batch.num_sequences <= 7
        seen += [s.tolist() for s in batch.unpack(batch.tokens)]
    assert sorted(seen) == sorted(data)
