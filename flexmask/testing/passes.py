"""The leak test's passes: which sources (outputs read, or inputs moved) may reach which
targets through the mask — its transitive closure, any number of layers deep — and the
passes that cover every pair of documents, cut documents, pick single tokens, and narrow a
leak down to a token pair."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from flexmask.testing.report import Leak, LeakReport, Missing

Source = Tensor  # (B, S) bool: the outputs read (grad) or the inputs moved (perturb)


class Probe:
    """The passes, over sources (outputs read, or inputs moved) and targets (the others)."""

    def __init__(self, runner: Any, allowed: Tensor, method: str) -> None:
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
