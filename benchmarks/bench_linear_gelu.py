"""A transformer MLP's first layer, linear then tanh GELU: cquant with the GELU in its kernel
against torch's own fused GELU epilogue.

For each (M, K, N) of Flux's MLPs and each scheme, interleaved on one GPU (benchmarks/_timing.py):

  torch_fused     torch._addmm_activation(b, x, W^T, use_gelu=True) in bf16: cuBLASLt's GEMM
                  with its GELU epilogue, the tanh form (on an H200 with torch 2.11, fp32:
                  max |out - gelu_tanh| 7e-6, |out - gelu_erf| 4.8e-4). The baseline.
  torch_unfused   F.linear, then F.gelu(approximate="tanh")
  <scheme>        ops.linear(..., activation="gelu_tanh"): the GELU inside cquant's kernel
                  (what cquant.quantize_ sets up), activation quantization included
  <scheme>:unfused  ops.linear, then F.gelu(approximate="tanh")

"x fused" is the median over repeats of torch_fused's time over the candidate's in the same
repeat, with its range; SQNR (dB) is against float64 gelu_tanh(x W^T + b) of the unquantized
weight, on a subsample of rows. The last line names the kernels of one fused fp8dqrow call.

    python benchmarks/bench_linear_gelu.py --out linear_gelu.json     # ~20 s on an H100
    python benchmarks/bench_linear_gelu.py --quick
    pytest benchmarks/test_bench_linear_gelu.py --benchmark-only   # pytest-benchmark's tables, seconds per call
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from cquant import ops
from cquant.demo import comma_list
from cquant.metrics import sqnr_db
from cquant.schemes import scheme

from _timing import (describe, describe_line, fmt_speedup, headline, interleaved, require_cuda, rotating, sets_for_l2,
                     text_table)
from bench_linear import capability, linear_args

SHAPES = [(4608, 3072, 12288), (4096, 3072, 12288), (512, 3072, 12288)]  # Flux-dev MLPs at 1024x1024
SCHEMES = ("fp8dqrow", "int8dq", "int8wo")
BASELINE = "torch_fused"
SQNR_ROWS = 64


def gelu_tanh(v):
    return 0.5 * v * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))


def make_sets(m, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [dict(x=torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16),
                 w=(torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16),
                 b=(torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
            for _ in range(sets_for_l2(2 * (m * k + n * k)))]


def candidates(sets, names, k):
    out = {BASELINE: lambda s: torch._addmm_activation(s["b"], s["x"], s["w"].t(), use_gelu=True),
           "torch_unfused": lambda s: F.gelu(F.linear(s["x"], s["w"], s["b"]), approximate="tanh")}
    for name in names:
        sc = scheme(name)
        if capability() < sc.min_compute_capability:
            print(f"  {name}: skipped, needs sm_{sc.min_compute_capability}+")
            continue
        kw = linear_args(sc, k)
        for s in sets:
            s[name] = ops.quantize(s["w"], kw["weight_format"], kw["weight_granularity"],
                                   group_size=kw.get("weight_group_size"))
        out[name] = lambda s, name=name, kw=kw: ops.linear(s["x"], *s[name], bias=s["b"], activation="gelu_tanh", **kw)
        out[f"{name}:unfused"] = lambda s, name=name, kw=kw: F.gelu(ops.linear(s["x"], *s[name], bias=s["b"], **kw),
                                                                    approximate="tanh")
    return out


@torch.no_grad()
def bench_shape(m, k, n, names, args):
    sets = make_sets(m, k, n)
    fns = candidates(sets, names, k)
    t = interleaved({name: rotating(fn, sets) for name, fn in fns.items()}, repeats=args.repeats, warmup=args.warmup,
                    iters=args.iters, baseline=BASELINE)
    s0 = sets[0]
    rows = torch.linspace(0, m - 1, min(m, SQNR_ROWS), device="cuda").long().unique()
    ref = gelu_tanh(F.linear(s0["x"][rows].double(), s0["w"].double(), s0["b"].double()))
    out = []
    for name, fn in fns.items():
        out.append(dict(shape=[m, k, n], method=name, **t[name].as_dict(), sqnr_db=sqnr_db(ref, fn(s0)[rows])))
    del sets
    torch.cuda.empty_cache()
    return out


def fused_kernels(k, n):
    """Kernel names of one fused fp8dqrow (or int8dq below sm_89) call."""
    name = "fp8dqrow" if capability() >= 89 else "int8dq"
    kw = linear_args(scheme(name), k)
    x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
    qw, sw = ops.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), kw["weight_format"])
    ops.linear(x, qw, sw, activation="gelu_tanh", **kw)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.linear(x, qw, sw, activation="gelu_tanh", **kw)
        torch.cuda.synchronize()
    return name, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--quick", action="store_true", help="one shape, 3 short repeats")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated cquant schemes (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="calls of each candidate before timing (default 3)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per candidate and repeat (default 10)")
    args = p.parse_args(argv)
    try:
        names = comma_list(args.schemes, "--schemes", "scheme", "comma-separated scheme names")
        for name in names:
            scheme(name)
    except ValueError as e:
        p.error(str(e))
    require_cuda("bench_linear_gelu")
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.iters = args.iters or (5 if args.quick else 10)
    shapes = SHAPES[:1] if args.quick else SHAPES

    t0, results = time.time(), []
    for m, k, n in shapes:
        print(f"{m}x{k}x{n}", flush=True)
        results += bench_shape(m, k, n, names, args)
    kernel_scheme, kernels = fused_kernels(3072, 12288)
    info = describe()
    print(f"\n# linear + tanh GELU, bf16; {describe_line(info)}; {args.repeats} repeats x {args.iters} calls")
    lines = [("shape (MxKxN)", "method", "ms", "ms range", "x fused (range)", "SQNR dB")]
    for r in results:
        lines.append(("x".join(map(str, r["shape"])), r["method"], f"{r['ms']:.4f}", f"{r['ms_min']:.4f}-{r['ms_max']:.4f}",
                      "-" if r["method"] == BASELINE else fmt_speedup(r), f"{r['sqnr_db']:.1f}"))
    print(text_table(lines))
    print(f"kernels of one fused {kernel_scheme} call: {', '.join(kernels)}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(info=info, args=vars(args), seconds=time.time() - t0, baseline=BASELINE, results=results,
                           fused_kernels=kernels, headline=headline(results, "method", BASELINE, "median over shapes")),
                      f, indent=1)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
