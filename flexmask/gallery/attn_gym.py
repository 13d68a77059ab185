"""attention-gym's mask generators (``attn_gym/masks``), built from pieces.

Each function takes its generator's name less ``generate_`` and ``_mask_mod`` and its
arguments, and returns the same mask as a :class:`~flexmask.Mask` composed of pieces:

* ``causal`` (``causal_mask``): ``causal()``;
* ``sliding_window(window_size)``, ``window_size`` keys back: ``causal() &
  sliding_window(window_size + 1)``;
* ``prefix_lm(prefix_length)``: ``causal() | prefix(prefix_length)``;
* ``packed_causal_doc(offsets)``: ``causal() & document(lengths)``;
* ``shared_prefix(offsets, prefix_document_id)``, one prompt and N continuations packed:
  ``tree(parents)``, each continuation hung under the last token of its prompt;
* ``global_sliding_window(window_size, is_global)``, Longformer: ``sliding_window(window_size
  + 1) | global_tokens(is_global)``;
* ``dilated_sliding_window(window_size, dilation)``: ``sliding_window(window_size + 1) &
  dilated(dilation)``;
* ``block_diffusion(seq_len, block_size)``, BD3-LM's training mask over ``2 * seq_len``;
* ``doc_mask(mask_mod, offsets)``, a mask of ``q_idx - kv_idx`` inside each packed document:
  ``document(lengths) & mask``;
* ``jetspec_tree_causal(prefix_length, ancestor_matrix)``, JetSpec's draft tree, queries
  numbered from 0 against keys after the prefix: ``prefix(prefix_length) | selected(picks,
  tile=1)``;
* ``vision_cross_attention(intervals, image_token_length)``, Flamingo's text-to-image
  cross-attention: ``selected(picks, tile=(t, image_token_length))``;
* ``spatial_head(...)``, Sparse VideoGen's spatial head: ``sliding_window(band) |
  global_tokens(prompt)`` (``| prefix(...)`` with a sink);
* ``vsa(topk_indices, tile_numel, variable_block_sizes)``, video sparse attention's top-k
  tiles: ``selected(topk_indices, tile=tile_numel)``;
* ``sta_2d(...)``, ``sta_3d(...)``, sliding tile attention: ``selected(window picks,
  tile=tile_numel)`` and the text's rows and columns as ``prefix``/``padding`` terms.

Not here: ``jetspec_training`` (its queries' blocks sit ``prefix_length`` keys after them, a
shift no piece holds, and its length is not an argument), ``natten`` (2-D neighbourhoods of
tokens) and SVG's temporal head (a band of positions modulo a frame); see
docs/gallery.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flexmask.algebra import Mask, leaves
from flexmask.pieces import (
    Causal,
    Dilated,
    Empty,
    Full,
    PositionWindow,
    SlidingWindow,
    dilated,
    document,
    full,
    global_tokens,
    padding,
    prefix,
    selected,
    tree,
)
from flexmask.pieces import causal as _causal
from flexmask.pieces import sliding_window as _window


def causal() -> Mask:
    """attention-gym's ``causal_mask``: ``kv_idx <= q_idx``.

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.causal().show(3))
        ■ ⬚ ⬚
        ■ ■ ⬚
        ■ ■ ■
    """
    return _causal()


def sliding_window(window_size: int) -> Mask:
    """``generate_sliding_window``: causal, and ``q_idx - kv_idx <= window_size``.

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.sliding_window(1).show(3))
        ■ ⬚ ⬚
        ■ ■ ⬚
        ⬚ ■ ■
    """
    return _causal() & _window(_count(window_size, "window_size") + 1)


def prefix_lm(prefix_length: int) -> Mask:
    """``generate_prefix_lm_mask``: causal, and the first ``prefix_length`` keys to all.

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.prefix_lm(2).show(3))
        ■ ■ ⬚
        ■ ■ ⬚
        ■ ■ ■
    """
    return _causal() | prefix(_count(prefix_length, "prefix_length"))


def packed_causal_doc(offsets: Any) -> Mask:
    """``generate_packed_causal_doc_mask_mod``: causal inside each packed document.

    Args:
        offsets: cumulative token counts ``[0, end_0, end_1, ...]`` (list or 1-D tensor).

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.packed_causal_doc([0, 2, 3]).show(3))
        ■ ⬚ ⬚
        ■ ■ ⬚
        ⬚ ⬚ ■
    """
    ends = _offsets(offsets)
    lengths = [end - start for start, end in zip(ends, ends[1:], strict=False) if end > start]
    return _causal() & document(lengths)


def shared_prefix(offsets: Any, prefix_document_id: Any) -> Mask:
    """``generate_shared_prefix_mask_mod``: packed documents, each causal inside itself, and
    each continuation (a document whose ``prefix_document_id`` is another) seeing all of its
    prefix document. Written as a tree: a continuation's first token hangs under its
    prefix's last token, so the prefix is shared without being copied.

    Args:
        offsets: cumulative token counts ``[0, end_0, ...]``, one more than documents.
        prefix_document_id: per document, its prefix document (itself for a prefix). A
            prefix document must come before its continuations and be its own prefix.

    Raises:
        ValueError: lengths that disagree, a prefix id out of range, after its continuation
            or itself a continuation.

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.shared_prefix([0, 2, 3, 5], [0, 0, 0]).show(5))
        ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚
        ■ ■ ⬚ ■ ⬚
        ■ ■ ⬚ ■ ■
    """
    ends = _offsets(offsets)
    ids = _ints(prefix_document_id, "prefix_document_id")
    if len(ids) + 1 != len(ends):
        raise ValueError(
            f"prefix_document_id must hold one id per document ({len(ends) - 1} from offsets), "
            f"got {len(ids)}"
        )
    parents: list[int] = []
    for doc, (start, end) in enumerate(zip(ends, ends[1:], strict=False)):
        owner = ids[doc]
        if not 0 <= owner < len(ids) or owner > doc or ids[owner] != owner:
            raise ValueError(
                f"prefix_document_id[{doc}] must name a prefix document at or before it that is "
                f"its own prefix (ids[p] == p), got {owner}"
            )
        # The prefix's last token; -1 (a root) for a prefix or an empty one.
        above = ends[owner + 1] - 1 if owner != doc and ends[owner + 1] > ends[owner] else -1
        parents += [above] + list(range(start, end - 1)) if end > start else []
    if not parents:
        raise ValueError("offsets must describe at least one token, got none")
    return tree(parents)


def global_sliding_window(window_size: int, is_global: Any) -> Mask:
    """``generate_global_sliding_window`` (Longformer): ``|q_idx - kv_idx| <= window_size``,
    or a global query or key.

    Args:
        window_size: the window's radius.
        is_global: one bool per token (its length is the sequence length).

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.global_sliding_window(0, [True, False, False]).show(3))
        ■ ■ ■
        ■ ■ ⬚
        ■ ⬚ ■
    """
    return _window(_count(window_size, "window_size") + 1) | global_tokens(is_global)


def dilated_sliding_window(window_size: int, dilation: int) -> Mask:
    """``generate_dilated_sliding_window``: ``|q_idx - kv_idx| <= window_size`` and a
    multiple of ``dilation``.

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.dilated_sliding_window(2, 2).show(4))
        ■ ⬚ ■ ⬚
        ⬚ ■ ⬚ ■
        ■ ⬚ ■ ⬚
        ⬚ ■ ⬚ ■
    """
    return _window(_count(window_size, "window_size") + 1) & dilated(dilation)


def block_diffusion(seq_len: int, block_size: int) -> Mask:
    """``generate_block_diffusion_mask`` (BD3-LM): over ``2 * seq_len`` tokens, noised
    ``[0, seq_len)`` then clean; noised tokens see their own noised block and the clean
    blocks before it, clean tokens the clean blocks up to their own.

    Built as ``document(blocks of both halves) | (~prefix(seq_len) & causal())`` (clean
    blocks to clean ones) ``| (~document(halves) & ~prefix(seq_len) & ~PositionWindow)``
    (noised to earlier clean blocks: block numbers as positions, ``block(kv) < block(q)``).

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.block_diffusion(4, 2).show(8))
        ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ■ ■ ⬚ ⬚
        ⬚ ⬚ ⬚ ⬚ ■ ■ ⬚ ⬚
        ⬚ ⬚ ⬚ ⬚ ■ ■ ⬚ ⬚
        ⬚ ⬚ ⬚ ⬚ ■ ■ ■ ■
        ⬚ ⬚ ⬚ ⬚ ■ ■ ■ ■
    """
    length = _count(seq_len, "seq_len")
    size = _count(block_size, "block_size")
    if length < 1 or size < 1:
        raise ValueError(f"seq_len and block_size must be >= 1, got {length} and {size}")
    blocks = [size] * (length // size) + ([length % size] if length % size else [])
    same_block = document(blocks + blocks)
    clean_keys = ~prefix(length)
    blocks_of = [(i % length) // size for i in range(2 * length)]
    earlier_block = ~PositionWindow(1, blocks_of, keys_ahead=True)
    noised_to_clean = ~document([length, length]) & clean_keys
    return same_block | (clean_keys & _causal()) | (noised_to_clean & earlier_block)


def doc_mask(mask_mod: Any, offsets: Any) -> Mask:
    """``attn_gym/masks/document_mask.py``'s ``generate_doc_mask_mod``: ``mask_mod`` applied
    inside each packed document, in the document's own positions.

    Inside one document a query and a key are shifted by the same start, so a mask that
    reads only ``q_idx - kv_idx`` is the same mask there: ``document(lengths) & mask``.
    ``mask_mod`` must be one of those — a flexmask Mask of ``causal``, ``sliding_window``
    (without positions), ``dilated``, ``full`` and ``empty`` under ``&``, ``|``, ``~`` — or
    attn-gym's ``causal_mask`` or torch's ``noop_mask``, read as ``causal()`` and ``full()``.

    Args:
        mask_mod: the mask inside each document (see above).
        offsets: cumulative token counts ``[0, end_0, end_1, ...]`` (list or 1-D tensor).

    Raises:
        TypeError: a ``mask_mod`` that is no Mask and neither function named above.
        ValueError: a Mask with a piece that reads absolute positions (``prefix``,
            ``chunked``, ``document``, ...), which a document's start would shift.

    Example:
        >>> import flexmask
        >>> from flexmask.gallery import attn_gym
        >>> local = flexmask.causal() & flexmask.sliding_window(2)
        >>> print(attn_gym.doc_mask(local, [0, 3, 6]).show(6))
        ■ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚
        ⬚ ■ ■ ⬚ ⬚ ⬚
        ⬚ ⬚ ⬚ ■ ⬚ ⬚
        ⬚ ⬚ ⬚ ■ ■ ⬚
        ⬚ ⬚ ⬚ ⬚ ■ ■
    """
    inner = _shift_invariant(mask_mod)
    ends = _offsets(offsets)
    return document([end - start for start, end in zip(ends, ends[1:], strict=False)]) & inner


def jetspec_tree_causal(prefix_length: int, ancestor_matrix: Any) -> Mask:
    """``attn_gym/masks/jetspec.py``'s ``generate_jetspec_tree_causal_mask_mod``: the ``N``
    tree nodes of a draft query all ``prefix_length`` context keys and, among the ``N`` tree
    keys after them, their ancestors (``ancestor_matrix[q, j]``, self included):
    ``prefix(prefix_length) | selected(picks, tile=1)``.

    Query ``i`` is node ``i`` while its key is ``prefix_length + i``: the queries sit
    ``prefix_length`` positions before their keys, so the tree's keys are picked token by
    token (``selected``, a tile of one query and one key; its table is ``S * S`` bools,
    ``S = prefix_length + N``) — exact for any matrix. The mask is attn-gym's for
    ``Q_LEN = N`` and ``KV_LEN = prefix_length + N``.

    Args:
        prefix_length: the context keys before the tree's (>= 0).
        ancestor_matrix: ``(N, N)`` bool (a tensor or nested lists), as attn-gym's
            ``build_tree_ancestor_matrix`` gives it.

    Raises:
        ValueError: a matrix that is not square and non-empty.

    Example:
        >>> import torch
        >>> from flexmask.gallery import attn_gym
        >>> ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        >>> mask = attn_gym.jetspec_tree_causal(2, ancestors)   # 2 context keys, 3 nodes
        >>> print(mask.show(5).splitlines()[:3] == ["■ ■ ■ ⬚ ⬚", "■ ■ ■ ■ ⬚", "■ ■ ■ ⬚ ■"])
        True
    """
    context = _count(prefix_length, "prefix_length")
    ancestors = torch.as_tensor(ancestor_matrix)
    if ancestors.dim() != 2 or ancestors.shape[0] != ancestors.shape[1] or not ancestors.numel():
        raise ValueError(
            f"ancestor_matrix must be a non-empty square (N, N) matrix, got "
            f"{tuple(ancestors.shape)}"
        )
    ancestors = ancestors.to(torch.bool).cpu()
    keys = torch.where(ancestors, torch.arange(ancestors.shape[0]) + context, -1)
    # Picks first, -1 (no pick) after: as many columns as the longest ancestor path.
    width = max(int(ancestors.sum(1).max()), 1)
    return prefix(context) | selected(keys.sort(dim=1, descending=True).values[:, :width], tile=1)


def vision_cross_attention(intervals: Any, image_token_length: int) -> Mask:
    """``attn_gym/masks/flamingo.py``'s ``generate_vision_cross_attention_mask_mod``
    (Flamingo): a text query attends the ``image_token_length`` keys of each image ``i``
    whose ``intervals[i] = [start, end)`` holds it: ``selected(picks, tile=(t,
    image_token_length))``, a key tile per image and ``t`` the largest query tile every
    interval's ends fall on.

    Keys are ``num_images * image_token_length`` image tokens; queries outside every
    interval attend nothing.

    Args:
        intervals: ``(num_images, 2)`` integer ``[start, end)`` query ranges (>= 0).
        image_token_length: tokens per image (>= 1).

    Raises:
        ValueError: intervals of another shape or below 0.

    Example:
        >>> import torch
        >>> from flexmask.gallery import attn_gym
        >>> mask = attn_gym.vision_cross_attention(torch.tensor([[0, 2], [1, 4]]), 2)
        >>> print(mask.show(4))   # keys 0-1: image 0, keys 2-3: image 1
        ■ ■ ⬚ ⬚
        ■ ■ ■ ■
        ⬚ ⬚ ■ ■
        ⬚ ⬚ ■ ■
    """
    per_image = _count(image_token_length, "image_token_length")
    if per_image < 1:
        raise ValueError(f"image_token_length must be >= 1, got {per_image}")
    bounds = torch.as_tensor(intervals)
    if bounds.dim() != 2 or bounds.shape[1] != 2 or bounds.dtype.is_floating_point:
        raise ValueError(
            f"intervals must be integer (num_images, 2) [start, end) pairs, got shape "
            f"{tuple(bounds.shape)} of {bounds.dtype}"
        )
    bounds = bounds.to(torch.int64).cpu()
    if bounds.numel() and int(bounds.min()) < 0:
        raise ValueError(f"intervals must be positions >= 0, got {bounds.tolist()}")
    tile = math.gcd(*bounds.flatten().tolist()) or 1
    ends = int(bounds[:, 1].max()) if bounds.numel() else 0
    first = torch.arange(max(ends // tile, 1))[:, None] * tile  # each query tile's first query
    inside = (bounds[:, 0] <= first) & (first < bounds[:, 1])
    picks = torch.where(inside, torch.arange(bounds.shape[0]), -1)
    if picks.shape[1] == 0:  # no images: one column of no picks
        picks = torch.full((picks.shape[0], 1), -1)
    return selected(picks, tile=(tile, per_image))


def spatial_head(
    prompt_length: int = 226,
    num_frames: int = 13,
    token_per_frame: int = 1350,
    width: int = 2,
    attn_sink: bool = False,
    round_width: int = 128,
) -> Mask:
    """``attn_gym/masks/svg.py``'s ``generate_spatial_head_mask_mod`` (Sparse VideoGen's
    spatial head): the prompt's rows and columns, and a band ``|q_idx - kv_idx| <
    round_down(width * token_per_frame, round_width)``: ``sliding_window(band) |
    global_tokens(prompt)``, and ``| prefix(prompt_length + token_per_frame)`` with
    ``attn_sink`` (the first frame is every query's sink).

    Args:
        prompt_length: the prompt's tokens, first in the sequence.
        num_frames: frames after it (the mask does not depend on it).
        token_per_frame: tokens per frame.
        width: the band's width, in frames.
        attn_sink: whether every query also sees the first frame.
        round_width: the band is rounded down to a multiple of this (>= 1).

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.spatial_head(1, 2, 2, width=1, round_width=1).show(5))
        ■ ■ ■ ■ ■
        ■ ■ ■ ⬚ ⬚
        ■ ■ ■ ■ ⬚
        ■ ⬚ ■ ■ ■
        ■ ⬚ ⬚ ■ ■
    """
    prompt = _count(prompt_length, "prompt_length")
    _count(num_frames, "num_frames")
    frame = _count(token_per_frame, "token_per_frame")
    rounding = _count(round_width, "round_width")
    if rounding < 1:
        raise ValueError(f"round_width must be >= 1, got {rounding}")
    band = _count(width, "width") * frame // rounding * rounding
    mask: Mask = _window(band)
    if prompt:  # the prompt's rows and columns: every pair with a prompt token
        mask = mask | global_tokens([True] * prompt)
    if attn_sink:
        mask = mask | prefix(prompt + frame)
    return mask


def vsa(topk_indices: Any, tile_numel: int, variable_block_sizes: Any = None) -> Mask:
    """``attn_gym/masks/vsa.py``'s ``generate_vsa_mask_mod`` (video sparse attention): each
    tile of ``tile_numel`` queries attends the key tiles its top-k lists:
    ``selected(topk_indices, tile=tile_numel)``. With ``variable_block_sizes`` (the real
    tokens of each padded key tile) the picks are the real keys of those tiles,
    ``selected(key picks, tile=(tile_numel, 1))``.

    Args:
        topk_indices: ``(B, H, Q_TILES, TOP_K)`` key tile ids per query tile (a tensor, as
            attn-gym's ``compute_vsa_topk_indices`` gives them); the mask is attn-gym's for
            ``Q_LEN = Q_TILES * tile_numel`` and keys in the tiles ``variable_block_sizes``
            (if given) covers.
        tile_numel: tokens per tile (>= 1).
        variable_block_sizes: ``(num_kv_tiles,)`` real tokens per key tile, or None.

    Raises:
        ValueError: ``topk_indices`` of another rank, sizes outside ``[0, tile_numel]``.

    Example:
        >>> import torch
        >>> from flexmask.gallery import attn_gym
        >>> topk = torch.tensor([[[[0], [0]]]])   # 2 query tiles of 2, each picks key tile 0
        >>> print(attn_gym.vsa(topk, 2, torch.tensor([1, 2])).show(4))
        ■ ⬚ ⬚ ⬚
        ■ ⬚ ⬚ ⬚
        ■ ⬚ ⬚ ⬚
        ■ ⬚ ⬚ ⬚
    """
    tile = _count(tile_numel, "tile_numel")
    if tile < 1:
        raise ValueError(f"tile_numel must be >= 1, got {tile}")
    picks = torch.as_tensor(topk_indices)
    if picks.dim() != 4:
        raise ValueError(
            f"topk_indices must have shape (B, H, Q_TILES, TOP_K), got {tuple(picks.shape)}"
        )
    if variable_block_sizes is None:
        return selected(picks, tile=tile)
    sizes = torch.as_tensor(variable_block_sizes).to(torch.int64).cpu()
    if sizes.dim() != 1 or (
        sizes.numel() and not 0 <= int(sizes.min()) <= int(sizes.max()) <= tile
    ):
        raise ValueError(
            f"variable_block_sizes must be 1-D real-token counts in [0, {tile}] per key tile, "
            f"got {sizes.tolist()[:8]}"
        )
    picks = picks.to(torch.int64).cpu()
    offset = torch.arange(tile)
    # Each picked tile's real keys (the rest, and no-picks, -1): a tile of one key.
    real = offset < sizes[picks.clamp(min=0)][..., None]
    keys = torch.where(real & (picks >= 0)[..., None], picks[..., None] * tile + offset, -1)
    return selected(keys.flatten(-2), tile=(tile, 1))


def sta_2d(
    canvas_hw: tuple[int, int],
    kernel_hw: tuple[int, int],
    tile_hw: tuple[int, int],
    text_seq_len: int = 0,
) -> Mask:
    """``attn_gym/masks/sta.py``'s ``generate_sta_mask_mod_2d`` (sliding tile attention):
    the canvas's tiles of ``tile_hw`` tokens, row by row, each query tile attending the
    ``kernel_hw`` window of tiles around it (its centre clamped inside the canvas), then
    ``text_seq_len`` text tokens every token attends, whose queries attend the canvas too.
    See ``sta_3d`` for the pieces.

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.sta_2d((1, 3), (1, 1), (1, 1), text_seq_len=1).show(4))
        ■ ⬚ ⬚ ■
        ⬚ ■ ⬚ ■
        ⬚ ⬚ ■ ■
        ■ ■ ■ ■
    """
    canvas, kernel, tile = ((1, *sizes) for sizes in (canvas_hw, kernel_hw, tile_hw))
    return _sta(canvas, kernel, tile, text_seq_len, "_hw")


def sta_3d(
    canvas_twh: tuple[int, int, int],
    kernel_twh: tuple[int, int, int],
    tile_twh: tuple[int, int, int],
    text_seq_len: int = 0,
) -> Mask:
    """``attn_gym/masks/sta.py``'s ``generate_sta_mask_mod_3d``: ``sta_2d`` over (time,
    height, width) tiles. The vision part is tile by tile, ``selected(window picks,
    tile=tile_numel)``; the text's columns ``prefix(V + text_seq_len) & ~prefix(V)`` and its
    rows ``prefix(V) & ~padding(V)`` (``V`` the canvas's tokens).

    Example:
        >>> from flexmask.gallery import attn_gym
        >>> print(attn_gym.sta_3d((2, 1, 2), (2, 1, 2), (1, 1, 2)).show(4))
        ■ ■ ■ ■
        ■ ■ ■ ■
        ■ ■ ■ ■
        ■ ■ ■ ■
    """
    return _sta(canvas_twh, kernel_twh, tile_twh, text_seq_len, "_twh")


def _sta(canvas: Any, kernel: Any, tile: Any, text_seq_len: int, axes: str) -> Mask:
    """STA over 3 axes (``sta_2d`` adds a time axis of 1): see ``sta_3d``."""
    sides = []
    for name, value in (("canvas", canvas), ("kernel", kernel), ("tile", tile)):
        sizes = [_count(v, f"{name}{axes}") for v in value]
        if len(sizes) != 3 or (name == "tile" and min(sizes) < 1):
            raise ValueError(
                f"{name}{axes} must be {len(axes) - 1} sizes (tiles >= 1), got {value}"
            )
        sides.append(sizes)
    (canvas_n, kernel_n, tile_n), text = sides, _count(text_seq_len, "text_seq_len")
    for name, value, sizes in (("canvas", canvas, canvas_n), ("kernel", kernel, kernel_n)):
        if any(n % t for n, t in zip(sizes, tile_n, strict=True)):
            raise ValueError(f"{name}{axes} must be multiples of tile{axes}, got {value}, {tile}")
    tiles = [n // t for n, t in zip(canvas_n, tile_n, strict=True)]
    vision = math.prod(canvas_n)
    ids = torch.arange(math.prod(tiles))
    picks = torch.zeros(len(ids), 1, dtype=torch.int64)
    valid = torch.ones(len(ids), 1, dtype=torch.bool)
    stride = math.prod(tiles)
    for count, k in zip(
        tiles, (k // t for k, t in zip(kernel_n, tile_n, strict=True)), strict=True
    ):
        stride //= count
        left, right = k // 2, k // 2 + (k % 2 - 1)
        centre = ((ids // stride) % count).clamp(left, count - 1 - right)
        along = centre[:, None] - left + torch.arange(max(right + left + 1, 0))  # the window
        ok = (along >= 0) & (along < count)
        picks = (picks[:, :, None] + along[:, None, :] * stride).flatten(1)
        valid = (valid[:, :, None] & ok[:, None, :]).flatten(1)
    picks = torch.where(valid, picks, -1)
    if picks.shape[1] == 0:  # a kernel of no tiles picks nothing
        picks = torch.full((len(ids), 1), -1)
    text_keys = prefix(vision + text) & ~prefix(vision)
    text_queries = prefix(vision) & ~padding(vision, truncate=True)
    return selected(picks, tile=math.prod(tile_n), truncate=True) | text_keys | text_queries


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _ints(values: Any, name: str) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise TypeError(f"{name} must be a list or 1-D tensor of ints, got {values!r}")
    return list(values)


def _offsets(offsets: Any) -> list[int]:
    ends = _ints(offsets, "offsets")
    if len(ends) < 2 or ends[0] != 0 or any(b < a for a, b in zip(ends, ends[1:], strict=False)):
        raise ValueError(
            f"offsets must be cumulative counts from 0, non-decreasing, at least [0, n], got {ends}"
        )
    return ends


def _shift_invariant(mask_mod: Any) -> Mask:
    """``mask_mod`` as a Mask that reads only ``q_idx - kv_idx`` (``doc_mask``)."""
    if not isinstance(mask_mod, Mask):
        named = (getattr(mask_mod, "__module__", None), getattr(mask_mod, "__name__", None))
        if named == ("attn_gym.masks.causal", "causal_mask"):
            return _causal()
        if named == ("torch.nn.attention.flex_attention", "noop_mask"):
            return full()
        raise TypeError(
            "mask_mod must be a flexmask Mask (causal, sliding_window, dilated, full, empty under "
            f"&, |, ~), attn-gym's causal_mask or torch's noop_mask, got {mask_mod!r}"
        )
    for leaf in leaves(mask_mod):
        if not isinstance(leaf, (Causal, SlidingWindow, Dilated, Full, Empty)):
            raise ValueError(
                f"mask_mod's piece {leaf!r} reads absolute positions, which a document's "
                "start would shift: doc_mask takes masks of q_idx - kv_idx only (causal, "
                "sliding_window without positions, dilated, full, empty)"
            )
    return mask_mod
