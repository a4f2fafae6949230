"""bench_attention through pytest-benchmark: cquant's bf16 and int8 attention against torch
SDPA's FLASH, cuDNN and EFFICIENT backends on bench_attention's shapes (shapes.json), inputs
rotating over copies larger than the L2, one table per shape; extra_info: TFLOP/s per call
(4 * B * H * Sq * Skv * D). See conftest.py.

    pytest benchmarks/test_bench_attention.py --benchmark-only
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

import cquant
from _timing import rotating, sets_for_l2, with_env
from bench_attention import HERE, SDPA_BACKENDS, load_shapes, variants

SHAPES = load_shapes(os.path.join(HERE, "shapes.json"))
# every cquant kernel some card runs (sm_90 with D <= 128 runs them all); variants() says which
# this card and head dim run
CQUANT = [name for name, _, _ in variants(90, 128)]


@pytest.mark.parametrize("method", [*SDPA_BACKENDS, *CQUANT])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s["model"].replace(" ", "_"))
def test_attention(per_call, shape, method):
    b, h, d, sq, skv = shape["B"], shape["H"], shape["D"], shape["Sq"], shape["Skv"]
    scale = 1.0 / math.sqrt(d)
    copies = sets_for_l2(2 * (b * sq * h * d + 2 * b * skv * h * d), factor=2, most=8)
    bshd = [tuple(torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for s in (sq, skv, skv))
            for _ in range(copies)]
    if method in SDPA_BACKENDS:
        sets = [tuple(t.transpose(1, 2).contiguous() for t in qkv) for qkv in bshd]  # SDPA's own layout

        def fn(q, k, v):
            with sdpa_kernel(SDPA_BACKENDS[method]):
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
    else:
        major, minor = torch.cuda.get_device_capability()
        runs = {name: (mode, env) for name, mode, env in variants(10 * major + minor, d)}
        if method not in runs:
            pytest.skip(f"{method}: not a kernel of this card at head dim {d}")
        mode, env = runs[method]
        sets, fn = bshd, with_env(lambda q, k, v: cquant.attention(q, k, v, scale=scale, mode=mode), env)
    try:
        fn(*sets[0])
    except (RuntimeError, NotImplementedError) as e:  # a backend that does not take this shape on this card
        pytest.skip(f"{method}: {str(e).splitlines()[0][:200]}")
    per_call(rotating(lambda qkv: fn(*qkv), sets), group=f"attention {shape['model']} B{b} H{h} Sq{sq} Skv{skv} D{d}",
             flops=4.0 * b * h * sq * skv * d)
