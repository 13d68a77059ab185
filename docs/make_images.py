"""Writes the PNGs under docs/img/ with flexmask.plot. Run: python docs/make_images.py

Each picture is the element mask beside its block classification at S = 2048 with torch's
default 128 x 128 blocks (a 16 x 16 grid of tiles). The images are committed; re-run this
script when a piece's semantics or the plot's look changes.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

import flexmask
from flexmask.packing import pack_one_tree
from flexmask.pieces import dilated, global_tokens

S = 2048
IMG = pathlib.Path(__file__).resolve().parent / "img"


def chunked(b, h, q_idx, kv_idx):
    """Chunked attention (as in Llama 4): attend only within the same 512-token chunk."""
    return q_idx // 512 == kv_idx // 512


def global_flags() -> list[bool]:
    """Longformer's global tokens: a CLS token and two question tokens mid-sequence."""
    return [i in (0, 700, 1500) for i in range(S)]


def shared_prefix_tree():
    """A 512-token prompt shared by three continuations, packed as one preorder trie."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 1000, (512,), generator=gen).tolist()
    branches = [torch.randint(1000, 2000, (n,), generator=gen).tolist() for n in (600, 500, 436)]
    packed = pack_one_tree([prompt + branch for branch in branches], pad_to=S)
    return packed.mask


def image_ids() -> list[int]:
    """Text with three images of 256 tokens: two in the first document, one in the second."""
    ids = [-1] * S
    for k, start in enumerate((100, 600, 1400)):
        ids[start : start + 256] = [k] * 256
    return ids


def router_picks() -> torch.Tensor:
    """An NSA-style router's top-4 of 128-key tiles for each of 16 query tiles: the query's
    own tile and three earlier ones (repeats where fewer exist)."""
    gen = torch.Generator().manual_seed(0)
    tiles = S // 128
    own = torch.arange(tiles).view(-1, 1)
    earlier = (torch.rand(tiles, 3, generator=gen) * (own + 1)).long()
    return torch.cat([own, earlier], 1)


def images() -> dict[str, tuple[flexmask.Mask, dict]]:
    """file name -> (mask, extra plot arguments)."""
    return {
        "causal.png": (flexmask.causal(), {}),
        "document.png": (flexmask.causal() & flexmask.document([700, 300, 1048]), {}),
        "padding.png": (
            flexmask.causal() & flexmask.padding([S, 1300]),
            {"batch": 1, "title": "causal() & padding([2048, 1300]), row 1"},
        ),
        "tree.png": (
            shared_prefix_tree(),
            {"title": "tree(parents): a 512-token prompt shared by 3 continuations"},
        ),
        "sliding_window.png": (flexmask.causal() & flexmask.sliding_window(256), {}),
        "prefix.png": (flexmask.causal() | flexmask.prefix(600), {}),
        "full.png": (flexmask.full(), {}),
        "chunked.png": (flexmask.causal() & flexmask.chunked(512), {}),
        "spans.png": (
            (flexmask.causal() | flexmask.spans(image_ids())) & flexmask.document([1100, 948]),
            {"title": "(causal() | spans(ids)) & document([1100, 948]): 3 images"},
        ),
        "selected.png": (
            flexmask.causal()
            & (flexmask.selected(router_picks(), tile=128) | flexmask.sliding_window(256)),
            {"title": "causal() & (selected(top-4 tiles of 128) | sliding_window(256))"},
        ),
        "global_tokens.png": (
            flexmask.sliding_window(129) | global_tokens(global_flags()),
            {"title": "sliding_window(129) | global_tokens(is_global): Longformer, 3 global"},
        ),
        "dilated.png": (
            flexmask.sliding_window(257) & dilated(64),
            {"title": "sliding_window(257) & dilated(64)"},
        ),
        "per_head.png": (
            flexmask.per_head(flexmask.causal(), flexmask.causal() & flexmask.chunked(512)),
            {"H": 2, "head": 1, "title": "per_head(causal(), causal() & chunked(512)), head 1"},
        ),
        "from_mask_mod.png": (
            flexmask.causal()
            & flexmask.from_mask_mod(chunked, batch_dependent=False, head_dependent=False),
            {"title": "causal() & from_mask_mod(chunked)"},
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=IMG)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (mask, extra) in images().items():
        path = flexmask.plot(mask, args.out / name, Q_LEN=S, KV_LEN=S, **extra)
        print(path)


if __name__ == "__main__":
    main()
