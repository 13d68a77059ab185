"""Shared prefixes computed once: :func:`pack_one_tree` merges sequences into one preorder
trie."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from flexmask._validate import check_int
from flexmask.packing.tokens import Device, _check_memory, _ranges, _token_lists
from flexmask.pieces import tree
from flexmask.runtime import lazy

if TYPE_CHECKING:
    from flexmask.algebra import Mask
    from flexmask.runtime import LazyBlockMask


@dataclasses.dataclass(frozen=True, eq=False)
class TreePack:
    """Sequences merged into one prefix trie, laid out token by token in preorder.

    Attributes:
        tokens: ``(L,)`` int64 token of every trie node, then ``pad_id`` up to ``pad_to``.
        parents: ``(num_tokens,)`` int64 parent position of every node, ``-1`` for roots;
            ``parents[i] < i``. Not padded: ``tree(parents)`` masks positions past its end.
        position_ids: ``(L,)`` int64 depth of every node (its position in each sequence that
            passes through it); 0 at padding.
        num_tokens: trie nodes, i.e. real packed tokens.
        unpacked_tokens: total length of the input sequences.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    position_ids: torch.Tensor
    num_tokens: int
    unpacked_tokens: int
    _paths: torch.Tensor = dataclasses.field(repr=False)
    _path_offsets: list[int] = dataclasses.field(repr=False)

    @property
    def saved_tokens(self) -> int:
        """``unpacked_tokens - num_tokens``: tokens not computed thanks to shared prefixes."""
        return self.unpacked_tokens - self.num_tokens

    @property
    def num_sequences(self) -> int:
        """How many input sequences were packed."""
        return len(self._path_offsets) - 1

    @property
    def length(self) -> int:
        """``L``, the length of ``tokens`` (``pad_to`` when given, else ``num_tokens``)."""
        return self.tokens.shape[0]

    @property
    def mask(self) -> Mask:
        """``tree(parents)``: each token attends to itself and its ancestors, nothing else.

        Positions past ``num_tokens`` (padding) attend to nothing. For the sequences
        ``[1, 2, 3]`` and ``[1, 4]`` (preorder ``1 2 3 4``, parents ``[-1, 0, 1, 0]``)::

            ■ ⬚ ⬚ ⬚
            ■ ■ ⬚ ⬚
            ■ ■ ■ ⬚
            ■ ⬚ ⬚ ■

        Example:
            >>> from flexmask.packing import pack_one_tree
            >>> tp = pack_one_tree([[1, 2, 3], [1, 4]])
            >>> tp.mask.to_dense(1, 1, 4, 4)[0, 0].int().tolist()
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
        """
        return tree(self.parents)

    def lazy(
        self, num_heads: int = 1, device: Device = None, block_size: int = 128
    ) -> LazyBlockMask:
        """A picklable handle that builds the BlockMask (``B = 1``, ``L x L``) on first use.

        Example:
            >>> from flexmask.packing import pack_one_tree
            >>> tp = pack_one_tree([[1, 2, 3], [1, 4]], pad_to=8)
            >>> tp.lazy(block_size=4).block_mask.seq_lengths
            (8, 8)
        """
        return lazy(
            self.mask, 1, num_heads, self.length, self.length, device=device, BLOCK_SIZE=block_size
        )

    def sequence_index(self, i: int) -> torch.Tensor:
        """Packed positions of sequence ``i``'s tokens, in order, as a 1-d LongTensor.

        ``tokens[sequence_index(i)]`` is sequence ``i``. The logit at packed position
        ``sequence_index(i)[t]`` predicts token ``t + 1`` of sequence ``i`` (a node is shared by
        every sequence through it, so gather per sequence; there is no packed ``labels``).

        Args:
            i: index of the input sequence, ``0 <= i < num_sequences``.

        Example:
            >>> import torch
            >>> from flexmask.packing import pack_one_tree
            >>> tp = pack_one_tree([[1, 2, 3], [1, 4]])
            >>> tp.sequence_index(1).tolist()
            [0, 3]
            >>> # log-probs of sequence 1's tokens 1.. from logits of shape (L, V):
            >>> logits = torch.randn(tp.length, 5)
            >>> idx, seq = tp.sequence_index(1), tp.tokens[tp.sequence_index(1)]
            >>> logp = logits[idx[:-1]].log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
            >>> logp.shape
            torch.Size([1])
        """
        i = check_int(i, "i")
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"i must be in [0, {self.num_sequences}), got {i}")
        return self._paths[self._path_offsets[i] : self._path_offsets[i + 1]]

    def unpack(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Gathers a ``(L, ...)`` per-token tensor along every sequence's path.

        Args:
            per_token: aligned with ``tokens`` (drop the batch dimension of model outputs:
                ``tp.unpack(logits[0])``).

        Returns:
            One ``(len_i, ...)`` tensor per input sequence, in input order. Shared nodes
            appear in every sequence through them.

        Example:
            >>> from flexmask.packing import pack_one_tree
            >>> tp = pack_one_tree([[1, 2, 3], [1, 4], [1, 2]])
            >>> [t.tolist() for t in tp.unpack(tp.tokens)]
            [[1, 2, 3], [1, 4], [1, 2]]
        """
        if not isinstance(per_token, torch.Tensor):
            raise TypeError(f"per_token must be a tensor, got {type(per_token).__name__}")
        if per_token.dim() == 0 or per_token.shape[0] != self.length:
            raise ValueError(
                f"per_token must have shape (L, ...) with L = {self.length}, got "
                f"{tuple(per_token.shape)} (for model outputs (1, L, ...) pass output[0])"
            )
        gathered = per_token.index_select(0, self._paths.to(per_token.device))
        lengths = [b - a for a, b in itertools.pairwise(self._path_offsets)]
        return list(gathered.split(lengths))


def pack_one_tree(
    sequences: Iterable[Sequence[int] | torch.Tensor],
    *,
    pad_to: int | None = None,
    pad_id: int = 0,
) -> TreePack:
    """Merges sequences that share prefixes into one trie laid out in preorder: a
    :class:`TreePack` of 1-D ``(L,)`` tokens (0.1 called it ``pack_tree``; many trees in
    ``(B, max_tokens)`` rows are :func:`pack_tree_batch`'s).

    Each distinct prefix is one node: a token's place in the trie is determined by the tokens
    before it, which is all a causal model looks at, so computing it once is exact. Nodes are
    laid out depth first, children in order of first appearance in ``sequences``; in preorder
    every subtree is a contiguous range, which lets ``flexmask.tree`` classify whole blocks
    from structure. A sequence that is a prefix of another, or a duplicate, adds no nodes.

    Per-sequence log-probs: a node can have several children, so there is no single packed
    ``labels``; gather along each path instead. The logit that predicts token ``t + 1`` of
    sequence ``i`` is at packed position ``sequence_index(i)[t]``::

        logits = model(tp.tokens[None], tp.position_ids[None], tp.lazy(H))[0]   # (L, V)
        path = tp.sequence_index(i)
        logp = logits[path[:-1]].log_softmax(-1).gather(-1, tp.tokens[path[1:], None])[:, 0]

    A shared node's gradient then sums the contributions of every sequence through it, exactly
    as if each sequence had been run alone.

    Args:
        sequences: lists/tuples of token ids (ints >= 0), or 1-d integer tensors/arrays; none
            may be empty.
        pad_to: pad ``tokens``/``position_ids`` to this length (e.g. a multiple of the block
            size, so shapes repeat across steps); padding is masked. ``None`` means no padding.
        pad_id: token id (>= 0) written into padding.

    Returns:
        A :class:`TreePack`.

    Raises:
        TypeError: a token is not an integer, or ``pad_to``/``pad_id`` is not an int.
        ValueError: ``sequences`` or one of them is empty, a token id or ``pad_id`` is
            negative (ids index the vocabulary, where a negative one would wrap), or ``pad_to``
            is smaller than the number of trie nodes. Also, before anything is allocated, when
            ``pad_to`` is too large to hold: ``tokens`` and ``position_ids`` take 16 bytes per
            position, and more than the machine's RAM (or the process's cgroup limit, when
            lower) is refused, since both are written in full. Any ``pad_to`` that fits is
            accepted.

    Example:
        >>> from flexmask.packing import pack_one_tree
        >>> tp = pack_one_tree([[1, 2, 3], [1, 2, 4], [1, 2]], pad_to=6)
        >>> tp.tokens.tolist(), tp.parents.tolist(), tp.position_ids.tolist()
        ([1, 2, 3, 4, 0, 0], [-1, 0, 1, 1], [0, 1, 2, 2, 0, 0])
        >>> tp.sequence_index(1).tolist(), tp.saved_tokens
        ([0, 1, 3], 4)
    """
    pad_id = check_int(pad_id, "pad_id", minimum=0)
    if pad_to is not None:
        pad_to = check_int(pad_to, "pad_to", minimum=1)
    token_lists = _token_lists(sequences)

    # A radix trie: each edge holds a run of tokens, so Python work grows with the number of
    # sequences and branch points while tokens are only sliced and compared (at C speed).
    root = _Edge([])
    for seq in token_lists:
        _insert(root, seq)
    if pad_to is not None:
        num_tokens = root.size()
        if pad_to < num_tokens:
            raise ValueError(
                f"pad_to={pad_to} is smaller than the packed tree, which has {num_tokens} "
                f"tokens; pass pad_to >= {num_tokens} or None"
            )
        _check_memory(
            16 * pad_to,
            f"tokens and position_ids (2 int64 tensors of {pad_to})",
            f"pad_to={pad_to}",
            f"the tree has {num_tokens} tokens, so pad_to only needs to reach that (rounded up "
            "to a multiple of the block size, say)",
        )

    flat_tokens, parents, depths, paths = _lay_out(root, token_lists)
    num_tokens = len(flat_tokens)

    length = num_tokens if pad_to is None else pad_to
    tokens = torch.full((length,), pad_id, dtype=torch.int64)
    tokens[:num_tokens] = flat_tokens
    position_ids = torch.zeros(length, dtype=torch.int64)
    position_ids[:num_tokens] = depths
    offsets = [0, *itertools.accumulate(map(len, token_lists))]
    return TreePack(
        tokens=tokens,
        parents=parents,
        position_ids=position_ids,
        num_tokens=num_tokens,
        unpacked_tokens=offsets[-1],
        _paths=paths,
        _path_offsets=offsets,
    )


def _lay_out(
    root: _Edge, token_lists: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trie in preorder: every node's token, parent and depth, and every sequence's path.

    Returns ``(tokens, parents, depths, paths)``: ``paths`` holds the positions of each
    sequence's tokens, sequences one after another in input order.
    """
    # Preorder over edges (iterative: paths can be far deeper than the recursion limit). An
    # edge's tokens are a chain, so each edge is one contiguous run of the token layout.
    runs: list[list[int]] = []
    run_start, run_len, run_parent, run_depth = [], [], [], []
    stack: list[tuple[_Edge, int, int]] = [
        (child, -1, 0) for child in reversed(root.children.values())
    ]
    position = 0
    while stack:
        edge, parent_pos, depth = stack.pop()
        edge.start = position
        runs.append(edge.tokens)
        run_start.append(position)
        run_len.append(len(edge.tokens))
        run_parent.append(parent_pos)
        run_depth.append(depth)
        position += len(edge.tokens)
        last, below = position - 1, depth + len(edge.tokens)
        stack.extend((child, last, below) for child in reversed(edge.children.values()))
    num_tokens = position

    starts = torch.tensor(run_start, dtype=torch.int64)
    lens = torch.tensor(run_len, dtype=torch.int64)
    # Inside a run, token k's parent is token k - 1; the run's first token hangs off the last
    # token of its parent edge. Depth counts up from the run's first depth.
    parents = torch.arange(-1, num_tokens - 1, dtype=torch.int64)
    parents[starts] = torch.tensor(run_parent, dtype=torch.int64)
    shift = torch.tensor(run_depth, dtype=torch.int64) - starts
    depths = torch.arange(num_tokens) + torch.repeat_interleave(shift, lens, output_size=num_tokens)

    path_starts, path_lens = [], []
    for seq in token_lists:
        for edge, take in _walk(root, seq):
            path_starts.append(edge.start)
            path_lens.append(take)
    paths = _ranges(
        torch.tensor(path_starts, dtype=torch.int64), torch.tensor(path_lens, dtype=torch.int64)
    )
    tokens = torch.tensor(list(itertools.chain.from_iterable(runs)), dtype=torch.int64)
    return tokens, parents, depths, paths


class _Edge:
    """A radix-trie edge: a run of tokens, then children keyed by their first token.

    Children are a dict, so they stay in insertion (= first-appearance) order.
    """

    __slots__ = ("tokens", "children", "start")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.children: dict[int, _Edge] = {}
        self.start = 0  # position of the first token in the layout, set by pack_one_tree

    def size(self) -> int:
        total, stack = 0, [self]
        while stack:
            edge = stack.pop()
            total += len(edge.tokens)
            stack.extend(edge.children.values())
        return total


def _matching(run: list[int], seq: list[int], at: int) -> int:
    """How many leading tokens of ``run`` equal ``seq[at:]`` (the first is known to match)."""
    n = min(len(run), len(seq) - at)
    if run[:n] == seq[at : at + n]:
        return n
    # Binary search on slice equality: run[:lo] matches, the first mismatch is before hi.
    lo, hi = 1, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run[lo:mid] == seq[at + lo : at + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _insert(root: _Edge, seq: list[int]) -> None:
    node, at = root, 0
    while at < len(seq):
        child = node.children.get(seq[at])
        if child is None:
            node.children[seq[at]] = _Edge(seq[at:])
            return
        matched = _matching(child.tokens, seq, at)
        at += matched
        if matched < len(child.tokens) and at < len(seq):
            # Diverges inside the edge: split it in place (keeping its slot, hence its order
            # among its siblings); the older tail comes before the new branch.
            tail = _Edge(child.tokens[matched:])
            tail.children = child.children
            child.tokens = child.tokens[:matched]
            child.children = {tail.tokens[0]: tail, seq[at]: _Edge(seq[at:])}
            return
        node = child  # whole edge matched, or seq ends inside it (nothing to add)


def _walk(root: _Edge, seq: list[int]) -> Iterator[tuple[_Edge, int]]:
    """The edges on ``seq``'s path in the finished trie, with how many tokens of each it uses."""
    node, at = root, 0
    while at < len(seq):
        node = node.children[seq[at]]
        take = min(len(node.tokens), len(seq) - at)
        yield node, take
        at += take


def _shared(root: _Edge, seq: list[int]) -> int:
    """How many leading tokens of ``seq`` the trie already holds (the nodes it would reuse)."""
    node, at = root, 0
    while at < len(seq):
        child = node.children.get(seq[at])
        if child is None:
            return at
        matched = _matching(child.tokens, seq, at)
        at += matched
        if matched < len(child.tokens):
            return at
        node = child
    return at
