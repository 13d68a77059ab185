"""What the leak test reports: leaking token pairs, missing influences, the documents."""

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
    """

    leaks: tuple[Leak, ...]
    pairs: dict[tuple[int, int], float]
    missing: tuple[Missing, ...]
    documents: tuple[tuple[int, int, int], ...]
    passes: int
    method: str
    seconds: float
    layers: int | None = None

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
