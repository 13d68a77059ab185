"""The memory a build writes into (``flexmask.blocks.memory``): large CPU outputs advised onto
transparent huge pages (FLEXMASK_HUGE_PAGES=0 turns it off), the tensors the same either way
and each with a storage of its own, as torch's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flexmask
from flexmask.blocks import memory
from tests import oracle

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The kernel's THP mode (the bracketed word), or None where there is none to read."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def _mappings(begin: int, end: int) -> list[dict[str, str]]:
    """The /proc/self/smaps entries of the mappings that overlap ``[begin, end)``: each its
    fields by name, its first line under "range". Read from the kernel, not from flexmask.
    (The advice splits a mapping at the first whole huge page: a tensor spans several.)"""
    found: list[dict[str, str]] = []
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = {"range": line} if lo < end and begin < hi else None
            if entry is not None:
                found.append(entry)
        elif entry is not None:
            entry[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return found


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    begin = tensor.data_ptr()
    return begin, begin + tensor.numel() * tensor.element_size()


def _huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings under ``tensor``'s memory."""
    return sum(int(m["AnonHugePages"].split()[0]) for m in _mappings(*_span(tensor)))


def _diagnosis(tensor: torch.Tensor) -> str:
    """What the kernel says of ``tensor``'s memory, for a failure's message."""
    begin, end = _span(tensor)
    fields = ("range", "Rss", "AnonHugePages", "THPeligible", "VmFlags")
    said = [" ".join(m.get(f, "") for f in fields) for m in _mappings(begin, end)]
    status = [x for x in Path("/proc/self/status").read_text().splitlines() if "THP" in x]
    return f"tensor at {begin:#x}-{end:#x}: " + " | ".join(said + status)


class _Recorder:
    """Stands in for libc's madvise: records (start, length, advice), answers 0."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, start: int, length: int, advice: int) -> int:
        self.calls.append((start, length, advice))
        return 0


@pytest.fixture
def recorder(monkeypatch):
    fake = _Recorder()
    monkeypatch.setattr(memory, "_madvise", lambda: fake)
    monkeypatch.delenv("FLEXMASK_HUGE_PAGES", raising=False)
    return fake


def test_the_advice_covers_whole_huge_pages_inside_the_tensor(recorder):
    out = memory.index_tensors([(4, 1024, 1024), (4, 1024), (8,)], torch.device("cpu"))
    assert [t.shape for t in out] == [(4, 1024, 1024), (4, 1024), (8,)]
    assert all(t.dtype == torch.int32 for t in out)
    (start, length, advice), *rest = recorder.calls
    assert rest == [], "only outputs of ADVISED_FROM bytes or more are advised"
    assert advice == 14  # MADV_HUGEPAGE
    assert start % memory.HUGE_PAGE == 0 and length % memory.HUGE_PAGE == 0 and length > 0
    begin, end = out[0].data_ptr(), out[0].data_ptr() + out[0].numel() * 4
    assert begin <= start and start + length <= end  # nothing beside the tensor changes
    assert start - begin < memory.HUGE_PAGE and end - (start + length) < memory.HUGE_PAGE


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_setting_turns_it_on_and_off(monkeypatch, recorder, value):
    monkeypatch.setenv("FLEXMASK_HUGE_PAGES", value)
    assert memory.huge_pages_on() == (value == "1")
    memory.index_tensors([(1 << 22,)], torch.device("cpu"))
    assert len(recorder.calls) == int(value)


# The spellings every FLEXMASK_* switch documents (1/0, true/false, yes/no, on/off, any
# case, spaces around), written out here rather than taken from flexmask's parser.
SPELLINGS = {
    "1": True, "true": True, "True": True, "yes": True, "on": True, " ON ": True,
    "0": False, "false": False, "FALSE": False, "no": False, "off": False, "Off": False,
}  # fmt: skip


@pytest.mark.parametrize("value", sorted(SPELLINGS))
def test_the_setting_takes_every_switchs_spellings(monkeypatch, recorder, value):
    """``true``/``off`` were refused at 13fda44 (read as an integer), while FLEXMASK_CHECK
    and FLEXMASK_COMPILE take them: one parser for every switch."""
    monkeypatch.setenv("FLEXMASK_HUGE_PAGES", value)
    assert memory.huge_pages_on() is SPELLINGS[value]
    memory.index_tensors([(1 << 22,)], torch.device("cpu"))
    assert len(recorder.calls) == int(SPELLINGS[value])
    # The same word means the same to FLEXMASK_CHECK.
    monkeypatch.setenv("FLEXMASK_CHECK", value)
    assert flexmask.packing.check_enabled(None) is SPELLINGS[value]


@pytest.mark.parametrize("value", ["-1", "2", "maybe", "enabled"])
def test_a_bad_setting_is_named(monkeypatch, value):
    monkeypatch.setenv("FLEXMASK_HUGE_PAGES", value)
    with pytest.raises(ValueError, match=r"FLEXMASK_HUGE_PAGES=.*true/false"):
        flexmask.create_block_mask(flexmask.causal(), 1, 1, 256, 256, "cpu")


def test_unset_or_empty_is_on(monkeypatch):
    monkeypatch.setenv("FLEXMASK_HUGE_PAGES", "")
    assert memory.huge_pages_on() is (memory._madvise() is not None)
    monkeypatch.delenv("FLEXMASK_HUGE_PAGES")
    assert memory.huge_pages_on() is (memory._madvise() is not None)


def test_small_and_foreign_tensors_are_left_alone(recorder):
    assert not memory.advise_huge_pages(
        torch.empty(memory.ADVISED_FROM // 4 - 1, dtype=torch.int32)
    )
    assert not memory.advise_huge_pages(torch.empty(1 << 22, device="meta"))
    assert recorder.calls == []


def test_without_a_libc_nothing_is_advised(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", lambda: None)
    monkeypatch.delenv("FLEXMASK_HUGE_PAGES", raising=False)
    assert not memory.huge_pages_on()
    assert not memory.advise_huge_pages(torch.empty(1 << 22, dtype=torch.int32))


def test_builds_are_the_same_on_and_off_and_each_tensor_has_its_storage(monkeypatch):
    """16 MiB index tensors (B = 16, S = 8192 in blocks of 16): equal tensor for tensor with
    huge pages on and off; at 1,024 tokens (the same mask's first rows) equal to torch's."""
    masks = {}
    for value in ("1", "0"):
        monkeypatch.setenv("FLEXMASK_HUGE_PAGES", value)
        rows = [[3000, 5192], [8192], [100, 8092], [4096] * 2] * 4
        mask = flexmask.causal() & flexmask.document(rows)
        masks[value] = flexmask.create_block_mask(mask, 16, 1, 8192, 8192, "cpu", 16)
    oracle.assert_same_block_mask(masks["1"], masks["0"], "huge pages on against off")
    small = flexmask.causal() & flexmask.document([[300, 724], [1024]])
    monkeypatch.setenv("FLEXMASK_HUGE_PAGES", "1")
    monkeypatch.setattr(memory, "ADVISED_FROM", 1 << 12)  # advise these small ones too
    ours = flexmask.create_block_mask(small, 2, 1, 1024, 1024, "cpu", 16)
    want = oracle.torch_build(small.to_dense(2, 1, 1024, 1024).numpy(), block=16)
    oracle.assert_same_block_mask(ours, want)


def test_a_long_build_advises_its_four_index_tensors(recorder):
    rows = [[3000, 5192], [8192], [100, 8092], [4096] * 2] * 4
    mask = flexmask.causal() & flexmask.document(rows)
    built = flexmask.create_block_mask(mask, 16, 1, 8192, 8192, "cpu", 16)
    advised = {start for start, _, _ in recorder.calls}
    for name in ("kv_indices", "full_kv_indices", "q_indices", "full_q_indices"):
        tensor = getattr(built, name)
        first = -(-tensor.data_ptr() // memory.HUGE_PAGE) * memory.HUGE_PAGE
        assert first in advised, name


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() not in ("madvise", "always"),
    reason="needs Linux with transparent huge pages (madvise or always)",
)
def test_the_kernel_takes_the_advice(monkeypatch):
    """The mapping under the tensor's middle is advised (``hg`` in its VmFlags); where its
    pages were not resident yet (fresh from the kernel: glibc may also hand out heap memory
    a process freed, already faulted in), writing it faults huge pages. (Off, no advice is
    asked for: ``test_the_setting_turns_it_on_and_off``; heap memory keeps the flag of an
    earlier advice, so the kernel's flags cannot show it.)"""
    monkeypatch.delenv("FLEXMASK_HUGE_PAGES", raising=False)
    (advised,) = memory.index_tensors([(10 << 20,)], torch.device("cpu"))
    middle = advised.data_ptr() + advised.numel() * 2
    (before,) = _mappings(middle, middle + 1)
    assert "hg" in before["VmFlags"].split(), before
    advised.fill_(1)
    if before["Rss"] == "0 kB":
        assert _huge_kib(advised) >= 2048, _diagnosis(advised)
