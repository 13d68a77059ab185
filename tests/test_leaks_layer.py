"""leak_test names where a leak starts (issue #43): the first module whose output already
depends on an input the mask keeps apart from it.

The reference is independent of the locator's planned passes: the full Jacobian of every
block's output (and of every module inside the first leaking block) with respect to the input
embeddings, taken with ``torch.autograd.functional.jacobian`` on tiny models, read against
the mask's reach written plainly (a dense boolean matrix power). The first module, in the
order they run, with a nonzero entry at a forbidden (output, input) pair is the one the
report must name. Models are seeded with leaks at known depths and kinds (an attention
kernel without the documents, a recurrence over the packed row, an MLP that mixes tokens,
a window one token too wide in every layer); transformers' hybrids must name their
recurrent layer, never an attention layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import flexmask
from flexmask.testing import LeakOrigin, leak_test

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DIM = 8


# ---------------------------------------------------------------------- the toy models
class Attention(nn.Module):
    """One head attending what a dense ``(S, S)`` mask allows (a row that allows nothing
    attends itself: finite)."""

    def __init__(self, attends: torch.Tensor) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        eye = torch.eye(attends.shape[-1], dtype=torch.bool)
        self.attends = attends | (~attends.any(-1, keepdim=True) & eye)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=self.attends))


class Scan(nn.Module):
    """A recurrence over the whole row: ignores the documents (transformers #46093)."""

    def __init__(self) -> None:
        super().__init__()
        self.decay = nn.Parameter(torch.full((DIM,), 0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, states = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = torch.sigmoid(self.decay) * h + x[:, t]
            states.append(h)
        return torch.stack(states, 1)


class MLP(nn.Module):
    """Per token; ``mixes="tokens"`` adds the row's mean between its two layers (a leak in
    the MLP's own code), ``"rows"`` the mean over the batch's rows."""

    def __init__(self, mixes: str | None = None) -> None:
        super().__init__()
        self.up, self.down, self.mixes = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM), mixes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        if self.mixes is not None:
            h = h + h.mean(1 if self.mixes == "tokens" else 0, keepdim=True)
        return self.down(h)


class Block(nn.Module):
    """norm -> attention -> optional mixer -> MLP, each with a residual."""

    def __init__(self, attends: torch.Tensor, leak: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = Attention(attends)
        self.mixer = Scan() if leak == "mixer" else None
        self.mlp = MLP(mixes={"mlp": "tokens", "rows": "rows"}.get(leak))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        if self.mixer is not None:
            x = x + self.mixer(x)
        return x + self.mlp(x)


class Toy(nn.Module):
    """Takes the input embeddings ``(B, S, DIM)``; ``layers`` of blocks, a head."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def toy(mask: flexmask.Mask, seq_len: int, leaks: list[str], kernel=None) -> Toy:
    """One block per entry of ``leaks``: "attention" (its kernel drops the documents: plain
    causal), "mixer", "mlp" (mixes tokens), "rows" (its MLP mixes rows), or "none";
    ``kernel`` overrides every block's kernel mask."""
    torch.manual_seed(0)
    right = mask.to_dense(1, 1, seq_len, seq_len)[0, 0]
    wrong = flexmask.causal().to_dense(1, 1, seq_len, seq_len)[0, 0]
    blocks = []
    for leak in leaks:
        attends = kernel if kernel is not None else (wrong if leak == "attention" else right)
        blocks.append(Block(attends, leak))
    return Toy(blocks)


# ---------------------------------------------------------------------- the reference
def reach(mask: flexmask.Mask, seq_len: int, layers: int) -> torch.Tensor:
    """``[o, i]``: input i may reach output o through ``layers`` applications of the mask,
    each token keeping its own input (the residual)."""
    step = mask.to_dense(1, 1, seq_len, seq_len)[0, 0] | torch.eye(seq_len, dtype=torch.bool)
    result = step
    for _ in range(layers - 1):
        result = (result.int() @ step.int()) > 0
    return result


def leaks_at(model: nn.Module, module: nn.Module, x: torch.Tensor, forbidden) -> bool:
    """The module's (first call's) output has a nonzero Jacobian entry at a forbidden
    (output token, input token) pair: ``forbidden[o, i]`` in a row, any pair across rows."""

    def output_of(embeds: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        handle = module.register_forward_hook(lambda m, a, out: seen.append(out))
        try:
            model(embeds)
        finally:
            handle.remove()
        return seen[0]

    jac = torch.autograd.functional.jacobian(output_of, x)  # (B, S, D, B, S, D)
    depends = jac.abs().sum(dim=(2, 5))  # [b, o, b', i]
    rows, seq_len = x.shape[:2]
    other_row = ~torch.eye(rows, dtype=torch.bool).view(rows, 1, rows, 1)
    return bool((depends[other_row | forbidden.view(1, seq_len, 1, seq_len)] != 0).any())


def first_leaking(model: Toy, x: torch.Tensor, forbidden: torch.Tensor) -> str | None:
    """The reference's answer: the first block whose output leaks, then the first of its
    modules, in the order they run, whose output leaks."""
    for number, block in enumerate(model.layers):
        if leaks_at(model, block, x, forbidden):
            for name in ("norm", "attn", "mixer", "mlp"):
                inner = getattr(block, name)
                if inner is not None and leaks_at(model, inner, x, forbidden):
                    return f"layers.{number}.{name}"
            return f"layers.{number}"
    return None


def embeddings(seq_len: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, seq_len, DIM, generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------- seeded toy models
def test_first_block_clean_second_leaking():
    mask = flexmask.causal() & flexmask.document([4, 5, 3])
    model = toy(mask, 12, ["none", "attention"])
    x = embeddings(12)
    report = leak_test(model, x, mask)
    assert first_leaking(model, x, ~reach(mask, 12, 1)) == "layers.1.attn"
    origin = report.origin
    assert isinstance(origin, LeakOrigin)
    assert (origin.path, origin.kind, origin.layer, origin.layer_type) == (
        "layers.1.attn",
        "Attention",
        1,
        None,
    )
    assert origin.chain == ("layers.1", "layers.1.attn")
    # The kernel is a function inside Attention: its out projection is given the leak.
    assert origin.before == "layers.1.attn.out" and origin.method == "grad"
    assert "leaks first at layers.1.attn (Attention), inside it before out" in str(report)


def test_a_leak_only_in_the_mlp():
    mask = flexmask.causal() & flexmask.document([5, 6])
    model = toy(mask, 11, ["none", "mlp", "none"])
    x = embeddings(11)
    report = leak_test(model, x, mask)
    assert first_leaking(model, x, ~reach(mask, 11, 1)) == "layers.1.mlp"
    assert report.origin.path == "layers.1.mlp"
    assert report.origin.before == "layers.1.mlp.down"  # the mean sits between up and down


def test_a_recurrent_mixer_under_a_correct_attention():
    mask = flexmask.causal() & flexmask.document([3, 4, 4])
    model = toy(mask, 11, ["mixer", "attention"])
    x = embeddings(11)
    report = leak_test(model, x, mask)
    assert first_leaking(model, x, ~reach(mask, 11, 1)) == "layers.0.mixer"
    assert report.origin.path == "layers.0.mixer" and report.origin.kind == "Scan"
    assert report.origin.before is None  # a module of no submodules: itself


def test_a_leak_that_needs_two_layers_is_named_where_it_shows():
    """A window kernel one token too wide in every layer: one layer stays inside what two
    layers of the mask reach, two do not. The first block's output is clean against the
    model's reach; the leak shows in the second, and that is the one named."""
    seq_len, layers = 12, 2
    mask = flexmask.causal() & flexmask.sliding_window(3)
    wide = (flexmask.causal() & flexmask.sliding_window(4)).to_dense(1, 1, seq_len, seq_len)[0, 0]
    model = toy(mask, seq_len, ["none"] * layers, kernel=wide)
    x = embeddings(seq_len)
    forbidden = ~reach(mask, seq_len, layers)
    assert not leaks_at(model, model.layers[0], x, forbidden)
    assert first_leaking(model, x, forbidden) == "layers.1.attn"
    report = leak_test(model, x, mask, layers=layers)
    assert report.leaks and report.origin.path == "layers.1.attn"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    leaks=st.lists(
        st.sampled_from(["none", "attention", "mixer", "mlp", "rows"]), min_size=1, max_size=3
    ),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    rows=st.integers(1, 2),
    method=st.sampled_from(["auto", "grad", "perturb"]),
)
def test_random_models_against_the_jacobian(leaks, lengths, rows, method):
    """Rows of the same documents; one document alone in a row leaks only across rows."""
    seq_len = sum(lengths)
    one_row = flexmask.causal() & flexmask.document(lengths)
    mask = flexmask.causal() & flexmask.document([lengths] * rows)
    model = toy(one_row, seq_len, leaks)
    x = embeddings(seq_len, rows)
    expected = first_leaking(model, x, ~reach(one_row, seq_len, 1))
    report = leak_test(model, x, mask, method=method, samples=0)
    if expected is None:
        assert report.ok and report.origin is None
    else:
        assert report.origin is not None, str(report)
        assert report.origin.path == expected, (str(report), expected)
        assert report.origin.method == ("perturb" if method == "perturb" else "grad")


# ---------------------------------------------------------------------- what it was not built for
class Remembers(nn.Module):
    """Keeps its input between calls; its second call adds the row's mean of what it kept:
    clean when first called, leaking when called again."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.proj(x))
        if self.kept is not None:
            out = out + self.kept.mean(1, keepdim=True)
            self.kept = None
        else:
            self.kept = x
        return out


class Twice(nn.Module):
    """One layer, run twice (shared weights)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.layers[0](x)
        return x + self.layers[0](x)


def test_a_layer_called_twice_is_named_with_its_call():
    mask = flexmask.causal() & flexmask.document([4, 4])
    x = embeddings(8)
    origin = leak_test(Twice(Remembers()), x, mask).origin
    assert (origin.path, origin.call, origin.calls) == ("layers.0", 2, 2)
    assert "layers.0 (Remembers, call 2 of 2)" in str(origin)
    # Leaking from its first call (its kernel drops the documents): call 1.
    torch.manual_seed(0)
    wrong = Attention(flexmask.causal().to_dense(1, 1, 8, 8)[0, 0])
    origin = leak_test(Twice(wrong), x, mask).origin
    assert (origin.path, origin.call, origin.calls) == ("layers.0", 1, 2)


class NoList(nn.Module):
    """Modules as attributes, no list of layers; ``own`` mixes tokens in its own code."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        self.first = MLP()
        self.scan = Scan()
        self.last = MLP()
        self.own = own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.first(x)
        # across the documents: in no module (own), or in the scan
        x = x + (x.cumsum(1) if self.own else self.scan(x))
        return x + self.last(x)


def test_a_model_without_a_list_of_layers():
    mask = flexmask.causal() & flexmask.document([3, 5])
    x = embeddings(8)
    torch.manual_seed(0)
    origin = leak_test(NoList(own=False), x, mask).origin
    assert (origin.path, origin.kind, origin.layer) == ("scan", "Scan", None)
    # A leak in the model's own code: the model itself, before the module it gave it to.
    torch.manual_seed(0)
    report = leak_test(NoList(own=True), x, mask)
    assert (report.origin.path, report.origin.before) == ("", "last")
    assert "leaks first at the model's own forward (NoList), inside it before last" in str(report)


class SharedOut(nn.Module):
    """Mixes tokens in its own code, then calls a projection the model owns (shared
    weights, registered outside it)."""

    def __init__(self, out: nn.Module) -> None:
        super().__init__()
        self.__dict__["out"] = out  # not a submodule of this one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x.cumsum(1))


def test_a_module_registered_elsewhere_is_named_by_its_own_path():
    mask = flexmask.causal() & flexmask.document([3, 3])
    torch.manual_seed(0)
    model = Toy([MLP()])
    model.shared = nn.Linear(DIM, DIM)
    model.layers.append(SharedOut(model.shared))
    origin = leak_test(model, embeddings(6), mask).origin
    assert (origin.path, origin.before) == ("layers.1", "shared")
    assert str(origin) == "layers.1 (SharedOut), inside it before shared"


class ChannelsFirst(nn.Module):
    """A block whose leak is a Conv1d over the packed row: its output is (B, C, S), not per
    token, so it is not read — the block is named, before the module it feeds."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 3, padding=2)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.out(mixed)


def test_a_module_whose_output_is_not_per_token_is_not_named():
    mask = flexmask.causal() & flexmask.document([4, 5])
    torch.manual_seed(0)
    origin = leak_test(Toy([MLP(), ChannelsFirst()]), embeddings(9), mask).origin
    assert (origin.path, origin.before) == ("layers.1", "layers.1.out")


class InPlace(nn.Module):
    """Mixes tokens into its projection's output in place: the projection is clean, and its
    output tensor, read after the update, is not what it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h += h.cumsum(1)
        return self.out(h)


@pytest.mark.parametrize("method", ["grad", "perturb"])
def test_an_output_updated_in_place_afterwards_is_not_blamed(method):
    mask = flexmask.causal() & flexmask.document([4, 4])
    torch.manual_seed(0)
    origin = leak_test(Toy([MLP(), InPlace()]), embeddings(8), mask, method=method).origin
    assert (origin.path, origin.before) == ("layers.1", "layers.1.out")


def test_a_leak_only_forward_passes_see_is_located_by_them():
    """A detached statistic: the gradient is clean, the forward passes find the leak, and
    the locator replays them (moved inputs, every module's output compared)."""

    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * x.detach().abs().amax(dim=(1, 2), keepdim=True)

    mask = flexmask.causal() & flexmask.document([4, 4])
    torch.manual_seed(0)
    model = Toy([MLP(), Detached(), MLP()])
    report = leak_test(model, embeddings(8), mask)
    assert report.leaks and all(leak.method == "perturb" for leak in report.leaks)
    assert (report.origin.path, report.origin.method) == ("layers.1", "perturb")


def test_locate_false_and_models_that_are_not_modules():
    mask = flexmask.causal() & flexmask.document([4, 4])
    x = embeddings(8)
    model = toy(mask, 8, ["attention"])
    assert leak_test(model, x, mask, locate=False).origin is None
    report = leak_test(lambda embeds: model(embeds), x, mask)  # nothing to hook
    assert report.leaks and report.origin is None
    assert leak_test(toy(mask, 8, ["none"]), x, mask).origin is None  # nothing leaks
    with pytest.raises(TypeError, match="locate must be True"):
        leak_test(model, x, mask, locate="yes")


# ---------------------------------------------------------------------- transformers hybrids
QWEN3_NEXT = dict(
    linear_num_value_heads=2,
    linear_num_key_heads=1,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    head_dim=16,
    num_experts=2,
    num_experts_per_tok=1,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)


def _hybrid(config_name: str, **settings):
    transformers = pytest.importorskip("transformers")
    config_cls = getattr(transformers, config_name, None)
    if config_cls is None:
        pytest.skip(f"{config_name} is not in transformers {transformers.__version__}")
    config = config_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        num_hidden_layers=2,
        **settings,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _packed(model, lengths):
    """flexmask's packing as the model's inputs: its ids, positions and per-layer-type masks.
    Not the recurrent kernels' ``seq_idx`` / ``cu_seq_lens``: on the CPU transformers refuses
    them (it cannot keep packed sequences apart without causal-conv1d / fla)."""
    from flexmask.integrations.transformers import model_inputs

    gen = torch.Generator().manual_seed(2)
    batch = flexmask.pack(
        [torch.randint(1, 64, (n,), generator=gen) for n in lengths],
        max_len=sum(lengths),
        strategy="next_fit",
    )
    inputs = model_inputs(model, batch)
    keep = ("input_ids", "position_ids", "attention_mask")
    return {k: v for k, v in inputs.items() if k in keep}, batch.mask


@pytest.mark.parametrize(
    "layer_types, expected",
    [
        (["linear_attention", "full_attention"], "model.layers.0.linear_attn"),
        (["full_attention", "linear_attention"], "model.layers.1.linear_attn"),
    ],
)
def test_qwen3_next_names_its_linear_attention_layer(layer_types, expected):
    model = _hybrid("Qwen3NextConfig", layer_types=layer_types, **QWEN3_NEXT)
    inputs, mask = _packed(model, [5, 4, 6])
    report = leak_test(model, inputs, mask, samples=0)
    assert not report.ok
    origin = report.origin
    assert (origin.path, origin.kind, origin.layer_type) == (
        expected,
        "Qwen3NextGatedDeltaNet",
        "linear_attention",
    )
    assert (
        f"leaks first at {expected} (Qwen3NextGatedDeltaNet, layer type linear_attention)"
        in str(report)
    )


@pytest.mark.parametrize(
    "config_name, settings, expected",
    [
        ("Lfm2Config", dict(layer_types=["full_attention", "conv"]), "model.layers.1.conv"),
        (
            "BambaConfig",
            dict(
                attn_layer_indices=[0],
                mamba_n_heads=2,
                mamba_d_head=32,
                mamba_d_state=8,
                mamba_n_groups=1,
                mamba_chunk_size=8,
            ),
            "model.layers.1.mamba",
        ),
        (  # Mamba 2 beside attention in every layer: the mixer, not its sibling attention
            "FalconH1Config",
            dict(
                mamba_d_ssm=32,
                mamba_n_heads=2,
                mamba_d_head=16,
                mamba_d_state=8,
                mamba_n_groups=1,
                head_dim=16,
                mamba_chunk_size=8,
            ),
            "model.layers.0.mamba",
        ),
    ],
)
def test_other_hybrids_name_their_recurrent_layer(config_name, settings, expected):
    model = _hybrid(config_name, **settings)
    inputs, mask = _packed(model, [5, 4, 6])
    report = leak_test(model, inputs, mask, samples=0, method="grad")
    assert report.origin.path == expected, str(report)
    assert "attention" not in report.origin.kind.lower()
