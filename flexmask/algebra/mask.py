"""Masks are values: an expression tree of pieces joined by ``&``, ``|`` and ``~``.

The piece protocol — what the builders (``flexmask.builders``) ask of a node, declared here
as ``Mask``'s methods (and ``Leaf.classify_tiles`` for leaves), public within the package:

* ``check(extent)`` — is the node valid for this batch size and sequence extent? (The whole
  expression is checked through ``validate``, once per spec.)
* ``lower_at(length, device, window=None)`` — its ``mask_mod`` with lookups padded to
  ``length`` (or, given a ``Window``, over the window's positions only), plus an evaluator
  the build may call with broadcasting index tensors to refine undecided blocks;
* ``intervals_at(q_idx, row, grid)`` and the shape flags ``has_intervals``,
  ``has_monotone_intervals``, ``attends_from_zero``, ``covers_diagonal``,
  ``attends_around_self``, ``attends_nowhere`` — each query's kv interval, where it has one;
* ``head_parts(heads)`` — for ``per_head``, its distinct masks and their heads;
* for leaves, ``classify_tiles(grid)`` — block codes from structure (``Leaf``).

This module imports nothing from the blocks or builders: ``&``, ``|`` and ``~`` combine block
codes in ``flexmask.builders.classify``.

Equality and hashing come from ``key``: the piece kinds and their data (small data as tuples,
large data as a strong digest of dtype, shape and bytes), never tensor or closure identity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from flexmask._validate import check_device, check_int

if TYPE_CHECKING:  # only for annotations: the build imports this module, not the reverse
    from flexmask.blocks.grid import BlockGrid

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class Lowered(NamedTuple):
    """A node made concrete for one padded length on one device."""

    mask_mod: MaskMod
    """What flex_attention and torch's create_block_mask call (scalar or vmapped indices)."""
    evaluate: MaskMod
    """The same predicate, callable with broadcasting index tensors of any shape."""


class Window(NamedTuple):
    """The positions a windowed build calls its mask_mod at: queries ``[q_start, q_start +
    q_len)`` and keys ``[kv_start, kv_start + kv_len)`` of the whole mask, the starts ints
    or, per batch row, ``(B,)`` int64 tensors.

    Given to ``lower_at`` for a window far from position 0 (``BlockGrid.lookup_window``):
    a piece whose lookups are indexed by position (document, spans, tree) then holds them
    for these positions only — one lookup per side, O(q_len + kv_len) — instead of for
    every position from 0, which for a window near 2**63 would not fit any memory. Its
    mask_mod still takes whole-mask positions (under the window's ``ShiftedMod``)."""

    q_start: int | Tensor
    q_len: int
    kv_start: int | Tensor
    kv_len: int


class MaskModFn:
    """Base of flexmask's mask_mods: a module-level callable object holding its tensors.

    Unlike a closure, it pickles (``pickle``, ``torch.save``, ``copy.deepcopy`` of a BlockMask
    work) and unpickles to a mask_mod that evaluates identically. Compiled ``flex_attention``
    traces ``__call__`` like a function: dynamo guards the class and the held tensors'
    dtypes and shapes, so a new object holding new same-shape tensors does not recompile.
    Equality stays identity: two mask_mods are the same mask only by their Mask's key.
    Subclasses define ``__call__(b, h, q_idx, kv_idx)``, index arithmetic only.
    """

    __slots__ = ()
    _name = "mask_mod"

    @property
    def __name__(self) -> str:  # what torch's BlockMask repr prints
        return self._name

    def _fields(self) -> list[str]:
        classes = reversed(type(self).__mro__)
        names = [n for cls in classes for n in cls.__dict__.get("__slots__", ())]
        return [f"{n}={_describe(getattr(self, n))}" for n in names]

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(self._fields())})"


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        shape = ", ".join(map(str, value.shape))
        return f"{str(value.dtype).removeprefix('torch.')}[{shape}]"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_describe, value)) + ")"
    return repr(value)


class _NaryMod(MaskModFn):
    __slots__ = ("mods",)

    def __init__(self, mods: tuple[MaskMod, ...]) -> None:
        self.mods = tuple(mods)

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(map(repr, self.mods))})"


class AndMod(_NaryMod):
    """``mods[0] & mods[1] & ...``: the mask_mod of an ``&`` node."""

    __slots__ = ()
    _name = "and_masks"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        result = self.mods[0](b, h, q_idx, kv_idx)
        for mod in self.mods[1:]:
            result = result & mod(b, h, q_idx, kv_idx)
        return result


class OrMod(_NaryMod):
    """``mods[0] | mods[1] | ...``: the mask_mod of an ``|`` node."""

    __slots__ = ()
    _name = "or_masks"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        result = self.mods[0](b, h, q_idx, kv_idx)
        for mod in self.mods[1:]:
            result = result | mod(b, h, q_idx, kv_idx)
        return result


def _combined(make: Callable[[tuple[MaskMod, ...]], MaskMod], parts: list[Lowered]) -> Lowered:
    """A node's Lowered from its children's; one object when each child's evaluator is its
    mask_mod (every piece but from_mask_mod)."""
    mask_mod = make(tuple(part.mask_mod for part in parts))
    if all(part.evaluate is part.mask_mod for part in parts):
        return Lowered(mask_mod, mask_mod)
    return Lowered(mask_mod, make(tuple(part.evaluate for part in parts)))


class NotMod(MaskModFn):
    """``~mod``: the mask_mod of a ``~`` node."""

    __slots__ = ("mod",)
    _name = "not_mask"

    def __init__(self, mod: MaskMod) -> None:
        self.mod = mod

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~self.mod(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"{self._name}({self.mod!r})"


class ShiftedMod(MaskModFn):
    """``mod(b, h, q_idx + q_offset, kv_idx + kv_offset)``: the mask_mod of a window of a
    mask (``create_block_mask(..., q_offset=, kv_offset=)``). The offsets are int64 tensors —
    0-d, or ``(B,)`` read at ``b`` when they differ by row — never Python ints, so new
    offsets of the same shape do not recompile a compiled kernel."""

    __slots__ = ("mod", "q_offset", "kv_offset", "per_row")
    _name = "shifted_mask"

    def __init__(self, mod: MaskMod, q_offset: Tensor, kv_offset: Tensor) -> None:
        self.mod = mod
        self.q_offset = q_offset
        self.kv_offset = kv_offset
        self.per_row = q_offset.dim() == 1

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if self.per_row:
            return self.mod(b, h, q_idx + self.q_offset[b], kv_idx + self.kv_offset[b])
        return self.mod(b, h, q_idx + self.q_offset, kv_idx + self.kv_offset)


class Extent(NamedTuple):
    """What a mask validates itself against: the batch size, heads, the furthest position
    any index may take (lookups are padded to it) and the device."""

    batch: int
    heads: int | None
    """None where no head count is given (``mask_mod_for``, ``show``): any head index."""
    length: int
    device: torch.device
    length_name: str = "max(Q_LEN, KV_LEN)"
    """How errors name ``length``: with a window, ``max(q_offset + Q_LEN, kv_offset + KV_LEN)``."""


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

    def check(self, extent: Extent) -> None:  # noqa: B027 - optional hook: no checks by default
        """Raises ValueError if the mask cannot apply to this extent."""

    def validate(self, extent: Extent) -> None:
        """Checks the whole expression against ``extent`` (ValueError if it cannot apply): the
        one entry every build, key and handle validates a mask through, once per spec
        (``flexmask.runtime.spec``); each node's own check is its ``check``."""
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

    def has_intervals(self) -> bool:
        """True if ``intervals_at`` describes this mask (every row one kv interval)."""
        return False

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> Intervals | None:
        """Each query's attended kv as one interval, if the mask has that shape (else None).

        Args:
            q_idx: (k, n) int64 query positions, each below ``grid.q_len``.
            row: (k, 1) int64 batch row of each line of ``q_idx`` (0 when not per row).
        """
        return None

    def has_monotone_intervals(self) -> bool:
        """True if ``intervals_at`` are monotone in the sense of ``flexmask.builders.closed_form``:
        on a prefix of the positions ``lo`` never decreases and ``lo(q) <= q``, ``hi`` never
        decreases and is ``>= q`` or constant; past the prefix, empty. The builder then
        writes the BlockMask in closed form from the intervals of the block edges."""
        return False

    def attends_nowhere(self) -> bool:
        """True if no query attends any key (``empty()``): a union drops it."""
        return False

    def attends_from_zero(self) -> bool:
        """True if every query attends one non-empty kv interval starting at 0 (causal,
        prefix, full): a union of such intervals is again one, ``[0, max hi]``."""
        return False

    def covers_diagonal(self) -> bool:
        """True if, besides ``attends_from_zero``, every query ``q`` attends at least up to
        itself (``hi >= q``: causal, full): a union with ``attends_around_self`` intervals is
        then one interval too."""
        return False

    def attends_around_self(self) -> bool:
        """True if each query's interval is empty or holds the query itself, ``lo <= q <=
        hi``, and the intervals are disjoint runs: an interval holding a later query ``p``
        is ``p``'s own too (spans). Not monotone alone; see ``Or`` for the union with
        ``covers_diagonal`` masks."""
        return False

    def head_parts(self, heads: int) -> tuple[tuple[Mask, ...], list[Tensor]] | None:
        """For a mask that is one of several masks on each head (``per_head``): the distinct
        masks and, for each, the heads (of ``heads``) that use it; the build then builds each
        once. None for every other mask."""
        return None

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
        return self.lower_at(extent.length, extent.device).mask_mod

    def to_dense(
        self,
        B: int | None = None,
        H: int | None = None,
        Q_LEN: int = 1,
        KV_LEN: int = 1,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """The boolean ``(B, H, Q_LEN, KV_LEN)`` mask, for debugging and tests (O(Q·KV) memory).

        Exactly what the mask means: a query that attends nothing is a row of False. The
        SDPA backend's dense mask of its BlockMask is the same tensor; attention over such a
        row gives 0 and zero gradients (the one rule: ``flexmask.algebra.dense``).

        Example:
            >>> import flexmask
            >>> flexmask.sliding_window(2).to_dense(1, 1, 3, 3)[0, 0].int().tolist()
            [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
        """
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


class Leaf(Mask):
    """A leaf of the algebra (every piece): it classifies its own tiles from its data."""

    __slots__ = ()

    settles_every_tile: bool = False
    """Whether ``classify_tiles`` never returns UNDECIDED (a tree decides every tile from its
    structure), so the builder need not look for undecided tiles."""

    @abstractmethod
    def classify_tiles(self, grid: BlockGrid) -> Tensor:
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

    def __repr__(self) -> str:
        return "(" + f" {self._symbol} ".join(repr(c) for c in self.children) + ")"

    _symbol = ""


class And(_Nary):
    """Intersection: attends where every child attends."""

    __slots__ = ()
    _name = "and"
    _symbol = "&"

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        return _combined(AndMod, [c.lower_at(length, device, window) for c in self.children])

    def has_intervals(self) -> bool:
        return all(c.has_intervals() for c in self.children)

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> Intervals | None:
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
        return _combined(OrMod, [c.lower_at(length, device, window) for c in self.children])

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

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: BlockGrid) -> Intervals | None:
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

    def __repr__(self) -> str:
        return f"~{self.child!r}"
