"""The leak test: which input tokens does each output of a model depend on?

Take the model's input embeddings as a leaf (a hook on the embedding layer's output, or
``inputs_embeds``) and backpropagate a random projection of a chosen set of outputs: the
gradient at every input token that none of the chosen outputs may depend on must be exactly
0 — masked attention gives exact zeros, so any nonzero value is a path the mask does not
allow. A few such passes cover every pair of documents (outputs of the documents whose
number has bit ``k`` set against inputs of those that have it clear, for every bit, both
ways), plus random cuts inside documents (no output depends on a later input) and single
tokens (every key the mask lets the token attend does reach it). A leaking pass is then
narrowed down, by more passes, to the documents and the token pair.

Kernels without a backward (torch's FlexAttention on the CPU) are tested the other way round
with forward passes: perturb chosen inputs, and the outputs that may not depend on them must
not move by a single bit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from flexmask import Mask, causal, document
from flexmask.testing.passes import Probe
from flexmask.testing.report import LeakReport


def leak_test(
    model: nn.Module,
    inputs: Mapping[str, Any] | Tensor | tuple,
    mask: Mask | None = None,
    *,
    seq_lens: Any = None,
    embedding: nn.Module | None = None,
    output: Callable[[Any], Tensor] | None = None,
    method: str = "auto",
    samples: int = 2,
    seed: int = 0,
    max_examples: int = 8,
    raise_on_leak: bool = False,
) -> LeakReport:
    """Proves that no token of a packed batch reaches an output the mask keeps it from, and
    that the influences the mask allows are there (sampled).

    With ``method="grad"`` the input embeddings (the output of ``embedding``, or
    ``inputs_embeds``) become a leaf, the model runs once, and each pass backpropagates a
    random projection of a set of outputs: every input token none of them may depend on
    (through any number of layers: the mask's transitive closure) must get an exactly zero
    gradient. ``2 * ceil(log2(documents))`` passes separate every ordered pair of documents;
    ``samples`` passes cut each document at a random token (no output depends on a later
    input) and ``samples`` pick one token per document (every key the mask lets it attend
    must reach it, and nothing else). A pass that leaks is narrowed down to its documents
    (one pass per document) and to a token pair (a bisection), at most ``max_examples``
    times. ``"perturb"`` does the same with forward passes, moving inputs and watching
    outputs — for kernels with no backward; ``"auto"`` uses it when the backward fails.

    Args:
        model: any module taking the batch (ids or embeddings) and returning per-token
            outputs ``(B, S, ...)`` (a tensor, or an object with ``logits`` /
            ``last_hidden_state``, or a tuple whose first item is that).
        inputs: ``model(**inputs)`` for a mapping, ``model(inputs)`` for a tensor,
            ``model(*inputs)`` for a tuple.
        mask: what each token may attend (the batch's mask, ``(B, S)`` as the inputs).
            None: ``causal() & document(seq_lens)``, or the documents where the inputs'
            ``position_ids`` restart at 0.
        seq_lens: the documents, without ``mask``.
        embedding: the module whose output is the input embeddings (default: the model's
            ``get_input_embeddings()``, else its first ``nn.Embedding``); unused with
            ``inputs_embeds`` or a float tensor as input.
        output: picks the per-token output from what the model returns.
        method: ``"grad"``, ``"perturb"`` or ``"auto"``.
        samples: cut passes and token passes each (0: only the document passes).
        seed: seeds the projections, cuts and tokens.
        max_examples: leaking document pairs narrowed down to a token pair.
        raise_on_leak: raise AssertionError when something leaks or is missing.

    Returns:
        A :class:`LeakReport`.

    Example:
        >>> import torch, flexmask
        >>> from flexmask.testing import leak_test
        >>> batch = flexmask.pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_len=5)
        >>> embed = torch.nn.Embedding(10, 8)
        >>> mixer = torch.nn.Conv1d(8, 8, 2, padding=1)            # sees the previous token
        >>> def model(ids):                                        # ignores the documents
        ...     return mixer(embed(ids).transpose(1, 2))[..., :-1].transpose(1, 2)
        >>> report = leak_test(model, batch.tokens, batch.mask, embedding=embed)
        >>> report.ok, sorted(report.pairs)     # documents: 0 in row 0; 1 and 2 in row 1
        (False, [(2, 1)])
        >>> print(report.leaks[0].output, report.leaks[0].input)   # output 3 reads input 2
        3 2
    """
    started = time.perf_counter()
    if method not in ("grad", "perturb", "auto"):
        raise ValueError(f"method must be 'grad', 'perturb' or 'auto', got {method!r}")
    if not isinstance(samples, int) or samples < 0:
        raise ValueError(f"samples must be an int >= 0, got {samples!r}")
    runner = _Runner(model, inputs, embedding, output, seed)
    with runner.prepared():
        batch, seq_len = runner.shape
        allowed = _mask(mask, seq_lens, inputs, batch, seq_len)
        probe = Probe(runner, allowed, method)
        report = probe.run(samples, max_examples)
    report = dataclasses.replace(report, seconds=time.perf_counter() - started)
    if raise_on_leak:
        report.raise_if_failed()
    return report


# ---------------------------------------------------------------------- the model, as a probe
class _Runner:
    """Runs the model with the input embeddings as a leaf (or moved), and reads its outputs."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        embedding: nn.Module | None,
        output: Callable[[Any], Tensor] | None,
        seed: int,
    ) -> None:
        self.model, self.inputs, self.output = model, inputs, output
        self.generator = torch.Generator().manual_seed(seed)
        self.embedding = embedding
        self.leaf: Tensor | None = None
        self.shift: Tensor | None = None  # added to the embeddings (perturb)
        self.grad = True
        self.shape = (0, 0)

    def prepared(self) -> Any:
        runner = self

        class _Context:
            def __enter__(self) -> None:
                runner._enter()

            def __exit__(self, *exc: Any) -> None:
                runner._exit()

        return _Context()

    def _enter(self) -> None:
        module = self.model if isinstance(self.model, nn.Module) else None
        self.was_training = module.training if module is not None else False
        self.flags: list[tuple[nn.Parameter, bool]] = []
        self.hook = None
        if module is not None:
            module.eval()  # no dropout: an allowed influence must not vanish at random
            for p in module.parameters():
                self.flags.append((p, p.requires_grad))
                p.requires_grad_(False)  # only the embeddings' gradient is wanted
        embeds = self._given_embeddings()
        if embeds is None:
            target = self.embedding or _embedding_of(self.model)
            self.hook = target.register_forward_hook(self._replace)
        shape = _batch_shape(self.inputs)
        if shape is None:
            self.grad = False
            out = self.forward()
            shape = (int(out.shape[0]), int(out.shape[1]))
            self.grad = True
        self.shape = shape

    def _exit(self) -> None:
        if self.hook is not None:
            self.hook.remove()
        for p, flag in self.flags:
            p.requires_grad_(flag)
        if isinstance(self.model, nn.Module):
            self.model.train(self.was_training)

    def _given_embeddings(self) -> Tensor | None:
        if isinstance(self.inputs, Mapping) and isinstance(
            self.inputs.get("inputs_embeds"), Tensor
        ):
            return self.inputs["inputs_embeds"]
        if isinstance(self.inputs, Tensor) and self.inputs.is_floating_point():
            return self.inputs
        return None

    def _leaf(self, embeds: Tensor) -> Tensor:
        leaf = embeds.detach().clone()
        if self.shift is not None:
            leaf = leaf + self.shift.to(leaf.dtype)
        leaf.requires_grad_(self.grad)
        self.leaf = leaf
        return leaf

    def _replace(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        return self._leaf(out)

    def forward(self) -> Tensor:
        inputs = self.inputs
        embeds = self._given_embeddings()
        if embeds is not None:
            leaf = self._leaf(embeds)
            inputs = leaf if isinstance(inputs, Tensor) else {**inputs, "inputs_embeds": leaf}
        with torch.set_grad_enabled(self.grad):
            if isinstance(inputs, Mapping):
                result = self.model(**inputs)
            elif isinstance(inputs, tuple):
                result = self.model(*inputs)
            else:
                result = self.model(inputs)
        out = self.output(result) if self.output is not None else _per_token(result)
        if self.leaf is None or out.dim() < 2:
            raise ValueError(
                "the model's input embeddings were not reached: give embedding= (the module "
                "that makes them) or inputs_embeds, and a model returning (B, S, ...) outputs"
            )
        return out.reshape(out.shape[0], out.shape[1], -1)


def _batch_shape(inputs: Any) -> tuple[int, int] | None:
    """``(B, S)`` from the ids or embeddings given, when they say it."""
    if isinstance(inputs, Mapping):
        first = inputs.get("input_ids", inputs.get("inputs_embeds"))
    elif isinstance(inputs, tuple):
        first = inputs[0] if inputs else None
    else:
        first = inputs
    if isinstance(first, Tensor) and first.dim() >= 2:
        return int(first.shape[0]), int(first.shape[1])
    return None


def _embedding_of(model: Any) -> nn.Module:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        found = get()
        if isinstance(found, nn.Module):
            return found
    if isinstance(model, nn.Module):
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                return module
    raise TypeError(
        "leak_test found no embedding layer: pass embedding= (the module whose output are "
        "the input embeddings) or give the model inputs_embeds"
    )


def _per_token(result: Any) -> Tensor:
    if isinstance(result, Tensor):
        return result
    for name in ("logits", "last_hidden_state"):
        value = getattr(result, name, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor):
        return result[0]
    raise TypeError(
        f"leak_test cannot read per-token outputs from a {type(result).__name__}: pass "
        f"output= (e.g. lambda out: out.hidden_states[-1])"
    )


def _mask(mask: Mask | None, seq_lens: Any, inputs: Any, batch: int, seq_len: int) -> Tensor:
    """``(B, S, S)`` bool: what each token may attend."""
    if mask is None:
        if seq_lens is None:
            positions = inputs.get("position_ids") if isinstance(inputs, Mapping) else None
            if positions is None:
                raise TypeError(
                    "leak_test needs the documents: pass mask=, seq_lens=, or inputs with "
                    "position_ids that restart at 0 in every document"
                )
            seq_lens = _lengths_from_positions(positions.expand(batch, seq_len))
        mask = causal() & document(seq_lens)
    dense = mask.to_dense(batch, 1, seq_len, seq_len)[:, 0]
    return dense.cpu()


def _lengths_from_positions(positions: Tensor) -> list[list[int]]:
    rows = []
    for row in positions.long().cpu():
        starts = (row == 0).nonzero().view(-1).tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        ends = [*starts[1:], row.numel()]
        rows.append([e - s for s, e in zip(starts, ends, strict=True)])
    return rows
