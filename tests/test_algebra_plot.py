"""flexmask.plot (module flexmask.plotting): PNGs of the right size, and block classes equal
to an independent oracle."""

from __future__ import annotations

import builtins
import pickle
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import create_mask

import flexmask
from flexmask.plotting import DPI, FIGSIZE, MAX_PIXELS, block_classes

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402

PNG_SHAPE = (round(FIGSIZE[1] * DPI), round(FIGSIZE[0] * DPI))


def reference_classes(mask_mod, B, H, q_len, kv_len, block, batch, head) -> np.ndarray:
    """Plain oracle: evaluate every element, then reduce each tile (ragged edge tiles are
    never full, as torch pads them with masked elements)."""
    dense = create_mask(mask_mod, B, H, q_len, kv_len, device="cpu")[batch, head]
    nq, nkv = -(-q_len // block), -(-kv_len // block)
    out = np.zeros((nq, nkv), dtype=np.int8)
    for i in range(nq):
        for j in range(nkv):
            tile = dense[i * block : (i + 1) * block, j * block : (j + 1) * block]
            complete = tile.shape == (block, block)
            if bool(tile.all()) and complete:
                out[i, j] = 2
            elif bool(tile.any()):
                out[i, j] = 1
    return out


MASKS = {
    "causal": lambda: flexmask.causal(),
    "document": lambda: flexmask.causal() & flexmask.document([[50, 90, 60], [200]]),
    "window": lambda: flexmask.causal() & flexmask.sliding_window(40),
    "prefix": lambda: flexmask.causal() | flexmask.prefix([70, 3]),
    "padding": lambda: flexmask.padding([130, 200]),
    "tree": lambda: flexmask.tree([-1, 0, 1, 0, 3, 4, 0] + list(range(6, 150))),
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("batch", [0, 1])
def test_block_classes_match_torch_and_oracle(name, batch):
    mask = MASKS[name]()
    q_len = kv_len = 200  # not a multiple of the block size
    block = 32
    ours = flexmask.create_block_mask(mask, 2, 1, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    theirs = torch_create_block_mask(mask.mask_mod, 2, 1, q_len, kv_len, "cpu", BLOCK_SIZE=block)
    expected = reference_classes(mask.mask_mod, 2, 1, q_len, kv_len, block, batch, 0)
    np.testing.assert_array_equal(block_classes(theirs, batch, 0), expected)
    np.testing.assert_array_equal(block_classes(ours, batch, 0), expected)


def test_block_classes_broadcasts_size_one_dims():
    cache = flexmask.MaskCache(maxsize=1)
    bm = cache.get(flexmask.causal(), 4, 8, 64, 64, "cpu", BLOCK_SIZE=16)
    assert bm.kv_num_blocks.shape[:2] == (1, 1)  # cached BlockMasks keep B = H = 1
    np.testing.assert_array_equal(block_classes(bm, 3, 7), block_classes(bm, 0, 0))


def test_block_classes_rejects_out_of_range_rows_and_non_block_masks():
    bm = flexmask.create_block_mask(flexmask.padding([10, 20]), None, 1, 32, 32, "cpu")
    with pytest.raises(ValueError, match="batch=2"):
        block_classes(bm, 2, 0)
    with pytest.raises(TypeError, match="BlockMask"):
        block_classes(flexmask.causal())


def test_plot_mask_writes_png_of_fixed_size(tmp_path):
    path = flexmask.plot(
        flexmask.causal() & flexmask.document([100, 156]), tmp_path / "m.png", Q_LEN=256
    )
    assert path == str(tmp_path / "m.png")
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == PNG_SHAPE
    assert image.std() > 0.05  # something was drawn


def test_plot_torch_block_mask_and_row_choice(tmp_path):
    mask = flexmask.causal() & flexmask.padding([100, 30])
    bm = torch_create_block_mask(mask.mask_mod, 2, 1, 128, 128, "cpu", BLOCK_SIZE=16)
    a = matplotlib.image.imread(flexmask.plot(bm, tmp_path / "row0.png", batch=0))
    b = matplotlib.image.imread(flexmask.plot(bm, tmp_path / "row1.png", batch=1))
    assert a.shape[:2] == b.shape[:2] == PNG_SHAPE
    assert not np.array_equal(a, b)


def test_plot_lazy_handle_leaves_it_unbuilt(tmp_path):
    cache = flexmask.MaskCache(maxsize=4)
    handle = flexmask.lazy(
        flexmask.causal() & flexmask.sliding_window(32), 1, 1, 256, 256, "cpu", cache=cache
    )
    flexmask.plot(handle, tmp_path / "lazy.png")
    assert not handle.built and cache.info().entries == 0
    assert (tmp_path / "lazy.png").stat().st_size > 0
    assert pickle.loads(pickle.dumps(handle)).mask == handle.mask


def test_plot_long_sequence_is_sampled(tmp_path):
    # 4096^2 elements with max_elements=2^16: the element panel is evaluated on a stride.
    mask = flexmask.causal() & flexmask.document([1000, 3096])
    path = flexmask.plot(mask, tmp_path / "long.png", Q_LEN=4096, max_elements=1 << 16)
    assert matplotlib.image.imread(path).shape[:2] == PNG_SHAPE


def test_plot_errors_teach(tmp_path):
    with pytest.raises(TypeError, match="Q_LEN"):
        flexmask.plot(flexmask.causal(), tmp_path / "x.png")
    with pytest.raises(TypeError, match="BlockMask"):
        flexmask.plot(torch.ones(3, 3), tmp_path / "x.png")
    with pytest.raises(ValueError, match="max_elements"):
        flexmask.plot(flexmask.causal(), tmp_path / "x.png", Q_LEN=8, max_elements=0)


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install flexmask\[plot\]"):
        flexmask.plot(flexmask.causal(), tmp_path / "x.png", Q_LEN=8)


def _drawn(monkeypatch):
    """Every array handed to imshow, in order (elements, then block classes)."""
    from matplotlib.axes import Axes

    drawn = []
    imshow = Axes.imshow

    def spy(self, X, *args, **kwargs):
        drawn.append(X)
        return imshow(self, X, *args, **kwargs)

    monkeypatch.setattr(Axes, "imshow", spy)
    return drawn


def test_plot_of_a_long_mask_draws_small_contiguous_pictures(tmp_path, monkeypatch):
    # Issue #29: 131k tokens in blocks of 16 (8192^2 tiles) failed in matplotlib with
    # "Input array could not be made C-contiguous": the tiles were drawn whole (2 GiB of
    # RGBA for a 480-pixel panel), from a strided view. 32k in blocks of 16 at B = H = 2
    # draws the same way: 2048^2 tiles.
    drawn = _drawn(monkeypatch)
    n = 32768
    mask = flexmask.causal() & flexmask.document([[n // 3, n - n // 3], [n]])
    bm = flexmask.create_block_mask(mask, 2, 2, n, n, "cpu", BLOCK_SIZE=16)
    path = flexmask.plot(bm, tmp_path / "long.png", batch=1, head=1)
    assert matplotlib.image.imread(path).shape[:2] == PNG_SHAPE
    assert len(drawn) == 2
    for picture in drawn:
        assert max(picture.shape) <= MAX_PIXELS, picture.shape
        assert picture.flags["C_CONTIGUOUS"]


def test_block_picture_is_one_class_per_cell(tmp_path, monkeypatch):
    # A cell standing for several tiles is empty or full where all of them are, else
    # partial: 9 x 7 tiles pooled to cells of 3 x 2 tiles (at most 4 per side).
    monkeypatch.setattr(sys.modules["flexmask.plotting"], "MAX_PIXELS", 4)
    drawn = _drawn(monkeypatch)
    mask = flexmask.causal() & flexmask.document([40, 20, 52])
    bm = flexmask.create_block_mask(mask, 1, 1, 9 * 16, 7 * 16, "cpu", BLOCK_SIZE=16)
    flexmask.plot(bm, tmp_path / "cells.png")
    tiles = block_classes(bm)
    assert tiles.shape == (9, 7) and len(set(tiles.flat)) == 3
    expected = np.zeros((3, 4), dtype=np.int8)
    for i in range(3):
        for j in range(4):
            kinds = set(tiles[3 * i : 3 * i + 3, 2 * j : 2 * j + 2].flat)
            expected[i, j] = kinds.pop() if len(kinds) == 1 else 1
    np.testing.assert_array_equal(drawn[1], expected)


def test_block_classes_of_each_row_and_head_match_the_oracle():
    mask = flexmask.per_head(flexmask.causal(), flexmask.sliding_window(20)) & flexmask.padding(
        [90, 130]
    )
    bm = flexmask.create_block_mask(mask, 2, 4, 150, 150, "cpu", BLOCK_SIZE=32)
    for b in range(2):
        for h in range(4):
            expected = reference_classes(mask.mask_mod, 2, 4, 150, 150, 32, b, h)
            classes = block_classes(bm, b, h)
            assert classes.flags["C_CONTIGUOUS"]
            np.testing.assert_array_equal(classes, expected, f"batch {b} head {h}")
