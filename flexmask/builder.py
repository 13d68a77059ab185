"""From a mask expression to a torch BlockMask, without evaluating the whole Q×KV grid.

The one data path: validate → classify every tile from structure (``Mask._classify``) →
evaluate the mask only on tiles left undecided → write torch's BlockMask tensors in the
order torch's own ``create_block_mask`` writes them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

from flexmask import ranges
from flexmask._validate import check_int
from flexmask.blocks import FULL, PARTIAL, UNDECIDED, BlockGrid
from flexmask.mask import Mask, MaskMod, ShiftedMod
from flexmask.ranges import Ordered
from flexmask.refine import refine_by_evaluation, refine_by_intervals

ENV_BUILD_THREADS = "FLEXMASK_BUILD_THREADS"


class Classified(NamedTuple):
    """Final tile codes (EMPTY / PARTIAL / FULL) and how many tiles needed evaluation."""

    codes: Tensor
    """(R, Hh, nq, nkv) int8, R = B if the mask depends on the row else 1; Hh likewise."""
    refined: int
    """Tiles the structure left undecided and the mask_mod was evaluated on."""


def default_device() -> torch.device:
    """torch's default for create_block_mask: the current accelerator, else the CPU."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        current = accelerator.current_accelerator()
        return torch.device(current) if current is not None else torch.device("cpu")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def block_sizes(BLOCK_SIZE: Any) -> tuple[int, int]:
    """(q_block, kv_block) from an int or a pair, validated."""
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise ValueError(f"BLOCK_SIZE must be an int or a (Q, KV) pair, got {BLOCK_SIZE!r}")
        q_block = check_int(BLOCK_SIZE[0], "BLOCK_SIZE[0]", minimum=1)
        kv_block = check_int(BLOCK_SIZE[1], "BLOCK_SIZE[1]", minimum=1)
        return q_block, kv_block
    size = check_int(BLOCK_SIZE, "BLOCK_SIZE", minimum=1)
    return size, size


def make_grid(
    mask: Mask,
    B: Any,
    H: Any,
    Q_LEN: Any,
    KV_LEN: Any,
    device: torch.device | str | None,
    BLOCK_SIZE: Any,
    q_offset: Any = 0,
    kv_offset: Any = 0,
) -> BlockGrid:
    """Validates the build arguments against the mask and lays out its tiles (of the window
    at the offsets)."""
    batch = 1 if B is None else check_int(B, "B", minimum=1)
    heads = 1 if H is None else check_int(H, "H", minimum=1)
    q_len = check_int(Q_LEN, "Q_LEN", minimum=0)
    kv_len = check_int(KV_LEN, "KV_LEN", minimum=0)
    q_block, kv_block = block_sizes(BLOCK_SIZE)
    if device is None:
        device = mask.device or default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device or its name, got {device!r}") from err
    if mask.rows is not None and B is None:
        batch = mask.rows
    q_off = offsets(q_offset, "q_offset", batch)
    kv_off = offsets(kv_offset, "kv_offset", batch)
    grid = BlockGrid.make(
        batch, heads, q_len, kv_len, q_block, kv_block, device, q_offset=q_off, kv_offset=kv_off
    )
    mask._check(grid)
    return grid


def offsets(value: Any, name: str, batch: int) -> int | list[int]:
    """A window offset: one int >= 0, or one per batch row (a list, or a (B,) tensor or
    array). Per-row values that are all equal collapse to one int."""
    if isinstance(value, Tensor) and value.dim() == 0 or not hasattr(value, "__len__"):
        return check_int(value, name, minimum=0)
    if isinstance(value, Tensor) and value.dim() != 1:
        raise ValueError(f"{name} must be an int or hold one offset per batch row, shape (B,)")
    values = [check_int(v, f"{name}[{i}]", minimum=0) for i, v in enumerate(value)]
    if len(values) != batch:
        raise ValueError(
            f"{name} holds {len(values)} offsets but B={batch}: pass one per batch row, or one "
            f"int for every row"
        )
    return values[0] if len(set(values)) == 1 else values


def classify_blocks(mask: Mask, grid: BlockGrid) -> Classified:
    """Every tile's final code: structure first, the mask_mod only on undecided tiles."""
    grid.refined[0] = 0
    rows = grid.batch if mask.batch_dependent else 1
    heads = grid.heads if mask.head_dependent else 1
    shape = (rows, heads, grid.num_q_blocks, grid.num_kv_blocks)
    codes = mask._classify(grid).expand(shape)
    codes = codes.contiguous()
    undecided = (codes == UNDECIDED).nonzero() if int(codes.max()) == UNDECIDED else None
    if undecided is not None:
        if mask._has_intervals():
            refine_by_intervals(codes, undecided, mask, grid)
        else:
            refine_by_evaluation(
                codes, undecided, mask._lower(grid.length, grid.device).evaluate, grid
            )
    return Classified(grid.demote_incomplete(codes), grid.refined[0])


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks, indices) of a bool grid, byte-identical to torch's stable argsort order:
    the set columns ascending, then the unset ones ascending. A cumsum ranks each column and
    one scatter writes it — O(columns), no sort."""
    n = blocks.shape[-1]
    ones = blocks.cumsum(-1, dtype=torch.int32)  # set columns up to and including each one
    count = ones[..., -1:]
    col1 = torch.arange(1, n + 1, dtype=torch.int32, device=blocks.device)
    # One-based rank: a set column is the ones-th; an unset one follows all `count` set ones
    # and the (col1 - ones) unset ones up to it.
    rank = torch.where(blocks, ones, (count + col1) - ones).to(torch.int64).sub_(1)
    indices = torch.empty(blocks.shape, dtype=torch.int32, device=blocks.device)
    indices.scatter_(-1, rank, (col1 - 1).expand(blocks.shape))
    return count.squeeze(-1).contiguous(), indices


def ordered_from_codes(codes: Tensor) -> tuple[Ordered, Ordered]:
    """torch's (kv side, q side) ordered tensors from final tile codes ``(R, Hh, nq, nkv)``."""
    partial = codes == PARTIAL
    full = codes == FULL
    kv = Ordered(*_ordered(partial), *_ordered(full))
    q = Ordered(
        *_ordered(partial.transpose(-2, -1).contiguous()),
        *_ordered(full.transpose(-2, -1).contiguous()),
    )
    return kv, q


def assemble(kv: Ordered, q: Ordered, grid: BlockGrid, mask_mod: MaskMod) -> BlockMask:
    """torch's BlockMask from both sides' ordered tensors, each ``(B, H, ...)`` contiguous
    with a storage of its own, as torch's: an in-place edit of one row or head changes that
    one, and ``PagedAttention`` can view them.

    Sides come as counts ``(R, Hh, n)`` and indices ``(R, Hh, n, m)`` with R in {1, B},
    Hh in {1, H}; rows and heads the mask ignores are copied out here. (The cache builds
    on a grid with B or H reduced to 1 instead: flex_attention broadcasts those.)
    """
    b, h, nq, nkv = grid.batch, grid.heads, grid.num_q_blocks, grid.num_kv_blocks

    def whole(t: Tensor, *shape: int) -> Tensor:
        return t.expand(b, h, *shape).contiguous()

    return BlockMask(
        seq_lengths=(grid.q_len, grid.kv_len),
        kv_num_blocks=whole(kv.partial_num, nq),
        kv_indices=whole(kv.partial_idx, nq, nkv),
        full_kv_num_blocks=whole(kv.full_num, nq),
        full_kv_indices=whole(kv.full_idx, nq, nkv),
        q_num_blocks=whole(q.partial_num, nkv),
        q_indices=whole(q.partial_idx, nkv, nq),
        full_q_num_blocks=whole(q.full_num, nkv),
        full_q_indices=whole(q.full_idx, nkv, nq),
        BLOCK_SIZE=(grid.q_block, grid.kv_block),
        mask_mod=mask_mod,
    )


def _empty_sides(rows: int, heads: int, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """A grid with no q or no kv blocks (Q_LEN or KV_LEN 0): nothing listed; every line is
    its unlisted blocks ascending, as torch writes them."""
    nq, nkv, dev = grid.num_q_blocks, grid.num_kv_blocks, grid.device

    def side(n: int, m: int) -> tuple[Tensor, Tensor]:
        count = torch.zeros((rows, heads, n), dtype=torch.int32, device=dev)
        order = torch.arange(m, dtype=torch.int32, device=dev).expand(rows, heads, n, m)
        return count, order.contiguous()

    kv_num, kv_idx = side(nq, nkv)
    q_num, q_idx = side(nkv, nq)
    return (
        Ordered(kv_num, kv_idx, kv_num.clone(), kv_idx.clone()),
        Ordered(q_num, q_idx, q_num.clone(), q_idx.clone()),
    )


def ordered_sides(mask: Mask, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """Both sides' ordered tensors: in closed form from the intervals at block edges where
    the mask's intervals are monotone (flexmask.ranges), else from the classified tiles."""
    if grid.num_q_blocks == 0 or grid.num_kv_blocks == 0:
        grid.refined[0] = 0
        rows = ranges.built_rows(mask, grid)
        return _empty_sides(rows, grid.heads if mask.head_dependent else 1, grid)
    if mask._has_monotone_intervals():
        grid.refined[0] = 0
        return ranges.ordered_sides(mask, grid)
    return ordered_from_codes(classify_blocks(mask, grid).codes)


def build_threads() -> int:
    """Intra-op threads a CPU build runs with: FLEXMASK_BUILD_THREADS, default 1."""
    raw = os.environ.get(ENV_BUILD_THREADS, "1").strip()
    try:
        threads = int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {ENV_BUILD_THREADS}={raw!r} must be a whole number >= 1"
        ) from None
    if threads < 1:
        raise ValueError(f"environment variable {ENV_BUILD_THREADS}={raw!r} must be >= 1")
    return threads


@contextlib.contextmanager
def _cpu_threads(device: torch.device) -> Iterator[None]:
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


def build(mask: Mask, grid: BlockGrid) -> BlockMask:
    """Builds the BlockMask of a validated mask on a validated grid."""
    with _cpu_threads(torch.device(grid.device)):
        # The lookups the mask_mod keeps are allocated before the build's temporaries.
        mask_mod = window_mask_mod(mask._lower(grid.length, grid.device).mask_mod, grid)
        if grid.per_row_offsets and not mask._has_monotone_intervals():
            kv, q = _row_by_row(mask, grid)
        else:
            kv, q = ordered_sides(mask, grid)
        return assemble(kv, q, grid, mask_mod)


def window_mask_mod(mask_mod: MaskMod, grid: BlockGrid) -> MaskMod:
    """The mask_mod of the grid's window: local indices shifted by the offsets (held as
    tensors); the mask's own where the window starts at (0, 0)."""
    if not grid.per_row_offsets and grid.q_offset == 0 and grid.kv_offset == 0:
        return mask_mod

    def held(offset: int | Tensor) -> Tensor:
        if isinstance(offset, Tensor):
            return offset.view(-1).expand(grid.batch).contiguous()
        return torch.tensor(offset, dtype=torch.int64, device=grid.device)

    return ShiftedMod(mask_mod, held(grid.q_offset), held(grid.kv_offset))


def _row_by_row(mask: Mask, grid: BlockGrid) -> tuple[Ordered, Ordered]:
    """Per-row windows on the tile path: each row's window built with its own offsets and
    its row kept (B builds; the closed form takes per-row offsets in one)."""
    q_off = grid.q_offset.view(-1).tolist()  # type: ignore[union-attr]
    kv_off = grid.kv_offset.view(-1).tolist()  # type: ignore[union-attr]
    parts = []
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
        sides = ordered_sides(mask, one)
        parts.append([t[row : row + 1] if t.shape[0] > 1 else t for side in sides for t in side])
    stacked = [torch.cat(column) for column in zip(*parts, strict=True)]
    return Ordered(*stacked[:4]), Ordered(*stacked[4:])


_SIDES = (
    ("kv_num_blocks", "kv_indices"),
    ("full_kv_num_blocks", "full_kv_indices"),
    ("q_num_blocks", "q_indices"),
    ("full_q_num_blocks", "full_q_indices"),
)


def same_blocks(a: BlockMask, b: BlockMask) -> bool:
    """True if two BlockMasks list the same blocks: equal lengths and block sizes, and for
    the partial and full blocks of both sides, equal counts and per row the same indices in
    the same order.

    Entries of the index tensors past each row's count are not compared: kernels,
    ``to_dense`` and ``from_kv_blocks`` never read them (``BlockMask._adjust`` does).
    ``flexmask.create_block_mask`` writes them as torch does — the unlisted blocks
    ascending — so its tensors are also ``torch.equal`` to torch's; this comparison also
    accepts BlockMasks from other writers (``from_kv_blocks`` with any tail).

    Example:
        >>> import flexmask
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> mask = flexmask.causal() & flexmask.document([300, 200])
        >>> ours = flexmask.create_block_mask(mask, 1, 1, 512, 512, device="cpu")
        >>> theirs = create_block_mask(mask.mask_mod, 1, 1, 512, 512, device="cpu")
        >>> flexmask.same_blocks(ours, theirs)
        True
    """
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, BlockMask):
            raise TypeError(
                f"{name} must be a torch BlockMask (from create_block_mask), "
                f"got {type(value).__name__}"
            )
    if tuple(a.seq_lengths) != tuple(b.seq_lengths) or tuple(a.BLOCK_SIZE) != tuple(b.BLOCK_SIZE):
        return False
    for num_name, idx_name in _SIDES:
        num_a, num_b = getattr(a, num_name), getattr(b, num_name)
        idx_a, idx_b = getattr(a, idx_name), getattr(b, idx_name)
        if num_a is None or num_b is None:
            if num_a is not num_b:
                return False
            continue
        if num_a.shape != num_b.shape or idx_a.shape != idx_b.shape:
            return False
        if not torch.equal(num_a, num_b.to(num_a.device)):
            return False
        listed = torch.arange(idx_a.shape[-1], device=idx_a.device) < num_a.unsqueeze(-1)
        if not torch.equal(idx_a[listed], idx_b.to(idx_a.device)[listed]):
            return False
    return True


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
) -> BlockMask:
    """Drop-in for ``torch.nn.attention.flex_attention.create_block_mask``, built from structure.

    For a flexmask expression the result lists the blocks torch's
    ``create_block_mask(mask.mask_mod, ...)`` lists — the same counts, the same blocks per row
    in the same order, the same full/partial split (``same_blocks``) — without evaluating the
    mask on every element. An ``&`` of interval pieces (causal, document, sliding window,
    prefix, padding) is written in closed form from the intervals at block edges
    (``flexmask.ranges``); any other expression has its tiles classified from each piece's data
    and is evaluated only on tiles the structure leaves undecided. A mask that does not depend
    on the batch row (or head) is built once and broadcast as a view. A plain mask_mod
    callable is passed to torch.

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

    Returns:
        A ``torch.nn.attention.flex_attention.BlockMask`` whose ``mask_mod`` captures only
        lookups sized by the sequence length.

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
            return torch_create_block_mask(
                mask,
                B,
                H,
                Q_LEN,
                KV_LEN,
                device=device or default_device(),
                BLOCK_SIZE=BLOCK_SIZE,
            )
        raise TypeError(
            f"mask must be a flexmask Mask or a mask_mod callable, got {type(mask).__name__}"
        )
    grid = make_grid(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, q_offset, kv_offset)
    return build(mask, grid)
