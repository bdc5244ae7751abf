#!/usr/bin/env bash
# The GPU checks of the vectorised executor, as one script for a lent GPU machine (see benchmarks/README.md):
# "quick" (one call, ~8 min): the throughput table (graph + bf16, with calls of 4 steps, the default since
# session 19, and of 16), the plain vmap + CUDA-graph reference of the same round and a step's time by width
# (vmap_reference.py: cnn2's round, and CCVR's simple_cnn at its widths, its round priced with them), CCVR's
# Table 2 timing (float32, bf16, bf16 with 16-step calls: round 1 builds the graphs), and how far DANN's vectorised clients are from its
# sequential ones on CUDA (cuda_equality.py); "suite" (the next call, ~2 min): the quick test suite with CUDA
# present (SUITE_ALL=1 SUITE_S=240: the whole suite); "reference": vmap_reference.py alone, both precisions;
# "kernels": k clients' convolutions several ways; "compile" (~9 min): runtime.compile (steps compiled by
# torch.compile) against graph_bf16, throughput and CCVR; "profile": a profile of one round, and of CCVR's first
# round (its builds by phase); "memory" (~3 min, not in "all"): device memory and CUDA graphs kept over 300
# rounds of 100 sampled clients of 1,000 (vectorised, graph mode).
# Results under $OUT (or gpu-out/). Data: DATA (default .gpu-data) holding cifar10-jpeg.tar.gz.
#   bash benchmarks/gpu_check.sh [lease|quick|suite|reference|kernels|compile|profile|memory|all]
set -uo pipefail
OUT=${OUT:-gpu-out}; DATA=${DATA:-.gpu-data}; WHAT=${1:-all}
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
if [[ $WHAT == quick || $WHAT == all ]]; then  # quick: about 8 minutes, one call of a 15-minute lease
  timeout ${THROUGHPUT_S:-210} python3 benchmarks/throughput.py --data "$DATA" --dataset cifar10 --models cnn2 \
    --clients 20 --batch-sizes 64 10 --variants ${VARIANTS:-graph_bf16 graph_bf16_b16} --out "$OUT/results" 2>&1 | tail -8
fi
if [[ $WHAT == quick || $WHAT == reference || $WHAT == all ]]; then
  # what a plain vmap + CUDA graph does with the same round (issue 29's prototype), lockstep, shrinking and
  # shrinking with hetfl's layer rules, and
  # a step's ms by width; CCVR's model at its widths (its rounds are a sum of this curve over ~1,580 steps)
  precisions=(bf16); [[ $WHAT == reference ]] && precisions=(bf16 fp32)
  timeout ${REFERENCE_S:-120} python3 benchmarks/vmap_reference.py --data "$DATA" --model cnn2 --clients 20 \
    --batch-sizes 64 10 --precisions "${precisions[@]}" --out "$OUT/results" 2>&1 | tail -6
  timeout 45 python3 benchmarks/vmap_reference.py --data "$DATA" --model simple_cnn --clients 10 --batch-sizes 64 \
    --precisions fp32 bf16 --layouts --ccvr --out "$OUT/results" 2>&1 | tail -5
fi
if [[ $WHAT == suite || $WHAT == all ]]; then  # the CUDA-only tests run in it
  # SUITE_ALL=1: the whole suite (issue 29's Done-means: pytest -q with CUDA present), slow tests too
  marks=(-m "not slow"); [[ ${SUITE_ALL:-0} == 1 ]] && marks=(--run-slow)
  HETFL_TEST_INDUCTOR=1 timeout ${SUITE_S:-150} python3 -m pytest -n 14 "${marks[@]}" -p no:cacheprovider -q -rf \
    2>&1 | tee "$OUT/suite.log" | tail -40
fi
if [[ $WHAT == quick || $WHAT == all ]]; then
  # fp32 beside bf16: at CCVR's widths a step is latency-bound, and bf16 adds 31 casts to its 65 kernels; calls
  # of 16 steps beside 4 (round 1: 281 steps run twice in Python to build 51 graphs, against 73 for 34)
  timeout 115 python3 benchmarks/ccvr_time_to_accuracy.py --data "$DATA" --variants graph graph_bf16 graph_bf16_b16 \
    --budget-each-s ${CCVR_BUDGET_S:-32} --runs /tmp/ccvr_time --out "$OUT/results" 2>&1 | tail -8
  timeout 60 python3 benchmarks/cuda_equality.py --methods dann fedavg --steps 1 2 10 2>&1 \
    | tee "$OUT/results/cuda_equality.md" | tail -9
fi
if [[ $WHAT == kernels ]]; then
  timeout 60 python3 benchmarks/conv_kernels.py --clients 20 --batch-size 64 --dtype bf16 --check 2>&1 \
    | tee -a "$OUT/results/conv_kernels_cuda.md" | tail -9
fi
if [[ $WHAT == compile ]]; then  # runtime.compile against graph_bf16 (~8 min: its compiles are in the warm-up)
  timeout ${THROUGHPUT_S:-330} python3 benchmarks/throughput.py --data "$DATA" --dataset cifar10 --models cnn2 \
    --clients 20 --batch-sizes 64 --variants graph_bf16 graph_bf16_compiled --skip-peer --out "$OUT/results" 2>&1 | tail -4
  timeout 200 python3 benchmarks/ccvr_time_to_accuracy.py --data "$DATA" --variants graph_bf16_compiled \
    --budget-s 180 --runs /tmp/ccvr_time --out "$OUT/results" 2>&1 | tail -4
fi
if [[ $WHAT == profile ]]; then  # PROFILE_VARIANTS: of profile_round.py's (the eager step: vectorized)
  for variant in ${PROFILE_VARIANTS:-graph_bf16 vectorized}; do
    timeout 90 python3 benchmarks/profile_round.py --data "$DATA" --variant "$variant" --out "$OUT/results" 2>&1 | tail -30
  done
  # CCVR's shape, round 1 (20 s of its 165 s on an H100 in session 17): where its CUDA graphs' builds go
  timeout 150 python3 benchmarks/profile_round.py --data "$DATA" --model simple_cnn --clients 10 --local-epochs 10 \
    --augment crop_flip --variant graph_bf16 --round 1 --out "$OUT/results" 2>&1 | tail -40
fi
if [[ $WHAT == lease ]]; then  # issue 29's Done-means in one call of a 15-minute lease, by priority, within LEASE_S
  # (default 520 s: a step gets the time left, at most its own cap, and is skipped with under 30 s left):
  # 1. the quick suite with CUDA present (Done-means: 0 failures; session 45's fixes have not run on a GPU);
  # 2. the throughput table at batch 64 with runtime.compile (graph + bf16 + torch.compile) beside graph + bf16,
  #    the one lever toward 25x never measured on a whole round (conv_kernels_cuda.md: the compiled encoder step
  #    1.55x plain vmap); batch 64 and 10 as two calls, so that one whose compiles run long keeps the other's row;
  # 3. CCVR's Table 2 setting, 100 rounds of graph + bf16 whole (session 45: projected from 30 rounds at 105 s);
  # 4. the batch-10 row; 5. DANN's CUDA difference by steps (results/kink_sensitivity_cpu.md)
  deadline=$((SECONDS + ${LEASE_S:-520}))
  budget() { local left=$((deadline - SECONDS)); ((left > $1)) && left=$1; echo $((left < 30 ? 0 : left)); }
  step() { local s; s=$(budget "$1"); shift; if ((s == 0)); then echo "skipped (lease time spent): $*"; return; fi
           echo "== $* (at most ${s} s)"; timeout "$s" "$@"; }
  step ${SUITE_S:-150} python3 -m pytest -n 14 -p no:cacheprovider -q -rf 2>&1 | tee "$OUT/suite.log" | tail -40
  for bs in 64 10; do
    ((bs == 10)) && step 140 python3 benchmarks/ccvr_time_to_accuracy.py --data "$DATA" --variants graph_bf16 \
      --budget-each-s ${CCVR_BUDGET_S:-120} --runs /tmp/ccvr_time --out "$OUT/results" 2>&1 | tail -8
    step ${THROUGHPUT_S:-170} python3 benchmarks/throughput.py --data "$DATA" --dataset cifar10 --models cnn2 \
      --clients 20 --batch-sizes $bs --variants ${VARIANTS:-graph_bf16 graph_bf16_compiled} --out "$OUT/results" \
      2>&1 | tail -6
  done
  step 45 python3 benchmarks/cuda_equality.py --methods dann --steps 1 2 10 2>&1 \
    | tee "$OUT/results/cuda_equality.md" | tail -6
fi
if [[ $WHAT == memory ]]; then  # is the device memory of a long run of sampled clients flat; what a kept graph costs
  timeout ${MEMORY_S:-200} python3 benchmarks/memory_long.py --rounds 300 --every 10 --set runtime.device=cuda \
    --set runtime.executor=vectorized --out "$OUT/results/memory_long_cuda" 2>&1 | tail -22
fi
