"""model_inputs gives every layer kind of transformers' hybrid models what it reads: the
attention layers their masks, the recurrent and convolution layers the document boundaries
(cu_seq_lens_q, seq_idx), positions that restart and labels that never cross a document.

The boundaries are followed to the kernels: each architecture's modeling module calls its
sequence-mixing kernels (causal_conv1d_fn, the delta rule, the Mamba scans) through module
globals, which the test replaces with recorders. What a kernel receives under the name its
package reads (causal_conv1d's and mamba_ssm's ``seq_idx``, fla's ``cu_seqlens``) is compared
with boundaries written plainly from the packed lengths, and with what check_inputs says of
the model: it must name exactly the architectures whose kernels get no boundaries.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from flexmask.integrations.transformers import flash_kwargs, model_inputs  # noqa: E402
from flexmask.integrations.transformers_check import check_inputs  # noqa: E402
from flexmask.integrations.transformers_layers import (  # noqa: E402
    boundary_kwargs,
    causal_lm_labels,
    layer_kinds,
    mask_kinds,
    unkept_layers,
)
from flexmask.packing import pack, pack_one_tree  # noqa: E402
from tests.hybrid_models import HYBRIDS, tiny_model  # noqa: E402

SEQUENCES = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
MAX_LEN = 9  # rows [5, 4] and [3, 2] plus padding: B = 2, documents mid-row, padding at ends

# The sequence-mixing kernels, and the argument their package reads the boundaries from
# (None: no kernel of that kind takes them).
LEAVES = {
    "causal_conv1d_fn": "seq_idx",  # causal_conv1d
    "mamba2_chunk_scan": "seq_idx",  # mamba_ssm's mamba_chunk_scan_combined
    "torch_chunk_gated_delta_rule": "cu_seqlens",  # fla's chunk_gated_delta_rule
    "chunk_kimi_delta_attention": "cu_seqlens",  # fla's chunk_kda
    "mamba_selective_scan": None,  # mamba_ssm's selective_scan_fn
}
_PACKING = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q")
_PACKING += ("max_length_k",)


@functools.cache
def _model(name):
    return tiny_model(name)


def _batch():
    return pack(SEQUENCES, MAX_LEN)


def _plain_boundaries(seq_lens, max_len):
    """cu over the B * S tokens end to end (documents, then each padding token alone) and
    the index of every token's sequence, written from the lengths."""
    cu, seq_idx, index = [0], [], 0
    for row in seq_lens:
        pieces = list(row) + [1] * (max_len - sum(row))
        for length in pieces:
            cu.append(cu[-1] + length)
            seq_idx += [index] * length
            index += 1
    return cu, [seq_idx[r * max_len : (r + 1) * max_len] for r in range(len(seq_lens))]


def _recorded_run(model, inputs):
    """Runs ``model(**inputs)`` with its kernels recorded: {kernel name: [kwargs names]}.
    The recorders pass the call on without the packing arguments, which transformers'
    torch path (this CPU's) refuses."""
    module = importlib.import_module(type(model).__module__)
    originals = {n: f for n, f in vars(module).items() if n in LEAVES}
    received: dict[str, dict] = {}

    def recorder(name, original):
        def call(*args, **kwargs):
            seen = {k: v for k, v in kwargs.items() if k in _PACKING and v is not None}
            received.setdefault(name, {}).update(seen)
            return original(*args, **{k: v for k, v in kwargs.items() if k not in _PACKING})

        return call

    try:
        for name, original in originals.items():
            setattr(module, name, recorder(name, original))
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        for name, original in originals.items():
            setattr(module, name, original)
    return received


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_kernels_get_the_boundaries_check_inputs_says_they_get(name):
    model, batch = _model(name), _batch()
    inputs = model_inputs(model, batch, check=True)
    cu, seq_idx = _plain_boundaries(batch.seq_lens, MAX_LEN)
    assert inputs["cu_seq_lens_q"].tolist() == cu and inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["seq_idx"].tolist() == seq_idx and inputs["seq_idx"].dtype == torch.int32
    assert inputs["max_length_q"] == inputs["max_length_k"] == max(map(len, SEQUENCES))
    received = _recorded_run(model, inputs)
    taken = {}
    for kernel, got in received.items():
        reads = LEAVES[kernel]
        taken[kernel] = reads is not None and reads in got
        if taken[kernel]:
            expected = cu if reads == "cu_seqlens" else seq_idx
            assert got[reads].tolist() == expected, (name, kernel)
    every_kernel_takes_them = bool(taken) and all(taken.values())
    messages = [m for _, m in unkept_layers(model, inputs)]
    # On this CPU transformers refuses given boundaries, and fla takes one row: neither is
    # a kernel reading none.
    unread = [m for m in messages if "do not run here" not in m and "takes one row" not in m]
    assert (not unread) == every_kernel_takes_them, (name, received, messages)


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_positions_restart_and_labels_never_cross(name):
    model, batch = _model(name), _batch()
    inputs = model_inputs(model, batch, labels=True)
    for row, lengths in enumerate(batch.seq_lens):
        positions = [p for n in lengths for p in range(n)]
        assert inputs["position_ids"][row, : len(positions)].tolist() == positions
        # transformers shifts: the logit at p is scored against labels[p + 1], which must be
        # the next token of p's own document, or -100.
        start = 0
        for n in lengths:
            for p in range(start, start + n):
                target = int(inputs["labels"][row, p + 1]) if p + 1 < MAX_LEN else -100
                expected = int(batch.tokens[row, p + 1]) if p + 1 < start + n else -100
                assert target == expected, (row, p)
            start += n
        assert (inputs["labels"][row, start + 1 :] == -100).all()


def test_each_layer_kind_gets_its_mask_key():
    assert layer_kinds(_model("falcon_h1").config) == ("full_attention", "linear_attention")
    assert layer_kinds(_model("jamba").config) == ("linear_attention", "full_attention")
    assert layer_kinds(_model("nemotron_h").config) == ("linear_attention", "full_attention")
    masks = model_inputs(_model("lfm2"), _batch())["attention_mask"]
    assert (
        set(masks)
        == set(mask_kinds(_model("lfm2").config))
        == {
            "conv",
            "full_attention",
            "linear_attention",
        }
    )
    assert masks["conv"] is None and masks["linear_attention"] is None
    dense = masks["full_attention"][:, 0]
    assert not dense[0, 5, :5].any() and dense[0, 5, 5]  # the second document sees only itself


def test_check_inputs_names_the_layer_kind_without_boundaries():
    model, batch = _model("qwen3_next"), _batch()
    bare = {"input_ids": batch.tokens, "position_ids": batch.position_ids, "use_cache": False}
    report = check_inputs(model, bare)
    assert report.first.inputs[0] == "linear_attention layers (Qwen3NextGatedDeltaNet)"
    assert report.first.token == 5  # where the second document, and the leak, starts
    assert "pass cu_seq_lens_q/seq_idx (model_inputs does)" in report.first.message
    assert "keep_documents_apart(model)" in report.first.message
    one_row = pack(SEQUENCES, sum(map(len, SEQUENCES)))  # fla's varlen delta rule: B = 1
    given = check_inputs(model, model_inputs(model, one_row), batch=one_row)
    assert "do not run here (cpu)" in given.first.message  # transformers would refuse them
    jamba = check_inputs(_model("jamba"), model_inputs(_model("jamba"), batch), batch=batch)
    assert "never get document boundaries" in jamba.first.message


def test_check_inputs_is_quiet_with_the_fallback_and_on_one_document_rows():
    hybrid = pytest.importorskip("flexmask.integrations.hybrid")
    model, batch = tiny_model("lfm2"), _batch()
    inputs = model_inputs(model, batch)
    assert not check_inputs(model, inputs, batch=batch).ok
    with hybrid.keep_documents_apart(model):
        assert check_inputs(model, inputs, batch=batch).ok
        # and the fallback reads model_inputs' boundaries: each document as it is alone
        with torch.no_grad():
            packed = model(**inputs, use_cache=False).logits
            for i, sequence in enumerate(SEQUENCES):
                alone = model(input_ids=torch.tensor([sequence])).logits[0]
                assert torch.allclose(batch.unpack(packed)[i], alone, atol=1e-5)
    alone = pack([SEQUENCES[0]], 5)
    assert check_inputs(model, model_inputs(model, alone), batch=alone).ok


def test_refusals_name_the_argument():
    with pytest.raises(TypeError, match="recurrent layers"):
        model_inputs(_model("lfm2"), pack_one_tree([[1, 2, 3], [1, 2, 4]]))
    with pytest.raises(ValueError, match="must end at B \\* S = 6"):
        cu = torch.tensor([0, 3, 5], dtype=torch.int32)
        boundary_kwargs({"cu_seq_lens_q": cu}, (1, 6))
    with pytest.raises(TypeError, match="labels must be a \\(B, S\\) tensor"):
        causal_lm_labels(torch.zeros(3))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    max_len=st.integers(1, 12),
    ignore=st.sampled_from([-100, -1]),
)
def test_boundaries_and_labels_against_plain_ones(lengths, max_len, ignore):
    sequences = [list(range(1, n + 1)) for n in lengths]
    batch = pack(sequences, max_len, ignore_index=ignore)
    shape = (batch.num_rows, max_len)
    found = boundary_kwargs(flash_kwargs(batch), shape)
    cu, seq_idx = _plain_boundaries(batch.seq_lens, max_len)
    assert found["cu_seq_lens_q"].tolist() == cu and found["seq_idx"].tolist() == seq_idx
    assert found["seq_idx"].dtype == torch.int32 and found["seq_idx"].shape == shape
    labels = causal_lm_labels(batch.labels, ignore)
    for row, row_lengths in enumerate(batch.seq_lens):
        start = 0
        expected = [ignore] * max_len
        for n in row_lengths:  # the token itself, but never a document's first one
            for p in range(start + 1, start + n):
                expected[p] = int(batch.tokens[row, p])
            start += n
        assert labels[row].tolist() == expected


def test_flash_implementations_get_the_boundaries_and_no_mask():
    inputs = model_inputs(_model("bamba"), _batch(), implementation="flash_attention_2")
    assert "attention_mask" not in inputs
    cu, seq_idx = _plain_boundaries(_batch().seq_lens, MAX_LEN)
    assert inputs["cu_seq_lens_q"].tolist() == cu and inputs["seq_idx"].tolist() == seq_idx


def test_the_delta_rule_takes_one_row():
    model = _model("qwen3_next")
    two_rows = [m for _, m in unkept_layers(model, model_inputs(model, _batch()))]
    assert any("fla's varlen delta rule takes one row (B = 1)" in m for m in two_rows)
    one_row = pack(SEQUENCES, sum(map(len, SEQUENCES)))
    messages = [m for _, m in unkept_layers(model, model_inputs(model, one_row))]
    assert messages and not any("takes one row" in m for m in messages)


def test_check_inputs_sees_boundaries_that_disagree_with_the_documents():
    model, batch = _model("bamba"), _batch()
    inputs = model_inputs(model, batch)
    merged = inputs["seq_idx"].clone()
    merged[0, 5:9] = merged[0, 0]  # the second document numbered as the first
    report = check_inputs(model, {**inputs, "seq_idx": merged}, batch=batch)
    assert any("seq_idx" in d.inputs for d in report.disagreements), report
    with pytest.raises(ValueError, match="seq_idx"):
        check_inputs(model, {**inputs, "seq_idx": merged}, batch=batch, raise_on_error=True)
