"""How far a packed document's logits move when a hybrid model's recurrent layers get no
document boundaries: the figures docs/hybrid.md quotes.

Every tiny hybrid of ``tests/hybrid_models.py`` (random float32 weights) runs two documents
(8 and 6 tokens) packed in one row with flexmask's masks and positions but none of the
boundary arguments (``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``), and the second
document alone; printed is the largest logit difference of that document. A model whose
every layer keeps documents apart prints 0.

Run from the repository root::

    python benchmarks/bench_hybrid_leaks.py
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

import torch  # noqa: E402
from common import machine  # noqa: E402

from flexmask.integrations.transformers import model_inputs  # noqa: E402
from flexmask.integrations.transformers_layers import BOUNDARY_NAMES  # noqa: E402
from flexmask.packing import pack  # noqa: E402
from tests.hybrid_models import HYBRIDS, tiny_model  # noqa: E402

DOCUMENTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]


def main() -> None:
    print(f"machine: {machine()}")
    batch = pack(DOCUMENTS, 14)
    for name in HYBRIDS:
        model = tiny_model(name)
        inputs = model_inputs(model, batch)
        inputs = {k: v for k, v in inputs.items() if k not in BOUNDARY_NAMES}
        with torch.no_grad():
            packed = model(**inputs, use_cache=False).logits
            alone = model(input_ids=torch.tensor([DOCUMENTS[1]]), use_cache=False).logits[0]
        moved = float((batch.unpack(packed)[1] - alone).abs().max())
        print(f"{name}: {moved:.1e}", flush=True)


if __name__ == "__main__":
    main()
