"""Latency of one benchmark cell: per-call times, their statistics, baseline and candidate interleaved.

How a latency is made (the method of benchmarks/_timing.py, for whole model calls):
  * each call is timed alone: on CUDA between two CUDA events on the current stream (queued work
    finishes first), on the CPU by the host's perf_counter; warm-up calls come first;
  * the baseline and the candidate are interleaved in one process: each of `repeats` repeats
    times `iters` calls of each, the order alternating from repeat to repeat, so clock or thermal
    drift moves both alike;
  * a cell's time is the median of its per-repeat medians, its spread the lowest and highest
    per-repeat median; its speed-up over the baseline is the median over repeats of
    (baseline's median / candidate's median) of the same repeat, with the min and max.
"""

from __future__ import annotations

import math
import statistics
import time

__all__ = ["time_runs", "latency_stats", "interleave"]


def time_runs(fn, *, warmup, iters, device):
    """Milliseconds of each of `iters` calls of fn() after `warmup` untimed calls: CUDA events
    around each call when `device` is a CUDA device, the host's perf_counter otherwise."""
    import torch

    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in pairs]
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _percentile(sorted_ms, q):
    """Linear interpolation between the closest ranks (numpy's default), q in [0, 100]."""
    if len(sorted_ms) == 1:
        return sorted_ms[0]
    pos = (len(sorted_ms) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


def latency_stats(ms):
    """{"mean", "min", "p50", "p90", "p99", "n"} of call times in milliseconds (percentiles by
    linear interpolation between ranks); ValueError on an empty list."""
    ms = [float(x) for x in ms]
    if not ms:
        raise ValueError("latency_stats needs at least one time")
    s = sorted(ms)
    return {"mean": statistics.fmean(s), "min": s[0], "p50": _percentile(s, 50), "p90": _percentile(s, 90),
            "p99": _percentile(s, 99), "n": len(s)}


def interleave(candidate, baseline, *, repeats, warmup, iters, device):
    """Time `candidate` against `baseline` (no-argument callables) interleaved, see the module
    docstring. baseline None: the candidate alone (it is the baseline itself, or --no-interleave).

    Returns {"candidate": {"runs": [[ms...] per repeat], "repeat_medians", "median", "spread"},
    "baseline": the same or None, "speedup": {"median", "min", "max", "repeats"} or None}."""
    if repeats < 1 or iters < 1 or warmup < 0:
        raise ValueError(f"repeats and iters must be at least 1 and warmup at least 0, got repeats={repeats}, "
                         f"iters={iters}, warmup={warmup}")
    names = ["candidate"] + (["baseline"] if baseline is not None else [])
    fns = {"candidate": candidate, "baseline": baseline}
    runs = {n: [] for n in names}
    for n in names:
        time_runs(fns[n], warmup=warmup, iters=0, device=device)
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            runs[n].append(time_runs(fns[n], warmup=0, iters=iters, device=device))
    out = {"baseline": None, "speedup": None}
    for n in names:
        medians = [statistics.median(x) for x in runs[n]]
        out[n] = {"runs": runs[n], "repeat_medians": medians, "median": statistics.median(medians),
                  "spread": [min(medians), max(medians)]}
    if baseline is not None:
        ratios = [b / c for b, c in zip(out["baseline"]["repeat_medians"], out["candidate"]["repeat_medians"])]
        out["speedup"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                          "repeats": ratios}
    return out
