"""flexmask.integrations.transformers on tiny models built from configs (nothing downloaded).

Every packed document (or tree path) must get the logits it gets alone from transformers' own
eager attention, for every layer type (full, sliding, a Gemma-style hybrid) and for every
backend flexmask prepares masks for.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed: pip install 'flexmask[transformers]' to run these",
)

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    Qwen2Config,
)

import flexmask  # noqa: E402
from flexmask.integrations.transformers import (  # noqa: E402
    attention_masks,
    layer_mask,
    model_inputs,
    register,
)
from flexmask.packing import pack, pack_trees  # noqa: E402
from tests import oracle  # noqa: E402

VOCAB = 32
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    # Qwen2: layers from max_window_layers on slide (here layers 1 and 2, window 3).
    "qwen2_sliding": lambda: Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=3, max_window_layers=1
    ),
    # Gemma 3 style hybrid: sliding, sliding, full (window 4).
    "gemma3_hybrid": lambda: Gemma3TextConfig(
        **SMALL, head_dim=8, sliding_window=4, sliding_window_pattern=3, query_pre_attn_scalar=8
    ),
}
_MODELS: dict = {}


def model(name, implementation):
    key = (name, implementation)
    if key not in _MODELS:
        torch.manual_seed(0)  # the same weights for every implementation
        _MODELS[key] = AutoModelForCausalLM.from_config(
            CONFIGS[name](), attn_implementation=implementation
        ).eval()
    return _MODELS[key]


def documents(seed, lengths=(11, 6, 14, 1, 9)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


def alone(name, seq):
    """transformers' own eager attention on the sequence alone: the reference."""
    with torch.no_grad():
        return model(name, "eager")(input_ids=seq[None]).logits[0]


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flexmask"])
def test_packed_logits_equal_each_document_alone(name, implementation):
    sequences = documents(1)
    batch = pack(sequences, 24)
    assert batch.num_rows > 1
    inputs = model_inputs(model(name, implementation), batch, block_size=8)
    if name != "llama":
        assert set(inputs["attention_mask"]) >= {"sliding_attention", "full_attention"}
    with torch.no_grad():
        logits = model(name, implementation)(**inputs).logits
    for got, seq in zip(batch.unpack(logits), sequences, strict=True):
        torch.testing.assert_close(got, alone(name, seq), atol=1e-5, rtol=1e-5)


def test_one_mask_for_every_layer_loses_the_window():
    # The failure the per-layer dict prevents: the full mask on sliding layers is not exact.
    sequences = documents(2, (14, 10))
    batch = pack(sequences, 24)
    masks = attention_masks(model("qwen2_sliding", "sdpa").config, batch)
    with torch.no_grad():
        wrong = model("qwen2_sliding", "sdpa")(
            input_ids=batch.tokens,
            position_ids=batch.position_ids,
            attention_mask=masks["full_attention"],
        ).logits
    first = batch.unpack(wrong)[0]
    assert (first - alone("qwen2_sliding", sequences[0])).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", ["sdpa", "flexmask"])
def test_tree_batch_paths_equal_each_sequence_alone_with_sliding_layers(implementation):
    gen = torch.Generator().manual_seed(5)
    sequences, prompt_lens = [], []
    for prompt_len in (7, 4):
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()
        for n in (5, 2, 6):
            sequences.append(prompt + torch.randint(0, VOCAB, (n,), generator=gen).tolist())
            prompt_lens.append(prompt_len)
    batch = pack_trees(sequences, 16, prompt_lens=prompt_lens)
    assert batch.num_rows >= 2 and batch.saved_tokens > 0
    for name in ("qwen2_sliding", "gemma3_hybrid"):
        m = model(name, implementation)
        with torch.no_grad():
            logits = m(**model_inputs(m, batch, block_size=8)).logits
        for got, seq in zip(batch.unpack(logits), sequences, strict=True):
            torch.testing.assert_close(got, alone(name, torch.tensor(seq)), atol=1e-5, rtol=1e-5)


def test_registered_attention_is_causal_without_a_mask_and_generates_like_eager():
    seq = documents(3, (12,))[0]
    for name in CONFIGS:
        with torch.no_grad():
            got = model(name, "flexmask")(input_ids=seq[None]).logits[0]
        torch.testing.assert_close(got, alone(name, seq), atol=1e-5, rtol=1e-5)
    # generate: a prefill, then decode steps whose keys outnumber the queries.
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    ours = model("qwen2_sliding", "flexmask").generate(seq[None], **kwargs)
    eager = model("qwen2_sliding", "eager").generate(seq[None], **kwargs)
    assert torch.equal(ours, eager)


def test_registered_attention_trains_on_the_cpu():
    m = model("gemma3_hybrid", "flexmask")
    batch = pack(documents(4), 24, loss_mask=[torch.arange(len(s)) >= 3 for s in documents(4)])
    logits = m(**model_inputs(m, batch, block_size=8)).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())
    loss.backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    m.zero_grad()


def positions_oracle(kind, size, lens, length):
    """Dense (length, length) for causal documents restricted by a window or a chunk of the
    in-document position, by walking every pair."""
    doc = oracle.causal(length, length) & oracle.document(lens, length, length)
    pos = [p for n in lens for p in range(n)] + [0] * (length - sum(lens))
    out = doc.copy()
    for q in range(length):
        for kv in range(length):
            if kind == "sliding_attention":
                out[q, kv] &= pos[q] - pos[kv] < size
            else:
                out[q, kv] &= pos[q] // size == pos[kv] // size
    return out


@pytest.mark.parametrize("kind", ["sliding_attention", "chunked_attention"])
@pytest.mark.parametrize("size", [1, 3, 5])
def test_layer_masks_match_a_position_walk_and_torchs_blocks(kind, size):
    batch = pack([list(range(n)) for n in (9, 4, 13, 7)], 20)
    mask = layer_mask(kind, batch.mask, batch.position_ids, sliding=size, chunk=size)
    dense = oracle.stack(
        [positions_oracle(kind, size, lens, 20) for lens in batch.seq_lens], heads=1
    )
    assert (mask.to_dense(batch.num_rows, 1, 20, 20).numpy() == dense).all()
    ours = flexmask.create_block_mask(mask, batch.num_rows, 1, 20, 20, BLOCK_SIZE=4)
    oracle.assert_same_block_mask(ours, oracle.torch_blocks(dense, 4), f"{kind} {size}")


def test_dense_masks_for_eager_are_additive_and_cached():
    config = CONFIGS["qwen2_sliding"]()
    batch = pack([[1, 2, 3], [4, 5]], 6)
    eager = attention_masks(config, batch, implementation="eager", dtype=torch.float32)
    sdpa = attention_masks(config, batch, implementation="sdpa")
    assert eager["full_attention"].dtype == torch.float32
    assert torch.equal(eager["full_attention"] == 0, sdpa["full_attention"])
    # The padding query attends only to itself, so no row is all -inf.
    assert sdpa["full_attention"][0, 0, 5].tolist() == [False] * 5 + [True]
    again = attention_masks(config, batch, implementation="sdpa")
    assert again["full_attention"] is sdpa["full_attention"]


def test_bad_arguments_name_what_is_right():
    config = CONFIGS["llama"]()
    with pytest.raises(TypeError, match="batch must be a PackedBatch"):
        attention_masks(config, [[1, 2]])
    with pytest.raises(TypeError, match="pass shape"):
        attention_masks(config, flexmask.causal())
    with pytest.raises(ValueError, match="implementation must be"):
        attention_masks(config, pack([[1]], 2), implementation="flash")
    with pytest.raises(ValueError, match="sliding_attention needs a window"):
        layer_mask("sliding_attention", flexmask.causal(), None, sliding=None)
    with pytest.raises(ValueError, match="layer_type must be one of"):
        layer_mask("linear_attention", flexmask.causal(), None)


@pytest.mark.slow
def test_transformers_flex_attention_path_takes_the_block_masks():
    # transformers compiles torch's flex_attention on first use: slow on the CPU.
    sequences = documents(6, (9, 12))
    batch = pack(sequences, 24)
    m = model("qwen2_sliding", "flex_attention")
    with torch.no_grad():
        logits = m(**model_inputs(m, batch, block_size=8)).logits
    for got, seq in zip(batch.unpack(logits), sequences, strict=True):
        torch.testing.assert_close(got, alone("qwen2_sliding", seq), atol=1e-5, rtol=1e-5)
