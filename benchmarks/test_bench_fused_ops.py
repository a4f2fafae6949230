"""bench_fused_ops through pytest-benchmark: norm_modulate, qk_norm_rope and linear_gated, cquant's
fused kernels against the unfused torch math (eager and torch.compile) at Flux-dev's shapes,
one table per op; extra_info: GB/s per call of the bytes the op must move. See conftest.py.

    pytest benchmarks/test_bench_fused_ops.py --benchmark-only
"""

import pytest

from bench_fused_ops import CANDIDATES, build

BATCH, SEQ = 1, 4608  # bench_fused_ops' defaults: Flux-dev at 1024x1024


@pytest.fixture(scope="module")
def cases():
    """case(op): the op's Case, built once (torch.compile) for all its candidates, one op's at a time."""
    built = {}

    def case(op):
        if op not in built:
            built.clear()
            built[op] = build(op, BATCH, SEQ)
        return built[op]
    return case


@pytest.mark.parametrize("op, method", [(op, name) for op, names in CANDIDATES.items() for name in names])
def test_fused_op(per_call, cases, op, method):
    case = cases(op)
    per_call(case.candidates[method], group=f"{op} [{BATCH}, {SEQ}]", nbytes=case.nbytes)
