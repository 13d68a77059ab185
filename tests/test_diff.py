"""Builds you can see into: ``flexmask.diff`` and ``flexmask.explain_build``.

``diff`` is checked against a plain reference: each side's attended pairs read from the
BlockMask's lists block by block (torch's documented meaning, ``side_pairs`` here) and its
mask_mod evaluated densely by torch's ``create_mask``; the first block (kv side, then q side,
each in (b, h, q block, kv block) order) where those disagree, its first pair, and the blocks
whose listing differs. The BlockMasks compared are torch's own builds, flexmask's, and
BlockMasks edited by hand (a block moved, a partial block turned full, the q side edited, a
different mask_mod over the same blocks), at B and H > 1 and lengths that are not block
multiples.

``explain_build`` is checked against what the build did: each builder's function spied on,
the path reported is the path that ran.
"""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

import flexmask
from flexmask.builders import closed_form, columns, unions
from flexmask.builders import create as create_module
from flexmask.builders import sides as sides_module
from tests import oracle

EMPTY, PARTIAL, FULL = 0, 1, 2
NAMES = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}


# -- the plain reference -----------------------------------------------------------------


def side_codes(block_mask: BlockMask, side: str, batch: int, heads: int) -> torch.Tensor:
    """(B, H, nq, nkv) codes of one side, read from its lists with Python loops; a block
    listed both partial and full reads as full (the kernels run the full list last)."""
    q_len, kv_len = block_mask.seq_lengths
    qb, kb = block_mask.BLOCK_SIZE
    nq, nkv = -(-q_len // qb), -(-kv_len // kb)
    codes = torch.zeros(batch, heads, nq, nkv, dtype=torch.int64)
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    if side == "q":
        names = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    lines = nq if side == "kv" else nkv
    for num_name, idx_name, code in ((*names[:2], PARTIAL), (*names[2:], FULL)):
        num, idx = getattr(block_mask, num_name), getattr(block_mask, idx_name)
        if num is None:
            continue
        for b in range(batch):
            for h in range(heads):
                mb, mh = b % num.size(0), h % num.size(1)
                for line in range(lines):
                    for other in idx[mb, mh, line, : int(num[mb, mh, line])].tolist():
                        at = (b, h, line, other) if side == "kv" else (b, h, other, line)
                        codes[at] = max(codes[at], code) if code == FULL else code
    return codes


def side_pairs(block_mask, codes, batch, heads) -> torch.Tensor:
    """(B, H, Q, KV) pairs the side attends: full blocks everything, partial blocks the
    mask_mod (torch's ``create_mask``), empty nothing."""
    q_len, kv_len = block_mask.seq_lengths
    qb, kb = block_mask.BLOCK_SIZE
    element = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    element = element.expand(batch, heads, q_len, kv_len)
    tile = codes.repeat_interleave(qb, 2).repeat_interleave(kb, 3)[..., :q_len, :kv_len]
    return (tile == FULL) | ((tile == PARTIAL) & element)


def reference_diff(a: BlockMask, b: BlockMask, batch: int, heads: int):
    """(first other-pairs block with its pair, first listing-only block, counts), by brute
    force over every pair."""
    qb, kb = a.BLOCK_SIZE
    firsts_other, firsts_listing, other, listing = [], [], 0, 0
    for side in ("kv", "q"):
        ca, cb = side_codes(a, side, batch, heads), side_codes(b, side, batch, heads)
        pa, pb = side_pairs(a, ca, batch, heads), side_pairs(b, cb, batch, heads)
        apart = pa != pb
        for bi, hi, i, j in itertools.product(*(range(n) for n in ca.shape)):
            block = apart[bi, hi, i * qb : (i + 1) * qb, j * kb : (j + 1) * kb]
            codes = (NAMES[int(ca[bi, hi, i, j])], NAMES[int(cb[bi, hi, i, j])])
            if block.any():
                other += 1
                q, kv = (int(x) for x in block.nonzero()[0])
                pair = (i * qb + q, j * kb + kv)
                by = "a" if bool(pa[bi, hi, pair[0], pair[1]]) else "b"
                firsts_other.append((side, bi, hi, i, j, *codes, pair, by))
            elif codes[0] != codes[1]:
                listing += 1
                firsts_listing.append((side, bi, hi, i, j, *codes))
    return (
        firsts_other[0] if firsts_other else None,
        firsts_listing[0] if firsts_listing else None,
        other,
        listing,
    )


def assert_matches_reference(a, b, batch, heads):
    got = flexmask.diff(a, b)
    first_other, first_listing, other, listing = reference_diff(a, b, batch, heads)
    if first_other is None and first_listing is None:
        assert got is None, str(got)
        return None
    assert got is not None
    named = (got.side, got.batch, got.head, got.q_block, got.kv_block, got.a, got.b)
    if first_other is not None:
        assert not got.same_pairs
        assert (*named, got.pair, got.attended_by) == first_other
    else:
        assert got.same_pairs and got.pair is None and got.attended_by is None
        assert named == first_listing
    assert (got.other_pairs, got.other_listing) == (other, listing)
    return got


def from_codes(codes, mask_mod, block, seq_lengths) -> BlockMask:
    """A BlockMask listing the given (B, H, nq, nkv) codes, its q side the transpose
    (``from_kv_blocks``), its lists in ascending order."""

    def lists(code):
        hit = codes == code
        num = hit.sum(-1).to(torch.int32)
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)
        return num, order.to(torch.int32)

    kv_num, kv_idx = lists(PARTIAL)
    full_num, full_idx = lists(FULL)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, block, mask_mod, seq_lengths=seq_lengths
    )


def with_q_side(block_mask: BlockMask, source: BlockMask) -> BlockMask:
    """``block_mask``'s kv side with ``source``'s q side: a BlockMask whose backward reads
    other blocks than its forward."""
    return BlockMask(
        block_mask.seq_lengths,
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        source.q_num_blocks,
        source.q_indices,
        source.full_q_num_blocks,
        source.full_q_indices,
        block_mask.BLOCK_SIZE,
        block_mask.mask_mod,
    )


# -- diff ---------------------------------------------------------------------------------

SHAPES = [(1, 1, 200, 200, 64), (2, 3, 150, 210, 32)]
"""(B, H, Q_LEN, KV_LEN, BLOCK_SIZE): lengths off the block multiples, B and H > 1."""


@pytest.mark.parametrize("shape", SHAPES)
def test_torch_and_flexmask_builds_of_one_mask_do_not_differ(shape):
    batch, heads, q_len, kv_len, block = shape
    mask = flexmask.causal() & flexmask.sliding_window(70)
    theirs = oracle.torch_build(mask.mask_mod, batch, heads, q_len, kv_len, block)
    ours = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", block)
    assert flexmask.diff(theirs, ours) is None
    assert flexmask.diff(theirs, mask) is None
    assert flexmask.diff(mask, ours) is None
    assert flexmask.diff(ours, ours) is None


@pytest.mark.parametrize("shape", SHAPES)
def test_another_mask_is_other_pairs_as_the_reference_says(shape):
    batch, heads, q_len, kv_len, block = shape
    mask = flexmask.causal() & flexmask.sliding_window(70)
    other = flexmask.causal() & flexmask.sliding_window(40)
    a = oracle.torch_build(mask.mask_mod, batch, heads, q_len, kv_len, block)
    b = flexmask.create_block_mask(other, batch, heads, q_len, kv_len, "cpu", block)
    got = assert_matches_reference(a, b, batch, heads)
    assert got is not None and not got.same_pairs
    assert got.attended_by == "a"  # the wider window attends what the narrow one does not
    assert "no flexmask build on record" in got.a_built_by and "closed form" in got.b_built_by


@pytest.mark.parametrize("shape", SHAPES)
def test_a_moved_block_is_found(shape):
    batch, heads, q_len, kv_len, block = shape
    mask = flexmask.causal()
    built = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", block)
    codes = side_codes(built, "kv", batch, heads)
    edited = codes.clone()
    b, h = batch - 1, heads - 1
    edited[b, h, 2, 1], edited[b, h, 2, 3] = EMPTY, FULL  # a full block moved past the diagonal
    moved = from_codes(edited, built.mask_mod, block, built.seq_lengths)
    got = assert_matches_reference(built, moved, batch, heads)
    assert (got.side, got.batch, got.head, got.q_block, got.kv_block) == ("kv", b, h, 2, 1)
    assert (got.a, got.b, got.attended_by) == ("full", "empty", "a")
    assert got.other_pairs == 4  # two blocks on each side


def test_a_partial_block_turned_full_attends_other_pairs():
    batch, heads, q_len, kv_len, block = 2, 2, 150, 150, 32
    mask = flexmask.causal()
    built = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", block)
    edited = side_codes(built, "kv", batch, heads)
    edited[1, 0, 3, 3] = FULL  # a diagonal block: its upper triangle now attends
    turned = from_codes(edited, built.mask_mod, block, built.seq_lengths)
    got = assert_matches_reference(built, turned, batch, heads)
    assert (got.batch, got.head, got.q_block, got.kv_block) == (1, 0, 3, 3)
    assert (got.a, got.b, got.pair, got.attended_by) == ("partial", "full", (96, 97), "b")


def test_a_full_block_listed_partial_is_the_same_pairs_listed_otherwise():
    batch, heads, q_len, kv_len, block = 1, 2, 250, 250, 64
    mask = flexmask.causal() & flexmask.document([130, 120])
    built = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", block)
    edited = side_codes(built, "kv", batch, heads)
    edited[edited == FULL] = PARTIAL  # the mask_mod is true throughout those blocks
    listed = from_codes(edited, built.mask_mod, block, built.seq_lengths)
    got = assert_matches_reference(built, listed, batch, heads)
    assert got.same_pairs and (got.a, got.b) == ("full", "partial")
    assert "same pairs, other listing" in str(got)
    # torch's own build without its full lists says the same.
    unsplit = oracle.torch_build(
        mask.mask_mod, batch, heads, q_len, kv_len, block, separate_full_blocks=False
    )
    assert flexmask.diff(mask, unsplit).same_pairs


def test_an_edited_q_side_is_found_on_the_q_side():
    batch, heads, q_len, kv_len, block = 2, 1, 130, 100, 32
    mask = flexmask.causal()
    built = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", block)
    edited = side_codes(built, "kv", batch, heads)
    edited[0, 0, 4, 0] = EMPTY  # kv block 0 no longer read by the last, incomplete q block
    q_side = from_codes(edited, built.mask_mod, block, built.seq_lengths)
    backward_only = with_q_side(built, q_side)
    got = assert_matches_reference(built, backward_only, batch, heads)
    assert (got.side, got.q_block, got.kv_block, got.a, got.b) == ("q", 4, 0, "partial", "empty")
    assert got.pair == (128, 0) and got.attended_by == "a"
    # Against its Mask too: the kv side agrees, the q side does not.
    assert flexmask.diff(mask, backward_only).side == "q"


@pytest.mark.parametrize("shape", SHAPES)
def test_another_mask_mod_over_the_same_blocks_is_found_in_a_partial_block(shape):
    batch, heads, q_len, kv_len, block = shape
    mask = flexmask.causal()
    built = flexmask.create_block_mask(mask, batch, heads, q_len, kv_len, "cpu", block)

    def strictly_causal(b, h, q_idx, kv_idx):
        return q_idx > kv_idx

    same_blocks = from_codes(
        side_codes(built, "kv", batch, heads), strictly_causal, block, built.seq_lengths
    )
    assert flexmask.same_blocks(built, same_blocks)
    got = assert_matches_reference(built, same_blocks, batch, heads)
    assert (got.a, got.b, got.pair, got.attended_by) == ("partial", "partial", (0, 0), "a")
    assert got.other_pairs == 2 * batch * heads * -(-min(q_len, kv_len) // block)


def test_a_per_row_mask_against_torch_with_a_mask_mod_that_reads_the_row():
    batch, heads, q_len, kv_len, block = 2, 2, 200, 200, 64
    mask = flexmask.causal() & flexmask.document([[100, 100], [50, 150]])
    theirs = oracle.torch_build(mask.mask_mod, batch, heads, q_len, kv_len, block)
    assert flexmask.diff(theirs, mask) is None
    swapped = flexmask.causal() & flexmask.document([[50, 150], [100, 100]])
    got = assert_matches_reference(
        theirs,
        flexmask.create_block_mask(swapped, batch, heads, q_len, kv_len, "cpu", block),
        batch,
        heads,
    )
    assert got.batch == 0 and not got.same_pairs


def test_a_broadcast_block_mask_is_compared_on_every_row_and_head():
    mask = flexmask.causal() & flexmask.sliding_window(50)
    one = flexmask.create_block_mask(mask, 1, 1, 150, 150, "cpu", 32)
    many = flexmask.create_block_mask(mask, 2, 3, 150, 150, "cpu", 32)
    assert flexmask.diff(one, many) is None
    wider = flexmask.create_block_mask(flexmask.causal(), 2, 3, 150, 150, "cpu", 32)
    got = assert_matches_reference(one, wider, 2, 3)
    assert got.other_pairs % (2 * 3) == 0  # the same blocks on every row and head


def test_a_window_is_compared_with_its_mask_at_the_offsets():
    mask = flexmask.causal() & flexmask.document([120, 200])
    window = flexmask.create_block_mask(mask, 1, 1, 100, 320, "cpu", 32, q_offset=220)
    assert flexmask.diff(window, mask, q_offset=220) is None
    got = flexmask.diff(window, mask)  # read at offset 0: another window
    assert got is not None and not got.same_pairs
    assert "no flexmask build on record" in got.a_built_by  # a window records no Mask


def test_the_path_that_built_each_side_is_named():
    tree = flexmask.tree([-1, 0, 1, 1, 0] + list(range(4, 63)))
    built = flexmask.create_block_mask(tree, 1, 1, 64, 64, "cpu", 16)
    causal = flexmask.create_block_mask(flexmask.causal(), 1, 1, 64, 64, "cpu", 16)
    got = flexmask.diff(built, causal)
    assert got.a_built_by == "built by flexmask: tiles"
    assert got.b_built_by == "built by flexmask: closed form"
    union = (flexmask.causal() & flexmask.document([30, 34])) | flexmask.prefix(8)
    got = flexmask.diff(causal, union)
    assert got.b_built_by == "the Mask, built by flexmask: unions"
    split = flexmask.per_head(flexmask.causal(), flexmask.causal() & ~flexmask.sliding_window(4))
    got = flexmask.diff(flexmask.create_block_mask(split, 1, 2, 64, 64, "cpu", 16), causal)
    assert got.a_built_by == "built by flexmask: per head (closed form, tiles)"
    # An edit in place is named as one, and a pickle keeps the route.
    edited = flexmask.create_block_mask(flexmask.causal(), 1, 1, 64, 64, "cpu", 16)
    edited.kv_num_blocks[0, 0, 3] = 0  # the diagonal block of q block 3 dropped
    assert flexmask.diff(edited, causal).a_built_by == "built by flexmask: closed form, then edited"
    loaded = pickle.loads(pickle.dumps(built))
    assert flexmask.diff(loaded, causal).a_built_by == "built by flexmask: tiles"


def test_the_result_reads():
    a = flexmask.create_block_mask(flexmask.causal(), 1, 1, 100, 100, "cpu", 32)
    got = flexmask.diff(a, flexmask.causal() & flexmask.sliding_window(20))
    text = str(got)
    assert text.startswith("other pairs: ")
    assert "kv side, batch row 0, head 0, q block 0, kv block 0: a lists it partial, b" in text
    assert "(q 20, kv 0) is attended by a only" in text
    assert "b: the Mask, built by flexmask: closed form" in text


def test_diff_refuses_what_it_cannot_compare():
    mask = flexmask.causal()
    bm = flexmask.create_block_mask(mask, 1, 1, 128, 128, "cpu", 64)
    with pytest.raises(TypeError, match="a must be a torch BlockMask or a flexmask Mask"):
        flexmask.diff(mask.mask_mod, bm)
    with pytest.raises(TypeError, match="both flexmask Masks"):
        flexmask.diff(mask, mask)
    with pytest.raises(TypeError, match="q_offset/kv_offset place a Mask reference"):
        flexmask.diff(bm, bm, q_offset=3)
    other_len = flexmask.create_block_mask(mask, 1, 1, 100, 128, "cpu", 64)
    with pytest.raises(ValueError, match=r"same \(Q_LEN, KV_LEN\)"):
        flexmask.diff(bm, other_len)
    other_block = flexmask.create_block_mask(mask, 1, 1, 128, 128, "cpu", 32)
    with pytest.raises(ValueError, match="same BLOCK_SIZE"):
        flexmask.diff(bm, other_block)
    two = flexmask.create_block_mask(mask, 2, 1, 128, 128, "cpu", 64)
    three = flexmask.create_block_mask(mask, 3, 1, 128, 128, "cpu", 64)
    with pytest.raises(ValueError, match="a has B=2 and b B=3"):
        flexmask.diff(two, three)


def test_a_block_mask_without_a_q_side_is_compared_on_its_kv_side():
    mask = flexmask.causal()
    built = flexmask.create_block_mask(mask, 1, 1, 100, 100, "cpu", 32)
    forward_only = BlockMask.from_kv_blocks(
        built.kv_num_blocks,
        built.kv_indices,
        built.full_kv_num_blocks,
        built.full_kv_indices,
        32,
        built.mask_mod,
        seq_lengths=(100, 100),
        compute_q_blocks=False,
    )
    assert flexmask.diff(forward_only, mask) is None


def test_partial_blocks_are_evaluated_only_where_they_decide(monkeypatch):
    """One mask_mod (or two builds of one Mask): no evaluation at all where the blocks agree;
    other mask_mods: only the partial blocks."""
    from flexmask.builders import differences

    calls = []
    real = differences.vmap_broadcast

    def counting(fn, args, shape):
        calls.append(shape[0])
        return real(fn, args, shape)

    monkeypatch.setattr(differences, "vmap_broadcast", counting)
    mask = flexmask.causal() & flexmask.document([300, 200])
    ours = flexmask.create_block_mask(mask, 1, 1, 512, 512, "cpu", 64)
    assert flexmask.diff(ours, mask) is None
    assert calls == []
    theirs = oracle.torch_build(mask.mask_mod, 1, 1, 512, 512, 64)
    assert flexmask.diff(ours, theirs) is None
    partial = int(ours.kv_num_blocks.sum())
    assert sum(calls) == 2 * 2 * partial  # both mask_mods, both sides, partial blocks only


# -- explain_build ------------------------------------------------------------------------


@pytest.fixture
def ran(monkeypatch):
    """The builder functions spied on: which of them a build called."""
    called: list[str] = []

    def spy(module, name, label):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            called.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    spy(closed_form, "ordered_sides", "closed form")
    spy(unions, "union_sides", "unions")
    spy(columns, "ordered_sides", "tree columns")
    spy(sides_module, "classify_blocks", "tiles")
    spy(sides_module, "_by_head", "per head")
    spy(sides_module, "_row_by_row", "rows")
    spy(create_module, "_torch_build", "torch")
    return called


PATH_CASES = [
    ("closed form", flexmask.causal() & flexmask.document([300, 200]), {}),
    ("unions", (flexmask.causal() & flexmask.document([300, 200])) | flexmask.prefix(64), {}),
    ("tiles", flexmask.causal() & ~flexmask.sliding_window(64), {}),
    ("per head", flexmask.per_head(flexmask.causal(), flexmask.full()), {"H": 2}),
    ("rows", flexmask.causal() & ~flexmask.sliding_window(8), {"B": 2, "q_offset": [0, 64]}),
    ("torch", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, {}),
    ("no tiles", flexmask.causal(), {"KV_LEN": 0}),
]


@pytest.mark.parametrize("path, mask, arguments", PATH_CASES, ids=[c[0] for c in PATH_CASES])
def test_explain_build_reports_the_path_the_build_took(ran, path, mask, arguments):
    arguments = {"B": 1, "H": 1, "Q_LEN": 500, "device": "cpu", "BLOCK_SIZE": 64, **arguments}
    report = flexmask.explain_build(mask, **arguments)
    assert report.path == path
    if path != "no tiles":
        assert ran[0] == path, ran
    built = flexmask.create_block_mask(mask, **arguments)
    partial, full = (
        int(t.sum()) if t is not None else 0
        for t in (built.kv_num_blocks, built.full_kv_num_blocks)
    )
    assert (report.partial, report.full) == (partial, full)
    assert (report.batch, report.heads) == tuple(built.kv_num_blocks.shape[:2])
    assert report.path in str(report) and report.why in str(report)


def test_explain_build_on_a_tree_in_preorder_takes_the_columns(ran, monkeypatch):
    import sys

    monkeypatch.setattr(sys.modules["flexmask.pieces.tree"], "_COLUMNS_FROM", 0)
    report = flexmask.explain_build(
        flexmask.tree([-1, 0, 1, 1, 0] + list(range(4, 95))),
        1,
        1,
        100,
        device="cpu",
        BLOCK_SIZE=16,
    )
    assert report.path == ran[0] == "tree columns"


def test_explain_build_counts_the_tiles_the_build_refined(monkeypatch):
    mask = flexmask.causal() & ~flexmask.sliding_window(3)
    report = flexmask.explain_build(mask, 2, 1, 500, device="cpu", BLOCK_SIZE=64)
    grid = flexmask.builders.make_grid(mask, 2, 1, 500, 500, "cpu", 64)
    _, refined = create_module.build_counted(mask, grid)
    assert report.route.tiles == 8 * 8  # one row: the mask does not depend on it
    assert report.route.refined == refined > 0
    assert "tiles: 64 tiles classified, 8 refined" in str(report)
    parts = flexmask.explain_build(
        flexmask.per_head(flexmask.causal(), mask), 1, 2, 500, device="cpu", BLOCK_SIZE=64
    )
    assert [p.path for p in parts.route.parts] == ["closed form", "tiles"]
    assert parts.route.total_refined == refined


def test_explain_build_takes_create_block_mask_s_arguments_and_errors():
    with pytest.raises(TypeError, match="mask must be a flexmask Mask or a mask_mod"):
        flexmask.explain_build(3, 1, 1, 128)
    with pytest.raises(ValueError, match="Q_LEN"):
        flexmask.explain_build(flexmask.causal(), 1, 1, -1)
    report = flexmask.explain_build(flexmask.causal(), 1, 1, 300, 200, "cpu", (64, 32))
    assert (report.q_blocks, report.kv_blocks, report.block_size) == (5, 7, (64, 32))


MOD_CHOICES = {
    "causal": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
    "strict": lambda b, h, q_idx, kv_idx: q_idx > kv_idx,
    "by row": lambda b, h, q_idx, kv_idx: (q_idx + b + h) % 3 != kv_idx % 3,
}


@pytest.mark.parametrize("seed", range(6))
def test_random_edits_against_the_reference(seed):
    """Random codes on both BlockMasks (each with its own q side, edited apart), random
    mask_mods: diff's first block, first pair and counts are the brute force's."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads = 1 + seed % 2, 1 + (seed // 2) % 2
    q_len, kv_len, block = 40 + 7 * seed, 50 - 3 * seed, 16
    nq, nkv = -(-q_len // block), -(-kv_len // block)
    names = list(MOD_CHOICES)
    codes = torch.randint(0, 3, (batch, heads, nq, nkv), generator=generator)
    edited = torch.where(
        torch.rand(codes.shape, generator=generator) < 0.15,
        torch.randint(0, 3, codes.shape, generator=generator),
        codes,
    )
    mod_a, mod_b = (MOD_CHOICES[names[(seed + k) % 3]] for k in (0, seed % 2))
    a = from_codes(codes, mod_a, block, (q_len, kv_len))
    b = from_codes(edited, mod_b, block, (q_len, kv_len))
    if seed % 3 == 0:  # b's backward reads yet other blocks
        backward = torch.where(torch.rand(codes.shape, generator=generator) < 0.2, 0, edited)
        b = with_q_side(b, from_codes(backward, mod_b, block, (q_len, kv_len)))
    assert_matches_reference(a, b, batch, heads)
