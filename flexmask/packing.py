"""Sequence packing: many short sequences in few rows, kept apart by document and tree masks.

Two ways to stop paying for padding:

* :func:`pack` bin-packs sequences into rows of ``max_len`` tokens. Each sequence (or chunk of
  one) becomes a *document*; the mask ``causal() & document(seq_lens)`` keeps documents from
  seeing each other, and ``position_ids`` restart at 0 in each document, so a causal model gives
  every document exactly what it would give it alone.
* :func:`pack_tree` merges sequences that share prefixes into one trie, laid out in preorder.
  A shared prefix is computed once; the mask ``tree(parents)`` lets each token see exactly its
  own prefix, so the logits along any sequence's path are the ones it would get alone.

Only small metadata (``seq_lens`` / ``parents``) is stored; the BlockMask is built lazily, in
the process that uses it (see :class:`PackingCollator`).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

# Attribute access is deferred to call time (``flexmask.causal()``), so this module can be
# imported while the package itself is still initialising.
import flexmask
from flexmask._validate import check_device

if TYPE_CHECKING:
    from flexmask.lazy import LazyBlockMask
    from flexmask.mask import Mask

Device = torch.device | str | None

__all__ = [
    "Chunk",
    "PackedBatch",
    "PackedDataset",
    "PackingCollator",
    "TreePack",
    "pack",
    "pack_tree",
]

Policy = Literal["split", "reject"]
Strategy = Literal["first_fit_decreasing", "best_fit_decreasing", "next_fit"]

_POLICIES = ("split", "reject")
_STRATEGIES = ("first_fit_decreasing", "best_fit_decreasing", "next_fit")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class Chunk(NamedTuple):
    """Where one piece of an input sequence landed: ``tokens[row, start:start + length]``."""

    row: int
    start: int
    length: int


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    # bool is an int subclass, but `max_len=True` is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def _token_list(seq: Any, index: int) -> list[int]:
    """Validates ``sequences[index]`` and returns it as a list of Python ints."""
    where = f"sequences[{index}]"
    if isinstance(seq, (str, bytes)):
        raise TypeError(
            f"{where} is a {type(seq).__name__}; pass token ids (tokenize the text first)"
        )
    if not isinstance(seq, torch.Tensor) and hasattr(seq, "__array__"):
        # numpy arrays: one dtype check instead of one per element.
        try:
            seq = torch.as_tensor(seq)
        except (TypeError, RuntimeError) as error:
            raise TypeError(f"{where} is an array torch cannot read as integers: {error}") from None
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            raise ValueError(
                f"{where} is a {seq.dim()}-d tensor of shape {tuple(seq.shape)}; each sequence "
                "must be 1-d (a 2-d tensor can be passed as sequences itself, one row each)"
            )
        if seq.dtype == torch.bool or seq.dtype.is_floating_point or seq.dtype.is_complex:
            raise TypeError(
                f"{where} has dtype {seq.dtype}; token tensors need an integer dtype such as "
                "torch.int64"
            )
        tokens = seq.tolist()
    elif isinstance(seq, Sequence):
        tokens = seq if isinstance(seq, list) else list(seq)  # read only, so no copy needed
        # Fast path, at C speed: nothing but plain ints (a bool's type is bool, not int).
        if not set(map(type, tokens)) <= {int}:
            tokens = [_token_value(t, f"{where}[{j}]") for j, t in enumerate(tokens)]
    elif isinstance(seq, Mapping):
        raise TypeError(
            f"{where} is a {type(seq).__name__} with keys {sorted(map(str, seq))}; pass the "
            "token list itself (e.g. item['input_ids']), or PackingCollator(key='input_ids')"
        )
    elif isinstance(seq, numbers.Integral) and not isinstance(seq, bool):
        raise TypeError(
            f"{where} is the int {seq!r}; sequences must be a list of sequences, e.g. "
            "[[1, 2, 3], [4, 5]], not one flat list of tokens"
        )
    else:
        raise TypeError(
            f"{where} is a {type(seq).__name__}; each sequence must be a list/tuple of ints or "
            "a 1-d integer tensor"
        )
    if not tokens:
        raise ValueError(f"{where} is empty; every sequence needs at least one token")
    lo, hi = min(tokens), max(tokens)
    if lo < _INT64_MIN or hi > _INT64_MAX:
        bad = lo if lo < _INT64_MIN else hi
        raise ValueError(f"{where} holds the token {bad}, which does not fit in int64")
    return tokens


def _token_value(token: Any, where: str) -> int:
    if isinstance(token, torch.Tensor):
        if token.dim() == 0 and not token.dtype.is_floating_point and token.dtype != torch.bool:
            return int(token)
    elif isinstance(token, numbers.Integral) and not isinstance(token, bool):
        return int(token)
    # numpy.bool_ is not numbers.Integral, so it lands here together with floats and strings.
    raise TypeError(
        f"{where} is {token!r} ({type(token).__name__}); tokens must be integers (int, a numpy "
        "integer or a 0-d integer tensor), not bools, floats or strings"
    )


def _token_lists(sequences: Any) -> list[list[int]]:
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
        raise TypeError(
            f"sequences must be an iterable of token sequences, got {type(sequences).__name__}"
        )
    if isinstance(sequences, torch.Tensor) and sequences.dim() < 2:
        raise ValueError(
            f"sequences is a {sequences.dim()}-d tensor; pass a list of 1-d tensors or a 2-d "
            "tensor with one sequence per row (to pack one sequence, pass [tensor])"
        )
    token_lists = [_token_list(seq, i) for i, seq in enumerate(sequences)]
    if not token_lists:
        raise ValueError("sequences is empty; pass at least one sequence to pack")
    return token_lists


# --------------------------------------------------------------------------------------------
# Bin packing: each returns, for every piece, the row it goes to (rows numbered from 0).
# --------------------------------------------------------------------------------------------


def _first_fit(lengths: Sequence[int], capacity: int) -> list[int]:
    # A max segment tree over the remaining capacity of every row that could ever be needed
    # (one per piece) finds the lowest-numbered row with room in O(log n); untouched rows have
    # full capacity, so "open a new row" is just first fit landing on the next unused row.
    n = len(lengths)
    size = 1
    while size < n:
        size *= 2
    room = [0] * (2 * size)
    room[size : size + n] = [capacity] * n
    for node in range(size - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
    rows = []
    for length in lengths:
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        rows.append(node - size)
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return rows


def _best_fit(lengths: Sequence[int], capacity: int) -> list[int]:
    # Open rows sorted by (remaining room, row); the first entry with room >= length is the
    # tightest fit, ties going to the lowest row.
    open_rows: list[tuple[int, int]] = []
    rows = []
    num_rows = 0
    for length in lengths:
        at = bisect.bisect_left(open_rows, (length, -1))
        if at < len(open_rows):
            room, row = open_rows.pop(at)
        else:
            room, row = capacity, num_rows
            num_rows += 1
        rows.append(row)
        if room > length:
            bisect.insort(open_rows, (room - length, row))
    return rows


def _next_fit(lengths: Sequence[int], capacity: int) -> list[int]:
    rows = []
    row, room = 0, capacity
    for length in lengths:
        if length > room:
            row, room = row + 1, capacity
        rows.append(row)
        room -= length
    return rows


# --------------------------------------------------------------------------------------------
# pack
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatch:
    """Sequences packed into ``B`` rows of ``max_len`` tokens, with only ``seq_lens`` stored.

    Attributes:
        tokens: ``(B, max_len)`` int64 token ids, padded with ``pad_id``.
        labels: ``(B, max_len)`` int64 next-token targets, already shifted:
            ``labels[b, p] == tokens[b, p + 1]`` inside a document, and ``ignore_index`` at the
            last token of every document and at padding. Use them without a further shift:
            ``F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=...)``.
        position_ids: ``(B, max_len)`` int64, restarting at 0 in every document; 0 at padding.
        seq_lens: per row, the lengths of its documents in the order they were laid out; the
            rest of the row is padding.
        placement: per input sequence, in input order, the :class:`Chunk` s it was cut into.
            One chunk unless the sequence was longer than ``max_len`` under ``policy="split"``.
        max_len: the row length.
        handle: a lazy BlockMask handle when one was attached (by :class:`PackingCollator` or
            :class:`PackedDataset`), else ``None``.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: list[list[int]]
    placement: list[list[Chunk]]
    max_len: int
    handle: LazyBlockMask | None = None

    @property
    def num_rows(self) -> int:
        """``B``, the number of packed rows."""
        return len(self.seq_lens)

    @property
    def num_sequences(self) -> int:
        """How many input sequences were packed."""
        return len(self.placement)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch."""
        return sum(map(sum, self.seq_lens))

    @property
    def efficiency(self) -> float:
        """Real tokens / ``(B * max_len)``: the share of the batch that is not padding.

        Example:
            >>> from flexmask.packing import pack
            >>> pack([[1, 2, 3], [4]], max_len=4).efficiency
            1.0
        """
        return self.num_tokens / (self.num_rows * self.max_len)

    @property
    def mask(self) -> Mask:
        """``causal() & document(seq_lens)``: causal inside each document, nothing across.

        Padding belongs to no document, so it neither attends nor is attended to. For
        ``seq_lens=[[2, 3]]`` and ``max_len=6`` (■ attends, ⬚ masked)::

            ■ ⬚ ⬚ ⬚ ⬚ ⬚
            ■ ■ ⬚ ⬚ ⬚ ⬚
            ⬚ ⬚ ■ ⬚ ⬚ ⬚
            ⬚ ⬚ ■ ■ ⬚ ⬚
            ⬚ ⬚ ■ ■ ■ ⬚
            ⬚ ⬚ ⬚ ⬚ ⬚ ⬚

        Example:
            >>> from flexmask.packing import pack
            >>> batch = pack([[1, 2], [3, 4, 5]], max_len=6)
            >>> batch.mask.to_dense(1, 1, 6, 6)[0, 0, 5].any().item()  # padding row
            False
        """
        return flexmask.causal() & flexmask.document(self.seq_lens)

    def lazy(
        self, num_heads: int = 1, device: Device = None, block_size: int = 128
    ) -> LazyBlockMask:
        """A picklable handle that builds this batch's BlockMask on first use.

        Args:
            num_heads: ``H`` of the BlockMask. The mask is the same for every head.
            device: where the BlockMask is built; ``None`` means flexmask's default.
            block_size: the BlockMask's ``BLOCK_SIZE``.

        Returns:
            ``flexmask.lazy(self.mask, B, num_heads, max_len, max_len, ...)``.

        Example:
            >>> from flexmask.packing import pack
            >>> batch = pack([[1, 2], [3, 4, 5]], max_len=8)
            >>> handle = batch.lazy(num_heads=2, block_size=4)
            >>> handle.built  # nothing built yet: cheap to create and to pickle
            False
            >>> handle.block_mask.seq_lengths
            (8, 8)
            >>> handle.built
            True
        """
        return flexmask.lazy(
            self.mask,
            self.num_rows,
            num_heads,
            self.max_len,
            self.max_len,
            device=device,
            BLOCK_SIZE=block_size,
        )

    def sequence_index(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, positions)`` of input sequence ``i``'s tokens, in order.

        Indexing a per-token tensor with it, ``x[batch.sequence_index(i)]``, gathers sequence
        ``i``'s entries (chunks included) as a ``(len_i, ...)`` tensor.

        Args:
            i: index of the input sequence, ``0 <= i < num_sequences``.

        Example:
            >>> from flexmask.packing import pack
            >>> batch = pack([[7, 8, 9], [5]], max_len=4)
            >>> batch.tokens[batch.sequence_index(0)].tolist()
            [7, 8, 9]
        """
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"i must be an int, got {type(i).__name__}")
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"i must be in [0, {self.num_sequences}), got {i}")
        chunks = self.placement[i]
        rows = torch.cat([torch.full((c.length,), c.row, dtype=torch.int64) for c in chunks])
        positions = torch.cat([torch.arange(c.start, c.start + c.length) for c in chunks])
        return rows, positions

    def unpack(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Splits a ``(B, max_len, ...)`` per-token tensor back into the input sequences.

        Args:
            per_token: anything aligned with ``tokens``: logits ``(B, max_len, V)``, per-token
                losses ``(B, max_len)``, hidden states, ...

        Returns:
            One ``(len_i, ...)`` tensor per input sequence, in input order; chunks of a split
            sequence are concatenated back together.

        Example:
            >>> from flexmask.packing import pack
            >>> batch = pack([[1, 2, 3], [4, 5]], max_len=3)
            >>> [t.tolist() for t in batch.unpack(batch.tokens)]
            [[1, 2, 3], [4, 5]]
        """
        if not isinstance(per_token, torch.Tensor):
            raise TypeError(f"per_token must be a tensor, got {type(per_token).__name__}")
        expected = (self.num_rows, self.max_len)
        if tuple(per_token.shape[:2]) != expected:
            raise ValueError(
                f"per_token must have shape (B, max_len, ...) = {expected + ('...',)}, got "
                f"{tuple(per_token.shape)}"
            )
        flat_index, lengths = self._flat_index()
        gathered = per_token.flatten(0, 1).index_select(0, flat_index.to(per_token.device))
        return list(gathered.split(lengths))

    def _flat_index(self) -> tuple[torch.Tensor, list[int]]:
        """Index into ``tokens.flatten()`` of every input token in input order, and the lengths."""
        starts, lengths = [], []
        for chunks in self.placement:
            for c in chunks:
                starts.append(c.row * self.max_len + c.start)
                lengths.append(c.length)
        index = _ranges(torch.tensor(starts), torch.tensor(lengths))
        return index, [sum(c.length for c in chunks) for chunks in self.placement]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """Moves ``tokens``, ``labels`` and ``position_ids``; the handle keeps its own device.

        Example:
            >>> from flexmask.packing import pack
            >>> pack([[1, 2]], max_len=2).to("cpu").tokens.device.type
            'cpu'
        """
        return dataclasses.replace(
            self,
            tokens=self.tokens.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> PackedBatch:
        """Pinned copy of the tensors; ``DataLoader(pin_memory=True)`` calls this."""
        return dataclasses.replace(
            self,
            tokens=self.tokens.pin_memory(),
            labels=self.labels.pin_memory(),
            position_ids=self.position_ids.pin_memory(),
        )


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    offsets = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    shift = torch.repeat_interleave(starts - offsets, lengths, output_size=total)
    return shift + torch.arange(total)


def pack(
    sequences: Iterable[Sequence[int] | torch.Tensor],
    max_len: int,
    *,
    policy: Policy = "split",
    pad_id: int = 0,
    ignore_index: int = -100,
    strategy: Strategy = "first_fit_decreasing",
) -> PackedBatch:
    """Packs token sequences into rows of at most ``max_len`` tokens.

    Every sequence becomes one document (or, if split, one document per chunk). Documents never
    see each other through :attr:`PackedBatch.mask`, ``position_ids`` restart at 0 in each, and
    ``labels`` never cross a document boundary, so a causal model computes the same thing for a
    packed document as for the sequence alone. Nothing is dropped: every input token is in
    exactly one packed position (see :attr:`PackedBatch.placement`).

    Args:
        sequences: lists/tuples of ints, or 1-d integer tensors/arrays; none may be empty.
        max_len: the row length, >= 1.
        policy: what to do with a sequence longer than ``max_len``: ``"split"`` cuts it into
            ``max_len``-token chunks (the last one shorter), each its own document, so no
            token attends or predicts across a cut; ``"reject"`` raises ``ValueError``.
        pad_id: token id written into padding.
        ignore_index: label written at each document's last token and at padding.
        strategy: how pieces are assigned to rows:

            * ``"first_fit_decreasing"`` (default): longest first, each into the lowest row
              with room. At most ``11/9 OPT + 6/9`` rows; O(n log n).
            * ``"best_fit_decreasing"``: longest first, each into the row it fills most
              tightly. Same bound; often leaves the free space in fewer rows.
            * ``"next_fit"``: input order, a new row whenever the next piece does not fit.
              Keeps documents in input order; the loosest packing.

            Ties keep input order, so packing is deterministic.

    Returns:
        A :class:`PackedBatch`.

    Raises:
        TypeError: ``sequences`` is not a collection of sequences, a token is not an integer
            (floats, bools and strings are refused), or ``max_len``/``pad_id``/``ignore_index``
            is not an int.
        ValueError: ``sequences`` or one of them is empty, ``max_len < 1``, an unknown
            ``policy``/``strategy``, or a sequence longer than ``max_len`` under ``"reject"``.

    Example:
        >>> from flexmask.packing import pack
        >>> batch = pack([[1, 2, 3], [4, 5], [6]], max_len=4)
        >>> batch.seq_lens
        [[3, 1], [2]]
        >>> batch.tokens.tolist()
        [[1, 2, 3, 6], [4, 5, 0, 0]]
        >>> batch.labels.tolist()
        [[2, 3, -100, -100], [5, -100, -100, -100]]
        >>> batch.position_ids.tolist()
        [[0, 1, 2, 0], [0, 1, 0, 0]]
        >>> batch.placement[2]
        [Chunk(row=0, start=3, length=1)]
    """
    max_len = _check_int("max_len", max_len, minimum=1)
    pad_id = _check_int("pad_id", pad_id)
    ignore_index = _check_int("ignore_index", ignore_index)
    _check_choice("policy", policy, _POLICIES)
    _check_choice("strategy", strategy, _STRATEGIES)
    token_lists = _token_lists(sequences)

    # Pieces: (sequence index, chunk start inside the sequence, length), in input order.
    pieces: list[tuple[int, int, int]] = []
    for i, seq in enumerate(token_lists):
        if len(seq) > max_len and policy == "reject":
            raise ValueError(
                f"sequences[{i}] has {len(seq)} tokens, more than max_len={max_len}; raise "
                'max_len, shorten the sequence, or pass policy="split" to cut it into chunks'
            )
        pieces.extend((i, s, min(max_len, len(seq) - s)) for s in range(0, len(seq), max_len))

    if strategy == "next_fit":
        order = list(range(len(pieces)))
        rows = _next_fit([p[2] for p in pieces], max_len)
    else:
        # sorted() is stable: equal lengths keep input order.
        order = sorted(range(len(pieces)), key=lambda k: -pieces[k][2])
        fit = _first_fit if strategy == "first_fit_decreasing" else _best_fit
        rows = fit([pieces[k][2] for k in order], max_len)

    # Lay pieces out in the order they were assigned, so each row's documents sit in that order.
    num_rows = max(rows) + 1
    seq_lens: list[list[int]] = [[] for _ in range(num_rows)]
    fill = [0] * num_rows
    chunk_of_piece: list[Chunk] = [Chunk(0, 0, 0)] * len(pieces)
    for k, row in zip(order, rows, strict=True):
        length = pieces[k][2]
        chunk_of_piece[k] = Chunk(row, fill[row], length)
        seq_lens[row].append(length)
        fill[row] += length
    placement: list[list[Chunk]] = [[] for _ in token_lists]
    # pieces are in input order and, within a sequence, in chunk order.
    for (i, _, _), chunk in zip(pieces, chunk_of_piece, strict=True):
        placement[i].append(chunk)
    dest_start = [c.row * max_len + c.start for c in chunk_of_piece]

    # Pieces in input order are `flat` split by `piece_lens`: label = next token in the piece,
    # position = offset in the piece; then one scatter puts them all in place.
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    piece_lens = torch.tensor([p[2] for p in pieces], dtype=torch.int64)
    piece_ends = torch.cumsum(piece_lens, 0)
    labels_flat = torch.roll(flat, -1)
    labels_flat[piece_ends - 1] = ignore_index
    positions_flat = torch.arange(len(flat)) - torch.repeat_interleave(
        piece_ends - piece_lens, piece_lens, output_size=len(flat)
    )
    dest = _ranges(torch.tensor(dest_start, dtype=torch.int64), piece_lens)

    tokens = torch.full((num_rows * max_len,), pad_id, dtype=torch.int64)
    labels = torch.full((num_rows * max_len,), ignore_index, dtype=torch.int64)
    position_ids = torch.zeros(num_rows * max_len, dtype=torch.int64)
    tokens[dest] = flat
    labels[dest] = labels_flat
    position_ids[dest] = positions_flat
    return PackedBatch(
        tokens=tokens.view(num_rows, max_len),
        labels=labels.view(num_rows, max_len),
        position_ids=position_ids.view(num_rows, max_len),
        seq_lens=seq_lens,
        placement=placement,
        max_len=max_len,
    )


# --------------------------------------------------------------------------------------------
# pack_tree
# --------------------------------------------------------------------------------------------


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
            >>> from flexmask.packing import pack_tree
            >>> tp = pack_tree([[1, 2, 3], [1, 4]])
            >>> tp.mask.to_dense(1, 1, 4, 4)[0, 0].int().tolist()
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
        """
        return flexmask.tree(self.parents)

    def lazy(
        self, num_heads: int = 1, device: Device = None, block_size: int = 128
    ) -> LazyBlockMask:
        """A picklable handle that builds the BlockMask (``B = 1``, ``L x L``) on first use.

        Example:
            >>> from flexmask.packing import pack_tree
            >>> tp = pack_tree([[1, 2, 3], [1, 4]], pad_to=8)
            >>> tp.lazy(block_size=4).block_mask.seq_lengths
            (8, 8)
        """
        return flexmask.lazy(
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
            >>> from flexmask.packing import pack_tree
            >>> tp = pack_tree([[1, 2, 3], [1, 4]])
            >>> tp.sequence_index(1).tolist()
            [0, 3]
            >>> # log-probs of sequence 1's tokens 1.. from logits of shape (L, V):
            >>> logits = torch.randn(tp.length, 5)
            >>> idx, seq = tp.sequence_index(1), tp.tokens[tp.sequence_index(1)]
            >>> logp = logits[idx[:-1]].log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
            >>> logp.shape
            torch.Size([1])
        """
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"i must be an int, got {type(i).__name__}")
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
            >>> from flexmask.packing import pack_tree
            >>> tp = pack_tree([[1, 2, 3], [1, 4], [1, 2]])
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


def pack_tree(
    sequences: Iterable[Sequence[int] | torch.Tensor],
    *,
    pad_to: int | None = None,
    pad_id: int = 0,
) -> TreePack:
    """Merges sequences that share prefixes into one trie laid out in preorder.

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
        sequences: lists/tuples of ints, or 1-d integer tensors/arrays; none may be empty.
        pad_to: pad ``tokens``/``position_ids`` to this length (e.g. a multiple of the block
            size, so shapes repeat across steps); padding is masked. ``None`` means no padding.
        pad_id: token id written into padding.

    Returns:
        A :class:`TreePack`.

    Raises:
        TypeError: a token is not an integer, or ``pad_to``/``pad_id`` is not an int.
        ValueError: ``sequences`` or one of them is empty, or ``pad_to`` is smaller than the
            number of trie nodes.

    Example:
        >>> from flexmask.packing import pack_tree
        >>> tp = pack_tree([[1, 2, 3], [1, 2, 4], [1, 2]], pad_to=6)
        >>> tp.tokens.tolist(), tp.parents.tolist(), tp.position_ids.tolist()
        ([1, 2, 3, 4, 0, 0], [-1, 0, 1, 1], [0, 1, 2, 2, 0, 0])
        >>> tp.sequence_index(1).tolist(), tp.saved_tokens
        ([0, 1, 3], 4)
    """
    pad_id = _check_int("pad_id", pad_id)
    if pad_to is not None:
        pad_to = _check_int("pad_to", pad_to, minimum=1)
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
    paths = _ranges(torch.tensor(path_starts), torch.tensor(path_lens))

    length = num_tokens if pad_to is None else pad_to
    tokens = torch.full((length,), pad_id, dtype=torch.int64)
    tokens[:num_tokens] = torch.tensor(list(itertools.chain.from_iterable(runs)))
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


class _Edge:
    """A radix-trie edge: a run of tokens, then children keyed by their first token.

    Children are a dict, so they stay in insertion (= first-appearance) order.
    """

    __slots__ = ("tokens", "children", "start")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.children: dict[int, _Edge] = {}
        self.start = 0  # position of the first token in the layout, set by pack_tree

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


# --------------------------------------------------------------------------------------------
# DataLoader integration
# --------------------------------------------------------------------------------------------


class PackingCollator:
    """``collate_fn`` that packs a list of sequences and attaches a lazy, unbuilt BlockMask.

    Workers only pack (cheap Python and small tensors) and ship the handle's recipe; the
    BlockMask is built in the process that first reads ``batch.handle.block_mask``, on its
    device, so no mask crosses process boundaries and no worker touches the accelerator.

    Args:
        max_len: row length, see :func:`pack`.
        num_heads: ``H`` of the BlockMask.
        device: where the BlockMask will be built (``None``: flexmask's default).
        block_size: the BlockMask's ``BLOCK_SIZE``.
        key: when dataset items are mappings (e.g. ``{"input_ids": [...]}``), the key holding
            the tokens; ``None`` means items are token sequences themselves.
        policy, pad_id, ignore_index, strategy: passed to :func:`pack`.

    Example:
        >>> from flexmask.packing import PackingCollator
        >>> from torch.utils.data import DataLoader
        >>> data = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
        >>> loader = DataLoader(data, batch_size=4, collate_fn=PackingCollator(max_len=5))
        >>> batch = next(iter(loader))
        >>> batch.seq_lens, batch.handle.built
        ([[4, 1], [3, 2]], False)
    """

    def __init__(
        self,
        max_len: int,
        num_heads: int = 1,
        *,
        device: Device = None,
        block_size: int = 128,
        key: str | None = None,
        policy: Policy = "split",
        pad_id: int = 0,
        ignore_index: int = -100,
        strategy: Strategy = "first_fit_decreasing",
    ) -> None:
        # Validated here so a bad setting fails at construction, not later inside a worker.
        self.max_len = _check_int("max_len", max_len, minimum=1)
        self.num_heads = _check_int("num_heads", num_heads, minimum=1)
        self.block_size = _check_int("block_size", block_size, minimum=1)
        # A name or torch.device, checked; nothing touches the device until a handle builds.
        self.device = None if device is None else check_device(device)
        self.key = key
        self.policy = _check_choice("policy", policy, _POLICIES)
        self.pad_id = _check_int("pad_id", pad_id)
        self.ignore_index = _check_int("ignore_index", ignore_index)
        self.strategy = _check_choice("strategy", strategy, _STRATEGIES)

    def __call__(self, items: Sequence[Any]) -> PackedBatch:
        if self.key is not None:
            items = [_select(item, self.key, j) for j, item in enumerate(items)]
        batch = pack(
            items,
            self.max_len,
            policy=self.policy,  # type: ignore[arg-type]
            pad_id=self.pad_id,
            ignore_index=self.ignore_index,
            strategy=self.strategy,  # type: ignore[arg-type]
        )
        handle = batch.lazy(self.num_heads, self.device, self.block_size)
        return dataclasses.replace(batch, handle=handle)

    def __repr__(self) -> str:
        return (
            f"PackingCollator(max_len={self.max_len}, num_heads={self.num_heads}, "
            f"device={self.device!r}, block_size={self.block_size}, key={self.key!r}, "
            f"policy={self.policy!r}, strategy={self.strategy!r})"
        )


def _select(item: Any, key: str, index: int) -> Any:
    if not isinstance(item, Mapping):
        raise TypeError(
            f"item {index} is a {type(item).__name__}, but key={key!r} was given; with key, "
            "items must be mappings such as {'input_ids': [...]} (or pass key=None)"
        )
    if key not in item:
        raise KeyError(f"item {index} has no {key!r}; its keys are {sorted(map(str, item))}")
    return item[key]


class PackedDataset(torch.utils.data.IterableDataset):
    """Streams :class:`PackedBatch` es, each packing the next ``buffer_size`` sequences.

    Use with ``DataLoader(dataset, batch_size=None)``; every batch carries an unbuilt lazy
    handle, as with :class:`PackingCollator`. With several workers, worker ``w`` of ``n`` takes
    sequences ``w, w + n, w + 2n, ...``, so ``sequences`` must iterate the same way in every
    worker (a list, a file, a seeded generator). The last, partial buffer is packed too.

    Args:
        sequences: an iterable of token sequences (or of mappings, with ``key``).
        max_len: row length, see :func:`pack`.
        buffer_size: sequences packed together; more gives tighter packing and bigger batches.
        num_heads, device, block_size, key, policy, pad_id, ignore_index, strategy: as in
            :class:`PackingCollator`.

    Example:
        >>> from flexmask.packing import PackedDataset
        >>> data = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11]]
        >>> batches = list(PackedDataset(data, max_len=5, buffer_size=4))
        >>> [b.seq_lens for b in batches]
        [[[4, 1], [3, 2]], [[1]]]
    """

    def __init__(
        self,
        sequences: Iterable[Any],
        max_len: int,
        *,
        buffer_size: int = 64,
        num_heads: int = 1,
        device: Device = None,
        block_size: int = 128,
        key: str | None = None,
        policy: Policy = "split",
        pad_id: int = 0,
        ignore_index: int = -100,
        strategy: Strategy = "first_fit_decreasing",
    ) -> None:
        super().__init__()
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
            raise TypeError(
                f"sequences must be an iterable of token sequences, got {type(sequences).__name__}"
            )
        self.sequences = sequences
        self.buffer_size = _check_int("buffer_size", buffer_size, minimum=1)
        self.collate = PackingCollator(
            max_len,
            num_heads,
            device=device,
            block_size=block_size,
            key=key,
            policy=policy,
            pad_id=pad_id,
            ignore_index=ignore_index,
            strategy=strategy,
        )

    def __iter__(self) -> Iterator[PackedBatch]:
        items: Iterator[Any] = iter(self.sequences)
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            items = itertools.islice(items, worker.id, None, worker.num_workers)
        while buffer := list(itertools.islice(items, self.buffer_size)):
            yield self.collate(buffer)
