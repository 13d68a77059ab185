"""The block-sparse backend: flexmask's own differentiable attention over a BlockMask's
tiles, for CPUs and for devices without a compiled flex_attention.

* ``api`` — ``block_sparse_attention``: q/k/v checks, the plan from the BlockMask, the driver;
* ``kernel`` — the grouped kernel over gathered kv tiles, and the kernel's thread choice.
"""

from flexmask.backends.block_sparse.api import DEFAULT_MAX_CHUNK_ELEMENTS, block_sparse_attention

__all__ = ["DEFAULT_MAX_CHUNK_ELEMENTS", "block_sparse_attention"]
