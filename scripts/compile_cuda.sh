#!/usr/bin/env bash
# Compiles libcquant with its CUDA kernels on a machine without a GPU (nvcc is enough), so the
# CUDA code cannot rot where no GPU runs it; then runs a few CPU tests against that build (a
# CUDA build must import and run its CPU path without a GPU or driver).
#
# Arches (CQUANT_CUDA_ARCHS, default "80;90a"): sm_80 compiles the branches for GPUs before Ada
# (code under __CUDA_ARCH__ < 890), sm_90a Hopper's wgmma kernels (__CUDA_ARCH_FEAT_SM90_ALL),
# and every CUDA build embeds compute_90 PTX, the generic path of sm_90 and newer. sm_89 has
# no code path of its own, so "80;90a" compiles every line the default 80;89;90a build does,
# in about three quarters of its time: 362 s on 2 cores (a CI run), then the CPU tests.
#
# The tracked files are copied to a temporary directory and built there.
# Usage: scripts/compile_cuda.sh     (PYTHON=... picks the interpreter, default python3)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/cquant-cuda.XXXXXX")"
trap 'rm -rf "$work"' EXIT

source "$repo/scripts/copy_source_tree.sh"
copy_source_tree "$repo" "$work" "$python"

cd "$work"
start=$SECONDS
echo "compile_cuda: building libcquant for ${CQUANT_CUDA_ARCHS:=80;90a} in $work"
CQUANT_CUDA_ARCHS="$CQUANT_CUDA_ARCHS" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  "$python" setup.py -q build_ext --inplace >build.log 2>&1 || { cat build.log; exit 1; }
grep "libcquant:" build.log
echo "compile_cuda: built in $((SECONDS - start)) s"

export PYTHONPATH="$work/python"
"$python" -c 'import sys, cquant
sys.exit(0 if cquant._C.built_with_cuda() and cquant.__file__.startswith(sys.argv[1]) else
         "compile_cuda: the build under test is not the CUDA build in " + sys.argv[1])' "$work/python/"
echo "compile_cuda: CPU tests against the CUDA build"
"$python" -m pytest -q -p no:cacheprovider -m "not cuda" tests/test_linear.py tests/test_quantize.py tests/test_attention.py
