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
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from flexmask import Mask, causal, document

Source = Tensor  # (B, S) bool: the outputs read (grad) or the inputs moved (perturb)


@dataclasses.dataclass(frozen=True)
class Leak:
    """Input token ``input`` (row ``input_row``) of document ``input_document`` reaches
    output ``output`` (row ``row``) of document ``output_document``, which the mask
    forbids. Documents are numbered in layout order over the batch; -1 is padding.
    ``magnitude`` is the size of the influence found (a gradient norm, or how far the output
    moved); ``relative`` is it over the typical allowed influence of the same pass kind."""

    row: int
    output: int
    input_row: int
    input: int
    output_document: int
    input_document: int
    magnitude: float
    relative: float

    def __str__(self) -> str:
        where = f"row {self.input_row}, " if self.input_row != self.row else ""
        return (
            f"row {self.row}: input token {where}{self.input} (document {self.input_document})"
            f" reaches output token {self.output} (document {self.output_document}), magnitude "
            f"{self.magnitude:.3g} ({self.relative:.3g} of a typical allowed influence)"
        )


@dataclasses.dataclass(frozen=True)
class Missing:
    """The mask lets output ``output`` attend input ``input`` (row ``row``), but it does not
    depend on it at all: the kernel attends less than the mask."""

    row: int
    output: int
    input: int

    def __str__(self) -> str:
        return (
            f"row {self.row}: output token {self.output} does not depend on input token "
            f"{self.input}, which the mask lets it attend"
        )


@dataclasses.dataclass(frozen=True)
class LeakReport:
    """What :func:`leak_test` found.

    Attributes:
        leaks: one example token pair per leaking (output document, input document) pair,
            largest first.
        pairs: ``(output document, input document) -> largest magnitude`` for every leaking
            pair found.
        missing: allowed influences that are absent (sampled; the first few).
        documents: ``(row, first token, length)`` of every document, by number.
        passes: backward (or forward) passes run, the narrowing-down included.
        method: ``"grad"`` or ``"perturb"``.
        seconds: wall time of the test.
    """

    leaks: tuple[Leak, ...]
    pairs: dict[tuple[int, int], float]
    missing: tuple[Missing, ...]
    documents: tuple[tuple[int, int, int], ...]
    passes: int
    method: str
    seconds: float

    @property
    def ok(self) -> bool:
        """No leak and no missing influence."""
        return not self.leaks and not self.missing

    def raise_if_failed(self) -> LeakReport:
        """Raises AssertionError naming the largest leak (or the first missing influence)."""
        if not self.ok:
            raise AssertionError(str(self))
        return self

    def __str__(self) -> str:
        head = (
            f"{len(self.pairs)} leaking document pairs, {len(self.missing)} missing influences "
            f"({self.passes} {self.method} passes over {len(self.documents)} documents)"
        )
        lines = [head] + [f"  leak: {leak}" for leak in self.leaks]
        lines += [f"  missing: {m}" for m in self.missing]
        return "\n".join(lines) if not self.ok else f"ok: {head}"


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
        probe = _Probe(runner, allowed, method)
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


# ---------------------------------------------------------------------- the passes
class _Probe:
    """The passes, over sources (outputs read, or inputs moved) and targets (the others)."""

    def __init__(self, runner: _Runner, allowed: Tensor, method: str) -> None:
        self.runner = runner
        self.direct = allowed
        self.real = allowed.any(-1)
        self.reach = _closure(allowed, self.real)
        self.component = _components(self.reach, self.real)
        self.documents = _documents(self.component)
        self.passes = 0
        self.method = "grad" if method in ("grad", "auto") else "perturb"
        self.fallback = method == "auto"
        self.out: Tensor | None = None
        self.base: Tensor | None = None
        self.scale: dict[str, float] = {}

    # -- one pass
    def influence(self, source: Source) -> Tensor:
        """``(B, S)`` size of the sources' influence on every target token."""
        self.passes += 1
        if self.method == "grad":
            try:
                return self._grad(source)
            except RuntimeError:
                if not self.fallback or self.passes > 1:
                    raise
                self.method = "perturb"  # no backward (torch's CPU flex): forward passes
        return self._perturb(source)

    def _grad(self, source: Source) -> Tensor:
        runner = self.runner
        if self.out is None:
            runner.grad, runner.shift = True, None
            self.out = runner.forward()
        weight = torch.randn(self.out.shape, generator=runner.generator).to(self.out)
        weight = weight * source.to(self.out.device).unsqueeze(-1).to(weight.dtype)
        assert runner.leaf is not None
        (grad,) = torch.autograd.grad((self.out * weight).sum(), runner.leaf, retain_graph=True)
        return grad.detach().reshape(*grad.shape[:2], -1).norm(dim=-1).cpu().float()

    def _perturb(self, source: Source) -> Tensor:
        runner = self.runner
        runner.grad = False
        if self.base is None:
            runner.shift = None
            self.base = runner.forward().detach()
            assert runner.leaf is not None
            self.width = runner.leaf.detach().float().std().clamp(min=1e-3)
            self.leaf_shape = runner.leaf.shape
        noise = torch.randn(self.leaf_shape, generator=runner.generator) * float(self.width)
        runner.shift = (noise * source.unsqueeze(-1)).to(self.base.device)
        moved = runner.forward().detach()
        runner.shift = None
        return (moved - self.base).float().norm(dim=-1).cpu()

    def relation(self) -> Tensor:
        """``[b, s, t]``: source s may reach target t (grad: output s reads input t)."""
        return self.reach if self.method == "grad" else self.reach.transpose(1, 2)

    def forbidden(self, source: Source) -> Tensor:
        """Targets no source may reach (other rows included)."""
        reachable = torch.bmm(source.unsqueeze(1).float(), self.relation().float())[:, 0] > 0
        return ~reachable

    # -- the test
    def run(self, samples: int, max_examples: int) -> LeakReport:
        gen = self.runner.generator
        leaking: list[tuple[Source, Tensor]] = []
        missing: list[Missing] = []
        # First every real output at once (grad; in auto, whether the backward runs): no
        # real output may read padding, nor a row another row's input.
        if self.method == "grad":
            found = self.influence(self.real)
            if self.method == "grad":
                self._record(self.real, found, leaking)
        if self.method == "perturb" and not bool(self.real.all()):
            # Moved padding must not move a real output.
            self._record(~self.real, self.influence(~self.real), leaking)
        for source in self._document_passes():
            self._record(source, self.influence(source), leaking)
        for _ in range(samples):
            source = self._cut(gen)
            self._record(source, self.influence(source), leaking)
        for _ in range(samples):
            source = self._one_each(gen)
            found = self.influence(source)
            self._record(source, found, leaking)
            missing += self._missing(source, found)
        leaks, pairs = self._narrow(leaking, max_examples)
        return LeakReport(
            leaks=tuple(leaks),
            pairs=pairs,
            missing=tuple(dict.fromkeys(missing))[:max_examples],
            documents=tuple(self.documents),
            passes=self.passes,
            method=self.method,
            seconds=0.0,
        )

    def _record(self, source: Source, found: Tensor, leaking: list[tuple[Source, Tensor]]) -> None:
        bad = self.forbidden(source) & (found > 0)
        if self.method == "perturb":
            bad &= self.real  # what a padding token outputs is never read
        allowed = ~self.forbidden(source) & (found > 0)
        if bool(allowed.any()):
            self.scale.setdefault(self.method, float(found[allowed].median()))
        if bool(bad.any()):
            leaking.append((source, found * bad))

    def _document_passes(self) -> list[Source]:
        count = len(self.documents)
        comp = self.component
        sources = []
        for bit in range(math.ceil(math.log2(count)) if count > 1 else 0):
            for value in (0, 1):
                side = ((comp >> bit) & 1) == value
                sources.append(side & (comp >= 0))
        return sources

    def _cut(self, gen: torch.Generator) -> Source:
        """Each document cut at a random token: the part up to it (grad: outputs that may
        not read what follows) or after it (perturb: inputs that may not reach before)."""
        cut = self._one_each(gen)
        # Per row, the cut's position in each token's document, spread over the document.
        at = torch.where(cut, torch.arange(cut.shape[1]), -1)
        per_doc = torch.full((len(self.documents) + 1,), -1, dtype=torch.int64)
        per_doc.scatter_reduce_(0, (self.component + 1).view(-1), at.view(-1), "amax")
        cut_of = per_doc[self.component + 1]
        position = torch.arange(cut.shape[1]).view(1, -1)
        before = position <= cut_of if self.method == "grad" else position > cut_of
        return before & self.real

    def _one_each(self, gen: torch.Generator) -> Source:
        """One random token of every document."""
        score = torch.rand(self.real.shape, generator=gen).masked_fill(~self.real, -1.0)
        best = torch.full((len(self.documents) + 1,), -1.0)
        best.scatter_reduce_(0, (self.component + 1).view(-1), score.view(-1), "amax")
        return self.real & (score == best[self.component + 1])

    def _missing(self, source: Source, found: Tensor) -> list[Missing]:
        direct = self.direct if self.method == "grad" else self.direct.transpose(1, 2)
        should = torch.bmm(source.unsqueeze(1).float(), direct.float())[:, 0] > 0
        absent = should & (found == 0)
        result = []
        for b, t in absent.nonzero().tolist():
            s = int((source[b] & direct[b, :, t]).nonzero()[0])
            out, inp = (s, t) if self.method == "grad" else (t, s)
            result.append(Missing(b, out, inp))
        return result

    # -- narrowing a leak down
    def _narrow(
        self, leaking: list[tuple[Source, Tensor]], max_examples: int
    ) -> tuple[list[Leak], dict[tuple[int, int], float]]:
        pairs: dict[tuple[int, int], float] = {}
        examples: dict[tuple[int, int], Leak] = {}
        done: set[int] = set()
        for source, _ in leaking:
            for doc in sorted(set(self.component[source].tolist()) - {-1} - done):
                alone = source & (self.component == doc)
                found = self.influence(alone) * self.forbidden(alone)
                if self.method == "perturb":
                    found = found * self.real
                done.add(doc)
                for b, t in (found > 0).nonzero().tolist():
                    pair = self._pair(doc, int(self.component[b, t]))
                    pairs[pair] = max(pairs.get(pair, 0.0), float(found[b, t]))
                    if pair not in examples and len(examples) < max_examples:
                        examples[pair] = self._example(alone, b, t, float(found[b, t]))
        scale = self.scale.get(self.method) or 1.0
        leaks = sorted(
            (dataclasses.replace(e, relative=e.magnitude / scale) for e in examples.values()),
            key=lambda leak: -leak.magnitude,
        )
        return leaks, pairs

    def _pair(self, source_doc: int, target_doc: int) -> tuple[int, int]:
        # (output document, input document)
        return (source_doc, target_doc) if self.method == "grad" else (target_doc, source_doc)

    def _example(self, source: Source, row: int, target: int, magnitude: float) -> Leak:
        """Bisects the source tokens down to one that reaches ``target``."""
        tokens = source.nonzero()
        while len(tokens) > 1:
            half = tokens[: len(tokens) // 2]
            part = torch.zeros_like(source)
            part[half[:, 0], half[:, 1]] = True
            found = self.influence(part)
            if float(found[row, target]) > 0:
                tokens, magnitude = half, float(found[row, target])
            else:
                tokens = tokens[len(tokens) // 2 :]
        b, s = (int(x) for x in tokens[0])
        (out_row, out), (in_row, inp) = (
            ((b, s), (row, target))
            if self.method == "grad"
            else (
                (row, target),
                (b, s),
            )
        )
        return Leak(
            row=out_row,
            output=out,
            input_row=in_row,
            input=inp,
            output_document=int(self.component[out_row, out]),
            input_document=int(self.component[in_row, inp]),
            magnitude=magnitude,
            relative=0.0,
        )


def _closure(direct: Tensor, real: Tensor) -> Tensor:
    """``[b, q, kv]``: kv reaches q through any number of layers (and itself)."""
    eye = torch.eye(direct.shape[-1], dtype=torch.bool).unsqueeze(0)
    reach = direct | (eye & real.unsqueeze(-1))
    while True:
        grown = reach | (torch.bmm(reach.float(), reach.float()) > 0)
        if torch.equal(grown, reach):
            return reach
        reach = grown


def _components(reach: Tensor, real: Tensor) -> Tensor:
    """``(B, S)`` document number of every real token (-1: padding), numbered over the batch
    in layout order: the groups of tokens connected by the mask."""
    batch, seq_len = real.shape
    linked = reach | reach.transpose(1, 2)
    big = batch * seq_len
    label = torch.where(real, torch.arange(big).view(batch, seq_len), big)
    while True:
        spread = torch.where(linked, label.unsqueeze(1), big).amin(-1)
        spread = torch.minimum(spread, label)
        if torch.equal(spread, label):
            break
        label = spread
    numbers = torch.unique(label[real])
    component = torch.full((batch, seq_len), -1, dtype=torch.int64)
    component[real] = torch.searchsorted(numbers, label[real])
    return component


def _documents(component: Tensor) -> list[tuple[int, int, int]]:
    found = []
    for number in range(int(component.max()) + 1 if component.numel() else 0):
        where = (component == number).nonzero()
        row, first = int(where[0, 0]), int(where[0, 1])
        found.append((row, first, int(where.shape[0])))
    return found
