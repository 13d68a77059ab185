"""What the leak test reports: leaking token pairs, missing influences, the documents."""

from __future__ import annotations

import dataclasses


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
