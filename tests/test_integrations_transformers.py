"""flexmask.integrations.transformers on tiny models built from configs (nothing downloaded).

Every packed document (or tree path) must get the logits it gets alone from transformers' own
eager attention, for every layer type (full, sliding, a Gemma-style hybrid) and for every
backend flexmask prepares masks for.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed: pip install 'flexmask[transformers]' to run these",
)

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma3TextConfig,
    Llama4TextConfig,
    LlamaConfig,
    Qwen2Config,
)
from transformers.masking_utils import (  # noqa: E402
    and_masks,
    blockwise_overlay,
    causal_mask_function,
    chunked_overlay,
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
    or_masks,
    packed_sequence_mask_function,
    padding_mask_function,
    remap_positions_for_packed_sequence,
    sliding_window_overlay,
)
from transformers.models.gemma3.modeling_gemma3 import (  # noqa: E402
    create_masks_for_vision_model,
    get_block_sequence_ids_for_mask,
)

import flexmask  # noqa: E402
from flexmask.integrations.transformers import (  # noqa: E402
    attention_masks,
    flash_kwargs,
    layer_mask,
    model_inputs,
    register,
)
from flexmask.packing import pack, pack_tree_batch  # noqa: E402
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
    batch = pack_tree_batch(sequences, 16, prompt_lens=prompt_lens)
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
    oracle.assert_same_block_mask(ours, oracle.torch_build(dense, block=4), f"{kind} {size}")


@pytest.mark.parametrize("kind", ["sliding_attention", "chunked_attention"])
@pytest.mark.parametrize("size", [1, 5, 37, 300])
def test_packed_batches_take_closed_forms_with_the_same_blocks(kind, size):
    """A PackedBatch's sliding and chunked layers are built from its documents (a window of
    offsets; each document cut every ``size`` tokens from its start: closed forms, as its
    positions restart in every document its mask keeps apart): the same blocks as the layer
    of its position_ids (layer_mask, as model_inputs' check builds it) and as torch's build
    of the position walk."""
    lens = [[60, 11, 130, 40], [250], [3, 90, 90, 17]]
    batch = pack([list(range(n)) for row in lens for n in row], 256)
    B, S = batch.num_rows, batch.max_len
    config = SimpleNamespace(
        layer_types=["full_attention", kind],
        sliding_window=size,
        attention_chunk_size=size,
    )
    built = attention_masks(config, batch, implementation="flex_attention", block_size=16)
    by_positions = layer_mask(kind, batch.mask, batch.position_ids, sliding=size, chunk=size)
    want = flexmask.create_block_mask(by_positions, B, 1, S, S, BLOCK_SIZE=16)
    oracle.assert_same_block_mask(built[kind], want, own_storage=False)
    dense = oracle.stack([positions_oracle(kind, size, row, S) for row in batch.seq_lens])
    oracle.assert_same_block_mask(want, oracle.torch_build(dense, block=16))


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


# --- Parity with transformers' own masks --------------------------------------------------
#
# The references below are transformers' own: the masks its models build (create_causal_mask,
# create_sliding_window_causal_mask, create_chunked_causal_mask, Gemma 3's
# create_masks_for_vision_model) and, for the random cases, its mask functions from
# masking_utils composed as Gemma 3 composes them: AND(window, OR(causal, image blocks)).
# Only the rows of real tokens are compared: what a padding query attends is never read
# (flexmask lets it attend itself in dense masks, transformers leaves it as its rule falls).

W = 4  # sliding window of the hybrid configs below
C = 3  # chunk size


def gemma3_config(window=W):
    config = Gemma3TextConfig(
        **SMALL,
        head_dim=8,
        sliding_window=window,
        sliding_window_pattern=3,
        query_pre_attn_scalar=8,
    )
    config._attn_implementation = "sdpa"
    return config


def llama4_config(chunk=C):
    config = Llama4TextConfig(
        **{**SMALL, "num_hidden_layers": 4},
        head_dim=8,
        intermediate_size_mlp=64,
        attention_chunk_size=chunk,
    )
    config._attn_implementation = "sdpa"
    return config


def qwen2_config(window=W):
    config = Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=window, max_window_layers=1
    )
    config._attn_implementation = "sdpa"
    return config


def embeds(batch_size, seq_len):
    return torch.zeros(batch_size, seq_len, 1)


def transformers_masks(
    config, attention_mask=None, position_ids=None, token_type_ids=None, shape=None
):
    """{layer_type: (B, 1, S, S) bool} as transformers' own mask creation builds them."""
    if attention_mask is not None:
        shape = tuple(attention_mask.shape)
    elif position_ids is not None:
        shape = tuple(position_ids.shape)
    kwargs = {
        "config": config,
        "inputs_embeds": embeds(*shape),
        "attention_mask": attention_mask,
        "cache": None,
        "position_ids": position_ids,
    }
    if token_type_ids is not None:
        blocks = get_block_sequence_ids_for_mask(token_type_ids)
        return create_masks_for_vision_model(block_sequence_ids=blocks, **kwargs)
    makers = {
        "full_attention": create_causal_mask,
        "sliding_attention": create_sliding_window_causal_mask,
        "chunked_attention": create_chunked_causal_mask,
    }
    return {
        kind: makers[kind](**kwargs, allow_is_causal_skip=False)
        for kind in dict.fromkeys(config.layer_types)
    }


def block_mask_pairs(block_mask):
    """(B, H, Q, KV) bool: what a BlockMask attends, read from its fields as torch documents
    them: full blocks attend every pair, partial blocks where the mask_mod is True (evaluated
    on broadcast index grids, as transformers evaluates its own mask functions)."""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    batch_size, heads = block_mask.kv_num_blocks.shape[:2]
    b = torch.arange(batch_size)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    q = torch.arange(q_len)[None, None, :, None]
    kv = torch.arange(kv_len)[None, None, None, :]
    mod = block_mask.mask_mod(b, h, q, kv).expand(batch_size, heads, q_len, kv_len)
    out = torch.zeros_like(mod)
    for b in range(batch_size):
        for h in range(heads):
            for qb in range(block_mask.kv_num_blocks.shape[2]):
                q = slice(qb * q_block, (qb + 1) * q_block)
                n = int(block_mask.kv_num_blocks[b, h, qb])
                for kb in block_mask.kv_indices[b, h, qb, :n].tolist():
                    kv = slice(kb * kv_block, (kb + 1) * kv_block)
                    out[b, h, q, kv] = mod[b, h, q, kv]
                n = int(block_mask.full_kv_num_blocks[b, h, qb])
                for kb in block_mask.full_kv_indices[b, h, qb, :n].tolist():
                    out[b, h, q, kb * kv_block : (kb + 1) * kv_block] = True
    return out


def assert_same_on_real_rows(config, batch, reference, real, **kwargs):
    """Our sdpa masks and our BlockMasks (element by element) equal the reference on every
    query row where ``real`` (B, S) is True, for every layer type of the config."""
    batch_size, seq_len = real.shape
    dense = attention_masks(config, batch, implementation="sdpa", **kwargs)
    blocks = attention_masks(config, batch, implementation="flexmask", block_size=8, **kwargs)
    if not isinstance(dense, dict):
        dense, blocks = {"full_attention": dense}, {"full_attention": blocks}
    assert set(dense) == set(reference)
    rows = real[:, None, :, None].expand(batch_size, 1, seq_len, seq_len)
    for kind, ref in reference.items():
        assert ref is not None and ref.shape == (batch_size, 1, seq_len, seq_len), kind
        for name, ours in (("sdpa", dense[kind]), ("flexmask", block_mask_pairs(blocks[kind]))):
            diff = (ours != ref) & rows
            assert not diff.any(), (
                f"{kind} ({name}): {int(diff.sum())} cells differ, first at "
                f"{diff.nonzero()[0].tolist()}"
            )


def padded(lengths, seq_len, side):
    """transformers' 2-D attention_mask and the flexmask mask of a padded batch."""
    am = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            am[b, seq_len - n :] = 1
        else:
            am[b, :n] = 1
    if side == "left":
        # Keys in the left padding are masked; causal() then leaves its queries nothing.
        keep = ~flexmask.prefix([seq_len - n for n in lengths])
    else:
        keep = flexmask.padding(list(lengths))
    return am, keep


def image_ids(am, images):
    """token_type_ids (1 at images) and flexmask span ids for images placed at
    ``(offset from the row's first real token, length)``."""
    token_type_ids = torch.zeros_like(am)
    span_ids = torch.full(am.shape, -1, dtype=torch.long)
    for b in range(am.shape[0]):
        first = int(am[b].nonzero()[0])
        for k, (start, length) in enumerate(images[b]):
            token_type_ids[b, first + start : first + start + length] = 1
            span_ids[b, first + start : first + start + length] = k
    return token_type_ids, span_ids


def generate_positions(am):
    # What generate() passes: counted from each row's first real token.
    return (am.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_images_with_padding_match_gemma3s_own_masks(side):
    # Images as Gemma 3 marks them (token_type_ids), one of them longer than the window.
    am, keep = padded([19, 13], 20, side)
    tti, span_ids = image_ids(am, [[(2, 9), (13, 3)], [(0, 2), (5, 6)]])
    config = gemma3_config()
    reference = transformers_masks(config, attention_mask=am, token_type_ids=tti)
    mask = (flexmask.causal() | flexmask.spans(span_ids)) & keep
    assert_same_on_real_rows(
        config, mask, reference, am.bool(), shape=(2, 20), position_ids=generate_positions(am)
    )
    # Windows are differences of positions: offsets give the same masks on real rows.
    assert_same_on_real_rows(config, mask, reference, am.bool(), shape=(2, 20))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_chunked_layers_with_padding_match_llama4s_own_masks(side, chunk):
    # Under left padding transformers' chunked_overlay starts each row's chunks at its first
    # real token (it shifts them by the row's left padding): the position_ids do here.
    am, keep = padded([14, 9, 5], 14, side)
    config = llama4_config(chunk)
    reference = transformers_masks(config, attention_mask=am)
    assert set(reference) == {"chunked_attention", "full_attention"}
    assert_same_on_real_rows(
        config,
        flexmask.causal() & keep,
        reference,
        am.bool(),
        shape=(3, 14),
        position_ids=generate_positions(am),
    )


@pytest.mark.parametrize("config_of", [gemma3_config, qwen2_config, llama4_config])
def test_packed_documents_match_transformers_own_packed_masks(config_of):
    # transformers reads packed documents from position_ids that restart (no attention_mask).
    batch = pack([list(range(n)) for n in (9, 4, 13, 2, 7, 1)], 20)
    assert batch.num_rows > 1
    config = config_of()
    reference = transformers_masks(config, position_ids=batch.position_ids)
    real = torch.zeros(batch.num_rows, 20, dtype=torch.bool)
    for b, lens in enumerate(batch.seq_lens):
        real[b, : sum(lens)] = True
    assert_same_on_real_rows(config, batch, reference, real)


@st.composite
def mixed_batches(draw):
    """Rows of documents holding images, padded on one side: what each token is."""
    batch_size = draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 24))
    side = draw(st.sampled_from(["left", "right"]))
    rows = []
    for _ in range(batch_size):
        real = draw(st.integers(0, seq_len))
        docs, left = [], real
        while left:
            docs.append(draw(st.integers(1, left)))
            left -= docs[-1]
        images = []  # (start, length) from the row's first real token, inside a document
        start = 0
        for n in docs:
            at = start
            while at < start + n and draw(st.booleans()):
                at += draw(st.integers(0, start + n - at - 1))
                length = draw(st.integers(1, start + n - at))
                images.append((at, length))
                at += length + 1  # a text token between images, as token_type_ids need
            start += n
        rows.append((real, docs, images))
    return seq_len, side, rows


def mixed_tensors(seq_len, side, rows):
    """Per-token tensors, and the flexmask mask of the batch."""
    batch_size = len(rows)
    am = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    doc = torch.arange(seq_len).repeat(batch_size, 1) + 1000  # padding: one id per token
    pos = torch.zeros(batch_size, seq_len, dtype=torch.long)
    span_ids = torch.full((batch_size, seq_len), -1, dtype=torch.long)
    doc_lens = []
    for b, (real, docs, images) in enumerate(rows):
        first = seq_len - real if side == "left" else 0
        am[b, first : first + real] = True
        at = first
        for d, n in enumerate(docs):
            doc[b, at : at + n] = d
            pos[b, at : at + n] = torch.arange(n)
            at += n
        for k, (start, length) in enumerate(images):
            span_ids[b, first + start : first + start + length] = k
        # The left padding is one more document, whose keys ~prefix masks.
        doc_lens.append(([first] if first else []) + docs or [0])
    lefts = [seq_len - real if side == "left" else 0 for real, _, _ in rows]
    mask = (
        (flexmask.causal() | flexmask.spans(span_ids))
        & flexmask.document(doc_lens)
        & ~flexmask.prefix(lefts)
    )
    return am, doc, pos, span_ids, mask


def reference_from_mask_functions(kind, size, am, doc, pos, span_ids):
    """transformers' mask functions, composed as Gemma 3 composes them, with positions
    remapped per document as transformers does for packed sequences."""
    base = or_masks(
        remap_positions_for_packed_sequence(causal_mask_function, pos),
        blockwise_overlay(span_ids),
    )
    parts = [base, packed_sequence_mask_function(doc), padding_mask_function(am)]
    if kind == "sliding_attention":
        parts.append(remap_positions_for_packed_sequence(sliding_window_overlay(size), pos))
    if kind == "chunked_attention":
        zero = torch.zeros(am.shape[0], dtype=torch.long)
        parts.append(remap_positions_for_packed_sequence(chunked_overlay(size, zero), pos))
    fn = and_masks(*parts)
    batch_size, seq_len = am.shape
    b = torch.arange(batch_size)[:, None, None, None]
    q = torch.arange(seq_len)[None, None, :, None]
    kv = torch.arange(seq_len)[None, None, None, :]
    return fn(b, torch.zeros_like(b), q, kv).expand(batch_size, 1, seq_len, seq_len)


@given(batch=mixed_batches(), size=st.integers(1, 7))
@settings(max_examples=30)
def test_every_layer_type_matches_transformers_mask_functions(batch, size):
    seq_len, side, rows = batch
    am, doc, pos, span_ids, mask = mixed_tensors(seq_len, side, rows)
    config = SimpleNamespace(
        layer_types=["full_attention", "sliding_attention", "chunked_attention"],
        sliding_window=size,
        attention_chunk_size=size,
    )
    reference = {
        kind: reference_from_mask_functions(kind, size, am, doc, pos, span_ids)
        for kind in config.layer_types
    }
    assert_same_on_real_rows(config, mask, reference, am, shape=tuple(am.shape), position_ids=pos)


# --- Regressions --------------------------------------------------------------------------


def test_block_masks_keep_their_own_positions():
    # attention_masks used to read batch.position_ids live: zeroing them in place afterwards
    # (a reused buffer) changed what the BlockMasks' partial blocks attend: here 66 pairs
    # more on the sliding layers of Qwen2 and 99 on the chunked ones of Llama 4.
    batch = pack([list(range(n)) for n in (9, 4, 13, 2, 7, 1)], 20)
    real = torch.zeros(batch.num_rows, 20, dtype=torch.bool)
    for b, lens in enumerate(batch.seq_lens):
        real[b, : sum(lens)] = True
    rows = real[:, None, :, None].expand(batch.num_rows, 1, 20, 20)
    checks = []
    for config, kind in (
        (qwen2_config(), "sliding_attention"),
        (llama4_config(), "chunked_attention"),
    ):
        reference = transformers_masks(config, position_ids=batch.position_ids)[kind]
        ours = attention_masks(config, batch, implementation="flexmask", block_size=8)[kind]
        checks.append((kind, reference, ours))
    batch.position_ids.zero_()
    for kind, reference, ours in checks:
        diff = (block_mask_pairs(ours) != reference) & rows
        assert not diff.any(), f"{kind}: {int(diff.sum())} pairs changed with the positions"


def test_sliding_window_is_one_sided_over_bidirectional_images():
    # The case: causal text around one image, window 2. Row 1 (an image token) sees
    # the whole image, as transformers' Gemma 3 lets it; sliding_window(2) is two-sided and
    # cut it to [1, 1, 1, 0, 0, 0].
    config = gemma3_config(window=2)
    mask = flexmask.causal() | flexmask.spans([[-1, 0, 0, 0, 0, -1]])
    ours = attention_masks(config, mask, shape=(1, 6), implementation="sdpa")
    reference = transformers_masks(
        config, token_type_ids=torch.tensor([[0, 1, 1, 1, 1, 0]]), shape=(1, 6)
    )
    assert ours["sliding_attention"][0, 0, 1].int().tolist() == [1, 1, 1, 1, 1, 0]
    assert torch.equal(ours["sliding_attention"], reference["sliding_attention"])


def test_gemma3_logits_with_a_long_image_equal_transformers_own_masks():
    # A 20-token image with window 8: the two-sided window differed from Gemma 3's own
    # sliding mask in 78 cells here and moved the logits by 0.32.
    seq_len = 32
    tti = torch.zeros(1, seq_len, dtype=torch.long)
    tti[0, 6:26] = 1
    mask = flexmask.causal() | flexmask.spans(torch.where(tti == 1, 0, -1))
    reference = transformers_masks(gemma3_config(8), token_type_ids=tti, shape=(1, seq_len))
    tokens = torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = gemma3_model(8, "sdpa")(input_ids=tokens, attention_mask=reference).logits
        for implementation in ("sdpa", "eager", "flexmask"):
            masks = attention_masks(
                gemma3_config(8),
                mask,
                shape=(1, seq_len),
                implementation=implementation,
                block_size=8,
            )
            if implementation == "sdpa":
                assert torch.equal(masks["sliding_attention"], reference["sliding_attention"])
            got = gemma3_model(8, implementation)(input_ids=tokens, attention_mask=masks).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def gemma3_model(window, implementation):
    torch.manual_seed(0)  # the same weights for every implementation
    return AutoModelForCausalLM.from_config(
        gemma3_config(window), attn_implementation=implementation
    ).eval()


# --- transformers' flash_attention_2 path: the cu_seq_lens_* / max_length_* kwargs.


@pytest.mark.parametrize("seed", range(4))
def test_flash_kwargs_are_what_transformers_derives_from_positions(seed):
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen)
    batch = pack([torch.arange(n) for n in lengths.tolist()], 16)
    kwargs = flash_kwargs(batch)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch.position_ids)
    assert kwargs["cu_seq_lens_q"].tolist() == cu_q.tolist() == cu_k.tolist()
    assert kwargs["cu_seq_lens_k"].tolist() == cu_q.tolist()
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == int(max_q) == int(max_k)
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32


def reference_flash_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    cu_seq_lens_q=None,
    cu_seq_lens_k=None,
    max_length_q=None,
    max_length_k=None,
    **kwargs,
):
    """transformers' flash path with the kernel replaced by flash-attn's documented
    semantics (tests/test_backends.py): flatten (B, S) to tokens, run each sequence of
    cu_seq_lens, causal as the module is, the layer's window as transformers sets it."""
    from tests.test_backends import flash_attn_varlen_reference

    assert cu_seq_lens_q is not None  # attention_mask (transformers' own causal one) unused
    batch_size = query.shape[0]
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]) for x in (query, key, value))
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    out = flash_attn_varlen_reference(
        q,
        k,
        v,
        cu_seq_lens_q,
        cu_seq_lens_k,
        max_length_q,
        max_length_k,
        softmax_scale=scaling,
        causal=module.is_causal,
        window_size=window,
    )
    return out.view(batch_size, -1, *out.shape[-2:]), None


@pytest.mark.parametrize("name", ["llama", "qwen2_sliding"])
def test_packed_logits_through_the_flash_kwargs_equal_each_document_alone(name):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # Not named *flash*: transformers would then look for a flash-attn kernel to load.
    AttentionInterface.register("reference_varlen", reference_flash_attention)
    AttentionMaskInterface.register("reference_varlen", sdpa_mask)
    sequences = documents(2)
    batch = pack(sequences, 24)
    assert batch.num_rows > 1 and bool((batch.position_ids[:, -1] == 0).any())  # padding
    net = model(name, "reference_varlen")
    inputs = model_inputs(net, batch, implementation="flash_attention_2")
    assert "attention_mask" not in inputs and inputs["max_length_q"] == max(map(len, sequences))
    with torch.no_grad():
        logits = net(**inputs).logits
    for got, seq in zip(batch.unpack(logits), sequences, strict=True):
        torch.testing.assert_close(got, alone(name, seq), atol=1e-5, rtol=1e-5)


def test_flash_kwargs_refuse_what_the_flash_path_cannot_mask():
    with pytest.raises(TypeError, match="batch must be a PackedBatch"):
        flash_kwargs([[1, 2]])
    with pytest.raises(ValueError, match="takes causal and the window from the model"):
        flash_kwargs(flexmask.causal() & flexmask.sliding_window(3), shape=(1, 8))
    with pytest.raises(ValueError, match="tree"):
        flash_kwargs(flexmask.tree([-1, 0, 0, 1]), shape=(1, 4))
    with pytest.raises(ValueError, match="flash_kwargs"):
        attention_masks(CONFIGS["llama"](), pack([[1]], 2), implementation="flash_attention_2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_attention_2_kernel_on_packed_kwargs_equals_each_document_alone():
    pytest.importorskip("flash_attn", reason="transformers' flash_attention_2 needs flash-attn")
    torch.manual_seed(0)
    net = (
        AutoModelForCausalLM.from_config(
            CONFIGS["llama"](), attn_implementation="flash_attention_2", dtype=torch.bfloat16
        )
        .cuda()
        .eval()
    )
    sequences = documents(3)
    batch = pack(sequences, 24)
    inputs = model_inputs(net, batch, device="cuda")
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        logits = net(**inputs).logits
        for got, seq in zip(batch.unpack(logits), sequences, strict=True):
            torch.testing.assert_close(
                got, net(input_ids=seq[None].cuda()).logits[0], atol=3e-2, rtol=3e-2
            )
