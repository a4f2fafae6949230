"""bench_linear through pytest-benchmark (not collected by the default run, whose testpaths is tests/).

    pytest benchmarks/test_bench_linear.py --benchmark-columns=median,ops

Each case times one cquant scheme (activation quantization included) or torch's bf16 F.linear on
a real model shape: a round is CALLS calls and one synchronize; pytest-benchmark reports the
time per round divided by its iterations, so extra_info["tflops"] divides by CALLS as well.
(bench_linear.py is the benchmark of record: CUDA events and interleaved baselines.)
"""

import math
import os
import sys

import pytest

pytest.importorskip("pytest_benchmark")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.nn.functional as F  # noqa: E402
from _timing import tflops  # noqa: E402
from _variants import linear_kwargs, parse, quantize_weight  # noqa: E402
from bench_linear import capability  # noqa: E402

from cquant import ops  # noqa: E402
from cquant.schemes import SCHEME_NAMES  # noqa: E402

SHAPES = [(4608, 3072, 3072), (4608, 3072, 12288), (4608, 15360, 3072), (8256, 3840, 10240), (1, 3072, 18432)]
CALLS = 10


def _setup(m, k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    return x, w, b


def _bench(benchmark, fn, m, k, n):
    def run():
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
    seconds_per_call = benchmark.stats.stats.median / CALLS
    benchmark.extra_info["tflops"] = tflops(2.0 * m * n * k, seconds_per_call * 1e3)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_torch_bf16(benchmark, shape):
    x, w, b = _setup(*shape)
    _bench(benchmark, lambda: F.linear(x, w, b), *shape)


@pytest.mark.parametrize("name", SCHEME_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cquant(benchmark, shape, name):
    s = parse(name).scheme
    if capability() < s.min_compute_capability:
        pytest.skip(f"{name} needs sm_{s.min_compute_capability}+")
    if s.refusal(shape[1], shape[2]):
        pytest.skip(s.refusal(shape[1], shape[2]))
    x, w, b = _setup(*shape)
    kw = linear_kwargs(s, shape[1])
    qw, sw = quantize_weight(s, w)
    _bench(benchmark, lambda: ops.linear(x, qw, sw, bias=b, **kw), *shape)
