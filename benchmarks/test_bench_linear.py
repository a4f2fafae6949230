"""bench_linear through pytest-benchmark (not collected by the default run, whose testpaths is tests/).

    pytest benchmarks/test_bench_linear.py --benchmark-columns=median,ops

Each case times one cquant scheme (activation quantization included) or torch's bf16 F.linear on
a real model shape; extra_info carries TFLOP/s.
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
import bench_linear  # noqa: E402
from cquant import ops  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = [(4608, 3072, 3072), (4608, 3072, 12288), (4608, 15360, 3072), (8256, 3840, 10240), (1, 3072, 18432)]


def _setup(m, k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    return x, w, b


def _bench(benchmark, fn, m, k, n):
    def run():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20, iterations=5, warmup_rounds=2)
    benchmark.extra_info["tflops"] = 2.0 * m * n * k / benchmark.stats.stats.median / 1e12 * 5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_torch_bf16(benchmark, shape):
    x, w, b = _setup(*shape)
    _bench(benchmark, lambda: F.linear(x, w, b), *shape)


@pytest.mark.parametrize("scheme", list(bench_linear.SCHEMES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cquant(benchmark, shape, scheme):
    wf, wg, af, ag = bench_linear.SCHEMES[scheme]
    if af and af.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 activations need sm_89+")
    x, w, b = _setup(*shape)
    qw, sw = ops.quantize(w, wf, wg)
    kw = dict(weight_format=wf, weight_granularity=wg, act_format=af, act_granularity=ag, bias=b, in_features=shape[1])
    _bench(benchmark, lambda: ops.linear(x, qw, sw, **kw), *shape)
