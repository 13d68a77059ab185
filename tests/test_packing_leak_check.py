"""flexmask.testing.leak_test on tiny models: every incident of issue #31 as a deliberately
broken configuration is caught with the leaking pair named, every correct one passes — and
both verdicts agree with an independent reference, each document run alone through the model.

The reference: a document's outputs in the packed batch equal its outputs alone iff nothing
else reaches them. So for every case the test asserts ``report.ok`` exactly when the packed
outputs equal the alone ones, and that the documents the leak test names are those whose
outputs differ.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask.testing import leak_test
from tests.leak_models import TinyLM, alone_differs, dense_kernel, flex_kernel, packed_batch, run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def leaked_outputs(report):
    return {out for out, _ in report.pairs if out >= 0}


def flagged(report):
    """The documents the leak test says are reached by something, or miss something."""
    found = leaked_outputs(report)
    for m in report.missing:
        found |= {
            number
            for number, (row, first, length) in enumerate(report.documents)
            if row == m.row and first <= m.output < first + length
        }
    return found


def check_both_sides(model, batch, attend, mask=None, doc_mask=None, **kwargs):
    """The leak test and the reference agree; returns the report."""
    mask = batch.mask if mask is None else mask
    inputs = (batch.tokens, batch.position_ids, attend)
    report = leak_test(model, inputs, mask, embedding=model.embed, **kwargs)
    with torch.no_grad():
        out = run(model, batch.tokens, batch.position_ids, attend)
    differs = alone_differs(model, batch, out, doc_mask)
    assert flagged(report) <= differs, (str(report), differs)
    if not report.missing:  # every pair of documents is tested: exactly those differ
        assert leaked_outputs(report) == differs, (str(report), differs)
    assert report.ok == (not differs), (str(report), differs)
    return report


# ---------------------------------------------------------------------- correct configurations
@pytest.mark.parametrize("kernel", ["flex", "dense"])
def test_a_correct_packed_batch_passes(kernel):
    model = TinyLM()
    batch = packed_batch([5, 9, 3, 7, 4], max_len=16)
    attend = (
        flex_kernel(batch.lazy(block_size=4))
        if kernel == "flex"
        else dense_kernel(batch.mask, batch.num_rows, batch.max_len)
    )
    report = check_both_sides(model, batch, attend)
    assert report.ok and report.method == "grad+perturb"
    assert len(report.documents) == 5
    # Each way (backward, then forward): every source at once, 2 * ceil(log2 5) passes
    # between documents, the 8 cuts of the longest (9 tokens); forward, moved padding
    # alone; then 2 single tokens per document for the influences the mask allows.
    each_way = 1 + 2 * math.ceil(math.log2(5)) + (9 - 1)
    assert report.passes == each_way + (each_way + 1) + 2


# ---------------------------------------------------------------------- the incidents
def test_all_ones_attention_mask_on_a_packed_batch_is_caught():
    """fastrl #14: a packed batch attended as one sequence per row."""
    model = TinyLM()
    batch = packed_batch([5, 6, 4], max_len=16)
    plain_causal = dense_kernel(flexmask.causal(), 1, 16)
    report = check_both_sides(model, batch, plain_causal)
    assert not report.ok
    assert {(1, 0), (2, 0), (2, 1)} <= set(report.pairs)
    first = min(report.leaks, key=lambda leak: (leak.output_document, leak.input_document))
    assert (first.output_document, first.input_document) == (1, 0)
    assert 5 <= first.output < 11 and 0 <= first.input < 5


def test_dropped_seq_lens_is_caught():
    """prime-rl #2944: seq_lens dropped, the kernel gets a mask without documents."""
    model = TinyLM()
    batch = packed_batch([4, 4, 6], max_len=14)
    dropped = flexmask.create_block_mask(flexmask.causal(), 1, 1, 14, 14, BLOCK_SIZE=4)
    report = check_both_sides(model, batch, flex_kernel(dropped))
    assert (1, 0) in report.pairs and (2, 1) in report.pairs


def test_a_mask_built_for_other_lengths_is_caught():
    """A BlockMask of the previous batch's documents, same row length."""
    model = TinyLM()
    batch = packed_batch([6, 3, 5], max_len=14)
    stale = flexmask.causal() & flexmask.document([3, 6, 5])
    report = check_both_sides(model, batch, flex_kernel(flexmask.lazy(stale, 1, 1, 14, 14)))
    assert not report.ok
    # Stale boundary at 9 instead of 6 and 9: document 1 (tokens 6-8) reads document 0.
    assert (1, 0) in report.pairs
    leak = next(x for x in report.leaks if (x.output_document, x.input_document) == (1, 0))
    assert 6 <= leak.output < 9 and 3 <= leak.input < 6


def test_a_causal_only_kernel_given_a_prefix_lm_mask_is_caught():
    """NeMo Automodel #2622: the kernel dropped the non-causal part (bidirectional prefixes)."""
    model = TinyLM()
    batch = packed_batch([6, 5], max_len=11)
    prefix_ids = torch.tensor([[0, 0, 0, -1, -1, -1, 1, 1, -1, -1, -1]])
    prefix_lm = (flexmask.causal() | flexmask.spans(prefix_ids)) & flexmask.document([6, 5])
    causal_kernel = flex_kernel(flexmask.lazy(batch.mask, 1, 1, 11, 11))

    def doc_prefix(n):  # each document alone: its prefix (3, then 2 tokens) bidirectional
        return flexmask.causal() | flexmask.prefix(3 if n == 6 else 2)

    report = check_both_sides(
        model, batch, causal_kernel, mask=prefix_lm, doc_mask=doc_prefix, samples=6
    )
    assert not report.leaks and report.missing
    missing = report.missing[0]
    # A prefix token that does not see a later prefix token of its own document.
    in_prefix = {(0, 0), (0, 1), (0, 2), (0, 6), (0, 7)}
    assert (missing.row, missing.output) in in_prefix and missing.input > missing.output
    # The right kernel passes.
    right = flex_kernel(flexmask.lazy(prefix_lm, 1, 1, 11, 11))
    assert check_both_sides(model, batch, right, mask=prefix_lm, doc_mask=doc_prefix).ok


@pytest.mark.parametrize("mixer", ["scan", "reset"])
def test_a_recurrent_layer_that_ignores_boundaries_is_caught(mixer):
    """transformers #46093: boundaries from position_ids never reached the recurrent layers."""
    model = TinyLM(mixer=mixer)
    batch = packed_batch([4, 3, 5], max_len=12)
    report = check_both_sides(model, batch, flex_kernel(batch.lazy(block_size=4)))
    if mixer == "reset":
        assert report.ok
    else:
        # A recurrence carries every document into all the later ones.
        assert set(report.pairs) == {(1, 0), (2, 0), (2, 1)}


def test_padding_and_rows_are_kept_apart():
    """Two rows, right padding: no real output reads padding or the other row."""
    model = TinyLM()
    batch = packed_batch([6, 3, 5, 4], max_len=10)
    assert batch.num_rows == 2
    assert check_both_sides(model, batch, flex_kernel(batch.lazy(block_size=4))).ok

    class RowMixer(TinyLM):  # adds row 1 to row 0: a leak across rows
        def forward(self, ids, positions, attend):
            x = super().forward(ids, positions, attend)
            return torch.cat([x[:1] + x[1:], x[1:]])

    mixed = RowMixer()
    inputs = (batch.tokens, batch.position_ids, flex_kernel(batch.lazy()))
    report = leak_test(mixed, inputs, batch.mask, embedding=mixed.embed)
    across = [leak for leak in report.leaks if leak.input_row != leak.row]
    assert across and all((leak.row, leak.input_row) == (0, 1) for leak in across)


def test_forward_only_kernels_are_tested_by_perturbation():
    model = TinyLM()
    batch = packed_batch([5, 6, 4], max_len=16)
    right = leak_test(
        model,
        (batch.tokens, batch.position_ids, flex_kernel(batch.lazy(block_size=4))),
        batch.mask,
        embedding=model.embed,
        method="perturb",
    )
    assert right.ok and right.method == "perturb"
    wrong = leak_test(
        model,
        (batch.tokens, batch.position_ids, dense_kernel(flexmask.causal(), 1, 16)),
        batch.mask,
        embedding=model.embed,
        method="perturb",
    )
    assert {(1, 0), (2, 0), (2, 1)} <= set(wrong.pairs)


def test_auto_falls_back_to_forward_passes_without_a_backward():
    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("this kernel has no backward")

    model = TinyLM()
    batch = packed_batch([5, 6], max_len=11)
    attend = dense_kernel(batch.mask, 1, 11)

    def kernel(q, k, v):
        return NoBackward.apply(attend(q, k, v))

    report = leak_test(
        model, (batch.tokens, batch.position_ids, kernel), batch.mask, embedding=model.embed
    )
    assert report.ok and report.method == "perturb"


# ---------------------------------------------------------------------- random batches
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    stale=st.lists(st.integers(1, 7), min_size=1, max_size=5),
)
def test_random_batches_against_documents_alone(lengths, stale):
    """One layer: what reaches an output is what the kernel's mask lets it attend. A plain
    dense reading of that mask says which documents leak and which miss something; the
    documents alone say which differ; the leak test must agree with both."""
    model = TinyLM(layers=1)
    max_len = max(sum(lengths), 4)
    batch = packed_batch(lengths, max_len=max_len)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    doc = torch.cat([doc, torch.full((max_len - sum(lengths),), -1)])
    intent = batch.mask.to_dense(1, 1, max_len, max_len)[0, 0]
    # A stale mask may run past the row: cut at its end, as a stale BlockMask of that length is.
    for mask in (batch.mask, flexmask.causal() & flexmask.document(stale, truncate=True)):
        attend = dense_kernel(mask, 1, max_len)
        kernel = mask.to_dense(1, 1, max_len, max_len)[0, 0]
        real = doc >= 0
        kernel = kernel | (~kernel.any(-1, keepdim=True) & torch.eye(max_len, dtype=torch.bool))
        outside = kernel & (doc.view(1, -1) != doc.view(-1, 1)) & real.view(-1, 1)
        lacking = intent & ~kernel
        oracle_leak = {int(d) for d in doc[outside.any(-1)]}
        oracle_missing = {int(d) for d in doc[lacking.any(-1)]}
        report = leak_test(
            model,
            (batch.tokens, batch.position_ids, attend),
            batch.mask,
            embedding=model.embed,
            samples=1,
        )
        with torch.no_grad():
            out = run(model, batch.tokens, batch.position_ids, attend)
        assert alone_differs(model, batch, out) == oracle_leak | oracle_missing
        assert leaked_outputs(report) == oracle_leak, str(report)
        assert flagged(report) - leaked_outputs(report) <= oracle_missing, str(report)
        assert bool(report.leaks) == bool(oracle_leak)


# ---------------------------------------------------------------------- transformers models
def _hf(config_name, implementation, **settings):
    transformers = pytest.importorskip("transformers")
    config_cls = getattr(transformers, config_name, None)
    if config_cls is None:
        pytest.skip(f"{config_name} is not in transformers {transformers.__version__}")
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    config = config_cls(**{**common, **settings})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation
    ).float()


def _hf_both_sides(model, lengths, **extra):
    """leak_test on transformers' packed format (position_ids restarting, no attention mask)
    against two references: each document alone (its outputs differ where something leaks
    in, beyond float noise), and, exactly, new token ids in one document at a time — the
    documents whose outputs move by a bit are those it leaks into."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    inputs = {"input_ids": ids, "position_ids": positions, **extra}
    report = leak_test(model, inputs, samples=1)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        differs = set()
        for number, (start, n) in enumerate(zip(starts, lengths, strict=True)):
            alone = model(input_ids=ids[:, start : start + n], use_cache=False).logits[0]
            if not torch.allclose(packed[start : start + n], alone, atol=1e-4):
                differs.add(number)
        moved = set()
        for source, (start, n) in enumerate(zip(starts, lengths, strict=True)):
            changed = ids.clone()
            changed[:, start : start + n] = (changed[:, start : start + n] + 7) % 63 + 1
            out = model(**{**inputs, "input_ids": changed}).logits[0]
            for target, (t0, m) in enumerate(zip(starts, lengths, strict=True)):
                if target != source and not torch.equal(out[t0 : t0 + m], packed[t0 : t0 + m]):
                    moved.add((target, source))
    assert differs <= leaked_outputs(report), (str(report), differs)
    # A gradient sees influences below a forward pass's float resolution (a recurrence's
    # decay over a whole document); every pair that moves an output bit is among them.
    assert moved <= set(report.pairs), (str(report), moved)
    scale = max(report.pairs.values(), default=0.0)
    assert all(report.pairs[p] < 1e-5 * scale for p in set(report.pairs) - moved), str(report)
    return report


LLAMA = dict(num_hidden_layers=2)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_transformers_packed_position_ids(implementation):
    model = _hf("LlamaConfig", implementation, **LLAMA)
    # Without a cache transformers reads the documents off the restarting positions.
    assert _hf_both_sides(model, [5, 4, 6], use_cache=False).ok
    # With one (config.use_cache is True by default) it builds a plain causal mask.
    leaky = _hf_both_sides(model, [5, 4, 6])
    assert {(1, 0), (2, 0), (2, 1)} <= set(leaky.pairs)
    # An all-ones attention_mask: one sequence per row, whatever the positions say.
    ones = _hf_both_sides(
        model, [5, 4, 6], use_cache=False, attention_mask=torch.ones(1, 15, dtype=torch.long)
    )
    assert (1, 0) in ones.pairs


def test_transformers_with_flexmask_attention():
    pytest.importorskip("transformers")
    from flexmask.integrations.transformers import model_inputs, register

    register()
    model = _hf("LlamaConfig", "flexmask", **LLAMA)
    batch = packed_batch([5, 4, 6], max_len=16, vocab=64)
    inputs = model_inputs(model, batch, block_size=8)
    report = leak_test(model, inputs, batch.mask)
    assert report.ok and report.method == "grad+perturb"


@pytest.mark.slow
def test_transformers_flex_attention_on_the_cpu():
    """torch's CPU flex kernel has no backward: tested with forward passes (compiles)."""
    pytest.importorskip("transformers")
    from flexmask.integrations.transformers import model_inputs

    model = _hf("LlamaConfig", "flex_attention", **LLAMA)
    batch = packed_batch([5, 4, 6], max_len=16, vocab=64)
    report = leak_test(model, model_inputs(model, batch), batch.mask)
    assert report.ok and report.method == "perturb"


HYBRIDS = {
    # Linear attention (gated delta net) + full attention.
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=1,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            head_dim=16,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
    ),
    # Mamba 2 + attention in every layer.
    "falcon_h1": (
        "FalconH1Config",
        dict(
            num_hidden_layers=2,
            mamba_d_ssm=32,
            mamba_n_heads=2,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            head_dim=16,
            mamba_chunk_size=8,
        ),
    ),
    # Mamba 2 layers and attention layers.
    "bamba": (
        "BambaConfig",
        dict(
            num_hidden_layers=2,
            attn_layer_indices=[1],
            mamba_n_heads=2,
            mamba_d_head=32,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=8,
        ),
    ),
    # Short convolutions + attention.
    "lfm2": ("Lfm2Config", dict(num_hidden_layers=2, layer_types=["conv", "full_attention"])),
}


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_hybrid_models_packed_on_the_cpu(name):
    """On the CPU (no causal-conv1d / mamba-ssm / fla kernels) transformers' recurrent and
    convolution layers run over the packed row as one sequence: the leak test finds the
    documents they carry into the next ones, and the reference agrees; the attention layers
    alone keep them apart. transformers refuses ``seq_idx`` / ``cu_seqlens`` there."""
    config_name, settings = HYBRIDS[name]
    model = _hf(config_name, "sdpa", **settings)
    report = _hf_both_sides(model, [5, 4, 6], use_cache=False)
    assert not report.ok and (1, 0) in report.pairs
    # One document per row (padding after it) keeps them apart.
    padded = _padded_rows_pass(model, [5, 4, 6])
    assert padded.ok


def _padded_rows_pass(model, lengths):
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.arange(1, n + 1)
        attention[row, :n] = 1
    mask = flexmask.causal() & flexmask.padding(lengths)
    return leak_test(
        model,
        {"input_ids": ids, "attention_mask": attention, "use_cache": False},
        mask,
        samples=1,
    )
