"""What every piece shares: its content key, per-row data bookkeeping and the row check."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask._validate import check_flag
from flexmask.algebra import Extent, Formula, Leaf, Lowered, MaskModFn, Window, one_range


class Piece(Leaf):
    """A leaf of the mask algebra. Subclasses set ``_key``, ``_rows``, ``_device``, ``_natural``."""

    __slots__ = ("_key", "_rows", "_device", "_natural", "_placed", "_truncate")
    _arg = "the mask's data"
    interval_shape: str | None = None
    """What the piece's ``intervals_at`` promise (``flexmask.builders.closed_form``): None — none;
    "monotone" — one interval per query, monotone; "from_zero" — monotone and starting at
    key 0, possibly empty as ``[0, -1]`` (so ``|``-unions of such pieces are intervals too:
    ``[0, max hi]``); "diagonal" — from zero and reaching at least the query itself
    (causal, full); "around_self" — empty or holding the query, disjoint runs, not monotone
    alone but monotone in a union with a "diagonal" piece (``Mask.attends_around_self``)."""

    def __init__(
        self,
        key: tuple,
        rows: int | None = None,
        device: torch.device | None = None,
        natural: int = 0,
        truncate: bool = False,
    ) -> None:
        self._key = key
        self._rows = rows
        self._device = device
        self._natural = natural
        self._truncate = check_flag(truncate, "truncate")
        self._placed: dict[tuple[str, torch.device], Tensor] = {}

    def _on(self, name: str, device: torch.device) -> Tensor:
        """The piece's tensor ``name`` on ``device``, moved there once (the device seam): a
        build on an accelerator copies each piece's data once, not at every lookup."""
        tensor: Tensor = getattr(self, name)
        device = torch.device(device)
        if tensor.device == device:
            return tensor
        placed = self._placed.get((name, device))
        if placed is None:
            placed = self._placed[(name, device)] = tensor.to(device)
        return placed

    def __getstate__(self) -> dict[str, object]:
        # The copies on devices are a cache of this process: never pickled.
        slots = [n for cls in type(self).__mro__ for n in getattr(cls, "__slots__", ())]
        return {n: getattr(self, n) for n in slots if n != "_placed" and hasattr(self, n)}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._placed = {}

    def has_intervals(self) -> bool:
        return self.interval_shape is not None

    def interval_form(self) -> Formula | None:
        # A piece whose rows are one interval each (``interval_shape``) is its interval
        # form: bounds read from its own ``intervals_at``, the builders' answer.
        return one_range(self) if self.has_intervals() else None

    def has_monotone_intervals(self) -> bool:
        return self.interval_shape not in (None, "around_self")

    def attends_from_zero(self) -> bool:
        return self.interval_shape in ("from_zero", "diagonal")

    def covers_diagonal(self) -> bool:
        return self.interval_shape == "diagonal"

    def attends_around_self(self) -> bool:
        return self.interval_shape == "around_self"

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
    def natural_length(self) -> int:
        return self._natural

    @property
    def data_reach(self) -> int:
        """The position after the last token the piece's data describes (documents' sum, the
        last span's end, a padding length): past the sequence, the data was made for other
        lengths, and the piece raises unless made with ``truncate=True``. 0 for a piece
        whose data holds no positions (a window size, a prefix length: any value means
        something at any length) or checks its own (trees, position tables)."""
        return 0

    def check(self, extent: Extent) -> None:
        reach = self.data_reach
        if reach > extent.length and not getattr(self, "_truncate", False):
            # Data for longer rows than the call's (lengths counted before truncating,
            # (B, S, H, D) tensors read as (B, H, S, D)) would be cut silently.
            name = type(self).__name__.lower()
            raise ValueError(
                f"{name}'s {self._arg} reach position {reach} in some row, past the sequence "
                f"{extent.length_name} = {extent.length}: give {self._arg} made for this "
                f"sequence (attention reads S from dim 2 of (B, H, S, D) tensors), or pass "
                f"{name}(..., truncate=True) to cut them at the sequence end"
            )
        if self._rows is not None and self._rows != extent.batch:
            raise ValueError(
                f"{self._arg} is given for {self._rows} batch rows but B={extent.batch}: pass one "
                f"value per row, or a single value shared by every row"
            )
        if self._device is not None and _device_key(self._device) != _device_key(extent.device):
            raise ValueError(
                f"{self._arg} lives on {self._device} but the mask is built on {extent.device}: "
                f"pass device={str(self._device)!r} or move the input to {extent.device}"
            )


def tracing() -> bool:
    """True under torch.compile or torch.export: the tensors made then are fake or graph
    values, which a later eager call must not read (a piece never keeps them)."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(torch.compiler.is_compiling() or (is_exporting is not None and is_exporting()))


def _device_key(device: torch.device) -> tuple[str, int]:
    device = torch.device(device)
    index = device.index
    if index is None and device.type not in ("cpu", "meta"):
        # "cuda" means the current device: compare it as such, so "cuda" == "cuda:0" there.
        try:
            index = torch.accelerator.current_device_index()
        except (AttributeError, RuntimeError):
            index = 0
    return device.type, index or 0


def window_positions(start: int | Tensor, length: int, device: torch.device) -> Tensor:
    """Whole-mask positions of one side of a ``Window``: ``(1, length)`` int64 from an int
    start, ``(B, length)`` from per-row starts."""
    steps = torch.arange(length, dtype=torch.int64, device=device)
    if isinstance(start, Tensor):
        return start.to(device).view(-1, 1) + steps
    return (steps + start).view(1, -1)


def window_rows(window: Window, rows: int) -> int:
    """Rows of a piece's window lookups: its own (1 when shared), or B where the window's
    starts differ by row."""
    for start in (window.q_start, window.kv_start):
        if isinstance(start, Tensor):
            rows = max(rows, start.numel())
    return rows


def held_start(start: int | Tensor, device: torch.device) -> Tensor:
    """A window side's start as its mask_mod holds it: a 0-d int64 tensor, or ``(B,)`` per
    row — never a Python int, so a new window of the same shape does not recompile."""
    if isinstance(start, Tensor):
        return start.to(device=device, dtype=torch.int64).view(-1)
    return torch.tensor(start, dtype=torch.int64, device=device)


def per_row_view(values: Tensor, per_row: bool) -> Tensor:
    """(R, 1, 1, 1) view of per-row values for block classification."""
    return values.view(-1, 1, 1, 1) if per_row else values.view(1, 1, 1, 1)


class PieceMod(MaskModFn):
    """A piece's mask_mod. Its data is given per batch row (``per_row``: tables indexed by
    ``b`` first) or shared by every row (0-d values, 1-d tables); the two helpers pick, so
    each piece writes its predicate once."""

    __slots__ = ("per_row",)

    def __init__(self, per_row: bool = False) -> None:
        self.per_row = per_row

    def _fields(self) -> list[str]:
        return [f for f in super()._fields() if self.per_row or f != "per_row=False"]

    def _value(self, values: Tensor, b: Tensor) -> Tensor:
        """Row b's value: ``values`` is (R,) per row, 0-d when shared."""
        return values[b] if self.per_row else values

    def _lookup(self, table: Tensor, b: Tensor, idx: Tensor) -> Tensor:
        """Row b's table entry at idx: ``table`` is (R, n) per row, (n,) when shared."""
        return table[b, idx] if self.per_row else table[idx]


class WindowMod(PieceMod):
    """A piece's mask_mod on a ``Window`` (``Mask.lower_at``): its lookups hold one side's
    positions each, from ``q_start`` and ``kv_start`` (0-d, or ``(B,)`` read at ``b``, when
    the lookups are per row too), plus a last entry that attends nowhere. It takes
    whole-mask positions, as the piece's own mask_mod does, but only those of the window."""

    __slots__ = ("q_start", "kv_start")

    def __init__(self, q_start: Tensor, kv_start: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.q_start = q_start
        self.kv_start = kv_start

    def _at(self, table: Tensor, start: Tensor, b: Tensor, idx: Tensor) -> Tensor:
        """Row b's entry of one side's ``table`` at whole-mask position ``idx``: ``idx -
        start``, clamped into the table (past the window, onto its last entry)."""
        local = idx - (start[b] if start.dim() else start)
        return self._lookup(table, b, local.clamp(0, table.shape[-1] - 1))


class SameIdWindowMod(WindowMod):
    """A mask_mod on a window that attends where q and kv hold the same id and q holds one
    (``>= 0``): document's and spans' on a window. ``q_id`` and ``kv_id`` are int32 ids of the
    window's query and key positions (``(R, n + 1)`` per row, ``(n + 1,)`` shared), each with a
    last -1 entry."""

    __slots__ = ("q_id", "kv_id")

    def __init__(
        self, q_id: Tensor, kv_id: Tensor, q_start: Tensor, kv_start: Tensor, per_row: bool
    ) -> None:
        super().__init__(q_start, kv_start, per_row)
        self.q_id = q_id
        self.kv_id = kv_id

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_id = self._at(self.q_id, self.q_start, b, q_idx)
        kv_id = self._at(self.kv_id, self.kv_start, b, kv_idx)
        return (q_id == kv_id) & (q_id >= 0)


def same_id_window(
    piece: Any, window: Window, rows: int, device: torch.device, mod: type[SameIdWindowMod]
) -> Lowered:
    """A same-id piece (document, spans) lowered on ``window``: each side's ids at its own
    positions (``piece._window_ids``), so a window near 2**63 holds O(Q + KV)."""
    rows = window_rows(window, rows)
    q_ids = piece._window_ids(window.q_start, window.q_len, rows, device)
    kv_ids = piece._window_ids(window.kv_start, window.kv_len, rows, device)
    per_row = piece.per_row or rows > 1
    if not per_row:
        q_ids, kv_ids = q_ids[0], kv_ids[0]
    starts = held_start(window.q_start, device), held_start(window.kv_start, device)
    window_mod = mod(q_ids, kv_ids, *starts, per_row)
    return Lowered(window_mod, window_mod)
