"""flexmask.integrations.transformers: what it refuses (naming the argument) and what it takes.

The sizes it accepts are checked against transformers' own mask functions, evaluated densely.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed: pip install 'flexmask[transformers]' to run these",
)

from transformers import PretrainedConfig  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    chunked_causal_mask_function,
    sliding_window_causal_mask_function,
)

import flexmask  # noqa: E402
from flexmask.integrations.transformers import attention_masks, layer_mask  # noqa: E402
from flexmask.packing import pack  # noqa: E402
from tests.test_integrations_transformers import block_mask_pairs  # noqa: E402

LAYERS = ["sliding_attention", "chunked_attention", "full_attention"]


def config(sliding_window=3, attention_chunk_size=4):
    # PretrainedConfig keeps its fields as given (model configs would refuse numpy values at
    # assignment, but a config from remote code or a plain namespace does not).
    return PretrainedConfig(
        layer_types=LAYERS,
        sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size,
    )


def reference(kind, size, seq_len):
    """(1, 1, S, S) bool from transformers' own mask functions on broadcast index grids."""
    if kind == "sliding_attention":
        fn = sliding_window_causal_mask_function(size)
    else:
        fn = chunked_causal_mask_function(size, torch.zeros(1, dtype=torch.long))
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(seq_len)[None, None, :, None]
    kv = torch.arange(seq_len)[None, None, None, :]
    return fn(zero, zero, q, kv).expand(1, 1, seq_len, seq_len)


@pytest.mark.parametrize("shape", [(2,), (1, 2, 3), (), "ab", 5])
def test_a_shape_that_is_not_two_sizes_names_shape(shape):
    with pytest.raises(ValueError, match=r"shape must be \(batch_size, seq_len\)"):
        attention_masks(config(), flexmask.causal(), shape=shape, implementation="sdpa")


@pytest.mark.parametrize(
    ("shape", "error", "match"),
    [
        ((0, 4), ValueError, r"shape\[0\] \(batch_size\) must be >= 1, got 0"),
        ((1, -2), ValueError, r"shape\[1\] \(seq_len\) must be >= 1, got -2"),
        ((1, 2.5), TypeError, r"shape\[1\] \(seq_len\) must be an int, got 2.5"),
        (None, TypeError, r"pass shape=\(batch_size, seq_len\)"),
    ],
)
def test_bad_sizes_in_shape_name_the_entry(shape, error, match):
    with pytest.raises(error, match=match):
        attention_masks(config(), flexmask.causal(), shape=shape, implementation="sdpa")


@pytest.mark.parametrize("make", [np.int64, np.int32, np.uint8, torch.tensor, np.array])
@pytest.mark.parametrize("implementation", ["sdpa", "flexmask"])
def test_numpy_and_tensor_sizes_in_the_config_are_taken(make, implementation):
    seq_len = 11
    masks = attention_masks(
        config(make(3), make(4)),
        flexmask.causal(),
        shape=(np.int64(1), np.int64(seq_len)),
        implementation=implementation,
        block_size=4,
    )
    for kind, size in (("sliding_attention", 3), ("chunked_attention", 4)):
        ours = masks[kind]
        if implementation == "flexmask":
            ours = block_mask_pairs(ours)
        assert torch.equal(ours, reference(kind, size, seq_len)), kind


def test_layer_mask_takes_numpy_sizes():
    for kind, size in (("sliding_attention", np.int64(2)), ("chunked_attention", np.int16(3))):
        mask = layer_mask(kind, flexmask.causal(), None, sliding=size, chunk=size)
        assert torch.equal(mask.to_dense(1, 1, 9, 9), reference(kind, int(size), 9)), kind


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("sliding_window", 0, ValueError, r"sliding_attention needs a window .* >= 1"),
        ("sliding_window", None, ValueError, r"sliding_attention needs a window"),
        ("sliding_window", 2.0, TypeError, r"config.sliding_window.*must be an int, got 2.0"),
        ("sliding_window", True, TypeError, r"config.sliding_window.*must be an int, got True"),
        ("attention_chunk_size", np.int64(0), ValueError, r"chunked_attention needs a chunk"),
        ("attention_chunk_size", "4", TypeError, r"config.attention_chunk_size.*must be an int"),
    ],
)
def test_bad_config_sizes_name_the_field(field, value, error, match):
    sizes = {"sliding_window": 3, "attention_chunk_size": 4, field: value}
    with pytest.raises(error, match=match):
        attention_masks(config(**sizes), flexmask.causal(), shape=(1, 5), implementation="sdpa")


def test_bad_position_ids_name_position_ids():
    mask = flexmask.causal()
    with pytest.raises(ValueError, match=r"position_ids must have shape .* = \(2, 5\), got \(5,\)"):
        attention_masks(config(), mask, shape=(2, 5), position_ids=torch.arange(5))
    with pytest.raises(TypeError, match="position_ids must be an integer tensor, got dtype"):
        attention_masks(config(), mask, shape=(1, 5), position_ids=torch.zeros(1, 5))
    with pytest.raises(TypeError, match="position_ids must be a .* tensor, got list"):
        attention_masks(config(), mask, shape=(1, 3), position_ids=[[0, 1, 2]])
    with pytest.raises(TypeError, match="PackedBatch brings its own position_ids"):
        attention_masks(config(), pack([[1, 2]], 3), position_ids=torch.zeros(1, 3))
