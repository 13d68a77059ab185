"""DecodeMasks' append/reuse paths for documents, windows, padding, prefix unions and trees,
step by step against torch's create_block_mask of a mask_mod written here from the documented
semantics (document ids, |q - kv| < size, ancestor sets), over walks that move rows by 0, 1 or
more tokens, jump back, start documents mid-block and cross kv blocks of odd sizes."""

from __future__ import annotations

import random

import pytest
import torch

import flexmask
from tests import oracle

CAPACITY = 150


def _doc_ids(rows: list[list[int]], capacity: int) -> torch.Tensor:
    """(B, capacity) document index of each position, -1 past the documents."""
    ids = torch.full((len(rows), capacity), -1)
    for b, lens in enumerate(rows):
        pos = 0
        for d, n in enumerate(lens):
            ids[b, pos : min(pos + n, capacity)] = d
            pos += n
    return ids


def _ancestors(rows: list[list[int]], capacity: int) -> torch.Tensor:
    """(B, capacity, capacity) bool: kv is q or an ancestor of q (nothing past the tree)."""
    out = torch.zeros(len(rows), capacity, capacity, dtype=torch.bool)
    for b, parents in enumerate(rows):
        for q in range(min(len(parents), capacity)):
            node = q
            while node >= 0:
                out[b, q, node] = True
                node = parents[node]
    return out


def _cases(rng: random.Random, batch: int):
    """(name, mask, mask_mod(b, q, kv) from the semantics) for each mask kind."""
    docs = [[rng.randint(1, 23) for _ in range(14)] for _ in range(batch)]
    ids = _doc_ids(docs, CAPACITY)
    sizes = [rng.randint(1, 40) for _ in range(batch)]
    size_t = torch.tensor(sizes)
    lengths = [rng.randint(0, CAPACITY) for _ in range(batch)]
    length_t = torch.tensor(lengths)
    parents = []
    for _ in range(batch):
        row = [-1]
        while len(row) < CAPACITY:
            row.append(len(row) - 1 if rng.random() < 0.85 else rng.randrange(len(row)))
        parents.append(row)
    anc = _ancestors(parents, CAPACITY)

    def doc_mod(b, q, kv):
        qd = ids[b, q.clamp(max=CAPACITY - 1)]
        return (q >= kv) & (qd == ids[b, kv.clamp(max=CAPACITY - 1)]) & (qd >= 0)

    def window_mod(b, q, kv):
        return (q >= kv) & ((q - kv).abs() < size_t[b])

    def doc_window_mod(b, q, kv):
        return doc_mod(b, q, kv) & ((q - kv).abs() < 9)

    def padding_mod(b, q, kv):
        return (q >= kv) & (q < length_t[b]) & (kv < length_t[b])

    def prefix_mod(b, q, kv):
        return (q >= kv) | (kv < 37)

    def tree_mod(b, q, kv):
        return anc[b, q.clamp(max=CAPACITY - 1), kv.clamp(max=CAPACITY - 1)]

    causal = flexmask.causal()
    return [
        ("documents", causal & flexmask.document(docs, truncate=True), doc_mod),
        ("window", causal & flexmask.sliding_window(sizes), window_mod),
        (
            "documents & window",
            causal & flexmask.document(docs, truncate=True) & flexmask.sliding_window(9),
            doc_window_mod,
        ),
        ("padding", causal & flexmask.padding(lengths, truncate=True), padding_mod),
        ("prefix", causal | flexmask.prefix(37), prefix_mod),
        # Shared intervals that broadcast over the rows (one for every row).
        ("window alone", flexmask.sliding_window(7), lambda b, q, kv: (q - kv).abs() < 7),
        ("prefix alone", flexmask.prefix(37), lambda b, q, kv: (kv < 37) & (q >= 0)),
        ("tree", flexmask.tree(parents), tree_mod),
        ("causal & tree", causal & flexmask.tree(parents), tree_mod),
    ]


@pytest.mark.parametrize(
    ("seed", "batch", "q_len", "block", "heads"),
    [
        (0, 1, 1, 16, 1),
        (1, 3, 1, (16, 7), 2),
        (2, 4, 1, 13, 1),
        (3, 2, 3, (8, 13), 1),
        (4, 3, 5, (32, 11), 2),
    ],
)
def test_steps_equal_torch_step_by_step(seed, batch, q_len, block, heads):
    rng = random.Random(seed)
    for name, mask, mod in _cases(rng, batch):
        lens = [rng.randrange(0, 40) for _ in range(batch)]
        steps = flexmask.DecodeMasks(
            mask, lens, CAPACITY, q_len=q_len, heads=heads, block_size=block
        )
        for index in range(40):
            step = steps.at(lens)
            oracle.assert_same_block_mask(
                step.block_mask,
                oracle.torch_build(
                    lambda b, h, q_idx, kv_idx, mod=mod: mod(b, q_idx, kv_idx),
                    len(lens),
                    heads,
                    q_len,
                    CAPACITY,
                    block,
                    q_offset=lens,
                ),
                f"{name} step {index} lens={lens} q_len={q_len} block={block}",
            )
            if index % 13 == 12:  # a slot reused by a new request: any row jumps anywhere
                moves = [rng.randrange(-30, 30) for _ in lens]
            else:  # decode: rows move by 0, 1 or a few accepted tokens
                moves = [rng.choice([0, 1, 1, 1, 2, 4]) for _ in lens]
            lens = [min(CAPACITY - q_len, max(0, n + m)) for n, m in zip(lens, moves, strict=True)]
        if name.endswith("tree") and q_len > 1:
            continue  # a tree verify step (q_len > 1) is built from structure
        # One build (the constructor's) for interval masks; a tree builds again only where a
        # row left its branch or jumped back.
        assert steps.appends + steps.reuses > 0, name
        if not name.endswith("tree"):
            assert steps.builds == 1, name


def test_a_step_rewrites_only_the_rows_whose_blocks_changed():
    # Row 0 crosses into kv block 2 (position 32), row 1 stays inside block 0.
    mask = flexmask.causal() & flexmask.document([[20, 200], [5, 200]], truncate=True)
    steps = flexmask.DecodeMasks(mask, [31, 6], CAPACITY, block_size=16)
    bm = steps.block_mask
    row1 = bm.kv_indices[1].clone()
    assert steps.at([32, 7]).kind == "append"
    assert steps.block_mask is bm  # rewritten in place
    assert bm.kv_num_blocks.flatten().tolist() == [2, 1]  # row 0: blocks 1, 2 (doc from 20)
    assert torch.equal(bm.kv_indices[1], row1)
    assert steps.at([33, 8]).kind == "reuse"
    assert (steps.builds, steps.appends, steps.reuses) == (1, 1, 1)


def test_a_window_drops_its_first_block_as_it_slides():
    # Window 16, block 8: the query at 23 sees 8..23 (blocks 1, 2), at 24 sees 9..24 (1..3).
    steps = flexmask.DecodeMasks(
        flexmask.causal() & flexmask.sliding_window(16), [23], 64, block_size=8
    )
    assert steps.block_mask.kv_indices[0, 0, 0, :2].tolist() == [1, 2]
    assert steps.at([24]).block_mask.kv_indices[0, 0, 0, :3].tolist() == [1, 2, 3]
    assert steps.at([32]).block_mask.kv_indices[0, 0, 0, :2].tolist() == [2, 3, 4][:2]
    assert steps.block_mask.kv_num_blocks.item() == 3  # 17..32: blocks 2, 3, 4


def test_a_tree_row_that_leaves_its_branch_is_built():
    # 0 → 1 → 2 and 0 → 3: from 2 to 3 the new token's parent is 0, not 2.
    parents = [-1, 0, 1, 0, 3, 4, 5, 6]
    steps = flexmask.DecodeMasks(flexmask.tree(parents), [1], 8, block_size=2)
    assert steps.at([2]).kind in ("append", "reuse")
    assert steps.at([3]).kind == "build"
    assert steps.block_mask.kv_indices[0, 0, 0, :1].tolist() == [0]
    assert steps.at([4]).kind in ("append", "reuse")
    assert steps.block_mask.kv_num_blocks.item() == 3  # 0, 3, 4: blocks 0, 1, 2
