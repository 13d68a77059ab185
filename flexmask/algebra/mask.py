"""Masks are values: an expression tree of pieces joined by ``&``, ``|`` and ``~``.

``Mask`` is the base of every node: its content key, validation, operators and pictures
(``to_dense``, ``show``). ``And``, ``Or`` and ``Not`` are the operators' nodes; ``Leaf``
(every piece) and ``Composite`` (a node made of other masks) the two kinds of the rest.
What the builders and the lowerings ask of a node — the piece protocol — is declared in
``flexmask.algebra.protocol`` (``Node``, which ``Mask`` subclasses); the mask_mods a node
lowers to are in ``flexmask.algebra.mods``. Both are re-exported here.

This package imports nothing from the blocks or builders: ``&``, ``|`` and ``~`` combine
block codes in ``flexmask.builders.classify``.

Equality and hashing come from ``key``: the piece kinds and their data (small data as tuples,
large data as a strong digest of dtype, shape and bytes), never tensor or closure identity.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_device, check_int, dense_lengths
from flexmask.algebra.combine import common_device, common_rows
from flexmask.algebra.interval_mods import Formula, all_of, any_of, mask_mod_at, negated
from flexmask.algebra.lines import VarlenPart, cannot_lower
from flexmask.algebra.mods import (
    AndMod,
    Lowered,
    MaskMod,
    MaskModFn,
    NotMod,
    OrMod,
    ShiftedMod,
    combined,
)
from flexmask.algebra.protocol import Extent, Intervals, Node, TileGrid, Window

__all__ = [
    "And",
    "Composite",
    "Extent",
    "Intervals",
    "Leaf",
    "Lowered",
    "Mask",
    "MaskMod",
    "MaskModFn",
    "Not",
    "Or",
    "ShiftedMod",
    "Window",
]


class Mask(Node, ABC):
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

    def check(self, extent: Extent) -> None:  # noqa: B027 - optional hook: no checks by default
        """Raises ValueError if the mask cannot apply to this extent."""

    def validate(self, extent: Extent) -> None:
        """Checks the whole expression against ``extent`` (ValueError if it cannot apply): the
        one entry every build, key and handle validates a mask through, once per spec
        (``flexmask.builders.spec``); each node's own check is its ``check``."""
        self.check(extent)

    def _extent(
        self, B: Any, H: Any, q_len: Any, kv_len: Any, device: Any, *, names=("Q_LEN", "KV_LEN")
    ) -> Extent:
        """Validated arguments of a whole-mask evaluation (``to_dense``, ``show``), checked
        against the mask. Arithmetic on ints only: nothing is allocated on ``device``."""
        batch = (self.rows or 1) if B is None else check_int(B, "B", minimum=1)
        heads = None if H is None else check_int(H, "H", minimum=1)
        q = check_int(q_len, names[0], minimum=0)
        kv = check_int(kv_len, names[1], minimum=0)
        extent = Extent(batch, heads, max(q, kv), check_device(device, self.device))
        self.validate(extent)
        return extent

    @abstractmethod
    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        """The mask_mod and evaluator with lookups padded to ``length``; with a ``window``,
        valid only at the window's positions (lookups over those alone)."""

    # ----------------------------------------------------------------- heads
    def head_parts(self, heads: int) -> tuple[tuple[Mask, ...], list[Tensor]] | None:
        """For a mask that is one of several masks on each head (``per_head``): the distinct
        masks and, for each, the heads (of ``heads``) that use it; the build then builds each
        once. None for every other mask."""
        return None

    def at_head(self, head: int) -> Mask:
        """The mask head ``head`` attends with: itself, but for ``per_head`` (its mask of
        that head) and the nodes that hold one (``head_cycle`` > 1)."""
        return self

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
        return self.lower_at(max(self.natural_length, 1), device).mask_mod

    def mask_mod_for(self, q_len: int, kv_len: int, device: torch.device | str | None = None):
        """The mask_mod with every lookup padded to ``max(q_len, kv_len)``, after validation.

        Example:
            >>> import flexmask
            >>> mod = flexmask.document([2, 3]).mask_mod_for(8, 8)
            >>> import torch
            >>> bool(mod(torch.tensor(0), torch.tensor(0), torch.tensor(4), torch.tensor(2)))
            True
        """
        extent = self._extent(None, None, q_len, kv_len, device, names=("q_len", "kv_len"))
        return mask_mod_at(self, extent.length, extent.device)

    def to_dense(
        self,
        B: int | None = None,
        H: int | None = None,
        Q_LEN: int | None = None,
        KV_LEN: int | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """The boolean ``(B, H, Q_LEN, KV_LEN)`` mask, for debugging and tests (O(Q·KV) memory).

        Exactly what the mask means: a query that attends nothing is a row of False. The
        SDPA backend's dense mask of its BlockMask is the same tensor; attention over such a
        row gives 0 and zero gradients (the one rule: ``flexmask.algebra.dense``).

        The shape is in torch's order (``KV_LEN`` None: ``Q_LEN``; ``dense_lengths``).

        Example:
            >>> import flexmask
            >>> flexmask.sliding_window(2).to_dense(1, 1, 3, 3)[0, 0].int().tolist()
            [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
        """
        Q_LEN, KV_LEN = dense_lengths(B, H, Q_LEN, KV_LEN)
        grid = self._extent(B, H, Q_LEN, KV_LEN, device)
        evaluate = self.lower_at(grid.length, grid.device).evaluate
        dev = grid.device
        rows = grid.batch if self.batch_dependent else 1
        all_heads = grid.heads or 1
        heads = all_heads if self.head_dependent else 1
        b = torch.arange(rows, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
        q = torch.arange(Q_LEN, device=dev).view(1, 1, -1, 1)
        kv = torch.arange(KV_LEN, device=dev).view(1, 1, 1, -1)
        dense = evaluate(b, h, q, kv).expand(rows, heads, Q_LEN, KV_LEN)
        return dense.expand(grid.batch, all_heads, Q_LEN, KV_LEN).contiguous()

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
        extent = self._extent(rows, None, span, span, "cpu", names=("q_len", "kv_len"))
        evaluate = self.lower_at(extent.length, extent.device).evaluate
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


class Leaf(Mask):
    """A leaf of the algebra (every piece): it classifies its own tiles from its data."""

    __slots__ = ()

    settles_every_tile: bool = False
    """Whether ``classify_tiles`` never returns UNDECIDED (a tree decides every tile from its
    structure), so the builder need not look for undecided tiles."""

    @abstractmethod
    def classify_tiles(self, grid: TileGrid) -> Tensor:
        """(R, H, nq, nkv) block codes of ``grid``'s tiles, EMPTY / PARTIAL / FULL (UNDECIDED
        where the piece cannot tell), broadcastable: R and H 1 where it ignores them."""


class Composite(Mask):
    """A mask made of other masks (``&``, ``|``, ``per_head``): its key is given, its rows
    and device are its parts' (validated to agree), and what depends on the data — rows,
    heads, length, validation — is any of its parts'."""

    __slots__ = ("_parts", "_key", "_rows", "_device")

    def _set_parts(self, parts: tuple[Mask, ...], key: tuple) -> None:
        self._parts = parts
        self._key = key
        self._rows = common_rows(parts)
        self._device = common_device(parts)

    @property
    def parts(self) -> tuple[Mask, ...]:
        """The masks this one is made of (each distinct one once)."""
        return self._parts

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
        return any(c.batch_dependent for c in self.parts)

    @property
    def head_dependent(self) -> bool:
        return any(c.head_dependent for c in self.parts)

    @property
    def natural_length(self) -> int:
        return max(c.natural_length for c in self.parts)

    @property
    def carries_batch_data(self) -> bool:
        return any(c.carries_batch_data for c in self.parts)

    def check(self, extent: Extent) -> None:
        for part in self.parts:
            part.check(extent)


class _Nary(Composite):
    """Shared by And/Or: a flat, validated tuple of children."""

    __slots__ = ("children",)
    _name = ""

    def __init__(self, children: tuple[Mask, ...]) -> None:
        self.children = children
        # Sorted so that `a & b == b & a`; repr makes keys of any piece comparable.
        self._set_parts(children, (self._name, tuple(sorted((c.key for c in children), key=repr))))

    @classmethod
    def of(cls, *masks: Mask) -> Mask:
        flat: list[Mask] = []
        for m in masks:
            flat.extend(m.children if type(m) is cls else (m,))
        return cls(tuple(flat))

    @property
    def head_cycle(self) -> int:
        return math.lcm(*(c.head_cycle for c in self.children))

    def at_head(self, head: int) -> Mask:
        return type(self).of(*(c.at_head(head) for c in self.children))

    def __repr__(self) -> str:
        return "(" + f" {self._symbol} ".join(repr(c) for c in self.children) + ")"

    _symbol = ""


class And(_Nary):
    """Intersection: attends where every child attends."""

    __slots__ = ()
    _name = "and"
    _symbol = "&"

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        return combined(AndMod, [c.lower_at(length, device, window) for c in self.children])

    def has_intervals(self) -> bool:
        return all(c.has_intervals() for c in self.children)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals | None:
        parts = []
        for child in self.children:
            part = child.intervals_at(q_idx, row, grid)
            if part is None:
                return None
            parts.append(part)
        return _intersect(parts)

    def has_monotone_intervals(self) -> bool:
        # Each child's properties carry over to their intersection (build.closed_form).
        return all(c.has_monotone_intervals() for c in self.children)

    def interval_form(self) -> Formula | None:
        return all_of([c.interval_form() for c in self.children])


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

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        return combined(OrMod, [c.lower_at(length, device, window) for c in self.children])

    # A union of intervals that all start at 0 is the interval up to the largest end: a
    # prefix-LM, `causal() | prefix(n)`, is [0, max(q, n - 1)]. Its lo is 0 and its hi a max
    # of ends that never decrease and are >= q or constant, so it is monotone too.
    #
    # Around-self intervals (spans) join such a union when a child covers the diagonal
    # (causal, full): text with images, `causal() | spans(ids)`. Proof that the union is one
    # monotone interval [0, H(q)], H(q) = max(q, hi_1(q), ..., hi_n(q)) (hi = -inf where a
    # child's interval is empty):
    # * one interval: an around-self [lo, hi] has lo <= q, and the covering child attends
    #   [0, >= q]; they overlap at q, so the union of all is [0, max hi] (after clipping to
    #   the kv window a covering full() is [0, kv_end - 1], which holds every other interval);
    # * lo = 0 never decreases and lo(q) = 0 <= q; H(q) >= q;
    # * H never decreases: each g(q) = max(q, hi(q)) does. For q < p, if hi(q) <= p then
    #   g(q) <= p <= g(p); else q's interval holds p (it holds q, ends past p, and is one
    #   run), so it is p's own interval (disjoint runs) and hi(p) = hi(q). From-zero
    #   children's hi never decrease already, and a max of non-decreasing functions does not
    #   decrease. These are the closed form's conditions (build.closed_form), so the union
    #   is written there; an `&` with document(...) stays monotone (an intersection).
    def attends_from_zero(self) -> bool:
        children = self.children
        if all(c.attends_from_zero() for c in children):
            return True
        return any(c.covers_diagonal() for c in children) and all(
            c.attends_from_zero() or c.attends_around_self() for c in children
        )

    def covers_diagonal(self) -> bool:
        return self.attends_from_zero() and any(c.covers_diagonal() for c in self.children)

    def has_intervals(self) -> bool:
        return self.attends_from_zero()

    def has_monotone_intervals(self) -> bool:
        return self.attends_from_zero()

    def varlen_part(self, length: int) -> VarlenPart:
        raise cannot_lower(self, "varlen", "a union (|) " + _NOT_VARLEN)

    def interval_form(self) -> Formula | None:
        return any_of([c.interval_form() for c in self.children])

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals | None:
        if not self.attends_from_zero():
            return None
        parts = [child.intervals_at(q_idx, row, grid) for child in self.children]
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

    def check(self, extent: Extent) -> None:
        self.child.check(extent)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        inner = self.child.lower_at(length, device, window)
        mask_mod = NotMod(inner.mask_mod)
        if inner.evaluate is inner.mask_mod:
            return Lowered(mask_mod, mask_mod)
        return Lowered(mask_mod, NotMod(inner.evaluate))

    @property
    def head_cycle(self) -> int:
        return self.child.head_cycle

    def at_head(self, head: int) -> Mask:
        return ~self.child.at_head(head)

    def varlen_part(self, length: int) -> VarlenPart:
        raise cannot_lower(self, "varlen", "a complement (~) " + _NOT_VARLEN)

    def interval_form(self) -> Formula | None:
        return negated(self.child.interval_form())

    def __repr__(self) -> str:
        return f"~{self.child!r}"


_NOT_VARLEN = (
    "is not one causal or bidirectional block per sequence; varlen takes an & of causal(), "
    "sliding_window(), document(), chunked() and padding() (use to_magi or to_flashmask for "
    "other masks)"
)
