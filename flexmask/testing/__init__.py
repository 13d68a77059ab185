"""Tests a model can be put through: does a packed batch reach the model's outputs only where
its mask says?

* :func:`leak_test` proves, with a few backward passes (or, for kernels without a backward,
  forward passes), that no document's output depends on another document's input — and that
  the influences the mask allows are there.

The input check (:func:`flexmask.check_batch`) needs no model; this one runs it.
"""

from flexmask.testing.leaks import leak_test
from flexmask.testing.report import Leak, LeakOrigin, LeakReport, Missing

__all__ = ["Leak", "LeakOrigin", "LeakReport", "Missing", "leak_test"]
