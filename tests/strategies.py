"""Hypothesis strategies: random mask expressions paired with their plain dense reference."""

from __future__ import annotations

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


@st.composite
def leaves(draw, batch: int, length: int, kinds: tuple[str, ...] = ALL_KINDS):
    """(mask, reference) where reference(q_len, kv_len) -> (B, Q, KV) numpy bool."""
    kind = draw(st.sampled_from(kinds))
    per_row = draw(st.booleans())

    def per_batch(fn_of_row):
        return lambda q, kv: np.stack([fn_of_row(r, q, kv) for r in range(batch)])

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
        mask = flexmask.spans(rows if per_row else rows[0])
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
            "padding": flexmask.padding,
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
        mask = flexmask.document(rows if per_row else rows[0])
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
