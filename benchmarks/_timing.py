"""The timing kit of cquant's benchmarks: one way to time, compare and describe.

    from _timing import interleaved, rotating, describe, speedup_table

    result = interleaved({"torch_bf16": rotating(f_bf16, sets), "fp8dqrow": rotating(f_fp8, sets)},
                         baseline="torch_bf16")
    result["fp8dqrow"].speedup      # median over repeats of (baseline / candidate), see Timing

How a number is made (DESIGN.md, "Numbers we measure by"):
  * each call is timed with a pair of CUDA events on the current stream, after warm-up calls;
  * the L2 cache cannot flatter a call: inputs rotate over sets larger than the L2 (`rotating`,
    `sets_for_l2`), or, with flush_l2=True, an L2-sized buffer is overwritten before each call;
  * candidates are interleaved: each repeat times every candidate in turn (the order rotating
    from repeat to repeat), so a clock or thermal drift between repeats moves the baseline
    and the candidate alike; a baseline timed once, first, moved +-15% between runs;
  * each candidate's time is the median over repeats of the per-repeat medians, its spread the
    lowest and highest per-repeat median; the speed-up over the baseline is computed per
    repeat (the two medians of the same repeat) and reported as the median with its min / max.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

import cquant
from cquant.demo import text_table  # noqa: F401  (the benchmarks' tables look like the demo's)

REPEATS = 5
WARMUP = 3
ITERS = 20


# ---------------------------------------------------------------- inputs


def l2_bytes():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def sets_for_l2(bytes_per_set, factor=4, most=64):
    """How many input sets to rotate over so that together they exceed `factor` L2 caches."""
    return max(2, min(most, math.ceil(factor * l2_bytes() / max(1, bytes_per_set))))


def rotating(fn, sets):
    """A no-argument callable calling fn(set) with the next of `sets` at each call."""
    cycle = itertools.cycle(sets)
    return lambda: fn(next(cycle))


_flush_buffer = None


def flush_l2():
    """Overwrite a buffer twice the L2's size, evicting whatever the last call left there."""
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(2 * l2_bytes(), dtype=torch.uint8, device="cuda")
    _flush_buffer.zero_()


def graphed(calls):
    """(replay, len(calls)): one CUDA graph of the no-argument calls, for interleaved(): kernels
    of a few microseconds are timed without the host's launch gaps. The calls run once eagerly on
    a side stream first (cuBLAS picks its kernels, modules load), as torch recommends."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return graph.replay, len(calls)


# ---------------------------------------------------------------- timing


def time_calls(fn, iters=ITERS, calls_per_run=1, flush=False):
    """Milliseconds per call of `iters` runs of fn(), each between two CUDA events on the current
    stream; fn may make calls_per_run calls (a CUDA graph of several, say). Work queued before
    (warm-up calls) finishes first, so it does not delay the first run."""
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if flush:
            flush_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / calls_per_run for s, e in zip(starts, ends)]


def tflops(flops, ms):
    """TFLOP/s of `flops` floating-point operations done in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def wall_time_calls(fn, iters=ITERS, calls_per_run=1, flush=False):
    """time_calls for work on the CPU: host wall time (ms) per call of each run."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3 / calls_per_run)
    return out


def percentiles(samples, qs=(10, 50, 90)):
    """{q: value} of the samples, linearly interpolated (q in percent)."""
    xs = sorted(samples)
    if not xs:
        return {q: math.nan for q in qs}
    out = {}
    for q in qs:
        pos = (len(xs) - 1) * q / 100.0
        lo, hi = math.floor(pos), math.ceil(pos)
        out[q] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


@dataclass
class Timing:
    """One candidate of an interleaved run. Times in milliseconds per call."""

    name: str
    repeat_medians: list = field(default_factory=list)  # median of each repeat's calls
    samples: list = field(default_factory=list)  # every timed call
    speedups: list = field(default_factory=list)  # baseline / this, per repeat (empty without a baseline)

    @property
    def median(self):
        """The median of the per-repeat medians."""
        return statistics.median(self.repeat_medians)

    @property
    def spread(self):
        """(lowest, highest) per-repeat median."""
        return min(self.repeat_medians), max(self.repeat_medians)

    @property
    def speedup(self):
        """Median over repeats of baseline time / this time (> 1: faster than the baseline)."""
        return statistics.median(self.speedups) if self.speedups else math.nan

    @property
    def speedup_spread(self):
        return (min(self.speedups), max(self.speedups)) if self.speedups else (math.nan, math.nan)

    def as_dict(self):
        p = percentiles(self.samples)
        out = dict(ms=self.median, ms_min=self.spread[0], ms_max=self.spread[1],
                   ms_repeats=self.repeat_medians, ms_p10=p[10], ms_p90=p[90], calls=len(self.samples))
        if self.speedups:
            out.update(speedup=self.speedup, speedup_min=self.speedup_spread[0], speedup_max=self.speedup_spread[1],
                       speedup_repeats=self.speedups)
        return out


def interleaved(candidates, repeats=REPEATS, warmup=WARMUP, iters=ITERS, baseline=None, flush=False,
                timer=time_calls):
    """Time every candidate round-robin in each of `repeats` repeats; {name: Timing}.

    candidates: {name: fn} or {name: (fn, calls_per_run)}, fn taking no argument (see
    `rotating`). Each candidate first runs `warmup` times (cuBLAS heuristics, lazy module
    loading), then each repeat times `iters` runs of each, in an order that rotates from repeat to
    repeat. baseline: the name every Timing.speedup is computed against, per repeat. timer(fn,
    iters, calls_per_run, flush) returns the milliseconds per call of each run (time_calls).
    """
    specs = {name: (c if isinstance(c, tuple) else (c, 1)) for name, c in candidates.items()}
    if baseline is not None and baseline not in specs:
        raise ValueError(f"baseline {baseline!r} is not among the candidates {list(specs)}")
    for fn, _ in specs.values():
        for _ in range(warmup):
            fn()
    names = list(specs)
    out = {name: Timing(name) for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, calls = specs[name]
            times = timer(fn, iters, calls, flush)
            out[name].samples += times
            out[name].repeat_medians.append(statistics.median(times))
    if baseline is not None:
        base = out[baseline].repeat_medians
        for t in out.values():
            t.speedups = [b / c for b, c in zip(base, t.repeat_medians)]
    return out


# ---------------------------------------------------------------- description of a run


def _cublaslt_version():
    """cuBLASLt's version as the process loaded it (cquant opens it on its first CUDA GEMM; so
    does torch), read from the library itself; None when none is loaded."""
    version = getattr(cquant._C, "cublaslt_version", None)
    if callable(version):
        return version()
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcublasLt" in line and line.split()[-1].startswith("/")})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            return int(lib.cublasLtGetVersion())
        except (OSError, AttributeError):
            continue
    return None


def _driver_version():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def headline(rows, name_key, baseline, note=""):
    """{"baseline", "note", "speedup": {name: median over rows}} of rows holding "speedup": the
    one-line result run_gpu.sh prints (benchmarks/_summary.py)."""
    by = {}
    for r in rows:
        if r[name_key] != baseline and r.get("speedup") is not None:
            by.setdefault(r[name_key], []).append(r["speedup"])
    return dict(baseline=baseline, note=note, speedup={k: statistics.median(v) for k, v in by.items()})


def describe():
    """What a result was measured with: card, driver, torch, CUDA, cuBLASLt, cquant, host. Call it
    after the benchmark ran (cuBLASLt is loaded by the first GEMM)."""
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                host=platform.node(), cquant=cquant.__version__, cquant_cuda_build=cquant._C.built_with_cuda())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(device=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    l2_mb=round(props.L2_cache_size / 2**20, 1), memory_gb=round(props.total_memory / 1e9, 1),
                    driver=_driver_version(), cublaslt=_cublaslt_version())
    return info


def describe_line(info):
    """One line for the head of a printed table."""
    parts = [info.get("device", "no GPU"), f"torch {info['torch']}", f"CUDA {info['cuda']}"]
    if info.get("cublaslt"):
        parts.append(f"cuBLASLt {info['cublaslt']}")
    if info.get("driver"):
        parts.append(f"driver {info['driver']}")
    parts.append(f"cquant {info['cquant']}")
    return ", ".join(parts)


def require_cuda(name):
    """Exit with a clear message where the benchmark cannot run (no GPU, or a CPU-only cquant)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA GPU; torch {torch.__version__} sees none")
    if not cquant._C.built_with_cuda():
        raise SystemExit(f"{name} needs cquant built with its CUDA kernels; this one "
                         f"({os.path.dirname(cquant.__file__)}) is CPU-only (see the README's Build section)")


def with_env(fn, env):
    """fn with os.environ set to env for each call (libcquant reads its switches once, so it is
    asked to read them again each time they change)."""
    def call(*args):
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        cquant.ops.reload_settings()
        try:
            return fn(*args)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            cquant.ops.reload_settings()
    return call


# ---------------------------------------------------------------- output


def fmt_speedup(t):
    """'1.23x (1.20-1.26)': the median speed-up over the baseline and its per-repeat range, of a
    Timing or of its as_dict()."""
    d = t.as_dict() if isinstance(t, Timing) else t
    if "speedup" not in d:
        return "-"
    return f"{d['speedup']:.2f}x ({d['speedup_min']:.2f}-{d['speedup_max']:.2f})"
