"""A piece is one module, its test and its page (docs/contributing.md, "A new piece"): a
piece written here, outside flexmask, with nothing in flexmask/ touched, lowers through
every format (to_varlen, to_flashmask, to_magi), every CPU attention backend (slices,
block_sparse, sdpa) and create_block_mask, each checked against a plain dense reference of
what it means; a piece that answers no lowering question is refused naming it and the
format, and still attends where a backend needs no lowering.

The piece, ``every_other_document(seq_lens)``: documents packed back to back; the
even-numbered ones (0, 2, ...) attend within themselves, the odd ones (held out) attend
nothing and are attended by nothing::

    seq_lens=[2, 1, 2]:  ■ ■ ⬚ ⬚ ⬚
                         ■ ■ ⬚ ⬚ ⬚
                         ⬚ ⬚ ⬚ ⬚ ⬚
                         ⬚ ⬚ ⬚ ■ ■
                         ⬚ ⬚ ⬚ ■ ■
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask
from flexmask.algebra import (
    Intervals,
    LineIntervals,
    Lowered,
    TileGrid,
    VarlenPart,
    Window,
    one_interval,
    run_at,
)
from flexmask.blocks.codes import UNDECIDED, codes_from, constant_codes
from flexmask.formats import to_flashmask, to_magi, to_varlen
from flexmask.pieces import Piece, PieceMod
from tests import oracle
from tests.test_formats import flashmask_dense, magi_dense, torch_varlen_dense, varlen_dense

_PAST = 1 << 62  # pads run starts and ends: past every position


# ----------------------------------------------------------------- the piece (its whole module)
class EveryOtherDocument(Piece):
    """q and kv lie in the same document, and that document is an even-numbered one."""

    __slots__ = ("starts", "ends", "per_row")
    # Each query's interval is empty or its own document, which holds it; documents are
    # disjoint runs (``Mask.attends_around_self``): ``causal() | this`` is one interval.
    interval_shape = "around_self"
    _arg = "seq_lens"

    def __init__(self, seq_lens: Any) -> None:
        per_row = bool(seq_lens) and isinstance(seq_lens[0], list | tuple)
        rows = [list(r) for r in seq_lens] if per_row else [list(seq_lens)]
        runs = [
            _even_runs(row, f"seq_lens[{i}]" if per_row else "seq_lens")
            for i, row in enumerate(rows)
        ]
        width = max(len(r) for r in runs) + 1  # a padding column: every row searchable
        self.starts = torch.full((len(rows), width), _PAST, dtype=torch.int64)
        self.ends = torch.full((len(rows), width), _PAST, dtype=torch.int64)
        for r, row_runs in enumerate(runs):
            for k, (start, end) in enumerate(row_runs):
                self.starts[r, k], self.ends[r, k] = start, end
        self.per_row = per_row
        super().__init__(
            ("every_other_document", tuple(map(tuple, rows)), per_row),
            rows=len(rows) if per_row else None,
            natural=max(sum(row) for row in rows),
        )

    @property
    def carries_batch_data(self) -> bool:
        return True

    def _run_ids(self, length: int, device: torch.device) -> Tensor:
        """(R, length + 1) int64: the run (visible document) of each position, -1 outside
        every run and at the last (sentinel) entry."""
        pos = torch.arange(length + 1).expand(self.ends.shape[0], -1).contiguous()
        k = torch.searchsorted(self.ends, pos, right=True).clamp(max=self.ends.shape[1] - 1)
        ids = torch.where(self.starts.gather(1, k) <= pos, k, -1)
        ids[:, length] = -1
        return ids.to(device)

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        # Lookups over positions 0..length (a piece read far from position 0 would hold the
        # window's positions only, as document does).
        ids = self._run_ids(length, device).to(torch.int32)
        mod = RunMod(ids if self.per_row else ids[0], self.per_row)
        return Lowered(mod, mod)

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
        firsts = torch.cat([grid.q_first.reshape(-1, nq), grid.kv_first.reshape(-1, nkv)], 1)
        lasts = torch.cat([grid.q_last.reshape(-1, nq), grid.kv_last.reshape(-1, nkv)], 1)
        rows = max(self.starts.shape[0], firsts.shape[0])
        starts = self.starts.to(grid.device).expand(rows, -1).contiguous()
        ends = self.ends.to(grid.device).expand(rows, -1).contiguous()
        firsts, lasts = firsts.expand(rows, -1).contiguous(), lasts.expand(rows, -1).contiguous()
        # The runs meeting [first, last]: from the first ending after first to the last
        # starting at or before last. Full: one run holds both sides wholly.
        lo = torch.searchsorted(ends, firsts, right=True)
        hi = torch.searchsorted(starts, lasts, right=True) - 1
        k = lo.clamp(max=ends.shape[1] - 1)
        whole = torch.where((starts.gather(1, k) <= firsts) & (ends.gather(1, k) > lasts), k, -1)
        q_lo, kv_lo = lo[:, :nq].view(rows, 1, nq, 1), lo[:, nq:].view(rows, 1, 1, nkv)
        q_hi, kv_hi = hi[:, :nq].view(rows, 1, nq, 1), hi[:, nq:].view(rows, 1, 1, nkv)
        q_whole, kv_whole = whole[:, :nq].view(rows, 1, nq, 1), whole[:, nq:].view(rows, 1, 1, nkv)
        nonempty = torch.maximum(q_lo, kv_lo) <= torch.minimum(q_hi, kv_hi)
        return codes_from(nonempty, (q_whole == kv_whole) & (q_whole >= 0))

    def intervals_at(self, q_idx: Tensor, row: Tensor, grid: TileGrid) -> Intervals:
        lookup = row.view(-1) if self.per_row else torch.zeros_like(row.view(-1))
        starts, ends = self.starts.to(grid.device)[lookup], self.ends.to(grid.device)[lookup]
        q_idx = q_idx.expand(lookup.shape[0], -1)
        k = torch.searchsorted(ends, q_idx.contiguous(), right=True).clamp(max=ends.shape[1] - 1)
        start = starts.gather(1, k)
        inside = start <= q_idx
        hi = ends.gather(1, k).clamp(max=grid.length) - 1
        return Intervals(torch.where(inside, start, 1), torch.where(inside, hi, 0))

    def lines_at(self, pos: Tensor, *, transpose: bool, fmt: str) -> LineIntervals:
        # Symmetric: a token's visible document, both ways; elsewhere nothing.
        return one_interval(*run_at(self.starts, self.ends, pos))

    def varlen_part(self, length: int) -> VarlenPart:
        # One sequence per visible document; the held-out ones in none.
        return VarlenPart(segment_ids=list(self._run_ids(length, torch.device("cpu"))))

    def __repr__(self) -> str:
        return (
            f"every_other_document({list(self.key[1]) if self.per_row else list(self.key[1][0])})"
        )


class RunMod(PieceMod):
    """every_other_document's mask_mod: q and kv have the same run id, and q has one."""

    __slots__ = ("run_id",)
    _name = "every_other_document"

    def __init__(self, run_id: Tensor, per_row: bool) -> None:
        super().__init__(per_row)
        self.run_id = run_id

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        last = self.run_id.shape[-1] - 1
        q_run = self._lookup(self.run_id, b, q_idx.clamp(max=last))
        return (q_run == self._lookup(self.run_id, b, kv_idx.clamp(max=last))) & (q_run >= 0)


def _even_runs(lens: list[Any], name: str) -> list[tuple[int, int]]:
    """The ``[start, end)`` of the even-numbered, non-empty documents, lengths checked."""
    if not lens:
        raise ValueError(f"{name} must list at least one document length, got []")
    runs, start = [], 0
    for i, n in enumerate(lens):
        if type(n) is not int or n < 0:
            raise ValueError(f"{name}[{i}] must be a document length >= 0, got {n!r}")
        if i % 2 == 0 and n:
            runs.append((start, start + n))
        start += n
    return runs


def every_other_document(seq_lens: Any) -> EveryOtherDocument:
    """Documents packed back to back; only the even-numbered ones attend, within themselves."""
    return EveryOtherDocument(seq_lens)


# ----------------------------------------------------------------- the plain reference
def reference(seq_lens: list[list[int]], q_len: int, kv_len: int) -> np.ndarray:
    """(B, Q, KV) written from the definition, one row of ``seq_lens`` per batch row."""
    out = []
    for lens in seq_lens:
        doc = [-1] * max(q_len, kv_len)
        position = 0
        for d, n in enumerate(lens):
            for p in range(position, min(position + n, len(doc))):
                doc[p] = d
            position += n
        row = np.zeros((q_len, kv_len), dtype=bool)
        for q in range(q_len):
            for kv in range(kv_len):
                row[q, kv] = doc[q] >= 0 and doc[q] % 2 == 0 and doc[q] == doc[kv]
        out.append(row)
    return np.stack(out)


def rows_of(seq_lens: Any, batch: int) -> list[list[int]]:
    per_row = isinstance(seq_lens[0], list)
    return [list(seq_lens[b]) for b in range(batch)] if per_row else [list(seq_lens)] * batch


CASES = [  # (seq_lens, batch, length): lengths not multiples of the block size
    ([5, 3, 4], 1, 13),
    ([2, 1, 2], 2, 5),
    ([0, 4, 3, 0, 6], 1, 17),  # empty documents keep their numbers
    ([7, 2, 9], 1, 11),  # the last visible document runs past the sequence
    ([[3, 4, 5], [6, 6]], 2, 14),  # one list per row
    ([150, 90, 130, 100, 40], 2, 530),
]
CASE_IDS = ["three", "tiny-b2", "empty-docs", "past-the-end", "per-row", "long"]


# ----------------------------------------------------------------- the piece itself
@pytest.mark.parametrize(("seq_lens", "batch", "length"), CASES, ids=CASE_IDS)
def test_to_dense_and_show_are_the_reference(seq_lens, batch, length):
    piece = every_other_document(seq_lens)
    dense = piece.to_dense(batch, 2, length, length)
    want = torch.from_numpy(reference(rows_of(seq_lens, batch), length, length))
    assert torch.equal(dense, want[:, None].expand(batch, 2, length, length))
    assert every_other_document([2, 1, 2]).show(5) == (
        "■ ■ ⬚ ⬚ ⬚\n■ ■ ⬚ ⬚ ⬚\n⬚ ⬚ ⬚ ⬚ ⬚\n⬚ ⬚ ⬚ ■ ■\n⬚ ⬚ ⬚ ■ ■"
    )


def test_it_is_a_value_and_validates_its_input():
    assert every_other_document([2, 1]) == every_other_document([2, 1])
    assert hash(every_other_document([2, 1])) == hash(every_other_document((2, 1)))
    assert every_other_document([2, 1]) != every_other_document([1, 2])
    with pytest.raises(ValueError, match=r"seq_lens\[1\] must be a document length >= 0"):
        every_other_document([2, -1])
    with pytest.raises(ValueError, match=r"seq_lens is given for 2 batch rows but B=3"):
        flexmask.create_block_mask(every_other_document([[1], [2]]), 3, 1, 8, 8, device="cpu")


# ----------------------------------------------------------------- create_block_mask
@pytest.mark.parametrize("combine", ["alone", "causal &", "causal |", "& document", "~"])
@pytest.mark.parametrize(("seq_lens", "batch", "length"), CASES, ids=CASE_IDS)
def test_create_block_mask_is_torchs(seq_lens, batch, length, combine):
    piece = every_other_document(seq_lens)
    mask = {
        "alone": piece,
        "causal &": flexmask.causal() & piece,
        "causal |": flexmask.causal() | piece,  # a union in closed form (around_self)
        "& document": piece & flexmask.document([4, 4, 4] * 60, truncate=True),
        "~": ~piece,
    }[combine]
    for block in (4, (8, 2)):
        ours = flexmask.create_block_mask(
            mask, batch, 2, length, length, device="cpu", BLOCK_SIZE=block
        )
        theirs = torch_create_block_mask(
            mask.mask_mod_for(length, length),
            batch,
            2,
            length,
            length,
            device="cpu",
            BLOCK_SIZE=block,
        )
        oracle.assert_same_block_mask(ours, theirs, f"{combine} {block}")
        meaning = oracle.block_mask_meaning(ours, batch, 2, length, length)
        assert torch.equal(meaning, mask.to_dense(batch, 2, length, length))


# ----------------------------------------------------------------- the formats
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seq_lens", "batch", "length"), CASES, ids=CASE_IDS)
def test_to_varlen_is_one_sequence_per_visible_document(seq_lens, batch, length, causal):
    mask = (
        flexmask.causal() & every_other_document(seq_lens)
        if causal
        else every_other_document(seq_lens)
    )
    want = reference(rows_of(seq_lens, batch), length, length)
    if causal:
        want &= np.tril(np.ones((length, length), dtype=bool))
    v = to_varlen(mask, batch, None, length, length)
    assert np.array_equal(varlen_dense(v, v.window_size, v.causal), want)
    assert np.array_equal(torch_varlen_dense(v), want)
    starts = [np.cumsum([0, *lens])[:-1] for lens in rows_of(seq_lens, batch)]
    visible = [
        i % 2 == 0 and n > 0 and start < length
        for lens, row_starts in zip(rows_of(seq_lens, batch), starts, strict=True)
        for i, (n, start) in enumerate(zip(lens, row_starts, strict=True))
    ]
    assert v.num_sequences == sum(visible)  # one per visible document in the window


def test_to_varlen_refuses_what_varlen_cannot_run_naming_it():
    piece = every_other_document([3, 2, 3])
    with pytest.raises(
        ValueError,
        match=r"~every_other_document\(\[3, 2, 3\]\) cannot be lowered to varlen: a complement",
    ):
        to_varlen(~piece, 1, None, 8, 8)
    with pytest.raises(ValueError, match=r"cannot be lowered to varlen: a union"):
        to_varlen(flexmask.causal() | piece, 1, None, 8, 8)


@pytest.mark.parametrize("combine", ["alone", "causal &", "causal |", "~"])
@pytest.mark.parametrize(("seq_lens", "batch", "length"), CASES, ids=CASE_IDS)
def test_to_flashmask_and_to_magi_are_the_reference(seq_lens, batch, length, combine):
    piece = every_other_document(seq_lens)
    mask = {
        "alone": piece,
        "causal &": flexmask.causal() & piece,
        "causal |": flexmask.causal() | piece,
        "~": ~piece,
    }[combine]
    want = mask.to_dense(batch, 1, length, length)[:, 0].numpy()
    for q_off, q_len in ((0, length), (length // 3, length - length // 3)):  # and a window
        window = want[:, q_off : q_off + q_len]
        magi = to_magi(mask, batch, None, q_len, length, q_offset=q_off)
        assert np.array_equal(magi_dense(magi, batch, q_len, length), window)
        flash = to_flashmask(mask, batch, 1, q_len, length, q_offset=q_off)
        got = flashmask_dense(flash.startend_row_indices, flash.causal, q_len)[:, 0]
        assert np.array_equal(got, window)


# ----------------------------------------------------------------- the CPU backends
@pytest.mark.parametrize("backend", ["slices", "block_sparse", "sdpa", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_on_every_cpu_backend_is_the_reference(backend, causal):
    seq_lens, batch, length = [[150, 90, 130, 100, 40], [200, 64, 120]], 2, 530
    piece = every_other_document(seq_lens)
    mask = flexmask.causal() & piece if causal else piece
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, 2, length, 16, requires_grad=True) for _ in range(3))
    allowed = torch.from_numpy(reference(seq_lens, length, length))[:, None]
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril()
    want, _ = oracle.attention(q, k, v, allowed)
    got = flexmask.attention(q, k, v, mask, backend=backend)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-4)


# ----------------------------------------------------------------- a piece that answers less
class OddDiagonal(Piece):
    """A piece with only what the build needs: its mask_mod and an UNDECIDED classifier
    (no intervals, no lowering answers): q == kv for odd q."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(("odd_diagonal",))

    def lower_at(self, length: int, device: torch.device, window: Window | None = None) -> Lowered:
        mod = OddDiagonalMod()
        return Lowered(mod, mod)

    def classify_tiles(self, grid: TileGrid) -> Tensor:
        return constant_codes(UNDECIDED, grid.device)

    def __repr__(self) -> str:
        return "odd_diagonal()"


class OddDiagonalMod(PieceMod):
    __slots__ = ()
    _name = "odd_diagonal"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx == kv_idx) & (q_idx % 2 == 1)


def test_a_piece_without_answers_is_refused_naming_it_and_the_format():
    mask = flexmask.causal() & OddDiagonal()
    for lower, fmt in (
        (lambda m: to_magi(m, 1, None, 8, 8), "MagiAttention"),
        (lambda m: to_flashmask(m, 1, 1, 8), "FlashMask"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"odd_diagonal\(\) cannot be lowered to {fmt}: OddDiagonal does not say",
        ):
            lower(mask)
    with pytest.raises(
        ValueError, match=r"odd_diagonal\(\) cannot be lowered to varlen: varlen takes an &"
    ):
        to_varlen(mask, 1, None, 8, 8)
    q, k, v = (torch.randn(1, 1, 70, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"odd_diagonal\(\) cannot be lowered to MagiAttention"):
        flexmask.attention(q, k, v, mask, backend="slices")
    allowed = mask.to_dense(1, 1, 70, 70)
    assert torch.equal(allowed[0, 0], torch.diag(torch.arange(70) % 2 == 1))
    want, _ = oracle.attention(q, k, v, allowed)
    for backend in ("auto", "block_sparse", "sdpa"):  # no lowering needed: they attend
        got = flexmask.attention(q, k, v, mask, backend=backend).double()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)  # float32's defaults
