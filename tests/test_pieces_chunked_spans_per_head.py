"""chunked, spans and per_head: every build equals torch's create_block_mask (of plain
mask_mods written here, of attn-gym's where it has the mask, and of the plain dense oracle),
over B and H > 1, lengths that are not block multiples, BLOCK_SIZE 16..128 and pairs, and
windows at offsets; chunked and ``causal() | spans`` take the closed form."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import flexmask
from tests import oracle
from tests.strategies import span_ids

BLOCKS = [16, 32, 64, 128, (16, 64), (128, 32)]


def _ours(mask, B, H, q_len, kv_len, block, **offsets):
    return flexmask.create_block_mask(mask, B, H, q_len, kv_len, "cpu", block, **offsets)


def _window(dense, q_off, kv_off, q_len, kv_len):
    """(B, H, Q, KV) window of a whole dense mask at per-row offsets."""
    B = dense.shape[0]
    q_off = [q_off] * B if isinstance(q_off, int) else q_off
    kv_off = [kv_off] * B if isinstance(kv_off, int) else kv_off
    return np.stack(
        [dense[b, :, q_off[b] : q_off[b] + q_len, kv_off[b] : kv_off[b] + kv_len] for b in range(B)]
    )


def _no_tiles(monkeypatch):
    monkeypatch.setattr(
        "flexmask.builders.sides.classify_blocks",
        lambda *a: pytest.fail("the closed form must not classify tiles"),
    )


# ---------------------------------------------------------------------------------- chunked
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(("size", "q_len", "kv_len"), [(64, 300, 300), (50, 257, 190), (7, 1, 33)])
def test_chunked_equals_torch(size, q_len, kv_len, block):
    def chunk(b, h, q_idx, kv_idx):
        return q_idx // size == kv_idx // size

    def causal_chunk(b, h, q_idx, kv_idx):
        return chunk(b, h, q_idx, kv_idx) & (kv_idx <= q_idx)

    for mask, mod in (
        (flexmask.chunked(size), chunk),
        (flexmask.causal() & flexmask.chunked(size), causal_chunk),
    ):
        ours = _ours(mask, 2, 3, q_len, kv_len, block)
        oracle.assert_same_block_mask(
            ours, oracle.torch_build(mod, 2, 3, q_len, kv_len, block), repr(mask)
        )


@pytest.mark.parametrize("block", [16, 128, (32, 16)])
@pytest.mark.parametrize(("seq_len", "size"), [(300, 64), (200, 7), (129, 128)])
def test_chunked_equals_attn_gym_block_diagonal(seq_len, size, block):
    # attn-gym has no chunked mask of its own; block diffusion's noised half is one: its
    # "block diagonal" over positions [0, seq_len) is q // size == kv // size.
    from attn_gym.masks import generate_block_diffusion_mask

    reference = oracle.torch_build(
        generate_block_diffusion_mask(seq_len, size), 1, 2, seq_len, seq_len, block
    )
    ours = _ours(flexmask.chunked(size), 1, 2, seq_len, seq_len, block)
    oracle.assert_same_block_mask(ours, reference)


def test_chunked_per_row_sizes_and_offsets_take_the_closed_form(monkeypatch):
    sizes = [16, 100, 1 << 62]
    mask = flexmask.causal() & flexmask.chunked(sizes)
    whole = oracle.stack(
        [oracle.causal(600, 600) & oracle.chunked(min(s, 600), 600, 600) for s in sizes], heads=2
    )
    _no_tiles(monkeypatch)
    for q_off, kv_off in ((0, 0), (130, 7), ([0, 64, 300], [5, 0, 250])):
        ours = _ours(mask, 3, 2, 250, 300, 64, q_offset=q_off, kv_offset=kv_off)
        reference = oracle.torch_build(_window(whole, q_off, kv_off, 250, 300), block=64)
        oracle.assert_same_block_mask(ours, reference, f"offsets {q_off}, {kv_off}")


# ------------------------------------------------------------------------------------ spans
IDS = [-1] * 5 + [0] * 70 + [-1] * 30 + [1] * 20 + [2] * 100 + [-1] * 3 + [3] * 1


def _spans_mod(ids, length):
    table = torch.full((length + 1,), -1)
    table[: len(ids)] = torch.tensor(ids)

    def mod(b, h, q_idx, kv_idx):
        return (table[q_idx] == table[kv_idx]) & (table[q_idx] >= 0)

    return mod


@pytest.mark.parametrize("block", BLOCKS)
def test_spans_and_text_with_images_equal_torch(block):
    q_len = kv_len = len(IDS) + 11  # 240: not a multiple of any block but 16
    span = _spans_mod(IDS, kv_len)

    def text_images(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | span(b, h, q_idx, kv_idx)

    docs = [90, 60, 90]
    doc = oracle.document(docs, q_len, kv_len)

    def in_docs(b, h, q_idx, kv_idx):
        return text_images(b, h, q_idx, kv_idx) & torch.from_numpy(doc)[q_idx, kv_idx]

    cases = [
        (flexmask.spans(IDS), span),
        (flexmask.causal() | flexmask.spans(IDS), text_images),
        ((flexmask.causal() | flexmask.spans(IDS)) & flexmask.document(docs), in_docs),
    ]
    for mask, mod in cases:
        ours = _ours(mask, 2, 3, q_len, kv_len, block)
        oracle.assert_same_block_mask(
            ours, oracle.torch_build(mod, 2, 3, q_len, kv_len, block), repr(mask)
        )


def test_text_with_images_takes_the_closed_form_with_offsets(monkeypatch):
    rows = [IDS, [0] * 10 + [-1] * 200 + [1] * 30, [-1] * 240]
    docs = [[100, 140], [240], [1, 239]]
    mask = (flexmask.causal() | flexmask.spans(rows)) & flexmask.document(docs)
    whole = oracle.stack(
        [
            (oracle.causal(240, 240) | oracle.spans(ids, 240, 240)) & oracle.document(d, 240, 240)
            for ids, d in zip(rows, docs, strict=True)
        ],
        heads=2,
    )
    assert mask.has_monotone_intervals()
    _no_tiles(monkeypatch)
    for q_off, kv_off, q_len, kv_len in (
        (0, 0, 240, 240),
        (70, 3, 170, 237),
        ([0, 5, 9], [0, 64, 1], 231, 150),
    ):
        ours = _ours(mask, 3, 2, q_len, kv_len, (32, 16), q_offset=q_off, kv_offset=kv_off)
        reference = oracle.torch_build(_window(whole, q_off, kv_off, q_len, kv_len), block=(32, 16))
        oracle.assert_same_block_mask(ours, reference, f"offsets {q_off}, {kv_off}")


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    q_len=st.integers(1, 200),
    kv_len=st.integers(1, 200),
    block=st.sampled_from(BLOCKS),
)
def test_random_spans_equal_the_dense_oracle(data, q_len, kv_len, block):
    length = max(q_len, kv_len)
    ids = data.draw(span_ids(length))
    dense = oracle.spans(ids, q_len, kv_len)
    causal = oracle.causal(q_len, kv_len)
    for mask, ref in (
        (flexmask.spans(ids), dense),
        (flexmask.causal() | flexmask.spans(ids), dense | causal),
    ):
        ours = _ours(mask, 1, 2, q_len, kv_len, block)
        oracle.assert_same_block_mask(
            ours, oracle.torch_build(oracle.stack([ref], 2), block=block), repr(mask)
        )


def test_spans_ids_are_canonical_and_validated():
    assert flexmask.spans([0, 0, -1, 1]) == flexmask.spans([7, 7, -1, 3])
    assert flexmask.spans([0, 0, 1, 1]) != flexmask.spans([0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"ids\[2\] must be a span id >= 0, or -1"):
        flexmask.spans([0, 0, -2])
    with pytest.raises(ValueError, match="span 3 must be contiguous"):
        flexmask.spans([3, 3, -1, 3])
    with pytest.raises(ValueError, match=r"ids\[1\]: span 0 must be contiguous"):
        flexmask.spans([[0, 1], [0, 1, 0]])
    with pytest.raises(TypeError, match="ids"):
        flexmask.spans([0.5, 1.0])
    # More ids than the sequence: clipped, as every length past it (test_pieces_edges.py).


# --------------------------------------------------------------------------------- per_head
def test_per_head_equals_torch_for_every_head_and_group():
    window, docs = flexmask.sliding_window(40), flexmask.document([[100, 133], [33, 200]])
    masks = (flexmask.causal(), flexmask.causal() & window, ~docs, flexmask.causal())

    def mod(b, h, q_idx, kv_idx):
        seq = torch.tensor([[0] * 100 + [1] * 133, [0] * 33 + [1] * 200])
        same_doc = seq[b, q_idx] == seq[b, kv_idx]
        options = torch.stack(
            [
                kv_idx <= q_idx,
                (kv_idx <= q_idx) & ((q_idx - kv_idx).abs() < 40),
                ~same_doc,
                kv_idx <= q_idx,
            ]
        )
        return options[(h // 2) % 4]

    for block in (16, 64, (128, 32)):
        ours = _ours(flexmask.per_head(*masks, group_size=2), 2, 16, 233, 200, block)
        oracle.assert_same_block_mask(
            ours, oracle.torch_build(mod, 2, 16, 233, 200, block), f"{block}"
        )


def _stripes(b, h, q_idx, kv_idx):
    return (q_idx + kv_idx + h) % 3 != 0


def test_per_head_with_a_custom_leaf_offsets_and_pickle():
    # An undecided tile (from_mask_mod) is refined with the head's own mask; per-row offsets
    # take the row-by-row path. The whole mask, then its window, equal the oracle.
    custom = flexmask.from_mask_mod(_stripes, batch_dependent=False)
    mask = flexmask.per_head(flexmask.causal() | flexmask.spans([-1] * 9 + [0] * 50), custom)
    q = np.arange(300)[:, None]
    kv = np.arange(300)[None, :]
    text_images = oracle.causal(300, 300) | oracle.spans([-1] * 9 + [0] * 50, 300, 300)
    heads = [text_images if h % 2 == 0 else (q + kv + h) % 3 != 0 for h in range(4)]
    whole = np.stack([np.stack(heads)] * 2)
    for q_off, kv_off in ((0, 0), (17, 40), ([0, 100], [3, 0])):
        ours = _ours(mask, 2, 4, 150, 170, 32, q_offset=q_off, kv_offset=kv_off)
        reference = oracle.torch_build(_window(whole, q_off, kv_off, 150, 170), block=32)
        oracle.assert_same_block_mask(ours, reference, f"offsets {q_off}, {kv_off}")
    bm = _ours(mask, 2, 4, 150, 170, 32)
    again = pickle.loads(pickle.dumps(bm))
    args = [torch.arange(2).view(-1, 1, 1, 1), torch.arange(4).view(1, -1, 1, 1)]
    args += [torch.arange(150).view(1, 1, -1, 1), torch.arange(170).view(1, 1, 1, -1)]
    attends = again.mask_mod(*args).expand(2, 4, 150, 170)
    assert torch.equal(attends, torch.from_numpy(whole[:, :, :150, :170]))


def test_per_head_shares_distinct_masks_and_validates():
    a, b = flexmask.causal(), flexmask.chunked(8)
    assert flexmask.per_head(a, a, a) == a  # one mask for every head: broadcast, H = 1
    m = flexmask.per_head(a, b, a)
    assert len(m.distinct) == 2 and m.head_table.tolist() == [0, 1, 0]
    assert m != flexmask.per_head(b, a, a) and m == flexmask.per_head(a, b, a)
    bm = _ours(m, 1, 6, 64, 64, 16)
    assert bm.kv_num_blocks.shape == (1, 6, 4)
    assert m.show(3, head=4) == b.show(3) and m.show(3, head=5) == a.show(3)
    with pytest.raises(ValueError, match=r"H=4 must be a multiple of len\(masks\) \* group_size"):
        _ours(m, 1, 4, 64, 64, 16)
    with pytest.raises(ValueError, match="at least one mask"):
        flexmask.per_head()
    with pytest.raises(TypeError, match=r"masks\[1\] must be a flexmask Mask"):
        flexmask.per_head(a, lambda b, h, q, kv: q >= kv)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        flexmask.per_head(a, b, group_size=0)


def test_chunked_validates_size():
    with pytest.raises(ValueError, match="size must be >= 1"):
        flexmask.chunked(0)
    with pytest.raises(ValueError, match=r"size\[1\] must be >= 1"):
        flexmask.chunked([4, 0])
    with pytest.raises(TypeError, match="size"):
        flexmask.chunked(2.5)


# ---------------------------------------------------------------------------- no host sync
class _Syncs(TorchDispatchMode):
    """Records ops whose result needs the host to wait for the device (a scalar read, a
    data-dependent output shape)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNCING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "mask",
    [
        flexmask.causal() & flexmask.chunked([64, 100]),
        (flexmask.causal() | flexmask.spans([[0] * 10 + [-1] * 20 + [1] * 30, [-1] * 5 + [0] * 90]))
        & flexmask.document([[50, 200], [250]]),
    ],
    ids=["chunked", "causal|spans"],
)
@pytest.mark.parametrize(
    "offsets",
    [{}, {"q_offset": 13, "kv_offset": 2}, {"q_offset": [0, 40], "kv_offset": [5, 0]}],
    ids=["no offset", "offsets", "per-row offsets"],
)
def test_closed_form_of_the_new_pieces_makes_no_host_sync(mask, offsets, monkeypatch):
    # The pieces' data is validated when the mask is made; the build itself reads nothing
    # back from the device.
    _no_tiles(monkeypatch)
    with _Syncs() as mode:
        _ours(mask, 2, 1, 200, 250, 32, **offsets)
    assert mode.seen == []


def test_the_sync_detector_can_fail():
    with _Syncs() as mode:
        torch.tensor([3, 0]).nonzero()
        int(torch.tensor(2))
    assert len(mode.seen) == 2


@pytest.mark.parametrize(
    "mask",
    [
        flexmask.causal() & flexmask.chunked([64, 100]),
        (flexmask.causal() | flexmask.spans([[0] * 10 + [-1] * 20 + [1] * 30, [-1] * 5 + [0] * 90]))
        & flexmask.document([[50, 200], [250]]),
    ],
    ids=["chunked", "causal|spans"],
)
def test_closed_form_of_the_new_pieces_builds_on_a_device_with_no_values(mask):
    # "meta" tensors hold shapes only: a build that read any value would fail.
    meta = flexmask.create_block_mask(mask, 2, 3, 200, 250, "meta", 32, q_offset=[10, 40])
    cpu = flexmask.create_block_mask(mask, 2, 3, 200, 250, "cpu", 32, q_offset=[10, 40])
    for field in oracle.BLOCK_FIELDS:
        got, want = getattr(meta, field), getattr(cpu, field)
        assert got.device.type == "meta"
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())


def test_per_head_builds_each_distinct_mask_once_in_closed_form(monkeypatch):
    from flexmask.builders import closed_form

    local = flexmask.causal() & flexmask.chunked([48, 100])
    mask = flexmask.per_head(flexmask.causal(), local, local, flexmask.causal())
    built = []
    original = closed_form.ordered_sides

    def spy(part, grid, **kwargs):
        built.append(part)
        return original(part, grid, **kwargs)

    monkeypatch.setattr(closed_form, "ordered_sides", spy)
    _no_tiles(monkeypatch)
    ours = _ours(mask, 2, 8, 300, 270, (64, 32))
    assert built == [flexmask.causal(), local]
    rows = [oracle.causal(300, 270) & oracle.chunked(n, 300, 270) for n in (48, 100)]
    dense = np.stack(
        [[oracle.causal(300, 270) if h % 4 in (0, 3) else r for h in range(8)] for r in rows]
    )
    oracle.assert_same_block_mask(ours, oracle.torch_build(dense, block=(64, 32)))
