"""keep_documents_apart on tiny instances of every hybrid architecture transformers ships:
packed logits against each document run alone through the unchanged model, and the leak
test on the packed model, with the fallback and without."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flexmask
from flexmask.testing import leak_test

pytest.importorskip("transformers")

from flexmask.integrations import hybrid  # noqa: E402
from flexmask.integrations.hybrid import keep_documents_apart  # noqa: E402
from tests.hybrid_models import EAGER_ONLY, HYBRIDS, packed_inputs, tiny_model  # noqa: E402

FAST = ["qwen3_next", "falcon_h1", "lfm2"]  # gated delta rule, Mamba-2, short convolution
SLOW = [name for name in HYBRIDS if name not in FAST]
LENGTHS = (7, 5, 9, 3, 6)


def _batch(lengths=LENGTHS, max_len=16, seed=1):
    """Documents packed into rows of ``max_len`` (two or more rows, each packed otherwise,
    padding at the ends)."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 64, (n,), generator=gen).tolist() for n in lengths]
    return flexmask.pack(docs, max_len=max_len, strategy="next_fit")


def _alone(model, batch):
    """Each document alone through the model as transformers ships it (no fallback, no
    packing arguments): {(row, start, length): logits}."""
    out = {}
    with torch.no_grad():
        for row, lengths in enumerate(batch.seq_lens):
            start = 0
            for n in lengths:
                ids = batch.tokens[row : row + 1, start : start + n]
                out[row, start, n] = model(input_ids=ids, use_cache=False).logits[0]
                start += n
    return out


def _worst(packed, alone):
    return max(
        (packed[row, start : start + n] - ref).abs().max().item()
        for (row, start, n), ref in alone.items()
    )


def _check_architecture(name, implementation):
    model = tiny_model(name, implementation)
    batch = _batch()
    assert batch.num_rows >= 2 and len(set(map(tuple, batch.seq_lens))) == batch.num_rows
    alone = _alone(model, batch)
    inputs = packed_inputs(model, batch)
    # Without the fallback, transformers refuses the packing arguments on the CPU (where a
    # layer hands them to a kernel) or ignores them; by position_ids alone the row leaks.
    by_positions = {k: v for k, v in inputs.items() if k not in hybrid.BOUNDARY_ARGUMENTS}
    with torch.no_grad():
        leaky = model(**by_positions, use_cache=False).logits
    assert _worst(leaky, alone) > 1e-6  # the reference can fail (float noise: ~1e-7)
    unguarded = leak_test(model, by_positions, batch.mask, samples=1, method="grad")
    assert unguarded.leaks and not unguarded.missing

    handle = keep_documents_apart(model)
    assert handle.layers
    with torch.no_grad():
        packed = model(**inputs).logits
    assert _worst(packed, alone) <= 1e-5
    report = leak_test(model, inputs, batch.mask, samples=1)
    assert report.ok, str(report)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(**by_positions, use_cache=False).logits, leaky)


@pytest.mark.parametrize("name", FAST)
def test_packed_equals_each_document_alone(name):
    _check_architecture(name, "sdpa")


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", SLOW + FAST)
def test_every_architecture_and_implementation(name, implementation):
    if name in FAST and implementation == "sdpa":
        pytest.skip("a fast test")
    if name in EAGER_ONLY and implementation != "eager":
        pytest.skip(f"transformers builds {name} with eager attention only")
    _check_architecture(name, implementation)


def test_training_gradients_equal_the_documents_alone():
    """Autograd through the per-document calls: the packed loss's parameter gradients are
    the sum of the documents' own (each run alone, without the fallback)."""
    model = tiny_model("falcon_h1").train()
    batch = _batch((6, 4, 5), max_len=8)
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for row, lengths in enumerate(batch.seq_lens):
        start = 0
        for n in lengths:
            ids = batch.tokens[row : row + 1, start : start + n]
            logits = model(input_ids=ids, use_cache=False).logits
            model.zero_grad()
            logits.pow(2).sum().backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    expected[name] += p.grad
            start += n
    real = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    for row, lengths in enumerate(batch.seq_lens):
        real[row, : sum(lengths)] = True
    with keep_documents_apart(model):
        logits = model(**packed_inputs(model, batch)).logits
        model.zero_grad()
        logits[real].pow(2).sum().backward()
    for name, p in model.named_parameters():
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(got, expected[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["bamba", "qwen3_5"])
def test_seq_idx_and_cu_seq_lens_are_read_and_never_reach_the_layer(name):
    """transformers' torch path raises on seq_idx / cu_seq_lens; with the fallback they give
    the boundaries (position_ids left at 0..S-1, so nothing else could)."""
    model = tiny_model(name)
    batch = _batch((5, 4, 6), max_len=15)
    assert batch.num_rows == 1
    alone = _alone(model, batch)
    mask = packed_inputs(model, batch)["attention_mask"]
    lengths = torch.tensor(batch.seq_lens[0])
    starts = torch.cat([torch.zeros(1), lengths.cumsum(0)]).int()
    seq_idx = torch.repeat_interleave(torch.arange(3), lengths).unsqueeze(0).int()
    plain = {"input_ids": batch.tokens, "attention_mask": mask, "use_cache": False}
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        model(**plain, seq_idx=seq_idx)
    with keep_documents_apart(model), torch.no_grad():
        by_seq_idx = model(**plain, seq_idx=seq_idx).logits
        by_cu = model(**plain, cu_seq_lens_q=starts, cu_seq_lens_k=starts).logits
    assert _worst(by_seq_idx, alone) <= 1e-5 and _worst(by_cu, alone) <= 1e-5


def test_a_cache_on_a_packed_row_is_refused_and_generation_is_untouched():
    model = tiny_model("lfm2")
    batch = _batch((5, 4), max_len=9)
    inputs = packed_inputs(model, batch)
    ids = torch.tensor([[3, 9, 4, 17, 5]])
    with torch.no_grad():
        before = model.generate(ids, max_new_tokens=4, do_sample=False)
    with keep_documents_apart(model) as handle:
        with pytest.raises(ValueError, match="use_cache=False"):
            model(**inputs, use_cache=True)
        # A packed call that leaves use_cache unset runs without a cache.
        assert model(**inputs).past_key_values is None
        with torch.no_grad():
            after = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert handle.installed
    assert torch.equal(before, after)


def test_left_padded_generation_is_one_sequence_per_row():
    """generate's left padding (positions 0 on padding, 0 at the prompt's first token, a 0/1
    attention_mask) is no packed row: the layers run as they were, with their cache."""
    model = tiny_model("bamba")
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 9, 4, 17, 5]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        before = model.generate(ids, attention_mask=attention, max_new_tokens=3, do_sample=False)
        with keep_documents_apart(model):
            after = model.generate(ids, attention_mask=attention, max_new_tokens=3, do_sample=False)
    assert torch.equal(before, after)


def test_install_is_idempotent_and_remove_restores():
    model = tiny_model("jamba")
    first = keep_documents_apart(model)
    assert keep_documents_apart(model) is first
    assert set(first.layers.values()) == {"JambaMambaMixer"}
    assert all("forward" in vars(m) for m in first._layers.values())
    first.remove()
    first.remove()
    assert not first.installed and all("forward" not in vars(m) for m in first._layers.values())
    second = keep_documents_apart(model)
    assert second is not first and second.installed
    second.remove()


def test_kernels_that_take_the_boundaries_are_left_alone(monkeypatch):
    """Where the kernels run (stood in here: CUDA and mamba_ssm are absent), a Mamba-2 layer
    given seq_idx is called as it is — here transformers' torch path, which raises."""
    model = tiny_model("bamba")
    batch = _batch((5, 4), max_len=9)
    seq_idx = torch.tensor([[0] * 5 + [1] * 4], dtype=torch.int32)
    inputs = {"input_ids": batch.tokens, "seq_idx": seq_idx, "use_cache": False}
    monkeypatch.setattr(hybrid, "kernels_take_boundaries", lambda device, packages: True)
    with keep_documents_apart(model), pytest.raises(ValueError, match="can't keep packed"):
        model(**inputs)
    monkeypatch.undo()
    assert not hybrid.kernels_take_boundaries(torch.device("cpu"), ("mamba_ssm",))


def test_a_model_without_a_known_mixer_is_refused():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    llama = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="no recurrent or convolution layer"):
        keep_documents_apart(llama)

    class Scan(nn.Module):  # a state space layer flexmask does not know
        def __init__(self):
            super().__init__()
            self.A_log = nn.Parameter(torch.zeros(4))

    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 4, 3, groups=4)

    for unknown, reason in ((Scan(), "A_log"), (Conv(), "depthwise Conv1d")):
        model = tiny_model("lfm2")
        model.model.layers[1].extra = unknown
        with pytest.raises(ValueError, match=reason):
            keep_documents_apart(model)
    with pytest.raises(TypeError, match="nn.Module"):
        keep_documents_apart("model")


def test_a_layer_called_outside_the_model_needs_the_boundaries():
    model = tiny_model("lfm2")
    with keep_documents_apart(model) as handle:
        layer = next(iter(handle._layers.values()))
        with pytest.raises(RuntimeError, match="outside a call of the model"):
            layer(torch.zeros(1, 5, 32))
        seq_idx = torch.tensor([[0, 0, 1, 1, 1]])
        x = torch.randn(1, 5, 32)
        with torch.no_grad():
            got = layer(x, seq_idx=seq_idx)
    with torch.no_grad():
        want = torch.cat([layer(x[:, :2]), layer(x[:, 2:])], dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_mixer_flexmask_does_not_know_is_named():
    """Zaya's attention convolves its queries and keys over tokens (a depthwise Conv1d in
    its projection): not in the table, so refused by name rather than run leaking."""
    import transformers

    config = transformers.ZayaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"ZayaCCAProjection\): its \w+ is a depthwise Conv1d"):
        keep_documents_apart(model)
