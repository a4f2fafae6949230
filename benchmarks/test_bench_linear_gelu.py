"""bench_linear_gelu through pytest-benchmark: linear then tanh GELU, cquant with the GELU in its
kernel (and unfused) against torch's fused cuBLASLt GELU epilogue (and unfused), at Flux's MLP
shapes, one table per shape; extra_info: TFLOP/s per call. See conftest.py.

    pytest benchmarks/test_bench_linear_gelu.py --benchmark-only
"""

import pytest

from _timing import rotating
from bench_linear import capability
from bench_linear_gelu import BASELINE, SCHEMES, SHAPES, candidates, make_sets
from cquant.schemes import scheme

UNFUSED = ":unfused"  # bench_linear_gelu's suffix of a scheme followed by F.gelu
METHODS = [BASELINE, "torch_unfused", *(name + suffix for name in SCHEMES for suffix in ("", UNFUSED))]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_gelu(per_call, shape, method):
    m, k, n = shape
    name = method.removesuffix(UNFUSED)
    names = [] if name in (BASELINE, "torch_unfused") else [name]
    if names and capability() < scheme(name).min_compute_capability:
        pytest.skip(f"{name} needs sm_{scheme(name).min_compute_capability}+")
    sets = make_sets(m, k, n)
    per_call(rotating(candidates(sets, names, k)[method], sets), group=f"linear_gelu {m}x{k}x{n}",
             flops=2.0 * m * n * k)
