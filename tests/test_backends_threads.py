"""How the block-sparse kernel uses the cores: the measured load that keeps torch's threads
(and their probes) off busy cores, and its two ways of using them (torch's intra-op threads,
or single-threaded workers) inside gloo ranks, with collectives in flight on gloo's own
threads.

A per-call choice between the two ways was once backed out after a gloo rank aborted
("terminate called without an active exception") about one run in five. These ranks take
both ways on purpose, call after call, with an asynchronous all-reduce running on gloo's
threads while the kernel's workers and OpenMP threads work, and check every output and
gradient against SDPA on the dense mask written from the documented semantics. A rank that
dies of a signal fails the test (``run_ranks``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from flexmask import _cores
from flexmask.backends import threads
from flexmask.backends.threads import CoreLoad, ThreadChoice
from tests.ranks import run_ranks

STAT = """cpu  {t0} 0 0 {i0} 0 0 0 0 0 0
cpu0 {a} 0 {b} {ia} 5 0 {c} 0 0 0
cpu1 {d} 0 0 {ib} 7 0 0 0 0 0
cpu2 {e} 0 0 0 0 0 0 0 0 0
intr 1 2 3
"""


class _Clock:
    def __init__(self) -> None:
        self.wall, self.cpu = 100.0, 3.0


def _fake_load(monkeypatch, clock: _Clock, stats: list[str], cpus=frozenset({0, 1})) -> CoreLoad:
    load = CoreLoad(period=0.2)
    load.cpus = cpus
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock.wall)
    monkeypatch.setattr(threads.time, "process_time", lambda: clock.cpu)
    texts = iter(stats)

    class _File:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, _n):
            return next(texts).encode()

    monkeypatch.setattr("builtins.open", lambda *a, **k: _File())
    return load


def test_core_load_is_the_allowed_cores_busy_time_less_this_process(monkeypatch):
    """Worked by hand: between two samples 1 s apart, cores 0 and 1 (core 2 is not ours)
    spent 150 + 30 + 20 + 100 = 300 ticks (1/100 s) outside idle and iowait, and this
    process 0.8 s of CPU: others took 3.0 - 0.8 = 2.2 core-seconds per second."""
    tick = _cores._TICKS
    scale = int(tick / 100)  # the counters are in the system's ticks; the sums above in 1/100 s
    before = STAT.format(t0=0, a=0, b=0, c=0, d=0, e=0, i0=0, ia=0, ib=0)
    after = STAT.format(
        t0=0, a=150 * scale, b=30 * scale, c=20 * scale, d=100 * scale, e=999, i0=0, ia=77, ib=9
    )
    clock = _Clock()
    load = _fake_load(monkeypatch, clock, [before, after])
    assert load.others() is None  # one sample: no window yet
    clock.wall += 0.1
    assert load.others() is None  # within the period: the last value stands, no read
    clock.wall += 0.9
    clock.cpu += 0.8
    assert load.others() == pytest.approx(3.0 - 0.8)


def test_core_load_never_below_zero(monkeypatch):
    """This process's CPU time can run ahead of the tick counters (they tick at 100 Hz)."""
    same = STAT.format(t0=0, a=10, b=0, c=0, d=10, e=0, i0=0, ia=0, ib=0)
    clock = _Clock()
    load = _fake_load(monkeypatch, clock, [same, same])
    load.others()
    clock.wall += 1.0
    clock.cpu += 0.5
    assert load.others() == 0.0


class _Fixed:
    """A load that reads ``value`` cores taken by others, on ``cores`` cores."""

    def __init__(self, value: float | None, cores: int = 2) -> None:
        self.value, self.cpus = value, frozenset(range(cores))

    def others(self) -> float | None:
        return self.value


@pytest.mark.parametrize("others", [0.95, 1.0, 2.0])
def test_busy_cores_keep_every_call_on_the_workers(others):
    """With another process on a core torch's threads would need, the choice neither runs
    nor probes them, whatever they cost when last measured."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        load = _Fixed(others)
        choice = ThreadChoice(first=1, most=2, load=load)
        kind = ("forward", 20)
        ways = []
        for _ in range(20):
            way = choice.pick(kind)
            choice.record(kind, way, {"torch": 1.0, "workers": 3.0}[way])
            ways.append(way)
        assert ways == ["workers"] * 20
        load.value = 0.1  # the other process left: torch's threads measured, and they win
        ways = []
        for _ in range(6):
            way = choice.pick(kind)
            choice.record(kind, way, {"torch": 1.0, "workers": 3.0}[way])
            ways.append(way)
        assert ways[0] == "torch" and choice.way(kind) == "torch"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("others", [None, 0.0, 0.4, 0.8])
def test_free_or_unknown_cores_leave_the_measured_choice_alone(others):
    """Free cores (or no counters to read) and the choice measures both ways as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        choice = ThreadChoice(first=1, most=2, load=_Fixed(others))
        kind = ("backward", 12)
        ways = [choice.pick(kind)]
        choice.record(kind, ways[0], 1.0)
        ways.append(choice.pick(kind))
        assert ways == ["torch", "workers"]
    finally:
        torch.set_num_threads(before)


def test_one_thread_leaves_room_for_a_busy_core():
    """torch's threads on 1 of 2 cores fit beside one busy process: nothing to avoid."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert not ThreadChoice(load=_Fixed(1.0))._others_busy()
        assert not ThreadChoice(load=_Fixed(1.8))._others_busy()
        assert ThreadChoice(load=_Fixed(1.95))._others_busy()
    finally:
        torch.set_num_threads(before)


def _cpu_seconds(pid: int) -> float:
    """A process's user + system time, from its own /proc/<pid>/stat (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")
def test_real_counters_see_a_spinning_process_and_not_this_one():
    """Real counters, checked against each process's own CPU time (/proc/<pid>/stat), so that
    other jobs on the machine cannot fail it: over a window in which this process and a child
    both spin, the reading is at least the child's share and at most what this process left
    of the cores (a tick, 10 ms in 0.5 s, of slack each way)."""
    cores = len(os.sched_getaffinity(0))
    load = CoreLoad(period=0.0)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        for _ in range(3):
            child = _cpu_seconds(spinner.pid)
            start_cpu, start = time.process_time(), time.monotonic()
            load.others()
            while time.monotonic() - start < 0.5:  # this process spins: its own time
                pass
            others = load.others()
            wall = time.monotonic() - start
            child = (_cpu_seconds(spinner.pid) - child) / wall
            own = (time.process_time() - start_cpu) / wall
            assert others is not None
            assert child - 0.1 <= others <= cores - own + 0.1, (child, own, others)
    finally:
        spinner.kill()
        spinner.wait()


def _dense_document_causal(lengths: list[int]) -> torch.Tensor:
    """q attends kv when both are in the same document and kv is not after q."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(doc.numel())
    return (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])


def _both_ways(rank: int, world: int, calls: int) -> None:
    import flexmask
    from flexmask.backends import threads
    from flexmask.backends.block_sparse.api import block_sparse_attention

    torch.set_num_threads(2)  # the ways differ only with more than one thread
    taken: list[str] = []
    # A choice that probes at every other call: both ways, alternating, in every rank.
    choice = threads.ThreadChoice(first=1, most=2)
    pick = choice.pick
    choice.pick = lambda kind: taken.append(pick(kind)) or taken[-1]  # type: ignore[method-assign]
    threads.CHOICE = choice
    lengths = [300, 40, 500, 184]
    S = sum(lengths)
    mask = flexmask.causal() & flexmask.document(lengths)
    block_mask = flexmask.create_block_mask(mask, 1, 1, S, S, "cpu", BLOCK_SIZE=64)
    dense = _dense_document_causal(lengths)
    for call in range(calls):
        gen = torch.Generator().manual_seed(call)
        q, k, v = (torch.randn(1, 4, S, 32, generator=gen, requires_grad=True) for _ in range(3))
        pending = torch.full((1 << 16,), float(rank + 1))
        work = torch.distributed.all_reduce(pending, async_op=True)  # on gloo's threads
        out = block_sparse_attention(q, k, v, block_mask, mask=mask, backend="sparse")
        out.sum().backward()
        work.wait()
        assert torch.all(pending == world * (world + 1) / 2)
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        expected = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=dense)
        expected.sum().backward()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        grads = torch.cat([q.grad.flatten(), k.grad.flatten()])
        total = grads.clone()
        torch.distributed.all_reduce(total)  # every rank drew the same tensors
        torch.testing.assert_close(total, world * grads)
    assert torch.get_num_threads() == 2
    assert {"torch", "workers"} <= set(taken), taken


@pytest.mark.slow  # two spawned ranks: 10-30 s on 2 busy cores
def test_both_thread_ways_in_gloo_ranks_with_collectives_in_flight():
    reports = run_ranks(_both_ways, 2, 8, group_timeout_s=60, deadline_s=240)
    assert reports == [None, None], "\n".join(r for r in reports if r)
