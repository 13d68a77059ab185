"""scripts/gpu_check.sh: the one-command GPU check (issue #32). No GPU here: its syntax, its
arguments, the order suggestion it prints, and its CPU dry run (the same steps, smallest
sizes) with the files it leaves."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexmask import backends

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
EXPECTED = [
    "env.txt",
    "gpu_tests.txt",
    "gpu_tests.xml",
    "bench_backends.json",
    "bench_backends.md",
    "bench_build.json",
    "bench_build.md",
    "bench_mask_mods.md",
    "steps.tsv",
    "summary.md",
]


def test_script_parses_and_is_executable():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)


def test_unknown_argument_is_refused_and_help_runs(tmp_path):
    bad = subprocess.run(
        ["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, cwd=tmp_path
    )
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
    help_ = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "--dry-run" in help_.stdout


def _bench_backends():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_backends_under_test", ROOT / "benchmarks" / "bench_backends.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_suggested_order_puts_each_rows_fastest_taker_first():
    bench = _bench_backends()
    rows = [  # sdpa takes every row; varlen only the first, where it is fastest
        {"takers": ["flex", "varlen", "sdpa"], "times": {"flex": 2.0, "varlen": 1.0, "sdpa": 3.0}},
        {"takers": ["flex", "sdpa"], "times": {"flex": 1.0, "sdpa": 4.0}},
        {"takers": ["flex", "sdpa"], "times": {"flex": 1.0, "sdpa": 1.5}},
    ]
    current = ("flex", "varlen", "sdpa")
    suggested, costs = bench.suggest_order(rows, current)
    assert suggested == ("varlen", "flex", "sdpa")
    assert costs["suggested"] == (1.0, 1.0)
    assert costs["current"][1] == 2.0  # flex first: the first row at 2x its fastest
    # Ties keep the order now; a backend that took no call keeps its place.
    tied = [{"takers": ["flex", "sdpa"], "times": {"flex": 1.0, "sdpa": 1.0}}]
    assert bench.suggest_order(tied, current)[0] == current
    slower = [{"takers": ["flex", "sdpa"], "times": {"flex": 2.0, "sdpa": 1.0}}]
    assert bench.suggest_order(slower, current)[0] == ("sdpa", "varlen", "flex")
    assert bench.first_taker(("varlen", "sdpa"), rows[1]) == "sdpa"


@pytest.mark.slow
def test_dry_run_runs_every_step_on_the_cpu_and_writes_the_figures(tmp_path):
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTEST_XDIST_WORKER")}
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    for name in EXPECTED:
        assert (out / name).is_file(), name
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert [s[0] for s in steps] == [
        "setup",
        "env",
        "gpu_tests",
        "bench_backends",
        "bench_build",
        "bench_mask_mods",
        "summary",
    ]
    assert all(s[1].startswith("ok") for s in steps), steps
    assert "torch:" in (out / "env.txt").read_text()
    assert "flexmask commit:" in (out / "env.txt").read_text()
    tests = (out / "gpu_tests.txt").read_text()  # collected, then skipped: no CUDA here
    assert "skipped" in tests and "deselected" in tests, tests
    bb = json.loads((out / "bench_backends.json").read_text())
    assert bb["device"] == "cpu" and bb["rows"]
    assert {r["pass"] for r in bb["rows"]} == {"fwd+bwd", "fwd"}
    assert set(bb["suggested_order"]) >= set(backends.AUTO["cpu"])
    bd = json.loads((out / "bench_build.json").read_text())
    assert {r["mask"] for r in bd["rows"]} == {"causal", "document-causal", "tree"}
    assert all(r["same_blocks"] is True and "error" not in r for r in bd["rows"]), bd["rows"]
    summary = (out / "summary.md").read_text()
    assert "suggested" in summary and "every step passed" in done.stdout
