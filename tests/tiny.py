"""The examples' tiny language model (examples/_model.py), loaded once for the tests that
train through a packed batch (test_rl, test_packing_sft)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def tiny_model(vocab: int):
    """A 2-layer, 2-head TinyLM of width 32 over ``vocab`` tokens, seeded."""
    path = Path(__file__).resolve().parent.parent / "examples" / "_model.py"
    spec = importlib.util.spec_from_file_location("flexmask_examples_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyLM(vocab=vocab, dim=32, num_heads=2, num_layers=2, seed=0)
