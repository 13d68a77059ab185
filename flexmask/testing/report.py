"""What the leak test reports: leaking token pairs, missing influences, the documents, and
the module where a leak starts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Leak:
    """Input token ``input`` (row ``input_row``) of document ``input_document`` reaches
    output ``output`` (row ``row``) of document ``output_document``, which the mask
    forbids. Documents are numbered in layout order over the batch; -1 is padding.
    ``magnitude`` is the size of the influence found, in float64 (a gradient norm, or how far
    the output moved); ``relative`` is it over the typical allowed influence of the same
    method; ``method`` is how it was found: ``"grad"`` (a backward pass) or ``"perturb"``
    (forward passes — a leak the gradient cannot see, such as a detached statistic)."""

    row: int
    output: int
    input_row: int
    input: int
    output_document: int
    input_document: int
    magnitude: float
    relative: float
    method: str = "grad"

    def __str__(self) -> str:
        where = f"row {self.input_row}, " if self.input_row != self.row else ""
        return (
            f"row {self.row}: input token {where}{self.input} (document {self.input_document})"
            f" reaches output token {self.output} (document {self.output_document}), magnitude "
            f"{self.magnitude:.3g} ({self.relative:.3g} of a typical allowed influence, "
            f"{self.method})"
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
class LeakOrigin:
    """The first module whose output already depends on an input the mask keeps apart from
    it: where a leak starts (:func:`leak_test`'s ``locate``).

    Found by descending from the model: among the modules called directly inside it, in the
    order they run, the first whose output leaks (a block of the model's layers), then the
    first leaking one inside that (the mixer), and so on — as long as that module was given
    clean inputs. It stops at a module none of whose submodules' outputs leak (a leaf, or
    the leak is in its own code), or at one whose first leaking submodule was already given
    the leak (``before``: the leak is in its own code, or in a submodule whose output is not
    per token, before that one ran).

    Attributes:
        path: the module's name in the model (``"model.layers.0.linear_attn"``); ``""`` is
            the model itself (the leak is in its own code).
        kind: its class name.
        layer: the index of the outermost module on the way that is an item of a list of
            layers (``model.layers``); None: none is.
        layer_type: that layer's kind where the model's config names one per layer
            (``config.layer_types[layer]``, or ``layers_block_type``); else None.
        call: which of the module's calls in a forward leaks first (1-based): a layer run
            twice (weights shared) is named with the call.
        calls: how many times the module ran in one forward.
        before: the submodule that was given the leak, when the descent stopped there.
        chain: the modules descended through, outermost first, ``path`` last (the model
            itself is not listed: ``()`` when the leak is in its own code).
        method: the evidence: ``"grad"`` (gradients of each module's output) or
            ``"perturb"`` (each module's output moved), as the leak was found.
        checks: backward passes (grad) or forward passes (perturb) the locator replayed.
    """

    path: str
    kind: str
    layer: int | None
    layer_type: str | None
    call: int
    calls: int
    before: str | None
    chain: tuple[str, ...]
    method: str
    checks: int

    def __str__(self) -> str:
        details = [self.kind]
        if self.layer_type is not None:
            details.append(f"layer type {self.layer_type}")
        if self.calls > 1:
            details.append(f"call {self.call} of {self.calls}")
        where = self.path if self.path else "the model's own forward"
        text = f"{where} ({', '.join(details)})"
        if self.before is not None:
            # Named from the module, as its own code names it (a shared module called
            # inside it keeps its whole name).
            inner = self.before
            if self.path and inner.startswith(self.path + "."):
                inner = inner[len(self.path) + 1 :]
            text += f", inside it before {inner}"
        return text


@dataclasses.dataclass(frozen=True)
class LeakReport:
    """What :func:`leak_test` found.

    Attributes:
        leaks: one example token pair per leaking (output document, input document) pair,
            those the gradient found first, then the largest.
        pairs: ``(output document, input document) -> largest magnitude`` for every leaking
            pair found (the gradient's, where it found the pair). A leak inside a document
            (a tree's branch reading its sibling, a window reaching too far) is ``(d, d)``.
        missing: allowed influences that are absent (sampled; the first few).
        documents: ``(row, first token, length)`` of every document (the tokens the mask
            links: a tree is one), by number.
        passes: backward and forward passes run, the narrowing-down included.
        method: ``"grad"``, ``"perturb"`` or ``"grad+perturb"``: the passes that ran.
        seconds: wall time of the test.
        layers: the depth the mask's reach was taken through (given, or read off the model
            when the reach grows with depth, as a window's does); None: any depth.
        origin: where the first leak starts (:class:`LeakOrigin`): None when nothing leaks,
            ``locate=False``, or the model is not an ``nn.Module``.
    """

    leaks: tuple[Leak, ...]
    pairs: dict[tuple[int, int], float]
    missing: tuple[Missing, ...]
    documents: tuple[tuple[int, int, int], ...]
    passes: int
    method: str
    seconds: float
    layers: int | None = None
    origin: LeakOrigin | None = None

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
        if self.origin is not None:
            lines.append(f"  leaks first at {self.origin}")
        lines += [f"  missing: {m}" for m in self.missing]
        return "\n".join(lines) if not self.ok else f"ok: {head}"
