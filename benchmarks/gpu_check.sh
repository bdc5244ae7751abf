#!/usr/bin/env bash
# The GPU checks of the vectorised executor, as one script for a lent GPU machine (see
# benchmarks/README.md): the CUDA-only tests, the throughput table, a profile of one round,
# CCVR's Table 2 timing, then the test suite with CUDA present. Results under $OUT (or
# gpu-out/). Data: DATA (default .gpu-data) holding cifar10-jpeg.tar.gz.
#   bash benchmarks/gpu_check.sh [quick|suite|all]
set -uo pipefail
OUT=${OUT:-gpu-out}; DATA=${DATA:-.gpu-data}; WHAT=${1:-all}
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
if [[ $WHAT == quick || $WHAT == all ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_vectorized_host.py \
    tests/engine/test_vectorized_static.py -k "cuda" 2>&1 | tee "$OUT/cuda_tests.log" | tail -25
  timeout 240 python3 benchmarks/throughput.py --data "$DATA" --dataset cifar10 --models cnn2 --clients 20 \
    --batch-sizes 10 64 --out "$OUT/results" 2>&1 | tail -8
  timeout 60 python3 benchmarks/profile_round.py --data "$DATA" --variant graph_bf16 --out "$OUT/results" 2>&1 | tail -30
  for bs in 64 10; do
    timeout 60 python3 benchmarks/conv_kernels.py --clients 20 --batch-size $bs --dtype bf16 --check 2>&1 \
      | tee -a "$OUT/results/conv_kernels_cuda.md" | tail -8
  done
  timeout 150 python3 benchmarks/ccvr_time_to_accuracy.py --data "$DATA" --variants graph_bf16 --budget-s ${CCVR_BUDGET_S:-130} \
    --runs /tmp/ccvr_time --out "$OUT/results" 2>&1 | tail -8
fi
if [[ $WHAT == suite || $WHAT == all ]]; then
  timeout ${SUITE_S:-280} python3 -m pytest -n 14 -m "not slow" -p no:cacheprovider -q -rf \
    2>&1 | tee "$OUT/suite.log" | tail -40
fi
