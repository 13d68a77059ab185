#!/usr/bin/env bash
# The GPU check, in one command (issue #32): run it whenever a CUDA device is lent.
#
#   scripts/gpu_check.sh                 # on the GPU: under 8 minutes (every step time-boxed)
#   scripts/gpu_check.sh --dry-run       # the same steps on the CPU, smallest sizes (~1-2 min)
#   scripts/gpu_check.sh --out DIR       # results folder (default: $OUT if set, else ./gpu-check-results)
#
# Steps, each under `timeout`; a failed step is recorded and the next one runs; the exit
# status is non-zero if any step failed:
#   1. env            torch version, CUDA device name, flexmask commit         -> env.txt
#   2. gpu_tests      pytest -m gpu (every test marked gpu)                    -> gpu_tests.txt, gpu_tests.xml
#   3. bench_backends benchmarks/bench_backends.py --device cuda: every backend,
#                     fwd+bwd then fwd, and the order AUTO["cuda"] should have -> bench_backends.{json,md}
#   4. bench_build    benchmarks/bench_build.py --device cuda: S = 32k-1M against
#                     torch's compiled create_block_mask, host syncs counted  -> bench_build.{json,md}
#   4b. bench_mask_mods benchmarks/bench_mask_mods.py: compiled forward, FLASH and TRITON, on
#                     flexmask's interval mask_mod against hand-written interval and equality
#                     forms, each checked against a dense SDPA reference  -> bench_mask_mods.md
#   5. summary        every step's status and time, the suggested order, the build table
#                                                                              -> summary.md, steps.tsv
# It installs nothing beyond `make install`, and that only where no Python here imports torch
# and flexmask's test tools (a device machine has no internet: its torch must be there).
# Budgets (seconds) can be changed with GPU_CHECK_BUDGET_<STEP>=N, e.g. GPU_CHECK_BUDGET_BUILD=200.
set -u

cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
DRY=0
RESULTS="${OUT:-./gpu-check-results}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) RESULTS="$2"; shift ;;
        --out=*) RESULTS="${1#--out=}" ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$RESULTS" || exit 2
RESULTS=$(cd "$RESULTS" && pwd)
STEPS="$RESULTS/steps.tsv"
printf 'step\tstatus\tseconds\tbudget\n' > "$STEPS"
FAILED=0
START=$(date +%s)

# Budgets: 30 + 15 + 120 + 175 + 120 + 10 = 470 s (7 min 50 s) at most, install included.
B_SETUP=${GPU_CHECK_BUDGET_SETUP:-30}
B_ENV=${GPU_CHECK_BUDGET_ENV:-15}
B_TESTS=${GPU_CHECK_BUDGET_TESTS:-120}
B_BACKENDS=${GPU_CHECK_BUDGET_BACKENDS:-175}
B_BUILD=${GPU_CHECK_BUDGET_BUILD:-120}
B_SUMMARY=${GPU_CHECK_BUDGET_SUMMARY:-10}
B_MASK_MODS=${GPU_CHECK_BUDGET_MASK_MODS:-150}

if [ "$DRY" = 1 ]; then
    DEVICE=cpu
    BACKENDS_ARGS=(--lengths 256 --repeat 2)
    BUILD_ARGS=(--sizes 1024 --quick)
    MASK_MODS_ARGS=(--sizes 1024 --repeat 1 --check)
else
    DEVICE=cuda
    BACKENDS_ARGS=(--lengths 4096 16384 --repeat 7)
    BUILD_ARGS=()
    # FLASH needs FA4 (flash_attn.cute); where it is missing its rows fail and TRITON's stand.
    MASK_MODS_ARGS=(--sizes 4096 16384 --repeat 5 --backends TRITON FLASH --check)
fi

# step NAME BUDGET LOG COMMAND...: runs COMMAND under `timeout`, output to LOG and the terminal.
step() {
    local name=$1 budget=$2 log=$3
    shift 3
    echo
    echo "=== gpu_check: $name (at most ${budget} s) ==="
    local t0 rc status
    t0=$(date +%s)
    timeout --kill-after=10 "$budget" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ $rc -eq 0 ]; then
        status=ok
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        status="timed out"
        FAILED=1
    else
        status="failed (exit $rc)"
        FAILED=1
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" "$budget" >> "$STEPS"
    echo "=== gpu_check: $name: $status in $(($(date +%s) - t0)) s ==="
}

# --- 0. the interpreter: the repository's venv, else the active one, else python3; else make install
usable() {  # usable PYTHON: imports torch (with CUDA unless a dry run), pytest and flexmask's deps
    local want_cuda=$((1 - DRY))
    "$1" - "$want_cuda" <<'EOF' >/dev/null 2>&1
import sys
import torch, pytest, cachetools  # noqa: F401
sys.exit(0 if sys.argv[1] == "0" or torch.cuda.is_available() else 1)
EOF
}
PY=""
for candidate in "$ROOT/.venv/bin/python" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$(command -v python3 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && usable "$candidate"; then
        PY=$candidate
        break
    fi
done
if [ -z "$PY" ]; then
    # `make install`: a .venv seeing the system's packages, an installed torch kept.
    step setup "$B_SETUP" "$RESULTS/setup.txt" make install
    PY=$(make -s print-python 2>/dev/null)
    if [ -z "$PY" ] || ! usable "$PY"; then
        echo "gpu_check: no Python here imports torch$([ "$DRY" = 0 ] && echo ' with CUDA'), pytest and cachetools" | tee -a "$RESULTS/setup.txt"
        FAILED=1
    fi
else
    printf 'setup\tok (no install: %s)\t0\t%s\n' "$PY" "$B_SETUP" >> "$STEPS"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # flexmask from this checkout, installed or not
export PYTHONUNBUFFERED=1

# --- 1. environment
step env "$B_ENV" "$RESULTS/env.txt" "$PY" - "$DEVICE" "$DRY" <<'EOF'
import os, platform, subprocess, sys
import torch
import flexmask
device, dry = sys.argv[1], sys.argv[2] == "1"
def git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception as error:
        return f"unknown ({error})"
print(f"mode: {'dry run (CPU)' if dry else 'GPU'}")
print(f"python: {sys.executable} {platform.python_version()}")
print(f"torch: {torch.__version__} (CUDA build {torch.version.cuda})")
print(f"flexmask: {flexmask.__version__} at {os.path.dirname(flexmask.__file__)}")
print(f"flexmask commit: {git('rev-parse', 'HEAD')} {'(uncommitted changes)' if git('status', '--porcelain', '--untracked-files=no') else ''}")
print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; load {os.getloadavg()}")
print(f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        print(f"cuda device {i}: {torch.cuda.get_device_name(i)}, {props.total_memory / 2**30:.0f} GiB, "
              f"capability {props.major}.{props.minor}")
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    print(f"nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}")
except Exception as error:
    print(f"nvidia-smi: not run ({type(error).__name__})")
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: the GPU steps cannot run")
EOF

# --- 2. the gpu-marked tests (on the CPU they skip: the dry run checks they are collected)
PLUGINS=()
for plugin in xdist.plugin _hypothesis_pytestplugin; do
    if "$PY" -c "import ${plugin%%.*}" >/dev/null 2>&1; then PLUGINS+=(-p "$plugin"); fi
done
export PY DRY RESULTS
PLUGINS_STR="${PLUGINS[*]}"
step gpu_tests "$B_TESTS" "$RESULTS/gpu_tests.txt" bash -c '
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest '"$PLUGINS_STR"' -q -rA -m gpu \
        --junitxml="$RESULTS/gpu_tests.xml" tests 2>&1 | tee "$RESULTS/.gpu_tests.raw"
    rc=${PIPESTATUS[0]}
    if [ "$DRY" = 0 ] && grep -q "needs a CUDA device" "$RESULTS/.gpu_tests.raw"; then
        echo "gpu_check: gpu tests skipped for want of a CUDA device on a GPU run"; rc=1
    fi
    rm -f "$RESULTS/.gpu_tests.raw"
    exit $rc'

# --- 3. every backend on the device, and the order AUTO[device] should have
step bench_backends "$B_BACKENDS" "$RESULTS/bench_backends.md" \
    "$PY" benchmarks/bench_backends.py --device "$DEVICE" "${BACKENDS_ARGS[@]}" \
    --json "$RESULTS/bench_backends.json"

# --- 4. the build on the device against torch's compiled create_block_mask, host syncs counted
step bench_build "$B_BUILD" "$RESULTS/bench_build.md" \
    "$PY" benchmarks/bench_build.py --device "$DEVICE" "${BUILD_ARGS[@]}" \
    --json "$RESULTS/bench_build.json"

# --- 4b. the mask_mod forms on torch's kernels, checked against the dense reference
step bench_mask_mods "$B_MASK_MODS" "$RESULTS/bench_mask_mods.md" \
    "$PY" benchmarks/bench_mask_mods.py --device "$DEVICE" "${MASK_MODS_ARGS[@]}"

# --- 5. summary (also when steps failed: it reports what they left)
TOTAL=$(($(date +%s) - START))
step summary "$B_SUMMARY" "$RESULTS/summary.md" "$PY" - "$RESULTS" "$TOTAL" "$DRY" <<'EOF'
import json, sys
from pathlib import Path
results, total, dry = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
print(f"# GPU check{' (dry run on the CPU)' if dry else ''}: summary\n")
env = results / "env.txt"
if env.exists():
    for line in env.read_text().splitlines():
        if line.split(":")[0] in ("torch", "flexmask commit", "cuda device 0", "mode"):
            print(f"- {line}")
print(f"- results: {results}\n- steps before this summary took {total} s\n")
print("| step | status | seconds | budget |\n|---|---|---|---|")
for line in (results / "steps.tsv").read_text().splitlines()[1:]:
    print("| " + " | ".join(line.split("\t")) + " |")
def load(name):
    try:
        return json.loads((results / name).read_text())
    except (OSError, ValueError):
        return None
bb = load("bench_backends.json")
print("\n## Backends (bench_backends.py)\n")
if bb and bb.get("rows"):
    print(f"{len(bb['rows'])} rows measured on {bb['device']} ({bb['dtype']}, B={bb['B']}, H={bb['H']}).")
    print(f"\n- AUTO[{bb['device']!r}] now:       {tuple(bb['current_order'])}")
    print(f"- AUTO[{bb['device']!r}] suggested: {tuple(bb['suggested_order'])}")
    costs = bb.get("order_costs") or {}
    if costs:
        s, c = costs["suggested"], costs["current"]
        print(f"- the pick against each row's fastest backend: suggested order geometric mean "
              f"{s[0]:.2f}x (worst {s[1]:.2f}x), order now {c[0]:.2f}x (worst {c[1]:.2f}x)")
    print("\n| S | mask | pass | fastest | auto picks | auto / fastest |\n|---|---|---|---|---|---|")
    for r in bb["rows"]:
        takers = {n: t for n, t in r["times"].items() if n in r["takers"]}
        fastest = min(takers, key=takers.get) if takers else "-"
        print(f"| {r['S']} | {r['mask']} | {r['pass']} | {fastest} | {r['auto picks']} | {r['auto / best']:.2f}x |")
    for r in bb["rows"]:
        for backend, error in (r.get("errors") or {}).items():
            print(f"\nFAILED: {backend} at S={r['S']} {r['mask']} {r['pass']}: {error}")
else:
    print("no rows (see bench_backends.md)")
bd = load("bench_build.json")
print("\n## Build (bench_build.py)\n")
if bd and bd.get("rows"):
    print(f"on {bd['device']} ({bd['device_name']})\n")
    print("| mask | S | flexmask (ms) | torch compiled (ms) | compiled first call (s) | compiled / flexmask "
          "| same blocks | sync warnings | syncing ops | error |\n|---|---|---|---|---|---|---|---|---|---|")
    ms = lambda x: "-" if x is None else f"{x * 1e3:.2f}"
    for r in bd["rows"]:
        first = r.get("compiled_first_s")
        vs = r.get("vs_compiled")
        ops = ", ".join(f"{k} {v}" for k, v in (r.get("syncing_ops") or {}).items()) or "none"
        print(f"| {r['mask']} | {r['S']:,} | {ms(r.get('flexmask_s'))} | {ms(r.get('compiled_s'))} "
              f"| {'-' if first is None else f'{first:.1f}'} | {'-' if vs is None else f'{vs:.1f}x'} "
              f"| {r.get('same_blocks', '-')} | {'-' if r.get('sync_debug_warnings') is None else r['sync_debug_warnings']} | {ops} | {r.get('error', '')} {('torch: ' + r['compiled_error']) if 'compiled_error' in r else ''} |")
else:
    print("no rows (see bench_build.md)")
EOF

echo
if [ "$FAILED" = 0 ]; then
    echo "gpu_check: every step passed in $(($(date +%s) - START)) s; figures in $RESULTS"
else
    echo "gpu_check: some step FAILED (see $STEPS); figures in $RESULTS"
fi
exit "$FAILED"
