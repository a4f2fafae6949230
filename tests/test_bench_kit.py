"""benchmarks/_timing.py: the interleaving, the median of medians and the per-repeat speed-ups,
checked on the CPU with a fake clock (the CUDA-event timer itself runs on the GPU machine)."""

import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import _timing  # noqa: E402


class FakeClock:
    """Each candidate's calls take the time its `plan` says for the current repeat; records the
    order in which candidates are timed."""

    def __init__(self, plan):
        self.plan, self.order, self.repeat = plan, [], {name: 0 for name in plan}

    def candidate(self, name):
        def fn():
            self.last = name
        return fn

    def timer(self, fn, iters, calls_per_run, flush):
        fn()
        name = self.last
        self.order.append(name)
        ms = self.plan[name][self.repeat[name]]
        self.repeat[name] += 1
        return [ms / calls_per_run] * (iters - 1) + [1000.0]  # one outlier per block: medians ignore it


def test_round_robin_in_rotating_order_and_median_of_medians():
    plan = {"base": [2.0, 2.4, 1.6], "fast": [1.0, 1.5, 1.0], "slow": [4.0, 4.0, 4.0]}
    clock = FakeClock(plan)
    out = _timing.interleaved({n: clock.candidate(n) for n in plan}, repeats=3, warmup=0, iters=5, baseline="base",
                              timer=clock.timer)
    assert clock.order == ["base", "fast", "slow", "fast", "slow", "base", "slow", "base", "fast"]
    assert out["base"].repeat_medians == [2.0, 2.4, 1.6]
    assert out["base"].median == 2.0 and out["base"].spread == (1.6, 2.4)
    # speed-ups pair the two medians of the same repeat: 2/1, 2.4/1.5, 1.6/1
    assert out["fast"].speedups == pytest.approx([2.0, 1.6, 1.6])
    assert out["fast"].speedup == pytest.approx(1.6) and out["fast"].speedup_spread == pytest.approx((1.6, 2.0))
    assert out["slow"].speedup == pytest.approx(0.5)
    assert out["base"].speedup == 1.0
    d = out["fast"].as_dict()
    assert d["ms"] == 1.0 and d["speedup"] == pytest.approx(1.6) and d["calls"] == 15


def test_calls_per_run_divides_and_warmup_runs_every_candidate():
    plan = {"graph": [10.0], "single": [1.0]}
    clock = FakeClock(plan)
    calls = []

    def counted(name):
        fn = clock.candidate(name)
        return lambda: (calls.append(name), fn())

    out = _timing.interleaved({"graph": (counted("graph"), 10), "single": counted("single")}, repeats=1, warmup=2,
                              iters=3, timer=clock.timer)
    assert out["graph"].median == 1.0 and out["single"].median == 1.0  # a graph of 10 calls: per call
    assert calls == ["graph", "graph", "single", "single", "graph", "single"]  # warm-up, then one timed block each


def test_unknown_baseline_is_an_error():
    with pytest.raises(ValueError, match="baseline"):
        _timing.interleaved({"a": lambda: None}, baseline="b", timer=lambda *a: [1.0])


def test_tflops_and_percentiles():
    # 2 M N K flops of a 4096 x 3072 x 3072 GEMM in 0.1 ms is 773 TFLOP/s
    assert _timing.tflops(2 * 4096 * 3072 * 3072, 0.1) == pytest.approx(773.094, rel=1e-5)
    p = _timing.percentiles([4.0, 1.0, 3.0, 2.0, 5.0], qs=(0, 10, 50, 100))
    assert p == {0: 1.0, 10: pytest.approx(1.4), 50: 3.0, 100: 5.0}


def test_rotating_cycles_through_the_sets():
    seen = []
    fn = _timing.rotating(seen.append, ["a", "b", "c"])
    for _ in range(5):
        fn()
    assert seen == ["a", "b", "c", "a", "b"]
