"""The block-sparse backend: flexmask's own differentiable attention over a BlockMask's
tiles, for CPUs and for devices without a compiled flex_attention.

* ``api`` — ``block_sparse_attention``: its options checked, then SDPA, grouped or score_mod;
* ``grouped`` — the driver of the grouped kernel (no ``score_mod``): slices, partial-block masks;
* ``kernel`` — the grouped kernel over gathered kv tiles, with its own backward;
* ``threads`` — how the kernel's groups share the CPU (``ThreadChoice``);
* ``score_mod`` — the chunked, checkpointed kernel that evaluates a ``score_mod``.
"""

from flexmask.backends.block_sparse.api import DEFAULT_MAX_CHUNK_ELEMENTS, block_sparse_attention

__all__ = ["DEFAULT_MAX_CHUNK_ELEMENTS", "block_sparse_attention"]
