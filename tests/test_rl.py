"""RL tree batches: token-budget packing into several trees, and the vectorised log-prob gather.

References: prefix sets written plainly (a trie is the set of its sequences' prefixes), a
first-fit over those sets, tests/oracle.py's tree mask, and per-sequence model runs.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from flexmask.packing import pack_tree_batch
from tests import oracle
from tests.tiny import tiny_model

PAD = 99  # above every token groups() draws, so padding shows
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def groups(draw, vocab=4, max_groups=5, max_len=10):
    """GRPO-like batches: a few prompts, each followed by several completions (some empty)."""
    sequences, prompt_lens = [], []
    for _ in range(draw(st.integers(1, max_groups))):
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=max_len // 2))
        for _ in range(draw(st.integers(1, 4))):
            completion = draw(st.lists(st.integers(0, vocab - 1), max_size=max_len // 2))
            sequences.append(prompt + completion)
            prompt_lens.append(len(prompt))
    return sequences, prompt_lens


def prefixes(seq):
    return {tuple(seq[: k + 1]) for k in range(len(seq))}


def reference_rows(sequences, budget):
    """First fit in input order, each sequence charged the prefixes its tree lacks."""
    trees, row_of = [], []
    for seq in sequences:
        if not seq:
            row_of.append(-1)
            continue
        fits = [r for r, nodes in enumerate(trees) if len(nodes | prefixes(seq)) <= budget]
        if not fits:
            trees.append(set())
        row = fits[0] if fits else len(trees) - 1
        trees[row] |= prefixes(seq)
        row_of.append(row)
    return row_of, [len(t) for t in trees]


@FAST
@given(data=groups(), slack=st.integers(0, 6), extra_rows=st.integers(0, 2))
def test_every_sequence_lands_in_exactly_one_tree_within_budget(data, slack, extra_rows):
    sequences, _ = data
    budget = max(map(len, sequences), default=0) + slack
    if budget == 0:
        budget = 1
    expected_rows, expected_sizes = reference_rows(sequences, budget)
    rows = max(len(expected_sizes), 1) + extra_rows
    batch = pack_tree_batch(sequences, budget, num_rows=rows, pad_id=PAD)

    assert batch.row_of == expected_rows
    assert batch.num_rows == rows
    assert batch.num_tokens == expected_sizes + [0] * (rows - len(expected_sizes))
    assert all(n <= budget for n in batch.num_tokens)
    assert batch.saved_tokens == sum(map(len, sequences)) - sum(expected_sizes)
    # Every sequence is found again along its path, in its own row, as a chain of parents.
    assert [t.tolist() for t in batch.unpack(batch.tokens)] == sequences
    for i, seq in enumerate(sequences):
        rows_i, positions = batch.sequence_index(i)
        assert rows_i.tolist() == [batch.row_of[i]] * len(seq)
        parents = batch.parents[batch.row_of[i]] if seq else None
        for t, p in enumerate(positions.tolist()):
            assert parents[p] == (positions[t - 1] if t else -1)
            assert batch.position_ids[batch.row_of[i], p] == t
    # The batch's mask is the tree oracle, row by row; padding and dummy rows attend nothing
    # past their one lone node.
    dense = batch.mask.to_dense(rows, 1, budget, budget)[:, 0].numpy()
    for r in range(rows):
        reference = oracle.tree(batch.parents[r].tolist(), budget, budget)
        assert (dense[r] == reference).all()
        assert (batch.tokens[r, batch.num_tokens[r] :] == PAD).all()


def gather_by_loop(batch, logits, sequences, prompt_lens, temperature):
    """Per sequence, through sequence_index: log-probs and entropies of tokens past the prompt."""
    out = []
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            out.append((torch.zeros(0), torch.zeros(0)))
            continue
        rows, positions = batch.sequence_index(i)
        logp = (logits[rows, positions].float() / temperature).log_softmax(-1)
        start = max(prompt_lens[i], 1)
        picked = logp[start - 1 : -1].gather(-1, torch.tensor(seq[start:])[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)[start - 1 : -1]
        out.append((picked, entropy))
    return out


@FAST
@given(data=groups(vocab=5), temperature=st.sampled_from([1.0, 0.7, 1.3]))
def test_gather_equals_a_per_sequence_loop_with_gradients(data, temperature):
    sequences, prompt_lens = data
    budget = max(max(map(len, sequences), default=1), 1) + 3
    batch = pack_tree_batch(sequences, budget, prompt_lens=prompt_lens)
    gen = torch.Generator().manual_seed(len(sequences))
    logits = torch.randn(batch.num_rows, budget, 5, generator=gen, requires_grad=True)
    got = batch.log_probs(logits, temperature=temperature, entropy=True)
    expected = gather_by_loop(batch, logits, sequences, prompt_lens, temperature)

    assert got.log_probs.shape[0] == len(sequences)
    for i, (logp, entropy) in enumerate(expected):
        n = len(logp)
        assert got.mask[i].tolist() == [True] * n + [False] * (got.mask.shape[1] - n)
        torch.testing.assert_close(got.log_probs[i, :n], logp, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got.entropy[i, :n], entropy, atol=1e-6, rtol=1e-6)
        assert (got.log_probs[i, n:] == 0).all() and (got.entropy[i, n:] == 0).all()
    weights = torch.arange(1.0, 1.0 + got.log_probs.numel()).view_as(got.log_probs)
    (grad,) = torch.autograd.grad((got.log_probs * weights).sum(), logits)
    reference = sum(
        (lp * weights[i, : len(lp)]).sum() for i, (lp, _) in enumerate(expected) if len(lp)
    )
    if isinstance(reference, torch.Tensor):
        (expected_grad,) = torch.autograd.grad(reference, logits)
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_loss_mask_and_prompt_lens_combine_and_empty_sequences_are_zero_rows():
    sequences = [[1, 2, 3, 4, 5], [], [1, 2, 6], [7]]
    batch = pack_tree_batch(
        sequences,
        8,
        prompt_lens=[2, 0, 2, 1],
        loss_mask=[[1, 1, 1, 0, 1], [], [0, 0, 0], [1]],
    )
    logits = torch.randn(batch.num_rows, 8, 9)
    out = batch.log_probs(logits)
    # Sequence 0 trains tokens 2 and 4 (3 is masked out); 1, 2 and 3 train nothing.
    assert out.mask.tolist() == [[True, True], [False, False], [False, False], [False, False]]
    rows, positions = batch.sequence_index(0)
    logp = logits[rows, positions].log_softmax(-1)
    torch.testing.assert_close(out.log_probs[0], torch.stack([logp[1, 3], logp[3, 5]]))
    assert (out.log_probs[1:] == 0).all() and out.entropy is None
    assert batch.row_of == [0, -1, 0, 0]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def grpo_batch(num_groups, completions, seed):
    gen = torch.Generator().manual_seed(seed)
    sequences, prompt_lens = [], []
    for _ in range(num_groups):
        prompt = torch.randint(
            0, 50, (int(torch.randint(4, 30, (1,), generator=gen)),), generator=gen
        )
        for _ in range(completions):
            n = int(torch.randint(0, 40, (1,), generator=gen))
            sequences.append(prompt.tolist() + torch.randint(0, 50, (n,), generator=gen).tolist())
            prompt_lens.append(len(prompt))
    return pack_tree_batch(sequences, 256, prompt_lens=prompt_lens)


def test_gather_is_vectorised_the_same_ops_for_10x_the_sequences():
    counts = []
    for groups_, completions in ((2, 2), (20, 8)):
        batch = grpo_batch(groups_, completions, seed=groups_)
        logits = torch.randn(batch.num_rows, 256, 50, requires_grad=True)
        with OpCounter() as counter:
            out = batch.log_probs(logits, temperature=0.9, entropy=True)
            out.log_probs.sum().backward()
        counts.append(counter.ops)
    assert counts[0] == counts[1]
    assert sum(counts[1].values()) < 60


def test_tree_batch_log_probs_equal_each_sequence_run_alone():
    gen = torch.Generator().manual_seed(3)
    sequences, prompt_lens = [], []
    for prompt_len in (5, 9, 3):
        prompt = torch.randint(0, 12, (prompt_len,), generator=gen).tolist()
        for n in (4, 0, 7, 2):
            sequences.append(prompt + torch.randint(0, 12, (n,), generator=gen).tolist())
            prompt_lens.append(prompt_len)
    sequences.insert(3, [])
    prompt_lens.insert(3, 0)
    batch = pack_tree_batch(sequences, 24, prompt_lens=prompt_lens, num_rows=4)
    assert batch.num_rows == 4 and len(set(batch.row_of) - {-1}) >= 2  # several trees, a dummy
    model = tiny_model(vocab=12)
    logits = model(batch.tokens, batch.position_ids, batch.lazy(2, block_size=8))
    got = batch.log_probs(logits, temperature=0.8, entropy=True)
    for i, seq in enumerate(sequences):
        start = max(prompt_lens[i], 1)
        n = max(len(seq) - start, 0)
        assert int(got.mask[i].sum()) == n
        if not n:
            continue
        alone = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0]
        logp = (alone / 0.8).log_softmax(-1)
        expected = logp[start - 1 : -1].gather(-1, torch.tensor(seq[start:])[:, None])[:, 0]
        torch.testing.assert_close(got.log_probs[i, :n], expected, atol=1e-5, rtol=0)
        entropy = -(logp.exp() * logp).sum(-1)[start - 1 : -1]
        torch.testing.assert_close(got.entropy[i, :n], entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"max_tokens": 2}, ValueError, r"sequences\[0\] has 3 tokens, more than max_tokens=2"),
        ({"prompt_lens": [1]}, ValueError, "prompt_lens has 1 entries but there are 2"),
        ({"prompt_lens": [4, 0]}, ValueError, r"prompt_lens\[0\]=4 is longer"),
        ({"prompt_lens": [1.0, 0]}, TypeError, r"prompt_lens\[0\] must be an int"),
        ({"prompt_lens": torch.ones(2)}, TypeError, "prompt_lens must be a 1-d integer"),
        ({"loss_mask": [[1, 1, 1]]}, ValueError, "loss_mask has 1 entries"),
        ({"num_rows": -1}, ValueError, "num_rows must be >= 0"),
        ({"max_tokens": "8"}, TypeError, "max_tokens must be an int"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        pack_tree_batch([[1, 2, 3], [1]], **{"max_tokens": 8, **kwargs})


def test_log_probs_rejects_bad_logits_and_temperature():
    batch = pack_tree_batch([[1, 2, 3]], 4)
    with pytest.raises(ValueError, match=r"\(1, 4, V\)"):
        batch.log_probs(torch.zeros(1, 5, 3))
    with pytest.raises(TypeError, match="logits must be a"):
        batch.log_probs(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="V=3 entries but the targets go up to token 3"):
        batch.log_probs(torch.zeros(1, 4, 3))
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="temperature must be a number > 0"):
            batch.log_probs(torch.zeros(1, 4, 5), temperature=bad)
    assert np.isfinite(batch.log_probs(torch.zeros(1, 4, 5)).log_probs.numpy()).all()


@FAST
@given(data=groups(vocab=5), step=st.integers(1, 3))
def test_micro_batches_of_rows_add_up_to_the_whole_batch(data, step):
    sequences, prompt_lens = data
    budget = max(max(map(len, sequences), default=1), 1) + 1
    batch = pack_tree_batch(sequences, budget, prompt_lens=prompt_lens, num_rows=2)
    logits = torch.randn(batch.num_rows, budget, 5)
    whole = batch.log_probs(logits, entropy=True)
    parts = [
        batch.log_probs(logits[a : a + step], entropy=True, rows=slice(a, a + step))
        for a in range(0, batch.num_rows, step)
    ]
    torch.testing.assert_close(sum(p.log_probs for p in parts), whole.log_probs)
    torch.testing.assert_close(sum(p.entropy for p in parts), whole.entropy)
    assert torch.equal(sum(p.mask.int() for p in parts), whole.mask.int())
    for a, part in zip(range(0, batch.num_rows, step), parts, strict=True):
        inside = [a <= r < a + step for r in batch.row_of]
        assert not part.mask[[not x for x in inside]].any()


def test_rows_must_be_a_plain_slice_matching_the_logits():
    batch = pack_tree_batch([[1, 2], [3, 4]], 2)
    with pytest.raises(TypeError, match="rows must be a slice"):
        batch.log_probs(torch.zeros(1, 2, 5), rows=1)
    with pytest.raises(ValueError, match=r"\(1, 2, V\)"):
        batch.log_probs(torch.zeros(2, 2, 5), rows=slice(1, 2))
