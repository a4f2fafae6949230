"""bench_gemv through pytest-benchmark: weight-only cquant schemes against torch's bf16 F.linear
at bench_gemv's M <= 16 shapes, weights rotating over copies larger than the L2, one table per
shape; extra_info: weight GB/s per call. Calls are launched eagerly (bench_gemv.py replays CUDA
graphs), so the smallest shapes measure the host's launch rate. See conftest.py.

    pytest benchmarks/test_bench_gemv.py --benchmark-only
"""

import os

import pytest
import torch
import torch.nn.functional as F

from _timing import rotating
from _variants import linear_kwargs, parse, quantize_weight, stored_bytes
from bench_gemv import BASELINE, HERE, WEIGHT_ONLY, gemv_shapes, n_copies
from cquant import ops

SHAPES = gemv_shapes(os.path.join(HERE, "shapes.json"))


@pytest.mark.parametrize("method", [BASELINE, *WEIGHT_ONLY])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[1]}x{s[2]}x{s[3]}")
def test_gemv(per_call, shape, method):
    _, m, k, n, _ = shape
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if method == BASELINE:
        weights = [w.clone() for _ in range(n_copies(2 * n * k))]
        fn, nbytes = rotating(lambda wc: F.linear(x, wc), weights), 2 * n * k
    else:
        s = parse(method).scheme
        if s.refusal(k, n):
            pytest.skip(s.refusal(k, n))
        q, sc = quantize_weight(s, w)
        nbytes, kw, y = stored_bytes(q, sc), linear_kwargs(s, k), torch.empty(m, n, device="cuda", dtype=x.dtype)
        weights = [(q.clone(), sc.clone()) for _ in range(n_copies(nbytes))]
        fn = rotating(lambda qs: ops.linear(x, *qs, out=y, **kw), weights)
    per_call(fn, group=f"gemv {m}x{k}x{n}", nbytes=nbytes)
