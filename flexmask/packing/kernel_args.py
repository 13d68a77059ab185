"""What a kernel is handed, against the mask the batch means: a BlockMask, a dense 4-D mask,
varlen (``cu_seqlens``), FlashMask and Magi arguments — each read as the kernel reads it
(its documented rule), compared exactly on every real query row
(:mod:`flexmask.packing.compare`), the first differing pair named.

Common forms cost little: a lazy handle is compared by its mask (never built), varlen and
Magi arguments made of whole documents become ``document`` masks compared by their
documents. A BlockMask is read on its partial blocks; other forms element by element.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexmask.algebra import Mask
from flexmask.formats import FlashMask, MagiMask, VarlenMask
from flexmask.packing import compare, format_args, segments
from flexmask.packing.kernel_masks import compare_masks, documents_mask, report
from flexmask.packing.segments import Claim, Disagreement
from flexmask.pieces import document
from flexmask.runtime import LazyBlockMask

KERNEL_BLOCKS = {"flex": 128, "flexmask": 1}
"""The block sizes a kernel takes: multiples of this. torch's Triton kernel (``"flex"``)
tiles a BlockMask's blocks by its default configs' BLOCK_M/BLOCK_N, up to 128 on every GPU
and dtype; flexmask's CPU backends take any."""


def batch_shape(value: Any) -> tuple[int, int]:
    """``(B, S)`` of a BlockMask, handle or 4-D mask."""
    if isinstance(value, LazyBlockMask):
        return value.B, value.Q_LEN
    if isinstance(value, BlockMask):
        return int(value.shape[0]), int(value.seq_lengths[0])
    return int(value.shape[0]), int(value.shape[-2])


def check_mask(
    mask: Mask,
    name: str,
    start: Tensor,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Disagreement],
    claims: list[Claim],
    derived: bool = False,
) -> None:
    """The batch's own mask: it keeps the documents apart (checked against them when it has
    no ``document`` of its own, unless ``derived`` from them) and gives every real token
    something to attend."""
    batch, seq_len = shape
    device = mask.device or torch.device("cpu")
    own_documents = derived or any(c.name == f"{name}'s documents" for c in claims)
    several = bool((start.sum(1) > 1).any()) or not bool(real.all())
    side = compare.mask_side(mask, batch, seq_len, (128, 128), device)
    if not own_documents and several and any(c.start is not None for c in claims):
        kept = compare.mask_side(
            mask & document(segments.runs(start, real)), batch, seq_len, (128, 128), device
        )
        found = compare.first_difference(kept, side, batch, seq_len, real, device)
        if found is not None:
            issues.append(
                Disagreement(
                    found.row,
                    found.q,
                    (name, "the documents"),
                    f"{name} lets token {found.q} attend token {found.kv}, which is "
                    + ("padding" if not bool(real[found.row, found.kv]) else "another document"),
                )
            )
    empty = compare.empty_rows(side, batch, seq_len, real, device)
    if empty is not None:
        b, q = empty
        issues.append(
            Disagreement(
                b,
                q,
                (name,),
                f"{name} lets token {q}, a real token, attend nothing: its output is 0 and it "
                f"learns nothing",
            )
        )


def check(
    name: str,
    value: Any,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    given: dict[str, Any],
    issues: list[Disagreement],
) -> None:
    """One kernel argument against the mask."""
    if isinstance(value, (LazyBlockMask, BlockMask)):
        _block_mask(name, value, mask, mask_name, real, shape, given["kernel"], issues)
    elif isinstance(value, Tensor) and value.dim() == 4:
        _dense(name, value, mask, mask_name, real, shape, issues)
    elif isinstance(value, VarlenMask):
        format_args.check_varlen(name, value, mask, mask_name, real, shape, issues)
    elif isinstance(value, FlashMask):
        format_args.check_flashmask(name, value, mask, mask_name, real, shape, issues)
    elif isinstance(value, MagiMask):
        format_args.check_magi(name, value, mask, mask_name, real, shape, issues)
    else:
        raise TypeError(f"{name} cannot be a {type(value).__name__}")


def check_cu_seqlens(
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    given: dict[str, Any],
    issues: list[Disagreement],
) -> None:
    """``cu_seqlens`` under a varlen kernel that is causal (or not) with a window: what it
    attends inside each sequence, against the mask."""
    batch, seq_len = shape
    claim, _ = segments.from_cu_seqlens(
        given["cu_seqlens"], given["cu_seqlens_padded"], shape, None
    )
    assert claim.start is not None and claim.real is not None
    kernel = documents_mask(
        claim.start, claim.real, bool(given["causal_kernel"]), given["window_size"], real
    )
    if kernel is None:
        raise ValueError(
            f"window_size={given['window_size']} is not (left, 0) under a causal kernel nor "
            f"(w, w): flexmask reads only those"
        )
    compare_masks("cu_seqlens", kernel, mask, mask_name, real, shape, issues)


# ---------------------------------------------------------------------- BlockMask and dense
def _block_mask(
    name: str,
    value: BlockMask | LazyBlockMask,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    kernel: str | None,
    issues: list[Disagreement],
) -> None:
    batch, seq_len = shape
    if isinstance(value, LazyBlockMask):
        block = _pair(value.BLOCK_SIZE)
        lengths = (value.Q_LEN, value.KV_LEN)
        rows = value.B
    else:
        block = _pair(value.BLOCK_SIZE)
        lengths = (int(value.seq_lengths[0]), int(value.seq_lengths[1]))
        rows = int(value.shape[0])
    if lengths != (seq_len, seq_len):
        issues.append(
            Disagreement(
                0,
                min(lengths[0], lengths[1], seq_len),
                (name, "the batch"),
                f"{name} was built for Q_LEN={lengths[0]}, KV_LEN={lengths[1]}, but the batch "
                f"has {seq_len} tokens per row",
            )
        )
        return
    if rows not in (1, batch):
        issues.append(
            Disagreement(
                0, 0, (name, "the batch"), f"{name} has {rows} rows, the batch has {batch}"
            )
        )
        return
    if kernel is not None:
        if kernel not in KERNEL_BLOCKS:
            raise ValueError(f"kernel must be one of {sorted(KERNEL_BLOCKS)}, got {kernel!r}")
        multiple = KERNEL_BLOCKS[kernel]
        if block[0] % multiple or block[1] % multiple:
            issues.append(
                Disagreement(
                    0,
                    0,
                    (name, f"kernel {kernel!r}"),
                    f"{name} has BLOCK_SIZE={block}; kernel {kernel!r} takes multiples of "
                    f"{multiple}",
                )
            )
    if isinstance(value, LazyBlockMask):
        # A handle builds its mask exactly: compare the masks, nothing to build or read.
        if value.mask != mask:
            compare_masks(name, value.mask, mask, mask_name, real, shape, issues)
        return
    device = value.kv_num_blocks.device
    got = compare.block_mask_side(value)
    expected = compare.mask_side(mask, batch, seq_len, block, device)
    report(
        name,
        compare.first_difference(expected, got, batch, seq_len, real, device),
        mask_name,
        issues,
    )
    # The backward reads the other side (dK and dV walk the q blocks of each kv block): a
    # q side that lists other tiles than the kv side trains on other pairs than the forward
    # attends. One equal to the kv side is covered by the comparison above.
    q_side = compare.block_mask_q_side(value)
    if q_side is None or (
        q_side.codes is not None and got.codes is not None and torch.equal(q_side.codes, got.codes)
    ):
        return
    found = compare.first_difference(expected, q_side, batch, seq_len, real, device)
    if found is not None:
        report(f"{name}'s q side", found, mask_name, issues)
        issue = issues[-1]
        issues[-1] = issue._replace(
            message=issue.message
            + f" (its q side, q_num_blocks/q_indices and full_q_*, is what torch's backward "
            f"reads for dK and dV; it lists other tiles than {name}'s kv side: rebuild it "
            f"from the kv side with BlockMask.from_kv_blocks)"
        )


def _dense(
    name: str,
    value: Tensor,
    mask: Mask,
    mask_name: str,
    real: Tensor,
    shape: tuple[int, int],
    issues: list[Disagreement],
) -> None:
    batch, seq_len = shape
    if value.shape[-2:] != (seq_len, seq_len) or value.shape[0] not in (1, batch):
        issues.append(
            Disagreement(
                0,
                0,
                (name, "the batch"),
                f"{name} has shape {tuple(value.shape)}, not (B, 1 or H, S, S) = ({batch}, 1, "
                f"{seq_len}, {seq_len})",
            )
        )
        return
    attends = _dense_attends(name, value)
    rows, heads = attends.shape[0], attends.shape[1]

    def rule(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return attends[b.clamp(max=rows - 1), h.clamp(max=heads - 1), q, kv]

    side = compare.Side(None, rule, (128, 128), heads)
    device = value.device
    expected = compare.mask_side(mask, batch, seq_len, (128, 128), device)
    report(
        name,
        compare.first_difference(expected, side, batch, seq_len, real.to(device), device),
        mask_name,
        issues,
    )


ADDITIVE_MASKED_AT = -1000.0
"""An additive float mask masks a pair whose value is at or below this. transformers writes
masked pairs as ``torch.finfo(dtype).min`` and, in its legacy extended masks, as
``(1 - mask) * -10000.0``; a bias this low leaves a weight of ``exp(-1000)``, 0 in every float
dtype (float64 underflows below ``exp(-745)``), so the pair is masked in effect."""


def _dense_attends(name: str, value: Tensor) -> Tensor:
    """Where a 4-D mask attends: a bool one where True; an integer one where 1 (0/1 only,
    as transformers takes them); an additive float one where its value is above
    :data:`ADDITIVE_MASKED_AT` (0 attends; ``finfo.min``, ``-inf`` and the legacy ``-10000.0``
    mask)."""
    if value.dtype == torch.bool:
        return value
    if value.dtype.is_complex:
        raise TypeError(
            f"{name} must be a bool, 0/1 integer or additive float mask, got dtype {value.dtype}"
        )
    if value.dtype.is_floating_point:
        return value > ADDITIVE_MASKED_AT
    bad = (value != 0) & (value != 1)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} is an integer mask with value {int(value[where])} at {list(where)}: an "
            f"integer 4-D mask must hold 0 (masked) and 1 (attends) only; pass an additive "
            f"mask as a float tensor (0 attends, finfo.min or -10000.0 masks)"
        )
    return value != 0


def _pair(block: Any) -> tuple[int, int]:
    if isinstance(block, (tuple, list)):
        return int(block[0]), int(block[1])
    return int(block), int(block)
