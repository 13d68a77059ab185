"""Inference masks: the training mask evaluated on the window of a decode or prefill step.

A step feeds row b's queries at positions ``[cache_lens[b], cache_lens[b] + q_len)`` against a
KV cache of fixed ``capacity``. Its BlockMask is the window of the training expression: rows
``[cache_lens[b], cache_lens[b] + q_len)``, columns ``[0, capacity)``. Documents, a tree or
padding describe the whole (growing) sequence; causal is aligned so the new queries see the
whole cache and nothing past themselves.

Fixed shapes, values in tensors: the BlockMask's tensors are ``(B, H, ceil(q_len / block),
ceil(capacity / block))`` at every step, and its mask_mod (a ``ShiftedMod``) holds the cache
lengths as a ``(B,)`` tensor and the mask's lookups padded to ``capacity``. So compiled
``flex_attention`` traces the first step and never recompiles as the cache grows.

The modules, in the order a step is made:

* ``arguments``: a step's arguments checked (cache lengths, block sizes, device, size);
* ``window``: one step's BlockMask built from structure (``decode_mask``);
* ``step``: ``DecodeStep``, the step a loop holds (its BlockMask and query positions);
* ``generation``: ``DecodeMasks``, every step of one generation;
* ``appending``: how a generation rewrites only the rows of its BlockMask that move;
* ``speculative``: ``speculative_tree``, a prefix and a draft tree.
"""

from flexmask.inference.generation import DecodeMasks
from flexmask.inference.speculative import speculative_tree
from flexmask.inference.step import DecodeStep
from flexmask.inference.window import decode_mask

# The public path, as before the split: reprs, the reference and pickles by name name it.
for _public in (DecodeMasks, DecodeStep, decode_mask, speculative_tree):
    _public.__module__ = __name__
del _public

__all__ = ["DecodeMasks", "DecodeStep", "decode_mask", "speculative_tree"]
