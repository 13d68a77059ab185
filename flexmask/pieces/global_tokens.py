"""Global tokens (Longformer): they attend every key, and every query attends them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmask._validate import digest, int_vector, is_nested, source_device
from flexmask.algebra import (
    INF,
    UNUSED,
    Extent,
    LineIntervals,
    Lowered,
    TileGrid,
    VarlenPart,
    Window,
    cannot_lower,
)
from flexmask.blocks import codes_from
from flexmask.pieces._base import Piece, PieceMod


class GlobalTokens(Piece):
    """``is_global[b, q_idx] or is_global[b, kv_idx]``; positions past the data are not global.

    ::

        is_global=[1, 0, 0, 1, 0]:  ■ ■ ■ ■ ■
                                    ■ ⬚ ⬚ ■ ⬚
                                    ■ ⬚ ⬚ ■ ⬚
                                    ■ ■ ■ ■ ■
                                    ■ ⬚ ⬚ ■ ⬚
    """

    __slots__ = ("per_row", "_flags", "_counts", "_starts", "_ends", "_reach")
    _arg = "is_global"

    def __init__(self, is_global: Any, truncate: bool = False) -> None:
        per_row = is_nested(is_global)
        rows_in = list(is_global) if per_row else [is_global]
        flags = [
            _flag_vector(row, f"is_global[{i}]" if per_row else "is_global")
            for i, row in enumerate(rows_in)
        ]
        width = max(f.numel() for f in flags)
        self.per_row = per_row
        # (R, n + 1) bool, rows padded with False, and one False column past the data: every
        # position at or past it reads "not global".
        self._flags = torch.zeros(len(flags), width + 1, dtype=torch.bool)
        for i, f in enumerate(flags):
            self._flags[i, : f.numel()] = f
        # Prefix counts of global tokens, (R, n + 1): a block's count is two lookups.
        self._counts = torch.nn.functional.pad(self._flags[:, :width].cumsum(1), (1, 0))
        # Runs of global tokens per row, (R, max runs), padded with empty runs past every
        # position: the intervals a non-global line attends (``lines_at``).
        self._starts, self._ends = _runs(self._flags)
        # One past the last global token of any row: False entries past the sequence say
        # nothing of it, as spans' -1 ids do not.
        where = self._flags.any(0).nonzero()
        self._reach = int(where.max()) + 1 if where.numel() else 0
        key_data = (per_row, width, digest(self._flags))
        super().__init__(
            ("global_tokens", key_data),
            rows=len(flags) if per_row else None,
            device=source_device(is_global),
            natural=width,
            truncate=truncate,
        )

    @property
    def data_reach(self) -> int:
        return self._reach

    @property
    def carries_batch_data(self) -> bool:
        return True  # which tokens are global is the batch's data (a CLS token's place)

    def check(self, extent: Extent) -> None:
        if self._reach > extent.length and not self._truncate:
            # Flags made for longer rows would be cut silently; said here, with the
            # function's own name (the base names the piece by its class).
            raise ValueError(
                f"global_tokens' is_global marks position {self._reach - 1} global, past the "
                f"sequence {extent.length_name} = {extent.length}: give is_global made for "
                f"this sequence (attention reads S from dim 2 of (B, H, S, D) tensors), or "
                f"pass global_tokens(..., truncate=True) to drop global tokens past its end"
            )
        super().check(extent)

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        # A block attends somewhere iff one of its rows or columns is global, everywhere iff
        # every row or every column is: counts of global tokens over each side's range
        # (token bounds clipped to the lengths), no token evaluated.
        counts = self._on("_counts", grid.device)
        rows = max(counts.shape[0], grid.q_first.shape[0], grid.kv_first.shape[0])
        if counts.shape[0] > 1:
            row = torch.arange(rows, device=grid.device).view(-1, 1, 1, 1)
        else:
            row = torch.zeros(rows, 1, 1, 1, dtype=torch.int64, device=grid.device)
        top = counts.shape[1] - 1  # positions at or past it count no more tokens

        def global_count(first: Tensor, last: Tensor) -> Tensor:
            # Clamped before the + 1: positions near 2**63 do not overflow.
            return counts[row, last.clamp(max=top - 1) + 1] - counts[row, first.clamp(max=top)]

        q_count = global_count(grid.q_first, grid.q_last)
        kv_count = global_count(grid.kv_first, grid.kv_last)
        q_size = grid.q_last - grid.q_first + 1
        kv_size = grid.kv_last - grid.kv_first + 1
        nonempty = (q_count > 0) | (kv_count > 0)
        full = (q_count == q_size) | (kv_count == kv_size)
        return codes_from(nonempty, full)

    settles_every_tile = True  # every code above is exact: no tile left to refine

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        # One shape per length (a compiled kernel sees the same table for every batch of this
        # length); on a window far from 0, the data's own positions. Either way a last False
        # entry, which every position past the table is clamped onto.
        width = length if window is None else min(self._flags.shape[1] - 1, length)
        flags = self._on("_flags", device)[:, :width]
        table = torch.zeros(flags.shape[0], width + 1, dtype=torch.bool, device=device)
        table[:, : flags.shape[1]] = flags
        mod = GlobalTokensMod(table if self.per_row else table[0], self.per_row)
        return Lowered(mod, mod)

    # ------------------------------------------------------------------ lowerings (formats)
    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        # Symmetric: a global line attends every position; any other, the runs of global
        # positions, one slot each (a format that caps its intervals refuses many runs).
        flags, starts, ends = self._flags, self._starts, self._ends
        rows = max(flags.shape[0], pos.shape[0])
        pos = pos.expand(rows, -1).to(torch.int64)
        at = pos.clamp(0, flags.shape[1] - 1)
        is_global = flags.expand(rows, -1).gather(1, at).unsqueeze(-1)
        runs_lo = starts.expand(rows, -1).unsqueeze(1)
        runs_hi = torch.where(ends == UNUSED, -UNUSED, ends - 1).expand(rows, -1).unsqueeze(1)
        slots = max(starts.shape[1], 1)
        slot = torch.arange(slots).view(1, 1, -1)
        every_lo = torch.where(slot == 0, -INF, UNUSED)
        every_hi = torch.where(slot == 0, INF, -UNUSED)
        if starts.shape[1] == 0:
            runs_lo = torch.full((rows, 1, 1), UNUSED, dtype=torch.int64)
            runs_hi = torch.full((rows, 1, 1), -UNUSED, dtype=torch.int64)
        lo = torch.where(is_global, every_lo, runs_lo)
        hi = torch.where(is_global, every_hi, runs_hi)
        return LineIntervals(lo, hi)

    def line_breaks(self, *, transpose: bool) -> Tensor:
        # Lines change only where a run of global tokens starts or ends.
        return torch.cat([self._starts, self._ends], 1).clamp(max=INF)

    def varlen_part(self, length: int) -> VarlenPart:
        raise cannot_lower(
            self,
            "varlen",
            "global tokens attend across every sequence, which is no partition of the positions "
            "into sequences; use to_flashmask or to_magi (their lists of intervals), or "
            "flexmask.create_block_mask",
        )

    def __repr__(self) -> str:
        if self.per_row:
            return f"global_tokens(<{self._flags.shape[0]} rows>)"
        return f"global_tokens({self._flags[0, :-1].int().tolist()})"


class GlobalTokensMod(PieceMod):
    """global_tokens' mask_mod: ``is_global[b, q_idx] | is_global[b, kv_idx]``.

    ``is_global`` is bool ``(R, n + 1)`` per row, ``(n + 1,)`` shared; its last entry is a
    False sentinel that indices past the table are clamped onto."""

    __slots__ = ("is_global",)
    _name = "global_tokens"

    def __init__(self, is_global: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.is_global = is_global

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        last = self.is_global.shape[-1] - 1
        q_global = self._lookup(self.is_global, b, q_idx.clamp(max=last))
        return q_global | self._lookup(self.is_global, b, kv_idx.clamp(max=last))


def _flag_vector(value: Any, name: str) -> Tensor:
    """One row's flags as a 1-D bool CPU tensor: bools, or ints that are 0 or 1."""
    if isinstance(value, Tensor) and value.dtype == torch.bool:
        value = value.to(torch.int64)
    elif getattr(value, "dtype", None) is not None and str(value.dtype) == "bool":
        value = value.astype("int64")  # a numpy array of bools
    elif isinstance(value, (list, tuple)):
        value = [int(v) if isinstance(v, bool) else v for v in value]
    values = int_vector(value, name)
    bad = ((values != 0) & (values != 1)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"{name}[{i}] must be True/False (or 1/0): whether the token is global, got "
            f"{int(values[i])}"
        )
    return values.bool()


def _runs(flags: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's runs of True as starts and exclusive ends, ``(R, max runs)`` int64, rows
    with fewer runs padded with the empty run ``[UNUSED, UNUSED)``."""
    edges = torch.diff(flags.to(torch.int8), dim=1, prepend=torch.zeros_like(flags[:, :1]))
    starts = [(row == 1).nonzero().view(-1) for row in edges]
    ends = [(row == -1).nonzero().view(-1) for row in edges]  # the last column is False
    width = max(s.numel() for s in starts)
    out_starts = torch.full((flags.shape[0], width), UNUSED, dtype=torch.int64)
    out_ends = torch.full_like(out_starts, UNUSED)
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        out_starts[i, : s.numel()] = s
        out_ends[i, : e.numel()] = e
    return out_starts, out_ends


def global_tokens(is_global: Any, *, truncate: bool = False) -> GlobalTokens:
    """Longformer's global attention: a global token attends every key and every query
    attends it, ``is_global[b, q_idx] | is_global[b, kv_idx]``.

    ``sliding_window(w + 1) | global_tokens(g)`` is Longformer's mask (attn-gym's
    ``generate_global_sliding_window(w, g)``); ``document(lens) & causal() &
    (global_tokens(is_context) | sliding_window(1))`` is packed HSTU's. The build decides
    every block from counts of global tokens per block, with no element evaluated.

    Args:
        is_global: whether each token is global, bools (or 1/0) — a list (or 1-D tensor or
            array) for every batch row, or a list of lists (or a 2-D tensor or array) with
            one list per row. Positions past the data are not global. A global token past
            the sequence raises where the mask is used, unless ``truncate``.
        truncate: drop global tokens past the sequence (docs/algebra.md, "Lengths past the
            sequence").

    Raises:
        ValueError: an entry other than True/False/1/0, naming it; where the mask is used, a
            global token past the sequence without ``truncate``, or rows that are not B.
        TypeError: entries that are not bools or integers.

    Example:
        >>> import flexmask
        >>> from flexmask.pieces import global_tokens
        >>> print((flexmask.sliding_window(2) | global_tokens([1, 0, 0, 0, 0])).show(5))
        ■ ■ ■ ■ ■
        ■ ■ ■ ⬚ ⬚
        ■ ■ ■ ■ ⬚
        ■ ⬚ ■ ■ ■
        ■ ⬚ ⬚ ■ ■
    """
    return GlobalTokens(is_global, truncate)
