"""Interval mask_mods: the form of a mask_mod that the GPU kernels run fastest.

A mask whose kept keys, on every query row, are a union of a few half-open intervals with
bounds that depend on the query alone — ``lo[q] <= kv_idx < hi[q]``, or arithmetic on
``q_idx`` — is written here as exactly that: comparisons of ``kv_idx`` with bounds read by
``(b, q_idx)`` from int32 tables, joined by ``&`` and ``|``. On the GPU, inductor's FLASH
lowering (``torch._inductor.kernel.flex.interval_mask_packing``) then turns the mask into
one packed 32-bit keep mask per 32 keys instead of evaluating it key by key, and every aux
load is lane-uniform (``aux_vectorization``: read once per query row, vectorised).

Which masks have this form is each node's answer to ``Node.interval_form``: a piece whose
rows are intervals says so (its ``lines_at`` gives the bounds), ``&``, ``|`` and ``~``
combine their children's, and anything else (trees, ``from_mask_mod``, ``per_head``)
answers None and keeps its general mask_mod. docs/compile.md lists them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.algebra.mods import MaskMod, MaskModFn

MAX_INTERVALS = 8
"""torch's limit (``MAX_PACKED_MASK_INTERVALS_FOR_CODE_SIZE``): a mask whose comparisons
count more intervals (``count``) is evaluated key by key."""

TAIL = 256
"""Rows past the length every table holds (attending nowhere): a kernel may read the bounds
of the padded rows of a last query block (256 rows on SM100) before discarding them, and a
bound read there must not run off the table (the mask_mod has no clamp: torch's interval
analysis reads no clamp)."""


class QBound(NamedTuple):
    """The bound ``q_idx + plus``: arithmetic on the query, ``plus`` fixed by the piece's
    kind (causal's 1), never its data, so it is no captured scalar that changes."""

    plus: int


class ConstBound(NamedTuple):
    """A bound that is a constant of the piece's kind: full's ``kv_idx >= 0``."""

    value: int


class RowBound(NamedTuple):
    """One end of a node's one interval per query (``intervals_at``, the builders' answer):
    a table ``(R, length + TAIL)`` read at ``(b, q_idx)`` (R rows of per-row data), or
    ``(length + TAIL,)`` read at ``q_idx``."""

    node: object
    high: bool
    """True: the exclusive end (``hi + 1``); False: the start."""


class ValueBound(NamedTuple):
    """A bound computed from one value per batch row (``interval_value``: a window size, a
    prefix length) and ``q_idx``, by the rule ``how`` (``RULES``), fixed by the piece's kind.
    The value is read from an ``(R,)`` int32 table at ``b``, or from ``(1,)`` at ``b - b``
    (an index: torch's analysis reads a captured tensor only through one): no table the
    length of the sequence, for pieces whose rows are arithmetic on ``q``."""

    node: object
    how: str


RULES = ("value", "q+value", "q-value+1", "chunk", "chunk+value", "below_value")
"""``value``: v; ``q+value``: q + v; ``q-value+1``: q - v + 1; ``chunk``: (q // v) * v, the
start of q's chunk; ``chunk+value``: its end; ``below_value``: v where q < v, else at most
-1, as ``v - ((q + 1) // (v + 1)) * (v + 1)`` (padding: a padded query attends nothing;
a comparison of q alone would refuse the whole mask in torch's analysis)."""


Bound = QBound | ConstBound | RowBound | ValueBound


class Atom(NamedTuple):
    """``kv_idx < bound`` (``below``) or ``kv_idx >= bound``: one interval each."""

    below: bool
    bound: Bound


class Join(NamedTuple):
    """``parts[0] & parts[1] & ...`` (``every``) or ``parts[0] | parts[1] | ...``."""

    every: bool
    parts: tuple[Formula, ...]


Formula = Atom | Join


def one_range(node: object) -> Formula:
    """The form of a node whose rows are one interval each (``Node.has_intervals``):
    ``start[q] <= kv_idx < end[q]``, both read from its ``intervals_at``."""
    return Join(True, (Atom(False, RowBound(node, False)), Atom(True, RowBound(node, True))))


def all_of(parts: list[Formula | None]) -> Formula | None:
    """``&`` of the children's forms; None when one has none."""
    if any(p is None for p in parts):
        return None
    return Join(True, tuple(p for p in parts if p is not None))


def any_of(parts: list[Formula | None]) -> Formula | None:
    """``|`` of the children's forms; None when one has none."""
    if any(p is None for p in parts):
        return None
    return Join(False, tuple(p for p in parts if p is not None))


def negated(form: Formula | None) -> Formula | None:
    """``~form`` pushed down to the comparisons (De Morgan): torch's analysis reads ``<``,
    ``>=``, ``&`` and ``|``, not ``~`` (a bitwise_not node refuses the whole mask)."""
    if form is None:
        return None
    if isinstance(form, Atom):
        return Atom(not form.below, form.bound)
    return Join(not form.every, tuple(negated(p) for p in form.parts))  # type: ignore[misc]


def count(form: Formula) -> int:
    """Intervals torch's analysis counts for ``form``, as it counts them: one per
    comparison, the product over an ``&``, the sum over an ``|`` (no simplification)."""
    if isinstance(form, Atom):
        return 1
    counts = [count(p) for p in form.parts]
    total = 1 if form.every else 0
    for c in counts:
        total = total * c if form.every else total + c
    return total


# A materialized formula, as the mask_mod holds it: static nested tuples (the code's shape,
# the same for every batch of one mask kind) and a tuple of tables (the data).
#   ("lt" | "ge", ("q", plus) | ("c", value) | ("t", table index))
#   ("and" | "or", (formula, ...))
Program = tuple


class IntervalMod(MaskModFn):
    """An interval mask_mod: ``program`` (comparisons of ``kv_idx`` with bounds, joined by
    ``&`` and ``|``) over int32 ``tables`` read by the query only.

    A table of shape ``(length + TAIL,)`` is read at ``q_idx``; ``(R, length + TAIL)``, per
    batch row, at ``(b, q_idx)`` — both lane-uniform loads that torch's interval analysis
    and aux vectorisation take with static or dynamic shapes (a flat ``t[b * S + q]`` is
    refused under ``dynamic=True``, where ``S`` is symbolic). No Python scalar is captured:
    the program's constants are fixed by the mask's kind.
    """

    __slots__ = ("program", "tables")
    _name = "interval_mask"

    def __init__(self, program: Program, tables: tuple[Tensor, ...]) -> None:
        self.program = program
        self.tables = tables

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self._run(self.program, b, q_idx, kv_idx)

    def _run(self, program: Program, b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        op, arg = program
        if op in ("and", "or"):
            result = self._run(arg[0], b, q_idx, kv_idx)
            for part in arg[1:]:
                if op == "and":
                    result = result & self._run(part, b, q_idx, kv_idx)
                else:
                    result = result | self._run(part, b, q_idx, kv_idx)
            return result
        kind, value = arg
        if kind == "q":
            # kv < q + 1 as torch's own causal idiom, kv <= q (one node fewer).
            if op == "lt" and value == 1:
                return kv_idx <= q_idx
            bound = q_idx + value if value else q_idx
        elif kind == "c":
            bound = value
        elif kind == "t":
            table = self.tables[value]
            bound = table[b, q_idx] if table.dim() == 2 else table[q_idx]
        else:
            table = self.tables[value[0]]
            v = table[b if table.shape[0] > 1 else b - b]
            bound = _rule(value[1], q_idx, v)
        return kv_idx < bound if op == "lt" else kv_idx >= bound

    def __repr__(self) -> str:
        return f"{self._name}({self._describe(self.program)})"

    def _describe(self, program: Program) -> str:
        op, arg = program
        if op in ("and", "or"):
            joiner = " & " if op == "and" else " | "
            return "(" + joiner.join(self._describe(p) for p in arg) + ")"
        kind, value = arg
        if kind == "q":
            bound = f"q+{value}" if value else "q"
        elif kind == "c":
            bound = str(value)
        elif kind == "v":
            bound = f"{value[1]}(t{value[0]}[{'b' if self.tables[value[0]].shape[0] > 1 else '0'}])"
        else:
            table = self.tables[value]
            where = "b, q" if table.dim() == 2 else "q"
            bound = f"t{value}[{where}]"
        return f"kv {'<' if op == 'lt' else '>='} {bound}"


def _rule(how: str, q_idx: Tensor, v: Tensor) -> Tensor:
    if how == "value":
        return v
    if how == "q+value":
        return q_idx + v
    if how == "q-value+1":
        return q_idx - v + 1
    if how == "below_value":
        step = v + 1  # never 0: v >= 0
        return v - torch.div(q_idx + 1, step, rounding_mode="floor") * step
    start = torch.div(q_idx, v, rounding_mode="floor") * v  # floor: what the analysis reads
    return start if how == "chunk" else start + v  # chunk, chunk+value


def interval_mod(mask: object, length: int, device: torch.device) -> IntervalMod | None:
    """The interval mask_mod of ``mask`` over positions ``[0, length)``, or None where the
    mask has no interval form (a node answers None), torch would count more than
    ``MAX_INTERVALS`` intervals, the bounds would not fit int32 (what the kernel renders
    them in), or under tracing (``intervals_at`` is a build's host-side arithmetic).

    Reads no value back from ``device``: each table is the piece's ``intervals_at`` at every
    position, clamped into ``[0, length]`` (exact: no key lies outside) and cast."""
    form = mask.interval_form()  # type: ignore[attr-defined]
    if form is None or count(form) > MAX_INTERVALS or _tracing() or length + TAIL >= 2**31:
        return None
    grid = WholeGrid(length, torch.device(device))
    tables: list[Tensor] = []
    made: dict[tuple, int] = {}
    ranges: dict[int, tuple[Tensor, Tensor]] = {}

    def table(bound: RowBound) -> int:
        key = (id(bound.node), bound.high)
        if key not in made:
            got = ranges.get(id(bound.node))
            if got is None:
                got = ranges[id(bound.node)] = _rows_at(bound.node, grid)
            values = got[1] if bound.high else got[0]
            made[key] = len(tables)
            tables.append(values[0] if values.shape[0] == 1 else values)
        return made[key]

    def value_table(node: object) -> int:
        key = (id(node), False, "value")
        if key not in made:
            made[key] = len(tables)
            tables.append(node.interval_value(length, grid.device))  # type: ignore[attr-defined]
        return made[key]

    def build(form: Formula) -> Program:
        if isinstance(form, Join):
            return ("and" if form.every else "or", tuple(build(p) for p in form.parts))
        op = "lt" if form.below else "ge"
        bound = form.bound
        if isinstance(bound, QBound):
            return (op, ("q", bound.plus))
        if isinstance(bound, ConstBound):
            return (op, ("c", bound.value))
        if isinstance(bound, ValueBound):
            return (op, ("v", (value_table(bound.node), bound.how)))
        return (op, ("t", table(bound)))

    return IntervalMod(build(_without_implied(_flattened(form))), tuple(tables))


def _rows_at(node: object, grid: WholeGrid) -> tuple[Tensor, Tensor]:
    """Every position's start and exclusive end in ``[0, length]``, ``(R, length)`` int32:
    the node's own ``interval_tables``, else its ``intervals_at`` at every position of every
    row of its data (clamped: exact, as no key lies outside)."""
    length = grid.length
    written = node.interval_tables(length, grid.device)  # type: ignore[attr-defined]
    if written is not None:
        return written
    rows = node.rows or 1  # type: ignore[attr-defined]
    positions = torch.arange(length, dtype=torch.int64, device=grid.device)
    row = torch.arange(rows, dtype=torch.int64, device=grid.device).view(-1, 1)
    got = node.intervals_at(positions.expand(rows, -1), row, grid)  # type: ignore[attr-defined]
    lo = got.lo.expand(rows, length).clamp(0, length).to(torch.int32)
    hi = (got.hi.expand(rows, length) + 1).clamp(0, length).to(torch.int32)
    # The tail attends nowhere: starts at the length, ends at 0.
    pad = torch.nn.functional.pad
    return pad(lo, (0, TAIL), value=length), pad(hi, (0, TAIL), value=0)


class WholeGrid:
    """The grid of one tile covering ``[0, length)`` on both sides, no offsets: what a
    piece's ``intervals_at`` reads (its device, its length) when asked about every
    position at once."""

    __slots__ = ("length", "device", "_first", "_last")

    def __init__(self, length: int, device: torch.device) -> None:
        self.length = length
        self.device = device
        self._first = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device)
        self._last = self._first + max(length - 1, 0)

    batch = 1
    heads = 1
    num_q_blocks = 1
    num_kv_blocks = 1
    q_offset = 0
    kv_offset = 0
    lookup_window = None

    @property
    def q_len(self) -> int:
        return self.length

    kv_len = q_len
    q_block = q_len
    kv_block = q_len
    q_end = q_len
    kv_end = q_len

    @property
    def q_first(self) -> Tensor:
        return self._first

    kv_first = q_first

    @property
    def q_last(self) -> Tensor:
        return self._last

    kv_last = q_last


def _flattened(form: Formula) -> Formula:
    """Nested joins of one kind made one (``(a & b) & c``), unary joins dropped: the same
    count, fewer nodes."""
    if isinstance(form, Atom):
        return form
    parts: list[Formula] = []
    for part in form.parts:
        part = _flattened(part)
        if isinstance(part, Join) and part.every == form.every:
            parts.extend(part.parts)
        else:
            parts.append(part)
    return parts[0] if len(parts) == 1 else Join(form.every, tuple(parts))


def _without_implied(form: Formula) -> Formula:
    """``kv < end[q]`` dropped from an ``&`` that holds ``kv <= q`` where the node's rows
    hold their own query whenever they are not empty, and start past it when they are
    (its ``interval_holds_query``: a document's): ``min(end[q], q + 1)`` is then ``q + 1``
    on every row that attends anything, so ``causal() & document(...)`` reads one table,
    ``start[q] <= kv <= q``, the form a hand-written mask_mod takes (one load and one
    comparison fewer per key on the GPU, and one table fewer to write). Decided from the
    nodes' kinds, never their data: every batch of one mask kind keeps one program."""
    if isinstance(form, Atom):
        return form
    parts = tuple(_without_implied(p) for p in form.parts)
    causal = Atom(True, QBound(1))
    if form.every and causal in parts:
        # Only beside the node's own start: past its rows the start (the length) is what
        # keeps the & empty once the end (0 there) is gone.
        parts = tuple(
            p
            for p in parts
            if not (
                isinstance(p, Atom)
                and p.below
                and isinstance(p.bound, RowBound)
                and p.bound.high
                and getattr(p.bound.node, "interval_holds_query", False)
                and Atom(False, RowBound(p.bound.node, False)) in parts
            )
        )
    return parts[0] if len(parts) == 1 else Join(form.every, parts)


def _tracing() -> bool:
    # lines_at reads tensor values (run_at's shortcuts); a trace keeps the general form.
    # is_dynamo_compiling, not is_compiling: the latter is also True for real Python that
    # dynamo runs while it compiles (a handle's build through its C-level field getter),
    # whose mask_mod would then be of another type than the same handle's built in eager
    # code, and every such handle would recompile the graph that guards on that type.
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(
        torch.compiler.is_dynamo_compiling() or (is_exporting is not None and is_exporting())
    )


def mask_mod_at(mask: object, length: int, device: torch.device, window: object = None) -> MaskMod:
    """The mask_mod a BlockMask carries: the interval form where the mask has one, else
    the general ``lower_at`` (and always on a far ``Window``, whose positions reach past
    int32 bounds)."""
    if window is None:
        mod = interval_mod(mask, length, device)
        if mod is not None:
            return mod
    return mask.lower_at(length, device, window).mask_mod  # type: ignore[attr-defined]
