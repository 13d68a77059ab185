import gc
import importlib
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    max_examples=int(os.environ.get("FLEXMASK_HYPOTHESIS_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile("default")


def pytest_sessionfinish(session, exitstatus):
    """Collect once, then freeze the heap, before pytest's own clean-up collects five times.

    pytest (>= 8.4) runs ``gc.collect()`` five times when a session ends, to report unraisable
    exceptions. With torch, transformers and dynamo loaded, one full collection of this
    suite's heap took 2.3 s at load 6.6 on 2 cores, and an xdist worker that has not finished
    5 s after the controller asked it to stop is sent SIGINT by execnet
    (``WorkerGateway._terminate_execution``): the KeyboardInterrupt traceback from
    hypothesis's ``gc_callback`` that one ``make test`` in three printed after 100%. One
    collection here still reports what the five would, and the frozen heap makes pytest's
    five cheap.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture
def searched(monkeypatch):
    """How many tiles the tree classifier settled by the search of sorted subtrees (the
    exact fallback of ``flexmask.pieces.tree``), counted through the test."""
    tree_module = importlib.import_module("flexmask.pieces.tree")  # not the function tree
    count = [0]
    search = tree_module._search_subtrees

    def counted(tiles, *args):
        count[0] += tiles.shape[0]
        return search(tiles, *args)

    monkeypatch.setattr(tree_module, "_search_subtrees", counted)
    return count


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each slow test compiles from a fresh dynamo: torch.compile(flex_attention) from any
    call site shares flex_attention's code object, whose automatic-dynamic state remembers
    the shapes earlier tests compiled; a later test then gets dynamic shapes, on which torch
    2.13's CPU flex kernel fails to build (CppCompileError, DESIGN-NOTES) — seen when the
    interval tests ran before the transformers ones in one process."""
    if request.node.get_closest_marker("slow") is not None:
        import torch._dynamo

        torch._dynamo.reset()
    yield
