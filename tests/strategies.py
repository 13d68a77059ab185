"""Hypothesis strategies: random mask expressions paired with their plain dense reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from hypothesis import strategies as st

import flexmask
from tests import oracle


def _head_stripes(b, h, q_idx, kv_idx):
    # Depends on the row and the head: a custom leaf the builder cannot classify.
    return ((q_idx + kv_idx + b + h) % 3) != 0


@st.composite
def random_parents(draw, n: int, preorder: bool | None = None):
    """A parent array of n tokens; preorder layout or an arbitrary parent-before-child one."""
    parents = [-1]
    for i in range(1, n):
        parents.append(draw(st.integers(-1, i - 1)))
    if preorder is None:
        preorder = draw(st.booleans())
    if not preorder:
        return parents
    # Relabel in depth-first preorder (children by index) so the layout is a preorder.
    children = {i: [] for i in range(n)}
    roots = []
    for i, p in enumerate(parents):
        (children[p] if p >= 0 else roots).append(i)
    order, stack = [], roots[::-1]
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(reversed(children[v]))
    new = {old: k for k, old in enumerate(order)}
    return [-1 if parents[old] < 0 else new[parents[old]] for old in order]


ALL_KINDS = (
    "causal",
    "full",
    "empty",
    "window",
    "prefix",
    "padding",
    "document",
    "tree",
    "custom",
    "chunked",
    "spans",
)
INTERVAL_KINDS = ("causal", "full", "empty", "window", "prefix", "padding", "document", "chunked")


@st.composite
def span_ids(draw, length: int):
    """Per-token span ids of up to ``length`` tokens: contiguous runs with distinct ids >= 0
    (adjacent runs included) and -1 gaps."""
    n = draw(st.integers(1, length))
    ids, pos, next_id = [], 0, 0
    while pos < n:
        run = draw(st.integers(1, max(1, min(n - pos, 40))))
        if draw(st.booleans()):
            ids += [next_id] * run
            next_id += 1
        else:
            ids += [-1] * run
        pos += run
    return ids


def selected_dense(picks, q_tile: int, kv_tile: int, q_len: int, kv_len: int) -> np.ndarray:
    """``selected``'s definition, plainly: query q attends key kv iff ``kv // kv_tile`` is
    among ``picks[q // q_tile]`` (entries < 0 pick nothing; query tiles past the lists
    pick nothing)."""
    out = np.zeros((q_len, kv_len), dtype=bool)
    for q in range(q_len):
        tile = q // q_tile
        if tile >= len(picks):
            continue
        chosen = {int(j) for j in picks[tile] if j >= 0}
        for kv in range(kv_len):
            out[q, kv] = kv // kv_tile in chosen
    return out


SELECTED_TILES = (1, 2, 3, 5, 8, 16, (2, 3), (5, 2), (16, 4))


@st.composite
def selected_picks(draw, rows: int, length: int):
    """``(indices, (q_tile, kv_tile))``: a router's top-k key tiles, ``(rows, n_q_tiles, k)``
    int64, for sequences up to ``length`` (and a tile past it: made with ``truncate``): -1
    padding, repeats, query tiles that pick nothing, and fewer or more query tiles than
    the sequence has."""
    tile = draw(st.sampled_from(SELECTED_TILES), label="tile")
    q_tile, kv_tile = tile if isinstance(tile, tuple) else (tile, tile)
    n_q = draw(st.integers(0, -(-length // q_tile) + 1), label="n_q_tiles")
    k = draw(st.integers(0, 4), label="k")
    n_kv = -(-length // kv_tile) + 1
    entries = st.lists(st.integers(-1, n_kv - 1), min_size=k * n_q, max_size=k * n_q)
    flat = [draw(entries) for _ in range(rows)]
    return torch.tensor(flat, dtype=torch.int64).reshape(rows, n_q, k), (q_tile, kv_tile)


@st.composite
def leaves(draw, batch: int, length: int, kinds: tuple[str, ...] = ALL_KINDS):
    """(mask, reference) where reference(q_len, kv_len) -> (B, Q, KV) numpy bool.

    ``"selected"`` (router picks, ``selected_picks``) is drawn only where asked for."""
    kind = draw(st.sampled_from(kinds))
    per_row = draw(st.booleans())

    def per_batch(fn_of_row):
        return lambda q, kv: np.stack([fn_of_row(r, q, kv) for r in range(batch)])

    if kind == "selected":
        picks, (q_tile, kv_tile) = draw(selected_picks(batch if per_row else 1, length))
        mask = flexmask.selected(
            picks if per_row else picks[0], tile=(q_tile, kv_tile), truncate=True
        )
        return mask, per_batch(
            lambda r, q, kv: selected_dense(
                picks[r if per_row else 0].tolist(), q_tile, kv_tile, q, kv
            )
        )

    if kind == "causal":
        return flexmask.causal(), per_batch(lambda r, q, kv: oracle.causal(q, kv))
    if kind == "full":
        return flexmask.full(), per_batch(lambda r, q, kv: np.ones((q, kv), bool))
    if kind == "empty":
        return flexmask.empty(), per_batch(lambda r, q, kv: np.zeros((q, kv), bool))
    if kind == "chunked":
        sizes = [draw(st.integers(1, length + 3)) for _ in range(batch if per_row else 1)]
        mask = flexmask.chunked(sizes if per_row else sizes[0])
        return mask, per_batch(lambda r, q, kv: oracle.chunked(sizes[r if per_row else 0], q, kv))
    if kind == "spans":
        rows = [draw(span_ids(length)) for _ in range(batch if per_row else 1)]
        mask = flexmask.spans(rows if per_row else rows[0], truncate=True)
        return mask, per_batch(lambda r, q, kv: oracle.spans(rows[r if per_row else 0], q, kv))
    if kind in ("window", "prefix", "padding"):
        hi = length + 3 if kind == "window" else length
        # padding(0): a row that attends nothing at all.
        lo = 0 if kind == "padding" else 1
        values = [draw(st.integers(lo, hi)) for _ in range(batch if per_row else 1)]
        ref = {"window": oracle.sliding_window, "prefix": oracle.prefix, "padding": oracle.padding}[
            kind
        ]
        make = {
            "window": flexmask.sliding_window,
            "prefix": flexmask.prefix,
            "padding": lambda v: flexmask.padding(v, truncate=True),
        }[kind]
        mask = make(values if per_row else values[0])
        return mask, per_batch(lambda r, q, kv: ref(values[r if per_row else 0], q, kv))
    if kind == "document":

        def lens():
            total = draw(st.integers(1, length))
            cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=6))) if total > 1 else []
            edges = [0, *cuts, total]
            return [b - a for a, b in zip(edges, edges[1:], strict=False)]

        rows = [lens() for _ in range(batch if per_row else 1)]
        mask = flexmask.document(rows if per_row else rows[0], truncate=True)
        return mask, per_batch(lambda r, q, kv: oracle.document(rows[r if per_row else 0], q, kv))
    if kind == "tree":
        rows = [
            draw(random_parents(draw(st.integers(1, length))))
            for _ in range(batch if per_row else 1)
        ]
        mask = flexmask.tree(rows if per_row else rows[0])
        return mask, per_batch(lambda r, q, kv: oracle.tree(rows[r if per_row else 0], q, kv))
    # custom: depends on b and h; reference for head 0 is handled by the caller via heads
    mask = flexmask.from_mask_mod(_head_stripes, key="stripes")
    return mask, None


@st.composite
def expressions(draw, batch: int, heads: int, length: int, max_leaves: int = 5):
    """(mask, dense) with dense(q_len, kv_len) -> (B, H, Q, KV) numpy bool."""
    n = draw(st.integers(1, max_leaves))
    items = []
    for _ in range(n):
        mask, ref = draw(leaves(batch, length))
        if ref is None:  # the b/h-dependent custom leaf

            def ref4(q, kv):
                b = np.arange(batch)[:, None, None, None]
                h = np.arange(heads)[None, :, None, None]
                qq = np.arange(q)[None, None, :, None]
                kk = np.arange(kv)[None, None, None, :]
                return ((qq + kk + b + h) % 3) != 0
        else:

            def ref4(q, kv, ref=ref):
                return np.repeat(ref(q, kv)[:, None], heads, axis=1)

        if draw(st.booleans()):
            mask, ref4 = ~mask, (lambda q, kv, f=ref4: ~f(q, kv))
        if heads % 2 == 0 and draw(st.integers(0, 3)) == 0:
            # per_head(this, another): even heads this mask, odd heads the other.
            other, other_ref = draw(leaves(batch, length, INTERVAL_KINDS + ("spans",)))

            def ref4(q, kv, a=ref4, b=other_ref):
                out = a(q, kv).copy()
                out[:, 1::2] = b(q, kv)[:, None]
                return out

            mask = flexmask.per_head(mask, other)
        items.append((mask, ref4))
    mask, ref = items[0]
    for other, other_ref in items[1:]:
        if draw(st.booleans()):
            mask, ref = mask & other, (lambda q, kv, a=ref, b=other_ref: a(q, kv) & b(q, kv))
        else:
            mask, ref = mask | other, (lambda q, kv, a=ref, b=other_ref: a(q, kv) | b(q, kv))
        if draw(st.integers(0, 2)) == 0:
            # A negated compound, ~(a & b) or ~(a | b): its codes are those of a build path
            # (closed form, union, refinement) with the edge tiles still to be demoted.
            mask, ref = ~mask, (lambda q, kv, f=ref: ~f(q, kv))
    return mask, ref


@st.composite
def from_zero_unions(draw, batch: int, length: int):
    """(mask, reference): an ``|`` of 2..3 pieces that attend from key 0 (causal, prefix,
    full), such as the prefix-LM ``causal() | prefix(n)``."""
    items = [
        draw(leaves(batch, length, ("causal", "prefix", "full")))
        for _ in range(draw(st.integers(2, 3)))
    ]
    mask, ref = items[0]
    for other, other_ref in items[1:]:
        mask, ref = mask | other, (lambda q, kv, a=ref, b=other_ref: a(q, kv) | b(q, kv))
    return mask, ref


@st.composite
def span_unions(draw, batch: int, length: int):
    """(mask, reference): ``causal() | spans(ids)`` (text with images), with 0..1 more
    from-zero pieces or spans in the union."""
    items = [draw(leaves(batch, length, ("causal",))), draw(leaves(batch, length, ("spans",)))]
    if draw(st.booleans()):
        items.append(draw(leaves(batch, length, ("prefix", "full", "spans"))))
    order = draw(st.permutations(range(len(items))))
    mask, ref = items[order[0]]
    for i in order[1:]:
        other, other_ref = items[i]
        mask, ref = mask | other, (lambda q, kv, a=ref, b=other_ref: a(q, kv) | b(q, kv))
    return mask, ref


@st.composite
def interval_intersections(draw, batch: int, length: int, max_leaves: int = 4):
    """(mask, dense): an ``&`` of 1..max_leaves interval pieces, from-zero unions or
    ``causal() | spans`` unions (the closed-form path) with dense(q_len, kv_len) -> (B, Q, KV)
    numpy bool."""
    leaf = st.one_of(
        leaves(batch, length, INTERVAL_KINDS),
        from_zero_unions(batch, length),
        span_unions(batch, length),
    )
    items = [draw(leaf) for _ in range(draw(st.integers(1, max_leaves)))]
    mask, ref = items[0]
    for other, other_ref in items[1:]:
        mask, ref = mask & other, (lambda q, kv, a=ref, b=other_ref: a(q, kv) & b(q, kv))
    return mask, ref


@st.composite
def ending_intersections(draw, batch: int, length: int):
    """(mask, dense): ``interval_intersections`` with a document or padding piece, so that
    the queries past the documents or the padding attend nothing."""
    end, end_ref = draw(leaves(batch, length, ("document", "padding")), label="ending")
    mask, ref = draw(interval_intersections(batch, length, max_leaves=2))
    if draw(st.booleans()):
        return end & mask, lambda q, kv: end_ref(q, kv) & ref(q, kv)
    return mask & end, lambda q, kv: ref(q, kv) & end_ref(q, kv)


@st.composite
def negated_compounds(draw, batch: int, heads: int, length: int):
    """(mask, dense) with dense(q_len, kv_len) -> (B, H, Q, KV): ``~`` over an ``&`` of
    interval pieces or an ``|`` of two such (the closed-form and union paths), sometimes
    combined with a random expression."""
    mask, ref = draw(interval_intersections(batch, length, max_leaves=3))
    if draw(st.booleans()):
        other, other_ref = draw(interval_intersections(batch, length, max_leaves=2))
        mask, ref = mask | other, (lambda q, kv, a=ref, b=other_ref: a(q, kv) | b(q, kv))
    mask = ~mask

    def dense(q, kv, f=ref):
        return np.repeat(~f(q, kv)[:, None], heads, axis=1)

    if draw(st.booleans()):
        other, other_ref = draw(expressions(batch, heads, length, max_leaves=2))
        if draw(st.booleans()):
            return mask & other, lambda q, kv: dense(q, kv) & other_ref(q, kv)
        return mask | other, lambda q, kv: dense(q, kv) | other_ref(q, kv)
    return mask, dense


# Tiny tiles and pairs: many tiles per row, incomplete edge tiles at most lengths, and
# offsets that are rarely a block multiple.
SMALL_BLOCKS = st.sampled_from([1, 2, 3, 4, 5, 8, (2, 4), (4, 3), (3, 1), (5, 2), (8, 3)])


def _attending_runs(attends: np.ndarray, kv_len: int, q_block: int, rows: int) -> list:
    """``(kv_offset, first, last)`` for every kv window ``[kv_offset, kv_offset + kv_len)``
    of the dense ``(n, n)`` mask that queries ``first..last`` (below ``rows``) attend, and no
    other, with ``first >= 1`` and a run short enough to sit strictly inside a q block."""
    found = []
    for k0 in range(attends.shape[1] - kv_len + 1):
        hit = attends[:rows, k0 : k0 + kv_len].any(1).nonzero()[0]
        if hit.size and hit[0] >= 1 and hit[-1] - hit[0] <= q_block - 3:
            found.append((k0, int(hit[0]), int(hit[-1])))
    return found


@st.composite
def small_windows(draw, batch: int, masks, max_len: int = 24):
    """``(mask, dense, q_len, kv_len, q_offset, kv_offset, block)``: a mask drawn from
    ``masks(batch, length)`` (a strategy of ``(mask, dense)``) and a small window of it with
    tiny tiles, its queries running past the mask's data (past the documents or the
    padding). Offsets are an int or one per row.

    Three times in four the window is cornered, from the dense reference: its kv offset picked so
    that the queries attending the window are a short run, and its q offset so that the run
    lies strictly inside a q block past the first — whose first query attends nothing in the
    window (its keys end before it) and neither does its last (past the data, say). Else the
    offsets are drawn near the last query that attends, or anywhere, the kv offset most
    often off the kv block grid."""
    block = draw(SMALL_BLOCKS, label="block")
    q_block, kv_block = block if isinstance(block, tuple) else (block, block)
    length = draw(st.integers(1, max_len), label="length")
    kv_len = draw(st.integers(1, max_len), label="kv_len")
    mask, dense = draw(masks(batch, length))
    q_past = draw(st.integers(1, 3), label="q_past")
    # Queries past the data attend too (causal): look at every position a window reaches.
    n = length + q_past + max_len + q_block
    attends = dense(n, n).reshape(-1, n, n).any(0)

    def offsets(one, name: str):
        if draw(st.booleans()):
            return draw(one, label=name)
        return draw(st.lists(one, min_size=batch, max_size=batch), label=name)

    runs = _attending_runs(attends, kv_len, q_block, length + q_past)
    # Those followed by a query that attends nothing at all, when there are any.
    runs = [r for r in runs if not attends[r[2] + 1].any()] or runs
    if runs and draw(st.integers(0, 3), label="cornered") != 0:
        kv_off, first, last = draw(st.sampled_from(runs), label="run")
        # The run's block starts at a in [last + 2 - q_block, first - 1], the window at a
        # block before it where there is room.
        a = draw(st.integers(max(0, last + 2 - q_block), first - 1), label="block_start")
        starts = [a - j * q_block for j in range(1, a // q_block + 1)] or [a]
        q_off = draw(st.sampled_from(starts), label="q_offset")
        q_len = max(length, last + 2) - q_off + q_past - 1
        if draw(st.booleans()):
            q_off, kv_off = [q_off] * batch, [kv_off] * batch
        return mask, dense, q_len, kv_len, q_off, kv_off, block
    rows = attends[:length].nonzero()[0]
    last = int(rows[-1]) if rows.size else length - 1

    def near(block: int):
        return st.integers(max(0, last - 2 * block), last + 1)

    q_off = offsets(st.one_of(near(q_block), st.integers(0, length - 1)), "q_offset")
    kv_one = st.one_of(near(kv_block), st.integers(0, length + 3))
    if kv_block > 1:
        kv_one = st.one_of(kv_one.filter(lambda k: k % kv_block), kv_one)
    kv_off = offsets(kv_one, "kv_offset")
    # Every row's queries reach the data's end: the window holds all the data it describes.
    q_len = max(1, length - min(q_off if isinstance(q_off, list) else [q_off])) + q_past - 1
    return mask, dense, q_len, kv_len, q_off, kv_off, block


def insertion_tree(n: int, seed: int, sequences: int, random_lengths: bool = False) -> list[int]:
    """A trie of ``sequences`` sequences, tokens numbered as inserted (AReaL's layout): each
    sequence shares a random prefix of a random earlier one, then appends its own tokens —
    ``n // sequences`` of them, or a random count with ``random_lengths``. Not a preorder once
    a branch lands after unrelated sequences."""
    gen = torch.Generator().manual_seed(seed)
    parents: list[int] = []
    paths: list[list[int]] = []
    per = max(1, n // sequences)
    while len(parents) < n:
        path: list[int] = []
        if paths:
            base = paths[int(torch.randint(0, len(paths), (1,), generator=gen))]
            path = base[: int(torch.randint(0, len(base) + 1, (1,), generator=gen))]
        if random_lengths:
            per = int(torch.randint(1, 2 * n // sequences + 2, (1,), generator=gen))
        for _ in range(min(per, n - len(parents))):
            parents.append(path[-1] if path else -1)
            path.append(len(parents) - 1)
        paths.append(path)
    return parents


def preorder_tree(n: int, seed: int) -> list[int]:
    """A random tree laid out in preorder: each token's parent is on the path to the token
    before it (its previous token or one of that token's ancestors), or it starts a root."""
    gen = torch.Generator().manual_seed(seed)
    parents: list[int] = []
    path: list[int] = []
    for i in range(n):
        keep = int(torch.randint(0, len(path) + 1, (1,), generator=gen)) if path else 0
        if torch.rand(1, generator=gen).item() < 0.8:
            keep = len(path)  # mostly chains
        path = path[:keep]
        parents.append(path[-1] if path else -1)
        path.append(i)
    return parents


# ------------------------------------------------------------------- attention call cases
# One attention call, drawn widely, for the backends' differential fuzz
# (tests/test_attention_fuzz.py) and any test that runs a call through a backend: a
# ``CaseSpec`` (every choice, hashable, printed by hypothesis) made into an ``AttentionCase``
# (the tensors, the mask as passed, the dense bool mask) by ``build_case``.

LAYOUTS = (
    "contiguous",
    "transposed",  # (B, S, H, D) storage, .transpose(1, 2)
    "expanded",  # a size-1 batch (else head) dim expanded: stride 0
    "last_dim_strided",  # x[..., ::2] of a twice-as-wide tensor
    "wide_slice",  # x[..., :D] of a wider projection
    "seq_strided",  # x[:, :, ::2] of a twice-as-long tensor
)
CONTIGUOUS = ("contiguous", "contiguous", "contiguous")
SPECIAL_SCALES = (None, 0.0, -1.0, -0.125, 1e-4, 30.0)
NON_FINITE = (float("nan"), float("inf"), float("-inf"))
PLACES = ("unattended", "partial", "attended")
"""Where a non-finite value goes: a key/value no query attends (a query that attends
nothing), one some queries attend and others not, or one that is attended."""
FORMS = ("mask", "lazy", "block_mask")
MAX_PAIRS = 160_000
"""Bound on B x Hq x Q_LEN x KV_LEN of a case (the reference forms every pair's product
where an input is non-finite)."""


class Placement(NamedTuple):
    """A non-finite ``value`` put in ``tensor`` ("q", "k" or "v") at a position of kind
    ``place`` (``PLACES``): the ``pick``-th such position (modulo their count), head dim
    ``dim`` (modulo D). No position of that kind: nothing is placed."""

    tensor: str
    value: float
    place: str
    pick: int = 0
    dim: int = 0


@dataclass(frozen=True)
class CaseSpec:
    """Every choice of one attention call; ``build_case`` makes it."""

    mask: flexmask.Mask
    q_len: int
    kv_len: int
    batch: int = 1
    kv_heads: int = 1
    group: int = 1
    """Query heads per kv head (Hq = kv_heads * group)."""
    head_dim: int = 8
    value_dim: int | None = None
    """None: head_dim."""
    dtype: torch.dtype = torch.float32
    form: str = "mask"
    """How the mask is passed: "mask", "lazy" (a handle), "block_mask" (built), "none"."""
    block_size: int | tuple[int, int] = 128
    mask_batch: int | None = None
    """B of a built BlockMask or handle (None: the batch); 1 broadcasts."""
    mask_heads: int | None = None
    """H of a built BlockMask or handle (None: the query heads); 1 broadcasts."""
    layouts: tuple[str, str, str] = CONTIGUOUS
    """Per q, k, v: one of LAYOUTS."""
    scale: float | None = None
    enable_gqa: Any = False
    return_lse: bool = False
    requires_grad: bool = False
    placements: tuple[Placement, ...] = ()
    seed: int = 0

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def mask_fits(self) -> bool:
        """Whether the call is valid for the mask's batch and head dims, by torch's rule as
        flexmask keeps it: a BlockMask or handle of B and H each 1 or the query's; per-row
        data (whether in a Mask built for the call, a handle or a BlockMask) given for
        exactly the query's rows, as the mask_mod reads row b of it."""
        if self.form == "none":
            return True
        if self.mask.rows is not None and self.mask.rows != self.batch:
            return False
        if self.form == "mask":
            return True
        mask_batch = self.batch if self.mask_batch is None else self.mask_batch
        mask_heads = self.q_heads if self.mask_heads is None else self.mask_heads
        if self.form == "lazy":  # a handle builds B (H) of 1 where the mask ignores the row (head)
            mask_batch = mask_batch if self.mask.batch_dependent else 1
            mask_heads = mask_heads if self.mask.head_dependent else 1
        return mask_batch in (1, self.batch) and mask_heads in (1, self.q_heads)


@dataclass(frozen=True, eq=False)
class AttentionCase:
    """One attention call: ``query``/``key``/``value`` (leaves, in their layouts), the mask as
    passed (a Mask, a handle, a BlockMask or None), the dense bool mask ``(B, Hq, Q, KV)`` it
    means (``Mask.to_dense``), the call's keyword arguments, and the gradient of the output
    the backward is run with."""

    spec: CaseSpec
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: Any
    dense: torch.Tensor
    kwargs: dict
    grad_out: torch.Tensor | None
    placed: tuple[str, ...]
    """The non-finite values placed: ``"k[b, h, s, d]=nan"``."""

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.query, self.key, self.value

    def explain(self, backend: str = "auto"):
        """``flexmask.explain`` of this call for ``backend``."""
        return flexmask.explain(*self.tensors, self.mask, backend=backend, **self.kwargs)

    def call(self, backend: str = "auto"):
        """The call's output, lse and gradients (``oracle.Outcome``), run by
        ``flexmask.attention(..., backend=backend)``, or by ``flexmask.flex_attention(...,
        compile=False)`` for ``backend="flex_attention"``."""
        from tests.oracle import Outcome

        with torch.set_grad_enabled(self.spec.requires_grad):
            if backend == "flex_attention":
                result = flexmask.flex_attention(
                    *self.tensors, block_mask=self.mask, compile=False, **self.kwargs
                )
            else:
                result = flexmask.attention(
                    *self.tensors, self.mask, backend=backend, **self.kwargs
                )
            out, lse = result if self.spec.return_lse else (result, None)
            grads = None
            if self.grad_out is not None:
                grads = torch.autograd.grad(out, self.tensors, self.grad_out, allow_unused=True)
        return Outcome(out.detach(), None if lse is None else lse.detach(), grads)

    def reference(self):
        """The float64 reference's Outcome for this call (``tests.oracle.attention_outcome``)."""
        from tests.oracle import attention_outcome

        return attention_outcome(
            *self.tensors,
            self.dense,
            self.spec.scale,
            self.spec.enable_gqa,
            self.grad_out,
        )

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{name}{tuple(t.shape)}:{t.stride()}"
            for name, t in zip("qkv", self.tensors, strict=True)
        )
        return f"AttentionCase({self.spec!r}, {shapes}, placed={list(self.placed)})"


def _positions(dense: torch.Tensor, tensor: str, place: str, group: int) -> torch.Tensor:
    """(n, 3) indices (b, h, s) of ``tensor``'s positions of kind ``place``."""
    batch, q_heads, q_len, kv_len = dense.shape
    if tensor == "q":
        attends = dense.any(-1)
        chosen = ~attends if place == "unattended" else attends
        return chosen.nonzero()
    count = dense.view(batch, q_heads // group, group, q_len, kv_len).sum((2, 3))
    if place == "unattended":
        chosen = count == 0
    elif place == "partial":
        chosen = (count > 0) & (count < group * q_len)
    else:
        chosen = count > 0
    return chosen.nonzero()


def _source_and_view(
    values: torch.Tensor, layout: str, gen: torch.Generator
) -> tuple[torch.Tensor, Any]:
    """(the tensor to write the values into, a function making the layout's view of it)."""
    batch, heads, length, dim = values.shape
    if layout == "transposed":
        store = values.transpose(1, 2).contiguous()
        return store.transpose(1, 2), lambda: store.transpose(1, 2)
    if layout == "expanded":
        dim_1 = 0 if batch > 1 else 1
        small = values.narrow(dim_1, 0, 1).clone()
        return small, lambda: small.expand(batch, heads, length, dim)
    if layout in ("last_dim_strided", "wide_slice", "seq_strided"):
        shape = {
            "last_dim_strided": (batch, heads, length, 2 * dim),
            "wide_slice": (batch, heads, length, dim + 5),
            "seq_strided": (batch, heads, 2 * length, dim),
        }[layout]
        # The gaps hold other (finite) numbers: a kernel that reads them gives another result.
        wide = torch.randn(shape, generator=gen, dtype=torch.float64).to(values.dtype)
        index = {
            "last_dim_strided": (..., slice(None, None, 2)),
            "wide_slice": (..., slice(0, dim)),
            "seq_strided": (slice(None), slice(None), slice(None, None, 2)),
        }[layout]
        wide[index] = values
        return wide[index], lambda: wide[index]
    if layout != "contiguous":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return values, lambda: values


def build_case(spec: CaseSpec) -> AttentionCase:
    """The tensors, the mask as passed and the dense mask of ``spec``."""
    batch, q_heads, kv_heads = spec.batch, spec.q_heads, spec.kv_heads
    value_dim = spec.head_dim if spec.value_dim is None else spec.value_dim
    # The mask's own rows (per-row data of another batch size: a call to be refused), the
    # dense reference of a valid call broadcast over the query's rows as torch does.
    rows = batch if spec.mask.rows is None else spec.mask.rows
    dense = spec.mask.to_dense(rows, q_heads, spec.q_len, spec.kv_len)
    if spec.mask_fits:
        dense = dense.expand(batch, *dense.shape[1:])
    gen = torch.Generator().manual_seed(spec.seed)
    shapes = {
        "q": (batch, q_heads, spec.q_len, spec.head_dim),
        "k": (batch, kv_heads, spec.kv_len, spec.head_dim),
        "v": (batch, kv_heads, spec.kv_len, value_dim),
    }
    views, sources = {}, {}
    for name, layout in zip("qkv", spec.layouts, strict=True):
        values = torch.randn(shapes[name], generator=gen, dtype=torch.float64).to(spec.dtype)
        sources[name], views[name] = _source_and_view(values, layout, gen)
    placed = []
    for p in spec.placements:
        found = _positions(dense, p.tensor, p.place, spec.group)
        if not len(found):
            continue
        b, h, s = found[p.pick % len(found)].tolist()
        d = p.dim % shapes[p.tensor][-1]
        source = sources[p.tensor]
        b, h = min(b, source.size(0) - 1), min(h, source.size(1) - 1)  # an expanded dim
        source[b, h, s, d] = p.value
        placed.append(f"{p.tensor}[{b}, {h}, {s}, {d}]={p.value}")
    q, k, v = (views[name]().detach().requires_grad_(spec.requires_grad) for name in "qkv")

    mask_batch = rows if spec.mask_batch is None else spec.mask_batch
    mask_heads = q_heads if spec.mask_heads is None else spec.mask_heads
    build = (spec.mask, mask_batch, mask_heads, spec.q_len, spec.kv_len)
    if spec.form == "mask":
        mask = spec.mask
    elif spec.form == "lazy":
        mask = flexmask.lazy(*build, device="cpu", BLOCK_SIZE=spec.block_size)
    elif spec.form == "block_mask":
        mask = flexmask.create_block_mask(*build, device="cpu", BLOCK_SIZE=spec.block_size)
    elif spec.form == "none":
        if spec.mask != flexmask.full():
            raise ValueError(f"form='none' means full(), got {spec.mask!r}")
        mask = None
    else:
        raise ValueError(f"form must be one of {FORMS} or 'none', got {spec.form!r}")
    kwargs = {"scale": spec.scale, "enable_gqa": spec.enable_gqa, "return_lse": spec.return_lse}
    grad_out = None
    if spec.requires_grad:
        grad_out = torch.randn(
            batch, q_heads, spec.q_len, value_dim, generator=gen, dtype=torch.float64
        ).to(spec.dtype)
    return AttentionCase(spec, q, k, v, mask, dense, kwargs, grad_out, tuple(placed))


MASK_KINDS = (
    "causal",
    "causal_document",
    "causal_padding",
    "causal_window",
    "leaf",
    "prefix_lm",
    "span_union",
    "per_head",
    "expression",
    "ending",
    "negated",
)
"""What ``attention_masks`` draws: plain causal, causal & document / padding / window, any
one piece, the prefix-LM and text-with-images unions, per_head, random compounds, ones
ending in documents or padding, negated compounds."""
COMMON_MASKS = st.sampled_from((*MASK_KINDS, "causal", "causal", "causal_document", "leaf"))
"""Every kind; plain causal, document-causal and single pieces more often."""


@st.composite
def attention_masks(draw, batch: int, heads: int, group: int, length: int, kinds=COMMON_MASKS):
    """A mask for an attention call of ``batch`` rows and ``heads`` query heads (``group``
    per kv head), of a kind drawn from ``kinds`` (names of ``MASK_KINDS``)."""
    kind = draw(kinds, label="mask kind")
    if kind == "causal":
        return flexmask.causal()
    if kind in ("causal_document", "causal_padding", "causal_window"):
        leaf_kind = {"causal_document": "document", "causal_padding": "padding"}.get(kind, "window")
        return flexmask.causal() & draw(leaves(batch, length, (leaf_kind,)))[0]
    if kind == "leaf":
        return draw(leaves(batch, length, tuple(k for k in ALL_KINDS if k != "custom")))[0]
    if kind == "prefix_lm":
        return draw(from_zero_unions(batch, length))[0]
    if kind == "span_union":
        return draw(span_unions(batch, length))[0]
    if kind == "per_head":
        # One mask per kv head's group of query heads, or alternating heads.
        per_kv = group > 1 and heads // group > 1 and draw(st.booleans())
        count = heads // group if per_kv else (2 if heads % 2 == 0 else 1)
        parts = [draw(leaves(batch, length, INTERVAL_KINDS))[0] for _ in range(count)]
        return flexmask.per_head(*parts, group_size=group if per_kv else 1)
    if kind == "expression":
        return draw(expressions(batch, heads, length, max_leaves=3))[0]
    if kind == "ending":
        return draw(ending_intersections(batch, length))[0]
    return draw(negated_compounds(batch, heads, length))[0]


LENGTHS = st.one_of(st.integers(1, 8), st.integers(9, 127), st.integers(129, 260))
DTYPES = st.sampled_from((torch.float32, torch.float32, torch.float64, torch.bfloat16))
ANY_LAYOUTS = st.tuples(*[st.sampled_from(LAYOUTS)] * 3)
SCALES = st.one_of(st.sampled_from(SPECIAL_SCALES), st.floats(-4, 4, allow_nan=False, width=32))
PLACEMENT = st.builds(
    Placement,
    st.sampled_from("qkv"),
    st.sampled_from(NON_FINITE),
    st.sampled_from(PLACES),
    st.integers(0, 1 << 20),
    st.integers(0, 64),
)
PLACEMENTS = st.lists(PLACEMENT, max_size=2).map(tuple)
"""None, one or two non-finite values (none about half the time)."""


@st.composite
def case_specs(
    draw,
    *,
    dtypes=DTYPES,
    layouts=ANY_LAYOUTS,
    scales=SCALES,
    placements=PLACEMENTS,
    requires_grad=st.booleans(),  # noqa: B008 - a strategy, immutable
    return_lse=st.booleans(),  # noqa: B008
    forms=st.sampled_from(FORMS),  # noqa: B008
    gqa_flags=st.sampled_from((False, True, "truthy")),  # noqa: B008
    mask_kinds=COMMON_MASKS,
    other_dims=st.sampled_from((False, False, False, True)),  # noqa: B008
):
    """A ``CaseSpec`` drawn from every axis; each keyword narrows one axis (a strategy).
    ``gqa_flags``: ``enable_gqa`` as a bool (True wherever heads differ) or, for "truthy",
    any truthy (falsy where the heads match) value of another type. ``mask_kinds``: names of
    ``MASK_KINDS``. ``other_dims``: whether the mask is made for a batch and heads of its
    own (per-row data of 1-3 rows, a handle or BlockMask of B and H 1, the query's or
    another): ``CaseSpec.mask_fits`` says whether the call is then valid."""
    q_len = draw(LENGTHS, label="q_len")
    kv_len = q_len if draw(st.booleans(), label="same length") else draw(LENGTHS, label="kv_len")
    batch = draw(st.integers(1, 3), label="batch")
    kv_heads = draw(st.integers(1, 2), label="kv_heads")
    group = draw(st.sampled_from((1, 1, 2, 3)), label="group")
    while batch * kv_heads * group * q_len * kv_len > MAX_PAIRS:
        if batch > 1:
            batch -= 1
        elif group > 1:
            group -= 1
        else:
            kv_heads -= 1
    heads = kv_heads * group
    flag = draw(gqa_flags, label="enable_gqa")
    if flag == "truthy":  # any truthy value, as torch takes it (a falsy one where heads match)
        others = (1, np.True_) if group > 1 else (0, np.False_, None)
        enable_gqa = draw(st.sampled_from(others), label="truthy enable_gqa")
    else:
        enable_gqa = True if group > 1 else flag
    longest = max(q_len, kv_len)
    length = longest if draw(st.booleans()) else draw(st.integers(1, longest))
    other = draw(other_dims, label="mask of its own B and H")
    rows = draw(st.integers(1, 3), label="mask rows") if other else batch
    mask = draw(attention_masks(rows, heads, group, length, mask_kinds), label="mask")
    form = draw(forms, label="form")
    if mask == flexmask.full() and draw(st.booleans()):
        form = "none"
    if other:
        # B and H a handle or BlockMask of this mask can be made for: per-row data fixes B,
        # per-head masks need a multiple of their heads.
        mask_batch = mask.rows or draw(st.integers(1, 4), label="mask B")
        head_choices = (heads, 2 * heads) if mask.head_dependent else (1, heads, heads + 1)
        mask_heads = draw(st.sampled_from(head_choices), label="mask H")
    else:
        mask_batch = None if mask.batch_dependent or draw(st.booleans()) else 1
        mask_heads = None if mask.head_dependent or draw(st.booleans()) else 1
    head_dim = draw(st.sampled_from((8, 16, 4, 1, 3, 24)), label="head_dim")
    value_dim = None if draw(st.integers(0, 3)) else draw(st.sampled_from((1, 5, 16)))
    return CaseSpec(
        mask=mask,
        q_len=q_len,
        kv_len=kv_len,
        batch=batch,
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        value_dim=value_dim,
        dtype=draw(dtypes, label="dtype"),
        form=form,
        block_size=draw(st.sampled_from((128, 128, 64, (32, 64), 16)), label="block_size"),
        mask_batch=mask_batch,
        mask_heads=mask_heads,
        layouts=draw(layouts, label="layouts"),
        scale=draw(scales, label="scale"),
        enable_gqa=enable_gqa,
        return_lse=draw(return_lse, label="return_lse"),
        requires_grad=draw(requires_grad, label="requires_grad"),
        placements=draw(placements, label="placements"),
        seed=draw(st.integers(0, 1 << 16), label="seed"),
    )


def attention_cases(**axes):
    """``AttentionCase``s: ``case_specs(**axes)`` built."""
    return case_specs(**axes).map(build_case)
