"""Smoke test of an installed wheel: every public name of flexmask, in an environment that holds
only the declared dependencies, run from outside the repository.

Usage (what .ci/run does): build the wheel, install it into a fresh virtual environment, then
``cd`` somewhere else and run ``python /path/to/.ci/smoke.py``. Each exercise checks its result
against an independent reference (torch's create_block_mask on a plain mask_mod, SDPA on a
dense mask, plain Python), not only that it runs. A name added to ``flexmask.__all__`` without
an exercise here fails the run.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexmask

S = 96


def dense_of(mask_mod: Callable, rows: int = 1) -> torch.Tensor:
    """(rows, 1, S, S) bool from a mask_mod, one element at a time: the plain reference."""
    out = torch.zeros(rows, 1, S, S, dtype=torch.bool)
    for b in range(rows):
        for q in range(S):
            for kv in range(S):
                out[b, 0, q, kv] = bool(mask_mod(b, 0, q, kv))
    return out


def doc_of(lens: list[int]) -> list[int]:
    return [d for d, n in enumerate(lens) for _ in range(n)] + [-1] * (S - sum(lens))


def check_mask(mask: flexmask.Mask, reference: Callable, rows: int = 1) -> None:
    assert torch.equal(mask.to_dense(rows, 1, S, S), dense_of(reference, rows)), mask
    ours = flexmask.create_block_mask(mask, rows, 1, S, S, device="cpu", BLOCK_SIZE=32)
    table = dense_of(reference, rows)
    theirs = torch_create_block_mask(
        lambda b, h, q, kv: table[b, 0, q, kv], rows, 1, S, S, device="cpu", BLOCK_SIZE=32
    )
    assert flexmask.same_blocks(ours, theirs), mask


def masks() -> None:
    docs = doc_of([40, 30, 20])
    check_mask(flexmask.causal(), lambda b, h, q, kv: kv <= q)
    check_mask(
        flexmask.document([40, 30, 20]), lambda b, h, q, kv: docs[q] == docs[kv] and docs[q] >= 0
    )
    parents = [-1, 0, 1, 1, 0, 4]

    def ancestor(q: int, kv: int) -> bool:
        while q != -1:
            if q == kv:
                return True
            q = parents[q] if q < len(parents) else -1
        return False

    check_mask(flexmask.tree(parents), lambda b, h, q, kv: q < len(parents) and ancestor(q, kv))
    lens = [50, 96]
    check_mask(flexmask.padding(lens), lambda b, h, q, kv: q < lens[b] and kv < lens[b], rows=2)
    check_mask(flexmask.sliding_window(8), lambda b, h, q, kv: abs(q - kv) < 8)
    check_mask(flexmask.prefix(10), lambda b, h, q, kv: kv < 10)
    check_mask(flexmask.full(), lambda b, h, q, kv: True)
    check_mask(
        flexmask.chunked(20) & flexmask.causal(),
        lambda b, h, q, kv: q // 20 == kv // 20 and kv <= q,
    )
    image = [-1] * 10 + [0] * 16 + [-1] * 30 + [1] * 8 + [-1] * 32  # two bidirectional spans
    check_mask(
        flexmask.causal() | flexmask.spans(image),
        lambda b, h, q, kv: kv <= q or (image[q] >= 0 and image[q] == image[kv]),
    )
    # Router-picked key tiles (NSA's selected blocks), per row, tiles unlike the blocks.
    picks = [([[0, -1], [0, 2], [1, 1]] * 5)[:14], ([[3, 3], [-1, -1], [0, 4]] * 5)[:14]]
    check_mask(
        flexmask.causal() & flexmask.selected(picks, tile=(7, 20)),
        lambda b, h, q, kv: kv <= q and kv // 20 in picks[b][q // 7],
        rows=2,
    )
    # A mask per head: heads 0 and 2 causal, 1 and 3 a window of 8 (H a multiple of 2).
    heads = flexmask.per_head(flexmask.causal(), flexmask.causal() & flexmask.sliding_window(8))
    bm = flexmask.create_block_mask(heads, 1, 4, S, S, device="cpu", BLOCK_SIZE=32)
    for h, reference in enumerate(
        [flexmask.causal(), flexmask.causal() & flexmask.sliding_window(8)] * 2
    ):
        one = flexmask.create_block_mask(reference, 1, 1, S, S, device="cpu", BLOCK_SIZE=32)
        assert torch.equal(bm.kv_indices[:, h : h + 1], one.kv_indices), h
        assert torch.equal(heads.to_dense(1, 4, S, S)[:, h], reference.to_dense(1, 1, S, S)[:, 0])
    check_mask(flexmask.empty(), lambda b, h, q, kv: False)
    check_mask(
        flexmask.from_mask_mod(
            lambda b, h, q, kv: (q // 16) == (kv // 16),
            key=("blocks", 16),
            batch_dependent=False,
            head_dependent=False,
        ),
        lambda b, h, q, kv: q // 16 == kv // 16,
    )
    a, b = flexmask.causal(), flexmask.prefix(10)
    assert isinstance(a & b, flexmask.And) and isinstance(a | b, flexmask.Or)
    assert isinstance(~a, flexmask.Not) and isinstance(a, flexmask.Mask)
    check_mask(
        ~(a & b) | flexmask.prefix(3), lambda b_, h, q, kv: not (kv <= q and kv < 10) or kv < 3
    )


def attention_and_handles() -> None:
    mask = flexmask.causal() & flexmask.document([40, 56])
    q, k, v = (torch.randn(1, 2, S, 8) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.to_dense(1, 1, S, S)
    )
    cache = flexmask.MaskCache(maxsize=4)
    handle = flexmask.lazy(mask, 1, 2, S, S, "cpu", 32, cache=cache)
    assert isinstance(handle, flexmask.LazyBlockMask) and not handle.built
    assert pickle.loads(pickle.dumps(handle)).mask == mask
    flexmask.set_compile(False)
    assert not flexmask.compile_enabled()
    with handle:
        out = flexmask.flex_attention(q, k, v, block_mask=handle)  # slices: builds nothing
        assert not handle.built
        by_blocks = flexmask.attention(q, k, v, handle, "block_sparse")  # reads the BlockMask
        assert handle.built
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_blocks, reference, atol=1e-5, rtol=1e-5)
    flexmask.set_compile(None)
    info = cache.info()
    assert isinstance(info, flexmask.CacheInfo) and (info.misses, info.discarded) == (1, 1)
    flexmask.cache_clear()
    flexmask.default_cache().get(flexmask.causal(), 1, 1, S, S, "cpu")
    assert flexmask.cache_info().misses == 1 and "MaskCache(" in repr(flexmask.default_cache())


def packing() -> None:
    sequences = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [1, 2, 5]]
    batch = flexmask.pack(sequences, max_len=6)
    assert isinstance(batch, flexmask.packing.PackedBatch)
    assert sorted(n for row in batch.seq_lens for n in row) == [2, 3, 3, 4]
    assert batch.mask.to_dense(batch.num_rows, 1, 6, 6).any()  # the digest path: no numpy
    assert [t.tolist() for t in batch.unpack(batch.tokens)] == sequences
    tp = flexmask.pack_one_tree(sequences)
    assert isinstance(tp, flexmask.packing.TreePack) and tp.num_tokens == 10  # [1, 2] shared
    assert tp.mask.to_dense(1, 1, 10, 10)[0, 0].sum() > 0
    collated = flexmask.PackingCollator(max_len=6, device="cuda")(sequences)  # nothing built
    assert not collated.handle.built and collated.handle.device == torch.device("cuda")
    streamed = list(flexmask.PackedDataset(sequences, max_len=6, buffer_size=2))
    assert sum(len(b.placement) for b in streamed) == len(sequences)


def windows_and_decoding() -> None:
    # A window of a mask (q_offset/kv_offset) equals torch's build of the shifted mask_mod.
    docs = doc_of([40, 30, 20])

    def shifted(b, h, q, kv):
        return (kv + 8 <= q + 32) & (torch.tensor(docs)[q + 32] == torch.tensor(docs)[kv + 8])

    mask = flexmask.causal() & flexmask.document([40, 30, 20])
    ours = flexmask.create_block_mask(mask, 1, 1, 48, 88, "cpu", 16, q_offset=32, kv_offset=8)
    theirs = torch_create_block_mask(shifted, 1, 1, 48, 88, "cpu", BLOCK_SIZE=16)
    assert flexmask.same_blocks(ours, theirs) and torch.equal(ours.kv_indices, theirs.kv_indices)
    # Decode: new queries at each row's cache length see the whole cache, causally.
    bm = flexmask.decode_mask(flexmask.causal(), [40, 7], q_len=1, capacity=S, block_size=32)
    assert bm.kv_num_blocks[:, 0, 0].tolist() == [2, 1]
    steps = flexmask.DecodeMasks(flexmask.causal(), [31, 3], capacity=S, block_size=32)
    assert steps.block_mask.kv_num_blocks[:, 0, 0].tolist() == [1, 1]  # queries at 31 and 3
    assert steps.advance().kv_num_blocks[:, 0, 0].tolist() == [2, 1]  # at 32: a new block
    step = steps.at([64, 5])  # queries at 64 and 5, wherever the loop stands
    assert isinstance(step, flexmask.DecodeStep) and step.cache_lens == [64, 5]
    assert step.block_mask.kv_num_blocks[:, 0, 0].tolist() == [3, 1]
    draft = flexmask.speculative_tree(3, [-1, 0, 0])  # prefix of 3, then a root and 2 children
    dense = draft.to_dense(1, 1, 6, 6)[0, 0]
    assert dense[5].tolist() == [True, True, True, True, False, True]  # not its sibling


def formats_and_backends() -> None:
    # Two causal documents, [0, 40) and [40, 96): each format as its own docs define it.
    mask = flexmask.causal() & flexmask.document([40, 56])
    varlen = flexmask.to_varlen(mask, 1, S)
    assert isinstance(varlen, flexmask.VarlenMask) and varlen.causal
    assert varlen.cu_seqlens_q.tolist() == varlen.cu_seqlens_k.tolist() == [0, 40, 96]
    flash = flexmask.to_flashmask(mask, 1, 1, S, S)  # causal: rows >= LTS[j] masked in column j
    assert isinstance(flash, flexmask.FlashMask) and flash.causal
    assert flash.startend_row_indices[0, 0, :, 0].tolist() == [40] * 40 + [96] * 56
    magi = flexmask.to_magi(mask, 1, S, S)  # one causal slice per document
    assert isinstance(magi, flexmask.MagiMask)
    assert magi.q_ranges.tolist() == magi.k_ranges.tolist() == [[0, 40], [40, 96]]
    assert magi.attn_type_map.tolist() == [1, 1]
    q, k, v = (torch.randn(1, 2, S, 8) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_of(lambda b, h, qi, kv: kv <= qi and (kv < 40) == (qi < 40))
    )
    out = flexmask.attention(q, k, v, mask, backend="auto")
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    choice = flexmask.explain(q, k, v, mask)
    assert "varlen" in repr(choice) and "CUDA" in repr(choice)  # refused here, and why
    # A mask saved and loaded with torch.load's default weights_only=True.
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mask.pt"
        torch.save(mask, path)
        with torch.serialization.safe_globals(flexmask.safe_globals()):
            assert torch.load(path) == mask


def batch_checks() -> None:
    # A packed batch agrees with itself; the same tokens with positions that never restart
    # (dropped position_ids) are named, row and token.
    packed = flexmask.pack([[1, 2, 3], [4, 5, 6, 7], [8, 9]], max_len=10)
    report = flexmask.check_batch(batch=packed)
    assert isinstance(report, flexmask.BatchReport) and report.ok, report
    flat = torch.arange(packed.tokens.shape[1]).expand_as(packed.tokens)
    report = flexmask.check_batch(batch=packed, position_ids=flat)
    assert not report.ok and report.first is not None, report
    try:
        flexmask.check_batch(batch=packed, position_ids=flat, raise_on_error=True)
    except ValueError as err:
        assert "position" in str(err), err
    else:
        raise AssertionError("check_batch(raise_on_error=True) did not raise")


def fa4_lowering() -> None:
    # FlashAttention-4's block-sparse arguments for causal documents, blocks (32, 16): full
    # tiles listed full, diagonal tiles partial, nothing above the diagonal.
    mask = flexmask.causal() & flexmask.document([40, 56])
    fa4 = flexmask.to_fa4(mask, 1, 1, S, S, q_block=32, kv_block=16)
    assert isinstance(fa4, flexmask.FA4Mask)
    built = flexmask.create_block_mask(mask, 1, 1, S, S, "cpu", BLOCK_SIZE=(32, 16))
    assert fa4.mask_block_cnt.tolist() == built.kv_num_blocks.tolist()
    assert fa4.full_block_cnt.tolist() == built.full_kv_num_blocks.tolist()
    # Compact indices: as long as the longest list. Varlen: one grid per document, FA4's
    # cu_* tensors. FlashInfer: causal documents on block edges, one BSR row per KV head.
    compact = flexmask.to_fa4(mask, 1, 1, S, S, q_block=32, kv_block=16, compact=True)
    assert compact.mask_block_idx.shape[-1] == int(compact.mask_block_cnt.max())
    varlen = flexmask.formats.to_fa4_varlen(mask, 1, 2, S, q_block=32, kv_block=16)
    assert varlen.cu_seqlens_q.tolist() == [0, 40, 96], varlen
    assert varlen.cu_total_m_blocks.tolist() == [0, 2, 4], varlen
    aligned = flexmask.causal() & flexmask.document([32, 64])
    fi = flexmask.formats.to_flashinfer(aligned, 1, 4, S, q_block=16, kv_block=16, num_kv_heads=2)
    assert fi.mask_type == "causal" and tuple(fi.block_indptr.shape) == (1, 2, S // 16 + 1), fi


def context_parallel() -> None:
    W, L = 2, S
    mask = flexmask.causal() & flexmask.document([50, 46])
    whole = mask.to_dense(1, 1, L, L)[0, 0]
    cache = flexmask.ShardCache(maxsize=4)
    for balancer in ("head_tail", flexmask.HeadTailBalancer(L, W)):
        for rank in range(W):
            part = flexmask.shard(
                mask,
                1,
                1,
                L,
                world_size=W,
                rank=rank,
                balancer=balancer,
                BLOCK_SIZE=16,
                device="cpu",
                cache=cache,
            )
            assert isinstance(part, flexmask.CPShard)
            order = part.indices[0]
            rows = order[part.local]
            expected = whole[rows][:, order]  # this rank's rows, keys in the permuted order
            got = torch.nn.attention.flex_attention.create_mask(
                part.block_mask.mask_mod, 1, 1, len(rows), L, "cpu"
            )[0, 0]
            assert torch.equal(got, expected)
    assert flexmask.lazy_shard(mask, 1, 1, L, cache=cache, world_size=W, rank=0, BLOCK_SIZE=16)
    per_doc = flexmask.PerDocumentBalancer([[48, 48]], W)
    assert sorted(per_doc._generate_indices()[0].tolist()) == list(range(L))
    aware = flexmask.MaskAwareBalancer(mask, 1, 1, L, W, block_size=16)
    assert aware.imbalance >= 1.0
    # One permutation for a step of several masks, each weighed by its layers.
    hybrid = flexmask.LayerWeightedBalancer(
        [(mask, 1), (mask & flexmask.sliding_window(16), 3)], 1, 1, L, W, block_size=16
    )
    assert sorted(hybrid._generate_indices()[0].tolist()) == list(range(L))
    assert 1.0 <= hybrid.imbalance <= hybrid.synced_imbalance
    # PTRR: q blocks by their non-empty kv blocks, heaviest first, dealt in rounds of
    # alternating direction; each rank's blocks ascending (torch's _PTRRLoadBalancer).
    ptrr = flexmask.PTRRBalancer(mask, 1, 1, L, W, block_size=16)
    counts = whole.view(L // 16, 16, L // 16, 16).any(3).any(1).sum(1).tolist()
    ranks: list[list[int]] = [[] for _ in range(W)]
    for n, block in enumerate(sorted(range(len(counts)), key=lambda i: -counts[i])):
        turn, slot = divmod(n, W)
        ranks[slot if turn % 2 == 0 else W - 1 - slot].append(block)
    dealt = [t for r in ranks for block in sorted(r) for t in range(block * 16, block * 16 + 16)]
    assert ptrr._generate_indices()[0].tolist() == dealt
    # cp_flex_attention on a one-process gloo group equals plain attention.
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            one = flexmask.shard(
                mask, 1, 1, L, world_size=1, rank=0, balancer=None, BLOCK_SIZE=16, device="cpu"
            )
            q, k, v = (torch.randn(1, 2, L, 8) for _ in range(3))
            out = flexmask.cp_flex_attention(q, k, v, one, compile=False)
            reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=whole)
            torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
        finally:
            dist.destroy_process_group()


def rl_trees() -> None:
    # Four sequences sharing a prompt [1, 2] (one empty) in one tree of 8 tokens; each
    # sequence's completion log-probs equal those gathered from the tree's logits by hand.
    seqs = [[1, 2, 3, 4], [1, 2, 5], [], [1, 2, 6, 7, 8]]
    batch = flexmask.pack_tree_batch(seqs, max_tokens=8, prompt_lens=[2, 2, 0, 2])
    assert isinstance(batch, flexmask.packing.TreeBatch) and batch.saved_tokens == 4
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    logits = torch.randn(batch.num_rows, 8, 10)
    got = batch.log_probs(logits)
    assert isinstance(got, flexmask.packing.SequenceLogProbs)
    log_softmax = logits[0].log_softmax(-1)
    # Sequence 3 is tokens 0, 1, 5, 6, 7 of the tree: completion 6, 7, 8 predicted at 1, 5, 6.
    expected = log_softmax[[1, 5, 6], [6, 7, 8]]
    torch.testing.assert_close(got.log_probs[3][got.mask[3]], expected)
    assert not got.mask[2].any()  # the empty sequence: a zero row


def builds_seen_into() -> None:
    # A BlockMask with one block moved: diff names that block against the Mask it should
    # mean; explain_build names the builder that ran.
    mask = flexmask.causal() & flexmask.document([40, 24])
    bm = flexmask.create_block_mask(mask, 1, 1, S, S, "cpu", BLOCK_SIZE=16)
    assert flexmask.diff(bm, mask) is None
    edited = flexmask.create_block_mask(flexmask.causal(), 1, 1, S, S, "cpu", BLOCK_SIZE=16)
    found = flexmask.diff(edited, mask)
    assert found is not None and "block" in str(found), found
    report = flexmask.explain_build(mask, 1, 1, S, S, "cpu", 16)
    assert "closed form" in str(report), report


def plotting() -> None:
    if importlib.util.find_spec("matplotlib") is None:  # an optional extra: a clear error
        try:
            flexmask.plot(flexmask.causal(), "never.png", Q_LEN=S)
        except ImportError as err:
            assert "pip install flexmask[plot]" in str(err), err
            return
        raise AssertionError("plot without matplotlib must raise ImportError")
    with tempfile.TemporaryDirectory() as tmp:
        png = flexmask.plot(flexmask.causal(), Path(tmp) / "m.png", Q_LEN=S)
        assert Path(png).stat().st_size > 0


def cudnn_lowerings() -> None:
    # cuDNN's formats (flexmask.formats): flex_attention's interval endpoints, BSA's block
    # lists and sparse_attention's top-k entries, each read back against the mask.
    from flexmask.formats import CudnnMask, to_cudnn, to_cudnn_bsa, to_cudnn_topk

    mask = flexmask.causal() & flexmask.document([40, 56])
    dense = mask.to_dense(1, 1, S, S)[0, 0]
    c = to_cudnn(mask, 1, 1, S)
    assert isinstance(c, CudnnMask) and c.n_func == 3, c
    f = c.mask_func[0]
    keys = torch.arange(S)
    seen = (keys < f[0, :, None]) | ((keys >= f[1, :, None]) & (keys < f[2, :, None]))
    assert torch.equal(seen, dense)
    blocks = to_cudnn_bsa(flexmask.document([64, 64]), 1, 1, 128, block_size=64)
    assert blocks.q2k_block_index[0, 0, :, 0].tolist() == [0, 1]
    top = to_cudnn_topk(mask, 1, 1, S)
    assert int(top.topk_length.sum()) == int(dense.sum())


EXERCISES: dict[Callable[[], None], set[str]] = {
    masks: {
        "causal", "document", "tree", "padding", "sliding_window", "prefix", "full", "empty",
        "from_mask_mod", "create_block_mask", "same_blocks", "And", "Or", "Not", "Mask",
        "chunked", "spans", "per_head", "selected",
    },
    attention_and_handles: {
        "lazy", "LazyBlockMask", "flex_attention", "set_compile", "compile_enabled",
        "MaskCache", "CacheInfo", "cache_clear", "cache_info", "default_cache",
    },
    packing: {
        "pack", "pack_one_tree", "pack_tree", "PackedBatch", "TreePack", "PackingCollator",
        "PackedDataset",
    },
    builds_seen_into: {"diff", "explain_build"},
    plotting: {"plot"},
    rl_trees: {"pack_tree_batch", "pack_trees", "TreeBatch", "SequenceLogProbs"},
    windows_and_decoding: {"decode_mask", "DecodeMasks", "DecodeStep", "speculative_tree"},
    batch_checks: {"check_batch", "BatchReport"},
    fa4_lowering: {"to_fa4", "FA4Mask"},
    cudnn_lowerings: {"to_cudnn", "CudnnMask", "to_cudnn_bsa", "to_cudnn_topk"},
    formats_and_backends: {
        "to_varlen", "VarlenMask", "to_flashmask", "FlashMask", "to_magi", "MagiMask",
        "attention", "explain", "safe_globals",
    },
    context_parallel: {
        "shard", "CPShard", "ShardCache", "lazy_shard", "cp_flex_attention",
        "HeadTailBalancer", "PerDocumentBalancer", "MaskAwareBalancer", "PTRRBalancer",
        "LayerWeightedBalancer",
    },
}  # fmt: skip


def main() -> None:
    here = Path.cwd().resolve()
    installed = Path(flexmask.__file__).resolve().parent
    assert "site-packages" in installed.parts, f"flexmask comes from {installed}, not a wheel"
    assert not (here / "flexmask").exists(), "run from outside the repository"
    assert (installed / "py.typed").is_file(), "py.typed is not shipped"
    # Only the declared dependencies: numpy is not one of them.
    assert importlib.util.find_spec("numpy") is None, "numpy is installed: not a clean env"
    covered = set().union(*EXERCISES.values())
    missing = set(flexmask.__all__) - covered
    assert not missing, f"public names without a smoke exercise: {sorted(missing)}"
    for exercise in EXERCISES:
        exercise()
        print(f"ok  {exercise.__name__:<22} {', '.join(sorted(EXERCISES[exercise]))}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(
        f"smoke: {len(covered)} public names ok, flexmask {flexmask.__version__} from {installed}"
    )


if __name__ == "__main__":
    sys.exit(main())
