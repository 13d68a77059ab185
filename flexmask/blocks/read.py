"""Reading a BlockMask: the one place that reads its tensors — which blocks it lists (its
block codes, checked for a kernel), its bytes, and whether two list the same blocks — for the
builder's tests, plot, cache, the backends' plan and the block-sparse path alike.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.blocks.codes import CODE_DTYPE, FULL, PARTIAL

SIDES = (
    ("kv_num_blocks", "kv_indices"),
    ("full_kv_num_blocks", "full_kv_indices"),
    ("q_num_blocks", "q_indices"),
    ("full_q_num_blocks", "full_q_indices"),
)
"""The (counts, indices) pairs of a BlockMask: kv side partial and full, then q side."""

BLOCK_FIELDS = tuple(name for side in SIDES for name in side)
"""The eight tensors of a BlockMask, in torch's constructor order."""

WRITE_ORDER_FIELDS = ("dq_write_order", "dq_write_order_full")
"""The dQ write-order tensors torch >= 2.13 adds with ``compute_dq_write_order=True``."""


def block_mask_nbytes(block_mask: BlockMask) -> int:
    """Bytes held by a BlockMask's tensors, each storage counted once (views share one)."""
    seen: dict[int, int] = {}
    for name in BlockMask._TENSOR_ATTRS if hasattr(BlockMask, "_TENSOR_ATTRS") else ():
        tensor = getattr(block_mask, name, None)
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def kv_lists(block_mask: BlockMask) -> list[tuple[Tensor, Tensor, str, int]]:
    """The kv side's block lists as ``(counts, indices, name of the indices, code)``: the
    partial blocks (PARTIAL), then the full ones (FULL) where the BlockMask has them."""
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, "kv_indices", PARTIAL)]
    if block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None:
        lists.append(
            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, "full_kv_indices", FULL)
        )
    return lists


def kv_codes(
    block_mask: BlockMask, *, checked: bool = False, at: tuple[int, int] | None = None
) -> Tensor:
    """Every tile's code (EMPTY / PARTIAL / FULL, int8) as the BlockMask lists it, from its kv
    side: ``(B, H, num_q_blocks, num_kv_blocks)`` for its own B and H (1 where it broadcasts).
    Only each row's first ``count`` indices are read, as the kernels read them; a block
    listed both partial and full reads as full.

    ``checked``: a BlockMask from anywhere (a kernel about to read it): its lists' shapes,
    counts and listed indices are checked first, a ValueError naming the field otherwise.
    ``at``: a (row, head) index into the BlockMask's own B and H: only that one's lists are
    read, ``(1, 1, num_q_blocks, num_kv_blocks)`` (a picture of one head of a long mask
    needs no int64 copy of every head's indices).
    """
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = (int(size) for size in block_mask.BLOCK_SIZE)
    lists = kv_lists(block_mask)
    if at is not None:
        b, h = at
        lists = [(n[b : b + 1, h : h + 1], i[b : b + 1, h : h + 1], x, c) for n, i, x, c in lists]
    return _codes(lists, (q_len, q_block, "Q_LEN"), (kv_len, kv_block, "KV_LEN"), checked)


def listed_counts(block_mask: BlockMask) -> tuple[int, int]:
    """How many blocks the kv side lists partial and full, summed over its rows and heads
    (each q block's ``count``, as the kernels read them; 0 full where it has no full list)."""
    q_len = block_mask.seq_lengths[0]
    num_q = -(-q_len // int(block_mask.BLOCK_SIZE[0]))
    partial, full = 0, 0
    for counts, _, _, code in kv_lists(block_mask):
        listed = int(counts[:, :, :num_q].sum())
        partial, full = (partial + listed, full) if code == PARTIAL else (partial, full + listed)
    return partial, full


def q_lists(block_mask: BlockMask) -> list[tuple[Tensor, Tensor, str, int]] | None:
    """The q side's block lists as ``(counts, indices, name of the indices, code)``, as
    :func:`kv_lists`; None where the BlockMask has no q side (``from_kv_blocks(...,
    compute_q_blocks=False)``: forward only)."""
    if block_mask.q_num_blocks is None or block_mask.q_indices is None:
        return None
    lists = [(block_mask.q_num_blocks, block_mask.q_indices, "q_indices", PARTIAL)]
    if block_mask.full_q_num_blocks is not None and block_mask.full_q_indices is not None:
        lists.append(
            (block_mask.full_q_num_blocks, block_mask.full_q_indices, "full_q_indices", FULL)
        )
    return lists


def q_codes(block_mask: BlockMask, *, checked: bool = False) -> Tensor | None:
    """Every tile's code as the BlockMask's q side lists it — what torch's backward reads
    for dK and dV — laid out as :func:`kv_codes` lays out the kv side's, ``(B, H,
    num_q_blocks, num_kv_blocks)``, so the two compare with ``torch.equal``; None without a
    q side. ``checked`` as for :func:`kv_codes`.

    Torch writes the q side as the kv side's transpose (``BlockMask.from_kv_blocks``); one
    written otherwise makes the backward disagree with the forward, silently.
    """
    lists = q_lists(block_mask)
    if lists is None:
        return None
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = (int(size) for size in block_mask.BLOCK_SIZE)
    codes = _codes(lists, (kv_len, kv_block, "KV_LEN"), (q_len, q_block, "Q_LEN"), checked)
    return codes.transpose(-1, -2)


def _codes(
    lists: list[tuple[Tensor, Tensor, str, int]],
    lines: tuple[int, int, str],
    listed_along: tuple[int, int, str],
    checked: bool,
) -> Tensor:
    """``(B, H, num_lines, num_listed)`` codes from one side's lists: each line (a q block on
    the kv side, a kv block on the q side) lists blocks along the other axis. ``lines`` and
    ``listed_along`` are (length, block size, torch's name of the length)."""
    line_len, line_block, line_name = lines
    other_len, other_block, other_name = listed_along
    num_lines, num_other = -(-line_len // line_block), -(-other_len // other_block)
    if checked:
        _check_shapes(lists, line_len, line_block, num_lines, line_name)
    batch, heads = lists[0][1].shape[:2]
    device = lists[0][1].device
    # One spare column takes the unlisted entries; it is dropped at the end.
    codes = torch.zeros(batch, heads, num_lines, num_other + 1, dtype=CODE_DTYPE, device=device)
    for num_blocks, indices, name, code in lists:
        count = num_blocks[:, :, :num_lines].long()
        index = indices[:, :, :num_lines].long()
        slots = index.shape[-1]
        listed = torch.arange(slots, device=device) < count.unsqueeze(-1)
        if checked:
            if count.numel() and (int(count.min()) < 0 or int(count.max()) > slots):  # B=0
                raise ValueError(f"block_mask's counts for {name} must lie in [0, {slots}]")
            if bool((listed & ((index < 0) | (index >= num_other))).any()):
                side = "kv" if other_name == "KV_LEN" else "q"
                raise ValueError(
                    f"block_mask.{name} points outside the {num_other} {side} blocks of "
                    f"{other_name}={other_len}"
                )
        if slots:
            codes.scatter_(-1, torch.where(listed, index, num_other), code)
    return codes[..., :num_other]


def _check_shapes(
    lists: list[tuple[Tensor, Tensor, str, int]],
    line_len: int,
    line_block: int,
    num_lines: int,
    line_name: str,
) -> None:
    dims: set[tuple[int, int]] = set()
    side = "q" if line_name == "Q_LEN" else "kv"
    listed = "kv" if side == "q" else "q"
    for num, idx, name, _ in lists:
        if num.dim() != 3 or idx.dim() != 4 or idx.shape[:3] != num.shape:
            raise ValueError(
                f"block_mask.{name} must be (B, H, {side}_blocks, max_blocks), got shape "
                f"{tuple(idx.shape)} with counts of shape {tuple(num.shape)}"
            )
        dims.add((idx.shape[0], idx.shape[1]))
        if idx.shape[2] < num_lines:
            raise ValueError(
                f"block_mask.{name} has {idx.shape[2]} {side} blocks but {line_name}={line_len} "
                f"needs {num_lines} of size {line_block}"
            )
    if len(dims) != 1:
        raise ValueError(
            f"block_mask's {listed}_indices and full_{listed}_indices must have the same batch "
            f"and head dims, got {sorted(dims)}"
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
    for num_name, idx_name in SIDES:
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
