#!/usr/bin/env bash
# Release check: flexmask's core tests on one torch release, in a venv of its own.
#
#   scripts/check_torch_range.sh VERSION              # the core test files, not the slow tests
#   scripts/check_torch_range.sh VERSION ARGS...      # ARGS go to pytest instead of the defaults
#
# The venv ($TORCH_RANGE_VENV, default /tmp/flexmask-torch-VERSION) is made once and reused
# while it holds that torch. torch comes from pip's configured sources, or from
# $TORCH_INDEX_URL when set: on Linux a plain PyPI torch is the CUDA build (~3 GB of downloads,
# ~5 GB installed; it runs on a machine without a GPU), PyTorch's CPU index gives the CPU one.
# The repository is tested in place (PYTHONPATH), never installed, so nothing outside the venv
# changes. tests/test_structure_torch_range.py fails by name when VERSION is outside pyproject's range:
# if everything else passes, widen the range and list the version in docs/getting-started.md.
set -euo pipefail

if [ $# -lt 1 ] || [[ ! $1 =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
    echo "usage: $0 VERSION [pytest args...]   (VERSION like 2.14.1, got '${1:-}')" >&2
    exit 2
fi
version=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${TORCH_RANGE_VENV:-/tmp/flexmask-torch-$version}
python=${PYTHON:-python3}

has_torch() {  # the venv's torch is VERSION (2.14.1 matches 2.14.1+cu130 and 2.14.1+cpu)
    [ -x "$venv/bin/python" ] && "$venv/bin/python" -c \
        "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null
}

if ! has_torch; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    start=$SECONDS
    "$venv/bin/python" -m pip install -q "torch==$version" \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    "$venv/bin/python" -m pip install -q pytest hypothesis numpy cachetools packaging
    # attn-gym declares torch without a bound: --no-deps keeps the torch under test.
    "$venv/bin/python" -m pip install -q --no-deps "attn-gym>=0.0.10"
    echo "installed torch $version and the test tools in $((SECONDS - start)) s;" \
        "$venv holds $(du -sh "$venv" | cut -f1) (remove it with: rm -rf $venv)"
fi

asked=("$@")
if [ $# -eq 0 ]; then
    set -- -m "not slow" tests/test_structure_torch_range.py tests/test_build.py tests/test_build_dropin.py \
        tests/test_build_closed_form.py tests/test_build_offsets.py tests/test_lazy.py \
        tests/test_attention.py tests/test_backends_block_sparse.py tests/test_algebra.py \
        tests/test_pieces_errors.py
fi

cd "$root"
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'at', torch.__file__)"
start=$SECONDS
status=0
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$root" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" || status=$?
echo "torch $version: pytest exit $status in $((SECONDS - start)) s" \
    "(command: scripts/check_torch_range.sh $version${asked[*]:+ ${asked[*]}})"
exit "$status"
