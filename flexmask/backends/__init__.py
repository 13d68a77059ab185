"""Attention backends: each lowers a BlockMask (and its Mask) to a kernel call."""
