"""pytest-benchmark entry points of the kernel benchmarks (benchmarks/test_bench_*.py):

    pytest benchmarks/ --benchmark-only

Every reported time is seconds per call: a round is `iterations` calls between two readings of
synchronized_clock, which waits for the current CUDA stream first, and pytest-benchmark divides
a round by its iterations. Each shape is one group, so the baseline and its candidates share a
table; extra_info holds TFLOP/s or GB/s of the per-call median. The bench_*.py scripts stay the
benchmarks of record (CUDA events, interleaved baselines, CUDA graphs for the small kernels):
calls here are launched eagerly, so a kernel shorter than its launch measures the host.
Without a CUDA GPU, a CUDA build of cquant or pytest-benchmark, every benchmark skips.
"""

import sys
import time
from pathlib import Path

import pytest
import torch

import cquant

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the bench scripts and their kits import each other by module name

CALLS = 10  # calls per round, timed together: a round's queue keeps the GPU busy
ROUNDS = 20
WARMUP_ROUNDS = 2


def _missing(config):
    """Why the benchmarks cannot run here; None where they can."""
    if not config.pluginmanager.has_plugin("benchmark"):
        return "pytest-benchmark is not installed (pip install '.[bench]') or not loaded"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if not cquant._C.built_with_cuda():
        return "needs cquant built with its CUDA kernels"
    return None


def pytest_addoption(parser, pluginmanager):
    if not pluginmanager.has_plugin("benchmark"):  # the documented command still runs, and skips
        parser.addoption("--benchmark-only", action="store_true",
                         help="(pytest-benchmark is not installed: every benchmark skips)")


def synchronized_clock():
    """time.perf_counter once the work queued on the current CUDA stream has finished."""
    torch.cuda.current_stream().synchronize()
    return time.perf_counter()


def pytest_collection_modifyitems(config, items):
    reason = _missing(config)
    for item in items:
        if HERE not in item.path.resolve().parents or "benchmark" not in getattr(item, "fixturenames", ()):
            continue
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        own = item.get_closest_marker("benchmark")
        item.add_marker(pytest.mark.benchmark(**dict(own.kwargs if own else {}, timer=synchronized_clock)),
                        append=False)


@pytest.fixture
def per_call(benchmark):
    """per_call(fn, group, flops=None, nbytes=None): time fn() (one call, queued on the current
    stream) in ROUNDS rounds of CALLS calls after WARMUP_ROUNDS rounds, as one entry of the
    table `group`; extra_info gets "tflops" (flops per call) and "gbps" (bytes moved per call)."""
    def run(fn, group, flops=None, nbytes=None):
        benchmark.group = group
        benchmark.pedantic(fn, iterations=CALLS, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
        if benchmark.stats is None:  # --benchmark-disable: fn ran once, untimed
            return None
        seconds = benchmark.stats.stats.median  # per call: pytest-benchmark divided by CALLS
        if flops is not None:
            benchmark.extra_info["tflops"] = flops / seconds / 1e12
        if nbytes is not None:
            benchmark.extra_info["gbps"] = nbytes / seconds / 1e9
        return seconds
    return run
