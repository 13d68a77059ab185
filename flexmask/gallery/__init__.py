"""Every mask family the field uses, by the name it is known by, built from pieces.

One function per family, named and taking the arguments of its source's generator, each
returning a :class:`~flexmask.Mask` composed of flexmask's pieces (never a wrapped
mask_mod), so it builds from structure, lowers to every format that can express it, and
compares and caches by value:

* ``flexmask.gallery.cudnn`` — NVIDIA cuDNN-frontend's flex-attention benchmark suite
  (``cudnn.make_mask(name, seqlen)``, one function per suite name);
* ``flexmask.gallery.attn_gym`` — attention-gym's ``attn_gym/masks`` generators.

docs/gallery.md lists each family with its source and the pieces it composes.
"""

from flexmask.gallery import attn_gym, cudnn

__all__ = [
    "attn_gym",
    "cudnn",
]

_INTERNAL: list[str] = []
