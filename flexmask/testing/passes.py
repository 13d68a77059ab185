"""The leak test's passes: which sources (outputs read, or inputs moved) may reach which
targets through the mask — through as many layers as the model has, or any number — the
planned passes that test every forbidden pair (:mod:`flexmask.testing.cover`), sampled
single tokens for the influences the mask allows, and the narrowing of a leak to a token
pair."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from flexmask.testing.cover import plan
from flexmask.testing.origin import locate as locate_origin
from flexmask.testing.report import Leak, LeakReport, Missing

Source = Tensor  # (B, S) bool: the outputs read (grad) or the inputs moved (perturb)


class Probe:
    """The passes, over sources (outputs read, or inputs moved) and targets (the others)."""

    def __init__(self, runner: Any, allowed: Tensor, method: str, layers: int | None) -> None:
        self.runner = runner
        self.direct = allowed
        self.real = allowed.any(-1)
        eye = torch.eye(allowed.shape[-1], dtype=torch.bool).unsqueeze(0)
        # One layer: what the mask lets a token attend, and itself (the residual stream).
        self.step = allowed | (eye & self.real.unsqueeze(-1))
        self.closure = _closure(self.step)
        self.component = _components(self.closure, self.real)
        self.documents = _documents(self.component)
        self.layers = layers
        self.reach = self.closure if layers is None else _power(self.step, layers)
        self.method = method
        self.passes = 0
        self.out: Tensor | None = None
        self.base: Tensor | None = None
        self.scale: dict[str, float] = {}
        self._as_float: dict[tuple[str, int | None], Tensor] = {}
        self.beside_grad = False  # forward passes run beside backward ones (auto)

    # -- one pass
    def influence(self, source: Source, method: str) -> Tensor:
        """``(B, S)`` float64 size of the sources' influence on every target token: a
        gradient norm (grad) or how far the outputs moved (perturb), both taken in float64
        so that an influence far below the model dtype's resolution is not rounded to 0."""
        self.passes += 1
        return self._grad(source) if method == "grad" else self._perturb(source)

    def _grad(self, source: Source) -> Tensor:
        runner = self.runner
        if self.out is None:
            runner.grad, runner.shift = True, None
            self.out = runner.forward()
            self.leaf = runner.leaf  # forward passes make leaves of their own
        weight = torch.randn(self.out.shape, generator=runner.generator).to(self.out)
        weight = weight * source.to(self.out.device).unsqueeze(-1).to(weight.dtype)
        (grad,) = torch.autograd.grad((self.out * weight).sum(), self.leaf, retain_graph=True)
        return grad.detach().reshape(*grad.shape[:2], -1).double().norm(dim=-1).cpu()

    def _perturb(self, source: Source) -> Tensor:
        runner = self.runner
        runner.grad = False
        if self.base is None:
            runner.shift = None
            self.base = runner.forward().detach()
            leaf = runner.leaf.detach()
            self.width = float(leaf.float().std().clamp(min=1e-3))
            self.leaf_shape = leaf.shape
        noise = torch.randn(self.leaf_shape, generator=runner.generator) * self.width
        runner.shift = (noise * source.unsqueeze(-1)).to(self.base.device)
        moved = runner.forward().detach()
        runner.shift = None
        change = (moved.double() - self.base.double()).norm(dim=-1)
        if self.beside_grad:
            # Beside the gradient, forward passes look for what it cannot carry (detached
            # statistics, custom ops), which moves outputs far beyond rounding; an output
            # that moves by a few ulps only is a kernel summing in another order (an MoE
            # batching its tokens by expert), not a path, and the gradient tests those.
            ulps = 16 * torch.finfo(self.base.dtype).eps if self.base.is_floating_point() else 0
            change = change * (change > ulps * self.base.double().norm(dim=-1))
        return change.cpu()

    def relation(self, method: str) -> Tensor:
        """``[b, s, t]``: source s may reach target t (grad: output s reads input t)."""
        return self.reach if method == "grad" else self.reach.transpose(1, 2)

    def targets(self, method: str) -> Tensor:
        # What a padding token outputs is never read; every input may be read.
        return torch.ones_like(self.real) if method == "grad" else self.real

    def forbidden(self, source: Source, method: str) -> Tensor:
        """Targets no source may reach (other rows included)."""
        key = (method, self.layers)
        if key not in self._as_float:  # asked after every pass: made once per depth
            self._as_float[key] = self.relation(method).float()
        reachable = torch.bmm(source.unsqueeze(1).float(), self._as_float[key])[:, 0] > 0
        return ~reachable & self.targets(method)

    # -- the test
    def run(self, samples: int, max_examples: int, locate: bool = True) -> LeakReport:
        gen = self.runner.generator
        leaking: dict[str, list[tuple[Source, Tensor]]] = {}
        methods, first = self._methods()
        if self.layers is None and not torch.equal(self.closure, self.step):
            self._infer_layers(methods[0], leaking)
        if first is not None:  # what is forbidden is known now: the depth is
            self._record(self.real, first, "grad", leaking)
        for method in methods:
            sources = self.real if method == "grad" else torch.ones_like(self.real)
            planned = plan(self.relation(method), sources, self.targets(method), self.component)
            for source in planned:
                if first is not None and method == "grad" and torch.equal(source, self.real):
                    continue  # run by _methods already
                self._record(source, self.influence(source, method), method, leaking)
        missing: list[Missing] = []
        for _ in range(samples):
            source = self._one_each(gen)
            found = self.influence(source, methods[0])
            self._record(source, found, methods[0], leaking)
            missing += self._missing(source, found, methods[0])
        leaks: list[Leak] = []
        pairs: dict[tuple[int, int], float] = {}
        for method in methods:
            # Forward passes only add what the gradient did not find.
            found_leaks, found_pairs = self._narrow(
                leaking.get(method, []), method, max_examples, pairs
            )
            known = set(pairs)
            leaks += [x for x in found_leaks if (x.output_document, x.input_document) not in known]
            pairs.update({p: v for p, v in found_pairs.items() if p not in known})
        leaks = sorted(leaks, key=lambda x: (x.method != "grad", -x.magnitude))
        origin = None
        if locate and leaks:
            # The evidence of the method that found the first leak: its leaking passes.
            method = leaks[0].method
            evidence: list[Tensor] = []
            for source, _ in leaking.get(method, []):
                if not any(torch.equal(source, seen) for seen in evidence):
                    evidence.append(source)
            if all(out != inp for out, inp in pairs):
                # No leak inside a document: the passes between whole documents test every
                # pair across documents, at any depth, so the cuts need not be replayed.
                whole = [source for source in evidence if self._whole_documents(source)]
                evidence = whole or evidence
            origin = locate_origin(self, evidence, method)
        return LeakReport(
            leaks=tuple(leaks)[:max_examples],
            pairs=pairs,
            missing=tuple(dict.fromkeys(missing))[:max_examples],
            documents=tuple(self.documents),
            passes=self.passes,
            method="+".join(methods),
            seconds=0.0,
            layers=self.layers,
            origin=origin,
        )

    def _whole_documents(self, source: Source) -> bool:
        """Every document is wholly in the source set, or wholly out of it."""
        owned = self.component >= 0
        size = torch.bincount(self.component[owned], minlength=len(self.documents))
        picked = torch.bincount(self.component[owned & source], minlength=len(self.documents))
        return bool(((picked == 0) | (picked == size)).all())

    def _methods(self) -> tuple[list[str], Tensor | None]:
        """The methods to run — ``auto``: both, or forward passes alone when the backward
        fails (torch's FlexAttention on the CPU has none) — and, when a backward ran, what
        it found: its pass reads every real output at once, the plan's first grad pass."""
        if self.method == "perturb":
            return ["perturb"], None
        try:
            found = self.influence(self.real, "grad")
        except RuntimeError:
            if self.method == "grad":
                raise
            self.passes = 0
            return ["perturb"], None
        self.beside_grad = self.method == "auto"
        return (["grad"] if self.method == "grad" else ["grad", "perturb"]), found

    def _infer_layers(self, method: str, leaking: dict[str, list[tuple[Source, Tensor]]]) -> None:
        """The number of layers, when the mask's reach grows with it (windows): one pass from
        one source per component, the one whose reach grows most, and the largest depth
        whose whole reach it shows. A model of ``L`` layers shows exactly ``L`` (when every
        allowed influence is there); a leak that widens every probed source's reach to a
        whole extra layer's would be read as a deeper model."""
        step = self.step if method == "grad" else self.step.transpose(1, 2)
        closure = self.closure if method == "grad" else self.closure.transpose(1, 2)
        growth = (closure.sum(-1) - step.sum(-1)).masked_fill(self.component < 0, -1)
        probes = torch.zeros_like(self.real)
        for number in range(len(self.documents)):
            score = growth.masked_fill(self.component != number, -1)
            if int(score.max()) > 0:
                flat = int(score.view(-1).argmax())
                probes.view(-1)[flat] = True
        found = self.influence(probes, method)
        depth: int | None = None
        for b, s in probes.nonzero().tolist():
            seen = (found[b] > 0) & (self.component[b] == self.component[b, s])
            row, layers = step[b, s], 1
            while True:
                if bool((row & ~seen).any()):
                    layers = max(layers - 1, 1)
                    break
                grown = (row.float() @ step[b].float()) > 0
                if torch.equal(grown, row):
                    layers = 0  # the whole closure is there: any depth
                    break
                row, layers = grown, layers + 1
            if layers and (depth is None or layers < depth):
                depth = layers
        self.layers = depth
        self.reach = self.closure if depth is None else _power(self.step, depth)
        self._record(probes, found, method, leaking)

    def _record(
        self,
        source: Source,
        found: Tensor,
        method: str,
        leaking: dict[str, list[tuple[Source, Tensor]]],
    ) -> None:
        forbidden = self.forbidden(source, method)
        bad = forbidden & (found > 0)
        allowed = ~forbidden & (found > 0) & self.targets(method)
        if bool(allowed.any()):
            self.scale.setdefault(method, float(found[allowed].median()))
        if bool(bad.any()):
            leaking.setdefault(method, []).append((source, found * bad))

    def _one_each(self, gen: torch.Generator) -> Source:
        """One random token of every component."""
        score = torch.rand(self.real.shape, generator=gen).masked_fill(~self.real, -1.0)
        best = torch.full((len(self.documents) + 1,), -1.0)
        best.scatter_reduce_(0, (self.component + 1).view(-1), score.view(-1), "amax")
        return self.real & (score == best[self.component + 1])

    def _missing(self, source: Source, found: Tensor, method: str) -> list[Missing]:
        direct = self.direct if method == "grad" else self.direct.transpose(1, 2)
        should = torch.bmm(source.unsqueeze(1).float(), direct.float())[:, 0] > 0
        absent = should & (found == 0)
        result = []
        for b, t in absent.nonzero().tolist():
            s = int((source[b] & direct[b, :, t]).nonzero()[0])
            out, inp = (s, t) if method == "grad" else (t, s)
            result.append(Missing(b, out, inp))
        return result

    # -- narrowing a leak down
    def _narrow(
        self,
        leaking: list[tuple[Source, Tensor]],
        method: str,
        max_examples: int,
        known: dict[tuple[int, int], float],
    ) -> tuple[list[Leak], dict[tuple[int, int], float]]:
        """Each leaking pass, per document among its sources (padding: -1), unless every
        (output, input) document pair it could name is named already — by this method or
        by the gradient: one pass per document finds the pairs, a bisection a token pair."""
        pairs: dict[tuple[int, int], float] = {}
        examples: dict[tuple[int, int], Leak] = {}
        for source, bad in leaking:
            into = set(self.component[bad > 0].tolist())
            for doc in sorted(set(self.component[source].tolist())):
                candidates = {self._pair(doc, target, method) for target in into}
                if candidates <= set(pairs) | set(known):
                    continue
                alone = source & (self.component == doc)
                found = self.influence(alone, method) * self.forbidden(alone, method)
                for b, t in (found > 0).nonzero().tolist():
                    pair = self._pair(doc, int(self.component[b, t]), method)
                    pairs[pair] = max(pairs.get(pair, 0.0), float(found[b, t]))
                    if pair not in examples and len(examples) < max_examples:
                        examples[pair] = self._example(alone, b, t, float(found[b, t]), method)
        scale = self.scale.get(method) or 1.0
        leaks = sorted(
            (dataclasses.replace(e, relative=e.magnitude / scale) for e in examples.values()),
            key=lambda leak: -leak.magnitude,
        )
        return leaks, pairs

    @staticmethod
    def _pair(source_doc: int, target_doc: int, method: str) -> tuple[int, int]:
        # (output document, input document)
        return (source_doc, target_doc) if method == "grad" else (target_doc, source_doc)

    def _example(
        self, source: Source, row: int, target: int, magnitude: float, method: str
    ) -> Leak:
        """Bisects the source tokens down to one that reaches ``target``: the target stays
        forbidden to every part, as no part reaches more than the whole."""
        tokens = source.nonzero()
        while len(tokens) > 1:
            half = tokens[: len(tokens) // 2]
            part = torch.zeros_like(source)
            part[half[:, 0], half[:, 1]] = True
            found = self.influence(part, method)
            if float(found[row, target]) > 0:
                tokens, magnitude = half, float(found[row, target])
            else:
                tokens = tokens[len(tokens) // 2 :]
        b, s = (int(x) for x in tokens[0])
        (out_row, out), (in_row, inp) = (
            ((b, s), (row, target)) if method == "grad" else ((row, target), (b, s))
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
            method=method,
        )


def _closure(step: Tensor) -> Tensor:
    """``[b, q, kv]``: kv reaches q through any number of layers (``step`` holds itself)."""
    reach = step
    while True:
        grown = reach | (torch.bmm(reach.float(), reach.float()) > 0)
        if torch.equal(grown, reach):
            return reach
        reach = grown


def _power(step: Tensor, layers: int) -> Tensor:
    """``[b, q, kv]``: kv reaches q through ``layers`` layers (``step`` holds itself)."""
    result, base = step, step
    layers -= 1
    while layers:
        if layers & 1:
            result = result | (torch.bmm(result.float(), base.float()) > 0)
        layers >>= 1
        if layers:
            base = base | (torch.bmm(base.float(), base.float()) > 0)
    return result


def _components(reach: Tensor, real: Tensor) -> Tensor:
    """``(B, S)`` document number of every real token (-1: padding), numbered over the batch
    in layout order: the groups of tokens connected by the mask."""
    batch, seq_len = real.shape
    linked = reach | reach.transpose(1, 2)
    big = batch * seq_len
    label = torch.where(real, torch.arange(big).view(batch, seq_len), big)
    while True:
        spread = torch.where(linked & real.unsqueeze(1), label.unsqueeze(1), big).amin(-1)
        spread = torch.where(real, torch.minimum(spread, label), big)
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
