"""flexmask.check_batch: every input of a training step against the others, and every kernel
argument against the batch's mask. Each incident of issue #31 is a deliberately broken input
whose first disagreement — row, token, the inputs named — is computed independently (a plain
reading of the documents, or a dense mask); each correct input passes. Where a model reads
the inputs, the check's verdict is also compared with each document run alone through it.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

import flexmask
from flexmask import check_batch
from flexmask.packing import PackedDataset, PackingCollator
from tests.leak_models import TinyLM, alone_differs, dense_kernel, flex_kernel, packed_batch, run

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
documents = st.lists(st.integers(1, 9), min_size=1, max_size=6)


def layout(batch):
    """Per token, plainly: document number in its row (-1: padding), and starts."""
    doc = torch.full(batch.tokens.shape, -1)
    for row, lengths in enumerate(batch.seq_lens):
        start = 0
        for number, n in enumerate(lengths):
            doc[row, start : start + n] = number
            start += n
    real = doc >= 0
    starts = real & torch.cat(
        [torch.ones_like(doc[:, :1], dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1
    )
    return doc, real, starts


def first_where(flags):
    """The first (row, token) where ``flags`` is True, row-major."""
    hits = flags.nonzero().tolist()
    return tuple(hits[0]) if hits else None


def first_pair(expected, got, real):
    """The first real query (row, q) and key kv where two dense (B, S, S) masks differ."""
    differs = (expected != got) & real.unsqueeze(-1)
    hits = differs.nonzero().tolist()
    return tuple(hits[0]) if hits else None


def random_batch(lengths, extra, rows):
    max_len = max(max(lengths), (sum(lengths) + rows - 1) // rows + extra)
    return packed_batch(lengths, max_len=max_len)


# ---------------------------------------------------------------------- correct inputs pass
@SETTINGS
@given(
    lengths=documents,
    extra=st.integers(0, 5),
    rows=st.integers(1, 3),
    block=st.sampled_from([2, 4, 8, 128]),
)
def test_a_packed_batch_and_every_lowering_of_its_mask_agree(lengths, extra, rows, block):
    batch = random_batch(lengths, extra, rows)
    B, S = batch.tokens.shape
    mask = batch.mask
    flat = torch.tensor(
        [0]
        + torch.cat([torch.tensor(r + [1] * (S - sum(r))) for r in batch.seq_lens])
        .cumsum(0)
        .tolist()
    )  # padding tokens as sequences of one, as transformers' flash path lays them out
    report = check_batch(
        batch=batch,
        seq_lens=batch.seq_lens,
        cu_seqlens=flat,
        causal_kernel=True,
        block_mask=torch_block_mask(mask.mask_mod, B, 1, S, S, device="cpu", BLOCK_SIZE=block),
        varlen=flexmask.to_varlen(mask, B, S),
        magi=flexmask.to_magi(mask, B, S),
        flashmask=flexmask.to_flashmask(mask, B, 1, S),
        attention_mask=mask.to_dense(B, 1, S, S),
    )
    assert report.ok, str(report)
    assert report.documents == len(lengths)
    handle = check_batch(batch=batch, block_mask=batch.lazy(block_size=block), kernel="flexmask")
    assert handle.ok, str(handle)


# ---------------------------------------------------------------------- the input incidents
@SETTINGS
@given(lengths=documents, extra=st.integers(0, 4), rows=st.integers(1, 3))
def test_an_all_ones_attention_mask_on_a_packed_batch(lengths, extra, rows):
    """fastrl #14: a 0/1 attention_mask makes each row one sequence."""
    batch = random_batch(lengths, extra, rows)
    _, real, starts = layout(batch)
    ones = torch.ones_like(batch.tokens)
    report = check_batch(batch=batch, attention_mask=ones)
    later_start = starts.clone()
    later_start[:, 0] = False
    expected = first_where(~real | later_start)
    if expected is None:
        assert report.ok
        return
    assert (report.first.row, report.first.token) == expected
    assert "attention_mask" in report.first.inputs
    # The same mask with zeros at padding still merges the documents of a row.
    padded = check_batch(batch=batch, attention_mask=real.long())
    assert padded.ok == (first_where(later_start) is None)


@SETTINGS
@given(lengths=documents, extra=st.integers(0, 4), rows=st.integers(1, 3))
def test_dropped_position_ids(lengths, extra, rows):
    """prime-rl #2944's kin: positions that do not restart in each document."""
    batch = random_batch(lengths, extra, rows)
    _, _, starts = layout(batch)
    starts[:, 0] = False
    arange = torch.arange(batch.max_len).expand_as(batch.tokens)
    report = check_batch(batch=batch, position_ids=arange)
    expected = first_where(starts)
    assert report.ok == (expected is None)
    if expected is not None:
        assert (report.first.row, report.first.token) == expected
        assert "position_ids" in report.first.inputs


@SETTINGS
@given(lengths=documents, stale=documents, extra=st.integers(0, 4))
def test_seq_lens_of_another_batch(lengths, stale, extra):
    """A mask made for other lengths: the first token where the documents differ."""
    batch = random_batch(lengths, extra, 1)
    S = batch.max_len
    report = check_batch(batch=batch, seq_lens=stale)
    truth = torch.full((S,), -1)
    other = torch.full((S,), -1)
    for ids, lens in ((truth, lengths), (other, stale)):
        at = 0
        for number, n in enumerate(lens):
            ids[at : min(at + n, S)] = number
            at += n
    real_t, real_o = truth >= 0, other >= 0
    start_t = real_t & torch.cat([torch.tensor([True]), truth[1:] != truth[:-1]])
    start_o = real_o & torch.cat([torch.tensor([True]), other[1:] != other[:-1]])
    flags = (real_t != real_o) | (real_t & real_o & (start_t != start_o))
    past = sum(stale) > S
    expected = first_where(flags.unsqueeze(0))
    if expected is None and not past:
        assert report.ok, str(report)
        return
    first = report.first
    assert (first.row, first.token) == (expected if expected is not None else (0, S))
    assert "seq_lens" in first.inputs


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 9), min_size=2, max_size=5), multiple=st.sampled_from([4, 8])
)
def test_padded_cu_seqlens_used_as_real(lengths, multiple):
    """NeMo-RL #4070: every sequence padded to a multiple (TransformerEngine's THD layout);
    the padded offsets passed as the real cu_seqlens too."""
    slots = [-(-n // multiple) * multiple for n in lengths]
    real_cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    padded_cu = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()])
    total = int(padded_cu[-1])
    attention = torch.zeros(1, total, dtype=torch.long)
    for start, n in zip(padded_cu[:-1].tolist(), lengths, strict=True):
        attention[0, start : start + n] = 1
    right = check_batch(padding_mask=attention, cu_seqlens=real_cu, cu_seqlens_padded=padded_cu)
    assert right.ok, str(right)
    wrong = check_batch(padding_mask=attention, cu_seqlens=padded_cu, cu_seqlens_padded=padded_cu)
    first_pad = next(
        (
            start + n
            for start, n, s in zip(padded_cu.tolist(), lengths, slots, strict=False)
            if n < s
        ),
        None,
    )
    if first_pad is None:
        assert wrong.ok
        return
    assert (wrong.first.row, wrong.first.token) == (0, first_pad)
    assert set(wrong.first.inputs) == {"cu_seqlens (with cu_seqlens_padded)", "padding_mask"}


def test_padded_cu_seqlens_under_a_bidirectional_kernel_against_documents_alone():
    """Both sides on a model: a bidirectional varlen kernel over the padded slots lets each
    document read its padding; the check names the first padding token, the documents run
    alone differ; with the real lengths both agree."""
    lengths, slots = [5, 3, 6], [8, 4, 8]
    starts = [0, 8, 12]
    tokens = torch.zeros(1, 20, dtype=torch.long)
    for start, n in zip(starts, lengths, strict=True):
        tokens[0, start : start + n] = torch.arange(1, n + 1) * 3
    model = TinyLM()
    real = torch.zeros(1, 20, dtype=torch.bool)
    for start, n in zip(starts, lengths, strict=True):
        real[0, start : start + n] = True
    ids = torch.full((1, 20), -1)
    for number, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        ids[0, start : start + n] = number
    bidirectional = flexmask.spans(ids)  # each document's real tokens, both ways
    for cu, ok in ((torch.tensor([0, 5, 8, 14]), True), (torch.tensor([0, 8, 12, 20]), False)):
        report = check_batch(
            padding_mask=real,
            cu_seqlens=cu,
            cu_seqlens_padded=torch.tensor([0, 8, 12, 20]),
            causal_kernel=False,
            mask=bidirectional,
        )
        assert report.ok == ok, str(report)
        # The model: each sequence of the kernel bidirectional, over its tokens.
        seq = torch.full((20,), -1)
        if ok:
            for i, (start, n) in enumerate(zip(starts, lengths, strict=True)):
                seq[start : start + n] = i
        else:
            for i, (start, s) in enumerate(zip(starts, slots, strict=True)):
                seq[start : start + s] = i
        allowed = (seq.view(-1, 1) == seq.view(1, -1)) & (seq.view(-1, 1) >= 0)
        allowed |= torch.eye(20, dtype=torch.bool)
        out = run(model, tokens, _positions(starts, slots), _dense(allowed))
        differs = False
        for start, n in zip(starts, lengths, strict=True):
            ids = tokens[:, start : start + n]
            alone = run(model, ids, torch.arange(n).unsqueeze(0), _dense(torch.ones(n, n) > 0))
            differs |= not torch.allclose(out[0, start : start + n], alone[0], atol=1e-5)
        assert differs == (not ok)
        if not ok:  # token 0 reads padding token 5, which the cu_seqlens call real
            assert "lets token 0 attend token 5" in report.first.message
            assert any(
                (d.row, d.token) == (0, 5) and "padding" in d.message for d in report.disagreements
            )


def _positions(starts, slots):
    return torch.cat([torch.arange(s) for s in slots]).unsqueeze(0)


def _dense(allowed):
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    return attend


@SETTINGS
@given(lengths=documents, extra=st.integers(0, 4))
def test_labels_that_cross_documents(lengths, extra):
    batch = random_batch(lengths, extra, 1)
    doc, real, starts = layout(batch)
    trained = batch.labels != -100
    # flexmask's shifted labels read as transformers' (the model would shift them again).
    report = check_batch(batch=batch, labels_shifted=False)
    starts[:, 0] = False
    expected = first_where(trained & (starts | ~real))
    assert report.ok == (expected is None)
    if expected is not None:
        assert (report.first.row, report.first.token) == expected
        assert report.first.inputs[0] == "labels"
    # Read right (as the batch says, or off the tokens), they cross nothing.
    assert check_batch(batch=batch).ok
    assert check_batch(
        input_ids=batch.tokens, labels=batch.labels, seq_lens=batch.seq_lens
    ).ok or not bool(trained.any())


def test_transformers_flattened_labels_read_as_shifted():
    """DataCollatorWithFlattening's labels are unshifted: read as shifted, each document's
    last token would be trained on the next document's first."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    labels = torch.tensor([[-100, 2, 3, -100, 5, 6]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert check_batch(input_ids=ids, labels=labels, position_ids=positions).ok
    report = check_batch(input_ids=ids, labels=labels, position_ids=positions, labels_shifted=True)
    assert (report.first.row, report.first.token) == (0, 2)


# ---------------------------------------------------------------------- kernel arguments
STALE_CASES = ["block_mask", "torch_block_mask", "varlen", "magi", "flashmask", "dense"]


@pytest.mark.parametrize("form", STALE_CASES)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=documents, stale=documents, extra=st.integers(0, 4))
def test_a_kernel_argument_for_other_documents(form, lengths, stale, extra):
    """The first (row, q, kv) a kernel argument made for other documents attends otherwise,
    against the dense masks."""
    batch = random_batch(lengths, extra, 1)
    S = batch.max_len
    other = flexmask.causal() & flexmask.document(stale, truncate=True)
    argument = {
        "block_mask": lambda: {
            "block_mask": flexmask.create_block_mask(other, 1, 1, S, S, BLOCK_SIZE=4)
        },
        "torch_block_mask": lambda: {
            "block_mask": torch_block_mask(other.mask_mod, 1, 1, S, S, device="cpu", BLOCK_SIZE=4)
        },
        "varlen": lambda: {"varlen": flexmask.to_varlen(other, 1, S)},
        "magi": lambda: {"magi": flexmask.to_magi(other, 1, S)},
        "flashmask": lambda: {"flashmask": flexmask.to_flashmask(other, 1, 1, S)},
        "dense": lambda: {"attention_mask": other.to_dense(1, 1, S, S)},
    }[form]()
    report = check_batch(mask=batch.mask, shape=(1, S), **argument)
    _, real, _ = layout(batch)
    expected = first_pair(
        batch.mask.to_dense(1, 1, S, S)[:, 0], other.to_dense(1, 1, S, S)[:, 0], real
    )
    if expected is None:
        assert report.ok, str(report)
        return
    row, q, kv = expected
    assert (report.first.row, report.first.token) == (row, q)
    assert f"attend token {kv}" in report.first.message


def test_a_causal_only_kernel_given_a_prefix_lm_mask():
    """NeMo Automodel #2622: a kernel that drops the non-causal part of a mask. Both sides:
    the model run through the causal kernel differs from each document alone under its
    prefix-LM mask, and the check names the first pair the kernel drops."""
    prefix_ids = torch.tensor([[0, 0, 0, -1, -1, -1, 1, 1, -1, -1, -1]])
    prefix_lm = (flexmask.causal() | flexmask.spans(prefix_ids)) & flexmask.document([6, 5])
    cu = torch.tensor([0, 6, 11])
    for kernel, name in (
        ({"cu_seqlens": cu, "causal_kernel": True}, "cu_seqlens"),
        ({"magi": flexmask.to_magi(flexmask.causal() & flexmask.document([6, 5]), 1, 11)}, "magi"),
        (
            {
                "block_mask": flexmask.create_block_mask(
                    flexmask.causal() & flexmask.document([6, 5]), 1, 1, 11, 11, BLOCK_SIZE=4
                )
            },
            "block_mask",
        ),
    ):
        report = check_batch(mask=prefix_lm, shape=(1, 11), **kernel)
        assert (report.first.row, report.first.token) == (0, 0), str(report)
        assert "does not let token 0 attend token 1" in report.first.message
        assert name in report.first.inputs
    # The right arguments pass.
    assert check_batch(mask=prefix_lm, shape=(1, 11), magi=flexmask.to_magi(prefix_lm, 1, 11)).ok
    assert check_batch(mask=prefix_lm, shape=(1, 11), cu_seqlens=cu).ok  # boundaries only
    # The model reference.
    model = TinyLM()
    batch = packed_batch([6, 5], max_len=11)
    out = run(model, batch.tokens, batch.position_ids, dense_kernel(batch.mask, 1, 11))

    def doc_prefix(n):
        return flexmask.causal() | flexmask.prefix(3 if n == 6 else 2)

    assert alone_differs(model, batch, out, doc_prefix) == {0, 1}
    right = run(
        model, batch.tokens, batch.position_ids, flex_kernel(flexmask.lazy(prefix_lm, 1, 1, 11, 11))
    )
    assert alone_differs(model, batch, right, doc_prefix) == set()


def test_a_block_mask_for_other_lengths_and_block_sizes():
    batch = packed_batch([5, 6], max_len=12)
    longer = flexmask.create_block_mask(batch.mask, 1, 1, 16, 16, BLOCK_SIZE=4)
    report = check_batch(batch=batch, block_mask=longer)
    assert "built for Q_LEN=16, KV_LEN=16" in report.first.message
    small = flexmask.create_block_mask(batch.mask, 1, 1, 12, 12, BLOCK_SIZE=64)
    assert check_batch(batch=batch, block_mask=small, kernel="flexmask").ok
    flagged = check_batch(batch=batch, block_mask=small, kernel="flex")
    assert "takes multiples of 128" in flagged.first.message
    with pytest.raises(ValueError, match="kernel must be one of"):
        check_batch(batch=batch, block_mask=small, kernel="triton")


def test_a_mask_that_leaves_a_real_token_nothing():
    batch = packed_batch([4, 4], max_len=8)
    hole = batch.mask & flexmask.from_mask_mod(lambda b, h, q, kv: q != 2, key="not row 2")
    report = check_batch(batch=batch, mask=hole)
    assert (report.first.row, report.first.token) == (0, 2)
    assert "attend nothing" in report.first.message


def test_a_mask_without_documents_against_the_documents():
    """A mask the batch means but written without document(): checked against the documents
    the other inputs give (here a tree over a whole row holding two documents)."""
    batch = packed_batch([3, 3], max_len=6)
    report = check_batch(batch=batch, mask=flexmask.causal())
    assert (report.first.row, report.first.token) == (0, 3)
    assert "another document" in report.first.message


# ---------------------------------------------------------------------- models read the inputs
@pytest.mark.parametrize(
    "incident", ["right", "ones", "positions", "stale", "causal_kernel_dropped_documents"]
)
def test_the_check_agrees_with_each_document_alone(incident):
    """The check's verdict on the inputs a tiny model reads, and that model's outputs against
    each document alone: the same."""
    model = TinyLM()
    batch = packed_batch([5, 4, 6], max_len=16)
    positions = batch.position_ids
    kernel_mask = batch.mask
    inputs = {}
    if incident == "ones":  # transformers' reading of a 0/1 mask: causal in the row
        inputs["attention_mask"] = torch.ones_like(batch.tokens)
        kernel_mask = flexmask.causal()
    elif incident == "positions":
        positions = torch.arange(16).unsqueeze(0)
        inputs["position_ids"] = positions
    elif incident == "stale":
        kernel_mask = flexmask.causal() & flexmask.document([4, 5, 6])
        inputs["block_mask"] = flexmask.lazy(kernel_mask, 1, 1, 16, 16)
    elif incident == "causal_kernel_dropped_documents":
        kernel_mask = flexmask.causal()
        inputs["block_mask"] = flexmask.create_block_mask(kernel_mask, 1, 1, 16, 16, BLOCK_SIZE=8)
    report = check_batch(batch=batch, **inputs)
    out = run(model, batch.tokens, positions, dense_kernel(kernel_mask, 1, 16))
    differs = alone_differs(model, batch, out)
    assert report.ok == (not differs), (str(report), differs)


# ---------------------------------------------------------------------- transformers
def _llama(implementation="sdpa"):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation
    ).eval()


def _flattened(lengths, **options):
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(1)
    features = [{"input_ids": torch.randint(1, 64, (n,), generator=gen).tolist()} for n in lengths]
    return transformers.DataCollatorWithFlattening(**options)(features)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_transformers_flattened_batches(implementation):
    from flexmask.integrations.transformers_check import check_inputs

    model = _llama(implementation)
    lengths = [5, 4, 6]
    features = _flattened(lengths)
    cases = {
        "default": (dict(features), False),  # config.use_cache: transformers skips packing
        "no cache": ({**features, "use_cache": False}, True),
        "all ones": (
            {
                **features,
                "use_cache": False,
                "attention_mask": torch.ones_like(features["input_ids"]),
            },
            False,
        ),
        "dropped positions": ({"input_ids": features["input_ids"], "use_cache": False}, False),
    }
    documents = flexmask.causal() & flexmask.document(lengths)
    for name, (inputs, ok) in cases.items():
        # Without position_ids the documents come from the mask the batch means.
        mask = documents if name == "dropped positions" else None
        report = check_inputs(model, inputs, mask=mask)
        with torch.no_grad():
            packed = model(**inputs).logits[0]
            differs, start = False, 0
            for n in lengths:
                ids = features["input_ids"][:, start : start + n]
                alone = model(input_ids=ids, use_cache=False).logits[0]
                differs |= not torch.allclose(packed[start : start + n], alone, atol=1e-4)
                start += n
        assert report.ok == ok == (not differs), (name, str(report))
        if not ok:
            assert (report.first.row, report.first.token) == (0, 5), (name, str(report))


def test_transformers_flash_sequences():
    """flash_attention_2 reads cu_seq_lens: checked against the documents (no GPU needed:
    only the config is read)."""
    transformers = pytest.importorskip("transformers")
    from flexmask.integrations.transformers_check import check_inputs

    config = transformers.LlamaConfig(num_hidden_layers=1)
    config._attn_implementation = "flash_attention_2"
    features = _flattened([5, 4, 6], return_flash_attn_kwargs=True)
    assert check_inputs(config, features).ok
    stale = {**features, "cu_seq_lens_q": torch.tensor([0, 4, 9, 15], dtype=torch.int32)}
    report = check_inputs(config, stale)
    assert (report.first.row, report.first.token) == (0, 4)
    assert any("flash_attention_2" in name for name in report.first.inputs)


@pytest.mark.parametrize("seq_idx", [False, True])
def test_check_batch_takes_the_collators_output_as_it_is(seq_idx):
    """``check_batch(**collated)``: DataCollatorWithFlattening's own keys (``cu_seq_lens_q``,
    ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``, ``seq_idx``, ``position_ids``,
    ``input_ids``, ``labels``) were refused as unknown keywords."""
    lengths = [5, 4, 6]
    collated = _flattened(lengths, return_flash_attn_kwargs=True, return_seq_idx=seq_idx)
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= set(collated)
    report = check_batch(**collated)
    assert report.ok, str(report)
    assert report.documents == len(lengths)
    assert "cu_seqlens" in report.checked and "labels" in report.checked
    assert ("seq_idx" in report.checked) == seq_idx
    # The same documents as the plain reading: a boundary moved is found where it moved.
    stale = {**collated, "cu_seq_lens_q": torch.tensor([0, 4, 9, 15], dtype=torch.int32)}
    stale["cu_seq_lens_k"] = stale["cu_seq_lens_q"]
    report = check_batch(**stale)
    assert (report.first.row, report.first.token) == (0, 4)


def test_check_batch_reads_the_collators_attention_mask_too():
    collated = _flattened([3, 2], return_flash_attn_kwargs=True)
    ones = torch.ones_like(collated["input_ids"])  # transformers: one sequence per row
    report = check_batch(**collated, attention_mask=ones)
    assert (report.first.row, report.first.token) == (0, 3)


def test_transformers_names_that_disagree_are_refused():
    collated = _flattened([3, 2], return_flash_attn_kwargs=True)
    other = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k must be the same"):
        check_batch(**{**collated, "cu_seq_lens_k": other})
    with pytest.raises(ValueError, match="cu_seqlens and cu_seq_lens_q must be the same"):
        check_batch(**collated, cu_seqlens=other)
    with pytest.raises(ValueError, match="max_length_q and max_length_k"):
        check_batch(**{**collated, "max_length_k": 9})
    # Given under both spellings and equal, they are one input.
    assert check_batch(**collated, cu_seqlens=collated["cu_seq_lens_q"].tolist()).ok


def test_model_inputs_check():
    pytest.importorskip("transformers")
    from flexmask.integrations.transformers import model_inputs
    from flexmask.integrations.transformers_check import check_inputs

    model = _llama("sdpa")
    batch = packed_batch([5, 4, 6], max_len=16, vocab=64)
    inputs = model_inputs(model, batch, check=True)
    assert check_inputs(model, inputs, batch=batch).ok
    broken = {**inputs, "attention_mask": flexmask.causal().to_dense(1, 1, 16, 16)}
    report = check_inputs(model, broken, batch=batch)
    assert (report.first.row, report.first.token) == (0, 5)  # one row: [5, 4, 6], padding
    with pytest.raises(ValueError, match="row 0, token"):
        check_inputs(model, broken, batch=batch, raise_on_error=True)


# ---------------------------------------------------------------------- where users meet it
def test_the_debug_mode_of_pack_and_the_collators(monkeypatch):
    assert flexmask.pack([[1, 2, 3], [4, 5]], max_len=4, check=True).seq_lens == [[3], [2]]
    assert flexmask.pack_tree_batch([[1, 2, 3], [1, 2, 4]], max_tokens=8, check=True).num_rows == 1
    collate = PackingCollator(max_len=8, check=True)
    assert collate([[1, 2, 3], [4, 5]]).seq_lens == [[3, 2]]
    assert len(list(PackedDataset([[1, 2], [3]], max_len=4, buffer_size=2, check=True))) == 1
    monkeypatch.setenv("FLEXMASK_CHECK", "1")
    assert flexmask.pack([[1, 2]], max_len=2).num_rows == 1
    monkeypatch.setenv("FLEXMASK_CHECK", "maybe")
    with pytest.raises(ValueError, match="FLEXMASK_CHECK"):
        flexmask.pack([[1, 2]], max_len=2)
    with pytest.raises(TypeError, match="check must be"):
        flexmask.pack([[1, 2]], max_len=2, check="yes")


def test_the_raising_mode_names_the_first_disagreement():
    batch = packed_batch([3, 4], max_len=8)
    with pytest.raises(ValueError, match=r"row 0, token 3 \(position_ids vs "):
        check_batch(batch=batch, position_ids=torch.arange(8).unsqueeze(0), raise_on_error=True)
    report = check_batch(batch=batch)
    assert report.raise_if_failed() is report
    assert str(report).startswith("ok: ")


def test_trees_positions_are_depths():
    trees = flexmask.pack_tree_batch([[1, 2, 3], [1, 2, 4], [5, 6]], max_tokens=6)
    assert check_batch(batch=trees).ok
    report = check_batch(batch=trees, position_ids=torch.arange(6).unsqueeze(0))
    assert (report.first.row, report.first.token) == (0, 3)
    assert "depth in the tree is 2" in report.first.message


def test_inputs_it_cannot_read_are_refused():
    with pytest.raises(TypeError, match="shape"):
        check_batch(seq_lens=[3, 4])
    with pytest.raises(ValueError, match="must not decrease"):
        check_batch(shape=(1, 8), cu_seqlens=torch.tensor([0, 5, 3]))
    with pytest.raises(TypeError, match="labels_shifted"):
        check_batch(labels=torch.zeros(1, 4, dtype=torch.long), seq_lens=[4])
    with pytest.raises(ValueError, match=r"\(B, S\)"):
        check_batch(
            input_ids=torch.zeros(2, 4, dtype=torch.long),
            position_ids=torch.zeros(3, 4, dtype=torch.long),
        )


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_model_inputs_check_every_layer_type(implementation):
    """A model with sliding layers: each layer type's mask against the batch's, windowed."""
    transformers = pytest.importorskip("transformers")
    from flexmask.integrations.transformers import model_inputs
    from flexmask.integrations.transformers_check import check_inputs

    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
    )
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation
    )
    batch = packed_batch([5, 4, 6], max_len=16, vocab=64)
    inputs = model_inputs(model, batch, check=True)
    assert set(inputs["attention_mask"]) == {"full_attention", "sliding_attention"}
    assert check_inputs(model, inputs, batch=batch).ok
    # The full mask given to the sliding layers too: their window is gone.
    full = inputs["attention_mask"]["full_attention"]
    dropped = {**inputs, "attention_mask": {"full_attention": full, "sliding_attention": full}}
    report = check_inputs(model, dropped, batch=batch)
    assert "sliding_attention" in report.first.inputs[0]
    assert (report.first.row, report.first.token) == (0, 3)  # token 3 reads token 0


# ---------------------------------------------------------------------- issue #39
def _doc_ids(lengths, seq_len):
    """Per token, its document's number; padding past the documents -1."""
    ids = torch.full((seq_len,), -1)
    start = 0
    for number, n in enumerate(lengths):
        ids[start : start + n] = number
        start += n
    return ids


def _doc_causal_dense(rows, seq_len):
    """(B, S, S) causal attention inside each row's documents, written plainly."""
    out = torch.zeros(len(rows), seq_len, seq_len, dtype=torch.bool)
    for b, lengths in enumerate(rows):
        ids = _doc_ids(lengths, seq_len)
        for q in range(seq_len):
            for kv in range(q + 1):
                out[b, q, kv] = bool(ids[q] >= 0 and ids[q] == ids[kv])
    return out


def _q_side_dense(bm, batch):
    """(B, S, S) what torch's backward attends (dK and dV): per kv block, the q blocks its
    ``full_q_indices`` list whole and its ``q_indices`` list through mask_mod; no others."""
    q_len, kv_len = bm.seq_lengths
    q_block, kv_block = bm.BLOCK_SIZE
    out = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        bb = min(b, bm.q_num_blocks.shape[0] - 1)
        for n in range(bm.q_num_blocks.shape[-1]):
            k0, k1 = n * kv_block, min((n + 1) * kv_block, kv_len)
            for m in bm.full_q_indices[bb, 0, n, : int(bm.full_q_num_blocks[bb, 0, n])].tolist():
                out[b, m * q_block : (m + 1) * q_block, k0:k1] = True
            for m in bm.q_indices[bb, 0, n, : int(bm.q_num_blocks[bb, 0, n])].tolist():
                for q in range(m * q_block, min((m + 1) * q_block, q_len)):
                    for kv in range(k0, k1):
                        out[b, q, kv] = bool(
                            bm.mask_mod(
                                torch.tensor(b), torch.tensor(0), torch.tensor(q), torch.tensor(kv)
                            )
                        )
    return out


def _with_q_side(kv_from, q_from):
    """torch's BlockMask with ``kv_from``'s kv side and mask_mod and ``q_from``'s q side."""
    return BlockMask(
        kv_from.seq_lengths,
        kv_from.kv_num_blocks,
        kv_from.kv_indices,
        kv_from.full_kv_num_blocks,
        kv_from.full_kv_indices,
        q_from.q_num_blocks,
        q_from.q_indices,
        q_from.full_q_num_blocks,
        q_from.full_q_indices,
        BLOCK_SIZE=kv_from.BLOCK_SIZE,
        mask_mod=kv_from.mask_mod,
    )


@pytest.mark.parametrize(
    ("rows", "seq_len", "block"),
    [([[5, 7]], 12, 4), ([[3, 9], [12]], 12, 4), ([[10, 20, 3]], 40, 8), ([[6, 6]], 13, 5)],
)
@pytest.mark.parametrize("q_side", ["causal only", "other documents", "none listed"])
def test_a_block_mask_whose_q_side_disagrees(rows, seq_len, block, q_side):
    """Item 7: torch's GPU backward reads the q side for dK and dV. A BlockMask with the
    documents' kv side and another q side — causal only over the packed documents, other
    documents, or nothing — is named at the first pair the backward attends otherwise,
    found by reading its q side plainly against the documents; one that lists other tiles
    but attends the same pairs passes."""
    batch = len(rows)
    ids = torch.stack([_doc_ids(r, seq_len) for r in rows])
    # The same lengths in reverse order, and a row of one document cut in two.
    others = torch.stack(
        [_doc_ids(r[::-1] if len(r) > 1 else [5, r[0] - 5], seq_len) for r in rows]
    )

    def documents(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, q_idx] >= 0)

    def other(b, h, q_idx, kv_idx):
        if q_side == "causal only":
            return q_idx >= kv_idx
        if q_side == "other documents":
            return (q_idx >= kv_idx) & (others[b, q_idx] == others[b, kv_idx])
        return q_idx < 0

    right = torch_block_mask(documents, batch, 1, seq_len, seq_len, "cpu", BLOCK_SIZE=block)
    wrong = torch_block_mask(other, batch, 1, seq_len, seq_len, "cpu", BLOCK_SIZE=block)
    given = _with_q_side(right, wrong)
    mask = flexmask.causal() & flexmask.document(rows)
    assert check_batch(mask=mask, shape=(batch, seq_len), block_mask=right).ok
    report = check_batch(mask=mask, shape=(batch, seq_len), block_mask=given)
    real = ids >= 0
    expected = first_pair(_doc_causal_dense(rows, seq_len), _q_side_dense(given, batch), real)
    if expected is None:
        # Other tiles, the same pairs: partial tiles go through mask_mod, which keeps the
        # documents apart, so the backward attends what the forward does.
        assert q_side == "other documents"
        assert report.ok, str(report)
        return
    row, q, kv = expected
    assert not report.ok
    assert (report.first.row, report.first.token) == (row, q), str(report)
    assert report.first.inputs[0] == "block_mask's q side"
    assert f"attend token {kv}" in report.first.message
    assert "backward" in report.first.message
    # The kv side alone is right: torch's own q side made from it passes.
    rebuilt = BlockMask.from_kv_blocks(
        given.kv_num_blocks,
        given.kv_indices,
        given.full_kv_num_blocks,
        given.full_kv_indices,
        BLOCK_SIZE=given.BLOCK_SIZE,
        mask_mod=given.mask_mod,
        seq_lengths=given.seq_lengths,
    )
    assert check_batch(mask=mask, shape=(batch, seq_len), block_mask=rebuilt).ok


def test_a_block_mask_without_a_q_side_is_read_for_the_forward():
    """``from_kv_blocks(compute_q_blocks=False)`` has no q side (forward only): its kv side
    is checked, nothing else is claimed."""
    mask = flexmask.causal() & flexmask.document([5, 7])
    bm = torch_block_mask(mask.mask_mod, 1, 1, 12, 12, "cpu", BLOCK_SIZE=4)
    forward = BlockMask.from_kv_blocks(
        bm.kv_num_blocks,
        bm.kv_indices,
        bm.full_kv_num_blocks,
        bm.full_kv_indices,
        BLOCK_SIZE=bm.BLOCK_SIZE,
        mask_mod=bm.mask_mod,
        seq_lengths=bm.seq_lengths,
        compute_q_blocks=False,
    )
    assert forward.q_num_blocks is None
    assert check_batch(mask=mask, shape=(1, 12), block_mask=forward).ok


# transformers' additive masks: 0 attends; masked is finfo(dtype).min (masking_utils) or,
# in its legacy extended masks, (1 - mask) * -10000.0.
def _additive(allowed, masked, dtype):
    value = torch.finfo(dtype).min if masked == "finfo.min" else float(masked)
    return torch.where(allowed, 0.0, value).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("masked", ["-10000.0", "finfo.min", "-inf"])
def test_transformers_additive_4d_masks(dtype, masked):
    rows, seq_len = [[4, 5], [9]], 9
    allowed = _doc_causal_dense(rows, seq_len).unsqueeze(1)
    mask = flexmask.causal() & flexmask.document(rows)
    right = check_batch(mask=mask, attention_mask=_additive(allowed, masked, dtype))
    assert right.ok, str(right)
    causal_only = torch.ones(seq_len, seq_len, dtype=torch.bool).tril().expand(2, 1, -1, -1)
    report = check_batch(mask=mask, attention_mask=_additive(causal_only, masked, dtype))
    real = torch.ones(2, seq_len, dtype=torch.bool)
    row, q, kv = first_pair(allowed[:, 0], causal_only[:, 0], real)
    assert (row, q, kv) == (0, 4, 0)
    assert (report.first.row, report.first.token) == (row, q)
    assert f"lets token {q} attend token {kv}" in report.first.message


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_4d_masks_read_as_0_1(dtype):
    rows, seq_len = [[3, 6]], 9
    allowed = _doc_causal_dense(rows, seq_len).unsqueeze(1)
    mask = flexmask.causal() & flexmask.document(rows)
    assert check_batch(mask=mask, attention_mask=allowed.to(dtype)).ok
    causal_only = torch.ones(1, 1, seq_len, seq_len, dtype=dtype).tril()
    report = check_batch(mask=mask, attention_mask=causal_only)
    row, q, kv = first_pair(allowed[:, 0], causal_only[:, 0].bool(), torch.ones(1, 9).bool())
    assert (report.first.row, report.first.token) == (row, q) == (0, 3)
    assert f"attend token {kv}" in report.first.message
    not_01 = allowed.to(dtype) * 2
    with pytest.raises(ValueError, match=r"attention_mask is an integer mask with value 2"):
        check_batch(mask=mask, attention_mask=not_01)


def test_one_row_of_position_ids_is_read_for_every_row_of_shape():
    """``(1, S)`` position_ids with ``shape=(2, S)``: read for both rows (transformers
    broadcasts them), so row 1's one document of 8 disagrees with the restart at token 4."""
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    report = check_batch(position_ids=positions, seq_lens=[[4, 4], [8]], shape=(2, 8))
    assert [(d.row, d.token) for d in report.disagreements] == [(1, 4)], str(report)
    assert set(report.first.inputs) == {"position_ids", "seq_lens"}
    assert check_batch(position_ids=positions, seq_lens=[[4, 4], [4, 4]], shape=(2, 8)).ok
    # A block mask of two rows is compared on both.
    two_rows = flexmask.create_block_mask(
        flexmask.causal() & flexmask.document([[4, 4], [8]]), 2, 1, 8, 8, BLOCK_SIZE=4
    )
    report = check_batch(position_ids=positions, block_mask=two_rows, shape=(2, 8))
    assert (report.first.row, report.first.token) == (1, 4)


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"input_ids": torch.zeros(3, 8, dtype=torch.long)}, r"rows: shape=\(2, 8\), input_ids"),
        ({"position_ids": torch.arange(9).unsqueeze(0)}, r"tokens per row: shape=\(2, 8\)"),
        (
            {"position_ids": torch.arange(8).expand(3, 8), "labels": torch.zeros(2, 8).long()},
            r"rows: shape=\(2, 8\), position_ids has shape \(3, 8\)",
        ),
    ],
)
def test_a_shape_that_disagrees_with_a_tensor_is_refused(given, words):
    with pytest.raises(ValueError, match=words):
        check_batch(shape=(2, 8), labels_shifted=True, **given)


@pytest.mark.parametrize(
    "seq_lens",
    [
        [10, -2],
        [3.5, 4.5],
        [[4, 4], [9, -1]],
        [[4.0, 4], [8]],
        torch.tensor([4.5, 3.5]),
        torch.tensor([[4, -4], [8, 0]]),
        [True, 7],
        "48",
    ],
)
def test_seq_lens_that_are_not_lengths_are_refused(seq_lens):
    with pytest.raises((ValueError, TypeError), match="seq_lens"):
        check_batch(seq_lens=seq_lens, shape=(2, 8))


def test_a_q_side_pointing_outside_the_blocks_is_named():
    mask = flexmask.causal() & flexmask.document([5, 7])
    bm = torch_block_mask(mask.mask_mod, 1, 1, 12, 12, "cpu", BLOCK_SIZE=4)
    broken = bm.q_indices.clone()
    broken[0, 0, 0, 0] = 3  # 12 tokens in blocks of 4: q blocks 0..2
    given = _with_q_side(bm, types.SimpleNamespace(**{**vars(bm), "q_indices": broken}))
    with pytest.raises(ValueError, match=r"block_mask.q_indices points outside the 3 q blocks"):
        check_batch(mask=mask, shape=(1, 12), block_mask=given)
