"""NVIDIA cuDNN-frontend's flex-attention benchmark suite, mask by mask, built from pieces.

The suite (``benchmark/flex_attention/benchmark_flex_attention.py`` in NVIDIA/cudnn-frontend)
times cuDNN's flex_attention on eight static masks at 128K tokens, each written there as
interval endpoints per query. Each function here takes the suite's ``seqlen`` and its
parameters (defaults: the suite's), draws the same document and node lengths from the same
seeds, and returns the same mask as a :class:`~flexmask.Mask`: built from structure, lowered
to every format that can express it (``to_cudnn`` gives back the suite's endpoints), and
compared and cached by value.

* ``causal``: ``causal()``;
* ``document_causal``, causal inside 13 documents: ``causal() & document(lens)``;
* ``local``, 512 keys back: ``causal() & sliding_window(513)``;
* ``sink_local``, 4 sinks + local 512: ``causal() & (prefix(4) | sliding_window(513))``;
* ``tree_dfs`` / ``tree_bfs``, a binary tree of 127 nodes: ``tree(parents)``;
* ``longformer``, radius 256 + 8 global tokens: ``sliding_window(257) | global_tokens(g)``;
* ``hstu``, packed context / target: ``causal() & document(lens) & (global_tokens(context)
  | sliding_window(1))``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Literal

import torch

from flexmask.algebra import Mask
from flexmask.pieces import causal as _causal
from flexmask.pieces import document, global_tokens, prefix, sliding_window, tree

STANDARD_SEQLEN = 128 * 1024
"""The suite's sequence length: 128K tokens."""

# The suite's document lengths at 128K (its DOCUMENT_LENGTHS_128K); other lengths draw a
# partition of 4K-16K-token documents from seed 42.
DOCUMENT_LENGTHS_128K = (
    11858,
    8270,
    12765,
    11038,
    4578,
    14018,
    11721,
    11988,
    4942,
    8393,
    7541,
    13495,
    10465,
)
MASK_NAMES = (
    "causal",
    "document_causal",
    "local",
    "sink_local",
    "tree_dfs",
    "tree_bfs",
    "longformer",
    "hstu",
)


def causal(seqlen: int | None = None) -> Mask:
    """The suite's ``causal``: every query attends itself and the keys before it.

    Example:
        >>> from flexmask.gallery import cudnn
        >>> print(cudnn.causal().show(3))
        ■ ⬚ ⬚
        ■ ■ ⬚
        ■ ■ ■
    """
    return _causal()


def document_causal(seqlen: int = STANDARD_SEQLEN, *, seed: int = 42) -> Mask:
    """The suite's ``document_causal`` ("Varlen document causal"): causal attention inside
    documents packed back to back — at 128K (seed 42) its 13 fixed lengths, otherwise a
    partition of ``seqlen`` into 4K-16K-token documents drawn from ``seed`` as the suite
    draws it (at least two where two fit).

    Example:
        >>> import flexmask
        >>> from flexmask.gallery import cudnn
        >>> mask = cudnn.document_causal()
        >>> mask == cudnn.causal() & flexmask.document(list(cudnn.DOCUMENT_LENGTHS_128K))
        True
    """
    return _causal() & document(document_lengths(seqlen, seed=seed))


def document_lengths(seqlen: int, *, seed: int = 42) -> list[int]:
    """The document lengths ``document_causal`` packs (the suite's, for ``seqlen``)."""
    _check_seqlen(seqlen)
    if seqlen == STANDARD_SEQLEN and seed == 42:
        return list(DOCUMENT_LENGTHS_128K)
    return _bounded_partition(seqlen, 4096, 16384, seed=seed, prefer_multiple=True)


def local(seqlen: int | None = None, *, window_left: int = 512) -> Mask:
    """The suite's ``local`` ("Causal local W=512"): each query attends itself and the
    ``window_left`` keys before it.

    Example:
        >>> from flexmask.gallery import cudnn
        >>> print(cudnn.local(window_left=1).show(4))
        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ⬚ ■ ■ ⬚
        ⬚ ⬚ ■ ■
    """
    return _causal() & sliding_window(window_left + 1)


def sink_local(seqlen: int | None = None, *, sink_tokens: int = 4, window_left: int = 512) -> Mask:
    """The suite's ``sink_local`` ("Sink S=4 + local W=512"): ``local`` plus the first
    ``sink_tokens`` keys (attention sinks), causal.

    Example:
        >>> from flexmask.gallery import cudnn
        >>> print(cudnn.sink_local(sink_tokens=1, window_left=1).show(4))
        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ■ ■ ■ ⬚
        ■ ⬚ ■ ■
    """
    return _causal() & (prefix(sink_tokens) | sliding_window(window_left + 1))


def tree_dfs(seqlen: int = STANDARD_SEQLEN, *, depth: int = 7, seed: int = 42) -> Mask:
    """The suite's ``tree_dfs`` ("Tree attention DFS"): a complete binary tree of
    ``2**depth - 1`` nodes laid out in depth-first order, node lengths jittered ±20% around
    ``seqlen / nodes`` from ``seed``; a token attends the tokens before it in its node and
    every token of its node's ancestors.

    Example:
        >>> from flexmask.gallery import cudnn
        >>> print(cudnn.tree_dfs(6, depth=2).show(6))   # root, left child, right child
        ■ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚ ⬚
        ■ ■ ■ ■ ⬚ ⬚
        ■ ■ ⬚ ⬚ ■ ⬚
        ■ ■ ⬚ ⬚ ■ ■
    """
    return tree(tree_parents(seqlen, "dfs", depth=depth, seed=seed))


def tree_bfs(seqlen: int = STANDARD_SEQLEN, *, depth: int = 7, seed: int = 42) -> Mask:
    """The suite's ``tree_bfs`` ("Tree attention BFS"): ``tree_dfs``'s tree and node lengths
    laid out level by level (breadth-first), so a node's ancestors lie far before it.

    Example:
        >>> from flexmask.gallery import cudnn
        >>> print(cudnn.tree_bfs(6, depth=2).show(6))   # the same nodes as tree_dfs(6, depth=2)
        ■ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚ ⬚
        ■ ■ ■ ■ ⬚ ⬚
        ■ ■ ⬚ ⬚ ■ ⬚
        ■ ■ ⬚ ⬚ ■ ■
    """
    return tree(tree_parents(seqlen, "bfs", depth=depth, seed=seed))


def tree_parents(
    seqlen: int, traversal: Literal["dfs", "bfs"], *, depth: int = 7, seed: int = 42
) -> list[int]:
    """Token parents of the suite's tree: a node's first token hangs below its parent
    node's last token, every other token below the token before it (so a token's ancestors
    are the earlier tokens of its node and all of its ancestor nodes')."""
    _check_seqlen(seqlen)
    nodes = 2**depth - 1
    lengths = _jittered_lengths(seqlen, nodes, seed=seed, jitter=0.2)
    order = list(range(nodes)) if traversal == "bfs" else _preorder(nodes)
    last: dict[int, int] = {}
    parents: list[int] = []
    for node in order:
        up = -1 if node == 0 else last[(node - 1) // 2]
        for _ in range(lengths[node]):
            parents.append(up)
            up = len(parents) - 1
        last[node] = up
    return parents


def longformer(
    seqlen: int = STANDARD_SEQLEN, *, local_radius: int = 256, global_count: int = 8
) -> Mask:
    """The suite's ``longformer``: a bidirectional window of ``local_radius`` keys each side,
    and ``global_count`` global tokens spread evenly (token ``(i + 0.5) * seqlen /
    global_count``) that attend, and are attended by, every token.

    Example:
        >>> from flexmask.gallery import cudnn
        >>> print(cudnn.longformer(6, local_radius=0, global_count=1).show(6))
        ■ ⬚ ⬚ ■ ⬚ ⬚
        ⬚ ■ ⬚ ■ ⬚ ⬚
        ⬚ ⬚ ■ ■ ⬚ ⬚
        ■ ■ ■ ■ ■ ■
        ⬚ ⬚ ⬚ ■ ■ ⬚
        ⬚ ⬚ ⬚ ■ ⬚ ■
    """
    _check_seqlen(seqlen)
    if isinstance(global_count, bool) or not isinstance(global_count, int) or global_count < 1:
        raise ValueError(f"global_count must be an int >= 1, got {global_count!r}")
    chosen = [min(int((i + 0.5) * seqlen / global_count), seqlen - 1) for i in range(global_count)]
    is_global = torch.zeros(seqlen, dtype=torch.bool)
    is_global[chosen] = True  # one flag per token, written by index, not a Python loop
    return sliding_window(local_radius + 1) | global_tokens(is_global)


def hstu(seqlen: int = STANDARD_SEQLEN, *, seed: int = 42) -> Mask:
    """The suite's ``hstu`` ("Packed HSTU context/target"): documents of 8K-16K tokens drawn
    from ``seed``, each a context then a target of the same length; context tokens attend
    causally within their document, target tokens attend their document's context and
    themselves.

    Example:
        >>> from flexmask.gallery import cudnn
        >>> print(cudnn.hstu(6).show(6))   # one document: 3 context tokens, 3 targets
        ■ ⬚ ⬚ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚ ⬚ ⬚
        ■ ■ ■ ⬚ ⬚ ⬚
        ■ ■ ■ ■ ⬚ ⬚
        ■ ■ ■ ⬚ ■ ⬚
        ■ ■ ■ ⬚ ⬚ ■
    """
    contexts, targets = hstu_lengths(seqlen, seed=seed)
    lengths = [context + target for context, target in zip(contexts, targets, strict=True)]
    halves = torch.tensor([n for pair in zip(contexts, targets, strict=True) for n in pair])
    is_context = torch.arange(halves.numel()).remainder(2).eq(0).repeat_interleave(halves)
    return _causal() & document(lengths) & (global_tokens(is_context) | sliding_window(1))


def hstu_lengths(seqlen: int, *, seed: int = 42) -> tuple[list[int], list[int]]:
    """The suite's HSTU (context, target) lengths: contexts a 4K-8K partition of half the
    tokens, each target its context's length (the last one takes an odd token)."""
    _check_seqlen(seqlen)
    contexts = _bounded_partition(seqlen // 2, 4096, 8192, seed=seed)
    targets = contexts.copy()
    targets[-1] += seqlen % 2
    return contexts, targets


def make_mask(name: str, seqlen: int = STANDARD_SEQLEN) -> Mask:
    """The suite's mask ``name`` (one of ``MASK_NAMES``) at ``seqlen`` tokens, with the
    suite's parameters.

    Example:
        >>> from flexmask.gallery import cudnn
        >>> cudnn.make_mask("local", 1024) == cudnn.local()
        True
    """
    makers: dict[str, Callable[[int], Mask]] = {
        "causal": causal,
        "document_causal": document_causal,
        "local": local,
        "sink_local": sink_local,
        "tree_dfs": tree_dfs,
        "tree_bfs": tree_bfs,
        "longformer": longformer,
        "hstu": hstu,
    }
    if name not in makers:
        raise ValueError(f"name must be one of {MASK_NAMES}, got {name!r}")
    return makers[name](seqlen)


def _check_seqlen(seqlen: object) -> None:
    """The masks with drawn data are drawn for a sequence of ``seqlen`` >= 1 tokens."""
    if isinstance(seqlen, bool) or not isinstance(seqlen, int):
        raise TypeError(f"seqlen must be an int (tokens in the sequence), got {seqlen!r}")
    if seqlen < 1:
        raise ValueError(f"seqlen must be >= 1 (tokens in the sequence), got {seqlen}")


def _preorder(nodes: int) -> list[int]:
    """Heap-numbered nodes (children of n: 2n + 1, 2n + 2) in depth-first preorder."""
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        if node < nodes:
            order.append(node)
            stack += [2 * node + 2, 2 * node + 1]
    return order


def _jittered_lengths(total: int, count: int, *, seed: int, jitter: float) -> list[int]:
    """``count`` lengths summing to ``total``, each ``total / count`` scaled by a uniform
    factor in ``1 ± jitter`` from ``seed``, rounded down, the remainder handed out by
    largest fraction (the suite's draw)."""
    if count <= 0 or total < count:
        raise ValueError(f"seqlen must be at least the tree's {count} nodes, got {total}")
    generator = random.Random(seed)
    weights = [generator.uniform(1.0 - jitter, 1.0 + jitter) for _ in range(count)]
    scaled = [w * total / sum(weights) for w in weights]
    lengths = [max(1, math.floor(v)) for v in scaled]
    by_fraction = sorted(
        range(count), key=lambda i: scaled[i] - math.floor(scaled[i]), reverse=True
    )
    for i in range(total - sum(lengths)):
        lengths[by_fraction[i % count]] += 1
    return lengths


def _bounded_partition(
    total: int, minimum: int, maximum: int, *, seed: int, prefer_multiple: bool = False
) -> list[int]:
    """Lengths in ``[minimum, maximum]`` summing to ``total`` (one part where ``total`` is
    below ``minimum``), drawn from ``seed`` and evened out in shuffled passes (the suite's
    draw)."""
    if total < minimum:
        return [total]
    max_parts = total // minimum
    count = min(
        max(round(total / ((minimum + maximum) / 2)), math.ceil(total / maximum)), max_parts
    )
    if prefer_multiple and count == 1 and max_parts >= 2:
        count = 2
    generator = random.Random(seed)
    lengths = [generator.randint(minimum, maximum) for _ in range(count)]
    left = total - sum(lengths)
    while left:
        order = list(range(count))
        generator.shuffle(order)
        moved = False
        for i in order:
            step = (
                min(left, maximum - lengths[i]) if left > 0 else -min(-left, lengths[i] - minimum)
            )
            lengths[i] += step
            left -= step
            moved = moved or step != 0
            if left == 0:
                break
        if not moved:
            raise ValueError(f"no partition of {total} into parts of {minimum} to {maximum}")
    return lengths
