#!/usr/bin/env bash
# The CPU test suite against a libcquant built with AddressSanitizer + UndefinedBehaviorSanitizer.
#
# The tracked files are copied to a temporary directory and built there CPU-only with
# CQUANT_SANITIZE=address,undefined (setup.py adds -fno-sanitize-recover=all, so any undefined
# behaviour aborts the run). The interpreter itself is not instrumented, so the ASan runtime is
# preloaded to come first in the process. NumPy and torch both import and run under it, so
# every CPU test that reaches libcquant runs (the `cuda` ones skip: there is no GPU, and this build
# has no CUDA). Tests marked `pure_python` are left out: torch alone, nothing here to sanitize
# (tests/conftest.py fails such a test in the plain suite if it ever reaches libcquant).
# tests/test_leaks.py notices ASan and skips its heap and RSS bounds (ASan replaces malloc and
# keeps freed memory in quarantine); its reference-count, capsule and Python-allocation checks run.
#
# Usage: scripts/sanitize.sh [pytest args]     (PYTHON=... picks the interpreter, default python3)
#   WORKERS=N  runs the tests on N pytest-xdist workers (pip install pytest-xdist), each with one
#              OpenMP and torch thread (OMP_NUM_THREADS=1 unless set): on 2 cores, CI's WORKERS=2
#              takes 0.6 of one process's time (2 workers of 2 threads each: 0.8, 3 workers: 0.7).
#              libcquant's OpenMP loops then run on one thread, every iteration still checked.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
cc="${CC:-gcc}"
workers="${WORKERS:-1}"
work="$(mktemp -d "${TMPDIR:-/tmp}/cquant-sanitize.XXXXXX")"
trap 'rm -rf "$work"' EXIT

source "$repo/scripts/copy_source_tree.sh"
copy_source_tree "$repo" "$work" "$python"

cd "$work"
echo "sanitize: building a CPU-only libcquant with -fsanitize=address,undefined in $work"
CQUANT_CUDA=0 CQUANT_SANITIZE=address,undefined CC="$cc" MAX_JOBS="${MAX_JOBS:-2}" \
  "$python" setup.py -q build_ext --inplace >build.log 2>&1 || { cat build.log; exit 1; }
# ldd's output is captured first: with pipefail, `ldd | grep -q` fails whenever grep exits at the
# first match before ldd has written the rest (ldd then dies of SIGPIPE)
linked="$(ldd python/cquant/libcquant.so)"
if [[ "$linked" != *libasan* ]]; then
  echo "sanitize: python/cquant/libcquant.so is not linked against libasan" >&2
  exit 1
fi

asan_runtime="$("$cc" -print-file-name=libasan.so)"
if [[ ! -f "$asan_runtime" ]]; then
  echo "sanitize: $cc has no ASan runtime (libasan.so not found)" >&2
  exit 1
fi

export PYTHONPATH="$work/python"
export LD_PRELOAD="$asan_runtime${LD_PRELOAD:+:$LD_PRELOAD}"
# CPython and its extensions keep memory until exit by design: no leak report. Errors abort.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:symbolize=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

# make sure the instrumented copy is the one that gets imported
"$python" -c 'import sys, cquant; sys.exit(not cquant.__file__.startswith(sys.argv[1]))' "$work/python/" || {
  echo "sanitize: 'import cquant' does not load the sanitized build in $work/python" >&2
  exit 1
}

xdist=()
how=""
if [[ "$workers" != 1 ]]; then
  "$python" -c "import xdist" 2>/dev/null || {
    echo "sanitize: WORKERS=$workers needs pytest-xdist (pip install pytest-xdist)" >&2
    exit 1
  }
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  xdist=(-n "$workers")
  how=" on $workers workers, OMP_NUM_THREADS=$OMP_NUM_THREADS"
fi

echo "sanitize: running the CPU tests under ASan + UBSan$how"
# this build is CPU-only on purpose: on a GPU machine, tests/conftest.py would stop the run
export CQUANT_TEST_ALLOW_CPU_BUILD=1
# An exception raised inside a torch custom op crosses torch's C++ dispatcher; with the ASan runtime
# preloaded into the uninstrumented interpreter, that unwinding aborts the process (it does on an
# unchanged cquant too), so those few tests run only in the plain suite.
"$python" -m pytest -q -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} \
  -m "not cuda and not raises_in_torch_op and not pure_python" tests "$@"
