"""From a mask expression to a torch BlockMask, without evaluating the whole Q×KV grid.

The one data path, one module per stage (``flexmask.blocks``, ``flexmask.builders``):

1. ``grid`` — validate the arguments and lay out the tiles of the window (``size_check``
   refuses, first, what cannot fit the device);
2. ``sides`` — the path that writes both sides: ``closed_form`` for an ``&`` of interval
   pieces (both sides' runs from the intervals at block edges, no tile grid), ``unions``
   for an ``|`` of two such (two runs per row); otherwise
3. ``classify`` — every tile's code from structure (``codes``), refining undecided tiles;
4. ``runs``, ``write`` — each line's runs of codes ranked into torch's tensors,
   byte-identical to its ``create_block_mask``, under each of the build flags the installed
   torch's ``create_block_mask`` takes (``torch_flags``);
5. ``provenance`` — the Mask recorded on the BlockMask it built.

This module is the entry: ``create_block_mask`` runs those stages, or hands a plain
mask_mod (and, under ``torch.export``, a mask off the closed form) to torch's own build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

from flexmask._validate import check_device, check_int, lengths
from flexmask.algebra import Mask, MaskMod, ShiftedMod, mask_mod_at
from flexmask.blocks import (
    TORCH_DEFAULTS,
    BlockGrid,
    Flags,
    assemble,
    block_sizes,
    exporting,
)
from flexmask.builders.provenance import (
    _Built,  # noqa: F401 - BlockMasks pickled by 0.1.0 name the record's class here
    record,
)
from flexmask.builders.sides import Route, build_sides, in_closed_form
from flexmask.builders.size_check import check_dense_size
from flexmask.builders.spec import make_spec
from flexmask.builders.threads import cpu_threads
from flexmask.builders.torch_flags import build_flags, torch_keywords
from flexmask.builders.zero_sizes import emptied


def window_mask_mod(mask_mod: MaskMod, grid: BlockGrid) -> MaskMod:
    """The mask_mod of the grid's window: local indices shifted by the offsets (held as
    tensors); the mask's own where the window starts at (0, 0)."""
    if not grid.row_offsets and grid.q_offset == 0 and grid.kv_offset == 0:
        return mask_mod

    def held(offset: int | Tensor) -> Tensor:
        if isinstance(offset, Tensor):
            return offset.view(-1).expand(grid.batch).contiguous()
        if grid.row_offsets:  # equal per-row offsets: still one per row, one shape
            return torch.full((grid.batch,), offset, dtype=torch.int64, device=grid.device)
        return torch.tensor(offset, dtype=torch.int64, device=grid.device)

    return ShiftedMod(mask_mod, held(grid.q_offset), held(grid.kv_offset))


def build(mask: Mask, grid: BlockGrid, flags: Flags = TORCH_DEFAULTS) -> BlockMask:
    """Builds the BlockMask of a validated mask on a validated grid, written as torch writes
    it under ``flags``."""
    return build_counted(mask, grid, flags)[0]


def build_counted(
    mask: Mask, grid: BlockGrid, flags: Flags = TORCH_DEFAULTS
) -> tuple[BlockMask, int]:
    """``build``, and how many tiles it refined (what benchmarks report)."""
    block_mask, route = build_routed(mask, grid, flags)
    return block_mask, route.total_refined


def build_routed(
    mask: Mask, grid: BlockGrid, flags: Flags = TORCH_DEFAULTS
) -> tuple[BlockMask, Route]:
    """``build``, and the path that wrote its sides (``explain_build`` reports it)."""
    with cpu_threads(torch.device(grid.device)):
        # The lookups the mask_mod keeps are allocated before the build's temporaries.
        lowered = mask_mod_at(mask, grid.length, grid.device, grid.lookup_window)
        mask_mod = window_mask_mod(lowered, grid)
        kv, q, route = build_sides(mask, grid)
        block_mask = assemble(kv, q, grid, mask_mod, flags)
        if mask_mod is lowered:  # no window: the BlockMask means the mask itself
            record(block_mask, mask, mask_mod, route)
        return block_mask, route


def create_block_mask(
    mask: Mask | MaskMod,
    B: int | None = None,
    H: int | None = None,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    *,
    q_offset: int | Sequence[int] | Tensor = 0,
    kv_offset: int | Sequence[int] | Tensor = 0,
    **flags: Any,
) -> BlockMask:
    """Drop-in for ``torch.nn.attention.flex_attention.create_block_mask``, built from structure.

    For a flexmask expression the result lists the blocks torch's
    ``create_block_mask(mask.mask_mod, ...)`` lists — the same counts, the same blocks per row
    in the same order, the same full/partial split (``same_blocks``) — without evaluating the
    mask on every element. An ``&`` of interval pieces (causal, document, sliding window,
    prefix, padding) is written in closed form from the intervals at block edges
    (``flexmask.builders.closed_form``); any other expression has its tiles classified from each
    piece's data and is evaluated only on tiles the structure leaves undecided. The eight
    tensors equal torch's as whole tensors (the unlisted tail in torch's order), each
    ``(B, H, ...)``, contiguous, with a storage of its own — a mask that does not depend on
    the row (or head) is built once and copied out. A plain mask_mod callable is passed to
    torch.

    Args:
        mask: a flexmask expression, or any mask_mod (forwarded to torch unchanged).
        B: batch size (None: 1, or the row count of per-row data).
        H: number of heads (None: 1).
        Q_LEN: query length (required, as torch requires it; omitted, the pre-0.2 default
            128 with a DeprecationWarning). KV_LEN: key/value length (None: Q_LEN).
            Neither needs to be a block multiple.
        device: where to build (None: the device of the mask's tensors, else torch's default).
        BLOCK_SIZE: tile size, an int or a (Q, KV) pair.
        q_offset, kv_offset: build the window of queries ``[q_offset, q_offset + Q_LEN)`` and
            keys ``[kv_offset, kv_offset + KV_LEN)`` of the mask (a context-parallel shard, a
            decode step): ints >= 0, or one per batch row (a list or a ``(B,)`` tensor). The
            BlockMask is torch's ``create_block_mask`` of the shifted mask_mod
            ``mod(b, h, q + q_offset[b], kv + kv_offset[b])``; its mask_mod takes local
            indices and holds the offsets as tensors (new offsets do not recompile).

        **flags: every further keyword the installed torch's ``create_block_mask`` takes
            (``TORCH_FLAGS``; by keyword only), with torch's meaning and the same tensors.
            torch 2.13: ``separate_full_blocks=False`` lists every nonempty block as partial
            (the full tensors are None); ``compute_dq_write_order=True`` adds
            ``dq_write_order`` and ``dq_write_order_full``, ranked by ``dq_kv_order`` (True:
            descending, False: ascending); ``_compile`` is ignored (with torch's
            deprecation warning). Each is read as torch reads it: ``dq_kv_order`` must be a
            bool (torch's ``ValueError``), the others by truth value (``"no"`` is true,
            ``None`` false). A keyword the installed torch does not take raises the
            ``TypeError`` torch raises.

    Returns:
        A ``torch.nn.attention.flex_attention.BlockMask`` whose ``mask_mod`` captures only
        lookups sized by the sequence length.

    Under ``torch.export`` a mask in closed form is traced as built here (a graph of block
    edge arithmetic); any other is built by torch's ``create_block_mask`` of its mask_mod,
    the same tensors, since classifying tiles reads tensor values to choose what to refine.
    A mask must be made outside the traced code: its pieces check and key their data by
    value (see docs/blocks.md).

    Example:
        >>> import flexmask
        >>> mask = flexmask.causal() & flexmask.document([300, 200])
        >>> bm = flexmask.create_block_mask(mask, 1, 1, 512, 512, device="cpu")
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
        ([[[1, 1, 3, 2]]], [[[0, 1, 0, 0]]])
    """
    return routed_build(
        mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, q_offset, kv_offset, flags
    ).block_mask


class Routed(NamedTuple):
    """A BlockMask and the path its build took."""

    block_mask: BlockMask
    route: Route


def routed_build(
    mask: Mask | MaskMod,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    device: Any,
    BLOCK_SIZE: Any,
    q_offset: Any,
    kv_offset: Any,
    flags: dict[str, Any],
    caller: str = "create_block_mask",
) -> Routed:
    """``create_block_mask``'s work, with the route it took: ``explain_build`` runs the same
    build, so what it reports is what ``create_block_mask`` does."""
    Q_LEN, KV_LEN = lengths(Q_LEN, KV_LEN, caller)
    if not isinstance(mask, Mask):
        _check_mask_mod(mask, q_offset, kv_offset)
        build_flags(flags)  # torch's errors for unknown keywords, before any work
        built = _torch_build(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, flags)
        return Routed(built, Route("torch", TORCH_WHY["mask_mod"]))
    checked = build_flags(flags)
    spec = make_spec(
        mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, q_offset, kv_offset, sized=False
    )
    # B=0 or H=0: one row or head is built, then emptied, as torch's tensors are.
    one = spec.one_row()
    one.check_fits(check_device(device, mask.device), reduced=False)  # all (B, H) written
    grid = one.grid(sized=False)
    if exporting() and not in_closed_form(mask):
        built, route = _traced_build(mask, grid, checked), Route("torch", TORCH_WHY["export"])
    else:
        built, route = build_routed(mask, grid, checked)
    return Routed(emptied(built, B, H) if spec.empty else built, route)


TORCH_WHY = {
    "mask_mod": "a plain mask_mod has no structure to read: torch evaluates it on every "
    "element of the (B, H, Q_LEN, KV_LEN) grid, padded to whole blocks",
    "export": "under torch.export, a mask off the closed form: classifying tiles reads "
    "tensor values export cannot trace, so torch evaluates its mask_mod on every element",
}
"""Why a build was handed to torch's create_block_mask."""


def _traced_build(mask: Mask, grid: BlockGrid, flags: Flags) -> BlockMask:
    """Under ``torch.export``, a mask off the closed form: torch's ``create_block_mask`` of
    its (windowed) mask_mod. Classifying tiles reads tensor values (which tiles are
    undecided, how many runs a line has) that export cannot trace as shapes; torch's build
    evaluates every element instead, and writes the same tensors."""
    lowered = mask.lower_at(grid.length, grid.device, grid.lookup_window)
    mask_mod = window_mask_mod(lowered.mask_mod, grid)
    return torch_create_block_mask(
        mask_mod,
        grid.batch,
        grid.heads,
        grid.q_len,
        grid.kv_len,
        device=grid.device,
        BLOCK_SIZE=(grid.q_block, grid.kv_block),
        **torch_keywords(flags),
    )


def _check_mask_mod(mask: Any, q_offset: Any, kv_offset: Any) -> None:
    """A ``mask`` that is no Mask must be a mask_mod callable, built without offsets."""
    if not callable(mask):
        raise TypeError(
            f"mask must be a flexmask Mask or a mask_mod callable, got {type(mask).__name__}"
        )
    if not (isinstance(q_offset, int) and q_offset == 0) or not (
        isinstance(kv_offset, int) and kv_offset == 0
    ):
        raise TypeError(
            "q_offset/kv_offset need a flexmask Mask (a plain mask_mod has no structure "
            "to window): wrap it with flexmask.from_mask_mod(fn, key=...)"
        )


def _torch_build(
    mask_mod: MaskMod,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    device: Any,
    BLOCK_SIZE: Any,
    flags: dict[str, Any],
) -> BlockMask:
    """torch's create_block_mask of a plain mask_mod, its arguments checked first: torch
    evaluates the mask on the whole ``(B, H, Q_LEN, KV_LEN)`` grid, padded to whole blocks."""
    batch = None if B is None else check_int(B, "B", minimum=0)
    heads = None if H is None else check_int(H, "H", minimum=0)
    q_len = check_int(Q_LEN, "Q_LEN", minimum=0)
    kv_len = check_int(KV_LEN, "KV_LEN", minimum=0)
    q_block, kv_block = block_sizes(BLOCK_SIZE)
    where = check_device(device)
    check_dense_size(batch, heads, q_len, kv_len, q_block, kv_block, where)
    return torch_create_block_mask(
        mask_mod,
        batch,
        heads,
        q_len,
        kv_len,
        device=where,
        BLOCK_SIZE=(q_block, kv_block),
        **flags,
    )
