"""Pictures of masks: the element mask beside its block classification, as a PNG.

The module is ``flexmask.plotting``; its :func:`plot` is also ``flexmask.plot`` (the module
was ``flexmask.plot`` before 0.2, where the function's name hid it).

matplotlib is an optional extra (``pip install flexmask[plot]``); it is imported only when
:func:`plot` runs. :func:`block_classes` needs only torch and numpy.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask

from flexmask._validate import check_int
from flexmask.algebra import Mask
from flexmask.blocks import EMPTY, FULL, PARTIAL, kv_codes
from flexmask.builders import create_block_mask
from flexmask.pieces import VmappedMod
from flexmask.runtime import LazyBlockMask

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "CLASS_COLORS",
    "CLASS_NAMES",
    "DEFAULT_MAX_ELEMENTS",
    "DPI",
    "FIGSIZE",
    "MAX_PIXELS",
    "block_classes",
    "plot",
]

"""The codes :func:`block_classes` returns."""

CLASS_NAMES = ("empty", "partial", "full")
CLASS_COLORS = ("#f2f2f2", "#f4a261", "#264653")
"""Colours of empty, partial and full blocks in the right-hand panel."""

FIGSIZE = (10.0, 4.8)
DPI = 100
"""Every PNG is ``FIGSIZE * DPI`` = 1000 x 480 pixels, whatever the sequence length."""

DEFAULT_MAX_ELEMENTS = 1 << 22
"""Most (q, kv) elements evaluated for the left panel; longer masks are sampled on a stride."""

MAX_PIXELS = 512
"""Both pictures are pooled down to at most this many cells per side (the panels are about
480 pixels wide): the elements by max, the blocks to a class per cell."""


def block_classes(block_mask: BlockMask, batch: int = 0, head: int = 0) -> np.ndarray:
    """Each tile's class in a BlockMask: 0 empty, 1 partial (mask_mod applied), 2 full.

    Read from ``kv_num_blocks``/``kv_indices`` (partial tiles) and
    ``full_kv_num_blocks``/``full_kv_indices`` (full tiles) of one batch row and head. A batch
    or head dimension of size 1 is broadcast, as flex_attention broadcasts it.

    Args:
        block_mask: a torch BlockMask (from torch's or flexmask's ``create_block_mask``).
        batch: the batch row to read.
        head: the head to read.

    Returns:
        An ``(num_q_blocks, num_kv_blocks)`` int8 numpy array.

    Example:
        >>> import flexmask
        >>> from flexmask.plotting import block_classes
        >>> bm = flexmask.create_block_mask(flexmask.causal(), 1, 1, 6, 6, "cpu", BLOCK_SIZE=2)
        >>> block_classes(bm).tolist()
        [[1, 0, 0], [2, 1, 0], [2, 2, 1]]
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a torch BlockMask, got {type(block_mask).__name__}; for a "
            f"flexmask Mask build one first: flexmask.create_block_mask(mask, B, H, Q_LEN, KV_LEN)"
        )
    b = _broadcast_index(batch, block_mask.kv_num_blocks.shape[0], "batch")
    h = _broadcast_index(head, block_mask.kv_num_blocks.shape[1], "head")
    # Only this row's and head's lists: reading every one at B = H = 2 and 131k tokens in
    # blocks of 16 copied 2 GiB of indices to draw one.
    classes = kv_codes(block_mask, at=(b, h))[0, 0].to("cpu").contiguous()
    return classes.numpy()


def plot(
    mask_or_block_mask: Mask | BlockMask | LazyBlockMask,
    path: str | os.PathLike[str],
    *,
    Q_LEN: int | None = None,
    KV_LEN: int | None = None,
    B: int | None = None,
    H: int | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    batch: int = 0,
    head: int = 0,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    title: str | None = None,
) -> str:
    """Writes a PNG: the element mask (left) beside its block classification (right).

    The left panel is what flex_attention computes for one batch row and head: the
    ``mask_mod`` inside partial tiles, every element of full tiles, nothing in empty tiles.
    The right panel colours each tile empty, partial or full. The title gives the block
    sparsity (the share of tiles flex_attention skips).

    Long sequences stay cheap: at most ``max_elements`` elements are evaluated (on a stride
    beyond that), only the drawn row's and head's blocks are read, and both pictures are
    pooled to at most 512 cells per side: an element cell is dark if any element it stands
    for attends, a block cell is empty or full where every tile it stands for is, else
    partial. The PNG is always 1000 x 480 pixels.

    Args:
        mask_or_block_mask: a flexmask ``Mask`` (``Q_LEN`` and ``KV_LEN`` required; built on
            the CPU unless its data lives elsewhere), a torch ``BlockMask``, or a
            ``flexmask.lazy`` handle (its BlockMask is used if built, else built aside,
            leaving the handle and the cache untouched).
        path: where to write the PNG.
        Q_LEN: query length, for a Mask.
        KV_LEN: key/value length, for a Mask (default ``Q_LEN``).
        B: batch size, for a Mask (None: 1, or its number of per-row values).
        H: number of heads, for a Mask (None: 1).
        BLOCK_SIZE: tile size, for a Mask.
        batch: the batch row to draw.
        head: the head to draw.
        max_elements: most (q, kv) elements evaluated for the left panel.
        title: the figure title (None: the mask's repr and the lengths).

    Returns:
        ``path``, as a string.

    Raises:
        ImportError: matplotlib is not installed (``pip install flexmask[plot]``).

    Example:
        >>> import flexmask, tempfile, os
        >>> mask = flexmask.causal() & flexmask.document([300, 212])
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     png = flexmask.plot(mask, os.path.join(tmp, "mask.png"), Q_LEN=512)
        ...     os.path.getsize(png) > 0
        True
    """
    try:
        import numpy as np

        # The Figure API, not pyplot: no global state, no backend switch in the caller's
        # session, and no window; savefig picks the Agg canvas for a .png path.
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("flexmask.plot needs matplotlib: pip install flexmask[plot]") from err

    if (
        isinstance(max_elements, bool)
        or not isinstance(max_elements, numbers.Integral)  # numpy integers too
        or max_elements < 1
    ):
        raise ValueError(f"max_elements must be an int >= 1, got {max_elements!r}")
    max_elements = int(max_elements)
    block_mask, label = _block_mask_of(mask_or_block_mask, Q_LEN, KV_LEN, B, H, BLOCK_SIZE)
    if min(block_mask.seq_lengths) < 1:
        raise ValueError(
            f"a BlockMask with no rows or columns has nothing to draw: its (Q_LEN, KV_LEN) is "
            f"{tuple(block_mask.seq_lengths)}, both must be >= 1"
        )
    classes = block_classes(block_mask, batch, head)
    elements = _element_picture(block_mask, classes, batch, head, max_elements)
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    sparsity = 100.0 * float((classes == EMPTY).mean())

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    left, right = fig.subplots(1, 2)
    left.imshow(
        np.ascontiguousarray(elements),
        cmap="Greys",
        vmin=0,
        vmax=1,
        interpolation="nearest",
        extent=(0, kv_len, q_len, 0),
        aspect="auto",
    )
    left.set_title("elements (dark: q attends kv)")
    right.imshow(
        _class_picture(classes, MAX_PIXELS),
        cmap=ListedColormap(CLASS_COLORS),
        vmin=0,
        vmax=2,
        interpolation="nearest",
        aspect="auto",
        extent=(0, classes.shape[1] * kv_block, classes.shape[0] * q_block, 0),
    )
    right.set_title(f"blocks of {q_block} x {kv_block}")
    right.legend(
        handles=[
            Patch(facecolor=c, edgecolor="black", label=n)
            for n, c in zip(CLASS_NAMES, CLASS_COLORS, strict=True)
        ],
        loc="upper right",
        fontsize="small",
        framealpha=0.9,
    )
    for ax in (left, right):
        ax.set_xlabel("kv_idx")
        ax.set_ylabel("q_idx")
    heading = title if title is not None else f"{label}  ({q_len} x {kv_len})"
    fig.suptitle(f"{heading}\nblock sparsity {sparsity:.1f}% (batch {batch}, head {head})")
    fig.savefig(os.fspath(path), dpi=DPI)
    return os.fspath(path)


def _broadcast_index(index: int, size: int, name: str) -> int:
    if isinstance(index, bool) or not isinstance(index, numbers.Integral) or index < 0:
        raise ValueError(f"{name} must be an int >= 0, got {index!r}")
    index = int(index)
    if size == 1:
        return 0  # broadcast, as flex_attention does
    if index >= size:
        raise ValueError(
            f"{name}={index} is out of range: the BlockMask's {name} dimension has size {size}"
        )
    return index


def _block_mask_of(
    obj: Any,
    Q_LEN: int | None,
    KV_LEN: int | None,
    B: int | None,
    H: int | None,
    BLOCK_SIZE: int | tuple[int, int],
) -> tuple[BlockMask, str]:
    """The BlockMask to draw and a label for the title."""
    if isinstance(obj, LazyBlockMask):  # first: a handle is a BlockMask too
        if obj.built:
            return obj.block_mask, repr(obj.mask)
        bm = create_block_mask(
            obj.mask, obj.B, obj.H, obj.Q_LEN, obj.KV_LEN, obj.mask.device or "cpu", obj.BLOCK_SIZE
        )
        return bm, repr(obj.mask)
    if isinstance(obj, BlockMask):
        name = getattr(obj.mask_mod, "__name__", "mask_mod")
        return obj, f"BlockMask({name})"
    if isinstance(obj, Mask):
        if Q_LEN is None:
            raise TypeError(
                "plot(mask, path) needs the lengths for a flexmask Mask: "
                "plot(mask, path, Q_LEN=..., KV_LEN=...) (or pass a BlockMask)"
            )
        kv_len = Q_LEN if KV_LEN is None else KV_LEN
        for value, name in ((Q_LEN, "Q_LEN"), (kv_len, "KV_LEN")):
            check_int(value, name, minimum=1)  # no rows or columns: nothing to draw
        bm = create_block_mask(obj, B, H, Q_LEN, kv_len, obj.device or "cpu", BLOCK_SIZE)
        return bm, repr(obj)
    raise TypeError(
        "plot takes a flexmask Mask, a torch BlockMask or a flexmask.lazy handle, got "
        f"{type(obj).__name__}"
    )


def _element_picture(
    block_mask: BlockMask, classes: np.ndarray, batch: int, head: int, max_elements: int
) -> np.ndarray:
    """(rows, cols) float array in {0, 1}: what flex computes, sampled and max-pooled."""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    _broadcast_index(batch, block_mask.kv_num_blocks.shape[0], "batch")
    _broadcast_index(head, block_mask.kv_num_blocks.shape[1], "head")
    mod = block_mask.mask_mod

    # create_mask numbers rows and heads from 0; shift them onto the ones drawn. flex passes
    # the real row and head to the mask_mod even where the BlockMask broadcasts.

    def at_row(b_idx: Tensor, h_idx: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mod(b_idx + batch, h_idx + head, q_idx, kv_idx)

    stride = max(1, math.ceil(math.sqrt(q_len * kv_len / max_elements)))
    device = block_mask.kv_num_blocks.device
    if stride == 1:
        attends = create_mask(at_row, 1, 1, q_len, kv_len, device=device)[0, 0]
        q_idx, kv_idx = torch.arange(q_len), torch.arange(kv_len)
    else:
        # Too many elements to evaluate: sample every `stride`-th query and key, vmapped the
        # way create_mask vmaps (0-d indices inside the mask_mod, indexing made index ops).
        q_idx, kv_idx = torch.arange(0, q_len, stride), torch.arange(0, kv_len, stride)
        zero = torch.zeros((1, 1), dtype=torch.int64, device=device)
        attends = VmappedMod(at_row)(zero, zero, q_idx.to(device)[:, None], kv_idx.to(device))
    code = torch.from_numpy(classes).long()[
        (q_idx // q_block).view(-1, 1), (kv_idx // kv_block).view(1, -1)
    ]
    attends = (attends.to("cpu") & (code == PARTIAL)) | (code == FULL)
    return _max_pool(attends.float(), MAX_PIXELS).numpy()


def _class_picture(classes: np.ndarray, max_cells: int) -> np.ndarray:
    """The block classes as drawn: at most ``max_cells`` cells per side, C-contiguous. A cell
    that stands for several tiles is empty or full where all of them are, else partial.

    Drawn whole, a BlockMask of 8192 x 8192 tiles (131k tokens in blocks of 16, or 1M in
    blocks of 128) had matplotlib make 2 GiB RGBA copies for a panel of 480 pixels, and fail
    with "Input array could not be made C-contiguous" where that memory was not there."""
    tiles = torch.from_numpy(classes).float()
    most = _max_pool(tiles, max_cells)
    least = -_max_pool(-tiles, max_cells)
    picture = torch.where(most == least, most, float(PARTIAL)).to(torch.int8)
    return picture.contiguous().numpy()


def _max_pool(picture: Tensor, max_cells: int) -> Tensor:
    rows, cols = picture.shape
    kr, kc = math.ceil(rows / max_cells), math.ceil(cols / max_cells)
    if kr == kc == 1:
        return picture
    pooled = torch.nn.functional.max_pool2d(
        picture[None, None], kernel_size=(kr, kc), stride=(kr, kc), ceil_mode=True
    )
    return pooled[0, 0]
