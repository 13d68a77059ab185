"""``flexmask.block_sparse``, the documented import path of ``block_sparse_attention`` (see
docs/cpu-training.md). The backend itself lives in ``flexmask.backends.block_sparse``."""

from flexmask.backends import DEFAULT_MAX_CHUNK_ELEMENTS, block_sparse_attention

__all__ = ["DEFAULT_MAX_CHUNK_ELEMENTS", "block_sparse_attention"]
