#!/usr/bin/env bash
# On a GPU machine, from the repo root: build, run the CUDA tests, then the benchmarks named as
# arguments, and print a short summary last.
#
#   benchmarks/run_gpu.sh linear gemv          # or: all | none; names: linear linear_gelu gemv
#                                              #     dequant attention fused_ops flux_step
#
# Build: with CQUANT_PREBUILT_LIB=/path/libcquant.so (built elsewhere, e.g. `CQUANT_CUDA_ARCHS=90a
# python setup.py build_ext` on a machine without a GPU) only the small Python extension is
# compiled here, in seconds; otherwise setup.py compiles the CUDA kernels for the GPU present.
# Either way `pip install -e . --no-build-isolation` (the machine may have no network).
# CQUANT_WHEELS=dir installs the wheels in dir first (diffusers for the workflow tests and
# bench_flux_step, where the machine lacks it), offline.
#
# Output, all in $OUT (default gpu-results/), flat names, at most 8 files:
#   run_gpu.log          everything printed (build log, benchmark tables, this summary)
#   pytest_cuda.log      the CUDA tests
#   bench_<name>.json    each benchmark's full results
# Env: PYTEST_ARGS, BENCH_ARGS (e.g. --quick), TEST_TIMEOUT, BENCH_TIMEOUT (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ALL=(linear linear_gelu gemv dequant attention fused_ops flux_step)
benches=("$@")
[[ "${1:-}" == "all" ]] && benches=("${ALL[@]}")
[[ "${1:-}" == "none" ]] && benches=()
for b in "${benches[@]}"; do
  [[ -f "benchmarks/bench_$b.py" ]] || { echo "run_gpu.sh: no benchmark '$b' (expected: ${ALL[*]}, all, none)" >&2; exit 2; }
done
summary=()
step() {  # step NAME RC SECONDS RESULT
  summary+=("$(printf '%-20s %4s %8s  %s' "$1" "$2" "$3" "$4")")
}

main() {
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,compute_cap --format=csv
python3 -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")'

if [[ -n "${CQUANT_WHEELS:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps "$CQUANT_WHEELS"/*.whl || { echo "installing $CQUANT_WHEELS failed"; return 1; }
fi

start=$SECONDS
python3 -m pip install -e . --no-build-isolation --no-deps -v >"$OUT/build.tmp" 2>&1
rc=$?
grep -E "^ *libcquant:" "$OUT/build.tmp"
[[ $rc -eq 0 ]] || tail -40 "$OUT/build.tmp"
rm -f "$OUT/build.tmp"
step build "$rc" $((SECONDS - start)) "${CQUANT_PREBUILT_LIB:+extension on $CQUANT_PREBUILT_LIB}"
[[ $rc -eq 0 ]] || { printf '%s\n' "${summary[@]}"; return 1; }
python3 -c 'import cquant; print("cquant", cquant.__version__, "CUDA build:", cquant._C.built_with_cuda(), cquant.__file__)'

start=$SECONDS
timeout "${TEST_TIMEOUT:-1200}" python3 -m pytest -m cuda -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} >"$OUT/pytest_cuda.log" 2>&1
test_rc=$?
tail -25 "$OUT/pytest_cuda.log"
step "pytest -m cuda" "$test_rc" $((SECONDS - start)) "$(tail -1 "$OUT/pytest_cuda.log" | tr -d '=' | sed 's/^ *//')"

for b in "${benches[@]}"; do
  echo; echo "== bench_$b ${BENCH_ARGS:-}"
  start=$SECONDS
  timeout "${BENCH_TIMEOUT:-900}" python3 "benchmarks/bench_$b.py" --out "$OUT/bench_$b.json" ${BENCH_ARGS:-}
  rc=$?
  step "bench_$b" "$rc" $((SECONDS - start)) "$OUT/bench_$b.json"
done

echo; echo "== headline numbers (median speed-up over each benchmark's baseline; ranges in the JSON)"
python3 benchmarks/_summary.py "$OUT"/bench_*.json 2>/dev/null
echo; printf '%-20s %4s %8s  %s\n' step rc seconds result
printf '%s\n' "${summary[@]}"
return "$test_rc"
}

main 2>&1 | tee "$OUT/run_gpu.log"
exit "${PIPESTATUS[0]}"
