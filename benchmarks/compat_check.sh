#!/usr/bin/env bash
# The test suite on other releases of hetfl's dependencies than the development venv's: a fresh venv in
# VENV (default /tmp/hetfl-compat), hetfl with its test extras, then the given requirements installed over them,
# then the whole suite, `pytest -q -n auto --run-slow` (extra pytest arguments after --). Records pip's view
# of the venv beside the result.
# PYTHON (default python3) is the interpreter the venv is made from: another Python release.
#
#   bash benchmarks/compat_check.sh "torch==2.4.1"                           # the oldest torch pyproject allows
#   bash benchmarks/compat_check.sh "flwr[simulation]==1.42.0"               # a Flower release
#   bash benchmarks/compat_check.sh "torch==2.4.1" "numpy==1.26.4" "matplotlib==3.8.0" "rich==13.0.0" \
#       "safetensors==0.4.0" "tomli-w==1.0.0" -- -m "not slow"              # the floors of pyproject.toml
#   PYTHON=python3.13 bash benchmarks/compat_check.sh "torch==2.13.0"       # another Python (torch from PyPI)
#
# A torch other than the development machines' local CPU build (CPython 3.11 only) comes from PyPI with its CUDA libraries
# (~3 GB); without a torch among the requirements, TORCH (default torch==2.13.0: that local build) is installed.
# The suite runs on the CPU either way (HETFL_DEVICE=cpu is set by the tests' conftest).
# Results: benchmarks/results/compat_versions.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/hetfl-compat}
reqs=()
while [[ $# -gt 0 && "$1" != "--" ]]; do reqs+=("$1"); shift; done
[[ $# -gt 0 ]] && shift  # the "--"
# without a torch among the requirements, the development machines' local CPU build (as the README's install)
[[ " ${reqs[*]} " == *" torch"* ]] || reqs=("${TORCH:-torch==2.13.0}" "${reqs[@]}")
rm -rf "$VENV" && "${PYTHON:-python3}" -m venv "$VENV"
# the requirements first (with their own dependencies: torch's CUDA libraries), then hetfl with its test extras,
# which may move a floor up (flwr and import-linter want rich >= 14), then the requirements again over them
"$VENV/bin/pip" install -q "${reqs[@]}"
"$VENV/bin/pip" install -q -e ".[test]"
"$VENV/bin/pip" install -q --no-deps "${reqs[@]}"
"$VENV/bin/pip" check || true  # a test extra that wants a newer release than a floor says so here
"$VENV/bin/python" -c "import torch, numpy, flwr; import sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, 'flwr', flwr.__version__)"
"$VENV/bin/python" -m pytest -q -n auto --run-slow -p no:cacheprovider "$@"
