"""leak_test's coverage: every forbidden (output, input) pair is tested, for any mask.

Seeded leaks the passes were not designed around — a tree sibling read, a window one token
too wide, a prefix one token too long, a detached statistic, a custom op whose forward
leaks and whose backward is masked, documents told by position_ids restarting at 1,
BatchNorm over tokens in training mode, a leak of 1e-30 — each found at default settings
in 20 of 20 seeds; the same models without the leak pass. The reference is independent of
the leak test: each output token run alone with only the tokens the mask lets it depend
on (its ancestors, its window, its document) must give the same output iff nothing else
reaches it; and the planner's coverage is checked pair by pair against a brute force.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flexmask
from flexmask.testing import leak_test
from flexmask.testing.cover import plan
from flexmask.testing.passes import _closure, _components, _power
from tests.leak_models import TinyLM, dense_kernel, run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SEEDS = range(20)


# ---------------------------------------------------------------------- references
def matrix_kernel(allowed):
    """Attention under a dense ``(S, S)`` (or ``(B, S, S)``) bool matrix."""

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(-3))

    return attend


def reach_of(mask, seq_len, layers):
    allowed = mask.to_dense(1, 1, seq_len, seq_len)[0, 0]
    step = allowed | torch.eye(seq_len, dtype=torch.bool)
    reach = step.clone()
    for _ in range(layers - 1):
        reach = (reach.float() @ step.float()) > 0
    return allowed, reach


def outputs_that_differ_alone(model, ids, positions, mask, layers, atol=1e-5):
    """Output tokens whose packed output differs from a run of only the tokens they may
    depend on (``layers`` applications of the mask), with the mask restricted to those."""
    seq_len = ids.shape[1]
    allowed, reach = reach_of(mask, seq_len, layers)
    with torch.no_grad():
        packed = run(model, ids, positions, matrix_kernel(allowed))
    return differ_alone(model, ids, positions, allowed, reach, packed, atol)


def differ_alone(model, ids, positions, allowed, reach, packed, atol=1e-5):
    differs = set()
    with torch.no_grad():
        for t in range(ids.shape[1]):
            keep = reach[t].nonzero().view(-1)
            sub = allowed[keep][:, keep]
            alone = run(model, ids[:, keep], positions[:, keep], matrix_kernel(sub))
            where = int((keep == t).nonzero())
            if not torch.allclose(packed[0, t], alone[0, where], atol=atol):
                differs.add(t)
    return differs


def random_ids(seed, seq_len, vocab=32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (1, seq_len), generator=gen)


def tree_parents(prompt, responses):
    """A prompt chain with responses forking off its last token, laid out in preorder."""
    parents = [-1] + list(range(prompt - 1))
    for length in responses:
        first = len(parents)
        parents += [prompt - 1] + list(range(first, first + length - 1))
    return parents


def depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return torch.tensor(out).unsqueeze(0)


def leaking_model(kernel_allowed, layers=2, seed=0):
    torch.manual_seed(seed)
    model = TinyLM(layers=layers)
    return model, matrix_kernel(kernel_allowed)


def assert_named(report, forbidden):
    """The leak test found a leak and every token pair it names is one the mask forbids."""
    assert report.leaks, str(report)
    for leak in report.leaks:
        assert leak.row == leak.input_row == 0, str(report)
        assert bool(forbidden[leak.output, leak.input]), str(report)


def assert_documents_agree(report, differs):
    """A statistic over the batch: every document with an output that differs alone is
    named as read into (a token whose output happens to agree alone, as the one holding the
    maximum does, still depends on the others: moving them moves it)."""
    assert differs, "the reference sees no leak"
    documents = {
        number
        for number, (row, first, length) in enumerate(report.documents)
        if any(first <= t < first + length for t in differs)
    }
    assert documents <= {out for out, _ in report.pairs}, (str(report), differs)


# ---------------------------------------------------------------------- seeded leaks
@pytest.mark.parametrize("seed", SEEDS)
def test_a_response_reading_its_sibling_is_found(seed):
    """issue 39 item 3: prompt 12, responses 3 + 3; one token of the second response reads
    one of the first's (a different pair every seed)."""
    parents = tree_parents(12, [3, 3])
    seq_len = len(parents)
    mask = flexmask.tree(parents)
    gen = torch.Generator().manual_seed(seed)
    out = 15 + int(torch.randint(0, 3, (), generator=gen))
    inp = 12 + int(torch.randint(0, 3, (), generator=gen))
    allowed, reach = reach_of(mask, seq_len, 2)
    kernel = allowed.clone()
    kernel[out, inp] = True
    model, attend = leaking_model(kernel, seed=seed)
    ids, positions = random_ids(seed, seq_len), depths(parents)
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed, seed=seed)
    assert_named(report, ~reach)
    # The reference: the reading token differs from its path alone, the other branch not.
    with torch.no_grad():
        packed = run(model, ids, positions, attend)
    differs = differ_alone(model, ids, positions, allowed, reach, packed)
    assert out in differs and not differs & set(range(15))
    assert {leak.output for leak in report.leaks} <= differs


def test_a_long_prompt_with_short_responses_sibling_leak_is_found():
    """issue 39 item 3, the second case: prompt 100, responses 8 + 8 (missed 10 of 10)."""
    parents = tree_parents(100, [8, 8])
    mask = flexmask.tree(parents)
    allowed, reach = reach_of(mask, len(parents), 2)
    kernel = allowed.clone()
    kernel[110, 103] = True
    model, attend = leaking_model(kernel)
    ids, positions = random_ids(0, len(parents)), depths(parents)
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed)
    assert_named(report, ~reach)
    assert any(leak.output >= 108 and 100 <= leak.input < 108 for leak in report.leaks)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_window_one_token_too_wide_is_found(seed):
    """A causal window of 4 in a kernel of 5, two layers: each output reads one token
    further back than the mask allows. Documents of random lengths; the depth is read off
    the model (one probe pass)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(11, 15, (2,), generator=gen)]
    seq_len = sum(lengths)
    docs = flexmask.causal() & flexmask.document(lengths)
    mask = docs & flexmask.sliding_window(4)
    kernel = (docs & flexmask.sliding_window(5)).to_dense(1, 1, seq_len, seq_len)[0, 0]
    model, attend = leaking_model(kernel, seed=seed)
    ids = random_ids(seed, seq_len)
    positions = torch.arange(seq_len).unsqueeze(0)
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed, seed=seed)
    allowed, reach = reach_of(mask, seq_len, 2)
    assert_named(report, ~reach)
    assert report.layers == 2, str(report)
    with torch.no_grad():
        packed = run(model, ids, positions, attend)
    assert {leak.output for leak in report.leaks} <= differ_alone(
        model, ids, positions, allowed, reach, packed
    )


def test_a_window_leak_that_looks_like_a_deeper_model_needs_layers():
    """Two layers of a window of 4 reach exactly as far as three of a window of 3: no
    dependence pattern tells them apart, so the depth read off the model is 3 and the leak
    of a kernel of 4 for a mask of 3 passes — ``layers=2`` finds it."""
    lengths = [12, 11]
    seq_len = sum(lengths)
    docs = flexmask.causal() & flexmask.document(lengths)
    mask = docs & flexmask.sliding_window(3)
    kernel = (docs & flexmask.sliding_window(4)).to_dense(1, 1, seq_len, seq_len)[0, 0]
    model, attend = leaking_model(kernel)
    inputs = (random_ids(0, seq_len), torch.arange(seq_len).unsqueeze(0), attend)
    read_off = leak_test(model, inputs, mask, embedding=model.embed)
    assert read_off.ok and read_off.layers == 3
    told = leak_test(model, inputs, mask, embedding=model.embed, layers=2)
    assert_named(told, ~reach_of(mask, seq_len, 2)[1])


@pytest.mark.parametrize("seed", SEEDS)
def test_a_prefix_one_token_too_long_is_found(seed):
    """Prefix-LM documents whose kernel makes the prefix one token longer: the prefix
    reads the first token after it. Short prefixes in long documents: a random cut or a
    random token rarely lands in one."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(20, 29, (2,), generator=gen)]
    prefixes = [int(torch.randint(1, 3, (), generator=gen)) for n in lengths]

    def prefix_lm(extra):
        ids = []
        for number, (n, p) in enumerate(zip(lengths, prefixes, strict=True)):
            ids += [number] * min(p + extra, n) + [-1] * (n - min(p + extra, n))
        spans = flexmask.spans(torch.tensor([ids]))
        return (flexmask.causal() | spans) & flexmask.document(lengths)

    seq_len = sum(lengths)
    mask = prefix_lm(0)
    kernel = prefix_lm(1).to_dense(1, 1, seq_len, seq_len)[0, 0]
    model, attend = leaking_model(kernel, seed=seed)
    ids, positions = random_ids(seed, seq_len), torch.arange(seq_len).unsqueeze(0)
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed, seed=seed)
    allowed, reach = reach_of(mask, seq_len, 2)
    assert_named(report, ~reach)
    with torch.no_grad():
        packed = run(model, ids, positions, attend)
    differs = differ_alone(model, ids, positions, allowed, reach, packed)
    assert {leak.output for leak in report.leaks} <= differs
    assert 0 in differs  # the first prefix token reads past its prefix


class AmaxScaled(TinyLM):
    """Per-tensor amax scaling of the hidden states, as FP8 recipes do: the scale is a
    detached statistic over the whole packed batch (no gradient flows through it)."""

    def forward(self, ids, positions, attend):
        x = super().forward(ids, positions, attend)
        return x / x.abs().amax().detach()


class LeakyForward(torch.autograd.Function):
    """Attention whose forward ignores the documents and whose backward is the masked one's
    (a custom kernel with a bug in its forward only)."""

    @staticmethod
    def forward(ctx, q, k, v, allowed):
        ctx.save_for_backward(q, k, v, allowed)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, allowed = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        return dq, dk, dv, None


def _documents_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(3, 7, (3,), generator=gen)]
    seq_len = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return lengths, seq_len, random_ids(seed, seq_len), positions


@pytest.mark.parametrize("seed", SEEDS)
def test_a_detached_statistic_is_found(seed):
    lengths, seq_len, ids, positions = _documents_batch(seed)
    mask = flexmask.causal() & flexmask.document(lengths)
    torch.manual_seed(seed)
    model = AmaxScaled()
    attend = matrix_kernel(mask.to_dense(1, 1, seq_len, seq_len)[0, 0])
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed, seed=seed)
    assert any(leak.method == "perturb" for leak in report.leaks), str(report)
    assert_named(report, ~reach_of(mask, seq_len, 2)[1])
    assert_documents_agree(report, outputs_that_differ_alone(model, ids, positions, mask, 2))
    # What a gradient alone sees: nothing.
    assert leak_test(model, (ids, positions, attend), mask, embedding=model.embed, method="grad").ok


@pytest.mark.parametrize("seed", SEEDS)
def test_a_custom_op_leaking_in_its_forward_only_is_found(seed):
    lengths, seq_len, ids, positions = _documents_batch(seed)
    mask = flexmask.causal() & flexmask.document(lengths)
    allowed = mask.to_dense(1, 1, seq_len, seq_len)[0, 0]

    def attend(q, k, v):
        return LeakyForward.apply(q, k, v, allowed)

    torch.manual_seed(seed)
    model = TinyLM()
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed, seed=seed)
    assert report.leaks and all(leak.method == "perturb" for leak in report.leaks), str(report)
    assert_named(report, ~reach_of(mask, seq_len, 2)[1])
    with torch.no_grad():
        packed = run(model, ids, positions, attend)
    _, reach = reach_of(mask, seq_len, 2)
    differs = differ_alone(model, ids, positions, allowed, reach, packed)
    assert {leak.output for leak in report.leaks} <= differs
    assert (1, 0) in report.pairs and (2, 1) in report.pairs


class Keyworded(nn.Module):
    """A transformers-like model: ``model(input_ids=..., position_ids=...)``, attending
    causally over the whole row (it ignores the documents the positions describe)."""

    def __init__(self):
        super().__init__()
        self.inner = TinyLM()
        self.embed = self.inner.embed

    def forward(self, input_ids, position_ids):
        seq_len = input_ids.shape[1]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        return self.inner(input_ids, position_ids, matrix_kernel(causal))


@pytest.mark.parametrize("seed", SEEDS)
def test_position_ids_restarting_at_one_start_documents(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(2, 6, (3,), generator=gen)]
    start = int(torch.randint(1, 4, (), generator=gen))  # restart at 1, 2 or 3: never 0
    positions = torch.cat([torch.arange(start, start + n) for n in lengths]).unsqueeze(0)
    torch.manual_seed(seed)
    model = Keyworded()
    inputs = {"input_ids": random_ids(seed, sum(lengths)), "position_ids": positions}
    report = leak_test(model, inputs, seed=seed)
    assert len(report.documents) == 3, str(report)
    # The reference: a causal kernel over the row reads every earlier document.
    assert {(1, 0), (2, 0), (2, 1)} <= set(report.pairs), str(report)
    # check_batch reads the same documents off these positions.
    docs = flexmask.causal() & flexmask.document(lengths)
    assert flexmask.check_batch(mask=docs, position_ids=positions - start).ok


class TokenNorm(TinyLM):
    """BatchNorm over the tokens of the whole batch: in training mode its statistics mix
    the documents; in eval mode it uses running statistics, per token."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, ids, positions, attend):
        x = super().forward(ids, positions, attend)
        return self.norm(x.reshape(-1, x.shape[-1])).view_as(x)


@pytest.mark.parametrize("seed", SEEDS)
def test_batchnorm_over_tokens_in_training_mode_is_found(seed):
    lengths, seq_len, ids, positions = _documents_batch(seed)
    mask = flexmask.causal() & flexmask.document(lengths)
    torch.manual_seed(seed)
    model = TokenNorm().train()
    stats = model.norm.running_mean.clone()
    attend = matrix_kernel(mask.to_dense(1, 1, seq_len, seq_len)[0, 0])
    inputs = (ids, positions, attend)
    report = leak_test(model, inputs, mask, embedding=model.embed, seed=seed)
    assert_named(report, ~reach_of(mask, seq_len, 2)[1])
    # Statistics of a single token are not defined: the reference runs whole documents.
    reference = copy.deepcopy(model)
    with torch.no_grad():
        packed = run(reference, ids, positions, attend)
        differs, start = set(), 0
        for n in lengths:
            alone_mask = flexmask.causal().to_dense(1, 1, n, n)[0, 0]
            end = start + n
            alone = run(
                reference, ids[:, start:end], positions[:, start:end], matrix_kernel(alone_mask)
            )
            differs |= {
                start + t
                for t in range(n)
                if not torch.allclose(alone[0, t], packed[0, start + t], atol=1e-5)
            }
            start = end
    assert_documents_agree(report, differs)
    # The model is left as it was: training mode, running statistics untouched.
    assert model.training and torch.equal(model.norm.running_mean, stats)
    assert leak_test(model, inputs, mask, embedding=model.embed, train=False).ok
    assert model.training


class TinyLeak(TinyLM):
    """Adds 1e-30 of one input token's embedding to one output of another document: far
    below float32's resolution of the output, so only a gradient sees it."""

    def __init__(self, out, inp):
        super().__init__()
        self.pair = (out, inp)

    def forward(self, ids, positions, attend):
        x = super().forward(ids, positions, attend)
        out, inp = self.pair
        extra = torch.zeros_like(x)
        extra[:, out] = 1e-30 * self.embed(ids)[:, inp]
        return x + extra


@pytest.mark.parametrize("seed", SEEDS)
def test_a_leak_of_1e_30_is_found(seed):
    lengths, seq_len, ids, positions = _documents_batch(seed)
    mask = flexmask.causal() & flexmask.document(lengths)
    out, inp = seq_len - 1, 0  # last document reads the first's first token
    torch.manual_seed(seed)
    model = TinyLeak(out, inp)
    attend = matrix_kernel(mask.to_dense(1, 1, seq_len, seq_len)[0, 0])
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed, seed=seed)
    assert [(x.output, x.input) for x in report.leaks] == [(out, inp)], str(report)
    assert 0 < report.leaks[0].magnitude < 1e-28
    # No forward pass can see it: the outputs are bit for bit those of the clean model.
    clean = TinyLM()
    clean.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(run(model, ids, positions, attend), run(clean, ids, positions, attend))


# ---------------------------------------------------------------------- clean models pass
def _clean_cases(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(4, 9, (2,), generator=gen)]
    docs = flexmask.causal() & flexmask.document(lengths)
    seq_len = sum(lengths)
    parents = tree_parents(int(torch.randint(2, 6, (), generator=gen)), [3, 2, 4])
    prefix_ids = torch.tensor(
        [[0] * 3 + [-1] * (lengths[0] - 3) + [1] * 2 + [-1] * (lengths[1] - 2)]
    )
    arange = torch.arange(seq_len).unsqueeze(0)
    return {
        "documents": (docs, seq_len, arange),
        "window": (docs & flexmask.sliding_window(3), seq_len, arange),
        "prefix_lm": (
            (flexmask.causal() | flexmask.spans(prefix_ids)) & flexmask.document(lengths),
            seq_len,
            arange,
        ),
        "tree": (flexmask.tree(parents), len(parents), depths(parents)),
    }


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", ["documents", "window", "prefix_lm", "tree"])
def test_clean_models_pass(case, seed):
    mask, seq_len, positions = _clean_cases(seed)[case]
    torch.manual_seed(seed)
    model = TinyLM()
    attend = matrix_kernel(mask.to_dense(1, 1, seq_len, seq_len)[0, 0])
    ids = random_ids(seed, seq_len)
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed, seed=seed)
    assert report.ok and report.method == "grad+perturb", str(report)
    assert report.layers == (2 if case == "window" else None)
    assert not outputs_that_differ_alone(model, ids, positions, mask, 2)


class Dropped(TinyLM):
    """Dropout on the hidden states: random in training mode, never across tokens."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, ids, positions, attend):
        return self.drop(super().forward(ids, positions, attend))


def test_dropout_in_training_mode_is_not_a_leak():
    """Every forward pass draws the same dropout masks: the forward passes move outputs
    only where the inputs moved, and the model stays in training mode."""
    lengths, seq_len, ids, positions = _documents_batch(0)
    mask = flexmask.causal() & flexmask.document(lengths)
    model = Dropped().train()
    attend = matrix_kernel(mask.to_dense(1, 1, seq_len, seq_len)[0, 0])
    report = leak_test(model, (ids, positions, attend), mask, embedding=model.embed)
    assert report.ok and report.method == "grad+perturb", str(report)
    assert model.training


# ---------------------------------------------------------------------- the plan
def brute_force_uncovered(relation, sources, targets, passes):
    """Forbidden (source, target) pairs over the flattened batch that no pass tests."""
    batch, seq_len = sources.shape
    n = batch * seq_len
    rel = torch.zeros(n, n, dtype=torch.bool)
    for b in range(batch):
        rel[b * seq_len : (b + 1) * seq_len, b * seq_len : (b + 1) * seq_len] = relation[b]
    forbidden = sources.reshape(-1, 1) & targets.reshape(1, -1) & ~rel
    tested = torch.zeros_like(forbidden)
    for chosen in passes:
        chosen = chosen.reshape(-1)
        reached = rel[chosen].any(0)
        tested |= chosen.view(-1, 1) & ~reached.view(1, -1)
    return forbidden & ~tested


def _plans(mask, batch, seq_len, layers=None):
    allowed = mask.to_dense(batch, 1, seq_len, seq_len)[:, 0]
    real = allowed.any(-1)
    step = allowed | (torch.eye(seq_len, dtype=torch.bool) & real.unsqueeze(-1))
    closure = _closure(step)
    reach = closure if layers is None else _power(step, layers)
    component = _components(closure, real)
    every = torch.ones_like(real)
    for relation, sources, targets in ((reach, real, every), (reach.transpose(1, 2), every, real)):
        passes = plan(relation, sources, targets, component)
        yield relation, sources, targets, passes, int(component.max()) + 1


MASKS = {
    "documents": (flexmask.causal() & flexmask.document([[5, 9], [3, 7, 4]]), 2, 16, None),
    "tree": (flexmask.tree(tree_parents(4, [3, 1, 4, 2])), 1, 14, None),
    "window": (
        flexmask.causal() & flexmask.sliding_window(3) & flexmask.document([10, 7]),
        1,
        17,
        2,
    ),
    "bidirectional window": (flexmask.sliding_window(2) & flexmask.document([6, 6]), 1, 12, 3),
    "prefix_lm": (
        (flexmask.causal() | flexmask.prefix(3)) & flexmask.padding([9]),
        1,
        12,
        None,
    ),
    "chunked": (flexmask.causal() & flexmask.chunked(4), 1, 13, None),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_the_plan_tests_every_forbidden_pair(name):
    mask, batch, seq_len, layers = MASKS[name]
    for relation, sources, targets, passes, _ in _plans(mask, batch, seq_len, layers):
        uncovered = brute_force_uncovered(relation, sources, targets, passes)
        assert not bool(uncovered.any()), uncovered.nonzero()[:5]


@pytest.mark.parametrize("seed", range(10))
def test_the_plan_covers_random_relations(seed):
    """Any relation (not a mask's): a random one, reflexive, over two rows with padding."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = 12
    relation = torch.rand(2, seq_len, seq_len, generator=gen) < 0.3
    real = torch.ones(2, seq_len, dtype=torch.bool)
    real[1, 9:] = False
    relation &= real.unsqueeze(-1) & real.unsqueeze(1)
    relation |= torch.eye(seq_len, dtype=torch.bool) & real.unsqueeze(-1)
    component = _components(_closure(relation), real)
    passes = plan(relation, real, torch.ones_like(real), component)
    uncovered = brute_force_uncovered(relation, real, torch.ones_like(real), passes)
    assert not bool(uncovered.any())


def test_the_plan_for_causal_documents_is_as_short_as_cuts_allow():
    """``1 + 2 * ceil(log2 documents) + (longest - 1)`` grad passes: every document's cuts at
    once; ``(t, t + 1)`` is tested only by a pass whose latest output is ``t``."""
    lengths = [[5, 9], [3, 7, 4]]
    mask = flexmask.causal() & flexmask.document(lengths)
    (_, _, _, passes, count), _ = list(_plans(mask, 2, 16))
    assert count == 5
    assert len(passes) == 1 + 2 * math.ceil(math.log2(5)) + (9 - 1)


# ---------------------------------------------------------------------- wrong inputs
def test_wrong_inputs_are_named():
    model = TinyLM()
    ids = torch.randint(1, 32, (1, 8))
    inputs = (ids, torch.arange(8).unsqueeze(0), dense_kernel(flexmask.causal(), 1, 8))
    mask = flexmask.causal()
    cases = [
        (dict(model=3), TypeError, "model must be"),
        (dict(inputs=[ids]), TypeError, "inputs must be a mapping"),
        (dict(inputs=()), ValueError, "inputs is an empty tuple"),
        (dict(mask=torch.ones(8, 8, dtype=torch.bool)), TypeError, "mask must be a flexmask Mask"),
        (dict(seq_lens=[4, 4]), ValueError, "give mask or seq_lens"),
        (dict(embedding="embed"), TypeError, "embedding must be"),
        (dict(output=3), TypeError, "output must be a callable"),
        (dict(method="fast"), ValueError, "method must be"),
        (dict(samples=-1), ValueError, "samples must be >= 0"),
        (dict(samples=1.5), TypeError, "samples must be an int"),
        (dict(seed="0"), TypeError, "seed must be an int"),
        (dict(layers=0), ValueError, "layers must be >= 1"),
        (dict(train="yes"), TypeError, "train must be None"),
        (dict(mask=flexmask.document([[4, 4], [8]])), ValueError, "mask does not fit the batch"),
        (dict(output=lambda out: out[0]), ValueError, "not per token"),
    ]
    for change, error, words in cases:
        kwargs = dict(model=model, inputs=inputs, mask=mask, embedding=model.embed)
        kwargs.update(change)
        with pytest.raises(error, match=words):
            leak_test(kwargs.pop("model"), kwargs.pop("inputs"), kwargs.pop("mask"), **kwargs)
    keyworded = Keyworded()
    for positions, words in (
        (torch.arange(7).unsqueeze(0), r"position_ids must be \(B, S\) = \(1, 8\)"),
        (torch.arange(8.0).unsqueeze(0), "position_ids must be an integer tensor"),
    ):
        with pytest.raises((ValueError, TypeError), match=words):
            leak_test(keyworded, {"input_ids": ids, "position_ids": positions})


def test_the_plan_for_a_tree_runs_siblings_side_by_side():
    """A prompt of 6 and responses of 4, 2 and 3, each way: one pass with everything, one
    per response (it against its siblings), the prompt's 5 cuts and the longest response's 3
    cuts, the responses' cuts side by side."""
    mask = flexmask.tree(tree_parents(6, [4, 2, 3]))
    for relation, sources, targets, passes, count in _plans(mask, 1, 15):
        assert count == 1
        assert not bool(brute_force_uncovered(relation, sources, targets, passes).any())
        assert len(passes) == 1 + 3 + (6 - 1) + (4 - 1)
