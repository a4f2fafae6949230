"""bench_dequant through pytest-benchmark: the weight-only schemes' row decoder (ops.dequantize
into bf16) against a bf16 device-to-device copy of the weight, on bench_dequant's weight shapes,
weights rotating over copies larger than the L2, one table per shape; extra_info: GB/s per call
(codes read + bf16 written). See conftest.py.

    pytest benchmarks/test_bench_dequant.py --benchmark-only
"""

import os

import pytest
import torch

from _timing import rotating
from bench_dequant import BASELINE, HERE, weight_shapes
from bench_gemv import WEIGHT_ONLY, n_copies
from cquant import ops
from cquant.schemes import scheme

SHAPES = weight_shapes(os.path.join(HERE, "shapes.json"))


@pytest.mark.parametrize("method", [BASELINE, *WEIGHT_ONLY])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_dequant(per_call, shape, method):
    n, k = shape
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(w)
    if method == BASELINE:
        fn, read = rotating(out.copy_, [w.clone() for _ in range(n_copies(2 * n * k))]), 2 * n * k
    else:
        fmt = scheme(method).weight_format.name
        q, s = ops.quantize(w, fmt)
        read = q.numel() * q.element_size()
        fn = rotating(lambda qs: ops.dequantize(qs[0], qs[1], fmt, cols=k, out=out),
                      [(q.clone(), s.clone()) for _ in range(n_copies(read))])
    per_call(fn, group=f"dequant {n}x{k}", nbytes=read + 2 * n * k)
