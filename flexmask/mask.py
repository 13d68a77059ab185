"""Masks are values: an expression tree of pieces joined by ``&``, ``|`` and ``~``.

Every node knows three things, and the builder only ever asks for these:

* ``_check(grid)`` — is the node valid for these lengths and this batch size?
* ``_classify(grid)`` — block codes (EMPTY / PARTIAL / FULL / UNDECIDED) from structure.
* ``_lower(length, device)`` — its ``mask_mod`` with lookups padded to ``length``, plus an
  evaluator the builder may call with broadcasting index tensors to refine undecided blocks.

Equality and hashing come from ``key``: the piece kinds and their data (small data as tuples,
large data as a strong digest of dtype, shape and bytes), never tensor or closure identity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from flexmask.blocks import UNDECIDED, BlockGrid, and_codes, not_codes, or_codes

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class Lowered(NamedTuple):
    """A node made concrete for one padded length on one device."""

    mask_mod: MaskMod
    """What flex_attention and torch's create_block_mask call (scalar or vmapped indices)."""
    evaluate: MaskMod
    """The same predicate, callable with broadcasting index tensors of any shape."""


class Intervals(NamedTuple):
    """For given query positions, the one kv interval ``[lo, hi]`` each attends (empty when
    lo > hi).

    Pieces whose rows are single intervals (causal, document, sliding window, prefix,
    padding) expose them; an ``&`` of such pieces is their intersection. The builder asks for
    them only at the queries of undecided tiles, and refines those tiles in O(q_block) per
    tile instead of O(q_block * kv_block).
    """

    lo: Tensor
    """First kv attended by each queried position (broadcasts against the query tensor)."""
    hi: Tensor
    """Last kv attended by each queried position."""


class Mask(ABC):
    """Base of every mask expression. Build masks with the piece functions and operators.

    Example:
        >>> import flexmask
        >>> m = flexmask.causal() & flexmask.document([3, 2])
        >>> print(m.show(5))
        ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ⬚ ■ ⬚
        ⬚ ⬚ ⬚ ■ ■
        >>> m == flexmask.document([3, 2]) & flexmask.causal()
        True
    """

    __slots__ = ()

    # ----------------------------------------------------------------- what each node owns
    @property
    @abstractmethod
    def key(self) -> tuple:
        """Content key: equal keys mean equal masks, on every length and batch."""

    @property
    def rows(self) -> int | None:
        """Number of batch rows this mask's data is given for, or None if shared by all rows."""
        return None

    @property
    def batch_dependent(self) -> bool:
        """True if the mask may differ between batch rows (built per row, else broadcast)."""
        return self.rows is not None

    @property
    def head_dependent(self) -> bool:
        """True if the mask may differ between heads (only custom leaves can)."""
        return False

    @property
    def natural_length(self) -> int:
        """The longest sequence the mask's data describes (0 when it has no data)."""
        return 0

    @property
    def carries_batch_data(self) -> bool:
        """True if the mask holds per-batch data (documents, a tree, padding lengths).

        Such masks rarely recur, so a released lazy handle evicts them from the cache;
        static masks (causal, a fixed window) stay cached to be hit next step.
        """
        return False

    @property
    def device(self) -> torch.device | None:
        """Device of the tensors the mask was made from, if any."""
        return None

    def _check(self, grid: BlockGrid) -> None:  # noqa: B027 - optional hook: no checks by default
        """Raises ValueError if the mask cannot apply to this grid."""

    @abstractmethod
    def _classify(self, grid: BlockGrid) -> Tensor:
        """Block codes from structure, broadcastable to (rows, heads, nq, nkv)."""

    @abstractmethod
    def _lower(self, length: int, device: torch.device) -> Lowered:
        """The mask_mod and evaluator with lookups padded to ``length``."""

    def _has_intervals(self) -> bool:
        """True if ``_intervals`` describes this mask (every row one kv interval)."""
        return False

    def _intervals(self, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> Intervals | None:
        """Each query's attended kv as one interval, if the mask has that shape (else None).

        Args:
            q_idx: (k, n) int64 query positions, each below ``grid.q_len``.
            row: (k, 1) int64 batch row of each line of ``q_idx`` (0 when not per row).
        """
        return None

    def _has_monotone_intervals(self) -> bool:
        """True if ``_intervals`` are monotone in the sense of ``flexmask.ranges``: on a
        prefix of the positions ``lo`` never decreases and ``lo(q) <= q``, ``hi`` never
        decreases and is ``>= q`` or constant; past the prefix, empty. The builder then
        writes the BlockMask in closed form from the intervals of the block edges."""
        return False

    def _attends_from_zero(self) -> bool:
        """True if every query attends one non-empty kv interval starting at 0 (causal,
        prefix, full): a union of such intervals is again one, ``[0, max hi]``."""
        return False

    def __and__(self, other: object) -> Mask:
        return And.of(self, _as_mask(other, "&"))

    def __or__(self, other: object) -> Mask:
        return Or.of(self, _as_mask(other, "|"))

    def __invert__(self) -> Mask:
        return self.child if isinstance(self, Not) else Not(self)

    def __rand__(self, other: object) -> Mask:
        return And.of(_as_mask(other, "&"), self)

    def __ror__(self, other: object) -> Mask:
        return Or.of(_as_mask(other, "|"), self)

    def __bool__(self) -> bool:
        raise TypeError(
            "a flexmask Mask has no truth value. Incorrect: `a and b`, `a or b`, `not a`, "
            "`if mask:`. Correct: `a & b`, `a | b`, `~a`."
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mask):
            return NotImplemented
        return self.key == other.key

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __hash__(self) -> int:
        return hash(self.key)

    # ----------------------------------------------------------------- public helpers
    @property
    def mask_mod(self) -> MaskMod:
        """A plain ``(b, h, q_idx, kv_idx) -> bool`` mask_mod for torch.

        Works with torch's ``create_block_mask``/``create_mask``, ``torch.vmap`` and
        ``torch.compile(flex_attention)`` at any length: indices past the mask's own data
        (a document's or tree's end) are clamped onto a sentinel entry that attends nowhere.
        For compiled training prefer ``mask_mod_for(q_len, kv_len)`` (what the builder puts
        in its BlockMask): its lookups are sized by the sequence length, so new batch
        content of the same length never recompiles.

        Example:
            >>> import flexmask, torch
            >>> from torch.nn.attention.flex_attention import create_block_mask
            >>> bm = create_block_mask(flexmask.causal().mask_mod, 1, 1, 256, 256, device="cpu")
            >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
            ([[[1, 1]]], [[[0, 1]]])
        """
        device = self.device or torch.device("cpu")
        return self._lower(max(self.natural_length, 1), device).mask_mod

    def mask_mod_for(self, q_len: int, kv_len: int, device: torch.device | str | None = None):
        """The mask_mod with every lookup padded to ``max(q_len, kv_len)``, after validation.

        Example:
            >>> import flexmask
            >>> mod = flexmask.document([2, 3]).mask_mod_for(8, 8)
            >>> import torch
            >>> bool(mod(torch.tensor(0), torch.tensor(0), torch.tensor(4), torch.tensor(2)))
            True
        """
        from flexmask.builder import make_grid

        grid = make_grid(self, None, None, q_len, kv_len, device, (128, 128))
        return self._lower(grid.length, grid.device).mask_mod

    def to_dense(
        self,
        B: int | None = None,
        H: int | None = None,
        Q_LEN: int = 1,
        KV_LEN: int = 1,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """The boolean ``(B, H, Q_LEN, KV_LEN)`` mask, for debugging and tests (O(Q·KV) memory).

        Example:
            >>> import flexmask
            >>> flexmask.sliding_window(2).to_dense(1, 1, 3, 3)[0, 0].int().tolist()
            [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
        """
        from flexmask.builder import make_grid

        grid = make_grid(self, B, H, Q_LEN, KV_LEN, device, (128, 128))
        evaluate = self._lower(grid.length, grid.device).evaluate
        dev = grid.device
        rows = grid.batch if self.batch_dependent else 1
        heads = grid.heads if self.head_dependent else 1
        b = torch.arange(rows, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
        q = torch.arange(Q_LEN, device=dev).view(1, 1, -1, 1)
        kv = torch.arange(KV_LEN, device=dev).view(1, 1, 1, -1)
        dense = evaluate(b, h, q, kv).expand(rows, heads, Q_LEN, KV_LEN)
        return dense.expand(grid.batch, grid.heads, Q_LEN, KV_LEN).contiguous()

    def show(
        self, q_len: int | None = None, kv_len: int | None = None, *, batch: int = 0, head: int = 0
    ) -> str:
        """A text picture: ■ where q (row) attends kv (column), ⬚ where it does not.

        Args:
            q_len: rows to draw. None: the mask's own length (the sum of its document
                lengths, its tree size...), at least 8 and at most 32 — a crop of longer
                masks; pass a length to see more.
            kv_len: columns to draw (None: ``q_len``).
            batch, head: which row and head of per-row or per-head masks.

        Example:
            >>> import flexmask
            >>> print(flexmask.causal().show(3))
            ■ ⬚ ⬚
            ■ ■ ⬚
            ■ ■ ■
            >>> len(flexmask.causal().show().splitlines())  # 8 rows by default
            8
        """
        from flexmask._validate import check_int
        from flexmask.builder import make_grid

        if q_len is None:
            q_len = min(max(self.natural_length, 8), 32)
        q_len = check_int(q_len, "q_len", minimum=1)
        kv_len = q_len if kv_len is None else check_int(kv_len, "kv_len", minimum=1)
        rows = self.rows or 1
        if not 0 <= batch < rows:
            raise ValueError(f"batch must be in [0, {rows}) for this mask, got {batch}")
        if head < 0:
            raise ValueError(f"head must be >= 0, got {head}")
        # A window shorter than the mask's data is a crop of the whole picture: validate and
        # pad lookups for the whole span, but evaluate only the q_len x kv_len window.
        span = max(q_len, kv_len, self.natural_length)
        grid = make_grid(self, rows, head + 1, span, span, "cpu", (128, 128))
        evaluate = self._lower(grid.length, grid.device).evaluate
        b = torch.tensor(batch if self.batch_dependent else 0).view(1, 1)
        h = torch.tensor(head if self.head_dependent else 0).view(1, 1)
        q = torch.arange(q_len).view(-1, 1)
        kv = torch.arange(kv_len).view(1, -1)
        dense = evaluate(b, h, q, kv).expand(q_len, kv_len)
        return "\n".join(" ".join("■" if x else "⬚" for x in row) for row in dense.tolist())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _as_mask(other: object, op: str) -> Mask:
    if isinstance(other, Mask):
        return other
    raise TypeError(
        f"`{op}` combines two flexmask masks, got {type(other).__name__}. Wrap a plain "
        f"mask_mod first: flexmask.from_mask_mod(fn, key=...)"
    )


def common_rows(children: tuple[Mask, ...]) -> int | None:
    """The shared per-row count of children, or a ValueError if two disagree."""
    rows = None
    for child in children:
        if child.rows is None:
            continue
        if rows is not None and child.rows != rows:
            raise ValueError(
                f"cannot combine masks given for {rows} and {child.rows} batch rows: "
                f"per-row data must have one entry per row of the same batch"
            )
        rows = child.rows
    return rows


def common_device(children: tuple[Mask, ...]) -> torch.device | None:
    device = None
    for child in children:
        if child.device is None:
            continue
        if device is not None and child.device != device:
            raise ValueError(
                f"cannot combine masks made from tensors on {device} and {child.device}: "
                f"move the inputs to one device"
            )
        device = child.device
    return device


class _Nary(Mask):
    """Shared by And/Or: a flat, validated tuple of children."""

    __slots__ = ("children", "_key", "_rows", "_device")
    _name = ""

    def __init__(self, children: tuple[Mask, ...]) -> None:
        self.children = children
        self._rows = common_rows(children)
        self._device = common_device(children)
        # Sorted so that `a & b == b & a`; repr makes keys of any piece comparable.
        self._key = (self._name, tuple(sorted((c.key for c in children), key=repr)))

    @classmethod
    def of(cls, *masks: Mask) -> Mask:
        flat: list[Mask] = []
        for m in masks:
            flat.extend(m.children if type(m) is cls else (m,))
        return cls(tuple(flat))

    @property
    def key(self) -> tuple:
        return self._key

    @property
    def rows(self) -> int | None:
        return self._rows

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def batch_dependent(self) -> bool:
        return any(c.batch_dependent for c in self.children)

    @property
    def head_dependent(self) -> bool:
        return any(c.head_dependent for c in self.children)

    @property
    def natural_length(self) -> int:
        return max(c.natural_length for c in self.children)

    @property
    def carries_batch_data(self) -> bool:
        return any(c.carries_batch_data for c in self.children)

    def _check(self, grid: BlockGrid) -> None:
        for child in self.children:
            child._check(grid)

    def __repr__(self) -> str:
        return "(" + f" {self._symbol} ".join(repr(c) for c in self.children) + ")"

    _symbol = ""


class And(_Nary):
    """Intersection: attends where every child attends."""

    __slots__ = ()
    _name = "and"
    _symbol = "&"

    def _classify(self, grid: BlockGrid) -> Tensor:
        codes = self.children[0]._classify(grid)
        for child in self.children[1:]:
            codes = and_codes(codes, child._classify(grid))
        # Two partial tiles met. If every child is an interval per query, their intersection
        # settles those tiles here, so an expression above (an `|`, a `~`) sees exact codes.
        if int(codes.max()) == UNDECIDED and self._has_intervals():
            from flexmask.refine import refine_by_intervals

            rows = grid.batch if self.batch_dependent else 1
            codes = codes.expand(rows, *codes.shape[1:]).contiguous()
            tiles = (codes == UNDECIDED).nonzero()
            refine_by_intervals(codes, tiles, self, grid)
        return codes

    def _lower(self, length: int, device: torch.device) -> Lowered:
        lowered = [c._lower(length, device) for c in self.children]
        mods = tuple(low.mask_mod for low in lowered)
        evals = tuple(low.evaluate for low in lowered)

        def and_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            result = mods[0](b, h, q_idx, kv_idx)
            for mod in mods[1:]:
                result = result & mod(b, h, q_idx, kv_idx)
            return result

        def and_eval(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            result = evals[0](b, h, q_idx, kv_idx)
            for ev in evals[1:]:
                result = result & ev(b, h, q_idx, kv_idx)
            return result

        return Lowered(and_mask, and_eval)

    def _has_intervals(self) -> bool:
        return all(c._has_intervals() for c in self.children)

    def _intervals(self, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> Intervals | None:
        parts = []
        for child in self.children:
            part = child._intervals(q_idx, row, grid)
            if part is None:
                return None
            parts.append(part)
        return _intersect(parts)

    def _has_monotone_intervals(self) -> bool:
        # The properties of each child carry over to their intersection (flexmask.ranges).
        return all(c._has_monotone_intervals() for c in self.children)


def _intersect(parts: list[Intervals]) -> Intervals:
    lo, hi = parts[0]
    for part in parts[1:]:
        lo, hi = torch.maximum(lo, part.lo), torch.minimum(hi, part.hi)
    return Intervals(lo, hi)


class Or(_Nary):
    """Union: attends where any child attends."""

    __slots__ = ()
    _name = "or"
    _symbol = "|"

    def _classify(self, grid: BlockGrid) -> Tensor:
        codes = self.children[0]._classify(grid)
        for child in self.children[1:]:
            codes = or_codes(codes, child._classify(grid))
        return codes

    def _lower(self, length: int, device: torch.device) -> Lowered:
        lowered = [c._lower(length, device) for c in self.children]
        mods = tuple(low.mask_mod for low in lowered)
        evals = tuple(low.evaluate for low in lowered)

        def or_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            result = mods[0](b, h, q_idx, kv_idx)
            for mod in mods[1:]:
                result = result | mod(b, h, q_idx, kv_idx)
            return result

        def or_eval(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            result = evals[0](b, h, q_idx, kv_idx)
            for ev in evals[1:]:
                result = result | ev(b, h, q_idx, kv_idx)
            return result

        return Lowered(or_mask, or_eval)

    # A union of intervals that all start at 0 is the interval up to the largest end: a
    # prefix-LM, `causal() | prefix(n)`, is [0, max(q, n - 1)]. Its lo is 0 and its hi a max
    # of ends that never decrease and are >= q or constant, so it is monotone too.
    def _attends_from_zero(self) -> bool:
        return all(c._attends_from_zero() for c in self.children)

    def _has_intervals(self) -> bool:
        return self._attends_from_zero()

    def _has_monotone_intervals(self) -> bool:
        return self._attends_from_zero()

    def _intervals(self, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> Intervals | None:
        if not self._attends_from_zero():
            return None
        parts = [child._intervals(q_idx, row, grid) for child in self.children]
        lo, hi = parts[0]  # type: ignore[misc]
        for part in parts[1:]:
            lo, hi = torch.minimum(lo, part.lo), torch.maximum(hi, part.hi)  # type: ignore[union-attr]
        return Intervals(lo, hi)


class Not(Mask):
    """Complement: attends where the child does not (within the sequence lengths)."""

    __slots__ = ("child",)

    def __init__(self, child: Mask) -> None:
        self.child = child

    @property
    def key(self) -> tuple:
        return ("not", self.child.key)

    @property
    def rows(self) -> int | None:
        return self.child.rows

    @property
    def device(self) -> torch.device | None:
        return self.child.device

    @property
    def batch_dependent(self) -> bool:
        return self.child.batch_dependent

    @property
    def head_dependent(self) -> bool:
        return self.child.head_dependent

    @property
    def natural_length(self) -> int:
        return self.child.natural_length

    @property
    def carries_batch_data(self) -> bool:
        return self.child.carries_batch_data

    def _check(self, grid: BlockGrid) -> None:
        self.child._check(grid)

    def _classify(self, grid: BlockGrid) -> Tensor:
        return not_codes(self.child._classify(grid))

    def _lower(self, length: int, device: torch.device) -> Lowered:
        inner = self.child._lower(length, device)
        mod, ev = inner.mask_mod, inner.evaluate

        def not_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return ~mod(b, h, q_idx, kv_idx)

        def not_eval(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return ~ev(b, h, q_idx, kv_idx)

        return Lowered(not_mask, not_eval)

    def __repr__(self) -> str:
        return f"~{self.child!r}"
