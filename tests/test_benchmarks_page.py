"""``make bench`` (benchmarks/run_all.py) rewrites only its own blocks of docs/benchmarks.md:
the sections pasted there by hand from other runs survive a regeneration."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_all():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run_all as module

        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_a_block_is_replaced_and_everything_around_it_kept(run_all):
    start, end = run_all.marker("bench_lazy")
    page = "\n".join(
        [
            "# Benchmarks",
            "",
            "## Lazy handles and the mask cache",
            "",
            "A note by hand before the block.",
            "",
            start,
            "",
            "old numbers",
            "",
            end,
            "",
            "## GPU check",
            "",
            "Written by hand.",
            "",
        ]
    )
    merged = run_all.merge(page, [("bench_lazy", "Lazy handles and the mask cache", ["new"])])
    assert "old numbers" not in merged
    assert merged.count("## Lazy handles and the mask cache") == 1
    before, block, after = merged.partition(f"{start}\n\nnew\n\n{end}")
    assert block
    assert before == page.partition(start)[0]
    assert after == page.partition(end)[2]
    assert "A note by hand before the block." in before and "Written by hand." in after


def test_a_block_the_page_lacks_is_appended_as_its_section(run_all):
    page = "# Benchmarks\n\nBy hand.\n"
    merged = run_all.merge(page, [("bench_forward", "Compiled forward", ["table"])])
    start, end = run_all.marker("bench_forward")
    section = f"## Compiled forward\n\n{start}\n\ntable\n\n{end}\n"
    assert merged == f"# Benchmarks\n\nBy hand.\n\n{section}"
    assert run_all.merge(merged, [("bench_forward", "Compiled forward", ["table"])]) == merged


def test_the_page_holds_one_block_for_every_benchmark_and_the_machine(run_all):
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for name in ["machine", *(bench.name for bench in run_all.BENCHMARKS)]:
        start, end = run_all.marker(name)
        assert page.count(start) == 1 and page.count(end) == 1, name
        assert page.index(start) < page.index(end), name
    # The hand-written sections sit outside every block.
    for title in ("## GPU check", "## First steps", "## Drop-in whole tensors"):
        at = page.index(title)
        for name in ["machine", *(bench.name for bench in run_all.BENCHMARKS)]:
            start, end = run_all.marker(name)
            assert not page.index(start) < at < page.index(end), (title, name)
