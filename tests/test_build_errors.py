"""Inputs that used to reach an obscure torch error now raise a ValueError/TypeError naming the
argument; valid inputs that used to be refused give what an independent reference gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import flexmask
import flexmask._validate
from flexmask.backends.block_sparse.api import block_sparse_attention
from tests import oracle


def causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def same_tensors(ours, theirs) -> None:
    assert ours.seq_lengths == theirs.seq_lengths
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.shape == b.shape, name
        assert a.equal(b), name


# --- meta tensors: no values to read -------------------------------------------------------


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: flexmask.document(torch.tensor([3, 2], device="meta")), "seq_lens"),
        (lambda: flexmask.spans(torch.tensor([0, 0, -1], device="meta")), "ids"),
        (
            lambda: flexmask.create_block_mask(
                flexmask.causal(), 1, 1, 16, 16, "cpu", q_offset=torch.tensor(3, device="meta")
            ),
            "q_offset",
        ),
        (
            lambda: flexmask.create_block_mask(
                flexmask.causal(), 1, 1, 16, 16, "cpu", kv_offset=torch.tensor([3], device="meta")
            ),
            "kv_offset",
        ),
    ],
)
def test_meta_tensor_data_is_named(make, name):
    with pytest.raises(ValueError, match=rf"{name}.* is a meta tensor"):
        make()


# --- mask_mods ------------------------------------------------------------------------------


def test_from_mask_mod_returning_a_python_bool():
    mask = flexmask.from_mask_mod(lambda b, h, q, kv: True, key="always")
    with pytest.raises(TypeError, match=r"mask_mod fn .* must return a bool tensor.*Python bool"):
        flexmask.create_block_mask(mask, 1, 1, 16, 16, "cpu")


def test_block_size_zero_with_a_plain_mask_mod():
    with pytest.raises(ValueError, match="BLOCK_SIZE must be >= 1, got 0"):
        flexmask.create_block_mask(causal_mod, 1, 1, 16, 16, "cpu", BLOCK_SIZE=0)


# --- sizes that cannot fit: refused before allocating -----------------------------------------


@pytest.mark.parametrize(
    "call, names",
    [
        (
            lambda: flexmask.create_block_mask(flexmask.causal(), 1, 1, 2**40, 2**40, "cpu"),
            ["Q_LEN=1099511627776", "KV_LEN=1099511627776"],
        ),
        (
            lambda: flexmask.create_block_mask(flexmask.causal(), 2**40, 2**40, 128, 128, "cpu"),
            ["B=1099511627776", "H=1099511627776"],
        ),
        (
            lambda: flexmask.create_block_mask(causal_mod, 1, 1, 128, 128, "cpu", BLOCK_SIZE=2**30),
            ["BLOCK_SIZE=(1073741824, 1073741824)"],
        ),
        (
            lambda: flexmask.lazy(flexmask.causal(), 1, 1, 2**40, 2**40, "cpu"),
            ["Q_LEN=1099511627776"],
        ),
        (
            lambda: flexmask.MaskCache().get(flexmask.causal(), 1, 1, 2**40, 2**40, "cpu"),
            ["Q_LEN=1099511627776"],
        ),
        (
            lambda: flexmask.decode_mask(flexmask.causal(), 2**62),
            ["capacity=4611686018427387905", "max(cache_lens)=4611686018427387904"],
        ),
        (
            lambda: flexmask.DecodeMasks(flexmask.causal(), [2**62], capacity=2**62 + 1),
            ["capacity=4611686018427387905"],
        ),
        (lambda: flexmask.speculative_tree(2**40, [-1, 0]), ["prefix_lens up to 1099511627776"]),
    ],
)
def test_sizes_that_cannot_fit(call, names):
    with pytest.raises(ValueError, match="would need .* bytes") as info:
        call()
    for name in names:
        assert name in str(info.value)


def test_block_size_past_the_memory_is_refused_and_one_that_fits_builds(monkeypatch):
    # 16 GiB of memory: a 2**30 block's queries (3 int64 values each, 24 GiB) cannot fit; a
    # block longer than the sequence that fits builds, equal to torch's.
    monkeypatch.setattr(flexmask._validate, "device_memory", lambda device: 16 << 30)
    with pytest.raises(ValueError, match=r"BLOCK_SIZE=\(1073741824, 1073741824\).*bytes"):
        flexmask.create_block_mask(flexmask.causal(), 1, 1, 128, 128, "cpu", BLOCK_SIZE=2**30)
    ours = flexmask.create_block_mask(flexmask.causal(), 2, 3, 200, 150, "cpu", BLOCK_SIZE=256)
    same_tensors(ours, torch_create_block_mask(causal_mod, 2, 3, 200, 150, "cpu", BLOCK_SIZE=256))


def test_memory_bound_refuses_only_past_it(monkeypatch):
    """The bound is all of the device's memory: a build needing less passes, more is refused."""
    args = (flexmask.causal(), 1, 1, 1024, 1024, "cpu")
    monkeypatch.setattr(flexmask._validate, "device_memory", lambda device: 10 << 20)
    same_tensors(
        flexmask.create_block_mask(*args),
        torch_create_block_mask(causal_mod, 1, 1, 1024, 1024, "cpu"),
    )
    monkeypatch.setattr(flexmask._validate, "device_memory", lambda device: 1000)
    with pytest.raises(
        ValueError, match=r"Q_LEN=1024.*would need .* bytes.* more than the 1000 bytes of memory"
    ):
        flexmask.create_block_mask(*args)


def test_window_past_int64_is_named():
    with pytest.raises(ValueError, match=r"q_offset=9223372036854775708 plus Q_LEN=128"):
        flexmask.create_block_mask(flexmask.causal(), 1, 1, 128, 128, "cpu", q_offset=2**63 - 100)
    with pytest.raises(ValueError, match=r"kv_offset=.* plus KV_LEN=16"):
        flexmask.create_block_mask(flexmask.causal(), 2, 1, 16, 16, "cpu", kv_offset=[0, 2**63 - 8])


# --- other call mistakes ----------------------------------------------------------------------


def test_release_after_a_non_module():
    handle = flexmask.lazy(flexmask.causal(), 1, 1, 16, 16, "cpu")
    with pytest.raises(TypeError, match=r"module must be a torch.nn.Module .*got str 'x'"):
        handle.release_after("x")


@pytest.mark.parametrize("block_mask", [None, "mask", "built"])
def test_flex_attention_without_heads_gives_the_empty_output(block_mask):
    """No heads is an empty output, as no batch row and no query are (torch's own
    flex_attention divides by the heads there); key and value without heads for a query with
    some are refused, naming them."""
    q = torch.randn(1, 0, 16, 8, requires_grad=True)
    given = {
        None: None,
        "mask": flexmask.causal(),
        "built": flexmask.create_block_mask(flexmask.causal(), 1, 1, 16, 16, "cpu"),
    }[block_mask]
    out, lse = flexmask.flex_attention(q, q, q, block_mask=given, compile=False, return_lse=True)
    assert out.shape == (1, 0, 16, 8) and lse.shape == (1, 0, 16)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    with pytest.raises(ValueError, match="key and value have no heads but query has 2") as info:
        flexmask.flex_attention(torch.randn(1, 2, 16, 8), q, q, block_mask=given, compile=False)
    assert "enable_gqa" not in str(info.value)


def test_plot_with_no_rows():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="Q_LEN must be >= 1, got 0"):
        flexmask.plot(flexmask.causal(), "unused.png", Q_LEN=0)
    empty = flexmask.create_block_mask(flexmask.causal(), 1, 1, 0, 16, "cpu")
    with pytest.raises(ValueError, match=r"\(Q_LEN, KV_LEN\) is \(0, 16\)"):
        flexmask.plot(empty, "unused.png")


# --- valid input, once refused ------------------------------------------------------------------


def _qkv(seed: int, b: int = 2, h: int = 2, n: int = 200, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3)]


def test_numpy_integer_knobs_equal_python_ints():
    q, k, v = _qkv(0)
    bm = torch_create_block_mask(causal_mod, 1, 1, 200, 200, "cpu", BLOCK_SIZE=64)
    plain = block_sparse_attention(q, k, v, bm, threads=2, memory_budget=1 << 16, backend="sparse")
    numpy = block_sparse_attention(
        q, k, v, bm, threads=np.int64(2), memory_budget=np.int32(1 << 16), backend="sparse"
    )
    assert numpy.equal(plain)
    torch.testing.assert_close(
        numpy, oracle.attention(q, k, v, torch.from_numpy(oracle.causal(200, 200)))[0]
    )


def test_flex_attention_passes_block_sparse_options_through():
    q, k, v = (t.requires_grad_() for t in _qkv(1))
    out = flexmask.flex_attention(
        q,
        k,
        v,
        block_mask=flexmask.causal(),
        threads=1,
        memory_budget=0,
        recompute=True,
        kernel="sparse",
    )
    bm = flexmask.create_block_mask(flexmask.causal(), 1, 1, 200, 200, "cpu")
    direct = block_sparse_attention(
        q, k, v, bm, threads=1, memory_budget=0, recompute=True, kernel="sparse"
    )
    assert out.equal(direct)
    torch.testing.assert_close(
        out, oracle.attention(q, k, v, torch.from_numpy(oracle.causal(200, 200)))[0]
    )
    # torch's kernel options tune its GPU kernels: on the CPU flexmask's backends run the
    # call and ignore them (torch's positional place for them, after return_lse).
    tuned = flexmask.flex_attention(
        q, k, v, None, flexmask.causal(), None, False, False, {"BLOCK_M": 64}
    )
    assert tuned.equal(flexmask.flex_attention(q, k, v, block_mask=flexmask.causal()))
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        flexmask.flex_attention(q, k, v, block_mask=flexmask.causal(), kernel_options=64)


@pytest.mark.parametrize("B, H", [(0, 2), (3, 0), (0, 0)])
def test_zero_rows_or_heads_give_torchs_empty_block_mask(B, H):
    mask = flexmask.causal() & flexmask.document([120, 80])
    ref = torch_create_block_mask(
        lambda b, h, q, kv: (q >= kv) & ((q < 120) == (kv < 120)), B, H, 200, 300, "cpu"
    )
    same_tensors(flexmask.create_block_mask(mask, B, H, 200, 300, "cpu"), ref)
    # The cache (and a handle, which builds through it) keeps a mask that ignores rows and
    # heads as (1, 1, ...), which flex_attention broadcasts: emptied where B or H is 0.
    reduced = torch_create_block_mask(
        lambda b, h, q, kv: (q >= kv) & ((q < 120) == (kv < 120)),
        min(B, 1),
        min(H, 1),
        200,
        300,
        "cpu",
    )
    same_tensors(flexmask.MaskCache().get(mask, B, H, 200, 300, "cpu"), reduced)
    same_tensors(flexmask.lazy(mask, B, H, 200, 300, "cpu").block_mask, reduced)


def test_zero_rows_attend_like_none_and_a_handle():
    q = torch.randn(0, 2, 16, 8)
    outs = [
        flexmask.flex_attention(q, q, q, block_mask=given, compile=False)
        for given in (
            None,
            flexmask.causal(),
            flexmask.lazy(flexmask.causal(), 0, 2, 16, 16, "cpu"),
        )
    ]
    reference = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    for out in outs:
        assert out.shape == reference.shape == (0, 2, 16, 8)


def test_zero_rows_with_per_row_data_name_b():
    with pytest.raises(ValueError, match="B=0 but the mask's data is given for 2 batch rows"):
        flexmask.create_block_mask(flexmask.document([[3, 2], [5]]), 0, 1, 5, 5, "cpu")


@pytest.mark.parametrize("backend", ["auto", "slices", "block_sparse", "sdpa"])
@pytest.mark.parametrize("made", ["handle", "block_mask"])
@pytest.mark.parametrize("lengths", [(300, 300), (200, 200), (256, 300), (300, 256)])
def test_a_block_mask_used_at_other_lengths_is_refused_as_torch_refuses(backend, made, lengths):
    """torch's flex_attention refuses a BlockMask built for other lengths than query's and
    key's; so does every backend here, the slices backend too (it lowers the Mask behind the
    BlockMask, and once lowered it for the tensors' lengths: a silently different mask)."""
    mask = flexmask.causal() & flexmask.document([100, 156])
    built = flexmask.create_block_mask(mask, 1, 1, 256, 256, device="cpu")
    given = flexmask.lazy(mask, 1, 1, 256, 256, "cpu") if made == "handle" else built
    q0, k0 = torch.randn(1, 1, lengths[0], 8), torch.randn(1, 1, lengths[1], 8)
    # torch's own refusal: a ValueError in 2.13, a RuntimeError in 2.14
    with pytest.raises((ValueError, RuntimeError), match="block_mask was created for"):
        torch_flex_attention(q0, k0, k0, block_mask=built)
    q = torch.randn(1, 1, lengths[0], 8, requires_grad=True)
    k = torch.randn(1, 1, lengths[1], 8)
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\)=\(256, 256\)"):
        flexmask.attention(q, k, k, given, backend)
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\)=\(256, 256\)"):
        flexmask.flex_attention(q, k, k, block_mask=given)
    assert not getattr(given, "built", False)
