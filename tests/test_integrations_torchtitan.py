"""flexmask.integrations.torchtitan against torchtitan's own builders: the ``VarlenMetadata``
its ``create_varlen_metadata_for_document`` reads from the batch's positions, and the
BlockMask torch's ``create_block_mask`` builds from torchtitan's own mask_mods.

torchtitan does not install cleanly as a test dependency (its requirements pull wandb,
tensorboard and datasets; even ``--no-deps`` needs triton, about 1 GB on a CPU machine), so
these tests run where it is installed and skip elsewhere, naming the install line.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

from flexmask.integrations.torchtitan import attention_masks, varlen_metadata
from flexmask.packing import pack

titan = pytest.importorskip(
    "torchtitan.models.common.attention",
    reason="torchtitan not installed: pip install --no-deps torchtitan==0.3.0 "
    "spmd_types==0.2.3 tyro docstring_parser triton",
)

CASES = [
    ([[1, 2, 3], [4, 5]], 6),  # one padding token
    ([[1] * 130, [2] * 70, [3] * 60, [4] * 5], 200),  # rows [130, 70] and [60, 5] + padding
    ([[1] * 128, [2] * 128], 128),  # full rows, no padding
    ([[1] * 100, [2] * 28, [3] * 77, [4] * 51], 128),
]


@pytest.mark.parametrize(("sequences", "max_len"), CASES)
def test_offsets_are_torchtitans_own(sequences, max_len):
    batch = pack(sequences, max_len)
    ours = attention_masks(batch, quadratic="varlen")
    theirs = titan.create_varlen_metadata_for_document(
        batch.position_ids, include_host_offsets=True
    )
    assert isinstance(ours["deltanet"], titan.VarlenMetadata)
    assert ours["quadratic_attention"] is ours["deltanet"]
    for field in ("cu_seq_q", "cu_seq_k"):
        assert torch.equal(getattr(ours["deltanet"], field), getattr(theirs, field))
        assert getattr(ours["deltanet"], field).dtype == torch.int32
    assert ours["deltanet"].cu_seq_q_host == theirs.cu_seq_q_host
    assert (ours["deltanet"].max_q, ours["deltanet"].max_k) == (theirs.max_q, theirs.max_k)


def _dense(mask_mod, batch_size, seq_len):
    b, q, kv = torch.meshgrid(
        torch.arange(batch_size), torch.arange(seq_len), torch.arange(seq_len), indexing="ij"
    )
    return mask_mod(b, torch.zeros_like(b), q, kv)


@pytest.mark.parametrize(("sequences", "max_len"), CASES)
def test_block_mask_keeps_torchtitans_documents(sequences, max_len):
    batch = pack(sequences, max_len)
    block_mask = attention_masks(batch, block_size=64)["quadratic_attention"]
    positions = batch.position_ids
    mod = and_masks(titan.get_causal_mask_mod(), titan.get_document_mask_mod(positions))
    theirs = _dense(mod, batch.num_rows, max_len)
    real = torch.zeros(batch.num_rows, max_len, dtype=torch.bool)
    for row, lengths in enumerate(batch.seq_lens):
        real[row, : sum(lengths)] = True
    ours = _dense(block_mask.mask_mod, batch.num_rows, max_len)
    # Real tokens attend exactly what torchtitan's mask lets them; padding (each token a
    # document of its own in torchtitan) attends nothing in flexmask's.
    assert torch.equal(ours[real], theirs[real])
    assert not ours[~real].any()
    if bool(real.all()):  # no padding: the very blocks torch builds from torchtitan's mod
        built = torch_create_block_mask(mod, batch.num_rows, None, max_len, max_len, "cpu", 64)
        for name in ("kv_num_blocks", "full_kv_num_blocks"):  # partial and full blocks alike
            assert torch.equal(getattr(block_mask, name), getattr(built, name)), name
        assert torch.equal(block_mask.to_dense(), built.to_dense())  # the same blocks listed


def test_refusals():
    batch = pack([[1, 2, 3]], 4)
    with pytest.raises(ValueError, match="quadratic must be"):
        attention_masks(batch, quadratic="sdpa")
    with pytest.raises(TypeError, match="PackedBatch"):
        varlen_metadata([[1, 2, 3]])
    assert attention_masks(batch, quadratic=None)["quadratic_attention"] is None
