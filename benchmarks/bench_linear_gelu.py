"""A transformer MLP's first layer, linear then tanh GELU: cquant with the GELU in its kernel.

For each (M, K, N) and scheme, in one run on one GPU:

  bf16+gelu   torch F.linear then F.gelu(approximate="tanh") in bfloat16 (the baseline)
  unfused     cquant's QuantizedLinear then torch's GELU kernel
  fused       QuantizedLinear with activation="gelu_tanh" (what cquant.quantize_ sets up)

Times are medians of CUDA-event-timed eager calls (activation quantization included), the
ratio is baseline / fused, and rel err the relative L2 error of the fused output against an
fp32 evaluation with the unquantized weight. The last line names the kernels of one fused
fp8dqrow call.

    python benchmarks/bench_linear_gelu.py --out benchmarks/results/linear_gelu_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = [(4608, 3072, 12288), (4096, 3072, 12288), (512, 3072, 12288)]  # Flux-dev MLPs at 1024x1024
SCHEMES = ("fp8dqrow", "int8dq", "int8wo")


def median_us(fn, iters):
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    from cquant.nn import QuantizedLinear

    torch.manual_seed(0)
    rows = []
    for m, k, n in SHAPES:
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        base = median_us(lambda: F.gelu(F.linear(x, lin.weight, lin.bias), approximate="tanh"), args.iters)
        exact = F.gelu(F.linear(x.float(), lin.weight.float(), lin.bias.float()), approximate="tanh")
        for scheme in SCHEMES:
            q = QuantizedLinear.from_float(lin, scheme)
            unfused = median_us(lambda: F.gelu(q(x), approximate="tanh"), args.iters)
            q.activation = "gelu_tanh"
            fused = median_us(lambda: q(x), args.iters)
            err = float((q(x).float() - exact).norm() / exact.norm())
            rows.append(dict(shape=[m, k, n], scheme=scheme, bf16_gelu_us=base, unfused_us=unfused, fused_us=fused,
                             ratio=base / fused, rel_err=err))
    q = QuantizedLinear.from_float(lin, "fp8dqrow")
    q.activation = "gelu_tanh"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        q(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}: linear + tanh GELU, bf16 activations")
    print(f"{'shape (M x K x N)':20s} {'scheme':9s} {'bf16+gelu us':>12s} {'unfused us':>10s} {'fused us':>9s} "
          f"{'x bf16':>7s} {'rel err':>8s}")
    for r in rows:
        print(f"{' x '.join(map(str, r['shape'])):20s} {r['scheme']:9s} {r['bf16_gelu_us']:12.1f} "
              f"{r['unfused_us']:10.1f} {r['fused_us']:9.1f} {r['ratio']:6.2f}x {r['rel_err']:8.4f}")
    print("kernels of one fused fp8dqrow call:", ", ".join(kernels))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, iters=args.iters, results=rows,
                           fused_fp8_kernels=kernels), f, indent=2)


if __name__ == "__main__":
    main()
