#!/usr/bin/env bash
# On a GPU machine, from the repo root: build, run the CUDA tests, then the benchmarks named
# as arguments (linear, gemv, attention, flux_step). Logs and JSON go to $OUT (default gpu-results/);
# a short summary is printed last.
#   benchmarks/run_gpu.sh linear attention
# Env: CQUANT_CUDA_ARCHS (default 90a here: the machine's own arch only), PYTEST_ARGS, BENCH_ARGS.
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

start=$(date +%s)
MAX_JOBS=$(nproc) CQUANT_CUDA_ARCHS=${CQUANT_CUDA_ARCHS:-90a} \
  python3 -m pip install -e . --no-build-isolation -q >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"

timeout ${TEST_TIMEOUT:-1200} python3 -m pytest -m cuda -q -rs ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
test_rc=${PIPESTATUS[0]}

for bench in "$@"; do
  timeout ${BENCH_TIMEOUT:-900} python3 "benchmarks/bench_${bench}.py" --out "$OUT/bench_${bench}.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench_${bench}.log" | tail -60
done
echo "pytest -m cuda exit code: $test_rc"
