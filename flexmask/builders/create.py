"""From a mask expression to a torch BlockMask, without evaluating the whole Q×KV grid.

The one data path, one module per stage (``flexmask.blocks``, ``flexmask.builders``):

1. ``grid`` — validate the arguments and lay out the tiles of the window;
2. ``closed_form`` — an ``&`` of interval pieces: both sides' runs from the intervals at
   block edges, no tile grid; ``unions`` — an ``|`` of two such: two runs per row; otherwise
3. ``classify`` — every tile's code from structure (``codes``), refining undecided tiles;
4. ``write`` — torch's tensors, byte-identical to its ``create_block_mask``, under each of
   the build flags the installed torch's ``create_block_mask`` takes (``TORCH_FLAGS``).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

from flexmask._validate import (
    block_mask_bytes,
    check_device,
    check_fits,
    check_int,
    check_window,
    env_int,
)
from flexmask.algebra.mask import Mask, MaskMod, ShiftedMod
from flexmask.blocks.grid import BlockGrid, block_sizes, make_grid, offsets
from flexmask.blocks.read import BLOCK_FIELDS, WRITE_ORDER_FIELDS
from flexmask.blocks.write import (
    TORCH_DEFAULTS,
    Flags,
    Ordered,
    assemble,
    empty_sides,
    exporting,
    ordered_from_codes,
)
from flexmask.builders import closed_form, unions
from flexmask.builders.classify import classify_blocks

ENV_BUILD_THREADS = "FLEXMASK_BUILD_THREADS"

_SHAPE_ARGS = ("mask_mod", "B", "H", "Q_LEN", "KV_LEN", "device", "BLOCK_SIZE")
TORCH_FLAGS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(torch_create_block_mask).parameters.items()
    if name not in _SHAPE_ARGS
    and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
}
"""The keywords the installed torch's ``create_block_mask`` takes beyond the shape arguments,
with their defaults — read from its signature, so each torch keeps its own set (2.13:
``_compile``, ``separate_full_blocks``, ``compute_dq_write_order``, ``dq_kv_order``)."""


def build_flags(flags: dict[str, Any]) -> Flags:
    """The build flags of a ``create_block_mask(..., **flags)`` call, read as the installed
    torch reads them: a keyword it does not take raises its ``TypeError``; a non-bool
    ``dq_kv_order`` its ``ValueError``; ``_compile``, ``separate_full_blocks`` and
    ``compute_dq_write_order`` by their truth value, as torch's ``if flag:`` does (``"no"``
    is true, ``None`` and ``""`` false), a value with none a ``TypeError`` naming it."""
    for name, value in flags.items():
        if name not in TORCH_FLAGS:
            raise TypeError(f"create_block_mask() got an unexpected keyword argument '{name}'")
        if name in Flags._fields or name == "_compile" or _is_default(value, TORCH_FLAGS[name]):
            continue
        raise TypeError(
            f"{name}={value!r}: flexmask does not build torch {torch.__version__}'s {name} yet; "
            f"leave it at its default {TORCH_FLAGS[name]!r}, or build with torch: "
            f"torch.nn.attention.flex_attention.create_block_mask(mask.mask_mod, ...)"
        )
    if _flag(flags, "_compile", False):
        warnings.warn(
            "create_block_mask(_compile=True) is deprecated in torch and ignored by flexmask, "
            "which builds from structure without compiling: drop _compile",
            DeprecationWarning,
            stacklevel=3,
        )
    dq_kv_order = flags.get("dq_kv_order", True)
    if not isinstance(dq_kv_order, bool):  # torch's own check and message, with the remedy
        raise ValueError(
            f"dq_kv_order must be a bool when using create_block_mask, got {dq_kv_order!r}: "
            f"True ranks kv blocks descending, False ascending (a tensor order goes to "
            f"BlockMask.from_kv_blocks with a precomputed dq_write_order)"
        )
    return Flags(
        separate_full_blocks=_flag(flags, "separate_full_blocks", True),
        compute_dq_write_order=_flag(flags, "compute_dq_write_order", False),
        dq_kv_order=dq_kv_order,
    )


def _flag(flags: dict[str, Any], name: str, default: bool) -> bool:
    """The flag's truth value: torch tests these flags with ``if flag:``, so any value it
    builds with (``1``, ``"no"``, ``None``) builds the same here."""
    value = flags.get(name, default)
    try:
        return bool(value)
    except Exception as err:  # a tensor of many values, a Mask: no truth value
        raise TypeError(
            f"{name}={value!r} has no truth value, which torch's create_block_mask tests "
            f"(`if {name}:`): pass True or False"
        ) from err


def _is_default(value: Any, default: Any) -> bool:
    try:
        return value is default or (type(value) is type(default) and bool(value == default))
    except Exception:  # noqa: BLE001 - a value that does not compare is not the default
        return False


def torch_keywords(flags: Flags) -> dict[str, Any]:
    """``flags`` as keywords of the installed torch's ``create_block_mask`` (those it takes)."""
    return {name: value for name, value in flags._asdict().items() if name in TORCH_FLAGS}


def in_closed_form(mask: Mask) -> bool:
    """True if the build writes ``mask`` from intervals at block edges, no tiles: monotone
    intervals (``closed_form``) or an ``|`` of two such (``unions``)."""
    return mask.has_monotone_intervals() or unions.union_operands(mask) is not None


class Sides(NamedTuple):
    """Both sides' ordered tensors of a build, and how many tiles it refined."""

    kv: Ordered
    q: Ordered
    refined: int
    """Tiles the structure left undecided (0 on the closed form)."""


def ordered_sides(mask: Mask, grid: BlockGrid) -> Sides:
    """Both sides' ordered tensors: in closed form from the intervals at block edges where
    the mask's intervals are monotone (``closed_form``) or it is an ``|`` of two such
    (``unions``), else from the classified tiles."""
    if grid.num_q_blocks == 0 or grid.num_kv_blocks == 0:
        return Sides(*empty_sides(*grid.reduced(mask), grid), 0)
    if mask.has_monotone_intervals():
        return Sides(*closed_form.ordered_sides(mask, grid), 0)
    if unions.union_operands(mask) is not None:
        return Sides(*unions.union_sides(mask, grid), 0)
    parts = mask.head_parts(grid.heads)
    if parts is not None:
        return _by_head(mask, parts, grid)
    codes, refined = classify_blocks(mask, grid)
    return Sides(*ordered_from_codes(codes), refined)


def _by_head(mask: Mask, parts: tuple[tuple[Mask, ...], list[Tensor]], grid: BlockGrid) -> Sides:
    """A mask that is one of several masks on each head (``per_head``): each distinct mask
    that some head uses built once on its own path, and its tensors copied (broadcast over
    the rows) into each of its heads' slices of torch's ``(rows, H, ...)`` layout — one
    write of the output past the parts' own (was an ``index_select`` and an
    ``index_copy_``: two). A part in closed form whose rows are the output's writes its
    index tensors straight into its first head's slice (row by row where B > 1 and H > 1:
    no tensors of its own, whose fresh pages cost as much as the copy at 131k B=8), and
    only its other heads are copies. The output is ordinary memory, a storage per tensor,
    as torch's."""
    masks, heads = parts
    rows = grid.reduced(mask)[0]
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    shapes = ((nq,), (nq, nkv), (nq,), (nq, nkv), (nkv,), (nkv, nq), (nkv,), (nkv, nq))
    out = [
        torch.empty((rows, grid.heads, *shape), dtype=torch.int32, device=grid.device)
        for shape in shapes
    ]
    refined = 0
    for part, index in zip(masks, heads, strict=True):
        head_list = index.tolist()
        if not head_list:  # H shorter than the cycle: no head uses this mask
            continue
        direct = part.has_monotone_intervals() and grid.reduced(part)[0] == rows
        if direct:  # index tensors in order kv partial, q partial, kv full, q full
            targets = [out[i].select(1, head_list[0]) for i in (1, 5, 3, 7)]
            kv, q = closed_form.ordered_sides(part, grid, out=targets)
            part_refined = 0
        else:
            kv, q, part_refined = ordered_sides(part, grid)
        refined += part_refined
        for field, (target, source) in enumerate(zip(out, (*kv, *q), strict=True)):
            for head in head_list:
                if direct and field % 2 and head == head_list[0]:
                    continue  # written in place
                target.select(1, head).copy_(source.select(1, head if source.shape[1] > 1 else 0))
    return Sides(Ordered(*out[:4]), Ordered(*out[4:]), refined)


def build_threads() -> int:
    """Intra-op threads a CPU build runs with: FLEXMASK_BUILD_THREADS, default 1."""
    threads = env_int(ENV_BUILD_THREADS, 1, minimum=1)
    assert threads is not None  # a default is given
    return threads


@contextlib.contextmanager
def cpu_threads(device: torch.device) -> Iterator[None]:
    # A tile build is a few dozen tensor ops, each one pass over the tile grid. With every
    # core busy (DataLoader workers, say) each parallel op waits for a descheduled thread:
    # benchmarks/bench_threads.py measured a 32k tree build at 2.5 ms on one thread and
    # 12 ms on torch's default two, with two busy processes on a 2-core machine.
    wanted = build_threads()
    previous = torch.get_num_threads()
    if device.type != "cpu" or wanted >= previous:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build(mask: Mask, grid: BlockGrid, flags: Flags = TORCH_DEFAULTS) -> BlockMask:
    """Builds the BlockMask of a validated mask on a validated grid, written as torch writes
    it under ``flags``."""
    return build_counted(mask, grid, flags)[0]


def build_counted(
    mask: Mask, grid: BlockGrid, flags: Flags = TORCH_DEFAULTS
) -> tuple[BlockMask, int]:
    """``build``, and how many tiles it refined (what benchmarks report)."""
    with cpu_threads(torch.device(grid.device)):
        # The lookups the mask_mod keeps are allocated before the build's temporaries.
        lowered = mask.lower_at(grid.length, grid.device, grid.lookup_window).mask_mod
        mask_mod = window_mask_mod(lowered, grid)
        if grid.per_row_offsets and not in_closed_form(mask):
            kv, q, refined = _row_by_row(mask, grid)
        else:
            kv, q, refined = ordered_sides(mask, grid)
        block_mask = assemble(kv, q, grid, mask_mod, flags)
        if mask_mod is lowered:  # no window: the BlockMask means the mask itself
            setattr(block_mask, _BUILT_FROM, _Built.of(block_mask, mask, mask_mod))
        return block_mask, refined


# A BlockMask flexmask built remembers its Mask with the mask_mod it was built with. torch
# makes a new BlockMask for ``.to()``, slicing and ``_adjust``, which so forget it.
_BUILT_FROM = "_flexmask_built_from"


def built_from(block_mask: BlockMask, blocks: bool = False) -> Mask | None:
    """The Mask ``block_mask`` was built from by :func:`build`, while its mask_mod is still
    the one it was built with; None for torch's BlockMasks, windows (``q_offset``/
    ``kv_offset``), and BlockMasks torch derived from flexmask's.

    With ``blocks``, also only while its index tensors are the ones built (no field set to
    another tensor, no in-place edit: each tensor's version counter unchanged), for a reader
    that takes the Mask for the blocks too: an edited BlockMask attends what its blocks say.
    """
    tag = getattr(block_mask, _BUILT_FROM, None)
    if not isinstance(tag, _Built) or tag.mask_mod is not block_mask.mask_mod:
        return None
    if blocks and not tag.intact(block_mask):
        return None
    return tag.mask


class _Built:
    """What a build records on its BlockMask: the Mask, the mask_mod, and each index tensor
    (weakly: the record keeps none alive) with its version counter, which every in-place op
    bumps. It pickles (and deep-copies) with the tensors themselves, so that the copy's
    record names the copy's tensors (the pickle's memo makes them the same objects) at their
    versions on load — or, for an edited BlockMask, with none: no copy of it is intact."""

    __slots__ = ("mask", "mask_mod", "tensors")

    def __init__(self, mask: Mask, mask_mod: MaskMod, fields: tuple[Tensor | None, ...] | None):
        self.mask, self.mask_mod = mask, mask_mod
        self.tensors = (
            None
            if fields is None
            else tuple(None if t is None else (weakref.ref(t), t._version) for t in fields)
        )

    @staticmethod
    def of(block_mask: BlockMask, mask: Mask, mask_mod: MaskMod) -> _Built:
        return _Built(mask, mask_mod, tuple(getattr(block_mask, n, None) for n in BLOCK_FIELDS))

    def intact(self, block_mask: BlockMask) -> bool:
        if self.tensors is None:
            return False
        for name, kept in zip(BLOCK_FIELDS, self.tensors, strict=True):
            tensor = getattr(block_mask, name, None)
            if kept is None:
                if tensor is not None:
                    return False
            elif kept[0]() is not tensor or tensor is None or kept[1] != tensor._version:
                return False
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        tensors = (
            ()
            if self.tensors is None
            else tuple(None if kept is None else kept[0]() for kept in self.tensors)
        )
        if self.tensors is None or any(
            kept is not None and (tensor is None or tensor._version != kept[1])
            for kept, tensor in zip(self.tensors, tensors, strict=True)
        ):
            return (_Built, (self.mask, self.mask_mod, None))
        return (_Built, (self.mask, self.mask_mod, tensors))


BUILT_RECORD = _Built
"""The class of the record a build leaves on its BlockMask (``flexmask.safe_globals`` lists
it for ``torch.load(weights_only=True)``)."""


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


def _row_by_row(mask: Mask, grid: BlockGrid) -> Sides:
    """Per-row windows on the tile path: each row's window built with its own offsets and
    its row kept (B builds; the closed form takes per-row offsets in one)."""
    q_off = grid.q_offset.view(-1).tolist()  # type: ignore[union-attr]
    kv_off = grid.kv_offset.view(-1).tolist()  # type: ignore[union-attr]
    parts, refined = [], 0
    for row in range(grid.batch):
        one = BlockGrid.make(
            grid.batch,
            grid.heads,
            grid.q_len,
            grid.kv_len,
            grid.q_block,
            grid.kv_block,
            grid.device,
            q_offset=q_off[row],
            kv_offset=kv_off[row],
            reach=grid.length,  # the lookups every row's window shares
        )
        kv, q, one_refined = ordered_sides(mask, one)
        parts.append([t[row : row + 1] if t.shape[0] > 1 else t for t in (*kv, *q)])
        refined += one_refined
    stacked = [torch.cat(column) for column in zip(*parts, strict=True)]
    return Sides(Ordered(*stacked[:4]), Ordered(*stacked[4:]), refined)


def create_block_mask(
    mask: Mask | MaskMod,
    B: int | None = None,
    H: int | None = None,
    Q_LEN: int = 128,
    KV_LEN: int = 128,
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
        Q_LEN: query length. KV_LEN: key/value length. Neither needs to be a block multiple.
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
    if not isinstance(mask, Mask):
        if callable(mask):
            if not (isinstance(q_offset, int) and q_offset == 0) or not (
                isinstance(kv_offset, int) and kv_offset == 0
            ):
                raise TypeError(
                    "q_offset/kv_offset need a flexmask Mask (a plain mask_mod has no structure "
                    "to window): wrap it with flexmask.from_mask_mod(fn, key=...)"
                )
            build_flags(flags)  # torch's errors for unknown keywords, before any work
            return _torch_build(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, flags)
        raise TypeError(
            f"mask must be a flexmask Mask or a mask_mod callable, got {type(mask).__name__}"
        )
    checked = build_flags(flags)
    empty = no_rows_or_heads(mask, B, H)
    if empty is not None:
        one = create_block_mask(
            mask,
            *empty,
            Q_LEN,
            KV_LEN,
            device,
            BLOCK_SIZE,
            q_offset=q_offset,
            kv_offset=kv_offset,
            **torch_keywords(checked),
        )
        return emptied(one, B, H)
    check_size(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, q_offset, kv_offset)
    grid = make_grid(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, q_offset, kv_offset)
    if exporting() and not in_closed_form(mask):
        return _traced_build(mask, grid, checked)
    return build(mask, grid, checked)


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
    rows, cols = (batch or 1) * (heads or 1), 1
    padded = -(-q_len // q_block) * q_block * -(-kv_len // kv_block) * kv_block
    check_fits(
        rows * (q_len * kv_len + padded)
        + block_mask_bytes(rows, cols, q_len, kv_len, q_block, kv_block),
        where,
        f"create_block_mask of a plain mask_mod with B={B}, H={H}, Q_LEN={q_len}, "
        f"KV_LEN={kv_len}, BLOCK_SIZE={(q_block, kv_block)} (torch evaluates it on every "
        f"element, padded to whole blocks, as bools)",
        "use shorter lengths, fewer B/H or a BLOCK_SIZE no longer than the sequence; a flexmask "
        "expression (flexmask.from_mask_mod(fn, key=...) & ...) evaluates only the blocks its "
        "structure leaves undecided",
    )
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


def check_size(
    mask: Mask,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    device: Any,
    BLOCK_SIZE: Any,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    *,
    reduced: bool = False,
) -> None:
    """Refuses, before anything is allocated, a build that cannot fit the device — its
    BlockMask (``reduced``: B and H cut to 1 where the mask ignores them, as the cache
    builds), the grid's tile bounds and, in closed form, one block's queries at a time — and
    a window whose positions would overflow int64. Arithmetic on Python ints only."""
    batch = (mask.rows or 1) if B is None else check_int(B, "B", minimum=1)
    heads = 1 if H is None else check_int(H, "H", minimum=1)
    q_len = check_int(Q_LEN, "Q_LEN", minimum=0)
    kv_len = check_int(KV_LEN, "KV_LEN", minimum=0)
    q_block, kv_block = block_sizes(BLOCK_SIZE)
    per_row = False
    for value, name, length, length_name, block in (
        (q_offset, "q_offset", q_len, "Q_LEN", q_block),
        (kv_offset, "kv_offset", kv_len, "KV_LEN", kv_block),
    ):
        offset = offsets(value, name, batch)
        per_row |= hasattr(value, "__len__") and not (
            isinstance(value, Tensor) and value.dim() == 0
        )
        check_window(
            max(offset) if isinstance(offset, list) else offset, length, block, name, length_name
        )
    rows = batch if not reduced or per_row or mask.batch_dependent else 1
    built_heads = heads if not reduced or mask.head_dependent else 1
    nq, nkv = -(-q_len // q_block), -(-kv_len // kv_block)
    nbytes = block_mask_bytes(rows, built_heads, q_len, kv_len, q_block, kv_block)
    nbytes += 16 * (nq + nkv) * (batch if per_row else 1)  # the grid's first/last tokens
    if in_closed_form(mask) and nq and nkv:
        # int64 queries of a block and both ends of their intervals, live together
        nbytes += 24 * rows * q_block
    check_fits(
        nbytes,
        check_device(device, mask.device),
        f"a BlockMask with B={batch}, H={heads}, Q_LEN={q_len}, KV_LEN={kv_len}, "
        f"BLOCK_SIZE={(q_block, kv_block)} ({nq} x {nkv} blocks per row and head)",
        "use shorter lengths, fewer B/H, or a BLOCK_SIZE no longer than the sequence (a block's "
        "queries are evaluated together)",
    )


def no_rows_or_heads(mask: Mask, B: Any, H: Any) -> tuple[Any, Any] | None:
    """For B=0 or H=0 (torch builds an empty BlockMask for those): the B and H to build one
    row or head with and then empty (``emptied``); None otherwise."""
    batch = None if B is None else check_int(B, "B", minimum=0)
    heads = None if H is None else check_int(H, "H", minimum=0)
    if batch != 0 and heads != 0:
        return None
    if batch == 0 and mask.rows is not None:
        raise ValueError(
            f"B=0 but the mask's data is given for {mask.rows} batch rows: pass B={mask.rows} "
            f"(or None), or data shared by every row for an empty batch"
        )
    return (1 if batch == 0 else B), (1 if heads == 0 else H)


def emptied(block_mask: BlockMask, B: Any, H: Any) -> BlockMask:
    """``block_mask`` with its batch (B=0) or head (H=0) dimension emptied: torch's
    create_block_mask for B=0 or H=0 has every tensor ``(0, H, ...)`` or ``(B, 0, ...)``."""
    rows = 0 if B is not None and int(B) == 0 else None
    heads = 0 if H is not None and int(H) == 0 else None
    fields: dict[str, Any] = dict.fromkeys(BLOCK_FIELDS)
    for name in (*BLOCK_FIELDS, *WRITE_ORDER_FIELDS):
        tensor = getattr(block_mask, name, None)
        if tensor is None:  # separate_full_blocks=False, or no write order
            continue
        if rows is not None:
            tensor = tensor[:0]
        if heads is not None:
            tensor = tensor[:, :0]
        fields[name] = tensor.contiguous()
    spt = getattr(block_mask, "dq_kv_order_spt", None)
    if spt is not None:
        fields["dq_kv_order_spt"] = spt
    out = BlockMask(
        seq_lengths=block_mask.seq_lengths,
        **fields,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
    )
    tag = getattr(block_mask, _BUILT_FROM, None)
    if isinstance(tag, _Built):
        tensors = tuple(getattr(out, name, None) for name in BLOCK_FIELDS)
        intact = tensors if tag.intact(block_mask) else None
        setattr(out, _BUILT_FROM, _Built(tag.mask, tag.mask_mod, intact))
    return out
