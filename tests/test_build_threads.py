"""How many intra-op threads a CPU build runs on: FLEXMASK_BUILD_THREADS where set; unset,
torch's own count while the cores are free and one while other processes keep a core busy
(``flexmask._cores.others_busy``), torch's setting restored after — the tensors the same
either way."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

import flexmask
from flexmask.builders import threads as build_threads
from flexmask.builders.threads import cpu_threads
from tests import oracle


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _inside(monkeypatch, busy: bool, env: str | None) -> int:
    monkeypatch.setattr(build_threads, "others_busy", lambda **_: busy)
    if env is None:
        monkeypatch.delenv("FLEXMASK_BUILD_THREADS", raising=False)
    else:
        monkeypatch.setenv("FLEXMASK_BUILD_THREADS", env)
    with cpu_threads(torch.device("cpu")):
        return torch.get_num_threads()


@pytest.mark.parametrize(
    ("busy", "env", "expected"),
    [(False, None, 2), (True, None, 1), (False, "1", 1), (True, "2", 2), (False, "8", 2)],
)
def test_the_threads_a_build_runs_on(monkeypatch, two_threads, busy, env, expected):
    assert _inside(monkeypatch, busy, env) == expected
    assert torch.get_num_threads() == 2  # restored


def test_a_bad_setting_is_named(monkeypatch, two_threads):
    monkeypatch.setenv("FLEXMASK_BUILD_THREADS", "0")
    with (
        pytest.raises(ValueError, match="FLEXMASK_BUILD_THREADS"),
        cpu_threads(torch.device("cpu")),
    ):
        pass


@pytest.mark.parametrize("busy", [False, True])
def test_the_tensors_do_not_depend_on_the_threads(monkeypatch, two_threads, busy):
    monkeypatch.setattr(build_threads, "others_busy", lambda **_: busy)
    monkeypatch.delenv("FLEXMASK_BUILD_THREADS", raising=False)
    mask = flexmask.causal() & flexmask.document([[700, 324], [300, 724]])
    ours = flexmask.create_block_mask(mask, 2, 1, 1024, 1024, "cpu", 64)
    want = oracle.torch_build(mask.to_dense(2, 1, 1024, 1024).numpy(), block=64)
    oracle.assert_same_block_mask(ours, want)


def _side_by_side_cases() -> dict[str, flexmask.Mask]:
    docs = [[700, 200, 124], [300, 724]]
    return {
        "closed form, rows": flexmask.causal() & flexmask.document(docs),
        "closed form, one row copied out": flexmask.causal(),
        "union": (flexmask.causal() & flexmask.document(docs)) | flexmask.prefix(100),
        "tiles, insertion order": flexmask.tree(
            [[-1, 0, 0, 1, *range(3, 1023)], [-1, *range(1023)]]
        ),
        # A tree alone is written from its columns; with a window its tiles are classified.
        "columns, preorder": flexmask.tree(
            [[-1, *range(499), 0, *range(500, 1023)], [-1, *range(300), 1, *range(301, 1023)]]
        ),
        "tiles, preorder": flexmask.tree(
            [[-1, *range(499), 0, *range(500, 1023)], [-1, *range(300), 1, *range(301, 1023)]]
        )
        & flexmask.sliding_window(600),
        "per head": flexmask.per_head(
            flexmask.causal() & flexmask.document(docs), flexmask.sliding_window(200)
        ),
    }


class _Sent:
    """The second-side thread's queue, counting what builds send it."""

    def __init__(self, tasks) -> None:
        self.tasks, self.count = tasks, 0

    def put(self, task) -> None:
        self.count += 1
        self.tasks.put(task)

    def get(self):
        return self.tasks.get()


@pytest.mark.parametrize("case", list(_side_by_side_cases()))
def test_sides_written_side_by_side_are_torchs(monkeypatch, two_threads, case):
    """Long grids write their two sides on two threads (``blocks.pair``): forced on a small
    grid here, the tensors are torch's."""
    from flexmask.blocks import pair

    worker = pair._the_worker()
    sent = _Sent(worker.tasks)
    monkeypatch.setattr(worker, "tasks", sent)
    monkeypatch.setattr(pair, "SPLIT_FROM", 1)
    # A tree's tiles in several chunks of q blocks, classified in two halves.
    tree_module = importlib.import_module("flexmask.pieces.tree")
    monkeypatch.setattr(tree_module, "_CHUNKED_FROM", 1 << 7)
    monkeypatch.setattr(tree_module, "_CHUNK_TILES", 1 << 7)
    monkeypatch.setattr(tree_module, "_COLUMNS_FROM", 0)  # a tree alone from its columns
    monkeypatch.setenv("FLEXMASK_BUILD_THREADS", "2")
    mask = _side_by_side_cases()[case]
    heads = 2 if case == "per head" else 1
    ours = flexmask.create_block_mask(mask, 2, heads, 1024, 1024, "cpu", 64)
    assert sent.count, "no side was written on the second thread"
    assert torch.get_num_threads() == 2  # restored
    want = oracle.torch_build(mask.to_dense(2, heads, 1024, 1024).numpy(), block=64)
    oracle.assert_same_block_mask(ours, want)


def test_an_error_on_the_second_thread_is_raised_on_the_first(monkeypatch, two_threads):
    from flexmask.blocks.pair import side_by_side

    monkeypatch.setattr("flexmask.blocks.pair.SPLIT_FROM", 1)

    def fails() -> None:
        raise ValueError("second side")

    with pytest.raises(ValueError, match="second side"):
        side_by_side(lambda: 1, fails, 2, torch.device("cpu"))
    assert torch.get_num_threads() == 2
    assert side_by_side(lambda: 1, lambda: 2, 2, torch.device("cpu")) == (1, 2)


def test_the_second_thread_takes_the_callers_inference_mode(monkeypatch, two_threads):
    """An in-place write of an inference tensor outside inference mode raises: the second
    side runs in the caller's mode."""
    from flexmask.blocks.pair import side_by_side

    monkeypatch.setattr("flexmask.blocks.pair.SPLIT_FROM", 1)
    with torch.inference_mode():
        out = torch.zeros(4)
        side_by_side(lambda: None, lambda: out.fill_(1), 2, torch.device("cpu"))
    assert out.tolist() == [1, 1, 1, 1]


def test_the_second_side_runs_on_the_long_lived_thread(monkeypatch, two_threads):
    """One thread, started once, runs every build's second side; the first stays here."""
    from flexmask.blocks.pair import side_by_side

    monkeypatch.setattr("flexmask.blocks.pair.SPLIT_FROM", 1)
    names = [
        side_by_side(
            lambda: threading.current_thread().name,
            lambda: (threading.current_thread().name, threading.get_ident()),
            2,
            torch.device("cpu"),
        )
        for _ in range(3)
    ]
    assert {first for first, _ in names} == {threading.current_thread().name}
    assert {second for _, second in names} == {names[0][1]}  # the same thread each time
    assert names[0][1][0] == "flexmask-side"


def test_builds_from_two_threads_at_once_are_torchs(monkeypatch, two_threads):
    """Two user threads building at once: one build's second side takes the long-lived
    thread, the other's a thread of its own; both are torch's tensors."""
    monkeypatch.setattr("flexmask.blocks.pair.SPLIT_FROM", 1)
    monkeypatch.setattr(importlib.import_module("flexmask.pieces.tree"), "_COLUMNS_FROM", 0)
    monkeypatch.setenv("FLEXMASK_BUILD_THREADS", "2")
    cases = _side_by_side_cases()
    names = ["closed form, rows", "union", "tiles, insertion order", "columns, preorder"]
    built: dict[str, object] = {}
    barrier = threading.Barrier(len(names))

    def build(name: str) -> None:
        barrier.wait()
        for _ in range(3):
            built[name] = flexmask.create_block_mask(cases[name], 2, 1, 1024, 1024, "cpu", 64)

    workers = [threading.Thread(target=build, args=(name,)) for name in names]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for name in names:
        want = oracle.torch_build(cases[name].to_dense(2, 1, 1024, 1024).numpy(), block=64)
        oracle.assert_same_block_mask(built[name], want, name)


def test_a_forked_child_starts_its_own_second_side_thread(two_threads):
    """After fork the child has no second-side thread (only the forking one survives): the
    hook forgets the parent's, and the child's first long build starts its own. (The child
    runs no torch op on two threads: GNU OpenMP hangs a forked child that does, which is why
    DataLoader workers run on one.)"""
    import multiprocessing

    from flexmask.blocks import pair

    pair._the_worker()  # the parent's, started before the fork
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        fresh, name = pool.apply_async(_child_worker).get(timeout=60)
    assert fresh, "the child kept the parent's second-side thread"
    assert name == "flexmask-side"


def _child_worker() -> tuple[bool, str]:
    import queue

    from flexmask.blocks import pair

    fresh = pair._worker is None
    done: queue.SimpleQueue[str] = queue.SimpleQueue()
    pair._the_worker().tasks.put(lambda: done.put(threading.current_thread().name))
    return fresh, done.get(timeout=30)
