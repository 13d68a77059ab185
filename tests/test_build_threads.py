"""How many intra-op threads a CPU build runs on: FLEXMASK_BUILD_THREADS where set; unset,
torch's own count while the cores are free and one while other processes keep a core busy
(``flexmask._cores.others_busy``), torch's setting restored after — the tensors the same
either way."""

from __future__ import annotations

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
