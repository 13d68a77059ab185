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
* ``block_diffusion(seq_len, block_size)``, BD3-LM's training mask over ``2 * seq_len``.

Not here: ``jetspec_tree_causal`` and ``jetspec_training`` index queries from 0 against keys
offset by the prefix (``Q_LEN != KV_LEN``, unaligned), and ``natten``/``sta``/``vsa``/``svg``/
``flamingo`` are 2-D/3-D neighbourhoods, learned selections or cross-attention; see
docs/gallery.md.
"""

from __future__ import annotations

from typing import Any

from flexmask.algebra import Mask
from flexmask.pieces import PositionWindow, dilated, document, global_tokens, prefix, tree
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
