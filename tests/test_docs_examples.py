"""The examples run end to end: each in a subprocess, in its quick mode, checked by its output.

Usage: python -m pytest tests/test_docs_examples.py -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT_S = 300  # a hung example fails the test instead of the whole run


def run_example(
    name: str, *args: str, pythonpath: Path | None = None, launcher: tuple[str, ...] = ()
) -> str:
    """Runs ``examples/<name>`` with ``args`` (under ``python -m <launcher>`` when given);
    returns its stdout, failing with its output."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    # One intra-op thread: on a shared CI machine, OpenMP threads that spin-wait on busy cores
    # made these runs several times slower; the examples' results do not depend on it.
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONHASHSEED", "0")
    result = subprocess.run(
        [sys.executable, *(("-m", *launcher) if launcher else ()), str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{name} {' '.join(args)} exited with {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
        )
    return result.stdout


@pytest.mark.slow  # 35-80 s on 2 busy cores: make test-slow and CI run it
def test_demo_quick_trains_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stdout = run_example("demo.py", "--quick", "--out", str(out))

    for line in (
        "closing report",
        "tokens/second",
        "mask build",
        "1 build per step shared by 3 layers",
        "block sparsity",
        "cache               hit rate",
        "peak mask memory",
        "packing efficiency",
        "loss                train",
        "mask picture",
    ):
        assert line in stdout, f"missing {line!r} in:\n{stdout}"

    png = out / "demo_mask.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "demo_report.json").read_text())
    assert report["steps"] == 40
    assert report["handle_builds_per_step"] == 1
    assert report["tokens_per_second"] > 0
    assert report["mask_build_ms_per_step"] > 0
    assert report["peak_mask_bytes"] < report["dense_mask_bytes"]
    assert report["packing_efficiency"] > report["padding_efficiency"]
    assert 0.8 < report["packing_efficiency"] <= 1.0
    # Training masks never recur: every one misses and leaves the cache on release. The
    # validation batches recur: all but their first lookups hit, and only they stay cached.
    cache = report["cache"]
    assert cache["train_hits"] == 0 and cache["train_misses"] == 40
    assert cache["eval_hits"] > 0
    assert cache["entries"] == cache["eval_misses"]
    loss = report["loss"]
    assert loss["val_end"] < loss["val_start"] - 1.0, loss
    assert loss["train_end"] < loss["train_start"], loss
    assert report["png"] == str(png)


@pytest.mark.slow  # 35-80 s on 2 busy cores: make test-slow and CI run it
def test_demo_without_workers_or_tqdm(tmp_path: Path) -> None:
    # A module named tqdm that fails to import, ahead of the real one on the path.
    (tmp_path / "tqdm.py").write_text("raise ImportError('tqdm hidden by the test')\n")
    out = tmp_path / "out"
    stdout = run_example(
        "demo.py", "--steps", "3", "--workers", "0", "--out", str(out), pythonpath=tmp_path
    )
    assert "0 DataLoader worker(s)" in stdout
    assert "tqdm is not installed" in stdout
    assert re.search(r"^step +3/3 ", stdout, re.MULTILINE), stdout
    assert json.loads((out / "demo_report.json").read_text())["steps"] == 3


@pytest.mark.slow  # two short runs: ~20 s on 2 busy cores
def test_demo_result_does_not_depend_on_threads_or_load(tmp_path: Path) -> None:
    """A fixed amount of work: the same steps and the same losses with 1 torch thread and
    with 2 (how the block-sparse path spreads its work follows the machine's load), and no
    time limit unless asked for."""
    reports = []
    for threads in ("1", "2"):
        out = tmp_path / threads
        run_example(
            "demo.py", "--steps", "6", "--workers", "0", "--threads", threads, "--out", str(out)
        )
        reports.append(json.loads((out / "demo_report.json").read_text()))
    assert [r["steps"] for r in reports] == [6, 6]
    assert [r["stopped_early"] for r in reports] == [None, None]
    assert reports[0]["loss"] == reports[1]["loss"]


def test_lazy_layers() -> None:
    stdout = run_example("lazy_layers.py", "--quick")
    rows = [line.split() for line in stdout.splitlines() if "causal &" in line]
    assert len(rows) == 12, stdout  # 3 steps x 2 micro-batches x 2 masks
    # Columns end: layers, builds, cache (hit/miss), released ("after fwd"/"after bwd"), cached.
    for row in rows:
        layers, builds = row[-6], row[-5]
        assert (layers, builds) == ("4", "1"), row
    static = [row for row in rows if "window(128)" in row]
    assert [row[-4] for row in static] == ["miss"] + ["hit"] * 5
    documents = [row for row in rows if "window(128)" not in row]
    assert all(row[-4] == "miss" and row[-2] == "fwd" for row in documents)
    assert all(row[-1] == "1" for row in rows)  # only the static mask stays cached
    assert "every document mask left the cache on release" in stdout


def test_lazy_layers_on_slices_build_nothing() -> None:
    """On the CPU, flex_attention runs the slices backend for both masks: it lowers each
    handle's Mask itself, so no handle builds a BlockMask and the cache sees no lookup."""
    stdout = run_example("lazy_layers.py", "--quick", "--backend", "auto")
    rows = [line.split() for line in stdout.splitlines() if "causal &" in line]
    assert len(rows) == 12, stdout
    assert all((row[-6], row[-5], row[-4], row[-1]) == ("4", "0", "-", "0") for row in rows)


@pytest.mark.slow  # two torchrun ranks: ~7 s idle
def test_context_parallel_example_on_two_gloo_ranks() -> None:
    """What docs/context-parallel.md runs: torchrun, 2 ranks, gloo; every rank checks its
    loss and gradients against the single-process model, so both print only when they agree."""
    torchrun = ("torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    stdout = run_example("context_parallel.py", "--steps", "2", "--seq", "512", launcher=torchrun)
    rows = re.findall(r"^ *(\w+) step (\d): loss CP (\S+) single (\S+)", stdout, re.MULTILINE)
    assert sorted({(mask, step) for mask, step, _, _ in rows}) == [
        ("documents", "0"),
        ("documents", "1"),
        ("tree", "0"),
        ("tree", "1"),
    ], stdout
    assert all(abs(float(cp) - float(single)) < 1e-4 for _, _, cp, single in rows), stdout


def test_packed_training() -> None:
    stdout = run_example("packed_training.py", "--quick")
    assert "packed logits == logits of each document alone" in stdout
    assert "fewer slots packed" in stdout
    first, last = re.search(r"^loss (\S+) → (\S+) over", stdout, re.MULTILINE).groups()
    assert float(last) < float(first)


def test_tree_logprobs() -> None:
    stdout = run_example("tree_logprobs.py", "--quick")
    assert "all three ways agree" in stdout
    assert "and so do the gradients" in stdout
    assert "tokens saved" in stdout
    for way in ("one sequence at a time", "packed (document mask)", "tree-packed (tree mask)"):
        assert way in stdout


def test_quickstart() -> None:
    stdout = run_example("quickstart.py", "--seq-len", "1024")
    assert "Every BlockMask above lists the same blocks" in stdout
