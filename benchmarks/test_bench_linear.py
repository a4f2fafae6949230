"""bench_linear through pytest-benchmark: torch's bf16 F.linear and every cquant scheme
(cquant.schemes, activation quantization included) on bench_linear's real model shapes, one
table per shape; extra_info: TFLOP/s and GB/s per call. See conftest.py.

    pytest benchmarks/test_bench_linear.py --benchmark-only
"""

import pytest

from _timing import rotating, sets_for_l2
from bench_linear import BASELINE, GROUPS, cquant_candidates, load_shapes, make_sets, torch_baselines
from cquant.schemes import SCHEME_NAMES

SHAPES = load_shapes(GROUPS)


@pytest.mark.parametrize("method", [BASELINE, *SCHEME_NAMES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['M']}x{s['K']}x{s['N']}")
def test_linear(per_call, shape, method):
    m, k, n = shape["M"], shape["K"], shape["N"]
    sets = make_sets(m, k, n, sets_for_l2(2 * (m * k + n * k)), seed=0)
    if method == BASELINE:
        fns = torch_baselines(sets, m, k, n, bf16_only=True)
    else:  # a scheme this card or shape does not take is left out, with why
        why = []
        fns = cquant_candidates(sets, [method], k, n, why.append)
        if method not in fns:
            pytest.skip(" ".join(why).strip())
    fn, weight_bytes = fns[method]
    per_call(rotating(fn, sets), group=f"linear {m}x{k}x{n}", flops=2.0 * m * n * k,
             nbytes=2 * m * k + weight_bytes + 2 * m * n)
