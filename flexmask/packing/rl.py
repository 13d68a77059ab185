"""RL batches: many sampled sequences in prefix trees under a token budget, and their log-probs.

A GRPO step samples several completions per prompt. :func:`pack_tree_batch` merges them into
prefix trees of at most ``max_tokens`` nodes, one tree per row of a ``(B, max_tokens)`` batch,
so each shared prompt is computed once per tree. :meth:`TreeBatch.log_probs` then reads every
sequence's completion log-probs (and entropies) out of the packed logits in one vectorised
gather: a handful of tensor ops whatever the number of sequences or tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from flexmask._validate import check_int
from flexmask.packing.check import check_batch, check_enabled
from flexmask.packing.tokens import Device, _check_memory, _loss_masks, _token_lists
from flexmask.packing.trie import _Edge, _insert, _lay_out, _shared
from flexmask.pieces import tree
from flexmask.runtime import lazy

if TYPE_CHECKING:
    from flexmask.algebra import Mask
    from flexmask.runtime import LazyBlockMask


class SequenceLogProbs(NamedTuple):
    """Per-sequence values of the trained tokens, in input order, padded to the longest.

    Attributes:
        log_probs: ``(N, T)`` float32: ``log_probs[i, k]`` is the log-probability of sequence
            ``i``'s ``k``-th trained token (its ``k``-th completion token when trained tokens
            are the completion); 0 where ``mask`` is False.
        entropy: ``(N, T)`` float32 entropy of the distribution that predicted that token, or
            ``None`` when not asked for.
        mask: ``(N, T)`` bool, True at real entries. A sequence with nothing to train on (an
            empty sequence, or an empty completion) is an all-False row of zeros.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    mask: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class TreeBatch:
    """Sequences merged into ``B`` prefix trees, one per row of ``max_tokens`` tokens.

    Each row is a trie laid out in preorder (see :func:`flexmask.pack_one_tree`); a sequence
    lives in exactly one row. Rows past the last real tree, added by ``num_rows``, are dummy
    trees: a single padding token that attends only to itself, so every rank of a
    data-parallel job can run the same number of rows.

    Attributes:
        tokens: ``(B, max_tokens)`` int64 trie nodes, then ``pad_id``.
        position_ids: ``(B, max_tokens)`` int64 depth of every node; 0 at padding.
        parents: per row, the ``(n,)`` parent positions of its nodes (``-1`` for roots).
        num_tokens: per row, the real nodes (0 for a dummy row).
        row_of: per input sequence, its row; ``-1`` for an empty sequence.
        unpacked_tokens: total length of the input sequences.
        max_tokens: the row length, the token budget of one tree.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    parents: list[torch.Tensor]
    num_tokens: list[int]
    row_of: list[int]
    unpacked_tokens: int
    max_tokens: int
    _paths: torch.Tensor = dataclasses.field(repr=False)
    _path_offsets: list[int] = dataclasses.field(repr=False)
    _predictor: torch.Tensor = dataclasses.field(repr=False)
    _predictor_inverse: torch.Tensor = dataclasses.field(repr=False)
    _target: torch.Tensor = dataclasses.field(repr=False)
    _target_row: torch.Tensor = dataclasses.field(repr=False)
    _target_col: torch.Tensor = dataclasses.field(repr=False)
    _width: int = dataclasses.field(repr=False)
    _max_target: int = dataclasses.field(repr=False)
    _max_token: int = dataclasses.field(repr=False)
    _pad_id: int = dataclasses.field(repr=False)

    @property
    def num_rows(self) -> int:
        """``B``, the number of trees (dummy ones included)."""
        return len(self.parents)

    @property
    def num_sequences(self) -> int:
        """How many input sequences were packed (empty ones included)."""
        return len(self.row_of)

    @property
    def saved_tokens(self) -> int:
        """Tokens not computed thanks to shared prefixes: ``unpacked_tokens - sum(num_tokens)``."""
        return self.unpacked_tokens - sum(self.num_tokens)

    @property
    def mask(self) -> Mask:
        """``tree(parents)`` with one tree per row: a token attends to its ancestors and itself.

        Example:
            >>> from flexmask.packing import pack_tree_batch
            >>> batch = pack_tree_batch([[1, 2, 3], [1, 2, 4], [5, 6]], max_tokens=4)
            >>> dense = batch.mask.to_dense(2, 1, 4, 4)[:, 0].int()
            >>> dense[0].tolist()   # [1, 2, 3] and [1, 2, 4] share [1, 2]
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
            >>> dense[1].tolist()   # [5, 6], then padding
            [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
        """
        return tree(self.parents)

    def lazy(
        self, num_heads: int = 1, device: Device = None, block_size: int = 128
    ) -> LazyBlockMask:
        """A picklable handle that builds the ``(B, H, max_tokens, max_tokens)`` BlockMask.

        Example:
            >>> from flexmask.packing import pack_tree_batch
            >>> batch = pack_tree_batch([[1, 2, 3], [1, 2, 4]], max_tokens=8)
            >>> batch.lazy(block_size=4).block_mask.shape
            (1, 1, 8, 8)
        """
        return lazy(
            self.mask,
            self.num_rows,
            num_heads,
            self.max_tokens,
            self.max_tokens,
            device=device,
            BLOCK_SIZE=block_size,
        )

    def sequence_index(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, positions)`` of sequence ``i``'s tokens, in order.

        Example:
            >>> from flexmask.packing import pack_tree_batch
            >>> batch = pack_tree_batch([[1, 2, 3], [1, 2, 4]], max_tokens=8)
            >>> batch.tokens[batch.sequence_index(1)].tolist()
            [1, 2, 4]
        """
        i = check_int(i, "i")
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"i must be in [0, {self.num_sequences}), got {i}")
        flat = self._paths[self._path_offsets[i] : self._path_offsets[i + 1]]
        return flat // self.max_tokens, flat % self.max_tokens

    def unpack(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Gathers a ``(B, max_tokens, ...)`` per-token tensor along every sequence's path.

        Example:
            >>> from flexmask.packing import pack_tree_batch
            >>> batch = pack_tree_batch([[1, 2, 3], [], [1, 4]], max_tokens=4)
            >>> [t.tolist() for t in batch.unpack(batch.tokens)]
            [[1, 2, 3], [], [1, 4]]
        """
        if not isinstance(per_token, torch.Tensor):
            raise TypeError(f"per_token must be a tensor, got {type(per_token).__name__}")
        expected = (self.num_rows, self.max_tokens)
        if tuple(per_token.shape[:2]) != expected:
            raise ValueError(
                f"per_token must have shape (B, max_tokens, ...) = {expected + ('...',)}, got "
                f"{tuple(per_token.shape)}"
            )
        gathered = per_token.flatten(0, 1).index_select(0, self._paths.to(per_token.device))
        lengths = [b - a for a, b in itertools.pairwise(self._path_offsets)]
        return list(gathered.split(lengths))

    def log_probs(
        self,
        logits: torch.Tensor,
        temperature: float = 1.0,
        entropy: bool = False,
        rows: slice | None = None,
    ) -> SequenceLogProbs:
        """Every sequence's trained-token log-probs (and entropies) from the packed logits.

        One vectorised gather: the softmax statistics are computed once per packed position
        that predicts something (a shared prompt's last token predicts the first token of
        every completion under it), then indexed per target. No Python loop over sequences
        or tokens; gradients flow back to ``logits``. Computed in float32 whatever the
        logits' dtype.

        Args:
            logits: ``(B, max_tokens, V)`` model output for :attr:`tokens`, or for the rows
                ``rows`` selects. ``V`` is the vocabulary: every packed token id and
                ``pad_id`` must be below it (``ValueError`` otherwise).
            temperature: the sampling temperature; logits are divided by it first, as the
                sampler did, so the log-probs are those of the policy that sampled.
            entropy: also return the entropy of each predicting distribution.
            rows: a micro-batch: ``logits`` cover only ``tokens[rows]`` (a ``slice`` of
                rows, step 1). Sequences of other rows come back as all-masked zero rows,
                so summing the micro-batches' losses gives the whole batch's.

        Returns:
            A :class:`SequenceLogProbs` of shape ``(num_sequences, T)``, ``T`` the most
            trained tokens of any sequence.

        Example:
            >>> import torch
            >>> from flexmask.packing import pack_tree_batch
            >>> batch = pack_tree_batch([[1, 2, 3], [1, 2, 4, 5]], max_tokens=8, prompt_lens=[2, 2])
            >>> out = batch.log_probs(torch.zeros(1, 8, 6), entropy=True)
            >>> out.mask.tolist()
            [[True, False], [True, True]]
            >>> round(float(out.log_probs[1, 1].exp()), 4), round(float(out.entropy[0, 0]), 4)
            (0.1667, 1.7918)
        """
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise TypeError(
                "logits must be a (B, max_tokens, V) tensor, got "
                + (
                    f"shape {tuple(logits.shape)}"
                    if isinstance(logits, torch.Tensor)
                    else type(logits).__name__
                )
            )
        first, stop = 0, self.num_rows
        if rows is not None:
            if not isinstance(rows, slice) or rows.step not in (None, 1):
                raise TypeError(f"rows must be a slice of rows with step 1, got {rows!r}")
            first, stop, _ = rows.indices(self.num_rows)
            stop = max(first, stop)
        if tuple(logits.shape[:2]) != (stop - first, self.max_tokens):
            raise ValueError(
                f"logits must have shape (B, max_tokens, V) = ({stop - first}, "
                f"{self.max_tokens}, V), got {tuple(logits.shape)}"
            )
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, numbers.Real)
            or not temperature > 0
        ):
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
        # Token ids are >= 0 (pack_tree_batch refuses negatives, which would wrap as indices),
        # so V bounds them from above: every id, prompt tokens and pad_id included, must be < V.
        vocab = logits.shape[2]
        if vocab <= self._max_target:
            raise ValueError(
                f"logits has V={vocab} entries but the targets go up to token "
                f"{self._max_target}; pass logits over the whole vocabulary"
            )
        if vocab <= self._max_token:
            raise ValueError(
                f"logits has V={vocab} entries but the sequences hold token {self._max_token}; "
                "pass logits over the whole vocabulary"
            )
        if vocab <= self._pad_id:
            raise ValueError(
                f"pad_id={self._pad_id} is not a token of the logits' vocabulary (V={vocab}); "
                f"pack with a pad_id in [0, {vocab})"
            )
        device = logits.device
        predictor, inverse = self._predictor, self._predictor_inverse
        target, target_row, target_col = self._target, self._target_row, self._target_col
        if (first, stop) != (0, self.num_rows):
            # Keep the targets predicted inside the micro-batch's rows (a sequence lives in
            # one row, so whole sequences are kept or dropped).
            lo, hi = first * self.max_tokens, stop * self.max_tokens
            kept_positions = (predictor >= lo) & (predictor < hi)
            kept = kept_positions[inverse]
            renumber = torch.cumsum(kept_positions, 0) - 1
            predictor, inverse = predictor[kept_positions] - lo, renumber[inverse[kept]]
            target, target_row, target_col = target[kept], target_row[kept], target_col[kept]
        scaled = logits.flatten(0, 1).index_select(0, predictor.to(device)).float()
        if temperature != 1.0:
            scaled = scaled / temperature
        log_z = scaled.logsumexp(-1)
        inverse = inverse.to(device)
        picked = scaled[inverse, target.to(device)] - log_z[inverse]
        shape = (self.num_sequences, self._width)
        where = (target_row.to(device), target_col.to(device))
        log_probs = picked.new_zeros(shape).index_put(where, picked)
        mask = torch.zeros(shape, dtype=torch.bool, device=device).index_put(
            where, torch.ones_like(picked, dtype=torch.bool)
        )
        ent = None
        if entropy:
            # H = log Z - sum p * x, per predicting position, then one entry per target.
            per_position = log_z - (scaled.softmax(-1) * scaled).sum(-1)
            ent = picked.new_zeros(shape).index_put(where, per_position[inverse])
        return SequenceLogProbs(log_probs, ent, mask)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TreeBatch:
        """Moves ``tokens`` and ``position_ids`` (gather plans move lazily with the logits)."""
        return dataclasses.replace(
            self,
            tokens=self.tokens.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
        )


def pack_tree_batch(
    sequences: Iterable[Sequence[int] | torch.Tensor],
    max_tokens: int,
    *,
    prompt_lens: Sequence[int] | torch.Tensor | None = None,
    loss_mask: Iterable[Sequence[bool] | torch.Tensor] | None = None,
    num_rows: int | None = None,
    pad_id: int = 0,
    check: bool | None = None,
) -> TreeBatch:
    """Packs sequences into prefix trees of at most ``max_tokens`` nodes, one tree per row: a
    :class:`TreeBatch` of 2-D ``(B, max_tokens)`` tokens (0.1 called it ``pack_trees``).

    Sequences are taken in input order; each goes into the first tree that can take it within
    the budget, counting only the nodes it adds (a completion whose prompt is already in a tree
    costs just its completion there), else it starts a new tree. Keep a group's completions
    together in the input so they share their prompt. Inside a row everything is as in
    :func:`flexmask.pack_one_tree`: the logits along a sequence's path are the ones it gets
    alone.

    Trained tokens: token ``t`` of sequence ``i`` is trained on when ``t >= prompt_lens[i]``
    and ``loss_mask[i][t]`` (each defaults to everything); token 0 never is (nothing predicts
    it). :meth:`TreeBatch.log_probs` returns them, in order, one row per sequence.

    Args:
        sequences: token id lists (ints >= 0) or 1-d integer tensors/arrays, e.g. prompt +
            completion for every
            sample of every GRPO group. Empty sequences are allowed: they take no tokens and
            get an all-masked row from :meth:`TreeBatch.log_probs`.
        max_tokens: the token budget of one tree and the row length, >= 1.
        prompt_lens: per sequence, how many leading tokens are prompt (not trained on): a
            list of ints or a 1-d integer tensor/array.
        loss_mask: per sequence, a bool per token: ``True`` where it is trained on (multi-turn
            masks, tool outputs masked out).
        num_rows: pad the batch to at least this many rows with dummy trees, e.g. the largest
            row count over data-parallel ranks, so every rank runs the same steps.
        pad_id: token id (>= 0) written into padding.
        check: run :func:`~flexmask.check_batch` on the result (positions against the
            trees' depths) and raise ValueError at a disagreement (a debug mode; None: the
            environment variable FLEXMASK_CHECK=1).

    Returns:
        A :class:`TreeBatch`.

    Raises:
        TypeError: a token, prompt length or mask value has the wrong type.
        ValueError: a sequence longer than ``max_tokens``, ``prompt_lens``/``loss_mask`` not one
            per sequence (a prompt length past its sequence's end), ``max_tokens < 1``, a
            token id or ``pad_id`` negative (ids index the vocabulary, where a negative one
            would wrap). Also, before anything is allocated, when the batch would not fit in
            memory: ``B * (16 * max_tokens + 16)`` bytes (two int64 tensors, plus a parent
            tensor and a count per row), more than the machine's RAM (or the process's cgroup
            limit, when lower), is refused, naming ``num_rows`` when it sets ``B``, else
            ``max_tokens``. Any size that fits is accepted.

    Example:
        >>> from flexmask.packing import pack_tree_batch
        >>> group = [[7, 8, 1, 2], [7, 8, 3], [7, 8, 4, 5, 6]]      # prompt [7, 8]
        >>> batch = pack_tree_batch(group, max_tokens=6, prompt_lens=[2, 2, 2], num_rows=3)
        >>> batch.tokens.tolist()
        [[7, 8, 1, 2, 3, 0], [7, 8, 4, 5, 6, 0], [0, 0, 0, 0, 0, 0]]
        >>> batch.row_of, batch.num_tokens, batch.saved_tokens
        ([0, 0, 1], [5, 5, 0], 2)
    """
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    pad_id = check_int(pad_id, "pad_id", minimum=0)
    if num_rows is not None:
        num_rows = check_int(num_rows, "num_rows", minimum=0)
    token_lists = _token_lists(sequences, allow_empty=True)
    count = len(token_lists)
    prompts = [0] * count if prompt_lens is None else _prompt_lens(prompt_lens, token_lists)
    masks = None if loss_mask is None else _loss_masks("loss_mask", loss_mask, token_lists)
    forest = _grow_trees(token_lists, max_tokens)
    rows = max(len(forest.roots), num_rows or 0, 1)  # at least one row, even if all are empty
    _check_trees_memory(rows, num_rows, max_tokens, forest)
    laid = _lay_out_trees(forest, token_lists, rows, max_tokens, pad_id)
    plan = _gather_plan(token_lists, laid.path_of, prompts, masks, laid.tokens)
    batch = TreeBatch(
        tokens=laid.tokens,
        position_ids=laid.position_ids,
        parents=laid.parents,
        num_tokens=forest.sizes + [0] * (rows - len(forest.roots)),
        row_of=forest.row_of,
        unpacked_tokens=plan.total,
        max_tokens=max_tokens,
        _paths=plan.paths,
        _path_offsets=plan.path_offsets,
        _predictor=plan.predictor,
        _predictor_inverse=plan.predictor_inverse,
        _target=plan.target,
        _target_row=plan.target_row,
        _target_col=plan.target_col,
        _width=plan.width,
        _max_target=int(plan.target.max()) if plan.target.numel() else -1,
        _max_token=max(map(max, filter(None, token_lists)), default=-1),
        _pad_id=pad_id,
    )
    if check_enabled(check):
        check_batch(batch=batch, raise_on_error=True)
    return batch


class _Forest(NamedTuple):
    """The prefix trees the sequences were merged into: per tree its root and node count, per
    sequence its tree (``-1`` for an empty one)."""

    roots: list[_Edge]
    sizes: list[int]
    row_of: list[int]


class _LaidOut(NamedTuple):
    """The trees written into rows: the packed tensors, and per sequence its flat path."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    parents: list[torch.Tensor]
    path_of: list[torch.Tensor]


class _GatherPlan(NamedTuple):
    """What :meth:`TreeBatch.log_probs` and :meth:`TreeBatch.unpack` index with.

    ``paths`` are every sequence's flat packed positions, end to end (``path_offsets`` cut
    them); per target, in sequence order: ``predictor_inverse`` into the unique predicting
    positions ``predictor``, the token ``target``, and its place ``(target_row, target_col)``
    in the ``(num_sequences, width)`` output.
    """

    total: int
    paths: torch.Tensor
    path_offsets: list[int]
    predictor: torch.Tensor
    predictor_inverse: torch.Tensor
    target: torch.Tensor
    target_row: torch.Tensor
    target_col: torch.Tensor
    width: int


def _grow_trees(token_lists: list[list[int]], max_tokens: int) -> _Forest:
    """First fit over open trees, charging each sequence only the nodes it adds."""
    roots: list[_Edge] = []
    sizes: list[int] = []
    row_of: list[int] = []
    for i, seq in enumerate(token_lists):
        if not seq:
            row_of.append(-1)
            continue
        if len(seq) > max_tokens:
            raise ValueError(
                f"sequences[{i}] has {len(seq)} tokens, more than max_tokens={max_tokens}; "
                "raise max_tokens or truncate the sequence"
            )
        for row, root in enumerate(roots):
            added = len(seq) - _shared(root, seq)
            if sizes[row] + added <= max_tokens:
                break
        else:
            row, added = len(roots), len(seq)
            roots.append(_Edge([]))
            sizes.append(0)
        _insert(roots[row], seq)
        sizes[row] += added
        row_of.append(row)
    return _Forest(roots, sizes, row_of)


def _check_trees_memory(rows: int, num_rows: int | None, max_tokens: int, forest: _Forest) -> None:
    """Refuses, before allocating, a batch that would not fit in memory, naming what sets it."""
    if num_rows is not None and num_rows > max(len(forest.roots), 1):
        culprit = f"num_rows={num_rows} with max_tokens={max_tokens}"
    else:
        culprit = f"max_tokens={max_tokens}"
    _check_memory(
        rows * (16 * max_tokens + 16),
        f"tokens and position_ids (2 int64 tensors of {rows} x {max_tokens}) and a parent "
        "tensor and a node count per row",
        culprit,
        f"the sequences make {len(forest.roots)} tree(s) of at most "
        f"{max(forest.sizes, default=0)} tokens; max_tokens needs only the longest sequence's "
        "length, and num_rows only the most trees any rank has",
    )


def _lay_out_trees(
    forest: _Forest, token_lists: list[list[int]], rows: int, max_tokens: int, pad_id: int
) -> _LaidOut:
    """Writes each tree into its row in preorder; rows past the last tree are dummy trees."""
    tokens = torch.full((rows, max_tokens), pad_id, dtype=torch.int64)
    position_ids = torch.zeros((rows, max_tokens), dtype=torch.int64)
    parents = [torch.tensor([-1], dtype=torch.int64)] * rows  # dummy rows: one lone node
    members: list[list[int]] = [[] for _ in forest.roots]
    for i, row in enumerate(forest.row_of):
        if row >= 0:
            members[row].append(i)
    path_of: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64)] * len(token_lists)
    for row, root in enumerate(forest.roots):
        nodes, row_parents, depths, paths = _lay_out(root, [token_lists[i] for i in members[row]])
        tokens[row, : len(nodes)] = nodes
        position_ids[row, : len(nodes)] = depths
        parents[row] = row_parents
        pieces = paths.split([len(token_lists[i]) for i in members[row]])
        for i, piece in zip(members[row], pieces, strict=True):
            path_of[i] = piece + row * max_tokens
    return _LaidOut(tokens, position_ids, parents, path_of)


def _gather_plan(
    token_lists: list[list[int]],
    path_of: list[torch.Tensor],
    prompts: list[int],
    masks: list[list[bool]] | None,
    tokens: torch.Tensor,
) -> _GatherPlan:
    """The gather plan, all at once: flat paths, flat trained flags, and for each target the
    packed position of the token before it."""
    count = len(token_lists)
    lengths = torch.tensor([len(seq) for seq in token_lists], dtype=torch.int64)
    total = int(lengths.sum())
    paths = torch.cat(path_of)
    sequence = torch.repeat_interleave(torch.arange(count), lengths, output_size=total)
    step = torch.arange(total) - (torch.cumsum(lengths, 0) - lengths)[sequence]
    # Token 0 is never a target, so every target has a predictor in its own sequence.
    flags = step >= torch.tensor(prompts, dtype=torch.int64).clamp(min=1)[sequence]
    if masks is not None:
        flags &= torch.tensor(list(itertools.chain.from_iterable(masks)), dtype=torch.bool)
    predictor = torch.roll(paths, 1)[flags]
    target = tokens.flatten()[paths[flags]]
    owner = sequence[flags]
    per_sequence = torch.zeros(count, dtype=torch.int64).index_add_(
        0, owner, torch.ones_like(owner)
    )
    first = torch.cumsum(per_sequence, 0) - per_sequence
    column = torch.arange(len(owner)) - first[owner]
    unique, inverse = torch.unique(predictor, return_inverse=True)
    return _GatherPlan(
        total=total,
        paths=paths,
        path_offsets=[0, *itertools.accumulate(lengths.tolist())],
        predictor=unique,
        predictor_inverse=inverse,
        target=target,
        target_row=owner,
        target_col=column,
        width=int(per_sequence.max()),
    )


def _prompt_lens(value: Any, token_lists: list[list[int]]) -> list[int]:
    if not isinstance(value, (torch.Tensor, list, tuple)) and hasattr(value, "__array__"):
        try:  # a numpy array: read as a tensor, then checked as one
            value = torch.as_tensor(value)
        except (TypeError, RuntimeError) as error:
            raise TypeError(
                f"prompt_lens is an array torch cannot read as integers: {error}"
            ) from None
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(
                f"prompt_lens must be a 1-d integer tensor or a list of ints, got a tensor of "
                f"shape {tuple(value.shape)} and dtype {value.dtype}"
            )
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"prompt_lens must be a list of ints, got {type(value).__name__}")
    if len(value) != len(token_lists):
        raise ValueError(
            f"prompt_lens has {len(value)} entries but there are {len(token_lists)} sequences; "
            "pass one per sequence"
        )
    lens = [check_int(p, f"prompt_lens[{i}]", minimum=0) for i, p in enumerate(value)]
    for i, (p, seq) in enumerate(zip(lens, token_lists, strict=True)):
        if p > len(seq):
            raise ValueError(
                f"prompt_lens[{i}]={p} is longer than sequences[{i}] ({len(seq)} tokens)"
            )
    return lens
