"""Documents side by side: :func:`pack` bin-packs sequences into rows, one document each."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from flexmask._validate import check_int
from flexmask.packing.check import check_batch, check_enabled
from flexmask.packing.tokens import (
    _POLICIES,
    _STRATEGIES,
    Device,
    Policy,
    Strategy,
    _best_fit,
    _check_choice,
    _check_memory,
    _first_fit,
    _labels,
    _loss_masks,
    _next_fit,
    _ranges,
    _token_lists,
)
from flexmask.pieces import causal, document
from flexmask.runtime import lazy

if TYPE_CHECKING:
    from flexmask.algebra import Mask
    from flexmask.runtime import LazyBlockMask


class Chunk(NamedTuple):
    """Where one piece of an input sequence landed: ``tokens[row, start:start + length]``."""

    row: int
    start: int
    length: int


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
        return causal() & document(self.seq_lens)

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
        return lazy(
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
        i = check_int(i, "i")
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


def pack(
    sequences: Iterable[Sequence[int] | torch.Tensor],
    max_len: int,
    *,
    policy: Policy = "split",
    pad_id: int = 0,
    ignore_index: int = -100,
    strategy: Strategy = "first_fit_decreasing",
    labels: Iterable[Sequence[int] | torch.Tensor] | None = None,
    loss_mask: Iterable[Sequence[bool] | torch.Tensor] | None = None,
    split_across_pack: bool = False,
    check: bool | None = None,
) -> PackedBatch:
    """Packs token sequences into rows of at most ``max_len`` tokens.

    Every sequence becomes one document (or, if split, one document per chunk). Documents never
    see each other through :attr:`PackedBatch.mask`, ``position_ids`` restart at 0 in each, and
    ``labels`` never cross a document boundary, so a causal model computes the same thing for a
    packed document as for the sequence alone. Nothing is dropped: every input token is in
    exactly one packed position (see :attr:`PackedBatch.placement`).

    Which tokens are trained on: by default every next token inside a document. ``labels``
    (unshifted, aligned with the tokens, as Hugging Face and torchtune write them) or
    ``loss_mask`` (``True`` where a token is a training target) choose otherwise; either way the
    packed ``labels`` are shifted here, per document, so ``labels[b, p]`` is the target of the
    logit at ``p``: the next token's label, or ``ignore_index`` where that token is masked, at a
    document's last token and at padding. A document's first token is never a target (nothing
    before it in the document predicts it).

    Args:
        sequences: lists/tuples of token ids (ints >= 0), or 1-d integer tensors/arrays; none
            may be empty.
        max_len: the row length, >= 1.
        policy: what to do with a sequence longer than ``max_len``: ``"split"`` cuts it into
            ``max_len``-token chunks (the last one shorter), each its own document, so no
            token attends or predicts across a cut; ``"reject"`` raises ``ValueError``.
        pad_id: token id (>= 0) written into padding.
        ignore_index: label written at each document's last token and at padding.
        strategy: how pieces are assigned to rows:

            * ``"first_fit_decreasing"`` (default): longest first, each into the lowest row
              with room. At most ``11/9 OPT + 6/9`` rows; O(n log n).
            * ``"best_fit_decreasing"``: longest first, each into the row it fills most
              tightly. Same bound; often leaves the free space in fewer rows.
            * ``"next_fit"``: input order, a new row whenever the next piece does not fit.
              Keeps documents in input order; the loosest packing.

            Ties keep input order, so packing is deterministic. Ignored with
            ``split_across_pack``.
        labels: one label list per sequence, as long as the sequence and aligned with it
            (``labels[i][t]`` is the target for token ``t``, ``ignore_index`` to skip it), e.g.
            torchtune's ``labels`` with the prompt at ``-100``. Not shifted: packing shifts.
        loss_mask: one bool list per sequence, as long as the sequence: ``True`` where the token
            is trained on (the completion), ``False`` where it is not (the prompt). torchtune's
            ``mask`` means the opposite: pass ``~mask``. At most one of ``labels``/``loss_mask``.
        split_across_pack: like torchtune's ``split_across_pack=True``: lay sequences end to end
            in input order and cut at every row end, so every row but the last is full. The
            part of a sequence after a cut is its own document: it cannot attend to the part
            before it, its ``position_ids`` restart at 0 (it is computed exactly as that chunk
            alone would be; torchtune instead keeps counting, giving positions whose context
            the mask hides), and the token before the cut has no label. ``unpack`` joins the
            parts again. ``policy`` must stay ``"split"``.
        check: run :func:`~flexmask.check_batch` on the result and raise ValueError at a
            disagreement (a debug mode; None: the environment variable FLEXMASK_CHECK=1).

    Returns:
        A :class:`PackedBatch`.

    Raises:
        TypeError: ``sequences`` is not a collection of sequences, a token is not an integer
            (floats, bools and strings are refused), or ``max_len``/``pad_id``/``ignore_index``
            is not an int.
        ValueError: ``sequences`` or one of them is empty, a token id or ``pad_id`` is
            negative (ids index the vocabulary, where a negative one would wrap), a label is
            negative but not ``ignore_index``, ``max_len < 1``, an unknown
            ``policy``/``strategy``, a sequence longer than ``max_len`` under ``"reject"``,
            ``labels``/``loss_mask`` not one per sequence of the same length, or both given.
            Also, before anything is allocated, when the packed tensors would not fit in
            memory: ``tokens``, ``labels`` and ``position_ids`` take 24 bytes per slot
            (``B * max_len * 24``), and more than the machine's RAM (or the process's cgroup
            limit, when lower) is refused, since those tensors are written in full. Any
            ``max_len`` that fits is accepted, however much of it is padding.

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

        Train on the completion only (prompt = the first two tokens of each sequence):

        >>> pack([[1, 2, 3, 4], [5, 6, 7]], max_len=8,
        ...      loss_mask=[[0, 0, 1, 1], [0, 0, 1]]).labels.tolist()
        [[-100, 3, 4, -100, -100, 7, -100, -100]]
        >>> pack([[1, 2, 3], [4, 5, 6]], max_len=4, split_across_pack=True).tokens.tolist()
        [[1, 2, 3, 4], [5, 6, 0, 0]]
    """
    max_len, pad_id, ignore_index = _check_options(
        max_len, pad_id, ignore_index, policy, strategy, split_across_pack, labels, loss_mask
    )
    token_lists = _token_lists(sequences)
    target_lists = _target_lists(token_lists, labels, loss_mask, ignore_index)
    if split_across_pack:
        assignment = _assign_across_rows(token_lists, max_len)
    else:
        assignment = _assign_to_rows(_cut(token_lists, max_len, policy), max_len, strategy)
    layout = _lay_out_pieces(assignment, len(token_lists), max_len)
    _check_pack_memory(layout.num_rows, max_len, token_lists)
    tokens, packed_labels, position_ids = _scatter(
        token_lists, target_lists, assignment.pieces, layout, max_len, pad_id, ignore_index
    )
    batch = PackedBatch(
        tokens=tokens,
        labels=packed_labels,
        position_ids=position_ids,
        seq_lens=layout.seq_lens,
        placement=layout.placement,
        max_len=max_len,
    )
    if check_enabled(check):
        check_batch(batch=batch, raise_on_error=True)
    return batch


class _Assignment(NamedTuple):
    """The pieces the sequences are cut into, and the row each piece goes to.

    ``pieces`` are ``(sequence index, chunk start inside the sequence, length)``, in input order
    and, within a sequence, in chunk order. ``order`` lists the piece indices in the order they
    were assigned; ``rows[j]`` is the row of piece ``order[j]``.
    """

    pieces: list[tuple[int, int, int]]
    order: list[int]
    rows: list[int]


class _Layout(NamedTuple):
    """Where the assigned pieces sit.

    ``seq_lens`` and ``placement`` are :class:`PackedBatch`'s; ``dest_start`` is, per piece, the
    index of its first token in the flattened ``(num_rows * max_len,)`` batch.
    """

    num_rows: int
    seq_lens: list[list[int]]
    placement: list[list[Chunk]]
    dest_start: list[int]


def _check_options(
    max_len: int,
    pad_id: int,
    ignore_index: int,
    policy: Policy,
    strategy: Strategy,
    split_across_pack: bool,
    labels: object,
    loss_mask: object,
) -> tuple[int, int, int]:
    """:func:`pack`'s checks on everything but the sequences; ``max_len, pad_id, ignore_index``."""
    max_len = check_int(max_len, "max_len", minimum=1)
    pad_id = check_int(pad_id, "pad_id", minimum=0)
    ignore_index = check_int(ignore_index, "ignore_index")
    _check_choice("policy", policy, _POLICIES)
    _check_choice("strategy", strategy, _STRATEGIES)
    if not isinstance(split_across_pack, bool):
        raise TypeError(f"split_across_pack must be a bool, got {split_across_pack!r}")
    if split_across_pack and policy != "split":
        raise ValueError(
            f"split_across_pack=True cuts every sequence at row ends; policy={policy!r} cannot "
            'apply (leave policy="split", or pass split_across_pack=False)'
        )
    if labels is not None and loss_mask is not None:
        raise ValueError(
            "pass labels or loss_mask, not both (a loss mask is labels equal to the tokens where "
            "True and ignore_index where False)"
        )
    return max_len, pad_id, ignore_index


def _target_lists(
    token_lists: list[list[int]],
    labels: Iterable[Sequence[int] | torch.Tensor] | None,
    loss_mask: Iterable[Sequence[bool] | torch.Tensor] | None,
    ignore_index: int,
) -> list[list[int]] | None:
    """Per sequence, the unshifted target of every token; ``None`` for the tokens themselves."""
    if labels is not None:
        return _labels("labels", labels, token_lists, ignore_index)
    if loss_mask is not None:
        masks = _loss_masks("loss_mask", loss_mask, token_lists)
        return [
            [t if keep else ignore_index for t, keep in zip(seq, mask, strict=True)]
            for seq, mask in zip(token_lists, masks, strict=True)
        ]
    return None


def _cut(token_lists: list[list[int]], max_len: int, policy: Policy) -> list[tuple[int, int, int]]:
    """Every sequence cut into ``max_len``-token pieces, in input order; raises under reject."""
    pieces: list[tuple[int, int, int]] = []
    for i, seq in enumerate(token_lists):
        if len(seq) > max_len and policy == "reject":
            raise ValueError(
                f"sequences[{i}] has {len(seq)} tokens, more than max_len={max_len}; raise "
                'max_len, shorten the sequence, or pass policy="split" to cut it into chunks'
            )
        pieces.extend((i, s, min(max_len, len(seq) - s)) for s in range(0, len(seq), max_len))
    return pieces


def _assign_to_rows(
    pieces: list[tuple[int, int, int]], max_len: int, strategy: Strategy
) -> _Assignment:
    """Bin-packs the pieces into rows of ``max_len`` with ``strategy``."""
    if strategy == "next_fit":
        order = list(range(len(pieces)))
        return _Assignment(pieces, order, _next_fit([p[2] for p in pieces], max_len))
    # sorted() is stable: equal lengths keep input order.
    order = sorted(range(len(pieces)), key=lambda k: -pieces[k][2])
    fit = _first_fit if strategy == "first_fit_decreasing" else _best_fit
    return _Assignment(pieces, order, fit([pieces[k][2] for k in order], max_len))


def _assign_across_rows(token_lists: list[list[int]], max_len: int) -> _Assignment:
    """``split_across_pack``: sequences end to end, cut at every row end, kept in input order."""
    pieces, rows = _cut_across_rows(token_lists, max_len)
    return _Assignment(pieces, list(range(len(pieces))), rows)


def _lay_out_pieces(assignment: _Assignment, num_sequences: int, max_len: int) -> _Layout:
    """Lays pieces out in the order they were assigned, so each row's documents sit in it."""
    pieces, order, rows = assignment
    num_rows = max(rows) + 1
    seq_lens: list[list[int]] = [[] for _ in range(num_rows)]
    fill = [0] * num_rows
    chunk_of_piece: list[Chunk] = [Chunk(0, 0, 0)] * len(pieces)
    for k, row in zip(order, rows, strict=True):
        length = pieces[k][2]
        chunk_of_piece[k] = Chunk(row, fill[row], length)
        seq_lens[row].append(length)
        fill[row] += length
    placement: list[list[Chunk]] = [[] for _ in range(num_sequences)]
    # pieces are in input order and, within a sequence, in chunk order.
    for (i, _, _), chunk in zip(pieces, chunk_of_piece, strict=True):
        placement[i].append(chunk)
    dest_start = [c.row * max_len + c.start for c in chunk_of_piece]
    return _Layout(num_rows, seq_lens, placement, dest_start)


def _check_pack_memory(num_rows: int, max_len: int, token_lists: list[list[int]]) -> None:
    """Refuses, before allocating, packed tensors that would not fit in memory."""
    _check_memory(
        24 * num_rows * max_len,
        f"tokens, labels and position_ids (3 int64 tensors of {num_rows} x {max_len})",
        f"max_len={max_len}",
        f"the sequences hold {sum(map(len, token_lists))} tokens, the longest "
        f"{max(map(len, token_lists))}: a max_len near the longest wastes little on padding, "
        "and fewer sequences per call make fewer rows",
    )


def _scatter(
    token_lists: list[list[int]],
    target_lists: list[list[int]] | None,
    pieces: list[tuple[int, int, int]],
    layout: _Layout,
    max_len: int,
    pad_id: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed ``(tokens, labels, position_ids)``, each ``(num_rows, max_len)``."""
    # Pieces in input order are `flat` split by `piece_lens`: label = next token in the piece,
    # position = offset in the piece; then one scatter puts them all in place.
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    if target_lists is None:
        targets = flat
    else:
        targets = torch.tensor(list(itertools.chain.from_iterable(target_lists)), dtype=torch.int64)
    piece_lens = torch.tensor([p[2] for p in pieces], dtype=torch.int64)
    piece_ends = torch.cumsum(piece_lens, 0)
    labels_flat = torch.roll(targets, -1)
    labels_flat[piece_ends - 1] = ignore_index
    positions_flat = torch.arange(len(flat)) - torch.repeat_interleave(
        piece_ends - piece_lens, piece_lens, output_size=len(flat)
    )
    dest = _ranges(torch.tensor(layout.dest_start, dtype=torch.int64), piece_lens)

    num_rows = layout.num_rows
    tokens = torch.full((num_rows * max_len,), pad_id, dtype=torch.int64)
    packed_labels = torch.full((num_rows * max_len,), ignore_index, dtype=torch.int64)
    position_ids = torch.zeros(num_rows * max_len, dtype=torch.int64)
    tokens[dest] = flat
    packed_labels[dest] = labels_flat
    position_ids[dest] = positions_flat
    shape = (num_rows, max_len)
    return tokens.view(shape), packed_labels.view(shape), position_ids.view(shape)


def _cut_across_rows(
    token_lists: list[list[int]], max_len: int
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Sequences end to end in input order, cut at every row end: the pieces and their rows."""
    pieces: list[tuple[int, int, int]] = []
    rows: list[int] = []
    row, fill = 0, 0
    for i, seq in enumerate(token_lists):
        start = 0
        while start < len(seq):
            if fill == max_len:
                row, fill = row + 1, 0
            take = min(max_len - fill, len(seq) - start)
            pieces.append((i, start, take))
            rows.append(row)
            start += take
            fill += take
    return pieces, rows
